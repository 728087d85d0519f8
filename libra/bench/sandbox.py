"""Benchmark: per-action overhead of a warm sandbox vs a bare ``subprocess.run`` of the same code.

``python -m libra.bench sandbox [--iterations N] [--cpu-iterations M] [--no-cold] [--json]``

Three ways to run the same Python snippet, interleaved in one run so host noise hits all of them alike:

- ``bare``: ``subprocess.run([python, "-c", code], capture_output=True)``, no isolation (the baseline);
- ``warm``: ``SandboxPool.run(traj, "python", {"code": code})`` on an already-bound trajectory: the
  zygote inside the bubblewrap sandbox forks, drops privileges, applies rlimits/affinity and execs the
  same interpreter;
- ``cold`` (reference): a one-shot ``bwrap ... python -c code`` per action with the same binds, i.e.
  what the pool would cost without a zygote.

Two workloads: ``noop`` (``pass``: pure dispatch overhead) and ``cpu`` (a ~0.2 s loop: the overhead as a
fraction of a CPU-bound action). Reported per workload and mode: median and p90 in ms, and for ``warm``
and ``cold`` the median difference to ``bare`` in ms and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from libra.engines.sandbox.pool import SandboxLimits, SandboxPool
from libra.engines.sandbox.isolation import (
    build_bwrap_argv,
    host_root_links,
    interpreter_paths,
)
from libra.logging import configure as configure_logging

WORKLOADS = {
    "noop": "pass",
    "cpu": "total = 0\nfor i in range(3_000_000):\n    total += i * i\n",
}


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(samples) * 1e3, "p90_ms": _percentile(samples, 0.9) * 1e3,
            "n": len(samples)}


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns ``{"isolation": {...}, "workloads": {name: {mode: stats}}}``."""
    python = args.python or sys.executable
    limits = SandboxLimits(timeout_s=60)
    results: dict[str, Any] = {"python": python, "workloads": {}}
    with SandboxPool(warm=1, max_sandboxes=4, limits=limits, python=python) as pool, \
            tempfile.TemporaryDirectory(prefix="libra-bench-cold-") as cold_ws:
        report = pool.isolation_report()
        results["isolation"] = {k: report[k] for k in ("mode", "bwrap_version", "user_namespace", "cpu_control")}
        cold_prefix: list[str] | None = None
        if not args.no_cold and report["mode"] == "bwrap" and shutil.which("bwrap"):
            os.chmod(cold_ws, 0o777)
            cold_prefix = build_bwrap_argv(
                shutil.which("bwrap") or "bwrap", workspace=cold_ws, command=(), ro_paths=interpreter_paths(python),
                root_links=host_root_links(), privileged=os.geteuid() == 0, tmp_mb=limits.tmp_mb)
        for name, code in WORKLOADS.items():
            iterations = args.iterations if name == "noop" else args.cpu_iterations
            if iterations <= 0:
                continue
            modes: dict[str, Callable[[], Any]] = {
                "bare": partial(subprocess.run, [python, "-c", code], capture_output=True, check=True),
                "warm": partial(_warm, pool, code),
            }
            if cold_prefix is not None:
                modes["cold"] = partial(subprocess.run, [*cold_prefix, python, "-c", code], capture_output=True,
                                        check=True)
            for fn in modes.values():  # warm-up: page cache, first bind of the trajectory
                fn()
            samples: dict[str, list[float]] = {m: [] for m in modes}
            order = list(modes)
            for i in range(iterations):
                for mode in order[i % len(order):] + order[:i % len(order)]:  # rotate who goes first
                    samples[mode].append(_time(modes[mode]))
            stats = {mode: _summary(s) for mode, s in samples.items()}
            bare = stats["bare"]["median_ms"]
            for mode in ("warm", "cold"):
                if mode in stats:
                    stats[mode]["minus_bare_ms"] = stats[mode]["median_ms"] - bare
                    stats[mode]["ratio_to_bare"] = stats[mode]["median_ms"] / bare
            results["workloads"][name] = stats
    return results


def _warm(pool: SandboxPool, code: str) -> None:
    result = pool.run("bench", "python", {"code": code})
    if result["exit_code"] != 0:
        raise RuntimeError(f"benchmark action failed: {result['stderr'][-500:]}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print a table, or one JSON object with ``--json``."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench sandbox", description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=40, help="runs per mode of the noop workload")
    parser.add_argument("--cpu-iterations", type=int, default=8, help="runs per mode of the cpu workload")
    parser.add_argument("--no-cold", action="store_true", help="skip the one-shot bwrap reference")
    parser.add_argument("--python", default=None, help="interpreter to run (default: this one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    configure_logging(level="warning")  # logs go to stderr; stdout carries only the table or the JSON
    results = run(args)
    if args.json:
        print(json.dumps(results))
        return 0
    iso = results["isolation"]
    print(f"sandbox: {iso['mode']} (bwrap {iso['bwrap_version']}, user namespace: {iso['user_namespace']}, "
          f"cpu control: {iso['cpu_control']}); python: {results['python']}")
    print(f"{'workload':<8} {'mode':<5} {'median ms':>10} {'p90 ms':>9} {'- bare ms':>10} {'/ bare':>7} {'n':>4}")
    for name, stats in results["workloads"].items():
        for mode, s in stats.items():
            diff = f"{s['minus_bare_ms']:+10.2f}" if "minus_bare_ms" in s else f"{'':>10}"
            ratio = f"{s['ratio_to_bare']:7.3f}" if "ratio_to_bare" in s else f"{'':>7}"
            print(f"{name:<8} {mode:<5} {s['median_ms']:10.2f} {s['p90_ms']:9.2f} {diff} {ratio} {s['n']:4d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
