"""SandboxPool behaviour against real bubblewrap sandboxes: the result contract, the tools, workspace
persistence and isolation, core grants, concurrency, release/LRU/TTL, reporting, unisolated mode.
Skipped only when bwrap is not installed (CI installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libra.engines.sandbox.pool import (
    SandboxCancelled,
    SandboxDenied,
    SandboxError,
    SandboxLimits,
    SandboxPool,
    SandboxUnavailable,
)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
LIMITS = SandboxLimits(timeout_s=20, memory_mb=1024, max_procs=128)
NCPU = len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    with SandboxPool(warm=2, max_sandboxes=16, limits=LIMITS) as p:
        yield p


def wait_until(predicate, what: str, attempts: int = 200) -> None:  # type: ignore[no-untyped-def]
    for _ in range(attempts):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


# --------------------------------------------------------------------------------- result contract
@needs_bwrap
def test_python_result_contract(pool: SandboxPool) -> None:
    out = pool.run("contract", "python", {"code": "import sys\nprint('héllo')\nprint('warn', file=sys.stderr)"})
    assert set(out) == {"stdout", "stderr", "exit_code", "truncated", "duration_s", "killed"}
    assert out["killed"] is None
    assert out["stdout"] == "héllo\n" and out["stderr"] == "warn\n" and out["exit_code"] == 0
    assert out["truncated"] == {"stdout": False, "stderr": False} and out["duration_s"] > 0


@needs_bwrap
def test_nonzero_exit_is_a_result_with_the_traceback(pool: SandboxPool) -> None:
    out = pool.run("contract", "python", {"code": "print('before')\n1 / 0"})
    assert out["exit_code"] == 1 and out["stdout"] == "before\n"
    assert out["stderr"].rstrip().endswith("ZeroDivisionError: division by zero")
    assert pool.run("contract", "python", {"code": "import sys; sys.exit(7)"})["exit_code"] == 7
    assert pool.run("contract", "bash", {"command": "kill -TERM $$"})["exit_code"] == -15


@needs_bwrap
def test_stdin_is_empty(pool: SandboxPool) -> None:
    out = pool.run("contract", "python", {"code": "try:\n    input()\nexcept EOFError:\n    print('eof')"})
    assert out["stdout"] == "eof\n"


@needs_bwrap
def test_denied_requests_bind_nothing(pool: SandboxPool) -> None:
    bound = pool.stats()["bound"]
    with pytest.raises(SandboxDenied, match="unknown tool: 'perl'"):
        pool.run("never-bound", "perl", {})
    with pytest.raises(SandboxDenied, match="inside the workspace"):
        pool.run("never-bound", "python", {"code": "pass", "files": {"../x": "y"}})
    with pytest.raises(SandboxDenied, match="cores"):
        pool.run("never-bound", "python", {"code": "pass"}, cores=0)
    with pytest.raises(SandboxDenied, match="trajectory"):
        pool.run("", "python", {"code": "pass"})
    assert pool.stats()["bound"] == bound


# ------------------------------------------------------------------------------ workspace semantics
@needs_bwrap
def test_state_persists_between_actions_of_a_trajectory(pool: SandboxPool) -> None:
    pool.run("persist", "python", {"code": "open('counter', 'w').write('1')"})
    pool.run("persist", "bash", {"command": "echo $(( $(cat counter) + 1 )) > counter"})
    out = pool.run("persist", "python", {"code": "import os; print(open('counter').read().strip(), os.getcwd())"})
    assert out["stdout"] == "2 /workspace\n"


@needs_bwrap
def test_trajectories_are_isolated(pool: SandboxPool) -> None:
    pool.run("iso-a", "python", {"code": "open('mine.txt', 'w').write('a')"})
    out = pool.run("iso-b", "python", {"code": "import os; print(sorted(os.listdir('.')))"})
    assert out["stdout"] == "[]\n"
    pool.run("iso-b", "python", {"code": "open('mine.txt', 'w').write('b')"})
    assert pool.run("iso-a", "bash", {"command": "cat mine.txt"})["stdout"] == "a"


@needs_bwrap
def test_files_argument_is_written_first(pool: SandboxPool) -> None:
    files = {"pkg/__init__.py": "", "pkg/mod.py": "VALUE = 41\n", "data.bin": b"\x00\xff"}
    out = pool.run("files", "python", {"code": "from pkg.mod import VALUE\nprint(VALUE + 2, open('data.bin','rb').read())",
                                       "files": files})
    assert out["stdout"] == "43 b'\\x00\\xff'\n"


@needs_bwrap
def test_large_code_runs_through_a_file(pool: SandboxPool) -> None:
    code = "total = 0\n" + "total += 1\n" * 8000 + "print(total)\n"  # ~ 88 KB, beyond one argv string
    assert pool.run("files", "python", {"code": code})["stdout"] == "8000\n"


# ------------------------------------------------------------------------------------------- tools
@needs_bwrap
def test_bash_tool_environment(pool: SandboxPool) -> None:
    out = pool.run("env", "bash", {"command": "echo $HOME $LANG; which python; hostname"})
    lines = out["stdout"].split("\n")
    assert lines[0] == "/workspace C.UTF-8" and lines[1].endswith("/python") and lines[2] == "sandbox"


@needs_bwrap
def test_pytest_tool_reports_a_summary(pool: SandboxPool) -> None:
    tests = ("def test_one():\n    assert 1\n\ndef test_two():\n    assert 2\n\n"
             "def test_bad():\n    assert 1 == 2\n")
    out = pool.run("pytest", "pytest", {"files": {"test_x.py": tests}, "args": ["-q", "-p", "no:cacheprovider"],
                                        "workers": 2}, cores=2)
    assert out["exit_code"] == 1
    assert out["summary"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 0}
    xdist = pool.isolation_report()["xdist"]
    assert out["workers"] == (2 if xdist else 1)


# ------------------------------------------------------------------------------------------- cores
@needs_bwrap
def test_granted_cores_bound_the_action(pool: SandboxPool) -> None:
    code = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    one = pool.run("cores", "python", {"code": code}, cores=1)["stdout"].split("] ")
    assert len(eval(one[0] + "]")) == 1 and one[1].strip() == "1"
    every = pool.run("cores", "python", {"code": code}, cores=64)["stdout"].split("] ")
    assert eval(every[0] + "]") == sorted(os.sched_getaffinity(0)) and every[1].strip() == str(NCPU)
    last = max(os.sched_getaffinity(0))
    pinned = pool.run("cores", "python", {"code": code}, core_ids=[last])["stdout"]
    assert pinned.startswith(f"[{last}]")
    with pytest.raises(SandboxDenied, match="core_ids"):
        pool.run("cores", "python", {"code": "pass"}, core_ids=[10_000])


# ------------------------------------------------------------------------------------- concurrency
@needs_bwrap
def test_concurrent_runs_from_threads(pool: SandboxPool) -> None:
    bump = ("import os\nn = int(open('n').read()) if os.path.exists('n') else 0\n"
            "open('n', 'w').write(str(n + 1))\nprint(n + 1)")
    errors: list[BaseException] = []

    def worker(traj: str) -> None:
        try:
            for _ in range(3):
                assert pool.run(traj, "python", {"code": bump})["exit_code"] == 0
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"conc-{i % 2}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for traj in ("conc-0", "conc-1"):  # actions of one trajectory never interleave: no lost update
        assert pool.run(traj, "bash", {"command": "cat n"})["stdout"] == "6"


# ------------------------------------------------------------------------------ lifecycle & report
@needs_bwrap
def test_warm_sandboxes_are_kept_ready() -> None:
    with SandboxPool(warm=2, max_sandboxes=4) as fresh:
        wait_until(lambda: fresh.stats()["warm"] == 2, "two warm sandboxes")
        assert fresh.stats()["bound"] == 0
        fresh.run("warm-new", "python", {"code": "pass"})
        wait_until(lambda: fresh.stats()["warm"] == 2, "the warm set topped up again")
        after = fresh.stats()
        assert after["bound"] == 1 and after["live"] == 3 and after["spawns"] == 3


@needs_bwrap
def test_release_wipes_the_workspace(pool: SandboxPool) -> None:
    pool.run("gone", "python", {"code": "open('f', 'w').write('x')"})
    assert pool.release("gone") is True and pool.release("gone") is False
    assert pool.run("gone", "python", {"code": "import os; print(os.listdir('.'))"})["stdout"] == "[]\n"


@needs_bwrap
def test_isolation_report(pool: SandboxPool) -> None:
    report = pool.isolation_report()
    version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert report["mode"] == "bwrap" and report["isolated"] is True and report["bwrap_version"] == version
    assert report["cpu_control"] in ("cgroup_v2", "affinity") and report["cgroup_reason"]
    assert report["user_namespace"] is (os.geteuid() != 0)
    assert {"pid", "net", "mount"} <= set(report["namespaces"]) and report["network"].startswith("none")
    assert report["rlimits"]["RLIMIT_NPROC"] == (LIMITS.max_procs, LIMITS.max_procs)


@needs_bwrap
def test_lru_eviction_and_ttl_expiry() -> None:
    now = [0.0]
    with SandboxPool(warm=0, max_sandboxes=2, ttl_s=100, clock=lambda: now[0]) as small:
        for traj in ("t1", "t2"):
            small.run(traj, "python", {"code": f"open('who', 'w').write({traj!r})"})
            now[0] += 1
        small.run("t1", "bash", {"command": "cat who"})  # t1 is now the most recent: t2 is evicted
        now[0] += 1
        small.run("t3", "bash", {"command": "echo t3 > who"})
        assert small.stats()["evictions"] == 1
        assert small.run("t1", "bash", {"command": "cat who"})["stdout"] == "t1"
        assert small.run("t2", "bash", {"command": "cat who 2>&1 || true"})["stdout"].startswith("cat:")
        now[0] += 1000  # everything idle past the TTL
        wait_until(lambda: small.stats()["bound"] == 0, "idle sandboxes expired")
        assert small.stats()["expired"] == 2


@needs_bwrap
def test_close_removes_workspaces_and_refuses_work() -> None:
    small = SandboxPool(warm=1, max_sandboxes=2)
    root = Path(small.isolation_report()["workspaces"])
    small.run("x", "python", {"code": "open('f', 'w').write('1')"})
    small.close()
    small.close()
    assert not root.exists()
    with pytest.raises(SandboxError, match="closed"):
        small.run("x", "python", {"code": "pass"})


# ------------------------------------------------------------------------------ cancellation & actor
@needs_bwrap
def test_cancel_kills_a_running_action(pool: SandboxPool) -> None:
    cancel = threading.Event()
    timer = threading.Timer(0.3, cancel.set)
    timer.start()
    try:
        with pytest.raises(SandboxCancelled) as info:  # the 20 s timeout would raise SandboxTimeout instead
            pool.run("cancel", "python", {"code": "import time\nprint('sleeping', flush=True)\ntime.sleep(60)"},
                     cancel=cancel)
    finally:
        timer.cancel()
    assert info.value.code == "cancelled" and info.value.result["exit_code"] == -9
    assert pool.run("cancel", "bash", {"command": "echo next"})["stdout"] == "next\n"


@needs_bwrap
def test_actor_handlers(pool: SandboxPool) -> None:
    from libra.actors.tools import ToolError, WorkContext
    from libra.engines.sandbox.handlers import sandbox_tools

    handlers = sandbox_tools(pool=pool)
    assert set(handlers) == {"bash", "pytest", "python"}
    ctx = WorkContext("w1", "actor-traj", budget_s=30.0)
    assert handlers["python"]({"code": "open('f', 'w').write('1'); print(2)"}, ctx)["stdout"] == "2\n"
    assert handlers["bash"]({"command": "cat f"}, ctx)["stdout"] == "1"
    bound = pool.stats()["bound"]
    anonymous = WorkContext("w2", None, budget_s=30.0)
    assert handlers["bash"]({"command": "ls | wc -l"}, anonymous)["stdout"].strip() == "0"
    assert pool.stats()["bound"] == bound  # a call without a trajectory gets a throw-away workspace
    with pytest.raises(ToolError) as bad:
        handlers["python"]({"script": "x"}, ctx)
    assert bad.value.code == "bad_request" and "unknown argument 'script'" in bad.value.message
    with pytest.raises(ToolError) as slow:
        handlers["python"]({"code": "while True: pass"}, WorkContext("w3", "actor-traj", budget_s=0.5))
    assert slow.value.code == "timeout"


# ------------------------------------------------------------------------------- without bubblewrap
def test_missing_bwrap_is_refused_with_a_clear_message() -> None:
    with pytest.raises(SandboxUnavailable, match="install bubblewrap .* allow_unisolated=True") as info:
        SandboxPool(bwrap="/nonexistent/bwrap")
    assert info.value.code == "unavailable"


def test_unusable_bwrap_is_refused_with_its_reason() -> None:
    with pytest.raises(SandboxUnavailable, match="cannot create a sandbox on this host.*allow_unisolated=True"):
        SandboxPool(bwrap="/bin/false")


def test_unisolated_mode_runs_and_says_so() -> None:
    with SandboxPool(bwrap="/nonexistent/bwrap", allow_unisolated=True, warm=0, max_sandboxes=2,
                     limits=SandboxLimits(timeout_s=5, max_procs=4096)) as plain:
        report = plain.isolation_report()
        assert report["mode"] == "unisolated" and report["isolated"] is False and "NOT safe" in report["warning"]
        out = plain.run("u", "python", {"code": "import os; open('f', 'w').write('1'); print(os.getcwd())"})
        assert out["exit_code"] == 0 and out["stdout"].strip().startswith(report["workspaces"])
        assert plain.run("u", "bash", {"command": "cat f"})["stdout"] == "1"
        with pytest.raises(SandboxError) as info:
            plain.run("u", "python", {"code": "while True: pass", "timeout_s": 1})
        assert info.value.code == "timeout"
        assert plain.run("u", "bash", {"command": "echo ok"})["stdout"] == "ok\n"
