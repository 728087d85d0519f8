"""Engine-backed actor roles: which handlers a ``rollout``, ``train`` or ``hybrid`` slot serves.

The roles themselves live in the modules named for them: the rollout instance (``generate`` work) in
:mod:`libra.actors.rollout_role`, the GRPO trainer rank (``train`` work) in :mod:`libra.actors.train_role`.
Here: :class:`HybridRole` (a slot switched between the two by broker directives) and
:func:`role_handlers`. The payload contracts (``generate`` args and reply, ``train`` args and reply,
data-plane refs) are the typed structs of ``libra.protocol.payloads_rollout``,
``libra.protocol.payloads_train`` and ``libra.protocol.payloads_refs``: their field docstrings are the
contract. Every public name of the role modules is importable from here too.
"""

from __future__ import annotations

import threading
from typing import Any

from libra.logging import get_logger

from .rollout_role import ROLLOUT_ENGINE_ENV, RolloutRole, make_rollout_engine, read_weights_file, write_weights_file
from .tools import Handler, WorkContext
from .train_role import TrainRole

__all__ = ["ROLLOUT_ENGINE_ENV", "HybridRole", "RolloutRole", "TrainRole", "make_rollout_engine",
           "read_weights_file", "role_handlers", "write_weights_file"]

log = get_logger("libra.roles")


class HybridRole:
    """A slot that can be a rollout instance or a trainer rank, switched by broker directives (the Elastic
    Hybrid Pool's worker, and how a plan moves GPUs between roles without restarting processes).

    Each engine is created on the first work of its kind; ``reconfigure(kinds, config)`` (called by the
    runtime after the actor drained for a directive) closes the engine of a kind no longer accepted and
    returns the capacity for the new role: 1 as a trainer rank, ``max_batch`` as a rollout instance.
    """

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, max_batch: int = 32,
                 torch_threads: int = 0) -> None:
        self.model_dir, self.run_dir, self.slot = model_dir, run_dir, slot
        self.max_batch, self.torch_threads = max_batch, torch_threads
        self._lock = threading.Lock()
        self.rollout: RolloutRole | None = None
        self.trainer: TrainRole | None = None
        self.switches = 0

    def generate(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        with self._lock:
            if self.rollout is None:
                self.rollout = RolloutRole(self.model_dir, self.run_dir, self.slot, max_batch=self.max_batch,
                                           torch_threads=self.torch_threads)
            r = self.rollout
        return r.generate(args, ctx)

    def train(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        with self._lock:
            if self.trainer is None:
                self.trainer = TrainRole(self.model_dir, self.run_dir, self.slot, torch_threads=self.torch_threads)
            t = self.trainer
        return t.train(args, ctx)

    def reconfigure(self, kinds: list[str], config: dict[str, Any]) -> int:
        with self._lock:
            self.switches += 1
            if "generate" not in kinds and self.rollout is not None:
                self.rollout.close()
                self.rollout = None
            if "train" not in kinds and self.trainer is not None:
                self.trainer.close()  # stops serving weights; its process group is left to the job
                self.trainer = None
            log.info("role_switched", kinds=kinds, role=config.get("role"), switches=self.switches)
            return 1 if "train" in kinds and "generate" not in kinds else self.max_batch


def role_handlers(role: str, model_dir: str | None, run_dir: str | None, slot: str, *, max_batch: int = 32,
                  torch_threads: int = 0) -> tuple[list[str], dict[str, list[str]], dict[tuple[str, str], Handler]]:
    """``(kinds, capabilities, handlers)`` for an engine role (``rollout`` or ``train``)."""
    if model_dir is None:
        raise ValueError(f"role {role!r} needs --model-dir")
    if role == "rollout":
        r = RolloutRole(model_dir, run_dir, slot, max_batch=max_batch, torch_threads=torch_threads)
        return ["generate"], {"generate": ["default"]}, {("generate", "*"): r.generate}
    if role == "train":
        t = TrainRole(model_dir, run_dir, slot, torch_threads=torch_threads)
        return ["train"], {"train": ["grpo"]}, {("train", "grpo"): t.train}
    raise ValueError(f"unknown role {role!r} (known: action, rollout, train, hybrid)")
