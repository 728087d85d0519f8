"""FSDP2 trainer on CUDA (libra/engines/fsdp.py): one GPU in an NCCL group of one takes the same step as the
replicated trainer, and its sharded checkpoint resumes. Skipped without CUDA."""

from __future__ import annotations

import socket

import pytest
import torch

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
