"""Readings the actor shell posts to its core (``libra.actors.state``): a GPU's NVML sample and the rollout
engine's KV use, and the credit the core bids from the latter. Plain values, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuSampled", "KvUse", "kv_credit"]


@dataclass(frozen=True, slots=True)
class GpuSampled:
    """A new NVML sample of this slot's GPU (``libra.actors.gpu_stats``): sent to the broker at once."""

    gpu: dict[str, float]


@dataclass(frozen=True, slots=True)
class KvUse:
    """The rollout engine's KV reading after a batch (``libra.engines.kv_use``): ``used`` fraction (0..1) of its
    KV budget, held by ``seqs`` sequences. Raises ``ValueError`` for a reading outside those ranges."""

    used: float
    seqs: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.used <= 1.0 or self.seqs < 0:
            raise ValueError(f"KvUse needs 0 <= used <= 1 and seqs >= 0, got used={self.used!r}, seqs={self.seqs!r}")


def kv_credit(used: float, seqs: int, base: int) -> int:
    """Sequences of the current mean size that fit the whole KV budget (``seqs / used``), within ``[1, base]``;
    ``base`` when nothing is held (no size to go by)."""
    if seqs <= 0 or used <= 0.0:
        return base
    return max(1, min(base, int(seqs / used)))
