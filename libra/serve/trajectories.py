"""The endpoint's trajectories: an id -> an :class:`~libra.rl.episode.EpisodeSession`, and the rule that
matches each request against what the session already recorded.

Chat (``/v1/chat/completions``): the first request's messages (and ``tools``) are rendered by the
tokenizer's chat template with the generation prompt and become the session's prompt (loss mask 0). Every
assistant message the endpoint returns is recorded as the ids the model sampled (mask 1, engine log-probs).
A later request must repeat the recorded messages exactly (compared as :func:`~.messages.normalize` does)
and may add messages after them; those are appended through the template's continuation, tokenized once,
mask 0 (``EpisodeSession.add_messages``), and the model takes the next turn.

Edited history is refused, never re-tokenized: a request that changes, drops or reorders a recorded
message, or changes ``tools``, gets **409** ``history_mismatch`` naming the first differing message. The
agent opens a new trajectory to branch. A request that repeats the last one exactly (a client retry after a
lost response) gets the same response again, not a new sample. Requests on one trajectory are served one at
a time.

Completions (``/v1/completions``): the first prompt (text, tokenized with the tokenizer's special tokens, or
a list of token ids) is the prompt; a later prompt must start with the recorded text (prompt + every
completion returned) or, as ids, with the recorded ids; the rest is appended with mask 0. One trajectory is
either chat or completions.

Sampling comes from the session (the job's ``[env]`` sampling, so the log-probs train on-policy): a request's
``max_tokens`` / ``max_completion_tokens`` may only lower the turn's cap; ``temperature``, ``top_p`` and
``stop`` strings are ignored; ``n`` other than 1 is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .messages import EndpointError, first_difference, for_template, normalize
from .toolcalls import get_tool_parser

__all__ = ["Entry", "TrajectoryRegistry", "Turn"]


@dataclass
class Turn:
    """One model turn: what the endpoint returned and the span of the session's ids it sampled."""

    ids: list[int]
    logprobs: list[float]
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int


