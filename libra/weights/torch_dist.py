"""Weights over ``torch.distributed``: the trainer's rank 0 sends a version to each rollout actor that asks.

The second implementation of :class:`~libra.weights.transport.WeightPublisher` /
:class:`~libra.weights.transport.WeightFetcher` (the first is the ZeroMQ data plane). Chosen on the trainer
with ``LIBRA_WEIGHTS_TRANSPORT=torch`` (:func:`libra.weights.transport.make_publisher`); a rollout actor
picks the fetcher from the ref it is given (``"transport": "torch"``), so nothing else changes. This transport
checks no key roles (``libra.dataplane.access``: job-scoped client keys are a data-plane matter): its peers are
the trainer's rank 0 and the rollout actors that reach its store, and a job-scoped client never fetches weights
over it.

Why pair groups: rollout actors come and go (elastic roles, restarts), while a ``torch.distributed`` group
has a fixed membership. So rank 0 keeps a :class:`torch.distributed.TCPStore` (the rendezvous and control
channel; never the bytes) and forms one two-member process group with each fetcher (per backend), which
both ends keep and reuse for every later version (:mod:`libra.weights.pairs`): a group per fetch leaked an
NCCL communicator per version for the whole job. Groups are destroyed at :meth:`TorchWeightPublisher.close`
/ :meth:`TorchWeightFetcher.close` (a closing fetcher tells the publisher, which drops its side), and when a
broadcast fails (the peer is gone: that pair's group is aborted and the next fetch forms a new one).

Which path: decided per fetch by :func:`libra.weights.backend.choose_backend` from where the two ends'
tensors actually live (the publisher's snapshot device, written in the manifest, and the fetcher's
``device``): ``nccl`` (bucketed broadcast GPU to GPU) only between two different CUDA devices,
``cuda_ipc`` (the fetcher opens rank 0's GPU buffers by CUDA IPC and copies them on the device) when both
are the same GPU, ``gloo`` when either end is on the CPU. A publisher or ref may force ``gloo``/``nccl``.

Full sync only: every fetch receives the whole version. Delta sync (:mod:`libra.weights.delta`) is the data
plane's (cross-host, where the bytes cost); this transport's peers are on fast links (NCCL, CUDA IPC) where
applying a delta would cost more than it saves.

Protocol (keys in rank 0's store; requests and answers are msgpack maps):

1. ``publish(v, state_dict)`` snapshots the tensors into per-dtype buckets
   (:func:`~libra.weights.backend.plan_buckets`; the trainer keeps updating its weights in place, the
   snapshot is what version ``v`` means) and writes ``manifest/v`` (msgpack: the publisher's device,
   names, shapes, dtypes, the bucket layout). The newest ``keep`` versions stay fetchable.
2. A fetcher (identity ``peer``, random per fetcher) takes a ticket ``t = add("tickets", 1)``, reads
   ``manifest/v``, chooses the backend and writes ``req/t = {peer, version, backend, gen}`` (``gen``: the
   generation of the pair group it holds with this publisher for that backend, or None).
3. Rank 0's serving thread sees ``req/t`` and answers ``resp/t`` = ``{answer: ok, gen}`` (the generation
   to use: the fetcher's if rank 0 still holds that group, else a new one that both ends form under
   ``pair/PEER/BACKEND/GEN/``; then it broadcasts in it as rank 0), ``{answer: ipc}`` (with the device's
   UUID and the buffers' CUDA IPC handles in ``ipc/t``; it keeps them alive until the fetcher sets
   ``done/t``) or ``{answer: gone}`` (the version was superseded). ``req/t = {op: bye, peer}`` drops that
   fetcher's groups.
4. The fetcher receives the buckets as rank 1 of the pair group (or opens the IPC handles on its own
   index of the publisher's GPU, found by UUID: :mod:`libra.weights.cuda_ipc`) and rebuilds the state
   dict on its device.

Contracts: a failed fetch raises :class:`~libra.dataplane.PeerLost` (rank 0 unreachable or silent) or
:class:`~libra.dataplane.TransferCorrupted` (bad manifest, version gone, size mismatch) and leaves the
caller's state alone, as the data plane does; :class:`~libra.weights.cuda_ipc.DeviceNotVisible` when the
publisher's GPU is not visible to the fetcher. A fetcher that dies mid-broadcast costs rank 0 that pair's
group (dropped) and at most one serving thread until the backend's timeout. The store has no authentication: like NCCL itself it belongs inside
the cluster's trusted network, so the publisher binds to loopback unless given a host.
"""

