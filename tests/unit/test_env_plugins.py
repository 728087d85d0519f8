"""Environments as plug-ins (libra.envs.loader / contract): an import path, a ``libra.envs`` entry point or
a bundled name; modules, classes and instances; ``[env.options]`` validated by the environment; the
single-turn reward environment; errors that name the file and the key; failed episodes kept with their
traceback by the broker's job for the driver's ``RUN/failures.jsonl``."""

from __future__ import annotations

import asyncio
import importlib.metadata
import re
import sys
import textwrap
from pathlib import Path

import pytest

from libra.broker.job_host import JobHost, JobSpec
from libra.config import ConfigError
from libra.envs import arith, loader, single_turn
from libra.envs.contract import EnvSettings, Session, dataset_row, format_failure, split_failure
from libra.rl.config import EnvConfig, load_job

PLUGIN = '''
from libra.envs.contract import OptionsError, options_with_defaults

def _check(options):
    o = options_with_defaults(options, {"depth": 2, "greeting": "hi"})
    if o["depth"] < 1:
        raise OptionsError("depth", "must be >= 1")
    return o

class Env:
    made = 0
    def __init__(self):
        Env.made += 1
    def validate_options(self, options):
        return _check(options)
    def make_problems(self, n, seed, **options):
        return [{"prompt": f"{options['greeting']} {seed}-{i}", "k": i} for i in range(n)]
    def from_row(self, row):
        return row
    async def episode(self, session, problem, cfg):
        return 1.0

env = Env()

# a module-style environment: the module's functions are the methods
validate_options = _check
def from_row(row):
    return row
async def episode(session, problem, cfg):
    return 0.5, {"correct": True}

class NoFromRow:
    async def episode(self, session, problem, cfg):
        return 0.0

class SyncEpisode:
    def from_row(self, row):
        return row
    def episode(self, session, problem, cfg):
        return 0.0

class Broken:
    def __init__(self):
        raise RuntimeError("no index on disk")

def exact(completion, row):
    return float(completion.strip() == row["answer"]), {"correct": completion.strip() == row["answer"]}

async def judged(completion, row):
    return 0.25
'''