@dataclass
class Entry:
    session: Any
    parser: Any
    mode: str | None = None  # "chat" | "completion", set by the first request
    recorded: list[dict[str, Any]] = field(default_factory=list)  # chat: normalized messages the ids hold
    tools_key: str = ""
    text: str = ""  # completion: prompt + every completion returned
    last: tuple[Any, dict[str, Any]] | None = None  # (request key, response): a retry gets the same answer
    turns: list[Turn] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # ------------------------------------------------------------------ chat
    async def chat(self, body: dict[str, Any]) -> tuple[dict[str, Any], Turn | None]:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise EndpointError(400, "invalid_messages", "messages must be a non-empty list", "messages")
        sent = [normalize(m, f"messages[{i}]") for i, m in enumerate(raw)]
        tools = body.get("tools") or None
        tools_key = json.dumps(tools, sort_keys=True)
        _check_n(body)
        key = (tools_key, json.dumps(sent, sort_keys=True, default=str))
        if self.last is not None and self.last[0] == key:
            return self.last[1], None
        s = self.session
        if self.mode is None:
            self._first()
            with _template_errors():
                text = s.tokenizer.apply_chat_template([for_template(m) for m in sent], tools=tools,
                                                       add_generation_prompt=True, tokenize=False)
            s.set_prompt(s.tokenizer.encode(text, add_special_tokens=False))
            self.mode, self.recorded, self.tools_key = "chat", list(sent), tools_key
        else:
            self._same_mode("chat")
            if tools_key != self.tools_key:
                raise EndpointError(409, "history_mismatch", "tools differ from the ones this trajectory "
                                    "started with; open a new trajectory to change them", "tools")
            diff = first_difference(self.recorded, sent)
            if diff is not None:
                raise EndpointError(409, "history_mismatch", f"messages[{diff}] differs from the message this "
                                    "trajectory recorded there (edited, dropped or reordered history is not "
                                    "re-tokenized; open a new trajectory to branch)", f"messages[{diff}]")
            new = sent[len(self.recorded):]
            if not new and self.recorded[-1]["role"] == "assistant":
                raise EndpointError(409, "history_mismatch", "no message after the recorded assistant turn: "
                                    "append the next user or tool message", "messages")
            if new:
                with _template_errors():
                    s.add_messages([for_template(m) for m in new], tools=tools)
                self.recorded += new
        turn = await self._turn(body)
        msg: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.tool_calls:
            msg["tool_calls"] = turn.tool_calls
        self.recorded.append(normalize(msg, "response"))
        logprobs = {"content": self._token_logprobs(turn)} if body.get("logprobs") else None
        resp = self._response("chat.completion", body, turn, {"index": 0, "message": msg, "logprobs": logprobs})
        self.last = (key, resp)
        return resp, turn

    # ------------------------------------------------------------------ completions
    async def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], Turn | None]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise EndpointError(400, "invalid_prompt", "prompt must be one non-empty string or one list of "
                                "token ids", "prompt")
        _check_n(body)
        key = json.dumps(prompt)
        if self.last is not None and self.last[0] == key:
            return self.last[1], None
        s, tok = self.session, self.session.tokenizer
        if self.mode is None:
            self._first()
            s.set_prompt(list(prompt) if is_ids else tok.encode(prompt))
            self.mode, self.text = "completion", prompt if isinstance(prompt, str) else tok.decode(prompt)
        else:
            self._same_mode("completion")
            if is_ids:
                if prompt[:len(s.input_ids)] != s.input_ids:
                    raise EndpointError(409, "history_mismatch", "the prompt ids do not start with this "
                                        "trajectory's recorded ids", "prompt")
                s.extend_context(list(prompt[len(s.input_ids):]))
                self.text = tok.decode(prompt)
            else:
                if not prompt.startswith(self.text):
                    raise EndpointError(409, "history_mismatch", "the prompt does not start with this "
                                        "trajectory's recorded text (prompt + completions returned)", "prompt")
                s.extend_context(tok.encode(prompt[len(self.text):], add_special_tokens=False))
                self.text = prompt
        turn = await self._turn(body, chat=False)
        self.text += turn.text
        choice: dict[str, Any] = {"index": 0, "text": turn.text}
        if body.get("logprobs") is not None:
            toks = [tok.decode([t]) for t in turn.ids]
            choice["logprobs"] = {"tokens": toks, "token_logprobs": [_finite(x) for x in turn.logprobs], "top_logprobs": None,
                                  "text_offset": _offsets(toks)}
        resp = self._response("text_completion", body, turn, choice)
        self.last = (key, resp)
        return resp, turn

    # ------------------------------------------------------------------ shared
    def _first(self) -> None:
        if self.session.versions:
            raise EndpointError(409, "history_mismatch", "this trajectory already has turns the endpoint did "
                                "not produce; open a new one")

    def _same_mode(self, mode: str) -> None:
        if self.mode != mode:
            raise EndpointError(409, "wrong_api", f"this trajectory is a {self.mode} trajectory; use one API "
                                "per trajectory")

    async def _turn(self, body: dict[str, Any], chat: bool = True) -> Turn:
        s = self.session
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise EndpointError(400, "invalid_max_tokens", "max_tokens must be a positive integer", "max_tokens")
        start = len(s.input_ids)
        try:
            await s.generate(max_new_tokens=cap)
        except Exception as exc:  # noqa: BLE001  (the broker's typed errors, reported to the agent)
            raise EndpointError(502, "generate_failed", f"{type(exc).__name__}: {exc}", kind="server_error") from exc
        ids, lps = list(s.input_ids[start:]), list(s.logprobs[start:])
        stopped = bool(ids) and ids[-1] in s.stop_token_ids
        shown = ids[:-1] if stopped else ids
        if chat:
            text = self._decode_keeping_markers(shown)
            parsed = self.parser.parse(text)
            content, calls = parsed.content, list(parsed.tool_calls)
        else:
            text = s.tokenizer.decode(shown, skip_special_tokens=True)
            content, calls = text, []
        reason = "tool_calls" if calls else "stop" if stopped else "length"
        turn = Turn(ids, lps, text, content, calls, reason, start)
        self.turns.append(turn)
        return turn

    def _decode_keeping_markers(self, ids: list[int]) -> str:
        tok = self.session.tokenizer
        keep = {tok.convert_tokens_to_ids(m) for m in getattr(self.parser, "markers", ())}
        drop = set(tok.all_special_ids) - keep
        return tok.decode([t for t in ids if t not in drop], skip_special_tokens=False)

    def _token_logprobs(self, turn: Turn) -> list[dict[str, Any]]:
        tok = self.session.tokenizer
        out = []
        for t, lp in zip(turn.ids, turn.logprobs):
            s = tok.decode([t], skip_special_tokens=False)
            out.append({"token": s, "logprob": _finite(lp), "bytes": list(s.encode()), "top_logprobs": []})
        return out

    def _response(self, obj: str, body: dict[str, Any], turn: Turn, choice: dict[str, Any]) -> dict[str, Any]:
        choice["finish_reason"] = turn.finish_reason
        if body.get("return_token_ids"):
            choice["token_ids"] = list(turn.ids)
        n = len(turn.ids)
        prefix = "chatcmpl" if obj == "chat.completion" else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": body.get("model") or "libra", "choices": [choice],
                "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n,
                          "total_tokens": turn.prompt_tokens + n}}

    def record(self) -> dict[str, Any]:
        """What training will use: the session's ids, loss mask, log-probs and per-turn weights versions."""
        s = self.session
        return {"object": "trajectory", "id": s.trajectory, "mode": self.mode, "input_ids": list(s.input_ids),
                "loss_mask": list(s.loss_mask), "logprobs": [_finite(x) for x in s.logprobs], "versions": list(s.versions),
                "turns": len(self.turns), "finished": bool(s.finished)}


