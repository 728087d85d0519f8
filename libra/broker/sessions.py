"""The broker core's session records and its tunables: :class:`BrokerConfig` (validated TOML lands here),
:class:`ActorSession` (one per connected actor socket: what it accepts, its capacity and the work it holds)
and :class:`ClientSession` (one per client socket). Plain data owned and mutated by
:class:`~libra.broker.state.BrokerState` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ActorSession", "BrokerConfig", "ClientSession"]


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Tunables of the core. All times in seconds."""

    broker_id: str = "libra-broker"
    heartbeat_s: float = 1.0
    liveness: int = 3
    max_frame_bytes: int = 64 * 1024 * 1024
    max_retries: int = 3  # lost assignments (actor death / lease expiry) tolerated per request
    lease_s: float = 3600.0  # longest a single assignment may run without a result
    max_queued_per_key: int = 100_000  # back-pressure: Busy beyond this many waiting per (kind, name)
    max_inflight_per_client: int = 50_000  # back-pressure: Busy beyond this many unanswered per client
    reply_cache: int = 20_000  # finished requests remembered for idempotent resubmission
    client_idle_s: float = 300.0  # forget silent clients with nothing in flight
    router: str = "cmlfq"  # rollout router for generate turns (libra.policies.routing.baselines)
    router_params: dict[str, Any] = field(default_factory=dict)
    buckets: list[dict[str, Any]] = field(default_factory=list)  # [{name, tp, max_tokens}], ascending
    action_scheduler: str = ""  # "" = first come first served by credit; or tangram | fixed_dop | per_trajectory
    action_scheduler_params: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool -> {cpu, max_cpu, parallel_fraction, duration_s}
    planner: dict[str, Any] = field(default_factory=dict)  # [broker.planner]: periodic GRP (planner_loop.py); {} = off


@dataclass(slots=True)
class ActorSession:
    peer: bytes
    actor_id: str
    host: str
    slot: str
    pid: int
    capabilities: dict[str, frozenset[str]]
    accepting: frozenset[str]
    capacity: int
    labels: dict[str, Any]
    connected_at: float
    last_seen: float
    last_sent: float
    held: set[str] = field(default_factory=set)
    directive: int | None = None  # id of a directive still draining
    directive_config: dict[str, Any] = field(default_factory=dict)  # role: bucket, tp, ...
    completed: int = 0
    bucket: str = ""  # rollout bucket when it accepts generate
    cores: int = 1  # CPU cores it offers to actions (labels["cores"], default its capacity)
    cores_used: int = 0  # cores granted to its running actions (action scheduler on)
    targeted: int = 0  # queued generate turns waiting for this instance

    @property
    def free(self) -> int:
        return 0 if self.directive is not None else self.capacity - len(self.held)

    def serves(self, kind: str, name: str) -> bool:
        if kind not in self.accepting:
            return False
        if kind == "generate":
            return name == self.bucket
        names = self.capabilities.get(kind)
        return names is not None and (name in names or "*" in names)

    @property
    def state(self) -> str:
        if self.directive is not None:
            return "draining"
        return "busy" if self.held else "idle"


@dataclass(slots=True)
class ClientSession:
    peer: bytes
    client_id: str
    last_seen: float
    inflight: int = 0
