"""``[data]`` + ``[eval]`` + ``--resume`` end to end on real processes (the tiny model on loopback): the
arithmetic environment reads its prompts from a JSONL file in the seeded order, eval rounds go through the
same episode runners and broker and land in ``metrics.jsonl``, ``summary.json`` and ``eval.png``; a resumed
job starts from the last checkpoint and trains on the rows that followed in the data order."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from libra.rl.config import load_job
from libra.rl.data import DataOrder, load_rows, read_cursor
from libra.rl.driver import run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: sudo apt-get install bubblewrap")]

JOB = """
[job]
name = "data_eval"
steps = 2
prompts_per_step = 2
max_policy_lag = 0
seed = 4
checkpoint_every = 1
keep_checkpoints = 0
[model]
name = "tiny"
[env]
name = "arith"
max_turns = 1
max_new_tokens = 8
[env.options]
digit_reward = 0.02
[data]
train = "train.jsonl"
eval = "eval.jsonl"
prompt_field = "question"
epochs = 2
[eval]
every = 1
k = 2
[grpo]
group_size = 2
lr = 1e-4
[actors]
rollout = 1
trainer = 1
action = 1
"""


def test_data_eval_and_resume(tmp_path: Path) -> None:
    rows = [{"pid": f"t{i}", "question": f"What is {i} + {i + 1}?", "answer": 2 * i + 1} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"pid": f"e{i}", "question": f"What is {i} + 2?",
                                                             "answer": i + 2}) + "\n" for i in range(2)))
    (tmp_path / "job.toml").write_text(JOB)
    cfg = load_job(tmp_path / "job.toml").with_run_dir(str(tmp_path / "run"))
    run = tmp_path / "run"
    summary = run_job(cfg, progress=False)

    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    evals = read_metrics(run, "eval")
    assert [e["step"] for e in evals] == [1, 2]  # every step (and the last)
    for e in evals:
        assert e["prompts"] == 2 and e["k"] == 2 and e["episodes_failed"] == 0
        assert {"greedy_accuracy", "pass@1", "pass@2"} <= set(e) and 0.0 <= e["pass@1"] <= e["pass@2"] <= 1.0
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["eval"]["rounds"] == 2 and summary["eval"]["last"]["step"] == 2
    assert (run / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the training prompts came from the file, in the seeded order; eval prompts never trained
    order = DataOrder(load_rows(tmp_path / "train.jsonl", prompt_field="question"), seed=4, epochs=2).take(0)
    trained = [json.loads(x)["question"] for x in (run / "samples.jsonl").read_text().splitlines()]
    assert trained and set(trained) <= {r["question"] for r in order[:4]}
    cur = read_cursor(run)
    assert cur is not None and cur.step == 2 and cur.position == 4 and Path(cur.checkpoint).name == "step2"

    # resume: two more steps from step 2's checkpoint, on the rows that follow position 4 (into epoch 2)
    more = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, steps=4))
    run_job(more, progress=False, resume=True)
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [e["step"] for e in read_metrics(run, "eval")] == [1, 2, 3, 4]
    later = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["question"] for s in later if s["step"] >= 3} <= {r["question"] for r in order[4:8]}
    assert read_cursor(run).step == 4 and read_cursor(run).position == 8
    assert (run / "checkpoints" / "step4").is_dir()
