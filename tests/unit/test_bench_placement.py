"""``python -m libra.bench placement`` places every action on CPU ids no other running action holds, makes the
same placements on every repeat, and reports placements/s."""

from __future__ import annotations

from libra.bench import placement


def test_the_placement_benchmark_places_on_free_ids_only(capsys) -> None:
    out = placement.run([3], cores=32, numa=2, load=0.5, steps=40, seed=1, repeats=2)
    (row,) = out["rows"]
    assert row["exclusive"] and row["same_placements"] and row["placed"] > 0 and row["rounds"] == 40
    assert row["per_s"] > 0 and row["ms_per_round"] > 0
    burst = placement.run([2], cores=32, numa=4, load=0.5, steps=10, seed=2, repeats=1, burst=4)["rows"][0]
    assert burst["exclusive"] and burst["placed"] > 10  # several actions placed per round
    assert placement.main(["--actors", "2", "--cores", "16", "--steps", "10", "--repeats", "1", "--burst", "2"]) == 0
    assert "ids exclusive" in capsys.readouterr().out


def test_bad_arguments_are_refused_with_a_message(capsys) -> None:
    assert placement.main(["--actors", "two"]) == 2
    assert placement.main(["--load", "1.5"]) == 2
    assert "--load" in capsys.readouterr().err
