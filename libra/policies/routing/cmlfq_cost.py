"""``cmlfq_cost``: distribution- and cost-based C-MLFQ (docs/papers.md §1.4.3, last paragraph).

Same causal prefix tree, tool-state keys, learning and fallbacks as :class:`~libra.policies.routing.cmlfq.CMLFQRouter`;
only the move rule differs. After a tool return, instead of "migrate iff bucket(mean) == bucket(p90) !=
current", the router looks at the *distribution* of remaining response lengths at the matched node (its
window of the last ``window_size``, default 200, samples) as a histogram with one bin per bucket
(bin ``i``: ``max_tokens[i-1] < r <= max_tokens[i]``; the last bin is open) and picks the instance minimising

    expected_s(inst) = sum_bins P(bin) * decode_seconds(inst, bin) + movement_seconds(home -> inst)

over the trajectory's home instance (movement 0) and, for every other bucket, the instance the base class
would move it to (least loaded among ready instances with room, :meth:`StickyRouter._room_in`). Ties, and
savings of at most ``min_gain_s``, keep it home (reason ``stay_cheaper``; ``migrate`` otherwise). A move is
committed only into an instance with room, so nothing is reserved that can fail: the move is transactional
in the sense that the logical bucket changes exactly when the context moves.

``decode_seconds(inst, bin)`` is the time to decode the bin's remaining *generated* tokens (its mean
remaining response times the learned generated share of a response) on that instance at its current load::

    b = active + queued + 1                       # running sequences with this one
    kv = (b - 1) * ctx_others + ctx + r_gen / 2   # KV tokens (ctx_others: mean context of the others homed there)
    per_token = decode_step(tp, b, kv) + b * (request_overhead + prefill(tp, payload_per_turn)) / gen_per_turn
    decode_seconds = r_gen * per_token * max(1, kv / token_capacity(tp))

The second term is the serial per-turn stall every running sequence's turn boundary charges the whole
instance (the simulator's ``SimInstance.charge``); the last factor is the KV overflow (sequences wait for KV
room). ``movement_seconds`` is the cost of the mode ``choose_mode`` picks for the move (KV transfer or
re-prefill of the current context on the target; re-prefill when the home instance is gone).
``gen_per_turn``, ``payload_per_turn`` and the generated share are learned from finished trajectories
(priors until ``learn_after`` have finished).

Initial placement: ``initial="cost"`` (the default: the same expected cost at the tree root, with the
prompt's prefill on the target as its movement) or ``"smallest"`` (C-MLFQ's rule). Fallbacks as C-MLFQ: no
statistics (``no_stats``) stays; with no candidate at all (home gone, no room anywhere) the bucket of the
mean (``no_room``), which the base class places with its usual fallbacks.

Costs come from a :class:`RouterCosts` object passed at construction (the simulator passes its
:class:`~libra.sim.cluster.InstanceCosts`); :func:`cost_model_costs` builds one from the analytic
:class:`~libra.policies.cost.RolloutCostModel`. Pure: no I/O, clocks or threads (``hardware``/``model``
profile names are resolved once at construction when no ``costs`` object is given).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from libra.policies.routing.cmlfq import CMLFQRouter, tool_state_key
from libra.policies.routing.prefix_tree import CausalPrefixTree
from libra.policies.routing.sticky import Track
from libra.policies.routing.interface import (
    BucketSpec,
    CapMetric,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrateMode,
    MigrationQuery,
    RouteDecision,
    ToolReturn,
    TrajectoryInfo,
    WhenFull,
    bucket_index_for,
    heuristic_migrate_mode,
)
from libra.policies.routing.tool_state import DEFAULT_THRESHOLDS, SizeThresholds

__all__ = ["CostCMLFQRouter", "ModelRouterCosts", "RouterCosts", "cost_model_costs", "histogram"]

Initial = Literal["smallest", "cost"]


class RouterCosts(Protocol):
    """Pure cost callbacks, seconds (the simulator's ``InstanceCosts`` satisfies this)."""

    request_overhead_s: float

    def decode_step(self, tp: int, seqs: int, tokens: float) -> float: ...

    def prefill(self, tp: int, tokens: float) -> float: ...

    def token_capacity(self, tp: int) -> float: ...

    def kv_seconds(self, q: MigrationQuery) -> float: ...

    def reprefill_seconds(self, q: MigrationQuery) -> float: ...


class ModelRouterCosts:
    """:class:`RouterCosts` on a :class:`~libra.policies.cost.RolloutCostModel` (KV moves at
    ``kv_bw_same_node``/``kv_bw_cross_node`` bytes/s plus ``kv_fixed_s``, as the simulator charges them)."""

    def __init__(self, cm: Any, *, kv_bw_same_node: float = 25e9, kv_bw_cross_node: float = 10e9,
                 kv_fixed_s: float = 0.02) -> None:
        self.cm = cm
        self.request_overhead_s = float(cm.cal.per_request_overhead_s)
        self._bw = (kv_bw_cross_node, kv_bw_same_node)
        self._fixed = kv_fixed_s
        self._kv_bytes = float(cm.kv_bytes_per_token(1))

    def decode_step(self, tp: int, seqs: int, tokens: float) -> float:
        return float(self.cm.decode_step(tp, max(1, seqs), tokens))

    def prefill(self, tp: int, tokens: float) -> float:
        return float(self.cm.prefill_time(tp, tokens)) if tokens > 0 else 0.0

    def token_capacity(self, tp: int) -> float:
        return float(self.cm.token_capacity(tp))

    def kv_seconds(self, q: MigrationQuery) -> float:
        return self._fixed + q.seq_len * self._kv_bytes / self._bw[q.same_node]

    def reprefill_seconds(self, q: MigrationQuery) -> float:
        return self.prefill(q.dst_tp, q.seq_len)


def cost_model_costs(hardware: str = "a800", model: str = "qwen3-14b") -> ModelRouterCosts:
    """:class:`ModelRouterCosts` of the named hardware and model profiles (reads the profile files once)."""
    from libra.policies.cost import RolloutCostModel, load_hardware, load_model

    return ModelRouterCosts(RolloutCostModel(load_hardware(hardware), load_model(model)))


def histogram(samples: Sequence[float], buckets: Sequence[BucketSpec]) -> list[tuple[float, float]]:
    """``(probability, mean remaining)`` of the non-empty bins, one bin per bucket (see the module docstring).

    Empty ``samples`` give ``[]``."""
    n = len(samples)
    sums = [0.0] * len(buckets)
    counts = [0] * len(buckets)
    for r in samples:
        i = bucket_index_for(r, buckets)
        sums[i] += r
        counts[i] += 1
    return [(c / n, s / c) for s, c in zip(sums, counts) if c]


class CostCMLFQRouter(CMLFQRouter):
    """Distribution- and cost-based C-MLFQ (see the module docstring).

    Extra parameters: ``costs`` (a :class:`RouterCosts`; else built from ``hardware``/``model``),
    ``initial`` (``"smallest"`` or ``"cost"``), ``min_gain_s`` (seconds a move must save beyond its cost;
    ties always stay), priors ``gen_per_turn``/``payload_per_turn``/``gen_share`` and ``learn_after``
    (finished trajectories before the learned values replace the priors). Other parameters as
    :class:`CMLFQRouter`. Raises :class:`ClusterViewError` for bad values.
    """

    name = "cmlfq_cost"
    commit_when_full = False  # moves go only to instances with room, so the logical bucket moves with the context

    def __init__(self, *, costs: RouterCosts | None = None, hardware: str = "a800", model: str = "qwen3-14b",
                 initial: Initial = "cost", min_gain_s: float = 0.0, gen_per_turn: float = 512.0,
                 payload_per_turn: float = 1000.0, gen_share: float = 0.5, learn_after: int = 16,
                 tree: CausalPrefixTree | None = None, thresholds: SizeThresholds = DEFAULT_THRESHOLDS,
                 min_visits: int = 1, window_size: int = 200, max_prompts: int = 10_000, history_size: int = 5000,
                 rebuild_interval: int = 50, max_queue_length: int = 3, cap_metric: CapMetric = "queued",
                 when_full: WhenFull = "overflow",
                 choose_mode: Callable[[MigrationQuery], MigrateMode] = heuristic_migrate_mode) -> None:
        # The C-MLFQ parameters are spelled out (not **params) so that make_router can check names.
        super().__init__(tree=tree, thresholds=thresholds, min_visits=min_visits, window_size=window_size,
                         max_prompts=max_prompts, history_size=history_size, rebuild_interval=rebuild_interval,
                         max_queue_length=max_queue_length, cap_metric=cap_metric, when_full=when_full,
                         choose_mode=choose_mode)
        if initial not in ("smallest", "cost"):
            raise ClusterViewError(f"initial must be 'smallest' or 'cost', got {initial!r}")
        if not (min_gain_s >= 0 and gen_per_turn > 0 and payload_per_turn >= 0 and 0 < gen_share <= 1):
            raise ClusterViewError("need min_gain_s >= 0, gen_per_turn > 0, payload_per_turn >= 0, 0 < gen_share <= 1")
        self.costs: RouterCosts = costs if costs is not None else cost_model_costs(hardware, model)
        self.initial: Initial = initial
        self.min_gain_s = float(min_gain_s)
        self._prior = (float(gen_per_turn), float(payload_per_turn), float(gen_share))
        self.learn_after = int(learn_after)
        self._sums = [0, 0, 0, 0, 0]  # finished trajectories, turns, generated, payload, response tokens
        #: ``{instance id: expected seconds}`` behind the latest decision (for metrics and tests).
        self.last_costs: dict[str, float] = {}
        #: ``{instance id: (live trajectories homed there, their summed context)}`` (see :meth:`_share`).
        self._homed: dict[str, tuple[int, int]] = {}

    # -- learned per-turn shape -----------------------------------------------------------------------------

    def shape(self) -> tuple[float, float, float]:
        """``(generated tokens per turn, tool-returned tokens per turn, generated share of a response)``."""
        n, turns, gen, payload, resp = self._sums
        if n < self.learn_after or turns == 0 or resp == 0:
            return self._prior
        return max(1.0, gen / turns), payload / turns, max(1e-3, min(1.0, gen / resp))

    def _learn(self, track: Track, total_output_tokens: int) -> None:
        super()._learn(track, total_output_tokens)
        s = self._sums
        s[0] += 1
        s[1] += len(track.positions) + 1
        s[2] += track.generated
        s[3] += track.payload
        s[4] += max(total_output_tokens, track.generated)

    # -- costs -----------------------------------------------------------------------------------------------

    def _tp(self, inst: InstanceView, view: ClusterView) -> int:
        return view.buckets[view.bucket_index(inst.bucket)].tp

    # The per-instance load (trajectories homed there, their summed context) is kept incrementally: every
    # public entry point that changes a track takes the track's share out first and puts it back after, so
    # inside a decision ``_homed`` covers exactly the *other* live tracks, at O(1) per event instead of a
    # scan of every live trajectory per tool return.

    def _share(self, track: Track | None, sign: int) -> None:
        if track is None or track.instance is None:
            return
        n, c = self._homed.get(track.instance, (0, 0))
        n, c = n + sign, c + sign * track.context
        if n:
            self._homed[track.instance] = (n, c)
        else:
            self._homed.pop(track.instance, None)

    def start(self, traj: TrajectoryInfo, view: ClusterView) -> RouteDecision:
        decision = super().start(traj, view)
        self._share(self._tracks.get(traj.traj_id), +1)
        return decision

    def on_tool_return(self, traj_id: str, ret: ToolReturn, view: ClusterView) -> RouteDecision:
        track = self._tracks.get(traj_id)
        self._share(track, -1)
        try:
            return super().on_tool_return(traj_id, ret, view)
        finally:
            self._share(track, +1)

    def on_turn_end(self, traj_id: str, generated_tokens: int) -> None:
        track = self._tracks.get(traj_id)
        self._share(track, -1)
        try:
            super().on_turn_end(traj_id, generated_tokens)
        finally:
            self._share(track, +1)

    def reroute(self, traj_id: str, view: ClusterView) -> RouteDecision:
        track = self._tracks.get(traj_id)
        self._share(track, -1)
        try:
            return super().reroute(traj_id, view)
        finally:
            self._share(track, +1)

    def finish(self, traj_id: str, total_output_tokens: int) -> None:
        self._share(self._tracks.get(traj_id), -1)
        super().finish(traj_id, total_output_tokens)

    def discard(self, traj_id: str) -> None:
        self._share(self._tracks.get(traj_id), -1)
        super().discard(traj_id)

    def decode_seconds(self, inst: InstanceView, tp: int, remaining: float, context: float,
                       others: dict[str, tuple[int, int]]) -> float:
        """Seconds to decode ``remaining`` response tokens on ``inst`` at its load (module docstring)."""
        gen_turn, payload_turn, share = self.shape()
        r_gen = remaining * share
        b = inst.active + inst.queued + 1
        n, ctx_sum = others.get(inst.id, (0, 0))
        ctx_other = ctx_sum / n if n else context
        kv = (b - 1) * ctx_other + context + r_gen / 2
        c = self.costs
        stall = c.request_overhead_s + c.prefill(tp, payload_turn)
        per_token = c.decode_step(tp, b, kv) + b * stall / gen_turn
        cap = c.token_capacity(tp)
        overflow = max(1.0, kv / cap) if cap > 0 else float("inf")
        return r_gen * per_token * overflow

    def movement_seconds(self, context: int, home: InstanceView | None, dst: InstanceView, view: ClusterView) -> float:
        """Seconds to move ``context`` tokens from ``home`` to ``dst`` by the mode ``choose_mode`` picks
        (re-prefill when ``home`` is gone or not ready; 0 when ``dst`` is ``home``)."""
        if home is not None and dst.id == home.id:
            return 0.0
        dst_tp = self._tp(dst, view)
        if home is None or not home.ready:
            return self.costs.reprefill_seconds(MigrationQuery(context, False, dst_tp, dst_tp))
        q = MigrationQuery(context, home.node is not None and home.node == dst.node, self._tp(home, view), dst_tp)
        return self.costs.kv_seconds(q) if self.choose_mode(q) == "kv" else self.costs.reprefill_seconds(q)

    def _candidates(self, track: Track, view: ClusterView, current: int
                    ) -> tuple[InstanceView | None, InstanceView | None, list[InstanceView]]:
        """``(home, usable home, candidates)`` at a tool return: the trajectory's own instance when it is
        ready, then one instance with room in every other bucket (within the logical bucket the context
        stays home; the base class does not move it)."""
        home = view.instance(track.instance) if track.instance is not None else None
        usable = home if home is not None and home.ready else None
        cands = [usable] if usable is not None else []
        for b in range(len(view.buckets)):
            if b == current and usable is not None:
                continue
            inst = self._room_in(view, b)
            if inst is not None and (usable is None or inst.id != usable.id):
                cands.append(inst)
        return home, usable, cands

    def _choose(self, track: Track, hist: list[tuple[float, float]], home: InstanceView | None,
                cands: list[InstanceView], view: ClusterView, extra: Callable[[InstanceView], float]) -> InstanceView:
        """The candidate with the least expected seconds; the first candidate (home) wins ties and gains up to
        ``min_gain_s``. ``extra(inst)`` adds the movement or first-placement seconds."""
        others = self._homed  # the other live tracks (this one's share is out during a decision)
        costs: dict[str, float] = {}
        for inst in cands:
            tp = self._tp(inst, view)
            dec = sum(p * self.decode_seconds(inst, tp, r, track.context, others) for p, r in hist)
            costs[inst.id] = dec + extra(inst)
        self.last_costs = costs
        best = cands[0]
        for inst in cands[1:]:
            if costs[inst.id] < costs[best.id] - (self.min_gain_s if best is home else 0.0):
                best = inst
        return best

    # -- decisions -------------------------------------------------------------------------------------------

    def _initial_bucket(self, traj: TrajectoryInfo, view: ClusterView) -> tuple[int, str]:
        if self.initial == "smallest":
            return 0, "initial"
        found = self.tree.lookup_window(traj.prompt_id, (), min_visits=self.min_visits)
        self.last_estimate = found[0] if found is not None else None
        hist = histogram(found[1], view.buckets) if found is not None else []
        cands = [i for i in (self._room_in(view, b) for b in range(len(view.buckets))) if i is not None]
        if not hist or not cands:
            return 0, "initial"
        track = Track(traj, view.buckets[0].name, view.buckets[0].max_tokens, context=traj.prompt_tokens)
        best = self._choose(track, hist, None, cands, view,
                            lambda i: self.costs.prefill(self._tp(i, view), traj.prompt_tokens))
        return view.bucket_index(best.bucket), "initial_cost"

    def _decide(self, track: Track, ret: ToolReturn, view: ClusterView) -> tuple[int, str]:
        track.states.append(tool_state_key(ret, self.thresholds))
        current = view.bucket_index(track.bucket)
        found = self.tree.lookup_window(track.info.prompt_id, track.states, min_visits=self.min_visits)
        self.last_estimate = found[0] if found is not None else None
        if found is None:
            return current, "no_stats"
        est, window = found
        hist = histogram(window, view.buckets)
        home, usable, cands = self._candidates(track, view, current)
        if not cands or not hist:
            return bucket_index_for(est.mean, view.buckets), "no_room"
        best = self._choose(track, hist, usable, cands, view,
                            lambda i: self.movement_seconds(track.context, home, i, view))
        if usable is not None and best.id == usable.id:
            return current, "stay_cheaper"
        return view.bucket_index(best.bucket), "migrate"
