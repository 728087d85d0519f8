"""The data plane's typed failures: a lost peer, a missing object, a refused key, a corrupted transfer, an
insecure bind.

Every one is a :class:`DataPlaneError`, whose message names the peer, the object and what went wrong.
"""

from __future__ import annotations

__all__ = ["DataPlaneError", "Forbidden", "InsecureDataPlane", "ObjectNotFound", "PeerLost", "TransferCorrupted"]


class DataPlaneError(RuntimeError):
    """A data-plane transfer failed; the message names the peer, the object and what went wrong."""


class PeerLost(DataPlaneError):
    """The serving peer did not answer within the idle timeout (it died, or is unreachable)."""


class ObjectNotFound(DataPlaneError):
    """The server does not hold (or no longer holds) the requested object."""


class Forbidden(DataPlaneError):
    """The server refused the request for the key's role: a job-scoped client key asked for another job's (or
    an untagged) object, or the key was removed from the allow directory (``libra.dataplane.access``). The
    message names the role and the object's job."""


class TransferCorrupted(DataPlaneError):
    """The bytes arrived but fail the format's checks (CRC-32, sizes, header)."""


class InsecureDataPlane(DataPlaneError, ValueError):
    """A non-loopback bind without CURVE keys and without the explicit insecure opt-in."""
