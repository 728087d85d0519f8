"""``python -m libra.rl.node_launch``: a job's actors on the nodes of a multi-node allocation (what
``deploy/slurm/libra.sbatch`` runs; any launcher that starts one task per node can).

``plan JOB.toml --nodes N --gpus-per-node G`` (once, on the first node, before anything starts): checks the
job file and its environment, resolves the model (the tiny one is built here, once, into the cache every node
reads), writes the broker's ``[broker]`` table to ``RUN/broker.toml`` (the job's policies, as ``libra run``
gives its own broker), prints the layout of every node (:mod:`libra.rl.node_layout`) on stderr and three lines
on stdout: the model directory and the run directory (absolute; both must be on a file system every node sees)
and the number of actor slots in all.

``actors JOB.toml --broker URL --model-dir M --run-dir R --nodes N --gpus-per-node G`` (one task per node):
execs ``libra actors`` with this node's part of the layout. The node's index is ``--node`` or ``$SLURM_NODEID``
(a Kubernetes StatefulSet passes its pod's ordinal). Its GPUs are those of ``CUDA_VISIBLE_DEVICES``, as Slurm
sets it for the task (unset: Slurm bound no GPU, so none is used, whatever NVML sees), or ``--node-gpus``. Its
data-plane sockets bind the address this node reaches the broker from (``LIBRA_DATAPLANE_HOST`` and
``LIBRA_ADVERTISE_ADDRESS`` unless set), so other nodes can fetch from them.
A node with no slot in the layout says so and exits 0.

``wait --broker URL --slots N [--pid PID]``: wait until ``N`` actor slots are connected (the job's driver checks
the tools on offer once, so it starts only then); gives up when ``PID`` (the launcher of the actors) exits.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["actor_command", "bound_gpus", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m libra.rl.node_launch",
                                description="Lay a job's actor slots over the nodes of an allocation (plan), or "
                                            "start this node's part (actors).")
    sub = p.add_subparsers(dest="command", required=True)
    for name, what in (("plan", "check the job, resolve its model, write RUN/broker.toml, print every node's slots"),
                       ("actors", "exec 'libra actors' with this node's slots")):
        s = sub.add_parser(name, help=what, description=what)
        s.add_argument("job", help="job TOML file")
        s.add_argument("--nodes", type=int, required=True, help="nodes in the allocation")
        s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs each node was given (default 0)")
        s.add_argument("--run-dir", help="the job's run directory (default: [job] run_dir, from here)")
    act = sub.choices["actors"]
    act.add_argument("--broker", required=True, help="the broker's address, tcp://HOST:PORT")
    act.add_argument("--model-dir", help="the model directory 'plan' printed (default: [model] name, resolved here)")
    act.add_argument("--node-gpus", type=int,
                     help="GPUs this node's task was given (default: the entries of CUDA_VISIBLE_DEVICES, none when "
                          "it is unset, as under Slurm; a container given GPUs by the NVIDIA device plugin sees "
                          "only those: pass its GPU request)")
    act.add_argument("--node", type=int, help="this node's index (default: $SLURM_NODEID)")
    act.add_argument("--log-level", default=None, help="the actors' log level")
    act.add_argument("--dry-run", action="store_true",
                     help="print the command and the environment it would get (JSON) instead of running it")
    w = sub.add_parser("wait", help="wait until the broker has N actor slots",
                       description="Wait until N actor slots are connected to the broker (its client key from "
                                   "LIBRA_CURVE_SECRET and LIBRA_BROKER_KEY); exit 1 at --timeout-s or when --pid "
                                   "exits.")
    w.add_argument("--broker", required=True, help="the broker's address")
    w.add_argument("--slots", type=int, required=True, help="actor slots to wait for ('plan' printed it)")
    w.add_argument("--timeout-s", type=float, default=600.0, help="give up after this long (default %(default)s)")
    w.add_argument("--pid", type=int, help="give up when this process (the actors' launcher) has exited")
    return p


def _job(args: argparse.Namespace) -> Any:
    from libra.rl.config import load_job

    cfg = load_job(args.job)
    return cfg.with_run_dir(str(Path(args.run_dir or cfg.job.run_dir).resolve()))


def _layout(cfg: Any, nodes: int, gpus: int) -> list[Any]:
    from libra.rl.node_layout import lay_out

    a = cfg.actors
    return lay_out(rollout=a.rollout, trainer=a.trainer, action=a.action, policy=cfg.broker.policy, nodes=nodes,
                   gpus_per_node=gpus)


def _plan(args: argparse.Namespace) -> int:
    from libra.envs.loader import load_env_config
    from libra.rl.broker_table import broker_mapping, broker_toml
    from libra.rl.cluster import gpu_names
    from libra.rl.driver import resolve_model
    from libra.rl.node_layout import roles_text

    cfg = _job(args)
    load_env_config(cfg.env, "job")  # a broken plug-in fails here, before any process starts
    layout = _layout(cfg, args.nodes, args.gpus_per_node)
    model_dir = resolve_model(cfg.model.name)
    run = Path(cfg.job.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    table, _ = broker_mapping(cfg, gpu_names(args.gpus_per_node))
    (run / "broker.toml").write_text(broker_toml(table))  # as libra run: the user sees what the broker ran with
    for i, node in enumerate(layout):
        parts = [f"GPUs {roles_text(node.gpu)}" if node.gpu else "", f"CPUs {roles_text(node.cpu)}" if node.cpu else ""]
        print(f"libra: node {i}: {'; '.join(p for p in parts if p) or 'nothing'}", file=sys.stderr)
    print(model_dir)
    print(run)
    print(sum(node.total for node in layout))
    return 0


def _wait(args: argparse.Namespace) -> int:
    from libra.client import Client, LibraError

    deadline = time.monotonic() + args.timeout_s
    n = 0
    try:
        with Client(args.broker, connect_timeout=30) as c:
            while (n := len(c.status(timeout=10).actors)) < args.slots:
                if args.pid is not None and not _alive(args.pid):
                    print(f"libra: the actors' launcher (pid {args.pid}) exited; {n} of {args.slots} actor slots "
                          "connected", file=sys.stderr)
                    return 1
                if time.monotonic() > deadline:
                    print(f"libra: {n} of {args.slots} actor slots connected after {args.timeout_s:g} s",
                          file=sys.stderr)
                    return 1
                time.sleep(1.0)
    except LibraError as exc:  # unreachable broker, refused key
        print(f"libra: {exc}", file=sys.stderr)
        return 1
    print(f"libra: {n} actor slots connected", file=sys.stderr)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def actor_command(cfg: Any, node: Any, broker: str, model_dir: str, own_gpus: int) -> list[str]:
    """The ``libra actors`` command line of one node's slots (a :class:`~libra.rl.node_layout.NodeSlots`)."""
    from libra.rl.cluster import slot_flags
    from libra.rl.node_layout import roles_text

    cmd = [sys.executable, "-m", "libra.actors", "--broker", broker, "--gpu-slots", "auto" if own_gpus else "0"]
    cmd += ["--roles", roles_text(node.cpu)] if node.cpu else ["--cpu-slots", "0"]
    if node.gpu:
        cmd += ["--gpu-roles", roles_text(node.gpu)]
    return cmd + slot_flags(cfg, Path(cfg.job.run_dir), Path(model_dir))


