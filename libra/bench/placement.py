"""Benchmark: placements/s of the broker's action placement at cluster scale, against the scanning pools.

One placement round is what the broker's dispatcher runs when an action is submitted or a core frees
(:meth:`libra.broker.actions.ActionPlacement.place`, then ``hold`` for each placed action): the ``tangram``
policy decides over the free cores of every action actor, and each grant is placed best fit inside NUMA
nodes (``libra/broker/core_pools.py``). Compared, in the same run and on the same sequence:

- **bitsets**: the broker's :class:`~libra.broker.core_pools.CorePools` (per-NUMA-node free-id bitsets kept
  up to date on grant and release);
- **scanning**: :class:`~libra.bench.placement_ref.ScanningCorePools` (every query scans every CPU id of every
  candidate actor), the implementation it replaced.

Setup per size: ``A`` actors × ``--cores`` CPU ids (default 256) in ``--numa`` NUMA nodes each, one host per
actor; the cluster is preloaded to ``--load`` of its cores with running 4-core actions (the same ids in both);
then ``--steps`` times: ``--burst`` (default 1) random running actions end, as many new ones are submitted
(a random tool among ``edit`` 1 core, ``pytest`` 1..8 cores, ``build`` 2..16 cores, elastic) and one round
places what it can. Each implementation runs ``--repeats`` times interleaved with the other; the fastest run
of each is reported. Reported per size: rounds, actions placed, placements/s of each (placed / seconds inside
the rounds), the ratio, and whether both placed every action on the same actor with the same core ids (they
must).

``python -m libra.bench placement [--actors 2,15,64] [--cores 256] [--numa 2] [--load 0.85] [--steps 300]
[--seed 0] [--repeats 3] [--burst 1] [--json]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from libra.bench.output import emit
from libra.bench.placement_ref import ScanningCorePools
from libra.broker.actions import ActionPlacement
from libra.broker.sessions import ActorSession
from libra.broker.work import Work

TOOLS: dict[str, dict[str, Any]] = {
    "edit": {"cpu": 1, "duration_s": 0.2},
    "pytest": {"cpu": 1, "max_cpu": 8, "parallel_fraction": 0.7, "duration_s": 2.0},
    "build": {"cpu": 2, "max_cpu": 16, "parallel_fraction": 0.8, "duration_s": 5.0},
}


def _actors(n: int, cores: int, numa: int) -> list[ActorSession]:
    per = max(1, cores // numa)
    out = []
    for i in range(n):
        cpus = list(range(cores))
        labels = {"cores": cores, "cpus": cpus, "numa": [min(c // per, numa - 1) for c in cpus]}
        out.append(ActorSession(f"a{i:03d}".encode(), f"n{i:03d}/cpu", f"n{i:03d}", "cpu", 1,
                                {"action": frozenset(TOOLS)}, frozenset({"action"}), cores, labels, 0.0, 0.0, 0.0,
                                cores=cores))
    return out


def run_one(scanning: bool, n_actors: int, cores: int, numa: int, load: float, steps: int,
            seed: int, burst: int = 1) -> dict[str, Any]:
    """One implementation over one size; returns its timings and the placements it made."""
    pl = ActionPlacement("tangram", None, TOOLS)
    if scanning:
        pl.cores = ScanningCorePools()  # type: ignore[assignment]
    actors = _actors(n_actors, cores, numa)
    rng = random.Random(seed)
    works: dict[str, Work] = {}
    queues: dict[tuple[str, str], list[str]] = {("action", t): [] for t in TOOLS}
    running: list[tuple[str, ActorSession]] = []
    now = 0.0
    for s in actors:  # preload: running 4-core actions over the same ids in both implementations
        for k in range(int(cores * load) // 4):
            wid = f"pre/{s.actor_id}/{k}"
            assert pl.cores.take(wid, s, list(range(4 * k, 4 * k + 4)))
            pl.started(wid, 4, now)
            s.held.add(wid)
            running.append((wid, s))
    placed: list[tuple[str, bytes, tuple[int, ...]]] = []
    busy = 0.0
    rounds = 0
    for step in range(steps):
        now += 0.01
        for b in range(burst):
            if running:
                wid, s = running.pop(rng.randrange(len(running)))
                s.held.discard(wid)
                s.cores_used -= pl.ended(wid)
            tool = rng.choice(sorted(TOOLS))
            wid = f"w{step}/{b}"
            works[wid] = Work(wid, wid, b"c", "action", tool, {}, f"t{rng.randrange(4 * n_actors)}", now,
                              now + 1e9, step * burst + b + 1)
            queues[("action", tool)].append(wid)
        t0 = time.perf_counter()
        out = pl.place(actors, queues, works, now)
        for w_id, sess, route in out:
            w = works[w_id]
            queues[w.key].remove(w_id)
            w.route = route
            pl.hold(w, sess, now)
        busy += time.perf_counter() - t0
        rounds += 1
        for w_id, sess, route in out:
            sess.held.add(w_id)
            running.append((w_id, sess))
            placed.append((w_id, sess.peer, tuple(route.get("core_ids") or ())))
    return {"rounds": rounds, "placed": len(placed), "seconds": busy, "placements": placed}


def run(sizes: list[int], cores: int, numa: int, load: float, steps: int, seed: int,
        repeats: int = 3, burst: int = 1) -> dict[str, Any]:
    run_one(False, 2, 16, 1, 0.5, 20, seed)  # warm up (imports, first-call caches) before anything is timed
    rows = []
    for n in sizes:
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(repeats):  # interleaved; the best of each (the least disturbed by the shared machine)
            for scanning in (False, True):
                runs[scanning].append(run_one(scanning, n, cores, numa, load, steps, seed, burst))
        new, ref = (min(runs[k], key=lambda r: r["seconds"]) for k in (False, True))
        pps_new = new["placed"] / new["seconds"] if new["seconds"] else float("inf")
        pps_ref = ref["placed"] / ref["seconds"] if ref["seconds"] else float("inf")
        rows.append({"actors": n, "cores": n * cores, "rounds": new["rounds"], "placed": new["placed"],
                     "bitsets_per_s": round(pps_new, 1), "scanning_per_s": round(pps_ref, 1),
                     "bitsets_ms_per_round": round(1e3 * new["seconds"] / new["rounds"], 3),
                     "scanning_ms_per_round": round(1e3 * ref["seconds"] / ref["rounds"], 3),
                     "ratio": round(pps_new / pps_ref, 2) if pps_ref else None,
                     "same_placements": new["placements"] == ref["placements"]})
    return {"benchmark": "placement", "cores_per_actor": cores, "numa_nodes": numa, "load": load, "steps": steps,
            "seed": seed, "repeats": repeats, "burst": burst, "rows": rows}


def fmt(out: dict[str, Any]) -> str:
    title = (f"broker action placement (tangram, {out['cores_per_actor']} cores x {out['numa_nodes']} NUMA nodes "
             f"per actor, preloaded to {out['load']:.0%}, {out['steps']} rounds of {out['burst']} released + submitted, "
             f"best of {out['repeats']})")
    header = (f"{'actors':>6} {'cores':>6} {'placed':>6} {'bitsets/s':>10} {'scanning/s':>11} {'ms/round':>15} "
              f"{'ratio':>7}  same placements")
    lines = [title, header]
    for r in out["rows"]:
        lines.append(f"{r['actors']:>6} {r['cores']:>6} {r['placed']:>6} {r['bitsets_per_s']:>10.0f} "
                     f"{r['scanning_per_s']:>11.0f} {r['bitsets_ms_per_round']:>7.2f}/{r['scanning_ms_per_round']:<7.2f}"
                     f" {r['ratio']:>6.1f}x  {r['same_placements']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m libra.bench placement", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--actors", default="2,15,64", help="comma-separated actor counts")
    p.add_argument("--cores", type=int, default=256, help="CPU ids per actor")
    p.add_argument("--numa", type=int, default=2, help="NUMA nodes per actor")
    p.add_argument("--load", type=float, default=0.85, help="fraction of the cores preloaded with running actions")
    p.add_argument("--steps", type=int, default=300, help="submit/release rounds per size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst", type=int, default=1, help="actions ended and submitted before each round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each; the fastest is reported")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = [int(x) for x in args.actors.split(",") if x]
    except ValueError:
        print(f"--actors: expected comma-separated integers, got {args.actors!r}", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or args.cores < 1 or args.numa < 1 or not 0 <= args.load < 1 or args.steps < 1 or args.repeats < 1 or args.burst < 1:
        print("--actors, --cores, --numa and --steps, --repeats, --burst must be positive and --load in [0, 1)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = run(sizes, args.cores, args.numa, args.load, args.steps, args.seed, args.repeats, args.burst)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(out, args.json, fmt)
    return 0 if all(r["same_placements"] for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
