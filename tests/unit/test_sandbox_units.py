"""Pure parts of the sandbox: limits, tools' argument validation, pytest summary parsing, the bwrap
command line, core granting and the cgroup v2 bookkeeping (against a fake cgroup tree). No sandboxes."""

from __future__ import annotations

import base64
import os
import signal

import pytest

from libra.engines.sandbox.cgroup import (
    IDLE_QUOTA_US,
    PERIOD_US,
    CgroupV2,
    detect_cgroup_v2,
    setup_cgroup,
)
from libra.engines.sandbox.cores import CoreAllocator, parse_cpulist, read_numa_nodes
from libra.engines.sandbox.errors import (
    SandboxBusy,
    SandboxCancelled,
    SandboxCrashed,
    SandboxDenied,
    SandboxError,
    SandboxLimits,
    SandboxMemoryExceeded,
    SandboxOutputLimit,
    SandboxTimeout,
    SandboxUnavailable,
)
from libra.engines.sandbox.isolation import (
    WORKSPACE_MOUNT,
    build_bwrap_argv,
    interpreter_paths,
)
from libra.engines.sandbox.outcome import interpret_outcome
from libra.engines.sandbox.proc import RawOutcome
from libra.engines.sandbox.tools import (
    ToolContext,
    get_tool,
    parse_pytest_summary,
    validate_files,
)

CTX = ToolContext(python="/opt/py/bin/python", workspace="/workspace", n_cores=3, limits=SandboxLimits())


# ------------------------------------------------------------------------------------------- errors
def test_error_codes_are_stable_and_hierarchical() -> None:
    codes = {cls: cls.code for cls in (SandboxTimeout, SandboxMemoryExceeded, SandboxOutputLimit, SandboxDenied,
                                       SandboxCrashed, SandboxCancelled, SandboxBusy, SandboxUnavailable)}
    assert codes == {SandboxTimeout: "timeout", SandboxMemoryExceeded: "memory", SandboxOutputLimit: "output_limit",
                     SandboxDenied: "denied", SandboxCrashed: "crashed", SandboxCancelled: "cancelled",
                     SandboxBusy: "busy", SandboxUnavailable: "unavailable"}
    assert all(issubclass(cls, SandboxError) for cls in codes)
    assert issubclass(SandboxDenied, ValueError)
    err = SandboxTimeout("late", result={"stdout": "partial"})
    assert err.result == {"stdout": "partial"} and str(err) == "late"


@pytest.mark.parametrize("field,value", [("timeout_s", 0), ("timeout_s", float("nan")), ("memory_mb", 8),
                                         ("max_procs", 1.5), ("output_bytes", 0), ("kill_grace_s", -1)])
def test_limits_reject_bad_fields_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SandboxLimits(**{field: value})  # type: ignore[arg-type]


def test_limits_timeout_cannot_exceed_maximum() -> None:
    with pytest.raises(ValueError, match="max_timeout_s"):
        SandboxLimits(timeout_s=20, max_timeout_s=10)


def test_rlimits_follow_limits() -> None:
    r = SandboxLimits(memory_mb=100, max_procs=7, max_open_files=50, max_file_mb=3).rlimits(cpu_seconds=9)
    assert r["RLIMIT_AS"] == (100 << 20, 100 << 20)
    assert r["RLIMIT_NPROC"] == (7, 7) and r["RLIMIT_NOFILE"] == (50, 50)
    assert r["RLIMIT_FSIZE"] == (3 << 20, 3 << 20) and r["RLIMIT_CORE"] == (0, 0)
    assert r["RLIMIT_CPU"] == (9, 10)


# -------------------------------------------------------------------------------------------- tools
def test_unknown_tool_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown tool: 'rm' \(known: bash, pytest, python\)"):
        get_tool("rm")