@contextlib.contextmanager
def _template_errors() -> Iterator[None]:
    """A chat template that refuses the messages (Jinja's ``raise_exception``, a missing key) is a 400."""
    try:
        yield
    except EndpointError:
        raise
    except Exception as exc:  # noqa: BLE001  (jinja2's TemplateError and whatever a template raises)
        raise EndpointError(400, "template_error", f"the model's chat template cannot render these messages: "
                            f"{type(exc).__name__}: {exc}", "messages") from exc


def _finite(lp: float) -> float:
    """A log-prob as JSON can carry it (-inf, which JSON has no word for, as OpenAI's -9999.0)."""
    return lp if math.isfinite(lp) else -9999.0


def _check_n(body: dict[str, Any]) -> None:
    if body.get("n") not in (None, 1):
        raise EndpointError(400, "unsupported_n", "n must be 1: one trajectory is one sample (open one "
                            "trajectory per sample)", "n")


def _offsets(toks: list[str]) -> list[int]:
    out, pos = [], 0
    for t in toks:
        out.append(pos)
        pos += len(t)
    return out


class TrajectoryRegistry:
    """The trajectories an endpoint serves. ``register`` and ``unregister`` are called on the endpoint's
    event loop (the sessions' client lives there). ``opener``, when set (``libra serve``), makes new sessions
    for ``POST /v1/trajectories``: ``async opener(body) -> session``."""

    def __init__(self, model_name: str = "libra", tool_parser: Any = "hermes", opener: Any = None) -> None:
        self.model_name = model_name
        self.tool_parser = get_tool_parser(tool_parser)
        self.opener = opener
        self._entries: dict[str, Entry] = {}

    def register(self, session: Any, key: str | None = None, tool_parser: Any = None) -> str:
        """Serve ``session`` under ``key`` (default: its trajectory id); returns the key (the API key)."""
        key = key or session.trajectory
        if key in self._entries:
            raise ValueError(f"trajectory {key!r} is already registered")
        parser = get_tool_parser(tool_parser) if tool_parser is not None else self.tool_parser
        self._entries[key] = Entry(session, parser)
        return key

    def unregister(self, key: str) -> Entry | None:
        return self._entries.pop(key, None)

    def get(self, key: str) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise EndpointError(404, "unknown_trajectory", f"unknown trajectory {key!r}: not open on this "
                                "endpoint (finished, never opened, or a typo)", "trajectory")
        return entry

    def __len__(self) -> int:
        return len(self._entries)
