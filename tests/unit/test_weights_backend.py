"""Weight-sync backend choice and bucket plans (libra/weights/backend.py), and a fetch whose backend the two
ends' devices chose (libra/weights/torch_dist.py): CPU ends use gloo even when CUDA would be visible."""

from __future__ import annotations

import itertools
import multiprocessing as mp

import pytest
import torch

from libra.weights.backend import DeviceEnd, choose_backend, local_end, plan_buckets
from libra.weights.torch_dist import TorchWeightFetcher, TorchWeightPublisher


def test_choose_backend_for_every_combination() -> None:
    cpu_a, cpu_b = DeviceEnd("a", "cpu"), DeviceEnd("b", "cpu")
    g0, g1 = DeviceEnd("a", "cuda", "GPU-0"), DeviceEnd("a", "cuda", "GPU-1")
    remote = DeviceEnd("b", "cuda", "GPU-9")
    unknown = DeviceEnd("a", "cuda", None)
    want = {
        (cpu_a, cpu_a): "gloo", (cpu_a, cpu_b): "gloo",  # the hang: both ends on CPU never pick NCCL
        (cpu_a, g0): "gloo", (g0, cpu_a): "gloo", (remote, cpu_a): "gloo",
        (g0, g0): "cuda_ipc",  # one GPU: NCCL cannot pair a device with itself
        (g0, g1): "nccl", (g1, g0): "nccl", (g0, remote): "nccl", (remote, g1): "nccl",
        (g0, unknown): "gloo", (unknown, unknown): "gloo",  # identity unknown: never risk NCCL on one GPU
        (g0, DeviceEnd("b", "cuda", "GPU-0")): "gloo",  # one UUID on two hosts is a broken report
    }
    ends = [cpu_a, cpu_b, g0, g1, remote, unknown]
    for src, dst in itertools.product(ends, ends):
        got = choose_backend(src, dst)
        assert got in ("gloo", "nccl", "cuda_ipc")
        if (src, dst) in want:
            assert got == want[(src, dst)], (src, dst)
        assert (got == "nccl") == (src.kind == dst.kind == "cuda" and None not in (src.uuid, dst.uuid)
                                   and src.uuid != dst.uuid)
    with pytest.raises(ValueError, match="kind"):
        DeviceEnd("a", "tpu")
    assert DeviceEnd.from_wire(g0.to_wire()) == g0
    with pytest.raises(ValueError):
        DeviceEnd.from_wire({"host": 1, "kind": "cpu"})
    assert local_end("cpu").kind == "cpu"


def test_bucket_plan_groups_by_dtype_within_the_limit() -> None:
    entries = [("a", "f32", 10, 4), ("b", "bf16", 10, 2), ("c", "f32", 10, 4), ("d", "f32", 100, 4),
               ("e", "f32", 5, 4), ("f", "bf16", 3, 2)]
    plan = plan_buckets(entries, bucket_bytes=80)
    assert sorted(i for _, idx in plan for i in idx) == list(range(len(entries)))
    for dtype, idx in plan:
        assert {entries[i][1] for i in idx} == {dtype}
        assert idx == sorted(idx)
        size = sum(entries[i][2] * entries[i][3] for i in idx)
        assert size <= 80 or len(idx) == 1  # only a lone oversized tensor exceeds the limit
    assert ("f32", [3]) in plan  # 400 bytes: a bucket of its own
    assert plan_buckets(entries, bucket_bytes=10**9) == [("f32", [0, 2, 3, 4]), ("bf16", [1, 5])]
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError):
        plan_buckets(entries, 0)


def _fetch(ref: dict, out: mp.Queue) -> None:  # a spawned "rollout actor" on the CPU
    f = TorchWeightFetcher(timeout_s=30)
    sd, version, stats = f.fetch(ref)
    out.put((f.last_backend, version, {k: v.double().tolist() for k, v in sd.items()}, stats.chunks))


def test_cpu_ends_pick_gloo_by_themselves_in_small_buckets() -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(40, 8, generator=g), "b": torch.randn(8, generator=g),
          "h": torch.randn(8, 40, generator=g).to(torch.bfloat16)}
    pub = TorchWeightPublisher(keep=1, timeout_s=30, bucket_bytes=1024)  # no forced backend
    try:
        ref = pub.publish(4, sd)
        assert ref["backend"] == "auto"
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        kid = ctx.Process(target=_fetch, args=(ref, q))
        kid.start()
        backend, version, got, buckets = q.get(timeout=120)
        kid.join(timeout=30)
    finally:
        pub.close()
    assert backend == "gloo" and version == 4 and pub.served_by == {"gloo": 1}
    assert buckets == 3  # w (1280 B) alone, b, and h (640 B) in its own dtype's bucket
    for k, v in sd.items():
        assert torch.equal(torch.tensor(got[k], dtype=torch.float64), v.double()), k
