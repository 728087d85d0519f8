"""Elastic DP group (libra/engines/elastic_dp.py): real gloo groups in three processes.

Two core ranks train a small model for four steps; a third process joins at step 2 from rank 0's
snapshot (weights and AdamW state) with a zero gradient, trains with real data at step 3 and leaves at
step 4. Every member holds the same weights after every step, and steps 1-2 equal a run without the
joiner bit for bit (a zero contribution is the same as not being there)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import socket
import time
import zlib
from pathlib import Path

import pytest
import torch

from libra.engines.elastic_dp import ElasticGroup, GroupSpec, SnapshotError, restore, snapshot


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _step(model, opt, seed: int | None) -> None:
    """One DP step: local gradient (zero without data), summed over the current group, then AdamW."""
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 1, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
    if torch.distributed.is_initialized():
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
    opt.step()


def _member(who: str, plan: list[tuple[int, list[str]] | None], port: int, snap_dir: str, q) -> None:
    """Run ``plan``: per step, ``(generation, members)`` or None (not a member this step)."""
    torch.set_num_threads(1)
    model, opt = _model()
    group = ElasticGroup(timeout_s=60)
    digests = []
    for step, entry in enumerate(plan, start=1):
        if entry is None:
            digests.append(None)
            continue
        gen, members = entry
        rank = members.index(who)
        path = Path(snap_dir) / f"state{step}.pt"
        joining = group.current is None and who == "hybrid"
        if rank == 0 and "hybrid" in members and not path.exists():
            torch.save(snapshot(model, opt), path.with_suffix(".tmp"))  # what rank 0 serves on its data plane
            path.with_suffix(".tmp").rename(path)
        if joining:
            while not path.exists():
                time.sleep(0.01)
            restore(model, opt, torch.load(path, weights_only=True))
        group.ensure(GroupSpec(gen, rank, len(members), "127.0.0.1", port))
        zero = joining  # the first step after joining contributes zeros
        _step(model, opt, None if zero else zlib.crc32(f"{who}:{step}".encode()))
        digests.append(_digest(model))
    group.close()
    q.put((who, digests))


def _run(plans: dict[str, list], tmp_path: Path) -> dict[str, list]:
    tmp_path.mkdir()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_member, args=(who, plan, port, str(tmp_path), q)) for who, plan in plans.items()]
    for p in procs:
        p.start()
    try:
        out = dict(q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            if p.is_alive() and p.exitcode is None:
                p.join(30)
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return out


@pytest.mark.slow
def test_a_replica_joins_with_zero_gradients_then_trains_then_leaves(tmp_path: Path) -> None:
    core = ["core0", "core1"]
    with_joiner = [core, core + ["hybrid"], core + ["hybrid"], core]
    gens = [1, 2, 2, 3]
    plans = {who: [(g, m) if who in m else None for g, m in zip(gens, with_joiner)] for who in core + ["hybrid"]}
    got = _run(plans, tmp_path / "a")
    alone = _run({who: [(1, core)] * 4 for who in core}, tmp_path / "b")
    for step in range(4):
        members = with_joiner[step]
        assert len({got[w][step] for w in members}) == 1, f"members differ after step {step + 1}"
    assert got["hybrid"][0] is None and got["hybrid"][3] is None
    # steps 1 and 2 (the joiner's zero-gradient step) equal the run without it, bit for bit ...
    assert got["core0"][:2] == alone["core0"][:2]
    # ... and from step 3 its real gradient changes the result
    assert got["core0"][2] != alone["core0"][2]


def test_snapshot_round_trip_and_typed_errors() -> None:
    model, opt = _model()
    _step(model, opt, 1)
    state = snapshot(model, opt)
    assert any(k.startswith("opt.") and k.endswith(".exp_avg_sq") for k in state)
    other, other_opt = _model()
    restore(other, other_opt, state)
    assert _digest(other) == _digest(model)
    _step(model, opt, 2)
    _step(other, other_opt, 2)
    assert _digest(other) == _digest(model)  # the optimizer state came along: the next step agrees
    wrong = torch.nn.Linear(3, 3)
    with pytest.raises(SnapshotError, match="do not fit"):
        restore(wrong, torch.optim.AdamW(wrong.parameters()), state)
    bad = dict(state)
    bad["opt.99.exp_avg"] = torch.zeros(1)
    with pytest.raises(SnapshotError, match="names no parameter"):
        restore(other, other_opt, bad)
    with pytest.raises(ValueError, match="rank"):
        GroupSpec(1, 3, 2, "127.0.0.1", 1234)


def test_a_joiner_that_loads_the_state_after_its_zero_all_reduce_ends_with_the_cores_weights(tmp_path) -> None:
    """The runtime's join order (actors/elastic_train.py): the joiner contributes zeros first and loads the
    core's state in ``train_step(before_update=...)``, after the gradients are reduced and before the
    optimizer applies them; the same update on the same state gives the core's weights bit for bit."""
    from libra.engines.tiny_model import ensure_tiny_model
    from libra.engines.trainer import GRPOTrainer, TrainBatch

    d = ensure_tiny_model(tmp_path / "model")
    core, joiner = GRPOTrainer(d, lr=2e-3), GRPOTrainer(d, lr=2e-3)
    core.train_step(TrainBatch([[5, 6, 7, 8, 9]], [[0, 1, 1, 1, 1]], [[0.0, -2.0, -2.0, -2.0, -2.0]], [1.0]))
    state = snapshot(core.model, core.optimizer)  # what rank 0 publishes before the join step
    empty = TrainBatch([], [], [], [])
    grads_at_load: list[float] = []

    def load() -> None:
        grads_at_load.append(sum(float(p.grad.abs().sum()) for p in joiner._params))
        restore(joiner.model, joiner.optimizer, state)

    core.train_step(empty)  # AdamW's momentum and weight decay still move the weights
    joiner.train_step(empty, before_update=load)
    assert grads_at_load == [0.0]  # it ran once, after the (zero) gradients were in
    mine, theirs = snapshot(joiner.model, joiner.optimizer), snapshot(core.model, core.optimizer)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not torch.equal(theirs["model.lm_head.weight"], state["model.lm_head.weight"])  # the update applied
