"""The hot path as it was before the hop-cost pass (commit 65820ea), kept only as the bench's baseline.

``python -m libra.bench broker --trace-hops`` and ``--loops`` run this loop and the current one in the same run,
interleaved, so their ratio is measured under the same load. The loop: ``sock.poll`` with the time to the
next tick as its timeout (a fresh poller per call), then up to ``max_recv_per_poll`` non-blocking receives,
each decoded and handled, one flush per pass.
"""

from __future__ import annotations

import contextlib
import time

import zmq

from libra.broker.events import BadFrame, PeerMessage, Tick
from libra.broker.server import BrokerServer
from libra.protocol import ProtocolError, decode_many
from libra.transport.zmqio import recv_frames


class LegacyBrokerServer(BrokerServer):
    """:class:`BrokerServer` with its old ``serve_forever`` (no journal, planner or metrics: bench use only)."""

    def serve_forever(self) -> None:
        sock, maxb = self.sock, self.config.max_frame_bytes
        mono = time.monotonic
        next_tick = mono() + self._tick_s
        try:
            while not self._stop.is_set():
                timeout_ms = max(0, int((next_tick - mono()) * 1000))
                if sock.poll(timeout_ms, zmq.POLLIN):
                    for _ in range(self._max_recv):
                        try:
                            frames = recv_frames(sock)
                        except zmq.Again:
                            break
                        now = mono()
                        peer = frames[0]
                        body = frames[1:]
                        if body and body[0] == b"":
                            body = body[1:]
                        try:
                            decoded = decode_many(body, maxb)
                        except ProtocolError as err:
                            self._note_bad(err, now)
                            self._handle(BadFrame(peer, err), now)
                            continue
                        for d in decoded:
                            self._handle(PeerMessage(peer, d.msg, d.buffers), now)
                    self._flush()
                now = mono()
                if now >= next_tick:
                    self._handle(Tick(), now)
                    self._flush()
                    next_tick = now + self._tick_s
        finally:
            self.sock.close(0)
            if self._own_ctx:
                self._ctx.term()


def drain_until_again(sock: zmq.Socket, limit: int):
    """The old drain: receive until ``zmq.Again`` (one exception per wake-up)."""
    for _ in range(limit):
        try:
            frames = recv_frames(sock)
        except zmq.Again:
            return
        yield frames


@contextlib.contextmanager
def legacy_hot_path():
    """Put this process (and the processes it forks inside the block) on the old hot path: the codec's
    field-by-field checks, drains that end on ``zmq.Again`` in the actor and the sync client, and inline
    handlers run with their log context bound. The broker's old loop is :class:`LegacyBrokerServer`."""
    import libra.actors.runtime as runtime
    import libra.client.sync as sync
    from libra.protocol.codec import _SPECS

    saved = {k: s.fast for k, s in _SPECS.items()}
    for s in _SPECS.values():
        object.__setattr__(s, "fast", _never)
    old_rt, old_cl, old_ctx = runtime.recv_ready, sync.recv_ready, runtime.ActorRuntime.inline_log_context
    runtime.recv_ready = sync.recv_ready = drain_until_again
    runtime.ActorRuntime.inline_log_context = True
    try:
        yield
    finally:
        for k, s in _SPECS.items():
            object.__setattr__(s, "fast", saved[k])
        runtime.recv_ready, sync.recv_ready = old_rt, old_cl
        runtime.ActorRuntime.inline_log_context = old_ctx


def _never(values: object) -> None:
    return None
