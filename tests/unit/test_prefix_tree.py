"""Causal prefix tree: insertion, statistics window, deepest-prefix lookup, rebuild, persistence, merge."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.policies.routing.prefix_tree import (
    FORMAT_VERSION,
    CausalPrefixTree,
    FinishedTrajectory,
    NodeEstimate,
    NodeStats,
    PrefixTree,
    PrefixTreeError,
    percentile,
)

A, B, C = "bash:large:failure", "python:small:success", "bash:small:success"


def traj(prompt: str | None, states: list[str], positions: list[int], total: int) -> FinishedTrajectory:
    return FinishedTrajectory(prompt, tuple(states), tuple(positions), total)


# --------------------------------------------------------------------------------------------- records


def test_finished_trajectory_remaining_is_total_minus_position() -> None:
    t = traj("p", [A, B], [100, 300], 1000)
    assert t.remaining() == (900, 700)


@pytest.mark.parametrize(
    ("states", "positions", "total", "match"),
    [
        ([A], [], 10, "1 tool states but 0 positions"),
        ([A, B], [50, 20], 100, r"positions\[1\]=20 is smaller"),
        ([A], [200], 100, "exceeds total_output_tokens=100"),
        ([""], [0], 100, r"states\[0\]"),
        ([A], [-1], 100, r"positions\[0\]"),
    ],
)
def test_finished_trajectory_rejects_inconsistent_records(
    states: list[str], positions: list[int], total: int, match: str
) -> None:
    with pytest.raises(PrefixTreeError, match=match):
        traj("p", states, positions, total)


# --------------------------------------------------------------------------------------------- stats


def test_insertion_puts_total_at_root_and_remaining_at_each_node() -> None:
    tree = PrefixTree()
    tree.insert(traj("p", [A, B], [100, 300], 1000))
    tree.insert(traj("p", [A], [200], 600))
    root = tree.root
    assert root.stats.count == 2 and root.stats.mean == pytest.approx(800)
    a = root.children[A].stats
    assert a.count == 2 and sorted(a.window) == [400, 900] and a.mean == pytest.approx(650)
    ab = root.children[A].children[B].stats
    assert ab.count == 1 and list(ab.window) == [700]
    assert tree.node_count == 3


def test_window_of_200_evicts_old_samples_but_mean_is_all_time() -> None:
    stats = NodeStats(window_size=200)
    for _ in range(50):
        stats.add(10_000)
    for _ in range(200):
        stats.add(100)
    assert stats.count == 250
    assert len(stats.window) == 200 and set(stats.window) == {100}
    assert stats.p90 == 100  # the old large samples left the window
    assert stats.mean == pytest.approx((50 * 10_000 + 200 * 100) / 250)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=300))
def test_p90_matches_numpy_linear_percentile(values: list[int]) -> None:
    stats = NodeStats(window_size=200)
    for v in values:
        stats.add(v)
    expected = np.percentile(np.array(values[-200:], dtype=float), 90)
    assert stats.p90 == pytest.approx(expected)
    assert stats.mean == pytest.approx(sum(values) / len(values))


def test_percentile_rejects_empty_and_bad_quantile() -> None:
    with pytest.raises(PrefixTreeError):
        percentile([], 0.9)
    with pytest.raises(PrefixTreeError):
        percentile([1.0], 1.5)


# --------------------------------------------------------------------------------------------- lookup


def test_lookup_on_empty_tree_has_no_stats() -> None:
    assert CausalPrefixTree().lookup("p", [A]) is None
    assert CausalPrefixTree().lookup(None, []) is None


def test_lookup_walks_to_deepest_matching_prefix() -> None:
    tree = CausalPrefixTree()
    tree.record(traj("p", [A, B], [100, 300], 1000))
    est = tree.lookup("p", [A, B, C])  # C never seen after A, B
    assert est is not None and est.depth == 2 and est.mean == 700 and est.source == "prompt"
    est = tree.lookup("p", [C, A])  # first state unseen: falls back to the root (total length)
    assert est is not None and est.depth == 0 and est.mean == 1000


def test_prompt_tree_first_then_global_for_unknown_prompts() -> None:
    tree = CausalPrefixTree()
    tree.record(traj("p1", [A], [100], 10_100))  # p1: A leaves 10_000
    tree.record(traj("p2", [A, B], [100, 200], 1_200))  # p2: A leaves 1_100, then B leaves 1_000
    # p1 is known and matches A as deep as the global tree does: its own tree answers the tie.
    est = tree.lookup("p1", [A])
    assert est is not None and est.source == "prompt" and est.depth == 1 and est.mean == 10_000
    # For A->B p1's tree stops at A, the global tree has the deeper A->B node: the deeper match answers.
    est = tree.lookup("p1", [A, B])
    assert est is not None and est.source == "global" and est.depth == 2 and est.mean == 1_000
    # An unknown prompt and a missing prompt id use the global tree (both trajectories pass through A).
    for pid in ("p-unknown", None):
        est = tree.lookup(pid, [A])
        assert est is not None and est.source == "global" and est.count == 2
        assert est.mean == pytest.approx((10_000 + 1_100) / 2)
    est = tree.lookup("p-unknown", [A, B])
    assert est is not None and est.depth == 2 and est.mean == 1_000


def test_min_visits_treats_rare_nodes_as_unseen() -> None:
    tree = CausalPrefixTree()
    tree.record(traj(None, [A], [0], 5000))
    tree.record(traj(None, [B], [0], 100))
    est = tree.lookup(None, [A], min_visits=2)
    assert est is not None and est.depth == 0 and est.count == 2  # A has 1 visit: parent (root) answers
    assert tree.lookup(None, [A], min_visits=3) is None  # even the root has too few


def test_prompt_forest_is_lru_capped() -> None:
    tree = CausalPrefixTree(max_prompts=2)
    tree.record(traj("p1", [], [], 10))
    tree.record(traj("p2", [], [], 20))
    tree.lookup("p1", [])  # touch p1: p2 becomes least recently used
    tree.record(traj("p3", [], [], 30))
    assert tree.knows_prompt("p1") and tree.knows_prompt("p3") and not tree.knows_prompt("p2")
    assert tree.num_prompts == 2
    assert tree.global_tree.root.stats.count == 3  # the global tree keeps everything


# --------------------------------------------------------------------------------------------- rebuild


def test_rebuild_uses_only_the_last_n_trajectories() -> None:
    tree = CausalPrefixTree(history_size=4)
    for total in (9000, 9000, 9000, 100, 200, 300, 400):  # drift: lengths shrink
        tree.record(traj("p", [A], [0], total))
    est = tree.lookup("p", [A])
    assert est is not None and est.count == 7
    tree.rebuild()
    est = tree.lookup("p", [A])
    assert est is not None and est.count == 4 and est.mean == pytest.approx(250)
    assert [t.total_output_tokens for t in tree.history] == [100, 200, 300, 400]


def test_maybe_rebuild_follows_the_interval() -> None:
    tree = CausalPrefixTree(rebuild_interval=5)
    fired = [step for step in (1, 3, 5, 6, 9, 10, 17) if tree.maybe_rebuild(step)]
    assert fired == [5, 10, 17]
    assert tree.rebuilds == 3
    assert not CausalPrefixTree(rebuild_interval=0).maybe_rebuild(1000)


# --------------------------------------------------------------------------------------------- persistence


def _random_tree(seed: int, n: int, **params: int) -> CausalPrefixTree:
    rng = random.Random(seed)
    tree = CausalPrefixTree(**params)
    for _ in range(n):
        k = rng.randint(0, 4)
        positions = sorted(rng.randint(0, 3000) for _ in range(k))
        tree.record(traj(f"p{rng.randint(0, 5)}", [rng.choice([A, B, C]) for _ in range(k)], positions,
                         3000 + rng.randint(0, 20_000)))
    return tree


def _all_lookups(tree: CausalPrefixTree) -> list[NodeEstimate | None]:
    seqs = [[], [A], [B], [A, B], [C, C, A], [B, A, C, A]]
    return [tree.lookup(p, s) for p in ("p0", "p3", "unknown", None) for s in seqs]


def test_save_load_round_trip(tmp_path) -> None:
    tree = _random_tree(1, 80, window_size=16, rebuild_interval=7)
    path = tmp_path / "tree.json"
    tree.save(path)
    saved = json.loads(path.read_text())
    assert saved["format"] == "libra-cmlfq-prefix-tree" and saved["version"] == FORMAT_VERSION
    loaded = CausalPrefixTree.load(path)
    assert loaded.window_size == 16 and loaded.rebuild_interval == 7
    assert loaded.to_dict() == tree.to_dict()
    assert _all_lookups(loaded) == _all_lookups(tree)
    assert loaded.history == tree.history


def test_load_rejects_bad_files(tmp_path) -> None:
    good = _random_tree(2, 5).to_dict()
    cases = {
        "version": ({**good, "version": 99}, "unsupported prefix tree version 99"),
        "format": ({**good, "format": "other"}, "not a prefix tree file"),
        "node": ({**good, "global": {"n": -1, "mean": 0, "window": []}}, r"global: n must be"),
        "window": ({**good, "global": {"n": 1, "mean": 5, "window": ["x"]}}, r"global\.window\[0\]"),
        "history": ({**good, "history": [{"prompt_id": "p", "states": ["a"], "positions": [9], "total": 1}]},
                    r"history\[0\]: positions\[0\]=9 exceeds"),
    }
    for name, (data, match) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(PrefixTreeError, match=match):
            CausalPrefixTree.load(path)
    bad = tmp_path / "garbage.json"
    bad.write_text("{not json")
    with pytest.raises(PrefixTreeError, match="not valid JSON"):
        CausalPrefixTree.load(bad)


# --------------------------------------------------------------------------------------------- merge


def test_merge_is_count_weighted() -> None:
    a = CausalPrefixTree()
    for _ in range(3):
        a.record(traj("p", [A], [0], 100))
    b = CausalPrefixTree()
    b.record(traj("p", [A], [0], 500))
    b.record(traj("q", [B], [0], 50))
    a.merge(b)
    est = a.lookup("p", [A])
    assert est is not None and est.count == 4 and est.mean == pytest.approx(200)  # (3*100 + 500) / 4
    assert a.knows_prompt("q")
    est = a.lookup(None, [B])
    assert est is not None and est.count == 1 and est.mean == 50
    assert len(a.history) == 5
    assert b.lookup("p", [A]).count == 1  # type: ignore[union-attr]  # the source is untouched


def test_merge_equals_recording_everything_in_one_tree() -> None:
    rng = random.Random(7)
    records = []
    for _ in range(120):
        k = rng.randint(0, 3)
        records.append(traj(f"p{rng.randint(0, 3)}", [rng.choice([A, B]) for _ in range(k)],
                            sorted(rng.randint(0, 500) for _ in range(k)), 500 + rng.randint(0, 9000)))
    left = CausalPrefixTree.from_trajectories(records[:70], window_size=50)
    right = CausalPrefixTree.from_trajectories(records[70:], window_size=50)
    whole = CausalPrefixTree.from_trajectories(records, window_size=50)
    left.merge(right)
    for got, want in zip(_all_lookups(left), _all_lookups(whole), strict=True):
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert got.count == want.count and got.depth == want.depth
            assert got.mean == pytest.approx(want.mean)
            assert got.p90 == pytest.approx(want.p90)  # windows concatenate in arrival order


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(PrefixTreeError, match="window_size"):
        CausalPrefixTree(window_size=0)
    with pytest.raises(PrefixTreeError, match="min_visits"):
        CausalPrefixTree().lookup(None, [], min_visits=0)


def test_prompt_tree_missing_the_state_does_not_hide_the_global_node() -> None:
    # Survivorship bias: the group-mate that finished first was short and never saw a failure. A sample of
    # the same prompt that now fails must get the global failure statistics, not the prompt's root.
    tree = CausalPrefixTree()
    tree.record(traj("p1", [B], [300], 1_000))  # mate: success, short
    for i in range(5):
        tree.record(traj(f"q{i}", [A], [300], 20_300))  # other prompts: failure leaves 20_000
    est = tree.lookup("p1", [A])
    assert est is not None and est.source == "global" and est.depth == 1 and est.mean == 20_000
    est = tree.lookup("p1", [B])
    assert est is not None and est.source == "prompt" and est.depth == 1 and est.mean == 700
    # With min_visits the prompt's sparse node counts as unseen and the global node answers.
    tree.record(traj("p2", [B], [300], 2_300))
    assert tree.lookup("p1", [B], min_visits=2).source == "global"  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------- snapshots


def test_a_frozen_tree_snapshots_its_state_at_freeze_while_it_keeps_serving() -> None:
    import threading

    tree = CausalPrefixTree(rebuild_interval=0)
    for i in range(6):
        tree.record(traj(f"p{i % 2}", [A, B][: 1 + i % 2], [100, 300][: 1 + i % 2], 1000 + i))
    before = tree.to_dict()
    snap = tree.freeze()
    assert tree.frozen
    with pytest.raises(PrefixTreeError, match="already frozen"):
        tree.freeze()
    with pytest.raises(PrefixTreeError, match="frozen"):
        tree.merge(CausalPrefixTree())
    tree.record(traj("p9", [C], [50], 400))  # held back: the snapshot's nodes do not change
    assert tree.lookup("p0", [A]) is not None  # lookups go on (they reorder the LRU only)
    assert tree.global_tree.root.stats.count == 6 and not tree.knows_prompt("p9")
    out: list[dict] = []
    t = threading.Thread(target=lambda: out.append(snap.to_dict()))
    t.start()
    t.join()
    assert out[0] == before and json.loads("".join(snap.iter_json())) == before
    assert tree.thaw() == 1 and not tree.frozen
    assert tree.global_tree.root.stats.count == 7 and tree.knows_prompt("p9") and len(tree.history) == 7
    assert tree.thaw() == 0


def test_a_rebuild_while_frozen_leaves_the_snapshot_alone() -> None:
    tree = CausalPrefixTree(rebuild_interval=1, history_size=2)
    for i in range(4):
        tree.record(traj("p", [A], [100], 1000 + i))
    before = tree.to_dict()
    snap = tree.freeze()
    assert tree.maybe_rebuild(5)  # keeps only the 2 newest trajectories, in new tree objects
    assert tree.global_tree.root.stats.count == 2
    assert snap.to_dict() == before
    tree.thaw()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["p0", "p1", 'p"2', None]),
                          st.lists(st.sampled_from([A, B, C, "x:y:\u00e9"]), max_size=4),
                          st.integers(0, 50_000)), max_size=25),
       st.integers(1, 5))
def test_streamed_json_is_exactly_the_compact_dump(records, window: int) -> None:
    tree = CausalPrefixTree(window_size=window, history_size=10, rebuild_interval=0)
    for pid, states, total in records:
        positions = sorted(min(total, 100 * (i + 1)) for i in range(len(states)))
        tree.record(traj(pid, states, positions, total))
    assert "".join(tree.iter_json()) == json.dumps(tree.to_dict(), separators=(",", ":"))
    assert "".join(tree.global_tree.iter_json()) == json.dumps(tree.global_tree.to_dict(), separators=(",", ":"))
