"""The ``rollout`` role: a rollout engine behind a turn batcher, serving ``generate`` work.

Role: turn an actor slot into a rollout instance behind the ``ActorRuntime(handlers={(kind, name): fn(args,
ctx)})`` interface. The payloads are typed: :class:`~libra.protocol.payloads_rollout.GenerateArgs` in,
:class:`~libra.protocol.payloads_rollout.GenerateResult` out (their docstrings hold the field contracts);
malformed args fail the turn with ``bad_request``.

Contracts:
- Engine: ``$LIBRA_ROLLOUT_ENGINE`` in the actor's environment picks it: ``hf`` (default,
  ``HFRolloutEngine``) or ``vllm`` (``VLLMRolloutEngine`` with ``max_num_seqs = --rollout-batch`` and the
  JSON object ``$LIBRA_VLLM_ARGS`` as extra ``vllm.LLM`` arguments). The slot must then run under an
  interpreter that has vLLM (the supervisor starts slots with its own ``sys.executable``). An unknown
  name, bad ``$LIBRA_VLLM_ARGS`` or an unusable vLLM raises ``ValueError`` (the slot exits with rc 2).
- Placement: the engine runs where ``libra.engines.device`` puts the slot (``placement``): a GPU slot's GPU in
  bf16 by default with its memory budget, the CPU in fp32 otherwise. A TP group's leader (``tp > 1``) builds
  one vLLM engine over the group's GPUs (``devices``); the HF engine refuses ``tp > 1`` (``TPUnsupported``).
- Failures of an engine call (``ToolFailed.tool_code`` at the client): a CUDA out-of-memory error or
  :class:`~libra.engines.rollout_base.EngineOutOfMemory` fails that batch's turns with ``oom`` and halves the
  batch (down to 1, also the engine's ``max_batch_size``); the CUDA cache is freed only after the ``except``
  block is left, so the failed call's tensors (held by its traceback) are gone first. The instance keeps
  serving. :class:`~libra.engines.rollout_base.EngineCrashed` fails the batch with ``engine_failed``, then the
  dead engine is closed and released and a new one built before the next batch (``engine_restarts``); while
  a rebuild fails, batches fail with ``engine_failed`` and it is retried after a back-off (2 s doubling to
  30 s). Any other engine exception fails the batch with ``engine_failed`` and keeps the engine.
- A turn whose prompt + ``max_new_tokens`` exceeds the engine's ``max_model_len`` fails alone with
  ``context_too_long`` before it is batched; the other turns run.
- :meth:`RolloutRole.close` stops and joins the batcher, closes the engine (``engine.close()``) and the context
  service, and drops every reference to the engine, so a role switch frees the model and its KV (idempotent;
  turns must be drained first). Each release (close, crash, OOM) records the memory before and after it
  (``libra.engines.memory``) in ``memory_releases`` (the last 20) of the status file.
- Concurrent turns are batched: one thread drains the queue of waiting turns (up to ``max_batch``) and
  runs one engine call for all of them.
- Weights are loaded only between engine calls, never mid-turn: before a batch, if any waiting turn
  names a newer version than the engine's, that version is fetched from the trainer over the data
  plane (chunked, CRC-checked) or torch.distributed and loaded first.
- Delta sync (data plane; off with ``$LIBRA_WEIGHTS_DELTA=0``): the instance keeps the last version it
  assembled in host memory (``host_weights``, :mod:`libra.weights.host_copy`; a hybrid slot's outlives the
  role) and fetches only the delta when the ref's ``delta_from`` is the version held, the full object
  otherwise or when the delta fails (:mod:`libra.weights.dataplane`). The torch.distributed transport always
  sends whole versions.
- A failed fetch (trainer dead mid-transfer: :class:`~libra.dataplane.PeerLost`; corrupted:
  :class:`~libra.dataplane.TransferCorrupted`; superseded: :class:`~libra.dataplane.ObjectNotFound`)
  never fails the turn: the instance keeps its old version, generates with it, reports the error in the
  reply and its status file, and does not retry that version for a back-off period (2 s, doubling to 30 s).
- While idle (no turn waiting for ``idle_poll_s``) the instance asks the last trainer endpoint it was
  told about for the newest ``weights`` object and loads it, so it is already up to date when the next
  turn comes (still never mid-turn: the batcher thread is the only one that generates or loads).
- The instance records its state in its record file (``RUN/actors/<actor id>.json``, keyed by the actor id,
  ``HOST/SLOT`` by default: :mod:`libra.actors.slot_records`) after every load or failure:
  ``weights_version``, ``loads``, ``dataplane_loads``, ``torch_loads``, ``file_loads``, ``delta_loads``,
  ``full_loads``, ``host_loads``, ``delta_fallbacks``, ``last_delta_error``, ``bytes_fetched``,
  ``last_load_s``, ``last_fetch_s``, ``fetch_errors``, ``last_error`` and ``fetches`` (the last 50
  ``{"version", "via", "sync", "fetch_s", "load_s", "bytes"}``); ``ooms``, ``max_batch``, ``engine_restarts``,
  ``restart_errors``, ``context_too_long`` and ``memory_releases`` after a failure; and the fields of
  ``record`` (a hybrid slot's role switches).
- A cancelled turn (its work revoked, preempted or handed back: ``WorkContext.cancelled``) stops: one still
  waiting fails with ``cancelled`` before it runs; one in the engine's batch leaves it at the next decode step
  on an engine that can interrupt (``cancellable``, the HF engine) and fails with ``cancelled`` too, keeping no
  context; the other turns of the batch finish. ``cancelled_turns`` counts both.
- Fallback (documented, not used by ``python -m libra run``): a weights ref with a ``path`` instead of an
  ``endpoint`` is read from a weights file (:mod:`libra.weights.file`), for weights on shared storage (e.g.
  a checkpoint) when no data-plane route to a trainer exists.
- KV use: after each batch the engine's KV reading (used fraction of its KV budget, sequences holding it;
  ``libra.engines.kv_use``) goes to ``on_kv_use`` (the runtime posts it to the actor core, which re-bids when
  the sequences that fit move by more than ``$LIBRA_KV_REBID_THRESHOLD`` of the batch size, default 0.1).
- Contexts stay on the instance: a turn in the delta form (``GenerateArgs.context``) is resolved by
  :class:`~libra.actors.rollout_context.ContextService` (its own cache; on a miss, KV or ids fetched over the
  data plane as ``Assign.route["mode"]`` says; a digest mismatch fails the turn with ``context_mismatch``), and
  the engine keeps each trajectory's context keyed by its trajectory id.
- Data-plane host and security: ``$LIBRA_DATAPLANE_HOST`` (default ``127.0.0.1``); CURVE when
  ``LIBRA_CURVE_SECRET`` is set (the actor's own key pair); a non-loopback host without keys is refused
  unless ``LIBRA_DATAPLANE_INSECURE=1`` (see ``libra.dataplane``). With ``LIBRA_CURVE_ALLOW`` too (the allow
  directory) the context server checks its fetchers' key roles (``libra.dataplane.access``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from libra.logging import get_logger
from libra.protocol.payloads_base import PayloadError
from libra.protocol.payloads_refs import WeightsRef
from libra.protocol.payloads_rollout import GenerateArgs, GenerateResult
from libra.weights.file import read_weights_file

from .rollout_failures import EngineKeeper
from .slot_records import default_actor_id, write_slot_record
from .tools import ToolError, WorkContext

__all__ = ["KV_REBID_ENV", "ROLLOUT_ENGINE_ENV", "RolloutRole", "attach_kv_reports", "make_rollout_engine",
           "set_torch_threads", "write_slot_record"]

log = get_logger("libra.roles")

ROLLOUT_ENGINE_ENV = "LIBRA_ROLLOUT_ENGINE"


def set_torch_threads(n: int) -> None:
    """Limit torch to ``n`` CPU threads (0: torch's default)."""
    import torch

    if n > 0:
        torch.set_num_threads(n)


def make_rollout_engine(model_dir: str, max_batch: int, placement: Any = None, *, tp: int = 1,
                        devices: tuple[int, ...] = ()) -> Any:
    """The rollout engine ``$LIBRA_ROLLOUT_ENGINE`` names (``hf`` by default; see the module contracts), on
    ``placement`` (a :class:`~libra.engines.device.placement.Placement`; CPU float32 when None). ``tp > 1``
    (a TP group's leader over ``devices``) needs vLLM: the HF engine raises
    :class:`~libra.engines.device.errors.TPUnsupported`."""
    from libra.engines.device.errors import TPUnsupported
    from libra.engines.device.placement import apply_memory_budget

    name = os.environ.get(ROLLOUT_ENGINE_ENV, "hf").strip().lower() or "hf"
    if name == "hf":
        if tp > 1:
            raise TPUnsupported(f"the HF rollout engine serves TP 1 only, asked for TP {tp} "
                                f"(set {ROLLOUT_ENGINE_ENV}=vllm for tensor-parallel rollout)")
        from libra.engines.hf_rollout import HFRolloutEngine

        if placement is None:
            return HFRolloutEngine(model_dir, max_batch_size=max_batch)
        apply_memory_budget(placement)
        return HFRolloutEngine(model_dir, max_batch_size=max_batch, device=placement.device,
                               dtype=placement.torch_dtype())
    if name == "vllm":
        from libra.engines.rollout_base import EngineUnavailable
        from libra.engines.vllm_rollout import VLLMRolloutEngine, vllm_args_from_env, vllm_engine_args

        args = vllm_engine_args(max_batch, placement, tp=tp, devices=devices, extra=vllm_args_from_env())
        try:
            return VLLMRolloutEngine(model_dir, **args)
        except EngineUnavailable as exc:
            raise ValueError(f"{ROLLOUT_ENGINE_ENV}=vllm: {exc}") from None
    raise ValueError(f"{ROLLOUT_ENGINE_ENV}={name!r}: unknown rollout engine (known: hf, vllm)")


KV_REBID_ENV = "LIBRA_KV_REBID_THRESHOLD"


def attach_kv_reports(handlers: Any, post: Any, state: Any, environ: Any = None) -> int:
    """Send the KV readings of every :class:`RolloutRole` (or hybrid role) behind ``handlers`` (a ``{(kind, name):
    fn}`` map) to the actor core as ``KvUse`` events through ``post`` (the runtime's event queue), with the threshold
    ``$LIBRA_KV_REBID_THRESHOLD`` (a fraction of the batch size, default 0.1) set on ``state``. Returns how many
    roles were wired. Raises ``ValueError`` for a threshold that is not a number within [0, 1]."""
    from .state import KvUse

    env = os.environ if environ is None else environ
    raw = env.get(KV_REBID_ENV, "").strip()
    try:
        threshold = float(raw) if raw else 0.1
    except ValueError:
        raise ValueError(f"{KV_REBID_ENV}={raw!r}: not a number") from None
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"{KV_REBID_ENV}={raw!r}: must be within [0, 1]")
    state.kv_rebid_threshold = threshold
    # a RolloutRole, or a HybridRole (which hands the hook to each rollout engine it builds)
    roles = {id(r): r for fn in handlers.values() if hasattr(r := getattr(fn, "__self__", None), "on_kv_use")}
    for role in roles.values():
        role.on_kv_use = lambda used, seqs: post(KvUse(used, seqs))
    return len(roles)


