"""The arithmetic environment (generator, parsing, reward, episode loop) and job-file validation."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from libra.config import ConfigError
from libra.envs import arith, get_env
from libra.rl.config import EnvConfig, job_from_mapping, load_job
from libra.rl.episode import chat_continuation

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_generator_is_seeded_and_answers_are_right() -> None:
    a = arith.make_problems(50, seed=3, max_operand=9, ops=["+", "-", "*"])
    assert a == arith.make_problems(50, seed=3, max_operand=9, ops=["+", "-", "*"])
    assert a != arith.make_problems(50, seed=4, max_operand=9, ops=["+", "-", "*"])
    for p in a:
        nums = [int(w) for w in re.findall(r"\d+", p.question)]
        x, y = nums
        if "more" in p.question:
            assert p.answer == x + y
        elif "gives away" in p.question:
            assert p.answer == x - y >= 0
        else:
            assert p.answer == x * y
        assert p.prompt[0]["role"] == "system" and p.prompt[1]["content"].startswith(p.question)
    with pytest.raises(ValueError, match="ops"):
        arith.make_problems(1, ops=["/"])


@pytest.mark.parametrize("text,code", [
    ("Let me compute.\n```python\nprint(3 + 4)\n```\n", "print(3 + 4)"),
    ("```py\nx = 2\nprint(x * 5)\n```", "x = 2\nprint(x * 5)"),
    ("```python\nprint(1)", "print(1)"),  # cut off by max_new_tokens: runs to the end
    ("no code here. Answer: 5", None),
    ("```python\n```", None),
])
def test_parse_tool_call(text: str, code: str | None) -> None:
    assert arith.parse_tool_call(text) == code


@pytest.mark.parametrize("text,value", [
    ("Answer: 42", 42), ("so the answer: -3", -3), ("Answer: 1,200 apples", 1200),
    ("Answer: 3\nwait, Answer: 4", 4), ("the result is 7", None), ("Answer: seven", None),
    ("So the answer is 12.", 12), ("answer = 5", 5), ("The Answer is: 8", 8),
])
def test_parse_answer(text: str, value: int | None) -> None:
    assert arith.parse_answer(text) == value


def test_score_correct_formatted_and_shaping() -> None:
    p = arith.Problem("t", "q", 12)
    assert arith.score("Answer: 12", p)[0] == pytest.approx(1.1)
    r, info = arith.score("Answer: 13", p)
    assert r == pytest.approx(0.1) and info == {"correct": False, "formatted": True, "answer": 13}
    assert arith.score("twelve", p)[0] == 0.0
    assert arith.score("1 2 3 4 5 6 7", p, digit_reward=0.01)[0] == pytest.approx(0.05)  # capped at 5 digits


class ScriptedSession:
    """Stands in for EpisodeSession: replays model turns, records tool calls and environment text."""

    def __init__(self, turns: list[str], tool_out: dict) -> None:
        self.turns, self.tool_out = list(turns), tool_out
        self.versions: list[int] = []
        self.tool_calls = 0
        self.calls: list[tuple[str, dict]] = []
        self.user: list[str] = []

    async def generate(self) -> str:
        self.versions.append(0)
        return self.turns.pop(0)

    async def call_tool(self, tool: str, args: dict, timeout: float = 30.0) -> dict:
        self.tool_calls += 1
        self.calls.append((tool, args))
        return self.tool_out

    def add_user(self, text: str) -> None:
        self.user.append(text)


def test_episode_runs_the_tool_then_scores_the_final_turn() -> None:
    p = arith.Problem("t", "Mia has 3 apples and gets 4 more.", 7)
    s = ScriptedSession(["```python\nprint(3+4)\n```", "Answer: 7"], {"stdout": "7\n", "stderr": "", "exit_code": 0})
    reward, info = asyncio.run(arith.episode(s, p, EnvConfig(max_turns=3)))
    assert reward == pytest.approx(1.1) and info["correct"] and info["turns"] == 2 and info["tool_calls"] == 1
    assert s.calls == [("python", {"code": "print(3+4)", "timeout_s": 5.0})]
    assert s.user == ["Output:\n7\n"]


def test_episode_stops_at_max_turns_and_on_an_answer() -> None:
    p = arith.Problem("t", "q", 7)
    s = ScriptedSession(["```python\nprint(1)\n```"], {"stdout": "1"})
    reward, info = asyncio.run(arith.episode(s, p, EnvConfig(max_turns=1)))
    assert reward == 0.0 and s.calls == [] and info["turns"] == 1
    s = ScriptedSession(["Answer: 7 ```python\nprint(1)\n```"], {})
    assert asyncio.run(arith.episode(s, p, EnvConfig(max_turns=3)))[0] == pytest.approx(1.1) and s.calls == []


def test_tool_errors_are_shown_to_the_model() -> None:
    assert arith.format_tool_output({"error": "ToolTimeout: slow"}) == "Tool error: ToolTimeout: slow"
    assert "Errors:\nNameError" in arith.format_tool_output({"stdout": "", "stderr": "NameError"})
    assert chat_continuation("user", "hi") == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_get_env_names_the_known_ones() -> None:
    assert get_env("arith") is arith
    with pytest.raises(ValueError, match="known: 'arith'"):
        get_env("chess")


def test_example_job_files_load() -> None:
    tiny = load_job(EXAMPLES / "arith_tiny.toml")
    assert tiny.model.name == "tiny" and tiny.actors.trainer == 2 and tiny.job.steps == 3
    smol = load_job(EXAMPLES / "arith_smollm2.toml")
    assert smol.model.name == "smollm2"
    again = job_from_mapping(__import__("tomllib").loads(tiny.to_toml()))
    assert again == tiny


@pytest.mark.parametrize("data,msg", [
    ({"job": {"stepz": 3}}, "unknown key"),
    ({"grpo": {"lr": "0.1"}}, "lr"),
    ({"grpo": {"group_size": 1}}, "group_size must be >= 2"),
    ({"jobs": {}}, "unknown table"),
    ({"env": {"ops": ["/"]}}, "ops"),
    ({"job": {"max_policy_lag": -1}}, "max_policy_lag"),
    ({"job": {"dispatch": "random"}}, "dispatch must be one of lpt, round_robin, contiguous"),
    ({"actors": {"weights_transport": "nccl"}}, "weights_transport must be 'dataplane' or 'torch'"),
])
def test_bad_job_files_say_what_is_wrong(data: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        job_from_mapping(data, "x.toml")


def test_episode_session_sends_its_prompt_id_with_every_turn() -> None:
    import asyncio
    from types import SimpleNamespace

    from libra.rl.episode import EpisodeSession, SamplingParams

    sent: list[dict] = []

    class _Client:  # records the generate requests; answers one token
        async def request(self, kind, name, args, trajectory, timeout):
            sent.append({"kind": kind, "trajectory": trajectory, **args})
            return SimpleNamespace(output={"token_ids": [7], "logprobs": [-0.5], "weights_version": 0,
                                           "gen_tokens": 1, "finish_reason": "length"})

    class _Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    async def two_turns(prompt_id):
        s = EpisodeSession(_Client(), _Tok(), "t1", [1, 2, 3], SamplingParams(), lambda: None, [0], prompt_id=prompt_id)
        await s.generate()
        await s.generate()

    asyncio.run(two_turns("p-abc"))
    assert [a["prompt_id"] for a in sent] == ["p-abc", "p-abc"] and sent[0]["prompt_tokens"] == 3
    sent.clear()
    asyncio.run(two_turns(None))
    assert all("prompt_id" not in a for a in sent)
