"""Key roles in the broker core (libra.broker.roles): every message kind from every role, and only the allowed
combinations get past the check; each refusal is typed, names the role, is logged and counted. The
authenticator side: the allow directory's role subdirectories give each key its roles."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from libra.broker import roles
from libra.broker.events import Log, PeerMessage, Send
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m
from libra.protocol.messages import MESSAGE_TYPES

SAMPLE = {str: "x", int: 1, float: 1.0, bool: True, bytes: b"x"}


def sample(cls: type) -> object:
    """An instance of message ``cls`` with a plain value in every required field."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        t = hints[f.name]
        origin = typing.get_origin(t) or t
        kw[f.name] = SAMPLE.get(origin, [] if origin is list else {} if origin is dict else None)
    return cls(**kw)


TO_BROKER = [c for c in MESSAGE_TYPES if c in BrokerState(BrokerConfig())._handlers]
EXPECTED = {
    "actor": {"ActorHello", "Bid", "Heartbeat", "WorkResult", "Handback", "DirectiveDone", "Goodbye", "LeaseReady",
              "OwnerReclaim",
              "LeaseReport", "LeaseEnd"},
    "client": {"ClientHello", "Heartbeat", "Submit", "StatusRequest", "CancelRequest", "Goodbye", "EndTrajectory",
               "JobSubmit", "JobPoll", "LeaseRequest", "LeaseEnd"},
}
EXPECTED["operator"] = EXPECTED["client"] | {"DirectRequest"}


def test_the_kinds_the_broker_accepts_are_the_ones_the_role_table_covers() -> None:
    names = {c.__name__ for c in TO_BROKER}
    assert names == EXPECTED["actor"] | EXPECTED["operator"], names  # a new message kind must get a role


@pytest.mark.parametrize("role", ["actor", "client", "operator", "any", "", "actor,client"])
@pytest.mark.parametrize("cls", TO_BROKER, ids=lambda c: c.__name__)
def test_every_kind_from_every_role_only_the_allowed_pass(role: str, cls: type) -> None:
    st = BrokerState(BrokerConfig())
    msg = sample(cls)
    out = st.handle(PeerMessage(b"peer", msg, (), role), 0.0)
    allowed = (role in ("any", "") or cls.__name__ in EXPECTED["actor"] | EXPECTED["client"]
               if role == "actor,client" else role in ("any", "") or cls.__name__ in EXPECTED[role])
    refused = [c for c in out if isinstance(c, Log) and c.event == "role_refused"]
    if allowed:
        assert not refused and st.stats["role_refused"] == 0
        return
    assert st.stats["role_refused"] == 1 and refused[0].fields == {"peer": b"peer".hex(), "role": role,
                                                                    "message": cls.__name__}
    (send,) = [c for c in out if isinstance(c, Send)]
    answer = send.msg
    text = {m.Reply: lambda r: (r.error_code, r.error), m.Disconnect: lambda d: ("forbidden", d.reason),
            m.Error: lambda e: (e.code, e.message)}[type(answer)](answer)
    assert text[0] == "forbidden" and repr(role) in text[1] and cls.__name__ in text[1], text
    if isinstance(getattr(msg, "request_id", None), str):
        assert isinstance(answer, m.Reply) and not answer.ok and answer.request_id == msg.request_id
    if cls in (m.ActorHello, m.ClientHello):
        assert isinstance(answer, m.Disconnect) and not st.actors  # never welcomed


def test_the_impostor_never_gets_work() -> None:
    # a client key says it is an actor: refused, so the echo call it hoped to receive goes to the real actor
    st = BrokerState(BrokerConfig())
    st.handle(PeerMessage(b"real", m.ActorHello("h/cpu0", "h", "cpu0", 1, {"action": ["echo"]}, ["action"], 4),
                          (), "actor"), 0.0)
    st.handle(PeerMessage(b"real", m.Bid(["action"], 4), (), "actor"), 0.0)
    for msg in (m.ActorHello("evil", "h", "cpu9", 2, {"action": ["echo"]}, ["action"], 64), m.Bid(["action"], 64)):
        st.handle(PeerMessage(b"evil", msg, (), "client"), 0.0)
    st.handle(PeerMessage(b"c", m.ClientHello("c1", 3), (), "client"), 0.0)
    out = st.handle(PeerMessage(b"c", m.Submit("r1", "action", "echo", {"secret": "user data"}), (), "client"), 0.1)
    (assign,) = [c for c in out if isinstance(c, Send) and isinstance(c.msg, m.Assign)]
    assert assign.peer == b"real" and [a.actor_id for a in st.actors.values()] == ["h/cpu0"]
    assert st.stats["role_refused"] == 2


