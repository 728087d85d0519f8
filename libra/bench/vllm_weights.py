"""``python -m libra.bench vllm_weights``: a weights update into a live vLLM engine, in buckets of whole layers
(what :meth:`~libra.engines.vllm_rollout.VLLMRolloutEngine.load_weights` does) vs every tensor in one call.

Run it with an interpreter that has vLLM (``.venv-vllm/bin/python -m libra.bench vllm_weights``, see
``scripts/vllm-venv.sh``). One engine serves the whole run: a randomly initialised model of a real shape
(``--shape``, ``libra.engines.shapes``; vLLM starts it with ``load_format="dummy"``), fp32, eager. The same
state dict (another random seed) is loaded ``--repeats`` times each way, the two ways interleaved so load from
other processes hits both alike:

- *bucketed*: the engine's own path, ``weight_bucket_bytes`` = ``--bucket-mib`` (256 by default);
- *one call*: the same code with a bucket larger than the model, so every tensor travels in a single
  ``collective_rpc``, which is how updates went before buckets (then as one packed byte blob).

After each load it generates greedily and checks that both ways give the same tokens (the load must be the
same). Prints seconds per update for each, the ratio (one call / bucketed), the buckets used, and the resident
memory of this process and its children after each load. Needs no GPU; on a GPU host it runs there as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

__all__ = ["main"]


def _rss_gib() -> float:
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**30


def run(shape: str, repeats: int, bucket_mib: int, device: str) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from libra.engines.rollout_base import GenRequest
    from libra.engines.shapes import build_random_model, write_shape_dir
    from libra.engines.vllm_rollout import VLLMRolloutEngine, weight_buckets

    with tempfile.TemporaryDirectory(prefix="libra-vllm-weights-") as tmp:
        model_dir = write_shape_dir(shape, os.path.join(tmp, "model"))
        kwargs: dict[str, Any] = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512,
                                  "load_format": "dummy"}
        if device == "cuda":
            kwargs["gpu_memory_utilization"] = 0.5
        t0 = time.perf_counter()
        eng = VLLMRolloutEngine(model_dir, **kwargs)
        start_s = time.perf_counter() - t0
        try:
            sd = build_random_model(shape, seed=1, dtype=torch.float32).state_dict()
            nbytes = sum(v.numel() * v.element_size() for v in sd.values())
            sizes = [(k, v.numel() * v.element_size()) for k, v in sd.items()]
            bucket_bytes = bucket_mib * 2**20
            ways = {"bucketed": bucket_bytes, "one_call": 2 * nbytes + 1}
            times: dict[str, list[float]] = {w: [] for w in ways}
            rss: dict[str, list[float]] = {w: [] for w in ways}
            tokens: dict[str, list[int]] = {}
            req = [GenRequest(prompt_ids=[2, 11, 20, 30], max_new_tokens=8, temperature=0.0)]
            version = 0
            for r in range(repeats):
                order = list(ways) if r % 2 == 0 else list(reversed(ways))
                for way in order:
                    eng.weight_bucket_bytes = ways[way]
                    version += 1
                    t = time.perf_counter()
                    eng.load_weights(version, sd)
                    times[way].append(time.perf_counter() - t)
                    rss[way].append(_rss_gib())
                    tokens[way] = eng.generate(req)[0].token_ids
        finally:
            eng.close()
    med = {w: statistics.median(v) for w, v in times.items()}
    return {
        "shape": shape, "device": device, "model_mib": round(nbytes / 2**20), "tensors": len(sd),
        "buckets": len(weight_buckets(sizes, bucket_bytes)), "bucket_mib": bucket_mib,
        "engine_start_s": round(start_s, 1),
        "seconds": {w: [round(x, 3) for x in v] for w, v in times.items()},
        "median_s": {w: round(x, 3) for w, x in med.items()},
        "one_call_over_bucketed": round(med["one_call"] / med["bucketed"], 3) if med["bucketed"] else None,
        "rss_gib_after": {w: [round(x, 2) for x in v] for w, v in rss.items()},
        "same_tokens": tokens["bucketed"] == tokens["one_call"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.bench vllm_weights",
                                description="vLLM weights update: buckets of whole layers vs one call (run with a "
                                            "vLLM interpreter, e.g. .venv-vllm/bin/python).")
    p.add_argument("--shape", default="qwen2-0.5b", help="model shape (libra.engines.shapes): tiny, qwen2-0.5b, ...")
    p.add_argument("--repeats", type=int, default=2, help="updates per way, interleaved (default 2)")
    p.add_argument("--bucket-mib", type=int, default=256, help="bucket size of the bucketed way (default 256)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where vLLM runs (default cpu)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    from libra.engines.vllm_rollout import vllm_available

    ok, why = vllm_available()
    if not ok:
        print(f"vllm_weights needs vLLM in this interpreter ({why}); run it with .venv-vllm/bin/python "
              "(scripts/vllm-venv.sh makes it)", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.bucket_mib < 1:
        p.error("--repeats and --bucket-mib must be >= 1")
    res = run(args.shape, args.repeats, args.bucket_mib, args.device)
    if args.json:
        print(json.dumps(res))
        return 0 if res["same_tokens"] else 1
    print(f"vLLM weights update, {res['shape']} ({res['model_mib']} MiB, {res['tensors']} tensors), {res['device']}:")
    for w in ("bucketed", "one_call"):
        print(f"  {w:<9} median {res['median_s'][w]:.3f} s  runs {res['seconds'][w]}  rss after {res['rss_gib_after'][w]} GiB")
    print(f"  buckets {res['buckets']} of <= {res['bucket_mib']} MiB; one call / bucketed = "
          f"{res['one_call_over_bucketed']}x; same tokens: {res['same_tokens']}")
    return 0 if res["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
