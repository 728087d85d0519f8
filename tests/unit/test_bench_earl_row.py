"""The ablation bench's EARL row runs the broker's EarlLoop on the hardware it names (issue #27 item 6)."""

from __future__ import annotations

from libra.bench.ablation import earl_run


def test_earl_row_is_the_broker_loop_on_h200() -> None:
    e = earl_run(points=3, loads=(32,))
    assert (e["hardware"], e["model"], e["selector"]) == ("h200", "qwen3-14b", "broker EarlLoop")
    assert len(e["rows"]) == 3
    # The loop's first decision places a TP (a switch from none); later ones keep or switch it.
    assert e["rows"][0]["selected_tp"] in e["configs"]
    assert e["never_oom"]