def test_allow_directory_roles(tmp_path) -> None:
    from libra.transport.keys import create_keypair
    from libra.transport.security import key_roles

    allowed = tmp_path / "allowed"
    made = {}
    for name, sub in (("old", ""), ("a", "actors"), ("c", "clients"), ("o", "operators"), ("ac", "actors")):
        d = allowed / sub
        d.mkdir(parents=True, exist_ok=True)
        kp = create_keypair(tmp_path / "keys", name)
        made[name] = kp.public_key
        (d / kp.public_file.name).write_bytes(kp.public_file.read_bytes())
    (allowed / "clients" / "ac.key").write_bytes((tmp_path / "keys" / "ac.key").read_bytes())  # in two places
    got = key_roles(allowed)
    assert got == {made["old"]: "any", made["a"]: "actor", made["c"]: "client", made["o"]: "operator",
                   made["ac"]: "actor,client"}
    assert roles.allows("actor,client", m.Submit) and roles.allows("actor,client", m.Bid)
    assert not roles.allows("actor,client", m.DirectRequest)


def test_revoked_peers_end_an_actor_as_lost_and_a_client_at_once() -> None:
    from libra.broker.events import RevokePeers

    st = BrokerState(BrokerConfig())
    st.handle(PeerMessage(b"a", m.ActorHello("h/cpu0", "h", "cpu0", 1, {"action": ["echo"]}, ["action"], 1),
                          (), "actor"), 0.0)
    st.handle(PeerMessage(b"a", m.Bid(["action"], 1), (), "actor"), 0.0)
    st.handle(PeerMessage(b"c", m.ClientHello("c1", 3), (), "client"), 0.0)
    st.handle(PeerMessage(b"c", m.Submit("r1", "action", "echo", {"x": 1}), (), "client"), 0.0)
    out = st.handle(RevokePeers((b"a", b"c", b"never-said-hello"), "its key was removed"), 1.0)
    assert not st.actors and st.stats["keys_revoked"] == 2 and st.stats["requeued"] == 1  # the loss counted
    told = {c.peer: c.msg for c in out if isinstance(c, Send) and isinstance(c.msg, m.Disconnect)}
    assert set(told) == {b"a", b"c"} and all(d.reason == "forbidden: its key was removed" for d in told.values())
    assert [c for c in out if isinstance(c, Log) and c.event == "keys_revoked"]
    # from then on the shell hands its messages the role "revoked": nothing passes
    out = st.handle(PeerMessage(b"a", m.ActorHello("h/cpu0", "h", "cpu0", 1, {}, [], 1), (), roles.REVOKED), 2.0)
    assert isinstance([c for c in out if isinstance(c, Send)][0].msg, m.Disconnect) and not st.actors


def test_the_authenticator_rereads_the_allow_directory_and_names_the_keys_removed(tmp_path) -> None:
    import zmq

    from libra.transport.keys import create_keypair
    from libra.transport.security import Authenticator

    allowed = tmp_path / "allowed"
    (allowed / "clients").mkdir(parents=True)
    a, b = create_keypair(tmp_path / "k", "a"), create_keypair(tmp_path / "k", "b")
    (allowed / "clients" / "a.key").write_bytes(a.public_file.read_bytes())
    ctx = zmq.Context()
    auth = Authenticator(ctx, allowed)
    try:
        assert auth.roles == {a.public_key.decode(): "client"} and auth.refresh() == set()
        (allowed / "operators").mkdir()
        (allowed / "operators" / "b.key").write_bytes(b.public_file.read_bytes())
        assert auth.refresh() == set() and auth.roles[b.public_key.decode()] == "operator"
        (allowed / "clients" / "a.key").unlink()
        assert auth.refresh() == {a.public_key.decode()} and a.public_key.decode() not in auth.roles
    finally:
        auth.stop()
        ctx.term()


def test_libra_keys_offers_exactly_the_roles_the_allow_directory_has() -> None:
    import argparse

    from libra.cli import build_parser
    from libra.transport.security import ROLE_DIRS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    role = next(a for a in sub.choices["keys"]._actions if a.dest == "role")
    assert tuple(role.choices) == tuple(ROLE_DIRS)
