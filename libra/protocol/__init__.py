"""Libra's wire protocol: typed messages (``messages``), the codec (``codec``) and error codes.

No I/O here. Import messages from ``libra.protocol.messages`` and ``encode``/``decode`` from here.
"""

from __future__ import annotations

from .codec import (DEFAULT_MAX_FRAME_BYTES, VERSION, Decoded, decode, decode_many, encode, encode_batch, encode_many,
                    kind_name)
from .errors import ErrorCode, ProtocolCode, ProtocolError

# Liveness defaults (7/MDP style). Sent to peers in Welcome so both sides use the same numbers.
HEARTBEAT_S = 1.0  # send a heartbeat when nothing else was sent for this long
LIVENESS = 3  # a peer is dead after this many silent intervals

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "VERSION", "Decoded", "decode", "decode_many", "encode", "encode_batch", "encode_many",
    "kind_name",
    "ErrorCode", "ProtocolCode", "ProtocolError", "HEARTBEAT_S", "LIVENESS",
]
