"""Key roles with CURVE on loopback (#33): a broker whose allow directory is split into actors/, clients/ and
operators/ refuses, with a typed error that names the role, logged and counted:
- the impostor: a client's key saying hello as an actor (and bidding) never gets work;
- a client key sending a directive (``Client.direct``: ``Forbidden``);
- an actor key submitting work;
while an operator key's directive, the real actor and the real client's call go through. A key removed from
the allow directory while its session is open: the broker (re-reading it every heartbeat interval) disconnects
the peer and refuses what the open connection sends next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from libra.client import Client, Forbidden
from libra.local import free_port
from libra.protocol import decode_many, encode
from libra.protocol import messages as m
from libra.transport.security import CurveClient, apply_client

from .role_keys import role_keys

pytestmark = pytest.mark.integration


def _raw(ctx: zmq.Context, url: str, curve: CurveClient) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    apply_client(s, curve)
    s.connect(url)
    return s


def _answers(s: zmq.Socket, wait_s: float) -> list:
    out, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if s.poll(50):
            out += [d.msg for d in decode_many(s.recv_multipart())]
        elif out:
            break
    return out


def test_each_role_may_send_only_its_own_messages(tmp_path: Path) -> None:
    keys, allowed, broker_kp = role_keys(tmp_path, (("host1", "actors"), ("envauthor", "clients"), ("ops", "operators")))
    cc = {n: CurveClient.from_files(keys / f"{n}.key_secret", broker_kp.public_file) for n in ("host1", "envauthor", "ops")}
    url = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "broker.log"
    with log_path.open("w") as log:
        broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "info",
                                   "--curve-secret", str(broker_kp.secret_file), "--curve-allow", str(allowed)],
                                  stdout=log, stderr=subprocess.STDOUT)
    env = {**os.environ, "LIBRA_CURVE_SECRET": str(keys / "host1.key_secret"),
           "LIBRA_BROKER_KEY": str(broker_kp.public_file)}
    actors = subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                               "--gpu-slots", "0", "--no-sandbox", "--no-restart", "--log-level", "warning"], env=env)
    ctx = zmq.Context()
    try:
        with Client(url, curve=cc["envauthor"], connect_timeout=30) as client:
            deadline = time.monotonic() + 60
            while not client.status().actors and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.call_tool("echo", {"warm": 1}).output == {"warm": 1}  # the actor key serves

            # the impostor: the environment author's key says hello as an actor and bids for action work
            evil = _raw(ctx, url, cc["envauthor"])
            evil.send_multipart(encode(m.ActorHello("evil/cpu0", "evil", "cpu0", 1, {"action": ["echo"]}, ["action"], 64)))
            evil.send_multipart(encode(m.Bid(["action"], 64)))
            got = _answers(evil, 10)
            assert got and all(isinstance(x, m.Disconnect) and x.reason.startswith("forbidden")
                               and "'client'" in x.reason for x in got), got
            out = client.call_tool("echo", {"secret": "user data"})
            assert out.output == {"secret": "user data"} and out.actor_id != "evil/cpu0"
            assert not [x for x in _answers(evil, 0.5) if isinstance(x, m.Assign)]  # it never saw the call

            with pytest.raises(Forbidden, match="'client'"):  # a client key moving a slot to another role
                client.direct(client.status().actors[0]["id"], ["action"])

            # an actor key submitting work: a failed Reply, typed
            host = _raw(ctx, url, cc["host1"])
            host.send_multipart(encode(m.Submit("r-evil", "action", "echo", {"x": 1})))
            (reply,) = [x for x in _answers(host, 10) if isinstance(x, m.Reply)]
            assert (reply.request_id, reply.ok, reply.error_code) == ("r-evil", False, "forbidden")
            assert "'actor'" in reply.error

        with Client(url, curve=cc["ops"], connect_timeout=30) as ops:  # an operator key may send directives
            st = ops.status()
            assert ops.direct(st.actors[0]["id"], ["action"]) >= 1
            assert ops.status().stats["role_refused"] == 4  # ActorHello, Bid, DirectRequest, Submit

            # key rotation: the environment author's key is removed while one of its sessions is open
            author = _raw(ctx, url, cc["envauthor"])
            author.send_multipart(encode(m.ClientHello("author-1", os.getpid())))
            assert [x for x in _answers(author, 10) if isinstance(x, m.Welcome)]
            (allowed / "clients" / "envauthor.key").unlink()
            t0 = time.monotonic()
            (bye,) = [x for x in _answers(author, 10) if isinstance(x, m.Disconnect)]
            took = time.monotonic() - t0  # the broker re-reads the directory every heartbeat interval (1 s)
            assert bye.reason == "forbidden: its key was removed from the allow directory", bye
            author.send_multipart(encode(m.StatusRequest("s-after")))  # the open connection is refused from now on
            (after,) = [x for x in _answers(author, 10) if isinstance(x, m.Reply)]
            assert (after.ok, after.error_code) == (False, "forbidden") and "'revoked'" in after.error
            stats = ops.status().stats
            assert stats["keys_revoked"] == 1 and stats["role_refused"] == 5
            print(f"key removal to Disconnect: {took:.2f} s")
    finally:
        ctx.destroy(0)
        for p in (actors, broker):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
    refused = [(x["role"], x["message"]) for x in lines if x["event"] == "role_refused"]
    assert refused == [("client", "ActorHello"), ("client", "Bid"), ("client", "DirectRequest"),
                       ("actor", "Submit"), ("revoked", "StatusRequest")], refused
    assert [x["why"] for x in lines if x["event"] == "keys_revoked"] == ["its key was removed from the allow directory"]
