"""The job refuses to start when a tool its environment needs is offered by no connected actor (e.g. the
``python`` tool on a host without bubblewrap), and says how to get it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from libra.envs import arith
from libra.rl.config import EnvConfig
from libra.rl.driver import JobFailed, check_tools, missing_tools


class FakeClient:
    """Answers ``status()`` like the broker does: one dict per actor with its capabilities."""

    def __init__(self, actors: list[dict[str, Any]]) -> None:
        self.actors = actors
        self.calls = 0

    async def status(self, timeout: float = 5.0) -> SimpleNamespace:
        self.calls += 1
        return SimpleNamespace(actors=self.actors, queues={}, stats={})


def actor(action: list[str], **more: list[str]) -> dict[str, Any]:
    return {"actor_id": "a", "capabilities": {"action": action, **more}}


WITHOUT_SANDBOX = [actor(["echo", "sleep", "reward_model"]), actor([], generate=["default"]), {"capabilities": {}}]
WITH_SANDBOX = [actor(["bash", "echo", "pytest", "python", "sleep"])]


def test_arith_declares_the_python_tool_only_when_episodes_can_call_it() -> None:
    assert arith.required_tools(EnvConfig(max_turns=2)) == ["python"]
    assert arith.required_tools(EnvConfig(max_turns=1)) == []


def test_missing_tools_reads_the_actors_action_capabilities() -> None:
    assert missing_tools(["python"], WITHOUT_SANDBOX) == ["python"]
    assert missing_tools(["python"], WITH_SANDBOX) == []
    assert missing_tools(["python"], []) == ["python"]
    # a tool offered for another kind of work does not count
    assert missing_tools(["python"], [actor(["echo"], generate=["python"])]) == ["python"]


def test_job_without_the_tool_fails_naming_it_and_the_install_command() -> None:
    client = FakeClient(WITHOUT_SANDBOX)
    with pytest.raises(JobFailed) as exc:
        asyncio.run(check_tools(client, arith, EnvConfig(max_turns=2), "arith_smollm2", wait_s=0.0))
    msg = str(exc.value)
    assert "'python'" in msg and "arith_smollm2" in msg
    assert "sudo apt-get install bubblewrap" in msg and "allow_unisolated" in msg
    assert "echo, reward_model, sleep" in msg  # what is offered instead


def test_job_with_the_tool_or_needing_none_starts() -> None:
    asyncio.run(check_tools(FakeClient(WITH_SANDBOX), arith, EnvConfig(max_turns=2), "j", wait_s=0.0))
    no_tool = FakeClient(WITHOUT_SANDBOX)
    asyncio.run(check_tools(no_tool, arith, EnvConfig(max_turns=1), "j", wait_s=0.0))
    assert no_tool.calls == 0  # nothing required: nothing asked
    env_without_declaration = SimpleNamespace()
    asyncio.run(check_tools(no_tool, env_without_declaration, EnvConfig(max_turns=2), "j", wait_s=0.0))


def test_check_waits_for_an_action_actor_that_is_still_connecting() -> None:
    client = FakeClient([])

    async def later() -> None:
        await asyncio.sleep(0.3)
        client.actors = WITH_SANDBOX

    async def main() -> None:
        task = asyncio.create_task(later())
        await check_tools(client, arith, EnvConfig(max_turns=2), "j", wait_s=30.0)
        await task

    asyncio.run(main())
    assert client.calls >= 2


def test_bundled_jobs_need_the_python_tool() -> None:
    from pathlib import Path

    from libra.rl.config import load_job

    root = Path(__file__).resolve().parents[2] / "examples"
    for name in ("arith_smollm2.toml", "arith_tiny.toml"):
        cfg = load_job(root / name)
        assert arith.required_tools(cfg.env) == ["python"], name
        assert not dataclasses.asdict(cfg)["actors"]["allow_unisolated"], name


def test_a_job_needing_a_user_tool_nobody_serves_is_refused_saying_how_to_offer_it() -> None:
    env = SimpleNamespace(required_tools=lambda cfg: ["search"])
    with pytest.raises(JobFailed) as exc:
        asyncio.run(check_tools(FakeClient(WITH_SANDBOX), env, EnvConfig(), "search_job", wait_s=0.0))
    msg = str(exc.value)
    assert "needs the tool(s) 'search'" in msg and "search_job" in msg
    assert "[actors] tools = [" in msg and "--tools" in msg and "libra.tools" in msg and "LIBRA_TOOLS" in msg
    asyncio.run(check_tools(FakeClient([actor(["echo", "search"])]), env, EnvConfig(), "j", wait_s=0.0))


def test_the_job_file_names_tool_modules_and_a_bad_one_fails_before_anything_starts(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from libra.config import ConfigError
    from libra.rl import driver
    from libra.rl.config import job_from_mapping

    cfg = job_from_mapping({"actors": {"tools": ["ut_nowhere_tools_mod"]}, "job": {"run_dir": str(tmp_path)}})
    assert cfg.actors.tools == ["ut_nowhere_tools_mod"] and job_from_mapping({}).actors.tools == []
    with pytest.raises(ConfigError, match=r"\[actors\] tools must be module names"):
        job_from_mapping({"actors": {"tools": ["pkg.mod:fn"]}})
    monkeypatch.setattr(driver, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(driver, "host_gpus", lambda: (0, "no GPU"))
    monkeypatch.setattr("libra.local.LocalCluster.start", lambda *a, **k: pytest.fail("a cluster was started"))
    with pytest.raises(JobFailed, match=r"\[actors\] tools: module ut_nowhere_tools_mod: cannot be imported: "
                                        r"ModuleNotFoundError"):
        driver.run_job(cfg)


def test_run_job_offers_the_tool_modules_and_places_their_calls_with_tangram(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from libra.config import ConfigError
    from libra.rl import driver
    from libra.rl.config import job_from_mapping

    (tmp_path / "ut_ok_tools_mod.py").write_text("from libra.actors.tools import Tool\n"
                                                 "LIBRA_TOOLS = [Tool('lookup', lambda a, c: a)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(driver, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(driver, "host_gpus", lambda: (0, "no GPU"))
    started: list[Any] = []

    class Started(Exception):
        pass

    def start(self: Any, *a: Any, **k: Any) -> None:
        started.append(self)
        raise Started

    monkeypatch.setattr("libra.local.LocalCluster.start", start)
    for scheduler, tools, expect in (("auto", ["ut_ok_tools_mod"], "tangram"), ("auto", [], None),
                                     ("fcfs", ["ut_ok_tools_mod"], None), ("fixed_dop", [], "fixed_dop")):
        run = tmp_path / f"run-{scheduler}-{len(tools)}"
        cfg = job_from_mapping({"actors": {"tools": tools, "action_scheduler": scheduler},  # the static baseline
                                "job": {"run_dir": str(run)}, "broker": {"policy": "static"}})
        with pytest.raises(Started):
            driver.run_job(cfg)
        c = started.pop()
        assert (c.actor_args.count("--tools"), "ut_ok_tools_mod" in c.actor_args) == (len(tools), bool(tools))
        conf = Path(c.broker_args[c.broker_args.index("--config") + 1]).read_text()  # RUN/broker.toml, always
        assert f'action_scheduler = "{expect or ""}"' in conf  # "": first come first served
    with pytest.raises(ConfigError, match=r"\[actors\] action_scheduler must be auto, fcfs or one of tangram"):
        job_from_mapping({"actors": {"action_scheduler": "best"}})