def test_python_tool_builds_argv_env_and_files() -> None:
    call = get_tool("python")({"code": "print(1)", "files": {"a/b.txt": "hi", "c.bin": b"\x00\x01"},
                               "timeout_s": 2.5}, CTX)
    assert call.argv == ("/opt/py/bin/python", "-c", "print(1)")
    assert call.timeout_s == 2.5
    assert call.env["PATH"].startswith("/opt/py/bin:") and call.env["HOME"] == "/workspace"
    assert call.env["OMP_NUM_THREADS"] == "3" and call.env["LIBRA_CORES"] == "3"
    assert call.files == {"a/b.txt": {"text": "hi"}, "c.bin": {"b64": base64.b64encode(b"\x00\x01").decode()}}


def test_python_tool_sends_large_code_through_a_file() -> None:
    code = "x = 1\n" * 20000  # 120 000 bytes: too long for one argv string
    call = get_tool("python")({"code": code}, CTX)
    script = call.argv[1]
    assert call.argv == ("/opt/py/bin/python", script) and script.startswith("/tmp/")
    assert call.files[script] == {"text": code}


@pytest.mark.parametrize("args,match", [
    ({}, "missing required argument 'code'"),
    ({"code": 3}, "'code' must be a string"),
    ({"code": "x", "cmd": 1}, "unknown argument 'cmd'"),
    ({"code": "x", "timeout_s": -1}, "timeout_s must be a positive"),
    ({"code": "x", "timeout_s": 10_000}, "exceeds"),
    ({"code": "a\x00b"}, "NUL"),
    ({"code": "x", "files": {"../escape": "x"}}, "inside the workspace"),
    ({"code": "x", "files": {"/etc/passwd": "x"}}, "inside the workspace"),
    ({"code": "x", "files": {"ok": 5}}, "must be str or bytes"),
    ({"code": "x", "files": ["a"]}, "must be a mapping"),
])
def test_python_tool_denies_bad_arguments(args: dict, match: str) -> None:
    with pytest.raises(SandboxDenied, match=match):
        get_tool("python")(args, CTX)


def test_files_total_size_is_limited() -> None:
    with pytest.raises(SandboxDenied, match="request limit"):
        validate_files("python", {"a": "x" * 10, "b": "y" * 10}, 15)
    assert validate_files("python", None, 15) == {}


def test_bash_tool() -> None:
    call = get_tool("bash")({"command": "ls -la"}, CTX)
    assert call.argv == ("/bin/bash", "-c", "ls -la") and call.timeout_s == SandboxLimits().timeout_s
    with pytest.raises(SandboxDenied, match="missing required argument 'command'"):
        get_tool("bash")({}, CTX)
    with pytest.raises(SandboxDenied, match=r"unknown argument 'code' \(known: command, files, timeout_s\)"):
        get_tool("bash")({"code": "ls"}, CTX)


def test_pytest_tool_uses_xdist_only_when_available_and_parallel() -> None:
    tool = get_tool("pytest")
    seq = tool({"args": ["-q"]}, CTX)
    assert seq.argv == ("/opt/py/bin/python", "-m", "pytest", "-q")
    assert seq.env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
    xdist_ctx = ToolContext(CTX.python, CTX.workspace, 3, CTX.limits, xdist=True)
    par = tool({"args": ["-q"]}, xdist_ctx)  # workers default to the granted cores
    assert par.argv == ("/opt/py/bin/python", "-m", "pytest", "-p", "xdist", "-n", "3", "-q")
    one = tool({"workers": 1}, xdist_ctx)
    assert "-n" not in one.argv
    with pytest.raises(SandboxDenied, match="workers"):
        tool({"workers": 0}, CTX)
    with pytest.raises(SandboxDenied, match="args must be a list"):
        tool({"args": "-q"}, CTX)


def test_pytest_finish_adds_summary_and_workers() -> None:
    call = get_tool("pytest")({}, CTX)
    assert call.finish is not None
    out = call.finish({"stdout": "....F\n1 failed, 4 passed in 0.31s\n", "stderr": ""})
    assert out["summary"] == {"passed": 4, "failed": 1, "errors": 0, "skipped": 0} and out["workers"] == 1


