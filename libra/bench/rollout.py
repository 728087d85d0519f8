"""``python -m libra.bench rollout``: tokens/s of a rollout engine behind Libra vs called directly.

``--engine hf`` (default): direct is ``HFRolloutEngine.generate`` on batches of ``--batch`` requests in
this process. Through Libra: a real broker and one rollout actor (``python -m libra.actors --roles
rollout=1``) running the same engine on the same model, fed by concurrent ``generate`` requests from an
asyncio client (the actor batches up to ``--batch`` concurrent turns per engine call). Same requests,
same number of torch threads; prints the ratio (target ≥ 0.90). ``--device cuda`` puts both on the GPU:
the direct engine on ``cuda`` and the actor on a GPU slot (``--gpu-roles rollout=1``; with no GPU it falls back
to the CPU and says so), both in ``--dtype`` (``auto``: bf16 on a GPU). ``--shape qwen2-0.5b|qwen2-1.5b``
(or ``tiny``) writes a randomly initialised model of that real shape (``libra.engines.shapes``) to a
temporary directory that both sides load.

``--engine vllm`` (run with an interpreter that has vLLM, e.g. ``.venv-vllm/bin/python``; the actor
processes use the same interpreter): three ways to generate the same requests with the same sampling
(temperature 1, per-request seed, ``ignore_eos``, sampled-token log-probs), all with
``max_num_seqs = --batch``:

1. *vLLM alone*: a plain ``vllm.LLM`` built with the adapter's engine arguments (no Libra worker
   extension), all requests in one ``LLM.generate`` call (vLLM's own continuous batching);
2. *adapter direct*: ``VLLMRolloutEngine.generate`` on batches of ``--batch`` requests in this process;
3. *through Libra*: broker + one rollout actor whose engine is ``VLLMRolloutEngine``
   (``LIBRA_ROLLOUT_ENGINE=vllm``, ``LIBRA_VLLM_ARGS``), fed like the HF case.

All three engines stay up for the whole run and are timed in ``--rounds`` interleaved rounds (the order
rotates every round), so load from other processes hits them alike. Prints tokens/s of each (total
tokens over total seconds of all rounds) and the ratios; the headline is Libra / vLLM alone (target
≥ 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from libra.client.aio import AsyncClient
from libra.local import LocalCluster


def _requests(n: int, new_tokens: int) -> list[dict]:
    return [{"prompt_ids": [1 + (i * 7 + j) % 200 for j in range(16)], "max_new_tokens": new_tokens,
             "temperature": 1.0, "seed": i} for i in range(n)]


def _placement(device: str, dtype: str):  # -> libra.engines.device.placement.Placement
    """Where the direct engine runs: the placement an actor on ``gpu0`` (cuda) or ``cpu0`` would choose."""
    from libra.engines.device.placement import choose_placement

    cuda = device.startswith("cuda")
    return choose_placement("gpu0" if cuda else "cpu0", cuda_devices=1 if cuda else 0, dtype=dtype)


def random_shape_dir(shape: str, dtype: str, device: str) -> Path:
    """A temporary checkpoint (config and random weights, in the engines' dtype) of model shape ``shape``."""
    from libra.engines.shapes import build_random_model

    out = Path(tempfile.mkdtemp()) / shape
    build_random_model(shape, dtype=_placement(device, dtype).torch_dtype()).save_pretrained(out)
    return out


def direct(model_dir: Path, reqs: list[dict], batch: int, threads: int, device: str = "cpu",
           dtype: str = "auto") -> dict:
    import torch

    from libra.engines.hf_rollout import HFRolloutEngine
    from libra.engines.rollout_base import GenRequest

    torch.set_num_threads(threads)
    p = _placement(device, dtype)
    eng = HFRolloutEngine(str(model_dir), max_batch_size=batch, device=p.device, dtype=p.torch_dtype())
    gen = [GenRequest(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"], seed=r["seed"]) for r in reqs]
    eng.generate(gen[:batch])  # warm-up
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(gen), batch):
        tokens += sum(len(r.token_ids) for r in eng.generate(gen[i : i + batch]))
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


async def _through(url: str, reqs: list[dict], batch: int, warmup: bool = True) -> dict:
    async with AsyncClient(url) as c:
        if warmup:
            await asyncio.gather(*(c.request("generate", "", r, timeout=600) for r in reqs[:batch]))
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.request("generate", "", r, timeout=600) for r in reqs))
        return {"tokens": sum(o.output["gen_tokens"] for o in outs), "seconds": time.perf_counter() - t0}


