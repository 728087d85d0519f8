"""EARL parallelism selector: pick the rollout TP degree from the average context length and the load.

Role: docs/papers.md §3.2.1 / §4 item 17. An offline profile table ``TGS[config][context range][load]``
(tokens per GPU per second) names the best rollout TP for each context range at each load; during
training the selector watches the average context per step and switches the rollout TP when the
average enters a new range. An OOM guard never returns a TP that runs out of memory at the current
context and load: it goes to the next larger TP instead.

Two table sources:

- :func:`build_profile_table` profiles a :class:`~libra.policies.cost.rollout.RolloutCostModel`:
  TGS is the batch throughput of ``load`` responses of the given context dealt round-robin to
  ``n_gpus // tp`` instances (the same batch model the rollout cost model is calibrated on), OOM means
  an instance cannot hold its responses' KV at once. Range boundaries are placed at the crossover
  points (found by bisection), so within a range the table's choice is the best non-OOM TP.
- :func:`earl_fig3_table` is the EARL paper's Fig. 3 (TP4 vs TP8, Qwen2.5-72B on H100) as relative
  TGS, with TP4 marked OOM at 32K context and 128 responses.

Pure: no clocks or I/O; :class:`ParallelismSelector` keeps only the current choice and range.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from libra.policies.cost.rollout import CALIBRATION_PROMPT_FRACTION, RolloutCostModel

__all__ = [
    "ParallelismError",
    "ParallelismSelector",
    "ProfileRow",
    "ProfileTable",
    "Selection",
    "batch_tgs",
    "build_profile_table",
    "earl_fig3_table",
    "make_selector",
]


class ParallelismError(ValueError):
    """Bad selector input or table (the message names the value)."""


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One context range ``[lo, hi)`` at one load: TGS per config (measured at ``probe``), the configs
    that OOM there, and the best non-OOM config (None if every config OOMs)."""

    lo: float
    hi: float
    probe: float
    tgs: Mapping[int, float]
    oom: frozenset[int]
    best: int | None


@dataclass(frozen=True, slots=True)
class ProfileTable:
    """``rows[load]``: contiguous :class:`ProfileRow` ranges covering ``[0, inf)`` for each profiled load."""

    configs: tuple[int, ...]
    rows: Mapping[int, tuple[ProfileRow, ...]]

    @property
    def loads(self) -> tuple[int, ...]:
        """Profiled loads (concurrent responses), ascending."""
        return tuple(sorted(self.rows))

    def load_key(self, load: float) -> int:
        """The profiled load used for ``load``: the smallest one >= it (the largest if none)."""
        if load <= 0:
            raise ParallelismError(f"load must be > 0, got {load!r}")
        loads = self.loads
        i = bisect.bisect_left(loads, load)
        return loads[min(i, len(loads) - 1)]

    def row(self, context: float, load: float) -> tuple[int, int, ProfileRow]:
        """``(load_key, range_index, row)`` for an average context and a load."""
        if not context > 0:
            raise ParallelismError(f"context must be > 0, got {context!r}")
        key = self.load_key(load)
        rows = self.rows[key]
        idx = bisect.bisect_right([r.lo for r in rows], context) - 1
        return key, max(idx, 0), rows[max(idx, 0)]

    def tgs(self, config: int, context: float, load: float) -> float:
        """``TGS[config][range of context][load]`` (0.0 where the config OOMs)."""
        _, _, row = self.row(context, load)
        return 0.0 if config in row.oom else float(row.tgs.get(config, 0.0))


def batch_tgs(
    cm: RolloutCostModel,
    tp: int,
    context: float,
    load: int,
    n_gpus: int,
    prompt_fraction: float = CALIBRATION_PROMPT_FRACTION,
) -> tuple[float, bool]:
    """``(tokens per GPU per second, oom)`` for ``load`` responses of ``context`` tokens on ``n_gpus``
    GPUs as TP-``tp`` instances (responses dealt round-robin; the busiest instance sets the makespan).
    ``oom`` is True when that instance cannot hold all its responses' KV at once."""
    instances = n_gpus // tp
    if instances < 1:
        return 0.0, True
    per = math.ceil(load / instances)
    if not cm.fits_load(tp, context, per):
        return 0.0, True
    total = per * context
    makespan = float(cm.segment_cost(tp, prompt_fraction * total, (1 - prompt_fraction) * total, per, context))
    if not math.isfinite(makespan) or makespan <= 0:
        return 0.0, True
    return load * context / makespan / n_gpus, False


