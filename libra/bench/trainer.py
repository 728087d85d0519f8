"""Trainer throughput, FSDP2 vs DDP, in the same run: ``python -m libra.bench trainer``.

What runs: ``--ranks`` trainer processes (torch.multiprocessing spawn; gloo on CPU, NCCL on CUDA, one GPU
per rank) build :class:`~libra.engines.trainer.GRPOTrainer` on a randomly initialised model of
``--shape`` (``libra.engines.shapes``: tiny, qwen2-0.5b, qwen2-1.5b), once with ``parallel = "ddp"`` and
once with ``"fsdp"``, and time ``--steps`` GRPO steps (after one warm-up step) on the same synthetic batch:
``--sequences`` sequences of ``--seq-len`` tokens per rank, the second half of each with loss.

Reported per mode: training tokens per second over all ranks (tokens with loss and without: every token
is forwarded and backpropagated), the step time (slowest rank), and each rank's peak memory (CUDA: peak
allocated; CPU: peak resident set). The ratio is FSDP tokens/s over DDP tokens/s. On one rank FSDP has
nothing to shard, so the ratio measures its overhead; its use is the memory column with several ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from typing import Any

__all__ = ["main", "run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_memory(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _rank(rank: int, world: int, port: int, mode: str, model_dir: str, device: str, dtype: str,
          sequences: int, seq_len: int, steps: int, threads: int, out: str) -> None:
    import torch

    from libra.engines.trainer import DistConfig, GRPOTrainer, TrainBatch

    torch.set_num_threads(threads)
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    dist = DistConfig("127.0.0.1", port, rank, world, timeout_s=600)  # fsdp needs a group, even of one rank
    trainer = GRPOTrainer(model_dir, lr=1e-6, micro_batch_tokens=sequences * seq_len, device=dev,
                          dtype=getattr(torch, dtype), dist_config=dist, parallel=mode, random_init=True)
    vocab = int(trainer.model.config.vocab_size)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, vocab, (sequences, seq_len), generator=g).tolist()
    half = seq_len // 2
    batch = TrainBatch(input_ids=ids, loss_mask=[[0] * half + [1] * (seq_len - half)] * sequences,
                       rollout_logprobs=[[-2.0] * seq_len] * sequences,
                       advantages=[1.0 if k % 2 else -1.0 for k in range(sequences)])
    trainer.train_step(batch)  # warm-up: allocator, kernels, optimizer state
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batch)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"wall_s": wall, "tokens": steps * sequences * seq_len, "peak_bytes": _peak_memory(dev),
                   "parallel": trainer.parallel}, f)
    trainer.close()


def _measure(mode: str, args: argparse.Namespace, model_dir: str, out: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.ranks)
    mp.spawn(_rank, args=(args.ranks, _free_port(), mode, model_dir, args.device, args.dtype, args.sequences,
                          args.seq_len, args.steps, threads, out), nprocs=args.ranks, join=True)
    per = [json.load(open(os.path.join(out, f"{mode}-rank{r}.json"))) for r in range(args.ranks)]
    wall = max(p["wall_s"] for p in per)
    tokens = sum(p["tokens"] for p in per)
    return {"parallel": per[0]["parallel"], "tok_s": tokens / wall, "step_s": wall / args.steps,
            "peak_gib": [round(p["peak_bytes"] / 1024**3, 3) for p in per]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure DDP then FSDP on the same shape and batch; returns the result object ``--json`` prints."""
    from libra.engines.shapes import param_count, write_shape_dir

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="libra-bench-trainer-") as tmp:
        model_dir = str(write_shape_dir(args.shape, os.path.join(tmp, "model")))
        ddp = _measure("ddp", args, model_dir, tmp)
        fsdp = _measure("fsdp", args, model_dir, tmp)
    return {"shape": args.shape, "params": param_count(args.shape), "device": args.device, "dtype": args.dtype,
            "ranks": args.ranks, "sequences_per_rank": args.sequences, "seq_len": args.seq_len, "steps": args.steps,
            "ddp": ddp, "fsdp": fsdp, "ratio_fsdp_over_ddp": fsdp["tok_s"] / ddp["tok_s"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def _fmt(r: dict[str, Any]) -> str:
    lines = [f"trainer: shape {r['shape']} ({r['params'] / 1e6:.1f} M params), {r['device']} {r['dtype']}, "
             f"{r['ranks']} rank(s), {r['sequences_per_rank']} x {r['seq_len']} tokens per rank, {r['steps']} steps",
             f"{'mode':>6} {'tok/s':>10} {'step s':>9}  peak GiB per rank"]
    for mode in ("ddp", "fsdp"):
        m = r[mode]
        lines.append(f"{mode:>6} {m['tok_s']:>10.1f} {m['step_s']:>9.3f}  {m['peak_gib']}")
    lines.append(f"ratio fsdp/ddp tokens/s: {r['ratio_fsdp_over_ddp']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shape", default="tiny", help="tiny, qwen2-0.5b or qwen2-1.5b (libra.engines.shapes)")
    p.add_argument("--ranks", type=int, default=None,
                   help="trainer ranks (default: 2 on CPU; the GPU count, at most 2, on CUDA)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--sequences", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    from libra.engines.shapes import SHAPES

    if args.shape not in SHAPES:
        p.error(f"unknown --shape {args.shape!r} (known: {', '.join(SHAPES)})")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device is visible")
        if args.ranks is None:
            args.ranks = min(2, torch.cuda.device_count())
        if args.ranks > torch.cuda.device_count():
            p.error(f"--ranks {args.ranks}: only {torch.cuda.device_count()} GPU(s) (NCCL needs one per rank)")
    args.ranks = args.ranks or 2
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.ranks < 1 or args.steps < 1 or args.sequences < 1 or args.seq_len < 2:
        p.error("--ranks, --steps and --sequences must be >= 1 and --seq-len >= 2")
    from libra.bench.output import emit

    emit(run(args), args.json, _fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
