"""Job-scoped client keys and the audit trail in the broker core (libra.broker.access, #33): a ``client:JOB``
key acts for its job only (job submit, poll and cancel of another job are refused, typed, logged, counted and
audited; its client id lives in its job's space, so it cannot cancel or take over another job's calls; its
status holds its job's rows only), and every directive, plan change, job start and cancel, refusal and revoked
key is an audit record with the key's fingerprint and role, shown to operators only."""

from __future__ import annotations

import json

import pytest

from libra.broker.access import AUDIT_KEEP, Access
from libra.broker.audit_log import AuditLog
from libra.broker.events import Audit, Log, PeerMessage, RevokePeers, Send
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m
from libra.transport.scopes import base_roles, fingerprint, job_scope, may_see_job

SPEC = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_policy_lag": 1, "world_size": 1, "env": "arith",
        "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
        "master_port": 12345}
ROWS = [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1} for i in range(4)]
KEY_A, KEY_B, KEY_OPS = "A" * 40, "B" * 40, "O" * 40


def hello(st: BrokerState, peer: bytes, role: str, key: str, client_id: str = "c1") -> None:
    out = st.handle(PeerMessage(peer, m.ClientHello(client_id, 1), (), role, key), 0.0)
    assert any(isinstance(c, Send) and isinstance(c.msg, m.Welcome) for c in out), out


def send(st: BrokerState, peer: bytes, msg: object, role: str, key: str, now: float = 1.0) -> list:
    return st.handle(PeerMessage(peer, msg, (), role, key), now)


def replies(out: list) -> list[m.Reply]:
    return [c.msg for c in out if isinstance(c, Send) and isinstance(c.msg, m.Reply)]


def audits(out: list) -> list[dict]:
    return [c.record for c in out if isinstance(c, Audit)]


def test_role_strings() -> None:
    assert job_scope("") is None and job_scope("any") is None and job_scope("operator") is None
    assert job_scope("client") is None and job_scope("actor,client:a") is None  # one unscoped place is enough
    assert job_scope("client:a") == {"a"} and job_scope("client:a,client:b") == {"a", "b"}
    assert job_scope("revoked") == frozenset()
    assert base_roles("actor,client:a") == ("actor", "client") and base_roles("") == ()
    assert may_see_job("client:a", "a") and not may_see_job("client:a", "b") and not may_see_job("client:a", None)
    assert may_see_job("operator", None) and not may_see_job("revoked", "a")
    assert fingerprint("") == "" and len(fingerprint(KEY_A)) == 16 and fingerprint(KEY_A) == fingerprint(KEY_A.encode())


def test_a_client_of_job_a_may_not_start_poll_or_cancel_job_b() -> None:
    st = BrokerState(BrokerConfig())
    hello(st, b"b", "client:b", KEY_B)
    hello(st, b"a", "client:a", KEY_A)
    out = send(st, b"b", m.JobSubmit("s-b", "b", SPEC, ROWS), "client:b", KEY_B)
    assert replies(out)[0].ok and audits(out) == [{"what": "job_start", "key": fingerprint(KEY_B), "role": "client:b",
                                                   "job": "b", "rows": 4}]
    for i, msg in enumerate((m.JobSubmit("s-a", "b", SPEC, ROWS), m.JobPoll("p-a", "b"),
                             m.JobPoll("c-a", "b", cancel=True))):
        out = send(st, b"a", msg, "client:a", KEY_A, now=10.0 * (i + 1))  # apart: each one audited
        (r,) = replies(out)
        assert (r.request_id, r.ok, r.error_code) == (msg.request_id, False, "forbidden"), r
        assert "'b'" in r.error and "clients/b/" in r.error and "['a']" in r.error
        (log,) = [c for c in out if isinstance(c, Log)]
        assert log.event == "job_refused" and log.fields["job"] == "b" and log.fields["role"] == "client:a"
        (rec,) = audits(out)
        assert rec == {"what": "refused", "key": fingerprint(KEY_A), "role": "client:a", "message": type(msg).__name__,
                       "repeats": 0, "why": "job", "job": "b"}
    assert st.stats["job_refused"] == 3 and st.jobs["b"].active  # job b runs on
    assert replies(send(st, b"a", m.JobSubmit("s-a2", "a", SPEC, ROWS), "client:a", KEY_A))[0].ok  # its own job
    out = send(st, b"b", m.JobPoll("c-b", "b", cancel=True), "client:b", KEY_B)
    assert replies(out)[0].ok and not st.jobs["b"].active
    assert audits(out) == [{"what": "job_cancel", "key": fingerprint(KEY_B), "role": "client:b", "job": "b", "ok": True}]


