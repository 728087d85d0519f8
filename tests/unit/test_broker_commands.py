"""The broker core's way out is its commands: journal records, planner searches and log lines come out of
``handle`` as commands (never as fields for the shell to read, never as direct I/O), the core modules
import no logger, and the server shell executes every kind of command."""

from __future__ import annotations

import ast
from pathlib import Path

from structlog.testing import capture_logs

from libra.broker.config import BrokerConfig
from libra.broker.events import (
    JournalWrite,
    Log,
    PeerMessage,
    Restore,
    Send,
    StartPlannerSearch,
    Tick,
)
from libra.broker.state import BrokerState
from libra.protocol import messages as m

ROOT = Path(__file__).resolve().parents[2]
BROKER = ROOT / "libra" / "broker"
C, A = b"client", b"actor"
#: The shell: the modules that do I/O around the core. Everything else in libra/broker that the core
#: imports is the core.
SHELL = {"libra.broker.server", "libra.broker.__main__", "libra.broker.journal_store", "libra.broker.metrics",
         "libra.broker.router_state"}
#: What no core module may import: loggers, and the shell's I/O.
FORBIDDEN = ("logging", "structlog", "libra.logging", "sqlite3", "zmq", "threading", "concurrent")


def _broker(journaling: bool) -> BrokerState:
    s = BrokerState(BrokerConfig(), journaling=journaling)
    s.handle(PeerMessage(C, m.ClientHello("c1", 1)), 0.0)
    s.handle(PeerMessage(A, m.ActorHello("a1", "h", "cpu0", 1, {"action": ["echo"]}, ["action"], 1)), 0.0)
    return s


def _roundtrip(s: BrokerState) -> tuple[list, list]:
    """Submit one echo call and return its result: (commands of the submit, commands of the result)."""
    sub = s.handle(PeerMessage(C, m.Submit("r1", "action", "echo", {"x": 1}, "t1", 30.0)), 1.0)
    (assign,) = [c.msg for c in sub if isinstance(c, Send) and isinstance(c.msg, m.Assign)]
    res = s.handle(PeerMessage(A, m.WorkResult(assign.work_id, assign.lease, True, {"x": 1}, duration_s=0.1)), 2.0)
    return sub, res


def test_an_accepted_submit_and_its_reply_come_out_as_journal_writes_when_journaling() -> None:
    s = _broker(journaling=True)
    sub, res = _roundtrip(s)
    (acc, start) = [c for c in sub if isinstance(c, JournalWrite)]
    assert acc == JournalWrite("accept", "c1", "r1", {"kind": "action", "name": "echo", "args": {"x": 1},
                                                       "trajectory": "t1", "timeout_s": 30.0, "work_id": "w1"})
    # its assignment is recorded too: a restarted broker knows its lease and how often it was started
    assert start == JournalWrite("start", "c1", "r1", {"work_id": "w1", "lease": 1, "attempt": 1, "actor_id": "a1"})
    (done,) = [c for c in res if isinstance(c, JournalWrite)]
    assert (done.op, done.client_id, done.request_id) == ("done", "c1", "r1")
    assert done.data["ok"] is True and done.data["output"] == {"x": 1} and done.data["actor_id"] == "a1"
    reply = next(i for i, c in enumerate(res) if isinstance(c, Send) and isinstance(c.msg, m.Reply))
    assert res.index(done) < reply  # the record precedes the reply it makes durable
    assert not hasattr(s, "journal_out")  # no side channel left for the shell to drain
    # a resubmission is answered from the record: nothing new to journal
    again = s.handle(PeerMessage(C, m.Submit("r1", "action", "echo", {"x": 1}, "t1", 30.0)), 3.0)
    assert [type(c) for c in again] == [Send] and again[0].msg.ok
    # a refused request was never accepted: nothing to journal
    bad = s.handle(PeerMessage(C, m.Submit("r2", "nope", "echo", {}, None, 30.0)), 3.0)
    assert [type(c) for c in bad] == [Send] and not bad[0].msg.ok


def test_no_journal_writes_without_journaling() -> None:
    sub, res = _roundtrip(_broker(journaling=False))
    assert not [c for c in [*sub, *res] if isinstance(c, JournalWrite)]
    assert [type(c) for c in res] == [Send]


