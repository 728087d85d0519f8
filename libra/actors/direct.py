"""The actor's side of direct leases: which ``DirectCall``\\s it answers itself, and where it listens for them.

The broker grants a client a lease on a tool this actor runs inline (``LeaseGrant``; see
``libra.broker.direct_leases``); the client then sends ``DirectCall``\\s to this actor's direct socket, a ROUTER
bound next to its broker connection. :class:`DirectLeaseTable` is the pure part: the leases held, whether a
call may run (a lease this actor holds, for a tool it runs inline), and the counts reported to the broker.
A call on a lease it does not hold (ended, or granted by a broker session that is gone) is refused with
``lease_ended`` before anything runs, so the client can send it through the broker without running it twice.

:func:`bind_direct` binds the socket: TCP on the address this host uses to reach the broker (loopback for a
local broker, never a wildcard), plus an ipc path for clients on the same host (``libra.transport.endpoints``). A
broker with CURVE keys gets no direct socket: its clients' keys are checked by the broker only.
"""

from __future__ import annotations

import os
import socket
import uuid

import zmq

from libra.transport.endpoints import ipc_dir, ipc_enabled, is_loopback_tcp
from libra.protocol import messages as m
from libra.transport.zmqio import bind_ipc

__all__ = ["DirectLeaseTable", "bind_direct"]


class DirectLeaseTable:
    """Leases this actor holds (pure). ``tools``: the tool names it runs inline."""

    def __init__(self, tools: frozenset[str]) -> None:
        self.tools = tools
        self.live: dict[str, str] = {}  # lease id -> tool
        self._counts: dict[str, list[int]] = {}  # lease id -> [done, failed] not yet reported

    def grant(self, msg: m.LeaseGrant) -> m.LeaseReady:
        if msg.kind != "action" or msg.name not in self.tools:
            return m.LeaseReady(msg.lease_id, False, f"{msg.kind} {msg.name!r} does not run inline here")
        self.live[msg.lease_id] = msg.name
        return m.LeaseReady(msg.lease_id)

    def end(self, lease_id: str) -> None:
        self.live.pop(lease_id, None)

    def clear(self) -> None:
        """A new broker session (it knows no lease of the old one) or a role change: hold none."""
        self.live.clear()

    def refusal(self, call: m.DirectCall) -> str:
        """Why ``call`` may not run here ("" when it may)."""
        tool = self.live.get(call.lease_id)
        if tool is None:
            return f"lease {call.lease_id} is not held by this actor (it ended)"
        if call.kind != "action" or call.name != tool:
            return f"lease {call.lease_id} is for {tool!r}, not {call.kind} {call.name!r}"
        return ""

    def count(self, lease_id: str, ok: bool) -> None:
        c = self._counts.get(lease_id)
        if c is None:
            c = self._counts[lease_id] = [0, 0]
        c[0 if ok else 1] += 1

    def reports(self) -> list[m.LeaseReport]:
        """What was answered since the last call, one report per lease."""
        out = [m.LeaseReport(lid, done, failed) for lid, (done, failed) in self._counts.items()]
        self._counts.clear()
        return out


def _route_address(broker_endpoint: str) -> str | None:
    """This host's address toward the broker of ``broker_endpoint`` (tcp), None for other transports."""
    if not broker_endpoint.startswith("tcp://"):
        return None
    host = broker_endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if is_loopback_tcp(broker_endpoint) or host in ("*", "0.0.0.0"):
        return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only picks the route's source address
            return s.getsockname()[0]
    except OSError:
        return None


def bind_direct(sock: zmq.Socket, broker_url: str) -> dict[str, str]:
    """Bind ``sock`` for direct calls; returns the labels to advertise (``direct``: tcp endpoint,
    ``direct_ipc``: ipc endpoint or absent). Empty when no address could be bound."""
    labels: dict[str, str] = {}
    addr = _route_address(broker_url)
    if addr is not None:
        host = f"[{addr}]" if ":" in addr else addr
        port = sock.bind_to_random_port(f"tcp://{host}")
        labels["direct"] = f"tcp://{host}:{port}"
    if ipc_enabled():
        d = ipc_dir()
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = d / f"actor-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
            if len(str(path).encode()) <= 100:
                labels["direct_ipc"] = bind_ipc(sock, path)  # its file is removed by zmqio.close_socket
        except (OSError, zmq.ZMQError):
            pass
    return labels
