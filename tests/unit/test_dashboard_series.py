"""The dashboard's derivations (libra.dashboard.timeline, libra.dashboard.history): the timeline de-duplicated
across polls from audit records that carry only their age, the planner's predicted gain, the series aligned to
the polls, bucket occupancy and the job curves."""

from __future__ import annotations

from libra.dashboard.history import History, actor_role, bucket_occupancy
from libra.dashboard.timeline import AUDIT_MATCH_S, ClockAnchor, Timeline

T0 = 1_800_000_000.0


def directive(actor: str, kinds: list[str], age: float, **extra: object) -> dict:
    return {"what": "directive", "key": "", "role": "ehp", "actor": actor, "kinds": kinds, "age_s": age, **extra}


def test_an_audit_record_seen_by_every_poll_is_one_entry_at_its_own_time() -> None:
    tl = Timeline()
    rec = directive("h/cpu2", ["train"], 0.3)
    assert tl.add_audit(T0, [rec]) == 1
    # the next polls see the same record, older by the time between polls (age_s is rounded to 0.1 s)
    assert tl.add_audit(T0 + 1.02, [{**rec, "age_s": 1.3}]) == 0
    assert tl.add_audit(T0 + 2.01, [{**rec, "age_s": 2.3}, directive("h/cpu2", ["generate"], 0.1)]) == 1
    rows = tl.view()
    assert [(r["text"], r["switch"], r["by"]) for r in rows] == [("h/cpu2 -> train", True, "ehp"),
                                                                ("h/cpu2 -> generate", True, "ehp")]
    assert abs(rows[0]["t"] - (T0 - 0.3)) < 1e-6 and abs(rows[1]["t"] - (T0 + 1.91)) < 1e-6
    assert rows[0]["actor"] == "h/cpu2"


def test_two_identical_records_in_one_poll_are_two_entries_and_stay_two() -> None:
    tl = Timeline()
    recs = [directive("h/cpu1", ["train"], 0.5), directive("h/cpu1", ["train"], 0.4)]
    assert tl.add_audit(T0, recs) == 2
    assert tl.add_audit(T0 + 1, [{**r, "age_s": r["age_s"] + 1} for r in recs]) == 0
    assert len(tl.view()) == 2


def test_the_same_content_later_than_the_match_window_is_a_new_entry() -> None:
    tl = Timeline()
    tl.add_audit(T0, [directive("h/cpu1", ["train"], 0.0)])
    later = directive("h/cpu1", ["train"], 0.0)
    assert tl.add_audit(T0 + AUDIT_MATCH_S + 2.0, [directive("h/cpu1", ["train"], AUDIT_MATCH_S + 2.0), later]) == 1
    assert len(tl.view()) == 2


def test_records_outside_the_timeline_kinds_are_left_out() -> None:
    tl = Timeline()
    n = tl.add_audit(T0, [{"what": "refused", "key": "k", "role": "client", "message": "DirectRequest", "age_s": 0.1},
                          {"what": "key_revoked", "key": "k", "role": "revoked", "age_s": 0.1},
                          {"what": "job_start", "key": "", "role": "unchecked", "job": "j", "rows": 8, "age_s": 0.1}])
    assert n == 1 and [r["text"] for r in tl.view()] == ["job j started (8 rows)"]


def decision(rnd: int, t: float, reason: str, current: float | None = None, candidate: float | None = None,
             plan: dict | None = None) -> dict:
    return {"round": rnd, "t": t, "reason": reason, "step": rnd, "trigger": "stage_imbalance" if current else None,
            "current_s": current, "candidate_s": candidate, "search_s": 0.01, "plan": plan}


