"""``python -m libra.bench endpoint``: a turn through the OpenAI-compatible endpoint against the same turn
through ``EpisodeSession.generate`` directly, on one cluster, in one run.

A broker and one tiny-model rollout actor start on loopback (``libra.local.LocalCluster``). Each of
``--trajectories`` trajectories runs ``--turns`` turns of the same conversation on three paths, interleaved
turn by turn (who goes first rotates), each on a session of its own:

- *direct*: ``session.generate()``, then ``session.add_user(...)`` (the chat template's continuation);
- *openai*: ``openai.AsyncOpenAI`` -> HTTP (uvicorn on loopback, same event loop) -> the endpoint (match
  the message list against the record, render the new message, parse tool calls) -> ``session.generate()``
  -> broker -> rollout actor, and the response back;
- *http*: the same request as plain JSON over ``httpx2`` (what the endpoint costs without the ``openai``
  client's own request building and response parsing).

All sessions have the same seed and prompt, so every path samples the same tokens (checked: ``same_tokens``)
and does the same engine work. Printed: per-turn time (median, mean, p90; ms) of each path, the ratio to
*direct* (target <= 1.1x) and the added milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from libra.bench.output import run_and_emit

QUESTION = "A shop has 12 boxes with 7 pens in each box. How many pens are there? Think step by step."


class _Paths:
    """The three ways one turn of trajectory ``k`` is taken (each on a session of its own, same seed)."""

    def __init__(self, c: Any, tok: Any, ep: Any, oa: Any, http: Any, prompt: list[int], messages: list[dict],
                 params: Any, stops: list[int], k: int) -> None:
        from libra.rl.episode import EpisodeSession

        seed = 1000 + k
        self.direct = EpisodeSession(c, tok, f"direct-{k}", prompt, params, lambda: None, stops, seed=seed,
                                     prompt_id=f"d{k}")
        self.served = {name: EpisodeSession(c, tok, f"{name}-{k}", [], params, lambda: None, stops, seed=seed,
                                            prompt_id=f"{name}{k}") for name in ("openai", "http")}
        self.keys = {name: ep.registry.register(s) for name, s in self.served.items()}
        self.msgs = {name: list(messages) for name in self.served}
        self.ep, self.oa, self.http = ep, oa, http

    async def direct_turn(self, follow: str) -> float:
        t0 = time.perf_counter()
        await self.direct.generate()
        self.direct.add_user(follow)
        return time.perf_counter() - t0

    async def openai_turn(self, follow: str) -> float:
        msgs = self.msgs["openai"]
        t0 = time.perf_counter()
        r = await self.oa.chat.completions.create(model="tiny", messages=msgs,
                                                  extra_headers={"X-Libra-Trajectory": self.keys["openai"]})
        dt = time.perf_counter() - t0
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow}]
        return dt

    async def http_turn(self, follow: str) -> float:
        msgs = self.msgs["http"]
        t0 = time.perf_counter()
        r = await self.http.post("/chat/completions", json={"model": "tiny", "messages": msgs},
                                 headers={"X-Libra-Trajectory": self.keys["http"]})
        dt = time.perf_counter() - t0
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": follow}]
        return dt

    def same_tokens(self) -> bool:
        gen = [[i for i, m in zip(s.input_ids, s.loss_mask) if m] for s in (self.direct, *self.served.values())]
        return all(g == gen[0] for g in gen)

    async def close(self) -> None:
        for key in self.keys.values():
            self.ep.registry.unregister(key)
        for s in (self.direct, *self.served.values()):
            await s.finish()


async def _measure(cluster: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    import httpx2
    import openai

    from libra.client.aio import AsyncClient
    from libra.protocol.payloads_job import EpisodeSampling
    from libra.serve import EndpointServer

    params = EpisodeSampling(max_new_tokens=args.max_new_tokens, temperature=1.0, max_total_tokens=100_000,
                             timeout_s=120)
    stops = [tok.convert_tokens_to_ids("<|im_end|>")]
    messages = [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": QUESTION}]
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    times: dict[str, list[float]] = {"direct": [], "openai": [], "http": []}
    same = True
    async with AsyncClient(cluster.url) as c:
        ep = EndpointServer()
        base = await ep.start()
        try:
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as oa, \
                    httpx2.AsyncClient(base_url=base, timeout=120) as http:
                for k in range(args.trajectories + 1):  # trajectory 0 warms every path up and is not counted
                    p = _Paths(c, tok, ep, oa, http, prompt, messages, params, stops, k)
                    turns = {"direct": p.direct_turn, "openai": p.openai_turn, "http": p.http_turn}
                    order = list(turns)
                    for t in range(args.turns):
                        order = order[1:] + order[:1]  # rotate who goes first
                        for name in order:
                            dt = await turns[name](f"Tool output {t}: 84. Continue.")
                            if k:
                                times[name].append(dt)
                    same = same and p.same_tokens()
                    await p.close()
        finally:
            await ep.stop()
    out: dict[str, Any] = {"trajectories": args.trajectories, "turns": args.turns,
                           "max_new_tokens": args.max_new_tokens, "same_tokens": same}
    for name, xs in times.items():
        out[f"{name}_median_ms"] = round(1000 * statistics.median(xs), 2)
        out[f"{name}_mean_ms"] = round(1000 * statistics.fmean(xs), 2)
        out[f"{name}_p90_ms"] = round(1000 * statistics.quantiles(xs, n=10)[-1], 2)
    for name in ("openai", "http"):
        out[f"{name}_ratio_median"] = round(out[f"{name}_median_ms"] / out["direct_median_ms"], 3)
        out[f"{name}_ratio_mean"] = round(out[f"{name}_mean_ms"] / out["direct_mean_ms"], 3)
        out[f"{name}_added_ms"] = round(out[f"{name}_median_ms"] - out["direct_median_ms"], 2)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from libra.engines.tiny_model import ensure_tiny_model
    from libra.local import LocalCluster

    model = args.model_dir or str(ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(model)
    cluster = LocalCluster(cpu_slots=1, actor_args=["--roles", "rollout=1", "--model-dir", model,
                                                    "--rollout-batch", "4", "--torch-threads", str(args.threads)])
    with cluster:
        cluster.wait_for_actors(1, timeout=180)
        return asyncio.run(_measure(cluster, tok, args))


def table(r: dict[str, Any]) -> str:
    lines = [f"endpoint vs direct session.generate: {r['trajectories']} trajectories x {r['turns']} turns per path, "
             f"<= {r['max_new_tokens']} new tokens per turn (same tokens on every path: {r['same_tokens']})"]
    names = {"direct": "direct session.generate", "openai": "endpoint, openai client",
             "http": "endpoint, plain HTTP client"}
    for name, label in names.items():
        line = (f"  {label:<28} median {r[name + '_median_ms']:>7} ms  mean {r[name + '_mean_ms']:>7} ms  "
                f"p90 {r[name + '_p90_ms']:>7} ms")
        if name != "direct":
            line += (f"  ratio {r[name + '_ratio_median']}x median, {r[name + '_ratio_mean']}x mean "
                     f"(+{r[name + '_added_ms']} ms)")
        lines.append(line)
    lines.append("  target: <= 1.1x per turn")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench endpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=8, help="trajectory pairs measured (after one warm-up pair)")
    p.add_argument("--turns", type=int, default=4, help="turns per trajectory")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per turn at most")
    p.add_argument("--model-dir", help="an HF causal-LM directory with a chat template instead of the tiny model")
    p.add_argument("--threads", type=int, default=1, help="the rollout actor's torch CPU threads")
    p.add_argument("--json", action="store_true", help="print the result object as JSON")
    args = p.parse_args(argv)
    return run_and_emit(run, args, table)


if __name__ == "__main__":
    sys.exit(main())
