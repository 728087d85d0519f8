"""Pure helpers of the endpoint: its typed error, request checks, and message normalization.

Normalization makes the message list an agent sends back comparable with the one the endpoint recorded:
a message is reduced to its role, its text (``None`` and ``""`` are the same; a list of content parts is
joined from its ``text`` parts), its tool calls as ``(name, arguments)`` with the arguments parsed from JSON
(so key order and spacing do not matter; the call ids do not count), and for a ``tool`` message its
``tool_call_id`` and ``name``. Anything else the client adds (``refusal``, ``annotations``...) is ignored.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["EndpointError", "ROLES", "for_template", "normalize", "first_difference", "trajectory_of"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and an OpenAI error body (``code``, ``param``)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.kind = status, code, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise EndpointError(400, "unsupported_content", f"{where}: only text content parts are "
                                    f"supported, got {p!r:.80}", where)
        return "".join(parts)
    raise EndpointError(400, "invalid_content", f"{where}: content must be a string or a list of parts", where)


def _args(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _calls(msg: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise EndpointError(400, "invalid_tool_calls", f"{where}.tool_calls must be a list", where)
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EndpointError(400, "invalid_tool_calls", f"{where}.tool_calls[{i}] needs function.name", where)
        out.append((fn["name"], _args(fn.get("arguments", "{}"))))
    return out


def normalize(msg: Any, where: str) -> dict[str, Any]:
    """The comparable form of one message (see the module docstring); 400 on a malformed one."""
    if not isinstance(msg, dict):
        raise EndpointError(400, "invalid_message", f"{where} must be an object", where)
    role = msg.get("role")
    if role not in ROLES:
        raise EndpointError(400, "invalid_role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                            where)
    out: dict[str, Any] = {"role": role, "content": text_of(msg.get("content"), f"{where}.content")}
    if role == "assistant":
        out["tool_calls"] = _calls(msg, where)
    if role == "tool":
        out["tool_call_id"] = msg.get("tool_call_id")
        if msg.get("name") is not None:
            out["name"] = msg.get("name")
    return out


def for_template(msg: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as chat templates take it (tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": msg["role"], "content": msg["content"]}
    if msg.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                             for n, a in msg["tool_calls"]]
    for k in ("tool_call_id", "name"):
        if msg.get(k) is not None:
            out[k] = msg[k]
    return out


def first_difference(recorded: list[dict[str, Any]], sent: list[dict[str, Any]]) -> int | None:
    """The index of the first recorded message that ``sent`` does not repeat, or None if it repeats all."""
    for i, m in enumerate(recorded):
        if i >= len(sent) or sent[i] != m:
            return i
    return None


def trajectory_of(body: dict[str, Any], headers: Any) -> str:
    """The trajectory id of a request: ``body["trajectory"]`` (``extra_body``), else the
    ``X-Libra-Trajectory`` header, else the bearer API key; 401 ``missing_trajectory`` without one."""
    got = body.get("trajectory")
    if got is None:
        got = headers.get("x-libra-trajectory")
    if got is None:
        auth = headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            got = auth[7:].strip() or None
    if got is None:
        raise EndpointError(401, "missing_trajectory", "no trajectory id: send it as the API key "
                            "(Authorization: Bearer <id>), an X-Libra-Trajectory header or "
                            "extra_body={'trajectory': <id>}", "trajectory")
    if not isinstance(got, str):
        raise EndpointError(400, "invalid_trajectory", "the trajectory id must be a string", "trajectory")
    return got
