"""``python -m libra bench job --job FILE [--seed N] [--steps N]``: one RL job under ``[broker] policy = "static"``
(the fixed rollout/trainer split: the baseline) and under the default ``"libra"`` (hybrid slots under the
Elastic Hybrid Pool, the planner, C-MLFQ, Tangram), from the same seed, one after the other in this run, each
on its own loopback cluster and in its own run directory (``--out``/<job>/<policy>).

Per policy, from what the run wrote (``RUN/metrics.jsonl`` step and decision records, ``RUN/summary.json``,
``RUN/actors/*.json``):

- **time per step**: the mean of the step records' ``step_time_s`` (the broker's seconds between one step's
  end and the next's; step 1 from the job's start), over all steps and over steps 2..n (step 1 carries the
  engines' warm-up); **steps wall**: their sum (job start to the last step's end); **total wall**: this
  process's seconds for the whole run, the cluster's start and stop included;
- **generated tokens/s**: the steps' ``gen_tokens`` over the steps wall;
- **idle share per role**: over the steps wall, the share of time during which no step was training
  (``train``: the union of the steps' ``train_span_s``) and during which no episode of any step was in
  flight (``rollout``: the union of ``rollout_span_s``). That is the role's idle share as a whole; the idle
  share of one slot (one rollout instance, one rank) is not in any record; what is measured instead is each
  slot process's **CPU share** over the same window (its CPU seconds over the window, sampled by
  :class:`~libra.bench.job_cpu.CpuSampler`; the window ends at the last write of ``metrics.jsonl``), by role
  (``rollout`` counts the hybrid slots, which also train while borrowed), and the **host CPU share** (every
  slot's and the broker's CPU seconds over cores x window): with fewer cores than slots a low slot share is
  idle *or* starved, and a host share near 1 says starved;
- **reward against wall time**: each step's end (seconds from the job's start) and its mean reward;
- **decisions**: the decision records counted by ``what``, the hybrid slots' role switches (their
  ``switches`` in ``RUN/actors/<actor id>.json``) and each step's trainer members (core ranks + borrowed slots);
- **prediction error**: the mean ``|log(predicted_step_s / step_time_s)|`` over the steps with a
  prediction (``libra.rl.metrics.prediction_error``; none under ``static``, which has no planner).

Printed last: libra/static of the mean time per step (all steps and steps 2..n): < 1 means Libra was
faster. ``--repeat N`` runs N pairs, each in the other order than the one before (on a shared host the load
moves between runs): every pair's ratios and their median. The result object goes to
``--out``/<job>/bench_job.json (and to stdout with ``--json``).
Under ``static`` the job file's ``[broker.planner]`` table is dropped (a static job has no planner).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from libra.bench.job_cpu import CpuSampler, window_cpu
from libra.bench.output import finite, run_and_emit

__all__ = ["POLICIES", "covered", "cpu_figures", "figures", "main", "policy_config", "ratios", "table"]

POLICIES = ("static", "libra")


def covered(spans: Iterable[Any], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of ``spans`` (``[start, end]`` pairs; others skipped)."""
    ivs = sorted((max(lo, float(s[0])), min(hi, float(s[1]))) for s in spans
                 if isinstance(s, (list, tuple)) and len(s) == 2)
    total, end = 0.0, lo
    for a, b in ivs:
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def figures(steps: list[dict[str, Any]], decisions: list[dict[str, Any]], slots: dict[str, dict[str, Any]],
            summary: dict[str, Any]) -> dict[str, Any]:
    """One policy's figures (see the module docstring) from its step records, decision records, slot records
    (``RUN/actors/<actor id>.json``, by actor id ``HOST/SLOT``) and ``summary.json``."""
    from libra.rl.metrics import prediction_error

    times = [float(r["step_time_s"]) for r in steps]
    wall = sum(times)
    tokens = sum(int(r.get("gen_tokens", 0)) for r in steps)
    idle: dict[str, float | None] = {"train": None, "rollout": None}
    if wall > 0:
        for role in idle:
            spans = [r.get(f"{role}_span_s") for r in steps]
            if any(spans):
                idle[role] = round(1.0 - covered(spans, 0.0, wall) / wall, 4)
    rewards = [r["reward_mean"] for r in steps]
    return {
        "steps": len(steps), "step_s_mean": _mean(times), "step_s_mean_2n": _mean(times[1:]),
        "step_s": [round(t, 3) for t in times], "steps_wall_s": round(wall, 3),
        "gen_tokens": tokens, "gen_tokens_per_s": tokens / wall if wall > 0 else None,
        "rollout_time_s": [round(float(r.get("rollout_time_s", 0.0)), 3) for r in steps],
        "train_time_s": [round(float(r.get("train_time_s", 0.0)), 3) for r in steps],
        "idle_share": idle,
        "reward_vs_wall": [{"step": r["step"], "wall_s": round(float((r.get("train_span_s") or [0, t_end])[1]), 3),
                            "reward_mean": round(float(r["reward_mean"]), 4)}
                           for r, t_end in zip(steps, _cumsum(times))],
        "reward_mean": _mean(rewards),
        "members": [len(r["members"]) if isinstance(r.get("members"), list) else r.get("ranks") for r in steps],
        "decisions": dict(Counter(str(d.get("what")) for d in decisions)),
        "role_switches": {slot: int(rec.get("switches", 0)) for slot, rec in sorted(slots.items())
                          if rec.get("switches")},
        "prediction_error": prediction_error(steps),
        "steps_predicted": sum(1 for r in steps if (r.get("predicted_step_s") or 0) > 0),
        "episodes_failed": summary.get("episodes_failed"), "dropped_groups": summary.get("dropped_groups"),
    }