def test_a_scoped_clients_id_lives_in_its_jobs_space() -> None:
    # job b's client has a call queued (nothing serves it); job a's client says the same client id and cancels
    # the same request id: b's call is untouched, and b's own cancel still works
    st = BrokerState(BrokerConfig())
    hello(st, b"b", "client:b", KEY_B, "shared-id")
    hello(st, b"a", "client:a", KEY_A, "shared-id")
    assert {c.client_id for c in st.clients.values()} == {"a/shared-id", "b/shared-id"}
    assert Access.scoped("x", "client:b,client:a") == "a+b/x" and Access.scoped("x", "operator") == "x"
    send(st, b"b", m.Submit("r1", "action", "slow", {"n": 1}), "client:b", KEY_B)
    assert not replies(send(st, b"a", m.CancelRequest("r1"), "client:a", KEY_A))
    assert len(st.works) == 1
    (r,) = replies(send(st, b"b", m.CancelRequest("r1"), "client:b", KEY_B))
    assert (r.request_id, r.ok, r.error_code) == ("r1", False, "cancelled") and not st.works


def test_a_scoped_clients_trajectories_are_its_jobs() -> None:
    # job a's client names job b's trajectory: its call does not run in b's trajectory (its sandbox, its
    # instance), and its end of that trajectory does not end b's
    st = BrokerState(BrokerConfig())
    st.handle(PeerMessage(b"act", m.ActorHello("h/cpu0", "h", "cpu0", 1, {"action": ["python"]}, ["action"], 4),
                          (), "actor", "H" * 40), 0.0)
    st.handle(PeerMessage(b"act", m.Bid(["action"], 4), (), "actor", "H" * 40), 0.0)
    hello(st, b"b", "client:b", KEY_B)
    hello(st, b"a", "client:a", KEY_A)
    hello(st, b"o", "operator", KEY_OPS)
    sent = {}
    for peer, role, key in ((b"b", "client:b", KEY_B), (b"a", "client:a", KEY_A), (b"o", "operator", KEY_OPS)):
        out = send(st, peer, m.Submit(f"r-{role}", "action", "python", {"code": "1"}, "traj-1"), role, key)
        (assign,) = [c.msg for c in out if isinstance(c, Send) and isinstance(c.msg, m.Assign)]
        sent[role] = assign.trajectory
    assert sent == {"client:b": "b/traj-1", "client:a": "a/traj-1", "operator": "traj-1"}


def test_status_a_scoped_key_sees_its_jobs_rows_and_operators_see_the_audit_trail() -> None:
    st = BrokerState(BrokerConfig())
    for peer, role, key in ((b"a", "client:a", KEY_A), (b"b", "client:b", KEY_B), (b"o", "operator", KEY_OPS),
                            (b"c", "client", "C" * 40), (b"p", "", "")):
        hello(st, peer, role, key)
    send(st, b"a", m.JobSubmit("s-a", "a", SPEC, ROWS), "client:a", KEY_A)
    send(st, b"b", m.JobSubmit("s-b", "b", SPEC, ROWS), "client:b", KEY_B)

    def status(peer: bytes, role: str, key: str) -> m.StatusReply:
        (reply,) = [c.msg for c in send(st, peer, m.StatusRequest("s"), role, key, 5.0) if isinstance(c, Send)]
        return reply

    a = status(b"a", "client:a", KEY_A)
    assert set(a.stats) == {"jobs", "scope"} and set(a.stats["jobs"]) == {"a"} and a.stats["scope"] == ["a"]
    assert "role_refused" not in a.stats and "audit" not in a.stats  # no counters, no trail
    ops = status(b"o", "operator", KEY_OPS)
    assert set(ops.stats["jobs"]) == {"a", "b"}
    assert [(r["what"], r["key"], r["role"]) for r in ops.stats["audit"]] == [
        ("job_start", fingerprint(KEY_A), "client:a"), ("job_start", fingerprint(KEY_B), "client:b")]
    assert ops.stats["audit"][0]["age_s"] == 4.0
    assert "audit" not in status(b"c", "client", "C" * 40).stats  # a client key not bound to a job: no trail
    assert set(status(b"c", "client", "C" * 40).stats["jobs"]) == {"a", "b"}
    assert "audit" in status(b"p", "", "").stats  # no CURVE: one user, who sees it all


