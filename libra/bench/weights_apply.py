"""Benchmark: a weights version reaching a rollout engine in place vs the previous path, same run, same model.

What it runs (one process; a data-plane server on TCP loopback; the same HF rollout engine for both paths,
alternating, ``--repeat`` times each):

- *before* (the previous path): the trainer's copies untied (every ``state_dict()`` name its own copy, so a
  tied embedding is shipped twice), ``fetch_state_dict`` decoding the stream into fresh tensors, then
  ``HFRolloutEngine.load_weights`` copying every name into the model;
- *in place* (the current path): copies tied again (``libra.weights.format.tie_like``: shipped once), the
  data-plane fetcher returning :class:`~libra.weights.packed.PackedWeights` (chunks verified, not decoded),
  and ``load_weights`` decoding straight into the model's tensors, each tied weight once.

Per path it prints the median bytes shipped, publish seconds (the trainer's pack; the same packer for both),
fetch seconds (the transfer), apply seconds (decode + copy into the model, i.e. fetch-and-load minus the
transfer) and their ratios. It checks that both paths leave the model with the published weights exactly.

``python -m libra.bench weights_apply [--model smollm2|tiny] [--repeat 5] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["main", "run"]


def _model_dir(name: str) -> Any:
    if name == "tiny":
        from libra.engines.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    from libra.engines.smollm2 import ensure_smollm2

    return ensure_smollm2()


def _one(server: Any, engine: Any, source: dict[str, torch.Tensor], version: int, in_place: bool) -> dict[str, float]:
    from libra.dataplane import ObjectRef, fetch_state_dict
    from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher
    from libra.weights.format import tie_like

    copies = {k: v.detach().clone() for k, v in source.items()}  # what the trainer's state_dict_for_sync copies
    if in_place:
        copies = tie_like(source, copies)
    t0 = time.perf_counter()
    ref = DataPlaneWeightPublisher(server).publish(version, copies)
    t1 = time.perf_counter()
    if in_place:
        sd, _, stats = DataPlaneWeightFetcher().fetch(ref)
    else:
        sd, _, stats = fetch_state_dict(ObjectRef.from_wire(ref))
    engine.load_weights(version, sd)
    t2 = time.perf_counter()
    own = engine.model.state_dict()
    if not all(torch.equal(own[k], v) for k, v in copies.items()):
        raise AssertionError(f"{'in place' if in_place else 'before'}: the model does not hold version {version}")
    return {"bytes": float(stats.nbytes), "publish_s": t1 - t0, "fetch_s": stats.seconds,
            "apply_s": (t2 - t1) - stats.seconds}


def run(model: str = "smollm2", repeat: int = 5) -> dict[str, Any]:
    from libra.dataplane import DataPlaneServer
    from libra.engines.hf_rollout import HFRolloutEngine

    path = _model_dir(model)
    engine = HFRolloutEngine(path)
    trainer_side = HFRolloutEngine(path).model  # stands in for the trainer's model: same names, ties
    rows: dict[str, list[dict[str, float]]] = {"before": [], "in_place": []}
    with DataPlaneServer() as server, torch.no_grad():
        for i in range(repeat):
            for in_place in (False, True):
                for p in trainer_side.parameters():  # a new version: every tensor changes, as under AdamW
                    p.add_(1e-4)
                key = "in_place" if in_place else "before"
                rows[key].append(_one(server, engine, trainer_side.state_dict(), 2 * i + in_place + 1, in_place))
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}
    b, n = med["before"], med["in_place"]
    return {"model": model, "repeat": repeat, "before": b, "in_place": n,
            "bytes_ratio": n["bytes"] / b["bytes"], "apply_ratio": n["apply_s"] / b["apply_s"],
            "fetch_apply_ratio": (n["fetch_s"] + n["apply_s"]) / (b["fetch_s"] + b["apply_s"])}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.bench weights_apply", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--repeat", type=int, default=5, help="versions per path, alternating (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    out = run(args.model, args.repeat)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"weights version -> rollout engine ({out['model']}, median of {out['repeat']} each)")
    print(f"{'path':>9} {'MB':>8} {'publish s':>10} {'fetch s':>8} {'apply s':>8}")
    for key in ("before", "in_place"):
        r = out[key]
        print(f"{key:>9} {r['bytes'] / 1e6:8.1f} {r['publish_s']:10.3f} {r['fetch_s']:8.3f} {r['apply_s']:8.3f}")
    print(f"in place / before: bytes {out['bytes_ratio']:.3f}x, apply {out['apply_ratio']:.3f}x, "
          f"fetch + apply {out['fetch_apply_ratio']:.3f}x")
    return 0
