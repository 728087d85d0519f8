"""Journal replication (#32): the pure bookkeeping of both sides, the wire messages, and a primary's journal
followed into a standby's over a real (inproc) socket pair."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
import zmq

from libra.broker.config import BrokerConfig
from libra.broker.events import JournalWrite
from libra.broker.journal_store import BrokerJournal
from libra.broker.replication import ReplicationPrimary, ReplicationStandby
from libra.broker.replication_state import FollowerState, ReplicaSet
from libra.protocol import ProtocolError
from libra.protocol.messages_replication import ReplAck, ReplBatch, ReplBeat, ReplHello, ReplSnapshot, decode_repl, encode_repl


# -- the primary's book ---------------------------------------------------------------------------------------

def test_replica_set_syncing_then_in_sync_then_lagging():
    book = ReplicaSet("e1")
    assert book.next_batch() is None and book.seq == 0  # nobody to ship to: no number used
    assert book.hello(b"s", "s1") == 0
    seq, targets = book.next_batch()
    assert (seq, targets) == (1, [b"s"])
    assert book.waiting(1) == []  # syncing: not waited for
    assert book.ack(b"s", "e1", 0) is True  # acked its snapshot: in sync
    seq, _ = book.next_batch()
    assert book.waiting(seq) == [b"s"]
    assert book.ack(b"s", "other-epoch", seq) is False and book.waiting(seq) == [b"s"]
    assert book.ack(b"s", "e1", seq) is False and book.waiting(seq) == []
    seq, _ = book.next_batch()
    late = book.expire(seq)
    assert [s.standby_id for s in late] == ["s1"] and book.in_sync() == 0
    assert book.next_batch() is None  # a lagging standby gets no batches...
    assert book.hello(b"s", "s1") == seq  # ...until it asks again
    assert book.standbys[b"s"].mode == "syncing"


def test_replica_set_ignores_unknown_and_future_acks():
    book = ReplicaSet("e")
    assert book.ack(b"x", "e", 0) is False
    book.hello(b"s", "s")
    assert book.ack(b"s", "e", 5) is False and book.standbys[b"s"].mode == "syncing"


# -- the standby's follower state -----------------------------------------------------------------------------

def test_follower_applies_in_order_and_resyncs_on_gaps():
    st = FollowerState(takeover_after_s=3.0)
    st.ask(0.0)
    assert st.on_batch("e", 4, 0.1) == "ignore"  # before the snapshot: it covers this
    st.on_snapshot("e", 4, 0.2)
    assert st.on_batch("e", 5, 0.3) == "apply"
    st.applied_batch(5)
    assert st.on_batch("e", 5, 0.4) == "duplicate"
    assert st.on_batch("e", 7, 0.5) == "resync"
    assert st.on_batch("e2", 6, 0.5) == "resync"
    assert st.on_beat("e", 5, 0.6) is False
    assert st.on_beat("e", 6, 0.6) is True  # batch 6 never came
    assert st.on_beat("e2", 5, 0.6) is True  # a new primary
    st.ask(0.7)
    assert st.on_beat("e2", 9, 0.8) is False  # a snapshot is on its way


def test_follower_takes_over_only_after_silence_and_with_a_snapshot():
    st = FollowerState(takeover_after_s=3.0)
    assert not st.should_take_over(100.0)  # never reached its primary: nothing to serve from
    st.ask(0.0)
    st.heard(0.5)
    assert not st.should_take_over(10.0)  # heard, but no snapshot yet
    st.on_snapshot("e", 0, 1.0)
    assert not st.should_take_over(3.9)
    assert st.should_take_over(4.0)
    st.on_beat("e", 0, 4.5)
    assert not st.should_take_over(5.0)
    assert st.ask_again(5.0, 1.0) is False  # not awaiting a snapshot
    st.ask(5.0)
    assert st.ask_again(5.5, 1.0) is False and st.ask_again(6.0, 1.0) is True


# -- wire -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("msg", [ReplHello("", "s", -1), ReplSnapshot("e", 3, b"\x00db"),
                                 ReplBatch("e", 4, [("accept", "c", "r", {"args": {"x": [1, 2]}})]),
                                 ReplAck("e", "s", 4), ReplBeat("e", 4)], ids=lambda m: type(m).__name__)
def test_repl_messages_round_trip(msg):
    assert decode_repl(encode_repl(msg)) == msg


@pytest.mark.parametrize("frame,code", [(b"LIBRA1\x03\x90", "bad_version"), (b"LIBRAR1\xc1", "bad_payload"),
                                        (b"LIBRAR1\x93\xa4beat\xa1e\xa1x", "bad_type"),
                                        (b"LIBRAR1\x92\xa4nope\xa1e", "bad_type")])
def test_repl_decode_refuses_bad_frames(frame, code):
    with pytest.raises(ProtocolError) as ei:
        decode_repl(frame)
    assert ei.value.code.value == code


# -- journal: records, snapshot, replace ------------------------------------------------------------------------

def _rows(path) -> dict[str, list]:
    db = sqlite3.connect(str(path))
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in ("accepted", "started", "done")}
    finally:
        db.close()


def _write_some(j: BrokerJournal, start: int, n: int) -> None:
    for i in range(start, start + n):
        j.write(JournalWrite("accept", "c", f"r{i}", {"kind": "action", "name": "echo", "args": {"i": i},
                                                      "trajectory": "", "timeout_s": 60.0, "work_id": f"w{i}"}))
        j.write(JournalWrite("start", "c", f"r{i}", {"work_id": f"w{i}", "lease": i, "attempt": 1, "actor_id": "a"}))
        if i % 2:
            j.write(JournalWrite("done", "c", f"r{i}", {"ok": True, "output": {"i": i}}))
    j.commit()


def test_snapshot_replace_and_apply_give_equal_journals(tmp_path):
    prim = BrokerJournal(tmp_path / "p.sqlite", keep_replies=3)
    prim.shipping = True
    _write_some(prim, 0, 6)
    prim.take_shipped()
    image = prim.snapshot()
    stand = BrokerJournal(tmp_path / "s.sqlite", keep_replies=3)
    _write_some(stand, 100, 2)  # whatever it held before is replaced
    stand.replace(image)
    _write_some(prim, 6, 6)
    prim.prune()
    prim.commit()
    stand.apply(prim.take_shipped())
    assert prim.take_shipped() == []
    assert stand.load() == prim.load()
    prim.close()
    stand.close()
    assert _rows(tmp_path / "p.sqlite") == _rows(tmp_path / "s.sqlite")
    assert len(_rows(tmp_path / "s.sqlite")["done"]) == 3  # pruned to the newest keep=3 on both


def test_apply_refuses_an_unknown_op(tmp_path):
    j = BrokerJournal(tmp_path / "j.sqlite")
    with pytest.raises(ValueError, match="unknown op 'drop'"):
        j.apply([("drop", "c", "r", {})])
    j.close()


def test_config_refuses_bad_replication_times():
    with pytest.raises(ValueError, match=r"\[broker\] takeover_after_s must be > 0"):
        BrokerConfig(takeover_after_s=0.0)
    with pytest.raises(ValueError, match="must exceed two replica beats"):
        BrokerConfig(takeover_after_s=0.9, replica_beat_s=0.5)


# -- a primary and a standby over a socket ----------------------------------------------------------------------

def _wait(cond, primary: ReplicationPrimary, what: str, rounds: int = 2000) -> None:
    for _ in range(rounds):
        if cond():
            return
        primary.sock.poll(5)
        primary.pump(time.monotonic())
    raise AssertionError(f"timed out waiting for {what}")


def test_round_trip_primary_to_standby_then_gap_resync_then_takeover(tmp_path):
    ctx = zmq.Context()
    cfg = BrokerConfig(replica_ack_timeout_s=5.0, takeover_after_s=2.0, replica_beat_s=0.1)
    pj = BrokerJournal(tmp_path / "p.sqlite")
    prim = ReplicationPrimary(ctx, "inproc://repl", pj, cfg)
    _write_some(pj, 0, 4)  # before the standby came: reaches it in the snapshot
    prim.ship()
    stand = ReplicationStandby("inproc://repl", tmp_path / "s.sqlite", cfg, ctx=ctx, standby_id="s1")
    took: list[bool] = []
    t = threading.Thread(target=lambda: took.append(stand.follow(poll_s=0.01)), daemon=True)
    t.start()
    _wait(lambda: prim.book.in_sync() == 1, prim, "the standby in sync")
    for k in range(3):  # synchronous batches: each ship returns once the standby has it
        _write_some(pj, 10 + 10 * k, 5)
        prim.ship()
        assert prim.lagging_events == 0 and prim.book.standbys[b"s1"].acked == prim.book.seq
    assert stand.snapshots == 1 and stand.batches == 3
    # a batch the standby never gets (as if dropped): the next beat shows the gap and it asks for a snapshot
    _write_some(pj, 50, 2)
    pj.take_shipped()
    prim.book.seq += 1
    _wait(lambda: stand.snapshots == 2, prim, "a resync snapshot")
    _wait(lambda: prim.book.in_sync() == 1, prim, "in sync again")
    _write_some(pj, 60, 2)
    prim.ship()
    expected = pj.load()
    prim.close()  # silent from now on: the standby takes over
    t.join(30)
    assert took == [True]
    j = BrokerJournal(tmp_path / "s.sqlite")
    assert j.load() == expected
    j.close()
    pj.close()
    ctx.term()


def test_a_standby_that_misses_the_ack_deadline_is_marked_lagging(tmp_path):
    ctx = zmq.Context()
    cfg = BrokerConfig(replica_ack_timeout_s=0.05)
    pj = BrokerJournal(tmp_path / "p.sqlite")
    prim = ReplicationPrimary(ctx, "inproc://repl2", pj, cfg)
    fake = ctx.socket(zmq.DEALER)  # says hello, acks the snapshot, then stops reading
    fake.setsockopt(zmq.IDENTITY, b"f")
    fake.connect("inproc://repl2")
    fake.send(encode_repl(ReplHello("", "f", -1)))
    _wait(lambda: fake.poll(0), prim, "the snapshot")
    snap = decode_repl(fake.recv())
    fake.send(encode_repl(ReplAck(snap.epoch, "f", snap.seq)))
    _wait(lambda: prim.book.in_sync() == 1, prim, "in sync")
    _write_some(pj, 0, 1)
    prim.ship()
    assert prim.lagging_events == 1 and prim.book.standbys[b"f"].mode == "lagging"
    _write_some(pj, 1, 1)
    prim.ship()  # alone now: no wait, no second event
    assert prim.lagging_events == 1 and prim.batches == 1
    fake.close(0)
    prim.close()
    pj.close()
    ctx.term()


# -- command line ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,said", [
    (["--replicate-bind", "tcp://127.0.0.1:5556"], "--replicate-bind needs --journal"),
    (["--standby-of", "tcp://127.0.0.1:5556"], "--standby-of needs --journal"),
    (["--standby-of", "127.0.0.1:5556", "--journal", "j.sqlite"], "it has no scheme"),
    (["--takeover-after-s", "0.5", "--journal", "j.sqlite"], "takeover_after_s (0.5) must exceed two replica beats"),
    (["--replica-ack-timeout-s", "0", "--journal", "j.sqlite"], "replica_ack_timeout_s must be > 0"),
])
def test_broker_cli_refuses_bad_replication_flags(argv, said, capsys, monkeypatch):
    from libra.broker import __main__ as broker_main
    from libra.broker.__main__ import main

    # main() configures logging with cached loggers for the process it owns; in this test process that would
    # freeze the loggers later tests capture
    monkeypatch.setattr(broker_main, "configure", lambda *a, **k: None)

    assert main(["--bind", "tcp://127.0.0.1:1", *argv]) == 2
    assert said in capsys.readouterr().err
