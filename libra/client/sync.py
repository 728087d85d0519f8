"""The synchronous client: ``Client(broker_url).call_tool("echo", {...})``.

Thread-safe without a background thread (leader/follower): whichever waiting thread holds the socket
lock polls the socket and hands replies to the threads they belong to; a thread that cannot take
the lock parks on its own event. A single caller therefore pays no thread hand-off at all, and many
threads can share one client. Sends made while another thread leads go through an outbox that the
leader flushes (it is woken through a pipe).

If the broker says it does not know this client (it restarted), the client says hello again and
re-sends every unanswered request with its original request id, so nothing is run twice.

The client's state (pending table, deadlines, reconnect gate, direct leases) lives in the pure
:class:`~libra.client.core.ClientCore`, shared with the asyncio client; this shell owns the sockets, the
threads, the futures and the clock, feeds the core its events and carries out the actions it returns.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any

import zmq

from libra.protocol import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode_many, encode, encode_batch
from libra.protocol import messages as m
from libra.transport.security import CurveClient
from libra.transport.zmqio import recv_ready, send_frames

from .common import ToolResult, batches
from .core import (Action, Ask, Cancel, Connect, Deadline, Event, MoveBroker, Received, Resend, Resolve, SendBroker,
                   SendDirect, Submit, Tick, Welcomed)
from .errors import BrokerUnreachable
from .shell import ShellBase, WelcomeFlag, configure_socket


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
    """A caller's waiter: handed to the core with its call and back in ``Resolve`` with the call's value."""

    __slots__ = ("event", "value", "future", "rid", "at")

    def __init__(self, rid: str | None = None, at: float = 0.0) -> None:
        self.event = _Done()
        self.value: Any = None
        self.future: Future | None = None
        self.rid = rid
        self.at = at  # the call's deadline (its start + timeout)


class _WelcomeEvent(WelcomeFlag, threading.Event):
    """The connected flag callers wait on, kept equal to the core's ``welcomed``."""


