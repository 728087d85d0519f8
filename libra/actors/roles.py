"""Engine-backed work handlers for actor roles: ``rollout`` (``generate``), ``train`` (``train``).

Role: turn an actor slot into a rollout instance or a GRPO trainer rank, behind the same
``ActorRuntime(handlers={(kind, name): fn(args, ctx)})`` interface as the tools.

Bulk data never goes through the broker or the run directory: it moves over the data plane
(``libra.dataplane``), peer to peer. The broker only carries refs ``{"endpoint", "name", "version",
"server_key", "bytes"}``. Trainer rank 0 runs a :class:`~libra.dataplane.DataPlaneServer` and publishes
weights version ``v`` there after each step; the job driver serves each rank's training shard from its
own server.

``rollout`` contracts:
- Engine: ``$LIBRA_ROLLOUT_ENGINE`` in the actor's environment picks it: ``hf`` (default,
  ``HFRolloutEngine``) or ``vllm`` (``VLLMRolloutEngine`` with ``max_num_seqs = --rollout-batch`` and the
  JSON object ``$LIBRA_VLLM_ARGS`` as extra ``vllm.LLM`` arguments). The slot must then run under an
  interpreter that has vLLM (the supervisor starts slots with its own ``sys.executable``). An unknown
  name, bad ``$LIBRA_VLLM_ARGS`` or an unusable vLLM raises ``ValueError`` (the slot exits with rc 2).
- ``generate`` args: ``prompt_ids``, ``max_new_tokens``, ``temperature``, ``top_p``, ``stop_token_ids``,
  optional ``seed`` and ``weights`` (a data-plane ref with an int ``version``). Concurrent turns are
  batched: one thread drains the queue of waiting turns (up to ``max_batch``) and runs one engine call
  for all of them.
- Weights are loaded only between engine calls, never mid-turn: before a batch, if any waiting turn
  names a newer version than the engine's, that version is fetched from the trainer over the data
  plane (chunked, CRC-checked) and loaded first. Every reply carries the ``weights_version`` that
  produced all of its tokens, ``gen_tokens``, ``token_ids``, ``logprobs``, ``finish_reason``, ``load_s``
  (seconds spent fetching + loading weights for this batch, 0 if none), ``fetch_s`` (the data-plane
  part of it), ``weights_via`` (``"dataplane"``, ``"torch"``, ``"file"`` or None when nothing was loaded) and
  ``weights_error`` (None, or why a wanted version could not be had).
- A failed fetch (trainer dead mid-transfer: :class:`~libra.dataplane.PeerLost`; corrupted:
  :class:`~libra.dataplane.TransferCorrupted`; superseded: :class:`~libra.dataplane.ObjectNotFound`)
  never fails the turn: the instance keeps its old version, generates with it, reports the error in the
  reply and its status file, and does not retry that version for a back-off period (2 s, doubling to 30 s).
- While idle (no turn waiting for ``idle_poll_s``) the instance asks the last trainer endpoint it was
  told about for the newest ``weights`` object and loads it, so it is already up to date when the next
  turn comes (still never mid-turn: the batcher thread is the only one that generates or loads).
- The instance records its state in ``RUN/actors/<slot>.json`` after every load or failure:
  ``weights_version``, ``loads``, ``dataplane_loads``, ``torch_loads``, ``file_loads``, ``bytes_fetched``,
  ``last_load_s``, ``last_fetch_s``, ``fetch_errors``, ``last_error`` and ``fetches`` (the last 50
  ``{"version", "via", "fetch_s", "load_s", "bytes"}``).
- Fallback (documented, not used by ``python -m libra run``): a ``weights`` mapping with a ``path``
  instead of an ``endpoint`` is read from a :func:`write_weights_file` file, for weights on shared
  storage (e.g. a checkpoint) when no data-plane route to a trainer exists.

``train`` contracts:
- args: ``parts`` (per rank, the list of ``{"ref", "advantage"}`` of the trajectories the broker's dispatch
  gave it; each ref names one trajectory on the episode runner that produced it) with ``micro_batches``
  (per rank, positions into its list), or ``shards`` (one packed data-plane shard per rank, see
  ``libra.rl.shards``); plus ``world_size``, ``rank``, ``master_port``, ``grpo`` (GRPOConfig fields),
  ``checkpoint`` (path or None). The first ``train``
  work fixes this actor's rank (``rank``) and joins the gloo group; later works use that rank whatever
  their ``rank`` says (the driver submits one work per rank per step, and a trainer holds one at a
  time, so each rank gets exactly one) and the rank fetches ``parts[its rank]`` (from every runner
  holding one, a few transfers at a time) or ``shards[its rank]``.
- Each rank trains on its shard with the shard's micro-batch plan; rank 0 publishes the weights on its
  data-plane server (the newest two versions stay fetchable). The reply: ``rank``, ``metrics``,
  ``weights_version``, ``weights`` (rank 0: the ref rollout instances fetch), ``checksum`` (sha256 over
  all parameters: equal on every rank), ``publish_s`` (serialise + register), ``shard_fetch_s``,
  ``shard_bytes``, ``shard_sources`` (distinct data-plane servers fetched from), ``shard_tokens``.
  A shard or trajectory that cannot be fetched fails the work with
  ``ToolError("shard_fetch_failed", ...)``.
- Data-plane host and security: ``$LIBRA_DATAPLANE_HOST`` (default ``127.0.0.1``); CURVE when
  ``LIBRA_CURVE_SECRET`` is set (the actor's own key pair); a non-loopback host without keys is refused
  unless ``LIBRA_DATAPLANE_INSECURE=1`` (see ``libra.dataplane``).
"""

