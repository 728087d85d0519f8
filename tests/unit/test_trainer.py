"""GRPO trainer (libra.engines.trainer): accumulation, checkpoints, and 2-rank gloo data parallelism."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.engines.grpo import group_advantages
from libra.engines.hf_rollout import HFRolloutEngine
from libra.engines.rollout_base import GenRequest
from libra.engines.tiny_model import ensure_tiny_model
from libra.engines.trainer import (
    DistConfig,
    GRPOTrainer,
    TrainBatch,
    TrainingDiverged,
    partition_by_tokens,
    split_balanced,
)

GROUP = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def toy_batch(model_dir: Path) -> TrainBatch:
    """A fixed GRPO batch: 4 prompts x 4 samples from the real engine, a toy reward, group advantages."""
    engine = HFRolloutEngine(model_dir)
    prompts = [[2, 10 + p, 20 + p, 30][: 2 + p] for p in range(4) for _ in range(GROUP)]
    reqs = [GenRequest(prompt_ids=pr, max_new_tokens=5 + (k % 5), seed=k) for k, pr in enumerate(prompts)]
    results = engine.generate(reqs)
    rewards = [float(sum(r.token_ids) % 2) + 0.1 * k for k, r in enumerate(results)]  # distinct per group
    adv = group_advantages(rewards, [k // GROUP for k in range(len(results))]).tolist()
    return TrainBatch.from_rollouts(prompts, results, adv)


@pytest.fixture(scope="module")
def batch(model_dir):
    return toy_batch(model_dir)


# -- batching helpers ---------------------------------------------------------------------------


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 120))
@settings(max_examples=80, deadline=None)
def test_partition_by_tokens_covers_everything_within_budget(lengths, budget):
    groups = partition_by_tokens(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert g, "no empty micro-batch"
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget
    assert partition_by_tokens(lengths, budget) == groups  # deterministic


def test_split_balanced_balances_tokens():
    lengths = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    parts = split_balanced(lengths, 2)
    totals = [sum(lengths[i] for i in p) for p in parts]
    assert sum(totals) == 55 and abs(totals[0] - totals[1]) <= 1
    assert split_balanced([5], 3) == [[0], [], []]


def test_train_batch_validation():
    ok = {"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]], "rollout_logprobs": [[0.0, -1.0, -2.0]],
          "advantages": [1.0]}
    TrainBatch(**ok)
    with pytest.raises(ValueError, match="loss_mask\\[0\\] must be 0"):
        TrainBatch(**{**ok, "loss_mask": [[1, 1, 1]]})
    with pytest.raises(ValueError, match="sequence 0: input_ids has 3 tokens but loss_mask has 2"):
        TrainBatch(**{**ok, "loss_mask": [[0, 1]]})
    with pytest.raises(ValueError, match="advantages has 2 entries"):
        TrainBatch(**{**ok, "advantages": [1.0, 2.0]})
    with pytest.raises(ValueError, match="not finite"):
        TrainBatch(**{**ok, "rollout_logprobs": [[0.0, float("nan"), -2.0]]})
    with pytest.raises(ValueError, match="unknown GRPOTrainer option"):
        GRPOTrainer("/nonexistent", learning_rate=1.0)


# -- single process -----------------------------------------------------------------------------


def test_trainer_logprobs_match_rollout_logprobs(model_dir, batch):
    trainer = GRPOTrainer(model_dir)
    recomputed = trainer.logprobs(batch.input_ids)
    for seq_lp, mask, rollout in zip(recomputed, batch.loss_mask, batch.rollout_logprobs):
        got = [x for x, m in zip(seq_lp, mask) if m]
        want = [x for x, m in zip(rollout, mask) if m]
        assert got == pytest.approx(want, abs=1e-4)


def test_micro_batching_does_not_change_the_gradient(model_dir, batch):
    one = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=10_000)
    many = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24)
    m1, m2 = one.train_step(batch), many.train_step(batch)
    assert m1["micro_batches"] == 1 and m2["micro_batches"] > 3
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    for p1, p2 in zip(one.model.parameters(), many.model.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6, rtol=1e-5)


def test_a_given_micro_batch_plan_is_used_and_exact(model_dir, batch):
    from libra.policies.parallelism.dispatch import pack_micro_batches

    default = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=10_000)
    planned = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=10_000)
    plan = pack_micro_batches(batch.lengths(), 24)  # the dispatch policy's length-aware packing
    m1, m2 = default.train_step(batch), planned.train_step(batch, micro_batches=plan)
    assert m1["micro_batches"] == 1 and m2["micro_batches"] == len(plan) > 1
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
    for p1, p2 in zip(default.model.parameters(), planned.model.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="exactly once"):
        planned.train_step(batch, micro_batches=[[0]])


def test_collectives_after_the_passes_give_the_same_step(model_dir, batch):
    # group_ready: the passes run with a normaliser of 1 and the global one divides the reduced gradient
    # afterwards (an elastic member's group forms meanwhile): the same step up to float rounding
    now = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24)
    later = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24)
    calls = []
    m1, m2 = now.train_step(batch), later.train_step(batch, group_ready=lambda: calls.append(1))
    assert calls == [1]
    for k in ("loss", "grad_norm", "clip_frac", "ratio_mean", "num_tokens", "num_sequences"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    for p1, p2 in zip(now.model.parameters(), later.model.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-7, rtol=1e-5)
        # AdamW turns a rounding difference in a near-zero gradient into up to ~1e-5 here: 1% of a step (lr 1e-3)
        assert torch.allclose(p1, p2, atol=5e-5, rtol=0)


def test_two_steps_decrease_loss_and_sync_to_rollout(model_dir, batch):
    trainer = GRPOTrainer(model_dir, lr=2e-3, micro_batch_tokens=40)
    first = trainer.train_step(batch)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: rollout logprobs are current
    second = trainer.train_step(batch)
    assert second["loss"] < first["loss"]
    assert (trainer.step, trainer.weights_version) == (2, 2)
    assert second["num_tokens"] == batch.num_loss_tokens()

    sync = trainer.state_dict_for_sync()
    engine = HFRolloutEngine(model_dir)
    engine.load_weights(trainer.weights_version, sync)
    res = engine.generate([GenRequest(prompt_ids=[2, 11, 21], max_new_tokens=6, seed=0)])[0]
    assert res.weights_version == 2
    full = trainer.logprobs([[2, 11, 21, *res.token_ids]])[0][3:]
    assert res.logprobs == pytest.approx(full, abs=1e-4)
    trainer.train_step(batch)  # the synced copy is independent of further training
    assert all(torch.equal(sync[k], v) for k, v in engine.model.state_dict().items())


def test_kl_term_is_zero_at_start_and_grows(model_dir, batch):
    trainer = GRPOTrainer(model_dir, lr=5e-3, kl_coef=0.1)
    assert trainer.train_step(batch)["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert trainer.train_step(batch)["kl_mean"] > 1e-6


def test_checkpoint_resume_is_exact(model_dir, batch, tmp_path):
    a = GRPOTrainer(model_dir, lr=1e-3, weight_decay=0.01, micro_batch_tokens=48)
    a.train_step(batch)
    a.train_step(batch)
    ckpt = a.save_checkpoint(tmp_path / "ckpt")
    a.save_checkpoint(tmp_path / "ckpt")  # overwriting an existing checkpoint is fine
    third_a = a.train_step(batch)

    b = GRPOTrainer(model_dir, lr=1e-3, weight_decay=0.01, micro_batch_tokens=48)
    b.load_checkpoint(ckpt)
    assert (b.step, b.weights_version) == (2, 2)
    third_b = b.train_step(batch)
    for k in ("loss", "grad_norm", "clip_frac", "ratio_mean"):
        assert third_a[k] == third_b[k], k
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["weights_version"] == 2
    HFRolloutEngine(ckpt)  # the checkpoint is a loadable model directory
    assert (ckpt / "tokenizer.json").is_file()
    with pytest.raises(FileNotFoundError, match="lacks optimizer.pt"):
        (ckpt / "optimizer.pt").unlink()
        b.load_checkpoint(ckpt)


def test_checkpoint_without_optimizer_state_and_pruning(model_dir, batch, tmp_path):
    from libra.engines.checkpoints import prune_checkpoints

    a = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=48)
    for step in (1, 2, 3):
        a.train_step(batch)
        a.save_checkpoint(tmp_path / f"step{step}", optimizer=False, keep_last=2)
    (tmp_path / "notes").mkdir()  # not a checkpoint: left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step2", "step3"]
    assert not (tmp_path / "step3" / "optimizer.pt").exists()  # the bulk of a checkpoint, left out
    b = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=48)
    b.load_checkpoint(tmp_path / "step3")  # weights, step and version; a fresh optimizer
    assert (b.step, b.weights_version) == (3, 3)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    assert not b.optimizer.state  # nothing restored: AdamW starts again
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step2"]
    with pytest.raises(ValueError, match="keep_last"):
        prune_checkpoints(tmp_path, 0)


def test_non_finite_gradient_raises_and_keeps_weights(model_dir, batch):
    trainer = GRPOTrainer(model_dir, lr=1e-3)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    poisoned = TrainBatch(
        input_ids=batch.input_ids,
        loss_mask=batch.loss_mask,
        rollout_logprobs=[[-1e30] * len(s) for s in batch.input_ids],  # ratio overflows to inf
        advantages=[-1.0] * len(batch),
    )
    with pytest.raises(TrainingDiverged, match="gradient norm"):
        trainer.train_step(poisoned)
    assert trainer.weights_version == 0
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


# -- two ranks, two processes, gloo ---------------------------------------------------------------


def _run_rank(rank: int, world: int, port: int, model_dir: str, batch_json: str, out_dir: str) -> None:
    from safetensors.torch import save_file

    batch = TrainBatch(**json.loads(batch_json))
    trainer = GRPOTrainer(
        model_dir, lr=2e-3, micro_batch_tokens=32,
        dist_config=DistConfig("127.0.0.1", port, rank, world, timeout_s=90),
    )
    try:
        shard = batch.shard(rank, world)
        metrics = [trainer.train_step(shard) for _ in range(2)]
        save_file(trainer.state_dict_for_sync(), f"{out_dir}/rank{rank}.safetensors")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"metrics": metrics, "shard": len(shard)}))
    finally:
        trainer.close()


def _child_rank(*args) -> None:
    torch.set_num_threads(1)  # two ranks share a 2-core machine: avoid oversubscribed OpenMP spinning
    _run_rank(*args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_stay_identical_and_match_single_process(model_dir, batch, tmp_path):
    """Rank 1 runs in a spawned process, rank 0 in this (already warm) test process."""
    from safetensors.torch import load_file

    payload = json.dumps({
        "input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
        "rollout_logprobs": batch.rollout_logprobs, "advantages": batch.advantages,
    })
    port = _free_port()
    args = (2, port, str(model_dir), payload, str(tmp_path))
    child = mp.get_context("spawn").Process(target=_child_rank, args=(1, *args), daemon=True)
    child.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run_rank(0, *args)
        child.join(timeout=120)
    finally:
        torch.set_num_threads(threads)
        if child.is_alive():  # never leave a hung rank behind
            child.kill()
            child.join(timeout=10)
    assert child.exitcode == 0

    w0, w1 = (load_file(tmp_path / f"rank{r}.safetensors") for r in range(2))
    assert w0.keys() == w1.keys()
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # bit-identical replicas
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["shard"] > 0 and r1["shard"] > 0 and r0["shard"] + r1["shard"] == len(batch)
    m0, m1 = r0["metrics"], r1["metrics"]
    assert m1[1]["loss"] < m1[0]["loss"]  # loss decreased on the fixed batch
    for a, b in zip(m0, m1):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]  # global metrics agree

    # The DP gradient is the whole batch's gradient: a single process on the full batch sees the same.
    single = GRPOTrainer(model_dir, lr=2e-3, micro_batch_tokens=32)
    s1 = single.train_step(batch)
    assert s1["loss"] == pytest.approx(m0[0]["loss"], abs=1e-6)
    assert s1["grad_norm"] == pytest.approx(m0[0]["grad_norm"], rel=1e-5)
    assert s1["num_tokens"] == m0[0]["num_tokens"] == batch.num_loss_tokens()
