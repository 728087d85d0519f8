"""GRPO training engine: torch + transformers, data parallel over torch.distributed (replicated or FSDP2).

Role: what a GPU (or CPU) slot runs for ``train`` work. One :class:`GRPOTrainer` per rank holds the
model (whole, or its FSDP2 shard: ``parallel``, see ``fsdp.py``), AdamW and the step/version counters;
``train_step`` consumes this rank's shard of a batch.

Contracts:

- **Exact global objective.** The loss is GRPO's token-mean over *all* generated tokens of the global
  batch (``grpo.py``). Before the backward passes the ranks all-reduce their token counts, every
  micro-batch's loss is divided by that global count, and gradients are all-reduced with a sum. The
  result is the gradient of the whole batch's loss whatever the micro-batching and however sequences
  are sharded over ranks: an average over ranks weighted by each rank's tokens, which reduces to the
  plain average when shards hold equal token counts.
- **Identical replicas.** Rank 0's initial weights are broadcast at start-up; all ranks then apply the
  same reduced, clipped gradient with the same optimizer, so weights stay bit-identical. Under ``fsdp``
  each rank holds a shard instead; gradients are reduce-scattered with a sum, and every rank runs the
  same number of micro-batches (a rank with fewer runs empty ones), because FSDP's collectives pair up
  forward and backward passes across ranks.
- **Versions.** ``weights_version`` starts at ``initial_version`` (or the checkpoint's) and increases
  by one per successful step; ``state_dict_for_sync()`` returns full CPU copies of the weights of that
  version (a collective under ``fsdp``: call it on every rank, as ``train_step`` and ``logprobs``).
- After ``train_step`` the parameters' ``.grad`` hold that step's reduced, clipped gradients until the
  next step (useful for checks); the model is left in eval mode.
- A non-finite gradient norm raises :class:`TrainingDiverged` without changing the weights.
- ``save_checkpoint``/``load_checkpoint`` round-trip model, optimizer state, step and version, so a
  resumed run continues bit-identically (tested); under ``fsdp`` as a sharded
  ``torch.distributed.checkpoint`` (``checkpoints.py``).

Not in this module: the GRPO formula (``grpo.py``), deciding batches or staleness (the broker's job
state), which rank trains on what (``libra.policies.parallelism.dispatch``), moving weights to rollout engines and
shards to ranks (``libra.dataplane``, driven by ``libra.actors.train_role``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # must precede the transformers import
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import torch.distributed as dist

from libra.engines import checkpoints, collectives, fsdp

from libra.engines.grpo import (
    Aggregation,
    GRPOLossOutput,
    TrainBatch,
    grpo_loss,
    partition_by_tokens,
    split_balanced,
    token_logprobs,
)
from libra.logging import get_logger

# TrainBatch and the batching helpers live in grpo.py (the objective's data layout); re-exported here.
__all__ = [
    "DistConfig",
    "GRPOConfig",
    "GRPOTrainer",
    "TrainBatch",
    "TrainingDiverged",
    "partition_by_tokens",
    "split_balanced",
]

log = get_logger(__name__)

_CLOSE_BARRIER_S = 30.0  # how long close() waits for the other ranks before leaving the group


class TrainingDiverged(FloatingPointError):
    """The gradient norm was NaN or infinite; the step was not applied."""


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    """Optimisation and objective settings (see ``grpo.py`` for the objective's terms).

    ``micro_batch_tokens`` bounds the padded tokens (sequences x longest length) of one forward/backward
    pass; a longer single sequence gets a micro-batch of its own.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float | None = None
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    micro_batch_tokens: int = 4096

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"GRPOConfig.lr must be a positive number, got {self.lr!r}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"GRPOConfig.max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"GRPOConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens!r}")
        if self.kl_coef < 0:
            raise ValueError(f"GRPOConfig.kl_coef must be >= 0, got {self.kl_coef!r}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(
                f"unknown aggregation: {self.aggregation!r} (known: 'seq_mean_token_mean', 'token_mean')"
            )


