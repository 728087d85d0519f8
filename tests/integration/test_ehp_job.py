"""The Elastic Hybrid Pool in the broker, end to end on real processes: a broker with ``allocation =
"grp_ehp"`` and a forced borrow from step 1 and release at step 4, two core trainer ranks, two hybrid
actors (rollout until borrowed), an episode runner and a tool actor run the tiny job. One hybrid actor
switches roles while the core trains step 1, joins training at step 2 (it loads rank 0's weights and AdamW state over the data plane, then contributes a
zero gradient), trains with real data at step 3 and is back in rollout from step 4; every member holds
the same weights after every step and every trajectory is trained exactly once."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from libra.client import Client
from libra.local import LocalCluster
from libra.rl.config import load_job
from libra.rl.driver import resolve_model, run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: sudo apt-get install bubblewrap")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"
BROKER = """
[broker]
heartbeat_s = 2.0

[broker.planner]
allocation = "grp_ehp"
interval_s = 3600

[broker.planner.ehp]
force = [[1, 1], [4, 0]]
"""


@pytest.mark.timeout(900)
def test_a_forced_borrow_joins_a_hybrid_replica_for_two_steps(tmp_path: Path) -> None:
    cfg = load_job(EXAMPLE)
    run = tmp_path / "run"
    cfg = cfg.with_run_dir(str(run))
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, steps=4),
                              actors=dataclasses.replace(cfg.actors, allow_unisolated=False))
    (tmp_path / "broker.toml").write_text(BROKER)
    model = resolve_model(cfg.model.name)
    actor_args = ["--roles", "train=2,hybrid=2,action=1,episode=1", "--model-dir", str(model), "--run-dir", str(run),
                  "--torch-threads", "1", "--rollout-batch", "4", "--no-restart"]
    # PYTHONFAULTHANDLER: an actor that crashes in native code (exit -11 was seen once) prints every thread's stack
    cluster = LocalCluster(cpu_slots=6, actor_args=actor_args, env={"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
                           broker_args=["--config", str(tmp_path / "broker.toml")])
    cluster.start(wait_actors=6, timeout=300.0)
    try:
        summary = run_job(cfg, cluster.url, progress=False)
        with Client(cluster.url) as c:
            kinds = {a["id"]: a["kinds"] for a in c.status().actors}
    finally:
        cluster.stop()
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and summary["final_version"] == 4
    assert [len(r["members"]) for r in recs] == [2, 3, 3, 2]
    assert [r["generation"] for r in recs] == [1, 2, 2, 3]
    core = recs[0]["members"]
    hybrid = recs[1]["members"][2]
    assert recs[1]["members"][:2] == core == recs[3]["members"] and hybrid not in core
    # step 2: the joiner loaded version 1 (rank 0's state before the step) and trained on nothing
    assert recs[1]["zero_members"] == recs[1]["joining"] == [hybrid]
    assert recs[1]["restored_versions"] == [None, None, 1] and recs[1]["shard_sequences"][2] == 0
    # step 3: it trains with real data; step 4: it is gone
    assert recs[2]["zero_members"] == [] and recs[2]["shard_sequences"][2] > 0
    for r in recs:
        assert r["trained_by"] == r["members"]
        assert len(set(r["checksums"])) == 1 and None not in r["checksums"], r["step"]  # identical weights
        assert sum(r["shard_sequences"]) == r["sequences"] == 2 * 4  # every trajectory once, none twice
        assert r["train_attempts"] == [1] * len(r["members"])  # no train work was started twice
    assert len({r["checksums"][0] for r in recs}) == 4  # the weights moved every step
    assert summary["episodes_failed"] == 0 and recs[-1]["dropped_groups"] == 0
    history = recs[-1]["ehp"]["replicas"][hybrid]["history"]
    assert history == ["g1:requested", "g1:fetching_state", "g1:zero_sync", "g1:activating", "g1:active",
                       "g1:released"]
    for r in recs:  # what the join cost each member (seconds; printed for the record, never asserted)
        print("ehp step", r["step"], "members", r["members"], "state_fetch_s", r["state_fetch_s"],
              "group_form_s", r["group_form_s"], "group_wait_s", r["group_wait_s"],
              "train_time_s", round(r["train_time_s"], 3))
    assert kinds[hybrid] == ["generate"] and all(kinds[a] == ["train"] for a in core)