class Client(ShellBase):
    """A connection to a Libra broker. ``connect_timeout=None`` skips waiting for the broker's welcome.
    ``direct=True``: calls of tools an actor runs inline go straight to that actor under a lease from the
    broker (``libra.client.direct``)."""

    def __init__(self, broker_url: str, *, client_id: str | None = None, connect_timeout: float | None = 5.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve: CurveClient | None = None,
                 direct: bool = False) -> None:
        self._open(zmq.Context, broker_url, client_id, max_frame_bytes, curve, direct, last_rx=time.monotonic())
        self._core_lock = threading.RLock()  # the core is driven by whichever thread holds this
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._lock = threading.Lock()  # the socket lock: its holder leads (polls, flushes, drains)
        self._outbox: deque[list[bytes]] = deque()  # encoded messages; flushed as batches
        self._welcomed = _WelcomeEvent(self._core)
        self._closed = False
        self._dsocks: dict[str, zmq.Socket] = {}  # actor direct endpoint -> socket (made by the leader)
        self._doutbox: deque[tuple[str, list[bytes]]] = deque()
        self._handle(Connect(), time.monotonic())
        self._kick()
        if connect_timeout is not None:
            try:
                self.wait_connected(connect_timeout)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ public API
    def wait_connected(self, timeout: float) -> None:
        """Block until the broker welcomed us; raise BrokerUnreachable after ``timeout`` seconds."""
        p = _Pending()
        deadline = time.monotonic() + timeout
        while not self._welcomed.is_set():
            if time.monotonic() >= deadline:
                raise BrokerUnreachable(self._unreachable(timeout))
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
        p = self._call(request_id, kind, name, args, trajectory, timeout)
        return self._result(p)

    def submit_tool(self, tool: str, args: Any = None, trajectory: str | None = None,
                    timeout: float = 60.0) -> "Future[ToolResult]":
        """Non-blocking call; the future resolves when some thread waits on this client (``gather``)."""
        p = self._call(None, "action", tool, args, trajectory, timeout)
        fut: Future = Future()
        p.future = fut
        fut.libra_started = p.at - timeout  # type: ignore[attr-defined]
        fut.libra_deadline = p.at  # type: ignore[attr-defined]
        fut.libra_pending = p  # type: ignore[attr-defined]
        if p.event.is_set():
            self._resolve_future(p)
        return fut

    def gather(self, futures: list["Future[ToolResult]"]) -> list[ToolResult | Exception]:
        """Drive the socket until every future from :meth:`submit_tool` is resolved."""
        out: list[ToolResult | Exception] = []
        for fut in futures:
            p: _Pending = fut.libra_pending  # type: ignore[attr-defined]
            self._wait(p)
            self._resolve_future(p)
            exc = fut.exception()
            out.append(exc if exc is not None else fut.result())
        return out

    def end_trajectory(self, trajectory: str, total_output_tokens: int = 0, ok: bool = True) -> None:
        """Tell the broker ``trajectory`` is finished (the rollout router learns from its length) or
        abandoned (``ok=False``). Fire and forget: there is no reply."""
        self._outbox.append(encode(m.EndTrajectory(trajectory, max(0, int(total_output_tokens)), ok)))
        self._kick()

    def status(self, timeout: float = 5.0) -> m.StatusReply:
        """A cluster snapshot (actors, queues, counters)."""
        rid = self._core.ids.next()
        p = _Pending(rid, time.monotonic() + timeout)
        self._handle(Ask(m.StatusRequest(rid), p), time.monotonic())
        self._kick()
        while not p.event.is_set():
            now = time.monotonic()
            if now >= p.at:
                self._handle(Cancel(rid), now)
                raise BrokerUnreachable(f"no status reply from {self.broker_url} within {timeout}s")
            self._lead_or_wait(p, p.at)
        if isinstance(p.value, Exception):
            raise p.value
        return p.value

    def direct(self, actor_id: str, kinds: list[str], mode: str = "finish", config: dict | None = None,
               timeout: float = 5.0) -> int:
        """Operator call: tell an actor to accept ``kinds``. Returns the directive id."""
        rid = self._core.ids.next()
        start = time.monotonic()
        p = _Pending(rid, start + timeout)
        self._handle(Ask(m.DirectRequest(rid, actor_id, list(kinds), mode, dict(config or {})), p, timeout, p.at),
                     start)
        self._kick()
        return int(self._result(p).output)

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

    # ------------------------------------------------------------------ driving the core
    def _handle(self, event: Event, now: float) -> None:
        """Feed ``event`` to the core and carry out its actions (sends are queued; the caller kicks)."""
        with self._core_lock:
            actions = self._core.handle(event, now)
            for a in actions:
                self._apply(a)

    def _apply(self, a: Action) -> None:
        t = type(a)
        if t is Resolve:
            self._complete(a.waiter, a.value)  # type: ignore[union-attr]
        elif t is SendBroker:
            self._outbox.append(a.frames)  # type: ignore[union-attr]
        elif t is SendDirect:
            self._doutbox.append((a.endpoint, a.frames))  # type: ignore[union-attr]
        elif t is Resend:
            self._outbox.extend(a.frames)  # type: ignore[union-attr]
        elif t is Welcomed:
            (self._welcomed.set if a.value else self._welcomed.clear)()  # type: ignore[union-attr]
        elif t is MoveBroker:  # the broker is silent: the next address (the leader holds the socket lock)
            self._outbox.clear()  # every queued request is pending: resent after the new broker's welcome
            old = self._reopen(a.url)  # type: ignore[union-attr]
            self._poller.unregister(old)
            old.close(0)
            self._poller.register(self._sock, zmq.POLLIN)
        # ArmTimer: no timer here; each waiting thread watches its own call's deadline (_wait)

    def _call(self, request_id: str | None, kind: str, name: str, args: Any, trajectory: str | None,
              timeout: float) -> _Pending:
        """Hand one call to the core (BadRequest / PayloadTooLarge here, in the caller's thread, before
        anything is sent) and send what it says."""
        rid = request_id or self._core.ids.next()
        start = time.monotonic()
        p = _Pending(rid, start + timeout)
        self._handle(Submit(rid, kind, name, args, trajectory, timeout, p.at, p, request_id is not None), start)
        self._kick()
        return p

    def _wait(self, p: _Pending) -> None:
        """Wait for ``p``'s value until its deadline, the caller's own (to within one poll tick, 50 ms): a
        broker that is gone, or answers late, does not stretch it; then the core fails the call."""
        while not p.event.is_set():
            now = time.monotonic()
            if now < p.at:
                self._lead_or_wait(p, p.at)
                continue
            self._handle(Deadline(), now)
            if not p.event.is_set():  # answered at this moment by the leader: its value is on its way
                p.event.wait(0.002)

    def _result(self, p: _Pending) -> Any:
        self._wait(p)
        if isinstance(p.value, Exception):
            raise p.value
        return p.value

    def _complete(self, p: _Pending, value: Any) -> None:
        """``p`` has its answer: wake its waiter, resolve its future."""
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

    # ------------------------------------------------------------------ sockets
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
                    now = time.monotonic()
                    remaining = deadline - now
                    if remaining <= 0:
                        break
                    self._handle(Tick(), now)  # a heartbeat while calls wait on a silent broker; idle leases
                    for sock, _ in self._poller.poll(min(50, max(1, int(remaining * 1000)))):
                        if sock == self._wake_r:
                            try:
                                os.read(self._wake_r, 65536)
                            except BlockingIOError:
                                pass
                        else:
                            self._drain(sock)
                    self._flush()
            finally:
                self._lock.release()
            if self._outbox:
                self._kick()
        else:
            target.wait(min(0.002, max(0.0, deadline - time.monotonic())))

    def _drain(self, sock: zmq.Socket) -> None:
        """Hand what the broker's socket (or an actor's direct one) has ready to the core."""
        direct = sock is not self._sock
        for frames in recv_ready(sock, 10_000):
            try:
                decoded = decode_many(frames, self.max_frame_bytes)
            except ProtocolError:
                continue  # a broker never sends garbage; a mismatched version is reported on timeout
            self._handle(Received([d.msg for d in decoded], direct), time.monotonic())
