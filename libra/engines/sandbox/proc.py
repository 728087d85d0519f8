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
        streams = {"stdout": _Stream(out_r, output_bytes), "stderr": _Stream(err_r, output_bytes)}
        by_fd = {s.fd: (name, s) for name, s in streams.items()}
        outcome = RawOutcome(b"", b"", {"stdout": False, "stderr": False}, None, 0.0)
        deadline = start + timeout_s
        kill_at: float | None = None  # when we asked the zygote to kill
        exit_at: float | None = None  # when the zygote reported the exit
        sel = selectors.DefaultSelector()
        try:
            for s in streams.values():
                sel.register(s.fd, selectors.EVENT_READ)
            sel.register(self.sock, selectors.EVENT_READ)
            while True:
                now = clock()
                pipes_open = any(s.open for s in streams.values())
                if exit_at is not None and (not pipes_open or now >= exit_at + _EOF_GRACE_S):
                    break
                if outcome.sandbox_died and (not pipes_open or (kill_at is not None and now >= kill_at + kill_grace_s)):
                    break
                if outcome.killed is None and now >= deadline:
                    outcome.killed, kill_at = "timeout", now
                    self._request_kill()
                if outcome.killed is None and cancel is not None and cancel.is_set():
                    outcome.killed, kill_at = "cancelled", now
                    self._request_kill()
                if kill_at is not None and exit_at is None and not outcome.sandbox_died \
                        and now >= kill_at + kill_grace_s:
                    self.kill()  # the zygote did not report in time: tear the whole sandbox down
                    outcome.sandbox_died = True
                    break
                if exit_at is not None:
                    wait = exit_at + _EOF_GRACE_S - now
                elif kill_at is not None:
                    wait = kill_at + kill_grace_s - now
                else:
                    wait = deadline - now
                if cancel is not None:
                    wait = min(wait, 0.05)
                for key, _ in sel.select(max(0.0, wait)):
                    if key.fileobj is self.sock:
                        if not self._fill():
                            try:
                                sel.unregister(self.sock)
                            except (KeyError, ValueError, OSError):
                                pass
                            outcome.sandbox_died = True
                            kill_at = kill_at if kill_at is not None else clock()
                        while (msg := self._pop()) is not None:
                            op = msg.get("op")
                            if op == "started" and self.mode == "pgrp":
                                self._action_pgid = msg.get("pid")
                            elif op == "error":  # the zygote refused the request: treat it as broken
                                outcome.sandbox_died = True
                                kill_at = kill_at if kill_at is not None else clock()
                            elif op == "exit":
                                outcome.status = int(msg["status"])
                                outcome.cpu_s = float(msg.get("cpu_s", 0.0))
                                outcome.maxrss_kb = int(msg.get("maxrss_kb", 0))
                                exit_at = clock()
                        continue
                    _, s = by_fd[key.fd]  # type: ignore[index]
                    chunk = os.read(s.fd, _READ_CHUNK)
                    if not chunk:
                        sel.unregister(s.fd)
                        s.open = False
                        continue
                    room = s.cap - len(s.data)
                    if len(chunk) > room:
                        s.data += chunk[:max(0, room)]
                        s.truncated = True
                        if outcome.killed is None:
                            outcome.killed, kill_at = "output_limit", clock()
                            self._request_kill()
                    else:
                        s.data += chunk
        finally:
            sel.close()
            for s in streams.values():
                os.close(s.fd)
            if outcome.sandbox_died:
                self.kill()
            self._action_pgid = None
        outcome.duration_s = clock() - start
        outcome.stdout = bytes(streams["stdout"].data)
        outcome.stderr = bytes(streams["stderr"].data)
        outcome.truncated = {name: s.truncated for name, s in streams.items()}
        return outcome

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
