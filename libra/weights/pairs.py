"""The two-member process groups of :mod:`libra.weights.torch_dist`, made once per peer pair and kept.

A ``torch.distributed`` group costs a rendezvous and, for NCCL, a communicator with its GPU buffers; one made
per fetch and never destroyed leaked communicators for the whole job. So each end keeps one group per peer
and backend (the publisher keys it by the fetcher's identity, the fetcher by the publisher's endpoint) and
reuses it for every later version.

Generations: the publisher numbers every group it forms (``gen``, unique for its lifetime) and names the
group's rendezvous keys after it (``pair/PEER/BACKEND/GEN/`` in its store). A fetcher tells the publisher
which generation it still holds; the publisher answers with the generation to use: the same one (both reuse
their group), or a new one (both form a fresh group, each destroying the one it held for that key). So an end
that lost its group (a failed broadcast, a restart) never waits on a peer that kept the old one.

Contracts: a group is destroyed exactly once: at :meth:`PairGroups.drop` (after a failed collective: the
peer is gone), at :meth:`PairGroups.close`, or when a new generation replaces it. Every use of a group holds
that key's lock, so two collectives never interleave on one pair.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from libra.logging import get_logger

__all__ = ["PairGroups", "destroy_group", "make_pair_group"]

log = get_logger("libra.weights.pairs")


def make_pair_group(store: Any, prefix: str, rank: int, backend: str, timeout_s: float) -> Any:
    """A two-member group of ``backend`` (``gloo`` or ``nccl``) over ``store``'s keys under ``prefix``."""
    scoped = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(scoped, rank, 2)
    return dist.ProcessGroupGloo(scoped, rank, 2, datetime.timedelta(seconds=timeout_s))


def destroy_group(pg: Any, *, failed: bool = False) -> None:
    """Release ``pg``'s connections (and an NCCL communicator): ``abort`` after a failure (the peer may be
    gone, a clean shutdown could wait on it), else ``shutdown``, falling back to ``abort``."""
    for how in (("abort",) if failed else ("shutdown", "abort")):
        fn = getattr(pg, how, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except RuntimeError as exc:
            log.debug("pair_group_destroy_failed", how=how, error=str(exc))


class PairGroups:
    """One end's pair groups, one per key (see the module docstring). ``make(prefix)`` forms a group whose
    rendezvous keys live under ``prefix``. ``made`` and ``destroyed`` count groups over this object's life."""

    def __init__(self, make: Callable[[Any, str, str], Any]) -> None:
        self._make = make  # (store, prefix, backend) -> group
        self._groups: dict[Hashable, tuple[int, Any]] = {}
        self._locks: dict[Hashable, threading.Lock] = {}
        self._mu = threading.Lock()
        self.made = 0
        self.destroyed = 0

    def __len__(self) -> int:
        with self._mu:
            return len(self._groups)

    def generation(self, key: Hashable) -> int | None:
        """The generation of the group held for ``key`` (None: none held)."""
        with self._mu:
            held = self._groups.get(key)
        return held[0] if held is not None else None

    def _lock(self, key: Hashable) -> threading.Lock:
        with self._mu:
            return self._locks.setdefault(key, threading.Lock())

    @contextmanager
    def use(self, key: Hashable, gen: int, store: Any, prefix: str, backend: str) -> Iterator[Any]:
        """The group for ``key`` at generation ``gen`` (formed now under ``prefix`` unless held), with the
        key's lock held. A failure inside drops (aborts) the group and propagates."""
        with self._lock(key):
            with self._mu:
                held = self._groups.get(key)
            if held is None or held[0] != gen:
                if held is not None:
                    self._discard(key, held, failed=False)
                pg = self._make(store, prefix, backend)
                with self._mu:
                    self._groups[key] = (gen, pg)
                    self.made += 1
            else:
                pg = held[1]
            try:
                yield pg
            except BaseException:
                self.drop(key, failed=True, locked=True)
                raise

    def _discard(self, key: Hashable, held: tuple[int, Any], *, failed: bool) -> None:
        with self._mu:
            if self._groups.get(key) is not held:
                return
            del self._groups[key]
            self.destroyed += 1
        destroy_group(held[1], failed=failed)

    def drop(self, key: Hashable, *, failed: bool = False, locked: bool = False) -> bool:
        """Destroy the group held for ``key`` (``failed``: its peer is gone); whether one was held."""
        def go() -> bool:
            with self._mu:
                held = self._groups.get(key)
            if held is None:
                return False
            self._discard(key, held, failed=failed)
            return True

        if locked:
            return go()
        with self._lock(key):
            return go()

    def keys(self) -> list[Hashable]:
        with self._mu:
            return list(self._groups)

    def close(self) -> None:
        """Destroy every group held (a collective still running on one is aborted by its peer's failure)."""
        with self._mu:
            held = list(self._groups.items())
            self._groups.clear()
            self.destroyed += len(held)
        for _, (_, pg) in held:
            destroy_group(pg)
