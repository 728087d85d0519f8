"""The engine benchmarks run on the CPU with a model shape built in code (``--shape tiny``), the same code path
``--device cuda --shape qwen2-0.5b`` takes on a GPU; both sides of each comparison run and the ratio prints."""

from __future__ import annotations

import json

from libra.bench import engines


def test_engines_bench_runs_a_random_shape_and_prints_both_sides(capsys) -> None:
    assert engines.main(["--shape", "tiny", "--batches", "2", "--repeats", "1", "--new-tokens", "4",
                         "--prompt-len", "4", "--train-sequences", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["shape"] == "tiny" and res["device"] == "cpu" and res["dtype"] == "float32"
    (row,) = res["rollout"]
    assert row["ours_tok_s"] > 0 and row["hf_generate_tok_s"] > 0
    assert abs(row["ratio"] - row["ours_tok_s"] / row["hf_generate_tok_s"]) < 1e-9
    assert res["train"]["ours_step_s"] > 0 and res["train"]["floor_step_s"] > 0
