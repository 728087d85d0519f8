"""Key files for the key-role tests: a broker pair and one pair per ``(name, role directory)``, each public key
placed in ``allowed/<role directory>/`` as ``libra keys --allow --role`` would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libra.transport.keys import create_keypair


def role_keys(tmp_path: Path, placed: tuple[tuple[str, str], ...]) -> tuple[Path, Path, Any]:
    """``(keys directory, allow directory, the broker's key pair)``."""
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    broker_kp = create_keypair(keys, "broker")
    for name, sub in placed:
        kp = create_keypair(keys, name)
        (allowed / sub).mkdir(parents=True, exist_ok=True)
        (allowed / sub / kp.public_file.name).write_bytes(kp.public_file.read_bytes())
    return keys, allowed, broker_kp
