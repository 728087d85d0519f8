"""The search example's own parts, without processes: the shipped corpus and questions are what the
generator makes, BM25 finds every answer, the ``search`` tool and the environment keep their contracts
(episodes driven by a scripted session). The end-to-end runs are in ``test_user_job.py``.

The example lives outside the package (``examples/search_env``); these tests import it from there, so they
need only its BM25 library (``pip install -e examples/search_env`` installs both)."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("bm25s", reason="the search example needs bm25s: pip install -e examples/search_env")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "search_env"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from search_env import corpus  # noqa: E402
from search_env.env import SearchEnv, normalize, parse_answer, parse_search  # noqa: E402
from search_env.retriever import Retriever, default_retriever, load_corpus  # noqa: E402
from search_env.tools import LIBRA_TOOLS, search  # noqa: E402

from libra.actors.tools import ToolError, WorkContext  # noqa: E402
from libra.envs.contract import OptionsError  # noqa: E402


def _rows(split: str) -> list[dict[str, Any]]:
    import json

    return [json.loads(x) for x in (corpus.DATA_DIR / f"{split}.jsonl").read_text().splitlines()]


def test_shipped_files_are_what_the_generator_makes(tmp_path: Path) -> None:
    made = corpus.write(tmp_path)
    for p in made:
        assert p.read_bytes() == (corpus.DATA_DIR / p.name).read_bytes(), p.name
    assert len(load_corpus()) == 3 * corpus.ENTITIES
    train, ev = _rows("train"), _rows("eval")
    assert (len(train), len(ev)) == (corpus.TRAIN, corpus.EVAL)
    assert not {r["id"] for r in train} & {r["id"] for r in ev}  # no question is in both sets


def test_bm25_finds_every_answer_in_the_top_three() -> None:
    r = default_retriever()
    rows = _rows("train") + _rows("eval")
    missed = [row["id"] for row in rows if not any(row["answer"] in h["text"] for h in r.search(row["question"], 3))]
    assert missed == []
    hits = r.search(rows[0]["question"], 2)
    assert len(hits) == 2 and hits[0]["score"] >= hits[1]["score"] > 0
    assert r.search("the of and", 3) == []  # only stopwords: nothing matches
    with pytest.raises(ValueError, match="empty corpus"):
        Retriever([])


def test_search_tool_declares_its_resources_and_checks_its_args() -> None:
    assert LIBRA_TOOLS == [search]
    t = search.libra_tool  # type: ignore[attr-defined]
    assert t.name == "search" and t.cores == 1 and t.memory_mb == 256 and not t.sandboxed
    ctx = WorkContext("w1", "traj-1", 10.0, threading.Event(), actor_id="host/cpu2", cores=1,
                      route={"core_ids": [3]})
    out = search({"query": _rows("eval")[0]["question"], "k": 2}, ctx)
    assert len(out["hits"]) == 2 and out["actor"] == "host/cpu2" and out["core_ids"] == [3]
    assert out["text"].startswith("Doc 1 (")
    for bad in (None, {"k": 2}, {"query": "  "}, {"query": "x", "k": 0}, {"query": "x", "k": True}):
        with pytest.raises(ToolError) as ei:
            search(bad, ctx)
        assert ei.value.code == "bad_request"


def test_options_are_validated_and_errors_name_the_key() -> None:
    env = SearchEnv()
    assert env.validate_options({}) == {"retrieve": "model", "topk": 3, "format_reward": 0.0,
                                     "tool_timeout_s": 10.0, "split": "train"}
    assert env.validate_options(env.validate_options({"topk": 5})) == env.validate_options({"topk": 5})
    for opts, key in (({"retrieve": "always"}, "retrieve"), ({"topk": 11}, "topk"), ({"topk": "3"}, "topk"),
                      ({"split": "test"}, "split"), ({"depth": 1}, "depth"),
                      ({"tool_timeout_s": 0}, "tool_timeout_s")):
        with pytest.raises(OptionsError) as ei:
            env.validate_options(opts)
        assert ei.value.key == key
    with pytest.raises(ValueError, match="'question'"):
        env.from_row({"answer": "x"})
    p = env.from_row({"prompt": "Who founded X?", "answer": 1642})  # [data] prompt_field copied to "prompt"
    assert (p.question, p.answer) == ("Who founded X?", "1642")
    assert env.required_tools(SimpleNamespace(max_turns=2, options={})) == ["search"]
    probs = env.make_problems(5, 3)
    assert [env.to_row(x) for x in probs] == [env.to_row(x) for x in env.make_problems(5, 3)]


def test_answer_parsing_and_normalization() -> None:
    assert parse_search("I will <search> town of Brimas </search> now") == "town of Brimas"
    assert parse_search("<search></search>") is None and parse_answer("no tags") is None
    assert parse_answer("<answer>x</answer> then <answer> The Blue salt. </answer>") == "The Blue salt."
    assert normalize("  The  Blue-salt. ") == "bluesalt" and normalize("an Iron nail") == "iron nail"


class ScriptedSession:
    """A session whose model turns are scripted and whose ``search`` calls run the real tool in-process."""

    def __init__(self, turns: list[str]) -> None:
        self.turns, self.tool_calls, self.versions, self.users, self.queries = list(turns), 0, [], [], []

    async def generate(self) -> str:
        self.versions.append(0)
        return self.turns.pop(0)

    async def call_tool(self, tool: str, args: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        assert tool == "search"
        self.tool_calls += 1
        self.queries.append(args["query"])
        return search(args, WorkContext("w", "t", timeout, threading.Event(), actor_id="host/cpu9"))

    def add_user(self, content: str) -> None:
        self.users.append(content)


def _episode(turns: list[str], retrieve: str, max_turns: int = 3) -> tuple[float, dict[str, Any], ScriptedSession]:
    env = SearchEnv()
    row = _rows("eval")[1]
    s = ScriptedSession(turns)
    cfg = SimpleNamespace(max_turns=max_turns, options=env.validate_options({"retrieve": retrieve}))
    reward, info = asyncio.run(env.episode(s, env.from_row(row), cfg))
    return reward, info, s


def test_episode_searches_then_answers_and_is_rewarded_by_exact_match() -> None:
    row = _rows("eval")[1]
    reward, info, s = _episode([f"<search>{row['question']}</search>", f"<answer>{row['answer'].upper()}</answer>"],
                               "model")
    assert reward == 1.0 and info["correct"] and info["searches"] == 1 and info["forced_searches"] == 0
    assert info["search_actors"] == ["host/cpu9"] and s.queries == [row["question"]]
    assert s.users[0].startswith("<information>\n") and row["answer"] in s.users[0]
    reward, info, _ = _episode(["<answer>nobody</answer>"], "model")
    assert reward == 0.0 and info["formatted"] and info["searches"] == 0


def test_fallback_retrieval_searches_the_question_when_the_model_does_not() -> None:
    row = _rows("eval")[1]
    reward, info, s = _episode(["gibberish", "more gibberish"], "fallback", max_turns=2)
    assert info["forced_searches"] == info["searches"] == 1 and s.queries == [row["question"]]
    assert reward == 0.0
    _, info, s = _episode(["gibberish", "more"], "model", max_turns=2)  # Search-R1 proper: no tag, no search
    assert info["searches"] == 0 and s.queries == []


def test_libra_loads_the_tool_module_as_actors_do() -> None:
    from libra.actors.tools import load_tools

    loaded = load_tools(["search_env.tools"], entry_points=False)
    assert list(loaded) == ["search"] and loaded["search"].source == "module search_env.tools"
    assert loaded["search"].tool.declaration().cores == 1
