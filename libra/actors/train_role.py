"""The ``train`` role: a GRPO trainer rank serving ``train`` work.

Role: turn an actor slot into one rank of the GRPO trainer behind the ``ActorRuntime(handlers={(kind,
name): fn(args, ctx)})`` interface. The payloads are typed: :class:`~libra.protocol.payloads_train.TrainArgs`
in, :class:`~libra.protocol.payloads_train.TrainResult` out (their docstrings hold the field contracts);
malformed args fail the work with ``bad_request``.

Contracts:
- Bulk data never goes through the broker or the run directory: it moves over the data plane
  (``libra.dataplane``), peer to peer; the broker only carries refs
  (:class:`~libra.protocol.payloads_refs.DataRef`). Rank 0 runs a
  :class:`~libra.dataplane.DataPlaneServer` and publishes weights version ``v`` there after each step
  (the newest two versions stay fetchable; ``LIBRA_WEIGHTS_TRANSPORT=torch`` publishes over
  torch.distributed instead). On the data plane it also serves the delta from the previous version when
  that is worth it (``libra.weights.dataplane``; ``LIBRA_WEIGHTS_DELTA=0`` turns it off), and the
  ``WeightsRef`` it returns names that delta's base (``delta_from``).
- Each rank trains on its data with the micro-batch plan it was given. A shard or trajectory that cannot
  be fetched fails the work with ``ToolError("shard_fetch_failed", ...)``.
- Parallelism and rendezvous: the train config (``TrainArgs.grpo``) may name ``parallel`` (``ddp``,
  ``fsdp`` or ``auto``, :func:`libra.engines.fsdp.choose_parallel`) and ``master_addr``, the routable
  address of the host whose actor trains as rank 0 (default ``$LIBRA_ADVERTISE_ADDRESS``, else
  ``127.0.0.1``); every rank joins the group at ``master_addr:master_port`` and rank 0 checks that the
  address is its own (``rendezvous_failed`` if not). Under ``fsdp`` every rank gathers the full weights
  after a step (rank 0 publishes them) and writes its shard of a checkpoint.
- Precision: the trainer computes in the placement's dtype (bf16 on a GPU slot; fp16 is refused as
  ``bad_request``) over fp32 master weights and optimizer state; rank 0 publishes the weights in the compute
  dtype, checkpoints keep fp32.
- A step whose forward or backward failed on any rank fails on every rank (``GRPOTrainer.train_step``
  raises ``TrainStepFailed``, weights unchanged): ``ToolError("oom", ...)`` when a rank ran out of CUDA
  memory, else ``ToolError("train_failed", ...)``; the CUDA cache is emptied after the error is dropped
  (inside the ``except`` block its traceback still holds the batch's tensors).
- Only rank 0 packs the weights (a full CPU copy) after a step, to publish them; every rank reports
  ``checksum``, a fingerprint of its master weights computed on the device
  (``GRPOTrainer.weights_fingerprint``), which the job compares across ranks. Under ``fsdp`` every rank
  takes part in the gather (a collective).
- :meth:`TrainRole.close` releases the trainer's model and optimizer (a role switch), empties the CUDA cache
  and returns the memory in use before and after (CUDA allocated/reserved bytes, or the process RSS).
- Data-plane host and security: ``$LIBRA_DATAPLANE_HOST`` (default ``127.0.0.1``); CURVE when
  ``LIBRA_CURVE_SECRET`` is set (the actor's own key pair); a non-loopback host without keys is refused
  unless ``LIBRA_DATAPLANE_INSECURE=1`` (see ``libra.dataplane``). With ``LIBRA_CURVE_ALLOW`` too (the allow
  directory) fetchers' key roles are checked; rank 0 tags the weights it publishes with ``TrainArgs.job``
  (:meth:`TrainRole.tag_weights`), so only that job's scoped client keys (and unscoped keys) may fetch them.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libra.logging import get_logger
from libra.protocol.payloads_base import PayloadError
from libra.protocol.payloads_refs import DataRef, WeightsRef
from libra.protocol.payloads_train import TrainArgs, TrainPart, TrainResult

from .rollout_role import set_torch_threads
from .tools import ToolError, WorkContext

__all__ = ["TrainRole"]

log = get_logger("libra.roles")


def _warm_model_class(model_dir: str) -> None:
    """Build the model once on the meta device (no memory, no weights read): this imports the architecture's
    modules and runs its set-up code, about 1.4 s of a 135M model's 1.5 s first build on 2 CPU cores, while
    the slot waits for step 1's rollouts instead of on the step's path. A failure is left to the real build."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    except Exception as exc:  # a missing or odd model dir: the first train work reports it properly
        log.info("trainer_warm_skipped", model_dir=str(model_dir), error=f"{type(exc).__name__}: {exc}")


