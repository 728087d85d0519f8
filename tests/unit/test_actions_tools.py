"""The sandbox tool handlers honour the scheduler's core grant: ``args["cores"]`` or ``WorkContext.cores``,
bounded by the pool's cores (real bubblewrap sandboxes)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from libra.actors.tools import ToolError, WorkContext
from libra.engines.sandbox.pool import SandboxLimits, SandboxPool
from libra.engines.sandbox.handlers import sandbox_tools

NCPU = len(os.sched_getaffinity(0))
PROBE = "import os; print(len(os.sched_getaffinity(0)), os.environ['LIBRA_CORES'])"


@pytest.fixture(scope="module")
def tools() -> Iterator[dict]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    with SandboxPool(warm=1, max_sandboxes=4, limits=SandboxLimits(timeout_s=20)) as pool:
        yield sandbox_tools(pool=pool)


def granted(tools: dict, args: dict, ctx: WorkContext) -> tuple[int, int]:
    out = tools["python"](args, ctx)
    assert out["exit_code"] == 0, out["stderr"]
    affinity, env = out["stdout"].split()
    return int(affinity), int(env)


def test_default_grant_is_one_core(tools: dict) -> None:
    assert granted(tools, {"code": PROBE}, WorkContext("w1", "t", 10.0)) == (1, 1)


def test_context_cores_are_granted_and_bounded_by_the_pool(tools: dict) -> None:
    assert granted(tools, {"code": PROBE}, WorkContext("w2", "t", 10.0, cores=NCPU)) == (NCPU, NCPU)
    assert granted(tools, {"code": PROBE}, WorkContext("w3", "t", 10.0, cores=64)) == (NCPU, NCPU)


def test_args_cores_override_the_context(tools: dict) -> None:
    assert granted(tools, {"code": PROBE, "cores": 1}, WorkContext("w4", None, 10.0, cores=NCPU)) == (1, 1)
    assert granted(tools, {"code": PROBE, "cores": 99}, WorkContext("w5", None, 10.0)) == (NCPU, NCPU)


@pytest.mark.parametrize("bad", [0, -1, True, "2", 1.5])
def test_bad_cores_are_refused(tools: dict, bad: object) -> None:
    with pytest.raises(ToolError) as ei:
        tools["bash"]({"command": "true", "cores": bad}, WorkContext("w6", None, 10.0))
    assert ei.value.code == "bad_request" and "cores" in ei.value.message


def test_actor_without_bubblewrap_offers_builtins_only_and_says_why(monkeypatch) -> None:
    import shutil

    from structlog.testing import capture_logs

    from libra.actors.tools import action_tools

    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with capture_logs() as logs:
        tools = action_tools(enable_services=False)
    assert sorted(tools) == ["echo", "sleep"]
    assert any(e["event"] == "code_tools_unavailable" and "bubblewrap" in e["reason"] for e in logs)
