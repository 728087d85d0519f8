"""Tools of a user's own on real processes (loopback): ``python -m libra.broker`` with the Tangram action
scheduler and ``python -m libra.actors --tools user_tools_mod``. A client calls the user's tools through the
broker and gets their results; the broker grants the cores the tool declares (the handler sees them, with
the exact CPU ids); a typed ToolError reaches the client; a job whose environment needs a tool that no actor
offers is refused, naming the tool and how to offer it; a sandboxed tool's code runs in the trajectory's
bubblewrap sandbox (real bubblewrap), in the workspace the built-in ``python`` tool uses."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from libra.client import Client
from libra.client.aio import AsyncClient
from libra.client.errors import LibraError
from libra.local import LocalCluster
from libra.rl.driver import JobFailed, check_tools

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
CORES = min(2, len(os.sched_getaffinity(0)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cfg = tmp_path_factory.mktemp("broker") / "broker.toml"
    cfg.write_text('[broker]\naction_scheduler = "tangram"\n')
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    c = LocalCluster(cpu_slots=1, broker_args=["--config", str(cfg)], env={"PYTHONPATH": path},
                     actor_args=["--no-restart", "--no-sandbox", "--capacity", "4", "--tools", "user_tools_mod"])
    c.start(timeout=120)
    try:
        yield c
    finally:
        c.stop()


def test_a_client_calls_the_users_tools_and_gets_their_results(cluster: LocalCluster) -> None:
    (actor,) = cluster.status().actors
    assert {"count_words", "shout", "echo"} <= set(actor["capabilities"]["action"])
    with Client(cluster.url) as c:
        r = c.call_tool("count_words", {"text": "one two three"}, trajectory="t1", timeout=60)
        assert r.output["words"] == 3 and r.output["pid"] != os.getpid()
        assert r.output["cores"] == CORES  # the declared cores, granted by the broker's scheduler
        assert r.output["core_ids"] is not None and len(set(r.output["core_ids"])) == CORES
        assert c.call_tool("shout", {"text": "hi"}, timeout=60).output == "HI"
        with pytest.raises(LibraError) as exc:  # the tool's typed error (bad_request), not a crash
            c.call_tool("shout", {"nope": 1}, timeout=60)
        assert "shout needs" in str(exc.value)


def test_a_job_needing_a_tool_no_actor_offers_is_refused(cluster: LocalCluster) -> None:
    env = SimpleNamespace(required_tools=lambda cfg: ["count_words", "web_search"])

    async def main() -> None:
        async with AsyncClient(cluster.url) as c:
            await check_tools(c, SimpleNamespace(required_tools=lambda cfg: ["count_words"]), None, "ok", wait_s=0.0)
            with pytest.raises(JobFailed) as exc:
                await check_tools(c, env, None, "search_job", wait_s=0.0)
            msg = str(exc.value)
            assert "needs the tool(s) 'web_search'" in msg and "count_words" in msg  # what is offered
            assert "[actors] tools" in msg and "--tools" in msg

    asyncio.run(main())


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_sandboxed_tool_runs_its_code_in_the_trajectorys_sandbox(tmp_path: Path) -> None:
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    with LocalCluster(cpu_slots=1, env={"PYTHONPATH": path},
                      actor_args=["--no-restart", "--capacity", "2", "--tools", "user_tools_mod"]) as c, \
            Client(c.url) as client:
        (actor,) = c.status().actors
        assert {"grade", "python"} <= set(actor["capabilities"]["action"])
        probe = "import os, json; open('mark.txt', 'w').write('x'); print(json.dumps([os.getpid(), os.getcwd()]))"
        r = client.call_tool("grade", {"code": probe}, trajectory="tg", timeout=120).output
        pid, cwd = json.loads(r["stdout"])
        assert r["exit_code"] == 0 and pid != r["handler_pid"]  # the code ran in a sandbox process, not the actor
        # the same workspace the built-in python tool gives that trajectory
        seen = client.call_tool("python", {"code": "import os; print(os.path.exists('mark.txt'), os.getcwd())"},
                                trajectory="tg", timeout=120).output["stdout"].split()
        assert seen == ["True", cwd]
