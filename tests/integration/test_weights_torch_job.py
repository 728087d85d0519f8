"""The RL job with weights over torch.distributed (``[actors] weights_transport = "torch"``): the trainer's rank 0
broadcasts each version to every rollout actor that asks, over gloo on this CPU machine (NCCL on GPUs),
with the same broker, roles and job as the data-plane run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from libra.rl.config import load_job
from libra.rl.driver import run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"


def test_rollout_actors_load_every_version_over_torch_distributed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("LIBRA_WEIGHTS_TRANSPORT", raising=False)  # the job file's setting alone selects it
    cfg = load_job(EXAMPLE).with_run_dir(str(tmp_path / "run"))
    cfg = dataclasses.replace(cfg, actors=dataclasses.replace(cfg.actors, allow_unisolated=False,
                                                              weights_transport="torch"))
    summary = run_job(cfg, progress=False)
    run = tmp_path / "run"
    assert summary["final_version"] == 3 and summary["dropped_groups"] == 0
    sync = summary["rollout_sync"]
    assert sync["torch_loads"] >= 2 and sync["dataplane_loads"] == 0 and sync["file_loads"] == 0
    assert sync["fetch_errors"] == 0
    assert {x["version"] for x in sync["fetches"] if x["via"] == "torch"} >= {3}
    assert all(x["bytes"] > 0 for x in sync["fetches"])
    assert all(v == 3 for v in summary["rollout_versions"].values()), summary["rollout_versions"]
    for f in (run / "actors").glob("*.json"):
        st = json.loads(f.read_text())
        if st.get("role") == "rollout":
            assert st["torch_loads"] == st["loads"] >= 1 and st["weights_version"] == 3
    recs = read_metrics(run)
    lag = cfg.job.max_policy_lag
    for r in recs:  # every turn generated within the lag bound, and both trainer ranks stayed identical
        assert r["checksums"][0] == r["checksums"][1]
        for versions in r["turn_versions"]:
            assert all(0 <= r["weights_version"] - 1 - v <= lag for v in versions)


def test_the_job_trains_with_fsdp_ranks_and_writes_a_sharded_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """``[grpo] parallel = "fsdp"``: two FSDP2 trainer ranks (gloo) under the real broker and actors; rank 0
    publishes the gathered weights, both ranks report the same weights, the final checkpoint is sharded."""
    monkeypatch.delenv("LIBRA_WEIGHTS_TRANSPORT", raising=False)
    cfg = load_job(EXAMPLE).with_run_dir(str(tmp_path / "run"))
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, parallel="fsdp"),
                              actors=dataclasses.replace(cfg.actors, allow_unisolated=False))
    summary = run_job(cfg, progress=False)
    assert summary["final_version"] == 3 and summary["dropped_groups"] == 0
    assert all(v == 3 for v in summary["rollout_versions"].values()), summary["rollout_versions"]
    for r in read_metrics(tmp_path / "run"):
        assert r["checksums"][0] == r["checksums"][1]
    ckpt = tmp_path / "run" / "checkpoints" / "step3"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["format"] == "sharded" and state["world_size"] == 2 and state["weights_version"] == 3
    assert (ckpt / ".metadata").is_file() and (ckpt / "config.json").is_file()