def _best(values: dict[int, tuple[float, bool]]) -> int | None:
    ok = [(v, -tp) for tp, (v, oom) in values.items() if not oom and v > 0]
    return -max(ok)[1] if ok else None


def build_profile_table(
    cm: RolloutCostModel,
    n_gpus: int,
    *,
    configs: tuple[int, ...] = (1, 2, 4, 8),
    loads: tuple[int, ...] = (8, 16, 32, 64, 128),
    min_context: float = 256.0,
    max_context: float = 131072.0,
    points_per_octave: int = 8,
) -> ProfileTable:
    """Profile ``cm`` into a table whose ranges end where the best non-OOM config changes.

    Raises :class:`ParallelismError` if no config fits on ``n_gpus`` or the context bounds are bad.
    """
    configs = tuple(sorted(c for c in set(configs) if c <= n_gpus))
    if not configs:
        raise ParallelismError(f"no config in {configs!r} fits on n_gpus={n_gpus}")
    if not 0 < min_context < max_context:
        raise ParallelismError(f"need 0 < min_context < max_context, got {min_context}, {max_context}")
    octaves = math.log2(max_context / min_context)
    grid = np.geomspace(min_context, max_context, math.ceil(octaves * points_per_octave) + 1)
    rows: dict[int, tuple[ProfileRow, ...]] = {}
    for load in sorted(set(loads)):

        def probe(ctx: float, load: int = load) -> dict[int, tuple[float, bool]]:
            return {tp: batch_tgs(cm, tp, ctx, load, n_gpus) for tp in configs}

        bests = [_best(probe(float(c))) for c in grid]
        cuts: list[float] = []
        for a, b, ba, bb in zip(grid[:-1], grid[1:], bests[:-1], bests[1:]):
            if ba == bb:
                continue
            lo, hi = float(a), float(b)
            for _ in range(60):
                mid = math.sqrt(lo * hi)
                if _best(probe(mid)) == ba:
                    lo = mid
                else:
                    hi = mid
            cuts.append(hi)
        edges = [0.0, *cuts, math.inf]
        out = []
        for lo, hi in itertools.pairwise(edges):
            at = min(max(math.sqrt(max(lo, min_context) * min(hi, max_context)), min_context), max_context)
            vals = probe(at)
            out.append(
                ProfileRow(
                    lo,
                    hi,
                    at,
                    {t: v for t, (v, _) in vals.items()},
                    frozenset(t for t, (_, o) in vals.items() if o),
                    _best(vals),
                )
            )
        rows[load] = tuple(out)
    return ProfileTable(configs, rows)


#: EARL Fig. 3: Speedup%(TP4 -> TP8) by context (rows) and number of responses (columns); None = TP4 OOM.
EARL_FIG3: dict[int, dict[int, float | None]] = {
    32768: {8: -1.5, 16: 4.6, 32: 5.0, 64: 6.5, 128: None},
    16384: {8: -18.8, 16: -5.0, 32: 3.4, 64: 5.5, 128: 3.1},
    8192: {8: -24.7, 16: -20.8, 32: -4.4, 64: 6.4, 128: 5.2},
    4096: {8: -18.0, 16: -25.2, 32: -21.9, 64: -5.9, 128: 5.1},
    2048: {8: -20.0, 16: -28.6, 32: -26.3, 64: -16.6, 128: -5.5},
    1024: {8: -21.1, 16: -32.2, 32: -30.7, 64: -29.1, 128: -6.9},
}


def earl_fig3_table() -> ProfileTable:
    """The EARL Fig. 3 numbers as a table of relative TGS (TP4 = 1.0, TP8 = 1 + speedup).

    Each measured context ``c`` covers ``[c / sqrt(2), c * sqrt(2))`` (the first row from 0, the last
    to infinity); where the paper reports TP4 OOM, TP4 is marked OOM.
    """
    contexts = sorted(EARL_FIG3)
    rows: dict[int, tuple[ProfileRow, ...]] = {}
    for load in (8, 16, 32, 64, 128):
        out = []
        for k, ctx in enumerate(contexts):
            lo = 0.0 if k == 0 else ctx / math.sqrt(2)
            hi = math.inf if k == len(contexts) - 1 else contexts[k + 1] / math.sqrt(2)
            speedup = EARL_FIG3[ctx][load]
            if speedup is None:
                tgs, oom, best = {4: 0.0, 8: 1.0}, frozenset({4}), 8
            else:
                tgs, oom = {4: 1.0, 8: 1.0 + speedup / 100.0}, frozenset()
                best = 8 if tgs[8] > tgs[4] else 4
            out.append(ProfileRow(lo, hi, float(ctx), tgs, oom, best))
        rows[load] = tuple(out)
    return ProfileTable((4, 8), rows)


