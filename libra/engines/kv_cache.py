"""Per-trajectory contexts a rollout instance keeps between turns: token ids, their digest and the KV cache.

Role: a sticky trajectory's next turn prefills only the tokens its instance has not seen
(``HFRolloutEngine`` reads and refills this cache), and a trajectory that moved to another instance can take
its context along (:func:`pack_context` / :func:`unpack_context`, sent over the data plane).

Contracts:

- :class:`KVCache` maps a key (the trajectory id) to a :class:`ContextEntry`: the whole context as token ids,
  its :class:`~libra.protocol.payloads_rollout.ContextDigest`, and the KV tensors of its first ``kv_len``
  tokens (one ``(keys, values)`` pair per layer, each ``[1, kv_heads, kv_len, head_dim]``) computed with
  weights ``version``. ``kv_len`` is ``len(ids) - 1`` after a turn: the last generated token was sampled but
  never fed through the model.
- Bounded by ``budget_bytes`` (the KV tensors' bytes plus 4 bytes per token id): inserting evicts least
  recently used entries until the total fits. An entry larger than the whole budget keeps its ids and drops
  its KV (a later turn re-prefills from the ids, no fetch needed). Stored tensors are never modified in place.
- Thread safe (one lock): the batcher thread reads and writes entries while the data-plane thread exports.
- The engine reuses KV only for a prompt whose first ``kv_len`` ids equal the entry's, and only with the
  weights version that computed it: nothing is generated from a wrong or stale context.

Not in this module: the model, the decode loop, sockets.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from libra.protocol.payloads_rollout import ContextDigest

__all__ = ["ContextEntry", "KVCache", "pack_context", "unpack_context"]

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True, slots=True)
class ContextEntry:
    """One trajectory's context (see the module contracts)."""

    ids: array  # uint32 token ids of the whole context
    digest: ContextDigest  # of ``ids``; callers extend copies, never this object
    kv: KV | None  # per layer (keys, values) of the first kv_len tokens, or None (ids only)
    kv_len: int
    version: int  # the weights version the KV was computed with

    @property
    def nbytes(self) -> int:
        kv = sum(k.nbytes + v.nbytes for k, v in self.kv) if self.kv is not None else 0
        return kv + 4 * len(self.ids)

    def without_kv(self) -> ContextEntry:
        return ContextEntry(self.ids, self.digest, None, 0, self.version)

    def kv_prefix_matches(self, prompt: Sequence[int]) -> bool:
        """Whether the first ``kv_len`` ids of ``prompt`` are this entry's (so its KV may be reused)."""
        n = self.kv_len
        return n > 0 and len(prompt) > n and array(self.ids.typecode, prompt[:n]) == self.ids[:n]


class KVCache:
    """An LRU map of trajectory contexts bounded by bytes (see the module contracts)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"KVCache.budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[str, ContextEntry] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "kv_dropped": 0}

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self._used)

    def use(self) -> tuple[float, int]:
        """``(used fraction of the budget, contexts held)``: what the actor's KV re-bid reads after a batch
        (``libra.engines.kv_use``). A zero budget reads as fully used when it holds anything."""
        with self._lock:
            n, used = len(self._entries), self._used
        if self.budget_bytes <= 0:
            return (1.0 if n else 0.0), n
        return min(1.0, used / self.budget_bytes), n

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def get(self, key: str, *, touch: bool = True) -> ContextEntry | None:
        """The entry for ``key`` (marked most recently used unless ``touch`` is False), or None."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None and touch:
                self._entries.move_to_end(key)
            return e

    def put(self, key: str, entry: ContextEntry) -> list[str]:
        """Insert or replace ``key``; returns the keys evicted to fit the budget."""
        if entry.nbytes > self.budget_bytes and entry.kv is not None:
            entry = entry.without_kv()
            self.stats["kv_dropped"] += 1
        evicted: list[str] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.nbytes
            while self._entries and self._used + entry.nbytes > self.budget_bytes:
                k, e = self._entries.popitem(last=False)
                self._used -= e.nbytes
                evicted.append(k)
            if entry.nbytes <= self.budget_bytes:
                self._entries[key] = entry
                self._used += entry.nbytes
            self.stats["evictions"] += len(evicted)
        return evicted

    def drop(self, key: str) -> None:
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self._used -= e.nbytes

    def clear(self) -> None:
        """Drop every entry (its KV tensors with it): the engine that owns the cache is closing."""
        with self._lock:
            self._entries.clear()
            self._used = 0

    def drop_kv(self) -> None:
        """Keep every entry's ids, drop all KV (new weights make the cached KV stale)."""
        with self._lock:
            for k, e in list(self._entries.items()):
                if e.kv is not None:
                    self._entries[k] = e.without_kv()
            self._used = sum(e.nbytes for e in self._entries.values())


def pack_context(entry: ContextEntry, *, with_kv: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, metadata)`` of an entry for :func:`libra.weights.format.pack_state_dict`: ``ids`` (int64),
    and with ``with_kv`` ``k.L``/``v.L`` per layer; metadata ``digest``, ``kv_len``, ``version``, ``layers``."""
    tensors: dict[str, torch.Tensor] = {"ids": torch.tensor(entry.ids.tolist(), dtype=torch.int64)}
    kv_len = 0
    if with_kv and entry.kv is not None:
        kv_len = entry.kv_len
        for i, (k, v) in enumerate(entry.kv):
            tensors[f"k.{i}"], tensors[f"v.{i}"] = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
    meta = {"digest": entry.digest.hexdigest(), "kv_len": kv_len, "version": entry.version,
            "layers": len(entry.kv) if kv_len else 0}
    return tensors, meta


def unpack_context(tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                   device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> ContextEntry:
    """The entry :func:`pack_context` described. Raises ``ValueError`` when the ids do not hash to the stated
    digest or the KV does not cover ``kv_len`` tokens."""
    ids = array("I", tensors["ids"].tolist())
    digest = ContextDigest(ids)
    if digest.hexdigest() != meta.get("digest"):
        raise ValueError("context ids do not match their digest")
    layers, kv_len = int(meta.get("layers", 0)), int(meta.get("kv_len", 0))
    kv: KV | None = None
    if layers:
        pairs = []
        for i in range(layers):
            k, v = tensors[f"k.{i}"], tensors[f"v.{i}"]
            if k.shape[-2] != kv_len or v.shape[-2] != kv_len or kv_len >= len(ids) + 1:
                raise ValueError(f"layer {i}: KV covers {k.shape[-2]} tokens, metadata says {kv_len}")
            pairs.append((k.to(device=device, dtype=dtype or k.dtype), v.to(device=device, dtype=dtype or v.dtype)))
        kv = tuple(pairs)
    return ContextEntry(ids, digest, kv, kv_len if kv is not None else 0, int(meta.get("version", -1)))
