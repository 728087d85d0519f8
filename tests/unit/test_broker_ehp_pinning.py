"""An elastic step's train work is pinned to its member (``Work.pin``) in the pure broker core: no other
actor that accepts ``train`` may take it, it waits for its own actor's credit, and it fails (the job says
why) when that actor is gone. Driven by messages, no sockets."""

from __future__ import annotations

from libra.broker.ehp import ActorView, EhpSettings, ElasticPool
from libra.broker.events import PeerMessage, Send, Tick
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

SPEC = {"steps": 2, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 1, "world_size": 2, "env": "arith",
        "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
        "master_port": 12345}
ROWS = [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1} for i in range(5)]
EP, T0, T1, T9 = b"ep", b"t0", b"t1", b"t9"


def sent(cmds: list[Send], cls: type, peer: bytes | None = None) -> list:
    return [c.msg for c in cmds if isinstance(getattr(c, "msg", None), cls) and (peer is None or c.peer == peer)]


def summary(i: int) -> dict:
    return {"reward": float(i % 2), "versions": [0], "gen_tokens": 5, "tokens": 10 + i,
            "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"traj/{i}", "version": None, "server_key": None,
                    "bytes": 90}, "info": {"start": 1.0, "end": 2.0}}


class Harness:
    def __init__(self, **cfg: float) -> None:
        self.s = BrokerState(BrokerConfig(planner={"allocation": "grp_ehp", "interval_s": 3600}, **cfg))
        self.now = 0.0
        self.msg(b"client", m.ClientHello("client-1", 1))
        self.msg(EP, m.ActorHello("ep", "h", "cpu3", 1, {"episode": ["*"]}, ["episode"], 64))
        self.msg(EP, m.Bid(["episode"], 64))

    def msg(self, peer: bytes, msg: object) -> list[Send]:
        self.now += 0.01
        out = self.s.handle(PeerMessage(peer, msg), self.now)
        self.s.validate()
        return out

    def tick(self, dt: float, alive: tuple[bytes, ...]) -> list[Send]:
        """``dt`` seconds pass in heartbeat-sized steps; the ``alive`` peers keep heartbeating."""
        out: list[Send] = []
        for _ in range(int(dt)):
            for peer in alive:
                self.msg(peer, m.Heartbeat())
            self.now += 1.0
            out += self.s.handle(Tick(), self.now)
            self.s.validate()
        return out

    def trainer(self, peer: bytes, credit: int) -> list[Send]:
        self.msg(peer, m.ActorHello(peer.decode(), "h", peer.decode(), 1, {"train": ["grpo"]}, ["train"], 4))
        return self.msg(peer, m.Bid(["train"], credit))


def start_step(hs: Harness) -> list[Send]:
    """Submit the job and finish its first step's episodes: the step's train works are handed out."""
    eps = sent(hs.msg(b"client", m.JobSubmit("s1", "j", SPEC, ROWS)), m.Assign, EP)
    out: list[Send] = []
    for i, a in enumerate(eps[:6]):
        out += hs.msg(EP, m.WorkResult(a.work_id, a.lease, True, summary(i)))
    return out


def test_a_members_train_work_waits_for_that_member_and_never_goes_to_a_non_member() -> None:
    hs = Harness()
    hs.trainer(T0, 1)
    hs.trainer(T1, 0)  # a member with no credit yet
    out = start_step(hs)
    # the core is fixed from the connected trainers (t0, t1); t9 connects later with plenty of credit
    out += hs.trainer(T9, 4)
    (a0,) = sent(out, m.Assign, T0)
    assert a0.args["rank"] == 0 and a0.args["elastic"]["members"] == ["t0", "t1"]
    assert sent(out, m.Assign, T9) == []  # t9 accepts train, has the most credit, and is not a member
    (w1,) = [w for w in hs.s.works.values() if w.kind == "train" and w.pin == "t1"]
    assert w1.state.value == "queued"  # rank 1's work waits for t1's credit
    out = hs.msg(T1, m.Bid(["train"], 1))
    (a1,) = sent(out, m.Assign, T1)
    assert a1.work_id == w1.work_id and a1.args["rank"] == 1
    # rank 1's actor leaves: its pinned work cannot run anywhere else, so the step (and the job) fails
    out = hs.msg(T1, m.Goodbye("restarting"))
    assert sent(out, m.Assign, T9) == []
    poll = sent(hs.msg(b"client", m.JobPoll("p", "j")), m.Reply)[0].output
    assert poll["state"] == "failed" and "pinned to actor 't1', which is gone" in poll["error"], poll["error"]


def test_a_failed_step_spends_its_generation() -> None:
    p = ElasticPool(EhpSettings())
    p.observe([ActorView("t0", False, ("train",)), ActorView("t1", False, ("train",))], 0.0, 0.0)
    g1 = p.plan_step(1, 2, False, None, None)
    assert p.plan_step(2, 2, True, 1.0, 1.0).generation == g1.generation  # same members: same group
    g2 = p.plan_step(3, 2, True, 1.0, 1.0)
    p.step_failed(g2)
    g3 = p.plan_step(4, 2, True, 1.0, 1.0)
    assert g3.members == g2.members and g3.generation == g2.generation + 1  # the group is formed anew


def test_a_pinned_work_whose_lease_expires_goes_back_to_its_own_actor() -> None:
    hs = Harness(lease_s=5.0)
    hs.trainer(T0, 1)
    hs.trainer(T1, 1)
    start_step(hs)
    hs.trainer(T9, 4)
    (w1,) = [w for w in hs.s.works.values() if w.kind == "train" and w.pin == "t1"]
    first = w1.lease
    out = hs.tick(8, (EP, T0, T1, T9))  # t1 stays connected but sends no result: its lease expires
    assert [r.work_id for r in sent(out, m.Revoke, T1)] == [w1.work_id]
    (again,) = sent(out, m.Assign, T1)  # handed to t1 again, never to the idle non-member t9
    assert again.work_id == w1.work_id and again.lease > first and sent(out, m.Assign, T9) == []
