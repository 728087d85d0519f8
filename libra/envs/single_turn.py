"""The single-turn environment: a dataset's prompt, one completion, a reward function.

A user with only data and a reward function has a job::

    [data]
    train = "data/train.jsonl"    # records with a "question" field (and whatever the reward needs)
    prompt_field = "question"

    [env]
    reward = "my_pkg.rewards:exact_match"   # fn(completion, row) -> float | (float, info); may be async

Each episode renders the row's prompt (:data:`~libra.envs.contract.PROMPT_KEY`: a string or chat messages),
generates once (``session.generate()``), and returns ``fn(completion, row)``, where ``row`` is the whole
dataset record. The reward function is loaded once per process (:func:`reward_fn`). A reward that needs a
model calls the ``reward_model`` service instead, from an environment of its own
(``session.call_tool("reward_model", ...)``), so the action scheduler places it.

``make_problems`` is not provided: the problems come from the job's ``[data]`` table. The environment
takes no ``[env.options]`` (a system prompt belongs in the dataset's prompt, as chat messages).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .contract import PROMPT_KEY, EnvSettings, Row, Session, prompt_messages
from .loader import load_reward, reward_outcome

__all__ = ["SingleTurnProblem", "episode", "from_row", "required_tools", "reward_fn", "to_row"]

NEEDS_REWARD = True
"""The loader refuses a job that runs this environment without ``[env] reward``."""
_REWARDS: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True, slots=True)
class SingleTurnProblem:
    """One dataset row: its ``prompt`` as chat messages, and the whole row (the reward function's input)."""

    prompt: list[dict[str, str]]
    row: Row = field(default_factory=dict)


def from_row(row: Row) -> SingleTurnProblem:
    """The problem of a row; raises ValueError when it has no usable prompt."""
    if not isinstance(row, Mapping) or PROMPT_KEY not in row:
        raise ValueError(f"a single_turn row needs a {PROMPT_KEY!r} (the [data] prompt field), got "
                         f"{sorted(row) if isinstance(row, Mapping) else type(row).__name__}")
    return SingleTurnProblem(prompt_messages(row[PROMPT_KEY]), dict(row))


def to_row(problem: SingleTurnProblem) -> Row:
    return dict(problem.row)


def required_tools(cfg: EnvSettings) -> list[str]:
    return []


def reward_fn(spec: str) -> Callable[..., Any]:
    """The reward function ``spec`` names (loaded once per process)."""
    if spec not in _REWARDS:
        _REWARDS[spec] = load_reward(spec, "single_turn")
    return _REWARDS[spec]


async def episode(session: Session, problem: SingleTurnProblem, cfg: EnvSettings) -> tuple[float, dict[str, Any]]:
    """Generate once and score the completion with ``cfg.reward`` (see the module docstring)."""
    if not cfg.reward:
        raise ValueError("the single_turn environment needs [env] reward = 'package.module:function'")
    fn = reward_fn(cfg.reward)
    text = await session.generate()
    out = fn(text, dict(problem.row))
    if inspect.isawaitable(out):
        out = await out
    reward, info = reward_outcome(out)
    info.setdefault("turns", len(session.versions))
    return reward, info

