"""Baseline rollout routers and the router registry (docs/papers.md §1.4.4, §4 item 9).

All routers implement :class:`libra.policies.routing.interface.Router` on top of
:class:`libra.policies.routing.sticky.StickyRouter` (stickiness, queue cap, fallbacks, migrate-vs-re-prefill), so
every comparison is one name in :func:`make_router`:

- ``round_robin``: cycles over ready instances (ignores load and length); sticky afterwards.
- ``least_loaded``: least-connections over all ready instances (load normalised by TP); sticky afterwards.
- ``length_aware``: categorises each request by its *input* length (<=5000 short, <=10000 medium, <=15000
  long, else extra_long) with preferred TP lists (``[1,2]``, ``[2,4]``, ``[4,8]``, ``[8,4]``); re-checked at
  each tool return on the grown context, moving only when the current TP is not preferred.
- ``la_mlfq``: classic length-threshold MLFQ. Starts in the smallest bucket; at every turn boundary, once the
  response tokens so far (generated + tool-returned, the unit of the bucket thresholds) exceed the current
  bucket's ``max_tokens``, it demotes **one** level (each demotion moves
  the whole context). Optional prompt-history table (``history_ttl_steps``) starts a prompt seen in the last
  steps in the bucket it ended in last time.
- ``predictor``: online ridge regression of ``log1p(total response tokens)`` on prompt features (bias,
  ``log1p(prompt_tokens)``, ``step / step_scale``, a one-hot of a stable hash of the prompt id); its
  prediction at T=0 picks the bucket once. It never sees tool returns.
- ``oracle`` (simulator only): :class:`libra.policies.routing.oracle.OracleRouter`, given the true remaining response
  tokens (``TrajectoryInfo``/``ToolReturn.true_remaining``): ``cmlfq_cost``'s placement rule with the true length
  (``placement="cost"``, the default), or the bucket of the true length (``placement="bucket"``, optionally
  ``follow=True``).
- ``cmlfq``: :class:`libra.policies.routing.cmlfq.CMLFQRouter`.
- ``cmlfq_cost``: :class:`libra.policies.routing.cmlfq_cost.CostCMLFQRouter` (distribution- and cost-based moves).

Pure: no I/O, clocks or threads.
"""

from __future__ import annotations

import inspect
import math
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np

from libra.policies.routing.cmlfq import CMLFQRouter
from libra.policies.routing.cmlfq_cost import CostCMLFQRouter
from libra.policies.routing.oracle import OracleRouter
from libra.policies.routing.prefix_tree import CausalPrefixTree
from libra.policies.routing.sticky import StickyRouter, Track
from libra.policies.routing.interface import (
    HEURISTIC_CROSS_NODE_MAX_TOKENS,
    HEURISTIC_SAME_NODE_MAX_TOKENS,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrateMode,
    MigrationQuery,
    NoInstanceAvailable,
    RouteDecision,
    Router,
    RoutingError,
    ToolReturn,
    TrajectoryInfo,
    bucket_index_for,
    check_int,
    has_room,
    heuristic_migrate_mode,
    least_loaded,
    migrate_mode_by_limits,
)
from libra.policies.routing.tool_state import DEFAULT_THRESHOLDS, R2E_THRESHOLDS, SizeThresholds

__all__ = [
    "DEFAULT_LENGTH_CATEGORIES",
    "migrate_mode_rule",
    "LAMLFQRouter",
    "LeastLoadedRouter",
    "LengthAwareRouter",
    "NAMED_THRESHOLDS",
    "OracleRouter",
    "PredictorRouter",
    "RoundRobinRouter",
    "make_router",
    "router_accepts",
    "router_names",
]


def _checked(name: str, value: int, minimum: int) -> int:
    check_int(name, value, minimum)
    return value


class _InstanceFirstRouter(StickyRouter):
    """A router that picks an instance directly at ``start``; its logical bucket is that instance's bucket."""

    def _pick(self, view: ClusterView, ready: list[InstanceView]) -> InstanceView | None:
        """The instance for a new trajectory (``ready`` is non-empty); ``None`` queues it. The default is
        the least-loaded ready instance (ties by id)."""
        return min(ready, key=lambda i: (i.load, i.id))

    def start(self, traj: TrajectoryInfo, view: ClusterView) -> RouteDecision:
        if traj.traj_id in self._tracks:
            raise RoutingError(f"trajectory {traj.traj_id!r} already started")
        ready = [i for i in view.instances if i.ready]
        if not ready and self.when_full != "queue":
            raise NoInstanceAvailable(f"no ready instance ({len(view.instances)} known)")
        inst = self._pick(view, ready) if ready else None
        spec = view.buckets[view.bucket_index(inst.bucket) if inst else 0]
        track = Track(traj, spec.name, spec.max_tokens, context=traj.prompt_tokens)
        decision = self._assign(track, inst, self.name, track.context, view)
        self._tracks[traj.traj_id] = track
        return decision


