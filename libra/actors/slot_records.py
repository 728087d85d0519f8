"""An actor slot's record file in the run directory: ``RUN/actors/<record name>.json``.

Contracts:
- A record is keyed by the actor's identity, not its slot name alone: slots on several hosts (Slurm, ``libra
  run --broker``) share one run directory and each host has its own ``cpu0``. The identity is the actor id
  (``HOST/SLOT`` by default, ``HOST/PREFIX-SLOT`` under ``--actor-id-prefix``, or ``--actor-id``); the file
  name is that id percent-encoded (:func:`urllib.parse.quote`, ``/`` becomes ``%2F`` and ``.`` ``%2E``): file-name-safe,
  distinct for distinct ids, and read back with :func:`actor_of_record`.
- Every record holds ``actor_id`` and ``host`` besides the writer's fields (``slot``, ``role``, ``pid``...).
- Writes are atomic (a temporary file, then :func:`os.replace`): a reader never sees half a record.
- :func:`read_slot_records` returns ``{actor id: record}`` of every readable record (a file being replaced or
  not JSON is left out; the next read sees it).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

__all__ = ["RECORDS_DIR", "actor_of_record", "default_actor_id", "read_slot_records", "record_name",
           "slot_record_path", "write_slot_record"]

RECORDS_DIR = "actors"  # under the run directory


def default_actor_id(slot: str) -> str:
    """The id a slot's runtime takes without ``--actor-id``: ``HOST/SLOT`` (as ``libra.actors.runtime``)."""
    return f"{socket.gethostname()}/{slot}"


def record_name(actor_id: str) -> str:
    """The record file's name (no directory) for ``actor_id``; raises ValueError for an empty id."""
    if not actor_id:
        raise ValueError("an actor record needs a non-empty actor id")
    # quote() never encodes '.': done here, so no name is hidden or '..' (host names keep their dots as %2E)
    return quote(actor_id, safe="-_@+=,").replace(".", "%2E") + ".json"


def actor_of_record(path: str | Path) -> str:
    """The actor id a record file's name stands for (inverse of :func:`record_name`)."""
    name = Path(path).name
    return unquote(name[:-5] if name.endswith(".json") else name)


def slot_record_path(run_dir: str | Path, slot: str, actor_id: str | None = None) -> Path:
    """``RUN/actors/<record name>.json`` of ``actor_id`` (default: :func:`default_actor_id` of ``slot``)."""
    return Path(run_dir) / RECORDS_DIR / record_name(actor_id or default_actor_id(slot))


def write_slot_record(run_dir: str | Path, slot: str, record: dict[str, Any], actor_id: str | None = None) -> Path:
    """Write ``record`` (plus ``actor_id`` and ``host``) as the actor's record file, atomically; returns its path."""
    aid = actor_id or default_actor_id(slot)
    path = slot_record_path(run_dir, slot, aid)
    path.parent.mkdir(parents=True, exist_ok=True)
    host = aid.split("/", 1)[0] if "/" in aid else socket.gethostname()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**record, "actor_id": aid, "host": host, "slot": record.get("slot", slot)}))
    os.replace(tmp, path)
    return path


def read_slot_records(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """``{actor id: record}`` of the run's record files (unreadable ones left out), in file-name order."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted((Path(run_dir) / RECORDS_DIR).glob("*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out[str(rec.get("actor_id") or actor_of_record(f))] = rec
    return out
