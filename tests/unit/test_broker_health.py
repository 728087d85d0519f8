"""What the broker's /healthz and /readyz answer (libra.broker.health.BrokerHealth), on a hand-moved clock."""

from __future__ import annotations

import pytest

from libra.broker.health import BrokerHealth


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(stall_s: float = 5.0) -> tuple[BrokerHealth, Clock, dict[str, float | None]]:
    clock = Clock()
    h = BrokerHealth(stall_s, clock=clock)
    tick: dict[str, float | None] = {"last": None}
    h.beat = lambda: tick["last"]
    return h, clock, tick


def test_starting_is_alive_but_not_ready() -> None:
    h, clock, _ = make()
    clock.t += 1000  # however long the journal takes to load: no loop of its own to be stuck yet
    assert h.healthz() == (200, {"status": "ok", "phase": "starting", "last_tick_s": None})
    assert h.readyz() == (503, {"status": "starting", "phase": "starting", "last_tick_s": None})


def test_a_standby_is_ready_only_after_it_took_over() -> None:
    h, clock, tick = make()
    h.set_phase("standby")
    clock.t += 60
    assert h.healthz()[0] == 200
    assert h.readyz() == (503, {"status": "standby", "phase": "standby", "last_tick_s": None})
    h.set_phase("serving")
    assert h.readyz()[0] == 200
    tick["last"] = clock.t
    assert h.readyz() == (200, {"status": "ok", "phase": "serving", "last_tick_s": 0.0})


def test_a_loop_that_stops_ticking_is_stalled_and_recovers() -> None:
    h, clock, tick = make(stall_s=5.0)
    h.set_phase("serving")
    tick["last"] = clock.t
    clock.t += 5.0
    assert h.healthz()[0] == 200  # at the limit: still alive
    clock.t += 0.5
    code, body = h.healthz()
    assert (code, body["status"], body["last_tick_s"]) == (503, "stalled", 5.5)
    assert h.readyz()[0] == 503  # a stuck loop serves nobody
    tick["last"] = clock.t  # it turned again
    assert h.healthz()[0] == h.readyz()[0] == 200


def test_before_the_first_tick_the_clock_runs_from_the_moment_it_began_serving() -> None:
    h, clock, _ = make(stall_s=2.0)
    clock.t += 50  # a long start is not a stall
    h.set_phase("serving")
    assert h.healthz()[0] == 200
    clock.t += 3.0  # but a loop that never ticks once it serves is
    assert h.healthz() == (503, {"status": "stalled", "phase": "serving", "last_tick_s": 3.0})


def test_stopping_is_not_ready() -> None:
    h, _, _ = make()
    h.set_phase("serving")
    h.set_phase("stopping")
    assert h.readyz()[0] == 503 and h.readyz()[1]["status"] == "stopping"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        BrokerHealth(0)
    with pytest.raises(ValueError, match="unknown phase 'ready'"):
        BrokerHealth().set_phase("ready")
