"""``python -m libra.bench ehp_join``: what a hybrid replica's join costs the core trainer ranks.

Two core ranks train a small MLP (``--width``, 4 layers, AdamW) for ``--steps`` data-parallel steps over
the elastic group of ``libra.engines.elastic_dp`` (gloo). Three runs in one invocation:

- **baseline**: the two core ranks alone, one group generation throughout;
- **blocking join**: a third process joins at step ``k = --join-at`` the way the broker's Elastic Hybrid
  Pool joins a hybrid actor today: rank 0 publishes its state (weights and AdamW moments) on its data
  plane before step ``k``, the joiner fetches it (``fetch_state_dict``), loads it (``elastic_dp.restore``)
  and the group re-forms at a new generation; the core waits at step ``k`` for all of it;
- **overlapped join**: rank 0 publishes its state before step ``k-1`` and the joiner fetches and loads it
  while the core trains step ``k-1``; after that step rank 0 publishes the step's applied gradient
  (``elastic_dp.grad_delta``). At step ``k`` the joiner joins the group first, contributes its zero
  gradient to the all-reduce at once, and only then fetches the delta and replays step ``k-1``
  (``elastic_dp.replay``) before applying step ``k``'s update: the core waits only for the group's
  re-formation.

In both joins the joiner contributes a zero gradient at step ``k`` and real gradients after it. Printed:
core rank 0's seconds per step in every run, the ratio of steps ``k-1`` and ``k`` to the baseline's same
steps, the joiner's fetch and load seconds and bytes, and whether every member ended with the same
weights (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import time
from typing import Any

__all__ = ["main"]


def _model(width: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _member(who: str, members_at: list[list[str]], width: int, port: int, refs: Any, out: Any,
            overlap: bool) -> None:
    import torch
    import torch.distributed as dist

    from libra.dataplane import DataPlaneServer, ObjectRef, fetch_state_dict
    from libra.engines.elastic_dp import ElasticGroup, GroupSpec, grad_delta, replay, restore, snapshot

    torch.set_num_threads(1)
    model, opt = _model(width)
    group = ElasticGroup(timeout_s=120)
    server = DataPlaneServer() if who == "core0" else None
    gen, last, times, join = 0, None, [], {}
    k = next(i for i, m in enumerate(members_at, start=1) if "hybrid" in m) if "hybrid" in members_at[-1] else 0

    def fetch(what: str) -> dict[str, Any]:
        ref = ObjectRef.from_wire(refs.get(timeout=120))
        f0 = time.perf_counter()
        sd, _, stats = fetch_state_dict(ref)
        f1 = time.perf_counter()
        (restore(model, opt, sd) if what == "state" else replay(model, opt, sd))
        return {f"{what}_fetch_s": f1 - f0, f"{what}_load_s": time.perf_counter() - f1, f"{what}_bytes": stats.nbytes}

    for step, members in enumerate(members_at, start=1):
        if members != last:  # the broker's generation: counted over every step, member or not
            gen, last = gen + 1, members
        if who == "hybrid" and overlap and step == k - 1:  # while the core trains step k-1
            join.update(fetch("state"))
        if who not in members:
            continue
        t0 = time.perf_counter()
        joining = who == "hybrid" and step == k
        if who == "core0" and step == (k - 1 if overlap else k):
            ref = server.publish_state_dict(f"ehp/state/s{step}", snapshot(model, opt), version=step - 1)
            refs.put(ref.to_wire())
            join["publish_state_s"] = time.perf_counter() - t0
        if joining and not overlap:
            join.update(fetch("state"))
        group.ensure(GroupSpec(gen, members.index(who), len(members), "127.0.0.1", port))
        opt.zero_grad(set_to_none=False)
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not joining:
            g = torch.Generator().manual_seed(step * 7 + members.index(who))
            x = torch.randn(64, width, generator=g)
            model(x).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        if joining and overlap:  # contributed; now catch up with step k-1, then apply step k
            reduced = [p.grad.clone() for p in model.parameters()]
            join.update(fetch("delta"))
            for p, r in zip(model.parameters(), reduced):
                p.grad = r
        opt.step()
        if who == "core0" and overlap and step == k - 1:  # the step the joiner missed: its applied gradient
            p0 = time.perf_counter()
            ref = server.publish_state_dict(f"ehp/delta/s{step}", grad_delta(model), version=step)
            refs.put(ref.to_wire())
            join["publish_delta_s"] = time.perf_counter() - p0
        times.append((step, time.perf_counter() - t0))
    group.close()
    if server is not None:
        server.close()
    out.put((who, times, join, _digest(model)))


def _run(members_at: list[list[str]], width: int, overlap: bool = False) -> dict[str, Any]:
    from libra.local import free_port

    ctx = mp.get_context("spawn")
    refs, out = ctx.Queue(), ctx.Queue()
    port = free_port()
    names = sorted({w for m in members_at for w in m})
    procs = [ctx.Process(target=_member, args=(w, members_at, width, port, refs, out, overlap)) for w in names]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            who, times, join, digest = out.get(timeout=600)
            got[who] = {"times": dict(times), "join": join, "digest": digest}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m libra.bench ehp_join", description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024, help="MLP width (4 layers: 4*width^2 parameters)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--join-at", type=int, default=4)
    args = ap.parse_args(argv)
    if not 2 <= args.join_at < args.steps:
        ap.error("--join-at must be in [2, steps)")
    core, k = ["core0", "core1"], args.join_at
    base = _run([core] * args.steps, args.width)
    plan = [core if s < k else core + ["hybrid"] for s in range(1, args.steps + 1)]
    runs = {"blocking": _run(plan, args.width), "overlapped": _run(plan, args.width, overlap=True)}
    b = base["core0"]["times"]
    t = {name: r["core0"]["times"] for name, r in runs.items()}
    steady = statistics.median(b[s] for s in b if s > 1)
    print(f"ehp_join: width {args.width}, {4 * args.width * args.width / 1e6:.1f} M parameters, "
          f"{args.steps} steps, the hybrid joins at step {k}; core rank 0's seconds per step")
    print("step  baseline_s  blocking_s  overlapped_s")
    for s in sorted(b):
        mark = "   <- join" if s == k else "   <- overlapped fetch" if s == k - 1 else ""
        print(f"{s:4d}  {b[s]:10.4f}  {t['blocking'][s]:10.4f}  {t['overlapped'][s]:12.4f}{mark}")
    jb, jo = runs["blocking"]["hybrid"]["join"], runs["overlapped"]["hybrid"]["join"]
    print(f"joiner (blocking): fetched {jb['state_bytes'] / 1e6:.1f} MB of weights and AdamW state in "
          f"{jb['state_fetch_s']:.4f} s, loaded in {jb['state_load_s']:.4f} s, on the core's path")
    print(f"joiner (overlapped): fetched {jo['state_bytes'] / 1e6:.1f} MB in {jo['state_fetch_s']:.4f} s and "
          f"loaded in {jo['state_load_s']:.4f} s during step {k - 1}; at step {k} fetched the "
          f"{jo['delta_bytes'] / 1e6:.1f} MB gradient delta in {jo['delta_fetch_s']:.4f} s and replayed it in "
          f"{jo['delta_load_s']:.4f} s after its all-reduce")
    cb, co = runs["blocking"]["core0"]["join"], runs["overlapped"]["core0"]["join"]
    print(f"core rank 0's own publishing: blocking {cb['publish_state_s']:.4f} s (state); overlapped "
          f"{co['publish_state_s']:.4f} s (state) + {co['publish_delta_s']:.4f} s (delta), inside its step "
          f"times above (the joiner runs on the same CPU cores as the core ranks here)")
    for name in runs:
        print(f"{name}: join step {k} {t[name][k]:.4f} s vs baseline {b[k]:.4f} s (ratio {t[name][k] / b[k]:.2f}); "
              f"step {k - 1} {t[name][k - 1]:.4f} s vs {b[k - 1]:.4f} s (ratio {t[name][k - 1] / b[k - 1]:.2f}); "
              f"baseline median step {steady:.4f} s")
    same = {name: len({v["digest"] for v in r.values()}) == 1 for name, r in runs.items()}
    print(f"every member identical at the end: {same}")
    return 0 if all(same.values()) else 1

if __name__ == "__main__":
    raise SystemExit(main())
