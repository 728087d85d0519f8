"""An actor farm for ``bench control_plane``: many synthetic idle actors in one process, each its own DEALER
socket speaking the real protocol (``ActorHello``, ``Bid`` after ``Welcome``, a ``Heartbeat`` whenever it sent
nothing for ``heartbeat_s``), as ``libra.actors.state`` does for an idle actor. The parent drives it over a pipe:
``"count"`` (actors registered so far), ``"measure"`` (reset the counters), ``"report"`` (counters since then),
``"stop"`` (``Goodbye`` from every actor, then exit)."""

from __future__ import annotations

import os
import time
from typing import Any

import zmq

from libra.protocol import messages as m
from libra.protocol.codec import decode_many, encode
from libra.transport.fdlimit import raise_open_files_limit

TOOL = "cp_idle"  # a tool no one calls: the synthetic actors must never be given the bench's echo calls


class _Actor:
    __slots__ = ("sock", "index", "registered", "last_send", "last_recv")

    def __init__(self, sock: zmq.Socket, index: int) -> None:
        self.sock, self.index = sock, index
        self.registered = False
        self.last_send = self.last_recv = 0.0


def _hello(i: int, per_host: int) -> m.ActorHello:
    return m.ActorHello(f"synth-{i}", f"synth-host-{i // per_host}", f"s{i % per_host}", os.getpid(),
                        {"action": [TOOL]}, ["action"], 1)


class Farm:
    def __init__(self, url: str, first: int, count: int, heartbeat_s: float, per_host: int = 40) -> None:
        self.url, self.heartbeat_s, self.per_host = url, heartbeat_s, per_host
        raise_open_files_limit("bench.control_plane.farm")  # each actor's socket takes a few descriptors
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, count + 64)  # the default of 1,023 sockets per context is too few
        self.poller = zmq.Poller()
        self.actors: dict[zmq.Socket, _Actor] = {}
        self.last_scan = 0.0
        for i in range(first, first + count):
            self._connect(i)
        self.reset()

    def _connect(self, i: int) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.url)
        a = _Actor(s, i)
        self.actors[s] = a
        self.poller.register(s, zmq.POLLIN)
        self._send(a, _hello(i, self.per_host), time.monotonic())

    def reset(self) -> None:
        self.counters: dict[str, Any] = {"heartbeats_sent": 0, "broker_frames": 0, "broker_heartbeats": 0,
                                         "disconnects": 0, "unexpected": 0}
        self.gaps: list[float] = []  # seconds between consecutive broker frames on one actor's socket

    def _send(self, a: _Actor, msg: Any, now: float) -> None:
        a.sock.send_multipart(encode(msg), copy=False)
        a.last_send = now

    def _receive(self, a: _Actor, now: float) -> None:
        while True:
            try:
                frames = a.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if a.last_recv and a.registered:
                self.gaps.append(now - a.last_recv)
            a.last_recv = now
            self.counters["broker_frames"] += 1
            for d in decode_many(frames):
                self._on_message(a, d.msg, now)

    def _on_message(self, a: _Actor, msg: Any, now: float) -> None:
        t = type(msg)
        if t is m.Welcome:
            a.registered = True
            self._send(a, m.Bid(["action"], 1), now)
        elif t is m.Heartbeat:
            self.counters["broker_heartbeats"] += 1
        elif t is m.Disconnect:  # the broker dropped us while we were alive: count it, say hello again
            self.counters["disconnects"] += 1
            a.registered = False
            self._send(a, _hello(a.index, self.per_host), now)
        elif t is m.Assign:  # never expected (no one calls our tool): hand it back as an actor would
            self.counters["unexpected"] += 1
            self._send(a, m.Handback(msg.work_id, msg.lease, "synthetic idle actor"), now)
        else:
            self.counters["unexpected"] += 1

    def step(self, timeout_ms: int = 50) -> None:
        for s, _ in self.poller.poll(timeout_ms):
            self._receive(self.actors[s], time.monotonic())
        now = time.monotonic()
        if now - self.last_scan < 0.1:  # heartbeats are due at most every 0.1 s of lateness
            return
        self.last_scan = now
        due = now - self.heartbeat_s
        for a in self.actors.values():
            if a.registered and a.last_send <= due:
                self._send(a, m.Heartbeat(), now)
                self.counters["heartbeats_sent"] += 1

    def report(self) -> dict[str, Any]:
        return {**self.counters, "registered": sum(a.registered for a in self.actors.values()),
                "gaps": self.gaps}

    def stop(self) -> None:
        now = time.monotonic()
        for a in self.actors.values():
            if a.registered:
                self._send(a, m.Goodbye("bench done"), now)
        time.sleep(0.5)
        for s in self.actors:
            s.close(0)
        self.ctx.term()


def run_farm(url: str, first: int, count: int, heartbeat_s: float, conn: Any) -> None:
    """A farm process's body (``multiprocessing``): step until the parent says ``stop``."""
    farm = Farm(url, first, count, heartbeat_s)
    while True:
        farm.step()
        while conn.poll():
            cmd = conn.recv()
            if cmd == "count":
                conn.send(sum(a.registered for a in farm.actors.values()))
            elif cmd == "measure":
                farm.reset()
                conn.send(True)
            elif cmd == "report":
                conn.send(farm.report())
            elif cmd == "stop":
                farm.stop()
                conn.send(True)
                return
