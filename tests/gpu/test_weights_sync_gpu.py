"""Weight sync on GPUs (libra/weights/torch_dist.py + libra/weights/backend.py): the path follows where the two
ends' tensors live. Skipped without CUDA; the NCCL pair needs two GPUs."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from libra.weights.torch_dist import TorchWeightFetcher, TorchWeightPublisher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(256, 64, generator=g), "h": torch.randn(64, 256, generator=g).to(torch.bfloat16)}
    return {k: v.to(device) for k, v in sd.items()}


def _fetch(ref: dict, device: str, out: mp.Queue) -> None:  # a spawned rollout actor
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        f = TorchWeightFetcher(timeout_s=60, device=device)
        sd, version, _ = f.fetch(ref)
        out.put(("ok", f.last_backend, version, {k: (str(v.device), v.double().cpu().tolist()) for k, v in sd.items()}))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", type(exc).__name__, str(exc), {}))


def _roundtrip(src: str, dst: str) -> tuple[str, dict]:
    torch.cuda.set_device(0)
    pub = TorchWeightPublisher(keep=1, timeout_s=60, bucket_bytes=32 * 1024)
    try:
        sd = _state(src)
        ref = pub.publish(1, sd)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        kid = ctx.Process(target=_fetch, args=(ref, dst, q))
        kid.start()
        status, backend, version, got = q.get(timeout=180)
        kid.join(timeout=30)
    finally:
        pub.close()
    assert status == "ok", (backend, version)
    assert version == 1
    for k, v in sd.items():
        device, values = got[k]
        assert device.startswith(dst.split(":")[0])
        assert torch.equal(torch.tensor(values, dtype=torch.float64), v.double().cpu()), k
    return backend, got


def test_cpu_trainer_and_cpu_rollout_use_gloo_although_cuda_is_visible() -> None:
    backend, _ = _roundtrip("cpu", "cpu")  # used to pick NCCL here and hang
    assert backend == "gloo"


def test_same_gpu_takes_the_cuda_ipc_device_copy() -> None:
    backend, _ = _roundtrip("cuda:0", "cuda:0")
    assert backend == "cuda_ipc"


def test_gpu_trainer_to_cpu_rollout_uses_gloo() -> None:
    backend, _ = _roundtrip("cuda:0", "cpu")
    assert backend == "gloo"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pair needs two GPUs")
def test_two_gpus_broadcast_over_nccl_in_buckets() -> None:
    backend, _ = _roundtrip("cuda:0", "cuda:1")
    assert backend == "nccl"


def _fetch_seeing_only(uuid: str, refs: list, out: mp.Queue) -> None:  # a rollout actor given one GPU by UUID
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = uuid  # before CUDA starts in this process: the GPU becomes cuda:0
    try:
        f = TorchWeightFetcher(timeout_s=60, device="cuda:0")
        got = [f.fetch(r) for r in refs]
        out.put(("ok", f.last_backend, [v for _, v, _ in got], f.pairs.made,
                 {k: t.double().cpu().tolist() for k, t in got[-1][0].items()}))
        f.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", type(exc).__name__, str(exc), 0, {}))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs to number one differently")
@pytest.mark.parametrize("fetcher_gpu", [1, 0])
def test_a_fetcher_numbering_gpus_differently_opens_ipc_by_uuid_and_keeps_one_nccl_group(fetcher_gpu: int) -> None:
    """The publisher's snapshots live on its cuda:1. A fetcher given only GPU 1 (by UUID) sees it as cuda:0: the
    CUDA IPC handle must be opened there, not on the publisher's index 1. A fetcher given only GPU 0 takes NCCL
    and keeps one pair group for both versions."""
    torch.cuda.set_device(1)
    pub = TorchWeightPublisher(keep=2, timeout_s=60, device="cuda:1")
    try:
        refs = [pub.publish(v, _state("cuda:1")) for v in (1, 2)]
        uuid = str(torch.cuda.get_device_properties(fetcher_gpu).uuid)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        kid = ctx.Process(target=_fetch_seeing_only, args=(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}", refs, q))
        kid.start()
        status, backend, versions, groups, got = q.get(timeout=180)
        kid.join(timeout=30)
        assert status == "ok", (backend, versions)
        assert versions == [1, 2] and backend == ("cuda_ipc" if fetcher_gpu == 1 else "nccl")
        assert groups == (0 if fetcher_gpu == 1 else 1)
        for k, v in _state("cpu").items():
            assert torch.equal(torch.tensor(got[k], dtype=torch.float64), v.double()), k
    finally:
        pub.close()
    assert len(pub.pairs) == 0