def run(requests: int = 128, new_tokens: int = 32, batch: int = 16, threads: int = 2,
        model_dir: str | None = None, device: str = "cpu", shape: str | None = None, dtype: str = "auto") -> dict:
    from libra.engines.tiny_model import ensure_tiny_model

    if shape:
        mdir = random_shape_dir(shape, dtype, device)
    else:
        mdir = Path(model_dir) if model_dir else ensure_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    reqs = _requests(requests, new_tokens)
    d = direct(mdir, reqs, batch, threads, device, dtype)
    common = ["--model-dir", str(mdir), "--rollout-batch", str(batch), "--torch-threads", str(threads),
              "--dtype", dtype]
    if device.startswith("cuda"):  # the actor on a GPU slot, as `libra run` places it
        cl = LocalCluster(cpu_slots=0, gpu_slots="auto", actor_args=["--gpu-roles", "rollout=1", *common])
    else:
        cl = LocalCluster(cpu_slots=1, actor_args=["--roles", "rollout=1", *common])
    cl.start(wait_actors=1, timeout=600.0)
    try:
        lib = asyncio.run(_through(cl.url, reqs, batch))
        slots = [a["slot"] for a in cl.status().actors]
    finally:
        cl.stop()
    dt, lt = d["tokens"] / d["seconds"], lib["tokens"] / lib["seconds"]
    return {"direct_tokens_per_s": dt, "libra_tokens_per_s": lt, "ratio": lt / dt, "requests": requests,
            "new_tokens": new_tokens, "batch": batch, "threads": threads, "model_dir": str(mdir), "device": device,
            "dtype": _placement(device, dtype).dtype, "shape": shape, "actor_slots": slots}


DEFAULT_VLLM_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512}


