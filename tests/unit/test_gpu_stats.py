"""NVML memory and utilisation per GPU actor: sampled by the slot (a fake NVML here), carried by heartbeats,
kept by the broker, shown by ``libra status`` and exported as Prometheus gauges. No GPU needed."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from libra.actors.gpu_stats import GpuSampler, sample_gpu
from libra.actors.state import ActorIdentity, ActorState, GpuSampled, Received, SendMsg, Start
from libra.broker.config import BrokerConfig
from libra.broker.events import PeerMessage
from libra.broker.metrics import gpu_families
from libra.broker.state import BrokerState
from libra.commands.status import format_status
from libra.protocol import decode, encode
from libra.protocol import messages as m


class FakeNvml:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if self.fail:
            raise RuntimeError("NVML: GPU is lost")
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=57)


SAMPLE = {"index": 2.0, "memory_used_bytes": 3.0 * 2**30, "memory_total_bytes": 80.0 * 2**30, "utilization_pct": 57.0}


def test_a_sample_reads_memory_and_utilisation_and_is_empty_without_nvml() -> None:
    assert sample_gpu(2, FakeNvml()) == SAMPLE
    assert sample_gpu(2, FakeNvml(fail=True)) == {}


def test_the_sampler_posts_samples_until_stopped() -> None:
    got: list[GpuSampled] = []
    two = threading.Event()

    def post(ev: GpuSampled) -> None:
        got.append(ev)
        if len(got) >= 2:
            two.set()

    s = GpuSampler(2, post, GpuSampled, every_s=0.01, nvml=FakeNvml()).start()
    assert two.wait(10)
    s.stop()
    s.thread.join(10)
    assert not s.thread.is_alive() and got[0] == GpuSampled(SAMPLE)
    dead = GpuSampler(0, got.append, GpuSampled, nvml=FakeNvml(fail=True)).start()  # no NVML: it just ends
    dead.thread.join(10)
    assert not dead.thread.is_alive() and dead.samples == 0


def test_the_actor_sends_each_sample_in_a_heartbeat_once_it_has_a_session() -> None:
    a = ActorState(ActorIdentity("h/gpu2", "h", "gpu2", 1, {"generate": ["default"]}), ["generate"], 8)
    a.handle(Start(), 0.0)
    assert a.handle(GpuSampled(SAMPLE), 0.1) == []  # connecting: kept for later
    a.handle(Received(m.Welcome("s", "b", 1.0, 3, 1 << 20)), 0.2)
    (sent,) = a.handle(GpuSampled(SAMPLE), 0.3)
    assert isinstance(sent, SendMsg) and sent.msg == m.Heartbeat(SAMPLE)
    assert decode(encode(sent.msg)).msg == m.Heartbeat(SAMPLE)  # it crosses the wire as a typed field
    assert decode(encode(m.Heartbeat())).msg == m.Heartbeat()  # a heartbeat without a sample is still valid


def test_the_broker_keeps_the_sample_for_status_and_metrics() -> None:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9))
    s.handle(PeerMessage(b"a1", m.ActorHello("h/gpu2", "h", "gpu2", 1, {"generate": ["*"]}, ["generate"], 8,
                                             {"slot_kind": "gpu"})), 0.0)
    s.handle(PeerMessage(b"a1", m.Heartbeat(SAMPLE)), 1.0)
    s.handle(PeerMessage(b"a1", m.Heartbeat()), 2.0)  # a plain heartbeat keeps the last sample
    (actor,) = s.snapshot("r", 2.0).actors
    assert actor["gpu"] == SAMPLE
    text = format_status([actor], {}, {})
    assert "GPU ACTOR" in text and "3.0/80.0 GiB" in text and "57%" in text
    fams = {f.name: f for f in gpu_families({"h/gpu2": SAMPLE})}
    used = fams["libra_actor_gpu_memory_used_bytes"].samples[0]
    assert used.labels == {"actor": "h/gpu2", "gpu": "2"} and used.value == 3.0 * 2**30
    assert fams["libra_actor_gpu_utilization_percent"].samples[0].value == 57.0
    assert list(gpu_families({})) == []  # CPU-only cluster: no GPU families at all
