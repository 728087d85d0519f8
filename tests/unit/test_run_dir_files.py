"""What a new run of the job driver clears from its run directory before it starts: the files the driver itself
wrote last time (its summary; its metrics, samples and failures unless it resumes), on a running cluster
(``libra run --broker``, where the slots' own files are left alone) as on the loopback one."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.rl.driver import clear_driver_files

DRIVER = ("summary.json", "metrics.jsonl", "samples.jsonl", "failures.jsonl")


@pytest.mark.parametrize("resume", [False, True])
def test_a_new_run_clears_what_the_last_one_wrote_and_a_resume_keeps_its_metrics(tmp_path: Path, resume: bool) -> None:
    run = tmp_path / "run"
    (run / "actors").mkdir(parents=True)
    for name in DRIVER:
        (run / name).write_text("old\n")
    (run / "actors" / "cpu0.json").write_text("{}")  # a live slot's record: not the driver's
    clear_driver_files(run, resume)
    left = {p.name for p in run.iterdir()}
    assert left == ({"actors", "metrics.jsonl", "samples.jsonl", "failures.jsonl"} if resume else {"actors"})
    assert (run / "actors" / "cpu0.json").exists()
    clear_driver_files(tmp_path / "new", resume)  # a run directory that is not there yet is made
    assert (tmp_path / "new").is_dir()
