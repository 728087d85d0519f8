"""CUDA as the engines see it: how many devices this process can use, and the out-of-memory helpers.

torch is imported only inside these functions, so this module is importable anywhere; without torch or
with a broken driver there is no CUDA (0 devices), never a crash.
"""

from __future__ import annotations

__all__ = ["cuda_device_count", "free_cuda_cache", "is_cuda_oom"]


def cuda_device_count() -> int:
    """The CUDA devices torch can use in this process (0 without torch or a usable driver)."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver is "no CUDA", not a crash
        return 0


def is_cuda_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA out-of-memory error (``torch.cuda.OutOfMemoryError``, or the RuntimeError
    older code paths raise with CUDA's message)."""
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:
        pass
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


def free_cuda_cache() -> None:
    """Give the caching allocator's free blocks back (after an OOM); nothing without CUDA."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
