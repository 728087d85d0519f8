"""FSDP2 trainer ranks (libra/engines/fsdp.py): two gloo ranks in real processes match a one-process
reference, and a sharded torch.distributed.checkpoint saved and resumed gives the same next step."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp_mp

from libra.engines.fsdp import CPU_BUDGET_BYTES, choose_parallel, training_state_bytes
from libra.engines.trainer import DistConfig, GRPOTrainer, TrainBatch



def toy_batch(model_dir: Path) -> TrainBatch:
    """16 sequences of varied lengths: 2-4 prompt tokens, 3-9 generated ones (with loss), the rollout
    log-probs of the initial policy and group advantages of a made-up reward."""
    g = torch.Generator().manual_seed(7)
    seqs, masks = [], []
    for k in range(16):
        p, n = 2 + k % 3, 3 + (k * 5) % 7
        seqs.append(torch.randint(5, 500, (p + n,), generator=g).tolist())
        masks.append([0] * p + [1] * n)
    lps = GRPOTrainer(model_dir).logprobs(seqs)
    adv = [((k * 37) % 11 - 5) / 5 for k in range(16)]
    return TrainBatch(input_ids=seqs, loss_mask=masks, rollout_logprobs=lps, advantages=adv)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from libra.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_choose_parallel_every_case() -> None:
    small, big = 10_000_000, 3_000_000_000
    gib80 = 80 * 1024**3
    assert choose_parallel("auto", world_size=1, n_params=big, param_bytes=4, device_type="cuda",
                           device_memory_bytes=gib80) == "ddp"  # one rank never shards
    assert choose_parallel("auto", world_size=2, n_params=small, param_bytes=2, device_type="cuda",
                           device_memory_bytes=gib80) == "ddp"
    assert choose_parallel("auto", world_size=2, n_params=big, param_bytes=4, device_type="cuda",
                           device_memory_bytes=gib80) == "fsdp"  # 48 GB of state > 40 GB
    # bf16 compute keeps fp32 master weights, gradients and AdamW moments (16 B a parameter) plus the bf16
    # copy autocast makes: 54 GB, not the 24 GB that bf16 parameters would take
    assert training_state_bytes(big, 2) == 18 * big
    assert training_state_bytes(big, 2, reference=True) == 20 * big  # a frozen bf16 reference model (kl > 0)
    assert choose_parallel("auto", world_size=8, n_params=big, param_bytes=2, device_type="cuda",
                           device_memory_bytes=gib80) == "fsdp"
    mid = 1_000_000_000  # 18 GB of bf16-compute state: fits half of a whole 80 GiB GPU ...
    assert choose_parallel("auto", world_size=2, n_params=mid, param_bytes=2, device_type="cuda",
                           device_memory_bytes=gib80) == "ddp"
    # ... not half of a slot's 0.4 share of it (32 GiB): the memory fraction is the budget
    assert choose_parallel("auto", world_size=2, n_params=mid, param_bytes=2, device_type="cuda",
                           device_memory_bytes=gib80, memory_fraction=0.4) == "fsdp"
    assert choose_parallel("auto", world_size=2, n_params=big, param_bytes=4, device_type="cpu") == "fsdp"
    assert training_state_bytes(small, 4) < CPU_BUDGET_BYTES // 2
    assert choose_parallel("auto", world_size=2, n_params=small, param_bytes=4, device_type="cpu") == "ddp"
    assert choose_parallel("fsdp", world_size=2, n_params=small, param_bytes=4, device_type="cpu") == "fsdp"
    assert choose_parallel("ddp", world_size=2, n_params=big, param_bytes=4, device_type="cpu") == "ddp"
    with pytest.raises(ValueError, match="known: auto, ddp, fsdp"):
        choose_parallel("zero3", world_size=2, n_params=small, param_bytes=4, device_type="cpu")


def test_unknown_parallel_mode_is_refused_before_loading(model_dir) -> None:
    with pytest.raises(ValueError, match="unknown parallel mode 'tp'"):
        GRPOTrainer(model_dir, parallel="tp")


def _rank(rank: int, world: int, port: int, model_dir: str, batch_json: str, out: str) -> None:
    from safetensors.torch import save_file

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    batch = TrainBatch(**json.loads(batch_json))
    shard = batch.shard(rank, world)
    cfg = DistConfig("127.0.0.1", port, rank, world, timeout_s=120)
    t = GRPOTrainer(model_dir, lr=2e-3, micro_batch_tokens=32, dist_config=cfg, parallel="fsdp")
    assert t.parallel == "fsdp"
    m1 = t.train_step(shard)
    save_file(t.state_dict_for_sync(), f"{out}/step1-rank{rank}.safetensors")
    t.save_checkpoint(f"{out}/ckpt/step1", optimizer=True, keep_last=1)
    m2 = t.train_step(shard)
    save_file(t.state_dict_for_sync(), f"{out}/step2-rank{rank}.safetensors")
    # a fresh trainer on the same group resumes from the sharded checkpoint and repeats step 2
    r = GRPOTrainer(model_dir, lr=2e-3, micro_batch_tokens=32, dist_config=cfg, parallel="fsdp")
    r.load_checkpoint(f"{out}/ckpt/step1")
    m2r = r.train_step(shard)
    save_file(r.state_dict_for_sync(), f"{out}/resumed-rank{rank}.safetensors")
    Path(out, f"rank{rank}.json").write_text(json.dumps({"m1": m1, "m2": m2, "m2r": m2r, "n": len(shard),
                                                         "resumed_version": r.weights_version}))
    del r  # its FSDP modules hold the group: let them go before the group does
    t.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_fsdp_gloo_ranks_match_one_process_and_resume_from_a_sharded_checkpoint(model_dir, tmp_path):
    from safetensors.torch import load_file

    batch = toy_batch(model_dir)
    payload = json.dumps({"input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
                          "rollout_logprobs": batch.rollout_logprobs, "advantages": batch.advantages})
    tmp_mp.spawn(_rank, args=(2, _free_port(), str(model_dir), payload, str(tmp_path)), nprocs=2, join=True)

    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["n"] > 0 and r1["n"] > 0 and r0["n"] + r1["n"] == len(batch)
    for k in ("m1", "m2", "m2r"):
        assert r0[k]["loss"] == r1[k]["loss"] and r0[k]["grad_norm"] == r1[k]["grad_norm"]
    w = {s: [load_file(tmp_path / f"{s}-rank{r}.safetensors") for r in range(2)] for s in ("step1", "step2", "resumed")}
    for s in w:  # every rank gathers the same full weights
        assert all(torch.equal(w[s][0][k], w[s][1][k]) for k in w[s][0])

    # one process, the whole batch, no sharding: the same loss and the same updated weights
    ref = GRPOTrainer(model_dir, lr=2e-3, micro_batch_tokens=32)
    assert ref.parallel == "ddp"
    s1 = ref.train_step(batch)
    assert s1["loss"] == pytest.approx(r0["m1"]["loss"], abs=1e-5)
    assert s1["grad_norm"] == pytest.approx(r0["m1"]["grad_norm"], rel=1e-5)
    ref_sd = ref.state_dict_for_sync()
    assert ref_sd.keys() == w["step1"][0].keys()
    for k, v in ref_sd.items():
        torch.testing.assert_close(w["step1"][0][k], v, atol=1e-5, rtol=0)

    # the resumed step is the step the uninterrupted run took
    assert r0["resumed_version"] == 2
    assert r0["m2r"]["loss"] == pytest.approx(r0["m2"]["loss"], abs=1e-6)
    for k in w["step2"][0]:
        torch.testing.assert_close(w["resumed"][0][k], w["step2"][0][k], atol=1e-6, rtol=0)
    state = json.loads((tmp_path / "ckpt" / "step1" / "trainer_state.json").read_text())
    assert state["format"] == "sharded" and state["step"] == 1 and state["optimizer"] is True
    assert (tmp_path / "ckpt" / "step1" / ".metadata").is_file()


def test_fsdp_on_one_rank_needs_a_group_and_then_matches_ddp(model_dir, tmp_path) -> None:
    """One GPU (or one CPU rank) can still run fsdp, in a group of one; it then takes the same step as ddp."""
    with pytest.raises(ValueError, match="needs a dist_config"):
        GRPOTrainer(model_dir, parallel="fsdp")
    batch = toy_batch(model_dir)
    one = GRPOTrainer(model_dir, lr=2e-3, micro_batch_tokens=32, parallel="fsdp",
                      dist_config=DistConfig("127.0.0.1", _free_port(), 0, 1))
    try:
        assert one.parallel == "fsdp" and one.world_size == 1
        m = one.train_step(batch)
        got = one.state_dict_for_sync()
        one.save_checkpoint(tmp_path / "step1", optimizer=False)
        assert (tmp_path / "step1" / ".metadata").is_file()
    finally:
        one.close()
    ref = GRPOTrainer(model_dir, lr=2e-3, micro_batch_tokens=32)
    assert ref.train_step(batch)["loss"] == pytest.approx(m["loss"], abs=1e-6)
    for k, v in ref.state_dict_for_sync().items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0)
    plain = GRPOTrainer(model_dir)  # a sharded checkpoint resumes into a replicated trainer too
    plain.load_checkpoint(tmp_path / "step1")
    assert plain.weights_version == 1
    for k, v in plain.state_dict_for_sync().items():
        assert torch.equal(v, got[k]), k