class TrainRole:
    """A GRPO trainer rank, created on the first ``train`` work (see the module contracts and
    :class:`~libra.protocol.payloads_train.TrainArgs`)."""

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, torch_threads: int = 0,
                 fetch_timeout_s: float = 60.0, placement: Any = None) -> None:
        set_torch_threads(torch_threads)
        from libra.dataplane import DataPlaneKeys

        importlib.import_module("libra.engines.trainer")  # pay the torch/transformers import before bidding
        _warm_model_class(model_dir)  # and the architecture's: the first train work (step 1) then only loads

        self.model_dir = model_dir
        self.run_dir = Path(run_dir) if run_dir else None
        self.slot = slot
        self.trainer: Any = None
        self.placement = placement  # device.placement.Placement: the trainer's device and dtype (None: CPU fp32)
        self.rank: int | None = None
        self.keys = DataPlaneKeys.from_env()
        self.fetch_timeout_s = fetch_timeout_s
        self.server: Any = None  # rank 0's DataPlaneServer, created with the trainer
        self.publisher: Any = None
        self.elastic: Any = None  # libra.engines.elastic_dp.ElasticGroup, in the broker's Elastic Hybrid Pool
        self._lock = threading.Lock()

    def _backend(self) -> str | None:
        """gloo where ranks may share a GPU (NCCL refuses that), else the trainer's own choice."""
        from libra.engines.device.placement import trainer_backend

        return trainer_backend(self.placement) if self.placement is not None else None

    def _ensure(self, args: TrainArgs) -> Any:
        from libra.engines.trainer import DistConfig, GRPOConfig, GRPOTrainer

        if self.trainer is not None:
            return self.trainer
        ws, rank = args.world_size, args.rank
        opts: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in args.grpo.items()}
        parallel = opts.pop("parallel", "auto")
        master_addr = opts.pop("master_addr", None) or os.environ.get("LIBRA_ADVERTISE_ADDRESS") or "127.0.0.1"
        if not isinstance(master_addr, str) or not isinstance(parallel, str):
            raise ToolError("bad_request", f"train config: master_addr and parallel must be strings, got "
                                           f"{master_addr!r} and {parallel!r}")
        if rank == 0 and ws > 1 and not is_local_address(master_addr):
            raise ToolError("rendezvous_failed", f"rank 0 runs on this host, but the train config's master_addr "
                                                 f"{master_addr!r} is not one of its addresses")
        dist = DistConfig(master_addr, args.master_port, rank, ws, backend=self._backend()) if ws > 1 else None
        try:
            cfg = GRPOConfig(**opts)
        except (TypeError, ValueError) as exc:
            raise ToolError("bad_request", f"train config: {exc}") from None
        if rank == 0:  # before the (slow) model load, so a refused bind fails fast with its own message
            self.serve_weights()
        try:
            self.trainer = GRPOTrainer(self.model_dir, cfg, dist_config=dist, parallel=parallel,
                                       **self.trainer_placement())
        except ValueError as exc:  # an unknown parallel mode, a group that does not fit
            raise ToolError("bad_request", f"train config: {exc}") from None
        self.rank = rank
        log.info("trainer_ready", rank=rank, world_size=ws, slot=self.slot,
                 dataplane=self.server.endpoint if self.server else None)
        return self.trainer

    def train(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        """One ``train`` work: :class:`TrainArgs` in, :class:`TrainResult` (as a mapping) out."""
        from libra.dataplane import DataPlaneError, InsecureDataPlane

        try:
            ta = TrainArgs.from_wire(args)
        except PayloadError as exc:
            raise ToolError("bad_request", str(exc)) from None
        if ta.elastic is not None:  # a step of the broker's Elastic Hybrid Pool (libra.actors.elastic_train)
            from .elastic_train import elastic_step

            with self._lock:
                return elastic_step(self, ta, ctx)
        parts, shards = ta.parts, ta.shards
        with self._lock:
            try:
                trainer = self._ensure(ta)
            except InsecureDataPlane as exc:
                raise ToolError("insecure_dataplane", str(exc)) from None
            self.tag_weights(ta.job)
            listed = parts if parts else shards
            if len(listed) != trainer.world_size:
                raise ToolError("bad_request", f"train names {len(listed)} ranks' data for a world of "
                                               f"{trainer.world_size} ranks")
            try:
                if parts:
                    shard, micro, fetched = self._fetch_parts(parts[trainer.rank],
                                                              ta.micro_batches[trainer.rank:][:1])
                else:
                    shard, micro, fetched = self._fetch_shard(shards[trainer.rank])
            except (DataPlaneError, ValueError, TypeError, KeyError) as exc:
                raise ToolError("shard_fetch_failed", f"rank {trainer.rank}: {type(exc).__name__}: {exc}") from None
            metrics = self.run_step(lambda: trainer.train_step(shard, micro_batches=micro))
            version = trainer.weights_version
            weights, publish_s, checkpoint = None, 0.0, None
            t0 = time.perf_counter()
            if trainer.rank == 0 or trainer.parallel == "fsdp":  # under fsdp a collective: every rank gathers
                full = trainer.state_dict_for_sync(copy=False)  # the publisher copies it at once
                if trainer.rank == 0:
                    weights = WeightsRef.from_wire(self.publisher.publish(version, full))
                    publish_s = time.perf_counter() - t0
                del full
            checksum = trainer.weights_fingerprint()
            if ta.checkpoint and (trainer.rank == 0 or trainer.parallel == "fsdp"):
                trainer.save_checkpoint(ta.checkpoint, optimizer=ta.checkpoint_optimizer,
                                        keep_last=ta.keep_checkpoints)
                checkpoint = ta.checkpoint if trainer.rank == 0 else None
            return TrainResult(rank=trainer.rank, metrics=metrics, weights_version=version, checksum=checksum,
                               weights=weights, publish_s=publish_s, shard_sequences=len(shard),
                               shard_tokens=sum(shard.lengths()), checkpoint=checkpoint, **fetched).to_wire()

    def _fetch_shard(self, ref: DataRef) -> tuple[Any, list[list[int]], dict[str, Any]]:
        """One packed shard (``libra.rl.shards``) from whoever published it."""
        from libra.dataplane import ObjectRef, fetch_state_dict
        from libra.rl.shards import decode_shard

        sd, hdr, fs = fetch_state_dict(ObjectRef.from_wire(ref.to_wire()), keys=self.keys,
                                       idle_timeout_s=self.fetch_timeout_s)
        shard, micro = decode_shard(sd, hdr.metadata)
        return shard, micro, {"shard_fetch_s": fs.seconds, "shard_bytes": fs.nbytes, "shard_sources": 1}

    def _fetch_parts(self, mine: list[TrainPart], micro: list[Any]) -> tuple[Any, list[list[int]], dict[str, Any]]:
        """This rank's trajectories, each fetched from the episode runner holding it (a few at a time), with
        the advantages and micro-batches the broker's dispatch decided."""
        from concurrent.futures import ThreadPoolExecutor

        from libra.dataplane import ObjectRef, fetch_state_dict
        from libra.rl.shards import merge_trajectories

        if not mine:
            raise ValueError("this rank was given no trajectories")
        refs = [ObjectRef.from_wire(p.ref.to_wire()) for p in mine]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(4, len(refs))) as pool:
            got = list(pool.map(lambda r: fetch_state_dict(r, keys=self.keys, idle_timeout_s=self.fetch_timeout_s),
                                refs))
        batch = merge_trajectories([(sd, hdr.metadata) for sd, hdr, _ in got], [p.advantage for p in mine])
        plan = [[int(i) for i in mb] for mb in micro[0]] if micro else [list(range(len(mine)))]
        if sorted(i for mb in plan for i in mb) != list(range(len(mine))):
            raise ValueError("micro_batches do not cover this rank's trajectories exactly once")
        return batch, plan, {"shard_fetch_s": time.perf_counter() - t0, "shard_bytes": sum(fs.nbytes for *_, fs in got),
                             "shard_sources": len({r.endpoint for r in refs})}

    def close(self) -> dict[str, int]:
        """Stop serving weights (rollouts that have not fetched the newest version keep theirs) and release
        the trainer's model and optimizer, then empty the CUDA cache; the memory in use before and after
        (``memory_in_use``) is logged and returned. Idempotent. The fixed group's process group is left to the
        job (a later trainer in this process reuses it)."""
        before = memory_in_use(self.placement)
        if self.trainer is not None:
            self.trainer.release()  # the model, reference, optimizer state: nothing else holds them
            self.trainer = None
        if self.publisher is not None and hasattr(self.publisher, "close"):
            self.publisher.close()  # the torch.distributed publisher's serving thread and store
        self.publisher = None
        if self.elastic is not None:
            self.elastic.close()  # leave the elastic DP group (a hybrid actor going back to rollout)
            self.elastic = None
        if self.server is not None:
            self.server.close()
            self.server = None
        free_memory(self.placement)
        after = memory_in_use(self.placement)
        mem = {**{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()}}
        log.info("train_role_closed", slot=self.slot, **mem)
        return mem

    def tag_weights(self, job: str) -> None:
        """Tag what rank 0's data-plane server publishes from now on (weights, an elastic state snapshot) with
        ``job`` (``TrainArgs.job``; "": untagged), so that job's scoped client keys may fetch it
        (``libra.dataplane.access``). The ``torch.distributed`` weights transport checks no roles."""
        if self.server is not None:
            self.server.default_job = job or None

    def checksum(self) -> str:
        """The fingerprint of the trainer's master weights (a collective under fsdp)."""
        return str(self.trainer.weights_fingerprint())

    def serve_weights(self) -> None:
        """Rank 0's data-plane server and weights publisher (``$LIBRA_WEIGHTS_TRANSPORT``); snapshots stay where
        the trainer lives: a GPU trainer serves GPU rollouts by NCCL or CUDA IPC."""
        from libra.dataplane import DataPlaneServer, allow_dir_from_env
        from libra.weights.transport import make_publisher, transport_from_env

        self.server = DataPlaneServer(keys=self.keys, allow_dir=allow_dir_from_env())
        on = self.placement.device if self.placement is not None else None
        try:
            self.publisher = make_publisher(transport_from_env(), server=self.server, device=on, keep=2)
        except ValueError as exc:  # an unknown $LIBRA_WEIGHTS_TRANSPORT
            raise ToolError("bad_request", str(exc)) from None

    def trainer_placement(self) -> dict[str, Any]:
        """The trainer's ``device``, compute ``dtype`` and ``memory_fraction`` from the placement (none: CPU
        fp32); applies the placement's memory budget first."""
        p = self.placement
        if p is None:
            return {}
        from libra.engines.device.placement import apply_memory_budget

        apply_memory_budget(p)
        return {"device": p.device, "dtype": p.torch_dtype(), "memory_fraction": p.memory_fraction}

    def run_step(self, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``step()`` (one ``train_step``), its typed failure mapped to ``ToolError`` ``oom`` or
        ``train_failed``; the CUDA cache is freed after the ``except`` block, once the error's traceback
        (which holds the batch's tensors) is gone."""
        from libra.engines.trainer import TrainStepFailed

        try:
            return step()
        except TrainStepFailed as exc:
            failed = ("oom" if exc.code == "oom" else "train_failed", str(exc))
        free_memory(self.placement)
        raise ToolError(*failed)


def free_memory(where: Any) -> None:
    """Give the CUDA caching allocator's free blocks back (``where``: a placement or a device; nothing on the
    CPU)."""
    device = str(getattr(where, "device", where) or "cpu")
    if device.startswith("cuda"):
        from libra.engines.device.cuda import free_cuda_cache

        free_cuda_cache()


def memory_in_use(where: Any) -> dict[str, int]:
    """CUDA ``allocated``/``reserved`` bytes on a GPU placement, else the process's resident set (``rss``)."""
    device = str(getattr(where, "device", where) or "cpu")
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return {"allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved())}
    import psutil

    return {"rss": int(psutil.Process().memory_info().rss)}


def state_checksum(state: dict[str, Any]) -> str:
    """sha256 over a state dict's names and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # bf16 too
    return h.hexdigest()


def is_local_address(addr: str) -> bool:
    """Whether this host can bind ``addr`` (one of its own addresses; loopback names count)."""
    import socket

    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False

