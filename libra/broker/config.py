"""The broker core's tunables: :class:`BrokerConfig` (the validated ``[broker]`` TOML table lands here).

A leaf module: the core, the shell and the tools that build a broker config import it without pulling in
anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BrokerConfig"]


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Tunables of the core. All times in seconds."""

    broker_id: str = "libra-broker"
    heartbeat_s: float = 1.0
    liveness: int = 3
    # how often the broker beats an actor that holds none of its work (None: 3 x heartbeat_s). Its beats are
    # most of an idle actor's cost to the broker (a send each); an actor still beats every heartbeat_s, so
    # a dead actor is found as fast, while an idle actor finds a dead broker after liveness x this (it holds
    # nothing that waits on it). heartbeat_s gives every actor the same beat.
    idle_heartbeat_s: float | None = None
    max_frame_bytes: int = 64 * 1024 * 1024
    max_retries: int = 3  # lost assignments (actor death / lease expiry) tolerated per request
    lease_s: float = 3600.0  # longest a single assignment may run without a result
    max_queued_per_key: int = 100_000  # back-pressure: Busy beyond this many waiting per (kind, name)
    max_inflight_per_client: int = 50_000  # back-pressure: Busy beyond this many unanswered per client
    reply_cache: int = 20_000  # finished requests remembered for idempotent resubmission
    client_idle_s: float = 300.0  # forget silent clients with nothing in flight
    # direct leases (direct_leases.py) an actor may hold at once; 0 = no direct calls, everything via the broker
    direct_leases_per_actor: int = 256
    router: str = "cmlfq"  # rollout router for generate turns (libra.policies.routing.baselines)
    router_params: dict[str, Any] = field(default_factory=dict)
    # Without a job publishing weights, count a policy step for the router's drift rebuild this often
    # (seconds; 0 = only on published weights versions).
    router_step_s: float = 0.0
    buckets: list[dict[str, Any]] = field(default_factory=list)  # [{name, tp, max_tokens}], ascending
    action_scheduler: str = ""  # "" = first come first served by credit; or tangram | fixed_dop | per_trajectory
    action_scheduler_params: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool -> {cpu, max_cpu, parallel_fraction, duration_s}
    planner: dict[str, Any] = field(default_factory=dict)  # [broker.planner]: periodic GRP (plan_decider.py); {} = off
    # [broker.engines]: {dtype, gpu_memory_fraction} for the engines of GPU actors the broker directs (sent in
    # every role directive; an actor's own --dtype / --gpu-memory-fraction hold until then). {} = the actors' own
    engines: dict[str, Any] = field(default_factory=dict)
    # Lent slots (broker/lending.py, docs/lending.md). When an owner reclaims a slot, each trajectory pinned to it
    # moves its KV to the next instance only if that fits before the owner's deadline, at this many seconds per
    # context token (default: SmolLM2-1.7B's KV, 24 layers x K and V x 32 heads x 64 dims x 2 bytes = 196 KiB a
    # token, over a ~10 GB/s host link: 20 us; a re-prefill otherwise); work a reclaimed slot still holds this
    # long after the deadline is taken back and re-queued (not counted as a loss).
    kv_move_s_per_token: float = 2e-5
    reclaim_grace_s: float = 2.0
    # Journal replication to a standby broker (libra.broker.replication, docs/failover.md): how long a primary
    # waits for an in-sync standby's ack of a pass's journal records before it sends the replies alone (and marks
    # the standby lagging); how often it beats on the replication stream; how long a standby hears nothing
    # before it takes over.
    replica_ack_timeout_s: float = 1.0
    replica_beat_s: float = 0.5
    takeover_after_s: float = 3.0

    @property
    def idle_beat_s(self) -> float:
        """The interval the broker beats an idle actor at (``idle_heartbeat_s``, or 3 x ``heartbeat_s``)."""
        return self.idle_heartbeat_s if self.idle_heartbeat_s is not None else 3 * self.heartbeat_s

    def __post_init__(self) -> None:
        if self.idle_heartbeat_s is not None and not self.idle_heartbeat_s >= self.heartbeat_s:
            raise ValueError(f"[broker] idle_heartbeat_s ({self.idle_heartbeat_s}) must be at least heartbeat_s "
                             f"({self.heartbeat_s}): an idle actor is beaten less often, never more")
        for key in ("replica_ack_timeout_s", "replica_beat_s", "takeover_after_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"[broker] {key} must be > 0 seconds, got {getattr(self, key)!r}")
        if not self.takeover_after_s > 2 * self.replica_beat_s:
            raise ValueError(f"[broker] takeover_after_s ({self.takeover_after_s}) must exceed two replica beats "
                             f"(replica_beat_s = {self.replica_beat_s}): a standby would take over from a live primary")
