"""Every message kind the broker accepts, from a key of every role, over real CURVE sockets (#33): a broker
process whose allow directory holds an actor, a client, an operator, two job-scoped clients (jobs ``x`` and
``y``) and a key of the flat layout. Each (role, kind) gets its own connection and one message with plain
values (names ``"x"``); exactly the combinations outside the role table, and a job message naming a job the
key is not bound to, are answered ``forbidden``, and the broker's counters agree."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import zmq

from libra.client import Client
from libra.local import free_port
from libra.protocol import decode_many, encode
from libra.protocol import messages as m
from libra.transport.security import CurveClient, apply_client

from .role_keys import role_keys

pytestmark = pytest.mark.integration

TO_BROKER = [m.ActorHello, m.ClientHello, m.Heartbeat, m.Bid, m.Submit, m.WorkResult, m.Handback, m.DirectiveDone,
             m.StatusRequest, m.CancelRequest, m.Goodbye, m.DirectRequest, m.EndTrajectory, m.JobSubmit, m.JobPoll,
             m.LeaseRequest, m.LeaseReady, m.LeaseReport, m.LeaseEnd]
ACTOR = {"ActorHello", "Bid", "Heartbeat", "WorkResult", "Handback", "DirectiveDone", "Goodbye", "LeaseReady",
         "LeaseReport", "LeaseEnd"}
CLIENT = {"ClientHello", "Heartbeat", "Submit", "StatusRequest", "CancelRequest", "Goodbye", "EndTrajectory",
          "JobSubmit", "JobPoll", "LeaseRequest", "LeaseEnd"}
EVERYTHING = {c.__name__ for c in TO_BROKER}
# key name, its place in the allow directory, the kinds it may send
ROLES = {"host": ("actors", ACTOR), "author": ("clients", CLIENT), "ops": ("operators", CLIENT | {"DirectRequest"}),
         "tenant_x": ("clients/x", CLIENT), "tenant_y": ("clients/y", CLIENT - {"JobSubmit", "JobPoll"}),
         "old": ("", EVERYTHING)}
PLAIN = {str: "x", int: 1, float: 1.0, bool: False, bytes: b"x"}


def sample(cls: type) -> object:
    """``cls`` with a plain value in each required field (every name and job ``"x"``)."""
    hints = typing.get_type_hints(cls)
    need = [f for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING]
    return cls(**{f.name: PLAIN.get(typing.get_origin(hints[f.name]) or hints[f.name],
                                    {} if (typing.get_origin(hints[f.name]) or hints[f.name]) is dict else [])
                  for f in need})


def _forbidden(answer: object) -> bool:
    text = {m.Reply: lambda r: r.error_code, m.Disconnect: lambda d: d.reason.split(":")[0],
            m.Error: lambda e: e.code}.get(type(answer), lambda _: "")(answer)
    return text == "forbidden"


def test_every_kind_from_every_role_over_curve(tmp_path: Path) -> None:
    assert {c.__name__ for c in TO_BROKER} == ACTOR | CLIENT | {"DirectRequest"}
    keys, allowed, broker_kp = role_keys(tmp_path, tuple((n, place) for n, (place, _) in ROLES.items()))
    cc = {n: CurveClient.from_files(keys / f"{n}.key_secret", broker_kp.public_file) for n in ROLES}
    url = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "error",
                               "--curve-secret", str(broker_kp.secret_file), "--curve-allow", str(allowed)])
    ctx = zmq.Context()
    socks: dict[tuple[str, str], zmq.Socket] = {}
    try:
        with Client(url, curve=cc["ops"], connect_timeout=30) as ops:
            ops.status()
            for name in ROLES:
                for cls in TO_BROKER:
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    apply_client(s, cc[name])
                    s.connect(url)
                    s.send_multipart(encode(sample(cls)))
                    socks[(name, cls.__name__)] = s
            time.sleep(2.0)  # every refusal is answered at once; what passes may be answered or not
            refused = set()
            for (name, kind), s in socks.items():
                while s.poll(0):
                    if any(_forbidden(d.msg) for d in decode_many(s.recv_multipart())):
                        refused.add((name, kind))
            stats = ops.status().stats
    finally:
        ctx.destroy(0)
        broker.terminate()
        try:
            broker.wait(20)
        except subprocess.TimeoutExpired:
            broker.kill()
    expected = {(name, c.__name__) for name, (_, may) in ROLES.items() for c in TO_BROKER if c.__name__ not in may}
    assert refused == expected, (sorted(refused - expected), sorted(expected - refused))
    assert stats["role_refused"] + stats["job_refused"] == len(expected) and stats["job_refused"] == 2
