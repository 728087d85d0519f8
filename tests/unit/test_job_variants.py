"""The broker's RL job with the job file's variants: the zero-variance group filter (DAPO's dynamic
sampling), eval rounds that are counted and never batched (greedy accuracy, unbiased pass@k), and a resumed
job's step and data offsets. JobHost driven with fake episode results; no sockets, no engines."""

from __future__ import annotations

import math

import pytest

from libra.broker.job_host import JobHost, JobSpec
from libra.broker.job_eval_rounds import pass_at_k
from libra.broker.job_groups import JobState, Trajectory

SPEC = {"steps": 2, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 0, "world_size": 1, "env": "arith",
        "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
        "master_port": 12345, "checkpoint_dir": "/tmp/ck", "seed": 3}
ROWS = [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1} for i in range(50)]


def result(reward: float, tokens: int = 10, version: int = 0) -> dict:
    return {"reward": reward, "versions": [version], "gen_tokens": tokens // 2, "tokens": tokens,
            "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"traj/{tokens}", "version": None, "server_key": None,
                    "bytes": 1}, "info": {"correct": reward > 0.5, "start": 1.0, "end": 2.0}}


def train_outputs(h: JobHost, works: list, version: int, now: float) -> None:
    for w in works:
        h.on_reply(w.tag, True, {"rank": w.args["rank"], "weights_version": version, "metrics": {}, "checksum": "c",
                                 "weights": None}, "", now)


def run(h: JobHost, reward_of, max_rounds: int = 200) -> list:
    """Answer every episode with ``reward_of(row, index)`` and every train work, until the job stops; returns
    every work handed out. Bounded: a job that never finishes fails the test instead of hanging."""
    seen, now, version = [], 0.0, 0
    for _ in range(max_rounds):
        now += 1.0
        works = h.take_work(now)
        seen += works
        train = [w for w in works if w.kind == "train"]
        for w in works:
            if w.kind == "episode":
                h.on_reply(w.tag, True, result(reward_of(w.args["row"], w.args["index"]), version=version), "", now)
        if train:
            version += 1
            train_outputs(h, train, version, now)
        if not h.active:
            return seen
    raise AssertionError(f"the job did not finish within {max_rounds} rounds: {h.poll(0)}")


# ------------------------------------------------------------------------------------ zero-variance filter
def test_state_filters_flat_groups_and_admits_others_up_to_the_bound() -> None:
    st = JobState(1, 2, 2, 0, filter_zero_variance=True, max_extra_groups=3)
    for _ in range(2):
        st.admit("p")
    for gid in (0, 1):  # both flat: filtered, their slots open again
        for i in range(2):
            st.add(Trajectory(gid, i, 5, 2, 1.0, [0]))
    assert st.filtered_groups == 2 and st.cut_batch() is None and st.can_admit()
    g2, g3 = st.admit("q"), st.admit("r")
    for i, r in enumerate((0.0, 1.0)):  # g2 has signal
        st.add(Trajectory(g2.gid, i, 5, 2, r, [0]))
    for i in range(2):  # g3 flat: the 3rd and last filter of this step
        st.add(Trajectory(g3.gid, i, 5, 2, 0.0, [0]))
    assert st.filtered_groups == 3
    g4 = st.admit("s")
    for i in range(2):  # flat again, but the bound is spent: batched as it is
        st.add(Trajectory(g4.gid, i, 5, 2, 0.0, [0]))
    batch = st.cut_batch()
    assert [g.gid for g in batch] == [g2.gid, g4.gid] and st.window == {"completed": 5, "zero_variance": 4, "filtered": 3}


def test_without_the_filter_flat_groups_are_trained_and_reported() -> None:
    h = JobHost("j", JobSpec.from_mapping({**SPEC, "steps": 1}), ROWS, 0.0)
    run(h, lambda row, i: 1.0)
    (rec,) = h.records
    assert rec["zero_variance_share"] == 1.0 and rec["no_signal"] is True and rec["filtered_groups"] == 0
    assert rec["batch_zero_variance_share"] == 1.0


def test_filter_on_all_equal_rewards_draws_new_groups_then_reports_no_signal_without_hanging() -> None:
    h = JobHost("j", JobSpec.from_mapping({**SPEC, "filter_zero_variance": True, "max_extra_groups": 3}), ROWS, 0.0)
    works = run(h, lambda row, i: 1.0)
    assert h.phase == "done" and len(h.records) == 2
    rows = {w.args["row"]["pid"] for w in works if w.kind == "episode"}
    assert len(rows) == 2 * 2 + 2 * 3  # 2 steps x (2 groups + 3 extra groups drawn)
    for rec in h.records:
        assert rec["filtered_groups"] == 3 and rec["no_signal"] is True and rec["zero_variance_share"] == 1.0


def test_filter_trains_on_signal_when_new_groups_bring_it() -> None:
    # rows with an even number answer correctly on some samples only; odd rows always the same
    h = JobHost("j", JobSpec.from_mapping({**SPEC, "filter_zero_variance": True}), ROWS, 0.0)
    run(h, lambda row, i: float(i == 0) if int(row["pid"][1:]) % 2 == 0 else 0.0)
    for rec in h.records:
        assert rec["no_signal"] is False and rec["batch_zero_variance_groups"] == 0 and rec["filtered_groups"] >= 1
        assert rec["rewards"].count(1.0) == 2  # one correct sample in each of the 2 groups


