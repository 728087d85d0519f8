"""``python -m libra.bench.gpu_checks CHECK``: the programs behind ``scripts/gpu-check.sh``'s own checks.

Three checks, each a function returning one JSON-able record with ``ok`` and the figures it read, each runnable
on the CPU too (``tests/unit/test_gpu_checks.py`` runs them on the tiny model, so they cannot rot unseen):

1. :func:`bf16_learning`: a GRPO trainer in the GPU's dtype (bf16) takes ``steps`` steps at ``lr`` 1e-5 on a
   fixed on-policy batch. It passes when the loss of the last step is below the first and the weights moved
   as in fp32: the share of weight elements changed by the first step is at least 0.8x the share an fp32
   trainer changes with the same step (without the reference, at least half). It reports the parameters'
   dtypes (fp32 master weights expected), the losses and both shares.
2. :func:`switch_memory`: a :class:`~libra.actors.roles.HybridRole` on the slot (``gpu0`` on a GPU, ``cpu0``
   otherwise) switches rollout -> train -> rollout, one real turn or step in each role. Memory is read at each
   stage (``torch.cuda.memory_allocated`` / ``memory_reserved`` / the device's used memory on CUDA, the
   process's RSS everywhere). It passes when the old role's model is gone after each switch by reference
   counting alone (a weak reference is dead with the cyclic collector switched off for the wait, and the
   slot's record, where it says, needed no ``gc.collect()`` at either switch) and, on
   CUDA, the allocated memory after each switch is back within a tolerance of what it was before that
   role was built. The actor's record (``RUN/actors/<actor id>.json``) is copied into the result as it is.
3. :func:`trainer_oom`: a trainer step runs out of memory. On CUDA it is a real allocation: a plain tensor
   takes all but ``margin`` of the free memory, then a step on a large batch asks for more. On the CPU the
   model's forward raises ``torch.OutOfMemoryError`` (nothing else can run the path there). It passes when
   the step fails with an out-of-memory error (its type is reported: a typed trainer failure, or torch's),
   the weights version is unchanged, a normal step then succeeds, and on CUDA the allocated memory is back
   within a tolerance of what it was before the failed step.

``--shape qwen2-0.5b`` runs the checks on a randomly initialised model of that real shape
(``libra.engines.shapes``; the switch check saves it to a scratch directory first), else the tiny model. Each
check prints one line ``RESULT {json}``; the exit status is 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from libra.bench.engines import sync
from libra.engines.grpo import TrainBatch
from libra.engines.trainer import GRPOTrainer

CHECKS = ("bf16", "switch", "oom")
MIB = 2**20
#: allocated memory may stay this far above its earlier reading after a release (cuBLAS workspaces, one per
#: thread that ran a matmul, and the allocator's rounding stay with the process)
TOLERANCE_BYTES = 256 * MIB


def memory_now(device: str | torch.device) -> dict[str, float]:
    """This process's memory in MiB: ``rss`` everywhere; on CUDA also ``allocated`` and ``reserved`` (the caching
    allocator's view) and ``device_used`` (the whole GPU, other processes included)."""
    out: dict[str, float] = {}
    try:
        import psutil

        out["rss"] = round(psutil.Process().memory_info().rss / MIB, 1)
    except Exception:  # noqa: BLE001 - a reading is optional
        pass
    dev = torch.device(device)
    if dev.type == "cuda":
        sync(dev)
        free, total = torch.cuda.mem_get_info(dev)
        out.update(allocated=round(torch.cuda.memory_allocated(dev) / MIB, 1),
                   reserved=round(torch.cuda.memory_reserved(dev) / MIB, 1),
                   device_used=round((total - free) / MIB, 1))
    return out


def card(device: str | torch.device) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def model_source(shape: str | None, scratch: Path, weights: bool = False) -> tuple[str, bool]:
    """``(model_dir, random_init)``: the tiny model, or shape ``shape``'s config alone (the trainer builds it
    with random weights) or, with ``weights``, a saved random model of that shape (what an engine loads)."""
    if not shape:
        from libra.engines.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model()), False
    from libra.engines.shapes import build_random_model, write_shape_dir

    if not weights:
        return str(write_shape_dir(shape, scratch / f"{shape}-config")), True
    out = scratch / f"{shape}-weights"
    if not (out / "config.json").is_file():
        build_random_model(shape, dtype=torch.bfloat16).save_pretrained(out)
    return str(out), False


