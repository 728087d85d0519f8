"""The actor's I/O shell: one DEALER socket to the broker, work on threads, decisions in ``ActorState``.

The socket thread polls the broker socket and a wake pipe. Work runs on a thread pool; a finished piece of work
is put on a queue and the pipe is written, so the socket thread (the only one that touches the socket) sends the
result. Engine reconfiguration for a directive also runs off the socket thread, so heartbeats keep flowing.

``python -m libra.actors.runtime --broker URL --slot cpu0`` runs one slot (the supervisor,
``python -m libra.actors``, starts one such process per slot).
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket as pysocket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable

import zmq

from libra.engines.device.slots import slot_gpu_index
from libra.engines.device.tp_groups import engine_labels_from_env
from libra.logging import bind_context, configure, get_logger
from libra.protocol import ProtocolError, decode_many, encode, encode_batch, encode_many, messages as m
from libra.protocol.errors import ErrorCode, ProtocolCode
from libra.transport import sdnotify
from libra.transport.endpoints import parse_endpoints
from libra.transport.fdlimit import raise_open_files_limit
from libra.transport.security import CurveClient
from libra.transport.zmqio import NOBLOCK, close_socket, connect_dealer, recv_ready, send_frames

from .state import (ActorIdentity, ActorState, CancelWork, Connect, Note, Received, Reconfigure,
                    Reconfigured, SendMsg, Start, StartWork, Stop, Tick, WorkDone)
from .diagnose import log_note
from .direct import DirectLeaseTable, bind_direct
from .slots import runtime_cuda_env
from .slot_records import default_actor_id
from .slot_setup import SlotSetupError, slot_role
from .tools import Handler, ToolError, WorkContext

log = get_logger("libra.actor")

Reconfigurer = Callable[[list[str], dict[str, Any]], "int | None"]  # returns the new capacity, if changed


class ActorRuntime:
    """Runs one actor slot until :meth:`stop`.

    ``handlers`` maps ``(kind, name)`` to a handler; for ``action`` work the name is the tool.
    ``reconfigure(kinds, config)`` is called (on a worker thread) when a directive changes the
    actor's role; it may raise, in which case the actor keeps its old kinds and says so.
    ``direct``: bind a direct socket for clients' direct calls of the tools it runs inline (``direct.py``;
    not with CURVE keys).
    """

    inline_log_context = False
    """Whether an inline handler runs with the work's ids bound to its log lines. Off: binding them costs
    about 18 µs (structlog's contextvars), more than an ``echo`` call's whole Python work, and an inline
    handler is constant-time and does not log. A handler that raises is still logged with the tool's name."""

    def __init__(self, broker_url: str | list[str], ident: ActorIdentity, kinds: list[str], capacity: int,
                 handlers: dict[tuple[str, str], Handler], *, heartbeat_s: float = 1.0, liveness: int = 3,
                 reconfigure: Reconfigurer | None = None, max_frame_bytes: int = 64 * 1024 * 1024,
                 drain_s: float = 10.0, curve: CurveClient | None = None, direct: bool = False) -> None:
        self.broker_urls = parse_endpoints(broker_url)  # one address, or a primary and standbys (BadAddress)
        self.broker_url = self.broker_urls[0]  # the one connected to (the core moves on a silence)
        self.curve = curve or CurveClient.from_env()  # CurveZMQ keys (LIBRA_CURVE_SECRET / LIBRA_BROKER_KEY)
        self.handlers = handlers
        self.ctx = zmq.Context()
        self.direct = DirectLeaseTable(frozenset(n for (k, n), h in handlers.items()
                                                 if k == "action" and getattr(h, "inline", False)))
        self.direct_sock: zmq.Socket | None = None
        if direct and self.curve is None and self.direct.tools:
            self.direct_sock = self._bind_direct(ident, max_frame_bytes)
        self.state = ActorState(ident, kinds, capacity, heartbeat_s=heartbeat_s, liveness=liveness,
                                addresses=len(self.broker_urls))
        self.reconfigure = reconfigure or (lambda kinds, config: None)
        self.max_frame_bytes = max_frame_bytes
        self.drain_s = drain_s
        self.sock: zmq.Socket | None = None
        self.endpoint = self.broker_url  # what the socket is connected to (an ipc path on the broker's host)
        self.poller = zmq.Poller()
        if self.direct_sock is not None:
            self.poller.register(self.direct_sock, zmq.POLLIN)
        self._no_cancel = threading.Event()  # direct calls run inline: nothing revokes them
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=max(1, capacity), thread_name_prefix="libra-work")
        self._cancel: dict[str, threading.Event] = {}
        self._outbuf: list[Any] = []
        self._stop = threading.Event()
        self._ready_sent = False
        self.log = log.bind(actor=ident.actor_id)

    def _bind_direct(self, ident: ActorIdentity, max_frame_bytes: int) -> zmq.Socket | None:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        labels = bind_direct(s, self.broker_url)
        if not labels:
            s.close(0)
            return None
        ident.labels.update(labels, direct_tools=sorted(self.direct.tools))
        return s

    # ------------------------------------------------------------------ commands
    def _execute(self, cmds: list[Any]) -> None:
        for c in cmds:
            t = type(c)
            if t is SendMsg:
                self._outbuf.append(c.msg)  # sent as one batch at the end of the loop pass
            elif t is StartWork:
                self._start(c.assign)
            elif t is CancelWork:
                ev = self._cancel.pop(c.work_id, None)
                if ev is not None:
                    ev.set()
            elif t is Connect:
                self._reconnect(c.address)
            elif t is Reconfigure:
                self._pool.submit(self._run_reconfigure, c)
            elif t is Note:  # logged; an unanswered hello also gets the likely causes, once (diagnose.py)
                log_note(self, c)

    def _flush(self) -> None:
        msgs, self._outbuf = self._outbuf, []
        if self.sock is None or not msgs:
            return
        for i in range(0, len(msgs), 256):
            try:
                send_frames(self.sock, encode_sendable(msgs[i : i + 256]), NOBLOCK)
            except zmq.Again:
                self.log.warning("send_dropped_hwm", count=len(msgs[i : i + 256]))

    def _reconnect(self, address: int = 0) -> None:
        self._outbuf.clear()  # queued for the old session: results among it are offered again in the hello
        if self.sock is not None:
            self.poller.unregister(self.sock)
            self.sock.close(0)
        self.broker_url = self.broker_urls[address % len(self.broker_urls)]  # the core picks the address
        self.sock, self.endpoint = connect_dealer(self.ctx, self.broker_url, identity_prefix=b"a-",
                                                  max_frame_bytes=self.max_frame_bytes, hwm=100_000, curve=self.curve)
        self.poller.register(self.sock, zmq.POLLIN)

    def _post(self, event: Any) -> None:
        self._events.put(event)
        os.write(self._wake_w, b"x")

    def _start(self, a: m.Assign) -> None:
        handler = self.handlers.get((a.kind, a.name)) or self.handlers.get((a.kind, "*"))
        if handler is None:
            self._post(WorkDone(a.work_id, a.lease, False, None, "unknown_tool",
                                f"actor {self.state.ident.actor_id} has no handler for {a.kind} {a.name!r}"))
            return
        cancelled = threading.Event()
        cores = a.route.get("cores") if isinstance(a.route, dict) else None
        ctx = WorkContext(a.work_id, a.trajectory, a.budget_s, cancelled, self.state.ident.actor_id,
                          cores if type(cores) is int and cores > 0 else 1,
                          a.route if isinstance(a.route, dict) else {})
        if getattr(handler, "inline", False):  # constant-time handler: no thread hand-off
            done = self._call(a.work_id, a.lease, a.name, a.args, a.trajectory, handler, ctx, self.inline_log_context)
            self._execute(self.state.handle(done, time.monotonic()))
            return
        self._cancel[a.work_id] = cancelled
        self._pool.submit(self._run_work, a, handler, ctx)

    def _run_work(self, a: m.Assign, handler: Handler, ctx: WorkContext) -> None:
        self._post(self._call(a.work_id, a.lease, a.name, a.args, a.trajectory, handler, ctx))

    def _call(self, work_id: str, lease: int, tool: str, args: Any, trajectory: str | None, handler: Handler,
              ctx: WorkContext, log_context: bool = True) -> WorkDone:
        """Run ``handler`` on ``args``: its outcome, a tool's own error code, or ``tool_failed`` for a bug (both
        paths: an assignment from the broker and a direct call)."""
        t0 = time.perf_counter()
        with bind_context(work_id=work_id, trajectory=trajectory) if log_context else nullcontext():
            try:
                out = handler(args, ctx)
                done = WorkDone(work_id, lease, True, out, duration_s=time.perf_counter() - t0)
            except ToolError as exc:
                done = WorkDone(work_id, lease, False, None, exc.code, exc.message, time.perf_counter() - t0)
            except Exception as exc:  # a tool bug must not kill the actor
                self.log.warning("tool_raised", tool=tool, work_id=work_id, error=repr(exc))
                done = WorkDone(work_id, lease, False, None, "tool_failed", f"{type(exc).__name__}: {exc}",
                                time.perf_counter() - t0)
        return done

    def _run_reconfigure(self, c: Reconfigure) -> None:
        try:
            cap = self.reconfigure(c.kinds, c.config)
            self._post(Reconfigured(c.directive_id, capacity=cap if type(cap) is int else None))
        except Exception as exc:
            self._post(Reconfigured(c.directive_id, False, f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def run(self) -> None:
        st = self.state
        mono = time.monotonic
        self._execute(st.handle(Start(), mono()))
        tick_s = max(0.01, min(0.1, st.heartbeat_s / 4))
        next_tick = mono() + tick_s
        stop_deadline: float | None = None
        try:
            while True:
                if self._stop.is_set() and stop_deadline is None:
                    stop_deadline = mono() + self.drain_s
                    sdnotify.stopping()
                    self.log.info("actor_draining_for_exit", running=len(st.running))
                if stop_deadline is not None and (not st.running or mono() >= stop_deadline):
                    self._execute(st.handle(Stop(), mono()))
                    self._flush()
                    break
                timeout = max(0, int((next_tick - mono()) * 1000))
                for sock, _ in self.poller.poll(timeout):
                    if sock is self._wake_r:
                        try:
                            os.read(self._wake_r, 65536)
                        except BlockingIOError:
                            pass
                        while True:
                            try:
                                ev = self._events.get_nowait()
                            except queue.Empty:
                                break
                            if type(ev) is WorkDone:
                                self._cancel.pop(ev.work_id, None)
                            self._execute(st.handle(ev, mono()))
                    elif sock is self.sock:
                        self._drain_socket()
                    elif sock is self.direct_sock:
                        self._drain_direct()
                now = mono()
                if now >= next_tick:
                    self._execute(st.handle(Tick(), now))
                    if st.phase.value != "connecting":
                        self._outbuf.extend(self.direct.reports())
                self._flush()
                if now >= next_tick:
                    tick_s = max(0.01, min(0.1, st.heartbeat_s / 4))
                    next_tick = now + tick_s
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self.sock is not None:
                self.sock.close(0)
            if self.direct_sock is not None:
                close_socket(self.direct_sock)  # and its ipc file
            self.ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self.log.info("actor_stopped")

    def _drain_socket(self) -> None:
        sock, st = self.sock, self.state
        assert sock is not None
        for frames in recv_ready(sock, 1000):
            try:
                decoded = decode_many(frames, self.max_frame_bytes)
            except ProtocolError as err:
                self.log.warning("bad_frame_from_broker", code=err.code.value, error=err.message)
                continue
            for d in decoded:
                t = type(d.msg)
                if t is m.LeaseGrant:
                    self._outbuf.append(self.direct.grant(d.msg))
                    continue
                if t is m.LeaseEnd:
                    self.direct.end(d.msg.lease_id)
                    continue
                if t is m.Welcome or t is m.Directive:  # a new broker session, a new role: no lease holds
                    self.direct.clear()
                if not self._ready_sent and t is m.Welcome:  # systemd Type=notify: first handshake
                    self._ready_sent = True
                    sdnotify.ready(f"connected to {self.broker_url}")
                self._execute(st.handle(Received(d.msg), time.monotonic()))
                if self.sock is not sock:  # reconnected while handling: stop reading the old socket
                    return


    def _drain_direct(self) -> None:
        """Answer what clients sent to the direct socket: each DirectCall on a lease held runs inline here."""
        sock = self.direct_sock
        assert sock is not None
        replies: dict[bytes, list[Any]] = {}
        for frames in recv_ready(sock, 1000):
            if len(frames) < 2:
                continue
            try:
                decoded = decode_many(frames[1:], self.max_frame_bytes)
            except ProtocolError as err:
                replies.setdefault(frames[0], []).append(m.Error(err.code.value, err.message))
                continue
            out = replies.setdefault(frames[0], [])
            for d in decoded:
                out.append(self._direct_call(d.msg) if type(d.msg) is m.DirectCall else m.Error(
                    ProtocolCode.UNEXPECTED.value, f"{type(d.msg).__name__} is not accepted on a direct socket"))
        for ident, msgs in replies.items():
            for i in range(0, len(msgs), 256):
                chunk = msgs[i : i + 256]
                try:
                    send_frames(sock, [ident, *encode_sendable(chunk)], NOBLOCK)
                except zmq.Again:
                    self.log.warning("direct_reply_dropped_hwm", count=len(chunk))

    def _direct_call(self, c: m.DirectCall) -> m.Reply:
        """Run one direct call on a lease this actor holds; its Reply is what the broker would have made of
        the same outcome (``dispatch.on_result``), with ``attempts`` 1."""
        aid = self.state.ident.actor_id
        why = self.direct.refusal(c)
        if why:
            return m.Reply(c.request_id, False, None, ErrorCode.LEASE_ENDED.value, why, c.lease_id, 0, aid)
        ctx = WorkContext(c.lease_id, None, c.timeout_s, self._no_cancel, aid)
        d = self._call(c.lease_id, 0, c.name, c.args, None, self.handlers[("action", c.name)], ctx,
                       self.inline_log_context)
        self.direct.count(c.lease_id, d.ok)
        if d.ok:
            return m.Reply(c.request_id, True, d.output, "", "", c.lease_id, 1, aid, d.duration_s)
        return m.Reply(c.request_id, False, None, ErrorCode.TOOL_FAILED.value, d.error, c.lease_id, 1, aid,
                       d.duration_s, tool_code=d.error_code or ErrorCode.TOOL_FAILED.value)


def _unsendable(msg: Any, exc: Exception) -> Any:
    """The typed failure sent in place of a result msgpack cannot carry (a tool returned a set, an object)."""
    why = f"the result cannot be sent ({exc}); return plain data"
    if type(msg) is m.WorkResult:
        return m.WorkResult(msg.work_id, msg.lease, False, None, "bad_result", why, msg.duration_s)
    if type(msg) is m.Reply:
        return m.Reply(msg.request_id, False, None, ErrorCode.TOOL_FAILED.value, why, msg.work_id, msg.attempts,
                       msg.actor_id, msg.duration_s, tool_code="bad_result")
    raise exc


def encode_sendable(msgs: list[Any]) -> list[bytes]:
    """``msgs`` as one Batch (``encode_many``); a result msgpack cannot carry goes as a typed failure instead
    of taking the actor's loop down with it (the broker's path and the direct one alike)."""
    try:
        return encode_many(msgs)
    except (TypeError, ValueError, OverflowError):
        enc = []
        for msg in msgs:
            try:
                enc.append(encode(msg))
            except (TypeError, ValueError, OverflowError) as exc:
                enc.append(encode(_unsendable(msg, exc)))
        return encode_batch(enc)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m libra.actors.runtime",
                                description="Run ONE Libra actor slot (normally started by python -m libra.actors).")
    p.add_argument("--broker", required=True,
                   help="broker endpoint, e.g. tcp://127.0.0.1:5555, or a comma-separated list (a primary and a "
                        "standby: the slot moves to the next when the one it uses is silent)")
    p.add_argument("--slot", required=True, help="slot name: cpuN or gpuN")
    p.add_argument("--actor-id", help="stable actor id (default HOST/SLOT)")
    p.add_argument("--instance", default=None,
                   help="id of the supervisor run that started this slot (default: a fresh one); the broker "
                        "refuses an actor id that a live session of another instance holds")
    p.add_argument("--capacity", type=int, default=4, help="concurrent work items (default %(default)s)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="initial heartbeat interval (the broker's wins)")
    p.add_argument("--no-sandbox", action="store_true", help="offer only the built-in echo/sleep tools")
    p.add_argument("--allow-unisolated", action="store_true",
                   help="run code tools without bubblewrap isolation (NOT safe for untrusted code)")
    p.add_argument("--tools", action="append", default=[], metavar="MODULE",
                   help="an action slot also offers the tools this module declares (LIBRA_TOOLS; repeatable)")
    p.add_argument("--role", default="action", choices=["action", "rollout", "train", "hybrid", "episode"],
                   help="what this slot runs: tool calls (action), generate turns (rollout), GRPO steps (train), "
                        "either of the last two as the broker directs (hybrid; starts as rollout), or RL jobs' "
                        "agent loops (episode)")
    p.add_argument("--model-dir", default=None, help="transformers checkpoint for the rollout/train roles")
    p.add_argument("--run-dir", default=None, help="job run directory (weights, batches, actor status files)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch CPU threads for engine roles (0: torch's default)")
    p.add_argument("--rollout-batch", type=int, default=32, help="max turns decoded together by a rollout slot")
    p.add_argument("--episode-concurrency", type=int, default=64,
                   help="episodes an episode slot runs at once (default %(default)s)")
    p.add_argument("--service-gpus", type=int, default=None,
                   help="GPUs a gpu action slot's model services use (default 1); without a GPU they run on CPU "
                        "and the slot says so (gpu_emulated)")
    p.add_argument("--no-direct", action="store_true",
                   help="bind no direct socket: clients' calls of inline tools (echo) always go through the broker")
    p.add_argument("--lend", default=None, metavar="SPEC",
                   help="the slot's GPU belongs to an owner (owner=NAME,kind=serving|notice|schedule,...; "
                        "libra.actors.owners): it serves rollouts while the owner allows and hands the GPU back "
                        "by the owner's deadline")
    p.add_argument("--log-level", default=None)
    return p


def _attach_reports(args: argparse.Namespace, handlers: dict, rt: ActorRuntime) -> bool:
    """The slot's readings sent to the broker; False (the reason printed) if the engine's cannot be attached."""
    if args.role in ("rollout", "hybrid"):  # the engine's KV reading after each batch: re-bid when the credit moves
        from .rollout_role import attach_kv_reports

        try:
            attach_kv_reports(handlers, rt._post, rt.state)
        except ValueError as exc:
            print(f"libra.actors.runtime: {exc}", file=sys.stderr)
            return False
    if args.slot.startswith("gpu"):  # NVML memory and utilisation of this slot's GPU, sent to the broker
        from .gpu_stats import GpuSampler
        from .state import GpuSampled

        GpuSampler(slot_gpu_index(args.slot), rt._post, GpuSampled).start()
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, cache=True)
    raise_open_files_limit("actor")  # a trainer's data plane serves every rollout slot: one descriptor each
    host = pysocket.gethostname()
    actor_id = args.actor_id or default_actor_id(args.slot)
    args.actor_id = actor_id  # the roles key their record file by it (libra.actors.slot_records)
    try:  # the slot's GPU (its supervisor already set it; a runtime started alone sets it by the same rule)
        os.environ.update(runtime_cuda_env(args.slot, os.environ))
    except ValueError as exc:  # a bad slot name, a GPU the parent may not see
        print(f"libra.actors.runtime: {exc}", file=sys.stderr)
        return 2
    labels = {"slot_kind": "gpu" if args.slot.startswith("gpu") else "cpu", "engine_role": args.role,
              "instance": args.instance or uuid.uuid4().hex[:12]}
    labels.update(engine_labels_from_env(args.slot, args.role))  # engine kind and max rollout TP, for the planner
    try:
        role = slot_role(args, labels)
    except SlotSetupError as exc:
        print(f"libra.actors.runtime: {exc}", file=sys.stderr)
        return 2
    kinds, caps, capacity, handlers, tools = role.kinds, role.caps, role.capacity, role.handlers, role.tools
    ident = ActorIdentity(actor_id, host, args.slot, os.getpid(), caps, labels)
    rt = ActorRuntime(args.broker, ident, kinds, capacity, handlers, heartbeat_s=args.heartbeat_s,
                      reconfigure=role.reconfigure,
                      direct=args.role == "action" and not args.no_direct)
    if not _attach_reports(args, handlers, rt):
        return 2
    if role.owner is not None:  # a lent slot: its owner's answers go to the core (lending.py)
        from .owner_watch import OwnerWatch

        OwnerWatch(role.owner, rt._post).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: rt.stop())
    log.info("actor_starting", actor=actor_id, broker=args.broker, role=args.role, tools=sorted(tools),
             capacity=capacity)
    rt.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
