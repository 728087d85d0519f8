"""CUDA IPC handles keyed by device UUID (libra/weights/cuda_ipc.py): the fetcher opens the publisher's buffers
on its own index of that GPU, whatever index the publisher's process gave it. Pure, on CPU."""

from __future__ import annotations

import pytest
import torch

from libra.dataplane import DataPlaneError
from libra.weights.cuda_ipc import DeviceNotVisible, device_index_for_uuid, ipc_open, normalize_uuid

A, B, C = ("GPU-0b1e6f7a-1111-2222-3333-444455556666", "GPU-9c2d4e5f-aaaa-bbbb-cccc-ddddeeeeffff",
           "GPU-77777777-8888-9999-aaaa-bbbbccccdddd")


def test_the_publishers_gpu_is_found_by_uuid_in_the_fetchers_own_numbering() -> None:
    # the publisher sees [A, B, C] and exports B as its cuda:1; a fetcher given CUDA_VISIBLE_DEVICES=B,C
    # numbers B as cuda:0, one given C,B as cuda:1
    assert device_index_for_uuid(B, [B, C]) == 0
    assert device_index_for_uuid(B, [C, B]) == 1
    # torch's device properties spell UUIDs without NVML's "GPU-" prefix, in any case
    assert device_index_for_uuid(B, [A.removeprefix("GPU-"), B.removeprefix("GPU-").upper()]) == 1
    assert normalize_uuid("MIG-abc") == "mig-abc" and normalize_uuid(" GPU-AbC ") == "abc"


def test_a_gpu_the_fetcher_cannot_see_raises_a_typed_error() -> None:
    with pytest.raises(DeviceNotVisible, match="not visible here"):
        device_index_for_uuid(A, [B, C])
    with pytest.raises(DeviceNotVisible, match="no device UUID"):
        device_index_for_uuid("", [A])
    assert issubclass(DeviceNotVisible, DataPlaneError)  # the rollout role's back-off catches it


def test_a_handle_is_opened_on_the_mapped_index_not_the_publishers(monkeypatch) -> None:
    import torch.multiprocessing.reductions as reductions

    seen: list[tuple] = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: seen.append(args) or torch.zeros(1))
    handle = ["torch:Tensor", [4], [1], 0, "torch.storage:TypedStorage", "torch.float32", 1, b"h", 16, 0, False,
              b"r", 0, b"e", True]  # written by a publisher whose device index was 1
    ipc_open(handle, device_index_for_uuid(B, [B]))
    (args,) = seen
    assert args[6] == 0 and args[5] is torch.float32 and args[1] == torch.Size([4]) and args[0] is torch.Tensor