from __future__ import annotations

import atexit
import datetime
import math
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from libra.dataplane import DataPlaneError, FetchStats, PeerLost, TransferCorrupted
from libra.logging import get_logger
from libra.weights.backend import DEFAULT_BUCKET_BYTES, DeviceEnd, choose_backend, local_end, plan_buckets
from libra.weights.cuda_ipc import device_index_for_uuid, dtype_named, ipc_handle, ipc_open, local_device_uuids
from libra.weights.pairs import PairGroups, make_pair_group

__all__ = ["TorchWeightFetcher", "TorchWeightPublisher", "latest_ref"]

log = get_logger("libra.weights.torch_dist")

SCHEME = "torch+tcp://"
_FORCED = ("gloo", "nccl")


def _broadcast(pg: Any, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def _pair_prefix(peer: str, backend: str, gen: int) -> str:
    return f"pair/{peer}/{backend}/{gen}/"


class TorchWeightPublisher:
    """Rank 0's side (see the module docstring). ``host``: the address rollout actors reach this process on
    (default loopback); ``backend``: ``gloo`` or ``nccl`` to force one for every fetch, or None to let each
    fetch choose from both ends' devices; ``device``: where snapshots are kept (default: where the published
    tensors are); ``bucket_bytes``: the largest broadcast bucket. Thread-safe."""

    def __init__(self, host: str = "127.0.0.1", *, keep: int = 2, backend: str | None = None,
                 timeout_s: float = 60.0, device: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if backend is not None and backend not in _FORCED:
            raise ValueError(f"backend must be 'gloo', 'nccl' or None (chosen per fetch), got {backend!r}")
        self.backend = backend
        self.device = torch.device(device) if device is not None else None
        self.host, self.keep, self.timeout_s, self.bucket_bytes = host, keep, timeout_s, bucket_bytes
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.endpoint = f"{SCHEME}{host}:{self.store.port}"
        self._versions: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.served = 0
        self.served_by: dict[str, int] = {}
        self._serving: set[threading.Thread] = set()  # one per fetch in flight
        #: one pair group per (fetcher identity, backend), kept across versions (libra.weights.pairs)
        self.pairs = PairGroups(lambda store, prefix, backend: make_pair_group(store, prefix, 0, backend,
                                                                                self.timeout_s))
        self._gen = itertools.count(1)
        self.dropped = 0  # pair groups dropped after a failed broadcast (their fetcher was lost)
        self._thread = threading.Thread(target=self._serve, name="torch-weights", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # stop polling the store before the interpreter tears c10d down

    def publish(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Snapshot ``state_dict`` as ``version``; returns the ref generate work carries to rollout actors."""
        items: list[tuple[str, torch.Tensor]] = []
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state dict entry {name!r} is {type(t).__name__}, not a tensor")
            items.append((name, t.detach()))
        device = self.device or (items[0][1].device if items else torch.device("cpu"))
        if self.backend == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        plan = plan_buckets([(n, str(t.dtype), t.numel(), t.element_size()) for n, t in items], self.bucket_bytes)
        layout, buffers = [], []
        for dt, idx in plan:
            flat = torch.cat([items[i][1].reshape(-1).to(device) for i in idx])  # a copy: the snapshot
            buffers.append(flat)
            layout.append({"dtype": dt, "numel": flat.numel(),
                           "entries": [[items[i][0], list(items[i][1].shape)] for i in idx]})
        end = local_end(device)
        manifest = msgpack.packb({"version": version, "buffers": layout, "device": end.to_wire()}, use_bin_type=True)
        with self._lock:
            self._versions[version] = buffers
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
        self.store.set(f"manifest/{version}", manifest)
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        ref = {"version": version, "transport": "torch", "backend": self.backend or "auto",
               "endpoint": self.endpoint, "name": f"weights/v{version}", "bytes": nbytes}
        self.store.set("latest", msgpack.packb(ref, use_bin_type=True))
        return ref

    def close(self, drain_s: float = 10.0) -> None:
        """Stop taking fetches, and wait up to ``drain_s`` for those in flight: a serving thread still inside
        its pair group's broadcast when the interpreter exits aborted the process ("terminate called without
        an active exception"). A fetch still running after that fails on its own timeout."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + drain_s
        for t in list(self._serving):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.pairs.close()  # every pair group (and NCCL communicator) this publisher formed

    # -- serving ----------------------------------------------------------------------------------------
    def _serve(self) -> None:
        handled = 0
        pending: dict[int, float] = {}
        while not self._closed.is_set():
            try:
                issued = int(self.store.add("tickets", 0))
            except RuntimeError:  # the store is going away with the process
                return
            for t in range(handled + 1, issued + 1):
                pending.setdefault(t, time.monotonic())
            handled = max(handled, issued)
            for t, since in list(pending.items()):
                if self.store.check([f"req/{t}"]):
                    del pending[t]
                    worker = threading.Thread(target=self._serve_one, args=(t,), name=f"torch-weights-{t}",
                                              daemon=True)
                    self._serving.add(worker)
                    worker.start()
                elif time.monotonic() - since > self.timeout_s:
                    del pending[t]  # the fetcher died between its ticket and its request
            self._closed.wait(0.005)

    def _serve_one(self, ticket: int) -> None:
        try:
            self._serve_ticket(ticket)
        finally:
            self._serving.discard(threading.current_thread())

    def _serve_ticket(self, ticket: int) -> None:
        peer, backend = "?", "?"
        try:
            req = msgpack.unpackb(self.store.get(f"req/{ticket}"), raw=False)
            peer = str(req["peer"])
            if req.get("op") == "bye":  # the fetcher closed: its groups go too
                for key in [k for k in self.pairs.keys() if k[0] == peer]:
                    self.pairs.drop(key)
                return
            version, backend, have = int(req["version"]), str(req["backend"] or self.backend or "gloo"), req.get("gen")
            with self._lock:
                buffers = self._versions.get(version)
            if buffers is None:
                self.store.set(f"resp/{ticket}", msgpack.packb({"answer": "gone"}))
                return
            if backend == "cuda_ipc":
                uuid = local_end(buffers[0].device).uuid if buffers else None
                self.store.set(f"ipc/{ticket}", msgpack.packb({"uuid": uuid, "handles": [ipc_handle(b) for b in buffers]},
                                                              use_bin_type=True))
                self.store.set(f"resp/{ticket}", msgpack.packb({"answer": "ipc"}))
                self.store.wait([f"done/{ticket}"], datetime.timedelta(seconds=self.timeout_s))  # buffers stay alive
            else:
                key = (peer, backend)
                gen = have if isinstance(have, int) and self.pairs.generation(key) == have else next(self._gen)
                self.store.set(f"resp/{ticket}", msgpack.packb({"answer": "ok", "gen": gen}))
                try:
                    with self.pairs.use(key, gen, self.store, _pair_prefix(peer, backend, gen), backend) as pg:
                        for b in buffers:
                            _broadcast(pg, b if backend == "nccl" or b.device.type == "cpu" else b.cpu())
                except RuntimeError:
                    self.dropped += 1  # the pair's group was dropped with the failure (PairGroups.use)
                    raise
            self.served += 1
            self.served_by[backend] = self.served_by.get(backend, 0) + 1
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            log.warning("torch_weights_serve_failed", ticket=ticket, peer=peer, backend=backend,
                        error=f"{type(exc).__name__}: {exc}")


def _client_store(endpoint: str, timeout_s: float) -> Any:
    """A client of the publisher's store at ``endpoint``; :class:`~libra.dataplane.PeerLost` if unreachable."""
    host, _, port = endpoint.removeprefix(SCHEME).rpartition(":")
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:
        raise PeerLost(f"torch weights {endpoint}: cannot reach the publisher ({type(exc).__name__})") from None


def latest_ref(endpoint: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
    """The newest ref published at ``endpoint`` (None if nothing is yet); raises
    :class:`~libra.dataplane.PeerLost` when the publisher cannot be reached."""
    store = _client_store(endpoint, timeout_s)
    try:
        if not store.check(["latest"]):
            return None
        ref = msgpack.unpackb(store.get("latest"), raw=False)
    except (RuntimeError, ValueError) as exc:
        raise PeerLost(f"torch weights {endpoint}: cannot reach the publisher ({type(exc).__name__})") from None
    return ref if isinstance(ref, dict) else None


class TorchWeightFetcher:
    """A rollout actor's side (see the module docstring): ``fetch(ref) -> (state_dict, version, stats)``.
    ``device``: where the weights should land (the rollout engine's device; default CPU). After a fetch,
    ``last_backend`` says which path it took. It keeps one store client and one pair group per publisher
    endpoint (and backend) across versions; :meth:`close` destroys them. One fetch at a time (a lock)."""

    def __init__(self, *, timeout_s: float = 60.0, device: str | None = None) -> None:
        self.timeout_s, self.device = timeout_s, torch.device(device or "cpu")
        self.last_backend: str | None = None
        self.peer = uuid.uuid4().hex[:16]  # this fetcher's identity at every publisher
        self.pairs = PairGroups(lambda store, prefix, backend: make_pair_group(store, prefix, 1, backend,
                                                                                self.timeout_s))
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _store(self, endpoint: str) -> Any:
        if endpoint not in self._stores:
            self._stores[endpoint] = _client_store(endpoint, self.timeout_s)
        return self._stores[endpoint]

    def request(self, store: Any, version: int, backend: str, gen: int | None) -> dict[str, Any]:
        """Ask the publisher for ``version`` over ``backend`` (holding pair generation ``gen``); its answer."""
        ticket = int(store.add("tickets", 1))
        store.set(f"req/{ticket}", msgpack.packb({"peer": self.peer, "version": version, "backend": backend,
                                                  "gen": gen}))
        answer = msgpack.unpackb(store.get(f"resp/{ticket}"), raw=False)  # blocks up to timeout_s
        if not isinstance(answer, dict):
            raise TransferCorrupted(f"torch weights: a bad answer {answer!r}")
        answer["ticket"] = ticket
        return answer

    def fetch(self, ref: Mapping[str, Any]) -> tuple[dict[str, Any], int, FetchStats]:
        endpoint, version, forced = ref.get("endpoint"), ref.get("version"), ref.get("backend") or "auto"
        if not (isinstance(endpoint, str) and endpoint.startswith(SCHEME) and type(version) is int
                and forced in (*_FORCED, "auto")):
            raise TransferCorrupted(f"not a torch weights ref: {dict(ref)!r}")
        with self._lock:
            try:
                return self._fetch(endpoint, version, forced)
            except PeerLost:
                self._forget(endpoint, failed=True)
                raise

    def _fetch(self, endpoint: str, version: int, forced: str) -> tuple[dict[str, Any], int, FetchStats]:
        t0 = time.perf_counter()
        store = self._store(endpoint)
        try:
            if not store.check([f"manifest/{version}"]):
                raise TransferCorrupted(f"torch weights {endpoint}: version {version} was never published there")
            meta = msgpack.unpackb(store.get(f"manifest/{version}"), raw=False)
            src = DeviceEnd.from_wire(meta["device"]) if "device" in meta else DeviceEnd("?", "cpu")
            backend = forced if forced in _FORCED else choose_backend(src, local_end(self.device))
            key = (endpoint, backend)
            answer = self.request(store, version, backend, self.pairs.generation(key))
            if answer.get("answer") not in ("ok", "ipc"):
                raise TransferCorrupted(f"torch weights {endpoint}: version {version} is gone (superseded)")
            if answer["answer"] == "ipc":
                flats = self._open_ipc(store, answer["ticket"])
            else:
                gen = int(answer["gen"])
                recv_on = self.device if backend == "nccl" else torch.device("cpu")
                flats = []
                with self.pairs.use(key, gen, store, _pair_prefix(self.peer, backend, gen), backend) as pg:
                    for b in meta["buffers"]:
                        dt = dtype_named(b["dtype"], "torch weights manifest")
                        flat = torch.empty(int(b["numel"]), dtype=dt, device=recv_on)
                        _broadcast(pg, flat)
                        flats.append(flat.to(self.device))
            sd, nbytes = self._unflatten(endpoint, meta["buffers"], flats)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise TransferCorrupted(f"torch weights {endpoint}: bad manifest ({type(exc).__name__}: {exc})") from None
        except RuntimeError as exc:  # store or collective timeout, peer gone mid-broadcast
            if isinstance(exc, DataPlaneError):
                raise
            raise PeerLost(f"torch weights {endpoint}: {type(exc).__name__}: {exc}") from None
        self.last_backend = backend
        return sd, version, FetchStats(time.perf_counter() - t0, nbytes, len(meta["buffers"]), 1)

    def _open_ipc(self, store: Any, ticket: int) -> list[torch.Tensor]:
        """Copy the publisher's buffers from their CUDA IPC handles, opened on this process's index of the
        publisher's GPU (by UUID: the two processes may number it differently)."""
        try:
            msg = msgpack.unpackb(store.get(f"ipc/{ticket}"), raw=False)
            index = device_index_for_uuid(str(msg.get("uuid") or ""), local_device_uuids())
            return [ipc_open(h, index).to(self.device, copy=True) for h in msg["handles"]]
        finally:
            store.set(f"done/{ticket}", "1")

    def _forget(self, endpoint: str, *, failed: bool) -> None:
        for key in [k for k in self.pairs.keys() if k[0] == endpoint]:
            self.pairs.drop(key, failed=failed)
        self._stores.pop(endpoint, None)

    def close(self) -> None:
        """Tell each publisher this fetcher is leaving (it drops its side of the pair groups), then destroy
        this side's groups. Best effort: an unreachable publisher is skipped."""
        with self._lock:
            for endpoint in {k[0] for k in self.pairs.keys()}:
                store = self._stores.get(endpoint)
                if store is None:
                    continue
                try:
                    ticket = int(store.add("tickets", 1))
                    store.set(f"req/{ticket}", msgpack.packb({"op": "bye", "peer": self.peer}))
                except RuntimeError:
                    pass
            self.pairs.close()
            self._stores.clear()

    @staticmethod
    def _unflatten(endpoint: str, layout: list[Any], flats: list[torch.Tensor]) -> tuple[dict[str, Any], int]:
        if len(flats) != len(layout):
            raise TransferCorrupted(f"torch weights {endpoint}: {len(flats)} buffers for {len(layout)} buckets")
        sd: dict[str, Any] = {}
        nbytes = 0
        for b, flat in zip(layout, flats):
            if flat.numel() != int(b["numel"]) or str(flat.dtype) != b["dtype"]:
                raise TransferCorrupted(f"torch weights {endpoint}: a {b['dtype']} bucket does not match its manifest")
            nbytes += flat.numel() * flat.element_size()
            offset = 0
            for name, shape in b["entries"]:
                n = math.prod(shape)
                sd[name] = flat[offset:offset + n].view(shape)
                offset += n
            if offset != flat.numel():
                raise TransferCorrupted(f"torch weights {endpoint}: manifest sizes do not add up for {b['dtype']}")
        return sd, nbytes