# ------------------------------------------------------------------------------------ eval rounds
def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    assert math.isclose(pass_at_k(4, 1, 1), 0.25) and math.isclose(pass_at_k(5, 2, 2), 1 - 3 / 10)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_eval_rounds_run_every_n_steps_and_at_the_end_and_are_never_batched() -> None:
    ev_rows = [{"pid": f"e{i}", "question": "q", "answer": i} for i in range(3)]
    h = JobHost("j", JobSpec.from_mapping({**SPEC, "steps": 3, "eval_rows": ev_rows, "eval_every": 2, "eval_k": 2,
                                            "eval_temperature": 0.7}), ROWS, 0.0)

    def reward(row: dict, i: int) -> float:
        if row["pid"].startswith("e"):  # e0: always right; e1: right on sample index 1 only; e2: never
            return {"e0": 1.0, "e1": float(i == 1), "e2": 0.0}[row["pid"]]
        return float(i == 0)

    works = run(h, reward)
    evals = [w for w in works if w.tag.startswith("ev:")]
    assert len(evals) == 2 * 3 * 3  # rounds after steps 2 and 3; 3 prompts x (greedy + 2 samples)
    greedy = [w for w in evals if w.tag.endswith(":g")]
    assert all(w.args["episode"]["sampling"]["temperature"] == 0.0 for w in greedy)
    assert all(w.args["episode"]["sampling"]["temperature"] == 0.7 for w in evals if w not in greedy)
    assert not any(w.args["row"]["pid"].startswith("e") for w in works if w.tag.startswith("ep:"))
    kinds = [(r.get("kind", "step"), r["step"]) for r in h.records]
    assert kinds == [("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("eval", 3)]
    ev = h.records[-1]
    assert ev["greedy_accuracy"] == pytest.approx(1 / 3)  # greedy is index 0: only e0
    assert ev["pass@1"] == pytest.approx((1 + 0.5 + 0) / 3) and ev["pass@2"] == pytest.approx(2 / 3)
    # eval trajectories never reach a train batch: each step trained its own 2 groups x 3 samples
    assert all(rec["sequences"] == 6 for rec in h.records if "kind" not in rec)


def test_job_is_done_only_after_the_final_eval_round_and_failed_evals_count_as_wrong() -> None:
    h = JobHost("j", JobSpec.from_mapping({**SPEC, "steps": 1, "eval_rows": [{"pid": "e0"}], "eval_k": 1}), ROWS, 0.0)
    now = 0.0
    for _ in range(20):
        now += 1
        works = h.take_work(now)
        for w in works:
            if w.kind == "episode" and w.tag.startswith("ep:"):
                h.on_reply(w.tag, True, result(float(w.args["index"] == 0)), "", now)
        if any(w.kind == "train" for w in works):
            train_outputs(h, [w for w in works if w.kind == "train"], 1, now)
            break
    assert h.active and h.outstanding()  # trained its last step, eval still out
    evals = h.take_work(now)
    assert sorted(w.tag for w in evals) == ["ev:1:0:g", "ev:1:0:s0"]
    h.on_reply(evals[0].tag, False, None, "runner died", now)
    assert h.active
    h.on_reply(evals[1].tag, True, result(1.0), "", now)
    assert h.phase == "done" and h.records[-1]["episodes_failed"] == 1
    assert h.poll(0)["records"][-1]["kind"] == "eval"


# ------------------------------------------------------------------------------------ resume offsets
def test_a_resumed_job_numbers_steps_and_checkpoints_on_and_reports_the_data_position() -> None:
    h = JobHost("j", JobSpec.from_mapping({**SPEC, "steps": 1, "step_offset": 4, "row_offset": 40,
                                            "checkpoint_every": 5}), ROWS, 0.0)
    works = run(h, lambda row, i: float(i == 0))
    (train,) = [w for w in works if w.kind == "train"]
    assert train.args["step"] == 5 and train.args["checkpoint"] == "/tmp/ck/step5"
    (rec,) = h.records
    assert rec["step"] == 5 and rec["checkpoint"] == "/tmp/ck/step5" and rec["data_position"] == 42


def test_the_no_signal_line_and_the_eval_report_say_each_thing_once() -> None:
    from libra.cli import _eval_lines
    from libra.rl.evals import signal_line

    rec = {"step": 2, "no_signal": True, "batch_zero_variance_groups": 2, "zero_variance_share": 0.0,
           "groups_completed": 0, "filtered_groups": 0}
    line = signal_line(rec)
    assert line is not None and "completed before the last step" in line and "share" not in line
    line = signal_line({**rec, "groups_completed": 4, "zero_variance_share": 0.5})
    assert line is not None and "of the 4 groups completed since the last step 0.50" in line
    assert signal_line({**rec, "no_signal": False}) is None
    one = {"rounds": 1, "prompts": 2, "first": {"step": 2, "pass@1": 0.5}, "last": {"step": 2, "pass@1": 0.5}}
    (text,) = _eval_lines(one)
    assert text.count("step 2") == 1
    two = {**one, "rounds": 2, "first": {"step": 1, "pass@1": 0.25}}
    (text,) = _eval_lines(two)
    assert "step 1: pass@1 0.250; step 2: pass@1 0.500" in text
