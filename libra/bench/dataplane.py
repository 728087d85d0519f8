"""Benchmark: the data plane vs the run-directory file path for weights, and layout-aware dispatch vs the
naive splits.

What it runs (one process, same inputs for both sides):

1. **Weights transfer.** For each size (default 0.5, 16 and 128 MiB of float32 tensors, 0.5 MiB being
   about the tiny example model) the full publish-to-usable path, best of ``--repeat``:
   - *data plane*: ``DataPlaneServer.publish_state_dict`` (serialise, CRC) on a server thread, then
     ``fetch_state_dict`` over TCP loopback (credit-based chunk requests, CRC check, rebuild tensors);
   - *file* (the previous design): ``write_weights_file`` (serialise, CRC, write, atomic rename) then
     ``read_weights_file`` (read, CRC check, rebuild), in ``--dir`` (default: the system temp dir;
     the read is served from the page cache, so this is the file path's best case).
   - *torch.distributed* (``LIBRA_WEIGHTS_TRANSPORT=torch``): ``TorchWeightPublisher.publish`` (snapshot into
     per-dtype flat buffers, manifest into the rendezvous store) then ``TorchWeightFetcher.fetch`` (ticket,
     a two-member gloo group formed for the fetch, broadcast, rebuild) in another thread of this process.
   It prints the times, ``file / data plane`` and ``torch / data plane``.
2. **Dispatch.** Synthetic batches of trajectory token lengths (``lognormal``: agentic multi-turn,
   median 2K, sigma 1, cap 32K; ``bimodal``: 80% short, 20% long; ``uniform``: 1-2K) over 2, 4 and 8
   ranks, ``--seeds`` batches each: the mean per-rank token imbalance (max/mean) of ``lpt`` vs
   ``round_robin`` and ``contiguous``, the mean cut of the slowest rank's tokens vs round robin, and
   the planning time.

``python -m libra.bench dataplane [--sizes-mib 0.5,16,128] [--repeat 3] [--seeds 20] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of this benchmark."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench dataplane", description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="0.5,16,128", help="state-dict sizes in MiB (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="best-of repeats per timing (default: %(default)s)")
    p.add_argument("--dir", default=None, help="directory for the file baseline (default: system temp dir)")
    p.add_argument("--batch", type=int, default=256, help="trajectories per dispatch batch (default: %(default)s)")
    p.add_argument("--ranks", default="2,4,8", help="data-parallel world sizes (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=20, help="random batches per case (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _state_dict(mib: float) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    total = max(1, int(mib * 1024 * 1024 / 4))
    sizes = [total // 2, total // 4, total - total // 2 - total // 4]  # a few tensors of mixed size
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_weights(sizes_mib: list[float], repeat: int, directory: str | None) -> list[dict[str, Any]]:
    """Publish-to-usable seconds of the data plane and of the file path for each size (best of ``repeat``)."""
    from libra.weights.file import read_weights_file, write_weights_file
    from libra.dataplane import DataPlaneServer, fetch_state_dict
    from libra.weights.torch_dist import TorchWeightFetcher, TorchWeightPublisher

    out = []
    torch_pub, torch_fetcher = TorchWeightPublisher(keep=1, backend="gloo"), TorchWeightFetcher()
    with DataPlaneServer() as server, tempfile.TemporaryDirectory(dir=directory) as tmp:
        for mib in sizes_mib:
            sd = _state_dict(mib)
            nbytes = sum(t.numel() * t.element_size() for t in sd.values())
            version = [0]

            def via_dataplane() -> None:
                version[0] += 1
                ref = server.publish_state_dict(f"weights/v{version[0]}", sd, version=version[0], topic="weights",
                                                keep=1)
                got, _, _ = fetch_state_dict(ref)
                assert got.keys() == sd.keys()

            def via_file() -> None:
                version[0] += 1
                path = write_weights_file(Path(tmp) / f"v{version[0]}.libra", sd, version[0])
                got, _ = read_weights_file(path)
                assert got.keys() == sd.keys()
                path.unlink()

            def via_torch() -> None:
                version[0] += 1
                got, _, _ = torch_fetcher.fetch(torch_pub.publish(version[0], sd))
                assert got.keys() == sd.keys()

            dp = _best(via_dataplane, repeat)
            fl = _best(via_file, repeat)
            td = _best(via_torch, repeat)
            out.append({"mib": nbytes / 2**20, "dataplane_s": dp, "file_s": fl, "torch_s": td,
                        "file_over_dataplane": fl / dp, "torch_over_dataplane": td / dp,
                        "dataplane_mib_s": nbytes / 2**20 / dp})
    torch_pub.close()
    return out


def _lengths(kind: str, n: int, rng: np.random.Generator) -> list[int]:
    if kind == "lognormal":
        x = np.minimum(rng.lognormal(np.log(2000), 1.0, n), 32768)
    elif kind == "bimodal":
        long = rng.random(n) < 0.2
        x = np.where(long, rng.uniform(4000, 16000, n), rng.uniform(300, 800, n))
    elif kind == "uniform":
        x = rng.uniform(1000, 2000, n)
    else:  # pragma: no cover - the caller passes known kinds
        raise ValueError(kind)
    return [max(1, int(v)) for v in x]


def bench_dispatch(batch: int, ranks: list[int], seeds: int) -> list[dict[str, Any]]:
    """Mean imbalance of each strategy per (distribution, world size) over ``seeds`` random batches."""
    from libra.policies.parallelism.dispatch import plan_dispatch

    out = []
    for kind in ("lognormal", "bimodal", "uniform"):
        for ws in ranks:
            imb: dict[str, list[float]] = {"lpt": [], "round_robin": [], "contiguous": []}
            cut, plan_s = [], []
            for seed in range(seeds):
                ls = _lengths(kind, batch, np.random.default_rng(seed))
                plans = {}
                for strategy in imb:
                    t0 = time.perf_counter()
                    plans[strategy] = plan_dispatch(ls, ws, micro_batch_tokens=16384, strategy=strategy)
                    if strategy == "lpt":
                        plan_s.append(time.perf_counter() - t0)
                    imb[strategy].append(plans[strategy].imbalance)
                cut.append(1 - plans["lpt"].max_tokens / plans["round_robin"].max_tokens)
            out.append({"lengths": kind, "batch": batch, "ranks": ws,
                        **{f"imbalance_{k}": statistics.fmean(v) for k, v in imb.items()},
                        "max_rank_tokens_cut_vs_round_robin": statistics.fmean(cut),
                        "plan_ms_median": 1000 * statistics.median(plan_s)})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [float(x) for x in args.sizes_mib.split(",") if x]
    ranks = [int(x) for x in args.ranks.split(",") if x]
    return {"weights": bench_weights(sizes, args.repeat, args.dir),
            "dispatch": bench_dispatch(args.batch, ranks, args.seeds)}


def _print_table(res: dict[str, Any]) -> None:
    print("weights: publish -> usable state dict (best of repeats)")
    print(f"{'MiB':>8} {'data plane s':>13} {'file s':>9} {'torch s':>9} {'file/dp':>8} {'torch/dp':>9} {'dp MiB/s':>9}")
    for r in res["weights"]:
        print(f"{r['mib']:8.1f} {r['dataplane_s']:13.4f} {r['file_s']:9.4f} {r['torch_s']:9.4f} "
              f"{r['file_over_dataplane']:8.2f} {r['torch_over_dataplane']:9.2f} {r['dataplane_mib_s']:9.0f}")
    print("\ndispatch: per-rank token imbalance (max/mean), mean over batches")
    print(f"{'lengths':>10} {'ranks':>5} {'lpt':>7} {'rr':>7} {'contig':>7} {'max cut vs rr':>14} {'plan ms':>8}")
    for r in res["dispatch"]:
        print(f"{r['lengths']:>10} {r['ranks']:5d} {r['imbalance_lpt']:7.3f} {r['imbalance_round_robin']:7.3f} "
              f"{r['imbalance_contiguous']:7.3f} {100 * r['max_rank_tokens_cut_vs_round_robin']:13.1f}% "
              f"{r['plan_ms_median']:8.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run, print a table (or one JSON object with ``--json``)."""
    args = build_parser().parse_args(argv)
    from libra.logging import configure

    configure("warning")  # keep the data plane's info lines out of the table / JSON
    result = run(args)
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
