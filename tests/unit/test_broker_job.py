"""The broker-hosted RL job: JobHost on its own, then inside BrokerState with actors as plain events
(no sockets, no engines): episode work under the lag bound, broker-decided dispatch of trajectory refs
to trainer ranks, versions attached to generate turns, failures and cancellation."""

from __future__ import annotations

import math
import random

import pytest

from libra.broker.events import PeerMessage, Send, Tick
from libra.broker.job_host import JobHost, JobSpec, group_advantages
from libra.broker.state import BrokerConfig, BrokerState
from libra.config import ConfigError
from libra.protocol import messages as m


def sent(cmds: list[Send], cls: type, peer: bytes | None = None) -> list:
    return [c.msg for c in cmds if isinstance(getattr(c, "msg", None), cls) and (peer is None or c.peer == peer)]


class Harness:
    """The pure broker core driven by messages; invariants checked after every event."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.s = BrokerState(config or BrokerConfig())
        self.now = 0.0

    def msg(self, peer: bytes, msg: object) -> list[Send]:
        self.now += 0.01
        out = self.s.handle(PeerMessage(peer, msg), self.now)
        self.s.validate()
        return out

    def client(self) -> None:
        self.msg(b"client", m.ClientHello("client-1", 1))

SPEC = {"steps": 2, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 1, "world_size": 2, "env": "arith",
        "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
        "master_port": 12345, "checkpoint_dir": "/tmp/ck"}
ROWS = [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1} for i in range(5)]


def summary(tokens: int, reward: float, versions: list[int], ep: str = "tcp://127.0.0.1:1") -> dict:
    return {"reward": reward, "versions": versions, "gen_tokens": tokens // 2, "tokens": tokens,
            "ref": {"endpoint": ep, "name": f"traj/{tokens}/{reward}", "version": None, "server_key": None,
                    "bytes": tokens * 9},
            "info": {"correct": reward > 0.5, "tool_calls": 1, "start": 1.0, "end": 2.0, "load_s": [0.0]}}


def host(**over: object) -> JobHost:
    return JobHost("j", JobSpec.from_mapping({**SPEC, **over}), ROWS, 0.0)


# ---------------------------------------------------------------------------------------------- JobSpec
@pytest.mark.parametrize("bad,needle", [
    ({"group_size": 1}, "group_size"), ({"dispatch": "random"}, "dispatch"), ({"steps": 0}, "steps"),
    ({"world_size": 0}, "world_size"), ({"colour": "red"}, "unknown key"), ({"steps": "2"}, "steps"),
    ({"keep_checkpoints": -1}, "keep_checkpoints"),
])
def test_bad_spec_is_refused_naming_the_key(bad: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        JobSpec.from_mapping({**SPEC, **bad})


def test_checkpoint_settings_reach_the_train_work() -> None:
    h = host(steps=1, checkpoint_optimizer=True, keep_checkpoints=3)
    works = h.take_work(0.0)
    for i, w in enumerate(works[:6]):
        h.on_reply(w.tag, True, summary(10 + i, float(i % 2), [0]), "", 1.0)
    train = h.take_work(2.0)
    assert [w.kind for w in train] == ["train", "train"]
    args = train[0].args
    assert args["checkpoint"] == "/tmp/ck/step1" and args["checkpoint_optimizer"] is True
    assert args["keep_checkpoints"] == 3


def test_a_job_without_rows_is_refused() -> None:
    with pytest.raises(ConfigError, match="rows"):
        JobHost("j", JobSpec.from_mapping(SPEC), [], 0.0)


# ---------------------------------------------------------------------------------------------- advantages
def test_advantages_match_the_trainers_reference_formula() -> None:
    torch = pytest.importorskip("torch")
    from libra.engines.grpo import group_advantages as ref

    rng = random.Random(3)
    rewards = [rng.choice([0.0, 0.1, 1.0, 1.1]) for _ in range(24)]
    groups = [i // 4 for i in range(24)]
    for scale in (True, False):
        want = ref(torch.tensor(rewards), torch.tensor(groups), scale_by_std=scale).tolist()
        got = group_advantages(rewards, groups, scale_by_std=scale)
        for g in set(groups):  # a flat group carries no signal: exactly 0 (the job drops float noise)
            if len({r for r, gg in zip(rewards, groups) if gg == g}) == 1:
                assert all(a == 0.0 for a, gg in zip(got, groups) if gg == g)
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got, want) if a != 0.0)


# ---------------------------------------------------------------------------------------------- JobHost
def test_admission_respects_the_lag_bound_then_a_batch_becomes_train_work_per_rank() -> None:
    h = host()
    works = h.take_work(0.0)
    # version 0, lag 1: nominal steps 0 and 1 may be in flight = 2 steps x 2 prompts x 3 samples
    assert [w.kind for w in works] == ["episode"] * 12 and h.take_work(0.0) == []
    assert {w.args["row"]["pid"] for w in works} == {"p0", "p1", "p2", "p3"}
    assert all(w.name == "arith" and w.args["episode"] == SPEC["episode"] for w in works)
    lengths = [10, 200, 30, 40, 50, 60]
    for i, w in enumerate(works[:6]):  # groups 0 and 1 finish
        h.on_reply(w.tag, True, summary(lengths[i], float(i % 3 == 0), [0]), "", 1.0)
    train = h.take_work(2.0)
    assert [w.kind for w in train] == ["train", "train"] and [w.args["rank"] for w in train] == [0, 1]
    parts = train[0].args["parts"]
    assert parts == train[1].args["parts"]  # every rank sees the whole plan, trains on its own part
    names = sorted(p["ref"]["name"] for rank in parts for p in rank)
    assert len(names) == 6 and len(set(names)) == 6  # each trajectory goes to exactly one rank
    rank_tokens = sorted(sum(int(p["ref"]["name"].split("/")[1]) for p in rank) for rank in parts)
    assert rank_tokens == [190, 200]  # LPT: the 200-token trajectory alone vs the rest
    assert train[0].args["checkpoint"] is None
    assert "checkpoint_optimizer" not in train[0].args  # the defaults stay off the wire
    for w in train:
        out = {"rank": w.args["rank"], "weights_version": 1, "metrics": {"loss": 0.5}, "checksum": "c",
               "weights": {"endpoint": "tcp://t:1", "name": "weights/v1", "version": 1} if w.args["rank"] == 0 else None}
        h.on_reply(w.tag, True, out, "", 3.0)
    (rec,) = h.records
    assert rec["step"] == 1 and rec["weights_version"] == 1 and rec["sequences"] == 6
    assert rec["dispatch_decided_by"] == "broker" and rec["dispatch_imbalance"] <= rec["dispatch_imbalance_round_robin"]
    # the step's own trajectories over their rollout window (start 1.0 to end 2.0), and the job-wide window
    assert rec["gen_tokens"] == 195 and rec["rollout_time_s"] == 1.0 and rec["tokens_per_s"] == 195.0
    assert rec["window_gen_tokens"] == 195 and rec["window_tokens_per_s"] == pytest.approx(195 / 3.0)
    assert h.weights is not None and h.weights["version"] == 1
    more = h.take_work(3.0)  # version 1 frees nominal step 2... but only 2 steps exist: nothing new
    assert more == [] and h.state.version == 1


def test_failed_and_malformed_episodes_shrink_the_group_and_are_counted() -> None:
    h = host()
    works = h.take_work(0.0)
    g0 = [w for w in works if w.args["group"] == 0]
    h.on_reply(g0[0].tag, False, None, "engine died", 1.0)
    h.on_reply(g0[1].tag, True, {"reward": 1.0}, "", 1.0)  # malformed summary: a failure, not a crash
    h.on_reply(g0[2].tag, True, summary(10, 1.0, [0]), "", 1.0)
    assert h.episodes_failed == 2 and h.active
    g1 = [w for w in works if w.args["group"] == 1]
    for i, w in enumerate(g1):
        h.on_reply(w.tag, True, summary(10 + i, float(i), [0]), "", 1.0)
    g2 = [w for w in works if w.args["group"] == 2]
    for i, w in enumerate(g2):
        h.on_reply(w.tag, True, summary(10 + i, float(i), [0]), "", 1.0)
    out = h.take_work(1.0)
    train = [w for w in out if w.kind == "train"]
    assert len(train) == 2  # group 0 (1 survivor) was dropped, 1 and 2 train
    assert h.state.dropped_groups == 1
    # the dropped group's place is admitted again in the same call, with the next row
    assert [(w.args["group"], w.args["row"]["pid"]) for w in out if w.kind == "episode"] == [(4, "p4")] * 3
    assert h.take_work(1.0) == []
    assert sum(len(r) for r in train[0].args["parts"]) == 6


def test_a_stale_group_dropped_at_the_cut_is_replaced_when_nothing_else_is_outstanding() -> None:
    # the slot-crash run that hung: the last step's groups went stale while a killed rollout slot's turns were
    # re-run, the cut dropped them with no episode or training outstanding, and no reply came to admit more
    h = host(steps=2, prompts_per_step=1, max_policy_lag=0)
    (w0, w1, w2) = h.take_work(0.0)
    for i, w in enumerate((w0, w1, w2)):
        h.on_reply(w.tag, True, summary(10 + i, float(i), [0]), "", 1.0)
    (t0, t1) = h.take_work(1.0)
    for w in (t0, t1):
        out = {"rank": w.args["rank"], "weights_version": 1, "metrics": {"loss": 0.5}, "checksum": "c",
               "weights": {"endpoint": "tcp://t:1", "name": "weights/v1", "version": 1} if w.args["rank"] == 0 else None}
        h.on_reply(w.tag, True, out, "", 2.0)
    step2 = h.take_work(2.0)
    assert [w.kind for w in step2] == ["episode"] * 3
    for i, w in enumerate(step2):  # turns served by weights older than the version the group was admitted at
        h.on_reply(w.tag, True, summary(10 + i, float(i), [0]), "", 3.0)
    assert not h.outstanding()
    again = h.take_work(3.0)
    assert h.state.dropped_groups == 1
    assert [w.kind for w in again] == ["episode"] * 3 and h.outstanding()


def test_a_failed_train_rank_fails_the_job_with_its_error() -> None:
    h = host()
    for i, w in enumerate(h.take_work(0.0)[:6]):
        h.on_reply(w.tag, True, summary(10 + i, float(i % 2), [0]), "", 1.0)
    r0, r1 = h.take_work(1.0)
    h.on_reply(r1.tag, False, None, "shard_fetch_failed: runner gone", 2.0)
    assert h.phase == "failed" and "rank 1" in h.error and "runner gone" in h.error
    assert not h.active and h.take_work(2.0) == []


# ---------------------------------------------------------------------------------------------- in the broker
EP, T0, T1, R = b"ep", b"t0", b"t1", b"ro"


def cluster(config: BrokerConfig | None = None) -> Harness:
    hs = Harness(config)
    hs.client()
    hs.msg(EP, m.ActorHello("ep", "h", "cpu3", 1, {"episode": ["*"]}, ["episode"], 64))
    hs.msg(EP, m.Bid(["episode"], 64))
    for peer in (T0, T1):
        hs.msg(peer, m.ActorHello(peer.decode(), "h", peer.decode(), 1, {"train": ["grpo"]}, ["train"], 1))
        hs.msg(peer, m.Bid(["train"], 1))
    hs.msg(R, m.ActorHello("ro", "h", "cpu0", 1, {"generate": ["default"]}, ["generate"], 8))
    hs.msg(R, m.Bid(["generate"], 8))
    return hs


def test_a_job_runs_inside_the_broker_and_its_weights_reach_generate_turns() -> None:
    hs = cluster(BrokerConfig(router_params={"rebuild_interval": 1}))
    tree = hs.s.rollout.router.tree
    out = hs.msg(b"client", m.JobSubmit("s1", "j", {**SPEC, "steps": 1}, ROWS))
    assert sent(out, m.Reply)[0].ok
    eps = sent(out, m.Assign, EP)
    assert len(eps) == 6 and all(a.kind == "episode" for a in eps)  # 1 step x 2 prompts x 3 samples
    # an episode's generate turn before any step: no weights attached
    out = hs.msg(b"client", m.Submit("g1", "generate", "default", {"prompt_ids": [1, 2], "prompt_tokens": 2}, "t-1"))
    (g,) = sent(out, m.Assign, R)
    assert "weights" not in g.args
    hs.msg(R, m.WorkResult(g.work_id, g.lease, True, {"gen_tokens": 1}))
    out = []
    for i, a in enumerate(eps[:6]):
        out += hs.msg(EP, m.WorkResult(a.work_id, a.lease, True, summary(20 + i, float(i % 2), [0])))
    trains = sent(out, m.Assign, T0) + sent(out, m.Assign, T1)
    assert sorted(a.args["rank"] for a in trains) == [0, 1]
    poll = sent(hs.msg(b"client", m.JobPoll("p1", "j")), m.Reply)[0].output
    assert poll["state"] == "running" and poll["training"] and poll["records"] == []
    weights = {"endpoint": "tcp://t0:9", "name": "weights/v1", "version": 1, "server_key": None, "bytes": 5}
    assert hs.s.rollout.steps == 0 and tree.rebuilds == 0
    out = []
    for a in trains:
        r = a.args["rank"]
        out += hs.msg(T0 if r == 0 else T1, m.WorkResult(a.work_id, a.lease, True, {
            "rank": r, "weights_version": 1, "metrics": {"loss": 0.1}, "checksum": "x", "weights": weights if r == 0 else None}))
    # the published version is the router's drift clock: C-MLFQ rebuilt its prefix tree (interval 1 step)
    assert hs.s.rollout.steps == 1 and tree.rebuilds == 1
    poll = sent(hs.msg(b"client", m.JobPoll("p2", "j")), m.Reply)[0].output
    assert poll["state"] == "done" and poll["version"] == 1 and [r["step"] for r in poll["records"]] == [1]
    assert poll["next_cursor"] == 1 and sent(hs.msg(b"client", m.JobPoll("p3", "j", 1)), m.Reply)[0].output["records"] == []
    assert not [w for w in hs.s.works.values() if w.client_id == "job:j"]
    # later turns carry the job's newest weights; a turn naming its own weights keeps them
    out = hs.msg(b"client", m.Submit("g2", "generate", "default", {"prompt_ids": [1], "prompt_tokens": 1}, "t-2"))
    assert sent(out, m.Assign, R)[0].args["weights"] == weights
    mine = {"endpoint": "tcp://x:1", "version": 7}
    out = hs.msg(b"client", m.Submit("g3", "generate", "default", {"prompt_ids": [1], "weights": mine}, "t-3"))
    assert sent(out, m.Assign, R)[0].args["weights"] == mine
    assert hs.s.snapshot("s", hs.now).stats["jobs"]["j"]["state"] == "done"


def test_a_lost_episode_runner_requeues_its_episodes_and_cancel_stops_everything() -> None:
    hs = cluster()
    eps = sent(hs.msg(b"client", m.JobSubmit("s1", "j", SPEC, ROWS)), m.Assign, EP)
    assert len(eps) == 12
    hs.msg(EP, m.Goodbye("restarting"))  # the runner leaves: its episodes wait for another one
    assert len(hs.s.queues[("episode", "arith")]) == 12
    out = hs.msg(b"ep2", m.ActorHello("ep2", "h", "cpu4", 1, {"episode": ["*"]}, ["episode"], 64))
    out += hs.msg(b"ep2", m.Bid(["episode"], 64))
    assert len(sent(out, m.Assign, b"ep2")) == 12  # each delivered again, once
    out = hs.msg(b"client", m.JobPoll("c", "j", cancel=True))
    assert sent(out, m.Reply)[0].output["state"] == "cancelled"
    assert len(sent(out, m.Revoke, b"ep2")) == 12 and not hs.s.works


def test_job_messages_are_validated() -> None:
    hs = cluster()
    (r,) = sent(hs.msg(b"client", m.JobSubmit("s1", "j", {**SPEC, "dispatch": "??"}, ROWS)), m.Reply)
    assert not r.ok and "dispatch" in r.error
    (r,) = sent(hs.msg(b"client", m.JobPoll("p", "nope")), m.Reply)
    assert not r.ok and "no job 'nope'" in r.error
    assert sent(hs.msg(b"client", m.JobSubmit("s2", "j", SPEC, ROWS)), m.Reply)[0].ok
    (r,) = sent(hs.msg(b"client", m.JobSubmit("s3", "j", SPEC, ROWS)), m.Reply)
    assert not r.ok and "already running" in r.error
    assert sent(hs.msg(b"client", m.JobSubmit("s2", "j", SPEC, ROWS)), m.Reply)[0].ok  # same request: answered
    assert len(hs.s.works) == 12  # ... and not run twice
    out = hs.msg(b"stranger", m.JobPoll("p", "j"))
    assert sent(out, m.Disconnect)


def test_without_a_job_the_router_counts_a_step_every_router_step_s() -> None:
    s = BrokerState(BrokerConfig(router_step_s=10.0, router_params={"rebuild_interval": 2}))
    tree = s.rollout.router.tree
    for now in (100.0, 105.0, 110.0, 115.0, 120.0, 131.0):
        s.handle(Tick(), now)
    assert s.rollout.steps == 3 and tree.rebuilds == 1  # steps at 110, 120, 131; rebuilt at step 2
    with pytest.raises(ValueError, match="router_step_s"):
        BrokerState(BrokerConfig(router_step_s=-1.0))


def test_an_active_job_with_nothing_outstanding_is_pumped_on_the_tick() -> None:
    # no reply will come for a job with nothing outstanding (a batch the Elastic Hybrid Pool was not ready for):
    # the board asks the core for a pump on its tick, and only then
    from libra.broker.job_board import JobBoard

    class Waiting:
        active, calls = True, 0

        def outstanding(self) -> bool:
            return False

        def take_work(self, now: float) -> list:
            self.calls += 1
            return []

    board, h = JobBoard(), Waiting()
    board.hosts["w"] = h
    assert board.wake_waiting() and board.dirty
    board.pump(1.0, lambda *a: None, lambda *a: None)
    assert h.calls == 1 and not board.dirty
    h.active = False
    assert not board.wake_waiting()
