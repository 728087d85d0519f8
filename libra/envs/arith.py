"""Arithmetic word problems with an optional sandboxed ``python`` tool: a multi-turn tool-use environment.

Tasks come from a seeded generator of our own (:func:`make_problems`): two-operand word problems
("Mia has 12 marbles and finds 7 more. How many marbles does Mia have now?"), operators from
``ops``, operands in ``[min_operand, max_operand]`` (the second in ``second_operand = [lo, hi]`` when
given), answers never negative. Same seed, same problems.

Prompt styles (``prompt_style``): ``plain`` (a system prompt that says a python block may be run) and
``tool_demo``, where the tool is the way to the answer: the system prompt says to compute with Python,
and the chat starts with ``tool_demos`` (default 2) demonstrated episodes (question → a fenced ``python``
block that prints the product → the tool output as the environment shows it → ``Answer: N``). With operands a small model
cannot multiply in its head (``ops = ["*"]``, 3-digit × 2-digit) and ``format_reward = 0``, the only
reward is for calling the tool with the right expression and copying its output into the answer.

The episode (:func:`episode`) is an async function over an :class:`~libra.rl.episode.EpisodeSession`:

1. the model gets the system + user prompt (:func:`messages`), which says it may run Python by writing
   a fenced ``python`` block and must finish with ``Answer: <integer>``;
2. if a turn contains a python block (:func:`parse_tool_call`) and turns remain, the code runs through
   the broker on a CPU actor's sandbox (``call_tool("python")``), its stdout/stderr is appended as a
   user message, and the model takes another turn;
3. otherwise the last turn is scored (:func:`score`): ``1.0`` for the right integer after ``Answer:``,
   plus ``format_reward`` for any well-formed ``Answer: <integer>`` line (so a wrong but well-formed
   answer earns only the format reward). The info counts the episode's tool calls and the successful
   ones (``tool_ok``: no error and exit code 0).

A **shifting workload** (``max_new_tokens_ramp = [start, end]`` with ``ramp_rows = R`` and optionally
``ramp_from_row = F``): problem ``i`` (in the order the job hands rows out: step ``~ i // prompts_per_step + 1``)
caps every model turn of its episodes at ``start`` up to row ``F``, then linearly more up to ``end`` at row
``R - 1`` (rounded), and ``end`` after it. The job's ``[env]
max_new_tokens`` still caps every turn: give it at least ``end``. A random model generates to the cap, so
rollout is cheap in the first steps and costly in the last (``examples/arith_shift.toml``).

The module is an environment plug-in like any other (:mod:`libra.envs.contract`): its options (the keys
above, and ``format_reward``, ``digit_reward``, ``tool_timeout_s``) sit in the job's ``[env.options]``
table and :func:`validate_options` checks them (:data:`OPTIONS` holds the defaults); ``max_turns`` is the
generic ``[env]`` key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from .contract import OptionsError, options_with_defaults

__all__ = [
    "ANSWER_HINT",
    "OPTIONS",
    "PROMPT_STYLES",
    "TOOL_SYSTEM_PROMPT",
    "SYSTEM_PROMPT",
    "Problem",
    "episode",
    "make_problems",
    "messages",
    "parse_answer",
    "parse_tool_call",
    "ramp_tokens",
    "required_tools",
    "score",
    "tool_succeeded",
    "validate_options",
]

SYSTEM_PROMPT = (
    "Solve the math problem. To compute, you may write Python in a ```python block and you will see "
    "what it prints. Finish with a line 'Answer: <number>'."
)
ANSWER_HINT = "Give a short reply that ends with 'Answer: <number>'."
TOOL_SYSTEM_PROMPT = (
    "You have a Python tool. To calculate, write a ```python block that prints the result; you will see "
    "its output. Then reply with 'Answer: <number>'."
)
PROMPT_STYLES = ("plain", "tool_demo")
# The demonstrated episodes of the ``tool_demo`` style: they show the format (a call, its output, the
# answer), not an answer to a task (a generated problem repeats one only by chance).
_DEMOS = (("Tom has 347 boxes with 28 coins in each box. How many coins does Tom have?", "347 * 28", 9716),
          ("Ava has 612 boxes with 45 shells in each box. How many shells does Ava have?", "612 * 45", 27540))

_NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Ana", "Ben"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards"]
_TEMPLATES = {
    "+": "{n} has {a} {it} and gets {b} more. How many {it} does {n} have now?",
    "-": "{n} has {a} {it} and gives away {b}. How many {it} does {n} have left?",
    "*": "{n} has {a} boxes with {b} {it} in each box. How many {it} does {n} have?",
}


@dataclass(frozen=True, slots=True)
class Problem:
    pid: str
    question: str
    answer: int
    style: str = "plain"  # the prompt style (PROMPT_STYLES)
    demos: int = 2  # tool_demo: how many demonstrated episodes the prompt starts with
    max_new_tokens: int = 0  # the turn cap of this problem's episodes (max_new_tokens_ramp); 0: the job's

    @property
    def prompt(self) -> list[dict[str, str]]:
        return messages(self.question, self.style, self.demos)


def messages(question: str, style: str = "plain", demos: int = 2) -> list[dict[str, str]]:
    """The chat prompt for one question in prompt style ``style`` (see the module docstring); ``tool_demo``
    starts with the first ``demos`` demonstrated episodes."""
    if style == "tool_demo":
        out = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}]
        for q, expr, value in _DEMOS[:demos]:
            out += [{"role": "user", "content": q},
                    {"role": "assistant", "content": f"```python\nprint({expr})\n```"},
                    {"role": "user", "content": format_tool_output({"stdout": f"{value}\n", "exit_code": 0})},
                    {"role": "assistant", "content": f"Answer: {value}"}]
        return out + [{"role": "user", "content": question}]
    if style != "plain":
        raise ValueError(f"prompt style must be one of {', '.join(PROMPT_STYLES)}, got {style!r}")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"{question}\n{ANSWER_HINT}"}]


def make_problems(n: int, seed: int = 0, *, max_operand: int = 20, ops: list[str] | tuple[str, ...] = ("+", "-"),
                  min_operand: int = 1, second_operand: list[int] | tuple[int, ...] = (),
                  prompt_style: str = "plain", tool_demos: int = 2,
                  max_new_tokens_ramp: list[int] | tuple[int, ...] = (), ramp_rows: int = 0,
                  ramp_from_row: int = 0, **_: Any) -> list[Problem]:
    """``n`` problems from a private ``random.Random(seed)``; deterministic, no global state touched.
    Operands are drawn from ``[min_operand, max_operand]``, the second from ``second_operand`` (``[lo, hi]``)
    when given; with ``max_new_tokens_ramp`` each problem carries its turn cap (:func:`ramp_tokens`)."""
    if not 1 <= min_operand <= max_operand:
        raise ValueError(f"need 1 <= min_operand <= max_operand, got {min_operand} and {max_operand}")
    if second_operand and (len(second_operand) != 2 or not 1 <= second_operand[0] <= second_operand[1]):
        raise ValueError(f"second_operand must be [lo, hi] with 1 <= lo <= hi, got {list(second_operand)}")
    bad = [o for o in ops if o not in _TEMPLATES]
    if bad or not ops:
        raise ValueError(f"ops must be a non-empty subset of {sorted(_TEMPLATES)}, got {list(ops)}")
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {', '.join(PROMPT_STYLES)}, got {prompt_style!r}")
    if not 0 <= tool_demos <= len(_DEMOS):
        raise ValueError(f"tool_demos must be within [0, {len(_DEMOS)}], got {tool_demos}")
    ramp_error = _ramp_problem(max_new_tokens_ramp, ramp_rows, ramp_from_row)
    if ramp_error:
        raise ValueError(f"{ramp_error[0]} {ramp_error[1]}")
    lo2, hi2 = (second_operand[0], second_operand[1]) if second_operand else (min_operand, max_operand)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        op = rng.choice(list(ops))
        a, b = rng.randint(min_operand, max_operand), rng.randint(lo2, hi2)
        if op == "-" and b > a:
            a, b = b, a
        ans = a + b if op == "+" else a - b if op == "-" else a * b
        q = _TEMPLATES[op].format(n=rng.choice(_NAMES), a=a, b=b, it=rng.choice(_ITEMS))
        cap = ramp_tokens(i, max_new_tokens_ramp, ramp_rows, ramp_from_row) if max_new_tokens_ramp else 0
        out.append(Problem(f"arith-{seed}-{i}", q, ans, prompt_style, tool_demos, cap))
    return out


def ramp_tokens(index: int, ramp: list[int] | tuple[int, ...], rows: int, from_row: int = 0) -> int:
    """The turn cap of row ``index`` under ``max_new_tokens_ramp = ramp`` (``[start, end]``) over ``rows``
    rows: ``start`` up to row ``from_row``, linear from there to ``end`` at row ``rows - 1``, ``end`` after."""
    start, end = int(ramp[0]), int(ramp[1])
    if rows - 1 <= from_row:
        return end
    at = min(max(index, from_row), rows - 1) - from_row
    return round(start + (end - start) * at / (rows - 1 - from_row))


def _ramp_problem(ramp: Any, rows: Any, from_row: Any = 0) -> tuple[str, str] | None:
    """``(key, what is wrong)`` with ``max_new_tokens_ramp`` / ``ramp_rows`` / ``ramp_from_row``, or None when
    they are valid."""
    if not isinstance(ramp, (list, tuple)) or (ramp and (len(ramp) != 2 or not all(type(x) is int and x >= 1
                                                                                     for x in ramp))):
        return "max_new_tokens_ramp", f"must be [start, end] with integers >= 1 (or empty), got {ramp!r}"
    if type(rows) is not int or rows < 0:
        return "ramp_rows", f"must be an integer >= 0, got {rows!r}"
    if ramp and rows < 2:
        return "ramp_rows", (f"must be >= 2 with max_new_tokens_ramp = {list(ramp)} (the rows over which the turn "
                             f"cap grows: e.g. [job] steps x prompts_per_step), got {rows}")
    if rows and not ramp:
        return "ramp_rows", f"is {rows} but max_new_tokens_ramp is not set: give both or neither"
    if type(from_row) is not int or from_row < 0 or (from_row and not ramp) or (ramp and from_row >= rows - 1):
        return "ramp_from_row", (f"must be an integer in [0, ramp_rows - 1) with max_new_tokens_ramp set (0 "
                                 f"without), got {from_row!r} with ramp_rows {rows!r}")
    return None


OPTIONS: dict[str, Any] = {
    "ops": ["+", "-"], "min_operand": 1, "max_operand": 20,
    "second_operand": [],  # [lo, hi] of the second operand; []: as the first
    "prompt_style": "plain",  # PROMPT_STYLES
    "tool_demos": 2,  # tool_demo: how many demonstrated episodes (0 to 2)
    "format_reward": 0.1, "digit_reward": 0.0,  # see score()
    "tool_timeout_s": 5.0,  # one python call's limit
    "max_new_tokens_ramp": [],  # [start, end]: each turn's cap grows over the rows (a shifting workload); []: off
    "ramp_rows": 0,  # the ramp reaches its end at row ramp_rows - 1 (>= 2 with a ramp; e.g. steps x prompts_per_step)
    "ramp_from_row": 0,  # the rows before it keep the ramp's start (a flat first phase)
}
"""The options (``[env.options]``) and their defaults."""


def validate_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``[env.options]`` with the defaults of :data:`OPTIONS` filled in; :class:`OptionsError` names a bad key."""
    o = options_with_defaults(options, OPTIONS)
    if not o["ops"] or not set(o["ops"]) <= set(_TEMPLATES):
        raise OptionsError("ops", f"must be a non-empty subset of {sorted(_TEMPLATES)}, got {o['ops']}")
    if not 1 <= o["min_operand"] <= o["max_operand"]:
        raise OptionsError("min_operand", f"needs 1 <= min_operand <= max_operand, got {o['min_operand']} "
                                          f"and {o['max_operand']}")
    so = o["second_operand"]
    if so and (len(so) != 2 or not all(type(x) is int for x in so) or not 1 <= so[0] <= so[1]):
        raise OptionsError("second_operand", f"must be [lo, hi] with 1 <= lo <= hi (or empty), got {so}")
    if o["prompt_style"] not in PROMPT_STYLES:
        raise OptionsError("prompt_style", f"must be one of {', '.join(PROMPT_STYLES)}, got {o['prompt_style']!r}")
    if not 0 <= o["tool_demos"] <= len(_DEMOS):
        raise OptionsError("tool_demos", f"must be within [0, {len(_DEMOS)}], got {o['tool_demos']}")
    if not o["tool_timeout_s"] > 0:
        raise OptionsError("tool_timeout_s", f"must be > 0, got {o['tool_timeout_s']}")
    ramp_error = _ramp_problem(o["max_new_tokens_ramp"], o["ramp_rows"], o["ramp_from_row"])
    if ramp_error:
        raise OptionsError(*ramp_error)
    return o


