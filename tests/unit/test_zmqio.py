"""``recv_ready`` drains what is ready, in order, without blocking and without losing a message."""

from __future__ import annotations

import zmq

from libra.transport.zmqio import recv_ready, send_frames


def _pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    a.bind("inproc://zmqio-test")
    b.setsockopt(zmq.IDENTITY, b"peer")
    b.connect("inproc://zmqio-test")
    return ctx, a, b


def test_recv_ready_drains_in_order_up_to_the_limit() -> None:
    ctx, a, b = _pair()
    try:
        assert list(recv_ready(a, 10)) == []  # nothing ready: returns at once
        for i in range(5):
            send_frames(b, [b"v", str(i).encode()])
        assert a.poll(1000)
        got = list(recv_ready(a, 3))
        assert got == [[b"peer", b"v", b"0"], [b"peer", b"v", b"1"], [b"peer", b"v", b"2"]]
        got = list(recv_ready(a, 10))
        assert [f[2] for f in got] == [b"3", b"4"]
        send_frames(b, [b"v", b"only"])
        assert a.poll(1000)
        assert list(recv_ready(a, 10)) == [[b"peer", b"v", b"only"]]  # one ready: one EVENTS check, no Again
        assert list(recv_ready(a, 10)) == []
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
