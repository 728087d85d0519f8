"""The broker shell's side of key roles (``libra.broker.roles``): under CURVE, the role of each message's key
(the connection's ZAP user id) as the allow directory was last read, which peers said hello with which key,
and, every heartbeat interval, the peers whose key was removed since (for ``RevokePeers``)."""

from __future__ import annotations

from typing import Any

from .roles import REVOKED

__all__ = ["PEER_KEYS_MAX", "REVOKED_WHY", "KeyWatch"]

# hellos remembered with their CURVE key: the peers a removed key disconnects. Past this many the oldest half
# is forgotten; a peer forgotten that way is still refused once its key is removed, only not told so at once.
PEER_KEYS_MAX = 1_000_000
REVOKED_WHY = "its key was removed from the allow directory"


class KeyWatch:
    """``auth``: the broker's :class:`~libra.transport.security.Authenticator` (``roles``, ``refresh()``)."""

    def __init__(self, auth: Any, every_s: float, now: float) -> None:
        self.auth, self.every_s, self.next_check = auth, every_s, now + every_s
        self.peer_keys: dict[bytes, str] = {}

    def role(self, key: str) -> str:
        """The role of ``key`` now (``revoked`` once it has left the allow directory)."""
        return self.auth.roles.get(key, REVOKED)

    def hello(self, peer: bytes, key: str) -> None:
        """``peer`` said hello with ``key``: it is disconnected if the key is removed."""
        self.peer_keys[peer] = key
        if len(self.peer_keys) > PEER_KEYS_MAX:  # bounded: the oldest hellos go first
            for old in list(self.peer_keys)[:PEER_KEYS_MAX // 2]:
                del self.peer_keys[old]

    def revoked(self, now: float) -> dict[str, tuple[bytes, ...]]:
        """Every ``every_s``: re-read the allow directory if it changed; each key removed since, with the peers
        that said hello with it (none: a key nobody used)."""
        if now < self.next_check:
            return {}
        self.next_check = now + self.every_s
        removed = self.auth.refresh()
        gone: dict[str, tuple[bytes, ...]] = {k: () for k in sorted(removed)}
        for p, k in list(self.peer_keys.items()):
            if k in removed:
                gone[k] += (p,)
                del self.peer_keys[p]
        return gone
