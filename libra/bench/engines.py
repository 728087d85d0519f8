"""``python -m libra.bench engines``: the real rollout and training engines against baselines, in one run.

1. Rollout: ``HFRolloutEngine.generate`` (explicit KV-cache decode loop, per-token log-probs) against
   transformers' own ``model.generate(do_sample=True, output_logits=True)`` plus a log-softmax over the
   returned logits, which yields the same information. Same model, prompts and forced length
   (no stop token), batch sizes 1/8/32 by default; generated tokens/s (median of ``--repeats``) and the
   ratio ours / baseline.
2. Training: ``GRPOTrainer.train_step`` (token-balanced micro-batches, GRPO loss, clipping, AdamW)
   against a bare floor: one forward/backward of a token-mean log-likelihood over the same padded
   batch plus the same AdamW step, in the trainer's precision (fp32 weights and optimizer state, the passes
   under ``torch.autocast`` to ``--dtype``). Step time (median) and the ratio.

Defaults use the tiny offline model (``libra.engines.tiny_model``); ``--model-dir`` points at any HF
causal-LM directory (e.g. the converted SmolLM2 from ``libra.engines.smollm2``); ``--shape qwen2-0.5b`` or
``qwen2-1.5b`` builds a randomly initialised model of that real shape in code (``libra.engines.shapes``: the
same FLOPs and bytes as trained weights, nothing to download). ``--device cuda`` runs both sides on the GPU,
in ``--dtype`` (``auto``: bf16 on a GPU, fp32 on the CPU, as the actors' engines run).

Clocks: every timed region, ours and the baseline's alike, runs through :func:`timed`, which synchronises the
device before the clock starts and before it stops (CUDA kernels run asynchronously: a clock read without
``torch.cuda.synchronize()`` times the launches, not the work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from libra.engines.grpo import token_logprobs
from libra.engines.hf_rollout import HFRolloutEngine
from libra.engines.rollout_base import GenRequest
from libra.engines.tiny_model import ensure_tiny_model
from libra.engines.trainer import GRPOTrainer, TrainBatch
from libra.logging import configure as configure_logging


T = TypeVar("T")
_clock = time.perf_counter  # the one clock of this module (tests/unit/test_gpu_checks.py watches its reads)


def sync(device: str | torch.device) -> None:
    """Wait until ``device`` has finished its queued work (``torch.cuda.synchronize``); nothing on the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], T], device: str | torch.device) -> tuple[T, float]:
    """``(fn(), seconds)``, the device synchronised before the clock starts and before it stops."""
    sync(device)
    t0 = _clock()
    out = fn()
    sync(device)
    return out, _clock() - t0


def _progress(what: str) -> None:
    """One line on stderr as each part finishes, so a run cut off by a time limit still shows how far it got
    and what each part cost."""
    print(f"[engines {time.monotonic() - _T0:7.1f} s] {what}", file=sys.stderr, flush=True)


_T0 = time.monotonic()  # progress lines only; timed() alone reads _clock


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def _baseline_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1)
    lp = token_logprobs(logits, new)  # the same per-token log-probs our engine returns
    return int(lp.numel())


def _dtype(name: str, device: str) -> torch.dtype:
    """``--dtype`` as a torch dtype; ``auto`` follows the actors' rule (bf16 on a GPU, fp32 on the CPU)."""
    from libra.engines.device.dtypes import parse_dtype

    d = parse_dtype(name)
    return getattr(torch, ("bfloat16" if device.startswith("cuda") else "float32") if d == "auto" else d)


def bench_rollout(model_dir: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int,
                  device: str, dtype: torch.dtype = torch.float32, shape: str | None = None) -> list[dict[str, float]]:
    if shape:
        from libra.engines.shapes import build_random_model

        engine = HFRolloutEngine.from_model(build_random_model(shape, dtype=dtype, device=device),
                                            max_batch_size=max(batches))
    else:
        engine = HFRolloutEngine(model_dir, device=device, dtype=dtype, max_batch_size=max(batches))
    model = engine.model
    _progress(f"rollout engine built on {device}")
    model.generation_config.eos_token_id = None
    pad_id = int(model.config.pad_token_id or 0)
    rows = []
    for bsz in batches:
        prompts = _prompts(bsz, prompt_len, engine.vocab_size, seed=bsz)
        reqs = [GenRequest(prompt_ids=p, max_new_tokens=new_tokens, seed=k) for k, p in enumerate(prompts)]
        ours, base = [], []

        def baseline() -> int:
            with torch.inference_mode():
                return _baseline_generate(model, prompts, new_tokens, pad_id)

        engine.generate(reqs)  # warm-up
        baseline()
        for _ in range(repeats):
            results, secs = timed(lambda: engine.generate(reqs), device)
            ours.append(sum(len(r.token_ids) for r in results) / secs)
            n, secs = timed(baseline, device)
            base.append(n / secs)
        o, b = statistics.median(ours), statistics.median(base)
        rows.append({"batch": bsz, "ours_tok_s": o, "hf_generate_tok_s": b, "ratio": o / b})
        _progress(f"rollout batch {bsz}: ours {o:.0f} tok/s, generate {b:.0f} tok/s, ratio {o / b:.3f}")
    return rows


