"""``python -m libra.bench NAME [args]``: run one benchmark (each compares against a baseline in the
same run and prints the ratio). ``python -m libra.bench --list`` lists them."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "broker": ("libra.bench.broker", "broker round trip and throughput vs raw pyzmq"),
    "planner": ("libra.bench.planner", "GRP planner search time with and without memoisation"),
    "planner_round": ("libra.bench.planner_round", "broker loop stall of a planning round: search on a worker thread vs inline"),
    "planner_accuracy": ("libra.bench.planner_accuracy", "planner rollout predictions vs the simulator: residency vs mean-request model"),
    "sandbox": ("libra.bench.sandbox", "warm sandbox dispatch vs plain subprocess"),
    "actions": ("libra.bench.actions", "actions end to end: sandbox dispatch vs subprocess, decision latency, sim ACT/cores/GPUs"),
    "actions_sched": ("libra.bench.actions_sched", "action scheduling: latency sweep, ACT and cores/GPUs in the simulator"),
    "overload": ("libra.bench.overload", "a 100,000-call burst: completed, Busy, lost (must be 0), peak broker memory"),
    "metrics": ("libra.bench.metrics", "broker Prometheus hook cost vs no metrics"),
    "rollout": ("libra.bench.rollout", "HF rollout engine behind Libra vs called directly (tokens/s)"),
    "engines": ("libra.bench.engines", "HF rollout engine and GRPO trainer vs plain transformers/torch"),
    "trainer": ("libra.bench.trainer", "GRPO trainer ranks: tokens/s and peak memory, FSDP2 vs DDP (--device, --shape)"),
    "routing": ("libra.bench.routing", "rollout routers compared on the same traces"),
    "ablation": ("libra.bench.ablation", "Libra ablation ladder (planner, hetero TP, C-MLFQ, EHP) and the EARL selector, simulated"),
    "weights_apply": ("libra.bench.weights_apply", "a weights version into a rollout engine in place (tied once, decoded into the model) vs the previous path"),
    "weights_delta": ("libra.bench.weights_delta", "delta vs full weights sync between consecutive versions of a real training run (SmolLM2 on CPU, --device cuda): bytes, seconds, unchanged tensors/elements/blocks in fp32 and bf16"),
    "dataplane": ("libra.bench.dataplane", "weights over the data plane vs the file path; dispatch imbalance vs round robin"),
    "router_state": ("libra.bench.router_state", "broker loop stall of a C-MLFQ tree save: frozen snapshot vs built on the loop"),
    "chaos": ("libra.bench.chaos", "broker SIGKILL mid-run: calls lost, executed twice, attempts > 1; re-attachment at 1,000 pending calls vs a broker that never crashed, and the first/last answer of the queued calls after a restart"),
    "cluster_chaos": ("libra.bench.cluster_chaos", "the side-effect chaos run on 8 supervisors x 8 CPU slots: slots, a whole supervisor and the broker SIGKILLed with 1,000 calls in flight; lost, run twice, attempts vs chaos side_effects in the same run"),
    "calibration": ("libra.bench.calibration", "cost models and simulator vs the paper: Fig. 3 per GPU, Fig. 2a 1K vs 32K, static uniform / colocated (streaming vs barrier)"),
    "prefix_cache": ("libra.bench.prefix_cache", "per-turn latency with the KV cache kept on the instance vs re-prefill; broker bytes per turn, deltas vs whole contexts"),
    "ehp_join": ("libra.bench.ehp_join", "what a hybrid replica's join (state over the data plane, group re-formed) costs the core ranks vs no join"),
    "placement": ("libra.bench.placement", "broker action placement at 2/15/64 actors x 256 cores: placements/s, bitset core pools vs the scanning ones"),
    "payloads": ("libra.bench.payloads", "typed work payloads (msgspec) vs hand-built dicts: codec + validation per payload"),
    "vllm_weights": ("libra.bench.vllm_weights", "vLLM weights update in buckets of whole layers vs one call (run with .venv-vllm/bin/python)"),
    "endpoint": ("libra.bench.endpoint", "a turn through the OpenAI-compatible endpoint vs session.generate directly, same cluster and run"),
    "job": ("libra.bench.job", "one RL job under policy static vs the default libra, same seed: time per step, tokens/s, idle share, reward vs wall"),
    "peer_trl": ("libra.bench.peer_trl", "the bundled job's task under TRL's GRPOTrainer vs libra run, same seeds: s/step, step 1, accuracy vs wall (needs the peer extra)"),
    "control_plane": ("libra.bench.control_plane", "one broker holding 100-20,000 synthetic idle actors: broker CPU per actor-second, RSS, heartbeat gaps, wrongly lost, status and echo p50/p99 vs 10 actors"),
    "broker_idle": ("libra.bench.broker_idle", "the broker core's CPU per registration and per idle actor-second at 1,000-10,000 actors vs 100, in process"),
    "role_lookup": ("libra.bench.role_lookup", "what key roles cost the broker per CURVE message: frames read with the sender's key and its role looked up vs as bytes, one run"),
    "failover": ("libra.bench.failover", "primary broker SIGKILLed with 1,000 calls pending, a standby takes over: lost, run twice, last answer vs no failure; echo p50 with a standby attached vs without"),
    "lending": ("libra.bench.lending", "a serving owner's p99 time per token with and without a lent rollout slot on its headroom (headroom rule vs never reclaimed), and the RL tokens/s gained, real processes on one CPU machine"),
    "borrowed": ("libra.bench.borrowed", "RL throughput on a serving owner's lent GPUs vs none, and the SLO violations it causes, at revocation rates 0/1/10 per GPU-hour (simulated)"),
    "gpu_checks": ("libra.bench.gpu_checks", "GPU-check programs: bf16 learning vs fp32, memory freed by a role switch, a trainer OOM (--device)"),
}


def main(argv: list[str] | None = None, prog: str = "python -m libra.bench") -> int:
    """``prog``: how the usage line names the command (``libra bench`` when run through ``libra``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(f"usage: {prog} NAME [--help]\n\nbenchmarks:")
        for name, (_, what) in BENCHMARKS.items():
            print(f"  {name:<16} {what}")
        return 0
    name = argv.pop(0)
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    try:
        mod = importlib.import_module(BENCHMARKS[name][0])
    except ModuleNotFoundError as exc:
        print(f"benchmark {name!r} is not available in this checkout: {exc}", file=sys.stderr)
        return 2
    return int(mod.main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
