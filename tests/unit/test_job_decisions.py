"""Decision records: every plan applied, bucket change, role switch, EHP join or leave and out-of-memory
re-plan becomes a ``"kind": "decision"`` record of the running job, returned by JobPoll among the step
records exactly once. Pure: JobHost and BrokerState driven by hand."""

from __future__ import annotations

import pytest

from libra.broker.ehp import ActorView, EhpSettings, ElasticPool
from libra.broker.events import PeerMessage, Tick
from libra.broker.job_host import JobHost, JobSpec
from libra.broker.job_records import DECISIONS, decision_record, job_totals
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m
from libra.protocol.payloads_job import JobPollReply

SPEC = {"steps": 2, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 0, "world_size": 2, "env": "arith",
        "micro_batch_tokens": 64}
ROWS = [{"question": f"{i}+1", "answer": i + 1} for i in range(4)]
KEYS = {"kind", "what", "step", "t", "text", "detail"}


def test_a_decision_record_has_the_agreed_shape() -> None:
    rec = decision_record("plan", 3, 12.34567, "plan 1 applied", {"n_train": 2})
    assert rec == {"kind": "decision", "what": "plan", "step": 3, "t": 12.346, "text": "plan 1 applied",
                   "detail": {"n_train": 2}}
    assert set(DECISIONS) == {"plan", "role_switch", "buckets", "ehp_join", "ehp_leave", "oom_replan"}
    with pytest.raises(ValueError, match="unknown decision 'nap'"):
        decision_record("nap", 1, 0.0, "")
    totals = job_totals([rec, {"step": 1, "oom_retries": 2, "predicted_step_s": 2.0, "step_time_s": 2.0},
                         {"kind": "eval", "step": 1}])
    assert totals == {"oom_retries": 2, "decisions": {"plan": 1}, "prediction_error": 0.0}


def reply_step(h: JobHost, t: float, weights: dict) -> list:
    """Finish the episodes out now, then train the step they make; returns the step's train works."""
    for i, w in enumerate(h.take_work(t)):
        h.on_reply(w.tag, True, {"reward": float(i % 2), "versions": [h.state.version], "gen_tokens": 10,
                                 "tokens": 20, "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"t/{t}/{i}"},
                                 "info": {"start": 1.0, "end": 2.0}}, "", t + 1.0)
    train = [w for w in h.take_work(t + 1.0) if w.kind == "train"]
    members = train[0].args.get("elastic", {}).get("members") if train[0].args.get("elastic") else None
    for w in train:
        r = w.args["rank"]
        h.on_reply(w.tag, True, {"rank": r, "weights_version": h.state.version + 1, "checksum": "c",
                                 "weights": weights if r == 0 else None, "member": members[r] if members else None,
                                 "restored_version": h.state.version}, "", t + 2.0)
    return train


def test_ehp_joins_and_leaves_are_decision_records_polled_exactly_once() -> None:
    core = [ActorView("h/t0", False, ("train",)), ActorView("h/t1", False, ("train",))]
    pool = ElasticPool(EhpSettings.from_planner({"ehp": {"force": [[1, 1], [2, 0]]}}))
    pool.observe(core + [ActorView("h/x0", True, ("generate",))], 0.0, 0.0)
    h = JobHost("j", JobSpec.from_mapping(SPEC), ROWS, 0.0)
    h.elastic = pool
    weights = {"version": 1, "endpoint": "tcp://127.0.0.1:7", "name": "weights", "server_key": None, "bytes": 1}
    reply_step(h, 0.0, weights)
    first = h.poll(0)
    (join,) = [r for r in first["records"] if r.get("kind") == "decision"]
    assert set(join) == KEYS and join["what"] == "ehp_join" and join["step"] == 1 and join["t"] == 1.0
    assert join["detail"]["actor"] == "h/x0" and "h/x0" in join["text"]
    reply_step(h, 10.0, weights)
    second = h.poll(first["next_cursor"])
    kinds = [r.get("kind", "step") for r in second["records"]]
    assert kinds == ["decision", "step"]  # the leave, then step 2: none of the first poll's again
    assert second["records"][0]["what"] == "ehp_leave" and second["records"][0]["step"] == 2
    everything = h.poll(0)
    assert len(everything["records"]) == len(first["records"]) + len(second["records"])
    assert everything["decisions"] == {"ehp_join": 1, "ehp_leave": 1}
    assert JobPollReply.from_wire(everything).decisions == {"ehp_join": 1, "ehp_leave": 1}


CAPS = {"generate": ["*"], "train": ["*"], "sync": ["*"]}


def planner_broker(n_gpus: int = 8) -> BrokerState:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "grp", "interval_s": 60.0}))
    for k in range(n_gpus):
        aid = f"n0/gpu{k}"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, "n0", f"gpu{k}", 1, CAPS, ["generate"], 4,
                                                       {"slot_kind": "gpu"})), 0.0)
    s.handle(PeerMessage(b"client-1", m.ClientHello("c", 1)), 0.0)
    return s


def finish_trajectories(s: BrokerState, n: int, now: float) -> None:
    view = s.rollout.view([("n0/gpu0", s.rollout.buckets[0].name, 0, 0, "n0")])
    for i in range(n):
        tid = f"t{now}-{i}"
        s.rollout.route(tid, {"prompt_tokens": 700}, view)
        s.rollout.turn_done(tid, {"gen_tokens": 800 + 700 * (i % 7)})
        s.handle(PeerMessage(b"client-1", m.EndTrajectory(tid, 800 + 700 * (i % 7), True)), now)


def test_a_plan_its_buckets_and_its_role_switches_become_records_of_the_running_job() -> None:
    s = planner_broker()
    h = JobHost("j", JobSpec.from_mapping(SPEC), ROWS, 0.0)
    s.jobs["j"] = h
    s.handle(Tick(), 1.0)
    finish_trajectories(s, 64, 10.0)
    out = s.handle(Tick(), 62.0)  # the first round's plan is applied at once
    directives = [c for c in out if isinstance(getattr(c, "msg", None), m.Directive)]
    assert directives and s.planner.applied == 1
    recs = [r for r in h.records if r.get("kind") == "decision"]
    whats = [r["what"] for r in recs]
    assert whats[0] == "plan" and whats.count("role_switch") == len(directives)
    assert all(set(r) == KEYS and r["step"] == 1 and r["t"] == 62.0 for r in recs)
    plan = recs[0]
    assert plan["detail"]["n_gpus"] == 8 and f"{plan['detail']['n_train']} of 8 GPUs train" in plan["text"]
    b = recs[whats.index("buckets")]  # the plan's C-MLFQ buckets replace the broker's default one
    assert b["detail"]["after"] != b["detail"]["before"] and "tokens" in b["text"]
    switch = recs[whats.index("role_switch")]
    assert switch["detail"]["actor"] in {d.peer.decode() for d in directives}
    assert h.poll(0)["decisions"] == {w: whats.count(w) for w in set(whats)}


def test_decisions_without_a_running_job_are_no_records() -> None:
    s = planner_broker()
    done = JobHost("old", JobSpec.from_mapping(SPEC), ROWS, 0.0)
    done.cancel("by hand", 0.5)
    s.jobs["old"] = done
    s.handle(Tick(), 1.0)
    finish_trajectories(s, 64, 10.0)
    s.handle(Tick(), 62.0)
    assert s.planner.applied == 1 and done.records == []
