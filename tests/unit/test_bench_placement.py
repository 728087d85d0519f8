"""``python -m libra.bench placement`` runs both core pools on the same submit/release sequence and they place
every action on the same actor with the same core ids; the table reports the ratio."""

from __future__ import annotations

from libra.bench import placement


def test_the_placement_benchmark_places_identically_with_both_pools(capsys) -> None:
    out = placement.run([3], cores=32, numa=2, load=0.5, steps=40, seed=1, repeats=1)
    (row,) = out["rows"]
    assert row["same_placements"] and row["placed"] > 0 and row["rounds"] == 40
    assert row["bitsets_per_s"] > 0 and row["scanning_per_s"] > 0 and row["ratio"] is not None
    burst = placement.run([2], cores=32, numa=4, load=0.5, steps=10, seed=2, repeats=1, burst=4)["rows"][0]
    assert burst["same_placements"] and burst["placed"] > 10  # several actions placed per round
    assert placement.main(["--actors", "2", "--cores", "16", "--steps", "10", "--repeats", "1", "--burst", "2"]) == 0
    assert "same placements" in capsys.readouterr().out


def test_bad_arguments_are_refused_with_a_message(capsys) -> None:
    assert placement.main(["--actors", "two"]) == 2
    assert placement.main(["--load", "1.5"]) == 2
    assert "--load" in capsys.readouterr().err
