"""Checkpoint directories of a training run: writing, reading, and which to keep.

Two formats, chosen by how the trainer holds its model:

- **replicated** (``ddp`` or one rank): ``model.safetensors`` (loadable with ``from_pretrained``; the
  tokenizer files are copied along), ``optimizer.pt`` (optional) and ``trainer_state.json``. Written by
  one rank (the replicas are identical).
- **sharded** (``fsdp``): a ``torch.distributed.checkpoint`` directory (its ``.metadata`` and one file per
  rank, model and optimizer state under ``model``/``optim``), ``config.json``, the tokenizer files and
  ``trainer_state.json``. Every rank writes its shard, so on several hosts the directory must be on a
  shared file system. It can be resumed with a different number of ranks (DCP reshards on load), and
  turned into one ``torch.save`` file with ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.

Both are written into a temporary sibling and renamed into place, so a crash never leaves a half
checkpoint under the final name. ``load_checkpoint`` reads either format into either kind of trainer,
except a replicated checkpoint's optimizer state into a sharded trainer (a ``ValueError`` says so).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from libra.logging import get_logger

__all__ = ["TOKENIZER_FILES", "load_checkpoint", "prune_checkpoints", "save_checkpoint"]

log = get_logger("libra.engines.checkpoints")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_DCP_MARK = ".metadata"


def _barrier(trainer: Any) -> None:
    if trainer.world_size > 1:
        dist.barrier()


def _write_state(trainer: Any, tmp: Path, optimizer: bool, fmt: str) -> None:
    for name in TOKENIZER_FILES:
        if (trainer.model_dir / name).is_file():
            shutil.copy2(trainer.model_dir / name, tmp / name)
    state = {
        "step": trainer.step,
        "weights_version": trainer.weights_version,
        "world_size": trainer.world_size,
        "config": dataclasses.asdict(trainer.config),
        "optimizer": optimizer,
        "format": fmt,
    }
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; rollout hosts may read it


def _swap_into_place(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(trainer: Any, path: str | os.PathLike[str], *, optimizer: bool = True,
                    keep_last: int = 0) -> Path:
    """Write ``trainer``'s checkpoint to ``path`` (see the module docstring; the trainer's
    ``save_checkpoint`` documents the arguments). Sharded: call it on every rank."""
    target = Path(path)
    if trainer.parallel == "fsdp":
        _save_sharded(trainer, target, optimizer)
    else:
        _save_replicated(trainer, target, optimizer)
    removed: list[Path] = []
    if keep_last > 0 and trainer.rank == 0:
        removed = prune_checkpoints(target.parent, keep_last)
    log.info("checkpoint_saved", path=str(target), step=trainer.step, version=trainer.weights_version,
             optimizer=optimizer, parallel=trainer.parallel, removed=[p.name for p in removed])
    return target


def _save_replicated(trainer: Any, target: Path, optimizer: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        trainer.model.save_pretrained(tmp)
        if optimizer:
            torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
        _write_state(trainer, tmp, optimizer, "replicated")
        _swap_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_sharded(trainer: Any, target: Path, optimizer: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    tmp = target.with_name(f".{target.name}.tmp-dcp")  # one name all ranks agree on
    if trainer.rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(trainer)
    if optimizer:
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(trainer.model)}
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier(trainer)
    if trainer.rank == 0:
        try:
            trainer.model.config.save_pretrained(tmp)
            _write_state(trainer, tmp, optimizer, "sharded")
            _swap_into_place(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _barrier(trainer)


def load_checkpoint(trainer: Any, path: str | os.PathLike[str]) -> None:
    """Restore model, optimizer state, step and version into ``trainer`` from either format. Call it on
    every rank. Raises ``FileNotFoundError`` for a missing part, ``ValueError`` when it does not fit."""
    src = Path(path)
    if not (src / "trainer_state.json").is_file():
        raise FileNotFoundError(f"checkpoint {str(src)!r} lacks trainer_state.json")
    state = json.loads((src / "trainer_state.json").read_text())
    with_optimizer = bool(state.get("optimizer", True))
    if (src / _DCP_MARK).is_file():
        _load_sharded(trainer, src, with_optimizer)
    elif (src / "model.safetensors").is_file():
        _load_replicated(trainer, src, with_optimizer)
    else:
        raise FileNotFoundError(f"checkpoint {str(src)!r} lacks model.safetensors (or a sharded {_DCP_MARK})")
    trainer.step = int(state["step"])
    trainer.weights_version = int(state["weights_version"])
    log.info("checkpoint_loaded", path=str(src), step=trainer.step, version=trainer.weights_version)


def _dcp_load(state: dict[str, Any], src: Path, single: bool) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        if single:  # DCP warns about a single-process load even when asked for one
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(src), no_dist=single)


def _load_sharded(trainer: Any, src: Path, with_optimizer: bool) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    single = not dist.is_initialized()  # a replicated trainer alone reads the whole sharded checkpoint
    try:
        if with_optimizer:
            model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            _dcp_load(state, src, single)
            set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            state = {"model": get_model_state_dict(trainer.model)}
            _dcp_load(state, src, single)
            set_model_state_dict(trainer.model, state["model"])
    except (RuntimeError, KeyError) as exc:
        raise ValueError(f"checkpoint {str(src)!r} does not fit the model: {type(exc).__name__}: {exc}") from None


def _load_replicated(trainer: Any, src: Path, with_optimizer: bool) -> None:
    from safetensors.torch import load_file

    if with_optimizer and not (src / "optimizer.pt").is_file():
        raise FileNotFoundError(f"checkpoint {str(src)!r} lacks optimizer.pt")
    if trainer.parallel == "fsdp":
        if with_optimizer:
            raise ValueError(f"checkpoint {str(src)!r} is replicated with its optimizer state, which a sharded "
                             "(fsdp) trainer cannot take: resume with parallel = 'ddp' or from a sharded checkpoint")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = load_file(src / "model.safetensors", device="cpu")
        set_model_state_dict(trainer.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    weights = load_file(src / "model.safetensors", device=str(trainer.device))
    missing, unexpected = trainer.model.load_state_dict(weights, strict=False)
    # save_pretrained stores tied tensors (e.g. lm_head tied to the embeddings) once: a "missing" name that
    # shares storage with a loaded one is fine.
    own = trainer.model.state_dict()
    loaded = {own[k].data_ptr() for k in weights if k in own}
    missing = [k for k in missing if own[k].data_ptr() not in loaded]
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(src)!r} does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if with_optimizer:
        opt_state = torch.load(src / "optimizer.pt", map_location=trainer.device, weights_only=True)
        trainer.optimizer.load_state_dict(opt_state)


def prune_checkpoints(directory: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` checkpoints ``step<N>`` in ``directory`` (newest: largest
    ``N``); other entries are left alone. Returns the removed paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    found = []
    for p in Path(directory).iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m is not None and p.is_dir():
            found.append((int(m.group(1)), p))
    found.sort()
    removed = [p for _, p in found[:-keep_last]]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


_STEP_DIR = re.compile(r"step(\d+)")
