"""A job's slots laid over the nodes of an allocation (libra.rl.node_layout), and each node's ``libra actors``
command (libra.rl.node_launch): trainer ranks on node 0, rollout slots where engine room is left (hybrid only
beside the trainers), tools and the episode runner on the least loaded nodes, GPUs as Slurm bound them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libra.rl.node_launch import bound_gpus
from libra.rl.node_layout import lay_out, roles_text

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "arith_tiny.toml"


def layout(**kw):  # type: ignore[no-untyped-def]
    args = {"rollout": 2, "trainer": 2, "action": 1, "policy": "libra", "nodes": 2, "gpus_per_node": 0, **kw}
    return [(roles_text(n.gpu), roles_text(n.cpu)) for n in lay_out(**args)]


def test_cpu_nodes_keep_the_trainers_on_node0_and_the_rest_elsewhere() -> None:
    assert layout() == [("", "train=2,episode=1"), ("", "rollout=2,action=1")]
    assert layout(nodes=1) == [("", "train=2,hybrid=2,action=1,episode=1")]  # one node: libra run's own layout


def test_gpu_nodes_fill_engine_room_and_only_node0s_rollout_slots_are_hybrid() -> None:
    assert layout(rollout=6, trainer=2, action=2, gpus_per_node=4) == [
        ("train=2,hybrid=2", "action=1"), ("rollout=4", "action=1,episode=1")]
    assert layout(rollout=6, trainer=2, action=2, gpus_per_node=4, policy="static") == [
        ("train=2,rollout=2", "action=1"), ("rollout=4", "action=1,episode=1")]
    # more engines than GPUs: they share them (libra actors places gpuN.K), spread by room left
    assert layout(rollout=5, trainer=1, action=0, nodes=2, gpus_per_node=1) == [
        ("train=1,hybrid=2", ""), ("rollout=3", "episode=1")]


def test_every_slot_is_placed_once_and_spare_nodes_stay_empty() -> None:
    nodes = lay_out(rollout=2, trainer=2, action=1, policy="libra", nodes=6, gpus_per_node=0)
    assert sum(n.total for n in nodes) == 2 + 2 + 1 + 1
    assert [n.total for n in nodes] == [2, 1, 1, 0, 1, 1]


@pytest.mark.parametrize("kw, match", [({"nodes": 0}, "at least one node"), ({"gpus_per_node": -1}, ">= 0"),
                                       ({"policy": "fifo"}, "policy must be")])
def test_bad_counts_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        layout(**kw)


@pytest.mark.parametrize("env, n", [({}, 0), ({"CUDA_VISIBLE_DEVICES": ""}, 0), ({"CUDA_VISIBLE_DEVICES": "2,3"}, 2),
                                    ({"CUDA_VISIBLE_DEVICES": "GPU-8f1a,GPU-77c2,GPU-0d3e"}, 3)])
def test_the_gpus_are_the_ones_slurm_bound(env: dict, n: int) -> None:
    assert bound_gpus(env) == n  # unset: Slurm bound none, whatever NVML sees on the node


def launch(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "libra.rl.node_launch", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def test_plan_checks_the_job_and_prints_where_things_go(tmp_path: Path) -> None:
    p = launch("plan", str(JOB), "--nodes", "2", "--run-dir", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    model_dir, run, slots = p.stdout.splitlines()
    assert (Path(model_dir) / "config.json").is_file() and run == str(tmp_path / "run") and slots == "6"
    assert "node 0: CPUs train=2,episode=1" in p.stderr and "node 1: CPUs rollout=2,action=1" in p.stderr
    assert (tmp_path / "run" / "broker.toml").read_text().startswith("[broker]")
    bad = tmp_path / "bad.toml"
    bad.write_text(JOB.read_text().replace('name = "arith"', 'name = "no_such_env"'))
    p = launch("plan", str(bad), "--nodes", "2")
    assert p.returncode == 2 and "no_such_env" in p.stderr


def test_each_node_starts_its_own_part_on_the_gpus_it_was_given(tmp_path: Path) -> None:
    import os

    common = ["actors", str(JOB), "--nodes", "2", "--gpus-per-node", "2", "--broker", "tcp://10.0.0.1:5555",
              "--model-dir", "/m", "--run-dir", str(tmp_path), "--dry-run"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIBRA_", "CUDA_VISIBLE"))}
    p = launch(*common, env={**env, "SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "4,5"})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    argv = out["argv"]
    assert argv[argv.index("--gpu-roles") + 1] == "rollout=2" and argv[argv.index("--roles") + 1] == "action=1"
    assert argv[argv.index("--gpu-slots") + 1] == "auto"  # libra actors keeps to CUDA_VISIBLE_DEVICES
    assert out["env"]["LIBRA_DATAPLANE_HOST"] == out["env"]["LIBRA_ADVERTISE_ADDRESS"]  # reachable by other nodes
    p = launch(*common, env={**env, "SLURM_NODEID": "0"})  # Slurm bound no GPU to this task
    assert p.returncode == 0, p.stderr
    argv = json.loads(p.stdout)["argv"]
    assert argv[argv.index("--gpu-slots") + 1] == "0" and "was given 0 GPU(s)" in p.stderr
    p = launch(*common, env=env)
    assert p.returncode == 2 and "SLURM_NODEID" in p.stderr
