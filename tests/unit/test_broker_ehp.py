"""The broker's Elastic Hybrid Pool (libra/broker/ehp.py) and the job host's elastic steps: pure, no sockets."""

from __future__ import annotations

import pytest

from libra.broker.ehp import ActorView, EhpSettings, ElasticPool, from_planner_config
from libra.broker.hybrid import JoinState
from libra.broker.job_host import JobHost, JobSpec
from libra.config import ConfigError
from libra.protocol.payloads_train import TrainArgs

SPEC = {"steps": 4, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 0, "world_size": 2, "env": "arith",
        "episode": {}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64, "master_port": 12345}
ROWS = [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1} for i in range(5)]


def summary(tokens: int, reward: float, versions: list[int]) -> dict:
    return {"reward": reward, "versions": versions, "gen_tokens": tokens // 2, "tokens": tokens,
            "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"traj/{tokens}", "version": None, "server_key": None,
                    "bytes": tokens * 9}, "info": {"start": 1.0, "end": 2.0}}

CORE = [ActorView("h/t0", False, ("train",)), ActorView("h/t1", False, ("train",))]
HYBRID = [ActorView("h/x0", True, ("generate",)), ActorView("h/x1", True, ("generate",)),
          ActorView("h/r0", False, ("generate",))]


def switched(p: ElasticPool, *aids: str) -> None:
    """The actors ``aids`` drained and bid again as trainers (what the broker's sessions then say)."""
    p.observe([ActorView(a.actor_id, a.hybrid, ("train",) if a.actor_id in aids else a.kinds)
               for a in CORE + HYBRID], 0.0, 0.0)


def pool(**ehp: object) -> ElasticPool:
    p = ElasticPool(EhpSettings.from_planner({"ehp": ehp}))
    p.observe(CORE + HYBRID, 0.0, 0.0)
    return p


def test_a_forced_borrow_joins_through_the_state_machine_and_a_release_leaves() -> None:
    p = pool(force=[[1, 1], [4, 0]])
    g1 = p.plan_step(1, 2, False, None, None)  # borrowed: the actor switches roles while the core trains
    assert (g1.members, g1.generation, g1.zero) == (("h/t0", "h/t1"), 1, ())
    assert p.take_moves() == [("h/x0", ["train"], {"role": "train", "group": "ehp"})]
    assert p.replicas["h/x0"].state is JoinState.REQUESTED
    switched(p, "h/x0")
    g2 = p.plan_step(2, 2, True, 5.0, 5.0)
    assert p.take_moves() == []
    assert g2.members == ("h/t0", "h/t1", "h/x0") and g2.generation == 2
    assert g2.zero == g2.joining == ("h/x0",) and g2.snapshot and g2.trainers == ("h/t0", "h/t1")
    assert p.replicas["h/x0"].state is JoinState.FETCHING_STATE
    p.step_done(g2, {"h/x0": {"restored_version": 1}})
    assert p.replicas["h/x0"].state is JoinState.ZERO_SYNC and p.replicas["h/x0"].state_version == 1
    g3 = p.plan_step(3, 2, True, 5.0, 5.0)
    assert p.replicas["h/x0"].state is JoinState.ACTIVE and p.replicas["h/x0"].joined_step == 3
    assert g3.generation == 2 and g3.zero == () and g3.trainers == ("h/t0", "h/t1", "h/x0")
    g4 = p.plan_step(4, 2, True, 5.0, 5.0)
    assert p.take_moves() == [("h/x0", ["generate"], {"role": "rollout", "bucket": "default"})]
    assert g4.members == ("h/t0", "h/t1") and g4.generation == 3
    assert p.replicas["h/x0"].state is JoinState.HYBRID_ROLLOUT
    assert [d["action"] for d in p.decisions] == ["borrow", "release"]