def _train_batch(vocab: int, n_seq: int, prompt_len: int, new_tokens: int) -> TrainBatch:
    prompts = _prompts(n_seq, prompt_len, vocab, seed=7)
    gen = torch.Generator().manual_seed(8)
    seqs, masks, lps, adv = [], [], [], []
    for k, p in enumerate(prompts):
        n_new = new_tokens - (k % 4) * (new_tokens // 8)  # ragged completions, like real rollouts
        comp = torch.randint(5, vocab, (n_new,), generator=gen).tolist()
        seqs.append(p + comp)
        masks.append([0] * len(p) + [1] * n_new)
        lps.append([0.0] * len(p) + [-6.0] * n_new)
        adv.append(1.0 if k % 2 else -1.0)
    return TrainBatch(input_ids=seqs, loss_mask=masks, rollout_logprobs=lps, advantages=adv)


def _floor_model(model_dir: Path, random_init: bool, device: str) -> Any:
    """The baseline's own copy of the model in fp32 (as the trainer keeps its weights), built with
    transformers alone: the same files, or the same seeded random initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_init:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device)


def bench_train(model_dir: str, n_seq: int, prompt_len: int, new_tokens: int, micro_tokens: int, repeats: int,
                device: str, dtype: torch.dtype = torch.float32, random_init: bool = False) -> dict[str, float]:
    trainer = GRPOTrainer(model_dir, lr=1e-5, device=device, dtype=dtype, micro_batch_tokens=micro_tokens,
                          **({"random_init": True} if random_init else {}))
    vocab = int(trainer.model.get_output_embeddings().weight.shape[0])
    batch = _train_batch(vocab, n_seq, prompt_len, new_tokens)
    ids, attn, mask, _, _ = batch.to_tensors(device)
    floor_model = _floor_model(Path(model_dir), random_init, device)
    floor_opt = torch.optim.AdamW(floor_model.parameters(), lr=1e-5)
    _progress("trainer and floor model built")
    dev_type = torch.device(device).type

    def floor_step() -> None:  # the trainer's precision: fp32 weights and AdamW, the passes autocast to dtype
        floor_opt.zero_grad()
        with torch.autocast(dev_type, dtype=dtype, enabled=dtype != torch.float32):
            logits = floor_model(input_ids=ids, attention_mask=attn).logits
        lp = token_logprobs(logits[:, :-1], ids[:, 1:])
        (-(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
        floor_opt.step()

    ours, base = [], []
    trainer.train_step(batch)
    floor_step()  # warm-up
    for _ in range(repeats):
        metrics, secs = timed(lambda: trainer.train_step(batch), device)
        ours.append(secs)
        base.append(timed(floor_step, device)[1])
    o, b = statistics.median(ours), statistics.median(base)
    _progress(f"train step: ours {o:.3f} s, floor {b:.3f} s, ratio {o / b:.3f}")
    tokens = sum(batch.lengths())
    return {
        "sequences": n_seq,
        "tokens": tokens,
        "micro_batches": metrics["micro_batches"],
        "ours_step_s": o,
        "floor_step_s": b,
        "ratio": o / b,
        "ours_train_tok_s": tokens / o,
    }


def run(args: argparse.Namespace) -> dict:
    """Run both benchmarks; returns the result object ``--json`` prints."""
    dtype = _dtype(args.dtype, args.device)
    if args.shape:
        import tempfile

        from libra.engines.shapes import write_shape_dir

        model_dir = str(write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape))  # config only
    else:
        model_dir = str(args.model_dir or ensure_tiny_model())
    torch.manual_seed(0)
    return {
        "model_dir": model_dir,
        "shape": args.shape,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "rollout": bench_rollout(model_dir, args.batches, args.prompt_len, args.new_tokens, args.repeats,
                                 args.device, dtype, args.shape),
        "train": bench_train(model_dir, args.train_sequences, args.prompt_len, args.new_tokens,
                             args.micro_batch_tokens, args.repeats, args.device, dtype, bool(args.shape)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="HF causal-LM directory (default: the tiny offline model)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16 or fp32")
    p.add_argument("--shape", choices=["tiny", "qwen2-0.5b", "qwen2-1.5b"], default=None,
                   help="a randomly initialised model of this shape instead of --model-dir")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="rollout batch sizes")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request (forced)")
    p.add_argument("--train-sequences", type=int, default=16, help="sequences per training step")
    p.add_argument("--micro-batch-tokens", type=int, default=512, help="trainer micro-batch budget")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    configure_logging(level="warning")  # engine logs go to stderr; stdout stays one JSON object
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"libra.bench engines: --device {args.device} but CUDA is not available here", file=sys.stderr)
        return 2
    res = run(args)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"model {res['shape'] or res['model_dir']}  device {res['device']} ({res['dtype']})  "
          f"torch threads {res['torch_threads']}")
    print(f"\nrollout ({args.prompt_len}-token prompts, {args.new_tokens} forced new tokens, sampling)")
    print(f"{'batch':>6} {'ours tok/s':>12} {'hf generate tok/s':>18} {'ratio':>7}")
    for r in res["rollout"]:
        print(f"{r['batch']:>6} {r['ours_tok_s']:>12.0f} {r['hf_generate_tok_s']:>18.0f} {r['ratio']:>7.2f}")
    t = res["train"]
    print(f"\ntraining step ({t['sequences']} sequences, {t['tokens']} tokens, {t['micro_batches']:.0f} micro-batches)")
    print(f"{'ours s':>10} {'floor s':>10} {'ratio':>7} {'ours tok/s':>11}")
    print(f"{t['ours_step_s']:>10.4f} {t['floor_step_s']:>10.4f} {t['ratio']:>7.2f} {t['ours_train_tok_s']:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
