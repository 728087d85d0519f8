"""``python -m libra.bench ehp_join``: what a hybrid replica's join costs the core trainer ranks.

Two core ranks train a small MLP (``--width``, 4 layers, AdamW) for ``--steps`` data-parallel steps over
the elastic group of ``libra.engines.elastic_dp`` (gloo). Two runs in one invocation:

- **baseline**: the two core ranks alone, one group generation throughout;
- **join**: a third process joins at step ``--join-at`` the way the broker's Elastic Hybrid Pool joins a
  hybrid actor: rank 0 publishes its state (weights and AdamW moments) on its data plane before the step,
  the joiner fetches it (``fetch_state_dict``), loads it (``elastic_dp.restore``) and the group re-forms
  at a new generation; the joiner contributes a zero gradient in that step and real gradients after it.

Printed: core rank 0's seconds per step in both runs, the join step's time over the baseline's same step
(the ratio), the joiner's fetch and load seconds and bytes, and whether every member ended with the
same weights. The core waits at the join step for the joiner's fetch and the group's re-formation.
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


def _member(who: str, members_at: list[list[str]], width: int, port: int, refs: Any, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from libra.dataplane import DataPlaneServer, ObjectRef, fetch_state_dict
    from libra.engines.elastic_dp import ElasticGroup, GroupSpec, restore, snapshot

    torch.set_num_threads(1)
    model, opt = _model(width)
    group = ElasticGroup(timeout_s=120)
    server = DataPlaneServer() if who == "core0" else None
    gen, last, times, join = 0, None, [], {}
    for step, members in enumerate(members_at, start=1):
        if members != last:  # the broker's generation: counted over every step, member or not
            gen, last = gen + 1, members
        if who not in members:
            continue
        t0 = time.perf_counter()
        joining = group.current is None and who == "hybrid"
        if who == "core0" and "hybrid" in members and step == next(
                i for i, m in enumerate(members_at, start=1) if "hybrid" in m):
            ref = server.publish_state_dict(f"ehp/state/s{step}", snapshot(model, opt), version=step - 1)
            refs.put(ref.to_wire())
        if joining:
            ref = ObjectRef.from_wire(refs.get(timeout=120))
            f0 = time.perf_counter()
            sd, _, stats = fetch_state_dict(ref)
            f1 = time.perf_counter()
            restore(model, opt, sd)
            join = {"fetch_s": f1 - f0, "load_s": time.perf_counter() - f1, "bytes": stats.nbytes}
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
        opt.step()
        times.append((step, time.perf_counter() - t0))
    group.close()
    if server is not None:
        server.close()
    out.put((who, times, join, _digest(model)))


def _run(members_at: list[list[str]], width: int) -> dict[str, Any]:
    from libra.local import free_port

    ctx = mp.get_context("spawn")
    refs, out = ctx.Queue(), ctx.Queue()
    port = free_port()
    names = sorted({w for m in members_at for w in m})
    procs = [ctx.Process(target=_member, args=(w, members_at, width, port, refs, out)) for w in names]
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
    core = ["core0", "core1"]
    base = _run([core] * args.steps, args.width)
    plan = [core if s < args.join_at else core + ["hybrid"] for s in range(1, args.steps + 1)]
    join = _run(plan, args.width)
    k = args.join_at
    b, j = base["core0"]["times"], join["core0"]["times"]
    steady = statistics.median(b[s] for s in b if s > 1)
    print(f"ehp_join: width {args.width}, {4 * args.width * args.width / 1e6:.1f} M parameters, "
          f"{args.steps} steps, the hybrid joins at step {k}")
    print("step  baseline_s  join_run_s")
    for s in sorted(b):
        print(f"{s:4d}  {b[s]:10.4f}  {j[s]:10.4f}{'   <- join' if s == k else ''}")
    jj = join["hybrid"]["join"]
    print(f"joiner: fetched {jj['bytes'] / 1e6:.1f} MB of weights and AdamW state in {jj['fetch_s']:.4f} s, "
          f"loaded in {jj['load_s']:.4f} s")
    print(f"core rank 0 at the join step: {j[k]:.4f} s vs {b[k]:.4f} s in the baseline's step {k} "
          f"(ratio {j[k] / b[k]:.2f}); baseline median step {steady:.4f} s")
    same = len({join[w]["digest"] for w in core}) == 1
    print(f"core ranks identical at the end: {same}; joined run's members identical: "
          f"{len({v['digest'] for v in join.values()}) == 1}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