class RoundRobinRouter(_InstanceFirstRouter):
    """Round-robin over ready instances in view order (the load-balance baseline on homogeneous TP)."""

    name = "round_robin"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._cursor = 0

    def _pick(self, view: ClusterView, ready: list[InstanceView]) -> InstanceView | None:
        inst = ready[self._cursor % len(ready)]
        self._cursor += 1
        return inst


class LeastLoadedRouter(_InstanceFirstRouter):
    """Least-connections over all ready instances; under the queue cap first, then per ``when_full``."""

    name = "least_loaded"

    def _pick(self, view: ClusterView, ready: list[InstanceView]) -> InstanceView | None:
        roomy = [i for i in ready if has_room(i, self.max_queue_length, self.cap_metric)]
        if roomy:
            return least_loaded(roomy, view)
        if self.when_full == "raise":
            raise NoInstanceAvailable(f"all {len(ready)} ready instances are full")
        return None if self.when_full == "queue" else least_loaded(ready, view)


#: ``(max input tokens or None for "no limit", category, preferred TP degrees)``, checked in order.
DEFAULT_LENGTH_CATEGORIES: Final = (
    (5000, "short", (1, 2)),
    (10000, "medium", (2, 4)),
    (15000, "long", (4, 8)),
    (None, "extra_long", (8, 4)),
)


class LengthAwareRouter(StickyRouter):
    """Routes by input length category to the first bucket with a preferred TP (see the module docstring).

    Within the cluster, the preferred bucket is the smallest bucket whose TP is the first preferred degree
    present; when none is present, the bucket whose TP is nearest (log scale, larger on ties).
    """

    name = "length_aware"

    def __init__(self, *, categories: Sequence[tuple[int | None, str, Sequence[int]]] = DEFAULT_LENGTH_CATEGORIES,
                 **params: Any) -> None:
        super().__init__(**params)
        cats = [(limit, str(name), tuple(int(t) for t in tps)) for limit, name, tps in categories]
        if not cats or cats[-1][0] is not None:
            raise ClusterViewError("length categories must be non-empty and end with an unbounded (None) category")
        limits = [c[0] for c in cats[:-1]]
        if any(not isinstance(x, int) or x < 0 for x in limits) or limits != sorted(x or 0 for x in limits):
            raise ClusterViewError(f"length category limits must be ascending non-negative integers, got {limits}")
        if any(not tps for _, _, tps in cats):
            raise ClusterViewError("every length category needs at least one preferred TP")
        self.categories = tuple(cats)

    def category(self, input_tokens: int) -> tuple[str, tuple[int, ...]]:
        """Category name and preferred TP degrees for a request with ``input_tokens`` of input."""
        for limit, name, tps in self.categories:
            if limit is None or input_tokens <= limit:
                return name, tps
        raise AssertionError("unreachable: the last category is unbounded")

    @staticmethod
    def _bucket_for_tps(tps: tuple[int, ...], view: ClusterView) -> int:
        for tp in tps:
            for i, b in enumerate(view.buckets):
                if b.tp == tp:
                    return i
        want = math.log2(tps[0])
        return min(range(len(view.buckets)), key=lambda i: (abs(math.log2(view.buckets[i].tp) - want), -i))

    def _initial_bucket(self, traj: TrajectoryInfo, view: ClusterView) -> tuple[int, str]:
        _, tps = self.category(traj.prompt_tokens)
        return self._bucket_for_tps(tps, view), "input_length"

    def _decide(self, track: Track, ret: ToolReturn, view: ClusterView) -> tuple[int, str]:
        current = view.bucket_index(track.bucket)
        input_tokens = max(ret.context_tokens, track.info.prompt_tokens + ret.position)
        _, tps = self.category(input_tokens)
        if view.buckets[current].tp in tps:
            return current, "in_preferred_bucket"
        return self._bucket_for_tps(tps, view), "input_length"