def test_a_join_waits_for_the_state_source_and_a_stale_reply_changes_nothing() -> None:
    p = pool(force=[[1, 1]])
    p.plan_step(1, 2, False, None, None)
    assert p.take_moves()  # the directive goes out (a move not yet sent is a switch not yet made)
    switched(p, "h/x0")
    g1 = p.plan_step(1, 2, False, None, None)  # switched, but no weights published yet: nothing to fetch from
    assert p.replicas["h/x0"].state is JoinState.REQUESTED and g1.members == ("h/t0", "h/t1")
    p.observe(CORE + HYBRID, 0.0, 0.0)  # not (or no longer) switched: it waits too
    assert p.plan_step(2, 2, True, 1.0, 1.0).members == ("h/t0", "h/t1")
    switched(p, "h/x0")
    g2 = p.plan_step(2, 2, True, 1.0, 1.0)
    assert g2.joining == ("h/x0",)
    p.step_done(g2, {"h/x0": {}})  # no restored version: the fetch did not happen, the join stays put
    assert p.replicas["h/x0"].state is JoinState.FETCHING_STATE


def test_the_hysteresis_borrows_on_a_training_bottleneck_and_protects_rollout() -> None:
    p = pool(min_rollout=2, warmup_steps=0)  # 3 rollout-serving actors, keep 2: capacity 1
    assert p.plan_step(1, 2, True, None, None).members == ("h/t0", "h/t1")  # no step yet: hold
    p.plan_step(2, 2, True, 10.0, 12.0)  # train/rollout = 1.2 >= 1.15
    assert p.signal.reason == "training_bottleneck" and [m[0] for m in p.take_moves()] == ["h/x0"]
    p.plan_step(3, 2, True, 10.0, 10.0)  # 1.0: hold
    assert p.signal.reason == "hysteresis_hold" and p.take_moves() == []
    p.observe(CORE + HYBRID, 0.9, 0.0)  # the rollout queue fills up: release, cancelling the join
    g = p.plan_step(4, 2, True, 10.0, 20.0)
    assert p.signal.reason == "protect_rollout" and [m[1] for m in p.take_moves()] == [["generate"]]
    assert g.members == ("h/t0", "h/t1") and p.replicas["h/x0"].history[-1].endswith("released")


def test_the_pool_holds_through_the_warm_up_step_and_counts_a_retried_step_once() -> None:
    p = pool(min_rollout=2)  # warmup_steps = 1: step 1's times (set-up included) decide nothing
    p.plan_step(1, 2, True, None, None)
    p.plan_step(2, 2, True, 1.0, 5.0)  # train/rollout = 5 after step 1: still held
    p.plan_step(2, 2, True, 1.0, 5.0)  # the same step planned again (a retried step): not a second step's times
    assert p.take_moves() == [] and p.signal is None
    p.plan_step(3, 2, True, 10.0, 12.0)  # step 2's times: the hysteresis decides
    assert p.signal.reason == "training_bottleneck" and [m[0] for m in p.take_moves()] == ["h/x0"]


def test_a_failed_step_or_a_lost_actor_sends_the_joiner_back() -> None:
    p = pool(force=[[1, 1]])
    p.plan_step(1, 2, True, None, None)
    p.take_moves()
    switched(p, "h/x0")
    g2 = p.plan_step(2, 2, True, 1.0, 1.0)
    assert g2.joining == ("h/x0",)
    p.step_failed(g2)
    assert p.replicas["h/x0"].state is JoinState.HYBRID_ROLLOUT
    assert p.take_moves() == [("h/x0", ["generate"], {"role": "rollout", "bucket": "default"})]
    p.observe([ActorView("h/x0", True, ("train",), switching=True)] + CORE, 0.0, 0.0)  # its directive drains
    g3 = p.plan_step(3, 2, True, 1.0, 1.0)  # the force still says 1: a new join, a new generation
    assert p.replicas["h/x0"].generation == 2 and g3.joining == ()  # it switches back first
    assert p.take_moves() == [("h/x0", ["train"], {"role": "train", "group": "ehp"})]
    switched(p, "h/x0")
    assert p.plan_step(4, 2, True, 1.0, 1.0).joining == ("h/x0",)
    p.actor_left("h/x0")
    assert p.replicas["h/x0"].state is JoinState.HYBRID_ROLLOUT


