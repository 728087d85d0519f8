"""Benchmark: the cost models and the simulator next to the paper's figures, in one run (docs/papers.md §1.2,
§1.7, §5.1). It prints what comes out; nothing here is tuned to make a number match.

1. **Fig. 3, per GPU.** For TP-1/2/4/8 on 8 A800 GPUs serving 512 Qwen3-14B requests (``8 / tp``
   instances): tokens/s per GPU (prompt + generated, Σ tokens / makespan over 8 GPUs,
   :func:`~libra.policies.cost.rollout.bucket_throughput`) for lengths spread over 0–2K and over 16–32K,
   and the steady decode rate per GPU at the bucket's mid context (``RolloutCostModel.tokens_per_s``,
   ``512 · tp / 8`` sequences per instance, clamped by the KV cache). Paper, read per GPU (§1.7): TP-1
   1,852 and TP-8 591 at 0–2K, TP-1 430 and TP-8 1,220 at 16–32K; checks: TP-1 / TP-8 ≈ 3.1 at 0–2K,
   TP-8 / TP-1 ≈ 2.8 at 16–32K.
2. **Fig. 2a, like for like.** The same number of sequences (``--sequences``, default 512: the batch of
   Fig. 3 and of the rollout fit) at 1K and at 32K tokens: rollout seconds on 8 GPUs (best homogeneous
   TP, :func:`~libra.policies.cost.rollout.batch_latency`) and training seconds of one step on 8 GPUs (best
   TP × PP of :class:`~libra.policies.cost.TrainingCostModel`); paper: rollout grows ≈ 95×, training ≈ 3.9×.
3. **Static uniform / colocated** in the simulator (R2E-like trace, ``gpus / 16`` groups of 16 per step,
   router ``least_loaded``), with streaming batches and with the per-step barrier (``SimConfig.batching``);
   paper ≈ 1.7× (423 vs ≈ 247 tok/s, §1.7).
4. **Fig. 2b** and the **oracle sanity** (:mod:`libra.bench.calibration_sim`): rollout vs training time at the
   first and last steps on the static uniform split; every router on every workload on the mixed-TP layout,
   the oracle router expected at least as fast as all others (``--no-oracle`` skips these runs).

``python -m libra.bench calibration [--gpus 48] [--steps 20] [--prompts N] [--seed 0] [--sequences 512]
[--quick] [--json]``; ``--quick``: 16 GPUs, 3 steps, 2 groups per step (for tests).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

from libra.bench.output import emit
from libra.sim.config import default_prompts

__all__ = ["fig2a", "fig3", "main", "run", "sim_ratio"]

PAPER_FIG3 = {"0_2k": {1: 1852.0, 8: 591.0}, "16k_32k": {1: 430.0, 8: 1220.0}}
PAPER_RATIOS = {"tp1_over_tp8_0_2k": 1852.0 / 591.0, "tp8_over_tp1_16k_32k": 1220.0 / 430.0,
                "rollout_32k_over_1k": 95.0, "train_32k_over_1k": 3.9, "static_uniform_over_colocated": 423.0 / 247.0}
BUCKETS = {"0_2k": (0.0, 2048.0), "16k_32k": (16384.0, 32768.0)}
TPS = (1, 2, 4, 8)


def _models(hardware: str = "a800", model: str = "qwen3-14b") -> tuple[Any, Any]:
    from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model

    hw, m = load_hardware(hardware), load_model(model)
    return RolloutCostModel(hw, m), TrainingCostModel(hw, m)


def fig3(cm: Any, n_gpus: int = 8, n_requests: int = 512) -> dict[str, Any]:
    """Per-GPU tokens/s of each TP at each Fig. 3 length bucket (see the module docstring)."""
    from libra.policies.cost.rollout import bucket_throughput

    rows: dict[str, dict[str, dict[str, float]]] = {}
    for name, (lo, hi) in BUCKETS.items():
        rows[name] = {}
        for tp in TPS:
            batch = bucket_throughput(cm, tp, lo, hi, n_gpus=n_gpus, n_requests=n_requests) / n_gpus
            steady = cm.tokens_per_s(tp, (lo + hi) / 2, n_requests * tp / n_gpus) / tp
            rows[name][str(tp)] = {"batch_tok_s_per_gpu": batch, "decode_tok_s_per_gpu": steady}
    b = {k: {tp: v[str(tp)]["batch_tok_s_per_gpu"] for tp in TPS} for k, v in rows.items()}
    return {"rows": rows, "paper_per_gpu": {k: {str(t): x for t, x in v.items()} for k, v in PAPER_FIG3.items()},
            "tp1_over_tp8_0_2k": b["0_2k"][1] / b["0_2k"][8] if b["0_2k"][8] else math.nan,
            "tp8_over_tp1_16k_32k": b["16k_32k"][8] / b["16k_32k"][1] if b["16k_32k"][1] else math.nan,
            "tp1_0_2k_vs_paper": b["0_2k"][1] / PAPER_FIG3["0_2k"][1]}


def step_physics(cm: Any, tp: int, lo: float, hi: float, n_gpus: int = 8, n_requests: int = 512) -> dict[str, float]:
    """The decode step one TP-``tp`` instance runs in a Fig. 3 bucket, split into the roofline's arms: its
    requests (``n_requests * tp / n_gpus``), steady batch, resident KV, HBM time, FLOP time, TP all-reduce
    time, engine CPU time, the step, and the decode steps it makes (``max(gen / batch, longest gen)``)."""
    from libra.policies.cost.rollout import CALIBRATION_PROMPT_FRACTION as PF

    hw, m, cal = cm.hardware, cm.model, cm.cal
    n = n_requests * tp // n_gpus
    mean = (lo + hi) / 2
    ctx, reserve = cm.resident_context(PF * mean, (1 - PF) * mean)
    b = float(cm.batch_for_reserve(tp, n, reserve))
    kv = b * float(ctx)
    mem = (cm.weight_bytes_per_gpu(tp) + kv * cm.kv_bytes_per_token(tp)) / (hw.mem_bw * cal.decode_bw_util)
    flop = float(cm.decode_flops(b, kv)) / (tp * hw.flops_peak * cal.decode_mfu)
    comm = max(0.0, float(cm.decode_step(tp, b, kv)) - max(mem, flop) - cal.per_step_overhead_s
               - b * cal.per_seq_step_overhead_s)
    cpu = cal.per_step_overhead_s + b * cal.per_seq_step_overhead_s
    steps = max(n * (1 - PF) * mean / b, (1 - PF) * hi)
    return {"requests": n, "batch": b, "kv_tokens": kv, "hbm_ms": mem * 1e3, "flop_ms": flop * 1e3,
            "comm_ms": comm * 1e3, "cpu_ms": cpu * 1e3, "step_ms": float(cm.decode_step(tp, b, kv)) * 1e3,
            "steps": steps}


def fig3_why(f3: dict[str, Any], phys: dict[str, dict[str, dict[str, float]]], cm: Any) -> list[str]:
    """Why the model's Fig. 3 ratios are where they are, from the step physics (one line per bucket; a
    ratio outside 1.5x of the paper's says which physical bound keeps it there)."""
    out = []
    for bucket, key, hi_tp, lo_tp, paper in (("0_2k", "tp1_over_tp8_0_2k", 1, 8, PAPER_RATIOS["tp1_over_tp8_0_2k"]),
                                            ("16k_32k", "tp8_over_tp1_16k_32k", 8, 1, PAPER_RATIOS["tp8_over_tp1_16k_32k"])):
        got = f3[key]
        if paper / 1.5 <= got <= paper * 1.5:
            out.append(f"{bucket}: TP-{hi_tp} / TP-{lo_tp} = {got:.2f} is within 1.5x of the paper's {paper:.2f}")
            continue
        a, b = phys[bucket][str(hi_tp)], phys[bucket][str(lo_tp)]
        head = (f"{bucket}: TP-{hi_tp} / TP-{lo_tp} = {got:.2f}, outside 1.5x of the paper's {paper:.2f}. TP-{lo_tp} "
                f"makes {b['steps']:.0f} steps of {b['step_ms']:.1f} ms at batch {b['batch']:.0f}, TP-{hi_tp} "
                f"{a['steps']:.0f} of {a['step_ms']:.1f} ms at batch {a['batch']:.0f}. ")
        if bucket == "0_2k":
            need = b["step_ms"] * paper / got
            body = (f"Both make the same number of steps (the longest request's), so the ratio is TP-8's step over "
                    f"TP-1's. Per GPU, TP-8's step at batch {b['batch']:.0f} carries {b['batch'] / 8:.0f} sequences' "
                    f"FLOPs and 1/8 of the weights against TP-1's {a['batch']:.0f}, and pays {b['comm_ms']:.1f} ms of "
                    f"all-reduce and {b['cpu_ms']:.1f} ms of engine CPU time. The paper's {paper:.2f} needs a TP-8 step "
                    f"of about {need:.0f} ms: {need - b['step_ms']:.0f} ms more than datasheet bandwidth, FLOPs, "
                    f"NVLink and the measured engine overhead give. Not fitted: no sourced constant produces it.")
        else:
            kv = {tp: cm.token_capacity(tp) * cm.kv_bytes_per_token(tp) / 1e9 for tp in (1, 8)}
            body = (f"Both are bound by reading their KV cache every step (HBM arm {a['hbm_ms']:.0f} of "
                    f"{a['step_ms']:.0f} ms, {b['hbm_ms']:.0f} of {b['step_ms']:.0f} ms), so per GPU throughput follows "
                    f"the KV bytes a GPU holds: TP-8 frees the weights' share, {kv[8]:.1f} GB of KV per GPU against "
                    f"TP-1's {kv[1]:.1f} GB ({kv[8] / kv[1]:.2f}x). The paper's {paper:.2f} needs more KV per GPU "
                    f"than an {cm.hardware.mem_bytes / 1e9:.0f} GB GPU holds. Not fitted.")
        out.append(head + body)
    return out