def test_directives_refusals_and_revoked_keys_are_audited_and_repeats_are_not() -> None:
    st = BrokerState(BrokerConfig())
    st.handle(PeerMessage(b"act", m.ActorHello("h/cpu0", "h", "cpu0", 1, {"action": ["echo"]}, ["action"], 1),
                          (), "actor", "H" * 40), 0.0)
    hello(st, b"o", "operator", KEY_OPS)
    out = send(st, b"o", m.DirectRequest("d1", "h/cpu0", ["action"]), "operator", KEY_OPS)
    assert replies(out)[0].ok
    assert audits(out) == [{"what": "directive", "key": fingerprint(KEY_OPS), "role": "operator", "actor": "h/cpu0",
                            "kinds": ["action"], "mode": "finish", "directive": 1}]
    out = send(st, b"o", m.DirectRequest("d2", "nobody", ["action"]), "operator", KEY_OPS)
    assert not replies(out)[0].ok and audits(out)[0]["error"]  # a failed directive is on the record too
    # a client key's directives, three in a second: each refused and counted, one audit record and log line
    hello(st, b"c", "client", "C" * 40)
    outs = [send(st, b"c", m.DirectRequest(f"x{i}", "h/cpu0", ["action"]), "client", "C" * 40, 2.0 + i / 10)
            for i in range(3)]
    assert all(replies(o)[0].error_code == "forbidden" for o in outs) and st.stats["role_refused"] == 3
    assert [len(audits(o)) for o in outs] == [1, 0, 0] and [sum(isinstance(c, Log) for c in o) for o in outs] == [1, 0, 0]
    (later,) = audits(send(st, b"c", m.DirectRequest("x9", "h/cpu0", ["action"]), "client", "C" * 40, 3.5))
    assert later["repeats"] == 2 and later["why"] == "role" and later["message"] == "DirectRequest"
    out = st.handle(RevokePeers((b"c",), "its key was removed", ("C" * 40,)), 4.0)
    assert audits(out) == [{"what": "key_revoked", "key": fingerprint("C" * 40), "role": "revoked", "sessions_ended": 1}]
    _, cmds = st.direct("h/cpu0", ["action"], 5.0)  # the broker process's own API
    assert audits(cmds)[0]["role"] == "local"


def test_the_trail_in_memory_is_bounded() -> None:
    acc = Access({})
    for i in range(AUDIT_KEEP + 5):
        acc.audit("directive", KEY_OPS, "operator", float(i), n=i)
    trail = acc.trail(1000.0)
    assert len(trail) == AUDIT_KEEP and trail[0]["n"] == 5 and "at" not in trail[0]


@pytest.mark.parametrize("cls", [m.JobSubmit, m.JobPoll])
@pytest.mark.parametrize("role,passes", [("client:x", True), ("client:y", False), ("client:y,client:x", True),
                                         ("client", True), ("operator", True), ("any", True), ("", True),
                                         ("actor", False), ("revoked", False)])
