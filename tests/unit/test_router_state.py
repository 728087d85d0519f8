"""The broker's router-state file (``--router-state``): load at start, periodic and final saves, bad files."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from libra.broker.router_state import RouterStateFile, learned_tree
from libra.broker.config import BrokerConfig
from libra.broker.state import BrokerState
from libra.policies.routing.prefix_tree import CausalPrefixTree, FinishedTrajectory
from libra.policies.routing.baselines import make_router, router_accepts


def _traj(i: int) -> FinishedTrajectory:
    states = ("python:small:success",) if i % 2 else ("python:small:failure", "python:medium:failure")
    positions = (100,) if i % 2 else (200, 900)
    return FinishedTrajectory(f"p{i % 3}", states, positions, 1000 + 100 * i)


def _tree(n: int = 10) -> CausalPrefixTree:
    return CausalPrefixTree.from_trajectories((_traj(i) for i in range(n)), rebuild_interval=0)


def _wait_writer(store: RouterStateFile) -> None:
    w = store._writer
    if w is not None:
        w.join(10)


def test_a_missing_file_leaves_the_config_alone_and_a_saved_tree_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    cfg = BrokerConfig(router="cmlfq")
    assert RouterStateFile(path).apply(cfg) is cfg
    _tree(10).save(path)
    applied = RouterStateFile(path).apply(cfg)
    tree = applied.router_params["tree"]
    assert isinstance(tree, CausalPrefixTree) and tree.to_dict() == _tree(10).to_dict()
    state = BrokerState(applied)  # the broker's router learns on from the saved tree
    assert learned_tree(state.rollout.router) is tree
    assert cfg.router_params == {}  # the original config is not mutated


def test_the_saved_state_wins_over_a_bootstrap_tree_in_the_config(tmp_path: Path) -> None:
    boot, path = tmp_path / "boot.json", tmp_path / "state.json"
    _tree(2).save(boot)
    _tree(7).save(path)
    cfg = BrokerConfig(router="cmlfq", router_params={"tree": str(boot), "min_visits": 1})
    applied = RouterStateFile(path).apply(cfg)
    assert applied.router_params["min_visits"] == 1
    assert applied.router_params["tree"].global_tree.root.stats.count == 7


def test_an_unreadable_file_is_moved_aside_and_the_broker_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"format": "something else"}')
    cfg = BrokerConfig(router="cmlfq")
    assert RouterStateFile(path).apply(cfg) is cfg
    assert not path.exists()
    aside = list(tmp_path.glob("state.json.corrupt-*"))
    assert len(aside) == 1 and json.loads(aside[0].read_text()) == {"format": "something else"}
    path.write_bytes(b"\xff\xfe not utf-8")
    assert RouterStateFile(path).apply(cfg) is cfg and not path.exists()


def test_a_router_without_a_tree_ignores_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("not json at all")
    cfg = BrokerConfig(router="least_loaded")
    assert not router_accepts("least_loaded", "tree") and router_accepts("cmlfq", "tree")
    assert router_accepts("cmlfq_cost", "tree") and not router_accepts("nope", "tree")
    store = RouterStateFile(path, interval_s=0.01)
    assert store.apply(cfg) is cfg
    assert path.read_text() == "not json at all"  # untouched, not moved aside
    router = make_router("least_loaded")
    assert learned_tree(router) is None
    store.maybe_save(router, 0.0)
    assert not store.maybe_save(router, 1.0)
    store.close(router)
    assert path.read_text() == "not json at all" and store.saves == 0


def test_saves_happen_on_the_interval_only_when_something_was_learned(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    router = make_router("cmlfq", tree=_tree(4))
    store = RouterStateFile(path, interval_s=10.0)
    assert not store.maybe_save(router, 100.0)  # the first call arms the timer
    assert not store.maybe_save(router, 105.0)  # not yet due
    assert store.maybe_save(router, 110.0)
    _wait_writer(store)
    assert store.saves == 1 and CausalPrefixTree.load(path).to_dict() == router.tree.to_dict()
    assert not list(tmp_path.glob("*.tmp"))
    assert not store.maybe_save(router, 121.0)  # due, but nothing new: no write
    router.tree.record(_traj(99))
    assert store.maybe_save(router, 131.0)
    _wait_writer(store)
    assert store.saves == 2 and CausalPrefixTree.load(path).global_tree.root.stats.count == 5
    router.tree.record(_traj(100))
    store.close(router)  # the final save is synchronous
    assert store.saves == 3 and CausalPrefixTree.load(path).global_tree.root.stats.count == 6
    store.close(router)
    assert store.saves == 3


def test_a_failed_write_is_logged_counted_and_retried(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "state.json"
    router = make_router("cmlfq", tree=_tree(3))
    store = RouterStateFile(path, interval_s=1.0)
    store.maybe_save(router, 0.0)
    assert store.maybe_save(router, 1.0)
    _wait_writer(store)
    assert store.failures == 1 and store.saves == 0
    path.parent.mkdir()
    store.close(router)  # same mark as the failed save: written anyway
    assert store.saves == 1 and path.exists()


def test_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval"):
        RouterStateFile(tmp_path / "x.json", interval_s=0)


def test_a_save_is_not_doubled_while_one_is_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.json"
    router = make_router("cmlfq", tree=_tree(3))
    store = RouterStateFile(path, interval_s=1.0)
    release = threading.Event()
    real_write = store._write

    def slow_write(snap):
        release.wait(10)
        real_write(snap)

    monkeypatch.setattr(store, "_write", slow_write)
    store.maybe_save(router, 0.0)
    assert store.maybe_save(router, 1.0)
    assert router.tree.frozen  # the writer thread reads a frozen tree ...
    router.tree.record(_traj(5))  # ... so what finishes meanwhile is held back
    assert router.tree.global_tree.root.stats.count == 3
    assert not store.maybe_save(router, 2.0)  # the first write still runs
    release.set()
    _wait_writer(store)
    assert store.saves == 1 and CausalPrefixTree.load(path).global_tree.root.stats.count == 3
    assert not store.maybe_save(router, 2.5)  # not due, but the write is done: the tree thaws
    assert not router.tree.frozen and router.tree.global_tree.root.stats.count == 4
    store.close(router)  # writes the newer snapshot synchronously
    assert store.saves == 2 and CausalPrefixTree.load(path).global_tree.root.stats.count == 4


def test_router_state_bench_runs_and_thaws_its_tree() -> None:
    from libra.bench.router_state import run

    res = run(steps=1, prompts=2, repeat=1)
    assert res["trajectories"] == 32 and res["prompts"] == 2
    assert res["naive_loop_stall_ms"] > 0 and res["freeze_pause_ms"] >= 0 and res["background_write_ms"] > 0
