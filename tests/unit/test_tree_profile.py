"""The offline profiler (``libra.commands.tree_profile``) and ``python -m libra tree``: a tree built from a trace
equals the tree C-MLFQ learns when the same trace runs through the real broker in the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.cli import main as cli_main
from libra.policies.routing.prefix_tree import CausalPrefixTree
from libra.policies.routing.tool_state import R2E_THRESHOLDS
from libra.sim.engine import SimConfig, Simulator
from libra.traces import write_trace
from libra.commands.tree_profile import finished_from_trace, profile_tree
from libra.sim.workloads import generate


def _canonical(node: dict) -> dict:
    """A tree dict with every window sorted (insertion order differs between the two paths)."""
    return {"n": node["n"], "mean": round(node["mean"], 6), "window": sorted(node["window"]),
            "children": {k: _canonical(v) for k, v in node.get("children", {}).items()}}


def _tree_dict(d: dict) -> dict:
    return {"global": _canonical(d["global"]), "prompts": {p: _canonical(t) for p, t in d["prompts"].items()}}


@pytest.fixture(scope="module")
def trace():
    return generate("r2e", 2, 4, 16, 3)  # 2 steps x 4 groups x 16 = 128 trajectories


def test_offline_profile_equals_what_the_broker_learned_online(trace) -> None:
    cfg = SimConfig(router="cmlfq", allocation="hetero", gpus=48, seed=3, rebuild_interval=0,
                    size_thresholds=(R2E_THRESHOLDS.small, R2E_THRESHOLDS.medium))
    sim = Simulator(trace, cfg)
    sim.run()
    online = sim.broker.rollout.router.tree
    offline = profile_tree(trace, R2E_THRESHOLDS, rebuild_interval=0)
    assert online.global_tree.root.stats.count == len(trace) == offline.global_tree.root.stats.count
    assert _tree_dict(offline.to_dict()) == _tree_dict(online.to_dict())
    assert sorted(offline.to_dict()["history"], key=json.dumps) == sorted(online.to_dict()["history"], key=json.dumps)


def test_finished_record_uses_response_positions_and_size_classes(trace) -> None:
    spec = next(t for t in trace if t.num_tool_calls >= 2)
    rec = finished_from_trace(spec, R2E_THRESHOLDS)
    assert rec.prompt_id == spec.prompt_id and rec.total_output_tokens == spec.total_response_tokens
    assert rec.positions == spec.response_positions
    assert rec.states == tuple(":".join(s) for s in spec.tool_states(R2E_THRESHOLDS.small, R2E_THRESHOLDS.medium))


def test_tree_cli_build_show_merge(trace, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tr = tmp_path / "t.jsonl"
    write_trace(tr, trace)
    a, b, ab = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ab.json"
    assert cli_main(["tree", "build", "--trace", str(tr), "--out", str(a), "--thresholds", "r2e"]) == 0
    assert cli_main(["tree", "build", "--trace", str(tr), "--out", str(b), "--thresholds", "1000,12000",
                     "--window", "50"]) == 0
    assert CausalPrefixTree.load(a).to_dict()["global"] == profile_tree(trace, R2E_THRESHOLDS).to_dict()["global"]
    assert CausalPrefixTree.load(b).window_size == 50
    assert cli_main(["tree", "merge", str(a), str(b), "--out", str(ab)]) == 0
    assert CausalPrefixTree.load(ab).global_tree.root.stats.count == 2 * len(trace)
    capsys.readouterr()
    assert cli_main(["tree", "show", str(ab), "--json", "--top", "3"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["trajectories"] == 2 * len(trace) and len(shown["first_states"]) == 3
    counts = [r["count"] for r in shown["first_states"]]
    assert counts == sorted(counts, reverse=True) and all(r["p90_remaining"] >= 0 for r in shown["first_states"])
    assert cli_main(["tree", "show", str(a)]) == 0
    assert "first tool-return state" in capsys.readouterr().out


def test_tree_cli_reports_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert cli_main(["tree", "show", str(bad)]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert cli_main(["tree", "show", str(tmp_path / "none.json")]) == 1
    assert cli_main(["tree", "merge", str(bad), str(bad), "--out", str(tmp_path / "m.json")]) == 1
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 1}\n')
    assert cli_main(["tree", "build", "--trace", str(trace), "--out", str(tmp_path / "o.json")]) == 1
    assert "cannot read trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["tree", "build", "--trace", str(trace), "--out", "o.json", "--thresholds", "big"])
    assert exc.value.code == 2
