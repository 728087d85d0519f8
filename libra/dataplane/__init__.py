"""The actor data plane: bulk bytes (weights, training shards) peer to peer over ZeroMQ, never via the broker.

Role: a producer (trainer rank 0 for weights, the job driver for training shards) publishes named,
immutable objects on a :class:`DataPlaneServer`; a consumer (a rollout instance, a trainer rank) that
was handed an :class:`ObjectRef` through the broker fetches the bytes straight from the producer with
:func:`fetch`. The broker only ever carries the small ref (``{"endpoint", "name", "version",
"server_key", "bytes"}``).

Objects are ``libra.weights.format`` streams: a msgpack header (tensor table + one CRC-32 per chunk)
and the chunks. A state dict is published with :meth:`DataPlaneServer.publish_state_dict`; any other
payload is encoded as a dict of tensors first (see ``libra.rl.shards``).

Wire protocol (``LDP1``; DEALER client → ROUTER server, every message ``[b"LDP1", msgpack map, *raw]``):

- ``{"op": "head", "name"}`` → ``{"ok": True, "op": "head", "name", "version", "n_chunks",
  "total_bytes"}`` followed by one raw frame, the object's header.
- ``{"op": "get", "name", "start", "count"}`` → ``count`` messages ``{"op": "chunk", "name", "index"}``
  each followed by one raw frame, the chunk. **Flow control is credit based** (as in the ZeroMQ
  guide's file-transfer model): the client never has more than ``window`` chunks requested and not yet
  received, so neither side buffers more than ``window`` chunks and the server's send queue never
  reaches its high-water mark.
- ``{"op": "latest", "topic"}`` → ``{"ok": True, "op": "latest", "topic", "name", "version"}``: the
  newest object published under ``topic`` (how an idle rollout instance learns of a new version).
- ``{"op": "ping"}`` → ``{"ok": True, "op": "pong"}``.
- Any failure → ``{"ok": False, "code": "not_found" | "bad_request" | "forbidden", "message"}``;
  ``forbidden``: the sender's key role may not see the object (``head``, ``get``, ``latest``; the message
  names the role and the object's job).

Contracts:

- An object is immutable once published; :meth:`DataPlaneServer.retire` removes it (a transfer in
  flight then fails with :class:`ObjectNotFound`). Publishing under a topic with ``keep=k`` retires
  that topic's older objects beyond the newest ``k``.
- :func:`fetch` returns the header and chunks only after every chunk arrived; :func:`fetch_state_dict`
  also checks every chunk's length and CRC-32. Failures are typed: :class:`PeerLost` (no answer for
  ``idle_timeout_s``: the server died or is unreachable, mid-transfer or before), :class:`ObjectNotFound`,
  :class:`Forbidden` (refused for the key's role), :class:`TransferCorrupted` (bad CRC, wrong size,
  malformed header). A failed fetch has no side effect
  on the caller's state: the caller keeps what it had (a rollout keeps its old weights version).
- Security: when keys are given (:class:`DataPlaneKeys`, normally from the ``LIBRA_CURVE_SECRET``
  key file every actor of a CURVE cluster has) the server is a CURVE server and advertises its public
  key in every ref; clients then connect with CURVE (their own key pair, or an ephemeral one) and a
  plaintext peer cannot connect. The server's key travels only inside refs, i.e. over the broker's
  authenticated channel; ``allow_dir`` adds a ZAP allow-list of client public keys. Without keys the
  server binds only to loopback: any other host raises :class:`InsecureDataPlane` unless
  ``insecure=True``.
- Roles and jobs (:mod:`.access`): every object may carry a job (``publish(..., job=)``; a ``traj/JOB/...``
  name is job JOB; else the server's ``default_job``, which a trainer sets from ``TrainArgs.job``). A CURVE
  server with an ``allow_dir`` (actors: ``$LIBRA_CURVE_ALLOW``, the broker's ``--curve-allow`` layout) reads
  each request's key role from it: actor, operator, ``any`` and unscoped client keys see every object; a
  job-scoped client key (``clients/JOB/``) sees only job JOB's objects (untagged ones are refused); a key
  removed from the directory sees nothing (the directory is re-read at most once a second). A refusal is
  answered ``forbidden``, logged (``dataplane_refused``) and counted (``DataPlaneServer.refused``). Without
  keys or without an allow directory nothing is checked. Context objects (``ctx/...``) are untagged: only
  unscoped keys (the rollout instances' actor keys) fetch them. The ``torch.distributed`` weights transport
  checks nothing of this (its peers are the trainer's gloo/NCCL group).

Weights ride on this data plane through :mod:`libra.weights` (the weights package: the stream format, the
transport interface and both of its implementations, this one and ``torch.distributed``).

Modules: :mod:`.errors` (the typed failures), :mod:`.access` (job tags and key roles), :mod:`.wire` (protocol tag, message packing, :class:`ObjectRef`,
:class:`FetchStats`, :class:`DataPlaneKeys`), :mod:`.server` (:class:`DataPlaneServer`), :mod:`.client`
(:func:`fetch`, :func:`fetch_state_dict`, :func:`latest`). This package re-exports their public names; the submodules
import one another, never the package.
"""

from __future__ import annotations

from libra.dataplane.access import ALLOW_ENV as ALLOW_ENV
from libra.dataplane.access import allow_dir_from_env, job_of_name
from libra.dataplane.client import fetch, fetch_state_dict, latest
from libra.dataplane.errors import (
    DataPlaneError,
    Forbidden,
    InsecureDataPlane,
    ObjectNotFound,
    PeerLost,
    TransferCorrupted,
)
from libra.dataplane.server import HOST_ENV as HOST_ENV
from libra.dataplane.server import INSECURE_ENV as INSECURE_ENV
from libra.dataplane.server import DataPlaneServer
from libra.dataplane.wire import DEFAULT_IDLE_TIMEOUT_S as DEFAULT_IDLE_TIMEOUT_S
from libra.dataplane.wire import DEFAULT_WINDOW as DEFAULT_WINDOW
from libra.dataplane.wire import PROTO as PROTO
from libra.dataplane.wire import DataPlaneKeys, FetchStats, ObjectRef

__all__ = [
    "DataPlaneError",
    "DataPlaneKeys",
    "DataPlaneServer",
    "FetchStats",
    "Forbidden",
    "InsecureDataPlane",
    "ObjectNotFound",
    "ObjectRef",
    "PeerLost",
    "TransferCorrupted",
    "allow_dir_from_env",
    "fetch",
    "fetch_state_dict",
    "job_of_name",
    "latest",
]
