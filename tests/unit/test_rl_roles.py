"""Engine-backed actor roles on the real tiny model: the weights file, the rollout batcher and its
version loading, a single-rank train step publishing weights; and ``--roles`` parsing."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from libra.actors.__main__ import parse_roles
from libra.actors.roles import (
    RolloutRole,
    TrainRole,
    read_weights_file,
    role_handlers,
    write_weights_file,
)
from libra.actors.tools import ToolError, WorkContext
from libra.engines.tiny_model import ensure_tiny_model


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


def test_rollout_batches_concurrent_turns_and_loads_versions_between_batches(tiny: Path, tmp_path: Path) -> None:
    role = RolloutRole(str(tiny), str(tmp_path), "cpu9", max_batch=8, window_s=0.2)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: role.generate(gen_args(i), ctx()), range(4)))
    assert all(o["weights_version"] == 0 and o["gen_tokens"] == len(o["token_ids"]) == len(o["logprobs"]) == 6
               for o in outs)
    assert max(o["batch"] for o in outs) > 1  # concurrent turns shared an engine call
    # publish version 1 (perturbed weights): the next turn that names it runs on it
    sd = {k: v + 0.01 for k, v in role.engine.model.state_dict().items()}
    path = write_weights_file(tmp_path / "weights" / "v1.libra", sd, 1)
    before = role.generate(gen_args(0), ctx())
    assert before["weights_version"] in (0, 1)  # idle polling may already have loaded it
    out = role.generate(gen_args(0, {"version": 1, "path": str(path)}), ctx())
    assert out["weights_version"] == 1
    assert out["logprobs"] != outs[0]["logprobs"]  # same prompt and seed, different weights
    status = json.loads((tmp_path / "actors" / "cpu9.json").read_text())
    assert status["weights_version"] == 1 and status["loads"] == 1
    # an idle instance picks up a newer published version on its own
    write_weights_file(tmp_path / "weights" / "v2.libra", sd, 2)
    deadline = time.monotonic() + 30
    while json.loads((tmp_path / "actors" / "cpu9.json").read_text())["weights_version"] != 2:
        assert time.monotonic() < deadline, "idle rollout instance never loaded v2"
        time.sleep(0.05)
    with pytest.raises(ToolError, match="prompt_ids"):
        role.generate({"max_new_tokens": 3}, ctx())
    with pytest.raises(ToolError, match="bad generate args"):
        role.generate({"prompt_ids": [], "max_new_tokens": 3}, ctx())


def test_single_rank_train_step_publishes_the_weights_it_checksums(tiny: Path, tmp_path: Path) -> None:
    role = TrainRole(str(tiny), str(tmp_path), "cpu8")
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [5, 6, 13, 14, 15, 16], [5, 6, 17]]
    batch = {"input_ids": seqs, "loss_mask": [[0, 0, 0] + [1] * (len(s) - 3) for s in seqs],
             "rollout_logprobs": [[0.0, 0.0, 0.0] + [-3.0] * (len(s) - 3) for s in seqs],
             "advantages": [1.0, -1.0, 0.5, -0.5]}
    bp = tmp_path / "b.json"
    bp.write_text(json.dumps(batch))
    out = role.train({"batch_path": str(bp), "world_size": 1, "rank": 0, "master_port": 1, "grpo": {"lr": 1e-3},
                      "checkpoint": None}, ctx())
    assert out["weights_version"] == 1 and out["rank"] == 0 and out["metrics"]["grad_norm"] > 0
    sd, version = read_weights_file(out["weights_path"])
    assert version == 1
    own = role.trainer.model.state_dict()
    assert all(torch.equal(sd[k], own[k]) for k in own)
    first = out["checksum"]
    out2 = role.train({"batch_path": str(bp), "world_size": 1, "rank": 0, "master_port": 1, "grpo": {"lr": 1e-3},
                       "checkpoint": str(tmp_path / "ck")}, ctx())
    assert out2["weights_version"] == 2 and out2["checksum"] != first
    assert (tmp_path / "ck" / "trainer_state.json").is_file()
    with pytest.raises(ToolError, match="batch_path"):
        role.train({}, ctx())


def test_role_handlers_and_roles_spec() -> None:
    assert parse_roles("rollout=2,train=1,action") == ["rollout", "rollout", "train", "action"]
    for bad, msg in (("gpu=1", "unknown role"), ("train=x", "integer"), ("", "no slots")):
        with pytest.raises(ValueError, match=msg):
            parse_roles(bad)
    with pytest.raises(ValueError, match="--model-dir"):
        role_handlers("rollout", None, None, "cpu0")
    with pytest.raises(ValueError, match="unknown role"):
        role_handlers("chef", "/nonexistent", None, "cpu0")
