"""The data plane (libra.dataplane) on loopback: chunked credit-based transfers, typed failures (CRC,
missing object, server killed mid-transfer), CURVE, and training shards (libra.rl.shards) over it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import msgpack
import pytest
import torch
import zmq

from libra.dataplane import (
    PROTO,
    DataPlaneKeys,
    DataPlaneServer,
    InsecureDataPlane,
    ObjectNotFound,
    ObjectRef,
    PeerLost,
    TransferCorrupted,
    fetch,
    fetch_state_dict,
    latest,
)
from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher
from libra.weights.format import pack_state_dict
from libra.rl.shards import decode_shard, encode_shard


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(50, 16, generator=g), "ids": torch.arange(7), "half": torch.randn(9, generator=g).half(),
            "empty": torch.empty(0)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def server():
    with DataPlaneServer() as s:
        yield s


@pytest.mark.parametrize(("chunk_size", "window", "batch"), [(64, 1, 1), (100, 3, 2), (1000, 64, 8), (1 << 22, 8, 2)])
def test_chunked_round_trip_is_bit_exact_for_any_window(server, chunk_size, window, batch) -> None:
    sd = weights()
    ref = server.publish_state_dict("w/v1", sd, version=1, chunk_size=chunk_size)
    assert ref.endpoint.startswith("tcp://127.0.0.1:") and ref.nbytes == sum(t.numel() * t.element_size()
                                                                              for t in sd.values())
    seen: list[tuple[int, int]] = []
    got, hdr, stats = fetch_state_dict(ref, window=window, batch=batch, on_chunk=lambda i, n: seen.append((i, n)))
    assert same(got, sd) and hdr.version == 1
    n = -(-ref.nbytes // chunk_size)
    assert stats.chunks == len(seen) == n and seen[-1] == (n, n) and stats.nbytes == ref.nbytes
    assert stats.requests == 1 + -(-n // min(batch, window)) or stats.requests <= 1 + n  # head + range requests


def test_concurrent_fetchers_each_get_the_whole_object(server) -> None:
    sd = weights(3)
    ref = server.publish_state_dict("w/v3", sd, version=3, chunk_size=97)
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(same(fetch_state_dict(ref, window=2)[0], sd)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True] * 4
    assert server.chunks_served == 4 * -(-ref.nbytes // 97)


def test_a_corrupted_chunk_is_a_typed_error_naming_it(server) -> None:
    header, chunks = pack_state_dict(weights(), version=1, chunk_size=128)
    bad = list(chunks)
    bad[2] = bytes([bad[2][0] ^ 0xFF]) + bad[2][1:]
    ref = server.publish("w/bad", header, bad, version=1)
    with pytest.raises(TransferCorrupted, match="chunk 2 failed its CRC-32"):
        fetch_state_dict(ref)
    short = server.publish("w/short", header, [*chunks[:-1], chunks[-1][:-1]], version=1)
    with pytest.raises(TransferCorrupted, match="bytes"):
        fetch_state_dict(short)


def test_missing_retired_and_superseded_objects(server) -> None:
    pub = DataPlaneWeightPublisher(server, keep=2, chunk_size=64)
    refs = [pub.publish(v, weights(v)) for v in (1, 2, 3)]
    assert server.names() == ["weights/v2", "weights/v3"]  # the newest two stay fetchable
    newest = latest(server.endpoint, "weights")
    assert newest is not None and newest.version == 3 and newest.name == "weights/v3"
    assert latest(server.endpoint, "nothing") is None
    with pytest.raises(ObjectNotFound, match="weights/v1"):
        DataPlaneWeightFetcher().fetch(refs[0])
    sd, version, _ = DataPlaneWeightFetcher().fetch(refs[2])
    assert version == 3 and same(sd, weights(3))
    # retired while a transfer is in flight: the next chunk request finds nothing
    ref = ObjectRef.from_wire(refs[1])
    with pytest.raises(ObjectNotFound, match="no longer"):
        fetch(ref, window=1, batch=1, on_chunk=lambda i, n: server.retire(ref.name) if i == 1 else None)


def test_a_version_mismatch_between_ref_and_header_is_refused(server) -> None:
    ref = server.publish_state_dict("w/v5", weights(), version=5).to_wire()
    with pytest.raises(TransferCorrupted, match="version 5"):
        DataPlaneWeightFetcher().fetch({**ref, "version": 6})


_SERVER = """
import sys, time, torch
from libra.dataplane import DataPlaneServer
s = DataPlaneServer()
s.publish_state_dict("w/v9", {"x": torch.arange(4096, dtype=torch.float32)}, version=9, chunk_size=256)
print("ENDPOINT", s.endpoint, flush=True)
time.sleep(600)
"""


def test_server_killed_mid_transfer_is_peer_lost() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("ENDPOINT "):  # skip log lines
            line = proc.stdout.readline()
            assert line, "the server process exited before serving"
        endpoint = line.split()[1]
        ref = ObjectRef(endpoint, "w/v9", 9)
        got: list[int] = []

        def kill_after_three(i: int, n: int) -> None:
            got.append(i)
            if i == 3:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

        with pytest.raises(PeerLost, match=r"after 3/64 chunks"):
            fetch(ref, window=1, batch=1, idle_timeout_s=1.0, on_chunk=kill_after_three)
        assert got == [1, 2, 3]
        with pytest.raises(PeerLost, match="down or unreachable"):
            fetch(ref, idle_timeout_s=0.3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_malformed_requests_get_errors_and_the_server_keeps_serving(server) -> None:
    ref = server.publish_state_dict("w/v1", weights(), version=1)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.endpoint)
    try:
        for payload in (b"\xc1garbage", msgpack.packb({"op": "get", "name": "w/v1", "start": 0, "count": 10_000}),
                        msgpack.packb({"op": "dance"})):
            s.send_multipart([PROTO, payload])
            assert s.poll(10_000)
            reply = msgpack.unpackb(s.recv_multipart()[1])
            assert reply["ok"] is False and reply["code"] == "bad_request"
        s.send_multipart([b"NOTUS", b"x"])  # another protocol: dropped
        s.send_multipart([PROTO, msgpack.packb({"op": "ping"})])
        assert s.poll(10_000) and msgpack.unpackb(s.recv_multipart()[1])["op"] == "pong"
    finally:
        s.close(0)
    assert same(fetch_state_dict(ref)[0], weights())


def test_curve_server_refuses_plaintext_and_serves_key_holders(tmp_path, monkeypatch) -> None:
    from libra.transport.keys import create_keypair

    kp = create_keypair(tmp_path / "keys", "trainer")
    monkeypatch.setenv("LIBRA_CURVE_SECRET", str(kp.secret_file))
    keys = DataPlaneKeys.from_env()
    assert keys is not None and keys.public_key == kp.public_key
    with DataPlaneServer(keys=keys) as s:
        ref = s.publish_state_dict("w/v1", weights(), version=1)
        assert ref.server_key == kp.public_key.decode() and ObjectRef.from_wire(ref.to_wire()) == ref
        assert same(fetch_state_dict(ref)[0], weights())  # ephemeral client keys suffice
        with pytest.raises(PeerLost):  # a plaintext peer never completes the handshake
            fetch(ObjectRef(ref.endpoint, ref.name, 1, None), idle_timeout_s=0.5)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    friend = create_keypair(tmp_path / "keys", "rollout")
    (allowed / "rollout.key").write_bytes(friend.public_file.read_bytes())
    with DataPlaneServer(keys=keys, allow_dir=allowed) as s:
        ref = s.publish_state_dict("w/v1", weights(), version=1)
        assert same(fetch_state_dict(ref, keys=DataPlaneKeys(friend.public_key, friend.secret_key))[0], weights())
        with pytest.raises(PeerLost):  # not on the allow-list
            fetch(ref, idle_timeout_s=0.5)


def test_public_bind_without_keys_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("LIBRA_DATAPLANE_INSECURE", raising=False)
    with pytest.raises(InsecureDataPlane, match="LIBRA_DATAPLANE_INSECURE=1"):
        DataPlaneServer("10.1.2.3")
    monkeypatch.setenv("LIBRA_DATAPLANE_HOST", "192.0.2.1")
    with pytest.raises(InsecureDataPlane, match="192.0.2.1"):
        DataPlaneServer()


def test_refs_from_work_messages_are_validated() -> None:
    good = {"endpoint": "tcp://127.0.0.1:5", "name": "w/v1", "version": 1, "server_key": None, "bytes": 10}
    assert ObjectRef.from_wire(good) == ObjectRef("tcp://127.0.0.1:5", "w/v1", 1, None, 10)
    for bad, msg in (([], "mapping"), ({**good, "endpoint": "http://x"}, "endpoint"), ({**good, "name": ""}, "name"),
                     ({**good, "version": "1"}, "version"), ({**good, "server_key": "short"}, "server_key")):
        with pytest.raises(ValueError, match=msg):
            ObjectRef.from_wire(bad)


def test_training_shards_round_trip_over_the_data_plane(server) -> None:
    seqs = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    masks = [[0, 0, 1, 1], [0, 1], [0, 1, 1]]
    lps = [[0.0, 0.0, -1.25, -0.5], [0.0, -2.0], [0.0, -0.75, -3.5]]
    tensors, meta = encode_shard(seqs, masks, lps, [0.5, -1.0, 0.25], traj_index=[4, 0, 7],
                                 micro_batches=[[0, 2], [1]], step=3, rank=1)
    ref = server.publish_state_dict("batch/step3/rank1", tensors, version=3, metadata=meta)
    sd, hdr, _ = fetch_state_dict(ref)
    batch, micro = decode_shard(sd, hdr.metadata)
    assert batch.input_ids == seqs and batch.loss_mask == masks and batch.rollout_logprobs == lps
    assert batch.advantages == [0.5, -1.0, 0.25] and micro == [[0, 2], [1]]
    empty, none = decode_shard(*encode_shard([], [], [], [], traj_index=[], micro_batches=[], step=3, rank=0))
    assert len(empty) == 0 and none == []
    with pytest.raises(ValueError, match="exactly once"):
        decode_shard(tensors, {**meta, "micro_batches": [[0, 1]]})
    with pytest.raises(ValueError, match="equally long"):
        encode_shard(seqs, masks, lps, [0.5], traj_index=[0, 1, 2], micro_batches=[], step=1, rank=0)
