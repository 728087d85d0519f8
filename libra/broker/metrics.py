"""Prometheus metrics for the broker: what an operator graphs and alerts on.

Contract with the server loop (``server.py``), which owns all mutation:
- :meth:`BrokerMetrics.observe` is called for every event the core handled, with the commands it
  returned. It only looks at ``Submit`` messages (remembers kind + submit time per request) and at
  ``Reply`` commands (end-to-end latency and execution time by work kind, outcomes). Constant work
  per message, no locks, no allocation beyond one small dict entry per request in flight.
- :meth:`BrokerMetrics.tick` is called from the loop's timer; at most every ``snapshot_s`` it reads
  ``BrokerState`` (queues, actors, ``stats``, ``rollout.stats``) and publishes an immutable
  snapshot. The HTTP thread of :meth:`serve` only ever reads the latest snapshot, so a scrape never
  touches live broker state and never slows the loop.

Exported families (all prefixed ``libra_``): ``queue_depth{kind,name}``, ``work_inflight``,
``actors{role,state}``, ``actor_capacity``/``actor_load``, ``clients``, ``work_submitted_total``,
``work_completed_total``, ``work_failed_total``, ``work_requeued_total``, ``broker_events_total{event}``
(every other ``BrokerState.stats`` counter), ``replies_total{kind,outcome}``,
``work_latency_seconds{kind}`` and ``work_exec_seconds{kind}`` histograms, ``act_seconds`` (mean action
completion time over the last window), ``generated_tokens_total`` and ``tokens_per_second``,
``rollout_*`` routing counters, ``broker_core_errors_total`` and ``broker_info``; per GPU actor (the NVML
samples its heartbeats carry) ``actor_gpu_memory_used_bytes{actor,gpu}``,
``actor_gpu_memory_total_bytes{actor,gpu}`` and ``actor_gpu_utilization_percent{actor,gpu}``.
Policy lag appears as ``policy_lag`` once the broker core reports it in ``stats`` (no job state yet).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from libra.protocol import messages as m

from .events import PeerMessage, Send

if TYPE_CHECKING:
    from .state import BrokerState

#: Latency buckets (seconds): tool calls run from sub-millisecond echo to minutes of sandboxed code.
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_NAMED_COUNTERS = {"submitted": "work_submitted", "completed": "work_completed", "failed": "work_failed",
                   "requeued": "work_requeued"}
_PENDING_SLACK_S = 60.0  # a request whose reply went elsewhere (resubmitted from a new socket) is forgotten


class _Hist:
    """Fixed-bucket histogram owned by the loop thread (no locks; copied into snapshots)."""

    __slots__ = ("counts", "total")

    def __init__(self, nbuckets: int) -> None:
        self.counts = [0] * (nbuckets + 1)  # counts[i]: observations <= bounds[i]; last slot: +Inf
        self.total = 0.0


_GPU_GAUGES = (("libra_actor_gpu_memory_used_bytes", "memory_used_bytes", "GPU memory in use (NVML), per GPU actor."),
               ("libra_actor_gpu_memory_total_bytes", "memory_total_bytes", "GPU memory in all (NVML), per GPU actor."),
               ("libra_actor_gpu_utilization_percent", "utilization_pct",
                "Share of the last NVML sample period a kernel ran on the actor's GPU."))


def gpu_families(gpus: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """The per-GPU-actor gauges from each actor's last NVML sample (none when no actor reports one)."""
    if not gpus:
        return
    for name, key, doc in _GPU_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["actor", "gpu"])
        for aid, sample in sorted(gpus.items()):
            if key in sample:
                g.add_metric([aid, str(int(sample.get("index", -1)))], float(sample[key]))
        yield g


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a scrape reports, frozen at one tick. Built by the loop, read by the HTTP thread."""

    queues: dict[tuple[str, str], int] = field(default_factory=dict)
    actors: dict[tuple[str, str], int] = field(default_factory=dict)  # (role, state) -> count
    capacity: int = 0
    load: int = 0
    inflight: int = 0
    clients: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    rollout: dict[str, int] = field(default_factory=dict)
    trajectories: int = 0
    replies: dict[tuple[str, str], int] = field(default_factory=dict)
    latency: dict[str, tuple[list[int], float]] = field(default_factory=dict)
    exec_time: dict[str, tuple[list[int], float]] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    act_mean_s: float = 0.0
    core_errors: int = 0
    info: dict[str, str] = field(default_factory=dict)
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)  # actor id -> its last NVML sample


def actor_role(kinds: frozenset[str] | set[str] | list[str]) -> str:
    """The role label of an actor: the work kinds it accepts now, ``+``-joined (``none`` if it accepts none)."""
    return "+".join(sorted(kinds)) or "none"


class BrokerMetrics:
    """Collects broker metrics from the loop thread and exposes them as a Prometheus collector."""

    def __init__(self, state: BrokerState, *, snapshot_s: float = 0.5, window_s: float = 10.0,
                 buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.state = state
        self.snapshot_s = snapshot_s
        self.window_s = window_s
        self.buckets = tuple(sorted(buckets))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._pending: dict[tuple[bytes, str], tuple[str, float, float]] = {}  # -> (kind, t0, forget_at)
        self._latency: dict[str, _Hist] = {}
        self._exec: dict[str, _Hist] = {}
        self._replies: dict[tuple[str, str], int] = {}
        self._act_window: deque[tuple[float, float]] = deque()  # (reply time, latency) of action work
        self._tokens_window: deque[tuple[float, int]] = deque()  # (time, cumulative tokens)
        self._next_snapshot = 0.0
        self._next_prune = 0.0
        self.server: Any = None
        self.last_tick: float | None = None  # the loop's clock at its last tick: the broker's liveness (health.py)
        self._snap = self._build(None, 0)  # scrapes before the first tick see real (zero) counters

    # ------------------------------------------------------------------ loop thread
    def observe(self, event: Any, cmds: list[Any], now: float) -> None:
        """Account one handled event and its commands (see the module docstring)."""
        msg = event.msg if type(event) is PeerMessage else None
        if type(msg) is m.Submit:
            self._pending[(event.peer, msg.request_id)] = (msg.kind, now, now + msg.timeout_s + _PENDING_SLACK_S)
        for c in cmds:
            if type(c) is Send and type(c.msg) is m.Reply:
                self._on_reply(c.peer, c.msg, now)

    def _on_reply(self, peer: bytes, r: m.Reply, now: float) -> None:
        rec = self._pending.pop((peer, r.request_id), None)
        if rec is None:  # status/direct replies, or a duplicate answered from the record
            return
        kind = rec[0]
        key = (kind, "ok" if r.ok else (r.error_code or "error"))
        replies = self._replies
        replies[key] = replies.get(key, 0) + 1
        if not r.work_id:  # rejected at the door (busy, unknown tool): no latency to speak of
            return
        lat = now - rec[1]
        h = self._latency.get(kind) or self._latency.setdefault(kind, _Hist(len(self.buckets)))
        h.counts[bisect_left(self.buckets, lat)] += 1
        h.total += lat
        d = r.duration_s
        if d > 0:
            e = self._exec.get(kind) or self._exec.setdefault(kind, _Hist(len(self.buckets)))
            e.counts[bisect_left(self.buckets, d)] += 1
            e.total += d
        if kind == "action":
            self._act_window.append((now, lat))

    def tick(self, now: float, core_errors: int = 0) -> None:
        """Publish a new snapshot if ``snapshot_s`` has passed since the last one."""
        self.last_tick = now
        if now < self._next_snapshot:
            return
        self._next_snapshot = now + self.snapshot_s
        if now >= self._next_prune:  # forget requests whose reply we can no longer see
            self._next_prune = now + 30.0
            stale = [k for k, v in self._pending.items() if v[2] < now]
            for k in stale:
                del self._pending[k]
        self._snap = self._build(now, core_errors)

    def _build(self, now: float | None, core_errors: int) -> Snapshot:
        st = self.state
        actors: dict[tuple[str, str], int] = {}
        cap = load = 0
        for s in st.actors.values():
            k = (actor_role(s.accepting), s.state)
            actors[k] = actors.get(k, 0) + 1
            cap += s.capacity
            load += len(s.held)
        rstats = dict(st.rollout.stats)
        tokens = int(rstats.get("tokens", 0))
        tw, aw = self._tokens_window, self._act_window
        if now is not None:  # None: the initial snapshot, before the loop has a clock reading
            tw.append((now, tokens))
            while len(tw) > 2 and now - tw[1][0] >= self.window_s:
                tw.popleft()
            while aw and now - aw[0][0] > self.window_s:
                aw.popleft()
        tps = (tw[-1][1] - tw[0][1]) / (tw[-1][0] - tw[0][0]) if len(tw) > 1 and tw[-1][0] > tw[0][0] else 0.0
        act = sum(v for _, v in aw) / len(aw) if aw else 0.0
        return Snapshot(
            queues={k: len(q) for k, q in st.queues.items()},
            actors=actors, capacity=cap, load=load, inflight=len(st.works), clients=len(st.clients),
            stats={k: v for k, v in st.stats.items() if isinstance(v, (int, float))},
            rollout=rstats, trajectories=len(st.rollout.trajs), replies=dict(self._replies),
            latency={k: (list(h.counts), h.total) for k, h in self._latency.items()},
            exec_time={k: (list(h.counts), h.total) for k, h in self._exec.items()},
            tokens_per_s=tps, act_mean_s=act, core_errors=core_errors,
            info={"broker_id": st.config.broker_id, "router": st.rollout.router_name},
            gpus={s.actor_id: dict(s.gpu) for s in st.actors.values() if getattr(s, "gpu", None)},
        )

    # ------------------------------------------------------------------ HTTP thread
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the bound port (``port=0``: any)."""
        server, _thread = start_http_server(port, addr, registry=self.registry)
        self.server = server
        return int(server.server_port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def describe(self) -> list[Metric]:
        return []  # families are dynamic; registration must not trigger a collect

    def collect(self) -> Iterator[Metric]:
        s = self._snap
        g = GaugeMetricFamily("libra_queue_depth", "Work waiting in each broker queue.", labels=["kind", "name"])
        for (kind, name), n in sorted(s.queues.items()):
            g.add_metric([kind, name], n)
        yield g
        g = GaugeMetricFamily("libra_actors", "Connected actors by role (accepted kinds) and state.",
                              labels=["role", "state"])
        for (role, state), n in sorted(s.actors.items()):
            g.add_metric([role, state], n)
        yield g
        yield GaugeMetricFamily("libra_actor_capacity", "Sum of actor capacities (concurrent work).", value=s.capacity)
        yield GaugeMetricFamily("libra_actor_load", "Work items held by actors now.", value=s.load)
        yield GaugeMetricFamily("libra_work_inflight", "Accepted work without a reply yet.", value=s.inflight)
        yield GaugeMetricFamily("libra_clients", "Connected client sessions.", value=s.clients)
        yield from gpu_families(s.gpus)
        ev = CounterMetricFamily("libra_broker_events", "Other broker counters (BrokerState.stats).",
                                 labels=["event"])
        for k, v in sorted(s.stats.items()):
            if k in _NAMED_COUNTERS:
                yield CounterMetricFamily(f"libra_{_NAMED_COUNTERS[k]}", f"Work {k} (BrokerState.stats).", value=v)
            elif k == "policy_lag":
                yield GaugeMetricFamily("libra_policy_lag", "Policy versions between rollout and training.", value=v)
            else:
                ev.add_metric([k], v)
        yield ev
        c = CounterMetricFamily("libra_replies", "Replies sent to clients by work kind and outcome.",
                                labels=["kind", "outcome"])
        for (kind, outcome), n in sorted(s.replies.items()):
            c.add_metric([kind, outcome], n)
        yield c
        yield self._hist("libra_work_latency_seconds", "Submit-to-reply latency by work kind.", s.latency)
        yield self._hist("libra_work_exec_seconds", "Execution time reported by actors, by work kind.", s.exec_time)
        yield GaugeMetricFamily("libra_act_seconds", f"Mean action completion time over the last {self.window_s:g}s.",
                                value=s.act_mean_s)
        yield CounterMetricFamily("libra_generated_tokens", "Tokens generated by rollout turns.",
                                  value=s.rollout.get("tokens", 0))
        yield GaugeMetricFamily("libra_tokens_per_second", f"Generated tokens per second over the last "
                                f"{self.window_s:g}s.", value=s.tokens_per_s)
        for k in ("turns", "migrations", "migrated_tokens"):
            yield CounterMetricFamily(f"libra_rollout_{k}", f"Rollout routing: {k.replace('_', ' ')}.",
                                      value=s.rollout.get(k, 0))
        yield GaugeMetricFamily("libra_rollout_trajectories", "Live trajectories known to the router.",
                                value=s.trajectories)
        yield CounterMetricFamily("libra_broker_core_errors", "Exceptions caught around the broker core.",
                                  value=s.core_errors)
        info = GaugeMetricFamily("libra_broker_info", "Broker identity.", labels=sorted(s.info))
        info.add_metric([s.info[k] for k in sorted(s.info)], 1)
        yield info

    def _hist(self, name: str, doc: str, data: dict[str, tuple[list[int], float]]) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, doc, labels=["kind"])
        for kind, (counts, total) in sorted(data.items()):
            cum, buckets = 0, []
            for bound, n in zip((*self.buckets, float("inf")), counts):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
            h.add_metric([kind], buckets, sum_value=total)
        return h
