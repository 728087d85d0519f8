"""A training step that runs out of memory is retried with smaller micro-batches (and makes the planner
re-plan) instead of failing the job; a step that cannot be split further fails with a clear error; any other
train failure still fails the job. Pure: JobHost and BrokerState driven by hand, no processes."""

from __future__ import annotations

from libra.broker.events import Tick
from libra.broker.job_host import JobHost, JobSpec
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

SPEC = {"steps": 1, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 0, "world_size": 2, "env": "arith",
        "micro_batch_tokens": 256}
ROWS = [{"question": f"{i}+1", "answer": i + 1} for i in range(4)]
OOM = "train step failed (oom) on rank(s) [0]; rank 0: OutOfMemoryError: CUDA out of memory"


def episode(tokens: int, reward: float) -> dict:
    return {"reward": reward, "versions": [0], "gen_tokens": tokens // 2, "tokens": tokens,
            "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"traj/{tokens}", "version": None, "server_key": None,
                    "bytes": tokens}, "info": {"start": 1.0, "end": 2.0}}


def at_training(**over: object) -> tuple[JobHost, list]:
    """A host whose first step's train works are out (six trajectories of 40..90 tokens)."""
    h = JobHost("j", JobSpec.from_mapping({**SPEC, **over}), ROWS, 0.0)
    for i, w in enumerate(h.take_work(0.0)):
        h.on_reply(w.tag, True, episode(40 + 10 * i, float(i % 2)), "", 1.0)
    train = h.take_work(2.0)
    assert [w.kind for w in train] == ["train", "train"]
    return h, train


def largest_micro_batch(works: list) -> int:
    return max(len(mb) for mbs in works[0].args["micro_batches"] for mb in mbs)


def reply_ok(h: JobHost, works: list, now: float) -> None:
    for w in works:
        r = w.args["rank"]
        weights = {"endpoint": "tcp://t:1", "name": "w/v1", "version": 1} if r == 0 else None
        h.on_reply(w.tag, True, {"rank": r, "weights_version": 1, "metrics": {}, "checksum": "c", "weights": weights},
                   "", now)


def test_an_oom_retries_the_step_with_smaller_micro_batches_under_new_tags() -> None:
    h, train = at_training()
    assert [w.tag for w in train] == ["train:1:0", "train:1:1"]
    before = largest_micro_batch(train)
    assert before > 1
    h.on_reply(train[0].tag, False, None, OOM, 3.0, code="oom")
    assert h.active and h.error == "" and h.train_ooms == 1
    retry = h.take_work(3.0)
    assert [w.tag for w in retry] == ["train:1:0:a1", "train:1:1:a1"]
    assert largest_micro_batch(retry) < before  # the same trajectories, split finer
    names = lambda ws: sorted(p["ref"]["name"] for rank in ws[0].args["parts"] for p in rank)  # noqa: E731
    assert names(retry) == names(train)
    (dec,) = [r for r in h.records if r.get("kind") == "decision"]
    assert dec["what"] == "oom_replan" and dec["step"] == 1 and dec["t"] == 3.0 and "out of memory" in dec["text"]
    assert dec["detail"]["attempt"] == 1 and dec["detail"]["micro_batch_tokens"] < 256
    # the failed attempt's other rank replies late (it failed the same step, or even finished): ignored
    h.on_reply(train[1].tag, False, None, OOM, 3.1, code="oom")
    reply_ok(h, train[1:], 3.2)
    assert h.active and h.train_ooms == 1 and h.state.steps_done == 0
    reply_ok(h, retry, 4.0)
    steps = [r for r in h.records if "kind" not in r]
    assert len(steps) == 1 and steps[0]["oom_retries"] == 1 and steps[0]["micro_batch_tokens"] < 256
    assert steps[0]["train_time_s"] == 2.0  # from the first attempt's start: the retry is part of the step
    poll = h.poll(0)
    assert poll["state"] == "done" and poll["oom_retries"] == 1 and poll["decisions"] == {"oom_replan": 1}


def test_the_oom_is_also_recognised_by_the_trainers_error_text() -> None:
    h, train = at_training()
    h.on_reply(train[1].tag, False, None, "tool_failed: " + OOM, 3.0)
    assert h.active and h.train_ooms == 1 and [w.tag for w in h.take_work(3.0)][0] == "train:1:0:a1"


def test_an_oom_with_one_trajectory_per_micro_batch_fails_the_job_saying_so() -> None:
    h, train = at_training(micro_batch_tokens=1)  # every micro-batch is already one trajectory
    assert largest_micro_batch(train) == 1
    h.on_reply(train[0].tag, False, None, OOM, 3.0, code="oom")
    assert h.phase == "failed" and "one trajectory per micro-batch" in h.error and "cannot be split" in h.error
    assert h.take_work(3.0) == []


def test_repeated_ooms_halve_until_one_trajectory_then_fail() -> None:
    h, work = at_training()
    for attempt in range(1, 10):
        h.on_reply(work[0].tag, False, None, OOM, 3.0 + attempt, code="oom")
        if not h.active:
            break
        work = h.take_work(3.0 + attempt)
        assert work[0].tag.endswith(f":a{attempt}")
    assert h.phase == "failed" and "one trajectory per micro-batch" in h.error
    assert largest_micro_batch(work) == 1 and 1 < attempt < 9


def test_a_non_oom_train_failure_still_fails_the_job() -> None:
    h, train = at_training()
    h.on_reply(train[0].tag, False, None, "train step failed (step_failed) on rank(s) [0]: boom", 3.0,
               code="train_failed")
    assert h.phase == "failed" and "failed on rank 0" in h.error and h.train_ooms == 0
    assert h.take_work(3.0) == []


def test_the_broker_core_forwards_a_train_oom_to_its_planner() -> None:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "grp", "interval_s": 600.0}))
    s.handle(Tick(), 0.0)
    h, train = at_training()
    s.jobs["j"] = h
    board = s._jobs
    assert s.planner is not None and not s.planner.oom_pending
    board.collect("job:j", train[0].tag, m.Reply("r", False, None, "tool_failed", OOM, tool_code="oom"))
    s.handle(Tick(), 5.0)  # the pump delivers the reply
    assert h.active and h.train_ooms == 1 and board.train_ooms == 1
    assert s.planner.oom_pending and s.planner.due(5.0)  # the next round re-plans at once
    assert s._table.owned_by("job:j")  # the retry's works were submitted


def test_an_elastic_step_that_runs_out_of_memory_retries_in_a_new_group_generation() -> None:
    from libra.broker.ehp import ActorView, EhpSettings, ElasticPool

    pool = ElasticPool(EhpSettings())
    pool.observe([ActorView("h/t0", False, ("train",)), ActorView("h/t1", False, ("train",))], 0.0, 0.0)
    h = JobHost("j", JobSpec.from_mapping(SPEC), ROWS, 0.0)
    h.elastic = pool
    for i, w in enumerate(h.take_work(0.0)):
        h.on_reply(w.tag, True, episode(40 + 10 * i, float(i % 2)), "", 1.0)
    train = h.take_work(2.0)
    assert [w.pin for w in train] == ["h/t0", "h/t1"] and train[0].args["elastic"]["generation"] == 1
    h.on_reply(train[1].tag, False, None, OOM, 3.0, code="oom")
    retry = h.take_work(3.0)
    assert h.active and [w.tag for w in retry] == ["train:1:0:a1", "train:1:1:a1"]
    assert [w.pin for w in retry] == ["h/t0", "h/t1"] and retry[0].args["elastic"]["generation"] == 2
