"""Engine-backed work handlers for actor roles: ``rollout`` (``generate``), ``train`` (``train``).

Role: turn an actor slot into a rollout instance or a GRPO trainer rank, behind the same
``ActorRuntime(handlers={(kind, name): fn(args, ctx)})`` interface as the tools.

On one host, bulk data goes through the run directory, never through the broker: the driver writes a
training batch to ``RUN/batches/stepN.json`` and passes the path; trainer rank 0 writes weights version
``v`` to ``RUN/weights/v{v}.libra`` (``libra.engines.weights`` format: u64 header length, msgpack
header, CRC-checked chunk stream; written to a temporary name and renamed, so a reader never sees a
partial file) and returns the path; generate requests carry the newest ``{"version", "path"}``.

``rollout`` contracts:
- ``generate`` args: ``prompt_ids``, ``max_new_tokens``, ``temperature``, ``top_p``, ``stop_token_ids``,
  optional ``seed`` and ``weights``. Concurrent turns are batched: one thread drains the queue of
  waiting turns (up to ``max_batch``) and runs one engine call for all of them.
- Weights are loaded only between engine calls, never mid-turn: before a batch, if any waiting turn
  names a newer version than the engine's, that version is loaded first. Every reply carries the
  ``weights_version`` that produced all of its tokens, ``gen_tokens``, ``token_ids``, ``logprobs``,
  ``finish_reason`` and ``load_s`` (seconds spent loading weights for this batch, 0 if none).
- The instance records its current version in ``RUN/actors/<slot>.json`` after every load. While idle
  (no turn waiting for ``idle_poll_s``) it also loads the newest ``RUN/weights/v*.libra`` on its own, so
  an idle instance is already up to date when the next turn comes (still never mid-turn: the batcher
  thread is the only one that generates or loads).

``train`` contracts:
- args: ``batch_path``, ``world_size``, ``rank``, ``master_port``, ``grpo`` (GRPOConfig fields),
  ``checkpoint`` (path or None). The first ``train`` work fixes this actor's rank (``rank``) and joins
  the gloo group; later works use that rank whatever their ``rank`` says (the driver submits one work
  per rank per step, and a trainer holds one at a time, so each rank gets exactly one).
- Each rank trains on its token-balanced shard (``TrainBatch.shard``); rank 0 publishes the weights.
  The reply: ``rank``, ``metrics``, ``weights_version``, ``weights_path`` (rank 0), ``checksum`` (sha256
  over all parameters: equal on every rank), ``publish_s``.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from libra.logging import get_logger

from .tools import Handler, ToolError, WorkContext

__all__ = ["HybridRole", "RolloutRole", "TrainRole", "read_weights_file", "role_handlers", "write_weights_file"]

log = get_logger("libra.roles")


def write_weights_file(path: Path, state_dict: Any, version: int) -> Path:
    """Write ``state_dict`` as weights version ``version`` to ``path`` atomically."""
    from libra.engines.weights import pack_state_dict

    header, chunks = pack_state_dict(state_dict, version=version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        for c in chunks:
            fh.write(c)
    os.replace(tmp, path)
    return path


def read_weights_file(path: str | Path) -> tuple[dict[str, Any], int]:
    """Read a file from :func:`write_weights_file`; returns ``(state_dict, version)``."""
    from libra.engines.weights import read_header, unpack_state_dict

    data = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = data[8 : 8 + n]
    hdr = read_header(header)
    stream = memoryview(data)[8 + n :]
    chunks = [stream[i : i + hdr.chunk_size] for i in range(0, hdr.total_bytes, hdr.chunk_size)]
    sd, hdr = unpack_state_dict(header, chunks)
    return sd, int(hdr.version or 0)


def _set_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)


class RolloutRole:
    """An HF rollout engine with a turn batcher (see the module contracts)."""

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, max_batch: int = 32,
                 window_s: float = 0.02, torch_threads: int = 0) -> None:
        from libra.engines.hf_rollout import HFRolloutEngine

        _set_threads(torch_threads)
        self.engine = HFRolloutEngine(model_dir, max_batch_size=max_batch)
        self.run_dir = Path(run_dir) if run_dir else None
        self.slot = slot
        self.max_batch = max_batch
        self.window_s = window_s
        self._q: queue.SimpleQueue[tuple[dict[str, Any], Future]] = queue.SimpleQueue()
        self._loads = 0
        self.idle_poll_s = 0.25
        self._stopped = threading.Event()
        self._write_status(0.0)
        threading.Thread(target=self._loop, name="libra-rollout-batcher", daemon=True).start()

    def generate(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        from libra.engines.rollout_base import GenRequest

        if not isinstance(args, dict) or not isinstance(args.get("prompt_ids"), list):
            raise ToolError("bad_request", "generate needs args {'prompt_ids': [int, ...], 'max_new_tokens': n, ...}")
        try:
            req = GenRequest(prompt_ids=[int(t) for t in args["prompt_ids"]],
                             max_new_tokens=int(args.get("max_new_tokens", 32)),
                             temperature=float(args.get("temperature", 1.0)), top_p=float(args.get("top_p", 1.0)),
                             stop_token_ids=[int(t) for t in args.get("stop_token_ids") or []],
                             seed=args.get("seed") if isinstance(args.get("seed"), int) else None)
        except (ValueError, TypeError) as exc:
            raise ToolError("bad_request", f"bad generate args: {exc}") from None
        fut: Future = Future()
        self._q.put(({"req": req, "weights": args.get("weights")}, fut))
        return fut.result()

    def close(self) -> None:
        """Stop the batcher after its current batch and release the engine (turns must be drained first)."""
        self._stopped.set()

    def _take_batch(self) -> list[tuple[dict[str, Any], Future]]:
        while True:
            if self._stopped.is_set():
                return []
            try:
                batch = [self._q.get(timeout=self.idle_poll_s)]
                break
            except queue.Empty:
                self._poll_published()  # idle: pick up a newly published version early
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                batch.append(self._q.get(timeout=max(0.0, remaining)) if remaining > 0 else self._q.get_nowait())
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                self.engine = None  # type: ignore[assignment]  # closed: free the model
                return
            try:
                load_s = self._maybe_load([item["weights"] for item, _ in batch])
                results = self.engine.generate([item["req"] for item, _ in batch])
            except Exception as exc:  # noqa: BLE001  (deliver the failure to every waiting turn)
                for _, fut in batch:
                    fut.set_exception(ToolError("engine_failed", f"{type(exc).__name__}: {exc}"))
                continue
            for (_, fut), r in zip(batch, results):
                fut.set_result({"token_ids": r.token_ids, "logprobs": r.logprobs, "finish_reason": r.finish_reason,
                                "weights_version": r.weights_version, "gen_tokens": len(r.token_ids),
                                "load_s": load_s, "batch": len(batch)})

    def _maybe_load(self, wanted: list[Any]) -> float:
        best = None
        for w in wanted:
            if (isinstance(w, dict) and isinstance(w.get("version"), int) and isinstance(w.get("path"), str)
                    and (best is None or w["version"] > best["version"])):
                best = w
        if best is None or best["version"] <= self.engine.weights_version:
            return 0.0
        t0 = time.perf_counter()
        sd, version = read_weights_file(best["path"])
        self.engine.load_weights(version, sd)
        load_s = time.perf_counter() - t0
        self._loads += 1
        self._write_status(load_s)
        log.info("weights_loaded", version=version, load_s=round(load_s, 4))
        return load_s

    def _poll_published(self) -> None:
        """Load the newest ``RUN/weights/v*.libra`` if it is newer than the engine's weights."""
        if self.run_dir is None:
            return
        best = -1
        for f in (self.run_dir / "weights").glob("v*.libra"):
            try:
                best = max(best, int(f.stem[1:]))
            except ValueError:
                continue
        if best > self.engine.weights_version:
            try:
                self._maybe_load([{"version": best, "path": str(self.run_dir / "weights" / f"v{best}.libra")}])
            except (FileNotFoundError, ValueError) as exc:  # superseded and removed meanwhile: next poll
                log.info("weights_poll_skipped", version=best, error=str(exc))

    def _write_status(self, load_s: float) -> None:
        if self.run_dir is None:
            return
        d = self.run_dir / "actors"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{self.slot}.json.tmp"
        tmp.write_text(json.dumps({"slot": self.slot, "role": "rollout", "weights_version": self.engine.weights_version,
                                   "loads": self._loads, "last_load_s": load_s, "pid": os.getpid()}))
        os.replace(tmp, d / f"{self.slot}.json")