def rollout_engine_name() -> str:
    """The rollout engine this slot runs (``$LIBRA_ROLLOUT_ENGINE``, ``hf`` by default)."""
    return os.environ.get(ROLLOUT_ENGINE_ENV, "hf").strip().lower() or "hf"


class RolloutRole(EngineKeeper):
    """A rollout engine (HF by default, see :func:`make_rollout_engine`) with a turn batcher (see the module
    contracts; its engine's failures and releases: :class:`~libra.actors.rollout_failures.EngineKeeper`)."""

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, max_batch: int = 32,
                 window_s: float = 0.02, torch_threads: int = 0, fetch_timeout_s: float = 10.0,
                 fetcher: Any = None, placement: Any = None, tp: int = 1, devices: tuple[int, ...] = (),
                 engine: Any = None, engine_factory: Any = None, record: dict[str, Any] | None = None,
                 host_weights: Any = None, actor_id: str | None = None) -> None:
        from libra.dataplane import DataPlaneKeys
        from libra.weights.dataplane import DataPlaneWeightFetcher
        from libra.weights.delta import delta_enabled
        from libra.weights.host_copy import HostWeights

        set_torch_threads(torch_threads)
        self.placement = placement
        # builds a new engine after a crash (a closure over the arguments, never over this role or its engine)
        self._factory = engine_factory or (lambda: make_rollout_engine(model_dir, max_batch, placement, tp=tp,
                                                                       devices=devices))
        self.engine = engine if engine is not None else self._factory()
        self._version = int(self.engine.weights_version)  # the last version an engine reported (for the record)
        self.ooms = 0  # out-of-memory failures survived (each halves max_batch)
        self.record = record if record is not None else {}  # extra record fields (a hybrid slot's switches)
        self._restart: tuple[float, float] = (0.0, 0.0)  # (next rebuild try, its back-off) while the engine is down
        self.run_dir = Path(run_dir) if run_dir else None
        self.slot = slot
        self.actor_id = actor_id or default_actor_id(slot)  # keys the record file (slot_records)
        self.max_batch = max_batch
        self.window_s = window_s
        self.keys = DataPlaneKeys.from_env()
        # the last weights version assembled, in host memory: delta sync's base (libra.weights.host_copy); a
        # hybrid slot passes its own, which outlives this role and its engine
        self.host_weights = host_weights if host_weights is not None else HostWeights() if delta_enabled() else None
        self.fetcher = fetcher or DataPlaneWeightFetcher(keys=self.keys, idle_timeout_s=fetch_timeout_s,
                                                         host_copy=self.host_weights)
        self.fetch_timeout_s = fetch_timeout_s
        from .rollout_context import ContextService

        self.contexts = ContextService(self.engine, self.keys, fetch_timeout_s=fetch_timeout_s)
        from libra.weights.transport import Fetchers

        on = placement.device if placement is not None else None  # weights land on the engine's device
        self._fetchers = Fetchers(keys=self.keys, device=on, timeout_s=fetch_timeout_s)  # one per transport
        self._q: queue.SimpleQueue[tuple[Any, WeightsRef | None, Future] | None] = queue.SimpleQueue()  # None: close
        self.stats: dict[str, Any] = {"loads": 0, "dataplane_loads": 0, "torch_loads": 0, "file_loads": 0,
                                      "delta_loads": 0, "full_loads": 0, "host_loads": 0, "delta_fallbacks": 0,
                                      "cancelled_turns": 0, "last_delta_error": None, "bytes_fetched": 0,
                                      "last_load_s": 0.0, "last_fetch_s": 0.0, "fetch_errors": 0, "last_error": None,
                                      "fetches": [], "ooms": 0, "max_batch": max_batch, "engine_restarts": 0,
                                      "restart_errors": 0, "context_too_long": 0, "memory_releases": []}
        self._source: WeightsRef | None = None  # the newest trainer ref seen: where idle polls ask
        self._backoff: dict[tuple[str, int], tuple[float, float]] = {}  # (source, version) -> (retry_at, delay)
        self.idle_poll_s = 0.25
        # called with the engine's KV reading (used fraction, sequences) after each batch: the actor's re-bid
        self.on_kv_use: Any = None
        self._stopped = threading.Event()
        self._write_status()
        self._thread = threading.Thread(target=self._loop, name="libra-rollout-batcher", daemon=True)
        self._thread.start()

    def generate(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        """One ``generate`` turn: :class:`GenerateArgs` in, :class:`GenerateResult` (as a mapping) out."""
        from libra.engines.rollout_base import GenRequest

        from .rollout_context import Turn

        try:
            ga = GenerateArgs.from_wire(args)
            prompt, via = self.contexts.resolve(ctx.trajectory, ga, getattr(ctx, "route", None))
            req = GenRequest(prompt_ids=prompt, max_new_tokens=ga.max_new_tokens, temperature=ga.temperature,
                             top_p=ga.top_p, stop_token_ids=ga.stop_token_ids, seed=ga.seed)
        except PayloadError as exc:
            raise ToolError("bad_request", str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise ToolError("bad_request", f"bad generate args: {exc}") from None
        limit = getattr(self.engine, "max_model_len", None)
        if isinstance(limit, int) and len(prompt) + req.max_new_tokens > limit:
            self.stats["context_too_long"] += 1
            n, m = len(prompt), req.max_new_tokens
            raise ToolError("context_too_long", f"prompt ({n} tokens) + max_new_tokens ({m}) = {n + m} exceeds the "
                                                f"rollout engine's context limit max_model_len ({limit})")
        if self._stopped.is_set():
            raise ToolError("engine_failed", f"rollout instance {self.slot} is closed")
        fut: Future = Future()
        self._q.put((Turn(req, ctx.trajectory, via, getattr(ctx, "cancelled", None)), ga.weights, fut))
        return fut.result()

    CLOSE_JOIN_S = 60.0  # how long close() waits for the batcher's current batch or idle poll

    def close(self) -> None:
        """Stop and join the batcher, close the engine and the context service, and drop every reference to the
        engine (see the module contracts). Turns must be drained first. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._q.put(None)  # wakes the batcher now
        if self._thread is not threading.current_thread():
            self._thread.join(self.CLOSE_JOIN_S)
            if self._thread.is_alive():
                log.warning("rollout_batcher_still_running", slot=self.slot, waited_s=self.CLOSE_JOIN_S)
        self.on_kv_use = None
        self.contexts.close()
        self._fetchers.close()  # a torch fetcher's pair groups go with it
        self._release_engine("close")

    def _take_batch(self) -> list[tuple[Any, WeightsRef | None, Future]]:
        while True:
            if self._stopped.is_set():
                return []
            try:
                first = self._q.get(timeout=self.idle_poll_s)
                break
            except queue.Empty:
                self._poll_published()  # idle: pick up a newly published version early
        if first is None:  # close() woke us
            return []
        batch = [first]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                item = self._q.get(timeout=max(0.0, remaining)) if remaining > 0 else self._q.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            batch.append(item)
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                return
            batch = self._drop_cancelled(batch)
            if not batch:
                continue
            failure: tuple[str, str] | None = None
            try:
                self._ensure_engine()
                sync = self._maybe_load([w for _, w, _ in batch])
                turns = [t for t, _, _ in batch]
                results = self.contexts.generate(turns)
                replies = [GenerateResult(token_ids=r.token_ids, logprobs=r.logprobs, finish_reason=r.finish_reason,
                                          weights_version=r.weights_version, gen_tokens=len(r.token_ids),
                                          batch=len(batch), **sync, **self.contexts.reply_fields(t, r)).to_wire()
                           for t, r in zip(turns, results)]
                del results
            except ToolError as exc:
                failure = (exc.code, exc.message)
            except Exception as exc:  # noqa: BLE001  (deliver the failure to every waiting turn)
                failure = self._classify(exc)  # strings only: nothing of the traceback outlives this block
            if failure is not None:  # out of the except block: the failed call's frames and tensors are gone
                err = self._engine_failure(*failure)
                for *_, fut in batch:
                    fut.set_exception(err)
                del err, batch
                continue
            self._report_kv()  # before the replies: the credit is re-bid before the next turns can come
            for (*_, fut), reply in zip(batch, replies):
                if reply["finish_reason"] == "cancelled":  # stopped mid-turn: its work was revoked or handed back
                    self.stats["cancelled_turns"] += 1
                    fut.set_exception(ToolError("cancelled", f"turn cancelled after {reply['gen_tokens']} tokens"))
                else:
                    fut.set_result(reply)
            del batch, replies

    def _drop_cancelled(self, batch: list[tuple[Any, WeightsRef | None, Future]]
                        ) -> list[tuple[Any, WeightsRef | None, Future]]:
        """Fail the turns cancelled while they waited (nothing of them ran); the rest go to the engine."""
        kept = []
        for item in batch:
            ev = item[0].cancelled
            if ev is not None and ev.is_set():
                self.stats["cancelled_turns"] += 1
                item[2].set_exception(ToolError("cancelled", "turn cancelled before it started"))
            else:
                kept.append(item)
        return kept

    def _report_kv(self) -> None:
        """Hand the engine's KV reading (``libra.engines.kv_use``) to :attr:`on_kv_use`, if set."""
        from libra.engines.kv_use import engine_kv_use

        if self.on_kv_use is None:
            return
        reading = engine_kv_use(self.engine)
        if reading is not None:
            self.on_kv_use(*reading)

    def _maybe_load(self, wanted: list[WeightsRef | None]) -> dict[str, Any]:
        """Load the newest version any of ``wanted`` names, if newer than the engine's. Returns the reply
        fields ``load_s``, ``fetch_s``, ``weights_via`` (``dataplane``/``file``/None) and ``weights_error``;
        on failure the engine keeps its version (see the module contracts)."""
        from libra.dataplane import DataPlaneError

        best: WeightsRef | None = None
        for w in wanted:
            if w is not None and (best is None or w.version > best.version):
                best = w
        nothing = {"load_s": 0.0, "fetch_s": 0.0, "weights_via": None, "weights_error": None}
        if best is None:
            return nothing
        if best.endpoint and (self._source is None or best.version >= self._source.version):
            first, self._source = self._source is None, best
            if first:
                self._write_status()  # the record says the instance can now follow the trainer (knows_publisher)
        if best.version <= self.engine.weights_version:
            return nothing
        key = (best.source, best.version)
        now = time.monotonic()
        retry = self._backoff.get(key)
        if retry is not None and now < retry[0]:
            return {**nothing, "weights_error": self.stats["last_error"]}
        t0 = time.perf_counter()
        try:
            fs: Any = None
            if best.endpoint:  # the ref names its transport (libra.weights.transport)
                sd, version, fs, via = self._fetchers.fetch(best.to_wire(), {"dataplane": self.fetcher})
                fetch_s, nbytes = fs.seconds, fs.nbytes
            else:
                sd, version = read_weights_file(str(best.path))
                via, fetch_s, nbytes = "file", time.perf_counter() - t0, 0
            self.engine.load_weights(version, sd)
            del sd  # the engine holds the weights now (a delta's base stays in the host copy)
        except (DataPlaneError, ValueError, OSError) as exc:
            delay = min(self.BACKOFF_S[1], retry[1] * 2) if retry else self.BACKOFF_S[0]
            self._backoff[key] = (now + delay, delay)
            error = f"{type(exc).__name__}: {exc}"
            self.stats["fetch_errors"] += 1
            self.stats["last_error"] = error
            self._write_status()
            log.warning("weights_fetch_failed", version=best.version, source=key[0], error=error,
                        kept_version=self.engine.weights_version, retry_in_s=delay)
            return {**nothing, "load_s": time.perf_counter() - t0, "weights_error": error}
        self._backoff.pop(key, None)
        load_s = time.perf_counter() - t0
        self._count_load(version, via, getattr(fs, "mode", "full"), getattr(fs, "delta_error", None), fetch_s,
                         load_s, nbytes)
        return {"load_s": load_s, "fetch_s": fetch_s, "weights_via": via, "weights_error": None}

    def _count_load(self, version: int, via: str, sync: str, delta_error: str | None, fetch_s: float, load_s: float,
                    nbytes: int) -> None:
        """Record a successful load in the stats and the status file: its transport (``via``), how its bytes
        came (``sync``: ``delta``, ``full``, or ``host`` when the host copy already held that version) and a
        delta that failed before a full fetch (``delta_fallbacks``, ``last_delta_error``)."""
        st = self.stats
        sync = sync if sync in ("delta", "host") else "full"  # a transport without deltas sends whole versions
        st["loads"] += 1
        st[f"{via}_loads"] += 1
        st[f"{sync}_loads"] += 1
        if delta_error is not None:
            st["delta_fallbacks"] += 1
            st["last_delta_error"] = delta_error
        st["bytes_fetched"] += nbytes
        st["last_load_s"], st["last_fetch_s"], st["last_error"] = load_s, fetch_s, None
        st["fetches"] = [*st["fetches"][-49:], {"version": version, "via": via, "sync": sync, "fetch_s": fetch_s,
                                                "load_s": load_s, "bytes": nbytes}]
        self._write_status()
        log.info("weights_loaded", version=version, via=via, sync=sync, bytes=nbytes, load_s=round(load_s, 4),
                 fetch_s=round(fetch_s, 4), delta_error=delta_error)

    def _poll_published(self) -> None:
        """Ask the last known trainer endpoint for its newest weights; load them if newer (idle only)."""
        from libra.dataplane import DataPlaneError, latest

        src = self._source
        if src is None or self.engine is None:
            return
        key = (src.source, -1)
        now = time.monotonic()
        retry = self._backoff.get(key)
        if retry is not None and now < retry[0]:
            return
        try:
            if src.transport == "torch":  # the publisher's store keeps its newest ref
                from libra.weights.torch_dist import latest_ref

                wire = latest_ref(str(src.endpoint), timeout_s=1.0)
            else:
                ref = latest(str(src.endpoint), "weights", server_key=src.server_key, keys=self.keys,
                             timeout_s=1.0)
                wire = ref.to_wire() if ref is not None else None
        except DataPlaneError as exc:
            delay = min(self.BACKOFF_S[1], retry[1] * 2) if retry else self.BACKOFF_S[0]
            self._backoff[key] = (now + delay, delay)
            log.info("weights_poll_failed", endpoint=src.endpoint, error=str(exc), retry_in_s=delay)
            return
        self._backoff.pop(key, None)
        try:
            newest = WeightsRef.from_wire(wire) if wire is not None else None
        except PayloadError as exc:
            log.info("weights_poll_bad_ref", endpoint=src.endpoint, error=str(exc))
            return
        if newest is not None and newest.version > self.engine.weights_version:
            self._maybe_load([newest])

    def write_status(self) -> None:
        """Write the status file (``RUN/actors/<actor id>.json``) now (see the module contracts)."""
        self._write_status()

    def _write_status(self) -> None:
        if self.engine is not None:
            self._version = int(self.engine.weights_version)
        if self.run_dir is None:
            return
        write_slot_record(self.run_dir, self.slot, {**self.record, "slot": self.slot, "role": "rollout",
                                                    "weights_version": self._version,
                                                    "knows_publisher": self._source is not None,
                                                    "pid": os.getpid(), **self.stats}, self.actor_id)


