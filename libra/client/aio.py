"""The asyncio twin of :class:`libra.client.Client`: ``await AsyncClient(url).call_tool(...)``.

One reader task per client dispatches replies to futures, so thousands of concurrent calls from one
event loop share one socket. Use ``async with AsyncClient(url) as c:`` or call ``await c.connect()``.

The hot path has no per-message event-loop work it can batch: requests made in one pass of the event loop
are queued and sent together, as one ``Batch`` frame, by a callback scheduled for the end of that pass
(no added latency: nothing else would run before it); the reader waits for the socket once and then
drains every frame that is ready without awaiting (a non-blocking shadow of the same socket).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
from typing import Any

import zmq
import zmq.asyncio

from libra.transport.endpoints import parse_endpoint, resolve
from libra.protocol import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode_many, encode, encode_batch
from libra.protocol import messages as m
from libra.transport.zmqio import recv_ready

from libra.transport.security import CurveClient

from .common import (
    served_timeout,
    ReconnectGate,
    RequestIds,
    batches,
    ToolResult,
    configure_socket,
    encode_checked,
    new_client_id,
    result_or_error,
    unreachable,
)
from .direct import LEASE_ENDED, DirectRoutes
from .errors import BrokerUnreachable, ProtocolRejected, ToolTimeout


def _retrieve(fut: asyncio.Future) -> None:
    """A send future nobody awaits: fetch its outcome (a send on a closing socket fails quietly)."""
    if not fut.cancelled():
        fut.exception()


class AsyncClient:
    """``direct=True``: calls of tools an actor runs inline go straight to that actor under a lease from the
    broker (``libra.client.direct``)."""

    def __init__(self, broker_url: str, *, client_id: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve: CurveClient | None = None,
                 direct: bool = False) -> None:
        self.broker_url = parse_endpoint(broker_url)  # BadAddress (a LibraError) before any socket
        self.client_id = client_id or new_client_id()
        self.max_frame_bytes = max_frame_bytes
        self._ids = RequestIds(self.client_id)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._curve = configure_socket(self._sock, max_frame_bytes, curve)
        self.endpoint = resolve(broker_url)  # the broker's ipc path when it is on this host (libra.transport.endpoints)
        self._sock.connect(self.endpoint)
        self._nb = zmq.Socket.shadow(self._sock.underlying)  # the same socket, for non-blocking sync calls
        self._outbox: list[list[bytes]] = []  # encoded requests waiting for the end of this loop pass
        self._flush_handle: asyncio.Handle | None = None
        self._keepalive_handle: asyncio.TimerHandle | None = None
        self._pending: dict[str, tuple[asyncio.Future, list[bytes]]] = {}  # id -> (future, its encoded request)
        self._welcomed: asyncio.Event | None = None
        self._reader: asyncio.Task | None = None
        self._last_rx = 0.0
        self._last_ping = 0.0
        self._ping_s = 1.0  # while requests wait, ping a silent broker this often (detects a restart)
        self._gate = ReconnectGate(retry_s=2 * self._ping_s)
        self._limit = max_frame_bytes  # the smaller of ours and the broker's (from its welcome)
        self._direct = DirectRoutes() if direct and not self._curve else None
        self._dcalls: dict[str, m.DirectCall] = {}  # direct calls not answered yet, to resend via the broker
        self._dsocks: dict[str, tuple[zmq.asyncio.Socket, asyncio.Task]] = {}  # endpoint -> socket, reader
        self._doutbox: dict[str, list[list[bytes]]] = {}
        self._deadlines: list[tuple[float, int, str, asyncio.Future, float]] = []  # heap: (at, seq, rid, fut, timeout)
        self._deadline_seq = itertools.count()
        self._deadline_handle: asyncio.TimerHandle | None = None
        self._deadline_at = 0.0

    async def connect(self, timeout: float = 5.0) -> "AsyncClient":
        """Say hello and wait for the broker's welcome; raise BrokerUnreachable after ``timeout``."""
        self._ensure_reader()
        assert self._welcomed is not None
        if not self._welcomed.is_set():
            await self._sock.send_multipart(encode(m.ClientHello(self.client_id, os.getpid())))
            start = asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(self._welcomed.wait(), timeout)
            except asyncio.TimeoutError:
                waited = round(asyncio.get_running_loop().time() - start, 2)
                raise BrokerUnreachable(unreachable(self.broker_url, self._curve, waited)) from None
        return self

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._welcomed = asyncio.Event()
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
        rid = request_id or self._ids.next()
        lease = None
        if self._direct is not None:
            lease, ask = self._direct.route(kind, name, trajectory, request_id is not None, loop.time())
            if ask:
                self._ask_lease(name)
        if lease is not None:
            call = m.DirectCall(rid, lease.lease_id, kind, name, args, served_timeout(timeout))
            frames = encode_checked(call, self._limit)
            self._direct.sent(rid, lease)  # type: ignore[union-attr]
            self._dcalls[rid] = call
            self._enqueue_direct(lease.endpoint, frames)
        else:
            frames = encode_checked(m.Submit(rid, kind, name, args, trajectory, served_timeout(timeout)), self._limit)
            self._enqueue(frames)
        fut: asyncio.Future = loop.create_future()
        self._pending[rid] = (fut, frames)
        # no timer per call (a TimerHandle built and cancelled: ~6 µs): the deadline goes on one heap, which
        # one timer, armed for its earliest entry, expires (_on_deadlines); the client-wide keepalive tick
        # (_keepalive_tick) pings a silent broker while calls wait
        self._add_deadline(loop, start + timeout, rid, fut, timeout)
        try:
            value = await fut
        except asyncio.CancelledError:
            self._pending.pop(rid, None)
            self._forget_direct(rid)
            raise
        if isinstance(value, Exception):
            raise value
        return value

    def _add_deadline(self, loop: asyncio.AbstractEventLoop, at: float, rid: str, fut: asyncio.Future,
                      timeout: float) -> None:
        heap = self._deadlines
        heapq.heappush(heap, (at, next(self._deadline_seq), rid, fut, timeout))
        if len(heap) > 2 * len(self._pending) + 1024:  # answered calls' entries: drop them (amortised O(1))
            heap[:] = [e for e in heap if not e[3].done()]
            heapq.heapify(heap)
        h = self._deadline_handle
        if h is None or at < self._deadline_at:
            if h is not None:
                h.cancel()
            self._deadline_at = at
            self._deadline_handle = loop.call_at(at, self._on_deadlines)

    def _on_deadlines(self) -> None:
        """Expire every call whose deadline passed (skipping answered ones), then re-arm for the next."""
        self._deadline_handle = None
        loop = asyncio.get_running_loop()
        now, heap = loop.time(), self._deadlines
        while heap and heap[0][0] <= now:
            at, _, rid, fut, timeout = heapq.heappop(heap)
            if not fut.done():
                self._expire(rid, fut, timeout, at)
        while heap and heap[0][3].done():
            heapq.heappop(heap)
        if heap:
            self._deadline_at = heap[0][0]
            self._deadline_handle = loop.call_at(self._deadline_at, self._on_deadlines)

    def _expire(self, rid: str, fut: asyncio.Future, timeout: float, at: float) -> None:
        """A call's deadline ``at`` (its start + ``timeout``: the caller's own, not stretched) passed without a
        reply: it fails with ToolTimeout (BrokerUnreachable if the broker never welcomed this client), saying
        how long it really waited."""
        self._pending.pop(rid, None)
        self._forget_direct(rid)
        if fut.done():
            return
        waited = asyncio.get_running_loop().time() - at + timeout
        if self._welcomed is None or not self._welcomed.is_set():
            fut.set_exception(BrokerUnreachable(unreachable(self.broker_url, self._curve, round(waited, 2))))
        else:
            fut.set_exception(ToolTimeout(f"request {rid} got no reply within {timeout:g}s (gave up after "
                                          f"{waited:.2f}s)"))

    # ------------------------------------------------------------------ direct calls (libra.client.direct)
    def _ask_lease(self, tool: str) -> None:
        assert self._direct is not None
        rid = self._ids.next()
        self._direct.asked(rid, tool, asyncio.get_running_loop().time())
        self._enqueue(encode(m.LeaseRequest(rid, "action", tool)))

    def _forget_direct(self, rid: str) -> None:
        if self._dcalls.pop(rid, None) is not None and self._direct is not None:
            self._direct.answered(rid)

    def _enqueue_direct(self, endpoint: str, frames: list[bytes]) -> None:
        q = self._doutbox.get(endpoint)
        if q is None:
            q = self._doutbox[endpoint] = []
        q.append(frames)
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

    def _via_broker(self, rid: str, prior_attempts: int) -> None:
        """Send unanswered direct call ``rid`` through the broker instead (same request id)."""
        call = self._dcalls.pop(rid, None)
        entry = self._pending.get(rid)
        if call is None or entry is None or entry[0].done():
            return
        frames = encode(m.Submit(rid, call.kind, call.name, call.args, None, call.timeout_s, prior_attempts))
        self._pending[rid] = (entry[0], frames)
        self._enqueue(frames)

    def _on_direct_reply(self, msg: m.Reply) -> bool:
        """A direct call's reply: resolve it (True), or send the call via the broker if it was refused."""
        assert self._direct is not None
        if msg.error_code == LEASE_ENDED:
            self._direct.refused(msg.request_id, asyncio.get_running_loop().time())
            self._via_broker(msg.request_id, 0)
            return False
        self._direct.answered(msg.request_id)
        # not a direct call any more (sent through the broker after its lease was lost): the broker's reply,
        # which counts both runs in ``attempts``, is the one that answers it
        return self._dcalls.pop(msg.request_id, None) is not None

    async def end_trajectory(self, trajectory: str, total_output_tokens: int = 0, ok: bool = True) -> None:
        """Tell the broker ``trajectory`` is finished (the rollout router learns from its length) or
        abandoned (``ok=False``). Fire and forget: there is no reply."""
        if self._reader is None:
            await self.connect()
        await self._sock.send_multipart(encode(m.EndTrajectory(trajectory, max(0, int(total_output_tokens)), ok)))

    def _on_lease_reply(self, msg: m.Reply) -> None:
        assert self._direct is not None
        _, surplus = self._direct.on_lease_reply(msg, asyncio.get_running_loop().time())
        if surplus is not None:
            self._sock.send_multipart(encode(m.LeaseEnd(surplus, "surplus"))).add_done_callback(_retrieve)

    async def status(self, timeout: float = 5.0) -> m.StatusReply:
        if self._reader is None:
            await self.connect()
        rid = self._ids.next()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        frames = encode(m.StatusRequest(rid))
        self._pending[rid] = (fut, frames)
        self._enqueue(frames)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(rid, None)
            raise BrokerUnreachable(f"no status reply from {self.broker_url} within {timeout}s") from None

    async def job_submit(self, name: str, spec: dict[str, Any], rows: list[Any], timeout: float = 30.0) -> Any:
        """Start RL job ``name`` inside the broker (``libra.broker.job_host``); returns the Reply's output.
        A bad spec raises the typed error the broker answered (``BadRequest``-style ``LibraError``)."""
        return (await self._ask(m.JobSubmit(self._ids.next(), name, spec, rows), timeout)).output

    async def job_poll(self, name: str, cursor: int = 0, *, cancel: bool = False, timeout: float = 30.0) -> dict[str, Any]:
        """Job ``name``'s progress: state, error and the step records from ``cursor`` on (see ``JobPoll``)."""
        return (await self._ask(m.JobPoll(self._ids.next(), name, cursor, cancel), timeout)).output

    async def _ask(self, msg: Any, timeout: float) -> ToolResult:
        """Send a request-style message and wait for its Reply (resent after a reconnect like Submit)."""
        if self._reader is None:
            await self.connect()
        frames = encode_checked(msg, self._limit)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[msg.request_id] = (fut, frames)
        self._enqueue(frames)
        try:
            value = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(msg.request_id, None)
            raise BrokerUnreachable(f"no reply from {self.broker_url} within {timeout}s") from None
        if isinstance(value, Exception):
            raise value
        return value

    def _enqueue(self, frames: list[bytes]) -> None:
        """Queue an encoded request; every request queued in this pass of the event loop goes out in one
        ``Batch`` frame when the pass ends (:meth:`_flush_out`)."""
        self._outbox.append(frames)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush_out)

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

    def _keepalive_tick(self) -> None:
        """Every ``_ping_s``: one heartbeat while calls wait and the broker has been silent that long, however
        many calls wait: a restarted broker answers it with ``Disconnect``, and we then say hello and resend."""
        if self._sock.closed:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._pending and now - self._last_rx > self._ping_s and now - self._last_ping > self._ping_s:
            self._last_ping = now
            self._sock.send_multipart(encode(m.Heartbeat())).add_done_callback(_retrieve)
        if self._direct is not None:
            for lease_id in self._direct.idle(now):
                self._sock.send_multipart(encode(m.LeaseEnd(lease_id, "idle"))).add_done_callback(_retrieve)
        self._keepalive_handle = loop.call_later(self._ping_s, self._keepalive_tick)

    async def _resend_pending(self) -> None:
        """Resend every unanswered request once (same request ids: the broker never runs one twice),
        ``RESEND_BATCH`` to a frame, yielding to the event loop between frames."""
        self._outbox.clear()  # every queued request is pending too: it is resent below, once
        waiting = [(frames, sum(map(len, frames))) for rid, (fut, frames) in list(self._pending.items())
                   if not fut.done() and rid not in self._dcalls]  # direct calls: their actors still answer
        for batch in batches(waiting):
            await self._sock.send_multipart(encode_batch(batch))
            await asyncio.sleep(0)

    async def _read_loop(self, sock: zmq.asyncio.Socket | None = None, nb: zmq.Socket | None = None) -> None:
        """Wait until the socket (the broker's, or an actor's direct one) is readable, then drain what is
        ready without awaiting per frame."""
        if sock is None or nb is None:
            sock, nb = self._sock, self._nb
        direct = sock is not self._sock
        loop = asyncio.get_running_loop()
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
                if not direct:
                    self._last_rx = loop.time()
                try:
                    decoded = decode_many(frames, self.max_frame_bytes)
                except ProtocolError:
                    continue
                for d in decoded:
                    t = type(d.msg)
                    if direct and (t is not m.Reply or not self._on_direct_reply(d.msg)):
                        continue
                    if t is m.Reply and self._direct is not None and d.msg.request_id in self._direct.asking:
                        self._on_lease_reply(d.msg)
                        continue
                    if t is m.Reply or t is m.StatusReply:  # the hot path, without an await
                        entry = self._pending.pop(d.msg.request_id, None)
                        if entry is not None and not entry[0].done():
                            entry[0].set_result(result_or_error(d.msg) if t is m.Reply else d.msg)
                    else:
                        await self._dispatch(d.msg)

    async def _dispatch(self, msg: Any) -> None:
        sock = self._sock
        t = type(msg)
        if t is m.Reply or t is m.StatusReply:
            entry = self._pending.pop(msg.request_id, None)
            if entry is not None and not entry[0].done():
                entry[0].set_result(result_or_error(msg) if t is m.Reply else msg)
        elif t is m.LeaseEnd:
            if self._direct is not None:  # a lost actor's unanswered calls go through the broker
                for rid in self._direct.ended(msg.lease_id, msg.lost):
                    self._via_broker(rid, 1)
        elif t is m.Welcome:
            assert self._welcomed is not None
            self._limit = min(self.max_frame_bytes, msg.max_frame_bytes or self.max_frame_bytes)
            self._welcomed.set()
            if self._gate.on_welcome():
                await self._resend_pending()
        elif t is m.Error and msg.request_id:
            entry = self._pending.pop(msg.request_id, None)
            if entry is not None and not entry[0].done():
                entry[0].set_result(ProtocolRejected(f"broker rejected request: {msg.message}"))
        elif t is m.Disconnect:
            # The broker does not know us (it restarted or expired us): one hello per reconnect; the
            # unanswered requests follow once, when the welcome comes.
            assert self._welcomed is not None
            if self._gate.on_disconnect(asyncio.get_running_loop().time()):
                self._welcomed.clear()
                if self._direct is not None:
                    self._direct.reset()  # a new broker session knows none of our leases
                await sock.send_multipart(encode(m.ClientHello(self.client_id, os.getpid())))

    async def close(self) -> None:
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            self._reader = None
        for dsock, task in self._dsocks.values():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
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
