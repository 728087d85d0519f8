"""The broker's periodic Global Resource Planner (``[broker.planner]``): finished trajectories in, role
directives out, on the broker's timer; bad settings are clear errors. Pure core, no sockets."""

from __future__ import annotations

import pytest

from libra.broker.events import Log, PeerMessage, PlannerDone, StartPlannerSearch, Tick
from libra.broker.plan_decider import PlannerLoop, PlannerSettings
from libra.broker.config import BrokerConfig
from libra.broker.state import BrokerState
from libra.protocol import messages as m

CAPS = {"generate": ["*"], "train": ["*"], "sync": ["*"]}
CLIENT = b"client-1"


def _broker(n_gpus: int = 16, offload: bool = False, **planner: object) -> BrokerState:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "grp", "interval_s": 60.0, **planner}),
                    planner_offload=offload)
    for k in range(n_gpus):
        aid = f"n{k // 8}/gpu{k % 8}"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, f"n{k // 8}", f"gpu{k % 8}", 1, CAPS, ["generate"], 4,
                                                       {"slot_kind": "gpu"})), 0.0)
    s.handle(PeerMessage(CLIENT, m.ClientHello("c", 1)), 0.0)
    return s


def _finish(s: BrokerState, n: int, now: float) -> None:
    """``n`` multi-turn trajectories run through the broker's rollout bookkeeping (routed turns, generated
    tokens, tool payloads) and end through the wire path (EndTrajectory from a client)."""
    view = s.rollout.view([("n0/gpu0", s.rollout.buckets[0].name, 0, 0, "n0")])
    for i in range(n):
        tid, turns = f"t{now}-{i}", 1 + i % 5
        gen = 800 + 700 * (i % 7) + (9000 if i % 13 == 0 else 0)
        for turn in range(turns):
            s.rollout.route(tid, {"prompt_tokens": 700}, view)
            s.rollout.turn_done(tid, {"gen_tokens": gen // turns})
            if turn < turns - 1:
                s.rollout.tool_returned(tid, "bash", True, {"payload_tokens": 1500 * (i % 3)}, "")
        s.handle(PeerMessage(CLIENT, m.EndTrajectory(tid, gen, True)), now)


def _directives(out: list) -> dict[str, m.Directive]:
    return {c.peer.decode(): c.msg for c in out if isinstance(getattr(c, "msg", None), m.Directive)}


def test_a_round_applies_the_first_plan_with_directives_and_shows_it_in_status() -> None:
    s = _broker()
    assert not _directives(s.handle(Tick(), 1.0))  # the first tick starts the planner's clock
    _finish(s, 64, 10.0)
    assert s.planner is not None and len(s.planner.history) == 64
    # (prompt + tool payload, generated (the client's count when larger), generate turns, tool seconds)
    assert s.planner.history[0] == (700.0, 9800.0, 1.0, 0.0) and s.planner.history[2] == (6700.0, 2200.0, 3.0, 0.0)
    assert not _directives(s.handle(Tick(), 30.0))  # not due yet (interval 60 s)
    out = s.handle(Tick(), 62.0)
    d = _directives(out)
    assert len(d) == 16 and s.plan_applier is not None  # every GPU actor gets its role
    plan = s.planner.plan
    assert plan is not None and plan.n_gpus == 16 and plan.n_train >= 1
    assert sum(x.config.get("role") == "train" for x in d.values()) == plan.n_train
    st = s.snapshot("x", 62.0).stats["planner"]
    assert st["plans_applied"] == 1 and st["decisions"][-1]["reason"] == "initial_plan"
    assert st["plan"]["n_train"] == plan.n_train and st["allocation"] == "grp"
    # while the plan is still being applied, no round runs
    assert not _directives(s.handle(Tick(), 200.0)) and s.planner.rounds == 1
    for aid, x in d.items():
        s.handle(PeerMessage(aid.encode(), m.DirectiveDone(x.directive_id, x.kinds)), 201.0)
        s.handle(PeerMessage(aid.encode(), m.Bid(x.kinds, 4)), 201.0)
    assert s.plan_applier.done
    _finish(s, 64, 250.0)
    s.handle(Tick(), 262.0)  # the next round re-evaluates the deployed plan against the candidate
    assert s.planner.rounds == 2 and s.planner.decisions[-1]["reason"] != "initial_plan"
    s.validate()


def test_too_few_gpu_actors_or_too_little_history_is_a_decision_not_an_error() -> None:
    s = _broker(n_gpus=1)
    s.handle(Tick(), 0.5)
    _finish(s, 32, 5.0)
    assert not _directives(s.handle(Tick(), 61.0))
    assert s.planner is not None and s.planner.decisions[-1]["reason"] == "too_few_gpu_actors"
    s2 = _broker(n_gpus=8)
    s2.handle(Tick(), 0.5)
    _finish(s2, 3, 5.0)  # below the re-planner's minimum history
    assert not _directives(s2.handle(Tick(), 61.0))
    assert s2.planner is not None and s2.planner.decisions[-1]["reason"] == "insufficient_history"


def test_without_a_planner_table_the_broker_never_plans() -> None:
    s = BrokerState(BrokerConfig())
    assert s.planner is None and "planner" not in s.snapshot("x", 0.0).stats


@pytest.mark.parametrize(("table", "match"), [
    ({}, "'allocation' is required"),
    ({"allocation": "best"}, "unknown allocation 'best'"),
    ({"allocation": "colocated"}, "time-shares every GPU"),
    ({"allocation": "grp", "interval": 5}, r"unknown key\(s\) interval"),
    ({"allocation": "grp", "interval_s": "5"}, "interval_s: Input should be a valid number"),
    ({"allocation": "grp", "interval_s": 0}, "interval_s must be > 0"),
    ({"allocation": "grp", "batch": 20}, "batch must be a positive multiple of group_size=16"),
    ({"allocation": "grp", "params": 3}, "params: Input should be a valid dictionary"),
])
def test_bad_planner_settings_name_the_problem(table: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlannerSettings.from_dict(table)


def test_unknown_profiles_and_the_broker_command_line_report_bad_configuration(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="broker planner"):
        PlannerLoop(PlannerSettings.from_dict({"allocation": "grp", "hardware": "tpu9"}))
    with pytest.raises(ValueError, match="params or replanner: .*cooldown"):
        PlannerLoop(PlannerSettings.from_dict({"allocation": "grp", "replanner": {"cooldown": 2}}))
    with pytest.raises(ValueError, match="params or replanner"):
        PlannerLoop(PlannerSettings.from_dict({"allocation": "static_uniform", "params": {"rollout_tpp": 2}}))
    # planner-config knobs (8-GPU steps, minimum pools) are fine, whatever the cluster will be
    PlannerLoop(PlannerSettings.from_dict({"allocation": "grp", "params": {"granularity": 8, "min_train_gpus": 8,
                                                                           "min_rollout_gpus": 8}}))
    cfg = tmp_path / "broker.toml"
    cfg.write_text('[broker]\n[broker.planner]\nallocation = "grp"\nhardware = "tpu9"\n')
    from libra.broker.__main__ import main

    assert main(["--bind", "tcp://127.0.0.1:0", "--config", str(cfg)]) == 2
    assert "bad configuration" in capsys.readouterr().err


def test_an_offloaded_round_leaves_its_search_to_the_shell_and_applies_its_result() -> None:
    s = _broker(offload=True)  # what the server does: the search runs off the event loop
    s.handle(Tick(), 1.0)
    _finish(s, 64, 10.0)
    out = s.handle(Tick(), 62.0)
    assert not _directives(out)
    (start,) = [c for c in out if isinstance(c, StartPlannerSearch)]  # the shell gets the search as a command
    job = start.job
    loop = s.planner
    assert loop is not None and loop.searching and job.decision is None
    assert not hasattr(loop, "job")  # and from nowhere else: the core holds no job for the shell to read
    assert not loop.due(500.0)  # no second round while one is in flight
    _finish(s, 5, 63.0)  # these wait for the search, then reach the re-planner
    assert not [c for c in s.handle(Tick(), 200.0) if isinstance(c, StartPlannerSearch)]
    assert loop.held == 5 and len(job.replanner.history) == 64
    job.run()  # the shell's worker thread
    d = _directives(s.handle(PlannerDone(job), 64.0))
    assert len(d) == 16 and not loop.searching and len(job.replanner.history) == 69
    assert loop.decisions[-1]["reason"] == "initial_plan" and loop.decisions[-1]["search_s"] >= 0
    assert s.handle(PlannerDone(job), 65.0) == []  # a stale (already finished) round does nothing


def test_an_inline_round_starts_no_search_command() -> None:
    s = _broker()  # the tests' and the simulator's mode: the search runs inside handle()
    s.handle(Tick(), 1.0)
    _finish(s, 64, 10.0)
    out = s.handle(Tick(), 62.0)
    assert len(_directives(out)) == 16 and not [c for c in out if isinstance(c, StartPlannerSearch)]
    (line,) = [c for c in out if isinstance(c, Log)]  # the round's decision, as a log command
    assert line.event == "planner_round" and line.fields["reason"] == "initial_plan" and "plan" not in line.fields


def test_a_crashed_or_failing_search_is_a_recorded_decision() -> None:
    s = _broker(offload=True)
    s.handle(Tick(), 1.0)
    _finish(s, 64, 10.0)
    (job,) = [c.job for c in s.handle(Tick(), 62.0) if isinstance(c, StartPlannerSearch)]
    job.error = "search crashed: RuntimeError('boom')"  # what the server sets when the thread raised
    out = s.handle(PlannerDone(job), 63.0)
    assert [(type(c), c.event, c.fields["reason"]) for c in out] == [(Log, "planner_round", "planner_error")]
    assert s.planner.decisions[-1]["reason"] == "planner_error" and "boom" in s.planner.decisions[-1]["error"]
    assert s.planner.plan is None and s.planner.due(200.0)  # the next round runs as usual


def test_planner_round_bench_measures_inline_and_offloaded_rounds(capsys) -> None:
    import json

    from libra.bench import planner_round

    assert planner_round.main(["--gpus", "8", "--repeat", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["gpus"] == 8 and row["inline_stall_ms"] > 0 and row["search_ms"] > 0
    assert row["max_loop_gap_during_search_ms"] > 0 and row["stall_ratio"] > 0


def test_tool_calls_of_a_trajectory_count_their_seconds_from_submission_to_result() -> None:
    s = _broker(n_gpus=0)
    tool = b"tools-1"
    s.handle(PeerMessage(tool, m.ActorHello("h/cpu0", "h", "cpu0", 1, {"action": ["bash"]}, ["action"], 4,
                                            {"slot_kind": "cpu"})), 0.0)
    view = s.rollout.view([("n0/gpu0", s.rollout.buckets[0].name, 0, 0, "n0")])
    s.rollout.route("t1", {"prompt_tokens": 500}, view)
    s.rollout.turn_done("t1", {"gen_tokens": 300})
    out = s.handle(PeerMessage(CLIENT, m.Submit("r1", "action", "bash", {"cmd": "ls"}, "t1")), 10.0)
    (a,) = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]
    s.handle(PeerMessage(tool, m.WorkResult(a.work_id, a.lease, True, {"payload_tokens": 40})), 12.5)
    s.rollout.route("t1", {}, view)
    s.rollout.turn_done("t1", {"gen_tokens": 200})
    s.handle(PeerMessage(CLIENT, m.EndTrajectory("t1", 500, True)), 13.0)
    assert s.planner is not None and s.planner.history[-1] == (540.0, 500.0, 2.0, 2.5)


def test_a_plan_that_does_not_fit_the_actors_is_recorded_as_apply_failed() -> None:
    # four GPU actors on four hosts: no host can hold the TP-2 rollout instances static_uniform wants
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "static_uniform", "interval_s": 60.0,
                                                           "hardware": "cpu", "model": "tiny",
                                                           "params": {"rollout_tp": 2}}))
    for k in range(4):
        aid = f"h{k}/gpu0"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, f"h{k}", "gpu0", 1, CAPS, ["generate"], 4,
                                                       {"slot_kind": "gpu"})), 0.0)
    s.handle(PeerMessage(CLIENT, m.ClientHello("c", 1)), 0.0)
    s.handle(Tick(), 1.0)
    _finish(s, 32, 10.0)
    assert not _directives(s.handle(Tick(), 62.0))
    last = s.planner.decisions[-1]
    assert last["reason"] == "apply_failed" and "aligned block" in last["error"], last
    assert s.planner.plan is None and s.planner.applied == 0 and s.plan_applier is None


