"""Real engines on CUDA: HF rollout log-probs, GRPO trainer steps, NCCL data parallelism.

Skipped without CUDA. The NCCL test needs two GPUs (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from libra.engines.grpo import group_advantages
from libra.engines.hf_rollout import HFRolloutEngine
from libra.engines.rollout_base import GenRequest
from libra.engines.tiny_model import ensure_tiny_model
from libra.engines.trainer import DistConfig, GRPOTrainer, TrainBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_batch(engine: HFRolloutEngine) -> TrainBatch:
    prompts = [[2, 10 + p, 20 + p] for p in range(4) for _ in range(4)]
    results = engine.generate([GenRequest(prompt_ids=pr, max_new_tokens=8, seed=k) for k, pr in enumerate(prompts)])
    rewards = [float(sum(r.token_ids) % 2) + 0.1 * k for k, r in enumerate(results)]
    adv = group_advantages(rewards, [k // 4 for k in range(16)]).tolist()
    return TrainBatch.from_rollouts(prompts, results, adv)


def test_hf_engine_on_cuda_matches_full_forward(model_dir):
    engine = HFRolloutEngine(model_dir, device="cuda")
    reqs = [GenRequest(prompt_ids=[2, *range(10, 12 + 3 * i)], max_new_tokens=12, temperature=[0.0, 1.0][i % 2],
                       top_p=[1.0, 0.9][i % 2], seed=i) for i in range(6)]
    for req, res in zip(reqs, engine.generate(reqs)):
        ids = torch.tensor([list(req.prompt_ids) + res.token_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(ids).logits[0].float(), dim=-1)
        n = len(req.prompt_ids)
        want = [logp[n - 1 + k, t].item() for k, t in enumerate(res.token_ids)]
        assert res.logprobs == pytest.approx(want, abs=1e-3)


def test_trainer_on_cuda_decreases_loss_and_syncs(model_dir):
    engine = HFRolloutEngine(model_dir, device="cuda")
    batch = make_batch(engine)
    trainer = GRPOTrainer(model_dir, lr=2e-3, device="cuda", micro_batch_tokens=48)
    first, second = trainer.train_step(batch), trainer.train_step(batch)
    assert second["loss"] < first["loss"]
    sync = trainer.state_dict_for_sync()
    assert all(t.device.type == "cpu" for t in sync.values())
    engine.load_weights(trainer.weights_version, sync)
    assert engine.generate([GenRequest(prompt_ids=[2, 3], max_new_tokens=3)])[0].weights_version == 2


def _rank_main(rank: int, port: int, model_dir: str, batch_json: str, out_dir: str) -> None:
    batch = TrainBatch(**json.loads(batch_json))
    trainer = GRPOTrainer(model_dir, lr=2e-3, device=f"cuda:{rank}",
                          dist_config=DistConfig("127.0.0.1", port, rank, 2))
    try:
        metrics = [trainer.train_step(batch.shard(rank, 2)) for _ in range(2)]
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in trainer.model.parameters()])
        torch.save(flat, f"{out_dir}/rank{rank}.pt")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        trainer.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL data parallelism needs two GPUs")
def test_two_nccl_ranks_stay_identical(model_dir, tmp_path):
    batch = make_batch(HFRolloutEngine(model_dir))
    payload = json.dumps({"input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
                          "rollout_logprobs": batch.rollout_logprobs, "advantages": batch.advantages})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(model_dir), payload, str(tmp_path)), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=300)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert torch.equal(w0, w1)
    m = json.loads((tmp_path / "rank0.json").read_text())
    assert m[1]["loss"] < m[0]["loss"]
