"""Weights over ``torch.distributed``: the trainer's rank 0 broadcasts a version to each rollout actor that asks.

The second implementation of :class:`~libra.dataplane.WeightPublisher` / :class:`~libra.dataplane.WeightFetcher`
(the first is the ZeroMQ data plane). Chosen on the trainer with ``LIBRA_WEIGHTS_TRANSPORT=torch``; a rollout
actor picks the fetcher from the ref it is given (``"transport": "torch"``), so nothing else changes.

Why a per-fetch group: rollout actors come and go (elastic roles, restarts), while a ``torch.distributed``
group has a fixed membership. So rank 0 keeps a :class:`torch.distributed.TCPStore` (the rendezvous and
control channel; never the bytes) and, for every fetch, the two processes form a fresh two-member process
group (``ProcessGroupNCCL`` when CUDA is available, else ``ProcessGroupGloo``) and rank 0 broadcasts the
version's tensors in it: one flat buffer per dtype, GPU to GPU under NCCL.

Protocol (keys in rank 0's store):

1. ``publish(v, state_dict)`` snapshots the tensors into per-dtype flat buffers (the trainer keeps
   updating its weights in place; the snapshot is what version ``v`` means) and writes ``manifest/v``
   (msgpack: names, shapes, dtypes, the buffer layout). The newest ``keep`` versions stay fetchable.
2. A fetcher takes a ticket ``t = add("tickets", 1)``, reads ``manifest/v`` and writes ``req/t = v``.
3. Rank 0's serving thread sees ``req/t`` and answers ``resp/t`` = ``ok`` (then joins the pair group
   ``pair/t/`` as its rank 0 and broadcasts) or ``gone`` (the version was superseded).
4. The fetcher joins as rank 1, receives the buffers and rebuilds the state dict.

Contracts: a failed fetch raises :class:`~libra.dataplane.PeerLost` (rank 0 unreachable or silent) or
:class:`~libra.dataplane.TransferCorrupted` (bad manifest, version gone, size mismatch) and leaves the
caller's state alone, as the data plane does. A fetcher that dies mid-broadcast costs rank 0 one serving
thread until the backend's timeout. The store has no authentication: like NCCL itself it belongs inside
the cluster's trusted network, so the publisher binds to loopback unless given a host.
"""

from __future__ import annotations

import atexit
import datetime
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from libra.dataplane import FetchStats, PeerLost, TransferCorrupted
from libra.logging import get_logger

__all__ = ["TorchWeightFetcher", "TorchWeightPublisher", "default_backend", "latest_ref"]

log = get_logger("libra.weights_dist")

SCHEME = "torch+tcp://"


