"""FSDP2 trainer on CUDA (libra/engines/fsdp.py): one GPU in an NCCL group of one takes the same step as the
replicated trainer, and its sharded checkpoint resumes; a bare ``device="cuda"`` gets the current device's index
(``torch.cuda.set_device`` needs one); in bf16 the shards stay fp32 (FSDP2's mixed-precision policy computes in
bf16) and the weights move at lr 1e-5 while the loss falls. Skipped without CUDA."""

from __future__ import annotations

import socket

import pytest
import torch

from libra.bench.gpu_checks import fixed_batch
from libra.engines.trainer import DistConfig, GRPOTrainer, TrainBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from libra.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, 500, (8 + k,), generator=g).tolist() for k in range(6)]
    return TrainBatch(input_ids=seqs, loss_mask=[[0, 0, 0] + [1] * (len(s) - 3) for s in seqs],
                      rollout_logprobs=[[-3.0] * len(s) for s in seqs], advantages=[1.0, -1.0] * 3)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_on_one_gpu_matches_the_replicated_step_and_resumes(model_dir, tmp_path) -> None:
    batch = _batch()
    ref = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24, device="cuda")
    m_ref = ref.train_step(batch)
    want = ref.state_dict_for_sync()
    t = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24, device="cuda", parallel="fsdp",
                    dist_config=DistConfig("127.0.0.1", _port(), 0, 1))
    try:
        assert t.parallel == "fsdp" and torch.distributed.get_backend() == "nccl"
        assert t.device == torch.device("cuda", torch.cuda.current_device())  # "cuda" got its index
        assert all(p.device.type == "cuda" for p in t.model.parameters())
        m = t.train_step(batch)
        assert m["loss"] == pytest.approx(m_ref["loss"], abs=1e-4)
        got = t.state_dict_for_sync()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, atol=1e-4, rtol=1e-4)
        t.save_checkpoint(tmp_path / "step1")
        m2 = t.train_step(batch)
        r = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24, device="cuda", parallel="fsdp",
                        dist_config=DistConfig("127.0.0.1", 1, 0, 1))  # reuses the group
        r.load_checkpoint(tmp_path / "step1")
        assert r.weights_version == 1
        assert r.train_step(batch)["loss"] == pytest.approx(m2["loss"], abs=1e-5)
    finally:
        t.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (the whole tensor in a group of one); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def test_fsdp_in_bf16_keeps_fp32_shards_and_learns_at_lr_1e5(model_dir) -> None:
    t = GRPOTrainer(model_dir, lr=1e-5, dtype=torch.bfloat16, device="cuda", parallel="fsdp",
                    micro_batch_tokens=1 << 16, dist_config=DistConfig("127.0.0.1", _port(), 0, 1))
    try:
        params = [p for p in t.model.parameters() if p.requires_grad]
        assert {p.dtype for p in params} == {torch.float32}  # master weights; the passes compute in bf16
        vocab = int(t.model.get_output_embeddings().weight.shape[0])
        seqs, masks, adv = fixed_batch(vocab, 8, 16, 32)
        batch = TrainBatch(input_ids=seqs, loss_mask=masks, rollout_logprobs=t.logprobs(seqs), advantages=adv)
        before = [_local(p.detach()).clone() for p in params]
        losses = [t.train_step(batch)["loss"] for _ in range(5)]
        moved = sum(int((_local(p.detach()) != b).sum()) for p, b in zip(params, before))
        assert losses[-1] < losses[0]
        assert moved / sum(b.numel() for b in before) > 0.5  # a bf16 weight would round most updates away
    finally:
        t.close()
