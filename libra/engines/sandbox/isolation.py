"""How a sandbox is isolated: bubblewrap discovery and the exact ``bwrap`` command line.

Role: turn facts about the host (where ``bwrap`` is, whether we are root, which interpreter the tools use,
how ``/bin``/``/lib`` are laid out) into the argument vector that starts one sandbox's zygote. The
builder :func:`build_bwrap_argv` is pure; the ``host_*``/``find_*`` helpers read the filesystem.

The sandbox (both modes):

- new PID, network (loopback only), IPC and UTS namespaces, a new mount namespace whose root is a tmpfs;
- read-only binds of ``/usr`` and ``/etc``, ``/bin``/``/lib*`` as the host has them (symlinks into
  ``/usr`` on merged-usr hosts), and the tool interpreter's prefixes (a venv and its base install), with
  their parent directories created ``0755`` so an unprivileged uid can traverse them;
- the workspace bound read-write at :data:`WORKSPACE_MOUNT`, a size-limited private tmpfs ``/tmp`` and
  ``/dev/shm``, a fresh ``/proc`` and a minimal ``/dev``;
- ``--die-with-parent`` (the sandbox dies with the thread that started bwrap: the pool starts every
  sandbox from one long-lived thread), ``--new-session``, ``--clearenv``, ``--as-pid-1`` (the zygote is
  the namespace's init, so the action cannot signal it).

Privileged mode (the pool runs as root; bwrap then does not use a user namespace): all capabilities are
dropped except ``CAP_SETUID``/``CAP_SETGID``/``CAP_KILL`` for the zygote, which starts each action as a
dedicated unprivileged host uid with no capabilities. That is what makes ``RLIMIT_NPROC`` bite (the
kernel never enforces it for uid 0, and a user namespace created by root maps the sandbox to uid 0) and
keeps root-only host files such as ``/etc/shadow`` unreadable.

Unprivileged mode (the pool runs as a normal user): a user namespace maps the sandbox uid 65534 to the
pool's uid; nested user namespaces are disabled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePosixPath

__all__ = [
    "WORKSPACE_MOUNT",
    "ZYGOTE_MOUNT",
    "build_bwrap_argv",
    "bwrap_version",
    "find_bwrap",
    "host_root_links",
    "interpreter_paths",
]

WORKSPACE_MOUNT = "/workspace"
ZYGOTE_MOUNT = "/.libra-zygote.py"
ZYGOTE_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL")
_ROOT_ENTRIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_SYSTEM_RO = ("/usr", "/etc")


def find_bwrap(path: str | None = None) -> str | None:
    """The bubblewrap executable: ``path`` if given and executable, else ``bwrap`` on ``$PATH``."""
    if path:
        return path if os.access(path, os.X_OK) else None
    return shutil.which("bwrap")


def bwrap_version(bwrap: str) -> str:
    """``bwrap --version`` without the program name (``"0.8.0"``); ``"unknown"`` if it does not say."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    words = out.stdout.split()
    return words[-1] if words else "unknown"


def host_root_links(root: str = "/") -> dict[str, str | None]:
    """For ``/bin``, ``/lib``... that exist on the host: the symlink target, or ``None`` for a real dir."""
    found: dict[str, str | None] = {}
    for name in _ROOT_ENTRIES:
        path = os.path.join(root, name)
        if os.path.islink(path):
            found["/" + name] = os.readlink(path)
        elif os.path.isdir(path):
            found["/" + name] = None
    return found


def interpreter_paths(python: str) -> tuple[str, ...]:
    """Directories to bind read-only so ``python`` (possibly a venv over a pyenv build) runs inside.

    That is the venv root (the directory above ``bin/`` holding ``pyvenv.cfg``) if ``python`` is in a
    venv, and the real directory two levels above its resolved executable (the base install); for the
    running interpreter also ``sys.prefix`` and ``sys.base_prefix``."""
    paths: list[str] = []
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        paths += [sys.prefix, sys.base_prefix]
    venv_root = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if os.path.isfile(os.path.join(venv_root, "pyvenv.cfg")):
        paths.append(venv_root)
    paths.append(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths))


def _covered(path: str, roots: Iterable[str]) -> bool:
    p = PurePosixPath(path)
    return any(p == PurePosixPath(r) or PurePosixPath(r) in p.parents for r in roots)


def build_bwrap_argv(
    bwrap: str,
    *,
    workspace: str,
    command: Sequence[str],
    ro_paths: Sequence[str],
    root_links: Mapping[str, str | None],
    privileged: bool,
    tmp_mb: int,
    info_fd: int | None = None,
    ro_files: Mapping[str, str] | None = None,
    hostname: str = "sandbox",
    path_env: str = "/usr/local/bin:/usr/bin:/bin",
) -> list[str]:
    """The full ``bwrap`` argument vector that runs ``command`` in a sandbox over ``workspace``.

    ``ro_paths`` are extra host directories bound read-only at the same path (interpreter prefixes);
    paths under ``/usr`` or ``/etc`` or under another entry are skipped as already visible. ``ro_files``
    maps single host files to a path inside (the zygote program). ``ValueError``
    for a relative path or one that would shadow the workspace mount."""
    for p in (workspace, *ro_paths):
        if not os.path.isabs(p):
            raise ValueError(f"sandbox bind paths must be absolute, got {p!r}")
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if privileged:
        argv += ["--cap-drop", "ALL"]
        for cap in ZYGOTE_CAPS:
            argv += ["--cap-add", cap]
    else:
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
    argv += ["--hostname", hostname, "--die-with-parent", "--new-session", "--as-pid-1"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    for path in _SYSTEM_RO:
        argv += ["--ro-bind", path, path]
    for link, target in sorted(root_links.items()):
        if target is None:
            argv += ["--ro-bind", link, link]
        else:
            argv += ["--symlink", target, link]
    # Fresh /proc, /dev and tmpfs first, so a prefix that lives under /tmp is bound on top of the tmpfs.
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp"]
    argv += ["--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/dev/shm"]
    bound: list[str] = [*_SYSTEM_RO, *(k for k, v in root_links.items() if v is None)]
    made_dirs: set[str] = {"/proc", "/dev", "/tmp", "/dev/shm"}
    for path in sorted(set(ro_paths), key=lambda p: (len(PurePosixPath(p).parts), p)):
        if _covered(path, bound):
            continue
        if _covered(WORKSPACE_MOUNT, [path]) or _covered(path, [WORKSPACE_MOUNT]):
            raise ValueError(f"read-only bind {path!r} would overlap the workspace mount {WORKSPACE_MOUNT}")
        for parent in reversed(PurePosixPath(path).parents):
            sp = str(parent)
            if sp == "/" or sp in made_dirs:
                continue
            argv += ["--perms", "0755", "--dir", sp]
            made_dirs.add(sp)
        argv += ["--ro-bind", path, path]
        bound.append(path)
    for src, dest in (ro_files or {}).items():
        argv += ["--ro-bind", src, dest]
    argv += ["--bind", workspace, WORKSPACE_MOUNT]
    argv += ["--clearenv", "--setenv", "PATH", path_env, "--chdir", "/"]  # the action chdirs itself
    argv += ["--", *command]
    return argv
