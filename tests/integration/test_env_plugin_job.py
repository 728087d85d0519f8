"""A user's environment plug-in through ``libra run`` on loopback with the tiny model: a class named by
``[env] entry`` (not bundled, imported by the driver and by the episode runner process) that scores with a
reward function (``[env] reward``, through the single-turn environment) and raises in 1 of 10 episodes.
The job finishes, the failures are counted, and ``RUN/failures.jsonl`` holds each one with its traceback.
A plug-in that cannot be imported fails ``run_job`` before any process starts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from libra.config import ConfigError
from libra.rl.config import EnvConfig, JobConfig, load_job
from libra.rl.driver import run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PLUGIN = '''
from libra.envs import single_turn


def reward(completion, row):
    """Shaping for the random tiny model (digits written), so groups have reward variance."""
    digits = sum(ch.isdigit() for ch in completion)
    return min(5, digits) * 0.1, {"correct": row["answer"] in completion, "digits": digits}


def explode(n):
    return n / 0


class Flaky:
    """Single-turn problems of its own; every 10th episode this runner starts raises."""

    def __init__(self):
        self.started = 0

    def make_problems(self, n, seed, **options):
        return [{"prompt": f"What is {seed + i} + 1?", "answer": str(seed + i + 1)} for i in range(n)]

    def from_row(self, row):
        return single_turn.from_row(row)

    async def episode(self, session, problem, cfg):
        self.started += 1
        if self.started % 10 == 3:
            explode(self.started)
        return await single_turn.episode(session, problem, cfg)
'''

JOB = '''
[job]
name = "flaky"
steps = 2
prompts_per_step = 2
max_policy_lag = 1
run_dir = "{run}"

[model]
name = "tiny"

[env]
entry = "flakyplug:Flaky"
reward = "flakyplug:reward"
max_turns = 1
max_new_tokens = 8

[grpo]
group_size = 4
lr = 1e-4

[actors]
rollout = 1
trainer = 1
action = 1
'''


@pytest.fixture(scope="module")
def flaky_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("plugin")
    (root / "flakyplug.py").write_text(PLUGIN)
    run = root / "run"
    (root / "job.toml").write_text(textwrap.dedent(JOB).format(run=run))
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))  # this process (the driver) ...
    mp.setenv("PYTHONPATH", str(root))  # ... and the episode runner it starts import the plug-in
    try:
        cfg = load_job(root / "job.toml")
        return run_job(cfg, progress=False), run
    finally:
        mp.undo()


def test_a_plugin_that_raises_in_one_of_ten_episodes_still_finishes_its_job(flaky_run: tuple[dict, Path]) -> None:
    summary, run = flaky_run
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2] and summary["final_version"] == 2
    assert summary["episodes_failed"] >= 1
    # the reward function scored the episodes that ran (it reports the digits it counted)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["question"] is None and len(s["texts"]) == 1 for s in samples)


def test_every_failed_episode_is_in_failures_jsonl_with_its_traceback(flaky_run: tuple[dict, Path]) -> None:
    summary, run = flaky_run
    lines = [json.loads(x) for x in (run / "failures.jsonl").read_text().splitlines()]
    assert len(lines) == summary["episodes_failed"]
    assert [x["seq"] for x in lines] == list(range(len(lines)))  # each once, in order
    for x in lines:
        assert x["job"] == "flaky" and isinstance(x["group"], int) and 0 <= x["index"] < 4
        assert x["error"] == "ZeroDivisionError: division by zero"
        assert x["traceback"].startswith("Traceback (most recent call last):")
        assert "flakyplug.py" in x["traceback"] and "in explode" in x["traceback"]


def test_a_plugin_that_does_not_import_fails_before_any_process_starts(tmp_path: Path) -> None:
    cfg = JobConfig(env=EnvConfig(entry="no_such_plugin_pkg.env:Env")).with_run_dir(str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"job \[env\] entry: cannot import module 'no_such_plugin_pkg.env'"):
        run_job(cfg, progress=False)
    assert not (tmp_path / "run").exists()