def cpu_figures(cpu: dict[str, float], window_s: float, cores: int) -> dict[str, Any]:
    """CPU shares from ``cpu`` (``slot:role`` or ``broker`` -> CPU seconds in a window of ``window_s``): per
    slot, per role (the mean over its slots; hybrid slots count as ``rollout``) and of the host (``cores``)."""
    if window_s <= 0 or not cpu:
        return {"window_s": window_s, "slot_share": {}, "role_share": {}, "host_share": None}
    roles: dict[str, list[float]] = {}
    for name, sec in cpu.items():
        role = name.rsplit(":", 1)[-1]
        roles.setdefault("rollout" if role == "hybrid" else role, []).append(sec / window_s)
    return {"window_s": round(window_s, 3), "slot_share": {n: round(c / window_s, 3) for n, c in sorted(cpu.items())},
            "role_share": {r: round(statistics.fmean(v), 3) for r, v in sorted(roles.items())},
            "host_share": round(sum(cpu.values()) / (max(1, cores) * window_s), 3)}


def _cumsum(xs: list[float]) -> list[float]:
    out, acc = [], 0.0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def ratios(static: dict[str, Any], libra: dict[str, Any]) -> dict[str, float | None]:
    """libra/static of the mean time per step (all steps, steps 2..n) and of the generated tokens/s."""
    def ratio(key: str) -> float | None:
        a, b = libra.get(key), static.get(key)
        return a / b if a is not None and b else None

    return {"step_s": ratio("step_s_mean"), "step_s_2n": ratio("step_s_mean_2n"),
            "gen_tokens_per_s": ratio("gen_tokens_per_s")}


def policy_config(cfg: Any, policy: str, run_dir: Path, *, seed: int | None = None, steps: int | None = None) -> Any:
    """Job ``cfg`` under ``[broker] policy = policy`` in ``run_dir``, with ``seed``/``steps`` when given (checked
    as at load time). ``static`` drops ``[broker.planner]`` (a static job has no planner)."""
    from libra.rl.broker_table import check_broker_table

    b = dataclasses.replace(cfg.broker, policy=policy, **({"planner": {}} if policy == "static" else {}))
    job = dataclasses.replace(cfg.job, run_dir=str(run_dir), **({"seed": seed} if seed is not None else {}),
                              **({"steps": steps} if steps is not None else {}))
    out = dataclasses.replace(cfg, broker=b, job=job)
    check_broker_table(out, "bench job")
    return out