@pytest.fixture()
def plug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A plug-in module on sys.path (a fresh name per test: imports are cached)."""
    name = f"plug_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    (tmp_path / f"{name}_bad.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def job_file(tmp_path: Path, env: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(textwrap.dedent(env))
    return p


# ---------------------------------------------------------------------------------------------- loading
def test_an_import_path_may_name_a_class_an_instance_or_a_module(plug: str) -> None:
    mod = sys.modules.get(plug) or __import__(plug)
    made = mod.Env.made
    cls = loader.load_env(f"{plug}:Env")
    assert isinstance(cls, mod.Env) and mod.Env.made == made + 1  # a class is instantiated once, no arguments
    assert loader.load_env(f"{plug}:env") is mod.env  # an instance as it is
    assert loader.load_env(plug) is mod  # a module whose functions are the methods
    assert loader.load_env("arith") is arith and loader.load_env("libra.envs.arith") is arith
    assert loader.load_env("openai_agent").__name__ == "libra.envs.openai_agent"
    for env in (cls, mod, arith, single_turn):
        assert isinstance(env.from_row, object) and asyncio.iscoroutinefunction(env.episode)


def test_an_entry_point_of_the_libra_envs_group_is_found_by_name(plug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = importlib.metadata.EntryPoint(name="fake_env", value=f"{plug}:Env", group="libra.envs")
    seen: list[str] = []

    def entry_points(*, group: str) -> list:
        seen.append(group)
        return [ep]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    env = loader.load_env("fake_env")
    assert type(env).__name__ == "Env" and seen == ["libra.envs"]
    with pytest.raises(ConfigError, match=r"unknown environment 'nope'.*known: arith, fake_env, openai_agent, single_turn"):
        loader.load_env("nope")
    broken = importlib.metadata.EntryPoint(name="broken", value=f"{plug}_bad:Env", group="libra.envs")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda *, group: [broken])
    with pytest.raises(ConfigError, match=r"entry point 'broken' .* cannot be loaded: ModuleNotFoundError: "
                                          r"No module named 'not_a_real_dependency_xyz'"):
        loader.load_env("broken")


@pytest.mark.parametrize("entry,msg", [
    ("nowhere_pkg_q.env:Env", r"\[env\] entry: cannot import module 'nowhere_pkg_q.env': ModuleNotFoundError"),
    ("{plug}_bad:Env", r"\[env\] entry: cannot import module '{plug}_bad': ModuleNotFoundError: No module named "
                       r"'not_a_real_dependency_xyz'"),
    ("{plug}:Missing", r"\[env\] entry: module '{plug}' has no attribute 'Missing'"),
    ("{plug}:NoFromRow", r"\[env\] entry: environment '{plug}:NoFromRow' has no from_row\(\)"),
    ("{plug}:SyncEpisode", r"\[env\] entry: environment '{plug}:SyncEpisode' has a synchronous episode\(\)"),
    ("{plug}:Broken", r"\[env\] entry: '{plug}:Broken' is a class and Broken\(\) raised RuntimeError: no index"),
    ("not_an_entry_point_zz", r"\[env\] entry: unknown environment 'not_an_entry_point_zz'"),
])
def test_a_broken_plug_in_is_a_config_error_naming_the_file_and_key(plug: str, tmp_path: Path, entry: str,
                                                                    msg: str) -> None:
    p = job_file(tmp_path, f'[env]\nentry = "{entry.format(plug=plug)}"\nmax_turns = 1\n')
    with pytest.raises(ConfigError, match=re.escape(str(p)) + " " + msg.format(plug=plug)):
        load_job(p)


def test_name_keeps_working_and_names_the_key(tmp_path: Path) -> None:
    assert load_job(job_file(tmp_path, '[env]\nname = "arith"\n')).env.options == arith.OPTIONS
    p = job_file(tmp_path, '[env]\nname = "chess"\n')
    with pytest.raises(ConfigError, match=re.escape(f"{p} [env] name: unknown environment 'chess'")):
        load_job(p)


# ---------------------------------------------------------------------------------------------- options
def test_options_are_validated_by_the_environment_and_errors_name_the_key(plug: str, tmp_path: Path) -> None:
    cfg = load_job(job_file(tmp_path, f'[env]\nentry = "{plug}:Env"\n[env.options]\ndepth = 5\n'))
    assert cfg.env.options == {"depth": 5, "greeting": "hi"}  # defaults filled in, kept in the resolved job
    for body, msg in (("depth = 0", r"\[env.options\] depth: must be >= 1"),
                      ("depht = 3", r"\[env.options\] depht: unknown option \(known: depth, greeting\)"),
                      ('depth = "3"', r"\[env.options\] depth: must be int, got '3'")):
        p = job_file(tmp_path, f'[env]\nentry = "{plug}:Env"\n[env.options]\n{body}\n')
        with pytest.raises(ConfigError, match=re.escape(str(p)) + " " + msg):
            load_job(p)
    p = job_file(tmp_path, '[env]\nreward = "x:y"\n[env.options]\nfoo = 1\n')
    with pytest.raises(ConfigError, match=r"\[env.options\] foo: this environment takes no options"):
        load_job(p)


def test_arith_options_live_in_env_options_and_old_keys_say_where_they_go(tmp_path: Path) -> None:
    cfg = load_job(job_file(tmp_path, '[env]\nmax_turns = 1\n[env.options]\nops = ["*"]\ntool_timeout_s = 2\n'))
    assert cfg.env.name == "arith" and cfg.env.options["ops"] == ["*"] and cfg.env.options["tool_timeout_s"] == 2.0
    p = job_file(tmp_path, '[env]\nmax_operand = 9\n')
    with pytest.raises(ConfigError, match=r"\[env\]: unknown key\(s\) max_operand: .*\[env.options\] max_operand"):
        load_job(p)


def test_problem_rows_come_from_make_problems_with_the_options(plug: str) -> None:
    env, options = loader.load_env_config(EnvConfig(entry=f"{plug}:Env", options={"greeting": "yo"}))
    assert loader.problem_rows(env, 2, 7, options) == [{"prompt": "yo 7-0", "k": 0}, {"prompt": "yo 7-1", "k": 1}]
    with pytest.raises(ConfigError, match="no make_problems"):
        loader.problem_rows(single_turn, 2, 0, {})


# ---------------------------------------------------------------------------------------------- rewards
class FakeSession:
    def __init__(self, text: str) -> None:
        self.text, self.versions, self.tool_calls, self.user = text, [], 0, []

    async def generate(self) -> str:
        self.versions.append(0)
        return self.text

    async def call_tool(self, tool: str, args: dict, timeout: float = 30.0) -> dict:
        raise AssertionError("a single-turn episode calls no tool")

    def add_user(self, content: str) -> None:
        self.user.append(content)


def test_a_reward_function_makes_a_single_turn_job(plug: str, tmp_path: Path) -> None:
    cfg = load_job(job_file(tmp_path, f'[env]\nreward = "{plug}:exact"\nmax_turns = 1\n'))
    assert cfg.env.name == "single_turn" and isinstance(cfg.env, EnvSettings)
    env, _ = loader.load_env_config(cfg.env)
    assert env is single_turn and single_turn.required_tools(cfg.env) == []
    row = dataset_row({"question": "What is 6 x 7?", "answer": "42"}, "question")
    problem = env.from_row(row)
    assert problem.prompt == [{"role": "user", "content": "What is 6 x 7?"}] and env.to_row(problem) == row
    s = FakeSession(" 42\n")
    assert isinstance(s, Session)
    assert asyncio.run(env.episode(s, problem, cfg.env)) == (1.0, {"correct": True, "turns": 1})
    assert asyncio.run(env.episode(FakeSession("41"), problem, cfg.env))[0] == 0.0
    judged = EnvConfig(reward=f"{plug}:judged", max_turns=1)  # an async reward function
    assert asyncio.run(env.episode(FakeSession("x"), problem, judged)) == (0.25, {"turns": 1})
    with pytest.raises(KeyError, match="no field 'q'"):
        dataset_row({"question": "?"}, "q")
    for bad, msg in ((f'"{plug}:nothing"', "has no attribute 'nothing'"), ('"justaname"', "not an import path")):
        p = job_file(tmp_path, f"[env]\nreward = {bad}\n")
        with pytest.raises(ConfigError, match=re.escape(f"{p} [env] reward: ") + ".*" + msg):
            load_job(p)
    p = job_file(tmp_path, '[env]\nname = "single_turn"\n')
    with pytest.raises(ConfigError, match=r"\[env\] reward: environment 'single_turn' needs a reward function"):
        load_job(p)


def test_an_episode_outcome_must_be_a_finite_reward() -> None:
    assert loader.reward_outcome(1) == (1.0, {}) and loader.reward_outcome((0.5, {"a": 1})) == (0.5, {"a": 1})
    for bad in (float("nan"), "1.0", None, True, (1.0, [1])):
        with pytest.raises(ValueError):
            loader.reward_outcome(bad)


# ---------------------------------------------------------------------------------------------- failures
def test_a_failure_text_is_the_error_line_then_a_bounded_traceback() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise KeyError("answer")
        deep(n - 1)

    try:
        deep(300)
    except KeyError as exc:
        text = format_failure(exc)
    error, tb = split_failure(text)
    assert error == "KeyError: 'answer'" and tb.startswith("Traceback (most recent call last):")
    assert tb.rstrip().endswith("KeyError: 'answer'") and "in deep" in tb
    try:
        raise ValueError("v" * 20_000)
    except ValueError as exc:
        text = format_failure(exc)
    error, tb = split_failure(text)
    assert len(text) <= 8192 and error == "ValueError: " + "v" * 488 and tb.startswith("...\n")


SPEC = {"steps": 2, "prompts_per_step": 1, "group_size": 3, "max_policy_lag": 0, "world_size": 1, "env": "flaky",
        "micro_batch_tokens": 64}


def ok_result(tokens: int, reward: float) -> dict:
    return {"reward": reward, "versions": [0], "gen_tokens": tokens // 2, "tokens": tokens,
            "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"traj/{tokens}", "server_key": None}}


def test_the_job_keeps_a_failed_episodes_traceback_and_goes_on() -> None:
    h = JobHost("j", JobSpec.from_mapping(SPEC), [{"prompt": "a"}, {"prompt": "b"}], 0.0)
    works = h.take_work(0.0)
    assert len(works) == 3
    tb = "ZeroDivisionError: division by zero\nTraceback (most recent call last):\n  File \"env.py\", line 3\n"
    h.on_reply(works[0].tag, False, None, tb, 1.0)
    for i, w in enumerate(works[1:]):
        h.on_reply(w.tag, True, ok_result(10 + i, float(i)), "", 1.0)
    first = h.poll(0)
    assert first["failures"] == [{"seq": 0, "group": 0, "index": 0, "error": tb}] and first["episodes_failed"] == 1
    assert h.poll(0)["failures"] == first["failures"]  # sent until the client has a newer record (deduped by seq)
    train = h.take_work(2.0)
    assert [w.kind for w in train] == ["train"]  # the group of 3 trains with its 2 episodes
    assert len(train[0].args["parts"][0]) == 2


def test_a_job_whose_every_episode_fails_stops_with_the_error() -> None:
    h = JobHost("j", JobSpec.from_mapping(SPEC), [{"prompt": "a"}], 0.0)
    for _ in range(40):  # groups of failed episodes are dropped and re-admitted ...
        for w in h.take_work(0.0):
            if h.active:
                h.on_reply(w.tag, False, None, "ValueError: bad row\nTraceback ...", 1.0)
        if not h.active:
            break
    st = h.poll(0)  # ... until 16 in a row say the environment fails every episode
    assert st["state"] == "failed" and st["episodes_failed"] == 16
    assert st["error"].startswith("16 episodes in a row failed") and st["error"].endswith("ValueError: bad row")

