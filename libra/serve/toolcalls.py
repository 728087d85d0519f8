"""Tool-call parsers: the model's text of one turn -> the OpenAI ``content`` and ``tool_calls``.

A parser is any object with ``parse(text) -> ParsedTurn`` and a ``markers`` tuple (the special tokens it
needs to see in the text; the endpoint keeps them when it decodes a turn and drops the other special
tokens). :func:`get_tool_parser` takes a registered name (``hermes``, the Qwen2.5/Qwen3/Hermes style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``qwen`` is the same; ``none`` never finds
a call), an import path ``"pkg.mod:obj"`` (a class is instantiated with no arguments), or a parser object.

Contracts: a block whose JSON does not parse, or has no string ``name``, stays in ``content`` (the agent sees
what the model wrote; the recorded token ids are unchanged either way); ``arguments`` is always a JSON
string, as OpenAI sends it; ``content`` is ``None`` when only tool calls remain.
"""

from __future__ import annotations

import importlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["HermesToolParser", "NoToolParser", "ParsedTurn", "ToolParser", "get_tool_parser", "TOOL_PARSERS"]


@dataclass
class ParsedTurn:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape: id, type, function


class ToolParser(Protocol):
    markers: tuple[str, ...]

    def parse(self, text: str) -> ParsedTurn: ...


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape, with a fresh id."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": args}}


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (an unclosed last block runs to the end of the text)."""

    markers = ("<tool_call>", "</tool_call>")
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept).strip() if calls else text
        return ParsedTurn(content or None, calls)

    @staticmethod
    def _call(body: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return tool_call(obj["name"], args if args is not None else {})


class NoToolParser:
    """Never finds a tool call: the whole text is the content."""

    markers: tuple[str, ...] = ()

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(text or None, [])


TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "qwen": HermesToolParser, "none": NoToolParser}


def get_tool_parser(spec: Any = "hermes") -> Any:
    """A parser from a registered name, an import path ``"pkg.mod:obj"`` or a parser object; ValueError
    naming what is wrong otherwise."""
    if spec is None:
        spec = "hermes"
    if not isinstance(spec, str):
        if not callable(getattr(spec, "parse", None)):
            raise ValueError(f"tool parser {spec!r} has no parse(text) method")
        return spec
    if spec in TOOL_PARSERS:
        return TOOL_PARSERS[spec]()
    if ":" not in spec:
        raise ValueError(f"unknown tool parser {spec!r} (known: {', '.join(TOOL_PARSERS)}, or 'pkg.mod:obj')")
    mod, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tool parser {spec!r} cannot be loaded: {exc}") from None
    return get_tool_parser(obj() if isinstance(obj, type) else obj)
