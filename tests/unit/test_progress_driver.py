"""The driver feeds its bars from the poll stream: a fake broker answers ``JobPoll`` with episodes collected,
training, then a step record; the terminal shows the step bar and the per-episode bar of each step, and the
job's log lines above them (no cluster, no model)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from libra.logging import configure, get_logger


def _step(step: int) -> dict:
    rewards = [1.0, 0.0, 1.0, 1.0] if step == 1 else [1.0, 1.0, 1.0, 0.0]
    return {"step": step, "rewards": rewards, "reward_mean": sum(rewards) / 4, "accuracy": sum(rewards) / 4,
            "tokens_per_s": 50.0, "policy_lag_max": 0, "step_time_s": 1.0, "weights_version": step,
            "weight_sync_version": step - 1, "episode_correct": [int(r) for r in rewards]}


# what the fake broker answers, poll after poll: (episodes_collected, training, records)
STREAM = [(0, False, []), (2, False, []), (4, False, []), (0, True, []), (1, False, [_step(1)]), (4, False, []),
          (0, True, []), (0, False, [_step(2)])]


class FakeClient:
    def __init__(self, url: str) -> None:
        self.polls = 0

    async def connect(self, timeout: float) -> "FakeClient":
        return self

    async def status(self) -> Any:
        return type("St", (), {"actors": [{"capabilities": {"action": ["python"]}}]})()

    async def job_submit(self, *a: Any) -> None:
        pass

    async def job_poll(self, name: str, cursor: int, cancel: bool = False, timeout: float = 5.0) -> dict:
        collected, training, recs = STREAM[min(self.polls, len(STREAM) - 1)]
        self.polls += 1
        if self.polls == 3:
            get_logger("test").warning("sandbox_evicted", slot="cpu1")  # a warning while the bars are live
        last = self.polls >= len(STREAM)
        return {"job": name, "state": "done" if last else "running", "steps": 2, "records": recs,
                "next_cursor": cursor + len(recs), "episodes_collected": collected, "training": training,
                "version": 2 if last else 0}

    async def close(self) -> None:
        pass


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, progress: bool) -> dict:
    """The driver's ``run`` against :class:`FakeClient` (2 steps of 2 prompts x 2 episodes)."""
    import libra.client.aio
    from libra.rl import driver
    from libra.rl.config import job_from_mapping

    configure("warning", json=True)
    monkeypatch.setattr(libra.client.aio, "AsyncClient", FakeClient)
    real_sleep = asyncio.sleep
    monkeypatch.setattr(driver.asyncio, "sleep", lambda s: real_sleep(0))

    async def no_wait(self: Any, version: int, timeout: float = 30.0) -> dict:
        return {}

    monkeypatch.setattr(driver._Driver, "_await_rollout_sync", no_wait)
    cfg = job_from_mapping({"job": {"run_dir": str(tmp_path), "steps": 2, "prompts_per_step": 2},
                            "grpo": {"group_size": 2}})
    return asyncio.run(driver._Driver(cfg, "tcp://fake", tmp_path, tmp_path, progress=progress).run())


def test_the_driver_draws_step_and_episode_bars_from_the_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    summary = _run(tmp_path, monkeypatch, progress=True)
    assert summary["steps"] == 2
    err = capsys.readouterr().err
    for seen in ("episodes of step 1", "2/4", "4/4", "training", "episodes of step 2", "1/2", "2/2",
                 "reward=0.75", "sandbox_evicted"):
        assert seen in err, (seen, err)
    # the warning came out on a line of its own, not glued into a bar's line
    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", err)  # tqdm's cursor moves
    (line,) = [x for x in plain.replace("\r", "\n").splitlines() if "sandbox_evicted" in x]
    assert "%|" not in line and line.lstrip().startswith("{") and line.rstrip().endswith("}")


def test_the_driver_without_progress_draws_no_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, monkeypatch, progress=False)
    err = capsys.readouterr().err
    assert "sandbox_evicted" in err and "%|" not in err and "episodes of step" not in err


class PagedClient(FakeClient):
    """A broker whose job is done with both step records waiting, answering one record a poll (``more``)."""

    async def job_poll(self, name: str, cursor: int, cancel: bool = False, timeout: float = 5.0,
                       limit: int = 500) -> dict:
        recs = [_step(1), _step(2)]
        page = recs[cursor:cursor + 1]
        return {"job": name, "state": "done", "steps": 2, "records": page, "next_cursor": cursor + len(page),
                "more": cursor + len(page) < len(recs), "episodes_collected": 0, "training": False, "version": 2}


def test_a_done_job_whose_records_come_in_pages_is_read_to_its_last_page(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setattr(__name__ + ".FakeClient.job_poll", PagedClient.job_poll)
    _run(tmp_path, monkeypatch, progress=False)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"step"' in x]
    assert steps == [1, 2]
