"""Offline routing-accuracy estimators: how predictable a trace's remaining lengths are, and from what.

:func:`routing_accuracy` replays a trace step by step and scores three simple length routers on the
tool-return decisions, so a workload generator can be checked for the property C-MLFQ relies on: the
tool-return-state prefix predicts the remaining response length, the prompt's own features do not.
These are calibration diagnostics, not the routers themselves (those live in ``libra/policies/``).
Pure functions: no I/O, no randomness, no clocks.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from libra.traces import TrajectorySpec

TREE_WINDOW = 200
"""Observations kept per prefix node (C-MLFQ's window)."""

_Key = tuple[Any, ...]


def bucket_of(value: float, thresholds: Sequence[int]) -> int:
    """Index of the first threshold ``>= value``; the last bucket when none is."""
    for i, thr in enumerate(thresholds):
        if value <= thr:
            return i
    return len(thresholds) - 1


def _mean_p90(values: Sequence[int]) -> tuple[float, float]:
    ordered = sorted(values)
    return sum(ordered) / len(ordered), float(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))])


class _Replay:
    """State of one replay: prefix trees and prompt-feature history built from finished steps.

    Mutation rule: :meth:`learn` adds a finished step; :meth:`score_step` only reads.
    """

    def __init__(self, thresholds: Sequence[int], size_thresholds: tuple[int, int]) -> None:
        self.thresholds = thresholds
        self.size_thresholds = size_thresholds
        self.global_tree: dict[_Key, deque[int]] = defaultdict(lambda: deque(maxlen=TREE_WINDOW))
        self.prompt_tree: dict[_Key, deque[int]] = defaultdict(lambda: deque(maxlen=TREE_WINDOW))
        self.depth_tree: dict[int, deque[int]] = defaultdict(lambda: deque(maxlen=TREE_WINDOW))
        self.hist_prompt: list[int] = []
        self.hist_total: list[int] = []

    def keys(self, traj: TrajectorySpec) -> list[_Key]:
        states = traj.tool_states(*self.size_thresholds)
        return [states[:depth] for depth in range(len(states) + 1)]

    def cmlfq(self, current: int, values: Sequence[int]) -> int:
        """C-MLFQ's conservative rule: move iff the mean's and the P90's buckets agree."""
        mean, p90 = _mean_p90(values)
        b_mean, b_p90 = bucket_of(mean, self.thresholds), bucket_of(p90, self.thresholds)
        return b_mean if b_mean == b_p90 else current

    def learn(self, batch: Sequence[TrajectorySpec]) -> None:
        for traj in batch:
            values = (traj.total_response_tokens, *traj.remaining_response_after_returns)
            for depth, (key, value) in enumerate(zip(self.keys(traj), values)):
                self.global_tree[key].append(value)
                self.prompt_tree[(traj.prompt_id, *key)].append(value)
                if depth:
                    self.depth_tree[depth - 1].append(value)
            self.hist_prompt.append(traj.prompt_tokens)
            self.hist_total.append(traj.total_response_tokens)

    def _prompt_predictor(self) -> Any:
        ptoks = np.asarray(self.hist_prompt, dtype=float)
        totals = np.asarray(self.hist_total, dtype=float)
        edges = np.unique(np.quantile(ptoks, np.linspace(0, 1, 11)[1:-1]))
        bins = np.searchsorted(edges, ptoks)
        means = {int(b): float(totals[bins == b].mean()) for b in np.unique(bins)}
        overall = float(totals.mean())
        return lambda prompt_tokens: means.get(int(np.searchsorted(edges, prompt_tokens)), overall)

    def _lookup(self, traj: TrajectorySpec, keys: list[_Key], depth: int, mates: list[dict[_Key, int]]) -> list[int]:
        """Deepest-prefix statistics: the prompt's tree (earlier steps + finished mates), else global."""
        for d in range(depth, -1, -1):
            values = [m[keys[d]] for m in mates if keys[d] in m]
            values.extend(self.prompt_tree.get((traj.prompt_id, *keys[d]), ()))
            if values:
                return values
        for d in range(depth, -1, -1):
            node = self.global_tree.get(keys[d])
            if node:
                return list(node)
        return []

    def score_step(self, batch: Sequence[TrajectorySpec]) -> list[tuple[int, int, int, int, int]]:
        """``(decision index, truth, prefix, prompt, depth)`` buckets for every decision of ``batch``."""
        predict_total = self._prompt_predictor()
        groups: dict[str, list[TrajectorySpec]] = defaultdict(list)
        for t in batch:
            groups[t.group].append(t)
        out = []
        for members in groups.values():
            keys = [self.keys(t) for t in members]
            own = [dict(zip(k, (t.total_response_tokens, *t.remaining_response_after_returns)))
                   for k, t in zip(keys, members)]
            for j, traj in enumerate(members):
                pred_total = predict_total(traj.prompt_tokens)
                cur_prefix = cur_depth = 0
                returns = zip(traj.tool_return_positions, traj.response_positions, traj.remaining_response_after_returns)
                for i, (g_i, p_i, remaining) in enumerate(returns):
                    # A mate that generated G tokens in all has finished once this one has generated G.
                    mates = [own[m] for m, t in enumerate(members) if m != j and t.total_gen_tokens <= g_i]
                    values = self._lookup(traj, keys[j], i + 1, mates)
                    if values:
                        cur_prefix = self.cmlfq(cur_prefix, values)
                    node = self.depth_tree.get(i)
                    if node:
                        cur_depth = self.cmlfq(cur_depth, node)
                    pred = bucket_of(max(pred_total - p_i, 0.0), self.thresholds)
                    out.append((i, bucket_of(remaining, self.thresholds), cur_prefix, pred, cur_depth))
        return out