def fixed_batch(vocab: int, n_seq: int, prompt_len: int, new_tokens: int, seed: int = 0) -> tuple[list, list, list]:
    """``(sequences, loss masks, advantages)``: random tokens, ragged completions, advantages +1/-1."""
    g = torch.Generator().manual_seed(seed)
    seqs, masks, adv = [], [], []
    for k in range(n_seq):
        n_new = max(1, new_tokens - (k % 4) * (new_tokens // 8))
        seqs.append(torch.randint(5, vocab, (prompt_len + n_new,), generator=g).tolist())
        masks.append([0] * prompt_len + [1] * n_new)
        adv.append(1.0 if k % 2 == 0 else -1.0)
    return seqs, masks, adv


def _vocab(trainer: GRPOTrainer) -> int:
    return int(trainer.model.get_output_embeddings().weight.shape[0])


def _on_policy(trainer: GRPOTrainer, seqs: list, masks: list, adv: list) -> TrainBatch:
    """The batch with the trainer's own current log-probs as the rollout's (ratio 1 at the first step)."""
    return TrainBatch(input_ids=seqs, loss_mask=masks, rollout_logprobs=trainer.logprobs(seqs), advantages=adv)


def _trainable(trainer: GRPOTrainer) -> list[torch.Tensor]:
    return [p for p in trainer.model.parameters() if p.requires_grad]


def _moved_share(before: list[torch.Tensor], trainer: GRPOTrainer) -> float:
    changed = total = 0
    for p0, p in zip(before, _trainable(trainer)):
        changed += int((p.detach() != p0).sum())
        total += p0.numel()
    return changed / max(total, 1)


def _collect(device: str) -> None:
    """Free what the collector can, and on CUDA give the caching allocator's free blocks back."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _drop(trainer: Any, device: str) -> None:
    trainer.close()
    del trainer
    _collect(device)


def _first_step_share(model_dir: str, random_init: bool, device: str, dtype: torch.dtype, lr: float,
                      batch_shape: tuple[int, int, int], steps: int) -> dict[str, Any]:
    """One trainer's run: losses of ``steps`` steps and the share of weights the first (and all) changed."""
    trainer = GRPOTrainer(model_dir, lr=lr, device=device, dtype=dtype, random_init=random_init,
                          micro_batch_tokens=1 << 16)
    seqs, masks, adv = fixed_batch(_vocab(trainer), *batch_shape)
    batch = _on_policy(trainer, seqs, masks, adv)
    before = [p.detach().clone() for p in _trainable(trainer)]
    losses, first_share = [], 0.0
    for s in range(steps):
        losses.append(float(trainer.train_step(batch)["loss"]))
        if s == 0:
            first_share = _moved_share(before, trainer)
    out = {"param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trainer.model.parameters()}),
           "losses": [round(x, 6) for x in losses], "moved_share_first_step": round(first_share, 4),
           "moved_share_all_steps": round(_moved_share(before, trainer), 4),
           "params": sum(p.numel() for p in _trainable(trainer))}
    del before, batch
    _drop(trainer, device)
    return out


def bf16_learning(*, shape: str | None = None, device: str = "cpu", steps: int = 5, lr: float = 1e-5,
                  n_seq: int = 8, prompt_len: int = 16, new_tokens: int = 32, reference: bool = True,
                  scratch: Path | None = None) -> dict[str, Any]:
    """Check 1 (see the module docstring)."""
    t0 = time.perf_counter()
    scratch = scratch or Path(tempfile.mkdtemp(prefix="libra-gpu-checks-"))
    model_dir, random_init = model_source(shape, scratch)
    bs = (n_seq, prompt_len, new_tokens)
    run = _first_step_share(model_dir, random_init, device, torch.bfloat16, lr, bs, steps)
    res: dict[str, Any] = {"check": "bf16", "device": device, "card": card(device), "model": shape or "tiny",
                           "compute_dtype": "bfloat16", "lr": lr, "steps": steps, **run,
                           "master_fp32": run["param_dtypes"] == ["float32"],
                           "loss_first": run["losses"][0], "loss_last": run["losses"][-1]}
    res["loss_fell"] = res["loss_last"] < res["loss_first"]
    want = 0.5
    if reference:
        ref = _first_step_share(model_dir, random_init, device, torch.float32, lr, bs, 1)
        res["fp32_moved_share_first_step"] = ref["moved_share_first_step"]
        res["bf16_over_fp32"] = round(run["moved_share_first_step"] / max(ref["moved_share_first_step"], 1e-12), 3)
        want = 0.8 * ref["moved_share_first_step"]
    res["ok"] = bool(res["loss_fell"] and run["moved_share_first_step"] >= want)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _ctx() -> Any:
    from libra.engines.work_context import WorkContext

    return WorkContext("gpu-check", "traj-gpu-check", 120.0, threading.Event(), "gpu-check")


def _wait_dead(ref: weakref.ref, timeout_s: float) -> bool:
    """Whether ``ref``'s object is gone within ``timeout_s`` (the rollout batcher drops its engine on its own
    thread) with the cyclic collector off: only reference counting may free it."""
    deadline = time.monotonic() + timeout_s
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    return ref() is None


def _switch_without_gc(role: Any, kinds: list[str], to: str, refs: dict[str, weakref.ref], wait_s: float
                       ) -> dict[str, bool]:
    """Switch ``role`` to ``to`` with the collector off, and whether each of ``refs`` was freed by reference
    counting (the first waited for up to ``wait_s``, the rest then not at all); the collector runs afterwards,
    so that what the switch left to it does not count against the next stage."""
    was = gc.isenabled()
    gc.disable()  # what follows must be freed by reference counting, as the issue asks
    try:
        role.reconfigure(kinds, {"role": to})
        freed = {name: _wait_dead(ref, wait_s if i == 0 else 0.0) for i, (name, ref) in enumerate(refs.items())}
    finally:
        if was:
            gc.enable()
    gc.collect()
    return freed


def _train_step(role: Any) -> int:
    """One GRPO step on ``role`` from a four-sequence shard published on a local data plane: its weights version."""
    from libra.dataplane import DataPlaneServer
    from libra.rl.shards import encode_shard

    seqs = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 13, 14, 15], [5, 6, 16, 17, 18, 19, 20], [5, 6, 21, 3, 4]]
    tensors, meta = encode_shard(seqs, [[0, 0, 0] + [1] * (len(s) - 3) for s in seqs],
                                 [[0.0] * 3 + [-3.0] * (len(s) - 3) for s in seqs], [1.0, -1.0, 0.5, -0.5],
                                 traj_index=list(range(4)), micro_batches=[[0, 1, 2, 3]], step=1, rank=0)
    with DataPlaneServer() as driver:
        ref = driver.publish_state_dict("batch/step1/rank0", tensors, version=1, metadata=meta).to_wire()
        out = role.train({"shards": [ref], "world_size": 1, "rank": 0, "master_port": 1, "grpo": {"lr": 1e-5},
                          "checkpoint": None}, _ctx())
    return out["weights_version"]