def test_every_job_message_from_every_scope(cls: type, role: str, passes: bool) -> None:
    st = BrokerState(BrokerConfig())
    msg = m.JobSubmit("r", "x", {}, []) if cls is m.JobSubmit else m.JobPoll("r", "x")
    out = st.handle(PeerMessage(b"p", msg, (), role, KEY_A), 0.0)
    refused = st.stats["job_refused"] + st.stats["role_refused"]
    assert refused == (0 if passes else 1), (role, out)
    if not passes:
        (r,) = [c.msg for c in out if isinstance(c, Send)]
        assert isinstance(r, m.Reply) and r.error_code == "forbidden"


def test_the_audit_log_appends_one_json_line_a_record(tmp_path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.write({"what": "job_start", "key": "k", "role": "client:a", "job": "a"})
    log.close()
    log = AuditLog(path)  # a restarted broker appends; it never truncates
    log.write({"what": "job_cancel", "key": "k", "role": "client:a", "job": "a"})
    log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["what"] for x in lines] == ["job_start", "job_cancel"] and all(x["time"].endswith("+00:00") for x in lines)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError, match="cannot open the audit log"):
        AuditLog(tmp_path / "missing" / "audit.jsonl")


def test_job_scoped_keys_in_the_allow_directory(tmp_path) -> None:
    import zmq

    from libra.transport.keys import create_keypair
    from libra.transport.security import Authenticator, key_roles

    allowed = tmp_path / "allowed"
    a, b, o = (create_keypair(tmp_path / "k", n) for n in ("a", "b", "o"))
    for kp, sub in ((a, "clients/jobA"), (b, "clients/jobA"), (b, "clients/jobB"), (o, "operators")):
        (allowed / sub).mkdir(parents=True, exist_ok=True)
        (allowed / sub / kp.public_file.name).write_bytes(kp.public_file.read_bytes())
    (allowed / "clients" / ".hidden").mkdir()
    (allowed / "clients" / ".hidden" / "o.key").write_bytes(o.public_file.read_bytes())  # not a job: ignored
    assert key_roles(allowed) == {a.public_key: "client:jobA", b.public_key: "client:jobA,client:jobB",
                                  o.public_key: "operator"}
    ctx = zmq.Context()
    auth = Authenticator(ctx, allowed)
    try:
        (allowed / "clients" / "jobB" / "b.key").unlink()  # a job's key directory is watched like the others
        assert auth.refresh() == set() and auth.roles[b.public_key.decode()] == "client:jobA"
        (allowed / "clients" / "jobA" / "a.key").unlink()
        assert auth.refresh() == {a.public_key.decode()}
    finally:
        auth.stop()
        ctx.term()


def test_the_key_watch_hands_each_removed_key_over_with_its_own_peers() -> None:
    from libra.broker.key_watch import KeyWatch

    class Auth:  # the authenticator's side: the keys removed by the last re-read of the allow directory
        roles: dict[str, str] = {}
        removed: set[str] = set()

        def refresh(self) -> set[str]:
            return self.removed

    auth = Auth()
    watch = KeyWatch(auth, 1.0, 0.0)
    for peer, key in ((b"p1", "A"), (b"p2", "B"), (b"p3", "A"), (b"p4", "C")):
        watch.hello(peer, key)
    assert watch.revoked(0.5) == {}  # not yet due
    auth.removed = {"A", "B", "D"}
    assert watch.revoked(1.0) == {"A": (b"p1", b"p3"), "B": (b"p2",), "D": ()}
    assert watch.peer_keys == {b"p4": "C"}  # the others are forgotten: told once
    # in the core, one event per key: each key's audit record counts its own sessions
    st = BrokerState(BrokerConfig())
    hello(st, b"p1", "client", "A")
    hello(st, b"p3", "client", "A")
    hello(st, b"p2", "client", "B")
    counts = {k: audits(st.handle(RevokePeers(p, "its key was removed", (k,)), 2.0))[0]["sessions_ended"]
              for k, p in {"A": (b"p1", b"p3"), "B": (b"p2",)}.items()}
    assert counts == {"A": 2, "B": 1} and st.stats["keys_revoked"] == 3