@dataclass(frozen=True, slots=True)
class Selection:
    """The selector's answer for one step: the TP, whether it changed, why, and whether even the
    chosen TP OOMs (only when every config does; ``reason == "all_configs_oom"``)."""

    tp: int
    switched: bool
    reason: str
    range_lo: float
    range_hi: float
    oom: bool = False


OomCheck = Callable[[int, float, int], bool]


class ParallelismSelector:
    """EARL's rule over a :class:`ProfileTable`.

    ``oom_check(tp, context, load)`` is the exact OOM guard at the current point (default: the
    table's OOM marks for the range). Mutation rule: only :meth:`select` changes ``current`` and the
    remembered range.
    """

    def __init__(
        self, table: ProfileTable, *, oom_check: OomCheck | None = None, initial_tp: int | None = None
    ) -> None:
        if initial_tp is not None and initial_tp not in table.configs:
            raise ParallelismError(f"initial_tp={initial_tp} not in table configs {table.configs}")
        self.table = table
        self.oom_check = oom_check
        self.current = initial_tp
        self._range: tuple[int, int] | None = None

    def _ooms(self, tp: int, context: float, load: int, row: ProfileRow) -> bool:
        if self.oom_check is not None:
            return self.oom_check(tp, context, load)
        return tp in row.oom

    @property
    def range(self) -> tuple[int, int] | None:
        """``(load_key, range_index)`` of the last :meth:`select` (None before the first)."""
        return self._range

    def range_of(self, context: float, load: float) -> tuple[int, int]:
        """``(load_key, range_index)`` that ``(context, load)`` falls in (no state change)."""
        key, idx, _ = self.table.row(context, load)
        return key, idx

    def ooms(self, tp: int, context: float, load: int) -> bool:
        """Whether TP ``tp`` runs out of memory at ``(context, load)`` (the OOM guard's own test)."""
        _, _, row = self.table.row(context, load)
        return self._ooms(tp, context, load, row)

    def select(self, avg_context: float, load: int) -> Selection:
        """The rollout TP for the next rollout stage given this step's average context and load.

        Switches to the range's best config when the average enters a new range; otherwise keeps
        the current TP. Either way, a TP that OOMs at ``(avg_context, load)`` is replaced by the
        next larger one that does not. Raises :class:`ParallelismError` on a non-positive input.
        """
        key, idx, row = self.table.row(avg_context, load)
        previous = self.current
        entered = self._range != (key, idx)
        self._range = (key, idx)
        want = row.best if (entered or self.current is None) else self.current
        reason = "range_changed" if entered else "same_range"
        if want is None:
            want = self.table.configs[-1]
        if self._ooms(want, avg_context, load, row):
            larger = [c for c in self.table.configs if c > want and not self._ooms(c, avg_context, load, row)]
            if larger:
                want, reason = larger[0], "oom_guard"
            else:
                fits = [c for c in self.table.configs if not self._ooms(c, avg_context, load, row)]
                if fits:
                    want, reason = fits[-1], "oom_guard"
                else:
                    self.current = self.table.configs[-1]
                    return Selection(self.current, self.current != previous, "all_configs_oom", row.lo, row.hi, True)
        self.current = want
        return Selection(want, want != previous, reason, row.lo, row.hi)


def make_selector(
    cm: RolloutCostModel | None = None,
    n_gpus: int = 8,
    *,
    source: str = "cost_model",
    configs: tuple[int, ...] = (1, 2, 4, 8),
    loads: tuple[int, ...] = (8, 16, 32, 64, 128),
) -> ParallelismSelector:
    """A selector over a cost-model profile (``source="cost_model"``, exact OOM guard from ``cm``) or
    the EARL Fig. 3 table (``source="earl_fig3"``). Raises ``ValueError`` on an unknown source."""
    if source == "earl_fig3":
        return ParallelismSelector(earl_fig3_table())
    if source != "cost_model":
        raise ValueError(f"unknown parallelism table source: {source!r} (known: cost_model, earl_fig3)")
    if cm is None:
        raise ParallelismError("source='cost_model' needs a RolloutCostModel")
    table = build_profile_table(cm, n_gpus, configs=configs, loads=loads)

    def oom(tp: int, context: float, load: int) -> bool:
        return batch_tgs(cm, tp, context, load, n_gpus)[1]

    return ParallelismSelector(table, oom_check=oom)
