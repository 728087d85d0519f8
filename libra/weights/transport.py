"""The one choice of weights transport: the interface both implementations follow, and which one to use.

- :class:`WeightPublisher` (the trainer's rank 0): ``publish(version, state_dict) -> ref``, a msgpack-able
  mapping with at least ``version`` that generate work carries to rollout actors; it copies the tensors
  before it returns (so a trainer may pass its model's own tensors); ``close()``.
- :class:`WeightFetcher` (a rollout actor): ``fetch(ref) -> (state_dict, version, stats)``, raising
  :class:`~libra.dataplane.DataPlaneError` subclasses and leaving no partial state behind; ``close()``.

Transports (:data:`TRANSPORTS`): ``dataplane`` (:mod:`libra.weights.dataplane`, the default: ZeroMQ, CURVE
when keyed, any host) and ``torch`` (:mod:`libra.weights.torch_dist`: gloo, NCCL or CUDA IPC).

- The trainer's transport is ``$LIBRA_WEIGHTS_TRANSPORT`` (``[actors] weights_transport`` of a job;
  :func:`transport_from_env`, an unknown name raises :class:`UnknownTransport`), and
  :func:`make_publisher` builds its publisher.
- A rollout actor never chooses: the ref names its transport (``"transport": "torch"``, none for the data
  plane), and :class:`Fetchers` keeps one fetcher per transport, made on first use.

Imports of the implementations are lazy, so that importing this module costs neither torch.distributed nor
ZeroMQ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["HOST_ENV", "TRANSPORTS", "TRANSPORT_ENV", "Fetchers", "UnknownTransport", "WeightFetcher",
           "WeightPublisher", "make_fetcher", "make_publisher", "transport_from_env", "transport_of"]

TRANSPORTS = ("dataplane", "torch")
TRANSPORT_ENV = "LIBRA_WEIGHTS_TRANSPORT"
HOST_ENV = "LIBRA_WEIGHTS_HOST"  # the address rollout actors reach a torch publisher's store on


class UnknownTransport(ValueError):
    """A weights transport name that is not one of :data:`TRANSPORTS`."""


class WeightPublisher(Protocol):
    """Trainer side of a weights transport (see the module docstring)."""

    def publish(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class WeightFetcher(Protocol):
    """Rollout side of a weights transport (see the module docstring)."""

    def fetch(self, ref: Mapping[str, Any]) -> tuple[dict[str, Any], int, Any]: ...

    def close(self) -> None: ...


def _check(name: str) -> str:
    if name not in TRANSPORTS:
        raise UnknownTransport(f"unknown weights transport {name!r} (known: {', '.join(TRANSPORTS)})")
    return name


def transport_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The trainer's transport: ``$LIBRA_WEIGHTS_TRANSPORT`` (default ``dataplane``)."""
    env = os.environ if environ is None else environ
    return _check(env.get(TRANSPORT_ENV, "").strip().lower() or "dataplane")


def transport_of(ref: Mapping[str, Any]) -> str:
    """The transport a ref was published on: its ``transport`` field, none meaning the data plane."""
    return _check(str(ref.get("transport") or "dataplane"))


def make_publisher(name: str, *, server: Any = None, device: Any = None, host: str | None = None,
                   keep: int = 2) -> WeightPublisher:
    """The publisher of transport ``name``: over ``server`` (a :class:`~libra.dataplane.DataPlaneServer`,
    needed for ``dataplane``), or a torch.distributed store on ``host`` (default ``$LIBRA_WEIGHTS_HOST`` or
    loopback) keeping snapshots on ``device`` (where the trainer lives: a GPU trainer serves GPU rollouts by
    NCCL or CUDA IPC). The newest ``keep`` versions stay fetchable."""
    if _check(name) == "torch":
        from libra.weights.torch_dist import TorchWeightPublisher

        return TorchWeightPublisher(host or os.environ.get(HOST_ENV, "127.0.0.1"), keep=keep, device=device)
    if server is None:
        raise ValueError("the dataplane weights transport needs the trainer's DataPlaneServer")
    from libra.weights.dataplane import DataPlaneWeightPublisher

    return DataPlaneWeightPublisher(server, keep=keep)


def make_fetcher(name: str, *, keys: Any = None, device: Any = None, timeout_s: float = 10.0) -> WeightFetcher:
    """The fetcher of transport ``name``: data-plane fetches with ``keys`` (CURVE) and an idle timeout of
    ``timeout_s``; torch fetches landing on ``device`` with at least 30 s for a rendezvous."""
    if _check(name) == "torch":
        from libra.weights.torch_dist import TorchWeightFetcher

        return TorchWeightFetcher(timeout_s=max(30.0, timeout_s), device=device)
    from libra.weights.dataplane import DataPlaneWeightFetcher

    return DataPlaneWeightFetcher(keys=keys, idle_timeout_s=timeout_s)


class Fetchers:
    """A rollout actor's fetchers, one per transport, each made on first use by :func:`make_fetcher` (with
    ``keys``, ``device``, ``timeout_s``). ``fetch(ref)`` uses the ref's transport
    and also returns its name. Holds no reference to its owner (a role), so it adds no cycle to it."""

    def __init__(self, *, keys: Any = None, device: Any = None, timeout_s: float = 10.0) -> None:
        self.keys, self.device, self.timeout_s = keys, device, timeout_s
        self._by_name: dict[str, Any] = {}
        self.made: list[str] = []  # the transports whose fetcher this object made, in order

    def get(self, name: str, override: Mapping[str, Any] | None = None) -> WeightFetcher:
        """The fetcher of transport ``name``: ``override[name]`` if given (an owner's current, swappable
        fetcher), else the one held, made now if none is."""
        _check(name)
        if override is not None and override.get(name) is not None:
            return override[name]
        if name not in self._by_name:
            self._by_name[name] = make_fetcher(name, keys=self.keys, device=self.device, timeout_s=self.timeout_s)
            self.made.append(name)
        return self._by_name[name]

    def fetch(self, ref: Mapping[str, Any], override: Mapping[str, Any] | None = None,
              ) -> tuple[dict[str, Any], int, Any, str]:
        """``(state_dict, version, stats, transport)`` of ``ref`` (:class:`UnknownTransport` for a ref of none)."""
        name = transport_of(ref)
        sd, version, stats = self.get(name, override).fetch(ref)
        return sd, version, stats, name

    def close(self) -> None:
        """Close every fetcher held (a torch fetcher's pair groups are destroyed)."""
        for f in self._by_name.values():
            close = getattr(f, "close", None)
            if close is not None:
                close()
        self._by_name.clear()
