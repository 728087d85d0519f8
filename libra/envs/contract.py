"""The environment contract: what ``libra run`` asks of an environment (a plug-in), with its types.

An environment is any object with the methods below: a module (like :mod:`libra.envs.arith`, whose
functions are the methods), an instance of a class, or a class (the loader instantiates it with no
arguments). A job names it in ``[env]`` (``entry = "my_pkg.my_env:MyEnv"``, a ``libra.envs`` entry point,
or a bundled name: ``arith``, ``single_turn``); :mod:`libra.envs.loader` loads and checks it.

Methods (:class:`Environment`; only ``episode`` and ``from_row`` are required):

- ``validate_options(options) -> dict``: the job's free-form ``[env.options]`` table in, the options the
  environment will use out (defaults filled in). It must be JSON-able and idempotent: the driver validates
  the table before anything starts and every episode runner validates the result again. Raise
  :class:`OptionsError` (``OptionsError("max_depth", "must be >= 1")``) so the job's error names the key
  (``JOB.toml [env.options] max_depth: must be >= 1``); any other ``ValueError``/``TypeError`` is reported
  for the table as a whole. :func:`options_with_defaults` does the usual part (unknown keys, types).
  Without ``validate_options`` an environment takes no options (a non-empty table is an error).
- ``make_problems(n, seed, **options) -> Sequence[problem]``: ``n`` problems, the same for the same seed
  (a job with a ``[data]`` table takes its problems from the dataset instead and need not have it).
- ``to_row(problem) -> Row`` / ``from_row(row) -> problem``: a problem as a JSON-able mapping (what a job
  ships to the broker and every episode runner gets back) and back. ``from_row`` also receives the records
  of a user's dataset: the data loader copies the configured prompt field to ``row["prompt"]``
  (:data:`PROMPT_KEY`, :func:`dataset_row`) and keeps every other field (answers, test cases) as it is.
  Without ``to_row``, problems must be mappings already. Raise ``ValueError`` naming what is wrong.
- a problem has a ``prompt`` (attribute, or key of a mapping): the chat messages
  (``[{"role": "user", "content": "..."}]``) or one string (a single user message); the runner renders it
  with the model's chat template and starts the trajectory with it.
- ``async episode(session, problem, cfg) -> reward | (reward, info)``: one agent loop over a
  :class:`Session`; ``reward`` is a finite float, ``info`` a small JSON-able mapping (shown in
  ``samples.jsonl``; ``correct`` feeds the accuracy metric). ``cfg`` is the job's ``[env]`` table
  (:class:`EnvSettings`: ``max_turns``, ``reward`` and the validated ``options``). A synchronous
  ``episode`` is not allowed: every turn is awaited.
- ``required_tools(cfg) -> list[str]``: the tools an episode under ``cfg`` calls; the driver refuses to
  start the job when no connected actor offers one of them.

Rewards. An environment returns its reward from ``episode``. A single-turn task may instead name a reward
function, ``[env] reward = "pkg.mod:fn"`` (:data:`RewardFn`): ``fn(completion, row) -> float | (float,
info)``, called with the model's one completion (text) and the problem's row (the dataset record, every
field included); it may be ``async``. The bundled :mod:`libra.envs.single_turn` environment runs such jobs
(it is the default environment of a job that names a ``reward``). A reward that needs a model (a judge, a
reward model) does not load one in the episode runner: it calls the ``reward_model`` service through the
session (``await session.call_tool("reward_model", {...})``), so the action scheduler (ARL-Tangram) places
it on a GPU actor like any other tool call.

Failures. An exception inside ``episode`` fails that episode, not the job: the runner replies with the
error and its traceback (:func:`format_failure`, bounded), the driver writes it to ``RUN/failures.jsonl``
and the job trains the group without it. A plug-in that cannot be imported, lacks a required method or
rejects its options fails the job before anything is submitted, with a ``ConfigError`` naming the file
and key.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "PROMPT_KEY",
    "REQUIRED",
    "Environment",
    "EnvSettings",
    "EpisodeOutcome",
    "OptionsError",
    "RewardFn",
    "Row",
    "Session",
    "dataset_row",
    "format_failure",
    "options_with_defaults",
    "prompt_messages",
    "split_failure",
]

Row: TypeAlias = dict[str, Any]
"""A problem as a JSON-able mapping (strings, numbers, booleans, None, lists and mappings of them)."""
EpisodeOutcome: TypeAlias = float | tuple[float, dict[str, Any]]
"""What ``episode`` returns: the reward, or the reward and a small JSON-able info mapping."""
RewardFn: TypeAlias = Callable[[str, Row], float | tuple[float, dict[str, Any]] | Awaitable[Any]]
"""``fn(completion, row)``: a single-turn task's reward function (``[env] reward``); may be async."""

