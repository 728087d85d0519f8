"""Agent code written against the ``openai`` client, run by ``libra run``: the environment adapter.

A job names the user's agent function in its options::

    [env]
    entry = "libra.envs.openai_agent"
    max_new_tokens = 128

    [env.options]
    agent = "my_pkg.agent:solve"      # fn(base_url, api_key, row) -> reward | (reward, info); may be async
    tool_parser = "hermes"            # how tool calls are read from the model's text (libra.serve.toolcalls)
    tools = []                        # broker tools the agent calls itself (the job refuses to start without them)
    timeout_s = 600.0                 # the most one agent run may take

Each episode registers its :class:`~libra.rl.episode.EpisodeSession` on the episode runner's loopback
endpoint (:func:`libra.serve.shared_endpoint`: one per runner process, a random port, started with the first
episode), calls ``fn(base_url, api_key, row)`` with the trajectory id as the API key and the problem's
dataset row (its ``prompt`` as chat messages under ``row["prompt"]``), and unregisters the session when the
function returns. The episode's info counts ``tool_calls`` (the calls the model made, parsed by the endpoint,
plus broker tools called through the session), ``endpoint_turns`` and ``tool_call_turns``. An ``async def`` agent runs on the runner's loop (use ``openai.AsyncOpenAI``); a plain
function runs in a worker thread (``openai.OpenAI`` is fine there). Every request the agent makes is one
``generate`` turn through the broker (C-MLFQ routes it), and the trajectory that trains is what the endpoint
recorded: the sampled ids and their log-probs, the agent's messages through the chat template with loss
mask 0 (:mod:`libra.serve.trajectories`; edited history is refused with a 409, never re-tokenized).

Problems come from the job's ``[data]`` table (rows with a prompt field), or from ``problems =
"pkg.mod:fn"`` in the options (``fn(n, seed) -> rows``). The agent's own first message list replaces the
row's prompt as the trajectory's prompt.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .contract import PROMPT_KEY, OptionsError, Row, options_with_defaults, prompt_messages
from .loader import reward_outcome

__all__ = ["AgentProblem", "episode", "from_row", "load_function", "make_problems", "required_tools", "to_row",
           "validate_options"]

DEFAULTS: dict[str, Any] = {"agent": "", "tool_parser": "hermes", "tools": [], "timeout_s": 600.0, "problems": ""}
_LOADED: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True, slots=True)
class AgentProblem:
    """One row: its prompt as chat messages (what the runner starts the trajectory with) and the row."""

    prompt: list[dict[str, str]]
    row: Row = field(default_factory=dict)


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """The function at ``"pkg.mod:fn"`` (loaded once per process); :class:`OptionsError` naming ``key``."""
    if spec in _LOADED:
        return _LOADED[spec]
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise OptionsError(key, f"{spec!r} is not an import path (write 'package.module:function')")
    try:
        fn = importlib.import_module(mod)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except Exception as exc:  # noqa: BLE001  (the import's own error is the message)
        raise OptionsError(key, f"cannot load {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise OptionsError(key, f"{spec!r} is a {type(fn).__name__}, not a function")
    _LOADED[spec] = fn
    return fn


def validate_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options with defaults filled in; the agent (and ``problems``) must load, the parser must exist."""
    from libra.serve.toolcalls import get_tool_parser

    out = options_with_defaults(options, DEFAULTS)
    for mod in ("starlette", "uvicorn"):
        if importlib.util.find_spec(mod) is None:
            raise OptionsError("agent", f"the endpoint needs {mod}: pip install 'libra[serve]'")
    if not out["agent"]:
        raise OptionsError("agent", "required: the agent function, 'package.module:function'")
    load_function(out["agent"], "agent")
    if out["problems"]:
        load_function(out["problems"], "problems")
    try:
        get_tool_parser(out["tool_parser"])
    except ValueError as exc:
        raise OptionsError("tool_parser", str(exc)) from None
    if not all(isinstance(t, str) and t for t in out["tools"]):
        raise OptionsError("tools", f"must be a list of tool names, got {out['tools']!r}")
    if out["timeout_s"] <= 0:
        raise OptionsError("timeout_s", f"must be > 0, got {out['timeout_s']}")
    return out


def make_problems(n: int, seed: int = 0, **options: Any) -> list[AgentProblem]:
    """``n`` problems from the ``problems`` function of the options (without it the job needs ``[data]``)."""
    spec = options.get("problems") or ""
    if not spec:
        raise ValueError("openai_agent takes its problems from the job's [data] table, or from "
                         "[env.options] problems = 'package.module:function' (fn(n, seed) -> rows)")
    return [from_row(r) for r in list(load_function(spec, "problems")(n, seed))[:n]]


def from_row(row: Row) -> AgentProblem:
    """The problem of a row; a row without a prompt starts from an empty user message."""
    if not isinstance(row, Mapping):
        raise ValueError(f"an openai_agent row must be a mapping, got {type(row).__name__}")
    prompt = prompt_messages(row[PROMPT_KEY]) if row.get(PROMPT_KEY) else [{"role": "user", "content": ""}]
    return AgentProblem(prompt, dict(row))


def to_row(problem: AgentProblem) -> Row:
    return dict(problem.row)


def _options(cfg: Any) -> dict[str, Any]:
    opts = cfg.get("options", {}) if isinstance(cfg, Mapping) else getattr(cfg, "options", {})
    return validate_options(opts or {})


def required_tools(cfg: Any) -> list[str]:
    """The broker tools the agent calls (``tools`` of the options)."""
    return list(_options(cfg)["tools"])


async def episode(session: Any, problem: AgentProblem, cfg: Any) -> tuple[float, dict[str, Any]]:
    """Serve ``session`` on the runner's endpoint while the agent runs (see the module docstring)."""
    from libra.serve import shared_endpoint

    opts = _options(cfg)
    fn = load_function(opts["agent"], "agent")
    ep = await shared_endpoint()
    key = ep.registry.register(session, tool_parser=opts["tool_parser"])
    try:
        row = {**problem.row, PROMPT_KEY: problem.prompt}
        if inspect.iscoroutinefunction(fn):
            call = fn(ep.base_url, key, row)
        else:
            call = asyncio.to_thread(fn, ep.base_url, key, row)
        out = await asyncio.wait_for(call, opts["timeout_s"])
        if inspect.isawaitable(out):
            out = await asyncio.wait_for(out, opts["timeout_s"])
    finally:
        entry = ep.registry.unregister(key)
    reward, info = reward_outcome(out)  # info: a fresh dict
    turns = entry.turns if entry is not None else []
    info.setdefault("turns", len(session.versions))
    info.setdefault("endpoint_turns", len(turns))
    info.setdefault("tool_call_turns", sum(bool(t.tool_calls) for t in turns))
    # the job's "tool calls per episode": the calls the model made (parsed into tool_calls) and the broker
    # tools the agent called through the session
    info.setdefault("tool_calls", sum(len(t.tool_calls) for t in turns) + session.tool_calls)
    return reward, info
