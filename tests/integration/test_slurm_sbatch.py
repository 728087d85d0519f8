"""``deploy/slurm/libra.sbatch`` run as Slurm would run it, with fake ``srun`` and ``scontrol`` on PATH that start
real processes on the hosts of the multi-host harness (``netns.py``): two hosts, the batch script on the
first, one task per node for ``srun`` (each in its host's namespace, with its own host name and
``SLURM_NODEID``), the tiny job (``examples/arith_tiny.toml``) run across them to the end. Also: a run
without keys, or with half of them, is refused with a clear message before anything starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .netns import netns_hosts

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "libra.sbatch"
JOB = ROOT / "examples" / "arith_tiny.toml"

#: ``srun [--opt=value ...] CMD...``: one task per node of ``$SLURM_JOB_NODELIST`` (``--ntasks-per-node=1``),
#: task ``i`` on the host ``$FAKE_SLURM_NETNS`` maps node ``i`` to, as that host; signals go to every task.
FAKE_SRUN = r'''
import json, os, signal, subprocess, sys
argv = sys.argv[1:]
opts = []
while argv and argv[0].startswith("-"):
    opts.append(argv.pop(0))
assert "--ntasks-per-node=1" in opts and argv, (opts, argv)
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps({"srun": opts, "cmd": argv}) + "\n")
netns = json.loads(os.environ["FAKE_SLURM_NETNS"])
nodes = os.environ["SLURM_JOB_NODELIST"].split(",")
tasks = []
for i, node in enumerate(nodes):
    env = {**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURM_LOCALID": "0",
           "SLURM_STEP_NUM_NODES": str(len(nodes)), "SLURMD_NODENAME": node}
    tasks.append(subprocess.Popen(["ip", "netns", "exec", netns[node], "unshare", "--uts", "sh", "-c",
                                   'hostname "$0" && exec "$@"', node, *argv], env=env))
def forward(sig, _frame):
    for t in tasks:
        if t.poll() is None:
            t.send_signal(sig)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
codes = [t.wait() for t in tasks]
sys.exit(next((c for c in codes if c), 0))
'''

FAKE_SCONTROL = r'''
import sys
if sys.argv[1:3] != ["show", "hostnames"] or len(sys.argv) != 4:
    sys.exit(f"fake scontrol: only 'show hostnames LIST', not {sys.argv[1:]}")
print("\n".join(sys.argv[3].split(",")))
'''


def fake_slurm(tmp_path: Path) -> Path:
    """A directory with the fake ``srun`` and ``scontrol``, for the front of PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, code in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{code}")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def sbatch_env(tmp_path: Path, nodes: list[str], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIBRA_", "SLURM_", "CUDA_VISIBLE"))}
    return {**env, "PATH": f"{fake_slurm(tmp_path)}:{env.get('PATH', '/usr/bin:/bin')}",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_JOB_NUM_NODES": str(len(nodes)),
            "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_CPUS_ON_NODE": "2", "LIBRA_PYTHON": sys.executable,
            "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"), **extra}


