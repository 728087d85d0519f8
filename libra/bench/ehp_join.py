"""``python -m libra.bench ehp_join``: what a hybrid replica's join costs the core trainer ranks.

Two core ranks train a small MLP (``--width``, 4 layers, AdamW) for ``--steps`` data-parallel steps over
the elastic group of ``libra.engines.elastic_dp`` (gloo). Three runs in one invocation:

- **baseline**: the two core ranks alone, one group generation throughout;
- **blocking join**: a third process joins at step ``k = --join-at`` the way the broker's Elastic Hybrid
  Pool joins a hybrid actor today: rank 0 publishes its state (weights and AdamW moments) on its data
  plane before step ``k``, the joiner fetches it (``fetch_state_dict``), loads it (``elastic_dp.restore``)
  and the group re-forms at a new generation; the core waits at step ``k`` for all of it;
- **joins first**: rank 0 publishes its state before step ``k`` as above, but the joiner forms the group
  and contributes its zero gradient to the all-reduce at once (it needs no weights for that), while a thread
  of its own fetches the state; it waits for that fetch and loads the state only before its optimizer applies
  the reduced gradient; rank 0 copies its state on its path but packs and publishes the copy on a thread.
  The core waits for the group's re-formation; the transfer overlaps the core's step ``k``;
- **overlapped** (what the broker runs, ``libra.actors.elastic_train``): joins first, and every member forms
  the step's group on a thread of its own while it runs its forward and backward passes (the trainer's
  collectives all come after the passes), so the core waits for the formation only where it outlasts the
  core's own passes.

In every join the joiner contributes a zero gradient at step ``k`` and real gradients after it. Printed:
core rank 0's seconds per step in every run, the ratio of steps ``k`` and ``k+1`` to the baseline's same
steps (a late joiner would hold up the core at ``k+1``'s all-reduce), the joiner's fetch and load seconds and bytes, and whether every member ended with the same
weights (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import threading
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


def _publish_state(server: Any, refs: Any, state: Any, step: int, first: bool) -> None:
    """Core rank 0 publishes its ``state`` (weights and AdamW moments, already copied) for the joiner of
    ``step`` and puts its reference on ``refs``: on a thread when the joiner ``first`` joins the group (the
    runtime's order), else on the step's path."""

    def publish() -> None:
        refs.put(server.publish_state_dict(f"ehp/state/s{step}", state, version=step - 1).to_wire())

    if first:
        threading.Thread(target=publish).start()
    else:
        publish()


def _local_gradient(model: Any, opt: Any, seed: int | None, rows: int, width: int) -> None:
    """This member's gradient of one step in ``.grad``: zeros, plus (``seed`` not None) one forward and
    backward pass over ``rows`` random inputs drawn from ``seed``; a joiner's first step (``None``) keeps
    the zeros."""
    import torch

    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if seed is not None:
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).mean().backward()


def _member(who: str, members_at: list[list[str]], width: int, port: int, refs: Any, out: Any,
            mode: str, rows: int) -> None:
    import torch
    import torch.distributed as dist

    from libra.dataplane import DataPlaneServer, ObjectRef, fetch_state_dict
    from libra.engines.elastic_dp import ElasticGroup, GroupSpec, restore, snapshot

    torch.set_num_threads(1)
    model, opt = _model(width)
    group = ElasticGroup(timeout_s=120)
    server = DataPlaneServer() if who == "core0" else None
    gen, last, times, join = 0, None, [], {}
    k = next(i for i, m in enumerate(members_at, start=1) if "hybrid" in m) if "hybrid" in members_at[-1] else 0
    first = mode != "blocking"

    def fetch() -> None:
        ref = ObjectRef.from_wire(refs.get(timeout=120))
        f0 = time.perf_counter()
        sd, _, stats = fetch_state_dict(ref)
        join.update(state=sd, state_fetch_s=time.perf_counter() - f0, state_bytes=stats.nbytes)

    def load() -> None:
        l0 = time.perf_counter()
        restore(model, opt, join.pop("state"))
        join["state_load_s"] = time.perf_counter() - l0

    for step, members in enumerate(members_at, start=1):
        if members != last:  # the broker's generation: counted over every step, member or not
            gen, last = gen + 1, members
        if who not in members:
            continue
        t0 = time.perf_counter()
        joining = who == "hybrid" and step == k
        if who == "core0" and step == k:
            _publish_state(server, refs, snapshot(model, opt), step, first)
            join["publish_state_s"] = time.perf_counter() - t0
        if joining and not first:
            fetch()
            load()
        fetching = threading.Thread(target=fetch) if joining and first else None
        if fetching is not None:  # overlaps the group's formation and the core's step
            fetching.start()
        spec = GroupSpec(gen, members.index(who), len(members), "127.0.0.1", port)
        forming = threading.Thread(target=group.ensure, args=(spec,)) if mode == "overlapped" else None
        s0 = time.perf_counter()
        if forming is not None:  # beside the passes below; waited for before the all-reduce
            forming.start()
        else:
            group.ensure(spec)
        sync = time.perf_counter() - s0
        _local_gradient(model, opt, None if joining else step * 7 + members.index(who), rows, width)
        s0 = time.perf_counter()
        if forming is not None:
            forming.join()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        join.setdefault("sync_s", {})[step] = sync + time.perf_counter() - s0  # waiting for the group, mostly
        if fetching is not None:  # its zeros are in: now load the core's state, then apply the reduced gradient
            w0 = time.perf_counter()
            fetching.join()
            join["state_wait_s"] = time.perf_counter() - w0
            load()
        opt.step()
        times.append((step, time.perf_counter() - t0))
    group.close()
    if server is not None:
        server.close()
    out.put((who, times, join, _digest(model)))


def _run(members_at: list[list[str]], width: int, mode: str = "blocking", rows: int = 64) -> dict[str, Any]:
    from libra.local import free_port

    ctx = mp.get_context("spawn")
    refs, out = ctx.Queue(), ctx.Queue()
    port = free_port()
    names = sorted({w for m in members_at for w in m})
    procs = [ctx.Process(target=_member, args=(w, members_at, width, port, refs, out, mode, rows)) for w in names]
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
    ap.add_argument("--rows", type=int, default=64,
                    help="input rows per member and step: the forward and backward passes' length (an LLM step's "
                         "passes take seconds; the all-reduce of the gradient is the same whatever this is)")
    args = ap.parse_args(argv)
    if not 2 <= args.join_at < args.steps:
        ap.error("--join-at must be in [2, steps)")
    core, k = ["core0", "core1"], args.join_at
    base = _run([core] * args.steps, args.width, rows=args.rows)
    plan = [core if s < k else core + ["hybrid"] for s in range(1, args.steps + 1)]
    runs = {mode: _run(plan, args.width, mode, args.rows) for mode in ("blocking", "joins_first", "overlapped")}
    b = base["core0"]["times"]
    t = {name: r["core0"]["times"] for name, r in runs.items()}
    steady = statistics.median(b[s] for s in b if s > 1)
    print(f"ehp_join: width {args.width}, {4 * args.width * args.width / 1e6:.1f} M parameters, {args.rows} rows, "
          f"{args.steps} steps, the hybrid joins at step {k}; core rank 0's seconds per step")
    print("step  baseline_s  blocking_s  joins_first_s  overlapped_s")
    for s in sorted(b):
        mark = "   <- join" if s == k else "   <- the joiner's first real step" if s == k + 1 else ""
        print(f"{s:4d}  {b[s]:10.4f}  {t['blocking'][s]:10.4f}  {t['joins_first'][s]:13.4f}  "
              f"{t['overlapped'][s]:12.4f}{mark}")
    for name in runs:
        j, c = runs[name]["hybrid"]["join"], runs[name]["core0"]["join"]
        where = "before joining the group: on the core's path" if name == "blocking" else \
            "on a thread while it joined the group and all-reduced its zeros"
        wait = f" (waited {j['state_wait_s']:.4f} s for it after the all-reduce)" if "state_wait_s" in j else ""
        print(f"{name}: the joiner fetched {j['state_bytes'] / 1e6:.1f} MB of weights and AdamW state in "
              f"{j['state_fetch_s']:.4f} s{wait} and loaded it in {j['state_load_s']:.4f} s, {where}; core rank 0 "
              f"spent {c['publish_state_s']:.4f} s of its step {k} on it (copy, and in the blocking run the publish)")
    sb = base["core0"]["join"]["sync_s"]
    print(f"core rank 0's seconds in group formation + all-reduce (where it waits for other members) at step {k}: "
          f"baseline {sb[k]:.4f}, " + ", ".join(f"{n} {r['core0']['join']['sync_s'][k]:.4f}" for n, r in runs.items())
          + f"; at step {k + 1}: baseline {sb[k + 1]:.4f}, "
          + ", ".join(f"{n} {r['core0']['join']['sync_s'][k + 1]:.4f}" for n, r in runs.items()))
    for name in runs:
        print(f"{name}: join step {k} {t[name][k]:.4f} s vs baseline {b[k]:.4f} s (ratio {t[name][k] / b[k]:.2f}); "
              f"step {k + 1} {t[name][k + 1]:.4f} s vs {b[k + 1]:.4f} s (ratio {t[name][k + 1] / b[k + 1]:.2f}); "
              f"baseline median step {steady:.4f} s (the joiner shares this machine's cores with the core ranks)")
    same = {name: len({v["digest"] for v in r.values()}) == 1 for name, r in runs.items()}
    print(f"every member identical at the end: {same}")
    return 0 if all(same.values()) else 1

if __name__ == "__main__":
    raise SystemExit(main())
