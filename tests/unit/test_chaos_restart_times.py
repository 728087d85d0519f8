"""The chaos bench's times after a broker restart (issue #28 item 2): the queued calls are those whose run
started after the restart; their answers are timed from the restart and from the last actor's
re-registration, next to the drain time at the rate the calls ran before the kill."""

from __future__ import annotations

from pathlib import Path

from libra.bench.chaos import _after_restart, _ledger


def test_queued_calls_are_timed_from_the_restart_and_from_the_actors_return(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    # five calls started before the kill (at 1 call/s), one adopted call answered after the restart, and two
    # calls that first ran after it (a half-written line is skipped)
    ledger.write_text("0 1.0\n1 2.0\n2 3,0\n3 4.0\n4 5.0\n5 20.5\n6 21.0\n7")
    runs = _ledger(ledger)
    assert [i for i, _ in runs] == ["0", "1", "2", "3", "4", "5", "6"] and runs[2] == ("2", 3.0)
    answered = {0: 1.5, 4: 19.0, 5: 20.8, 6: 22.0}
    r = _after_restart(runs, answered, (10.0, 18.0, 20.0), 0.1)
    assert r["queued_after_restart"] == 2 and r["actors_back_s"] == 2.0
    assert r["first_answer_s"] == 1.0  # call 4, adopted: answered before the actors' status showed both
    assert (r["queued_first_answer_s"], r["queued_last_answer_s"]) == (2.8, 4.0)
    assert r["queued_first_start_after_actors_s"] == 0.5
    assert (r["queued_first_answer_after_actors_s"], r["queued_last_answer_after_actors_s"]) == (0.8, 2.0)
    assert r["rate_before_kill_per_s"] == 1.0 and r["drain_at_rate_before_s"] == 2.0
    assert r["drain_floor_s"] == 0.2