@pytest.mark.parametrize("bad,needle", [({"zero_steps": 0}, "zero_steps"), ({"force": [[1]]}, "force"),
                                        ({"release_ratio": 2.0}, "release_ratio"), ({"colour": 1}, "unknown")])
def test_bad_settings_are_refused_naming_the_key(bad: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        from_planner_config({"allocation": "grp_ehp", "ehp": bad})


def test_grp_ehp_runs_grp_rounds_plus_the_pool() -> None:
    loop, p = from_planner_config({"allocation": "grp_ehp", "interval_s": 5, "ehp": {"min_rollout": 2}})
    assert loop == {"allocation": "grp", "interval_s": 5} and p is not None and p.settings.min_rollout == 2
    assert from_planner_config({"allocation": "grp"}) == ({"allocation": "grp"}, None)
    with pytest.raises(RuntimeError, match="core train actors"):
        ElasticPool(EhpSettings()).plan_step(1, 2, False, None, None)


def _train_args(works: list) -> list[TrainArgs]:
    return [TrainArgs.from_wire(w.args) for w in works if w.kind == "train"]


def test_the_job_host_gives_a_joining_member_no_trajectories_and_every_one_to_exactly_one_rank() -> None:
    h = JobHost("j", JobSpec.from_mapping(SPEC), ROWS, 0.0)
    h.elastic = pool(force=[[1, 1], [4, 0]])
    weights = {"version": 1, "endpoint": "tcp://127.0.0.1:7", "name": "weights", "server_key": None, "bytes": 1}
    n = 0
    for step in (1, 2, 3, 4):
        works = h.take_work(float(step))
        eps = [w for w in works if w.kind == "episode"]
        for w in eps:
            n += 1
            h.on_reply(w.tag, True, summary(10 + n, float(n % 2), [step - 1]), "", float(step))
        train = h.take_work(float(step) + 0.5)
        args = _train_args(train)
        g = args[0].elastic
        assert g is not None and all(a.elastic == g for a in args) and len(args) == len(g.members)
        refs = [p.ref.name for rank in args[0].parts for p in rank]
        assert len(refs) == len(set(refs)) == 2 * 3  # 2 prompts x group of 3: each trajectory once
        zero = [args[0].parts[g.members.index(z)] for z in g.zero]
        assert all(z == [] for z in zero)
        if step == 2:
            assert g.joining == ["h/x0"] and g.join_from.endpoint == weights["endpoint"]
        if step == 3:
            assert g.members == ["h/t0", "h/t1", "h/x0"] and g.zero == [] and args[0].parts[2]
        for r, w in enumerate(reversed(train)):  # replies in any order: the rank in the reply places them
            rank = len(train) - 1 - r
            out = {"rank": rank, "metrics": {}, "weights_version": step, "checksum": "c",
                   "weights": {**weights, "version": step} if rank == 0 else None, "member": g.members[rank],
                   "restored_version": step - 1 if g.members[rank] in g.joining else None}
            h.on_reply(w.tag, True, out, "", float(step) + 0.9, attempts=1)
        h.elastic.take_moves()  # the broker sends them as directives
        switched(h.elastic, "h/x0")
        rec = h.records[-1]
        assert rec["members"] == g.members and rec["train_attempts"] == [1] * len(g.members)
    steps = [r for r in h.records if "kind" not in r]  # the decision records (EHP joins, leaves) aside
    assert [len(r["members"]) for r in steps] == [2, 3, 3, 2]
    assert [r["generation"] for r in steps] == [1, 2, 2, 3]