def test_a_rejected_replan_shows_its_predicted_gain_and_quiet_rounds_are_left_out() -> None:
    tl = Timeline()
    decs = [decision(1, 100.0, "too_few_gpu_actors"), decision(2, 101.0, "no_trigger"),
            decision(3, 102.0, "gain_below_reconfig_cost", current=10.0, candidate=9.5)]
    assert tl.add_decisions(T0, decs) == 1
    assert tl.add_decisions(T0 + 1, decs) == 0  # seen again: not added twice
    (row,) = tl.view()
    assert row["what"] == "decision" and row["gain_s"] == 0.5 and row["gain_ratio"] == 0.05
    assert "gain_below_reconfig_cost" in row["text"] and row["by"] == "planner"
    assert row["t"] == T0  # the newest decision at the first poll: placed at that poll


def test_an_applied_replan_is_folded_into_its_plan_record_with_the_gain() -> None:
    tl = Timeline(slack_s=3.0)
    plan = {"n_gpus": 4, "n_train": 2, "rollout_tps": [1, 1]}
    tl.add_decisions(T0, [decision(1, 50.0, "no_trigger")])  # anchors the broker clock: 50.0 is at most T0
    tl.add_decisions(T0 + 1, [decision(1, 50.0, "no_trigger"), decision(2, 50.8, "applied", 8.0, 6.0, plan)])
    tl.add_audit(T0 + 1, [{"what": "plan", "key": "", "role": "planner", "text": "plan 1 applied: 2 of 4 GPUs train",
                           "age_s": 0.2},
                          {"what": "role_switch", "key": "", "role": "planner", "text": "h/gpu0 -> train (tp 1)",
                           "age_s": 0.2}])
    rows = tl.view()
    assert [r["what"] for r in rows] == ["plan", "role_switch"]  # the decision is the plan record's, not a row
    assert rows[0]["gain_s"] == 2.0 and rows[0]["gain_ratio"] == 0.25 and rows[0]["reason"] == "applied"
    assert rows[1]["switch"] and rows[1]["actor"] == "h/gpu0"


def test_a_plan_the_broker_could_not_lay_out_is_updated_in_place() -> None:
    tl = Timeline()
    d = decision(4, 10.0, "applied", 8.0, 6.0, {"n_gpus": 2})
    tl.add_decisions(T0, [d])
    tl.add_decisions(T0 + 1, [{**d, "reason": "apply_failed", "error": "no layout"}])
    (row,) = tl.view()
    assert row["reason"] == "apply_failed"


def test_the_clock_anchor_keeps_the_earliest_consistent_offset() -> None:
    a = ClockAnchor()
    a.see(T0, 100.0)  # seen at T0: it happened at T0 at the latest
    a.see(T0 + 1.0, 101.5)  # first seen one poll later: it happened before T0 + 1.0
    assert a.wall(101.5) == T0 + 1.0  # offset T0 - 100.5, from the tighter sighting
    assert a.wall(100.0) == T0 - 0.5


def test_without_the_audit_trail_the_jobs_decision_records_make_the_timeline() -> None:
    h = History("tcp://b:1")
    h.add(T0, [], {}, {"jobs": {"j": {"state": "running"}}})
    h.add_job("j", T0, {"records": [
        {"kind": "decision", "what": "role_switch", "step": 1, "t": 2.0, "text": "h/cpu2 -> train (EHP)",
         "detail": {"actor": "h/cpu2", "by": "ehp"}},
        {"step": 1, "reward_mean": 0.5, "accuracy": 0.25, "tokens_per_s": 100.0, "samples": [{"texts": ["x"]}]}],
        "next_cursor": 2, "state": "running", "steps": 3, "steps_done": 1})
    v = h.view()
    assert v["audit_visible"] is False
    (row,) = v["timeline"]
    assert row["switch"] and row["actor"] == "h/cpu2" and row["by"] == "ehp" and row["t"] == T0
    assert v["jobs"]["j"]["step"] == [1] and v["jobs"]["j"]["reward_mean"] == [0.5]
    assert h.job_cursor("j") == 2 and "samples" not in str(v["jobs"])
    h.add(T0 + 1, [], {}, {"audit": []})  # an audit trail (even empty): the job records are no longer shown
    assert h.view()["timeline"] == []


