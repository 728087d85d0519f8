"""Engine-backed actor roles on the real tiny model: the rollout batcher and its version loading over the
data plane (and the file fallback), a dead trainer mid-fetch, a single-rank train step that fetches its
shard and publishes weights over the data plane; and ``--roles`` parsing."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from libra.actors.__main__ import parse_roles
from libra.actors.roles import role_handlers
from libra.actors.rollout_role import RolloutRole
from libra.actors.slot_records import slot_record_path
from libra.weights.file import read_weights_file, write_weights_file
from libra.actors.train_role import TrainRole
from libra.actors.tools import ToolError, WorkContext
from libra.dataplane import DataPlaneServer
from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher
from libra.engines.tiny_model import ensure_tiny_model
from libra.rl.shards import encode_shard


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


def ctx() -> WorkContext:
    return WorkContext("w1", "t1", 60.0, threading.Event(), "test")


def gen_args(seed: int, weights: dict | None = None) -> dict:
    return {"prompt_ids": [5, 6, 7, 8 + seed], "max_new_tokens": 6, "temperature": 1.0, "stop_token_ids": [],
            "seed": seed, "weights": weights}


def test_weights_file_round_trips_bit_exact(tmp_path: Path) -> None:
    sd = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(2, dtype=torch.float16)}
    p = write_weights_file(tmp_path / "w" / "v7.libra", sd, 7)
    got, version = read_weights_file(p)
    assert version == 7 and list(got) == list(sd)
    for k, want in sd.items():
        assert got[k].dtype == want.dtype and torch.equal(got[k], want)
    assert not list((tmp_path / "w").glob(".*"))  # no temporary file left behind


def status(run: Path, slot: str) -> dict:
    return json.loads(slot_record_path(run, slot).read_text())


def test_rollout_batches_turns_and_fetches_versions_over_the_data_plane(tiny: Path, tmp_path: Path) -> None:
    role = RolloutRole(str(tiny), str(tmp_path), "cpu9", max_batch=8, window_s=0.2)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: role.generate(gen_args(i), ctx()), range(4)))
    assert all(o["weights_version"] == 0 and o["gen_tokens"] == len(o["token_ids"]) == len(o["logprobs"]) == 6
               for o in outs)
    assert max(o["batch"] for o in outs) > 1  # concurrent turns shared an engine call
    sd = {k: v + 0.01 for k, v in role.engine.model.state_dict().items()}
    with DataPlaneServer() as trainer:  # what trainer rank 0 runs
        pub = DataPlaneWeightPublisher(trainer, keep=2, chunk_size=64 * 1024)
        ref1 = pub.publish(1, sd)
        out = role.generate(gen_args(0, ref1), ctx())
        assert out["weights_version"] == 1 and out["weights_via"] == "dataplane" and out["weights_error"] is None
        assert out["load_s"] >= out["fetch_s"] > 0
        assert out["logprobs"] != outs[0]["logprobs"]  # same prompt and seed, different weights
        assert all(torch.equal(role.engine.model.state_dict()[k], v) for k, v in sd.items())
        st = status(tmp_path, "cpu9")
        assert st["weights_version"] == 1 and st["dataplane_loads"] == 1 and st["file_loads"] == 0
        assert st["bytes_fetched"] == ref1["bytes"] and st["fetches"][0]["via"] == "dataplane"
        # an idle instance asks the trainer it last heard of for newer weights and loads them on its own
        pub.publish(2, sd)
        deadline = time.monotonic() + 60
        while status(tmp_path, "cpu9")["weights_version"] != 2:
            assert time.monotonic() < deadline, "idle rollout instance never loaded v2"
            time.sleep(0.05)
    assert not (tmp_path / "weights").exists()  # nothing went through files
    with pytest.raises(ToolError, match="prompt_ids"):
        role.generate({"max_new_tokens": 3}, ctx())
    with pytest.raises(ToolError, match="bad generate args"):
        role.generate({"prompt_ids": [], "max_new_tokens": 3}, ctx())
    role.close()


def test_trainer_gone_mid_fetch_keeps_the_old_version_and_reports(tiny: Path, tmp_path: Path) -> None:
    role = RolloutRole(str(tiny), str(tmp_path), "cpu7", max_batch=4, window_s=0.0, fetch_timeout_s=1.0)
    sd = {k: v * 1.5 for k, v in role.engine.model.state_dict().items()}
    trainer = DataPlaneServer()
    ref = DataPlaneWeightPublisher(trainer, chunk_size=4096).publish(1, sd)
    before = role.generate(gen_args(1), ctx())

    class DiesMidTransfer(DataPlaneWeightFetcher):  # the trainer process dies after the first chunks arrived
        def fetch(self, r):
            from libra.dataplane import ObjectRef, fetch

            fetch(ObjectRef.from_wire(r), window=1, batch=1, idle_timeout_s=1.0,
                  on_chunk=lambda i, n: trainer.close() if i == 2 else None)
            raise AssertionError("the transfer cannot complete")

    role.fetcher = DiesMidTransfer()
    out = role.generate(gen_args(1, ref), ctx())
    assert out["weights_version"] == 0 and out["token_ids"] == before["token_ids"]  # the turn ran on v0
    assert out["weights_error"].startswith("PeerLost") and "after 2/" in out["weights_error"]
    st = status(tmp_path, "cpu7")
    assert st["weights_version"] == 0 and st["fetch_errors"] == 1 and st["loads"] == 0
    assert st["last_error"].startswith("PeerLost")
    again = role.generate(gen_args(1, ref), ctx())  # within the back-off: no new attempt, same report
    assert again["weights_version"] == 0 and again["weights_error"] == out["weights_error"]
    assert status(tmp_path, "cpu7")["fetch_errors"] == 1
    role.close()


def test_the_weights_file_fallback_still_loads(tiny: Path, tmp_path: Path) -> None:
    role = RolloutRole(str(tiny), None, "cpu6", max_batch=2, window_s=0.0)
    sd = {k: v + 0.02 for k, v in role.engine.model.state_dict().items()}
    path = write_weights_file(tmp_path / "v4.libra", sd, 4)
    out = role.generate(gen_args(0, {"version": 4, "path": str(path)}), ctx())
    assert out["weights_version"] == 4 and out["weights_via"] == "file" and role.stats["file_loads"] == 1
    role.close()


def shard_refs(server: DataPlaneServer, seqs: list[list[int]], step: int) -> list[dict]:
    tensors, meta = encode_shard(seqs, [[0, 0, 0] + [1] * (len(s) - 3) for s in seqs],
                                 [[0.0, 0.0, 0.0] + [-3.0] * (len(s) - 3) for s in seqs], [1.0, -1.0, 0.5, -0.5],
                                 traj_index=list(range(len(seqs))), micro_batches=[[0, 2], [1, 3]], step=step, rank=0)
    return [server.publish_state_dict(f"batch/step{step}/rank0", tensors, version=step, metadata=meta).to_wire()]


def test_single_rank_train_step_fetches_its_shard_and_publishes_weights(tiny: Path, tmp_path: Path) -> None:
    role = TrainRole(str(tiny), str(tmp_path), "cpu8")
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [5, 6, 13, 14, 15, 16], [5, 6, 17, 3]]
    with DataPlaneServer() as driver:
        args = {"shards": shard_refs(driver, seqs, 1), "world_size": 1, "rank": 0, "master_port": 1,
                "grpo": {"lr": 1e-3}, "checkpoint": None}
        out = role.train(args, ctx())
        assert out["weights_version"] == 1 and out["rank"] == 0 and out["metrics"]["grad_norm"] > 0
        assert out["metrics"]["micro_batches"] == 2.0  # the shard's micro-batch plan was used
        assert out["shard_tokens"] == sum(map(len, seqs)) and out["shard_bytes"] > 0
        assert out["weights"]["version"] == 1 and out["weights"]["endpoint"] == role.server.endpoint
        sd, version, _ = DataPlaneWeightFetcher().fetch(out["weights"])
        assert version == 1
        own = role.trainer.model.state_dict()
        assert all(torch.equal(sd[k], own[k]) for k in own)
        first = out["checksum"]
        out2 = role.train({**args, "shards": shard_refs(driver, seqs, 2), "checkpoint": str(tmp_path / "ck")}, ctx())
        assert out2["weights_version"] == 2 and out2["checksum"] != first
        assert (tmp_path / "ck" / "trainer_state.json").is_file()
        with pytest.raises(ToolError, match="shard_fetch_failed|not"):
            role.train({**args, "shards": [{**args["shards"][0], "name": "batch/gone"}]}, ctx())
    assert not (tmp_path / "weights").exists() and not (tmp_path / "batches").exists()
    with pytest.raises(ToolError, match="shards"):
        role.train({}, ctx())
    role.close()


def test_role_handlers_and_roles_spec() -> None:
    assert parse_roles("rollout=2,train=1,action") == ["rollout", "rollout", "train", "action"]
    for bad, msg in (("gpu=1", "unknown role"), ("train=x", "integer"), ("", "no slots")):
        with pytest.raises(ValueError, match=msg):
            parse_roles(bad)
    with pytest.raises(ValueError, match="--model-dir"):
        role_handlers("rollout", None, None, "cpu0")
    with pytest.raises(ValueError, match="unknown role"):
        role_handlers("chef", "/nonexistent", None, "cpu0")


def test_a_cancelled_turn_leaves_the_running_batch_and_a_waiting_one_never_starts(tiny: Path) -> None:
    from libra.engines.work_context import ToolError

    role = RolloutRole(str(tiny), None, "cpu4", max_batch=2, window_s=0.5)
    long_ctx, short_ctx = ctx(), WorkContext("w2", "t2", 60.0, threading.Event(), "test")
    engine_generate, steps = role.engine.generate, []

    def revoke_at_step_10(got: list) -> None:  # the broker revokes the long turn's work as its 10th token comes
        steps.append(got)
        if len(steps) == 10:
            long_ctx.cancelled.set()

    role.engine.generate = lambda reqs, **kw: engine_generate(reqs, on_tokens=revoke_at_step_10, **kw)
    with ThreadPoolExecutor(2) as pool:
        long_turn = pool.submit(role.generate, {**gen_args(1), "max_new_tokens": 2000}, long_ctx)
        short = pool.submit(role.generate, gen_args(2), short_ctx).result()
        with pytest.raises(ToolError) as err:
            long_turn.result()
    assert short["batch"] == 2 and short["finish_reason"] == "length" and short["gen_tokens"] == 6
    assert err.value.code == "cancelled" and err.value.message == "turn cancelled after 10 tokens"
    assert len(steps) == 10  # the batch ended at the cancelled row's 10th token, not at its 2000th
    waiting = ctx()
    waiting.cancelled.set()  # cancelled before the batcher took it: nothing of it runs
    with pytest.raises(ToolError, match="before it started"):
        role.generate(gen_args(3), waiting)
    assert role.stats["cancelled_turns"] == 2 and len(steps) == 10
    role.close()
