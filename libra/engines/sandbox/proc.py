"""One sandbox as seen from the pool: its zygote process, control channel and per-action I/O.

Role: start a zygote (:mod:`libra.engines.sandbox.zygote`) inside bubblewrap, or unisolated, and run one
action at a time through it: create the stdout/stderr pipes, hand their write ends to the zygote with the
request, read both pipes incrementally while enforcing the wall-clock deadline and the per-stream byte
cap, and return a :class:`RawOutcome`. Interpreting the outcome (result dict vs typed error) is the
pool's job, not this module's.

Contracts:

- :meth:`SandboxProcess.start` returns only once the zygote said ``ready``; if bwrap or the zygote fails
  to start it raises :class:`SandboxUnavailable` with bwrap's own error text.
- :meth:`SandboxProcess.execute` never buffers more than ``output_bytes`` per stream: past the cap the
  action is killed and the rest is read and dropped. On the deadline it asks the zygote to kill the
  action; if the zygote has not reported the exit ``kill_grace_s`` later, the whole sandbox is killed.
  It raises :class:`ZygoteGone` only when the request could not even be delivered (nothing ran).
- Not thread-safe: the pool runs one action per sandbox at a time (it holds the sandbox's lock).
- Must be started from a thread that outlives the sandbox: ``--die-with-parent`` is tied to the thread
  that forked bwrap.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.engines.sandbox.errors import SandboxUnavailable

__all__ = ["ZYGOTE_FILE", "RawOutcome", "SandboxProcess", "ZygoteGone", "wipe_tree"]

_HEADER = struct.Struct(">I")
_READ_CHUNK = 1 << 16
_EOF_GRACE_S = 0.5  # after the exit report, how long leftover pipe writers may keep a stream open


ZYGOTE_FILE = str(Path(__file__).with_name("zygote.py"))
"""The zygote program on the host (bound read-only into each sandbox)."""


class ZygoteGone(Exception):
    """The zygote is dead or its socket is closed; the request was not delivered."""


@dataclass(slots=True)
class RawOutcome:
    """What happened to one action, before interpretation.

    ``status`` is the raw wait status (``None`` if the sandbox died first); ``killed`` is why the pool
    killed it (``"timeout"``, ``"output_limit"``, ``"cancelled"``) or ``None``; ``sandbox_died`` means the zygote vanished
    during the action (it is then unusable)."""

    stdout: bytes
    stderr: bytes
    truncated: dict[str, bool]
    status: int | None
    duration_s: float
    killed: str | None = None
    sandbox_died: bool = False
    oom_killed: bool = False  # the sandbox's cgroup counted an OOM kill during the action
    cpu_s: float = 0.0
    maxrss_kb: int = 0


@dataclass(slots=True)
class _Stream:
    fd: int
    cap: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    open: bool = True


@dataclass(slots=True)
class _Run:
    """One :meth:`SandboxProcess.execute` in flight: its pipes, outcome so far, and its times."""
    streams: dict[str, _Stream]
    outcome: RawOutcome
    deadline: float
    kill_at: float | None = None  # when we asked the zygote to kill
    exit_at: float | None = None  # when the zygote reported the exit


class SandboxProcess:
    """A started zygote for one workspace (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, errfile: Any, *, mode: str,
                 host_pid: int | None) -> None:
        self.proc = proc
        self.sock = sock
        self._errfile = errfile
        self.mode = mode
        self.host_pid = host_pid  # the zygote's pid on the host, when known (cgroup placement)
        self._buf = b""
        self._action_pgid: int | None = None

    # ----------------------------------------------------------------------------------- start/stop
    @classmethod
    def start(
        cls,
        command_prefix: Sequence[str],
        python: str,
        zygote: str,
        *,
        mode: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        want_host_pid: bool = False,
        ready_timeout_s: float = 20.0,
    ) -> SandboxProcess:
        """Start ``python -I -S zygote`` after ``command_prefix`` (the bwrap argv up to ``--``, or empty when
        unisolated); ``zygote`` is the program's path as that process sees it."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        info_r = info_w = -1
        if want_host_pid and command_prefix:
            info_r, info_w = os.pipe()
        prefix = list(command_prefix)
        if info_w >= 0:
            prefix[1:1] = ["--info-fd", str(info_w)]
        command = [*prefix, python, "-I", "-S", zygote, str(child.fileno()), mode]
        errfile = tempfile.TemporaryFile()  # noqa: SIM115 - owned by the SandboxProcess, closed in kill()
        pass_fds = [child.fileno()] + ([info_w] if info_w >= 0 else [])
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errfile,
                pass_fds=pass_fds, cwd=cwd, env=env if env is not None else {"PATH": "/usr/bin:/bin"},
                start_new_session=not command_prefix,
            )
        except OSError as exc:
            parent.close()
            child.close()
            errfile.close()
            for fd in (info_r, info_w):
                if fd >= 0:
                    os.close(fd)
            raise SandboxUnavailable(f"cannot start the sandbox process {command[0]!r}: {exc}") from exc
        child.close()
        if info_w >= 0:
            os.close(info_w)
        sandbox = cls(proc, parent, errfile, mode=mode, host_pid=proc.pid if not command_prefix else None)
        try:
            msg = sandbox._recv_blocking(ready_timeout_s)
            if msg is None or msg.get("op") != "ready":
                raise SandboxUnavailable(
                    "the sandbox did not start"
                    + (f" (bubblewrap said: {sandbox.stderr_text()})" if sandbox.stderr_text() else "")
                )
            if info_r >= 0:
                sandbox.host_pid = _read_child_pid(info_r)
        except BaseException:
            sandbox.kill()
            raise
        finally:
            if info_r >= 0:
                os.close(info_r)
        return sandbox

    def alive(self) -> bool:
        """True while the zygote (bwrap) process is running and its socket is open."""
        return self.proc.poll() is None and self.sock.fileno() >= 0

    def stderr_text(self) -> str:
        """What bwrap/the zygote wrote to stderr so far (diagnostics), stripped."""
        try:
            self._errfile.seek(0)
            return self._errfile.read(8192).decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def kill(self) -> None:
        """Kill the sandbox and everything in it (idempotent); reaps the process and closes descriptors."""
        if self._action_pgid is not None and self.mode == "pgrp":
            try:
                os.killpg(self._action_pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            try:
                self.proc.kill()  # SIGKILL to bwrap: its pid-1 child dies by PDEATHSIG, the namespace with it
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()
        self._errfile.close()

    # ------------------------------------------------------------------------------------- channel
    def _send(self, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        frame = _HEADER.pack(len(data)) + data
        try:
            if fds:
                sent = self.sock.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
                )
                frame = frame[sent:]
            if frame:
                self.sock.sendall(frame)
        except OSError as exc:
            raise ZygoteGone(str(exc)) from exc

    def _pop(self) -> dict[str, Any] | None:
        if len(self._buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buf)
        if len(self._buf) < _HEADER.size + length:
            return None
        body = self._buf[_HEADER.size:_HEADER.size + length]
        self._buf = self._buf[_HEADER.size + length:]
        return json.loads(body)

    def _fill(self) -> bool:
        """One read from the socket into the buffer; False on EOF or error."""
        try:
            data = self.sock.recv(_READ_CHUNK)
        except OSError:
            return False
        if not data:
            return False
        self._buf += data
        return True

    def _recv_blocking(self, timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            while True:
                msg = self._pop()
                if msg is not None:
                    return msg
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left) or not self._fill():
                    return None

    # ------------------------------------------------------------------------------------- actions
    def ping(self, timeout_s: float = 5.0) -> bool:
        """Round trip to the zygote; False if it does not answer."""
        try:
            self._send({"op": "ping"})
        except ZygoteGone:
            return False
        msg = self._recv_blocking(timeout_s)
        return msg is not None and msg.get("op") == "pong"

    def execute(
        self,
        request: dict[str, Any],
        *,
        timeout_s: float,
        output_bytes: int,
        kill_grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        cancel: threading.Event | None = None,
    ) -> RawOutcome:
        """Run one action (the ``run`` message minus ``op``) and collect its outcome (module docstring).

        ``cancel``, when given, is polled every 50 ms; once set the action is killed (``killed ==
        "cancelled"``)."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        start = clock()
        try:
            self._send({"op": "run", **request}, fds=(out_w, err_w))
        except ZygoteGone:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        run = _Run({"stdout": _Stream(out_r, output_bytes), "stderr": _Stream(err_r, output_bytes)},
                   RawOutcome(b"", b"", {"stdout": False, "stderr": False}, None, 0.0), start + timeout_s)
        sel = selectors.DefaultSelector()
        try:
            for st in run.streams.values():
                sel.register(st.fd, selectors.EVENT_READ)
            sel.register(self.sock, selectors.EVENT_READ)
            self._run_loop(run, sel, kill_grace_s, clock, cancel)
        finally:
            sel.close()
            for st in run.streams.values():
                os.close(st.fd)
            if run.outcome.sandbox_died:
                self.kill()
            self._action_pgid = None
        outcome = run.outcome
        outcome.duration_s = clock() - start
        outcome.stdout = bytes(run.streams["stdout"].data)
        outcome.stderr = bytes(run.streams["stderr"].data)
        outcome.truncated = {name: st.truncated for name, st in run.streams.items()}
        return outcome

    def _run_loop(self, run: "_Run", sel: selectors.BaseSelector, kill_grace_s: float,
                  clock: Callable[[], float], cancel: threading.Event | None) -> None:
        """Until the action has exited and its pipes are drained (or the sandbox died): enforce the deadline,
        the cancel flag and the kill grace, and read the zygote's reports and the action's output."""
        by_fd = {st.fd: st for st in run.streams.values()}
        while True:
            wait = self._check_timers(run, clock(), kill_grace_s, cancel)
            if wait is None:
                return
            for key, _ in sel.select(max(0.0, wait)):
                if key.fileobj is self.sock:
                    self._on_zygote(run, sel, clock)
                else:
                    self._on_output(run, sel, by_fd[key.fd], clock)  # type: ignore[index]

    def _check_timers(self, run: "_Run", now: float, kill_grace_s: float,
                      cancel: threading.Event | None) -> float | None:
        """The loop's time rules at ``now``: None when the run is over, else how long to wait for I/O."""
        outcome, pipes_open = run.outcome, any(st.open for st in run.streams.values())
        if run.exit_at is not None and (not pipes_open or now >= run.exit_at + _EOF_GRACE_S):
            return None
        if outcome.sandbox_died and (not pipes_open or (run.kill_at is not None
                                                        and now >= run.kill_at + kill_grace_s)):
            return None
        if outcome.killed is None and now >= run.deadline:
            self._kill_for(run, "timeout", now)
        if outcome.killed is None and cancel is not None and cancel.is_set():
            self._kill_for(run, "cancelled", now)
        if run.kill_at is not None and run.exit_at is None and not outcome.sandbox_died \
                and now >= run.kill_at + kill_grace_s:
            self.kill()  # the zygote did not report in time: tear the whole sandbox down
            outcome.sandbox_died = True
            return None
        if run.exit_at is not None:
            wait = run.exit_at + _EOF_GRACE_S - now
        elif run.kill_at is not None:
            wait = run.kill_at + kill_grace_s - now
        else:
            wait = run.deadline - now
        return min(wait, 0.05) if cancel is not None else wait

    def _kill_for(self, run: "_Run", why: str, now: float) -> None:
        run.outcome.killed, run.kill_at = why, now
        self._request_kill()

    def _on_zygote(self, run: "_Run", sel: selectors.BaseSelector, clock: Callable[[], float]) -> None:
        """The zygote's socket is readable: its ``started``/``error``/``exit`` reports, or its death."""
        if not self._fill():
            try:
                sel.unregister(self.sock)
            except (KeyError, ValueError, OSError):
                pass
            run.outcome.sandbox_died = True
            run.kill_at = run.kill_at if run.kill_at is not None else clock()
        while (msg := self._pop()) is not None:
            op = msg.get("op")
            if op == "started" and self.mode == "pgrp":
                self._action_pgid = msg.get("pid")
            elif op == "error":  # the zygote refused the request: treat it as broken
                run.outcome.sandbox_died = True
                run.kill_at = run.kill_at if run.kill_at is not None else clock()
            elif op == "exit":
                run.outcome.status = int(msg["status"])
                run.outcome.cpu_s = float(msg.get("cpu_s", 0.0))
                run.outcome.maxrss_kb = int(msg.get("maxrss_kb", 0))
                run.exit_at = clock()

    def _on_output(self, run: "_Run", sel: selectors.BaseSelector, st: "_Stream",
                   clock: Callable[[], float]) -> None:
        """One of the action's pipes is readable: keep up to its cap; past it, kill for ``output_limit``."""
        chunk = os.read(st.fd, _READ_CHUNK)
        if not chunk:
            sel.unregister(st.fd)
            st.open = False
            return
        room = st.cap - len(st.data)
        if len(chunk) <= room:
            st.data += chunk
            return
        st.data += chunk[:max(0, room)]
        st.truncated = True
        if run.outcome.killed is None:
            self._kill_for(run, "output_limit", clock())

    def _request_kill(self) -> None:
        if self.mode == "pgrp" and self._action_pgid is not None:
            try:
                os.killpg(self._action_pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self._send({"op": "kill"})
        except ZygoteGone:
            pass


def _read_child_pid(fd: int, timeout_s: float = 5.0) -> int | None:
    """Parse bwrap's ``--info-fd`` JSON (``{"child-pid": N, ...}``); ``None`` if it does not arrive."""
    data = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and sel.select(left):
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
            try:
                return int(json.loads(data.decode())["child-pid"])
            except (ValueError, KeyError, TypeError):
                continue
    return None


def wipe_tree(path: str | os.PathLike[str]) -> None:
    """Remove a workspace tree, never following symlinks; fixes permissions the sandbox may have removed
    (a directory chmod-ed to 0 by its owner). A missing path is fine."""

    def fix(func: Callable[..., Any], p: str, _exc: object) -> None:
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    if not os.path.lexists(path):
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fix)
    else:
        shutil.rmtree(path, onerror=fix)
