"""The synchronous client: ``Client(broker_url).call_tool("echo", {...})``.

Thread-safe without a background thread (leader/follower): whichever waiting thread holds the socket
lock polls the socket and hands replies to the threads they belong to; a thread that cannot take
the lock parks on its own event. A single caller therefore pays no thread hand-off at all, and many
threads can share one client. Sends made while another thread leads go through an outbox that the
leader flushes (it is woken through a pipe).

If the broker says it does not know this client (it restarted), the client says hello again and
re-sends every unanswered request with its original request id, so nothing is run twice.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any

import zmq

from libra.transport.endpoints import parse_endpoint, resolve
from libra.protocol import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode_many, encode, encode_batch
from libra.protocol import messages as m
from libra.transport.zmqio import recv_ready, send_frames

from libra.transport.security import CurveClient

from .common import (
    served_timeout,
    ReconnectGate,
    RequestIds,
    ToolResult,
    batches,
    configure_socket,
    encode_checked,
    new_client_id,
    result_or_error,
    unreachable,
)
from .direct import LEASE_ENDED, DirectRoutes
from .errors import BrokerUnreachable, ProtocolRejected, ToolTimeout


class _Done:
    """A one-shot flag with ``threading.Event``'s ``is_set``/``set``/``wait``, whose Event (5.7 µs to build, a
    Condition and a lock) is made only when a follower thread actually waits: a single caller never does.
    ``set`` writes the flag before it reads the event and ``wait`` makes the event before it re-reads the flag,
    so one of them always sees the other."""

    __slots__ = ("flag", "_ev")

    def __init__(self) -> None:
        self.flag = False
        self._ev: threading.Event | None = None

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        self.flag = True
        ev = self._ev
        if ev is not None:
            ev.set()

    def wait(self, timeout: float) -> bool:
        if self.flag:
            return True
        ev = self._ev
        if ev is None:
            ev = self._ev = threading.Event()
        return True if self.flag else ev.wait(timeout)


class _Pending:
    __slots__ = ("event", "value", "msg", "future", "frames")

    def __init__(self, msg: Any, frames: list[bytes] | None = None) -> None:
        self.event = _Done()
        self.value: Any = None
        self.msg = msg
        self.future: Future | None = None
        self.frames = frames  # ``msg`` encoded once, when it was checked; sent (and resent) as is


class Client:
    """A connection to a Libra broker. ``connect_timeout=None`` skips waiting for the broker's welcome.
    ``direct=True``: calls of tools an actor runs inline go straight to that actor under a lease from the
    broker (``libra.client.direct``)."""

    def __init__(self, broker_url: str, *, client_id: str | None = None, connect_timeout: float | None = 5.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve: CurveClient | None = None,
                 direct: bool = False) -> None:
        self.broker_url = parse_endpoint(broker_url)  # BadAddress (a LibraError) before any socket
        self.client_id = client_id or new_client_id()
        self.max_frame_bytes = max_frame_bytes
        self._ids = RequestIds(self.client_id)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._curve = configure_socket(self._sock, max_frame_bytes, curve)
        self.endpoint = resolve(broker_url)  # the broker's ipc path when it is on this host (libra.transport.endpoints)
        self._sock.connect(self.endpoint)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._lock = threading.Lock()
        self._outbox: deque[list[bytes]] = deque()  # encoded messages; flushed as batches
        self._pending: dict[str, _Pending] = {}
        self._welcomed = threading.Event()
        self._last_rx = time.monotonic()
        self._last_ping = 0.0
        self._ping_s = 1.0  # while requests wait, ping the broker this often if it is silent
        self._gate = ReconnectGate(retry_s=2 * self._ping_s)
        self._limit = max_frame_bytes  # the smaller of ours and the broker's (from its welcome)
        self._closed = False
        self._direct = DirectRoutes() if direct and not self._curve else None
        self._dsocks: dict[str, zmq.Socket] = {}  # actor direct endpoint -> socket (made by the leader)
        self._doutbox: deque[tuple[str, list[bytes]]] = deque()
        self._next_idle_check = 0.0
        self._send(m.ClientHello(self.client_id, os.getpid()))
        if connect_timeout is not None:
            try:
                self.wait_connected(connect_timeout)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ public API
    def wait_connected(self, timeout: float) -> None:
        """Block until the broker welcomed us; raise BrokerUnreachable after ``timeout`` seconds."""
        p = _Pending(None)
        deadline = time.monotonic() + timeout
        while not self._welcomed.is_set():
            if time.monotonic() >= deadline:
                raise BrokerUnreachable(unreachable(self.broker_url, self._curve, timeout))
            self._lead_or_wait(p, deadline, until=self._welcomed)

    def call_tool(self, tool: str, args: Any = None, trajectory: str | None = None, timeout: float = 60.0,
                  *, request_id: str | None = None) -> ToolResult:
        """Run ``tool`` with ``args`` on some actor and return its result.

        Raises UnknownTool, ToolTimeout, ToolFailed, WorkLost, Busy, BrokerUnreachable (all LibraError).
        ``request_id`` makes the call idempotent across retries (default: a fresh id).
        """
        return self.request("action", tool, args, trajectory, timeout, request_id=request_id)

    def request(self, kind: str, name: str, args: Any = None, trajectory: str | None = None,
                timeout: float = 60.0, *, request_id: str | None = None) -> ToolResult:
        """Submit any kind of work (``action``, ``generate``, ...) and wait for its one reply."""
        rid = request_id or self._ids.next()
        p = self._submit_call(rid, kind, name, args, trajectory, timeout, request_id is not None)
        return self._result(p, rid, timeout)

    def submit_tool(self, tool: str, args: Any = None, trajectory: str | None = None,
                    timeout: float = 60.0) -> "Future[ToolResult]":
        """Non-blocking call; the future resolves when some thread waits on this client (``gather``)."""
        rid = self._ids.next()
        p = self._submit_call(rid, "action", tool, args, trajectory, timeout, False)
        fut: Future = Future()
        p.future = fut
        fut.libra_started = start = time.monotonic()  # type: ignore[attr-defined]
        fut.libra_deadline = start + timeout  # type: ignore[attr-defined]
        fut.libra_pending = p  # type: ignore[attr-defined]
        if p.event.is_set():
            self._resolve_future(p)
        return fut

    def gather(self, futures: list["Future[ToolResult]"]) -> list[ToolResult | Exception]:
        """Drive the socket until every future from :meth:`submit_tool` is resolved."""
        out: list[ToolResult | Exception] = []
        for fut in futures:
            p: _Pending = fut.libra_pending  # type: ignore[attr-defined]
            deadline: float = fut.libra_deadline  # type: ignore[attr-defined]
            while not p.event.is_set() and time.monotonic() < deadline:
                self._lead_or_wait(p, deadline)
            if not p.event.is_set():
                self._pending.pop(p.msg.request_id, None)
                if self._direct is not None:
                    self._direct.answered(p.msg.request_id)
                p.value = self._timeout_error(p.msg.request_id, p.msg.timeout_s,
                                              time.monotonic() - fut.libra_started)  # type: ignore[attr-defined]
                p.event.set()
            self._resolve_future(p)
            exc = fut.exception()
            out.append(exc if exc is not None else fut.result())
        return out

    def end_trajectory(self, trajectory: str, total_output_tokens: int = 0, ok: bool = True) -> None:
        """Tell the broker ``trajectory`` is finished (the rollout router learns from its length) or
        abandoned (``ok=False``). Fire and forget: there is no reply."""
        self._send(m.EndTrajectory(trajectory, max(0, int(total_output_tokens)), ok))

    def status(self, timeout: float = 5.0) -> m.StatusReply:
        """A cluster snapshot (actors, queues, counters)."""
        rid = self._ids.next()
        p = self._submit(m.StatusRequest(rid))
        deadline = time.monotonic() + timeout
        while not p.event.is_set():
            if time.monotonic() >= deadline:
                self._pending.pop(rid, None)
                raise BrokerUnreachable(f"no status reply from {self.broker_url} within {timeout}s")
            self._lead_or_wait(p, deadline)
        if isinstance(p.value, Exception):
            raise p.value
        return p.value

    def direct(self, actor_id: str, kinds: list[str], mode: str = "finish", config: dict | None = None,
               timeout: float = 5.0) -> int:
        """Operator call: tell an actor to accept ``kinds``. Returns the directive id."""
        rid = self._ids.next()
        p = self._submit(m.DirectRequest(rid, actor_id, list(kinds), mode, dict(config or {})))
        res = self._result(p, rid, timeout)
        return int(res.output)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._lock:
                self._sock.send_multipart(encode(m.Goodbye("client closing")), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._sock.close(0)
        for dsock in self._dsocks.values():
            dsock.close(0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _timeout_error(self, rid: str, timeout: float, elapsed: float) -> Exception:
        """The call's deadline passed: BrokerUnreachable if the broker never welcomed us, else ToolTimeout;
        either says how long the call really waited."""
        if not self._welcomed.is_set():
            return BrokerUnreachable(unreachable(self.broker_url, self._curve, round(elapsed, 2)))
        return ToolTimeout(f"request {rid} got no reply within {timeout:g}s (gave up after {elapsed:.2f}s)")

    def _submit_call(self, rid: str, kind: str, name: str, args: Any, trajectory: str | None, timeout: float,
                     explicit_id: bool) -> _Pending:
        """Send one call: straight to an actor when a direct lease covers it, else through the broker."""
        d = self._direct
        if d is not None:
            now = time.monotonic()
            lease, ask = d.route(kind, name, trajectory, explicit_id, now)
            if ask:
                lrid = self._ids.next()
                d.asked(lrid, name, now)
                self._send(m.LeaseRequest(lrid, "action", name))
            if lease is not None:
                call = m.DirectCall(rid, lease.lease_id, kind, name, args, served_timeout(timeout))
                p = _Pending(call, encode_checked(call, self._limit))
                d.sent(rid, lease)
                self._pending[rid] = p
                self._doutbox.append((lease.endpoint, p.frames))
                self._kick()
                return p
        return self._submit(m.Submit(rid, kind, name, args, trajectory, served_timeout(timeout)))

    def _submit(self, msg: Any) -> _Pending:
        # BadRequest / PayloadTooLarge here, in the caller's thread, before anything is sent.
        p = _Pending(msg, encode_checked(msg, self._limit))
        self._pending[msg.request_id] = p
        self._send_frames(p.frames)
        return p

    def _result(self, p: _Pending, rid: str, timeout: float) -> ToolResult:
        """Wait for ``p``'s reply until ``timeout`` seconds from now, the caller's deadline (to within one poll
        tick, 50 ms): a broker that is gone, or answers late, does not stretch it."""
        start = time.monotonic()
        deadline = start + timeout
        while not p.event.is_set():
            now = time.monotonic()
            if now >= deadline:
                self._pending.pop(rid, None)
                if self._direct is not None:
                    self._direct.answered(rid)
                raise self._timeout_error(rid, timeout, now - start)
            self._lead_or_wait(p, deadline)
        if isinstance(p.value, Exception):
            raise p.value
        return p.value

    def _complete(self, p: _Pending, value: Any) -> None:
        """``p`` has its answer (taken off ``_pending`` by the caller): wake its waiter, resolve its future."""
        p.value = value
        p.event.set()
        self._resolve_future(p)

    def _resolve_future(self, p: _Pending) -> None:
        """Resolve ``p``'s future from its value. Two threads may race here (the leader dispatching the reply
        and a ``gather`` that saw the event): the loser's ``InvalidStateError`` is ignored, since both set the
        same value. It used to escape from the leader's drain and drop the rest of the replies it had read."""
        fut = p.future
        if fut is None or fut.done():
            return
        try:
            if isinstance(p.value, Exception):
                fut.set_exception(p.value)
            else:
                fut.set_result(p.value)
        except InvalidStateError:
            pass

    def _send(self, msg: Any) -> None:
        self._send_frames(encode(msg))

    def _send_frames(self, frames: list[bytes]) -> None:
        self._outbox.append(frames)
        self._kick()

    def _kick(self) -> None:
        while self._outbox or self._doutbox:
            if self._lock.acquire(blocking=False):
                try:
                    self._flush()
                finally:
                    self._lock.release()
            else:
                try:
                    os.write(self._wake_w, b"x")  # the leader flushes
                except BlockingIOError:
                    pass
                return

    def _flush(self) -> None:
        if self._doutbox:
            self._flush_direct()
        out = self._outbox
        sock = self._sock
        while out:
            items = [(f, sum(map(len, f))) for f in (out.popleft() for _ in range(len(out)))]
            for batch in batches(items):
                send_frames(sock, encode_batch(batch))

    def _flush_direct(self) -> None:
        """Send queued direct calls, one batch per actor (the leader only: it makes and polls the sockets)."""
        dout = self._doutbox
        if len(dout) == 1:  # one caller, one call: no grouping
            endpoint, frames = dout.popleft()
            send_frames(self._dsocks.get(endpoint) or self._dsock(endpoint), frames)
            return
        by_endpoint: dict[str, list[tuple[list[bytes], int]]] = {}
        while dout:
            endpoint, frames = dout.popleft()
            by_endpoint.setdefault(endpoint, []).append((frames, sum(map(len, frames))))
        for endpoint, items in by_endpoint.items():
            sock = self._dsocks.get(endpoint) or self._dsock(endpoint)
            for batch in batches(items):
                send_frames(sock, encode_batch(batch))

    def _dsock(self, endpoint: str) -> zmq.Socket:
        sock = self._dsocks[endpoint] = self._ctx.socket(zmq.DEALER)
        configure_socket(sock, self.max_frame_bytes, None)
        sock.connect(endpoint)
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _lead_or_wait(self, p: _Pending, deadline: float, until: threading.Event | _Done | None = None) -> None:
        target = until or p.event
        if self._lock.acquire(blocking=False):
            try:
                self._flush()
                while not target.is_set():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    now = time.monotonic()
                    if self._pending and now - self._last_rx > self._ping_s and now - self._last_ping > self._ping_s:
                        # A restarted broker does not know us; our ping makes it say Disconnect, and we then
                        # say hello again and resend every unanswered request (same ids: never run twice).
                        self._last_ping = now
                        self._outbox.append(encode(m.Heartbeat()))
                        self._flush()
                    if self._direct is not None and now >= self._next_idle_check:
                        self._next_idle_check = now + 1.0
                        for lease_id in self._direct.idle(now):  # its actor's credit goes back to the broker
                            self._outbox.append(encode(m.LeaseEnd(lease_id, "idle")))
                    for sock, _ in self._poller.poll(min(50, max(1, int(remaining * 1000)))):
                        if sock is self._sock:
                            self._drain()
                        elif sock == self._wake_r:
                            try:
                                os.read(self._wake_r, 65536)
                            except BlockingIOError:
                                pass
                        else:
                            self._drain_direct(sock)
                    self._flush()
            finally:
                self._lock.release()
            if self._outbox:
                self._kick()
        else:
            target.wait(min(0.002, max(0.0, deadline - time.monotonic())))

    def _drain(self) -> None:
        for frames in recv_ready(self._sock, 10_000):
            try:
                decoded = decode_many(frames, self.max_frame_bytes)
            except ProtocolError:
                continue  # a broker never sends garbage; a mismatched version is reported on timeout
            self._last_rx = time.monotonic()
            for d in decoded:
                self._dispatch(d.msg)

    def _drain_direct(self, sock: zmq.Socket) -> None:
        d = self._direct
        assert d is not None
        for frames in recv_ready(sock, 10_000):
            try:
                decoded = decode_many(frames, self.max_frame_bytes)
            except ProtocolError:
                continue
            for x in decoded:
                msg = x.msg
                if type(msg) is not m.Reply:
                    continue
                if msg.error_code == LEASE_ENDED:  # refused before it ran: send it through the broker
                    d.refused(msg.request_id, time.monotonic())
                    self._via_broker(msg.request_id, 0)
                    continue
                rid = msg.request_id
                d.answered(rid)
                p = self._pending.get(rid)
                if p is not None and type(p.msg) is m.DirectCall:  # else sent via the broker since: it answers
                    del self._pending[rid]
                    self._complete(p, result_or_error(msg))

    def _via_broker(self, rid: str, prior_attempts: int) -> None:
        """Send unanswered direct call ``rid`` through the broker instead (same request id)."""
        p = self._pending.get(rid)
        if p is None or type(p.msg) is not m.DirectCall:
            return
        c = p.msg
        p.msg = m.Submit(rid, c.kind, c.name, c.args, None, c.timeout_s, prior_attempts)
        p.frames = encode(p.msg)
        self._outbox.append(p.frames)

    def _dispatch(self, msg: Any) -> None:
        t = type(msg)
        d = self._direct
        if t is m.Reply and d is not None and msg.request_id in d.asking:
            _, surplus = d.on_lease_reply(msg, time.monotonic())
            if surplus is not None:
                self._outbox.append(encode(m.LeaseEnd(surplus, "surplus")))
            return
        if t is m.Reply or t is m.StatusReply:
            p = self._pending.pop(msg.request_id, None)
            if p is not None:
                self._complete(p, result_or_error(msg) if t is m.Reply else msg)
        elif t is m.Welcome:
            self._limit = min(self.max_frame_bytes, msg.max_frame_bytes or self.max_frame_bytes)
            self._welcomed.set()
            if self._gate.on_welcome():  # a reconnect is complete: resend each unanswered request once
                for p in list(self._pending.values()):
                    if p.msg is not None and type(p.msg) is not m.DirectCall:  # direct: its actor answers
                        self._outbox.append(p.frames)
        elif t is m.LeaseEnd:
            if d is not None:  # a lost actor's unanswered calls go through the broker
                for rid in d.ended(msg.lease_id, msg.lost):
                    self._via_broker(rid, 1)
        elif t is m.Error:
            p = self._pending.pop(msg.request_id, None) if msg.request_id else None
            if p is not None:
                self._complete(p, ProtocolRejected(f"broker rejected request: {msg.message}"))
        elif t is m.Disconnect:
            # The broker does not know us (it restarted or expired us): one hello per reconnect; the
            # unanswered requests follow once, when the welcome comes (see ReconnectGate).
            if self._gate.on_disconnect(time.monotonic()):
                self._welcomed.clear()
                if d is not None:
                    d.reset()  # a new broker session knows none of our leases
                self._outbox.append(encode(m.ClientHello(self.client_id, os.getpid())))
