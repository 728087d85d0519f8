"""What an action actor reports about its resources: CPU ids and NUMA nodes parsed from a sysfs tree, GPU
service slots (emulated on CPU when no GPU exists, and said so), and the typed labels the broker parses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libra.actors.topology import action_labels, cpu_topology
from libra.protocol.payloads_actions import ActorResources
from libra.protocol.payloads_base import PayloadError


def fake_sysfs(tmp_path: Path, nodes: dict[int, str]) -> str:
    for node, cpulist in nodes.items():
        d = tmp_path / f"node{node}"
        d.mkdir()
        (d / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node directory: ignored
    return str(tmp_path)


def test_numa_nodes_come_from_the_cpulists(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"})
    cpus, numa = cpu_topology([0, 1, 4, 5, 8, 12], root=root)
    assert cpus == [0, 1, 4, 5, 8, 12] and numa == [0, 0, 1, 1, 0, 1]


def test_a_host_without_numa_information_reports_node_zero(tmp_path: Path) -> None:
    cpus, numa = cpu_topology([3, 1, 2], root=str(tmp_path / "absent"))
    assert cpus == [1, 2, 3] and numa == [0, 0, 0]


def test_labels_of_cpu_and_gpu_slots(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {0: "0-1023"})
    cpu = ActorResources.from_wire(action_labels("cpu0", root=root))
    mine = sorted(os.sched_getaffinity(0))
    assert cpu.cpus == mine and cpu.cores == len(mine) and cpu.numa == [0] * len(mine) and cpu.gpus == 0
    gpu = ActorResources.from_wire(action_labels("gpu0", 2, gpu_present=False, root=root))
    assert gpu.gpus == 2 and gpu.gpu_emulated is True
    assert action_labels("gpu1", gpu_present=True, root=root)["gpus"] == 1
    with pytest.raises(ValueError, match="gpu slots"):
        action_labels("cpu0", 2, root=root)


def test_bad_resource_labels_are_typed_errors() -> None:
    with pytest.raises(PayloadError, match="numa"):
        ActorResources.from_wire({"cpus": [0, 1], "numa": [0]})
    with pytest.raises(PayloadError, match="cpus"):
        ActorResources.from_wire({"cpus": [0, 0]})
    with pytest.raises(PayloadError, match="gpus"):
        ActorResources.from_wire({"gpus": -1})