def switch_memory(*, shape: str | None = None, device: str = "cpu", scratch: Path | None = None,
                  wait_s: float = 10.0) -> dict[str, Any]:
    """Check 2 (see the module docstring)."""
    from libra.actors.roles import HybridRole
    from libra.actors.slot_records import slot_record_path
    from libra.engines.device.placement import choose_placement

    t0 = time.perf_counter()
    scratch = scratch or Path(tempfile.mkdtemp(prefix="libra-gpu-checks-"))
    model_dir, _ = model_source(shape, scratch, weights=True)
    cuda = torch.device(device).type == "cuda"
    slot = "gpu0" if cuda else "cpu0"
    placement = choose_placement(slot, cuda_devices=torch.cuda.device_count() if cuda else 0)
    run_dir = scratch / "run"
    gen = {"prompt_ids": [5, 6, 7, 8, 9], "max_new_tokens": 8, "temperature": 1.0, "stop_token_ids": [],
           "seed": 3, "weights": None}
    mem: dict[str, dict[str, float]] = {"start": memory_now(device)}
    freed: dict[str, bool] = {}
    role = HybridRole(model_dir, str(run_dir), slot, max_batch=4, placement=placement)
    role.generate(gen, _ctx())
    mem["rollout"] = memory_now(device)
    engine = role.rollout.engine  # type: ignore[union-attr]
    refs = {"rollout_model": weakref.ref(engine.model), "rollout_engine": weakref.ref(engine)}
    del engine
    freed.update(_switch_without_gc(role, ["train", "sync"], "train", refs, wait_s))
    mem["rollout_closed"] = memory_now(device)
    train_version = _train_step(role)
    mem["train"] = memory_now(device)
    model = role.trainer.trainer.model  # type: ignore[union-attr]
    refs = {"trainer_model": weakref.ref(model)}
    del model
    freed.update(_switch_without_gc(role, ["generate"], "rollout", refs, wait_s))
    mem["train_closed"] = memory_now(device)
    role.generate(gen, _ctx())
    mem["rollout_again"] = memory_now(device)
    record_path = slot_record_path(run_dir, slot, role.actor_id)
    record = json.loads(record_path.read_text()) if record_path.is_file() else None
    role.reconfigure(["sync"], {"role": "none"})  # neither role: both engines released
    del role
    _collect(device)
    mem["end"] = memory_now(device)
    res: dict[str, Any] = {"check": "switch", "device": device, "card": card(device), "model": shape or "tiny",
                           "slot": slot, "train_weights_version": train_version, "memory_mib": mem,
                           "freed_without_gc": freed, "actor_record": record}
    gc_needed = [sw.get("gc_needed") for sw in (record or {}).get("role_switches", [])]  # absent: not recorded
    res["gc_needed_by_switches"] = gc_needed
    ok = all(freed.values()) and not any(gc_needed)
    if cuda:
        tol = TOLERANCE_BYTES / MIB
        returned = {"after_rollout": mem["rollout_closed"]["allocated"] <= mem["start"]["allocated"] + tol,
                    "after_train": mem["train_closed"]["allocated"] <= mem["rollout_closed"]["allocated"] + tol,
                    "rollout_again": mem["rollout_again"]["allocated"] <= mem["rollout"]["allocated"] + tol}
        res["memory_returned"] = returned
        res["trainer_mib"] = round(mem["train"]["allocated"] - mem["train_closed"]["allocated"], 1)
        ok = ok and all(returned.values())
    res["ok"] = bool(ok)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _is_oom(exc: BaseException) -> bool:
    """An out-of-memory failure: torch's error, or a typed failure that says so or was caused by one."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, torch.OutOfMemoryError) or "OutOfMemory" in type(seen).__name__ \
                or getattr(seen, "code", None) == "oom":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _hog(device: torch.device, margin_bytes: int) -> list[torch.Tensor]:
    """Plain allocations that leave about ``margin_bytes`` of the device free (halving the last one until the
    driver takes it)."""
    held: list[torch.Tensor] = []
    for _ in range(64):
        free, _ = torch.cuda.mem_get_info(device)
        want = free - margin_bytes
        if want < 64 * MIB:
            break
        try:
            held.append(torch.empty(want, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            margin_bytes += max(want // 8, 64 * MIB)
    return held


def trainer_oom(*, shape: str | None = None, device: str = "cpu", scratch: Path | None = None,
                margin_mib: int = 256, big: tuple[int, int] = (256, 512)) -> dict[str, Any]:
    """Check 3 (see the module docstring). ``big`` is the failing batch's (sequences, tokens each)."""
    t0 = time.perf_counter()
    scratch = scratch or Path(tempfile.mkdtemp(prefix="libra-gpu-checks-"))
    model_dir, random_init = model_source(shape, scratch)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    trainer = GRPOTrainer(model_dir, lr=1e-5, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                          random_init=random_init, micro_batch_tokens=1 << 30)
    vocab = _vocab(trainer)
    small = _on_policy(trainer, *fixed_batch(vocab, 4, 8, 8))
    trainer.train_step(small)
    seqs, masks, adv = fixed_batch(vocab, big[0], big[1] // 2, big[1] - big[1] // 2, seed=1)
    large = TrainBatch(input_ids=seqs, loss_mask=masks, rollout_logprobs=[[-3.0] * len(s) for s in seqs],
                       advantages=adv)
    version = trainer.weights_version
    before = memory_now(device)
    held: list[torch.Tensor] = []
    restore: Any = None
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)  # a role's budget (set earlier) would fail first
        held = _hog(dev, margin_mib * MIB)
    else:  # no real allocation fails on the CPU: the forward raises what CUDA would
        real = trainer.model.forward

        def forward(*a: Any, **k: Any) -> Any:
            torch.empty(1 << 20, dtype=torch.uint8)
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the CPU run of the gpu check)")

        trainer.model.forward = forward
        restore = real
    error: BaseException | None = None
    try:
        trainer.train_step(large)
    except Exception as exc:  # noqa: BLE001 - any failure is read below; a step that passed is a failed check
        error = exc
    err_type = type(error).__name__ if error is not None else None
    err_code = getattr(error, "code", None)
    err_text = str(error)[:300] if error is not None else None
    is_oom = error is not None and _is_oom(error)
    del error, large, held
    if restore is not None:
        trainer.model.forward = restore
    _collect(device)
    after_fail = memory_now(device)
    unchanged = trainer.weights_version == version
    recovered = trainer.train_step(small)["weights_version"] == version + 1
    after = memory_now(device)
    res: dict[str, Any] = {"check": "oom", "device": device, "card": card(device), "model": shape or "tiny",
                           "mode": "real allocation" if cuda else "raised in forward (CPU)",
                           "error_type": err_type, "error_code": err_code, "error": err_text, "is_oom": is_oom,
                           "version_unchanged": unchanged, "recovered": recovered,
                           "memory_mib": {"before": before, "after_failure": after_fail, "after_recovery": after}}
    ok = is_oom and unchanged and recovered
    if cuda:
        res["memory_returned"] = after_fail["allocated"] <= before["allocated"] + TOLERANCE_BYTES / MIB
        ok = ok and res["memory_returned"]
    res["ok"] = bool(ok)
    _drop(trainer, device)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def run_checks(names: list[str], *, shape: str | None, device: str, scratch: Path | None = None) -> list[dict]:
    """Run ``names`` in order; a check that raises is a failed record naming the error, and the rest still run."""
    scratch = scratch or Path(tempfile.mkdtemp(prefix="libra-gpu-checks-"))
    fns = {"bf16": bf16_learning, "switch": switch_memory, "oom": trainer_oom}
    out = []
    for name in names:
        t0 = time.perf_counter()
        try:
            res = fns[name](shape=shape, device=device, scratch=scratch)
        except Exception as exc:  # noqa: BLE001 - reported as the check's result
            import traceback

            traceback.print_exc()
            res = {"check": name, "device": device, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                   "seconds": round(time.perf_counter() - t0, 2)}
        print("RESULT " + json.dumps(res), flush=True)
        out.append(res)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench.gpu_checks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checks", nargs="*", metavar="CHECK",
                   help=f"which checks, in order: {', '.join(CHECKS)} (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (cuda:0) or cpu (default: cuda when available)")
    p.add_argument("--shape", choices=["tiny", "qwen2-0.5b", "qwen2-1.5b"], default=None,
                   help="a randomly initialised model of this shape (default: the tiny offline model)")
    p.add_argument("--json-out", default=None, help="also write the records as one JSON list to this file")
    args = p.parse_args(argv)
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    device = "cuda:0" if args.device == "cuda" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_checks: --device {args.device} but CUDA is not available here", file=sys.stderr)
        return 2
    from libra.logging import configure as configure_logging

    configure_logging(level="warning")
    results = run_checks(list(args.checks) or list(CHECKS), shape=args.shape, device=device)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"{r['check']:<7} {'ok' if r['ok'] else 'FAILED'}  {r.get('seconds', 0):.1f} s", file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