class _PlainVLLM:
    """vLLM alone: ``vllm.LLM`` with the adapter's engine arguments minus its worker extension."""

    def __init__(self, model_dir: Path, batch: int, vllm_args: dict) -> None:
        import vllm

        self.llm = vllm.LLM(**{"model": str(model_dir), "skip_tokenizer_init": True, "logprobs_mode": "raw_logprobs",
                               "seed": 0, "max_num_seqs": batch, **vllm_args})

    def run(self, reqs: list[dict]) -> dict:
        """Generate all ``reqs`` in one ``LLM.generate`` call; returns tokens and seconds."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs]
        params = [SamplingParams(n=1, temperature=r["temperature"], max_tokens=r["max_new_tokens"], ignore_eos=True,
                                 seed=r["seed"], logprobs=0, detokenize=False) for r in reqs]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class _AdapterDirect:
    """The Libra vLLM adapter called in this process, ``batch`` requests per ``generate`` call."""

    def __init__(self, model_dir: Path, batch: int, vllm_args: dict) -> None:
        from libra.engines.vllm_rollout import VLLMRolloutEngine

        self.batch = batch
        self.eng = VLLMRolloutEngine(model_dir, **{"max_num_seqs": batch, **vllm_args})

    def run(self, reqs: list[dict]) -> dict:
        from libra.engines.rollout_base import GenRequest

        gen = [GenRequest(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"],
                          temperature=r["temperature"], seed=r["seed"]) for r in reqs]
        t0 = time.perf_counter()
        tokens = 0
        for i in range(0, len(gen), self.batch):
            tokens += sum(len(x.token_ids) for x in self.eng.generate(gen[i : i + self.batch]))
        return {"tokens": tokens, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.eng.close()


def run_vllm(requests: int = 128, new_tokens: int = 32, batch: int = 16, rounds: int = 3, threads: int = 2,
             model_dir: str | None = None, vllm_args: dict | None = None, start_timeout_s: float = 600.0) -> dict:
    """The ``--engine vllm`` comparison (see the module docstring). Returns tokens/s per mode, ratios,
    per-round tokens/s and the 1-minute load average before and after. Raises ``RuntimeError`` if vLLM
    cannot be imported by this interpreter."""
    from libra.engines.tiny_model import ensure_tiny_model
    from libra.engines.vllm_rollout import VLLM_ARGS_ENV, vllm_available

    ok, why = vllm_available()
    if not ok:
        raise RuntimeError(f"--engine vllm needs vLLM in this interpreter ({sys.executable}): {why}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine on CPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    vargs = dict(DEFAULT_VLLM_ARGS if vllm_args is None else vllm_args)
    mdir = Path(model_dir) if model_dir else ensure_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    reqs = _requests(requests, new_tokens)
    load_before = os.getloadavg()[0]
    cl = LocalCluster(cpu_slots=1, env={"LIBRA_ROLLOUT_ENGINE": "vllm", VLLM_ARGS_ENV: json.dumps(vargs)},
                      actor_args=["--roles", "rollout=1", "--model-dir", str(mdir), "--rollout-batch", str(batch),
                                  "--torch-threads", str(threads)])
    engines: dict = {}
    try:
        engines["vllm_alone"] = _PlainVLLM(mdir, batch, vargs)
        engines["adapter_direct"] = _AdapterDirect(mdir, batch, vargs)
        cl.start(timeout=start_timeout_s)
        run_mode = {"vllm_alone": engines["vllm_alone"].run, "adapter_direct": engines["adapter_direct"].run,
                    "libra": lambda rs: asyncio.run(_through(cl.url, rs, batch, warmup=False))}
        for fn in run_mode.values():  # warm-up: one batch each
            fn(reqs[:batch])
        modes = list(run_mode)
        per_round: dict[str, list[dict]] = {m: [] for m in modes}
        for k in range(rounds):
            for m in modes[k % len(modes):] + modes[: k % len(modes)]:
                per_round[m].append(run_mode[m](reqs))
    finally:
        cl.stop()
        for e in engines.values():
            e.close()
    tps = {m: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for m, rs in per_round.items()}
    round_tps = {m: [r["tokens"] / r["seconds"] for r in rs] for m, rs in per_round.items()}
    round_ratio = [lib / alone for lib, alone in zip(round_tps["libra"], round_tps["vllm_alone"])]
    return {"engine": "vllm", "vllm_alone_tokens_per_s": tps["vllm_alone"],
            "adapter_direct_tokens_per_s": tps["adapter_direct"], "libra_tokens_per_s": tps["libra"],
            "ratio_libra_vs_vllm": tps["libra"] / tps["vllm_alone"],
            "ratio_libra_vs_adapter": tps["libra"] / tps["adapter_direct"],
            "ratio_adapter_vs_vllm": tps["adapter_direct"] / tps["vllm_alone"],
            "round_ratio_libra_vs_vllm": round_ratio, "round_ratio_median": statistics.median(round_ratio),
            "round_tokens_per_s": round_tps, "tokens_per_round": per_round["libra"][0]["tokens"],
            "requests": requests, "new_tokens": new_tokens, "batch": batch, "rounds": rounds,
            "load1_before": load_before, "load1_after": os.getloadavg()[0], "vllm_args": vargs,
            "vllm_version": why, "model_dir": str(mdir)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench rollout", description=__doc__.split("\n\n")[0],
                                epilog="--engine vllm must run under an interpreter with vLLM, e.g. "
                                       "PYTHONPATH=. .venv-vllm/bin/python -m libra.bench rollout --engine vllm")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="rollout engine to compare (default %(default)s; see the module docstring)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="turns per engine call (vllm: also max_num_seqs)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (hf engine; vllm: the actor's frontend)")
    p.add_argument("--rounds", type=int, default=3, help="vllm only: interleaved timed rounds (default %(default)s)")
    p.add_argument("--vllm-args", default=json.dumps(DEFAULT_VLLM_ARGS),
                   help="vllm only: JSON object of extra vllm.LLM arguments for all three engines (default %(default)s)")
    p.add_argument("--model-dir", help="a transformers checkpoint (default: the tiny random model)")
    p.add_argument("--device", default="cpu", help="hf only: cpu or cuda (the actor then runs on a GPU slot)")
    p.add_argument("--dtype", default="auto", help="hf only: auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--shape", choices=["tiny", "qwen2-0.5b", "qwen2-1.5b"], default=None,
                   help="hf only: a randomly initialised model of this shape instead of --model-dir")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.engine == "vllm":
        try:
            vargs = json.loads(a.vllm_args)
        except json.JSONDecodeError as exc:
            p.error(f"--vllm-args is not valid JSON: {exc}")
        if not isinstance(vargs, dict):
            p.error("--vllm-args must be a JSON object")
        try:
            r = run_vllm(a.requests, a.new_tokens, a.batch, a.rounds, a.threads, a.model_dir, vargs)
        except RuntimeError as exc:
            print(f"libra.bench rollout: {exc}", file=sys.stderr)
            return 2
        if a.json:
            print(json.dumps(r))
        else:
            print(f"vLLM alone (LLM.generate):  {r['vllm_alone_tokens_per_s']:9.1f} tok/s")
            print(f"vLLM adapter direct:        {r['adapter_direct_tokens_per_s']:9.1f} tok/s")
            print(f"vLLM adapter behind Libra:  {r['libra_tokens_per_s']:9.1f} tok/s")
            print(f"ratio Libra/vLLM alone {r['ratio_libra_vs_vllm']:.3f} (target >= 0.95; per round "
                  f"{', '.join(f'{x:.3f}' for x in r['round_ratio_libra_vs_vllm'])}); Libra/adapter direct "
                  f"{r['ratio_libra_vs_adapter']:.3f}; adapter/vLLM alone {r['ratio_adapter_vs_vllm']:.3f}")
            print(f"{r['requests']} requests x {r['new_tokens']} tokens x {r['rounds']} rounds, batch {r['batch']}, "
                  f"vLLM {r['vllm_version']}, load1 {r['load1_before']:.2f} -> {r['load1_after']:.2f}")
        return 0
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"libra.bench rollout: --device {a.device} but CUDA is not available here", file=sys.stderr)
            return 2
    r = run(a.requests, a.new_tokens, a.batch, a.threads, a.model_dir, a.device, a.shape, a.dtype)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"model {r['shape'] or r['model_dir']} on {r['device']} ({r['dtype']}); actor slot(s) "
              f"{', '.join(r['actor_slots'])}")
        print(f"HF engine direct:        {r['direct_tokens_per_s']:9.0f} tok/s")
        print(f"HF engine behind Libra:  {r['libra_tokens_per_s']:9.0f} tok/s")
        print(f"ratio {r['ratio']:.2f} (target >= 0.90); {r['requests']} requests x {r['new_tokens']} tokens, "
              f"batch {r['batch']}, {r['threads']} torch threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
