"""The train role around the trainer (libra/actors/train_role.py): a failed step becomes ToolError oom /
train_failed with the CUDA cache freed outside the except block, only rank 0 packs the weights while every
rank reports the weights' fingerprint, and close() frees the model and optimizer (issue #25).

At af91053: every DDP rank packed a full CPU copy and hashed it each step, and TrainRole.close() kept the
trainer (model and AdamW state) alive."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch

from libra.actors.tools import ToolError
from libra.actors.train_role import TrainRole
from libra.engines.trainer import GRPOTrainer, TrainBatch, TrainStepFailed
from libra.protocol.payloads_train import TrainArgs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from libra.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _batch() -> TrainBatch:
    seqs = [[2, 11, 21, 31, 41, 51], [2, 12, 22, 32, 42]]
    return TrainBatch(input_ids=seqs, loss_mask=[[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1]],
                      rollout_logprobs=[[-4.0] * 6, [-4.0] * 5], advantages=[1.0, -1.0])


class _FakeTrainer:
    """What TrainRole.train uses of a trainer, recording the calls."""

    def __init__(self, rank: int, parallel: str = "ddp") -> None:
        self.rank, self.world_size, self.parallel = rank, 2, parallel
        self.weights_version, self.device, self.calls = 0, torch.device("cpu"), []

    def train_step(self, batch: Any, micro_batches: Any = None) -> dict[str, float]:
        self.calls.append("train_step")
        self.weights_version += 1
        return {"loss": 0.5}

    def state_dict_for_sync(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        self.calls.append("state_dict_for_sync")
        return {"w": torch.ones(2)}

    def weights_fingerprint(self) -> str:
        self.calls.append("weights_fingerprint")
        return "fp-of-the-weights"


class _Publisher:
    def __init__(self) -> None:
        self.published: list[int] = []

    def publish(self, version: int, state: dict) -> dict:
        self.published.append(version)
        return {"endpoint": "tcp://127.0.0.1:1", "name": f"weights/{version}", "version": version}


def _role(tmp_path, monkeypatch, trainer: Any) -> TrainRole:
    role = TrainRole(str(tmp_path), None, "cpu0")
    role.trainer = trainer
    role.publisher = _Publisher()
    monkeypatch.setattr(role, "_ensure", lambda ta: trainer)
    monkeypatch.setattr(role, "_fetch_parts", lambda mine, micro: (_batch(), [[0, 1]], {}))
    return role


def _args(rank: int) -> dict:
    part = {"ref": {"endpoint": "tcp://127.0.0.1:1", "name": "traj/1"}, "advantage": 1.0}
    return TrainArgs.from_wire({"parts": [[part], [part]], "world_size": 2, "rank": rank,
                                "master_port": 29999}).to_wire()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_only_rank_0_packs_the_weights_and_every_rank_reports_a_fingerprint(tmp_path, monkeypatch, parallel) -> None:
    r1 = _FakeTrainer(1, parallel)
    out1 = _role(tmp_path, monkeypatch, r1).train(_args(1), None)
    # ddp: rank 1 neither packs nor hashes a full copy; fsdp: the gather is a collective, so it takes part
    want = ["train_step", *(["state_dict_for_sync"] if parallel == "fsdp" else []), "weights_fingerprint"]
    assert r1.calls == want
    assert out1["checksum"] == "fp-of-the-weights" and out1.get("weights") is None
    r0 = _FakeTrainer(0, parallel)
    role0 = _role(tmp_path, monkeypatch, r0)
    out0 = role0.train(_args(0), None)
    assert r0.calls == ["train_step", "state_dict_for_sync", "weights_fingerprint"]
    assert out0["checksum"] == out1["checksum"] and role0.publisher.published == [1]


@pytest.mark.parametrize(("code", "want"), [("oom", "oom"), ("step_failed", "train_failed")])
def test_a_failed_step_is_a_typed_tool_error_and_memory_is_freed_outside_the_except(
        tmp_path, monkeypatch, code, want) -> None:
    import libra.actors.train_role as tr

    freed: list[Any] = []
    monkeypatch.setattr(tr, "free_memory", lambda where: freed.append(sys.exc_info()[1]))
    fake = _FakeTrainer(1)

    def failing(batch: Any, micro_batches: Any = None) -> dict:
        raise TrainStepFailed(code, [0], 1, "CUDA out of memory." if code == "oom" else "KeyError: 'x'")

    fake.train_step = failing  # type: ignore[method-assign]
    role = _role(tmp_path, monkeypatch, fake)
    with pytest.raises(ToolError) as info:
        role.train(_args(1), None)
    assert info.value.code == want and "rank(s) [0]" in str(info.value)
    assert freed == [None]  # freed once, with no exception (and its traceback's tensors) alive
    assert "state_dict_for_sync" not in fake.calls and fake.weights_version == 0


def test_close_frees_the_model_and_optimizer_without_gc(tmp_path, model_dir) -> None:
    role = TrainRole(str(model_dir), None, "cpu0")
    role.trainer = GRPOTrainer(model_dir, lr=1e-3)
    role.trainer.train_step(_batch())  # AdamW state exists
    refs = [weakref.ref(x) for x in (role.trainer, role.trainer.model, role.trainer.optimizer)]
    gc.collect()
    gc.disable()
    try:
        mem = role.close()
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()
    assert role.trainer is None and mem["rss_before"] > 0 and mem["rss_after"] > 0
    assert role.close()["rss_after"] > 0  # idempotent


def test_the_elastic_trainer_runs_on_the_slots_placement(tmp_path, model_dir) -> None:
    from libra.actors.elastic_train import _ensure_trainer
    from libra.engines.device.placement import Placement

    role = TrainRole(str(model_dir), None, "cpu0", placement=Placement("cpu", "bfloat16", None, "test"))
    part = {"ref": {"endpoint": "tcp://127.0.0.1:1", "name": "traj/1"}, "advantage": 1.0}
    ta = TrainArgs.from_wire({"parts": [[part], [part]], "world_size": 2, "rank": 1, "master_port": 29999,
                              "grpo": {"lr": 1e-5}, "elastic": {"generation": 1, "members": ["a", "b"]}})
    trainer = _ensure_trainer(role, ta, 1)
    try:
        # at af91053 the elastic trainer ignored the placement: CPU fp32 compute whatever the slot
        assert trainer.dtype == torch.bfloat16 and trainer.device == torch.device("cpu")
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
        assert role.elastic is not None and role.elastic.backend == "gloo"
    finally:
        role.close()
