"""The abuse suite, against real bubblewrap sandboxes: every hostile action is contained, reported with
the documented result or typed error, leaves no process behind, and the pool keeps serving — other
trajectories' workspaces intact. Skipped only when bwrap is not installed (CI installs it)."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from libra.engines.sandbox.pool import (
    SandboxCrashed,
    SandboxError,
    SandboxLimits,
    SandboxMemoryExceeded,
    SandboxOutputLimit,
    SandboxPool,
    SandboxTimeout,
)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap")

UID_BASE = 0x5B000000 + (os.getpid() % 1000) * 64
MAX_SANDBOXES = 8
LIMITS = SandboxLimits(timeout_s=10, memory_mb=512, max_procs=64, max_file_mb=8, output_bytes=1 << 20)
VICTIM, BYSTANDER = "victim", "bystander"
SECRET_IN_BYSTANDER = "bystander state 42"


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    with SandboxPool(warm=1, max_sandboxes=MAX_SANDBOXES, limits=LIMITS, uid_base=UID_BASE) as p:
        out = p.run(BYSTANDER, "python", {"code": f"open('state.txt', 'w').write({SECRET_IN_BYSTANDER!r})"})
        assert out["exit_code"] == 0, out
        yield p


def py(pool: SandboxPool, code: str, traj: str = VICTIM, **extra: object) -> dict:
    return pool.run(traj, "python", {"code": code, **extra})


def sh(pool: SandboxPool, command: str, traj: str = VICTIM, **extra: object) -> dict:
    return pool.run(traj, "bash", {"command": command, **extra})


def sandbox_uids_on_host() -> list[tuple[int, int]]:
    """(pid, uid) of host processes running as one of this pool's sandbox uids."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
                if UID_BASE <= uid < UID_BASE + MAX_SANDBOXES:
                    found.append((int(entry), uid))
    return found


def assert_healthy(pool: SandboxPool) -> None:
    """The pool still runs a normal action, nothing is left over, the bystander's workspace is intact."""
    out = py(pool, "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getpid())")
    assert out["exit_code"] == 0, out
    pids, me = out["stdout"].rsplit(" ", 1)
    assert eval(pids) == sorted({1, int(me)}), "a process of an earlier action survived in the sandbox"
    if os.geteuid() == 0:
        assert sandbox_uids_on_host() == []
    assert subprocess.run(["true"], check=False).returncode == 0  # the host still forks
    mine = py(pool, "print(open('state.txt').read())", traj=BYSTANDER)
    assert mine["stdout"] == SECRET_IN_BYSTANDER + "\n"


def test_infinite_loop_times_out(pool: SandboxPool) -> None:
    with pytest.raises(SandboxTimeout) as info:
        py(pool, "while True: pass", timeout_s=1)
    assert info.value.code == "timeout"
    assert info.value.result is not None and info.value.result["exit_code"] == -9
    assert info.value.result["duration_s"] >= 1.0
    assert_healthy(pool)


def test_cpu_time_limit_is_a_timeout(pool: SandboxPool) -> None:
    code = ("import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_CPU)\n"
            "resource.setrlimit(resource.RLIMIT_CPU, (1, hard))\nwhile True: pass")
    with pytest.raises(SandboxTimeout, match="CPU-time limit"):
        py(pool, code)
    assert_healthy(pool)


@pytest.mark.parametrize("tool,bomb", [
    ("python", "import os\nwhile True:\n    os.fork()"),
    ("bash", "f() { f | f & }; f; sleep 30"),
])
def test_fork_bomb_is_contained(pool: SandboxPool, tool: str, bomb: str) -> None:
    key = "code" if tool == "python" else "command"
    try:
        out = pool.run(VICTIM, tool, {key: bomb, "timeout_s": 3})
        assert out["exit_code"] != 0  # the bomb hit RLIMIT_NPROC and died of it
    except SandboxTimeout:
        pass  # or it kept retrying and was killed at the deadline
    assert_healthy(pool)


def test_process_limit_is_set(pool: SandboxPool) -> None:
    assert sh(pool, "ulimit -u")["stdout"].strip() == str(LIMITS.max_procs)


@pytest.mark.parametrize("code", ["x = bytearray(1 << 30)", "chunks = []\nwhile True: chunks.append(bytearray(10**7))"])
def test_memory_bomb_is_a_memory_error(pool: SandboxPool, code: str) -> None:
    with pytest.raises(SandboxMemoryExceeded) as info:
        py(pool, code)
    assert info.value.code == "memory" and "MemoryError" in info.value.result["stderr"]
    assert_healthy(pool)


def test_100mb_of_output_is_truncated_without_buffering(pool: SandboxPool) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = ("import sys\nblock = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(block)\n"
            "sys.stdout.flush()\nsys.stderr.write('finished')")
    out = py(pool, code)
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert out["truncated"] == {"stdout": True, "stderr": False}
    assert len(out["stdout"]) == LIMITS.output_bytes and set(out["stdout"]) == {"x"}
    assert out["exit_code"] == -9 and "finished" not in out["stderr"]  # killed at the cap, not run to the end
    assert out["killed"] == "output_limit"  # a caller can tell it from a run that finished
    assert grown_kb < 50 * 1024, f"the parent grew by {grown_kb} KiB reading capped output"
    assert_healthy(pool)