from __future__ import annotations

import hashlib
import importlib
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

__all__ = ["HybridRole", "RolloutRole", "TrainRole", "make_rollout_engine", "read_weights_file", "role_handlers",
           "write_weights_file"]

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


ROLLOUT_ENGINE_ENV = "LIBRA_ROLLOUT_ENGINE"


def make_rollout_engine(model_dir: str, max_batch: int) -> Any:
    """The rollout engine ``$LIBRA_ROLLOUT_ENGINE`` names (``hf`` by default; see the module contracts)."""
    name = os.environ.get(ROLLOUT_ENGINE_ENV, "hf").strip().lower() or "hf"
    if name == "hf":
        from libra.engines.hf_rollout import HFRolloutEngine

        return HFRolloutEngine(model_dir, max_batch_size=max_batch)
    if name == "vllm":
        from libra.engines.rollout_base import EngineUnavailable
        from libra.engines.vllm_rollout import VLLMRolloutEngine, vllm_args_from_env

        try:
            return VLLMRolloutEngine(model_dir, **{"max_num_seqs": max_batch, **vllm_args_from_env()})
        except EngineUnavailable as exc:
            raise ValueError(f"{ROLLOUT_ENGINE_ENV}=vllm: {exc}") from None
    raise ValueError(f"{ROLLOUT_ENGINE_ENV}={name!r}: unknown rollout engine (known: hf, vllm)")


