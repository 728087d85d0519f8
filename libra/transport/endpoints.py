"""Which transport a peer uses to reach the broker: ``ipc://`` on the broker's host, TCP across hosts.

A broker bound at ``tcp://HOST:PORT`` also binds the same ROUTER socket at a Unix socket path derived from
the port (:func:`ipc_path_for_port`, in a per-user directory created with mode 0700). An actor or client
given a loopback TCP endpoint (``tcp://127.x.x.x:PORT``, ``tcp://localhost:PORT``, ``tcp://[::1]:PORT``)
connects to that path instead when a broker is listening on it (:func:`resolve`): a Unix-socket hop
skips the loopback TCP stack. Any other endpoint, an explicit ``ipc://`` one included, is used as given.
``LIBRA_IPC=0`` turns the switch off on either side (the broker then binds no path; peers keep TCP).

Security is unchanged: the ipc endpoint is a second address of the same socket, so a broker started with
CURVE keys authenticates and encrypts ipc peers exactly as TCP ones (the mechanism is per socket, not per
transport), and the directory's 0700 mode keeps other local users from connecting at all.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

_LOOPBACK_NAMES = ("localhost", "::1")


def ipc_enabled() -> bool:
    """False when ``LIBRA_IPC`` is ``0``/``off``/``false``/``no``."""
    return os.environ.get("LIBRA_IPC", "1").strip().lower() not in ("0", "off", "false", "no")


def ipc_dir() -> Path:
    """The per-user directory of broker ipc sockets: ``$LIBRA_IPC_DIR`` or ``<tmp>/libra-ipc-<uid>``."""
    d = os.environ.get("LIBRA_IPC_DIR")
    return Path(d) if d else Path(tempfile.gettempdir()) / f"libra-ipc-{os.getuid()}"


def ipc_path_for_port(port: int) -> Path:
    """The Unix socket path a broker whose TCP port is ``port`` binds."""
    return ipc_dir() / f"broker-{port}.sock"


def tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    """The host (IPv6 brackets removed) and port of a ``tcp://host:port`` endpoint, else None (wildcard ``*``
    ports included)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, port = _host_port(endpoint[len("tcp://"):])
    if port is None or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def tcp_port(endpoint: str) -> int | None:
    """The port of a ``tcp://host:port`` endpoint, else None (wildcard ``*`` ports included)."""
    hp = tcp_host_port(endpoint)
    return hp[1] if hp else None