def test_status_prints_the_planner_on_one_line() -> None:
    from libra.commands.status import format_status

    s = _broker()
    s.handle(Tick(), 1.0)
    _finish(s, 64, 10.0)
    s.handle(Tick(), 62.0)
    snap = s.snapshot("x", 62.0)
    text = format_status(snap.actors, snap.queues, snap.stats)
    (line,) = [x for x in text.splitlines() if x.startswith("PLANNER")]
    plan = s.planner.plan
    assert "PLANNER grp (a800/qwen3-14b, every 60.0 s): rounds=1 plans=1 history=64" in line
    assert f"train {plan.n_train} " in line and line.endswith("last: initial_plan")
    assert "planner=" not in text  # not dumped into the counters line


def test_an_actor_leaving_mid_application_abandons_the_plan_and_the_next_round_replans() -> None:
    s = _broker()
    s.handle(Tick(), 1.0)
    _finish(s, 64, 10.0)
    d = _directives(s.handle(Tick(), 62.0))
    assert len(d) == 16 and s.plan_applier is not None
    gone = sorted(d)[0]
    for aid, x in d.items():  # all but one finish switching; that one's process dies
        if aid != gone:
            s.handle(PeerMessage(aid.encode(), m.DirectiveDone(x.directive_id, x.kinds)), 63.0)
            s.handle(PeerMessage(aid.encode(), m.Bid(x.kinds, 4)), 63.0)
    s.handle(PeerMessage(gone.encode(), m.Goodbye("killed")), 64.0)
    assert s.plan_applier is None and s.planner.plan is None
    assert s.planner.decisions[-1]["reason"] == "plan_abandoned" and s.planner.decisions[-1]["actor"] == gone
    _finish(s, 64, 100.0)
    d2 = _directives(s.handle(Tick(), 130.0))  # the next round plans for the 15 actors left
    assert s.planner.plan is not None and s.planner.plan.n_gpus == 15 and gone not in d2
    assert s.planner.decisions[-1]["reason"] == "initial_plan"
    s.validate()


def test_an_rl_jobs_stage_times_drive_the_stage_imbalance_trigger() -> None:
    from types import SimpleNamespace

    s = _broker(replanner={"plan_interval": 100})  # no interval trigger in these rounds
    s.handle(Tick(), 1.0)
    _finish(s, 64, 10.0)
    d = _directives(s.handle(Tick(), 62.0))  # the first plan needs no trigger
    for aid, x in d.items():
        s.handle(PeerMessage(aid.encode(), m.DirectiveDone(x.directive_id, x.kinds)), 63.0)
        s.handle(PeerMessage(aid.encode(), m.Bid(x.kinds, 4)), 63.0)
    s.handle(Tick(), 130.0)
    assert s.planner.decisions[-1]["reason"] == "no_trigger"
    # an RL job in this broker recorded a step whose rollout took 3x its training
    s.jobs["j"] = SimpleNamespace(records=[{"step": 4, "rollout_time_s": 300.0, "train_time_s": 100.0}])
    s.handle(Tick(), 200.0)
    assert s.planner.decisions[-1]["trigger"] == "stage_imbalance"
