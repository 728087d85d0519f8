"""A hybrid slot's role switch frees what the old role held before it builds the next engine: after rollout ->
train -> rollout on the real tiny model (HF engine and GRPO trainer on the CPU) the old engine, its model, the
trainer's model and its optimizer are collected by reference counting alone (the automatic collector is off,
and the release step says it needed no ``gc.collect()``); the next engine's constructor runs only once the old
one is gone; and the slot's record holds each switch with the memory before and after the release."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from libra.actors import rollout_role
from libra.actors.roles import HybridRole
from libra.actors.slot_records import slot_record_path
from libra.actors.tools import WorkContext
from libra.dataplane import DataPlaneServer
from libra.engines.device.placement import choose_placement
from libra.engines.tiny_model import ensure_tiny_model
from libra.rl.shards import encode_shard

ROLLOUT = (["generate", "sync"], {"role": "rollout"})
TRAIN = (["train", "sync"], {"role": "train"})


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


@pytest.fixture
def no_auto_gc() -> Iterator[None]:
    """Only reference counting frees objects during the test (a cycle would keep them until a collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def ctx() -> WorkContext:
    return WorkContext("w1", "t1", 60.0, threading.Event(), "test")


GEN = {"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 4, "temperature": 1.0, "stop_token_ids": [], "seed": 1,
       "weights": None}


def record(run: Path, slot: str) -> dict:
    return json.loads(slot_record_path(run, slot).read_text())


def train_args(server: DataPlaneServer) -> dict:
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [5, 6, 13, 14, 15, 16], [5, 6, 17, 3]]
    tensors, meta = encode_shard(seqs, [[0, 0, 0] + [1] * (len(s) - 3) for s in seqs],
                                 [[0.0, 0.0, 0.0] + [-3.0] * (len(s) - 3) for s in seqs], [1.0, -1.0, 0.5, -0.5],
                                 traj_index=list(range(len(seqs))), micro_batches=[[0, 2], [1, 3]], step=1, rank=0)
    ref = server.publish_state_dict("batch/step1/rank0", tensors, version=1, metadata=meta).to_wire()
    return {"shards": [ref], "world_size": 1, "rank": 0, "master_port": 1, "grpo": {"lr": 1e-3}, "checkpoint": None}


def hybrid(tiny: Path, run: Path) -> HybridRole:
    return HybridRole(str(tiny), str(run), "cpu3", max_batch=4, placement=choose_placement("cpu3", cuda_devices=0))


def test_rollout_train_rollout_frees_the_engine_and_the_trainer_by_refcount(tiny: Path, tmp_path: Path,
                                                                            no_auto_gc: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    role = hybrid(tiny, tmp_path)
    role.reconfigure(*ROLLOUT)
    assert len(role.generate(GEN, ctx())["token_ids"]) == 4
    r = role.rollout
    assert r is not None
    dead = {"rollout role": weakref.ref(r), "engine": weakref.ref(r.engine), "model": weakref.ref(r.engine.model),
            "context service": weakref.ref(r.contexts)}
    del r

    assert role.reconfigure(*TRAIN) == 1
    alive = [name for name, ref in dead.items() if ref() is not None]
    assert not alive, f"still alive after the switch to train: {alive}"
    sw = record(tmp_path, "cpu3")["role_switches"][-1]
    assert sw["released"] == ["rollout"] and sw["gc_needed"] is False and sw["still_alive"] == []
    assert sw["memory_before"]["rss_bytes"] > 0 and sw["memory_after"]["rss_bytes"] > 0

    with DataPlaneServer() as driver:
        assert role.train(train_args(driver), ctx())["weights_version"] == 1
    t = role.trainer
    assert t is not None and t.trainer is not None
    tdead = {"train role": weakref.ref(t), "trainer": weakref.ref(t.trainer), "trainer model": weakref.ref(t.trainer.model),
             "optimizer": weakref.ref(t.trainer.optimizer)}
    del t

    seen_at_build: list[list[str]] = []
    real = rollout_role.make_rollout_engine

    def spy(*args, **kwargs):  # the next engine is built only after the old roles were released
        seen_at_build.append([name for name, ref in {**dead, **tdead}.items() if ref() is not None])
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout_role, "make_rollout_engine", spy)
    assert role.reconfigure(*ROLLOUT) == 4
    alive = [name for name, ref in tdead.items() if ref() is not None]
    assert not alive, f"still alive after the switch back to rollout: {alive}"
    rec = record(tmp_path, "cpu3")
    assert rec["switches"] == 3 and [s["released"] for s in rec["role_switches"]] == [[], ["rollout"], ["train"]]
    assert rec["role_switches"][-1]["gc_needed"] is False
    assert len(role.generate(GEN, ctx())["token_ids"]) == 4
    assert seen_at_build == [[]]
    rec = record(tmp_path, "cpu3")  # the rollout role's own status keeps the slot's switch history
    assert rec["role"] == "rollout" and rec["switches"] == 3 and len(rec["role_switches"]) == 3
    role.reconfigure(*TRAIN)


