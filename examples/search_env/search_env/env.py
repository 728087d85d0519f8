"""A Search-R1-style environment: answer questions about made-up towns by searching a local corpus.

The model sees a question it cannot answer from memory (the towns and their facts are generated,
:mod:`search_env.corpus`). It may search by writing ``<search>query</search>``; the environment runs the
``search`` tool (BM25, :mod:`search_env.tools`) through the broker, so an action actor runs it where the
action scheduler places it, and appends the hits as ``<information>...</information>``. The model
answers with ``<answer>...</answer>``. Reward: 1.0 when the normalized answer (lower case, no
punctuation, no articles, single spaces) equals the normalized gold answer exactly, plus
``format_reward`` for any ``<answer>`` tag (0 by default); the episode's ``info`` says whether it was
correct, how many searches ran (``searches``, of which ``forced_searches`` the environment issued) and on
which actors (``search_actors``).

``retrieve`` chooses who searches:

- ``"model"`` (default, Search-R1): only the model's own ``<search>`` calls run.
- ``"fallback"``: a turn that neither searches nor answers is followed by a search for the question
  itself, issued by the environment (Search-R1's "retrieve first" baseline, one turn late). An untrained
  model, such as the random ``tiny`` test model, almost never writes a well-formed tag, so this is how the
  tool path is exercised deterministically: every episode with ``max_turns >= 2`` runs at least one search
  (unless its first turn already answers).

Options (``[env.options]`` of a job file; validated by :meth:`SearchEnv.validate_options`, errors name
the key): ``retrieve``, ``topk`` (passages per search, 1 to 10, default 3), ``format_reward`` (default
0.0), ``tool_timeout_s`` (one search's limit, default 10.0), ``split`` (the shipped question set
:meth:`SearchEnv.make_problems` draws from without ``[data]``: ``train`` or ``eval``). The number of
turns is ``[env] max_turns``, as for every environment.

Rows (``[data] train = ".../train.jsonl"``, or :meth:`SearchEnv.make_problems`): ``{"question", "answer"}``
and optionally ``"id"``.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Any

from libra.envs.contract import OptionsError, options_with_defaults

from .corpus import DATA_DIR

__all__ = ["DEFAULTS", "Problem", "SearchEnv", "normalize", "parse_answer", "parse_search"]

SYSTEM_PROMPT = (
    "Answer the question about a town. You do not know these towns: look them up. To search a local "
    "encyclopedia, write <search>your query</search>; the results come back between <information> and "
    "</information>. You may search more than once. When you know the answer, write it as "
    "<answer>the answer</answer> with nothing else inside the tags.")
RETRIEVE = ("model", "fallback")

_SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL | re.IGNORECASE)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


DEFAULTS: dict[str, Any] = {"retrieve": "model", "topk": 3, "format_reward": 0.0, "tool_timeout_s": 10.0,
                            "split": "train"}
"""The environment's options (``[env.options]``) and their defaults."""


@dataclass(frozen=True, slots=True)
class Problem:
    pid: str
    question: str
    answer: str

    @property
    def prompt(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"Question: {self.question}"}]