def routing_accuracy(
    trajs: Sequence[TrajectorySpec],
    bucket_thresholds: Sequence[int],
    size_thresholds: tuple[int, int] = (1000, 12000),
) -> dict[str, float | int]:
    """Replay ``trajs`` step by step and score three routers; returns accuracies in [0, 1].

    Predictors for step ``t`` learn only from steps ``< t`` (plus, for the prefix router, group-mates
    that have already finished); the first step is not scored. A *decision* is the i-th tool return
    of a trajectory; it is correct when the router's bucket equals the bucket of the true remaining
    response tokens ``total - p_i`` (generated + tool-returned, ``p_i`` counting the i-th payload; bucket =
    first threshold ``>=`` the value, else the last).

    - ``prefix``: C-MLFQ on causal prefix trees keyed by the ``(tool, size class, status)`` sequence,
      each node holding the last 200 remaining lengths. If the prompt has data (earlier steps, or
      group-mates with ``G`` generated tokens once this trajectory has generated ``G``) its tree's
      deepest matching prefix is used, else the global tree's. A trajectory starts in bucket 0 and
      moves iff ``bucket(mean) == bucket(p90) != current``.
    - ``prompt``: a T=0 predictor from prompt features: mean total response tokens of earlier
      trajectories in the same prompt-token decile, minus ``p_i``.
    - ``depth``: C-MLFQ's rule on nodes keyed by the tool-return index only (no states): what the
      router would do without the causal signal.

    Keys: ``{router}_single_shot`` (first decision of each trajectory, the paper's "single-shot
    routing accuracy"), ``{router}_single_shot_late`` (the same over the second half of the steps,
    where lengths straddle the thresholds), ``{router}_all`` (every decision), ``decisions`` and
    ``single_shots`` (counts). Every accuracy is 0.0 when nothing was scored.
    """
    by_step: dict[int, list[TrajectorySpec]] = defaultdict(list)
    for t in trajs:
        by_step[t.step].append(t)
    steps = sorted(by_step)
    late_from = steps[len(steps) // 2] if steps else 0
    replay = _Replay(bucket_thresholds, size_thresholds)
    routers = ("prefix", "prompt", "depth")
    hits = {f"{r}_{scope}": 0 for r in routers for scope in ("single_shot", "single_shot_late", "all")}
    n_all = n_first = n_late = 0
    for step in steps:
        if replay.hist_total:
            for i, truth, *preds in replay.score_step(by_step[step]):
                n_all += 1
                first = i == 0
                n_first += first
                late = first and step >= late_from
                n_late += late
                for router, pred in zip(routers, preds):
                    ok = pred == truth
                    hits[f"{router}_all"] += ok
                    hits[f"{router}_single_shot"] += ok and first
                    hits[f"{router}_single_shot_late"] += ok and late
        replay.learn(by_step[step])
    out: dict[str, float | int] = {}
    for key, n_hits in hits.items():
        n = n_all if key.endswith("_all") else n_late if key.endswith("_late") else n_first
        out[key] = n_hits / n if n else 0.0
    out["decisions"] = n_all
    out["single_shots"] = n_first
    return out


CEILING_FEATURES = ("none", "key", "key+payload", "key+latency", "key+first_gen")
"""Feature sets of :func:`first_return_ceiling`: nothing (never migrate's prior), the first return's tool-state
key, and the key with the payload size, the tool's latency or the first turn's generated length (log bins)."""


def _log_bin(x: float, base: float = 1.5) -> int:
    return int(np.log(max(float(x), 1.0)) / np.log(base))


def first_return_ceiling(
    trajs: Sequence[TrajectorySpec],
    bucket_thresholds: Sequence[int],
    size_thresholds: tuple[int, int] = (1000, 12000),
    history_steps: int = 4,
) -> dict[str, float | int]:
    """Best single-shot accuracy a router can reach at the first tool return from each feature set of
    :data:`CEILING_FEATURES`: for step ``s >= 1``, predict the most frequent true bucket among the first tool
    returns of steps ``s - history_steps .. s - 1`` with the same feature value (the whole history's mode when
    the value is unseen), scored on step ``s``. The modal bucket maximises expected accuracy given the feature,
    so this bounds what any rule on that information can do, up to the drift inside the window. ``none`` is
    the prior alone; ``decisions`` counts the scored first returns."""
    rows = []
    for t in trajs:
        rem = t.remaining_response_after_returns
        if not rem:
            continue
        call = t.tool_turns[0]
        key = t.tool_states(*size_thresholds)[0]
        rows.append((t.step, bucket_of(rem[0], bucket_thresholds), {
            "none": 0, "key": key, "key+payload": (key, _log_bin(call.payload_tokens or 0)),
            "key+latency": (key, _log_bin(call.tool_seconds or 0.0, 1.3)),
            "key+first_gen": (key, _log_bin(t.turns[0].gen_tokens))}))
    by_step: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for step, truth, feats in rows:
        by_step[step].append((truth, feats))
    steps = sorted(by_step)
    hits = dict.fromkeys(CEILING_FEATURES, 0)
    n = 0
    for k, step in enumerate(steps[1:], start=1):
        train = [x for s in steps[max(0, k - history_steps):k] for x in by_step[s]]
        prior = Counter(truth for truth, _ in train).most_common(1)[0][0]
        for name in CEILING_FEATURES:
            counts: dict[Any, Counter[int]] = defaultdict(Counter)
            for truth, feats in train:
                counts[feats[name]][truth] += 1
            for truth, feats in by_step[step]:
                c = counts.get(feats[name])
                hits[name] += (c.most_common(1)[0][0] if c else prior) == truth
        n += len(by_step[step])
    out: dict[str, float | int] = {name: h / n if n else 0.0 for name, h in hits.items()}
    out["decisions"] = n
    return out