def test_stderr_is_capped_separately(pool: SandboxPool) -> None:
    out = py(pool, "import sys\nprint('ok')\nsys.stdout.flush()\nwhile True: sys.stderr.write('e' * 65536)")
    assert out["truncated"] == {"stdout": False, "stderr": True} and out["stdout"] == "ok\n"
    assert out["killed"] == "output_limit"
    assert len(out["stderr"]) == LIMITS.output_bytes


def test_file_size_limit(pool: SandboxPool) -> None:
    with pytest.raises(SandboxOutputLimit) as info:
        sh(pool, f"exec head -c {(LIMITS.max_file_mb + 4) << 20} /dev/zero > big.bin")
    assert info.value.code == "output_limit"
    assert sh(pool, "stat -c %s big.bin; rm big.bin")["stdout"].strip() == str(LIMITS.max_file_mb << 20)
    assert_healthy(pool)


def test_network_is_unreachable(pool: SandboxPool) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = (
            "import socket\nfor addr in [('1.1.1.1', 53), ('127.0.0.1', PORT)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=2)\n        print('CONNECTED', addr)\n"
            "    except OSError as exc:\n        print('failed', type(exc).__name__)\n"
            "try:\n    socket.getaddrinfo('pypi.org', 443)\n    print('RESOLVED')\n"
            "except OSError:\n    print('no dns')\n"
        ).replace("PORT", str(port))
        out = py(pool, code)
        assert "CONNECTED" not in out["stdout"] and "RESOLVED" not in out["stdout"]
        assert out["stdout"].count("failed") == 2 and "no dns" in out["stdout"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing from the sandbox reached the host's loopback
    finally:
        listener.close()


def test_writes_outside_the_workspace_fail(pool: SandboxPool) -> None:
    marker = f"libra-escape-{os.getpid()}"
    targets = ["/usr/" + marker, "/etc/" + marker, "/" + marker, str(Path(tempfile.gettempdir()) / marker)]
    code = (
        "import sys\nfor path in TARGETS:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
        "    except OSError as exc:\n        print('denied', path, type(exc).__name__)\n"
    ).replace("TARGETS", repr(targets))
    out = py(pool, code)
    # /tmp inside is the sandbox's private tmpfs: writable there, invisible on the host.
    assert out["stdout"].count("denied") == 3 and f"WROTE /tmp/{marker}" in out["stdout"]
    for target in targets:
        assert not os.path.exists(target)
    assert_healthy(pool)


def test_host_secret_and_other_workspaces_are_invisible(pool: SandboxPool) -> None:
    secret_dir = tempfile.mkdtemp(prefix="secret-")
    secret = Path(secret_dir) / "token.txt"
    secret.write_text("hunter2")
    try:
        root = Path(pool.isolation_report()["workspaces"])
        candidates = [str(secret), f"/proc/1/root{secret}", "/etc/shadow",
                      *(str(p / "state.txt") for p in root.glob("ws-*"))]
        code = ("for path in PATHS:\n    try:\n        print('READ', path, open(path).read())\n"
                "    except OSError as exc:\n        print('hidden', type(exc).__name__)\n").replace("PATHS", repr(candidates))
        out = py(pool, code)
        assert "READ" not in out["stdout"] and "hunter2" not in out["stdout"]
        assert out["stdout"].count("hidden") == len(candidates)
    finally:
        shutil.rmtree(secret_dir)


def test_action_runs_unprivileged(pool: SandboxPool) -> None:
    out = sh(pool, "id -u; grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status")
    lines = out["stdout"].split()
    assert lines[0] != "0"
    assert lines[1:] == ["CapPrm:", "0000000000000000", "CapEff:", "0000000000000000", "CapAmb:", "0000000000000000"]


@pytest.mark.parametrize("tool,attack", [
    ("python", "import os\nos.kill(os.getppid(), 9)\nprint('survived')"),
    ("bash", "kill -9 -1; echo survived"),
    ("bash", "kill -9 1; echo survived"),
])
def test_killing_the_parent_does_not_reach_the_pool(pool: SandboxPool, tool: str, attack: str) -> None:
    key = "code" if tool == "python" else "command"
    pool.run(VICTIM, tool, {key: attack})  # a result either way: the signal is refused or ignored
    assert_healthy(pool)


@pytest.mark.parametrize("code,signame", [
    ("import os; os.abort()", "SIGABRT"),
    ("import ctypes; ctypes.string_at(0)", "SIGSEGV"),
])
def test_interpreter_crash_is_a_typed_error(pool: SandboxPool, code: str, signame: str) -> None:
    with pytest.raises(SandboxCrashed, match=signame) as info:
        py(pool, code)
    assert info.value.code == "crashed" and info.value.result["exit_code"] < 0
    assert_healthy(pool)


def test_background_processes_do_not_outlive_their_action(pool: SandboxPool) -> None:
    out = sh(pool, "(setsid sleep 600 &) ; nohup sleep 600 >/dev/null 2>&1 & echo started")
    assert out["stdout"] == "started\n"
    assert_healthy(pool)


def test_errors_carry_no_host_state(pool: SandboxPool) -> None:
    # A sandbox error never leaves the pool unusable for that trajectory: its workspace persists.
    py(pool, "open('keep.txt', 'w').write('kept')")
    with pytest.raises(SandboxError):
        py(pool, "while True: pass", timeout_s=1)
    assert py(pool, "print(open('keep.txt').read())")["stdout"] == "kept\n"