def stop_group(p: subprocess.Popen) -> None:
    """SIGTERM the batch script's process group (broker, srun, the tasks), SIGKILL what is left after 20 s."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed: the job's python tool")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare gives each fake node its host name")
def test_the_batch_script_runs_the_tiny_job_across_two_hosts(tmp_path: Path) -> None:
    with netns_hosts(2, "10.233.5") as hosts:
        nodes = [h.addr for h in hosts]  # node names that resolve without a DNS: their addresses
        run, keys = tmp_path / "run", tmp_path / "keys"
        env = sbatch_env(tmp_path, nodes, LIBRA_KEYS=str(keys), LIBRA_RUN_DIR=str(run), LIBRA_ACTORS_TIMEOUT_S="300",
                         FAKE_SLURM_NETNS=json.dumps({h.addr: h.ns for h in hosts}))
        # the batch script runs on the first node of the allocation, as Slurm runs it
        cmd = hosts[0].argv("unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', nodes[0],
                            "bash", str(SBATCH), "--make-keys", str(JOB))
        p = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # its own process group: all of it stops with the test
        try:
            out, _ = p.communicate(timeout=540)
        finally:
            stop_group(p)
    assert p.returncode == 0, out[-6000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_version"] == 3 and summary["episodes_failed"] == 0, summary
    # each node ran its part of the layout (libra.rl.node_layout), as its own host
    assert f"libra: node 0 ({nodes[0]}): -m libra.actors --broker tcp://{nodes[0]}:5555 --gpu-slots 0 " \
           "--roles train=2,episode=1" in out, out[-6000:]
    assert f"libra: node 1 ({nodes[1]}): -m libra.actors --broker tcp://{nodes[0]}:5555 --gpu-slots 0 " \
           "--roles rollout=2,action=1" in out, out[-6000:]
    # node 1's rollout slots loaded each new weights version from trainer rank 0 on node 0, over the data plane
    rollout = [json.loads(f.read_text()) for f in (run / "actors").glob("*.json")]
    rollout = [r for r in rollout if r["role"] == "rollout"]
    assert len(rollout) == 2 and all(r["dataplane_loads"] >= 1 and r["fetch_errors"] == 0 for r in rollout), rollout
    steps = [json.loads(line) for line in (tmp_path / "slurm.log").read_text().splitlines()]
    assert [s["srun"] for s in steps] == [["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                                           "--kill-on-bad-exit=0"]]
    # the keys were made once, into LIBRA_KEYS, and the broker let in only them (CURVE, roles)
    assert {f.name for f in keys.iterdir()} >= {"broker.key", "broker.key_secret", "actors.key_secret",
                                                "actors-calls.key_secret", "driver.key_secret", "allowed"}
    audit = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()]
    assert [(r["what"], r["role"]) for r in audit if r["what"] == "job_start"] == [("job_start", "client")]
    assert not [r for r in audit if r["what"] == "refused"], audit


def run_sbatch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), *args], env=sbatch_env(tmp_path, ["nodeA", "nodeB"], **env),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_a_run_without_keys_is_refused_before_anything_starts(tmp_path: Path) -> None:
    p = run_sbatch(tmp_path, str(JOB))
    assert p.returncode == 2
    assert "LIBRA_KEYS is not set" in p.stderr and "--make-keys" in p.stderr, p.stderr
    empty = tmp_path / "nokeys"
    empty.mkdir()
    p = run_sbatch(tmp_path, str(JOB), LIBRA_KEYS=str(empty))
    assert p.returncode == 2
    assert f"LIBRA_KEYS={empty} lacks broker.key broker.key_secret actors.key_secret" in p.stderr, p.stderr
    assert "run once with --make-keys" in p.stderr
    assert not (tmp_path / "slurm.log").exists()  # no srun: nothing was started
    assert list(empty.iterdir()) == []  # and nothing made without being asked


def test_half_a_key_directory_is_refused_not_overwritten(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "libra", "keys", "--out", str(keys), "--name", "broker"], check=True,
                   capture_output=True, timeout=60)
    before = (keys / "broker.key_secret").read_bytes()
    p = run_sbatch(tmp_path, "--make-keys", str(JOB), LIBRA_KEYS=str(keys))
    assert p.returncode == 2
    assert "holds some of the keys but not actors.key_secret" in p.stderr, p.stderr
    assert (keys / "broker.key_secret").read_bytes() == before
    assert not (tmp_path / "slurm.log").exists()


def test_a_missing_job_file_and_a_run_outside_slurm_are_refused(tmp_path: Path) -> None:
    p = run_sbatch(tmp_path, str(tmp_path / "nope.toml"), LIBRA_KEYS=str(tmp_path))
    assert p.returncode == 2 and "job file" in p.stderr and "not found" in p.stderr
    env = {k: v for k, v in sbatch_env(tmp_path, []).items() if k != "SLURM_JOB_NODELIST"}
    p = subprocess.run(["bash", str(SBATCH), str(JOB)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "submit this script with sbatch" in p.stderr


def test_waiting_for_the_slots_gives_up_when_their_launcher_exits(tmp_path: Path) -> None:
    from libra.local import free_port, stop_process

    url = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        p = subprocess.run([sys.executable, "-m", "libra.rl.node_launch", "wait", "--broker", url, "--slots", "2",
                            "--pid", str(gone.pid)], capture_output=True, text=True, timeout=120)
    finally:
        stop_process(broker)
    assert p.returncode == 1
    assert f"the actors' launcher (pid {gone.pid}) exited; 0 of 2 actor slots connected" in p.stderr, p.stderr