def _slots(run: Path) -> dict[str, dict[str, Any]]:
    from libra.actors.slot_records import read_slot_records

    return read_slot_records(run)  # by actor id (HOST/SLOT)


def run_policy(cfg: Any, policy: str, run: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run the job under ``policy`` in ``run`` on its own loopback cluster; its figures."""
    from libra.rl.driver import run_job
    from libra.rl.metrics import read_metrics

    pc = policy_config(cfg, policy, run, seed=args.seed, steps=args.steps)
    t0 = time.perf_counter()
    with CpuSampler() as sampler:
        summary = run_job(pc, progress=False, log_level=args.log_level)
    total = time.perf_counter() - t0
    fig = figures(read_metrics(run), read_metrics(run, "decision"), _slots(run), summary)
    end = (run / "metrics.jsonl").stat().st_mtime  # the last step's record: the window's end
    window = float(fig["steps_wall_s"])
    cpu = cpu_figures(window_cpu(sampler.samples, sampler.names, end - window, end), window, os.cpu_count() or 1)
    return {"policy": policy, "run_dir": str(run), "total_wall_s": round(total, 2),
            "job_wall_s": round(float(summary.get("total_wall_s", 0.0)), 2), **fig, "cpu": cpu}


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def table(out: dict[str, Any]) -> str:
    """The result object as text."""
    res = out["policies"]
    lines = [f"bench job: {out['job']} ({out['steps']} steps, seed {out['seed']}), policies run in the order "
             f"{', '.join(res)} on this host ({out['cpus']} CPUs, load before {out['load_before']})"
             + (f"; the first of {len(out['pairs'])} pairs" if len(out.get("pairs", ())) > 1 else ""), "",
             f"{'':28s}" + "".join(f"{p:>14s}" for p in res)]

    def row(label: str, fn: Any) -> None:
        lines.append(f"{label:28s}" + "".join(f"{fn(r):>14s}" for r in res.values()))

    row("time per step (s)", lambda r: _f(r["step_s_mean"]))
    row("time per step 2..n (s)", lambda r: _f(r["step_s_mean_2n"]))
    row("steps wall (s)", lambda r: _f(r["steps_wall_s"], 2))
    row("total wall (s)", lambda r: _f(r["total_wall_s"], 1))
    row("generated tokens/s", lambda r: _f(r["gen_tokens_per_s"], 0))
    row("idle share: training", lambda r: _f(r["idle_share"]["train"], 2))
    row("idle share: rollout", lambda r: _f(r["idle_share"]["rollout"], 2))
    for role in sorted({k for r in res.values() for k in r.get("cpu", {}).get("role_share", {})}):
        row(f"CPU share: {role}" + ("" if role == "broker" else " slots"), lambda r, role=role: _f(r.get("cpu", {}).get("role_share", {}).get(role), 2))
    row("host CPU share", lambda r: _f(r.get("cpu", {}).get("host_share"), 2))
    row("mean reward", lambda r: _f(r["reward_mean"]))
    row("prediction error", lambda r: _f(r["prediction_error"]))
    row("episodes failed", lambda r: _f(r["episodes_failed"]))
    for p, r in res.items():
        lines.append(f"{p}: step s {r['step_s']}; rollout s {r['rollout_time_s']}; train s {r['train_time_s']}; "
                     f"trainer members {r['members']}")
        lines.append(f"{p}: decisions {r['decisions'] or 'none'}; role switches {r['role_switches'] or 'none'}")
    lines.append("")
    lines.append("reward against wall time (s from the job's start: a step's end, its mean reward)")
    lines.append("step" + "".join(f"{p + ' wall':>14s}{p + ' reward':>16s}" for p in res))
    for i in range(max(len(r["reward_vs_wall"]) for r in res.values())):
        cells = ""
        for r in res.values():
            rv = r["reward_vs_wall"][i] if i < len(r["reward_vs_wall"]) else None
            cells += f"{_f(rv['wall_s'], 2) if rv else '-':>14s}{_f(rv['reward_mean'], 4) if rv else '-':>16s}"
        lines.append(f"{i + 1:4d}{cells}")
    lines.append("")
    lines.append("idle share: share of the steps wall with no step training / no episode in flight (a role as a "
                 "whole; a slot's own idle share is not measured: no record holds its busy time). CPU share: a slot's "
                 "CPU seconds over the steps wall (mean over the role's slots; hybrid slots count as rollout); host: "
                 "all slots' and the broker's over cores x wall")
    q = out["ratios"]
    lines.append(f"libra/static time per step: {_f(q['step_s'])} (steps 2..n: {_f(q['step_s_2n'])}); generated "
                 f"tokens/s libra/static: {_f(q['gen_tokens_per_s'])}  (< 1 time per step: Libra faster); "
                 f"load after {out['load_after']}")
    for i, pair in enumerate(out.get("pairs", ())[1:] if len(out.get("pairs", ())) > 1 else (), start=2):
        q = pair["ratios"]
        lines.append(f"pair {i} ({', '.join(pair['order'])}): libra/static time per step {_f(q['step_s'])} (steps "
                     f"2..n: {_f(q['step_s_2n'])}), tokens/s {_f(q['gen_tokens_per_s'])}")
    if "ratios_median" in out:
        m = out["ratios_median"]
        lines.append(f"median over {len(out['pairs'])} pairs: libra/static time per step {_f(m.get('step_s'))} "
                     f"(steps 2..n: {_f(m.get('step_s_2n'))}), tokens/s {_f(m.get('gen_tokens_per_s'))}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.rl.config import load_job

    cfg = load_job(args.job)
    root = Path(args.out) / cfg.job.name
    res: dict[str, Any] = {"job": str(args.job), "name": cfg.job.name, "steps": cfg.job.steps if args.steps is None
                           else args.steps, "seed": cfg.job.seed if args.seed is None else args.seed,
                           "cpus": os.cpu_count(), "load_before": [round(x, 2) for x in os.getloadavg()], "pairs": []}
    for i in range(args.repeat):  # each pair in the other order than the one before: no policy always goes first
        first = args.first if i % 2 == 0 else next(p for p in POLICIES if p != args.first)
        order = [first, *[p for p in POLICIES if p != first]]
        pair = {p: run_policy(cfg, p, (root / (p if args.repeat == 1 else f"{p}{i + 1}")).resolve(), args)
                for p in order}
        res["pairs"].append({"order": order, "ratios": ratios(pair["static"], pair["libra"]), "policies": pair})
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    res["policies"], res["ratios"] = res["pairs"][0]["policies"], res["pairs"][0]["ratios"]
    if args.repeat > 1:
        res["ratios_median"] = {k: statistics.median(x["ratios"][k] for x in res["pairs"])
                                for k in res["ratios"] if all(x["ratios"][k] is not None for x in res["pairs"])}
    root.mkdir(parents=True, exist_ok=True)
    (root / "bench_job.json").write_text(json.dumps(finite(res), indent=1))
    res["result_file"] = str(root / "bench_job.json")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra bench job", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--job", required=True, help="the job file (e.g. examples/arith_shift.toml)")
    p.add_argument("--seed", type=int, help="[job] seed for both runs (default: the file's)")
    p.add_argument("--steps", type=int, help="[job] steps for both runs (default: the file's)")
    p.add_argument("--out", default="runs/bench_job", help="run directories go to OUT/<job name>/<policy>")
    p.add_argument("--first", choices=POLICIES, default="static", help="the policy run first")
    p.add_argument("--repeat", type=int, default=1, help="pairs of runs, each pair in the other order (the table "
                                                         "shows the first pair; every pair's ratio and the median)")
    p.add_argument("--log-level", default="warning", help="the cluster's log level")
    p.add_argument("--json", action="store_true", help="print the result object as JSON")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1 or args.repeat < 1:
        p.error("--steps and --repeat must be >= 1")
    return run_and_emit(run, args, table)


if __name__ == "__main__":
    sys.exit(main())
