"""The one choice of weights transport (libra/weights/transport.py): the trainer's publisher from
$LIBRA_WEIGHTS_TRANSPORT, a rollout's fetcher from the ref, typed errors for unknown names."""

from __future__ import annotations

import pytest
import torch

from libra.dataplane import DataPlaneServer
from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher
from libra.weights.torch_dist import TorchWeightFetcher, TorchWeightPublisher
from libra.weights.transport import (
    TRANSPORTS,
    Fetchers,
    UnknownTransport,
    make_fetcher,
    make_publisher,
    transport_from_env,
    transport_of,
)


def test_the_transport_is_read_from_the_environment_and_checked() -> None:
    assert TRANSPORTS == ("dataplane", "torch")
    assert transport_from_env({}) == "dataplane" and transport_from_env({"LIBRA_WEIGHTS_TRANSPORT": "Torch"}) == "torch"
    with pytest.raises(UnknownTransport, match="nccl"):
        transport_from_env({"LIBRA_WEIGHTS_TRANSPORT": "nccl"})
    assert transport_of({"version": 1, "endpoint": "tcp://x:1"}) == "dataplane"
    assert transport_of({"version": 1, "transport": "torch"}) == "torch"
    with pytest.raises(UnknownTransport):
        transport_of({"transport": "carrier-pigeon"})
    with pytest.raises(ValueError, match="DataPlaneServer"):
        make_publisher("dataplane")
    assert isinstance(make_fetcher("dataplane"), DataPlaneWeightFetcher)
    assert isinstance(make_fetcher("torch", timeout_s=1), TorchWeightFetcher)


def test_either_publisher_reaches_a_fetcher_chosen_by_its_ref() -> None:
    sd = {"w": torch.arange(12.0).view(3, 4)}
    server = DataPlaneServer()
    fetchers = Fetchers(timeout_s=30)
    pubs = [make_publisher("dataplane", server=server), make_publisher("torch", keep=1)]
    try:
        assert isinstance(pubs[0], DataPlaneWeightPublisher) and isinstance(pubs[1], TorchWeightPublisher)
        for v, pub in enumerate(pubs, start=1):
            for _ in range(2):
                got, version, stats, via = fetchers.fetch(pub.publish(v, sd))
                assert version == v and torch.equal(got["w"], sd["w"]) and stats.nbytes == 48
                assert via == ("dataplane", "torch")[v - 1]
        assert fetchers.made == ["dataplane", "torch"]  # one fetcher per transport, made on first use
        mine = DataPlaneWeightFetcher()
        assert fetchers.get("dataplane", {"dataplane": mine}) is mine  # an owner's swappable fetcher wins
    finally:
        fetchers.close()
        for pub in pubs:
            pub.close()
        server.close()