class RolloutRole:
    """A rollout engine (HF by default, see :func:`make_rollout_engine`) with a turn batcher (see the module
    contracts)."""

    BACKOFF_S = (2.0, 30.0)  # first retry delay after a failed fetch, and its cap (doubling in between)

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, max_batch: int = 32,
                 window_s: float = 0.02, torch_threads: int = 0, fetch_timeout_s: float = 10.0,
                 fetcher: Any = None) -> None:
        from libra.dataplane import DataPlaneKeys, DataPlaneWeightFetcher

        _set_threads(torch_threads)
        self.engine = make_rollout_engine(model_dir, max_batch)
        self.run_dir = Path(run_dir) if run_dir else None
        self.slot = slot
        self.max_batch = max_batch
        self.window_s = window_s
        self.keys = DataPlaneKeys.from_env()
        self.fetcher = fetcher or DataPlaneWeightFetcher(keys=self.keys, idle_timeout_s=fetch_timeout_s)
        self.fetch_timeout_s = fetch_timeout_s
        self._torch: Any = None  # TorchWeightFetcher, created on the first torch.distributed ref
        self._q: queue.SimpleQueue[tuple[dict[str, Any], Future]] = queue.SimpleQueue()
        self.stats: dict[str, Any] = {"loads": 0, "dataplane_loads": 0, "torch_loads": 0, "file_loads": 0,
                                      "bytes_fetched": 0,
                                      "last_load_s": 0.0, "last_fetch_s": 0.0, "fetch_errors": 0, "last_error": None,
                                      "fetches": []}
        self._source: dict[str, Any] | None = None  # the newest trainer ref seen: where idle polls ask
        self._backoff: dict[tuple[str, int], tuple[float, float]] = {}  # (source, version) -> (retry_at, delay)
        self.idle_poll_s = 0.25
        self._stopped = threading.Event()
        self._write_status()
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
                sync = self._maybe_load([item["weights"] for item, _ in batch])
                results = self.engine.generate([item["req"] for item, _ in batch])
            except Exception as exc:  # noqa: BLE001  (deliver the failure to every waiting turn)
                for _, fut in batch:
                    fut.set_exception(ToolError("engine_failed", f"{type(exc).__name__}: {exc}"))
                continue
            for (_, fut), r in zip(batch, results):
                fut.set_result({"token_ids": r.token_ids, "logprobs": r.logprobs, "finish_reason": r.finish_reason,
                                "weights_version": r.weights_version, "gen_tokens": len(r.token_ids),
                                **sync, "batch": len(batch)})

    @staticmethod
    def _source_of(w: dict[str, Any]) -> str:
        return str(w.get("endpoint") or w.get("path"))

    def _maybe_load(self, wanted: list[Any]) -> dict[str, Any]:
        """Load the newest version any of ``wanted`` names, if newer than the engine's. Returns the reply
        fields ``load_s``, ``fetch_s``, ``weights_via`` (``dataplane``/``file``/None) and ``weights_error``;
        on failure the engine keeps its version (see the module contracts)."""
        from libra.dataplane import DataPlaneError

        best = None
        for w in wanted:
            if (isinstance(w, dict) and type(w.get("version")) is int
                    and (isinstance(w.get("endpoint"), str) or isinstance(w.get("path"), str))
                    and (best is None or w["version"] > best["version"])):
                best = w
        nothing = {"load_s": 0.0, "fetch_s": 0.0, "weights_via": None, "weights_error": None}
        if best is None:
            return nothing
        if best.get("endpoint") and (self._source is None or best["version"] >= (self._source.get("version") or 0)):
            self._source = best
        if best["version"] <= self.engine.weights_version:
            return nothing
        key = (self._source_of(best), best["version"])
        now = time.monotonic()
        retry = self._backoff.get(key)
        if retry is not None and now < retry[0]:
            return {**nothing, "weights_error": self.stats["last_error"]}
        t0 = time.perf_counter()
        try:
            if best.get("transport") == "torch":  # the trainer publishes over torch.distributed
                sd, version, fs = self._torch_fetcher().fetch(best)
                via, fetch_s, nbytes = "torch", fs.seconds, fs.nbytes
            elif best.get("endpoint"):
                sd, version, fs = self.fetcher.fetch(best)
                via, fetch_s, nbytes = "dataplane", fs.seconds, fs.nbytes
            else:
                sd, version = read_weights_file(best["path"])
                via, fetch_s, nbytes = "file", time.perf_counter() - t0, 0
            self.engine.load_weights(version, sd)
        except (DataPlaneError, ValueError, OSError) as exc:
            delay = min(self.BACKOFF_S[1], retry[1] * 2) if retry else self.BACKOFF_S[0]
            self._backoff[key] = (now + delay, delay)
            error = f"{type(exc).__name__}: {exc}"
            self.stats["fetch_errors"] += 1
            self.stats["last_error"] = error
            self._write_status()
            log.warning("weights_fetch_failed", version=best["version"], source=key[0], error=error,
                        kept_version=self.engine.weights_version, retry_in_s=delay)
            return {**nothing, "load_s": time.perf_counter() - t0, "weights_error": error}
        self._backoff.pop(key, None)
        load_s = time.perf_counter() - t0
        st = self.stats
        st["loads"] += 1
        st[f"{via}_loads"] += 1
        st["bytes_fetched"] += nbytes
        st["last_load_s"], st["last_fetch_s"], st["last_error"] = load_s, fetch_s, None
        st["fetches"] = [*st["fetches"][-49:], {"version": version, "via": via, "fetch_s": fetch_s, "load_s": load_s,
                                                "bytes": nbytes}]
        self._write_status()
        log.info("weights_loaded", version=version, via=via, load_s=round(load_s, 4), fetch_s=round(fetch_s, 4))
        return {"load_s": load_s, "fetch_s": fetch_s, "weights_via": via, "weights_error": None}

    def _torch_fetcher(self) -> Any:
        if self._torch is None:
            from libra.weights_dist import TorchWeightFetcher

            self._torch = TorchWeightFetcher(timeout_s=max(30.0, self.fetch_timeout_s))
        return self._torch

    def _poll_published(self) -> None:
        """Ask the last known trainer endpoint for its newest weights; load them if newer (idle only)."""
        from libra.dataplane import DataPlaneError, latest

        src = self._source
        if src is None or self.engine is None:
            return
        key = (self._source_of(src), -1)
        now = time.monotonic()
        retry = self._backoff.get(key)
        if retry is not None and now < retry[0]:
            return
        try:
            if src.get("transport") == "torch":  # the publisher's store keeps its newest ref
                from libra.weights_dist import latest_ref

                wire = latest_ref(src["endpoint"], timeout_s=1.0)
            else:
                ref = latest(src["endpoint"], "weights", server_key=src.get("server_key"), keys=self.keys,
                             timeout_s=1.0)
                wire = ref.to_wire() if ref is not None else None
        except DataPlaneError as exc:
            delay = min(self.BACKOFF_S[1], retry[1] * 2) if retry else self.BACKOFF_S[0]
            self._backoff[key] = (now + delay, delay)
            log.info("weights_poll_failed", endpoint=src["endpoint"], error=str(exc), retry_in_s=delay)
            return
        self._backoff.pop(key, None)
        if wire is not None and type(wire.get("version")) is int and wire["version"] > self.engine.weights_version:
            self._maybe_load([wire])

    def _write_status(self) -> None:
        if self.run_dir is None:
            return
        d = self.run_dir / "actors"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{self.slot}.json.tmp"
        tmp.write_text(json.dumps({"slot": self.slot, "role": "rollout", "weights_version": self.engine.weights_version,
                                   "pid": os.getpid(), **self.stats}))
        os.replace(tmp, d / f"{self.slot}.json")


