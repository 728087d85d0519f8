"""The end-of-run wait for the rollout actors' weights (``libra.rl.driver._Driver._await_rollout_sync``).

An instance whose every turn ran before the first publish was never sent a weights ref, so it has nowhere to
poll and cannot reach the final version: the wait used to run out its whole timeout for it. Its record now says
``knows_publisher: false`` and the wait does not count it; an instance that knows the publisher is still waited
for."""

from __future__ import annotations

import asyncio
import os
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from libra.rl.driver import _Driver


def _record(run: Path, slot: str, version: int, knows: bool | None) -> None:
    (run / "actors").mkdir(parents=True, exist_ok=True)
    rec = {"slot": slot, "weights_version": version}
    if knows is not None:
        rec["knows_publisher"] = knows
    (run / "actors" / f"{slot}.json").write_text(json.dumps(rec))


@pytest.mark.timeout(60)
def test_an_instance_never_sent_a_ref_is_not_waited_for(tmp_path: Path) -> None:
    _record(tmp_path, "cpu0", 0, knows=False)
    _record(tmp_path, "cpu1", 2, knows=True)
    fake = SimpleNamespace(run_dir=tmp_path, expected_rollouts=2)
    seen = asyncio.run(_Driver._await_rollout_sync(fake, 2, timeout=3600.0))  # type: ignore[arg-type]
    assert seen == {"cpu0": 0, "cpu1": 2}


@pytest.mark.timeout(60)
def test_an_instance_that_knows_the_publisher_is_waited_for(tmp_path: Path) -> None:
    _record(tmp_path, "cpu0", 1, knows=True)
    fake = SimpleNamespace(run_dir=tmp_path, expected_rollouts=1)

    async def main() -> dict[str, int]:
        wait = asyncio.create_task(_Driver._await_rollout_sync(fake, 2, timeout=3600.0))  # type: ignore[arg-type]
        await asyncio.sleep(0.5)
        assert not wait.done()  # still behind: waited for
        _record(tmp_path, "cpu0", 2, knows=True)  # it loads the final version
        return await wait

    assert asyncio.run(main()) == {"cpu0": 2}


@pytest.mark.timeout(60)
def test_a_dead_processs_record_is_waited_for_until_its_restart_writes_one(tmp_path: Path) -> None:
    """A slot killed mid-job leaves its old record; until the restarted process writes its own, the slot counts as
    not synced (the old record's ``knows_publisher`` says nothing about the new process)."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "cpu0.json").write_text(json.dumps({"weights_version": 0, "knows_publisher": False,
                                                               "pid": gone.pid}))
    fake = SimpleNamespace(run_dir=tmp_path, expected_rollouts=1)

    async def main() -> dict[str, int]:
        wait = asyncio.create_task(_Driver._await_rollout_sync(fake, 2, timeout=3600.0))  # type: ignore[arg-type]
        await asyncio.sleep(0.5)
        assert not wait.done()  # the dead process's record is not taken as "cannot follow"
        (tmp_path / "actors" / "cpu0.json").write_text(json.dumps({"weights_version": 0, "knows_publisher": False,
                                                                   "pid": os.getpid()}))
        return await wait

    assert asyncio.run(main()) == {"cpu0": 0}
