"""Rollout routing inside the broker: every ``generate`` turn goes through a rollout router (C-MLFQ by
default), which sees the tool-return states because tool calls pass through the broker too.

Pure: owned by :class:`~libra.broker.state.BrokerState` and driven by its dispatcher (``dispatch.py``, which
enforces the decisions), no I/O. Rollout instances are the actors that accept ``generate``; each belongs to
a bucket (its role config ``{"bucket": name}``, else the first bucket) and the broker keeps one generate
queue per bucket. A trajectory sticks to the
instance the router chose (its prefix cache lives there) until the router migrates it.

What the broker tells the router:
- first ``generate`` of a trajectory → ``start`` (prompt id/tokens/step come from the Submit's args, read as
  :class:`~libra.protocol.payloads_rollout.RouteHints`);
- an ``action`` reply for a trajectory → a pending :class:`ToolReturn` (tool, payload size, status,
  the generated-token position and the response position: generated + tool-returned tokens) consumed
  by ``on_tool_return`` before the next turn;
- a ``generate`` reply → ``on_turn_end`` with the cumulative generated tokens (``output["gen_tokens"]``);
- ``EndTrajectory`` → ``finish`` with the response length (learning) or ``discard``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from libra.policies.routing.baselines import make_router
from libra.policies.routing.interface import (
    BucketSpec,
    ClusterView,
    InstanceView,
    RouteDecision,
    RoutingError,
    ToolReturn,
    TrajectoryInfo,
)
from libra.protocol.payloads_rollout import OracleHints

DEFAULT_BUCKETS: tuple[BucketSpec, ...] = (BucketSpec("default", 1, 1 << 30),)


@dataclass(slots=True)
class TrajRoute:
    """What the broker remembers about one live trajectory."""

    instance: str | None = None  # actor id of its instance
    bucket: str = ""
    generated: int = 0  # cumulative generated tokens
    context: int = 0  # prompt + generated + tool payload tokens
    prompt: int = 0  # prompt tokens (context - prompt = response tokens so far)
    pending_return: ToolReturn | None = None
    turns: int = 0
    tool_s: float = 0.0  # seconds its tool calls took, submission to result
    migrations: int = 0
    migrated_tokens: int = 0
    decisions: list[tuple[str, str, bool]] = field(default_factory=list)  # (bucket, reason, migrated)


class RolloutRouting:
    """Routes generate turns. ``route(...)`` returns the decision; the broker enforces it."""

    def __init__(self, router: str = "cmlfq", buckets: tuple[BucketSpec, ...] | list[BucketSpec] = (),
                 params: dict[str, Any] | None = None) -> None:
        self.router_name = router
        self.router = make_router(router, **(params or {}))
        self.buckets: tuple[BucketSpec, ...] = tuple(sorted(buckets, key=lambda b: b.max_tokens)) or DEFAULT_BUCKETS
        self.trajs: dict[str, TrajRoute] = {}
        self.stats = {"turns": 0, "migrations": 0, "migrated_tokens": 0, "tokens": 0}
        self.steps = 0  # policy steps the router has been told of (advance)
        self.turn_contexts: deque[int] | None = None  # each routed turn's context length, when EARL reads them

    def set_buckets(self, buckets: list[BucketSpec]) -> None:
        """Replace the bucket layout (the planner's re-plan); live trajectories are re-mapped by the router."""
        self.buckets = tuple(sorted(buckets, key=lambda b: b.max_tokens)) or DEFAULT_BUCKETS

    def bucket_named(self, name: Any) -> str:
        """``name`` if it is a current bucket, else the first (smallest) bucket."""
        return name if isinstance(name, str) and any(b.name == name for b in self.buckets) else self.buckets[0].name

    def bucket_of_actor(self, role: dict[str, Any]) -> str:
        return self.bucket_named(role.get("bucket"))

    def view(self, instances: list[tuple[str, str, int, int, str]]) -> ClusterView:
        """``instances``: (actor id, bucket, active, queued, host) for every ready rollout actor."""
        return ClusterView(self.buckets, tuple(InstanceView(i, b, a, q, True, h) for i, b, a, q, h in instances))

    def route(self, traj_id: str, args: Any, view: ClusterView) -> tuple[RouteDecision, TrajRoute]:
        """Decide where this generate turn of ``traj_id`` runs. Raises ``RoutingError`` (no ready instance can
        take it); a trajectory that was never placed is then forgotten, so its next turn starts it afresh."""
        fresh = traj_id not in self.trajs
        try:
            return self._route(traj_id, args, view)
        except RoutingError:
            if fresh:  # never placed: forget it, so its next turn starts it afresh
                self.trajs.pop(traj_id, None)
                with contextlib.suppress(RoutingError):
                    self.router.discard(traj_id)
            raise

    def _route(self, traj_id: str, args: Any, view: ClusterView) -> tuple[RouteDecision, TrajRoute]:
        tr = self.trajs.get(traj_id)
        # the routing hints of the generate args; true_remaining only ever comes from the simulator (oracle)
        h = OracleHints.from_args(args)
        if tr is None:
            prompt = h.prompt_tokens or 0
            tr = TrajRoute(context=prompt, prompt=prompt)
            self.trajs[traj_id] = tr
            info = TrajectoryInfo(traj_id, h.prompt_id, prompt, h.step or 0, h.true_remaining)
            d = self.router.start(info, view)
        elif tr.pending_return is not None:
            ret, tr.pending_return = tr.pending_return, None
            if h.true_remaining is not None:  # simulator/oracle only
                ret = replace(ret, true_remaining=h.true_remaining)
            d = self.router.on_tool_return(traj_id, ret, view)
        elif tr.instance is not None and view.instance(tr.instance) is not None:
            d = RouteDecision(tr.instance, tr.bucket, "sticky", placed_bucket=tr.bucket)
        else:
            d = self.router.reroute(traj_id, view)
        if d.instance_id is not None and tr.instance is not None and d.instance_id != tr.instance:
            tr.migrations += 1
            tr.migrated_tokens += tr.context
            self.stats["migrations"] += 1
            self.stats["migrated_tokens"] += tr.context
        if d.instance_id is not None:
            tr.instance = d.instance_id
        tr.bucket = d.bucket
        if self.turn_contexts is not None:
            self.turn_contexts.append(max(tr.context, _stated_len(args)))
        tr.turns += 1
        self.stats["turns"] += 1
        if len(tr.decisions) < 64:
            tr.decisions.append((d.bucket, d.reason, d.migrated))
        return d, tr

    def requeue_target_lost(self, traj_id: str) -> None:
        tr = self.trajs.get(traj_id)
        if tr is not None:
            tr.instance = None

    def turn_done(self, traj_id: str, output: Any) -> None:
        tr = self.trajs.get(traj_id)
        if tr is None:
            return
        gen = _nonneg(output.get("gen_tokens")) if isinstance(output, dict) else 0
        tr.generated += gen
        tr.context += gen
        self.stats["tokens"] += gen
        self.router.on_turn_end(traj_id, tr.generated)

    def tool_returned(self, traj_id: str, tool: str, ok: bool, output: Any, error_code: str,
                      seconds: float = 0.0) -> None:
        """A tool call of ``traj_id`` returned after ``seconds`` (submission to result)."""
        tr = self.trajs.get(traj_id)
        if tr is None:
            return
        tr.tool_s += max(0.0, seconds)
        payload_tokens, chars, status = tool_output_fields(output, ok, error_code)
        tr.context += payload_tokens if payload_tokens is not None else chars // 4
        tr.pending_return = ToolReturn(tool, tr.generated, tr.context, output=output, status=status,
                                       payload_tokens=payload_tokens, payload_chars=chars,
                                       response_tokens=tr.context - tr.prompt)

    def end(self, traj_id: str, total_output_tokens: int, ok: bool) -> TrajRoute | None:
        """Finish (``ok``: the router learns) or discard a trajectory.

        The router learns the response length from the broker's own bookkeeping (generated + tool-returned
        tokens, the unit of its tool-return positions), plus any generated tokens the client reports that
        the broker did not see.
        """
        tr = self.trajs.pop(traj_id, None)
        if tr is None:
            return None
        if ok:
            unseen = max(0, _nonneg(total_output_tokens) - tr.generated)
            self.router.finish(traj_id, tr.context - tr.prompt + unseen)
        else:
            self.router.discard(traj_id)
        return tr

    def on_step(self, step: int) -> None:
        self.router.on_step(step)

    def summary(self) -> dict[str, Any]:
        """For status: the router's name, the policy steps it was told of, and what it says of itself
        (C-MLFQ: its trees' size and rebuild count)."""
        describe = getattr(self.router, "describe", None)
        return {"router": self.router_name, "steps": self.steps, **(describe() if callable(describe) else {}),
                **{k: v for k, v in self.stats.items()}}

    def advance(self) -> None:
        """One more policy step happened (a job published weights, or the rebuild interval passed without
        a job): the router counts it and rebuilds its prefix tree when its ``rebuild_interval`` is reached
        (C-MLFQ's drift rebuild, docs/papers.md §1.4.2)."""
        self.steps += 1
        self.router.on_step(self.steps)


def tool_output_fields(output: Any, ok: bool, error_code: str = "") -> tuple[int | None, int, str | None]:
    """What the broker reads from a tool's reply for the router's tool-return state: ``(payload_tokens``
    (the output's own ``payload_tokens`` count, else ``None``), ``payload_chars``, ``status`` (``None`` for
    a success: the extractor then reads the output itself; else ``"timeout"`` or ``"failure"``))``."""
    payload_tokens = None
    if isinstance(output, dict) and isinstance(output.get("payload_tokens"), int):
        payload_tokens = max(0, output["payload_tokens"])
    chars = len(str(output)) if output is not None else 0
    status = None if ok else ("timeout" if error_code == "timeout" else "failure")
    return payload_tokens, chars, status


def _stated_len(args: Any) -> int:
    """A generate turn's own context length: ``len(prompt_ids)`` or ``context.total_len`` (0 when neither)."""
    if not isinstance(args, dict):
        return 0
    ids = args.get("prompt_ids")
    if isinstance(ids, list):
        return len(ids)
    ctx = args.get("context")
    return _nonneg(ctx.get("total_len")) if isinstance(ctx, dict) else 0


def _nonneg(x: Any) -> int:
    return x if type(x) is int and x >= 0 else 0
