"""The side-effect chaos run on a small real cluster (issue #32): 2 supervisors x 4 CPU slots, 200 bash calls
that each append their id to a ledger, one slot process and then one whole supervisor with its slots
SIGKILLed while the calls run. Every call is answered with success; a call runs twice only when its slot was
killed while it ran, and then its ``attempts`` says so (never fewer starts than the ledger holds)."""

from __future__ import annotations

import pytest

from libra.bench.cluster_chaos import cluster_run

pytestmark = pytest.mark.integration


def test_a_slot_and_a_whole_supervisor_killed_lose_nothing_and_run_nothing_twice_unannounced(tmp_path) -> None:
    r = cluster_run(tmp_path, supervisors=2, slots=4, calls=200, capacity=2, sleep_s=0.5, clients=2,
                    kill_slots=1, points=(0.15, 0.35, 1.0), kill_broker=False)
    assert r["slots_killed"] == 1 and r["slot_processes"] == 8
    assert r["answered"] == 200 and r["never_answered"] == 0
    assert r["lost"] == 0 and r["failed"] == 0 and r["wrong"] == 0
    assert r["never_ran"] == 0
    assert r["twice_unexplained"] == 0
    assert r["attempts_under"] == 0  # a call run twice always says so (attempts may count a start on a slot
    # that was killed before the command ran: it is reported, not asserted)
    assert r["executed_twice"] == r["twice_after_kill"]