def default_backend() -> str:
    """``nccl`` where CUDA and NCCL are available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and hasattr(dist, "ProcessGroupNCCL") else "gloo"


def _pair_group(store: Any, ticket: int, rank: int, backend: str) -> Any:
    prefix = dist.PrefixStore(f"pair/{ticket}/", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefix, rank, 2)
    return dist.ProcessGroupGloo(prefix, rank, 2)


def _broadcast(pg: Any, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise TransferCorrupted(f"torch weights manifest names an unknown dtype {name!r}")
    return dt


class TorchWeightPublisher:
    """Rank 0's side (see the module docstring). ``host``: the address rollout actors reach this process on
    (default loopback); ``backend``: ``gloo``, ``nccl`` or None (:func:`default_backend`). Thread-safe."""

    def __init__(self, host: str = "127.0.0.1", *, keep: int = 2, backend: str | None = None,
                 timeout_s: float = 60.0) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.backend = backend or default_backend()
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        self.host, self.keep, self.timeout_s = host, keep, timeout_s
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.endpoint = f"{SCHEME}{host}:{self.store.port}"
        self._versions: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.served = 0
        self._thread = threading.Thread(target=self._serve, name="torch-weights", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # stop polling the store before the interpreter tears c10d down

    def publish(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Snapshot ``state_dict`` as ``version``; returns the ref generate work carries to rollout actors."""
        groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state dict entry {name!r} is {type(t).__name__}, not a tensor")
            groups.setdefault(str(t.dtype), []).append((name, t.detach()))
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        layout, buffers = [], []
        for dt, items in groups.items():
            flat = torch.cat([t.reshape(-1).to(device) for _, t in items])  # a copy: the snapshot of version
            buffers.append(flat)
            layout.append({"dtype": dt, "numel": flat.numel(),
                           "entries": [[n, list(t.shape)] for n, t in items]})
        manifest = msgpack.packb({"version": version, "buffers": layout}, use_bin_type=True)
        with self._lock:
            self._versions[version] = buffers
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
        self.store.set(f"manifest/{version}", manifest)
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        ref = {"version": version, "transport": "torch", "backend": self.backend, "endpoint": self.endpoint,
               "name": f"weights/v{version}", "bytes": nbytes}
        self.store.set("latest", msgpack.packb(ref, use_bin_type=True))
        return ref

    def close(self) -> None:
        """Stop serving (fetches in flight finish or fail on their own timeouts)."""
        self._closed.set()
        self._thread.join(timeout=5)

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
                    threading.Thread(target=self._serve_one, args=(t,), name=f"torch-weights-{t}",
                                     daemon=True).start()
                elif time.monotonic() - since > self.timeout_s:
                    del pending[t]  # the fetcher died between its ticket and its request
            self._closed.wait(0.005)

    def _serve_one(self, ticket: int) -> None:
        try:
            version = int(self.store.get(f"req/{ticket}"))
            with self._lock:
                buffers = self._versions.get(version)
            if buffers is None:
                self.store.set(f"resp/{ticket}", "gone")
                return
            self.store.set(f"resp/{ticket}", "ok")
            pg = _pair_group(self.store, ticket, 0, self.backend)
            for b in buffers:
                _broadcast(pg, b)
            self.served += 1
        except (RuntimeError, ValueError) as exc:
            log.warning("torch_weights_serve_failed", ticket=ticket, error=f"{type(exc).__name__}: {exc}")


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
    """A rollout actor's side (see the module docstring): ``fetch(ref) -> (state_dict, version, stats)``."""

    def __init__(self, *, timeout_s: float = 60.0, device: str | None = None) -> None:
        self.timeout_s, self.device = timeout_s, device

    def fetch(self, ref: Mapping[str, Any]) -> tuple[dict[str, Any], int, FetchStats]:
        endpoint, version, backend = ref.get("endpoint"), ref.get("version"), ref.get("backend", "gloo")
        if not (isinstance(endpoint, str) and endpoint.startswith(SCHEME) and type(version) is int
                and backend in ("gloo", "nccl")):
            raise TransferCorrupted(f"not a torch weights ref: {dict(ref)!r}")
        t0 = time.perf_counter()
        store = _client_store(endpoint, self.timeout_s)
        try:
            if not store.check([f"manifest/{version}"]):
                raise TransferCorrupted(f"torch weights {endpoint}: version {version} was never published there")
            meta = msgpack.unpackb(store.get(f"manifest/{version}"), raw=False)
            ticket = int(store.add("tickets", 1))
            store.set(f"req/{ticket}", str(version))
            answer = store.get(f"resp/{ticket}").decode()  # blocks up to timeout_s
            if answer != "ok":
                raise TransferCorrupted(f"torch weights {endpoint}: version {version} is gone (superseded)")
            device = torch.device(self.device or ("cuda" if backend == "nccl" else "cpu"))
            pg = _pair_group(store, ticket, 1, backend)
            sd: dict[str, Any] = {}
            nbytes = 0
            for b in meta["buffers"]:
                flat = torch.empty(int(b["numel"]), dtype=_dtype(b["dtype"]), device=device)
                _broadcast(pg, flat)
                nbytes += flat.numel() * flat.element_size()
                offset = 0
                for name, shape in b["entries"]:
                    n = math.prod(shape)
                    sd[name] = flat[offset:offset + n].view(shape)
                    offset += n
                if offset != flat.numel():
                    raise TransferCorrupted(f"torch weights {endpoint}: manifest sizes do not add up for {b['dtype']}")
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferCorrupted(f"torch weights {endpoint}: bad manifest ({type(exc).__name__}: {exc})") from None
        except RuntimeError as exc:  # store or collective timeout, peer gone mid-broadcast
            if isinstance(exc, (PeerLost, TransferCorrupted)):
                raise
            raise PeerLost(f"torch weights {endpoint}: {type(exc).__name__}: {exc}") from None
        return sd, version, FetchStats(time.perf_counter() - t0, nbytes, len(meta["buffers"]), 1)
