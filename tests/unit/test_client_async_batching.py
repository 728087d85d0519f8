"""AsyncClient: the requests made in one event-loop pass leave as one Batch frame, and every reply of a
batch answers its own call (against a real ROUTER socket that plays the broker)."""

from __future__ import annotations

import asyncio
import threading

import zmq

from libra.client.aio import AsyncClient
from libra.protocol import decode_many, encode, encode_many
from libra.protocol import messages as m


def _fake_broker(sock: zmq.Socket, frames_seen: list[int], stop: threading.Event) -> None:
    """Welcome each hello; answer each Submit with its args; count the frames that carried Submits."""
    while not stop.is_set():
        if not sock.poll(50):
            continue
        peer, *body = sock.recv_multipart()
        msgs = [d.msg for d in decode_many(body, 1 << 20)]
        replies = []
        for msg in msgs:
            if type(msg) is m.ClientHello:
                sock.send_multipart([peer, *encode(m.Welcome("s", "b", 1.0, 3, 1 << 20))])
            elif type(msg) is m.Submit:
                replies.append(m.Reply(msg.request_id, True, msg.args, work_id=msg.request_id, attempts=1))
        if replies:
            frames_seen.append(len(replies))
            sock.send_multipart([peer, *encode_many(replies)])


def test_one_pass_of_calls_goes_out_as_one_batch_and_each_gets_its_reply(monkeypatch) -> None:
    monkeypatch.setenv("LIBRA_IPC", "0")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    frames_seen: list[int] = []
    stop = threading.Event()
    t = threading.Thread(target=_fake_broker, args=(sock, frames_seen, stop), daemon=True)
    t.start()

    async def go() -> list:
        async with AsyncClient(f"tcp://127.0.0.1:{port}") as c:
            first = await asyncio.gather(*(c.call_tool("echo", i, timeout=10) for i in range(50)))
            second = await asyncio.gather(*(c.call_tool("echo", {"j": j}, timeout=10) for j in range(7)))
            return first + second

    try:
        results = asyncio.run(go())
    finally:
        stop.set()
        t.join(5)
        sock.close(0)
        ctx.term()
    assert [r.output for r in results] == list(range(50)) + [{"j": j} for j in range(7)]
    assert frames_seen == [50, 7]  # one frame per event-loop pass of calls, not one per call
