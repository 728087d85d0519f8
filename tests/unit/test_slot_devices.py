"""Which GPUs each slot sees (libra/actors/slots.py, supervisor.py, engines/device/): an existing
CUDA_VISIBLE_DEVICES is respected, PCI bus order is set, gpuN.K is GPU N, CPU slots see no GPU, bad slot names
are refused. Pure: an environment in, an environment out."""

from __future__ import annotations

import sys

import pytest

from libra.actors.slots import allowed_gpus, discover_gpus, parent_visible, slot_cuda_env
from libra.actors.supervisor import Supervisor, service_gpus_of, slot_environment
from libra.engines.device.errors import DeviceConfigError, SlotNameError
from libra.engines.device.slots import parse_slot, slot_gpu_index
from libra.engines.device.tp_groups import cuda_visible_for

SLURM = {"CUDA_VISIBLE_DEVICES": "2,5,7", "HOME": "/h"}
UUIDS = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa1111,GPU-bbbb2222"}
MIG = {"CUDA_VISIBLE_DEVICES": "MIG-11112222-3333,MIG-44445555-6666"}


def test_gpu_slots_index_into_an_existing_cuda_visible_devices_in_pci_bus_order() -> None:
    assert slot_cuda_env("gpu1", SLURM) == {"CUDA_VISIBLE_DEVICES": "5", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                            "LIBRA_NODE_CUDA_DEVICES": "2,5,7", "LIBRA_SLOT_CUDA": "gpu1"}
    assert slot_cuda_env("gpu0", UUIDS)["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa1111"
    assert slot_cuda_env("gpu1", MIG)["CUDA_VISIBLE_DEVICES"] == "MIG-44445555-6666"
    # no list given: NVML's index, with the order that makes CUDA's numbering NVML's
    assert slot_cuda_env("gpu3", {}) == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                         "LIBRA_SLOT_CUDA": "gpu3"}
    with pytest.raises(DeviceConfigError, match="lists 3"):
        slot_cuda_env("gpu3", SLURM)  # a GPU the supervisor was not given
    # a GPU action slot's services given two GPUs see two, from the slot's own
    assert slot_cuda_env("gpu1", SLURM, service_gpus=2)["CUDA_VISIBLE_DEVICES"] == "5,7"
    # a TP group spanning GPUs 1..2 of the node names them as the node's list does
    node = {"LIBRA_NODE_CUDA_DEVICES": "2,5,7"}
    assert cuda_visible_for((1, 2), node) == "5,7" and cuda_visible_for((0, 1), {}) == "0,1"
    with pytest.raises(DeviceConfigError):
        cuda_visible_for((3,), node)


