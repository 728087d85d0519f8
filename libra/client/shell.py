"""What the two client shells (``sync.Client``, ``aio.AsyncClient``) share: the socket setup every client uses,
opening the broker socket, making the :class:`~libra.client.core.ClientCore` they drive, and the core's tables
under their old private names."""

from __future__ import annotations

import os
import uuid
from typing import Any

import zmq

from libra.transport.endpoints import parse_endpoints
from libra.transport.security import CurveClient
from libra.transport.zmqio import configure_dealer, connect_dealer

from .common import unreachable
from .core import ClientCore
from .probe import port_accepts


#: messages a client's socket queues each way (a burst of submits waits here, not in the caller)
CLIENT_HWM = 1_000_000


def new_client_id() -> str:
    return f"c-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def configure_socket(sock: zmq.Socket, max_frame_bytes: int, curve: CurveClient | None = None) -> bool:
    """Socket options every client uses; CURVE keys when ``curve`` (or the LIBRA_CURVE_* env) is set.
    Returns whether the connection uses CURVE."""
    curve = curve or CurveClient.from_env()
    configure_dealer(sock, identity_prefix=b"c-", max_frame_bytes=max_frame_bytes, hwm=CLIENT_HWM, curve=curve)
    return curve is not None


def open_dealer(ctx: zmq.Context, broker_url: str, max_frame_bytes: int,
                curve: CurveClient | None) -> tuple[zmq.Socket, bool, str]:
    """A client's DEALER socket to the broker, configured (:func:`configure_socket`) and connected:
    ``(socket, whether it uses CURVE, the endpoint connected to)`` (the broker's ipc path when it is on this
    host: ``libra.transport.endpoints.resolve``)."""
    curve = curve or CurveClient.from_env()
    sock, endpoint = connect_dealer(ctx, broker_url, identity_prefix=b"c-", max_frame_bytes=max_frame_bytes,
                                    hwm=CLIENT_HWM, curve=curve)
    return sock, curve is not None, endpoint


class ShellBase:
    """The fields both shells set up the same way; each shell adds its sockets, threads or tasks."""

    _core: ClientCore

    def _open(self, ctx_type: type, broker_url: str | list[str] | tuple[str, ...], client_id: str | None,
              max_frame_bytes: int, curve: CurveClient | None, direct: bool, last_rx: float = 0.0) -> None:
        # one address, or a list (``"tcp://A:5555,tcp://B:5555"``, a list or tuple): BadAddress before any socket
        self.broker_urls = parse_endpoints(broker_url)
        self.broker_url = self.broker_urls[0]  # the one in use (the core moves on when it is silent)
        self.client_id = client_id or new_client_id()
        self.max_frame_bytes = max_frame_bytes
        self._ctx = ctx_type()
        self._curve_keys = curve
        self._sock, self._curve, self.endpoint = open_dealer(self._ctx, self.broker_url, max_frame_bytes, curve)
        # direct calls skip CURVE: an actor's direct socket is plain
        self._core = ClientCore(self.broker_url, self.client_id, os.getpid(), max_frame_bytes, curve=self._curve,
                                direct=direct and not self._curve, last_rx=last_rx, urls=self.broker_urls)

    def _reopen(self, url: str) -> Any:
        """A new broker socket to ``url`` (the core's :class:`~libra.client.core.MoveBroker`): becomes
        ``_sock``; returns the old one, for the shell to unregister and close."""
        old = self._sock
        self._sock, _, self.endpoint = open_dealer(self._ctx, url, self.max_frame_bytes, self._curve_keys)
        self.broker_url = url
        return old

    def _unreachable(self, waited: float) -> str:
        """Why no broker of the address list welcomed us within ``waited`` seconds (every address named)."""
        named = self.broker_url if len(self.broker_urls) == 1 else " or ".join(self.broker_urls)
        return unreachable(named, self._curve, waited, port_accepts(",".join(self.broker_urls)))

    @property
    def _pending(self) -> dict:
        return self._core.pending

    @property
    def _deadlines(self) -> list:
        return self._core.deadlines

    @property
    def _gate(self) -> Any:
        return self._core.gate

    @property
    def _direct(self) -> Any:
        return self._core.direct

    @property
    def _ping_s(self) -> float:
        return self._core.ping_s

    @_ping_s.setter
    def _ping_s(self, value: float) -> None:
        self._core.ping_s = value


class WelcomeFlag:
    """Mixin for a shell's connected flag (a ``threading.Event`` or an ``asyncio.Event``): ``set``/``clear``
    also write the core's ``welcomed``, which picks BrokerUnreachable or ToolTimeout for a call that times out."""

    def __init__(self, core: ClientCore) -> None:
        super().__init__()
        self._core = core

    def set(self) -> None:
        self._core.welcomed = True
        super().set()  # type: ignore[misc]

    def clear(self) -> None:
        self._core.welcomed = False
        super().clear()  # type: ignore[misc]


__all__ = ["ShellBase", "WelcomeFlag", "configure_socket", "open_dealer"]
