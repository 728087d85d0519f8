"""Per-job isolation and the audit trail with CURVE on loopback (#33). A broker (a real process, with
``--audit-log``) whose allow directory holds job-scoped client keys (``clients/jobA/``, ``clients/jobB/``) and an
operator key:

- job B's client starts job B; job A's client may not start, poll or cancel job B (``Forbidden``, typed, naming
  the job), and each refusal is logged and counted;
- job A's client, saying job B's client id, cannot cancel job B's queued call (ids live in their job's space),
  which job B's client still can;
- a scoped client's status holds its own job's rows only; the operator's holds every job and the audit trail,
  which ``libra status`` (run as a user would, with the operator key in its environment) prints;
- the audit log file has a line for each job start, cancel, directive and refusal, with the key's fingerprint
  and role.
(Fetching job B's shard from the data plane with job A's key: ``tests/unit/test_dataplane_roles.py``.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libra.client import Forbidden
from libra.client.aio import AsyncClient
from libra.local import free_port
from libra.protocol import encode
from libra.protocol import messages as m
from libra.transport.scopes import fingerprint
from libra.transport.security import CurveClient

from .role_keys import role_keys

pytestmark = pytest.mark.integration

SPEC = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_policy_lag": 1, "world_size": 1, "env": "arith",
        "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
        "master_port": 12345}
ROWS = [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1} for i in range(4)]


async def _scenario(url: str, cc: dict[str, CurveClient]) -> dict:
    a = AsyncClient(url, curve=cc["alice"], client_id="shared-id")
    b = AsyncClient(url, curve=cc["bob"], client_id="shared-id")
    ops = AsyncClient(url, curve=cc["ops"])
    try:
        for c in (a, b, ops):
            await c.connect()
        assert await b.job_submit("jobB", SPEC, ROWS) == {"job": "jobB"}
        for attempt in (a.job_submit("jobB", SPEC, ROWS), a.job_poll("jobB"), a.job_poll("jobB", cancel=True)):
            with pytest.raises(Forbidden, match="may not act on job 'jobB'"):
                await attempt
            await asyncio.sleep(1.1)  # the same refusal again within a second is counted, not audited again
        assert (await b.job_poll("jobB"))["state"] == "running", "job B goes on"
        assert await a.job_submit("jobA", SPEC, ROWS) == {"job": "jobA"}

        # job B's call waits (nothing serves 'slow'); job A's client, with the same client id, cancels its id
        queued = asyncio.ensure_future(b.request("action", "slow", {"n": 1}, request_id="r1", timeout=30))
        await asyncio.sleep(0.3)
        sa = await a.status()
        await a._sock.send_multipart(encode(m.CancelRequest("r1")))  # as its client would for its own "r1"
        await asyncio.sleep(0.5)
        assert not queued.done(), "job A's cancel reached job B's call"
        queued.cancel()  # no longer wanted (the client sends its own CancelRequest)

        so = await ops.status()
        assert await ops.job_poll("jobB", cancel=True) is not None  # an operator may cancel any job
        return {"alice": sa.stats, "ops": so.stats}
    finally:
        for c in (a, b, ops):
            await c.close()


def test_job_scoped_keys_and_the_audit_trail(tmp_path: Path) -> None:
    keys, allowed, broker_kp = role_keys(tmp_path, (("alice", "clients/jobA"), ("bob", "clients/jobB"),
                                                    ("ops", "operators")))
    cc = {n: CurveClient.from_files(keys / f"{n}.key_secret", broker_kp.public_file) for n in ("alice", "bob", "ops")}
    fp = {n: fingerprint(c.public_key) for n, c in cc.items()}
    url = f"tcp://127.0.0.1:{free_port()}"
    log_path, audit_path = tmp_path / "broker.log", tmp_path / "audit.jsonl"
    with log_path.open("w") as log:
        broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "info",
                                   "--curve-secret", str(broker_kp.secret_file), "--curve-allow", str(allowed),
                                   "--audit-log", str(audit_path)], stdout=log, stderr=subprocess.STDOUT)
    try:
        seen = asyncio.run(_scenario(url, cc))
        env = {**os.environ, "LIBRA_CURVE_SECRET": str(keys / "ops.key_secret"),
               "LIBRA_BROKER_KEY": str(broker_kp.public_file)}
        shown = subprocess.run([sys.executable, "-m", "libra", "status", "--broker", url], env=env,
                               capture_output=True, text=True, timeout=60)
    finally:
        broker.terminate()
        try:
            broker.wait(20)
        except subprocess.TimeoutExpired:
            broker.kill()
    assert set(seen["alice"]) == {"jobs", "scope"} and set(seen["alice"]["jobs"]) == {"jobA"}
    assert set(seen["ops"]["jobs"]) == {"jobA", "jobB"} and seen["ops"]["job_refused"] == 3
    assert shown.returncode == 0, shown.stderr
    assert "AUDIT" in shown.stdout and f"job_start  by {fp['bob']} (client:jobB)" in shown.stdout, shown.stdout
    assert f"refused  by {fp['alice']} (client:jobA)" in shown.stdout

    records = [json.loads(x) for x in audit_path.read_text().splitlines()]
    got = [(r["what"], r["key"], r["role"], r.get("job"), r.get("message")) for r in records]
    assert got == [("job_start", fp["bob"], "client:jobB", "jobB", None),
                   ("refused", fp["alice"], "client:jobA", "jobB", "JobSubmit"),
                   ("refused", fp["alice"], "client:jobA", "jobB", "JobPoll"),
                   ("refused", fp["alice"], "client:jobA", "jobB", "JobPoll"),
                   ("job_start", fp["alice"], "client:jobA", "jobA", None),
                   ("job_cancel", fp["ops"], "operator", "jobB", None)], got
    assert all(r["time"] for r in records)
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
    assert [x["job"] for x in lines if x["event"] == "job_refused"] == ["jobB"] * 3
