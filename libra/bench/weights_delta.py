"""Benchmark: delta vs full weights sync between consecutive versions of a real training run, same run.

What it runs (one process): SmolLM2-135M-Instruct (``--model smollm2``, default; ``tiny`` under ``--quick``)
trained by :class:`~libra.engines.trainer.GRPOTrainer` with the bundled job's GRPO settings
(``examples/arith_smollm2.toml``: AdamW, its ``lr``, betas (0.9, 0.999), eps 1e-8, no weight decay, gradient
clipped at 1.0; ``--lr`` overrides) on completions the model samples itself (HF rollout engine, temperature 1)
for the job's arithmetic prompts, ``group_size`` per prompt. The advantages alternate +1/-1 within each group
(a stand-in for rewards, so that every step has a learning signal; AdamW normalises the gradient's scale, so
the share of unchanged weights is decided by the learning rate and the dtype, not by the reward).

For each consecutive pair of versions ``(v, v+1)`` (``v0`` is the checkpoint) and for each dtype (the one the
trainer exports: fp32 on a CPU trainer, bf16 from a bf16 GPU trainer; and bf16, both versions cast), over a
real :class:`~libra.dataplane.DataPlaneServer` on TCP loopback with delta sync on (no size threshold):

- *delta*: a fetcher holding ``v`` in host memory fetches ``weights/v{v+1}/from/v{v}`` and applies it (the
  transfer, the application and every check; :mod:`libra.weights.dataplane`);
- *full*: a fetcher holding nothing fetches ``weights/v{v+1}`` (the transfer and its CRC checks);
- bytes on the wire (headers + chunks) and seconds of each, their ratio, the publisher's encode seconds, and
  the share of unchanged tensors, elements and blocks (``--block-bytes`` of a tensor's bytes; a tensor's last
  block may be shorter), compared by bit pattern in that dtype.

``python -m libra.bench weights_delta [--model smollm2|tiny] [--steps 3] [--lr LR] [--device cpu|cuda]
[--block-bytes 4096] [--quick] [--json]``. ``--device cuda`` (a lent GPU) trains and samples there in bf16.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["main", "run"]

JOB = Path(__file__).resolve().parents[2] / "examples" / "arith_smollm2.toml"


def job_settings() -> dict[str, Any]:
    """The bundled job's GRPO and sampling settings (the trainer's defaults where it has no such file)."""
    raw = tomllib.loads(JOB.read_text()) if JOB.is_file() else {}
    grpo, env, job = raw.get("grpo", {}), raw.get("env", {}), raw.get("job", {})
    return {"lr": float(grpo.get("lr", 1e-6)), "group_size": int(grpo.get("group_size", 4)),
            "prompts": int(job.get("prompts_per_step", 2)), "max_new_tokens": int(env.get("max_new_tokens", 24)),
            "options": dict(env.get("options", {})), "source": str(JOB) if JOB.is_file() else "trainer defaults"}


def _model_dir(name: str) -> Any:
    if name == "tiny":
        from libra.engines.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    from libra.engines.smollm2 import ensure_smollm2

    return ensure_smollm2()


def _batch(engine: Any, tokenizer: Any, cfg: dict[str, Any], step: int) -> Any:
    """One GRPO batch: the model's own samples for this step's prompts, advantages +1/-1 per group."""
    from libra.engines.grpo import TrainBatch
    from libra.engines.rollout_base import GenRequest
    from libra.envs.arith import make_problems

    opts = {k: v for k, v in cfg["options"].items() if k != "format_reward"}
    opts["prompt_style"] = "plain"  # short prompts: the figure does not depend on them, the run time does
    problems = make_problems(cfg["prompts"], seed=step, **opts)
    reqs = []
    for p in problems:
        text = tokenizer.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        reqs += [GenRequest(ids, cfg["max_new_tokens"], temperature=1.0, seed=1000 * step + g)
                 for g in range(cfg["group_size"])]
    outs = engine.generate(reqs)
    seqs = [list(r.prompt_ids) + list(o.token_ids) for r, o in zip(reqs, outs)]
    return TrainBatch(input_ids=seqs,
                      loss_mask=[[0] * len(r.prompt_ids) + [1] * len(o.token_ids) for r, o in zip(reqs, outs)],
                      rollout_logprobs=[[0.0] * len(r.prompt_ids) + list(o.logprobs) for r, o in zip(reqs, outs)],
                      advantages=[1.0 if i % 2 else -1.0 for i in range(len(reqs))])


def _blocks(a: torch.Tensor, b: torch.Tensor, block: int) -> tuple[int, int]:
    """``(blocks, unchanged blocks)`` of ``block`` bytes of two same-shaped tensors' bytes."""
    x = a.reshape(-1).view(torch.uint8).numpy()
    y = b.reshape(-1).view(torch.uint8).numpy()
    n = -(-x.nbytes // block)
    if not n:
        return 0, 0
    pad = n * block - x.nbytes
    diff = np.concatenate([x != y, np.zeros(pad, dtype=bool)]).reshape(n, block).any(axis=1)
    return n, int(n - np.count_nonzero(diff))


class Lane:
    """One dtype's data-plane server, publisher and the two fetchers (host copy / none)."""

    def __init__(self, dtype: torch.dtype) -> None:
        from libra.dataplane import DataPlaneServer
        from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher
        from libra.weights.host_copy import HostWeights

        self.dtype, self.server = dtype, DataPlaneServer()
        self.pub = DataPlaneWeightPublisher(self.server, keep=2, delta=True, delta_max_ratio=float("inf"))
        self.held = HostWeights()
        self.delta_f = DataPlaneWeightFetcher(host_copy=self.held)
        self.full_f = DataPlaneWeightFetcher()
        self.prev: dict[str, torch.Tensor] | None = None

    def step(self, version: int, sd: dict[str, torch.Tensor], block: int) -> dict[str, Any] | None:
        from libra.weights.format import tie_like

        cast = tie_like(sd, {k: v.detach().to("cpu", self.dtype, copy=True) for k, v in sd.items()})
        t0 = time.perf_counter()
        ref = self.pub.publish(version, cast)
        publish_s = time.perf_counter() - t0
        prev, self.prev = self.prev, cast
        if prev is None:
            self.delta_f.fetch(ref)  # the slot's first version comes whole
            return None
        t0 = time.perf_counter()
        got, _, ds = self.delta_f.fetch(ref)
        delta_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        full, _, fs = self.full_f.fetch(ref)
        full_s = time.perf_counter() - t0
        if ds.mode != "delta" or got.header_bytes != full.header_bytes or any(
                not torch.equal(got[k].reshape(-1).view(torch.uint8), full[k].reshape(-1).view(torch.uint8)) for k in full):
            raise AssertionError(f"v{version} {self.dtype}: the delta did not rebuild the full version ({ds})")
        blocks = [_blocks(prev[k], cast[k], block) for k in cast if prev[k].shape == cast[k].shape]
        s = self.pub.last_delta
        d_bytes, f_bytes = ds.nbytes + ds.header_bytes, fs.nbytes + fs.header_bytes
        return {"pair": f"v{version - 1}->v{version}", "dtype": str(self.dtype).removeprefix("torch."),
                "full_bytes": f_bytes, "delta_bytes": d_bytes, "bytes_ratio": d_bytes / f_bytes,
                "full_s": full_s, "delta_s": delta_s, "seconds_ratio": delta_s / full_s,
                "apply_s": ds.apply_s, "encode_s": self.pub.last_delta_s, "publish_s": publish_s,
                "unchanged_tensors": s.unchanged_tensors / max(1, s.tensors),
                "unchanged_elements": s.unchanged_elements / max(1, s.elements),
                "unchanged_blocks": sum(u for _, u in blocks) / max(1, sum(n for n, _ in blocks)),
                "encodings": dict(s.encodings)}

    def close(self) -> None:
        self.server.close()


def run(model: str = "smollm2", steps: int = 3, lr: float | None = None, device: str = "cpu",
        block_bytes: int = 4096) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from libra.engines.hf_rollout import HFRolloutEngine
    from libra.engines.trainer import GRPOConfig, GRPOTrainer

    cfg = job_settings()
    if lr is not None:
        cfg["lr"] = lr
    path = _model_dir(model)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    trainer = GRPOTrainer(path, GRPOConfig(lr=cfg["lr"]), device=device, dtype=dtype)
    engine = HFRolloutEngine(path, device=device, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    exported = trainer.state_dict_for_sync()
    lanes = [Lane(next(iter(exported.values())).dtype)]
    if lanes[0].dtype != torch.bfloat16:
        lanes.append(Lane(torch.bfloat16))
    rows: list[dict[str, Any]] = []
    train_s = 0.0
    try:
        for lane in lanes:
            lane.step(0, exported, block_bytes)
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            trainer.train_step(_batch(engine, tokenizer, cfg, step))
            train_s += time.perf_counter() - t0
            exported = trainer.state_dict_for_sync()
            engine.load_weights(trainer.weights_version, exported)
            rows += [r for lane in lanes if (r := lane.step(trainer.weights_version, exported, block_bytes))]
    finally:
        for lane in lanes:
            lane.close()
    return {"model": model, "device": device, "exported_dtype": str(lanes[0].dtype).removeprefix("torch."),
            "optimizer": "AdamW", "lr": cfg["lr"], "settings_from": cfg["source"], "steps": steps,
            "sequences_per_step": cfg["prompts"] * cfg["group_size"], "block_bytes": block_bytes,
            "train_s": train_s, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.bench weights_delta", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("smollm2", "tiny"), default=None, help="default: smollm2 (tiny with --quick)")
    p.add_argument("--steps", type=int, default=None, help="training steps, one version each (default: 3; 2 --quick)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the bundled job's [grpo] lr)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] on a lent GPU (bf16 there)")
    p.add_argument("--block-bytes", type=int, default=4096, help="block size of the unchanged-blocks share")
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 steps (a smoke test)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = p.parse_args(argv)
    if a.block_bytes < 1 or (a.steps is not None and a.steps < 1):
        p.error("--block-bytes and --steps must be >= 1")
    out = run(a.model or ("tiny" if a.quick else "smollm2"), a.steps or (2 if a.quick else 3), a.lr, a.device,
              a.block_bytes)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"delta vs full weights sync: {out['model']} on {out['device']}, exported {out['exported_dtype']}, "
          f"{out['optimizer']} lr {out['lr']:g} ({out['settings_from']}), {out['sequences_per_step']} sequences a step")
    print(f"{'pair':>8} {'dtype':>8} {'full MB':>8} {'delta MB':>9} {'bytes x':>8} {'full s':>7} {'delta s':>8} "
          f"{'time x':>7} {'encode s':>9} {'same tensors':>13} {'same elems':>11} {'same blocks':>12}")
    for r in out["rows"]:
        print(f"{r['pair']:>8} {r['dtype']:>8} {r['full_bytes'] / 1e6:8.2f} {r['delta_bytes'] / 1e6:9.2f} "
              f"{r['bytes_ratio']:8.3f} {r['full_s']:7.3f} {r['delta_s']:8.3f} {r['seconds_ratio']:7.3f} "
              f"{r['encode_s']:9.3f} {r['unchanged_tensors']:13.1%} {r['unchanged_elements']:11.2%} "
              f"{r['unchanged_blocks']:12.2%}")
    print(f"blocks of {out['block_bytes']} bytes; bytes x / time x: delta over full (lower is better)")
    return 0
