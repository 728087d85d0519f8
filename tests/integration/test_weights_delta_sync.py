"""Delta weight sync between real processes on loopback: a trainer-side process publishes the tiny model's
weights on its own DataPlaneServer (libra.weights.dataplane, delta on) and changes a few tensors per version;
this process fetches them. v1 comes whole, v2 by delta, bit-identical to the full v2 and fewer bytes; and a
hybrid slot whose rollout engine was released (a reclaimed borrowed GPU) catches up by delta from the version
its host copy held when its engine is rebuilt."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from libra.actors.roles import HybridRole
from libra.actors.slot_records import slot_record_path
from libra.actors.tools import WorkContext
from libra.engines.device.placement import choose_placement
from libra.engines.tiny_model import ensure_tiny_model
from libra.weights.dataplane import DataPlaneWeightFetcher
from libra.weights.host_copy import HostWeights

TRAINER = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
from libra.dataplane import DataPlaneServer
from libra.weights.dataplane import DataPlaneWeightPublisher
from libra.weights.format import tie_like

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
server = DataPlaneServer()
pub = DataPlaneWeightPublisher(server, keep=2, delta=True)
version = 1
def publish():
    sd = model.state_dict()
    print("REF", json.dumps(pub.publish(version, tie_like(sd, {k: v.detach().clone() for k, v in sd.items()}))), flush=True)
publish()
for line in sys.stdin:  # each line: a training step that changes a few tensors (some of their elements)
    version += 1
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if i % 3 == version % 3:
                p.view(-1)[:: 7 + version] += 0.01
    publish()
"""


class Trainer:
    """The trainer-side process: ``ref`` is its newest weights ref; :meth:`step` publishes the next version."""

    def __init__(self, model_dir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(model_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.ref = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # (its log lines go to stdout too)
            if line.startswith("REF "):
                return json.loads(line[4:])
        raise AssertionError(f"the trainer process exited (rc {self.proc.poll()})")

    def step(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        self.ref = self._read()
        return self.ref

    def stop(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=10)  # reaps it and closes its pipes


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


@pytest.fixture
def trainer(tiny: Path) -> Iterator[Trainer]:
    t = Trainer(tiny)
    yield t
    t.stop()


def same_bits(a: Any, b: Any) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
                                      for k in a)


def test_v1_whole_then_v2_by_delta_bit_identical_to_the_full_v2(trainer: Trainer) -> None:
    held = HostWeights()
    f = DataPlaneWeightFetcher(host_copy=held)
    v1 = trainer.ref
    assert "delta_from" not in v1
    _, version, st = f.fetch(v1)
    assert (version, st.mode, held.version) == (1, "full", 1)
    v2 = trainer.step()
    assert v2["version"] == 2 and v2["delta_from"] == 1
    got, version, st = f.fetch(v2)
    full, _, full_st = DataPlaneWeightFetcher().fetch(v2)
    assert (version, st.mode, st.delta_error) == (2, "delta", None)
    assert same_bits(got, full) and got.header_bytes == full.header_bytes
    assert st.nbytes + st.header_bytes < full_st.nbytes and full_st.nbytes == v2["bytes"]


def ctx() -> WorkContext:
    return WorkContext("w1", "t1", 60.0, threading.Event(), "test")


def turn(ref: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 2, "temperature": 1.0, "stop_token_ids": [], "seed": 1,
            "weights": ref}


def test_a_slot_whose_engine_was_released_catches_up_by_delta(tiny: Path, trainer: Trainer, tmp_path: Path) -> None:
    role = HybridRole(str(tiny), str(tmp_path), "cpu5", max_batch=2, placement=choose_placement("cpu5", cuda_devices=0))
    role.reconfigure(["generate"], {"role": "rollout"})
    assert role.generate(turn(trainer.ref), ctx())["weights_version"] == 1
    assert role.rollout is not None and role.rollout.stats["full_loads"] == 1
    role.reconfigure([], {})  # reclaimed: the engine is closed and freed; the host copy stays
    rec = json.loads(slot_record_path(tmp_path, "cpu5").read_text())
    assert role.rollout is None and rec["role_switches"][-1]["released"] == ["rollout"]
    assert rec["role_switches"][-1]["still_alive"] == []
    assert role.host_weights is not None and role.host_weights.version == 1
    v2 = trainer.step()  # the trainer moved on while the slot was away
    role.reconfigure(["generate"], {"role": "rollout"})  # lent again: a new engine (the checkpoint's weights)
    assert role.generate(turn(v2), ctx())["weights_version"] == 2
    r = role.rollout
    assert r is not None
    st = r.stats
    assert (st["delta_loads"], st["full_loads"], st["delta_fallbacks"]) == (1, 0, 0)
    assert st["fetches"][-1]["sync"] == "delta" and 0 < st["bytes_fetched"] < v2["bytes"]
    full, _, _ = DataPlaneWeightFetcher().fetch(v2)
    own = r.engine.model.state_dict()
    assert all(torch.equal(own[k], full[k]) for k in full)
    assert json.loads(slot_record_path(tmp_path, "cpu5").read_text())["delta_loads"] == 1
    role.reconfigure([], {})
