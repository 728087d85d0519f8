"""GRPO training engine: torch + transformers, data parallel over torch.distributed (replicated or FSDP2).

Role: what a GPU (or CPU) slot runs for ``train`` work. One :class:`GRPOTrainer` per rank holds the
model (whole, or its FSDP2 shard: ``parallel``, see ``fsdp.py``), AdamW and the step/version counters;
``train_step`` consumes this rank's shard of a batch.

Contracts:

- **Exact global objective.** The loss is GRPO's token-mean over *all* generated tokens of the global batch
  (``grpo.py``). Before the backward passes the ranks all-reduce their token counts, every micro-batch's loss
  is divided by that global count, and gradients are all-reduced with a sum. The result is the gradient of
  the whole batch's loss whatever the micro-batching and however sequences are sharded over ranks: an
  average over ranks weighted by each rank's tokens (the plain average when shards hold equal token counts).
- **Identical replicas.** Rank 0's initial weights are broadcast at start-up; all ranks then apply the same
  reduced, clipped gradient with the same optimizer, so weights stay bit-identical. Under ``fsdp`` each rank
  holds a shard instead; gradients are reduce-scattered with a sum, and every rank runs the same number of
  micro-batches (a rank with fewer runs empty ones): FSDP's collectives pair up passes across ranks.
- **Versions.** ``weights_version`` starts at ``initial_version`` (or the checkpoint's) and increases
  by one per successful step; ``state_dict_for_sync()`` returns full CPU copies of the weights of that
  version (a collective under ``fsdp``: call it on every rank, as ``train_step`` and ``logprobs``).
- After ``train_step`` the parameters' ``.grad`` hold that step's reduced, clipped gradients until the
  next step (useful for checks); the model is left in eval mode.
- **Precision** (``fsdp.py``'s contract): ``dtype`` is the compute dtype (fp32 or bf16; fp16 raises
  :class:`~libra.engines.fsdp.PrecisionUnsupported`). Parameters, gradients and AdamW state are fp32;
  the passes (and :meth:`logprobs`) run under ``torch.autocast`` (``fsdp``: FSDP2's mixed-precision
  policy); gradients are reduced in fp32; :meth:`state_dict_for_sync` casts to the compute dtype;
  checkpoints keep fp32. The frozen reference model (``kl_coef > 0``) is held in the compute dtype.
- A non-finite gradient norm raises :class:`TrainingDiverged` without changing the weights.
- **A failed pass fails the step on every rank.** An exception in this rank's forward or backward (a CUDA
  out-of-memory error or anything else) is caught; under ``fsdp`` the rank runs empty passes for the rest
  of the step (and in place of the failed one if it failed before the model ran) so that the others'
  collectives pair up (a failure in the middle of an FSDP pass leaves that pass's remaining collectives
  unpaired; the group's timeout then ends it). The ranks then exchange a status
  flag in the small all-reduce that precedes the gradient all-reduce; if any rank failed, every rank zeroes
  its gradients, skips the gradient all-reduce and the update (weights, step and version unchanged) and
  raises :class:`TrainStepFailed` (``code`` ``"oom"`` or ``"step_failed"``, the failed ranks). The failed
  pass's tensors are released before it is raised (only the error's text is kept).
- :meth:`release` drops the model, the reference model, the optimizer and its state so that their memory
  can be freed (a role switch); :meth:`weights_fingerprint` identifies the weights by their exact bits,
  computed where they live.
- ``save_checkpoint``/``load_checkpoint`` round-trip model, optimizer state, step and version, so a
  resumed run continues bit-identically (tested); under ``fsdp`` as a sharded
  ``torch.distributed.checkpoint`` (``checkpoints.py``).

Not in this module: the GRPO formula and settings (``grpo.py``), the process group and collectives
(``collectives.py``), sharding and precision (``fsdp.py``), the step's metrics dict (``train_metrics.py``),
deciding batches or staleness (the broker's job state), which rank trains on what
(``libra.policies.parallelism.dispatch``), moving weights to rollout engines and shards to ranks
(``libra.dataplane``, driven by ``libra.actors.train_role``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # must precede the transformers import
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import torch.distributed as dist

from libra.engines import checkpoints, collectives, fsdp
from libra.engines.collectives import DistConfig
from libra.engines.device.cuda import is_cuda_oom
from libra.engines.fsdp import PrecisionUnsupported
from libra.engines.grpo import (
    GRPOConfig,
    GRPOLossOutput,
    TrainBatch,
    grpo_loss,
    partition_by_tokens,
    split_balanced,
    token_logprobs,
)
from libra.engines.train_metrics import step_metrics
from libra.logging import get_logger
from libra.weights.format import tie_like

# TrainBatch and the batching helpers live in grpo.py (the objective's data layout), DistConfig in
# collectives.py; re-exported here.
__all__ = [
    "DistConfig",
    "GRPOConfig",
    "GRPOTrainer",
    "PrecisionUnsupported",
    "TrainBatch",
    "TrainStepFailed",
    "TrainingDiverged",
    "partition_by_tokens",
    "resolve_device",
    "split_balanced",
]

log = get_logger(__name__)

_CLOSE_BARRIER_S = 30.0  # how long close() waits for the other ranks before leaving the group


class TrainingDiverged(FloatingPointError):
    """The gradient norm was NaN or infinite; the step was not applied."""


class TrainStepFailed(RuntimeError):
    """A rank's forward or backward failed, so the step failed on every rank: gradients zeroed, weights, step
    and version unchanged. ``code``: ``"oom"`` (a CUDA out-of-memory error on some rank) or
    ``"step_failed"``; ``ranks``: the ranks that failed; ``rank``: the rank raising it."""

    def __init__(self, code: str, ranks: Sequence[int], rank: int, detail: str) -> None:
        self.code, self.ranks, self.rank, self.detail = code, list(ranks), rank, detail
        super().__init__(f"train step failed ({code}) on rank(s) {self.ranks}; rank {rank}: {detail}")


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device; a bare ``"cuda"`` becomes the current CUDA device with its index
    (``torch.cuda.set_device`` needs one)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class GRPOTrainer:
    """GRPO trainer for one data-parallel rank (see the module contracts).

    ``GRPOTrainer(model_dir, lr=1e-5, device="cpu")``: any :class:`GRPOConfig` field can be given as a
    keyword, or a whole ``config``. ``dtype`` is the compute dtype (the weights stay fp32).
    ``memory_fraction``: this slot's share of its GPU (for ``auto``'s choice). ``dist=None`` trains alone;
    with a :class:`DistConfig` the constructor joins (or reuses) the default process group and blocks
    until all ranks have joined. ``ref_model_dir`` (default: ``model_dir``) is loaded, frozen, only when
    ``kl_coef > 0``. ``parallel``: ``"ddp"`` (replicas), ``"fsdp"`` (FSDP2 shards) or ``"auto"``
    (:func:`libra.engines.fsdp.choose_parallel`); the choice is :attr:`parallel`. ``random_init``: build
    the model from ``model_dir``'s ``config.json`` with random weights (seed 0, the same on every rank),
    for benchmarks of realistic shapes (``libra.engines.shapes``).

    Mutation rule: model, optimizer, ``step`` and ``weights_version`` change only in
    :meth:`train_step` and :meth:`load_checkpoint` (and are dropped by :meth:`release`).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        config: GRPOConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        dist_config: DistConfig | None = None,
        ref_model_dir: str | os.PathLike[str] | None = None,
        initial_version: int = 0,
        parallel: str = "auto",
        random_init: bool = False,
        memory_fraction: float | None = None,
        **overrides: Any,
    ) -> None:
        self.config = self._make_config(config, overrides)
        self.model_dir = Path(model_dir)
        self.dtype = fsdp.check_compute_dtype(dtype)  # the compute dtype; parameters are fp32
        self.device = resolve_device(device)
        self.memory_fraction = memory_fraction
        if parallel not in fsdp.PARALLEL_MODES:
            raise ValueError(f"unknown parallel mode {parallel!r} (known: {', '.join(fsdp.PARALLEL_MODES)})")
        self.random_init = random_init
        if parallel == "fsdp" and dist_config is None:
            raise ValueError("parallel='fsdp' needs a dist_config (a process group, even one of one rank)")
        self._init_distributed(dist_config, parallel)
        self._init_model(parallel)
        self._init_reference(ref_model_dir)
        self._init_optimizer()
        self.step = 0
        self.weights_version = int(initial_version)

    # -- construction ---------------------------------------------------------------------------

    @staticmethod
    def _make_config(config: GRPOConfig | None, overrides: dict[str, Any]) -> GRPOConfig:
        base = config or GRPOConfig()
        known = {f.name for f in dataclasses.fields(GRPOConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown GRPOTrainer option(s): {unknown} (known: {sorted(known)})")
        return dataclasses.replace(base, **overrides)

    def _init_distributed(self, cfg: DistConfig | None, parallel: str) -> None:
        self.rank, self.world_size, self._owns_group = 0, 1, False
        if cfg is None or (cfg.world_size == 1 and parallel != "fsdp"):  # fsdp needs a group, even of one
            return
        self._owns_group = collectives.join_group(cfg, self.device)
        self.rank, self.world_size = cfg.rank, cfg.world_size

    def _load_model(self, path: Path, device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"GRPOTrainer: no config.json in model dir {str(path)!r}")
        if self.random_init:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model: Any = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model.to(device)

    def _init_model(self, parallel: str) -> None:
        self.model = self._load_model(self.model_dir, torch.device("cpu"), torch.float32)  # fp32 master weights
        n_params = sum(p.numel() for p in self.model.parameters())
        mem = None
        if self.device.type == "cuda":
            mem = torch.cuda.get_device_properties(self.device).total_memory
        self.parallel = fsdp.choose_parallel(parallel, world_size=self.world_size, n_params=n_params,
                                             param_bytes=self.dtype.itemsize, device_type=self.device.type,
                                             device_memory_bytes=mem, memory_fraction=self.memory_fraction,
                                             reference=self.config.kl_coef > 0)
        if self.parallel == "fsdp":
            # every rank loaded the same weights (same files, or the same seed): shard them where they are;
            # fully_shard moves each rank's shard, and only it, to the device
            fsdp.shard_model(self.model, self.device.type, self.world_size, self.dtype)
        else:
            self.model.to(self.device)
        self.model.eval()  # dropout off for the log-prob passes; train_step switches modes itself
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        if self.parallel == "ddp":  # identical replicas from the first step on
            collectives.broadcast_params(self._params, self.world_size)
        log.info("trainer_model_ready", parallel=self.parallel, params=n_params, rank=self.rank,
                 compute_dtype=str(self.dtype))

    def _init_reference(self, ref_model_dir: str | os.PathLike[str] | None) -> None:
        self.ref_model = None
        if self.config.kl_coef > 0:  # frozen: the compute dtype is enough
            self.ref_model = self._load_model(Path(ref_model_dir) if ref_model_dir else self.model_dir,
                                              self.device, self.dtype)
            self.ref_model.eval().requires_grad_(False)

    def _init_optimizer(self) -> None:
        c = self.config
        self.optimizer: Any = torch.optim.AdamW(
            self._params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
        )

    def release(self) -> None:
        """Drop the model, the reference model, the optimizer (and its state) and the parameter list, so that
        nothing of this trainer keeps their memory (a role switch; the caller then empties the CUDA cache).
        Idempotent; the trainer cannot train afterwards."""
        opt = getattr(self, "optimizer", None)
        if opt is not None:
            opt.state.clear()
            opt.param_groups.clear()
        self.optimizer = None
        self._params = []
        self.model = None
        self.ref_model = None

    def close(self) -> None:
        """Leave the process group if this trainer created it, and :meth:`release` the model. Idempotent.

        Ranks first meet at a bounded barrier: rank 0 hosts the group's store, and a rank that tore the group
        down while a peer still used it aborted that peer's process at exit ("terminate called without an
        active exception"). A peer that never arrives (it died) costs at most ``_CLOSE_BARRIER_S``."""
        if self._owns_group:
            collectives.leave_group(self.world_size, self.rank, _CLOSE_BARRIER_S)
        self._owns_group = False
        self.release()

    def _autocast(self) -> Any:
        return fsdp.autocast(self.device.type, self.dtype, sharded=self.parallel == "fsdp")

    # -- training -------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, micro_batches: Sequence[Sequence[int]] | None = None,
                   before_update: Callable[[], None] | None = None,
                   group_ready: Callable[[], None] | None = None) -> dict[str, float]:
        """One optimisation step on this rank's shard ``batch`` (may be empty on some ranks).

        ``micro_batches`` (indices into ``batch``, each exactly once; e.g. a dispatch plan's
        length-aware packing) replaces the default :func:`partition_by_tokens` split; the gradient is the
        same either way (the global token normaliser makes micro-batching exact). Raises ``ValueError`` if
        it is not a partition of the batch. ``before_update`` runs after the gradients are reduced and
        clipped and just before the optimizer applies them (an elastic member that joined with a zero
        gradient loads the group's state there: ``libra.actors.elastic_train``). Every rank of the group
        must call it the same number of times. ``group_ready`` (``ddp`` only) defers every collective until
        the local passes are done: they run with a normaliser of 1, then ``group_ready()`` is called (an
        elastic member's group may still be forming on another thread), then one all-reduce carries the
        counts with the sums and the reduced gradient is divided by the global normaliser: the same update
        up to float rounding. Returns global metrics
        (identical on all ranks): ``loss`` (the objective before the update), ``grad_norm`` (before
        clipping), ``clip_frac`` (fraction of tokens where the clip was active), ``ratio_mean``,
        ``kl_mean``, ``num_tokens``, ``num_sequences``, ``micro_batches`` (this rank's), ``step``,
        ``weights_version`` (after the step), ``lr``, ``step_time_s``.
        Raises :class:`TrainingDiverged` on a non-finite gradient norm and :class:`TrainStepFailed` on every
        rank when a rank's pass failed (see the module contracts).
        """
        started = time.perf_counter()
        c = self.config
        if micro_batches is None:
            micro = partition_by_tokens(batch.lengths(), c.micro_batch_tokens)
        else:
            micro = [list(mb) for mb in micro_batches if len(mb)]
            if sorted(i for mb in micro for i in mb) != list(range(len(batch))):
                raise ValueError(f"micro_batches must cover the batch's {len(batch)} sequences exactly once")
        if group_ready is not None and self.parallel != "ddp":
            raise ValueError(f"group_ready (collectives after the passes) needs parallel='ddp', not {self.parallel!r}")
        sums, g_tokens, g_sequences = self._reduced_gradients(batch, micro, group_ready)
        grad_norm = fsdp.grad_norm_value(torch.nn.utils.clip_grad_norm_(self._params, c.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=False)
            raise TrainingDiverged(f"step {self.step + 1}: gradient norm is {grad_norm}; weights left unchanged")
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.step += 1
        self.weights_version += 1
        metrics = step_metrics(sums.tolist(), grad_norm, g_tokens, g_sequences, micro_batches=len(micro),
                               step=self.step, weights_version=self.weights_version,
                               lr=self.optimizer.param_groups[0]["lr"], started=started)
        log.info("train_step_done", step=self.step, version=self.weights_version, loss=metrics["loss"],
                 grad_norm=grad_norm)
        return metrics

    def _reduced_gradients(self, batch: TrainBatch, micro: list[list[int]],
                           group_ready: Callable[[], None] | None) -> tuple[torch.Tensor, float, float]:
        """This rank's passes over ``micro`` and the step's collectives up to the reduced gradient (see
        :meth:`train_step`): returns the global diagnostic sums (loss, clipped tokens, ratio sum, kl sum),
        loss tokens and sequences. Raises :class:`TrainStepFailed` when a rank's pass failed."""
        c = self.config
        counts = torch.tensor(
            [float(batch.num_loss_tokens()), float(batch.num_sequences_with_loss()), float(len(batch))],
            dtype=torch.float64,
        )
        deferred = group_ready is not None
        if not deferred:
            self._all_reduce_cpu(counts)
        g_tokens, g_seqs, g_sequences = counts.tolist()
        def global_normalizer() -> float:  # the aggregation's denominator over the whole batch
            return g_tokens if c.aggregation == "token_mean" else g_seqs

        self.optimizer.zero_grad(set_to_none=False)
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        passes = len(micro)
        if self.parallel == "fsdp" and self.world_size > 1:  # the same number of passes on every rank
            most = torch.tensor([float(passes)], dtype=torch.float64)
            self._all_reduce_cpu(most, dist.ReduceOp.MAX)
            passes = int(most.item())
        sums, failure = self._passes(batch, micro, passes, 1.0 if deferred else global_normalizer())
        status = torch.tensor(collectives.failure_flags(failure[0] if failure else None, self.rank),
                              dtype=torch.float64)
        if deferred:
            assert group_ready is not None
            group_ready()
            both = torch.cat([counts, sums, status])
            self._all_reduce_cpu(both)
            counts, sums, status = both[:3], both[3:7].clone(), both[7:]
            g_tokens, g_seqs, g_sequences = counts.tolist()
            sums[0] *= 1.0 / max(global_normalizer(), 1.0)
        else:
            both = torch.cat([sums, status])
            self._all_reduce_cpu(both)
            sums, status = both[:4], both[4:]
        self._raise_if_failed(status.tolist(), failure)
        if deferred:
            self._all_reduce_grads()
            for p in self._params:
                p.grad.mul_(1.0 / max(global_normalizer(), 1.0))
        elif self.parallel == "ddp":
            self._all_reduce_grads()
        return sums, g_tokens, g_sequences

    def _passes(self, batch: TrainBatch, micro: list[list[int]], passes: int,
                normalizer: float) -> tuple[torch.Tensor, tuple[str, str] | None]:
        """This rank's forward and backward passes: the summed diagnostics (loss, clipped tokens, ratio sum,
        kl sum) and, when a pass raised, ``(code, text)`` (the error itself is not kept: its traceback holds
        the pass's tensors). Under ``fsdp`` the passes after a failed one are empty ones (paired collectives)."""
        sums = torch.zeros(4, dtype=torch.float64)
        failure: tuple[str, str] | None = None
        self.model.train()
        try:
            for i in range(passes):
                # fsdp reduce-scatters after every pass into the sharded gradients: skipping the sync until
                # the last pass would keep every layer's unsharded gradient, the memory FSDP is used to save
                if failure is not None and self.parallel != "fsdp":
                    break
                out, self._in_model = None, False
                try:
                    if i >= len(micro) or failure is not None:
                        self._empty_pass()
                        continue
                    out = self._micro_step(batch.select(micro[i]), normalizer)
                    out.loss.backward()
                    sums += torch.tensor([float(out.loss.detach()), out.clipped_tokens, out.ratio_sum, out.kl_sum],
                                         dtype=torch.float64)
                except Exception as exc:  # noqa: BLE001 - every rank learns of it from the status flags
                    out = None  # a failed backward's graph
                    if failure is not None:
                        break  # an empty pass failed too: nothing more can be paired
                    failure = ("oom" if is_cuda_oom(exc) else "step_failed", f"{type(exc).__name__}: {exc}"[:500])
                    log.error("train_pass_failed", rank=self.rank, code=failure[0], error=failure[1])
                    if self.parallel == "fsdp" and not self._in_model:  # no collective yet: pair this pass too
                        with contextlib.suppress(Exception):
                            self._empty_pass()
        finally:
            self.model.eval()
        return sums, failure

    def _raise_if_failed(self, status: list[float], failure: tuple[str, str] | None) -> None:
        code, ranks = collectives.failed_ranks(status)
        if code is None:
            return
        self.optimizer.zero_grad(set_to_none=False)  # nothing of the failed step is applied
        detail = failure[1] if failure else "its own passes succeeded"
        raise TrainStepFailed(code, ranks, self.rank, detail)

    def _empty_pass(self) -> None:
        """A forward and backward that adds nothing to any gradient (FSDP: pairs up another rank's pass)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with self._autocast():
            logits = self.model(input_ids=ids).logits
        (logits.float().sum() * 0.0).backward()

    def _micro_step(self, mb: TrainBatch, normalizer: float) -> GRPOLossOutput:
        c = self.config
        ids, attn, mask, rollout_lp, adv = mb.to_tensors(self.device)
        self._in_model = True  # from here on an fsdp pass has started its collectives
        with self._autocast():
            logits = self.model(input_ids=ids, attention_mask=attn).logits
            ref_logits = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits = self.ref_model(input_ids=ids, attention_mask=attn).logits
        lp = token_logprobs(logits[:, :-1], ids[:, 1:])  # fp32 math (grpo.py)
        ref_lp = None if ref_logits is None else token_logprobs(ref_logits[:, :-1], ids[:, 1:])
        return grpo_loss(lp, rollout_lp[:, 1:], adv, mask[:, 1:], clip_low=c.clip_low, clip_high=c.clip_high,
                         ref_logprobs=ref_lp, kl_coef=c.kl_coef, aggregation=c.aggregation, normalizer=normalizer)

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Current-policy log-probs of every token of every sequence (index 0, which nothing predicts,
        is 0.0): the same numbers ``train_step`` uses (the same autocast), for recomputing or checking
        rollout log-probs."""
        if not sequences:
            return []
        batch = TrainBatch(
            input_ids=[list(s) for s in sequences],
            loss_mask=[[0] * len(s) for s in sequences],
            rollout_logprobs=[[0.0] * len(s) for s in sequences],
            advantages=[0.0] * len(sequences),
        )
        ids, attn, _, _, _ = batch.to_tensors(self.device)
        with self._autocast():
            logits = self.model(input_ids=ids, attention_mask=attn).logits
        lp = token_logprobs(logits[:, :-1], ids[:, 1:])
        return [[0.0, *lp[i, : len(s) - 1].tolist()] for i, s in enumerate(sequences)]

    def _all_reduce_cpu(self, t: torch.Tensor, op: Any = None) -> None:
        collectives.all_reduce_cpu(t, self.world_size, self.device, op)

    def _all_reduce_grads(self) -> None:
        collectives.all_reduce_grads(self._params, self.world_size)

    # -- weights and checkpoints ----------------------------------------------------------------

    def state_dict_for_sync(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """Version :attr:`weights_version` (``model.state_dict()`` names, a tied weight's sharing one tensor) on
        the CPU in the compute dtype: copies; ``copy=False``: the model's own tensors where they are such (CPU
        fp32 replicas), for a publisher that copies before it returns. A collective under ``fsdp``."""
        if not copy and self.parallel != "fsdp" and self.device.type == "cpu" and self.dtype == torch.float32:
            return dict(self.model.state_dict())  # detached views of the parameters; tied ones are one tensor
        return tie_like(self.model.state_dict(), dict(fsdp.full_state_items(self.model, dtype=self.dtype)))

    def weights_fingerprint(self) -> str:
        """A digest of the fp32 master weights' exact bits (:func:`libra.engines.fsdp.fingerprint`), computed
        on the device without a CPU copy: equal on every rank whose replica is identical. Under ``fsdp`` a
        collective (call it on all ranks)."""
        return fsdp.fingerprint(self.model.state_dict().items())

    def save_checkpoint(self, path: str | os.PathLike[str], *, optimizer: bool = True,
                        keep_last: int = 0) -> Path:
        """Write model (replicated: safetensors, loadable with ``from_pretrained``, tokenizer files copied
        along; ``fsdp``: a sharded ``torch.distributed.checkpoint``), step, version and (``optimizer``) the
        optimizer state to ``path`` atomically (replacing an older checkpoint there). The optimizer state is
        the bulk of a checkpoint (AdamW keeps two fp32 moments: 8 bytes a parameter, 1.08 GB for a 135M
        model); without it a resumed run starts a fresh optimizer. ``keep_last > 0``: afterwards remove all
        but the newest ``keep_last`` sibling checkpoints named ``step<N>``
        (:func:`~libra.engines.checkpoints.prune_checkpoints`). Replicated: call it on one rank (replicas
        are identical); ``fsdp``: on every rank. Returns ``path``."""
        return checkpoints.save_checkpoint(self, path, optimizer=optimizer, keep_last=keep_last)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore model weights, optimizer state, step and version from :meth:`save_checkpoint`'s output
        (either format). A checkpoint saved without its optimizer state leaves this trainer's optimizer
        fresh. Raises ``FileNotFoundError`` if a part is missing and ``ValueError`` if the weights do not
        fit this model. Call it on every rank."""
        checkpoints.load_checkpoint(self, path)
