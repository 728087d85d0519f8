"""The train role's config handling: parallel mode and rendezvous address (libra/actors/train_role.py)."""

from __future__ import annotations

import pytest
import torch

from libra.actors.tools import ToolError
from libra.actors.train_role import TrainRole, is_local_address, state_checksum
from libra.protocol.payloads_train import TrainArgs


def _args(rank: int, grpo: dict) -> dict:
    part = {"ref": {"endpoint": "tcp://127.0.0.1:1", "name": "traj/1"}, "advantage": 1.0}
    return TrainArgs.from_wire({"parts": [[part], [part]], "world_size": 2, "rank": rank, "master_port": 29999,
                                "grpo": grpo}).to_wire()


def test_local_addresses() -> None:
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.55")  # TEST-NET-1: never this host's
    assert not is_local_address("no-such-host.invalid")


def test_rank0_refuses_a_master_addr_that_is_not_its_own(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("LIBRA_ADVERTISE_ADDRESS", raising=False)
    role = TrainRole(str(tmp_path), None, "t0")
    with pytest.raises(ToolError) as e:
        role.train(_args(0, {"master_addr": "192.0.2.55"}), None)
    assert e.value.code == "rendezvous_failed" and "192.0.2.55" in str(e.value)
    monkeypatch.setenv("LIBRA_ADVERTISE_ADDRESS", "192.0.2.56")  # the actor's advertised address is the default
    with pytest.raises(ToolError, match="192.0.2.56"):
        role.train(_args(0, {}), None)
    with pytest.raises(ToolError) as e:
        role.train(_args(1, {"master_addr": 7}), None)
    assert e.value.code == "bad_request"
    with pytest.raises(ToolError) as e:
        role.train(_args(1, {"no_such_option": 1}), None)
    assert e.value.code == "bad_request" and "no_such_option" in str(e.value)
    assert role.trainer is None and role.server is None  # refused before anything was built


def test_state_checksum_covers_bf16_and_differs_on_change() -> None:
    a = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    b = {"b": torch.zeros(2), "w": torch.ones(3, dtype=torch.bfloat16)}
    assert state_checksum(a) == state_checksum(b)
    b["w"][0] = 2
    assert state_checksum(a) != state_checksum(b)


def test_rendezvous_interface_for_loopback_and_unroutable(monkeypatch) -> None:
    from libra.engines.rendezvous import interface_for, pin_interfaces

    assert interface_for("127.0.0.1") == "lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert pin_interfaces("127.0.0.1") is None  # loopback groups keep torch's defaults
    assert pin_interfaces("no-such-host.invalid") is None
    import os

    assert "GLOO_SOCKET_IFNAME" not in os.environ
