"""``python -m libra.bench prefix_cache``: contexts that stay on the rollout instance, against re-sending and
re-prefilling them, in one run.

1. Per-turn latency of a multi-turn trajectory (default 6 turns) at each ``--contexts`` size (default 2K and
   8K tokens at the first turn; every turn then adds its ``--new-tokens`` generated tokens and
   ``--tool-tokens`` of tool output): *sticky*, the HF engine keeping the trajectory's KV cache between turns
   (``generate(..., sessions=[trajectory])``: a turn prefills only its new tokens), against *re-prefill*, the
   same engine given the whole context every turn without a cache (what every turn cost before). The two
   runs are interleaved turn by turn on one engine; the first turn is a cold prefill in both and is reported
   apart. Both sample with the same seeds: the tokens must be the same and the log-probs agree to float
   tolerance (printed).
2. Broker bytes per generate turn at ``--bytes-context`` (default 16K) tokens: an ``EpisodeSession`` runs a
   6-turn trajectory against a stand-in client that records what the broker would carry (the ``Submit``
   and ``Assign`` of each turn with its args, the ``WorkResult`` and ``Reply`` with its result, encoded by
   the real codec), in the delta form (new tokens + length + digests, the context published on a data-plane
   server) and in the whole form (every token every turn).

The model is the tiny offline model built with ``--max-positions`` (default 16,384, so an 8K context fits)
and ``--layers``/``--hidden``; ``--model-dir`` takes any HF causal LM instead (e.g. the converted SmolLM2,
whose 8,192 positions need ``--contexts 2048 7168``). ``--threads`` (default 1) fixes torch's CPU threads:
on a shared machine extra threads mostly wait on each other.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

from libra.bench.output import run_and_emit
from libra.engines.hf_rollout import HFRolloutEngine
from libra.engines.rollout_base import GenRequest
from libra.engines.tiny_model import (
    TinyModelSpec,
    build_tiny_tokenizer,
    ensure_tiny_model,
)
from libra.logging import configure as configure_logging


def _engine(args: argparse.Namespace) -> HFRolloutEngine:
    if args.model_dir:
        return HFRolloutEngine(args.model_dir, kv_cache_bytes=args.kv_cache_mib << 20)
    spec = TinyModelSpec(num_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_heads=max(1, args.hidden // 32), num_kv_heads=1, max_position_embeddings=args.max_positions)
    return HFRolloutEngine(ensure_tiny_model(spec=spec), kv_cache_bytes=args.kv_cache_mib << 20)


def bench_latency(engine: HFRolloutEngine, context: int, turns: int, new_tokens: int, tool_tokens: int,
                  seed: int) -> dict[str, Any]:
    """One trajectory of ``turns`` turns starting at ``context`` tokens, sticky (KV cache) and re-prefill,
    interleaved turn by turn."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    ctx = {"sticky": torch.randint(5, vocab, (context,), generator=gen).tolist()}
    ctx["reprefill"] = list(ctx["sticky"])
    times: dict[str, list[float]] = {"sticky": [], "reprefill": []}
    prefilled: dict[str, list[int]] = {"sticky": [], "reprefill": []}
    same_tokens, max_dlp = True, 0.0
    key = f"bench-{context}-{seed}"
    for t in range(turns):
        tool = torch.randint(5, vocab, (tool_tokens,), generator=gen).tolist()
        out = {}
        for mode in ("sticky", "reprefill"):
            req = GenRequest(prompt_ids=ctx[mode], max_new_tokens=new_tokens, temperature=1.0, seed=seed * 100 + t)
            t0 = time.perf_counter()
            (r,) = engine.generate([req], sessions=[key if mode == "sticky" else None])
            times[mode].append(time.perf_counter() - t0)
            prefilled[mode].append(r.num_prompt_tokens - r.cached_tokens)
            out[mode] = r
        a, b = out["sticky"], out["reprefill"]
        same_tokens &= a.token_ids == b.token_ids
        max_dlp = max(max_dlp, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
        for mode in ctx:
            ctx[mode] = ctx[mode] + out[mode].token_ids + tool
    engine.kv_cache.drop(key)
    warm = {m: statistics.mean(v[1:]) if len(v) > 1 else v[0] for m, v in times.items()}
    return {"context": context, "turns": turns, "new_tokens": new_tokens, "tool_tokens": tool_tokens,
            "sticky_turn_s": warm["sticky"], "reprefill_turn_s": warm["reprefill"],
            "ratio": warm["reprefill"] / warm["sticky"],
            "first_turn_s": {m: v[0] for m, v in times.items()},
            "turn_s": times, "prefill_tokens": prefilled, "same_tokens": same_tokens, "max_logprob_diff": max_dlp}


class _RecordingClient:
    """Stands in for the broker: answers each generate turn with ``new_tokens`` tokens and counts the bytes of
    the four messages a turn is through the broker (Submit, Assign, WorkResult, Reply; real codec)."""

    def __init__(self, new_tokens: int, vocab: int, context_at: dict[str, Any] | None) -> None:
        self.new_tokens, self.vocab, self.context_at = new_tokens, vocab, context_at
        self.turn_bytes: list[int] = []
        self.gen = torch.Generator().manual_seed(3)

    async def request(self, kind: str, name: str, args: Any, trajectory: str | None, timeout: float = 60.0) -> Any:
        from libra.protocol import encode
        from libra.protocol import messages as m
        from libra.protocol.payloads_rollout import GenerateResult

        toks = torch.randint(5, self.vocab, (self.new_tokens,), generator=self.gen).tolist()
        extra = {"context_at": self.context_at, "context_via": "cache"} if self.context_at else {}
        out = GenerateResult(token_ids=toks, logprobs=[-1.5] * len(toks), finish_reason="length", weights_version=0,
                             gen_tokens=len(toks), **extra).to_wire()
        msgs = [m.Submit("r-1", kind, name, args, trajectory, timeout),
                m.Assign("w-1", 1, 1, kind, name, args, trajectory, timeout,
                         {"bucket": name, "reason": "sticky", "migrated": False, "mode": None}),
                m.WorkResult("w-1", 1, True, out), m.Reply("r-1", True, out, work_id="w-1", actor_id="h/gpu0")]
        self.turn_bytes.append(sum(len(f) for msg in msgs for f in encode(msg)))
        return SimpleNamespace(output=out)


def bench_bytes(context: int, turns: int, new_tokens: int, tool_tokens: int, vocab: int = 49152) -> dict[str, Any]:
    """Broker bytes per turn of an EpisodeSession at ``context`` tokens: delta form vs whole form."""
    from libra.dataplane import DataPlaneServer
    from libra.protocol.payloads_job import EpisodeSampling
    from libra.rl.episode import EpisodeSession

    tok = build_tiny_tokenizer()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(5, vocab, (context,), generator=gen).tolist()  # ids of a real vocabulary's size
    tool_text = "x" * max(0, tool_tokens - 12)  # the chat wrapper adds a few tokens around it
    params = EpisodeSampling(max_new_tokens=new_tokens, max_total_tokens=context + turns * (new_tokens + 2 * tool_tokens))
    rows = {}
    with DataPlaneServer() as server:
        holder = {"endpoint": server.endpoint, "name": "ctx/bench", "server_key": None}
        for form, delta in (("delta", True), ("whole", False)):
            client = _RecordingClient(new_tokens, 256, holder if delta else None)
            s = EpisodeSession(client, tok, "bench", prompt, params, lambda: None, [1], seed=1, delta=delta,
                               context_server=server if delta else None)

            async def run(s: EpisodeSession = s) -> None:
                for _ in range(turns):
                    await s.generate()
                    s.add_user(tool_text)

            asyncio.run(run())
            rows[form] = {"bytes_per_turn": statistics.mean(client.turn_bytes), "turn_bytes": client.turn_bytes,
                          "final_context": len(s.input_ids)}
    return {"context": context, "turns": turns, **rows,
            "ratio": rows["whole"]["bytes_per_turn"] / rows["delta"]["bytes_per_turn"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    engine = _engine(args)
    rows = [bench_latency(engine, c, args.turns, args.new_tokens, args.tool_tokens, seed=k + 1)
            for k, c in enumerate(args.contexts)]
    return {"threads": torch.get_num_threads(), "model": str(args.model_dir or f"tiny {args.layers}L x {args.hidden}"),
            "latency": rows, "bytes": bench_bytes(args.bytes_context, args.turns, args.new_tokens, args.tool_tokens,
                                                  args.bytes_vocab)}


def table(res: dict[str, Any], args: argparse.Namespace) -> str:
    """The human-readable result."""
    lines = [f"prefix cache: {res['model']}, {res['threads']} torch thread(s), {args.turns} turns of "
             f"{args.new_tokens} new + {args.tool_tokens} tool tokens; s/turn = mean of turns 2..{args.turns}",
             f"{'context':>8} {'sticky s/turn':>14} {'re-prefill s/turn':>18} {'ratio':>7} {'first turn s':>14} "
             f"{'same tokens':>12} {'max |dlogp|':>12}"]
    for r in res["latency"]:
        ft = r["first_turn_s"]
        lines.append(f"{r['context']:>8} {r['sticky_turn_s']:>14.4f} {r['reprefill_turn_s']:>18.4f} "
                     f"{r['ratio']:>6.2f}x {ft['sticky']:>6.3f}/{ft['reprefill']:<7.3f} {r['same_tokens']!s:>12} "
                     f"{r['max_logprob_diff']:>12.2e}")
        lines.append(f"{'':>8} tokens fed per turn: sticky {r['prefill_tokens']['sticky']}, "
                     f"re-prefill {r['prefill_tokens']['reprefill']}")
    b = res["bytes"]
    lines.append(f"broker bytes per generate turn at {b['context']} context tokens (Submit + Assign + WorkResult + "
                 f"Reply): delta {b['delta']['bytes_per_turn']:,.0f}, whole {b['whole']['bytes_per_turn']:,.0f}, "
                 f"ratio {b['ratio']:.1f}x")
    lines.append(f"{'':>8} per turn: delta {b['delta']['turn_bytes']}, whole {b['whole']['turn_bytes']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench prefix_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192], help="context tokens at the first turn")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per turn (no stop token)")
    p.add_argument("--tool-tokens", type=int, default=64, help="tool-output tokens appended after each turn")
    p.add_argument("--bytes-context", type=int, default=16384, help="context tokens of the broker-bytes part")
    p.add_argument("--bytes-vocab", type=int, default=49152, help="prompt ids of the broker-bytes part are drawn "
                   "below this (49,152: SmolLM2's vocabulary; msgpack spends 1-5 bytes per id by its size)")
    p.add_argument("--model-dir", help="an HF causal-LM directory instead of the tiny model")
    p.add_argument("--layers", type=int, default=2, help="tiny model layers")
    p.add_argument("--hidden", type=int, default=64, help="tiny model hidden size")
    p.add_argument("--max-positions", type=int, default=16384, help="tiny model max_position_embeddings")
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="the engine's context cache budget")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print the result object as JSON")
    args = p.parse_args(argv)
    configure_logging(level="WARNING")
    return run_and_emit(run, args, lambda r: table(r, args))


if __name__ == "__main__":
    sys.exit(main())