class LAMLFQRouter(StickyRouter):
    """Length-threshold MLFQ with stepwise demotion (see the module docstring)."""

    name = "la_mlfq"

    def __init__(self, *, history_ttl_steps: int = 0, **params: Any) -> None:
        super().__init__(**params)
        self.history_ttl_steps = _checked("history_ttl_steps", history_ttl_steps, 0)
        self._history: dict[str, tuple[str, int]] = {}  # prompt id -> (bucket name, step recorded)

    def _initial_bucket(self, traj: TrajectoryInfo, view: ClusterView) -> tuple[int, str]:
        if self.history_ttl_steps and traj.prompt_id in self._history:
            bucket, step = self._history[traj.prompt_id]
            if traj.step - step <= self.history_ttl_steps and view.has_bucket(bucket):
                return view.bucket_index(bucket), "prompt_history"
        return 0, "initial"

    def _decide(self, track: Track, ret: ToolReturn, view: ClusterView) -> tuple[int, str]:
        current = view.bucket_index(track.bucket)
        # Lengths are response tokens (generated + tool-returned), the unit of the bucket thresholds.
        if track.response > view.buckets[current].max_tokens and current < len(view.buckets) - 1:
            return current + 1, "demote"
        return current, "within_threshold"

    def _learn(self, track: Track, total_output_tokens: int) -> None:
        if self.history_ttl_steps and track.info.prompt_id is not None:
            self._history[track.info.prompt_id] = (track.bucket, track.info.step)

    def on_step(self, step: int) -> None:
        """Drop history entries older than the TTL (keeps the table bounded)."""
        if self.history_ttl_steps:
            self._history = {p: v for p, v in self._history.items() if step - v[1] <= self.history_ttl_steps}


class PredictorRouter(StickyRouter):
    """T=0 length predictor: online ridge regression on prompt features, bucket chosen once at ``start``.

    ``ridge`` is the L2 penalty, ``decay`` (0 < decay <= 1) the per-sample forgetting factor (1: none),
    ``hash_buckets`` the size of the prompt-id one-hot, ``warmup`` the samples needed before predicting
    (until then: the smallest bucket, reason ``no_stats``).
    """

    name = "predictor"

    def __init__(self, *, ridge: float = 1.0, decay: float = 1.0, hash_buckets: int = 64, step_scale: float = 100.0,
                 warmup: int = 8, **params: Any) -> None:
        super().__init__(**params)
        if not ridge > 0 or not 0 < decay <= 1 or not step_scale > 0:
            raise ClusterViewError(f"need ridge > 0, 0 < decay <= 1, step_scale > 0; "
                                   f"got ridge={ridge} decay={decay} step_scale={step_scale}")
        self.hash_buckets = _checked("hash_buckets", hash_buckets, 0)
        self.warmup = _checked("warmup", warmup, 1)
        self.ridge, self.decay, self.step_scale = float(ridge), float(decay), float(step_scale)
        dim = 3 + self.hash_buckets
        self._a = np.zeros((dim, dim))
        self._b = np.zeros(dim)
        self._w: np.ndarray | None = None
        self.samples = 0

    def features(self, traj: TrajectoryInfo) -> np.ndarray:
        """Feature vector of a trajectory's prompt (only what is known at T=0)."""
        x = np.zeros(3 + self.hash_buckets)
        x[0] = 1.0
        x[1] = math.log1p(traj.prompt_tokens)
        x[2] = traj.step / self.step_scale
        if self.hash_buckets and traj.prompt_id is not None:
            x[3 + zlib.crc32(traj.prompt_id.encode("utf-8")) % self.hash_buckets] = 1.0
        return x

    def predict(self, traj: TrajectoryInfo) -> float | None:
        """Predicted total output tokens, or ``None`` before ``warmup`` samples."""
        if self.samples < self.warmup:
            return None
        if self._w is None:
            reg = self._a + self.ridge * np.eye(len(self._b))
            reg[0, 0] -= self.ridge  # leave the bias unpenalised
            self._w = np.linalg.solve(reg, self._b)
        return max(0.0, math.expm1(float(self.features(traj) @ self._w)))

    def observe(self, traj: TrajectoryInfo, total_output_tokens: int) -> None:
        """One training sample: the trajectory's prompt features and its true total output length."""
        x = self.features(traj)
        self._a = self.decay * self._a + np.outer(x, x)
        self._b = self.decay * self._b + x * math.log1p(total_output_tokens)
        self._w = None
        self.samples += 1

    def _initial_bucket(self, traj: TrajectoryInfo, view: ClusterView) -> tuple[int, str]:
        pred = self.predict(traj)
        if pred is None:
            return 0, "no_stats"
        return bucket_index_for(pred, view.buckets), "predicted"

    def _decide(self, track: Track, ret: ToolReturn, view: ClusterView) -> tuple[int, str]:
        return view.bucket_index(track.bucket), "predicted"

    def _learn(self, track: Track, total_output_tokens: int) -> None:
        if isinstance(total_output_tokens, bool) or not isinstance(total_output_tokens, int) or total_output_tokens < 0:
            raise RoutingError(f"total_output_tokens must be a non-negative integer, got {total_output_tokens!r}")
        self.observe(track.info, total_output_tokens)