def test_series_are_aligned_to_the_polls_and_rates_come_from_the_counters() -> None:
    h = History("tcp://b:1")
    a = {"id": "h/cpu0", "host": "h", "slot": "cpu0", "kinds": ["generate"], "role": {"role": "rollout"},
         "load": 1, "capacity": 4}
    h.add(T0, [a], {"generate:default": 3}, {"completed": 10, "submitted": 12, "router": {"migrations": 0}})
    h.add(T0 + 2, [{**a, "kinds": ["train"], "role": {"role": "train"}}],
          {"generate:default": 1, "generate:long": 5},
          {"completed": 30, "submitted": 20, "router": {"migrations": 4},
           "actions": {"running": 2, "cores": {"h/cpu1": {"cores": 8, "free": 6}, "h/cpu2": {"cores": 4, "free": 4}}}})
    v = h.view()
    assert v["series"]["t"] == [T0, T0 + 2]
    assert v["queues"] == {"generate:default": [3.0, 1.0], "generate:long": [None, 5.0]}
    assert v["series"]["completed_per_s"] == [None, 10.0] and v["series"]["submitted_per_s"] == [None, 4.0]
    assert v["series"]["migrations_per_s"] == [None, 2.0] and v["series"]["migrations"] == [0, 4]
    assert v["series"]["cores_free"] == [None, 10.0] and v["series"]["cores_total"] == [None, 12.0]
    assert v["series"]["actors_generate"] == [1.0, 0.0] and v["series"]["actors_train"] == [0.0, 1.0]
    assert v["roles"] == {"h/cpu0": "train"}


def test_the_history_keeps_the_newest_points_only() -> None:
    h = History("tcp://b:1", keep=3)
    for i in range(5):
        h.add(T0 + i, [], {f"q:{i % 2}": i}, {"completed": i})
    v = h.view()
    assert v["series"]["t"] == [T0 + 2, T0 + 3, T0 + 4]
    assert all(len(s) == 3 for s in (*v["queues"].values(), v["series"]["completed_per_s"]))


def test_an_unanswered_poll_keeps_the_last_snapshot_and_says_why() -> None:
    h = History("tcp://b:1")
    h.add(T0, [{"id": "a"}], {}, {})
    h.failed(T0 + 5, "BrokerUnreachable: no status reply")
    v = h.view()
    assert v["error"].startswith("BrokerUnreachable") and v["snapshot"]["actors"] == [{"id": "a"}]
    h.add(T0 + 6, [], {}, {})
    assert h.view()["error"] is None


def test_bucket_occupancy_counts_queued_turns_and_the_rollout_actors_per_bucket() -> None:
    actors = [{"id": "a", "kinds": ["generate"], "role": {"role": "rollout", "bucket": "long"}, "load": 2, "capacity": 4},
              {"id": "b", "kinds": ["generate"], "role": {}, "load": 1, "capacity": 4},
              {"id": "c", "kinds": ["train"], "role": {"role": "train", "bucket": "long"}, "load": 1, "capacity": 1}]
    out = bucket_occupancy(actors, {"generate:short": 7, "generate:long": 2, "action:python": 9})
    assert out == [{"bucket": "default", "queued": 0, "actors": ["b"], "load": 1, "capacity": 4},
                   {"bucket": "long", "queued": 2, "actors": ["a"], "load": 2, "capacity": 4},
                   {"bucket": "short", "queued": 7, "actors": [], "load": 0, "capacity": 0}]


def test_an_actors_role_is_its_directive_while_it_accepts_that_work() -> None:
    assert actor_role({"kinds": ["train"], "role": {"role": "train"}}) == "train"
    assert actor_role({"kinds": ["generate"], "role": {"role": "rollout"}}) == "rollout"
    assert actor_role({"kinds": ["train"], "role": {"role": "rollout"}}) == "train"  # switching: what it takes now
    assert actor_role({"kinds": ["action"], "role": {}}) == "action"
    assert actor_role({"kinds": [], "role": {}}) == "idle"
