"""The asyncio twin of :class:`libra.client.Client`: ``await AsyncClient(url).call_tool(...)``.

One reader task per client hands replies to the core, which resolves their futures, so thousands of
concurrent calls from one event loop share one socket. Use ``async with AsyncClient(url) as c:`` or call
``await c.connect()``.

The hot path has no per-message event-loop work it can batch: requests made in one pass of the event loop
are queued and sent together, as one ``Batch`` frame, by a callback scheduled for the end of that pass
(no added latency: nothing else would run before it); the reader waits for the socket once and then
drains every frame that is ready without awaiting (a non-blocking shadow of the same socket).

The client's state (pending table, deadlines, reconnect gate, direct leases) lives in the pure
:class:`~libra.client.core.ClientCore`, shared with the threaded client; this shell owns the sockets, the
event loop's tasks and timers, the futures and the clock (``loop.time()``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from libra.protocol import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode_many, encode, encode_batch
from libra.protocol import messages as m
from libra.transport.security import CurveClient
from libra.transport.zmqio import recv_ready

from .common import ToolResult, batches
from .core import (Action, ArmTimer, Ask, Cancel, Connect, Deadline, Event, MoveBroker, Received, Resend, Resolve,
                   SendBroker, SendDirect, Submit, Tick, Welcomed)
from .errors import BrokerUnreachable
from .shell import ShellBase, WelcomeFlag, configure_socket


def _retrieve(fut: asyncio.Future) -> None:
    """A send future nobody awaits: fetch its outcome (a send on a closing socket fails quietly)."""
    if not fut.cancelled():
        fut.exception()


class _WelcomeEvent(WelcomeFlag, asyncio.Event):
    """The connected flag callers wait on, kept equal to the core's ``welcomed``."""


