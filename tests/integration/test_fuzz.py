"""Protocol fuzzing against a live broker process: 100,000 generated frames.

Hypothesis generates 5,000 seed frames (100 examples × 50); each seed also yields 19 seeded mutants
(byte flips, truncation, kind-byte swaps, spliced and extra frames), for 100,000 frames in all.

Frames are a mix of garbage, near-valid frames (right header, wrong kind, wrong field types, truncated
msgpack, batches with bad items) and *valid* messages sent in the wrong state or with hostile values
(negative capacities, unknown work kinds, results for unknown work, directives from clients, stale
leases). Half come from a socket that said hello (it gets Error replies), half from strangers. The broker
must stay up, still serve a well-formed client afterwards, count no internal errors, and keep its
resident memory growth under 50 MB.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

import msgpack
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from libra.client import Client
from libra.local import free_port
from libra.protocol import encode
from libra.protocol import messages as m

pytestmark = pytest.mark.integration

KINDS = [c.KIND for c in m.MESSAGE_TYPES]
BATCH = 50
EXAMPLES = int(__import__("os").environ.get("LIBRA_FUZZ_BATCHES", "100"))  # × BATCH seed frames
MUTANTS = 19  # per seed frame
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=4)),
                      max_leaves=8)


@st.composite
def frames(draw) -> list[bytes]:
    choice = draw(st.integers(0, 6))
    if choice == 0:  # garbage
        return draw(st.lists(st.binary(max_size=40), min_size=1, max_size=5))
    if choice == 1:  # right header, any kind byte, any msgpack payload
        return [b"LIBRA1", bytes([draw(st.integers(0, 255))]), msgpack.packb(draw(values))]
    if choice == 2:  # known kind, field list of random values and length
        return [b"LIBRA1", bytes([draw(st.sampled_from(KINDS))]),
                msgpack.packb(draw(st.lists(values, max_size=10)))]
    if choice == 3:  # truncated valid payload (one frame: VERSION + kind + payload)
        f = encode(m.Submit("r", "action", "echo", draw(values)))
        cut = draw(st.integers(0, len(f[0])))
        return [f[0][:cut]]
    if choice == 4:  # batch with random items
        return [b"LIBRA1", bytes([m.Batch.KIND]), msgpack.packb(draw(st.lists(values, max_size=6)))]
    # valid messages with hostile contents, in any state
    msg = draw(st.one_of(
        st.builds(m.Bid, st.lists(st.text(max_size=8), max_size=3), st.integers(-10, 10)),
        st.builds(m.WorkResult, st.text(max_size=6), st.integers(-5, 5), st.booleans(), values),
        st.builds(m.Handback, st.text(max_size=6), st.integers(-5, 5)),
        st.builds(m.Submit, st.text(max_size=6), st.sampled_from(["action", "generate", "train", "x"]),
                  st.text(max_size=6), values, st.one_of(st.none(), st.text(max_size=6)),
                  st.floats(-1.0, 1e9)),
        st.builds(m.DirectRequest, st.text(max_size=6), st.text(max_size=6),
                  st.lists(st.sampled_from(["action", "train", "zzz"]), max_size=2),
                  st.sampled_from(["finish", "handback", "bogus"])),
        st.builds(m.EndTrajectory, st.text(max_size=6), st.integers(-5, 10**9), st.booleans()),
        st.builds(m.CancelRequest, st.text(max_size=6)),
        st.builds(m.DirectiveDone, st.integers(-3, 3), st.lists(st.text(max_size=4), max_size=2)),
        st.builds(m.Heartbeat), st.builds(m.StatusRequest, st.text(max_size=6)),
        st.builds(m.ActorHello, st.text(max_size=6), st.text(max_size=4), st.text(max_size=4),
                  st.integers(-1, 10), st.just({"action": ["echo"]}), st.just(["action"]),
                  st.integers(-3, 3)),
    ))
    try:
        return encode(msg)
    except (TypeError, ValueError, OverflowError):
        return [b"LIBRA1", b"\x03", msgpack.packb([])]


def mutants(frame: list[bytes], rng: random.Random, n: int) -> list[list[bytes]]:
    out = []
    for _ in range(n):
        f = [bytearray(x) for x in frame] or [bytearray()]
        op = rng.randrange(5)
        i = rng.randrange(len(f))
        if op == 0 and f[i]:
            f[i][rng.randrange(len(f[i]))] ^= 1 << rng.randrange(8)
        elif op == 1:
            f[i] = f[i][: rng.randrange(len(f[i]) + 1)]
        elif op == 2 and len(f) > 1:
            f[1] = bytearray([rng.randrange(256)])
        elif op == 3:
            f.insert(rng.randrange(len(f) + 1), bytearray(rng.randbytes(rng.randrange(16))))
        else:
            f = f[: rng.randrange(1, len(f) + 1)] + f
        out.append([bytes(x) for x in f])
    return out


def _drain(sock: zmq.Socket) -> None:
    while sock.poll(0):
        sock.recv_multipart()


def test_broker_survives_100k_fuzzed_frames(tmp_path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    log_file = open(tmp_path / "broker.log", "wb")
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "error"],
                              stderr=log_file)
    actors = subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                               "--gpu-slots", "0", "--no-sandbox", "--no-restart", "--log-level", "error"])
    ctx = zmq.Context()
    try:
        with Client(url, connect_timeout=30) as c:
            deadline = time.monotonic() + 30
            while not c.status().actors and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.call_tool("echo", 1).output == 1
        proc = psutil.Process(broker.pid)
        rss0 = proc.memory_info().rss
        known = ctx.socket(zmq.DEALER)
        known.setsockopt(zmq.LINGER, 0)
        known.connect(url)
        known.send_multipart(encode(m.ClientHello("fuzzer", 1)))
        strangers = []
        for _ in range(4):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(url)
            strangers.append(s)
        sent = 0
        rng = random.Random(1234)

        # generate only: a failure here is the broker's, reported by the assertions below, not shrunk
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(st.lists(frames(), min_size=BATCH, max_size=BATCH))
        def burst(batch: list[list[bytes]]) -> None:
            nonlocal sent
            for i, f in enumerate(batch):
                for j, g in enumerate([f, *mutants(f, rng, MUTANTS)]):
                    (known if (i + j) % 2 else strangers[(i + j) % 4]).send_multipart(g)
                    sent += 1
                for s in [known, *strangers]:
                    _drain(s)
            for s in [known, *strangers]:
                _drain(s)

        burst()
        assert sent >= 0.95 * EXAMPLES * BATCH * (1 + MUTANTS)  # hypothesis may discard a few oversized draws
        assert broker.poll() is None, "broker died"
        time.sleep(1.0)
        with Client(url, connect_timeout=10) as c:
            assert c.call_tool("echo", {"after": "fuzz"}).output == {"after": "fuzz"}
            stats = c.status().stats
        assert stats["bad_frames"] > 0.3 * sent  # most frames are invalid; valid-but-wrong ones are not counted
        growth = proc.memory_info().rss - rss0
        assert growth < 50 * 1024 * 1024, f"broker RSS grew by {growth / 1e6:.1f} MB"
        log = (tmp_path / "broker.log").read_text(errors="replace")
        assert "broker_core_error" not in log, log[-3000:]
    finally:
        ctx.destroy(0)
        log_file.close()
        for p in (actors, broker):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