@pytest.mark.parametrize("text,expected", [
    ("===== 3 passed, 1 failed, 2 errors in 0.12s =====", {"passed": 3, "failed": 1, "errors": 2, "skipped": 0}),
    ("2 passed, 1 skipped, 1 warning in 1.50s", {"passed": 2, "failed": 0, "errors": 0, "skipped": 1}),
    ("===== 1 error in 0.05s =====", {"passed": 0, "failed": 0, "errors": 1, "skipped": 0}),
    ("===== no tests ran in 0.01s =====", {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}),
])
def test_parse_pytest_summary(text: str, expected: dict) -> None:
    assert parse_pytest_summary("collected 4 items\n\n" + text + "\n") == expected


def test_parse_pytest_summary_without_summary_line() -> None:
    assert parse_pytest_summary("ERROR: usage: pytest [options]\n") is None


# ---------------------------------------------------------------------------------- bwrap command
def _argv(**kw: object) -> list[str]:
    base: dict[str, object] = {
        "workspace": "/srv/ws-0", "command": ("python", "-c", "pass"), "ro_paths": ("/opt/venv", "/root/.pyenv/x"),
        "root_links": {"/bin": "usr/bin", "/lib": "usr/lib", "/lib64": None}, "privileged": True, "tmp_mb": 16,
    }
    base.update(kw)
    return build_bwrap_argv("bwrap", **base)  # type: ignore[arg-type]


def _pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


def test_bwrap_argv_namespaces_binds_and_command() -> None:
    argv = _argv()
    assert argv[0] == "bwrap" and argv[-4:] == ["--", "python", "-c", "pass"]
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                 "--new-session", "--as-pid-1", "--clearenv"):
        assert flag in argv
    ro = _pairs(argv, "--ro-bind")
    assert ("/usr", "/usr") in ro and ("/etc", "/etc") in ro and ("/lib64", "/lib64") in ro
    assert ("/opt/venv", "/opt/venv") in ro and ("/root/.pyenv/x", "/root/.pyenv/x") in ro
    assert ("usr/bin", "/bin") in _pairs(argv, "--symlink")
    assert ("/srv/ws-0", WORKSPACE_MOUNT) in _pairs(argv, "--bind")
    # Parents of bound prefixes are created traversable (0755) before the bind.
    root_dir = argv.index("/root")
    assert argv[root_dir - 3:root_dir] == ["--perms", "0755", "--dir"]
    assert root_dir < argv.index("/root/.pyenv/x")
    assert argv[argv.index("/tmp") - 5:argv.index("/tmp")] == ["--perms", "1777", "--size", str(16 << 20), "--tmpfs"]


def test_bwrap_argv_privileged_vs_user_namespace() -> None:
    priv = _argv(privileged=True)
    assert "--unshare-user" not in priv and ("--cap-drop", "ALL") == tuple(priv[priv.index("--cap-drop"):][:2])
    assert {priv[i + 1] for i, a in enumerate(priv) if a == "--cap-add"} == {"CAP_SETUID", "CAP_SETGID", "CAP_KILL"}
    user = _argv(privileged=False)
    assert "--unshare-user" in user and "--disable-userns" in user and "--cap-add" not in user
    assert user[user.index("--uid") + 1] == "65534"


def test_bwrap_argv_skips_paths_already_visible_and_rejects_bad_ones() -> None:
    argv = _argv(ro_paths=("/usr/local/lib/python3", "/opt/a", "/opt/a/b"))
    ro = _pairs(argv, "--ro-bind")
    assert ("/usr/local/lib/python3", "/usr/local/lib/python3") not in ro
    assert ("/opt/a", "/opt/a") in ro and ("/opt/a/b", "/opt/a/b") not in ro
    with pytest.raises(ValueError, match="absolute"):
        _argv(ro_paths=("relative/dir",))
    with pytest.raises(ValueError, match="overlap the workspace"):
        _argv(ro_paths=(WORKSPACE_MOUNT,))


def test_interpreter_paths_cover_the_running_interpreter() -> None:
    import sys

    paths = interpreter_paths(sys.executable)
    assert os.path.realpath(sys.prefix) in paths and os.path.realpath(sys.base_prefix) in paths