PROMPT_KEY = "prompt"
"""The row key the prompt sits under when a dataset record reaches ``from_row``."""
REQUIRED = ("episode", "from_row")
"""The methods every environment must have."""
FAILURE_LIMIT = 8192
"""The most characters of a failure's text (error line + traceback) an episode runner sends back."""


class OptionsError(ValueError):
    """An ``[env.options]`` value an environment rejects; ``key`` names it in the job's error."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@runtime_checkable
class Session(Protocol):
    """What an episode drives (:class:`libra.rl.episode.EpisodeSession` in a job): every call goes
    through the broker, so the rollout router (C-MLFQ) and the action scheduler see every turn."""

    tool_calls: int
    versions: list[int]

    async def generate(self) -> str:
        """One model turn from the whole trajectory so far; returns its text."""
        ...

    async def call_tool(self, tool: str, args: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        """Run ``tool`` on an action actor; a failure comes back as ``{"error": "..."}``, not raised."""
        ...

    def add_user(self, content: str) -> None:
        """Append an environment message (tool output, feedback) as a user turn (no loss on it)."""
        ...


@runtime_checkable
class EnvSettings(Protocol):
    """The ``cfg`` an episode gets: the job's ``[env]`` table (``libra.rl.config.EnvConfig``)."""

    max_turns: int
    reward: str
    options: Mapping[str, Any]


class Environment(Protocol):
    """The full contract (see the module docstring); ``episode`` and ``from_row`` are required, the rest
    optional. Modules and instances both satisfy it."""

    def validate_options(self, options: Mapping[str, Any]) -> dict[str, Any]: ...

    def make_problems(self, n: int, seed: int, **options: Any) -> Sequence[Any]: ...

    def to_row(self, problem: Any) -> Row: ...

    def from_row(self, row: Row) -> Any: ...

    def episode(self, session: Session, problem: Any, cfg: EnvSettings) -> Awaitable[EpisodeOutcome]: ...

    def required_tools(self, cfg: EnvSettings) -> list[str]: ...


def options_with_defaults(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``options``; raises :class:`OptionsError` for an unknown key or a value
    whose type differs from its default's (an int is accepted where the default is a float)."""
    out = dict(defaults)
    for key, value in options.items():
        if key not in defaults:
            raise OptionsError(key, f"unknown option (known: {', '.join(sorted(defaults)) or 'none'})")
        want = type(defaults[key])
        if want is float and type(value) is int:
            value = float(value)
        elif isinstance(value, bool) != (want is bool) or not isinstance(value, want):
            raise OptionsError(key, f"must be {want.__name__}, got {value!r}")
        out[key] = value
    return out


def prompt_messages(prompt: Any) -> list[dict[str, str]]:
    """A problem's prompt as chat messages: a string is one user message; raises ValueError otherwise."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"a prompt must be a string or a non-empty list of {{'role', 'content'}} messages, "
                     f"got {str(prompt)[:120]!r}")


def dataset_row(record: Mapping[str, Any], prompt_field: str) -> Row:
    """A dataset record as the row ``from_row`` gets: every field kept, the prompt copied to
    :data:`PROMPT_KEY`. Raises KeyError naming the field when the record lacks it."""
    if prompt_field not in record:
        raise KeyError(f"no field {prompt_field!r} in the record (fields: {', '.join(map(str, record)) or 'none'})")
    return {**record, PROMPT_KEY: record[prompt_field]}


def format_failure(exc: BaseException, limit: int = FAILURE_LIMIT) -> str:
    """``"Type: message"``, a newline and the traceback, at most ``limit`` characters (the end of the
    traceback, where the raising frame is, is kept)."""
    head = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    head = head[:500]
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    room = max(0, limit - len(head) - 1)
    if len(tb) > room:
        tb = "...\n" + tb[len(tb) - room + 4:]
    return f"{head}\n{tb}"


def split_failure(text: str) -> tuple[str, str]:
    """``(error, traceback)`` of a :func:`format_failure` text (an error without a traceback: ``""``)."""
    head, _, tb = str(text).partition("\n")
    return head, tb