class AsyncClient(ShellBase):
    """``direct=True``: calls of tools an actor runs inline go straight to that actor under a lease from the
    broker (``libra.client.direct``)."""

    def __init__(self, broker_url: str, *, client_id: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve: CurveClient | None = None,
                 direct: bool = False) -> None:
        self._open(zmq.asyncio.Context, broker_url, client_id, max_frame_bytes, curve, direct)
        self._nb = zmq.Socket.shadow(self._sock.underlying)  # the same socket, for non-blocking sync calls
        self._outbox: list[list[bytes]] = []  # encoded requests waiting for the end of this loop pass
        self._flush_handle: asyncio.Handle | None = None
        self._keepalive_handle: asyncio.TimerHandle | None = None
        self._welcomed: _WelcomeEvent | None = None
        self._reader: asyncio.Task | None = None
        self._dsocks: dict[str, tuple[zmq.asyncio.Socket, asyncio.Task]] = {}  # endpoint -> socket, reader
        self._doutbox: dict[str, list[list[bytes]]] = {}
        self._deadline_handle: asyncio.TimerHandle | None = None

    async def connect(self, timeout: float = 5.0) -> "AsyncClient":
        """Say hello and wait for the broker's welcome; raise BrokerUnreachable after ``timeout``."""
        self._ensure_reader()
        assert self._welcomed is not None
        if not self._welcomed.is_set():
            loop = asyncio.get_running_loop()
            self._handle(Connect())
            start = loop.time()
            try:
                await asyncio.wait_for(self._welcomed.wait(), timeout)
            except asyncio.TimeoutError:
                waited = round(loop.time() - start, 2)
                raise BrokerUnreachable(self._unreachable(waited)) from None
        return self

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._welcomed = _WelcomeEvent(self._core)
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read_loop())
            self._keepalive_handle = loop.call_later(self._ping_s, self._keepalive_tick)

    async def call_tool(self, tool: str, args: Any = None, trajectory: str | None = None,
                        timeout: float = 60.0, *, request_id: str | None = None) -> ToolResult:
        """See :meth:`libra.client.Client.call_tool`."""
        return await self.request("action", tool, args, trajectory, timeout, request_id=request_id)

    async def request(self, kind: str, name: str, args: Any = None, trajectory: str | None = None,
                      timeout: float = 60.0, *, request_id: str | None = None) -> ToolResult:
        loop = asyncio.get_running_loop()
        start = loop.time()  # the call's deadline is start + timeout, connecting included
        if self._reader is None:
            await self.connect(min(5.0, timeout))  # an absent broker is reported as soon as ever, never later
        rid = request_id or self._core.ids.next()
        fut: asyncio.Future = loop.create_future()
        # no timer per call (a TimerHandle built and cancelled: ~6 µs): the core keeps the deadlines on one
        # heap and asks for one timer, armed for its earliest entry (_on_deadlines); the client-wide keepalive
        # tick (_keepalive_tick) pings a silent broker while calls wait
        self._handle(Submit(rid, kind, name, args, trajectory, timeout, start + timeout, fut, request_id is not None))
        try:  # as _outcome, inline: one coroutine a call fewer
            value = await fut
        except asyncio.CancelledError:
            self._handle(Cancel(rid))
            raise
        if isinstance(value, Exception):
            raise value
        return value

    async def _outcome(self, fut: asyncio.Future, rid: str, timeout: float | None = None) -> Any:
        """``fut``'s value (raised when it is an error); a cancelled or timed-out wait forgets the call."""
        try:
            value = await (fut if timeout is None else asyncio.wait_for(fut, timeout))
        except (asyncio.CancelledError, asyncio.TimeoutError):
            self._handle(Cancel(rid))
            raise
        if isinstance(value, Exception):
            raise value
        return value

    async def end_trajectory(self, trajectory: str, total_output_tokens: int = 0, ok: bool = True) -> None:
        """Tell the broker ``trajectory`` is finished (the rollout router learns from its length) or
        abandoned (``ok=False``). Fire and forget: there is no reply."""
        if self._reader is None:
            await self.connect()
        await self._sock.send_multipart(encode(m.EndTrajectory(trajectory, max(0, int(total_output_tokens)), ok)))

    async def status(self, timeout: float = 5.0) -> m.StatusReply:
        try:
            return await self._ask(m.StatusRequest(self._core.ids.next()), timeout)
        except asyncio.TimeoutError:
            raise BrokerUnreachable(f"no status reply from {self.broker_url} within {timeout}s") from None

    async def job_submit(self, name: str, spec: dict[str, Any], rows: list[Any], timeout: float = 30.0) -> Any:
        """Start RL job ``name`` inside the broker (``libra.broker.job_host``); returns the Reply's output.
        A bad spec raises the typed error the broker answered (``BadRequest``-style ``LibraError``)."""
        return (await self._ask_reply(m.JobSubmit(self._core.ids.next(), name, spec, rows), timeout)).output

    async def job_poll(self, name: str, cursor: int = 0, *, cancel: bool = False, timeout: float = 30.0,
                       limit: int = m.JOB_POLL_LIMIT) -> dict[str, Any]:
        """Job ``name``'s progress: state, error and at most ``limit`` step records from ``cursor`` on (``more``
        in the reply: page on from its ``next_cursor``; see ``JobPoll``). A bad ``limit`` raises the broker's
        ``bad_request`` as its typed error."""
        return (await self._ask_reply(m.JobPoll(self._core.ids.next(), name, cursor, cancel, limit), timeout)).output

    async def _ask_reply(self, msg: Any, timeout: float) -> ToolResult:
        try:
            return await self._ask(msg, timeout)
        except asyncio.TimeoutError:
            raise BrokerUnreachable(f"no reply from {self.broker_url} within {timeout}s") from None

    async def _ask(self, msg: Any, timeout: float) -> Any:
        """Send a request-style message and wait for its reply (resent after a reconnect like Submit)."""
        if self._reader is None:
            await self.connect()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._handle(Ask(msg, fut))
        return await self._outcome(fut, msg.request_id, timeout)

    # ------------------------------------------------------------------ driving the core
    def _handle(self, event: Event) -> list[list[bytes]] | None:
        """Feed ``event`` to the core at the loop's time and carry out its actions (replies and queued sends
        inline: the hot path). Returns the requests to resend after a reconnect (the reader sends them,
        paced), if any."""
        resend = None
        for a in self._core.handle(event, asyncio.get_running_loop().time()):
            t = type(a)
            if t is Resolve:
                fut = a.waiter  # type: ignore[union-attr]
                if not fut.done():
                    fut.set_result(a.value)  # type: ignore[union-attr]
            elif t is SendBroker and not a.urgent:  # type: ignore[union-attr]
                self._enqueue(a.frames)  # type: ignore[union-attr]
            elif t is Resend:
                resend = a.frames  # type: ignore[union-attr]
            else:
                self._apply(a)
        return resend

    def _apply(self, a: Action) -> None:
        t = type(a)
        if t is SendBroker:
            if not self._sock.closed:  # an urgent control message (hello, heartbeat, lease end): at once
                self._sock.send_multipart(a.frames).add_done_callback(_retrieve)  # type: ignore[union-attr]
        elif t is SendDirect:
            self._doutbox.setdefault(a.endpoint, []).append(a.frames)  # type: ignore[union-attr]
            self._schedule_flush()
        elif t is ArmTimer:
            if self._deadline_handle is not None:
                self._deadline_handle.cancel()
            at: float = a.at  # type: ignore[union-attr]
            self._deadline_handle = asyncio.get_running_loop().call_at(at, self._on_deadlines)
        elif t is Welcomed and self._welcomed is not None:
            (self._welcomed.set if a.value else self._welcomed.clear)()  # type: ignore[union-attr]
        elif t is MoveBroker:
            self._move(a.url)  # type: ignore[union-attr]

    def _move(self, url: str) -> None:
        """The broker is silent: a socket to the next address, and a reader for it (the core says hello)."""
        self._outbox.clear()  # every queued request is pending: resent after the new broker's welcome
        old, reader = self._reopen(url), self._reader
        self._nb = zmq.Socket.shadow(self._sock.underlying)
        if reader is not None:
            reader.cancel()
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        old.close(0)

    def _on_deadlines(self) -> None:
        """The core's timer: expire every call whose deadline passed; the core re-arms for the next."""
        self._deadline_handle = None
        self._handle(Deadline())

    def _keepalive_tick(self) -> None:
        """Every ``_ping_s``: one heartbeat while calls wait and the broker has been silent that long, however
        many calls wait: a restarted broker answers it with ``Disconnect``, and we then say hello and resend."""
        if self._sock.closed:
            return
        self._handle(Tick())
        self._keepalive_handle = asyncio.get_running_loop().call_later(self._ping_s, self._keepalive_tick)

    # ------------------------------------------------------------------ sockets
    def _enqueue(self, frames: list[bytes]) -> None:
        """Queue an encoded request; every request queued in this pass of the event loop goes out in one
        ``Batch`` frame when the pass ends (:meth:`_flush_out`)."""
        self._outbox.append(frames)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush_out)

    def _dsock(self, endpoint: str) -> zmq.asyncio.Socket:
        entry = self._dsocks.get(endpoint)
        if entry is None:
            s = self._ctx.socket(zmq.DEALER)
            configure_socket(s, self.max_frame_bytes, None)
            s.connect(endpoint)
            task = asyncio.get_running_loop().create_task(self._read_loop(s, zmq.Socket.shadow(s.underlying)))
            entry = self._dsocks[endpoint] = (s, task)
        return entry[0]

    def _flush_out(self) -> None:
        self._flush_handle = None
        if self._doutbox:
            dout, self._doutbox = self._doutbox, {}
            for endpoint, items in dout.items():
                sock = self._dsock(endpoint)
                for batch in batches([(f, sum(map(len, f))) for f in items]):
                    sock.send_multipart(encode_batch(batch)).add_done_callback(_retrieve)
        out, self._outbox = self._outbox, []
        if not out or self._sock.closed:
            return
        for batch in batches([(f, sum(map(len, f))) for f in out]):
            # through the asyncio socket (sent at once unless the pipe is full, then in order when it drains),
            # so that pyzmq re-checks the socket's edge-triggered events after the send
            self._sock.send_multipart(encode_batch(batch)).add_done_callback(_retrieve)

    async def _resend(self, frames: list[list[bytes]]) -> None:
        """Resend every unanswered request once (same request ids: the broker never runs one twice),
        ``RESEND_BATCH`` to a frame, yielding to the event loop between frames."""
        self._outbox.clear()  # every queued request is pending too: it is resent below, once
        for batch in batches([(f, sum(map(len, f))) for f in frames]):
            await self._sock.send_multipart(encode_batch(batch))
            await asyncio.sleep(0)

    async def _read_loop(self, sock: zmq.asyncio.Socket | None = None, nb: zmq.Socket | None = None) -> None:
        """Wait until the socket (the broker's, or an actor's direct one) is readable, then hand what is ready
        to the core without awaiting per frame."""
        if sock is None or nb is None:
            sock, nb = self._sock, self._nb
        direct = sock is not self._sock
        while True:
            try:
                await sock.poll(None, zmq.POLLIN)
            except (zmq.ContextTerminated, zmq.ZMQError, asyncio.CancelledError):
                return
            try:  # what is ready now, ending on EVENTS (edge-triggered: drained either way) rather than Again
                ready = list(recv_ready(nb, 10_000))
            except (zmq.ContextTerminated, zmq.ZMQError):
                return
            for frames in ready:
                try:
                    decoded = decode_many(frames, self.max_frame_bytes)
                except ProtocolError:
                    continue
                resend = self._handle(Received([d.msg for d in decoded], direct))
                if resend is not None:
                    await self._resend(resend)

    async def close(self) -> None:
        for name in ("_deadline_handle", "_keepalive_handle", "_flush_handle"):
            handle = getattr(self, name)
            if handle is not None:
                handle.cancel()
                setattr(self, name, None)
        tasks = [t for t in [self._reader, *(task for _, task in self._dsocks.values())] if t is not None]
        for task in tasks:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._reader = None
        for dsock, _ in self._dsocks.values():
            dsock.close(0)
        self._dsocks.clear()
        try:
            await self._sock.send_multipart(encode(m.Goodbye("client closing")), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