def sim_why(sim: dict[str, Any], paper: float) -> list[str]:
    """One line per batching mode: the static uniform / colocated ratio against the paper's, and what separates
    the two allocations (their mean step times and how far rollout runs ahead of training)."""
    out = []
    for batching in ("streaming", "barrier"):
        r = sim[batching]
        got, u, c = r["static_uniform_over_colocated"], r["static_uniform"], r["colocated"]
        verdict = "within" if paper / 1.5 <= got <= paper * 1.5 else "outside"
        out.append(f"{batching}: static uniform / colocated = {got:.2f}, {verdict} 1.5x of the paper's {paper:.2f}; "
                   f"mean step {u['step_time_s']:.1f} s vs {c['step_time_s']:.1f} s, rollout up to "
                   f"{u['staleness_max']:.0f} step(s) ahead of training on the split (colocated: "
                   f"{c['staleness_max']:.0f}, rollout and training in turn on every GPU)")
    return out


def _best_train(tm: Any, n_gpus: int, lengths: list[int]) -> tuple[float, str]:
    from libra.policies.cost.training import TrainConfig

    best, label = math.inf, "OOM"
    for tp in (8, 4, 2, 1):
        for pp in (1, 2, 4, 5, 8):
            if n_gpus % (tp * pp) or tp > n_gpus:
                continue
            cfg = TrainConfig(tp=tp, pp=pp, dp=n_gpus // (tp * pp), micro_batch=1)
            padded = lengths + [1] * ((-len(lengths)) % cfg.dp)
            t = float(tm.step_time(cfg, padded))
            if t < best:
                best, label = t, f"TP{tp} PP{pp} DP{cfg.dp}"
    return best, label


def fig2a(cm: Any, tm: Any, sequences: int = 512, n_gpus: int = 8) -> dict[str, Any]:
    """Rollout and training seconds for ``sequences`` sequences of 1K and of 32K tokens on ``n_gpus``."""
    from libra.policies.cost.rollout import batch_latency

    out: dict[str, Any] = {"sequences": sequences, "n_gpus": n_gpus}
    for name, length in (("1k", 1024), ("32k", 32768)):
        roll = batch_latency(cm, length, n_gpus=n_gpus, n_requests=sequences)
        train, layout = _best_train(tm, n_gpus, [length] * sequences)
        out[name] = {"rollout_s": roll, "train_s": train, "train_layout": layout}
    out["rollout_32k_over_1k"] = out["32k"]["rollout_s"] / out["1k"]["rollout_s"]
    out["train_32k_over_1k"] = out["32k"]["train_s"] / out["1k"]["train_s"]
    m, why = cm.model, []
    flops = {n: sequences * (6 * m.active_params * L + 6 * m.n_layers * m.q_dim * L * L) for n, L in (("1k", 1024), ("32k", 32768))}
    out["train_flops_32k_over_1k"] = flops["32k"] / flops["1k"]
    r = out["rollout_32k_over_1k"]
    if not 95.0 / 1.5 <= r <= 95.0 * 1.5:
        cap = cm.token_capacity(8)
        why.append(f"rollout {r:.0f}x vs 95x: 32x the tokens per sequence, and at 32K a TP-8 instance's KV cache "
                   f"({cap:.0f} tokens) holds {cap / 32768:.0f} sequences against {min(cm.cal.max_batch, cap / 1024):.0f} "
                   f"at 1K, while each decode step reads ~32x the KV per sequence: tokens x steps grow together; "
                   f"95x needs a 1K baseline dominated by costs that do not grow with length")
    t = out["train_32k_over_1k"]
    if not 3.9 / 1.5 <= t <= 3.9 * 1.5:
        why.append(f"training {t:.1f}x vs 3.9x: the same {sequences} sequences at 32K are 32x the tokens and "
                   f"{out['train_flops_32k_over_1k']:.0f}x the FLOPs (6 N per token plus the attention core); at a fixed MFU "
                   f"no FLOP-based model grows only 3.9x unless fixed per-step costs dominate the 1K step. The paper's "
                   f"3.9x is not reproducible like for like from FLOPs; it is not fitted")
    out["why"] = why
    return out


def sim_ratio(gpus: int, steps: int, prompts: int, seed: int, hardware: str = "a800") -> dict[str, Any]:
    """Static uniform and colocated tokens/s with streaming and with barrier batching, and their ratios."""
    from libra.sim.engine import SimConfig, Simulator
    from libra.sim.workload_profiles import get_profile
    from libra.sim.workloads import generate

    prof = get_profile("r2e")
    trajs = generate("r2e", steps, prompts, 16, seed)
    out: dict[str, Any] = {"gpus": gpus, "steps": steps, "prompts": prompts, "seed": seed}
    for batching in ("streaming", "barrier"):
        row: dict[str, Any] = {}
        for alloc in ("static_uniform", "colocated"):
            cfg = SimConfig(router="least_loaded", allocation=alloc, gpus=gpus, seed=seed, batching=batching, hardware=hardware,
                            bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds,
                            router_params={"cap_metric": "load", "max_queue_length": 3})
            res = Simulator(trajs, cfg).run()
            row[alloc] = {"tokens_per_s": res.tokens_per_s, "step_time_s": res.step_time_s["mean"],
                          "rollout_time_s": res.rollout_time_s, "train_time_s": res.train_time_s,
                          "staleness_max": res.staleness["max"]}
        co = row["colocated"]["tokens_per_s"]
        row["static_uniform_over_colocated"] = row["static_uniform"]["tokens_per_s"] / co if co else math.nan
        out[batching] = row
    return out


def run(gpus: int = 48, steps: int = 20, prompts: int | None = None, seed: int = 0,
        sequences: int = 512, oracle: bool = True, hardware: str = "a800") -> dict[str, Any]:
    from libra.bench.calibration_sim import oracle_sanity, stage_ratio

    cm, tm = _models(hardware)
    prompts = prompts if prompts is not None else default_prompts(gpus)
    f3 = fig3(cm)
    f3["physics"] = {k: {str(tp): step_physics(cm, tp, lo, hi) for tp in TPS} for k, (lo, hi) in BUCKETS.items()}
    f3["why"] = fig3_why(f3, f3["physics"], cm)
    out = {"fig3": f3, "fig2a": fig2a(cm, tm, sequences), "sim": sim_ratio(gpus, steps, prompts, seed, hardware),
           "stages": stage_ratio(gpus, steps, prompts, seed, hardware), "paper": dict(PAPER_RATIOS),
           "hardware": hardware}
    if oracle:
        out["oracle"] = oracle_sanity(gpus, steps, prompts, seed, hardware=hardware)
    return out


def _fmt(out: dict[str, Any]) -> str:
    f3, f2, sim, paper = out["fig3"], out["fig2a"], out["sim"], out["paper"]
    lines = [f"Fig. 3, tokens/s per GPU (8 x {out.get('hardware', 'a800')}, Qwen3-14B, 512 requests; batch = tokens / makespan over 8 GPUs; "
             "decode = steady decode at the mid context)",
             f"{'lengths':<9} {'TP':>3} {'batch/GPU':>10} {'decode/GPU':>11} {'paper A800':>10}"]
    for name, rows in f3["rows"].items():
        for tp, r in rows.items():
            p = f3["paper_per_gpu"][name].get(tp)
            lines.append(f"{name:<9} {tp:>3} {r['batch_tok_s_per_gpu']:>10.1f} {r['decode_tok_s_per_gpu']:>11.1f} "
                         f"{'-' if p is None else format(p, '.0f'):>10}")
    lines += [f"TP-1 / TP-8 at 0-2K: {f3['tp1_over_tp8_0_2k']:.2f} (paper {paper['tp1_over_tp8_0_2k']:.2f}); "
              f"TP-8 / TP-1 at 16-32K: {f3['tp8_over_tp1_16k_32k']:.2f} (paper {paper['tp8_over_tp1_16k_32k']:.2f}); "
              f"TP-1 at 0-2K = {f3['tp1_0_2k_vs_paper']:.3f} x the paper's per-GPU figure",
              "Decode-step physics per instance (roofline: max(HBM, FLOP) + TP all-reduce + engine CPU):",
              f"{'lengths':<9} {'TP':>3} {'reqs':>5} {'batch':>6} {'HBM ms':>7} {'FLOP ms':>8} {'comm ms':>8} "
              f"{'CPU ms':>7} {'step ms':>8} {'steps':>6}"]
    for name, rows in f3.get("physics", {}).items():
        for tp, r in rows.items():
            lines.append(f"{name:<9} {tp:>3} {r['requests']:>5.0f} {r['batch']:>6.0f} {r['hbm_ms']:>7.2f} "
                         f"{r['flop_ms']:>8.2f} {r['comm_ms']:>8.2f} {r['cpu_ms']:>7.2f} {r['step_ms']:>8.2f} "
                         f"{r['steps']:>6.0f}")
    lines += [f"why: {w}" for w in f3.get("why", [])]
    lines += ["",
              f"Fig. 2a, {f2['sequences']} sequences on {f2['n_gpus']} GPUs: 1K vs 32K tokens",
              f"{'':<9} {'1K s':>9} {'32K s':>10} {'32K/1K':>8} {'paper':>6}",
              f"{'rollout':<9} {f2['1k']['rollout_s']:>9.1f} {f2['32k']['rollout_s']:>10.1f} "
              f"{f2['rollout_32k_over_1k']:>8.1f} {paper['rollout_32k_over_1k']:>6.1f}",
              f"{'training':<9} {f2['1k']['train_s']:>9.1f} {f2['32k']['train_s']:>10.1f} "
              f"{f2['train_32k_over_1k']:>8.1f} {paper['train_32k_over_1k']:>6.1f}  "
              f"(layouts {f2['1k']['train_layout']} / {f2['32k']['train_layout']})",
              *[f"why: {w}" for w in f2.get("why", [])], "",
              f"Simulator, R2E-like trace: {sim['gpus']} GPUs, {sim['steps']} steps, {sim['prompts']} groups x 16, "
              f"seed {sim['seed']}, router least_loaded",
              f"{'batching':<10} {'uniform tok/s':>13} {'coloc tok/s':>11} {'ratio':>6} {'paper':>6} "
              f"{'uniform step s':>14} {'staleness max':>13}"]
    for batching in ("streaming", "barrier"):
        r = sim[batching]
        lines.append(f"{batching:<10} {r['static_uniform']['tokens_per_s']:>13.1f} {r['colocated']['tokens_per_s']:>11.1f} "
                     f"{r['static_uniform_over_colocated']:>6.2f} {paper['static_uniform_over_colocated']:>6.2f} "
                     f"{r['static_uniform']['step_time_s']:>14.1f} {r['static_uniform']['staleness_max']:>13.0f}")
    lines += [f"why: {w}" for w in sim_why(sim, paper["static_uniform_over_colocated"])]
    st = out["stages"]
    lines += ["", f"Fig. 2b, static uniform ({st['rollout_gpus']} rollout / {st['train_gpus']} training GPUs): "
              "rollout vs training per step (paper: rollout the faster stage first, the bottleneck after the drift)",
              f"{'step':<6} {'mean tok':>8} {'model roll s':>12} {'model train s':>13} {'roll/train':>10} "
              f"{'sim step s':>10} {'sim train s':>11} {'sim wait':>8}"]
    for name in ("first", "last"):
        r = st[name]
        lines.append(f"{name:<6} {r['mean_tokens']:>8.0f} {r['model_rollout_s']:>12.1f} {r['model_train_s']:>13.1f} "
                     f"{r['model_rollout_over_train']:>10.2f} {r['sim_step_s']:>10.1f} {r['sim_train_s']:>11.1f} "
                     f"{r['sim_wait_fraction']:>8.2f}")
    if "oracle" in out:
        from libra.bench.calibration_sim import format_oracle

        lines += format_oracle(out["oracle"])
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench calibration", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=None, help="simulated GPUs, whole 8-GPU nodes (default 48; --quick 16)")
    p.add_argument("--steps", type=int, default=None, help="simulated RL steps (default 20; --quick 3)")
    p.add_argument("--prompts", type=int, default=None, help="GRPO groups of 16 per step (default gpus/16, 3 at 48 GPUs: ~346K tokens per step, docs/papers.md §1.7; --quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequences", type=int, default=512, help="Fig. 2a: sequences at each length (default 512)")
    p.add_argument("--quick", action="store_true", help="a tiny simulation (16 GPUs, 3 steps) for smoke tests")
    p.add_argument("--hardware", default="a800",
                   help="hardware profile name or TOML path (default a800, the paper's GPU; also h100, h200)")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle-router sanity runs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gpus = args.gpus if args.gpus is not None else (16 if args.quick else 48)
    steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    prompts = args.prompts if args.prompts is not None else (2 if args.quick else None)
    if steps < 1 or gpus < 16 or gpus % 8 or args.sequences < 1:
        print("--steps and --sequences must be >= 1 and --gpus a multiple of 8, at least 16")
        return 2
    t0 = time.perf_counter()
    out = run(gpus, steps, prompts, args.seed, args.sequences, oracle=not args.no_oracle, hardware=args.hardware)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(out, args.json, _fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