@dataclass(frozen=True, slots=True)
class DistConfig:
    """How this rank joins the data-parallel group. ``backend`` defaults to NCCL on CUDA, gloo otherwise."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    backend: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not (0 <= self.rank < self.world_size):
            raise ValueError(f"DistConfig: rank {self.rank} must be in [0, world_size={self.world_size})")
        if not (0 < self.master_port < 65536):
            raise ValueError(f"DistConfig.master_port must be in 1..65535, got {self.master_port}")


class GRPOTrainer:
    """GRPO trainer for one data-parallel rank (see the module contracts).

    ``GRPOTrainer(model_dir, lr=1e-5, device="cpu")``: any :class:`GRPOConfig` field can be given as a
    keyword, or a whole ``config``. ``dist=None`` trains alone; with a :class:`DistConfig` the
    constructor joins (or reuses) the default process group and blocks until all ranks have joined.
    ``ref_model_dir`` (default: ``model_dir``) is loaded, frozen, only when ``kl_coef > 0``.
    ``parallel``: ``"ddp"`` (replicas), ``"fsdp"`` (FSDP2 shards) or ``"auto"``
    (:func:`libra.engines.fsdp.choose_parallel`); the choice is :attr:`parallel`. ``random_init``: build
    the model from ``model_dir``'s ``config.json`` with random weights (seed 0, the same on every rank),
    for benchmarks of realistic shapes (``libra.engines.shapes``).

    Mutation rule: model, optimizer, ``step`` and ``weights_version`` change only in
    :meth:`train_step` and :meth:`load_checkpoint`.
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
        **overrides: Any,
    ) -> None:
        self.config = self._make_config(config, overrides)
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
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
        backend = cfg.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if dist.is_initialized():
            if dist.get_rank() != cfg.rank or dist.get_world_size() != cfg.world_size:
                raise ValueError(
                    f"a process group already exists as rank {dist.get_rank()}/{dist.get_world_size()}, "
                    f"but DistConfig says {cfg.rank}/{cfg.world_size}"
                )
        else:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            from libra.engines.rendezvous import pin_interfaces

            pin_interfaces(cfg.master_addr)  # several hosts: connect over the interface that reaches rank 0
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                rank=cfg.rank,
                world_size=cfg.world_size,
                timeout=timedelta(seconds=cfg.timeout_s),
            )
            self._owns_group = True
        self.rank, self.world_size = cfg.rank, cfg.world_size
        log.info("trainer_joined_group", rank=self.rank, world_size=self.world_size, backend=backend)

    def _load_model(self, path: Path, device: torch.device | None = None) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"GRPOTrainer: no config.json in model dir {str(path)!r}")
        if self.random_init:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model: Any = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=self.dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        return model.to(device or self.device)

    def _init_model(self, parallel: str) -> None:
        self.model = self._load_model(self.model_dir, torch.device("cpu"))
        n_params = sum(p.numel() for p in self.model.parameters())
        mem = None
        if self.device.type == "cuda":
            mem = torch.cuda.get_device_properties(self.device).total_memory
        self.parallel = fsdp.choose_parallel(parallel, world_size=self.world_size, n_params=n_params,
                                             param_bytes=self.dtype.itemsize, device_type=self.device.type,
                                             device_memory_bytes=mem)
        if self.parallel == "fsdp":
            # every rank loaded the same weights (same files, or the same seed): shard them where they are;
            # fully_shard moves each rank's shard, and only it, to the device
            fsdp.shard_model(self.model, self.device.type, self.world_size)
        else:
            self.model.to(self.device)
        self.model.eval()  # dropout off for the log-prob passes; train_step switches modes itself
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        if self.world_size > 1 and self.parallel == "ddp":  # identical replicas from the first step on
            with torch.no_grad():
                for p in self._params:
                    dist.broadcast(p.data, src=0)
        log.info("trainer_model_ready", parallel=self.parallel, params=n_params, rank=self.rank)

    def _init_reference(self, ref_model_dir: str | os.PathLike[str] | None) -> None:
        self.ref_model = None
        if self.config.kl_coef > 0:
            self.ref_model = self._load_model(Path(ref_model_dir) if ref_model_dir else self.model_dir)
            self.ref_model.eval().requires_grad_(False)

    def _init_optimizer(self) -> None:
        c = self.config
        self.optimizer = torch.optim.AdamW(
            self._params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
        )

    def close(self) -> None:
        """Leave the process group if this trainer created it. Idempotent.

        Ranks first meet at a bounded barrier: rank 0 hosts the group's store, and a rank that tore the group
        down while a peer still used it aborted that peer's process at exit ("terminate called without an
        active exception"). A peer that never arrives (it died) costs at most ``_CLOSE_BARRIER_S``."""
        if self._owns_group and dist.is_initialized():
            if self.world_size > 1:
                try:
                    if dist.get_backend() == "gloo":
                        dist.monitored_barrier(timeout=timedelta(seconds=_CLOSE_BARRIER_S))
                    else:
                        dist.barrier()
                except Exception as e:  # noqa: BLE001 - a dead peer: leave anyway
                    log.warning("trainer_close_barrier_failed", rank=self.rank, error=repr(e))
            dist.destroy_process_group()
        self._owns_group = False

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
        Raises :class:`TrainingDiverged` on a non-finite gradient norm.
        """
        started = time.perf_counter()
        c = self.config
        counts = torch.tensor(
            [float(batch.num_loss_tokens()), float(batch.num_sequences_with_loss()), float(len(batch))],
            dtype=torch.float64,
        )
        deferred = group_ready is not None
        if deferred and self.parallel != "ddp":
            raise ValueError(f"group_ready (collectives after the passes) needs parallel='ddp', not {self.parallel!r}")
        if not deferred:
            self._all_reduce_cpu(counts)
        g_tokens, g_seqs, g_sequences = counts.tolist()
        def global_normalizer() -> float:  # the aggregation's denominator over the whole batch
            return g_tokens if c.aggregation == "token_mean" else g_seqs

        normalizer = 1.0 if deferred else global_normalizer()

        self.optimizer.zero_grad(set_to_none=False)
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if micro_batches is None:
            micro = partition_by_tokens(batch.lengths(), c.micro_batch_tokens)
        else:
            micro = [list(mb) for mb in micro_batches if len(mb)]
            if sorted(i for mb in micro for i in mb) != list(range(len(batch))):
                raise ValueError(f"micro_batches must cover the batch's {len(batch)} sequences exactly once")
        passes = len(micro)
        if self.parallel == "fsdp" and self.world_size > 1:  # the same number of passes on every rank
            most = torch.tensor([float(passes)], dtype=torch.float64)
            self._all_reduce_cpu(most, dist.ReduceOp.MAX)
            passes = int(most.item())
        sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped tokens, ratio sum, kl sum
        self.model.train()
        try:
            for i in range(passes):
                # fsdp reduce-scatters after every pass into the sharded gradients: skipping the sync until
                # the last pass would keep every layer's unsharded gradient, the memory FSDP is used to save
                if i >= len(micro):
                    self._empty_pass()
                    continue
                out = self._micro_step(batch.select(micro[i]), normalizer)
                out.loss.backward()
                sums += torch.tensor(
                    [float(out.loss.detach()), out.clipped_tokens, out.ratio_sum, out.kl_sum], dtype=torch.float64
                )
        finally:
            self.model.eval()
        if deferred:
            assert group_ready is not None
            group_ready()
            both = torch.cat([counts, sums])
            self._all_reduce_cpu(both)
            counts, sums = both[:3], both[3:].clone()
            g_tokens, g_seqs, g_sequences = counts.tolist()
            scale = 1.0 / max(global_normalizer(), 1.0)
            sums[0] *= scale
            self._all_reduce_grads()
            for p in self._params:
                p.grad.mul_(scale)
        else:
            self._all_reduce_cpu(sums)
            if self.parallel == "ddp":
                self._all_reduce_grads()
        grad_norm = fsdp.grad_norm_value(torch.nn.utils.clip_grad_norm_(self._params, c.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=False)
            raise TrainingDiverged(f"step {self.step + 1}: gradient norm is {grad_norm}; weights left unchanged")
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.step += 1
        self.weights_version += 1
        loss, clipped, ratio_sum, kl_sum = sums.tolist()
        denom = max(g_tokens, 1.0)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "clip_frac": clipped / denom,
            "ratio_mean": ratio_sum / denom if g_tokens else 1.0,
            "kl_mean": kl_sum / denom,
            "num_tokens": g_tokens,
            "num_sequences": g_sequences,
            "micro_batches": float(len(micro)),
            "step": float(self.step),
            "weights_version": float(self.weights_version),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "step_time_s": time.perf_counter() - started,
        }
        log.info("train_step_done", step=self.step, version=self.weights_version, loss=loss, grad_norm=grad_norm)
        return metrics

    def _empty_pass(self) -> None:
        """A forward and backward that adds nothing to any gradient (FSDP: pairs up another rank's pass)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        (self.model(input_ids=ids).logits.sum() * 0.0).backward()

    def _micro_step(self, mb: TrainBatch, normalizer: float) -> GRPOLossOutput:
        c = self.config
        ids, attn, mask, rollout_lp, adv = mb.to_tensors(self.device)
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        lp = token_logprobs(logits[:, :-1], ids[:, 1:])
        ref_lp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_lp = token_logprobs(self.ref_model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:])
        return grpo_loss(
            lp,
            rollout_lp[:, 1:],
            adv,
            mask[:, 1:],
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            ref_logprobs=ref_lp,
            kl_coef=c.kl_coef,
            aggregation=c.aggregation,
            normalizer=normalizer,
        )

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Current-policy log-probs of every token of every sequence (index 0, which nothing predicts,
        is 0.0): the same numbers ``train_step`` uses, for recomputing or checking rollout log-probs."""
        if not sequences:
            return []
        batch = TrainBatch(
            input_ids=[list(s) for s in sequences],
            loss_mask=[[0] * len(s) for s in sequences],
            rollout_logprobs=[[0.0] * len(s) for s in sequences],
            advantages=[0.0] * len(sequences),
        )
        ids, attn, _, _, _ = batch.to_tensors(self.device)
        lp = token_logprobs(self.model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:])
        return [[0.0, *lp[i, : len(s) - 1].tolist()] for i, s in enumerate(sequences)]

    # -- distributed helpers -------------------------------------------------------------------

    def _all_reduce_cpu(self, t: torch.Tensor, op: Any = None) -> None:
        collectives.all_reduce_cpu(t, self.world_size, self.device, op)

    def _all_reduce_grads(self) -> None:
        collectives.all_reduce_grads(self._params, self.world_size)

    # -- weights and checkpoints ----------------------------------------------------------------

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of the current weights (``model.state_dict()`` names), safe to serialise or load
        into a rollout engine while training continues; they are of version :attr:`weights_version`. Under
        ``fsdp`` every rank gathers them (a collective: call it on all ranks)."""
        return dict(fsdp.full_state_items(self.model))

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