_ROUTERS: Final[dict[str, Callable[..., StickyRouter]]] = {
    "cmlfq": CMLFQRouter,
    "round_robin": RoundRobinRouter,
    "least_loaded": LeastLoadedRouter,
    "length_aware": LengthAwareRouter,
    "la_mlfq": LAMLFQRouter,
    "predictor": PredictorRouter,
    "oracle": OracleRouter,
    "cmlfq_cost": CostCMLFQRouter,
}
_SHARED_PARAMS: Final = ("max_queue_length", "cap_metric", "when_full", "choose_mode")
NAMED_THRESHOLDS: Final = {"default": DEFAULT_THRESHOLDS, "r2e": R2E_THRESHOLDS}
"""Payload size-class thresholds by name (a router's ``thresholds = "r2e"`` in config, ``python -m libra tree build``)."""


def router_names() -> tuple[str, ...]:
    """Names :func:`make_router` accepts."""
    return tuple(_ROUTERS)


def _accepted(name: str) -> set[str]:
    cls = _ROUTERS[name]
    params = {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")}
    return params | set(_SHARED_PARAMS)


def router_accepts(name: str, param: str) -> bool:
    """Whether router ``name`` takes keyword ``param`` (False for an unknown router)."""
    return name in _ROUTERS and param in _accepted(name)


def make_router(name: str, **params: Any) -> Router:
    """Build the router called ``name`` with keyword ``params``.

    Config conveniences: ``thresholds`` may be ``"default"``, ``"r2e"`` or ``{"small": .., "medium": ..}``;
    ``tree`` (cmlfq) may be a path to a saved prefix tree. Raises ``ValueError`` for an unknown name or
    parameter, and the router's own errors for bad values.
    """
    if name not in _ROUTERS:
        raise ValueError(f"unknown router: {name!r} (known: {', '.join(_ROUTERS)})")
    accepted = _accepted(name)
    for key in params:
        if key not in accepted:
            raise ValueError(f"router {name!r}: unknown parameter {key!r} (accepted: {', '.join(sorted(accepted))})")
    th = params.get("thresholds")
    if isinstance(th, str):
        if th not in NAMED_THRESHOLDS:
            raise ValueError(f"unknown thresholds: {th!r} (known: {', '.join(NAMED_THRESHOLDS)})")
        params["thresholds"] = NAMED_THRESHOLDS[th]
    elif isinstance(th, Mapping):
        extra = set(th) - {"small", "medium"}
        if extra:
            raise ValueError(f"thresholds: unknown keys {sorted(extra)} (accepted: small, medium)")
        params["thresholds"] = SizeThresholds(**th)
    tree = params.get("tree")
    if isinstance(tree, (str, os.PathLike)):
        params["tree"] = CausalPrefixTree.load(tree)
    if "choose_mode" in params and not callable(params["choose_mode"]):
        params["choose_mode"] = migrate_mode_rule(params["choose_mode"])
    return _ROUTERS[name](**params)


def migrate_mode_rule(spec: Any) -> Callable[[MigrationQuery], MigrateMode]:
    """A router's ``choose_mode`` from config: ``"heuristic"`` (Libra's rule: re-prefill up to 4096 tokens on
    the same node, 2048 across nodes, else KV transfer), ``"kv"`` or ``"reprefill"`` (always), or a table
    ``{same_node_max_tokens = N, cross_node_max_tokens = M}`` (the heuristic's two limits, for an interconnect
    where KV transfer pays off sooner or later). Raises ``ValueError`` for anything else."""
    if spec == "heuristic":
        return heuristic_migrate_mode
    if spec in ("kv", "reprefill"):
        mode: MigrateMode = spec
        return lambda q: mode
    if isinstance(spec, Mapping):
        extra = set(spec) - {"same_node_max_tokens", "cross_node_max_tokens"}
        limits = {k: spec.get(k, d) for k, d in (("same_node_max_tokens", HEURISTIC_SAME_NODE_MAX_TOKENS),
                                                 ("cross_node_max_tokens", HEURISTIC_CROSS_NODE_MAX_TOKENS))}
        if extra or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in limits.values()):
            raise ValueError(f"choose_mode: a table takes non-negative integers same_node_max_tokens and "
                             f"cross_node_max_tokens, got {dict(spec)!r}")
        same, cross = limits["same_node_max_tokens"], limits["cross_node_max_tokens"]
        return lambda q: migrate_mode_by_limits(q, same, cross)
    raise ValueError(f"choose_mode: expected 'heuristic', 'kv', 'reprefill' or a table of limits, got {spec!r}")
