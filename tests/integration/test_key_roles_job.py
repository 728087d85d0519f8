"""The bundled job end to end under CURVE with role-scoped keys (#33): the actor host connects with a key in
``allowed/actors/`` and its episode runner calls tools with a second key in ``allowed/clients/``
(``LIBRA_CLIENT_CURVE_SECRET``); the driver holds the environment author's client key, bound to the job
(``allowed/clients/arith_tiny/``); the actors' data-plane servers check fetchers' roles too
(``LIBRA_CURVE_ALLOW``), and the broker keeps an audit log. Every version trains: each role could do its part
and nothing more was needed; the audit log says who started the job."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import libra.local as local
from libra.rl.config import load_job
from libra.rl.driver import run_job
from libra.transport.keys import load_keypair
from libra.transport.scopes import fingerprint

from .role_keys import role_keys

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"


def test_the_bundled_job_runs_with_role_scoped_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    keys, allowed, broker_kp = role_keys(tmp_path, (("host1", "actors"), ("host1-calls", "clients"),
                                                    ("envauthor", "clients/arith_tiny")))
    audit = tmp_path / "audit.jsonl"

    class CurveCluster(local.LocalCluster):  # what `libra run` starts, with CURVE on and the host's two keys
        def start(self, *args, **kw):  # type: ignore[no-untyped-def]
            self.broker_args = [*self.broker_args, "--curve-secret", str(broker_kp.secret_file),
                                "--curve-allow", str(allowed), "--audit-log", str(audit)]
            self.env = {**self.env, "LIBRA_CURVE_SECRET": str(keys / "host1.key_secret"),
                        "LIBRA_CLIENT_CURVE_SECRET": str(keys / "host1-calls.key_secret"),
                        "LIBRA_CURVE_ALLOW": str(allowed)}
            return super().start(*args, **kw)

    monkeypatch.setattr(local, "LocalCluster", CurveCluster)
    monkeypatch.setenv("LIBRA_CURVE_SECRET", str(keys / "envauthor.key_secret"))  # the driver's own client key
    monkeypatch.setenv("LIBRA_BROKER_KEY", str(broker_kp.public_file))
    cfg = load_job(EXAMPLE).with_run_dir(str(tmp_path / "run"))
    summary = run_job(cfg, progress=False)
    assert summary["final_version"] == cfg.job.steps and summary["episodes_failed"] == 0
    err = capfd.readouterr().err  # the broker's and actors' warnings: a refusal would be one
    for refusal in ('"role_refused"', '"job_refused"', '"dataplane_refused"'):
        assert refusal not in err, err[-3000:]
    records = [json.loads(x) for x in audit.read_text().splitlines()]
    author = fingerprint(load_keypair(keys / "envauthor.key").public_key)
    assert [(r["what"], r["key"], r["role"], r["job"]) for r in records if r["what"] == "job_start"] == [
        ("job_start", author, "client:arith_tiny", "arith_tiny")], records
    assert not [r for r in records if r["what"] == "refused"], records