def _node_address(broker: str) -> str | None:
    """The address this node reaches the broker's host from (where other nodes can reach it)."""
    from libra.engines.rendezvous import route_source
    from libra.transport.endpoints import split_endpoints, tcp_host_port

    hp = tcp_host_port(str(split_endpoints(broker)[0]))
    return route_source(hp[0]) if hp else None


def bound_gpus(environ: Mapping[str, str]) -> int:
    """The GPUs Slurm (or another launcher) bound to this task: the entries of ``CUDA_VISIBLE_DEVICES``; none when
    it is unset (Slurm bound none, whatever NVML sees on the node)."""
    from libra.actors.slots import parent_visible

    return len(parent_visible(environ) or [])


def _actors(args: argparse.Namespace) -> int:
    from libra.rl.cluster import slot_env
    from libra.transport.endpoints import parse_endpoints

    node = args.node if args.node is not None else os.environ.get("SLURM_NODEID")
    if node is None or not str(node).isdigit() or not 0 <= int(node) < args.nodes:
        raise ValueError(f"this node's index must be 0..{args.nodes - 1} (--node or $SLURM_NODEID), got {node!r}")
    parse_endpoints(args.broker)  # BadAddress (a ValueError) names what is wrong with it
    cfg = _job(args)
    mine = _layout(cfg, args.nodes, args.gpus_per_node)[int(node)]
    host = socket.gethostname()
    if not mine.total:
        print(f"libra: node {node} ({host}): no slot of the job goes here", file=sys.stderr)
        return 0
    own = args.node_gpus if args.node_gpus is not None else bound_gpus(os.environ)
    if own != args.gpus_per_node:
        print(f"libra: node {node} ({host}) was given {own} GPU(s) (CUDA_VISIBLE_DEVICES), the layout assumed "
              f"{args.gpus_per_node}", file=sys.stderr)
    env = {**os.environ, **slot_env(cfg)}
    address = _node_address(args.broker)
    for var in ("LIBRA_DATAPLANE_HOST", "LIBRA_ADVERTISE_ADDRESS"):
        if address and not env.get(var):
            env[var] = address
    if args.model_dir is None:
        from libra.rl.driver import resolve_model

        args.model_dir = str(resolve_model(cfg.model.name))
    cmd = actor_command(cfg, mine, args.broker, args.model_dir, own)
    if args.log_level:
        cmd += ["--log-level", args.log_level]
    print(f"libra: node {node} ({host}): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    if args.dry_run:
        print(json.dumps({"argv": cmd, "env": {k: v for k, v in env.items() if os.environ.get(k) != v}}))
        return 0
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"plan": _plan, "actors": _actors, "wait": _wait}[args.command](args)
    except (ValueError, OSError, RuntimeError) as exc:  # ConfigError, a bad count; JobFailed: the model
        print(f"libra.rl.node_launch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
