"""Several hosts on one machine: the broker and an actor host in separate network namespaces joined by a
veth pair (made by this test), CURVE on. The actor host is cut off (link down) and restored while a client
on the broker host keeps calling: the broker expires the actor, queued calls wait, the actor reconnects by
itself, and every call completes exactly once (issue #7). Also two trainer ranks, one per host, that
rendezvous at rank 0's routable address and train one step (issue #18). Needs root and iproute2; skipped
otherwise (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from libra.transport.keys import create_keypair

from .netns import sh as _sh
from .netns import netns_hosts

pytestmark = pytest.mark.integration

CLIENT = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from libra.client import Client
url, n = sys.argv[1], int(sys.argv[2])
with Client(url, connect_timeout=30) as c:
    deadline = time.monotonic() + 60
    while not c.status().actors and time.monotonic() < deadline:
        time.sleep(0.2)
    print("READY", flush=True)
    def one(i):
        return c.call_tool("sleep", {"seconds": 0.1}, timeout=120).output == {"slept": 0.1}
    with ThreadPoolExecutor(4) as pool:
        ok = list(pool.map(one, range(n)))
    print(json.dumps({"ok": sum(ok), "n": n, "stats": c.status().stats}), flush=True)
"""


@pytest.fixture
def hosts():
    """Two hosts (``netns.netns_hosts``): the broker's at 10.231.7.1 and the actor host at 10.231.7.2."""
    with netns_hosts(2, "10.231.7") as (b, a):
        yield b.ns, a.ns, a.dev


def test_actor_host_cut_off_and_restored_with_curve(hosts, tmp_path) -> None:
    b, a, va = hosts
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    broker_kp = create_keypair(keys, "broker")
    for name in ("actorhost", "client"):
        kp = create_keypair(keys, name)
        shutil.copy(kp.public_file, allowed / kp.public_file.name)
    url = "tcp://10.231.7.1:5555"
    py = sys.executable
    broker = subprocess.Popen(["ip", "netns", "exec", b, py, "-m", "libra.broker", "--bind", "tcp://0.0.0.0:5555",
                               "--heartbeat-s", "0.3", "--curve-secret", str(broker_kp.secret_file),
                               "--curve-allow", str(allowed), "--log-level", "warning"])
    actor_env = {**os.environ, "LIBRA_CURVE_SECRET": str(keys / "actorhost.key_secret"),
                 "LIBRA_BROKER_KEY": str(broker_kp.public_file)}
    actors = subprocess.Popen(["ip", "netns", "exec", a, py, "-m", "libra.actors", "--broker", url,
                               "--cpu-slots", "1", "--gpu-slots", "0", "--no-sandbox", "--log-level", "warning"],
                              env=actor_env)
    client_env = {**os.environ, "LIBRA_CURVE_SECRET": str(keys / "client.key_secret"),
                  "LIBRA_BROKER_KEY": str(broker_kp.public_file)}
    client = subprocess.Popen(["ip", "netns", "exec", b, py, "-c", CLIENT, url, "80"], env=client_env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "READY"
        time.sleep(1.0)
        _sh("ip", "-n", a, "link", "set", va, "down")  # the actor host drops off the network
        time.sleep(3.0)  # > 3 × 0.3 s: the broker expires it; the client's calls wait in the queue
        _sh("ip", "-n", a, "link", "set", va, "up")
        out, _ = client.communicate(timeout=180)
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in (client, actors, broker):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
    assert result["ok"] == result["n"] == 80  # every call completed, with the right output, once
    stats = result["stats"]
    assert stats["actors_expired"] >= 1  # the cut-off was noticed
    assert stats["completed"] == 80 and stats["failed"] == 0


TRAIN_RANK = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from libra.actors.train_role import TrainRole, state_checksum
from libra.engines.trainer import TrainBatch
from libra.protocol.payloads_train import TrainArgs
model_dir, rank, port, parallel, grpo = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
part = {"ref": {"endpoint": "tcp://127.0.0.1:1", "name": "unused"}, "advantage": 0.0}
args = TrainArgs.from_wire({"parts": [[part], [part]], "world_size": 2, "rank": rank, "master_port": port,
                            "grpo": {"lr": 1e-2, "parallel": parallel, **grpo}})
role = TrainRole(model_dir, None, f"host{rank}")
trainer = role._ensure(args)  # joins the group at the train config's (or the advertised) master address
g = torch.Generator().manual_seed(11)
seqs = [torch.randint(5, 500, (6 + k,), generator=g).tolist() for k in range(4)]
batch = TrainBatch(input_ids=seqs, loss_mask=[[0, 0] + [1] * (len(s) - 2) for s in seqs],
                   rollout_logprobs=trainer.logprobs(seqs), advantages=[1.0, -1.0, 0.5, -0.5])
m = trainer.train_step(batch.shard(rank, 2))
print(json.dumps({"rank": rank, "loss": m["loss"], "checksum": state_checksum(trainer.state_dict_for_sync()),
                  "parallel": trainer.parallel, "version": trainer.weights_version}), flush=True)
role.close()
trainer.close()
"""


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_trainer_ranks_on_two_hosts_rendezvous_at_rank0s_address(hosts, tmp_path, parallel) -> None:
    """Rank 0 on the broker's host (10.231.7.1: its actor advertises it), rank 1 on the other host, told the
    address by the train config; one GRPO step over gloo between the namespaces, identical weights after."""
    from libra.engines.tiny_model import ensure_tiny_model

    b, a, _ = hosts
    model_dir = ensure_tiny_model(tmp_path / "model")
    py, port = sys.executable, 29731
    rank0 = subprocess.Popen(["ip", "netns", "exec", b, py, "-c", TRAIN_RANK, str(model_dir), "0", str(port),
                              parallel, "{}"], env={**os.environ, "LIBRA_ADVERTISE_ADDRESS": "10.231.7.1"},
                             stdout=subprocess.PIPE, text=True)
    rank1 = subprocess.Popen(["ip", "netns", "exec", a, py, "-c", TRAIN_RANK, str(model_dir), "1", str(port),
                              parallel, json.dumps({"master_addr": "10.231.7.1"})],
                             env={k: v for k, v in os.environ.items() if k != "LIBRA_ADVERTISE_ADDRESS"},
                             stdout=subprocess.PIPE, text=True)
    outs = []
    try:
        for p in (rank0, rank1):
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0
            outs.append(json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))))  # past log lines
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait(15)
    assert [o["rank"] for o in outs] == [0, 1]
    assert outs[0]["parallel"] == outs[1]["parallel"] == parallel
    assert outs[0]["version"] == outs[1]["version"] == 1
    assert outs[0]["loss"] == outs[1]["loss"]  # the global loss, reduced across the hosts
    assert outs[0]["checksum"] == outs[1]["checksum"]  # the same weights on both hosts after the step