class TrainRole:
    """A GRPO trainer rank, created on the first ``train`` work (see the module contracts)."""

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, torch_threads: int = 0) -> None:
        _set_threads(torch_threads)
        import libra.engines.trainer  # noqa: F401  (pay the torch/transformers import before bidding)

        self.model_dir = model_dir
        self.run_dir = Path(run_dir) if run_dir else None
        self.slot = slot
        self.trainer: Any = None
        self.rank: int | None = None
        self._lock = threading.Lock()

    def _ensure(self, args: dict[str, Any]) -> Any:
        from libra.engines.trainer import DistConfig, GRPOConfig, GRPOTrainer

        if self.trainer is not None:
            return self.trainer
        ws, rank = int(args.get("world_size", 1)), int(args.get("rank", 0))
        dist = DistConfig("127.0.0.1", int(args["master_port"]), rank, ws) if ws > 1 else None
        opts: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (args.get("grpo") or {}).items()}
        cfg = GRPOConfig(**opts)
        self.trainer = GRPOTrainer(self.model_dir, cfg, dist_config=dist)
        self.rank = rank
        log.info("trainer_ready", rank=rank, world_size=ws, slot=self.slot)
        return self.trainer

    def train(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        from libra.engines.grpo import TrainBatch

        if not isinstance(args, dict) or not isinstance(args.get("batch_path"), str):
            raise ToolError("bad_request", "train needs args {'batch_path': str, 'world_size': n, 'rank': r, ...}")
        with self._lock:
            trainer = self._ensure(args)
            raw = json.loads(Path(args["batch_path"]).read_text())
            batch = TrainBatch(raw["input_ids"], raw["loss_mask"], raw["rollout_logprobs"], raw["advantages"])
            shard = batch.shard(trainer.rank, trainer.world_size)
            metrics = trainer.train_step(shard)
            version = trainer.weights_version
            out: dict[str, Any] = {"rank": trainer.rank, "metrics": metrics, "weights_version": version,
                                   "checksum": self.checksum(), "shard_sequences": len(shard), "publish_s": 0.0,
                                   "weights_path": None}
            if trainer.rank == 0 and self.run_dir is not None:
                t0 = time.perf_counter()
                path = write_weights_file(self.run_dir / "weights" / f"v{version}.libra",
                                          trainer.state_dict_for_sync(), version)
                out["publish_s"] = time.perf_counter() - t0
                out["weights_path"] = str(path)
                old = self.run_dir / "weights" / f"v{version - 2}.libra"
                if old.exists():
                    old.unlink()
                if args.get("checkpoint"):
                    trainer.save_checkpoint(args["checkpoint"])
                    out["checkpoint"] = args["checkpoint"]
            return out

    def checksum(self) -> str:
        h = hashlib.sha256()
        for name, t in sorted(self.trainer.model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()


class HybridRole:
    """A slot that can be a rollout instance or a trainer rank, switched by broker directives (the Elastic
    Hybrid Pool's worker, and how a plan moves GPUs between roles without restarting processes).

    Each engine is created on the first work of its kind; ``reconfigure(kinds, config)`` (called by the
    runtime after the actor drained for a directive) closes the engine of a kind no longer accepted and
    returns the capacity for the new role: 1 as a trainer rank, ``max_batch`` as a rollout instance.
    """

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, max_batch: int = 32,
                 torch_threads: int = 0) -> None:
        self.model_dir, self.run_dir, self.slot = model_dir, run_dir, slot
        self.max_batch, self.torch_threads = max_batch, torch_threads
        self._lock = threading.Lock()
        self.rollout: RolloutRole | None = None
        self.trainer: TrainRole | None = None
        self.switches = 0

    def generate(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        with self._lock:
            if self.rollout is None:
                self.rollout = RolloutRole(self.model_dir, self.run_dir, self.slot, max_batch=self.max_batch,
                                           torch_threads=self.torch_threads)
            r = self.rollout
        return r.generate(args, ctx)

    def train(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        with self._lock:
            if self.trainer is None:
                self.trainer = TrainRole(self.model_dir, self.run_dir, self.slot, torch_threads=self.torch_threads)
            t = self.trainer
        return t.train(args, ctx)

    def reconfigure(self, kinds: list[str], config: dict[str, Any]) -> int:
        with self._lock:
            self.switches += 1
            if "generate" not in kinds and self.rollout is not None:
                self.rollout.close()
                self.rollout = None
            if "train" not in kinds and self.trainer is not None:
                self.trainer = None  # its process group is left to the job; weights were published
            log.info("role_switched", kinds=kinds, role=config.get("role"), switches=self.switches)
            return 1 if "train" in kinds and "generate" not in kinds else self.max_batch


def role_handlers(role: str, model_dir: str | None, run_dir: str | None, slot: str, *, max_batch: int = 32,
                  torch_threads: int = 0) -> tuple[list[str], dict[str, list[str]], dict[tuple[str, str], Handler]]:
    """``(kinds, capabilities, handlers)`` for an engine role (``rollout`` or ``train``)."""
    if model_dir is None:
        raise ValueError(f"role {role!r} needs --model-dir")
    if role == "rollout":
        r = RolloutRole(model_dir, run_dir, slot, max_batch=max_batch, torch_threads=torch_threads)
        return ["generate"], {"generate": ["default"]}, {("generate", "*"): r.generate}
    if role == "train":
        t = TrainRole(model_dir, run_dir, slot, torch_threads=torch_threads)
        return ["train"], {"train": ["grpo"]}, {("train", "grpo"): t.train}
    raise ValueError(f"unknown role {role!r} (known: action, rollout, train, hybrid)")
