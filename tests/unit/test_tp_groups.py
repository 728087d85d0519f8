"""Rollout TP groups as one engine: only the leader holds an engine and bids, members idle, regrouping
drains and rebuilds; the HF engine refuses TP > 1; a CUDA out-of-memory error is a typed ``oom`` failure
after which the instance keeps serving with a smaller batch. CPU only: engines are fakes where a real one
would need GPUs (vLLM's arguments are tested in test_engine_device.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from libra.actors import roles as roles_mod
from libra.actors.roles import HybridRole
from libra.actors.rollout_role import RolloutRole, make_rollout_engine
from libra.actors.state import ActorIdentity, ActorState, Received, Reconfigure, Reconfigured, SendMsg, Start
from libra.actors.tools import ToolError, WorkContext
from libra.engines.device.errors import TPUnsupported
from libra.engines.device.placement import choose_placement
from libra.engines.kv_cache import KVCache
from libra.engines.rollout_base import GenResult
from libra.protocol import messages as m


def ctx() -> WorkContext:
    return WorkContext("w1", "t1", 60.0, threading.Event(), "test")


def ready_actor(slot: str) -> ActorState:
    ident = ActorIdentity(f"h/{slot}", "h", slot, 1, {"generate": ["default"], "train": ["grpo"], "sync": ["*"]},
                          {"slot_kind": "gpu", "engine": "vllm", "max_tp": 4})
    a = ActorState(ident, ["generate"], 32)
    a.handle(Start(), 0.0)
    a.handle(Received(m.Welcome("s1", "b", 1.0, 3, 1 << 20)), 0.0)
    return a


def direct(a: ActorState, did: int, rank: int, tp: int = 2, group: str = "g1.rollout0") -> m.Bid:
    cfg = {"role": "rollout", "tp": tp, "group": group, "bucket": f"tp{tp}", "rank": rank, "size": tp}
    (rc,) = [c for c in a.handle(Received(m.Directive(did, ["generate", "sync"], "finish", cfg)), 1.0)
             if isinstance(c, Reconfigure)]
    assert rc.config == cfg
    out = a.handle(Reconfigured(did, capacity=None if rank else 16), 1.1)
    (bid,) = [c.msg for c in out if isinstance(c, SendMsg) and isinstance(c.msg, m.Bid)]
    return bid


def test_only_the_leader_of_a_tp_group_bids_and_members_bid_for_nothing() -> None:
    leader, member = ready_actor("gpu0"), ready_actor("gpu1")
    assert direct(leader, 1, rank=0).kinds == ["generate", "sync"]
    assert direct(member, 1, rank=1).kinds == []
    assert member.group == ("g1.rollout0", 2, 1) and leader.group == ("g1.rollout0", 2, 0)
    # ungrouped again (a TP-1 instance): the former member bids for rollout work itself
    assert direct(member, 2, rank=0, tp=1, group="g2.rollout1").kinds == ["generate", "sync"]
    assert member.group == ("", 1, 0)


class FakeRollout:
    """Stands in for RolloutRole: records the engine it would build and whether it was closed."""

    built: list[FakeRollout] = []

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, **kw: Any) -> None:
        self.slot, self.tp, self.devices, self.closed = slot, kw["tp"], kw["devices"], False
        self.placement = kw["placement"]
        FakeRollout.built.append(self)

    def generate(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        return {"slot": self.slot, "tp": self.tp}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_rollout(monkeypatch: pytest.MonkeyPatch) -> type[FakeRollout]:
    FakeRollout.built = []
    monkeypatch.setattr(roles_mod, "RolloutRole", FakeRollout)
    monkeypatch.setenv("LIBRA_ROLLOUT_ENGINE", "vllm")
    return FakeRollout


def hybrid(slot: str) -> HybridRole:
    return HybridRole("/no/model", None, slot, max_batch=16, placement=choose_placement(slot, cuda_devices=1))


def group_cfg(rank: int, tp: int = 2, group: str = "g1.rollout0") -> dict[str, Any]:
    return {"role": "rollout", "tp": tp, "group": group, "bucket": f"tp{tp}", "rank": rank, "size": tp}


def test_a_tp_group_is_one_engine_on_the_leader_over_the_groups_gpus(fake_rollout: type[FakeRollout]) -> None:
    leader, member = hybrid("gpu2"), hybrid("gpu3")
    assert leader.reconfigure(["generate", "sync"], group_cfg(0)) == 16
    assert member.reconfigure(["generate", "sync"], group_cfg(1)) == 0
    (engine,) = fake_rollout.built  # one engine for the group, built at the directive
    assert (engine.slot, engine.tp, engine.devices) == ("gpu2", 2, (2, 3))
    assert leader.rollout is engine and member.rollout is None and member.trainer is None
    assert leader.generate({}, ctx()) == {"slot": "gpu2", "tp": 2}
    with pytest.raises(ToolError, match="its leader serves") as exc:
        member.generate({}, ctx())
    assert exc.value.code == "bad_request"
    assert not fake_rollout.built[1:]  # the member never built one


def test_regrouping_closes_the_drained_engine_and_builds_the_new_one(fake_rollout: type[FakeRollout]) -> None:
    leader = hybrid("gpu0")
    leader.reconfigure(["generate", "sync"], group_cfg(0))
    first = leader.rollout
    leader.reconfigure(["generate", "sync"], group_cfg(0))  # same group: the engine stays
    assert leader.rollout is first and len(fake_rollout.built) == 1
    leader.reconfigure(["generate", "sync"], group_cfg(0, tp=4, group="g2.rollout0"))
    assert first.closed and leader.rollout is not first
    assert (leader.rollout.tp, leader.rollout.devices) == (4, (0, 1, 2, 3))
    leader.reconfigure(["train", "sync"], {"role": "train", "tp": 1, "group": "g3.replica0", "rank": 0})
    assert leader.rollout is None and leader.group == ("", 1, 0)


def test_the_brokers_engine_settings_in_a_directive_rebuild_the_engine(fake_rollout: type[FakeRollout]) -> None:
    role = hybrid("gpu0")
    role.generate({}, ctx())
    first = role.rollout
    assert first.placement.dtype == "bfloat16"
    one = {"role": "rollout", "tp": 1, "group": "g1.rollout0", "rank": 0}
    role.reconfigure(["generate", "sync"], one)
    assert role.rollout is first  # same placement: the engine stays
    role.reconfigure(["generate", "sync"], {**one, "dtype": "fp16", "gpu_memory_fraction": 0.5})
    assert first.closed and role.placement.dtype == "float16" and role.placement.memory_fraction == 0.5
    role.generate({}, ctx())
    assert role.rollout.placement.dtype == "float16"


def test_the_hf_engine_refuses_tp_above_one(fake_rollout: type[FakeRollout], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIBRA_ROLLOUT_ENGINE", "hf")
    leader = hybrid("gpu0")
    leader.reconfigure(["generate", "sync"], {"role": "rollout", "tp": 1, "group": "g1.rollout0", "rank": 0})
    with pytest.raises(TPUnsupported, match="TP-2"):
        leader.reconfigure(["generate", "sync"], group_cfg(0))
    assert leader.group == ("", 1, 0)  # refused before anything changed
    with pytest.raises(TPUnsupported, match="TP 1 only"):
        make_rollout_engine("/no/model", 8, None, tp=2)


class OomOnce:
    """A rollout engine whose first call runs out of CUDA memory. It keeps contexts in a KV cache of its own, as
    the HF engine does, so the role calls it the way it calls a real engine (``sessions=``)."""

    weights_version = 0

    def __init__(self) -> None:
        self.max_batch_size, self.calls = 32, 0
        self.kv_cache = KVCache(1 << 20)

    def generate(self, reqs: list, sessions: list | None = None) -> list[GenResult]:
        self.calls += 1
        if self.calls == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return [GenResult([1, 2], [-0.1, -0.2], "length", 0) for _ in reqs]


def test_an_injected_cuda_oom_is_a_typed_oom_failure_and_the_instance_keeps_serving(tmp_path) -> None:
    engine = OomOnce()
    role = RolloutRole("/no/model", str(tmp_path), "gpu0", max_batch=32, window_s=0.0, engine=engine)
    args = {"prompt_ids": [5, 6], "max_new_tokens": 2, "temperature": 0.0, "stop_token_ids": [], "seed": 1,
            "weights": None}
    with pytest.raises(ToolError) as exc:
        role.generate(args, ctx())
    assert exc.value.code == "oom" and "32 -> 16" in exc.value.message
    assert (role.max_batch, engine.max_batch_size, role.ooms) == (16, 16, 1)
    out = role.generate(args, ctx())  # the same instance serves the next turn
    assert out["token_ids"] == [1, 2] and out["batch"] == 1
    role.close()