def required_tools(cfg: Any) -> list[str]:
    """The tools an episode under ``cfg`` (the job's ``[env]``) calls: ``python`` whenever a turn can be
    followed by another (``max_turns > 1``). The job driver refuses to start when no actor offers one."""
    return ["python"] if int(getattr(cfg, "max_turns", 1)) > 1 else []


def to_row(problem: Problem) -> dict[str, Any]:
    """A problem as a dataset row (what a job ships to the broker and episode runners get back)."""
    row: dict[str, Any] = {"pid": problem.pid, "question": problem.question, "answer": problem.answer}
    if problem.style != "plain":
        row["style"] = problem.style
    if problem.demos != 2:
        row["demos"] = problem.demos
    if problem.max_new_tokens:
        row["max_new_tokens"] = problem.max_new_tokens
    return row


def from_row(row: Any) -> Problem:
    """The problem of a dataset row; raises ValueError naming what is wrong."""
    try:
        p = Problem(str(row["pid"]), str(row["question"]), int(row["answer"]), str(row.get("style", "plain")),
                    int(row.get("demos", 2)), int(row.get("max_new_tokens", 0)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"arith row needs pid, question and an int answer: {exc!r}") from None
    if p.style not in PROMPT_STYLES or not 0 <= p.demos <= len(_DEMOS) or p.max_new_tokens < 0:
        raise ValueError(f"arith row style must be one of {', '.join(PROMPT_STYLES)} with 0 to {len(_DEMOS)} "
                         f"demos and max_new_tokens >= 0, got {p.style!r} with {p.demos} and {p.max_new_tokens}")
    return p


_CODE_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
_ANSWER_RE = re.compile(r"Answer(?:\s*:|\s+is\s*:?|\s*=)\s*\$?\s*(-?\d[\d,]*)", re.IGNORECASE)


def parse_tool_call(text: str) -> str | None:
    """The code of the first fenced python block in ``text`` (an unclosed block runs to the end), or None."""
    mt = _CODE_RE.search(text)
    if mt is None:
        return None
    code = mt.group(1).strip()
    return code or None


def parse_answer(text: str) -> int | None:
    """The integer after the last ``Answer:`` (or ``answer is`` / ``answer =``) in ``text``, or None."""
    found = _ANSWER_RE.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


def score(text: str, problem: Problem, format_reward: float = 0.1,
          digit_reward: float = 0.0) -> tuple[float, dict[str, Any]]:
    """``(reward, info)`` for the final turn ``text``: 1 if correct, plus ``format_reward`` if well-formed,
    plus ``digit_reward`` per digit character in ``text`` (at most 5 counted): a shaping term that only
    the untrained tiny test model needs, so that its groups have reward variance (off by default)."""
    got = parse_answer(text)
    correct = got is not None and got == problem.answer
    reward = (1.0 if correct else 0.0) + (format_reward if got is not None else 0.0)
    if digit_reward:
        reward += digit_reward * min(5, sum(ch.isdigit() for ch in text))
    return reward, {"correct": correct, "formatted": got is not None, "answer": got}


def tool_succeeded(out: dict[str, Any]) -> bool:
    """Whether a tool call's result is a success: no error and exit code 0."""
    return not out.get("error") and out.get("exit_code") == 0


def format_tool_output(out: dict[str, Any], limit: int = 300) -> str:
    """What the model sees after its code ran."""
    if out.get("error"):
        return f"Tool error: {str(out['error'])[:limit]}"
    stdout = str(out.get("stdout", ""))[:limit]
    stderr = str(out.get("stderr", ""))[-limit:]
    text = f"Output:\n{stdout}" if stdout.strip() else "Output: (nothing printed)"
    if stderr.strip():
        text += f"\nErrors:\n{stderr}"
    return text


async def episode(session: Any, problem: Problem, cfg: Any) -> tuple[float, dict[str, Any]]:
    """Run one episode (see the module docstring); ``cfg`` is the job's ``[env]`` table (its ``options``
    as :func:`validate_options` returns them)."""
    o = validate_options(getattr(cfg, "options", {}) or {})
    text, ok = "", 0
    for turn in range(cfg.max_turns):
        # a ramped problem caps its turns itself (the session keeps the job's cap as the ceiling)
        text = await (session.generate(problem.max_new_tokens) if problem.max_new_tokens else session.generate())
        code = parse_tool_call(text)
        if code is None or turn == cfg.max_turns - 1 or parse_answer(text) is not None:
            break
        out = await session.call_tool("python", {"code": code, "timeout_s": o["tool_timeout_s"]},
                                      timeout=o["tool_timeout_s"] + 30.0)
        ok += tool_succeeded(out)
        session.add_user(format_tool_output(out))
    reward, info = score(text, problem, o["format_reward"], o["digit_reward"])
    info["turns"] = len(session.versions)
    info["tool_calls"] = session.tool_calls
    info["tool_ok"] = ok
    return reward, info
