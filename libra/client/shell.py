"""What the two client shells (``sync.Client``, ``aio.AsyncClient``) share: opening the broker socket, making
the :class:`~libra.client.core.ClientCore` they drive, and the core's tables under their old private names."""

from __future__ import annotations

import os
from typing import Any


from libra.transport.endpoints import parse_endpoint
from libra.transport.security import CurveClient

from .common import new_client_id, open_dealer
from .core import ClientCore


class ShellBase:
    """The fields both shells set up the same way; each shell adds its sockets, threads or tasks."""

    _core: ClientCore

    def _open(self, ctx_type: type, broker_url: str, client_id: str | None, max_frame_bytes: int,
              curve: CurveClient | None, direct: bool, last_rx: float = 0.0) -> None:
        self.broker_url = parse_endpoint(broker_url)  # BadAddress (a LibraError) before any socket
        self.client_id = client_id or new_client_id()
        self.max_frame_bytes = max_frame_bytes
        self._ctx = ctx_type()
        self._sock, self._curve, self.endpoint = open_dealer(self._ctx, broker_url, max_frame_bytes, curve)
        # direct calls skip CURVE: an actor's direct socket is plain
        self._core = ClientCore(self.broker_url, self.client_id, os.getpid(), max_frame_bytes, curve=self._curve,
                                direct=direct and not self._curve, last_rx=last_rx)

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


__all__ = ["ShellBase", "WelcomeFlag"]
