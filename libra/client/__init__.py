"""Client API for environment authors: ``from libra.client import Client``.

``Client(broker_url).call_tool(tool, args, trajectory=None, timeout=...)`` returns a
:class:`ToolResult`; failures raise subclasses of :class:`LibraError`. The asyncio twin is
``libra.client.aio.AsyncClient``.
"""

from __future__ import annotations

from .common import ToolResult
from .errors import (BadAddress, BadRequest, BrokerUnreachable, Busy, Cancelled, Forbidden, LibraError,
                     PayloadTooLarge, ProtocolRejected, ToolFailed, ToolTimeout, UnknownTool, WorkLost)
from .sync import Client

__all__ = [
    "Client", "ToolResult", "LibraError", "UnknownTool", "ToolTimeout", "ToolFailed", "WorkLost", "Busy",
    "Cancelled", "BadRequest", "PayloadTooLarge", "BrokerUnreachable", "ProtocolRejected", "BadAddress",
    "Forbidden",
]