class Engine:
    """Stands in for an engine: only its lifetime matters here."""


class RecordingRollout:
    """Stands in for RolloutRole in a TP group's rebuild: notes, when built, whether the last engine is gone."""

    last: weakref.ref | None = None
    seen: list[bool] = []
    events: list[str] = []

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, **kw: object) -> None:
        cls = RecordingRollout
        cls.seen.append(cls.last is None or cls.last() is None)
        cls.events.append("built")
        self.engine: Engine | None = Engine()
        cls.last = weakref.ref(self.engine)

    def close(self) -> None:
        self.engine = None


def test_a_regroup_builds_the_new_engine_only_after_the_old_one_is_gone(tmp_path: Path, no_auto_gc: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from libra.actors import roles as roles_mod
    from libra.engines import memory

    real_release = memory.release_memory

    def release(*args, **kwargs):
        RecordingRollout.events.append("released")
        return real_release(*args, **kwargs)

    monkeypatch.setattr(memory, "release_memory", release)
    monkeypatch.setattr(roles_mod, "RolloutRole", RecordingRollout)
    monkeypatch.setenv("LIBRA_ROLLOUT_ENGINE", "vllm")
    RecordingRollout.last, RecordingRollout.seen, RecordingRollout.events = None, [], []
    role = HybridRole("/no/model", str(tmp_path), "gpu0", max_batch=8, placement=choose_placement("gpu0", cuda_devices=1))
    group = {"role": "rollout", "tp": 2, "group": "g1.rollout0", "rank": 0, "size": 2}
    role.reconfigure(["generate", "sync"], group)
    role.reconfigure(["generate", "sync"], {**group, "tp": 4, "group": "g2.rollout0", "size": 4})
    assert RecordingRollout.seen == [True, True]  # the TP-4 engine was built after the TP-2 one was dropped
    assert RecordingRollout.events == ["built", "released", "built"]  # ... and its memory released
    rec = record(tmp_path, "gpu0")
    assert rec["role"] == "rollout" and [s["released"] for s in rec["role_switches"]] == [[], ["rollout"]]


def test_the_release_step_collects_a_cycle_only_when_one_holds_what_should_be_gone(no_auto_gc: None) -> None:
    from libra.engines.memory import memory_reading, release_memory, weak

    class Held:
        pass

    plain, looped = Held(), Held()
    looped.me = looped  # type: ignore[attr-defined]  # a reference cycle: only a collection frees it
    refs = weak(plain, looped, None, 3)  # None and ints cannot be weakly referenced: left out
    assert len(refs) == 2
    del plain
    rec = release_memory(memory_reading(), refs[:1])
    assert rec["gc_needed"] is False and rec["still_alive"] == [] and rec["after"]["rss_bytes"] > 0
    del looped
    assert refs[1]() is not None
    rec = release_memory(memory_reading(), refs)
    assert rec["gc_needed"] is True and rec["still_alive"] == [] and refs[1]() is None


def test_an_eager_hybrid_slot_builds_its_rollout_engine_at_start_and_hands_it_the_kv_hook(tiny: Path,
                                                                                       tmp_path: Path) -> None:
    lazy = hybrid(tiny, tmp_path)
    assert lazy.rollout is None and lazy.engines_built == 0  # built on the first turn
    role = HybridRole(str(tiny), str(tmp_path), "cpu4", max_batch=4, placement=choose_placement("cpu4", cuda_devices=0),
                      eager=True)
    try:
        assert role.rollout is not None and role.engines_built == 1  # before any turn
        hook = lambda used, seqs: None  # noqa: E731  (the runtime sets it after start-up)
        role.on_kv_use = hook
        assert role.rollout.on_kv_use is hook
        assert len(role.generate(GEN, ctx())["token_ids"]) == 4 and role.engines_built == 1
    finally:
        role.rollout.close()
