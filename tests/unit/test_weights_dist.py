"""Weights over torch.distributed (libra/weights/torch_dist.py): a real gloo broadcast between the publisher and
fetchers in other processes, snapshots, superseded versions and unreachable publishers."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from libra.dataplane import PeerLost, TransferCorrupted
from libra.weights.torch_dist import TorchWeightFetcher, TorchWeightPublisher


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(50, 8, generator=g), "ln.bias": torch.randn(8, generator=g),
            "head.weight": torch.randn(8, 50, generator=g).to(torch.bfloat16),
            "step": torch.tensor([seed], dtype=torch.int64)}


def _fetch_in_child(ref: dict, out: mp.Queue) -> None:  # runs in a spawned process
    try:
        sd, version, stats = TorchWeightFetcher(timeout_s=30).fetch(ref)
        # plain data across the queue (a tensor would travel as a shared-memory handle that dies with us)
        out.put(("ok", version, {k: (str(v.dtype), v.double().tolist()) for k, v in sd.items()}, stats.nbytes))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", type(exc).__name__, str(exc), 0))


def test_two_processes_receive_the_published_snapshot_over_gloo() -> None:
    pub = TorchWeightPublisher(keep=2, backend="gloo", timeout_s=30)
    try:
        sd = _state(1)
        ref = pub.publish(1, sd)
        assert ref["transport"] == "torch" and ref["backend"] == "gloo" and ref["version"] == 1
        want = {k: v.clone() for k, v in sd.items()}
        for v in sd.values():  # the trainer keeps updating in place: version 1 is the snapshot
            v.add_(1)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        kids = [ctx.Process(target=_fetch_in_child, args=(ref, q)) for _ in range(2)]
        for k in kids:
            k.start()
        got = [q.get(timeout=120) for _ in kids]
        for k in kids:
            k.join(timeout=30)
        for status, version, fetched, nbytes in got:
            assert status == "ok", (version, fetched)
            assert version == 1 and set(fetched) == set(want) and nbytes == ref["bytes"]
            for name, t in want.items():
                dtype, values = fetched[name]
                assert dtype == str(t.dtype) and torch.equal(torch.tensor(values, dtype=torch.float64), t.double()), name
        assert pub.served == 2
    finally:
        pub.close()


def test_a_superseded_version_is_reported_gone_and_a_missing_one_never_published() -> None:
    pub = TorchWeightPublisher(keep=1, backend="gloo", timeout_s=10)
    try:
        old = pub.publish(1, _state(1))
        new = pub.publish(2, _state(2))
        f = TorchWeightFetcher(timeout_s=10)
        with pytest.raises(TransferCorrupted, match="gone"):
            f.fetch(old)
        with pytest.raises(TransferCorrupted, match="never published"):
            f.fetch({**new, "version": 7})
        sd, version, _ = f.fetch(new)  # same process, another thread on the publisher side
        assert version == 2 and torch.equal(sd["emb.weight"], _state(2)["emb.weight"])
    finally:
        pub.close()


def test_bad_refs_and_an_unreachable_publisher_raise_typed_errors() -> None:
    f = TorchWeightFetcher(timeout_s=1)
    with pytest.raises(TransferCorrupted, match="not a torch weights ref"):
        f.fetch({"version": 1, "endpoint": "tcp://127.0.0.1:1"})
    with pytest.raises(PeerLost, match="cannot reach"):
        f.fetch({"version": 1, "endpoint": "torch+tcp://127.0.0.1:1", "backend": "gloo", "transport": "torch"})


def _nccl_fetch_in_child(ref: dict, out: mp.Queue) -> None:  # runs in a spawned process on GPU 1
    torch.cuda.set_device(1)
    sd, version, _ = TorchWeightFetcher(timeout_s=60).fetch(ref)
    out.put((version, {k: (str(v.dtype), str(v.device), v.double().cpu().tolist()) for k, v in sd.items()}))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pair needs two GPUs")
def test_nccl_broadcast_gpu_to_gpu() -> None:
    torch.cuda.set_device(0)
    pub = TorchWeightPublisher(keep=1, backend="nccl", timeout_s=60)
    try:
        sd = {k: v.cuda() for k, v in _state(3).items()}
        ref = pub.publish(1, sd)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        kid = ctx.Process(target=_nccl_fetch_in_child, args=(ref, q))
        kid.start()
        version, got = q.get(timeout=180)
        kid.join(timeout=30)
        assert version == 1
        for name, t in sd.items():
            dtype, device, values = got[name]
            assert dtype == str(t.dtype) and device.startswith("cuda")
            assert torch.equal(torch.tensor(values, dtype=torch.float64), t.double().cpu()), name
    finally:
        pub.close()


def test_close_waits_for_a_fetch_in_flight() -> None:
    """A serving thread still broadcasting when the interpreter exits aborted the process; close() (also run
    at exit) now waits, bounded, for the fetches in flight, and they complete."""
    import threading
    import time

    pub = TorchWeightPublisher(timeout_s=30)
    ref = pub.publish(3, {"w": torch.arange(1000, dtype=torch.float32)})
    real = pub._serve_ticket

    def slow(ticket: int) -> None:
        time.sleep(0.5)  # a broadcast that takes a while
        real(ticket)

    pub._serve_ticket = slow  # type: ignore[method-assign]
    got: list = []
    t = threading.Thread(target=lambda: got.append(TorchWeightFetcher(timeout_s=30).fetch(ref)))
    t.start()
    deadline = time.monotonic() + 20
    while not pub._serving:
        assert time.monotonic() < deadline, "the fetch never reached the publisher"
        time.sleep(0.01)
    pub.close()
    assert not pub._serving  # close returned only after the serve finished
    t.join(30)
    sd, version, _ = got[0]
    assert version == 3 and torch.equal(sd["w"], torch.arange(1000, dtype=torch.float32))
