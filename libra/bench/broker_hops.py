"""``python -m libra.bench broker --trace-hops``: where one call's time goes, hop by hop.

A real broker (:class:`~libra.broker.server.BrokerServer`) and a real actor
(:class:`~libra.actors.runtime.ActorRuntime` with the ``echo`` handler) run in two forked processes; this
process is the client (:class:`~libra.client.Client`). Only here, each of the three sockets is replaced by a
shadow of itself that stamps ``time.perf_counter_ns()`` (CLOCK_MONOTONIC: one clock for all processes on the
host) at every frame it sends or receives; the broker's ``BrokerState.handle`` and the actor's handler are
wrapped to stamp when they return. Production code carries no stamps.

Each traced call has a unique tag as its request id and its echo argument, so every message of that call
(Submit, Assign, WorkResult, Reply) is found among the recorded frames by the tag's bytes. With one call in
flight, the stamps of call ``i`` give the segments below; their medians over ``n`` calls are printed, and the
same for a call the broker answers alone (an unknown tool: two hops, no actor).

No baseline loop: the hot path before the hop-cost pass was kept here as a near-copy of the broker's
server (``bench/broker_legacy.py``) and compared in the same run; that copy is gone (#29). The segments are
absolute figures of the current path, measured with the load printed beside them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import threading
import time
from typing import Any

import zmq

from libra.local import free_port

_ns = time.perf_counter_ns


class _TracedSocket(zmq.Socket):
    """A shadow of a real socket that records ``(t_ns, op, frame)`` for every frame sent or received."""

    log: list

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False, **kw: Any) -> Any:
        self.log.append((_ns(), "s", data))
        return super().send(data, flags, copy=copy, track=track, **kw)

    def recv(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        out = super().recv(flags, copy=copy, track=track)
        self.log.append((_ns(), "r", out))
        return out

    def poll(self, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        out = super().poll(timeout, flags)
        if out:
            self.log.append((_ns(), "w", b""))
        return out


def _traced(sock: zmq.Socket, log: list) -> _TracedSocket:
    t = _TracedSocket.shadow(sock.underlying)
    t.log = log
    return t


def _dump(path: str, log: list) -> None:
    with open(path, "wb") as f:
        pickle.dump([(t, op, bytes(x) if isinstance(x, (bytes, bytearray, memoryview)) else x) for t, op, x in log], f)


def _broker_proc(url: str, out: str, ready: Any, stop: Any) -> None:
    from libra.broker.server import BrokerServer

    log: list = []
    srv = BrokerServer(url, ipc=False)
    real = srv.sock  # kept referenced: a collected socket object closes the socket its shadow shares
    srv.sock = _traced(real, log)
    handle = srv.state.handle

    def traced_handle(event: Any, now: float) -> Any:
        cmds = handle(event, now)
        msg = getattr(event, "msg", None)
        tag = getattr(msg, "request_id", None) or getattr(msg, "output", None)
        log.append((_ns(), "h", tag if isinstance(tag, str) else ""))
        return cmds

    srv.state.handle = traced_handle  # type: ignore[method-assign]
    threading.Thread(target=lambda: (_wait_for(stop), srv.stop()), daemon=True).start()
    ready.set()
    srv.serve_forever()
    del real
    _dump(out, log)


def _wait_for(stop: Any) -> None:
    """Until ``stop`` is set, by polling: a process that died inside ``Event.wait`` would leave its sleeper
    counted, and the parent's ``stop.set()`` would then wait for it for ever (seen when the actor process
    crashed at start)."""
    while not stop.is_set():
        time.sleep(0.05)


def _actor_proc(url: str, out: str, stop: Any) -> None:
    from libra.actors.runtime import ActorRuntime
    from libra.actors.state import ActorIdentity
    from libra.actors.tools import echo

    log: list = []

    def traced_echo(args: Any, ctx: Any) -> Any:
        r = echo(args, ctx)
        log.append((_ns(), "d", args if isinstance(args, str) else ""))
        return r

    traced_echo.inline = True  # type: ignore[attr-defined]

    class TracedRuntime(ActorRuntime):
        def _reconnect(self, address: int = 0) -> None:
            super()._reconnect(address)
            assert self.sock is not None
            self.poller.unregister(self.sock)
            self._untraced = self.sock  # keeps the real socket object alive
            self.sock = _traced(self.sock, log)
            self.poller.register(self.sock, zmq.POLLIN)

    ident = ActorIdentity("hops/cpu0", "hops", "cpu0", os.getpid(), {"action": ["echo"]}, {"slot_kind": "cpu"})
    rt = TracedRuntime(url, ident, ["action"], 64, {("action", "echo"): traced_echo})
    threading.Thread(target=lambda: (_wait_for(stop), rt.stop()), daemon=True).start()
    rt.run()
    _dump(out, log)


def _find(log: list, tag: bytes, op: str, start: int = 0) -> tuple[int, int]:
    """Index and time of the first ``op`` record at or after ``start`` whose frame holds ``tag``."""
    for k in range(start, len(log)):
        t, o, x = log[k]
        if o == op and isinstance(x, bytes) and tag in x:
            return k, t
    raise LookupError(tag)


def _find_str(log: list, tag: str, op: str, start: int = 0) -> tuple[int, int]:
    for k in range(start, len(log)):
        t, o, x = log[k]
        if o == op and x == tag:
            return k, t
    raise LookupError(tag)


SEGMENTS = [
    ("client send -> broker recv (hop 1)", "c_send", "b_recv1"),
    ("broker recv -> core handled", "b_recv1", "b_h1"),
    ("core handled -> broker send", "b_h1", "b_send1"),
    ("broker send -> actor recv (hop 2)", "b_send1", "a_recv"),
    ("actor recv -> handler done", "a_recv", "a_done"),
    ("handler done -> actor send", "a_done", "a_send"),
    ("actor send -> broker recv (hop 3)", "a_send", "b_recv2"),
    ("broker recv -> core handled", "b_recv2", "b_h2"),
    ("core handled -> broker send", "b_h2", "b_send2"),
    ("broker send -> client recv (hop 4)", "b_send2", "c_recv"),
    ("client recv -> call returns", "c_recv", "c_ret"),
]
SEGMENTS_NO_ACTOR = [
    ("client send -> broker recv", "c_send", "b_recv1"),
    ("broker recv -> core handled", "b_recv1", "b_h1"),
    ("core handled -> broker send", "b_h1", "b_send1"),
    ("broker send -> client recv", "b_send1", "c_recv"),
    ("client recv -> call returns", "c_recv", "c_ret"),
]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def trace(n: int = 500, window: int = 100) -> dict:
    """Run ``n`` traced echo calls and ``n`` unknown-tool calls (per-segment medians in µs), then, with the
    client's socket untraced, ``n`` echo calls one at a time (p50) and ``3 n`` with ``window`` in flight
    (calls/s)."""
    with tempfile.TemporaryDirectory(prefix="libra-hops-") as tmp:  # the processes' stamps; removed afterwards
        return _trace_in(tmp, n, window)


def _trace_in(tmp: str, n: int, window: int) -> dict:
    from .broker_drive import pct

    url = f"tcp://127.0.0.1:{free_port()}"
    bout, aout = os.path.join(tmp, "broker.pkl"), os.path.join(tmp, "actor.pkl")
    ctx = mp.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    saved = os.environ.get("LIBRA_IPC")
    os.environ["LIBRA_IPC"] = "0"
    bp = ctx.Process(target=_broker_proc, args=(url, bout, ready, stop), daemon=True)
    bp.start()
    ready.wait(10)
    ap = ctx.Process(target=_actor_proc, args=(url, aout, stop), daemon=True)
    ap.start()
    clog: list = []
    try:
        calls, unknown, lat, per_s = _traced_calls(url, clog, n, window)
    finally:
        stop.set()
        bp.join(20)
        ap.join(20)
        if saved is None:
            os.environ.pop("LIBRA_IPC", None)
        else:
            os.environ["LIBRA_IPC"] = saved
    with open(bout, "rb") as f:
        blog = pickle.load(f)
    with open(aout, "rb") as f:
        alog = pickle.load(f)
    seg, total = _echo_segments(calls, clog, blog, alog)
    seg0, total0 = _no_actor_segments(unknown, clog, blog)
    return {
        "loop": "current",
        "calls": len(total),
        "echo_total_us": _median(total),
        "echo_segments_us": {k.split("|")[0] + f" [{i}]": _median(v) for i, (k, v) in enumerate(seg.items())},
        "no_actor_total_us": _median(total0),
        "no_actor_segments_us": {k.split("|")[0] + f" [{i}]": _median(v) for i, (k, v) in enumerate(seg0.items())},
        "p50_us": pct(lat, 0.5) * 1e6,
        "per_s": per_s,
        "load_1m": os.getloadavg()[0],
    }


def _traced_calls(url: str, clog: list, n: int, window: int) -> tuple[list, list, list, float]:
    """``n`` traced ``echo`` calls and ``n`` calls of an unknown tool through a client whose socket records every
    frame in ``clog``; then the untraced closed-loop drive. Returns (calls, unknown, latencies, calls/s)."""
    from libra.client import Client, UnknownTool

    from .broker_drive import drive

    calls: list[tuple[str, int, int]] = []
    unknown: list[tuple[str, int, int]] = []
    with Client(url, connect_timeout=30) as c:
        for i in range(300):  # warm up (and wait for the actor to bid)
            c.call_tool("echo", i)
        c._poller.unregister(c._sock)
        real = c._sock
        c._sock = _traced(real, clog)
        c._poller.register(c._sock, zmq.POLLIN)
        for i in range(n):
            tag = f"hop-{i:07d}"
            t0 = _ns()
            r = c.call_tool("echo", tag, request_id=tag)
            calls.append((tag, t0, _ns()))
            if r.output != tag:
                raise RuntimeError(f"echo returned {r.output!r}")
            tag = f"nop-{i:07d}"
            t0 = _ns()
            try:
                c.call_tool("no-such-tool", tag, request_id=tag)
                raise RuntimeError("an unknown tool was answered")
            except UnknownTool:
                unknown.append((tag, t0, _ns()))
        c._poller.unregister(c._sock)
        c._sock = real
        c._poller.register(real, zmq.POLLIN)
        lat, per_s = drive(c, n, window)
    return calls, unknown, lat, per_s


def _echo_segments(calls: list, clog: list, blog: list, alog: list) -> tuple[dict[str, list[float]], list[float]]:
    """Each traced echo call's stamps in the client, broker and actor logs, cut into SEGMENTS (µs)."""
    seg: dict[str, list[float]] = {}
    total: list[float] = []
    ci = bi = ai = 0
    for tag, t0, t1 in calls:
        b = tag.encode()
        st: dict[str, int] = {}
        ci, st["c_send"] = _find(clog, b, "s", ci)
        bi, st["b_recv1"] = _find(blog, b, "r", bi)
        bi, st["b_h1"] = _find_str(blog, tag, "h", bi)
        bi, st["b_send1"] = _find(blog, b, "s", bi)
        ai, st["a_recv"] = _find(alog, b, "r", ai)
        ai, st["a_done"] = _find_str(alog, tag, "d", ai)
        ai, st["a_send"] = _find(alog, b, "s", ai)
        bi, st["b_recv2"] = _find(blog, b, "r", bi + 1)
        bi, st["b_h2"] = _find_str(blog, tag, "h", bi)
        bi, st["b_send2"] = _find(blog, b, "s", bi)
        ci, st["c_recv"] = _find(clog, b, "r", ci + 1)
        st["c_ret"] = t1
        for name, a, z in SEGMENTS:
            seg.setdefault(f"{name}|{a}", []).append((st[z] - st[a]) / 1e3)
        total.append((t1 - t0) / 1e3)
    return seg, total