def test_the_supervisor_gives_each_child_its_slots_gpu(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa1111,GPU-bbbb2222")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    sup = Supervisor("tcp://127.0.0.1:1", ["gpu1", "gpu1.1", "cpu0"],
                     slot_env={"gpu1.1": {"LIBRA_ENGINES_PER_GPU": "2"}})
    env = {c.slot: c.env for c in sup.children}
    assert env["gpu1"]["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb2222" and env["gpu1"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["gpu1.1"]["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb2222"  # was "1.1": no GPU, CPU fallback
    assert env["gpu1.1"]["LIBRA_ENGINES_PER_GPU"] == "2" and env["gpu1"]["PYTHONFAULTHANDLER"] == "1"
    assert env["cpu0"]["CUDA_VISIBLE_DEVICES"] == ""


def test_second_engine_on_a_gpu_gets_that_gpu() -> None:
    assert slot_cuda_env("gpu0.1", {})["CUDA_VISIBLE_DEVICES"] == "0"  # was "0.1"
    assert slot_cuda_env("gpu1.2", SLURM)["CUDA_VISIBLE_DEVICES"] == "5"
    assert parse_slot("gpu0.1") == ("gpu", 0, 1) and slot_gpu_index("gpu0.1") == 0


def test_a_runtime_started_without_the_supervisor_sets_its_own_gpu() -> None:
    from libra.actors.slots import runtime_cuda_env

    assert runtime_cuda_env("gpu0.1", {})["CUDA_VISIBLE_DEVICES"] == "0"  # a systemd unit's --slot gpu0.1
    assert runtime_cuda_env("gpu1", SLURM)["CUDA_VISIBLE_DEVICES"] == "5"
    assert runtime_cuda_env("gpu1", slot_environment("gpu1", SLURM)) == {}  # the supervisor already did


def test_cpu_slots_see_no_gpu() -> None:
    for parent in ({}, SLURM):
        env = slot_environment("cpu2", parent)
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert slot_environment("cpu0", SLURM)["HOME"] == "/h"  # the rest of the environment is inherited
    assert discover_gpus({"CUDA_VISIBLE_DEVICES": ""}).count == 0  # so a CPU slot's own discovery finds none


@pytest.mark.parametrize("bad", ["gpu", "gpux", "gpu0.x", "gpu0.0", "gpu01", "cpu0.1", "tpu0", "gpu-1", "", "gpu0.1.2"])
def test_bad_slot_names_are_refused_with_a_typed_error(bad: str) -> None:
    with pytest.raises(SlotNameError):
        parse_slot(bad)
    with pytest.raises(SlotNameError):
        slot_cuda_env(bad, {})
    with pytest.raises(SlotNameError):
        Supervisor("tcp://127.0.0.1:1", ["cpu0", bad])
    assert issubclass(SlotNameError, DeviceConfigError) and issubclass(SlotNameError, ValueError)


def test_gpu_discovery_counts_only_the_gpus_the_parent_may_see() -> None:
    nvml = ["GPU-aaaa1111-0", "GPU-bbbb2222-0", "GPU-cccc3333-0", "GPU-dddd4444-0"]
    assert allowed_gpus(nvml, None) == [("0", 0), ("1", 1), ("2", 2), ("3", 3)]
    assert allowed_gpus(nvml, ["3", "1"]) == [("3", 3), ("1", 1)]
    assert allowed_gpus(nvml, ["GPU-cccc", "gpu-AAAA1111-0"]) == [("GPU-cccc", 2), ("gpu-AAAA1111-0", 0)]
    assert allowed_gpus(nvml, ["MIG-1", "MIG-2"]) == [("MIG-1", None), ("MIG-2", None)]
    assert allowed_gpus(nvml, ["1", "9", "2"]) == [("1", 1)]  # CUDA stops at the first invalid entry
    assert allowed_gpus(nvml, ["GPU-", "1"]) == []  # an ambiguous UUID prefix names no GPU
    assert parent_visible({}) is None and parent_visible({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert parent_visible({"CUDA_VISIBLE_DEVICES": " 0, 2,-1,3"}) == ["0", "2"]


def test_gpu_discovery_reads_nvml_through_the_visible_list(monkeypatch) -> None:
    class FakeNvml:
        class NVMLError(Exception):
            pass

        nvmlInit = nvmlShutdown = staticmethod(lambda: None)
        nvmlDeviceGetCount = staticmethod(lambda: 4)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
        nvmlDeviceGetName = staticmethod(lambda h: f"H100 #{h}".encode())
        nvmlDeviceGetUUID = staticmethod(lambda h: f"GPU-{h}{h}{h}{h}-x")

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)
    d = discover_gpus({"CUDA_VISIBLE_DEVICES": "GPU-2222,0"})
    assert (d.count, d.names) == (2, ("H100 #2", "H100 #0")) and "2 of NVML's 4" in d.reason
    assert discover_gpus({}).count == 4


def test_service_gpus_are_read_from_a_slots_arguments() -> None:
    assert service_gpus_of(["--slot", "gpu0", "--service-gpus", "2"]) == 2
    assert service_gpus_of(["--service-gpus=3"]) == 3 and service_gpus_of([]) == 0


def test_a_runtime_started_alone_refuses_a_bad_slot_name_and_sets_its_gpu_by_the_slot_rule(monkeypatch, capsys):
    """The runtime used to write ``slot[3:]`` into CUDA_VISIBLE_DEVICES (``gpu0.1`` -> ``"0.1"``, a silent CPU
    fallback); it now applies the supervisor's rule itself and refuses a malformed slot with rc 2."""
    import os

    from libra.actors.runtime import main

    assert main(["--broker", "tcp://127.0.0.1:1", "--slot", "gpu0.x"]) == 2
    assert "slot names are" in capsys.readouterr().err
    from libra.actors.slots import runtime_cuda_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = runtime_cuda_env("gpu0.1", dict(os.environ))
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
