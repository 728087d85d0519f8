"""The rollout side of delta weight sync: the last fully assembled weights version, kept in host memory.

Role: a rollout slot fetches ``weights/v{N}/from/v{M}`` (:mod:`libra.weights.delta`) instead of the whole
``weights/v{N}`` when it holds exactly ``v{M}``. What it holds is not its engine's weights but a
:class:`HostWeights`: the verified byte stream (:class:`~libra.weights.packed.PackedWeights`' chunks) of the
last version it fetched or assembled, and the trainer endpoint it came from.

Why the host, and what it costs:

- It is engine-agnostic: a delta is applied to these bytes and the engine gets an ordinary full
  :class:`~libra.weights.packed.PackedWeights`, so the HF and vLLM engines load it unchanged (no engine has
  to expose, patch or read back its own tensors, which a vLLM engine would make hard and a GPU copy slow).
- It outlives the engine: a borrowed slot whose engine is released when the owner reclaims the GPU
  (``HybridRole.reconfigure(kinds=[])``) keeps its :class:`HostWeights` (held by the ``HybridRole``, handed to
  each ``RolloutRole`` it builds), so when it is lent again it catches up by delta from the version it held.
- Cost: one copy of the model in the *exported* dtype in host RAM per rollout slot (4 bytes a parameter from
  a CPU fp32 trainer, 2 from a bf16 GPU trainer: 0.27 GB for a 135M model in bf16, 14 GB for 7B), and a
  second one while a delta is being applied (the new version is assembled beside the base, which is then
  dropped). ``$LIBRA_WEIGHTS_DELTA=0`` keeps none (every version is then fetched whole).

Contracts: :class:`HostWeights` holds no reference to a role or an engine (no cycle; a closed engine is
freed by refcount); it is thread safe. :class:`SyncStats` is what one data-plane weights fetch reports: its
``mode`` (``delta``, ``full``, or ``host`` when the version asked for was already held), the bytes and
seconds of every transfer it made (a delta that failed and the full object after it), and the delta's error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .packed import PackedWeights

__all__ = ["HostWeights", "SyncStats"]


@dataclass(slots=True)
class SyncStats:
    """One weights fetch over the data plane (see the module contracts). ``seconds``: transfers and delta
    application; ``apply_s``: the delta's application alone; ``nbytes``: the chunks' bytes (as
    :class:`~libra.dataplane.FetchStats`), ``header_bytes``: the headers' (a delta's holds the version's own)."""

    seconds: float = 0.0
    nbytes: int = 0
    header_bytes: int = 0
    chunks: int = 0
    requests: int = 0
    mode: str = "full"
    apply_s: float = 0.0
    delta_error: str | None = None


class HostWeights:
    """The last assembled weights version of a slot: ``(source endpoint, PackedWeights)`` or nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._source: str | None = None
        self._held: PackedWeights | None = None

    def get(self, source: str) -> PackedWeights | None:
        """The version held, if it came from ``source`` (a trainer's data-plane endpoint)."""
        with self._lock:
            return self._held if self._held is not None and self._source == source else None

    def clear(self) -> None:
        """Hold nothing (the trainer serves no deltas: the copy would only cost memory)."""
        with self._lock:
            self._source, self._held = None, None

    def put(self, source: str, weights: PackedWeights) -> None:
        """Hold ``weights`` (from ``source``) instead of the previous version; keeps a copy of the view with no
        decoded tensors, so what an engine decodes is never kept here."""
        held = weights.fresh()
        with self._lock:
            self._source, self._held = source, held

    def clear(self) -> None:
        with self._lock:
            self._source, self._held = None, None

    @property
    def version(self) -> int | None:
        """The version held (None: nothing)."""
        held = self._held
        return held.version if held is not None else None

    @property
    def nbytes(self) -> int:
        """Host bytes the version held takes (0: nothing)."""
        held = self._held
        return held.nbytes() if held is not None else 0
