"""Per-job isolation on the data plane (libra.dataplane.access): real CURVE sockets on loopback, an allow directory
in the broker's layout (clients/a/, clients/b/, clients/, actors/, operators/, and a key directly in it), objects
tagged with their job. A job-scoped client key is refused another job's trajectories and weights with a typed
``Forbidden`` (logged and counted); unscoped keys see everything; a removed key is refused once the directory is
re-read; without an allow directory nothing changes. Also: ``TrainArgs.job`` and the job host that fills it."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from structlog.testing import capture_logs

from libra.dataplane import (
    ALLOW_ENV,
    PROTO,
    DataPlaneKeys,
    DataPlaneServer,
    Forbidden,
    ObjectRef,
    PeerLost,
    allow_dir_from_env,
    fetch_state_dict,
    job_of_name,
    latest,
)
from libra.dataplane.access import REFRESH_S
from libra.transport.keys import KeyFileError, create_keypair
from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher

#: name → the place of its public key under the allow directory ("" : the directory itself, role "any")
PLACES = {"ca": "clients/a", "cb": "clients/b", "client": "clients", "actor": "actors", "op": "operators", "any": ""}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(6, dtype=torch.int32) + seed, "y": torch.full((3,), float(seed))}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def world(tmp_path: Path):
    """``(server, {name: DataPlaneKeys}, {what: ObjectRef}, allow directory)``: a CURVE server with role checks
    holding job a's and job b's trajectory, job b's weights (published as a trainer does) and an untagged
    object."""
    keys_dir, allowed = tmp_path / "keys", tmp_path / "allowed"
    server_kp = create_keypair(keys_dir, "server")
    keys = {}
    for name, place in PLACES.items():
        kp = create_keypair(keys_dir, name)
        (allowed / place).mkdir(parents=True, exist_ok=True)
        (allowed / place / kp.public_file.name).write_bytes(kp.public_file.read_bytes())
        keys[name] = DataPlaneKeys(kp.public_key, kp.secret_key)
    with DataPlaneServer(keys=DataPlaneKeys(server_kp.public_key, server_kp.secret_key), allow_dir=allowed) as s:
        refs = {"traj_a": s.publish_state_dict("traj/a/g0/0/w1", tensors(1)),
                "traj_b": s.publish_state_dict("traj/b/g0/0/w2", tensors(2)),
                "untagged": s.publish_state_dict("misc/table", tensors(3))}
        s.default_job = "b"  # what TrainRole.tag_weights does with TrainArgs.job
        refs["weights_b"] = ObjectRef.from_wire(DataPlaneWeightPublisher(s).publish(1, tensors(4)))
        s.default_job = None
        yield s, keys, refs, allowed


def test_a_client_of_job_a_fetching_job_bs_shard_is_refused_typed_logged_and_counted(world) -> None:
    s, keys, refs, _ = world
    assert (s.job_of("traj/a/g0/0/w1"), s.job_of("traj/b/g0/0/w2"), s.job_of("weights/v1"),
            s.job_of("misc/table")) == ("a", "b", "b", None)
    with capture_logs() as logs:
        with pytest.raises(Forbidden, match=r"role 'client:a'.*'traj/b/g0/0/w2'.*job 'b'"):
            fetch_state_dict(refs["traj_b"], keys=keys["ca"], idle_timeout_s=5.0)
    assert s.refused == 1
    refusals = [e for e in logs if e["event"] == "dataplane_refused"]
    assert len(refusals) == 1 and refusals[0]["log_level"] == "warning"
    assert (refusals[0]["role"], refusals[0]["job"], refusals[0]["name"], refusals[0]["op"]) == \
        ("client:a", "b", "traj/b/g0/0/w2", "head")
    assert refusals[0]["key"] == keys["ca"].public_key.decode()
    # its own job's shard is served, and that is not a refusal
    assert same(fetch_state_dict(refs["traj_a"], keys=keys["ca"], idle_timeout_s=5.0)[0], tensors(1))
    assert s.refused == 1


def test_weights_are_the_jobs_too_and_latest_is_checked(world) -> None:
    s, keys, refs, _ = world
    with pytest.raises(Forbidden, match="client:a"):
        DataPlaneWeightFetcher(keys=keys["ca"], idle_timeout_s=5.0).fetch(refs["weights_b"].to_wire())
    sd, version, _ = DataPlaneWeightFetcher(keys=keys["cb"], idle_timeout_s=5.0).fetch(refs["weights_b"].to_wire())
    assert version == 1 and same({k: sd[k] for k in ("x", "y")}, tensors(4))
    with pytest.raises(Forbidden, match=r"latest|weights/v1"):
        latest(s.endpoint, "weights", server_key=s.server_key, keys=keys["ca"], timeout_s=5.0)
    got = latest(s.endpoint, "weights", server_key=s.server_key, keys=keys["cb"], timeout_s=5.0)
    assert got is not None and (got.name, got.version) == ("weights/v1", 1)
    assert s.refused == 2
    # job b's client may not see job a's shard nor an untagged object
    for ref in (refs["traj_a"], refs["untagged"]):
        with pytest.raises(Forbidden, match="client:b"):
            fetch_state_dict(ref, keys=keys["cb"], idle_timeout_s=5.0)
    assert s.refused == 4


@pytest.mark.parametrize("who", ["actor", "op", "any", "client"])
def test_unscoped_keys_fetch_every_jobs_objects(world, who: str) -> None:
    s, keys, refs, _ = world
    for what, seed in (("traj_a", 1), ("traj_b", 2), ("untagged", 3)):
        assert same(fetch_state_dict(refs[what], keys=keys[who], idle_timeout_s=5.0)[0], tensors(seed))
    assert DataPlaneWeightFetcher(keys=keys[who], idle_timeout_s=5.0).fetch(refs["weights_b"].to_wire())[1] == 1
    assert s.refused == 0


def _ask(sock: zmq.Socket, name: str) -> dict:
    sock.send_multipart([PROTO, msgpack.packb({"op": "head", "name": name, "req": "r"})])
    assert sock.poll(5000), "the data-plane server did not answer"
    return msgpack.unpackb(sock.recv_multipart()[1], raw=False)


def test_a_key_removed_from_the_directory_is_refused_after_the_refresh(world, tmp_path: Path) -> None:
    s, keys, refs, allowed = world
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey = keys["cb"].public_key, keys["cb"].secret_key
    sock.curve_serverkey = s.server_key.encode()
    sock.connect(s.endpoint)
    try:
        assert _ask(sock, "traj/b/g0/0/w2")["ok"] is True  # an open connection of job b's client
        (allowed / "clients" / "b" / "cb.key").unlink()
        deadline = time.monotonic() + 5 * REFRESH_S + 5.0
        while (reply := _ask(sock, "traj/b/g0/0/w2"))["ok"] is True:
            assert time.monotonic() < deadline, "the removed key was still served after the directory re-read"
            time.sleep(0.1)
        assert reply["code"] == "forbidden" and "revoked" in reply["message"]
        assert s.refused >= 1
    finally:
        sock.close(0)
    with pytest.raises(PeerLost):  # a new connection of the removed key fails the handshake
        fetch_state_dict(refs["traj_b"], keys=keys["cb"], idle_timeout_s=1.0)
    # a key moved in while the server runs is taken in too: job a's client now also holds job b's key
    kp_b = keys["cb"]
    (allowed / "clients" / "a" / "cb.key").write_bytes((tmp_path / "keys" / "cb.key").read_bytes())
    deadline = time.monotonic() + 5 * REFRESH_S + 5.0
    while True:
        try:
            with pytest.raises(Forbidden, match="client:a"):
                fetch_state_dict(refs["traj_b"], keys=kp_b, idle_timeout_s=1.0)
            break
        except PeerLost:
            assert time.monotonic() < deadline, "a key added to the directory was never let in"


def test_a_provided_object_is_refused_before_it_is_made(tmp_path: Path) -> None:
    keys_dir, allowed = tmp_path / "keys", tmp_path / "allowed"
    skp, ca, actor = (create_keypair(keys_dir, n) for n in ("server", "ca", "actor"))
    for kp, place in ((ca, "clients/a"), (actor, "actors")):
        (allowed / place).mkdir(parents=True)
        (allowed / place / kp.public_file.name).write_bytes(kp.public_file.read_bytes())
    made: list[str] = []

    def provider(name: str):
        from libra.weights.format import pack_state_dict

        made.append(name)
        return pack_state_dict(tensors(5))

    with DataPlaneServer(keys=DataPlaneKeys(skp.public_key, skp.secret_key), allow_dir=allowed,
                         provider=provider) as s:
        ref = ObjectRef(s.endpoint, "ctx/t1/ids", None, s.server_key)
        with pytest.raises(Forbidden, match="no job"):
            fetch_state_dict(ref, keys=DataPlaneKeys(ca.public_key, ca.secret_key), idle_timeout_s=5.0)
        assert made == [] and s.refused == 1
        got = fetch_state_dict(ref, keys=DataPlaneKeys(actor.public_key, actor.secret_key), idle_timeout_s=5.0)[0]
        assert same(got, tensors(5)) and made == ["ctx/t1/ids"]


def test_without_an_allow_directory_nothing_is_checked(tmp_path: Path) -> None:
    skp = create_keypair(tmp_path / "keys", "server")
    with DataPlaneServer(keys=DataPlaneKeys(skp.public_key, skp.secret_key)) as s:
        ra = s.publish_state_dict("traj/a/g0/0/w1", tensors(1))
        rb = s.publish_state_dict("traj/b/g0/0/w2", tensors(2))
        for ref, seed in ((ra, 1), (rb, 2)):  # any CURVE client, here an ephemeral key
            assert same(fetch_state_dict(ref, idle_timeout_s=5.0)[0], tensors(seed))
        assert s.refused == 0 and s.job_of("traj/b/g0/0/w2") == "b"
    with DataPlaneServer(allow_dir=tmp_path / "keys") as s:  # without keys the allow directory is ignored
        ref = s.publish_state_dict("traj/b/g0/0/w2", tensors(2))
        assert same(fetch_state_dict(ref, idle_timeout_s=5.0)[0], tensors(2)) and s.refused == 0


def test_the_job_of_an_object() -> None:
    assert [job_of_name(n) for n in ("traj/a/g0/0/w1", "traj/x-y/g1/2/w", "traj//g0", "weights/v1", "ctx/traj/a")] \
        == ["a", "x-y", None, None, None]
    with DataPlaneServer() as s:
        s.publish("traj/a/g0/0/w", b"h", [b"c"], job="b")  # an explicit job wins over the name
        s.default_job = "t"
        s.publish("traj/a/g0/0/w2", b"h", [b"c"])  # the name wins over the default
        s.publish("weights/v3", b"h", [b"c"])  # the default tags the rest
        s.default_job = None
        s.publish("weights/v4", b"h", [b"c"], job="")
        assert [s.job_of(n) for n in ("traj/a/g0/0/w", "traj/a/g0/0/w2", "weights/v3", "weights/v4", "nope")] == \
            ["b", "a", "t", None, None]


def test_the_allow_directory_comes_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert allow_dir_from_env() is None
    monkeypatch.setenv(ALLOW_ENV, str(tmp_path))
    assert allow_dir_from_env() == tmp_path
    (tmp_path / "f").write_text("")
    monkeypatch.setenv(ALLOW_ENV, str(tmp_path / "f"))
    with pytest.raises(KeyFileError, match=ALLOW_ENV):
        allow_dir_from_env()


def test_train_args_carry_the_job_and_the_job_host_fills_it() -> None:
    from libra.broker.job_host import JobHost, JobSpec
    from libra.protocol.payloads_refs import DataRef
    from libra.protocol.payloads_train import TrainArgs

    ref = DataRef.from_wire({"endpoint": "tcp://127.0.0.1:1", "name": "traj/j/g0/0/w", "version": None,
                             "server_key": None, "bytes": 1})
    assert "job" not in TrainArgs(shards=[ref]).to_wire()  # the default stays off the wire
    wire = TrainArgs(shards=[ref], job="j").to_wire()
    assert wire["job"] == "j" and TrainArgs.from_wire(wire).job == "j"
    spec = {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_policy_lag": 1, "world_size": 2,
            "env": "arith", "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64, "master_port": 1}
    h = JobHost("jobx", JobSpec.from_mapping(spec), [{"question": "1+1", "answer": 2}], 0.0)
    for i, w in enumerate(h.take_work(0.0)):
        h.on_reply(w.tag, True, {"reward": float(i), "versions": [0], "gen_tokens": 4, "tokens": 8,
                                 "ref": {**ref.to_wire(), "name": f"traj/jobx/g0/{i}/w"}, "info": {}}, "", 1.0)
    train = [w for w in h.take_work(2.0) if w.kind == "train"]
    assert len(train) == 2 and [TrainArgs.from_wire(w.args).job for w in train] == ["jobx", "jobx"]