def test_interpreter_paths_of_another_venv(tmp_path: os.PathLike[str]) -> None:
    from pathlib import Path

    venv = Path(tmp_path) / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    paths = interpreter_paths(str(venv / "bin" / "python"))
    assert os.path.realpath(venv) in paths
    assert os.path.dirname(os.path.dirname(os.path.realpath("/usr/bin/python3"))) in paths


# ------------------------------------------------------------------------------------------- cores
def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()
    with pytest.raises(ValueError, match="bad CPU"):
        parse_cpulist("3-1")


def test_read_numa_nodes_from_fake_sysfs(tmp_path: os.PathLike[str]) -> None:
    from pathlib import Path

    root = Path(tmp_path)
    for node, cpus in (("node0", "0-1"), ("node1", "2-3")):
        (root / node).mkdir()
        (root / node / "cpulist").write_text(cpus + "\n")
    assert read_numa_nodes(root) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert read_numa_nodes(root / "missing") == {}


def test_core_allocator_packs_into_one_numa_node_and_balances() -> None:
    alloc = CoreAllocator(range(8), {c: c // 4 for c in range(8)})
    a = alloc.acquire(3)
    assert a == (0, 1, 2)  # node 0 first (tie on idle cores: lower node id)
    b = alloc.acquire(3)
    assert b == (4, 5, 6)  # node 1 now has the most idle cores
    c = alloc.acquire(2)
    assert set(c) == {3, 7}  # the last idle cores before sharing any
    d = alloc.acquire(1)
    assert alloc.load()[d[0]] == 2  # oversubscribed, never refused
    for grant in (a, b, c, d):
        alloc.release(grant)
    assert set(alloc.load().values()) == {0}


def test_core_allocator_clamps_and_validates() -> None:
    alloc = CoreAllocator([2, 5])
    assert alloc.acquire(10) == (2, 5)
    with pytest.raises(ValueError, match="positive integer"):
        alloc.acquire(0)
    with pytest.raises(ValueError, match="not held"):
        alloc.release([2, 2])
    with pytest.raises(ValueError, match="at least one"):
        CoreAllocator([])


# ------------------------------------------------------------------------------------------ cgroup
def _fake_cgroup_tree(tmp_path: os.PathLike[str], controllers: str = "cpu memory pids") -> tuple:
    from pathlib import Path

    root = Path(tmp_path) / "cg"
    base = root / "system.slice" / "libra.service"
    base.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (base / "cgroup.controllers").write_text(controllers + "\n")
    (base / "cgroup.subtree_control").write_text("")
    self_cg = Path(tmp_path) / "self_cgroup"
    self_cg.write_text("0::/system.slice/libra.service\n")
    return root, base, self_cg


def test_detect_cgroup_v2_reports_why_not(tmp_path: os.PathLike[str]) -> None:
    from pathlib import Path

    found, reason = detect_cgroup_v2(Path(tmp_path) / "nothing", Path(tmp_path) / "nope")
    assert found is None and "no cgroup v2" in reason
    root, _base, self_cg = _fake_cgroup_tree(tmp_path, controllers="memory pids")
    found, reason = detect_cgroup_v2(root, self_cg)
    assert found is None and "cpu controller" in reason


def test_cgroup_v2_quota_lifecycle_on_fake_tree(tmp_path: os.PathLike[str]) -> None:
    root, base, self_cg = _fake_cgroup_tree(tmp_path)
    found, reason = detect_cgroup_v2(root, self_cg)
    assert (found, reason) == (base, "ok")
    cg = CgroupV2(base, name="libra-test")
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (cg.parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    group = cg.create(3, memory_bytes=1 << 30)
    assert (group / "cpu.max").read_text() == f"{IDLE_QUOTA_US} {PERIOD_US}"
    assert (group / "memory.max").read_text() == str(1 << 30)
    cg.add(3, 4242)
    assert (group / "cgroup.procs").read_text() == "4242"
    cg.grant(3, 4)
    assert (group / "cpu.max").read_text() == f"{4 * PERIOD_US} {PERIOD_US}"
    cg.reclaim(3)
    assert (group / "cpu.max").read_text() == f"{IDLE_QUOTA_US} {PERIOD_US}"
    assert cg.oom_kills(3) == 0
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    assert cg.oom_kills(3) == 1


def test_setup_cgroup_choices() -> None:
    assert setup_cgroup("affinity", isolated=True) == (None, "cpu_control='affinity' requested")
    assert setup_cgroup("auto", isolated=False) == (None, "unisolated mode")
    with pytest.raises(SandboxUnavailable, match="cgroup v2 is not usable: unisolated mode"):
        setup_cgroup("cgroup", isolated=False)


# ----------------------------------------------------------------------------------------- outcome
def _outcome(status: int | None, **kw: object) -> RawOutcome:
    stderr = kw.pop("stderr", b"")
    return RawOutcome(b"out", stderr, {"stdout": False, "stderr": False}, status, 0.5, **kw)  # type: ignore[arg-type]


def _exited(code: int) -> int:
    return code << 8


PY_CALL = get_tool("python")({"code": "pass", "timeout_s": 3}, CTX)
PYTEST_CALL = get_tool("pytest")({}, CTX)


def test_interpret_ordinary_exits_are_results() -> None:
    ok = interpret_outcome("python", PY_CALL, _outcome(_exited(0)), CTX.limits)
    assert ok == {"stdout": "out", "stderr": "", "exit_code": 0, "truncated": {"stdout": False, "stderr": False},
                  "duration_s": 0.5, "killed": None}
    assert interpret_outcome("python", PY_CALL, _outcome(_exited(3), stderr=b"ValueError: x\n"),
                             CTX.limits)["exit_code"] == 3
    assert interpret_outcome("bash", PY_CALL, _outcome(signal.SIGTERM), CTX.limits)["exit_code"] == -15
    assert interpret_outcome("bash", PY_CALL, _outcome(signal.SIGKILL), CTX.limits)["exit_code"] == -9


@pytest.mark.parametrize("outcome,error,match", [
    (_outcome(signal.SIGKILL, killed="timeout"), SandboxTimeout, "3 s wall-clock timeout"),
    (_outcome(None, sandbox_died=True), SandboxCrashed, "sandbox died"),
    (_outcome(signal.SIGKILL, killed="cancelled"), SandboxCancelled, "cancelled by the caller"),
    (_outcome(signal.SIGXCPU), SandboxTimeout, "CPU-time limit"),
    (_outcome(signal.SIGXFSZ), SandboxOutputLimit, "larger than 256 MiB"),
    (_outcome(signal.SIGKILL, oom_killed=True), SandboxMemoryExceeded, "out-of-memory killer"),
    (_outcome(signal.SIGSEGV), SandboxCrashed, "SIGSEGV"),
    (_outcome(signal.SIGABRT), SandboxCrashed, "SIGABRT"),
    (_outcome(_exited(1), stderr=b"Traceback ...\nMemoryError\n"), SandboxMemoryExceeded, "ran out of memory"),
])
def test_interpret_errors(outcome: RawOutcome, error: type, match: str) -> None:
    with pytest.raises(error, match=match) as info:
        interpret_outcome("python", PY_CALL, outcome, CTX.limits)
    assert info.value.result["stdout"] == "out"


def test_interpret_output_limit_is_a_truncated_result() -> None:
    out = _outcome(signal.SIGKILL, killed="output_limit")
    out.truncated = {"stdout": True, "stderr": False}
    result = interpret_outcome("python", PY_CALL, out, CTX.limits)
    assert result["truncated"] == {"stdout": True, "stderr": False} and result["exit_code"] == -9
    assert result["killed"] == "output_limit"


def test_interpret_memory_hint_only_for_python_like_tools() -> None:
    outcome = _outcome(_exited(1), stderr=b"MemoryError\n")
    result = interpret_outcome("pytest", PYTEST_CALL, outcome, CTX.limits)  # a failing test, not our limit
    assert result["exit_code"] == 1 and result["summary"] == {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}

