"""What a run reports per quarter: tool calls per episode, tool success rate, accuracy and reward, each as
mean, spread and n over episodes; and the broker's per-step record that they are pooled from."""

from __future__ import annotations

import math
import statistics

import pytest

from libra.broker.job_host import JobHost, JobSpec
from libra.cli import format_summary
from libra.rl.metrics import quarter_stats, summarize


def record(step: int, calls: list[int], oks: list[int], correct: list[int]) -> dict:
    rewards = [float(c) for c in correct]
    return {"step": step, "rewards": rewards, "reward_mean": statistics.fmean(rewards), "accuracy": statistics.fmean(correct),
            "policy_lag_max": 1, "tokens_per_s": 10.0, "step_time_s": 1.0, "episode_tool_calls": calls,
            "episode_tool_ok": oks, "episode_correct": correct}


def test_quarters_pool_episodes_with_mean_spread_and_n() -> None:
    recs = [record(1, [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]), record(2, [1, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0])]
    recs += [record(s, [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 0]) for s in (3, 4, 5, 6)]
    recs += [record(s, [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]) for s in (7, 8)]
    s = summarize(recs)
    assert s["quarter_steps"] == 2
    first, last = s["quarters"]["first"], s["quarters"]["last"]
    assert first["tool_calls_per_episode"] == {"mean": 3 / 8, "std": pytest.approx(statistics.pstdev([0, 1, 0, 0, 1, 0, 0, 1])), "n": 8}
    assert first["tool_success_rate"] == {"mean": pytest.approx(1 / 3), "std": pytest.approx(statistics.pstdev([0, 1, 0])), "n": 3}
    assert first["accuracy"]["mean"] == 1 / 8 and first["accuracy"]["n"] == 8
    assert first["reward"]["mean"] == 1 / 8 and first["reward"]["n"] == 8
    assert last["tool_calls_per_episode"]["mean"] == 0.75 and last["tool_success_rate"]["mean"] == pytest.approx(2 / 3)
    assert last["tool_success_rate"]["n"] == 6 and last["accuracy"] == {"mean": 0.5, "std": 0.5, "n": 8}
    # each figure once: the per-episode quarters, not also step means (n = steps) beside them
    assert not [k for k in s if k.startswith(("first_quarter", "last_quarter"))], sorted(s)


def test_quarters_without_tool_calls_or_per_episode_lists() -> None:
    q = quarter_stats([record(1, [0, 0], [0, 0], [0, 1])])
    assert q["tool_calls_per_episode"] == {"mean": 0.0, "std": 0.0, "n": 2}
    assert q["tool_success_rate"]["n"] == 0 and math.isnan(q["tool_success_rate"]["mean"])
    old = {"step": 1, "rewards": [0.5], "reward_mean": 0.5, "accuracy": 0.0}  # a record from before the lists
    q = quarter_stats([old])
    assert q["accuracy"]["n"] == 0 and q["reward"]["n"] == 1


def test_format_summary_prints_the_per_quarter_figures() -> None:
    recs = [record(s, [s % 2, 1], [0, 1], [0, s % 2]) for s in range(1, 9)]
    text = format_summary({**summarize(recs), "job": "j", "total_wall_s": 12.0, "final_version": 8}, "runs/j")
    lines = text.splitlines()
    for label in ("tool calls/episode", "tool success rate", "accuracy", "reward"):
        (line,) = [x for x in lines if x.startswith("  " + label)]
        assert line.count("±") == 2 and line.count("(n=") == 2, line
    (calls,) = [x for x in lines if "tool calls/episode" in x]
    assert "0.750 ± 0.433 (n=4)" in calls
    assert "per episode" in text and format_summary({"job": "j"}, "r")  # an empty summary still prints
    assert sum(line.lstrip().startswith("accuracy") for line in lines) == 1  # printed once
    assert sum(line.lstrip().startswith("reward") for line in lines) == 1


SPEC = {"steps": 1, "prompts_per_step": 1, "group_size": 3, "max_policy_lag": 0, "world_size": 1, "env": "arith",
        "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
        "master_port": 12345, "checkpoint_dir": "/tmp/ck"}


def test_step_record_counts_tool_calls_successes_and_correct_episodes() -> None:
    h = JobHost("j", JobSpec.from_mapping(SPEC), [{"pid": "p0", "question": "q", "answer": 1}], 0.0)
    works = h.take_work(0.0)
    assert len(works) == 3
    infos = [{"correct": True, "tool_calls": 1, "tool_ok": 1}, {"correct": False, "tool_calls": 1, "tool_ok": 0},
             {"correct": False, "tool_calls": 0, "tool_ok": 0}]
    for i, (w, info) in enumerate(zip(works, infos)):
        out = {"reward": float(info["correct"]), "versions": [0], "gen_tokens": 5, "tokens": 10,
               "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"traj/{i}", "version": None, "server_key": None,
                       "bytes": 90},
               "info": {**info, "start": 1.0, "end": 2.0, "load_s": [0.0]}}
        h.on_reply(w.tag, True, out, "", 1.0)
    (train,) = h.take_work(2.0)
    h.on_reply(train.tag, True, {"rank": 0, "weights_version": 1, "metrics": {}, "checksum": "c",
                                 "weights": {"endpoint": "tcp://t:1", "name": "weights/v1", "version": 1}}, "", 3.0)
    (rec,) = h.records
    assert sorted(rec["episode_tool_calls"]) == [0, 1, 1] and sum(rec["episode_tool_ok"]) == 1
    assert sum(rec["episode_correct"]) == 1 and rec["tool_success_rate"] == 0.5
    assert rec["tool_calls_per_episode"] == pytest.approx(2 / 3)
    # the lists are per episode in one order: a correct episode is the one whose call succeeded
    assert [(c, o, k) for c, o, k in zip(rec["episode_tool_calls"], rec["episode_tool_ok"], rec["episode_correct"])
            if k] == [(1, 1, 1)]
