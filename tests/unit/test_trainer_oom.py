"""A trainer rank whose forward or backward fails (a CUDA out-of-memory error, or any other exception) fails
the step on every rank as a typed TrainStepFailed, with no rank left in an all-reduce, the weights, step and
version unchanged, and the next step working (libra/engines/trainer.py, collectives.py).

At af91053 the failing rank raised the bare error and the other rank waited in the all-reduce until the
group's timeout. The ranks here are two processes on gloo (rank 1 spawned, rank 0 in the test process, as
in test_trainer.py); the out-of-memory error is injected on rank 1 only."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from libra.engines.trainer import DistConfig, GRPOTrainer, TrainBatch, TrainStepFailed

GROUP_TIMEOUT_S = 60  # a rank left in a collective would fail with the group's timeout, not TrainStepFailed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from libra.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, 500, (6 + k % 5,), generator=g).tolist() for k in range(8)]
    return TrainBatch(input_ids=seqs, loss_mask=[[0, 0] + [1] * (len(s) - 2) for s in seqs],
                      rollout_logprobs=[[-4.0] * len(s) for s in seqs], advantages=[1.0, -1.0] * 4)


def _inject(trainer: GRPOTrainer, exc: Exception) -> None:
    """The trainer's next micro-batch pass raises ``exc`` (once)."""
    real = trainer._micro_step

    def failing(mb, normalizer):
        trainer._micro_step = real  # type: ignore[method-assign]
        raise exc

    trainer._micro_step = failing  # type: ignore[method-assign]


def _run_rank(rank: int, port: int, model_dir: str, out_dir: str, parallel: str, error: str) -> None:
    trainer = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24, parallel=parallel,
                          dist_config=DistConfig("127.0.0.1", port, rank, 2, timeout_s=GROUP_TIMEOUT_S))
    out: dict = {"rank": rank}
    try:
        shard = _batch().shard(rank, 2)
        before = trainer.state_dict_for_sync()
        if rank == 1:
            _inject(trainer, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                    if error == "oom" else KeyError("boom"))
        try:
            trainer.train_step(shard)
            out["failed"] = None
        except TrainStepFailed as exc:
            out["failed"] = {"code": exc.code, "ranks": exc.ranks, "rank": exc.rank, "text": str(exc)}
        after = trainer.state_dict_for_sync()
        out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        out["grads_zero"] = all(not p.grad.any() for p in trainer._params if p.grad is not None)
        out["version"] = [trainer.step, trainer.weights_version]
        out["next"] = trainer.train_step(shard)["loss"]  # the following step works on every rank
        out["version_after"] = trainer.weights_version
        out["fingerprint"] = trainer.weights_fingerprint()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        trainer.close()


def _child(*args) -> None:
    torch.set_num_threads(1)
    _run_rank(*args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(model_dir: Path, tmp_path: Path, parallel: str, error: str) -> tuple[dict, dict]:
    args = (_free_port(), str(model_dir), str(tmp_path), parallel, error)
    child = mp.get_context("spawn").Process(target=_child, args=(1, *args), daemon=True)
    child.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run_rank(0, *args)
        child.join(timeout=GROUP_TIMEOUT_S * 3)
    finally:
        torch.set_num_threads(threads)
        if child.is_alive():  # never leave a hung rank behind
            child.kill()
            child.join(timeout=10)
    assert child.exitcode == 0
    return tuple(json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))  # type: ignore[return-value]


@pytest.mark.parametrize(("parallel", "error", "code"), [("ddp", "oom", "oom"), ("fsdp", "other", "step_failed")])
def test_a_failed_pass_on_one_rank_fails_the_step_on_every_rank(model_dir, tmp_path, parallel, error, code) -> None:
    r0, r1 = _two_ranks(model_dir, tmp_path, parallel, error)
    for r in (r0, r1):
        assert r["failed"] is not None and r["failed"]["code"] == code, r
        assert r["failed"]["ranks"] == [1] and r["failed"]["rank"] == r["rank"]
        assert r["unchanged"] and r["grads_zero"]  # nothing of the failed step was applied
        assert r["version"] == [0, 0] and r["version_after"] == 1
    assert ("out of memory" if error == "oom" else "KeyError") in r1["failed"]["text"]
    assert r0["next"] == r1["next"]  # the next step is a normal, global one
    if parallel == "ddp":
        assert r0["fingerprint"] == r1["fingerprint"]  # the replicas are still identical


def test_a_failed_pass_alone_leaves_the_trainer_usable(model_dir) -> None:
    t = GRPOTrainer(model_dir, lr=1e-3, micro_batch_tokens=24)
    before = t.weights_fingerprint()
    _inject(t, torch.cuda.OutOfMemoryError("CUDA out of memory."))
    with pytest.raises(TrainStepFailed) as info:
        t.train_step(_batch())
    assert info.value.code == "oom" and info.value.ranks == [0]
    assert info.value.__cause__ is None and info.value.__context__ is None  # no traceback holding tensors
    assert t.weights_fingerprint() == before and t.weights_version == 0
    assert t.train_step(_batch())["weights_version"] == 1