class TrainRole:
    """A GRPO trainer rank, created on the first ``train`` work (see the module contracts)."""

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, torch_threads: int = 0,
                 fetch_timeout_s: float = 60.0) -> None:
        _set_threads(torch_threads)
        from libra.dataplane import DataPlaneKeys

        importlib.import_module("libra.engines.trainer")  # pay the torch/transformers import before bidding

        self.model_dir = model_dir
        self.run_dir = Path(run_dir) if run_dir else None
        self.slot = slot
        self.trainer: Any = None
        self.rank: int | None = None
        self.keys = DataPlaneKeys.from_env()
        self.fetch_timeout_s = fetch_timeout_s
        self.server: Any = None  # rank 0's DataPlaneServer, created with the trainer
        self.publisher: Any = None
        self._lock = threading.Lock()

    def _ensure(self, args: dict[str, Any]) -> Any:
        from libra.dataplane import DataPlaneServer, DataPlaneWeightPublisher
        from libra.engines.trainer import DistConfig, GRPOConfig, GRPOTrainer

        if self.trainer is not None:
            return self.trainer
        ws, rank = int(args.get("world_size", 1)), int(args.get("rank", 0))
        dist = DistConfig("127.0.0.1", int(args["master_port"]), rank, ws) if ws > 1 else None
        opts: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (args.get("grpo") or {}).items()}
        cfg = GRPOConfig(**opts)
        if rank == 0:  # before the (slow) model load, so a refused bind fails fast with its own message
            self.server = DataPlaneServer(keys=self.keys)
            if os.environ.get("LIBRA_WEIGHTS_TRANSPORT", "dataplane") == "torch":
                from libra.weights_dist import TorchWeightPublisher

                self.publisher = TorchWeightPublisher(os.environ.get("LIBRA_WEIGHTS_HOST", "127.0.0.1"), keep=2)
            else:
                self.publisher = DataPlaneWeightPublisher(self.server, keep=2)
        self.trainer = GRPOTrainer(self.model_dir, cfg, dist_config=dist)
        self.rank = rank
        log.info("trainer_ready", rank=rank, world_size=ws, slot=self.slot,
                 dataplane=self.server.endpoint if self.server else None)
        return self.trainer

    def train(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        from libra.dataplane import DataPlaneError, InsecureDataPlane

        parts = args.get("parts") if isinstance(args, dict) else None
        shards = args.get("shards") if isinstance(args, dict) else None
        if not (isinstance(parts, list) and parts) and not (isinstance(shards, list) and shards):
            raise ToolError("bad_request", "train needs args {'parts': [[{ref, advantage}, ...] per rank], "
                                           "'micro_batches': [...] per rank} or {'shards': [data-plane ref per rank]}, "
                                           "plus 'world_size', 'rank', 'master_port'")
        with self._lock:
            try:
                trainer = self._ensure(args)
            except InsecureDataPlane as exc:
                raise ToolError("insecure_dataplane", str(exc)) from None
            listed = parts if parts else shards
            if len(listed) != trainer.world_size:
                raise ToolError("bad_request", f"train names {len(listed)} ranks' data for a world of "
                                               f"{trainer.world_size} ranks")
            try:
                if parts:
                    shard, micro, fetched = self._fetch_parts(parts[trainer.rank],
                                                              (args.get("micro_batches") or [])[trainer.rank:][:1])
                else:
                    shard, micro, fetched = self._fetch_shard(shards[trainer.rank])
            except (DataPlaneError, ValueError, TypeError, KeyError) as exc:
                raise ToolError("shard_fetch_failed", f"rank {trainer.rank}: {type(exc).__name__}: {exc}") from None
            metrics = trainer.train_step(shard, micro_batches=micro)
            version = trainer.weights_version
            out: dict[str, Any] = {"rank": trainer.rank, "metrics": metrics, "weights_version": version,
                                   "checksum": self.checksum(), "shard_sequences": len(shard), "publish_s": 0.0,
                                   "weights": None, **fetched, "shard_tokens": sum(shard.lengths())}
            if trainer.rank == 0:
                t0 = time.perf_counter()
                out["weights"] = self.publisher.publish(version, trainer.state_dict_for_sync())
                out["publish_s"] = time.perf_counter() - t0
                if args.get("checkpoint"):
                    trainer.save_checkpoint(args["checkpoint"])
                    out["checkpoint"] = args["checkpoint"]
            return out

    def _fetch_shard(self, wire: Any) -> tuple[Any, list[list[int]], dict[str, Any]]:
        """One packed shard (``libra.rl.shards``) from whoever published it."""
        from libra.dataplane import ObjectRef, fetch_state_dict
        from libra.rl.shards import decode_shard

        sd, hdr, fs = fetch_state_dict(ObjectRef.from_wire(wire), keys=self.keys, idle_timeout_s=self.fetch_timeout_s)
        shard, micro = decode_shard(sd, hdr.metadata)
        return shard, micro, {"shard_fetch_s": fs.seconds, "shard_bytes": fs.nbytes, "shard_sources": 1}

    def _fetch_parts(self, mine: Any, micro: list[Any]) -> tuple[Any, list[list[int]], dict[str, Any]]:
        """This rank's trajectories, each fetched from the episode runner holding it (a few at a time), with
        the advantages and micro-batches the broker's dispatch decided."""
        from concurrent.futures import ThreadPoolExecutor

        from libra.dataplane import ObjectRef, fetch_state_dict
        from libra.rl.shards import merge_trajectories

        if not isinstance(mine, list) or not mine:
            raise ValueError("this rank was given no trajectories")
        refs = [ObjectRef.from_wire(p["ref"]) for p in mine]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(4, len(refs))) as pool:
            got = list(pool.map(lambda r: fetch_state_dict(r, keys=self.keys, idle_timeout_s=self.fetch_timeout_s),
                                refs))
        batch = merge_trajectories([(sd, hdr.metadata) for sd, hdr, _ in got], [float(p["advantage"]) for p in mine])
        plan = [[int(i) for i in mb] for mb in micro[0]] if micro else [list(range(len(mine)))]
        if sorted(i for mb in plan for i in mb) != list(range(len(mine))):
            raise ValueError("micro_batches do not cover this rank's trajectories exactly once")
        return batch, plan, {"shard_fetch_s": time.perf_counter() - t0, "shard_bytes": sum(fs.nbytes for *_, fs in got),
                             "shard_sources": len({r.endpoint for r in refs})}

    def close(self) -> None:
        """Stop serving weights (rollouts that have not fetched the newest version keep theirs)."""
        if self.publisher is not None and hasattr(self.publisher, "close"):
            self.publisher.close()  # the torch.distributed publisher's serving thread and store
        self.publisher = None
        if self.server is not None:
            self.server.close()
            self.server = None

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
                self.trainer.close()  # stops serving weights; its process group is left to the job
                self.trainer = None
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
