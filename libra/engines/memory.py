"""Device and process memory readings, and the release step of a role switch or an out-of-memory error.

Role: a slot that drops an engine (a hybrid role switch, a rollout engine restarted after a crash, a batch
that ran out of memory) must give the memory back before it builds or runs anything else, and say how much
it got back. :func:`memory_reading` is what the slot holds now; :func:`release_memory` is the release step;
both readings go to the ``role_switched`` / ``rollout_oom`` / ``engine_restarted`` log lines and the actor's
record file (``RUN/actors/<actor id>.json``, :mod:`libra.actors.slot_records`).

Contracts:
- :func:`memory_reading` never raises: on CUDA ``allocated_bytes`` / ``reserved_bytes``
  (``torch.cuda.memory_allocated`` / ``memory_reserved``: the caching allocator's view of this process) and
  ``device_free_bytes`` / ``device_total_bytes`` (``torch.cuda.mem_get_info``: the whole device, other
  processes included); everywhere the process's resident set ``rss_bytes`` (psutil). A reading it cannot
  make is left out.
- :func:`release_memory` is called after the caller dropped its references. It never collects garbage
  itself unless something it was told should be gone (``expect_dead``, weak references) is still alive,
  i.e. held by a reference cycle: then it runs one ``gc.collect()`` and says so (``gc_needed``), because a
  GPU engine left to the cyclic collector keeps its memory for an unbounded time. Then, on CUDA,
  ``torch.cuda.empty_cache()`` hands the allocator's free blocks back to the device. It returns the
  record ``{"before", "after", "gc_needed", "still_alive"}``.

Not in this module: deciding what to drop (the roles do), logging, files.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["memory_reading", "release_memory", "weak"]


def _cuda() -> Any:
    """``torch.cuda`` when torch is imported and CUDA is initialised-able here, else None."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001  (a broken driver: no CUDA reading, never a failure)
        return None


def memory_reading(device: Any = None) -> dict[str, int | str]:
    """What this process holds now (see the module contracts); ``device`` is the CUDA device to read (its
    index, ``"cuda:N"`` or a ``torch.device``; default the current one)."""
    out: dict[str, int | str] = {}
    try:
        import psutil

        out["rss_bytes"] = int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # noqa: BLE001
        pass
    cuda = _cuda()
    if cuda is None:
        return out
    try:
        dev = device if isinstance(device, int) or str(device).startswith("cuda") else None  # "cpu": the current
        out["device"] = str(dev if dev is not None else f"cuda:{cuda.current_device()}")
        out["allocated_bytes"] = int(cuda.memory_allocated(dev))
        out["reserved_bytes"] = int(cuda.memory_reserved(dev))
        free, total = cuda.mem_get_info(dev)
        out["device_free_bytes"], out["device_total_bytes"] = int(free), int(total)
    except Exception:  # noqa: BLE001  (no reading rather than a failed switch)
        pass
    return out


def weak(*objs: Any) -> list[weakref.ref]:
    """Weak references to those of ``objs`` that are not None and can be weakly referenced."""
    refs = []
    for o in objs:
        if o is None:
            continue
        try:
            refs.append(weakref.ref(o))
        except TypeError:
            continue
    return refs


def release_memory(before: dict[str, Any], expect_dead: Sequence[weakref.ref] = (),
                   device: Any = None) -> dict[str, Any]:
    """The release step (see the module contracts): ``before`` is the :func:`memory_reading` taken before the
    caller dropped what ``expect_dead`` points at."""
    alive = [r for r in expect_dead if r() is not None]
    gc_needed = bool(alive)
    if gc_needed:
        gc.collect()
        alive = [r for r in alive if r() is not None]
    cuda = _cuda()
    if cuda is not None:
        try:
            cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
    still = [type(o).__name__ for r in alive if (o := r()) is not None]
    return {"before": before, "after": memory_reading(device), "gc_needed": gc_needed, "still_alive": still}