def is_loopback_tcp(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in _LOOPBACK_NAMES or host.startswith("127.")


def broker_ipc_endpoint(bound_tcp: str) -> str | None:
    """The ipc endpoint a broker bound at ``bound_tcp`` (its resolved ``LAST_ENDPOINT``) should also bind,
    or None (switched off, or not a TCP endpoint). Creates the 0700 directory and removes a stale path."""
    port = tcp_port(bound_tcp)
    if port is None or not ipc_enabled():
        return None
    host = bound_tcp[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if not (is_loopback_tcp(bound_tcp) or host in ("*", "0.0.0.0", "::")):
        return None  # bound to one external address: loopback peers cannot reach it by TCP either
    path = ipc_path_for_port(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.parent.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path.parent, 0o700)  # raises if the directory is someone else's: then no ipc
    if len(str(path).encode()) > 100:  # sun_path is 108 bytes with its NUL; leave room
        return None
    return f"ipc://{path}"


def forget_ipc(bound_tcp: str) -> None:
    """Remove a stale ipc path for ``bound_tcp``'s port (a broker started without ipc calls it, so no peer
    is sent to a path nobody serves; libzmq removes the path itself when a broker closes cleanly)."""
    port = tcp_port(bound_tcp)
    if port is None or _listening(ipc_path_for_port(port)):
        return  # nothing there, or a live broker's (never take another broker's path away)
    try:
        ipc_path_for_port(port).unlink()
    except (FileNotFoundError, PermissionError):
        pass


def _listening(path: Path) -> bool:
    """A Unix socket at ``path`` accepts connections (not a stale file left by a killed broker)."""
    try:
        if not stat.S_ISSOCK(path.stat().st_mode):
            return False
    except OSError:
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def resolve(endpoint: str) -> str:
    """The endpoint to connect to for ``endpoint``: the broker's ipc path when ``endpoint`` is loopback TCP
    and a broker listens there, else ``endpoint`` itself."""
    if not is_loopback_tcp(endpoint) or not ipc_enabled():
        return endpoint
    port = tcp_port(endpoint)
    if port is None:
        return endpoint
    path = ipc_path_for_port(port)
    return f"ipc://{path}" if _listening(path) else endpoint


# ---------------------------------------------------------------------------------------------- validation
#: What every Libra address may be (said in each :class:`~libra.client.errors.BadAddress` message).
ACCEPTED = ("tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555), ipc://PATH (a Unix socket on this host) "
            "or inproc://NAME (inside one process)")
DEFAULT_PORT = 5555  # the broker's default port, used in a suggestion when an address has none
_NOUN = {"connect": "broker address", "bind": "bind address"}


def _tcp_problem(rest: str, role: str) -> tuple[str, str | None]:
    """What is wrong with the ``HOST:PORT`` of a tcp address (``""``: nothing) and a corrected address."""
    host, port = _host_port(rest)
    if not host:
        return "it names no host", None
    if port is None:
        return "it has no port", f"tcp://{host}:{DEFAULT_PORT}"
    if role == "bind" and port in ("*", "0"):
        return "", None  # any free port
    if role == "connect" and host == "*":
        return "'*' (every interface) is for a bind: connect to the broker's host", f"tcp://127.0.0.1:{port}"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"its port {port!r} is not a number from 1 to 65535", f"tcp://{host}:{DEFAULT_PORT}"
    return "", None


def _host_port(rest: str) -> tuple[str, str | None]:
    """``HOST:PORT`` (an IPv6 host in brackets) split; the port is None when there is none."""
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            return "", None
        host, tail = rest[: close + 1], rest[close + 1:]
        return host, tail[1:] if tail.startswith(":") else None
    host, sep, port = rest.rpartition(":")
    return (host, port) if sep else (rest, None)


def _guess(rest: str) -> str:
    """The tcp address a scheme-less or wrong-scheme address most likely meant (its path dropped)."""
    hostport = rest.split("/", 1)[0]
    host, port = _host_port(hostport)
    return f"tcp://{host or '127.0.0.1'}:{port if port and port.isdigit() else DEFAULT_PORT}"


def address_problem(addr: object, role: str = "connect") -> str | None:
    """Why ``addr`` is not an address a Libra socket can ``role`` (``connect`` or ``bind``) to, in one
    sentence that names it, says what is accepted and suggests the fix; None when it is fine. Pure."""
    noun = _NOUN[role]
    if not isinstance(addr, str) or not addr.strip():
        return f"bad {noun} {addr!r}: it is empty. Libra takes {ACCEPTED}."
    why, fix = "", None
    scheme, sep, rest = addr.partition("://")
    if addr != addr.strip():
        why, fix = "it has spaces around it", addr.strip()
    elif not sep:
        path_like = addr.startswith(("/", "./", "~"))
        why, fix = "it has no scheme", (f"ipc://{addr}" if path_like else _guess(addr))
    elif scheme == "tcp":
        why, fix = _tcp_problem(rest, role)
    elif scheme in ("ipc", "inproc"):
        why = "" if rest else f"it names no {'path' if scheme == 'ipc' else 'name'}"
    elif scheme.lower() in ("tcp", "ipc", "inproc"):
        why, fix = f"the scheme {scheme!r} must be lower case", f"{scheme.lower()}://{rest}"
    else:
        why, fix = f"{scheme}:// is not a ZeroMQ transport Libra speaks", _guess(rest)
    if not why:
        return None
    return f"bad {noun} {addr!r}: {why}" + (f"; did you mean {fix}?" if fix else ".") + f" Libra takes {ACCEPTED}."


def parse_endpoint(addr: str, role: str = "connect") -> str:
    """``addr`` when a Libra socket can ``role`` (``connect`` or ``bind``) to it, else
    :class:`libra.client.errors.BadAddress` (a ``LibraError`` and a ``ValueError``) with
    :func:`address_problem`'s message: raised before any socket is made, instead of libzmq's bare
    ``Invalid argument`` or ``Protocol not supported``."""
    problem = address_problem(addr, role)
    if problem is not None:
        from libra.client.errors import BadAddress  # lazy: libra.client imports this module

        raise BadAddress(problem, address=addr if isinstance(addr, str) else repr(addr))
    return addr


def split_endpoints(addrs: object) -> list[object]:
    """The items of a broker address list: ``"tcp://A:5555,tcp://B:5555"`` (one string, as flags, env vars
    and TOML give it) split at its commas, or a list/tuple as given. Pure; nothing is checked here."""
    if isinstance(addrs, (list, tuple)):
        return list(addrs)
    if isinstance(addrs, str) and "," in addrs:
        return addrs.split(",")
    return [addrs]


def endpoints_problem(addrs: object, role: str = "connect") -> str | None:
    """Why ``addrs`` (one address or a list: :func:`split_endpoints`) is not a list of addresses a socket can
    ``role`` to, naming the bad item and its place; None when every item is fine. One address: exactly
    :func:`address_problem`'s sentence."""
    items = split_endpoints(addrs)
    if len(items) == 1:
        return address_problem(items[0], role)
    if not items:
        return address_problem("", role)
    for i, item in enumerate(items, 1):
        problem = address_problem(item, role)
        if problem is not None:
            return f"item {i} of {len(items)} in the address list {addrs!r}: {problem}"
    return None


def parse_endpoints(addrs: object, role: str = "connect") -> list[str]:
    """The addresses of ``addrs`` (``"tcp://A:5555,tcp://B:5555"``, a list or tuple, or one address) in
    order, each checked as :func:`parse_endpoint` does; :class:`libra.client.errors.BadAddress` naming the
    bad item otherwise. The first is the broker tried first; the rest are tried in turn when it is silent."""
    problem = endpoints_problem(addrs, role)
    if problem is not None:
        from libra.client.errors import BadAddress  # lazy: libra.client imports this module

        raise BadAddress(problem, address=addrs if isinstance(addrs, str) else repr(addrs))
    return [str(a) for a in split_endpoints(addrs)]
