"""docs/job-file.md is the generator's output (``python -m libra.rl.config_doc``), and every key of every
job-file table is documented, so the reference cannot drift from the config dataclasses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from libra.rl import config as job_config
from libra.rl.config_doc import field_docs, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "job-file.md"


def test_job_file_reference_is_current() -> None:
    assert DOC.read_text() == render(), ("docs/job-file.md is out of date: regenerate it with "
                                         "`python -m libra.rl.config_doc > docs/job-file.md`")


def test_every_key_of_every_table_is_documented_in_the_reference() -> None:
    text = render()
    for table, cls in job_config._TABLES.items():
        assert f"## `[{table}]`" in text
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"[{table}] {f.name} has no doc (a comment on its line, or metadata doc)"
            assert f"| `{f.name}` |" in text