def test_a_restored_journal_answers_and_requeues_and_is_not_journaled_again() -> None:
    s = BrokerState(BrokerConfig(), journaling=True)
    done = [("c1", "old", {"ok": True, "output": 7, "work_id": "w9", "attempts": 1})]
    accepted = [("c1", "r1", {"kind": "action", "name": "echo", "args": 1, "trajectory": None, "timeout_s": 30.0}),
                ("c1", "old", {"kind": "action", "name": "echo", "args": 1, "trajectory": None, "timeout_s": 30.0})]
    assert s.handle(Restore(accepted, done), 0.0) == []
    assert s.stats["restored"] == 1 and [w.request_id for w in s.works.values()] == ["r1"]
    s.handle(PeerMessage(C, m.ClientHello("c1", 1)), 1.0)
    (r,) = s.handle(PeerMessage(C, m.Submit("old", "action", "echo", 1, None, 30.0)), 1.0)
    assert isinstance(r, Send) and r.msg.output == 7  # answered from the journal's record


def test_an_offloaded_planner_round_is_a_start_search_command() -> None:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "grp", "interval_s": 10.0}),
                    planner_offload=True)
    caps = {"generate": ["*"], "train": ["*"]}
    for k in range(8):
        aid = f"n0/gpu{k}"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, "n0", f"gpu{k}", 1, caps, ["generate"], 4,
                                                       {"slot_kind": "gpu"})), 0.0)
    s.handle(Tick(), 1.0)
    out = s.handle(Tick(), 20.0)
    (start,) = [c for c in out if isinstance(c, StartPlannerSearch)]
    assert start.job.decision is None and s.planner is not None and s.planner.searching
    assert not hasattr(s.planner, "job")  # the shell gets the job from the command only


def test_the_core_returns_log_commands_and_writes_no_log_line() -> None:
    s = BrokerState(BrokerConfig())
    with capture_logs() as logs:
        s.handle(PeerMessage(C, m.ClientHello("c1", 1)), 0.0)
        # a generate turn before any rollout instance: queued, and said so in a log line
        out = s.handle(PeerMessage(C, m.Submit("g1", "generate", "default", {"prompt_tokens": 3}, "t1", 30.0)), 1.0)
        s.handle(Tick(), 2.0)
    (line,) = [c for c in out if isinstance(c, Log)]
    assert line.component == "libra.broker.rollout" and line.fields["work_id"] and line.level == "info"
    assert logs == []  # the core itself wrote nothing


def _imports(path: Path) -> set[str]:
    mod = "libra.broker." + path.stem
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = mod.rpartition(".")[0] if node.level else ""
            full = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            names.add(full)
            names.update(f"{full}.{a.name}" for a in node.names)
    return names


def test_the_core_modules_import_no_logger_and_no_shell() -> None:
    modules = {"libra.broker." + p.stem: p for p in BROKER.glob("*.py") if p.stem != "__init__"}
    core, todo = set(), ["libra.broker.state"]
    while todo:  # everything in libra/broker the core imports, transitively
        mod = todo.pop()
        if mod in core:
            continue
        core.add(mod)
        todo += [n for n in _imports(modules[mod]) if n in modules]
    assert core & SHELL == set(), f"the core imports the shell: {sorted(core & SHELL)}"
    assert {"libra.broker.sessions", "libra.broker.work_table", "libra.broker.dispatch", "libra.broker.plan_rounds",
            "libra.broker.plan_decider", "libra.broker.journal", "libra.broker.rollout"} <= core
    bad = {mod: sorted(n for n in _imports(modules[mod]) if any(n == f or n.startswith(f + ".") for f in FORBIDDEN))
           for mod in sorted(core)}
    assert not {k: v for k, v in bad.items() if v}, bad
    package = ast.parse((BROKER / "__init__.py").read_text())
    assert not [n for n in ast.walk(package) if isinstance(n, (ast.Import, ast.ImportFrom))]  # it imports nothing


def test_the_server_executes_journal_and_log_commands(tmp_path) -> None:
    from libra.broker.server import BrokerServer

    srv = BrokerServer("tcp://127.0.0.1:0", BrokerConfig(), journal=str(tmp_path / "j.sqlite"))
    try:
        assert srv.state.journaling and not srv.state.planner_offload
        with capture_logs() as logs:
            srv._execute([JournalWrite("accept", "c1", "r1", {"kind": "action"}),
                          Log("plan_abandoned", {"actor": "a1", "why": "gone"}, "warning", "libra.broker.plan_rounds")])
        assert srv.journal is not None
        srv.journal.commit()
        assert srv.journal.load() == ([("c1", "r1", {"kind": "action"})], [])
        assert logs == [{"event": "plan_abandoned", "actor": "a1", "why": "gone", "component": "libra.broker.plan_rounds",
                         "log_level": "warning"}]
    finally:
        srv.sock.close(0)
        srv.journal.close()
        srv._ctx.term()
