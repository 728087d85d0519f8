"""Typed refs to bulk data held elsewhere: :class:`DataRef` (one object on a data-plane server) and
:class:`WeightsRef` (a weights version a rollout instance can load: over the data plane, over
torch.distributed, or from a file).

No I/O. Bulk data never goes through the broker: the broker and the work payloads carry only these refs,
and the holder of the ref fetches the bytes peer to peer (``libra.dataplane``). The mapping form is the
one ``libra.dataplane.ObjectRef.to_wire`` writes.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .payloads_base import Payload

__all__ = ["DataRef", "WeightsRef"]

_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


def _check_key(key: str | None) -> None:
    if key is not None and len(key) != 40:
        raise ValueError("field `server_key`: expected 40 Z85 characters (the server's CURVE public key)")


class DataRef(Payload, frozen=True, kw_only=True):
    """One object published on a data-plane server (``libra.dataplane``)."""

    WHAT = "data-plane ref"

    endpoint: str
    """The server's ZeroMQ endpoint (``tcp://host:port``, ``ipc://...`` or ``inproc://...``)."""
    name: Annotated[str, msgspec.Meta(min_length=1)]
    """The object's name on that server (``weights``, ``traj/JOB/gG/I/WORK``, ``batch/stepS/rankR``)."""
    version: int | None = None
    """The object's version (weights: the policy version), or None for unversioned objects."""
    server_key: str | None = None
    """The server's CURVE public key (40 Z85 characters) when the data plane is encrypted, else None."""
    bytes: NonNeg = 0
    """The object's size in bytes (informational: progress and metrics)."""

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(_ENDPOINT_SCHEMES):
            raise ValueError(f"field `endpoint`: expected a tcp://, ipc:// or inproc:// endpoint, got {self.endpoint!r}")
        _check_key(self.server_key)


class WeightsRef(Payload, frozen=True, kw_only=True):
    """A weights version a rollout instance can load between turns.

    Three forms: a data-plane ref (``endpoint``, ``name``, ``server_key``, ``bytes``, and ``delta_from`` when a
    delta from that version is served too: trainer rank 0's
    :class:`~libra.weights.dataplane.DataPlaneWeightPublisher`), a torch.distributed ref (``transport="torch"``,
    ``backend``, ``endpoint`` of the publisher's store: ``libra.weights.torch_dist``), or a file (``path`` of a
    ``libra.weights.file.write_weights_file`` file on shared storage, the documented fallback)."""

    WHAT = "weights ref"
    OMIT_DEFAULT = ("transport", "backend", "path", "delta_from", "delta_bytes", "deltas")

    version: int
    """The policy version these weights are (0 = the initial model)."""
    endpoint: str | None = None
    """Where to fetch them: a data-plane server, or the torch.distributed publisher's store."""
    name: str | None = None
    """The object's name at ``endpoint`` (``weights`` on a data-plane server, ``weights/vN`` for torch)."""
    server_key: str | None = None
    """The data-plane server's CURVE public key, when encrypted."""
    bytes: NonNeg = 0
    """Total size of the weights in bytes."""
    transport: str | None = None
    """``"torch"`` for a torch.distributed ref; None for the data plane or a file."""
    backend: str | None = None
    """The torch.distributed backend (``gloo``/``nccl``) of a torch ref."""
    path: str | None = None
    """A weights file (``libra.weights.file.write_weights_file``) instead of an endpoint."""
    delta_from: NonNeg | None = None
    """A data-plane ref only: the base version of the delta served next to these weights
    (``weights/v{version}/from/v{delta_from}``, ``libra.weights.delta``); None when no delta is served (a ref
    without the field, from an older trainer, is loaded whole)."""
    delta_bytes: NonNeg = 0
    """That delta's size in bytes (informational)."""
    deltas: bool = False
    """A data-plane ref only: the trainer serves deltas to later versions, so a rollout slot keeps this one in
    host memory to receive the next by delta (without it, a slot keeps no copy: a CPU trainer's fp32 versions
    change almost every element, and their deltas are not served)."""

    def __post_init__(self) -> None:
        if self.endpoint is None and self.path is None:
            raise ValueError("field `endpoint`: a weights ref needs an endpoint (or a file path)")
        if self.delta_from is not None and self.delta_from >= self.version:
            raise ValueError(f"field `delta_from`: the delta's base ({self.delta_from}) must be older than the "
                             f"version ({self.version})")
        _check_key(self.server_key)

    @property
    def source(self) -> str:
        """Where the weights come from (the endpoint, else the file path): the back-off key."""
        return str(self.endpoint or self.path)
