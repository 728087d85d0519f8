"""The broker's I/O shell: one ROUTER socket, decode → ``BrokerState.handle`` → execute the commands.

The socket is bound at ``bind`` and, for a TCP endpoint, also at a per-port Unix path (see
``libra.transport.endpoints``) that peers on this host use instead of loopback TCP. Nothing here decides anything. The loop drains up to ``max_recv_per_poll`` frames without blocking
(so a burst cannot starve the timers), feeds each to the core, executes the returned commands, and
ticks the core every ``tick_s``. The commands: ``Send`` (queued per peer, sent at the end of the pass),
``JournalWrite`` (appended to the SQLite journal, committed before the pass's replies go out), ``Log`` (a
structlog line) and ``StartPlannerSearch`` (a broker planner round's search, run on one worker thread and
handed back as a ``PlannerDone`` event). With ``replicate_bind`` (and a journal) the journal is also shipped to
standby brokers (``libra.broker.replication``): each pass's records go out after the local commit and the
in-sync standbys' acks are awaited before the pass's replies are sent. A frame that fails to decode becomes a ``BadFrame`` event (the core
answers known peers with an ``Error`` and ignores strangers); an exception inside the core is logged
with its traceback and counted, and the broker keeps serving. SIGTERM/SIGINT only set a flag.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import zmq

from libra.transport.endpoints import broker_ipc_endpoint, forget_ipc
from libra.logging import get_logger
from libra.protocol import ProtocolError, decode_many, encode, encode_many
from libra.transport.security import Authenticator, CurveServer, apply_server
from libra.transport.zmqio import NOBLOCK, recv_frames, recv_frames_user, recv_ready, send_frames

from .audit_log import AuditLog
from .config import BrokerConfig
from .events import (
    Audit,
    BadFrame,
    Command,
    JournalWrite,
    Log,
    PeerMessage,
    PlannerDone,
    Restore,
    RevokePeers,
    Send,
    StartPlannerSearch,
    Tick,
)
from .journal_store import BrokerJournal
from .replication import ReplicationPrimary
from .key_watch import REVOKED_WHY, KeyWatch
from .roles import HELLOS
from .router_state import RouterStateFile
from .state import BrokerState

if TYPE_CHECKING:  # prometheus-client is only imported when metrics are switched on
    from .metrics import BrokerMetrics

log = get_logger("libra.broker")


class BrokerServer:
    """Runs a :class:`BrokerState` behind a ROUTER socket bound at ``bind``."""

    def __init__(self, bind: str, config: BrokerConfig | None = None, *, ctx: zmq.Context | None = None,
                 max_recv_per_poll: int = 2000, on_ready: Callable[[str], None] | None = None,
                 curve: CurveServer | None = None, journal: str | None = None,
                 router_state: str | None = None, router_state_interval_s: float = 60.0,
                 ipc: bool = True, io_threads: int = 1, replicate_bind: str | None = None,
                 audit_log: str | None = None) -> None:
        self.audit = AuditLog(audit_log) if audit_log else None  # the core's Audit records (audit_log.py)
        self.router_state = RouterStateFile(router_state, router_state_interval_s) if router_state else None
        config = config or BrokerConfig()
        self.config = self.router_state.apply(config) if self.router_state is not None else config
        # the core emits journal records only when there is a journal, and leaves a planner round's search
        # to this shell (StartPlannerSearch) only when there is a planner
        self.state = BrokerState(self.config, journaling=bool(journal), planner_offload=bool(self.config.planner))
        self._ctx = ctx or zmq.Context(io_threads=max(1, io_threads))
        self._own_ctx = ctx is None
        self._curve = curve is not None
        self._auth = (Authenticator(self._ctx, curve.allow_dir, on_refused=_log_refused_handshake)
                      if curve is not None else None)
        self.sock = self._ctx.socket(zmq.ROUTER)
        if curve is not None:
            apply_server(self.sock, curve)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # libzmq drops a connection whose frame exceeds MAXMSGSIZE without a word; with headroom the codec
        # sees a frame up to twice the limit, refuses it as oversize and the core answers a known peer.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_frame_bytes)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        # the same socket at a Unix path too: peers on this host given a loopback TCP endpoint use it
        # (libra.transport.endpoints.resolve); CURVE, when on, applies to it as to TCP
        self.ipc_endpoint: str | None = None
        ipc_ep = broker_ipc_endpoint(self.endpoint) if ipc else None
        if ipc_ep is not None:
            try:
                self.sock.bind(ipc_ep)
                self.ipc_endpoint = ipc_ep
            except zmq.ZMQError as exc:
                log.warning("ipc_bind_failed", endpoint=ipc_ep, error=str(exc))
        elif not ipc:
            forget_ipc(self.endpoint)  # a stale path from an earlier broker on this port would mislead peers
        self._stop = threading.Event()
        self._max_recv = max_recv_per_poll
        self._tick_s = min(0.25, self.config.heartbeat_s / 2)
        self._bad_logged_at = 0.0
        self._bad_since_log = 0
        self.core_errors = 0
        self._on_ready = on_ready
        self._outq: dict[bytes, list] = {}
        self._ticks = 0
        self.journal = BrokerJournal(journal, self.config.reply_cache) if journal else None
        if self.journal is not None:
            accepted, done = self.journal.load()
            self.state.handle(Restore(accepted, done), time.monotonic())  # no commands: nothing is connected yet
            log.info("journal_restored", path=journal, restored=len(self.state.works), replies=len(done),
                     adopt_grace_s=self.state.adopt_grace_s)
        if replicate_bind is not None and self.journal is None:
            raise ValueError("replicate_bind needs a journal to replicate (--journal)")
        self.replica = (ReplicationPrimary(self._ctx, replicate_bind, self.journal, self.config, curve)
                        if replicate_bind is not None and self.journal is not None else None)
        self.metrics: BrokerMetrics | None = None  # optional Prometheus hook (set by __main__ / tests)
        # the broker planner's searches run on one worker thread, so a round never stalls the loop
        # (3 s at 512 GPUs); their result comes back to the core as a PlannerDone event
        self._planner_pool: ThreadPoolExecutor | None = None
        self._plan_running: tuple[Any, Future] | None = None
        if self.state.planner is not None:
            self._planner_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="libra-planner")

    def stop(self) -> None:
        """Ask the loop to exit (safe from signal handlers and other threads)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def _execute(self, cmds: list[Command]) -> None:
        """Execute the core's commands: sends are queued (:meth:`_flush` sends them, one batch per peer, at
        the end of the pass); journal records are appended (committed by :meth:`_flush` before any send);
        log lines are written; a planner search is started on the worker thread."""
        outq = self._outq
        for c in cmds:
            t = type(c)
            if t is Send:
                if c.buffers:  # raw buffers travel alone; keep order with what is queued for the peer
                    self._flush_peer(c.peer, outq.pop(c.peer, []))
                    self._send(c.peer, encode(c.msg, *c.buffers), type(c.msg).__name__)
                else:
                    outq.setdefault(c.peer, []).append(c.msg)
            elif t is JournalWrite:
                if self.journal is not None:
                    self.journal.write(c)
            elif t is Log:
                self._log(c)
            elif t is StartPlannerSearch:
                self._start_search(c.job)
            elif t is Audit:
                log.info("audit", **c.record)
                if self.audit is not None:
                    self.audit.write(c.record)
            else:
                log.error("unknown_command", command=t.__name__)

    @staticmethod
    def _log(c: Log) -> None:
        logger = log if c.component == "libra.broker" else get_logger(c.component)
        getattr(logger, c.level, logger.info)(c.event, **c.fields)

    def _start_search(self, job: Any) -> None:
        """Run a planning round's search on the worker thread (:meth:`_pump_planner` hands it back)."""
        if self._planner_pool is None or self._plan_running is not None:  # the core never asks for two
            log.error("planner_search_refused", running=self._plan_running is not None)
            return
        self._plan_running = (job, self._planner_pool.submit(job.run, time.perf_counter))  # the shell's clock

    def _flush(self) -> None:
        if self.journal is not None:
            self.journal.commit()  # durable before any reply of this pass is sent
            if self.replica is not None:
                self.replica.ship()  # and on the in-sync standbys too
        outq, self._outq = self._outq, {}
        for peer, msgs in outq.items():
            self._flush_peer(peer, msgs)

    def _flush_peer(self, peer: bytes, msgs: list) -> None:
        for i in range(0, len(msgs), 256):
            chunk = msgs[i : i + 256]
            self._send(peer, encode_many(chunk), type(chunk[0]).__name__)

    def _send(self, peer: bytes, frames: list[bytes], what: str) -> None:
        try:
            send_frames(self.sock, [peer, *frames], NOBLOCK)
        except zmq.Again:  # peer's pipe is full: it is not reading; liveness will deal with it
            log.warning("send_dropped_hwm", kind=what)
        except zmq.ZMQError as exc:
            log.warning("send_failed", kind=what, error=str(exc))

    def _handle(self, event, now: float) -> None:
        try:
            cmds = self.state.handle(event, now)
        except Exception:
            self.core_errors += 1
            log.exception("broker_core_error", event=type(event).__name__)
            return
        if self.metrics is not None:
            self.metrics.observe(event, cmds, now)
        if cmds:
            self._execute(cmds)

    def _pump_planner(self) -> None:
        """Hand a finished planner search (started by a ``StartPlannerSearch`` command) back to the core."""
        running = self._plan_running
        if running is None:
            return
        job, fut = running
        if not fut.done():
            return
        self._plan_running = None
        exc = fut.exception()
        if exc is not None:  # PlanJob.run keeps planner errors; anything else is a bug, reported as one
            log.error("planner_search_crashed", error=repr(exc))
            job.error = f"search crashed: {exc!r}"
        self._handle(PlannerDone(job), time.monotonic())
        self._flush()

    def _note_bad(self, err: ProtocolError, now: float) -> None:
        self._bad_since_log += 1
        if now - self._bad_logged_at >= 1.0:  # rate-limited: a flood must not flood the log
            log.warning("bad_frames", count=self._bad_since_log, last_code=err.code.value, last=err.message)
            self._bad_logged_at = now
            self._bad_since_log = 0

    def _frames(self, item: Any, keys: KeyWatch | None, maxb: int, now: float) -> None:
        """One received message (its frames, with its key under CURVE): decoded and handed to the core."""
        frames, key = item if keys is not None else (item, "")
        role = keys.role(key) if keys is not None else ""
        peer = frames[0]
        body = frames[1:]
        if body and body[0] == b"":  # REQ-style empty delimiter: tolerate it
            body = body[1:]
        try:
            decoded = decode_many(body, maxb)
        except ProtocolError as err:
            self._note_bad(err, now)
            self._handle(BadFrame(peer, err), now)
            return
        for d in decoded:
            if keys is not None and type(d.msg) in HELLOS:
                keys.hello(peer, key)
            self._handle(PeerMessage(peer, d.msg, d.buffers, role, key), now)

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`. Closes the socket on exit."""
        log.info("broker_started", endpoint=self.endpoint, ipc=self.ipc_endpoint, heartbeat_s=self.config.heartbeat_s,
                 liveness=self.config.liveness, max_frame_bytes=self.config.max_frame_bytes,
                 curve="on: only keys in the allow directory get in" if self._curve else "off: plaintext")
        if self._on_ready:
            self._on_ready(self.endpoint)
        sock, maxb = self.sock, self.config.max_frame_bytes
        mono = time.monotonic
        next_tick = mono() + self._tick_s
        poller = zmq.Poller()  # one poller for the loop's life (Socket.poll builds a new one per call)
        poller.register(sock, zmq.POLLIN)
        replica = self.replica
        if replica is not None:
            poller.register(replica.sock, zmq.POLLIN)
        poll = poller.poll
        # under CURVE each message comes with its key, whose role the key watch looks up (libra.broker.roles)
        keys = KeyWatch(self._auth, self.config.heartbeat_s, mono()) if self._auth is not None else None
        recv = recv_frames_user if keys is not None else recv_frames
        try:
            while not self._stop.is_set():
                timeout_ms = max(0, int((next_tick - mono()) * 1000))
                ready = dict(poll(timeout_ms))
                if replica is not None and replica.sock in ready:
                    replica.pump(mono())
                received = 0
                if sock in ready:
                    for item in recv_ready(sock, self._max_recv, recv):
                        received += 1
                        self._frames(item, keys, maxb, mono())
                    self._flush()
                now = mono()
                removed = keys.revoked(now) if keys is not None else {}
                for key, gone in removed.items():  # keys left the allow directory: their peers go, each key audited
                    self._handle(RevokePeers(gone, REVOKED_WHY, (key,)), now)
                if removed:
                    self._flush()
                if now >= next_tick:
                    self._handle(Tick(behind=received >= self._max_recv), now)
                    self._ticks += 1
                    if self.journal is not None and self._ticks % 240 == 0:
                        self.journal.prune()
                    self._flush()
                    if self.metrics is not None:
                        self.metrics.tick(now, self.core_errors)
                    if replica is not None:
                        replica.pump(now)
                    if self.router_state is not None:
                        self.router_state.maybe_save(self.state.rollout.router, now)
                    next_tick = now + self._tick_s
                if self._planner_pool is not None:
                    self._pump_planner()
        finally:
            log.info("broker_stopped", **{k: v for k, v in self.state.stats.items() if v})
            if self._planner_pool is not None:
                self._planner_pool.shutdown(wait=False, cancel_futures=True)
            self.sock.close(0)
            if self.ipc_endpoint is not None:  # no peer should find a path nobody serves
                with contextlib.suppress(OSError):
                    os.unlink(self.ipc_endpoint[len("ipc://"):])
            if self.router_state is not None:
                self.router_state.close(self.state.rollout.router)
            if self.metrics is not None:
                self.metrics.close()
            if self._auth is not None:
                self._auth.stop()
            if self.replica is not None:
                self.replica.close()
            if self.journal is not None:
                self.journal.close()
            if self.audit is not None:
                self.audit.close()
            if self._own_ctx:
                self._ctx.term()


def _log_refused_handshake(info: dict[str, str]) -> None:
    """A peer the CURVE allow-list refused (called on the authenticator's thread)."""
    log.warning("handshake_refused", **info)
