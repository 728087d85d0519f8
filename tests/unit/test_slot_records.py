"""Actor record files (``RUN/actors/<actor id>.json``, :mod:`libra.actors.slot_records`) are keyed by the actor's
identity, not its slot name: rollout slots on several hosts share a run directory and each host has its own
``cpu0``. Keyed by slot, one host's record overwrote the other's and the driver's end-of-run wait for weight
versions saw fewer instances than it expected, so it went on only at its deadline."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from libra.actors.roles import HybridRole
from libra.actors.rollout_role import RolloutRole
from libra.actors.slot_records import (actor_of_record, default_actor_id, read_slot_records, record_name,
                                       slot_record_path, write_slot_record)
from libra.engines.device.placement import choose_placement
from libra.engines.kv_cache import KVCache
from libra.rl.driver import _Driver


class StubEngine:
    """Just enough of a rollout engine for a role to write its record (no model)."""

    def __init__(self, version: int) -> None:
        self.weights_version, self.max_batch_size, self.kv_cache = version, 4, KVCache(1 << 20)

    def close(self) -> None:
        pass


def test_the_record_name_is_the_actor_id_file_name_safe_and_reversible() -> None:
    for aid in ("node-a/cpu0", "node-b.cluster.local/cpu0", "h/lent-gpu3", "..", "a b/c%d"):
        name = record_name(aid)
        assert "/" not in name and not name.startswith(".") and name.endswith(".json"), name
        assert actor_of_record(name) == aid
    assert record_name("node-a/cpu0") != record_name("node-b/cpu0")
    with pytest.raises(ValueError, match="non-empty actor id"):
        record_name("")


@pytest.mark.timeout(60)
def test_the_same_slot_on_two_hosts_is_two_instances_the_driver_waits_for(tmp_path: Path) -> None:
    roles = [RolloutRole("/no/model", str(tmp_path), "cpu0", window_s=0.0, engine=StubEngine(3), actor_id=aid)
             for aid in ("node-a/cpu0", "node-b/cpu0")]
    try:
        for r in roles:  # both have been sent a weights ref: the wait counts them
            r._source = object()  # type: ignore[assignment]
            r.write_status()
        recs = read_slot_records(tmp_path)
        assert sorted(recs) == ["node-a/cpu0", "node-b/cpu0"]
        assert {(r["host"], r["slot"], r["weights_version"]) for r in recs.values()} == {("node-a", "cpu0", 3),
                                                                                        ("node-b", "cpu0", 3)}
        fake = SimpleNamespace(run_dir=tmp_path, expected_rollouts=2)
        # keyed by slot, the two records were one file: the wait saw one instance of two and returned only at its
        # deadline with one entry; keyed by actor it returns both as soon as both report the version
        seen = asyncio.run(_Driver._await_rollout_sync(fake, 3, timeout=5.0))  # type: ignore[arg-type]
        assert seen == {"node-a/cpu0": 3, "node-b/cpu0": 3}
        stats = _Driver._rollout_sync_stats(fake)  # type: ignore[arg-type]
        assert stats["fetches"] == []
    finally:
        for r in roles:
            r.close()


def test_a_hybrid_slot_keys_its_record_by_its_actor_id(tmp_path: Path) -> None:
    role = HybridRole("/no/model", str(tmp_path), "cpu3", placement=choose_placement("cpu3", cuda_devices=0),
                      actor_id="node-a/p-cpu3")
    role.reconfigure(["train"], {"role": "train"})  # no engine built yet: the switch is recorded by the hybrid role
    rec = json.loads(slot_record_path(tmp_path, "cpu3", "node-a/p-cpu3").read_text())
    assert (rec["actor_id"], rec["host"], rec["slot"], rec["role"]) == ("node-a/p-cpu3", "node-a", "cpu3", "train")
    assert list(read_slot_records(tmp_path)) == ["node-a/p-cpu3"]


def test_without_an_actor_id_the_record_is_the_runtimes_default_host_slot(tmp_path: Path) -> None:
    path = write_slot_record(tmp_path, "cpu1", {"role": "rollout"})
    assert path == slot_record_path(tmp_path, "cpu1")
    assert read_slot_records(tmp_path)[default_actor_id("cpu1")]["slot"] == "cpu1"
