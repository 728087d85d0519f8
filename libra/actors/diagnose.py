"""Why an actor's broker says nothing: one warning that names the likely causes.

A broker that refuses an actor's CurveZMQ handshake (the broker public key the actor was given is wrong, the
actor's public key is not in the broker's allow directory, a plaintext actor against a CURVE broker or the
reverse) looks to the actor exactly like a broker that is not running: its hello is never answered, and the
state machine can only say ``broker_silent`` and retry with back-off. :func:`log_note` logs the state
machine's notes and, the first time a hello goes unanswered for a whole liveness window, adds one
``broker_unanswered`` warning saying what to check, as the client's ``BrokerUnreachable`` does. A welcome
re-arms it: the next outage gets one warning again, not one per retry.
"""

from __future__ import annotations

import os
from typing import Any
from weakref import WeakKeyDictionary

__all__ = ["SilenceHint", "log_note", "silence_hint"]


class SilenceHint:
    """Decides when to add the hint, from the notes alone. Pure: no clock, no I/O."""

    __slots__ = ("answered", "hinted")

    def __init__(self) -> None:
        self.answered = False  # a welcome came since the last hello
        self.hinted = False  # the hint was given in this streak of unanswered hellos

    def on_note(self, event: str) -> bool:
        """True when this note should be followed by the hint."""
        if event == "actor_registered":
            self.answered, self.hinted = True, False
            return False
        if event != "broker_silent":
            return False
        fire = not self.answered and not self.hinted  # the hello itself went unanswered
        self.hinted = self.hinted or fire
        self.answered = False  # a new hello follows the back-off
        return fire


def silence_hint(broker_url: str, curve: bool, others: tuple[str, ...] = ()) -> str:
    """The likely causes of an unanswered hello, in words an operator can act on. ``others``: the rest of the
    actor's broker address list (it tries them in turn)."""
    retry = f"the actor tries {', '.join(others)} next, then this one again" if others else "the actor keeps retrying"
    head = (f"the broker at {broker_url} has not answered this actor's hello ({retry}): "
            f"is a broker running there ('libra broker --bind {broker_url}')?")
    if curve:
        key = os.environ.get("LIBRA_BROKER_KEY", "LIBRA_BROKER_KEY")
        return (f"{head} This actor uses CURVE keys, and a broker that refuses its handshake stays silent: "
                f"check that {key} holds the broker's public key, that this actor's public key (the pair of "
                "LIBRA_CURVE_SECRET) is in the broker's --curve-allow directory, and that the broker was started "
                "with --curve-secret at all (a plaintext broker cannot answer a CURVE actor). The broker logs "
                "handshake_refused for a key not in its allow directory; a wrong broker key leaves no trace there.")
    return (f"{head} This actor has no CURVE keys; a broker started with --curve-secret ignores plaintext "
            "peers: set LIBRA_CURVE_SECRET to this actor's secret key file and LIBRA_BROKER_KEY to the broker's "
            "public key file for 'libra actors' (its slots inherit them), and put this actor's public key in "
            "the broker's --curve-allow directory ('libra keys --allow' creates a pair).")


_HINTS: WeakKeyDictionary[Any, SilenceHint] = WeakKeyDictionary()


def log_note(rt: Any, note: Any) -> None:
    """Log a state-machine ``Note`` on the runtime's logger, at its level; after the first ``broker_silent``
    of an unanswered hello, the ``broker_unanswered`` warning (:func:`silence_hint`) once."""
    urls = getattr(rt, "broker_urls", None) or [rt.broker_url]
    fields = note.fields
    if len(urls) > 1 and note.event == "broker_silent":  # name the address that was silent
        fields = {**fields, "broker": rt.broker_url}
    getattr(rt.log, note.level, rt.log.info)(note.event, **fields)
    hint = _HINTS.get(rt)
    if hint is None:
        hint = _HINTS[rt] = SilenceHint()
    if hint.on_note(note.event):
        others = tuple(u for u in urls if u != rt.broker_url)
        rt.log.warning("broker_unanswered", broker=rt.broker_url, endpoint=rt.endpoint, curve=rt.curve is not None,
                       hint=silence_hint(rt.broker_url, rt.curve is not None, others))
