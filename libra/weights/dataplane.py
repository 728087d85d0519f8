"""The data-plane implementation of the weights transport (:class:`DataPlaneWeightPublisher` on the trainer,
:class:`DataPlaneWeightFetcher` on a rollout instance), the default. The interface and the choice between
transports are in :mod:`libra.weights.transport`; the other implementation is :mod:`libra.weights.torch_dist`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from libra.dataplane.client import fetch
from libra.dataplane.errors import TransferCorrupted
from libra.dataplane.server import DataPlaneServer
from libra.dataplane.wire import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_WINDOW,
    DataPlaneKeys,
    FetchStats,
    ObjectRef,
)
from libra.weights.format import WeightsFormatError
from libra.weights.packed import PackedWeights

__all__ = ["DataPlaneWeightFetcher", "DataPlaneWeightPublisher"]


class DataPlaneWeightPublisher:
    """:class:`~libra.weights.transport.WeightPublisher` over a :class:`DataPlaneServer`: version ``v`` is object ``weights/v{v}`` in
    topic ``weights``; the newest ``keep`` versions stay fetchable (so a fetch of ``v-1`` that started
    before ``v`` was published completes). Each version is tagged with the server's ``default_job`` (the
    trainer sets it from ``TrainArgs.job``), which the server's role checks go by (``libra.dataplane.access``)."""

    TOPIC = "weights"

    def __init__(self, server: DataPlaneServer, *, keep: int = 2, chunk_size: int | None = None) -> None:
        self.server, self.keep, self.chunk_size = server, keep, chunk_size

    def publish(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        ref = self.server.publish_state_dict(f"{self.TOPIC}/v{version}", state_dict, version=version, topic=self.TOPIC,
                                             keep=self.keep, chunk_size=self.chunk_size)
        return ref.to_wire()

    def close(self) -> None:
        """Nothing to release: the server belongs to the trainer role, which closes it."""


class DataPlaneWeightFetcher:
    """:class:`~libra.weights.transport.WeightFetcher` over :func:`~libra.dataplane.client.fetch`; checks every
    chunk and that the header's version is the ref's. The state dict is a
    :class:`~libra.weights.packed.PackedWeights` (the received chunks, verified), which a rollout engine
    decodes straight into its model's tensors."""

    def __init__(self, *, keys: DataPlaneKeys | None = None, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 window: int = DEFAULT_WINDOW) -> None:
        self.keys, self.idle_timeout_s, self.window = keys, idle_timeout_s, window

    def fetch(self, ref: Mapping[str, Any]) -> tuple[PackedWeights, int, FetchStats]:
        r = ObjectRef.from_wire(ref)
        header, chunks, stats = fetch(r, keys=self.keys, idle_timeout_s=self.idle_timeout_s, window=self.window)
        try:
            sd = PackedWeights(header, chunks)
        except WeightsFormatError as exc:
            raise TransferCorrupted(f"data plane {r.endpoint} object {r.name!r}: {exc}") from None
        hdr = sd.header
        if r.version is not None and hdr.version != r.version:
            raise TransferCorrupted(f"data plane {r.endpoint} object {r.name!r}: header says version {hdr.version}, "
                                    f"the ref says {r.version}")
        return sd, int(hdr.version or 0), stats

    def close(self) -> None:
        """Nothing to release: every fetch opens and closes its own socket."""
