"""The data-plane implementation of the weights transport (:class:`DataPlaneWeightPublisher` on the trainer,
:class:`DataPlaneWeightFetcher` on a rollout instance), the default. The interface and the choice between
transports are in :mod:`libra.weights.transport`; the other implementation is :mod:`libra.weights.torch_dist`.

Delta sync (on unless ``$LIBRA_WEIGHTS_DELTA=0``): the publisher keeps the previous version's packed chunks
(the same bytes its server still serves) and, next to ``weights/v{N}``, serves
``weights/v{N}/from/v{M}`` (:mod:`libra.weights.delta`, topic ``weights_delta``, the newest ``keep``) when
that delta is at most ``delta_max_ratio`` of the full object; the ref it returns then names the base
(``delta_from``, ``delta_bytes``). A fetcher given a :class:`~libra.weights.host_copy.HostWeights` fetches the
delta when it holds exactly ``delta_from`` from that endpoint, takes the version from host memory when it
already holds it, and otherwise, or when the delta fails (fetch error, wrong base, checksum), the full object.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from libra.dataplane.client import fetch
from libra.dataplane.errors import DataPlaneError, TransferCorrupted
from libra.dataplane.server import DataPlaneServer
from libra.dataplane.wire import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_WINDOW,
    DataPlaneKeys,
    ObjectRef,
)
from libra.weights.delta import apply_delta, delta_enabled, delta_name, encode_delta
from libra.weights.format import DEFAULT_CHUNK_SIZE, WeightsFormatError, pack_state_dict
from libra.weights.host_copy import HostWeights, SyncStats
from libra.weights.packed import PackedWeights

__all__ = ["DataPlaneWeightFetcher", "DataPlaneWeightPublisher"]


class DataPlaneWeightPublisher:
    """:class:`~libra.weights.transport.WeightPublisher` over a :class:`DataPlaneServer`: version ``v`` is object ``weights/v{v}`` in
    topic ``weights``; the newest ``keep`` versions stay fetchable (so a fetch of ``v-1`` that started
    before ``v`` was published completes). Each version is tagged with the server's ``default_job`` (the
    trainer sets it from ``TrainArgs.job``), which the server's role checks go by (``libra.dataplane.access``).
    ``delta`` (default ``$LIBRA_WEIGHTS_DELTA``, on): also serve the delta from the previous version (see the
    module docstring); :attr:`last_delta` is the newest delta's :class:`~libra.weights.delta.DeltaSummary`
    and :attr:`last_delta_s` the seconds its encoding took."""

    TOPIC = "weights"
    DELTA_TOPIC = "weights_delta"
    SKIP_AFTER = 2
    PROBE_EVERY = 16

    def __init__(self, server: DataPlaneServer, *, keep: int = 2, chunk_size: int | None = None,
                 delta: bool | None = None, delta_max_ratio: float = 0.9) -> None:
        self.server, self.keep, self.chunk_size = server, keep, chunk_size
        self.delta = delta_enabled() if delta is None else delta
        self.delta_max_ratio = delta_max_ratio
        self._prev: PackedWeights | None = None
        self.last_delta: Any = None
        self.last_delta_s = 0.0
        # deltas too big to serve in a row (an fp32 export changes ~99 % of its elements a step): after
        # SKIP_AFTER of them the publisher stops paying the encode, trying again every PROBE_EVERY versions
        self.unserved = 0
        self.skipped = 0

    def publish(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        cs = self.chunk_size or DEFAULT_CHUNK_SIZE
        header, chunks = pack_state_dict(state_dict, version=version, chunk_size=cs)
        ref = self.server.publish(f"{self.TOPIC}/v{version}", header, chunks, version=version, topic=self.TOPIC,
                                  keep=self.keep)
        wire = ref.to_wire()
        if not self.delta:
            return wire
        new = PackedWeights.from_verified(header, chunks)  # packed here: nothing to check again
        prev, self._prev = self._prev, new
        if self.unserved >= self.SKIP_AFTER and version % self.PROBE_EVERY:
            self.skipped += 1
            return wire
        wire["deltas"] = True  # a slot keeps this version to take the next one by delta
        if prev is not None and isinstance(prev.version, int) and prev.version < version:
            t0 = time.perf_counter()
            dh, dc, summary = encode_delta(prev, new, chunk_size=cs)
            self.last_delta, self.last_delta_s = summary, time.perf_counter() - t0
            if summary.delta_bytes <= self.delta_max_ratio * max(1, summary.full_bytes):
                self.server.publish(delta_name(version, prev.version), dh, dc, version=version,
                                    topic=self.DELTA_TOPIC, keep=self.keep)
                wire.update(delta_from=prev.version, delta_bytes=summary.delta_bytes)
                self.unserved = 0
            else:
                self.unserved += 1
        return wire

    def close(self) -> None:
        """Drops the previous version kept for deltas; the server belongs to the trainer role, which closes it."""
        self._prev = None


class DataPlaneWeightFetcher:
    """:class:`~libra.weights.transport.WeightFetcher` over :func:`~libra.dataplane.client.fetch`; checks every
    chunk and that the header's version is the ref's. The state dict is a
    :class:`~libra.weights.packed.PackedWeights` (the received chunks, verified, or a delta applied to the
    ``host_copy``), which a rollout engine decodes straight into its model's tensors; the stats are a
    :class:`~libra.weights.host_copy.SyncStats`. Without ``host_copy`` every version is fetched whole."""

    def __init__(self, *, keys: DataPlaneKeys | None = None, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 window: int = DEFAULT_WINDOW, host_copy: HostWeights | None = None) -> None:
        self.keys, self.idle_timeout_s, self.window = keys, idle_timeout_s, window
        self.host_copy = host_copy

    def fetch(self, ref: Mapping[str, Any]) -> tuple[PackedWeights, int, SyncStats]:
        r = ObjectRef.from_wire(ref)
        stats = SyncStats()
        held = self.host_copy.get(r.endpoint) if self.host_copy is not None else None
        if held is not None and r.version is not None and held.version == r.version:
            stats.mode = "host"
            return held.fresh(), int(r.version), stats
        base = ref.get("delta_from")
        if held is not None and r.version is not None and type(base) is int and held.version == base:
            try:
                sd = self._delta(r, held, base, stats)
            except (DataPlaneError, WeightsFormatError) as exc:
                stats.delta_error = f"{type(exc).__name__}: {exc}"
            else:
                return self._keep(r, ref, sd, stats)
        return self._keep(r, ref, self._full(r, stats), stats)

    def _get(self, r: ObjectRef, stats: SyncStats) -> tuple[bytes, list[memoryview]]:
        header, chunks, fs = fetch(r, keys=self.keys, idle_timeout_s=self.idle_timeout_s, window=self.window)
        stats.seconds += fs.seconds
        stats.nbytes += fs.nbytes
        stats.header_bytes += len(header)  # a delta's header holds the version's own
        stats.chunks += fs.chunks
        stats.requests += fs.requests
        return header, chunks

    def _delta(self, r: ObjectRef, held: PackedWeights, base: int, stats: SyncStats) -> PackedWeights:
        d = ObjectRef(r.endpoint, delta_name(int(r.version or 0), base), r.version, r.server_key)
        header, chunks = self._get(d, stats)
        t0 = time.perf_counter()
        sd = apply_delta(held, header, chunks)
        stats.apply_s = time.perf_counter() - t0
        stats.seconds += stats.apply_s
        stats.mode = "delta"
        return sd

    def _full(self, r: ObjectRef, stats: SyncStats) -> PackedWeights:
        header, chunks = self._get(r, stats)
        try:
            sd = PackedWeights(header, chunks)
        except WeightsFormatError as exc:
            raise TransferCorrupted(f"data plane {r.endpoint} object {r.name!r}: {exc}") from None
        stats.mode = "full"
        return sd

    def _keep(self, r: ObjectRef, ref: Mapping[str, Any], sd: PackedWeights,
              stats: SyncStats) -> tuple[PackedWeights, int, SyncStats]:
        hdr = sd.header
        if r.version is not None and hdr.version != r.version:
            raise TransferCorrupted(f"data plane {r.endpoint} object {r.name!r}: header says version {hdr.version}, "
                                    f"the ref says {r.version}")
        if self.host_copy is not None:  # kept only while the trainer serves deltas (WeightsRef.deltas)
            if ref.get("deltas") or type(ref.get("delta_from")) is int:
                self.host_copy.put(r.endpoint, sd)
            else:
                self.host_copy.clear()
        return sd, int(hdr.version or 0), stats

    def close(self) -> None:
        """Nothing to release: every fetch opens and closes its own socket (the host copy is its owner's)."""
