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
    with pytest.raises(ValueError, match="unknown environment 'chess'.*known: arith, .*single_turn"):
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
    ({"env": {"options": {"ops": ["/"]}}}, r"x.toml \[env.options\] ops: must be a non-empty subset"),
    ({"env": {"ops": ["*"]}}, r"x.toml \[env\]: unknown key\(s\) ops: .* go in the \[env.options\] table"),
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


# ------------------------------------------------------------------ the tool task (tool_demo style)
TOOL_TASK = {"ops": ["*"], "min_operand": 100, "max_operand": 999, "second_operand": [10, 99], "prompt_style": "tool_demo"}


def test_tool_task_multiplies_a_three_digit_by_a_two_digit_number() -> None:
    ps = arith.make_problems(200, seed=1, **TOOL_TASK)
    assert ps == arith.make_problems(200, seed=1, **TOOL_TASK)
    for p in ps:
        x, y = (int(w) for w in re.findall(r"\d+", p.question))
        assert 100 <= x <= 999 and 10 <= y <= 99 and p.answer == x * y and p.style == "tool_demo"
    # the default options draw exactly what they drew before the new options existed
    old = arith.make_problems(20, seed=3, max_operand=9, ops=["+", "-"])
    assert old == arith.make_problems(20, seed=3, max_operand=9, ops=["+", "-"], min_operand=1, second_operand=[],
                                      prompt_style="plain")
    assert all(p.style == "plain" and "style" not in arith.to_row(p) for p in old)
    for bad in ({"min_operand": 0}, {"min_operand": 30, "max_operand": 20}, {"second_operand": [5]},
                {"second_operand": [9, 3]}, {"prompt_style": "fancy"}):
        with pytest.raises(ValueError):
            arith.make_problems(1, **bad)


def test_tool_demo_prompt_demonstrates_a_tool_call_as_the_episode_shows_it() -> None:
    p = arith.make_problems(1, seed=0, **TOOL_TASK)[0]
    roles = [m["role"] for m in p.prompt]
    demos = (len(roles) - 2) // 4
    assert demos >= 1 and roles == ["system"] + ["user", "assistant", "user", "assistant"] * demos + ["user"]
    for k in range(demos):
        demo_call, demo_out, demo_answer = (p.prompt[1 + 4 * k + j]["content"] for j in (1, 2, 3))
        code = arith.parse_tool_call(demo_call)
        assert code is not None and code.startswith("print(")
        value = eval(code[len("print("):-1])  # the demonstrated expression is plain arithmetic
        assert demo_out == arith.format_tool_output({"stdout": f"{value}\n", "exit_code": 0})
        assert arith.parse_answer(demo_answer) == value
    assert p.prompt[-1]["content"] == p.question and "python" in p.prompt[0]["content"].lower()
    # the row carries the style to the episode runner
    assert arith.from_row(arith.to_row(p)) == p and arith.to_row(p)["style"] == "tool_demo"
    with pytest.raises(ValueError, match="style"):
        arith.from_row({**arith.to_row(p), "style": "fancy"})


def test_episode_counts_successful_tool_calls() -> None:
    p = arith.Problem("t", "q", 9716, "tool_demo")
    cfg = EnvConfig(max_turns=2, options={"format_reward": 0.0, "prompt_style": "tool_demo"})
    ok = ScriptedSession(["```python\nprint(347 * 28)\n```", "Answer: 9716"], {"stdout": "9716\n", "exit_code": 0})
    reward, info = asyncio.run(arith.episode(ok, p, cfg))
    assert reward == 1.0 and info["tool_calls"] == 1 and info["tool_ok"] == 1
    failed = ScriptedSession(["```python\nprint(x)\n```", "Answer: 1"], {"stdout": "", "stderr": "NameError", "exit_code": 1})
    reward, info = asyncio.run(arith.episode(failed, p, cfg))
    assert reward == 0.0 and info["tool_calls"] == 1 and info["tool_ok"] == 0  # a wrong, formatted answer: 0
    errored = ScriptedSession(["```python\nwhile 1: pass\n```", "Answer: 9716"], {"error": "ToolTimeout: slow"})
    assert asyncio.run(arith.episode(errored, p, cfg))[1]["tool_ok"] == 0
    no_tool = ScriptedSession(["Answer: 9716"], {})
    assert asyncio.run(arith.episode(no_tool, p, cfg))[1] == {"correct": True, "formatted": True, "answer": 9716,
                                                                "turns": 1, "tool_calls": 0, "tool_ok": 0}
    assert arith.tool_succeeded({"stdout": "1", "exit_code": 0}) and not arith.tool_succeeded({"stdout": "1"})


def test_bundled_smollm2_job_makes_the_tool_the_way_to_the_answer() -> None:
    smol = load_job(EXAMPLES / "arith_smollm2.toml")
    e, o = smol.env, smol.env.options
    assert o["prompt_style"] == "tool_demo" and o["ops"] == ["*"] and o["format_reward"] == 0.0 and e.max_turns >= 2
    assert o["min_operand"] >= 100 and o["second_operand"][0] >= 10
    rows = [arith.to_row(p) for p in arith.make_problems(4, smol.job.seed, **o)]
    assert all(r["answer"] >= 1000 and r["style"] == "tool_demo" for r in rows)


@pytest.mark.parametrize("env,msg", [
    ({"min_operand": 0}, "min_operand"), ({"second_operand": [1, 2, 3]}, "second_operand"),
    ({"prompt_style": "fancy"}, "prompt_style"),
])
def test_bad_tool_task_options_say_what_is_wrong(env: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[env.options\] {msg}: "):
        job_from_mapping({"env": {"options": env}})


def test_tool_demos_sets_how_many_demonstrations_the_prompt_has() -> None:
    two, one, none = (arith.make_problems(1, seed=0, **TOOL_TASK, tool_demos=k)[0] for k in (2, 1, 0))
    assert len(two.prompt) == 10 and len(one.prompt) == 6 and len(none.prompt) == 2
    assert two.prompt == arith.make_problems(1, seed=0, **TOOL_TASK)[0].prompt  # 2 is the default
    assert one.prompt[1:5] == two.prompt[1:5] and none.prompt[-1]["content"] == none.question
    assert "demos" not in arith.to_row(two) and arith.from_row(arith.to_row(one)) == one
    with pytest.raises(ValueError, match="tool_demos"):
        arith.make_problems(1, **TOOL_TASK, tool_demos=3)
    with pytest.raises(ValueError, match="demos"):
        arith.from_row({**arith.to_row(one), "demos": 7})
    with pytest.raises(ConfigError, match=r"\[env.options\] tool_demos: must be within \[0, 2\]"):
        job_from_mapping({"env": {"options": {"tool_demos": -1}}})
