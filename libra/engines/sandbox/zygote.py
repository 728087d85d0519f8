"""Sandbox zygote: the long-lived process inside one sandbox that forks a fresh child per action.

Role: :mod:`libra.engines.sandbox.proc` runs this file as a program inside a bubblewrap sandbox (bound
read-only at ``/.libra-zygote.py``) with ``python -I -S ZYGOTE CTRL_FD MODE``. It must use the standard library only, import nothing
from ``libra`` and keep no state between actions except the sandbox itself. Paying bwrap's namespace
setup and the interpreter start once per sandbox, instead of once per action, is what makes dispatch warm.

Control protocol over the inherited ``AF_UNIX`` stream socket ``CTRL_FD``: frames are a 4-byte big-endian
length plus a JSON object.

- zygote → pool: ``{"op": "ready", "pid": P}`` once at start.
- pool → zygote: ``{"op": "run", "argv", "env", "cwd", "rlimits", "cpus", "uid", "gid", "files"}``
  with two file descriptors attached (``SCM_RIGHTS``): the write ends of the stdout and stderr pipes.
  The zygote answers ``{"op": "started", "pid": P}`` (P in the
  zygote's PID namespace), then ``{"op": "exit", "status": waitstatus, "cpu_s",
  "maxrss_kb"}`` when the action's process has exited and every leftover process is gone.
- pool → zygote: ``{"op": "kill"}`` kills the running action and everything it started.
- EOF on the socket: the pool is gone; kill everything and exit.

``MODE`` is ``ns`` inside a bubblewrap sandbox: the zygote is PID 1 of a private PID namespace, so the
action cannot signal it (signals from inside a namespace to its init are dropped unless handled), and
cleanup is ``kill(-1, SIGKILL)``: every process of the namespace except the zygote. ``MODE`` is ``pgrp``
when running unisolated on the host: the action is its own session and cleanup kills that process group
(a process that leaves the group escapes it; that mode is not a security boundary).

The child: new session, stdin ``/dev/null``, stdout/stderr on the pipes, every other descriptor closed,
default signal dispositions, then (when ``uid`` is set, i.e. the zygote runs as root) supplementary
groups cleared and uid/gid dropped, which also drops every capability; then umask, CPU affinity, working
directory, the request's files written as that user, the rlimits, and ``execve``. Any failure before
``execve`` is written to stderr and exits with status 127.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import select
import signal
import socket
import struct
import sys

_HEADER = struct.Struct(">I")
_MAX_FDS = 4


class _Channel:
    """Framed JSON messages with attached descriptors over a stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.fds: list[int] = []

    def send(self, obj: dict) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _fill(self) -> bool:
        """Read once; return False on EOF."""
        fds_size = socket.CMSG_SPACE(_MAX_FDS * 4)
        data, anc, _flags, _addr = self.sock.recvmsg(1 << 16, fds_size)
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                self.fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        if not data:
            return False
        self.buf += data
        return True

    def pop(self) -> dict | None:
        """A complete buffered message, or None."""
        if len(self.buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self.buf)
        if len(self.buf) < _HEADER.size + length:
            return None
        body = self.buf[_HEADER.size:_HEADER.size + length]
        self.buf = self.buf[_HEADER.size + length:]
        return json.loads(body)

    def recv(self) -> dict | None:
        """Block until a message arrives; None on EOF."""
        while True:
            msg = self.pop()
            if msg is not None:
                return msg
            if not self._fill():
                return None


def _write_files(files: dict) -> None:
    for path, spec in files.items():
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        data = base64.b64decode(spec["b64"]) if "b64" in spec else spec["text"].encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def _child(req: dict, out_w: int, err_w: int) -> None:
    """In the forked child: set up and exec; never returns."""
    try:
        os.setsid()
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 20)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if req.get("uid") is not None:
            gid = req["gid"]
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(req["uid"], req["uid"], req["uid"])
        os.umask(0o022)
        if req.get("cpus"):
            os.sched_setaffinity(0, req["cpus"])
        os.chdir(req["cwd"])
        _write_files(req.get("files") or {})
        for name, (soft, hard) in req["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.execve(req["argv"][0], req["argv"], req["env"])
    except BaseException as exc:  # noqa: BLE001 - report anything, then die
        try:
            os.write(2, f"libra sandbox: could not start the action: {exc!r}\n".encode())
        finally:
            os._exit(127)


class _Action:
    """One running action: its main pid and, once reaped, its wait status and resource usage."""

    def __init__(self, pid: int, mode: str) -> None:
        self.pid = pid
        self.mode = mode
        self.status: int | None = None
        self.usage: resource.struct_rusage | None = None

    def reap(self, block: bool) -> None:
        """Collect exited children (as PID 1 every orphan of the namespace is ours), noting the main one."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                self.status, self.usage = status, usage

    def kill_all(self) -> None:
        """Kill the action and everything it started; reap what is ours to reap."""
        if self.mode == "ns":
            # Everything in this PID namespace but us. Repeat: a fork bomb may fork while we signal.
            for _ in range(1000):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
                self.reap(block=True)
            self.reap(block=False)
        else:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.status is None:
                self.reap(block=True)


def _run(chan: _Channel, req: dict, mode: str) -> bool:
    """Run one action; False when the pool went away (the zygote should exit)."""
    if len(chan.fds) < 2:
        chan.send({"op": "error", "message": "run request without its two pipe descriptors"})
        return True
    out_w, err_w = chan.fds[0], chan.fds[1]
    del chan.fds[:2]
    pid = os.fork()
    if pid == 0:
        _child(req, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    action = _Action(pid, mode)
    chan.send({"op": "started", "pid": pid})
    pidfd = os.pidfd_open(pid)
    alive = True
    sock_fd = chan.sock.fileno()
    try:
        while action.status is None:
            readable, _, _ = select.select([sock_fd, pidfd], [], [])
            if pidfd in readable:
                action.reap(block=False)
                continue
            if not chan._fill():
                alive = False
                action.kill_all()
                continue
            while True:
                msg = chan.pop()
                if msg is None:
                    break
                if msg.get("op") == "kill":
                    action.kill_all()
    finally:
        os.close(pidfd)
    action.kill_all()
    if alive:
        usage = action.usage
        chan.send({
            "op": "exit",
            "status": action.status,
            "cpu_s": (usage.ru_utime + usage.ru_stime) if usage else 0.0,
            "maxrss_kb": usage.ru_maxrss if usage else 0,
        })
    return alive


def main(argv: list[str]) -> int:
    """Serve run requests until the control socket closes."""
    ctrl_fd, mode = int(argv[1]), argv[2]
    if mode == "pgrp":
        # Unisolated: a signal from the action may reach us; only SIGKILL should be able to stop us.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
    chan = _Channel(socket.socket(fileno=ctrl_fd))
    chan.send({"op": "ready", "pid": os.getpid()})
    while True:
        msg = chan.recv()
        if msg is None:
            return 0
        op = msg.get("op")
        if op == "run":
            if not _run(chan, msg, mode):
                return 0
        elif op == "ping":
            chan.send({"op": "pong"})
        # "kill" with nothing running: nothing to do.


if __name__ == "__main__":
    sys.exit(main(sys.argv))