def _no_actor_segments(unknown: list, clog: list, blog: list) -> tuple[dict[str, list[float]], list[float]]:
    """The unknown-tool calls (answered by the broker alone), cut into SEGMENTS_NO_ACTOR (µs)."""
    seg0: dict[str, list[float]] = {}
    total0: list[float] = []
    for tag, t0, t1 in unknown:
        b = tag.encode()
        st: dict[str, int] = {}
        try:
            k, st["c_send"] = _find(clog, b, "s")
            _, st["b_recv1"] = _find(blog, b, "r")
            k2, st["b_h1"] = _find_str(blog, tag, "h")
            _, st["b_send1"] = _find(blog, b, "s", k2)
            _, st["c_recv"] = _find(clog, b, "r", k + 1)
        except LookupError:
            continue
        st["c_ret"] = t1
        for name, a, z in SEGMENTS_NO_ACTOR:
            seg0.setdefault(f"{name}|{a}", []).append((st[z] - st[a]) / 1e3)
        total0.append((t1 - t0) / 1e3)
    return seg0, total0


def compare(n: int = 300, rounds: int = 3, window: int = 100) -> list[dict]:
    """The current hot path, ``rounds`` runs; each figure is the median of the rounds' figures (one row)."""
    runs: dict[str, list[dict]] = {"current": [trace(n, window) for _ in range(rounds)]}
    out = []
    for loop, rs in runs.items():
        row: dict = {"loop": loop, "rounds": len(rs)}
        for key in ("echo_total_us", "no_actor_total_us", "p50_us", "per_s", "load_1m"):
            row[key] = _median([r[key] for r in rs])
        for key in ("echo_segments_us", "no_actor_segments_us"):
            row[key] = {k: _median([r[key][k] for r in rs]) for k in rs[0][key]}
        out.append(row)
    return out


