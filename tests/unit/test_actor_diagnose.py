"""``libra.actors.diagnose``: when an actor's hello goes unanswered it logs ONE warning naming the likely causes
(broker not running, wrong broker key, actor key not allowed, plaintext vs CURVE), re-armed by a welcome."""

from __future__ import annotations

from typing import Any

from libra.actors.diagnose import SilenceHint, log_note, silence_hint
from libra.actors.state import Note


def test_one_hint_per_streak_of_unanswered_hellos() -> None:
    h = SilenceHint()
    assert [h.on_note(e) for e in ("broker_silent", "broker_silent", "broker_silent")] == [True, False, False]
    assert h.on_note("actor_registered") is False  # a welcome re-arms it
    assert h.on_note("broker_silent") is False  # a session lost after a welcome: the broker was there
    assert h.on_note("broker_silent") is True  # its next hello unanswered too: one hint for this outage
    assert h.on_note("broker_silent") is False and h.on_note("work_started") is False


def test_an_answered_hello_never_hints() -> None:
    h = SilenceHint()
    assert not any(h.on_note(e) for e in ("actor_registered", "broker_silent", "actor_registered", "broker_silent"))


def test_the_hint_names_the_address_and_every_likely_cause(monkeypatch: Any) -> None:
    monkeypatch.setenv("LIBRA_BROKER_KEY", "/keys/broker.key")
    curve = silence_hint("tcp://10.0.0.1:5555", curve=True)
    for part in ("tcp://10.0.0.1:5555", "is a broker running there", "/keys/broker.key holds the broker's public key",
                 "--curve-allow directory", "plaintext broker", "handshake_refused", "wrong broker key"):
        assert part in curve, part
    plain = silence_hint("tcp://10.0.0.1:5555", curve=False)
    for part in ("tcp://10.0.0.1:5555", "is a broker running there", "no CURVE keys", "--curve-secret",
                 "LIBRA_CURVE_SECRET", "LIBRA_BROKER_KEY", "--curve-allow"):
        assert part in plain, part


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.lines.append((level, event, kw))


class _Runtime:  # what log_note reads of an ActorRuntime
    def __init__(self) -> None:
        self.log, self.curve = _Log(), None
        self.broker_url = self.endpoint = "tcp://127.0.0.1:5555"


def test_log_note_logs_every_note_and_adds_the_warning_once() -> None:
    rt = _Runtime()
    for _ in range(3):
        log_note(rt, Note("broker_silent", {"silent_s": 3.0, "retry_in_s": 1.0}))
    events = [(level, event) for level, event, _ in rt.log.lines]
    assert events == [("info", "broker_silent"), ("warning", "broker_unanswered"), ("info", "broker_silent"),
                      ("info", "broker_silent")]
    fields = rt.log.lines[1][2]
    assert fields["broker"] == "tcp://127.0.0.1:5555" and fields["curve"] is False
    assert fields["hint"] == silence_hint("tcp://127.0.0.1:5555", curve=False)
