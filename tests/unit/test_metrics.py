"""BrokerMetrics driven by a real BrokerState with events (no sockets): what a scrape reports."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="prometheus-client is not installed (pip install prometheus-client)")

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from libra.broker.events import PeerMessage, Tick
from libra.broker.metrics import LATENCY_BUCKETS, BrokerMetrics, actor_role
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

A1, A2, C = b"actor-1", b"actor-2", b"client"


class Rig:
    """A broker core plus its metrics, fed exactly as ``server.py`` feeds them."""

    def __init__(self, **cfg: object) -> None:
        self.state = BrokerState(BrokerConfig(heartbeat_s=1.0, liveness=3, **cfg))  # type: ignore[arg-type]
        self.metrics = BrokerMetrics(self.state, snapshot_s=0.5, window_s=10.0)
        self.now = 0.0

    def send(self, peer: bytes, msg: object, dt: float = 0.0) -> list:
        self.now += dt
        ev = PeerMessage(peer, msg)
        cmds = self.state.handle(ev, self.now)
        self.metrics.observe(ev, cmds, self.now)
        return cmds

    def tick(self, dt: float = 1.0) -> None:
        self.now += dt
        ev = Tick()
        self.metrics.observe(ev, self.state.handle(ev, self.now), self.now)
        self.metrics.tick(self.now, core_errors=0)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = generate_latest(self.metrics.registry).decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def assigns(cmds: list) -> list[m.Assign]:
    return [c.msg for c in cmds if isinstance(c.msg, m.Assign)]


@pytest.fixture
def rig() -> Rig:
    r = Rig()
    r.send(C, m.ClientHello("client-1", 1))
    for peer, aid in ((A1, "a1"), (A2, "a2")):
        r.send(peer, m.ActorHello(aid, "h", aid, 1, {"action": ["echo", "sleep"]}, ["action"], 1))
        r.send(peer, m.Bid(["action"], 1))
    return r


def test_queue_depth_actor_states_and_latency_histogram(rig: Rig) -> None:
    a1 = assigns(rig.send(C, m.Submit("r1", "action", "echo", 1, None, 60.0)))
    a2 = assigns(rig.send(C, m.Submit("r2", "action", "echo", 2, None, 60.0)))
    assert assigns(rig.send(C, m.Submit("r3", "action", "echo", 3, None, 60.0))) == []  # both actors busy
    rig.tick(0.5)
    s = rig.scrape()
    assert s[("libra_queue_depth", (("kind", "action"), ("name", "echo")))] == 1
    assert s[("libra_actors", (("role", "action"), ("state", "busy")))] == 2
    assert s[("libra_work_inflight", ())] == 3
    assert s[("libra_actor_load", ())] == 2 and s[("libra_actor_capacity", ())] == 2

    # r1 answers 0.52 s after its submit (exec 0.015 s), r2 after 2.0 s: they land in different buckets.
    (w1,), (w2,) = a1, a2
    rig.send(A1, m.WorkResult(w1.work_id, w1.lease, True, 1, duration_s=0.015), dt=0.02)
    rig.send(A2, m.WorkResult(w2.work_id, w2.lease, False, None, "boom", "tool broke", 0.5), dt=1.48)
    rig.tick(0.5)
    s = rig.scrape()
    lat = {dict(k[1])["le"]: v for k, v in s.items() if k[0] == "libra_work_latency_seconds_bucket"}
    assert lat["0.5"] == 0 and lat["1.0"] == 1 and lat["2.5"] == 2 and lat["+Inf"] == 2
    assert s[("libra_work_latency_seconds_count", (("kind", "action"),))] == 2
    assert s[("libra_work_latency_seconds_sum", (("kind", "action"),))] == pytest.approx(0.52 + 2.0)
    ex = {dict(k[1])["le"]: v for k, v in s.items() if k[0] == "libra_work_exec_seconds_bucket"}
    assert ex["0.01"] == 0 and ex["0.025"] == 1 and ex["0.5"] == 2
    assert s[("libra_replies_total", (("kind", "action"), ("outcome", "ok")))] == 1
    assert s[("libra_replies_total", (("kind", "action"), ("outcome", "tool_failed")))] == 1
    assert s[("libra_work_completed_total", ())] == 1 and s[("libra_work_failed_total", ())] == 1
    assert s[("libra_act_seconds", ())] == pytest.approx((0.52 + 2.0) / 2)
    # r3 went to the first actor that freed up; the queue is empty again
    assert s[("libra_queue_depth", (("kind", "action"), ("name", "echo")))] == 0
    assert s[("libra_actors", (("role", "action"), ("state", "busy")))] == 1
    assert s[("libra_actors", (("role", "action"), ("state", "idle")))] == 1


def test_rejections_count_as_outcomes_without_latency(rig: Rig) -> None:
    rig.send(C, m.Submit("r1", "action", "nope", 1, None, 60.0))
    rig.tick()
    s = rig.scrape()
    assert s[("libra_replies_total", (("kind", "action"), ("outcome", "unknown_tool")))] == 1
    assert s[("libra_broker_events_total", (("event", "unknown_tool"),))] == 1
    assert not any(k[0] == "libra_work_latency_seconds_count" for k in s)


def test_requeue_after_actor_death_and_timeout_are_counted(rig: Rig) -> None:
    (w,) = assigns(rig.send(C, m.Submit("r1", "action", "sleep", {"seconds": 9}, None, 5.0)))
    for _ in range(4):  # A1 holds r1; only A2 keeps heartbeating, so A1 expires and r1 is re-queued to A2
        rig.send(A2, m.Heartbeat(), dt=1.0)
        rig.tick(0.0)
    s = rig.scrape()
    assert s[("libra_work_requeued_total", ())] == 1
    assert s[("libra_broker_events_total", (("event", "actors_expired"),))] == 1
    assert s[("libra_actors", (("role", "action"), ("state", "busy")))] == 1
    rig.send(A2, m.Heartbeat(), dt=1.5)
    rig.tick(0.0)  # past the 5 s deadline: a typed timeout reply
    s = rig.scrape()
    assert s[("libra_replies_total", (("kind", "action"), ("outcome", "timeout")))] == 1
    assert s[("libra_work_latency_seconds_count", (("kind", "action"),))] == 1
    assert w.work_id not in rig.state.works


def test_tokens_per_second_from_rollout_stats() -> None:
    r = Rig()
    r.tick(1.0)
    r.state.rollout.stats["tokens"] += 500  # what turn_done adds for generated tokens
    r.tick(1.0)
    r.state.rollout.stats["tokens"] += 1500
    r.tick(1.0)
    s = r.scrape()
    assert s[("libra_generated_tokens_total", ())] == 2000
    assert s[("libra_tokens_per_second", ())] == pytest.approx(2000 / 2.0)


def test_scrape_before_the_first_tick_shows_zero_counters() -> None:
    s = Rig().scrape()
    assert s[("libra_work_completed_total", ())] == 0 and s[("libra_tokens_per_second", ())] == 0


def test_snapshot_is_rate_limited_and_scrape_reads_only_the_snapshot(rig: Rig) -> None:
    rig.tick(1.0)
    before = rig.scrape()[("libra_work_inflight", ())]
    rig.send(C, m.Submit("r1", "action", "echo", 1, None, 60.0))
    rig.send(C, m.Submit("r2", "action", "echo", 1, None, 60.0))
    rig.send(C, m.Submit("r3", "action", "echo", 1, None, 60.0))
    assert rig.scrape()[("libra_work_inflight", ())] == before  # live state not read by a scrape
    rig.tick(0.1)  # within snapshot_s of the last snapshot: not refreshed
    assert rig.scrape()[("libra_work_inflight", ())] == before
    rig.tick(0.5)
    assert rig.scrape()[("libra_work_inflight", ())] == 3


def test_pending_requests_are_forgotten_when_their_reply_went_elsewhere(rig: Rig) -> None:
    rig.send(C, m.Submit("r1", "action", "sleep", {"seconds": 1}, None, 2.0))
    assert len(rig.metrics._pending) == 1
    rig.send(b"other", m.ClientHello("client-1", 2))  # same client id on a new socket resubmits
    rig.send(b"other", m.Submit("r1", "action", "sleep", {"seconds": 1}, None, 2.0))
    for _ in range(100):  # forgotten 60 s after its deadline, at the next 30 s sweep
        rig.send(A1, m.Heartbeat())
        rig.send(A2, m.Heartbeat())
        rig.tick(1.0)
    assert rig.metrics._pending == {}


def test_actor_role_label() -> None:
    assert actor_role(frozenset({"generate", "action"})) == "action+generate"
    assert actor_role(frozenset()) == "none"
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