def print_trace(rows: list[dict]) -> None:
    print(f"per-segment medians (µs), one call in flight, every peer on loopback TCP; load (1 min) "
          f"{os.getloadavg()[0]:.2f}")
    keys = list(rows[0]["echo_segments_us"])
    head = "".join(f"{r['loop']:>10}" for r in rows)
    print(f"{'echo call via broker + actor':<46}{head}")
    for k in keys:
        print(f"  {k.rsplit(' [', 1)[0]:<44}" + "".join(f"{r['echo_segments_us'].get(k, float('nan')):>10.1f}" for r in rows))
    print(f"  {'whole call (median)':<44}" + "".join(f"{r['echo_total_us']:>10.1f}" for r in rows))
    print(f"{'unknown tool, answered by the broker':<46}{head}")
    for k in rows[0]["no_actor_segments_us"]:
        print(f"  {k.rsplit(' [', 1)[0]:<44}" + "".join(f"{r['no_actor_segments_us'].get(k, float('nan')):>10.1f}" for r in rows))
    print(f"  {'whole call (median)':<44}" + "".join(f"{r['no_actor_total_us']:>10.1f}" for r in rows))
    print(f"{'untraced echo calls':<46}{head}")
    print(f"  {'p50 µs, one in flight':<44}" + "".join(f"{r['p50_us']:>10.1f}" for r in rows))
    print(f"  {'calls/s, 100 in flight (sync window)':<44}" + "".join(f"{r['per_s']:>10.0f}" for r in rows))
    print(f"medians of {rows[0]['rounds']} rounds")
