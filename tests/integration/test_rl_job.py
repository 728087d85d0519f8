"""The RL job end to end on real processes: broker + 2 rollout + 2 trainer (gloo) + 1 action actor on
loopback, the tiny random model, three GRPO steps through ``run_job``. Weights and training shards move
over the data plane (peer to peer), never through files or the broker."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from libra.actors.slot_records import read_slot_records
from libra.policies.routing.prefix_tree import CausalPrefixTree
from libra.rl.config import load_job
from libra.rl.driver import run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              # the job needs the sandboxed python tool and refuses to start without it
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: sudo apt-get install bubblewrap")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    cfg = load_job(EXAMPLE)
    assert (cfg.actors.rollout, cfg.actors.trainer, cfg.job.steps) == (2, 2, 3)
    run = tmp_path_factory.mktemp("rl") / "run"
    cfg = cfg.with_run_dir(str(run))
    cfg = dataclasses.replace(cfg, actors=dataclasses.replace(cfg.actors, allow_unisolated=False))
    summary = run_job(cfg, progress=False)
    return summary, run


def test_three_steps_produce_versions_metrics_and_files(tiny_run: tuple[dict, Path]) -> None:
    summary, run = tiny_run
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["weights_version"] for r in recs] == [1, 2, 3]
    assert summary["final_version"] == 3
    assert summary["job_state_in"] == "broker" and summary["episodes_failed"] == 0
    for r in recs:
        assert r["sequences"] == 2 * 4 and r["ranks"] == 2
        # the broker decided the dispatch; each rank fetched its trajectories from the episode runner
        assert r["dispatch_decided_by"] == "broker" and r["shard_sources"] == 1 and r["shard_bytes"] > 0
        assert sum(r["rank_tokens"]) > 0 and r["dispatch_imbalance"] <= r["dispatch_imbalance_round_robin"]
        for key in ("reward_mean", "reward_std", "tokens_per_s", "rollout_time_s", "train_time_s",
                    "sync_time_s", "policy_lag_max", "versions_seen"):
            assert key in r
    for name in ("config.toml", "metrics.jsonl", "reward.png", "throughput.png", "summary.json"):
        assert (run / name).is_file(), name
    assert (run / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the broker's C-MLFQ tree learned every finished episode, and the job left it in the run directory
    tree = CausalPrefixTree.load(run / "router_state.json")
    assert tree.global_tree.root.stats.count == sum(r["sequences"] for r in recs)
    assert 1 <= tree.num_prompts <= tree.global_tree.root.stats.count // 2  # a GRPO group shares one prompt tree
    ckpt = run / "checkpoints" / "step3"
    assert json.loads((ckpt / "trainer_state.json").read_text())["weights_version"] == 3
    assert not (ckpt / "optimizer.pt").exists()  # by default a checkpoint leaves out the optimizer state


def test_both_trainer_ranks_end_with_identical_weights_that_changed(tiny_run: tuple[dict, Path]) -> None:
    _, run = tiny_run
    recs = read_metrics(run)
    for r in recs:
        assert len(r["checksums"]) == 2 and r["checksums"][0] == r["checksums"][1], r["step"]
    # the shaping reward gives the random model's groups reward variance, so steps really move weights
    assert any(r["grad_norm"] > 0 for r in recs)
    assert len({r["checksums"][0] for r in recs}) > 1


def test_every_turn_is_within_the_lag_bound(tiny_run: tuple[dict, Path]) -> None:
    _, run = tiny_run
    lag = load_job(EXAMPLE).job.max_policy_lag
    for r in read_metrics(run):
        trained_at = r["weights_version"] - 1
        for versions in r["turn_versions"]:
            assert versions, "a trajectory without turns"
            for v in versions:
                assert 0 <= trained_at - v <= lag, (r["step"], versions)
        assert r["policy_lag_max"] <= lag


def _serving(run: Path) -> dict[str, dict]:
    """The rollout slots' records by actor id, less a hybrid slot the Elastic Hybrid Pool released back to rollout
    that has served no turn since (its engine is built, with the newest weights, on its next turn: no version)."""
    released = {d["detail"]["actor"] for d in read_metrics(run, "decision") if d["what"] == "ehp_leave"}
    return {aid: rec for aid, rec in read_slot_records(run).items()
            if not (aid in released and "weights_version" not in rec)}


def test_rollout_actors_report_the_new_version(tiny_run: tuple[dict, Path]) -> None:
    summary, run = tiny_run
    assert len(summary["rollout_versions"]) == 2
    serving = _serving(run)
    assert serving and all(summary["rollout_versions"][aid] == 3 for aid in serving), summary["rollout_versions"]
    for st in serving.values():
        assert st["role"] == "rollout" and st["weights_version"] == 3 and st["loads"] >= 1


def test_weights_and_batches_moved_over_the_data_plane(tiny_run: tuple[dict, Path]) -> None:
    summary, run = tiny_run
    assert not (run / "weights").exists() and not (run / "batches").exists()  # no file in the path
    sync = summary["rollout_sync"]
    assert sync["file_loads"] == 0 and sync["fetch_errors"] == 0
    assert sync["dataplane_loads"] >= 2  # each rollout actor loaded at least version 3 over the data plane
    assert {x["version"] for x in sync["fetches"] if x["via"] == "dataplane"} >= {3}
    assert all(x["bytes"] > 0 for x in sync["fetches"])
    for st in _serving(run).values():
        assert st["dataplane_loads"] == st["loads"] >= 1 and st["file_loads"] == 0
    for r in read_metrics(run):
        assert r["weights_bytes"] > 0 and r["weight_publish_s"] > 0
        assert r["shard_bytes"] > 0 and sum(r["rank_tokens"]) > 0 and len(r["rank_tokens"]) == 2
        assert r["dispatch"] == "lpt" and r["dispatch_imbalance"] <= r["dispatch_imbalance_round_robin"]
