"""``python -m libra.bench rollout``: tokens/s of the HF rollout engine behind Libra vs called directly.

Direct: ``HFRolloutEngine.generate`` on batches of ``--batch`` requests in this process. Through Libra: a
real broker and one rollout actor (``python -m libra.actors --roles rollout=1``) running the same engine
on the same model, fed by concurrent ``generate`` requests from an asyncio client (the actor batches up
to ``--batch`` concurrent turns per engine call). Same requests, same number of torch threads; prints the
ratio (target ≥ 0.90).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from libra.client.aio import AsyncClient
from libra.local import LocalCluster


def _requests(n: int, new_tokens: int) -> list[dict]:
    return [{"prompt_ids": [1 + (i * 7 + j) % 200 for j in range(16)], "max_new_tokens": new_tokens,
             "temperature": 1.0, "seed": i} for i in range(n)]


def direct(model_dir: Path, reqs: list[dict], batch: int, threads: int) -> dict:
    import torch

    from libra.engines.hf_rollout import HFRolloutEngine
    from libra.engines.rollout_base import GenRequest

    torch.set_num_threads(threads)
    eng = HFRolloutEngine(str(model_dir), max_batch_size=batch)
    gen = [GenRequest(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"], seed=r["seed"]) for r in reqs]
    eng.generate(gen[:batch])  # warm-up
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(gen), batch):
        tokens += sum(len(r.token_ids) for r in eng.generate(gen[i : i + batch]))
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


async def _through(url: str, reqs: list[dict], batch: int) -> dict:
    async with AsyncClient(url) as c:
        await asyncio.gather(*(c.request("generate", "", r, timeout=600) for r in reqs[:batch]))  # warm-up
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.request("generate", "", r, timeout=600) for r in reqs))
        return {"tokens": sum(o.output["gen_tokens"] for o in outs), "seconds": time.perf_counter() - t0}


def run(requests: int = 128, new_tokens: int = 32, batch: int = 16, threads: int = 2,
        model_dir: str | None = None) -> dict:
    from libra.engines.tiny_model import ensure_tiny_model

    mdir = Path(model_dir) if model_dir else ensure_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    reqs = _requests(requests, new_tokens)
    d = direct(mdir, reqs, batch, threads)
    with LocalCluster(cpu_slots=1, actor_args=["--roles", "rollout=1", "--model-dir", str(mdir),
                                               "--rollout-batch", str(batch), "--torch-threads", str(threads)]) as cl:
        lib = asyncio.run(_through(cl.url, reqs, batch))
    dt, lt = d["tokens"] / d["seconds"], lib["tokens"] / lib["seconds"]
    return {"direct_tokens_per_s": dt, "libra_tokens_per_s": lt, "ratio": lt / dt, "requests": requests,
            "new_tokens": new_tokens, "batch": batch, "threads": threads, "model_dir": str(mdir)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", help="a transformers checkpoint (default: the tiny random model)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = run(a.requests, a.new_tokens, a.batch, a.threads, a.model_dir)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"HF engine direct:        {r['direct_tokens_per_s']:9.0f} tok/s")
        print(f"HF engine behind Libra:  {r['libra_tokens_per_s']:9.0f} tok/s")
        print(f"ratio {r['ratio']:.2f} (target >= 0.90); {r['requests']} requests x {r['new_tokens']} tokens, "
              f"batch {r['batch']}, {r['threads']} torch threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