def normalize(text: str) -> str:
    """Lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def parse_search(text: str) -> str | None:
    """The query of the first ``<search>...</search>`` in ``text`` (stripped; None when absent or empty)."""
    m = _SEARCH_RE.search(text)
    return (m.group(1).strip() or None) if m else None


def parse_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` in ``text`` (None when absent)."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def _load(split: str) -> list[dict[str, Any]]:
    with open(DATA_DIR / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class SearchEnv:
    """The environment (see the module docstring). Stateless: one instance serves every episode."""

    name = "search"

    def validate_options(self, options: Any) -> dict[str, Any]:
        """``[env.options]`` with defaults filled in; raises OptionsError naming the bad key."""
        o = options_with_defaults(dict(options or {}), DEFAULTS)
        checks = (("retrieve", o["retrieve"] in RETRIEVE, f"must be one of {', '.join(RETRIEVE)}"),
                  ("topk", 1 <= o["topk"] <= 10, "must be within [1, 10]"),
                  ("format_reward", 0 <= o["format_reward"] <= 1, "must be within [0, 1]"),
                  ("tool_timeout_s", o["tool_timeout_s"] > 0, "must be > 0"),
                  ("split", o["split"] in ("train", "eval"), "must be 'train' or 'eval'"))
        for key, ok, why in checks:
            if not ok:
                raise OptionsError(key, f"{why}, got {o[key]!r}")
        return o

    def required_tools(self, cfg: Any) -> list[str]:
        """Every episode may search (the job is refused where no actor offers ``search``)."""
        return ["search"] if int(getattr(cfg, "max_turns", 1)) > 1 else []

    def make_problems(self, n: int, seed: int = 0, **options: Any) -> list[Problem]:
        """``n`` problems from the shipped question set ``split``, shuffled by ``seed`` (cycled when ``n``
        exceeds it); a job with ``[data]`` reads its own rows instead."""
        rows = _load(self.validate_options(options)["split"])
        random.Random(seed).shuffle(rows)
        return [self.from_row(rows[i % len(rows)]) for i in range(n)]

    def to_row(self, problem: Problem) -> dict[str, Any]:
        return {"id": problem.pid, "question": problem.question, "answer": problem.answer}

    def from_row(self, row: Any) -> Problem:
        """A dataset row as a problem: its ``question`` (else its ``prompt``, the field ``[data] prompt_field``
        names, as a string) and ``answer``; raises ValueError naming what is missing."""
        q = row.get("question", row.get("prompt")) if isinstance(row, dict) else None
        if not isinstance(q, str) or not q.strip() or "answer" not in row:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"a search_env row needs a string 'question' (or 'prompt') and an 'answer', got {got}")
        return Problem(str(row.get("id", "")), q, str(row["answer"]))

    def score(self, text: str, problem: Problem, format_reward: float = 0.0) -> tuple[float, dict[str, Any]]:
        got = parse_answer(text)
        correct = got is not None and normalize(got) == normalize(problem.answer)
        reward = (1.0 if correct else 0.0) + (format_reward if got is not None else 0.0)
        return reward, {"correct": correct, "formatted": got is not None, "answer": got}

    async def episode(self, session: Any, problem: Problem, cfg: Any) -> tuple[float, dict[str, Any]]:
        """Turns until an answer or ``max_turns``; searches between turns (see the module docstring)."""
        o = self._opts(cfg)
        max_turns, timeout = int(cfg.max_turns), float(o["tool_timeout_s"])
        text, actors, forced, ok = "", [], 0, 0
        for turn in range(max_turns):
            text = await session.generate()
            if parse_answer(text) is not None or turn == max_turns - 1:
                break
            query = parse_search(text)
            if query is None:
                if o["retrieve"] != "fallback":
                    break
                query, forced = problem.question, forced + 1
            out = await session.call_tool("search", {"query": query, "k": o["topk"]}, timeout=timeout + 30.0)
            if out.get("error"):
                info = f"Search failed: {str(out['error'])[:200]}"
            else:
                ok += 1
                actors.append(out.get("actor", ""))
                info = str(out.get("text", ""))
            session.add_user(f"<information>\n{info}\n</information>")
        reward, info_ = self.score(text, problem, o["format_reward"])
        info_.update({"tool_calls": session.tool_calls, "tool_ok": ok, "searches": session.tool_calls,
                      "forced_searches": forced, "search_actors": actors, "turns": len(session.versions)})
        return reward, info_

    def _opts(self, cfg: Any) -> dict[str, Any]:
        """The validated options of an episode's ``cfg`` (the job's ``[env]``: its ``options`` table)."""
        return self.validate_options(getattr(cfg, "options", None) or {})
