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

import importlib
import threading
from typing import Any

from libra.logging import get_logger

from .rollout_role import ROLLOUT_ENGINE_ENV, RolloutRole, make_rollout_engine
from .slot_records import default_actor_id, write_slot_record
from .tools import Handler, ToolError, WorkContext
from .train_role import TrainRole

__all__ = ["ROLLOUT_ENGINE_ENV", "HybridRole", "RolloutRole", "TrainRole", "make_rollout_engine", "role_handlers"]

log = get_logger("libra.roles")


class HybridRole:
    """A slot that can be a rollout instance or a trainer rank, switched by broker directives (the Elastic
    Hybrid Pool's worker, and how a plan moves GPUs between roles without restarting processes).

    Each engine runs where :func:`~libra.engines.device.placement.placement_from_env` puts the slot (its GPU in bf16
    on a GPU slot, the CPU otherwise) and is created on the first work of its kind (``eager``: the rollout engine
at start-up, as the actor runtime asks, so a hybrid slot's first turn does not wait for it). ``reconfigure(kinds,
    config)`` (called by the runtime after the actor drained for a directive) closes the engine of a kind no
    longer accepted and returns the capacity for the new role: 1 as a trainer rank, ``max_batch`` as a rollout
    instance. A rollout TP group (``config`` ``tp > 1``) is one engine: its leader (``rank`` 0) builds it over
    the group's GPUs at once (vLLM, ``tensor_parallel_size = tp``); the other members close their engines
    and hold none while grouped (their actor core bids for nothing). A directive for a TP degree the
    engine cannot serve raises :class:`~libra.engines.device.errors.TPUnsupported` before anything is closed.

    A switch frees what the old role held before anything new is built: the rollout role is closed
    (:meth:`RolloutRole.close`: batcher, engine, context service), the trainer rank too (:meth:`TrainRole.close`),
    every reference to them is dropped, and on CUDA the allocator's cache is emptied
    (:func:`~libra.engines.memory.release_memory`, which also says whether a reference cycle had to be
    collected). The memory before and after goes to the ``role_switched`` log line and to the slot's record
    ``RUN/actors/<actor id>.json`` (:mod:`libra.actors.slot_records`): ``switches`` and ``role_switches``
    (the last 20 ``{"switch", "kinds", "role", "released", "memory_before", "memory_after", "gc_needed",
    "still_alive", "at"}``).

    What a release keeps: :attr:`host_weights` (:class:`~libra.weights.host_copy.HostWeights`, unless
    ``$LIBRA_WEIGHTS_DELTA=0``), the last weights version its rollout engines fetched, in host memory (plain
    bytes, no reference to a role or an engine), handed to every :class:`RolloutRole` it builds: a slot whose
    engine was closed (``reconfigure(kinds=[])``, a reclaimed borrowed GPU) catches up by delta when it is
    built again.
    """

    def __init__(self, model_dir: str, run_dir: str | None, slot: str, *, max_batch: int = 32,
                 torch_threads: int = 0, placement: Any = None, eager: bool = False,
                 actor_id: str | None = None) -> None:
        from libra.engines.device.placement import placement_from_env

        from .rollout_role import rollout_engine_name

        if rollout_engine_name() == "hf":  # its imports now, outside any engine's constructor (see hf_rollout)
            importlib.import_module("libra.engines.hf_rollout")
        self.model_dir, self.run_dir, self.slot = model_dir, run_dir, slot
        self.actor_id = actor_id or default_actor_id(slot)  # keys the record file (slot_records)
        self.max_batch, self.torch_threads = max_batch, torch_threads
        self.placement = placement if placement is not None else placement_from_env(slot)
        self._lock = threading.Lock()
        self.rollout: RolloutRole | None = None
        self.trainer: TrainRole | None = None
        self.switches = 0
        self.group: tuple[str, int, int] = ("", 1, 0)  # (name, tp, rank) of the rollout group; "" ungrouped
        self.engines_built = 0
        self._on_kv_use: Any = None  # handed to each rollout engine's role: the actor's re-bid by KV use
        self.record: dict[str, Any] = {"switches": 0, "role_switches": []}  # in the slot's record file
        from libra.weights.delta import delta_enabled
        from libra.weights.host_copy import HostWeights

        # the last weights version its rollout engines fetched, in host memory: it outlives each RolloutRole, so
        # a slot whose engine was released (a reclaimed borrowed GPU) catches up by delta when it is rebuilt
        self.host_weights = HostWeights() if delta_enabled() else None
        if eager:  # a hybrid slot starts as rollout: build its engine before the first turn, as a rollout slot does
            self.rollout = self._new_rollout()

    @property
    def on_kv_use(self) -> Any:
        return self._on_kv_use

    @on_kv_use.setter
    def on_kv_use(self, fn: Any) -> None:  # set after start-up too: reaches an engine built eagerly
        self._on_kv_use = fn
        if getattr(self, "rollout", None) is not None:  # (a role built without __init__, as tests do, has none)
            self.rollout.on_kv_use = fn

    def _new_rollout(self) -> RolloutRole:
        from libra.engines.device.tp_groups import group_devices

        _, tp, rank = self.group
        devices = group_devices(self.slot, rank, tp) if tp > 1 else ()
        self.engines_built += 1
        r = RolloutRole(self.model_dir, self.run_dir, self.slot, max_batch=self.max_batch,
                        torch_threads=self.torch_threads, placement=self.placement, tp=tp, devices=devices,
                        record=self.record, host_weights=getattr(self, "host_weights", None),
                        actor_id=self.actor_id)
        r.on_kv_use = self.on_kv_use
        return r

    def generate(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        with self._lock:
            if self.group[2] > 0:
                raise ToolError("bad_request", f"slot {self.slot} is member {self.group[2]} of TP group "
                                               f"{self.group[0]!r}: its leader serves the group's turns")
            if self.rollout is None:
                self.rollout = self._new_rollout()
            r = self.rollout
        return r.generate(args, ctx)

    def train(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        with self._lock:
            if self.trainer is None:
                self.trainer = TrainRole(self.model_dir, self.run_dir, self.slot, torch_threads=self.torch_threads,
                                         placement=self.placement)
            t = self.trainer
        return t.train(args, ctx)

    def reconfigure(self, kinds: list[str], config: dict[str, Any]) -> int:
        from libra.engines.device.errors import TPUnsupported
        from libra.engines.device.placement import with_settings
        from libra.engines.device.tp_groups import max_tp_for

        from .rollout_role import rollout_engine_name

        tp, rank = int(config.get("tp", 1) or 1), int(config.get("rank", 0) or 0)
        rollout_group = "generate" in kinds and config.get("role", "rollout") == "rollout" and tp > 1
        if rollout_group and rank == 0 and tp > max_tp_for(rollout_engine_name(), tp):
            raise TPUnsupported(f"slot {self.slot}: the {rollout_engine_name()} rollout engine cannot lead a TP-{tp} "
                                "group (the HF engine serves TP 1 only)")
        group = (str(config.get("group", "")), tp, rank) if rollout_group else ("", 1, 0)
        placement = with_settings(self.placement, self.slot, config)  # the broker's [broker.engines], if any
        with self._lock:
            self.switches += 1
            regroup = group != self.group or placement != self.placement
            # the rollout role was drained by the actor core before this call; a trainer rank stops serving
            # weights (its process group is left to the job) or is rebuilt in a new dtype / memory budget
            drop_rollout = self.rollout is not None and ("generate" not in kinds or regroup)
            drop_trainer = self.trainer is not None and (placement != self.placement or "train" not in kinds
                                                         or group[2] > 0)
            released = self._release(drop_rollout, drop_trainer)
            self.placement = placement
            self.group = group
            if rollout_group and rank == 0 and self.rollout is None:
                self.rollout = self._new_rollout()  # the group's one engine, built now (after the release)
            self._note_switch(kinds, config.get("role"), released)
            log.info("role_switched", kinds=kinds, role=config.get("role"), switches=self.switches,
                     group=group[0] or None, tp=group[1], rank=group[2], released=released["released"],
                     memory_before=released["before"], memory_after=released["after"],
                     gc_needed=released["gc_needed"])
            if group[2] > 0:
                return 0  # a member: no engine, no capacity
            return 1 if "train" in kinds and "generate" not in kinds else self.max_batch

    def _device(self) -> Any:
        p = self.placement
        return p.device if p is not None and getattr(p, "on_gpu", False) else None

    def _release(self, rollout: bool, trainer: bool) -> dict[str, Any]:
        """Close and drop the rollout role and/or the trainer rank, then release their memory (see the class
        docstring); the record of what was released and the memory before and after."""
        from libra.engines.memory import memory_reading, release_memory, weak

        before = memory_reading(self._device())
        refs, what = [], []
        if rollout:
            r, self.rollout = self.rollout, None
            engine = getattr(r, "engine", None)
            refs += weak(r, engine, getattr(engine, "model", None))
            del engine
            r.close()  # type: ignore[union-attr]
            del r
            what.append("rollout")
        if trainer:
            t, self.trainer = self.trainer, None
            inner = getattr(t, "trainer", None)
            refs += weak(t, inner, getattr(inner, "model", None), getattr(inner, "optimizer", None))
            del inner
            t.close()  # type: ignore[union-attr]
            del t
            what.append("train")
        if not what:
            after = memory_reading(self._device())
            return {"released": what, "before": before, "after": after, "gc_needed": False, "still_alive": []}
        return {"released": what, **release_memory(before, refs, self._device())}

    def _note_switch(self, kinds: list[str], role: Any, released: dict[str, Any]) -> None:
        """Add this switch to the slot's record and write it (through the rollout role when there is one)."""
        import os
        import time

        entry = {"switch": self.switches, "kinds": list(kinds), "role": role, "at": time.time(),
                 "released": released["released"], "memory_before": released["before"],
                 "memory_after": released["after"], "gc_needed": released["gc_needed"],
                 "still_alive": released["still_alive"]}
        self.record["switches"] = self.switches
        self.record["role_switches"] = [*self.record["role_switches"][-19:], entry]
        if self.rollout is not None and hasattr(self.rollout, "write_status"):
            self.rollout.write_status()
            return
        if self.run_dir is None:
            return
        now = "rollout" if "generate" in kinds else "train" if "train" in kinds else "hybrid"
        write_slot_record(self.run_dir, self.slot, {**self.record, "slot": self.slot, "role": now, "pid": os.getpid()},
                          self.actor_id)


def role_handlers(role: str, model_dir: str | None, run_dir: str | None, slot: str, *, max_batch: int = 32,
                  torch_threads: int = 0,
                  actor_id: str | None = None) -> tuple[list[str], dict[str, list[str]], dict[tuple[str, str], Handler]]:
    """``(kinds, capabilities, handlers)`` for an engine role (``rollout`` or ``train``), its engine placed by
    :func:`~libra.engines.device.placement.placement_from_env` (the slot's GPU, or the CPU)."""
    from libra.engines.device.placement import placement_from_env

    if model_dir is None:
        raise ValueError(f"role {role!r} needs --model-dir")
    placement = placement_from_env(slot)
    log.info("engine_placement", slot=slot, role=role, device=placement.device, dtype=placement.dtype,
             memory_fraction=placement.memory_fraction, reason=placement.reason)
    if role == "rollout":
        r = RolloutRole(model_dir, run_dir, slot, max_batch=max_batch, torch_threads=torch_threads, placement=placement,
                        actor_id=actor_id)
        return ["generate"], {"generate": ["default"]}, {("generate", "*"): r.generate}
    if role == "train":
        t = TrainRole(model_dir, run_dir, slot, torch_threads=torch_threads, placement=placement)
        return ["train"], {"train": ["grpo"]}, {("train", "grpo"): t.train}
    raise ValueError(f"unknown role {role!r} (known: action, rollout, train, hybrid)")
