"""Elastic ``train`` steps: a trainer rank (core or hybrid) in the broker's Elastic Hybrid Pool.

Role: what :class:`~libra.actors.train_role.TrainRole` runs for a ``train`` work whose args carry an
:class:`~libra.protocol.payloads_train.ElasticArgs` group (``allocation = "grp_ehp"``, ``libra.broker.ehp``).

Contracts:

- The work of rank ``r`` is pinned to ``members[r]`` by the broker (``Work.pin``), so only that member
  takes it; the member checks that ``members[rank]`` is its own actor id and fails the work with
  ``not_a_member`` otherwise (a broker that did not pin it).
- The trainer runs where the role's placement says (the slot's device, compute dtype and memory budget,
  fp32 master weights: as in the fixed group) and is created without a fixed process group; each step the member joins the group of the
  step's generation (``libra.engines.elastic_dp.ElasticGroup``: rendezvous store on 127.0.0.1:
  ``master_port``, hosted by rank 0; gloo, a GPU trainer's gradients staged through the CPU) when it changed, **on a thread of its own** while it fetches its
  shard and runs its forward and backward passes: the step's collectives all come after the passes
  (``GRPOTrainer.train_step(group_ready=...)``), so a member waits for a new group only if forming it takes
  longer than its own passes. It reports ``group_form_s`` (the formation's seconds) and ``group_wait_s``
  (how long its step waited for it).
- Rank 0 serves weights as in the fixed group, and when the group has joining members it first copies
  its state before the step (weights and AdamW state, ``elastic_dp.snapshot``) and publishes the copy on
  its data plane under ``snapshot`` from a thread, while it goes on with the step.
- A joining member takes the step with an empty shard and **joins first**: it forms the group and contributes its zero gradient to the all-reduce at once (it needs no weights for that), so the
  core ranks wait neither for the state transfer nor (beyond their own passes) for the group's formation. It fetches rank 0's
  state from ``join_from`` on a thread started before it forms the group (waiting while rank 0 has not
  published it yet, up to the fetch timeout: ``join_state_unavailable``), so the transfer overlaps the
  core's step, and loads it before its optimizer applies the reduced gradient
  (``GRPOTrainer.train_step(before_update=...)``): the same update applied to the same state leaves it with the
  core's weights. It reports the version it loaded (``restored_version``), its fetch seconds
  (``state_fetch_s``) and how long it waited for the fetch after the all-reduce (``state_wait_s``), both off
  the core's path unless the joiner is still loading when the next step's all-reduce comes.
- A member that contributes real gradients fetches its trajectories as in the fixed group.
- A pass that fails on any member fails the step on every member (``TrainStepFailed``: ``oom`` or
  ``train_failed``, weights unchanged); a joiner still loads the core's state, which the failed step left as
  it was, so it holds the core's weights for the next step.
- Only rank 0 packs the weights after a step; every member reports the fingerprint of its master weights.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from libra.logging import get_logger
from libra.protocol.payloads_refs import WeightsRef
from libra.protocol.payloads_train import TrainArgs, TrainResult

from .tools import ToolError, WorkContext

__all__ = ["elastic_step"]

log = get_logger("libra.roles")


def _ensure_trainer(role: Any, ta: TrainArgs, rank: int) -> Any:
    """The role's trainer (created on the first elastic work, with no fixed group); rank 0 also serves."""
    from libra.engines.elastic_dp import ElasticGroup
    from libra.engines.trainer import GRPOConfig, GRPOTrainer

    if role.trainer is None:
        opts: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in ta.grpo.items()}
        opts.pop("master_addr", None)  # the elastic group's rendezvous is on 127.0.0.1 (one host for now)
        if opts.pop("parallel", "auto") not in ("auto", "ddp"):
            raise ToolError("bad_request", "an elastic group joins whole replicas: parallel must be ddp or auto")
        try:
            cfg = GRPOConfig(**opts)
        except (TypeError, ValueError) as exc:
            raise ToolError("bad_request", f"train config: {exc}") from None
        try:
            role.trainer = GRPOTrainer(role.model_dir, cfg, parallel="ddp", **role.trainer_placement())
        except ValueError as exc:  # fp16, a bad option
            raise ToolError("bad_request", f"train config: {exc}") from None
        role.elastic = ElasticGroup()  # gloo: CUDA gradients are staged through the CPU (engines.collectives)
    if rank == 0 and role.server is None:  # core rank 0 never changes: it serves weights and state
        role.serve_weights()
    return role.trainer


def _fetch_state(role: Any, ta: TrainArgs) -> tuple[dict[str, Any], int]:
    """Fetch rank 0's state from ``join_from``, waiting until it is published; the state and its version."""
    from libra.dataplane import ObjectNotFound, ObjectRef, fetch_state_dict

    e = ta.elastic
    assert e is not None and e.join_from is not None
    ref = ObjectRef.from_wire(e.join_from.to_wire())
    deadline = time.monotonic() + role.fetch_timeout_s
    while True:
        try:
            sd, hdr, _ = fetch_state_dict(ref, keys=role.keys, idle_timeout_s=role.fetch_timeout_s)
            return sd, int(hdr.version)
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise ToolError("join_state_unavailable", f"{ref.endpoint} did not publish {ref.name!r} within "
                                                          f"{role.fetch_timeout_s}s") from None
            time.sleep(0.05)


class _StateFetch:
    """A joiner's state fetch on a thread of its own: started before the member forms the group, so the
    transfer overlaps the core's step; :meth:`load` waits for it and loads it (in ``before_update``)."""

    def __init__(self, role: Any, ta: TrainArgs) -> None:
        self.started = time.perf_counter()
        self.fetched_s = 0.0  # the fetch's own seconds
        self.waited_s = 0.0  # how long load() waited for it (after the all-reduce)
        self.version: int | None = None  # the version load() loaded
        self._got: tuple[dict[str, Any], int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(role, ta), name="ehp-state-fetch", daemon=True)
        self._thread.start()

    def _run(self, role: Any, ta: TrainArgs) -> None:
        try:
            self._got = _fetch_state(role, ta)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the step's thread by load()
            self._error = exc
        self.fetched_s = time.perf_counter() - self.started

    def load(self, trainer: Any) -> None:
        """Wait for the fetch and load it into ``trainer`` (sets :attr:`version` and :attr:`waited_s`)."""
        from libra.engines.elastic_dp import SnapshotError, restore

        w0 = time.perf_counter()
        self._thread.join()
        self.waited_s = time.perf_counter() - w0
        if self._error is not None:
            raise self._error
        assert self._got is not None
        sd, version = self._got
        try:
            restore(trainer.model, trainer.optimizer, sd)
        except SnapshotError as exc:
            raise ToolError("join_state_mismatch", str(exc)) from None
        trainer.weights_version = trainer.step = self.version = version


class _GroupForm:
    """The step's group, formed on a thread of its own while the member fetches its shard and runs its passes;
    :meth:`wait` (the trainer's ``group_ready``) waits for it before the step's first collective."""

    def __init__(self, group: Any, spec: Any) -> None:
        self.form_s = 0.0  # the formation's own seconds
        self.waited_s = 0.0  # how long the step waited for it
        self.formed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(group, spec), name="ehp-group-form", daemon=True)
        self._thread.start()

    def _run(self, group: Any, spec: Any) -> None:
        t0 = time.perf_counter()
        try:
            self.formed = group.ensure(spec)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the step's thread by wait()
            self._error = exc
        self.form_s = time.perf_counter() - t0

    def join(self) -> None:
        """Wait for the formation to end, whatever its outcome (the step failed before ``wait``)."""
        self._thread.join()

    def wait(self) -> None:
        w0 = time.perf_counter()
        self._thread.join()
        self.waited_s += time.perf_counter() - w0
        if self._error is not None:
            raise ToolError("rendezvous_failed", f"forming the step's group: {type(self._error).__name__}: "
                                                 f"{self._error}") from None


def _publish_on_a_thread(server: Any, name: str, state: dict[str, Any], version: int) -> None:
    """Pack and publish rank 0's state snapshot for the joiners on a thread of its own: rank 0 goes on with
    its step at once; a joiner's fetch waits (``ObjectNotFound`` retries) until it is served."""

    def publish() -> None:
        try:
            server.publish_state_dict(name, state, version=version, topic="ehp/state", keep=1)
        except Exception as exc:  # noqa: BLE001 - the joiner then fails with join_state_unavailable
            log.error("ehp_state_publish_failed", name=name, error=repr(exc))

    threading.Thread(target=publish, name="ehp-state-publish", daemon=True).start()


def _train(trainer: Any, shard: Any, micro: Any, form: _GroupForm, fetch: _StateFetch | None) -> dict[str, Any]:
    """The member's ``train_step``; a joiner whose step failed still loads the (unchanged) core state."""
    from libra.engines.trainer import TrainStepFailed

    try:
        return trainer.train_step(shard, micro_batches=micro, group_ready=form.wait,
                                  before_update=(lambda: fetch.load(trainer)) if fetch is not None else None)
    except TrainStepFailed:
        if fetch is not None and fetch.version is None:
            fetch.load(trainer)
        raise


def elastic_step(role: Any, ta: TrainArgs, ctx: WorkContext) -> dict[str, Any]:
    """One elastic ``train`` work for ``role`` (a ``TrainRole``; the caller holds its lock)."""
    from libra.dataplane import DataPlaneError
    from libra.engines.elastic_dp import GroupSpec, snapshot
    from libra.engines.grpo import TrainBatch

    e = ta.elastic
    assert e is not None
    rank = ta.rank
    if not (0 <= rank < len(e.members)) or e.members[rank] != ctx.actor_id:
        raise ToolError("not_a_member", f"actor {ctx.actor_id!r} took rank {rank}'s work of the group {e.members}")
    trainer = _ensure_trainer(role, ta, rank)
    role.tag_weights(ta.job)  # before the snapshot and the weights are published
    if rank == 0 and e.snapshot:  # copied now (the step changes it); packed and published off the step's path
        _publish_on_a_thread(role.server, e.snapshot, snapshot(trainer.model, trainer.optimizer),
                             trainer.weights_version)
    fetch = _StateFetch(role, ta) if ctx.actor_id in e.joining else None  # overlaps group formation and step
    form = _GroupForm(role.elastic, GroupSpec(e.generation, rank, len(e.members), "127.0.0.1", ta.master_port))
    trainer.rank, trainer.world_size = rank, len(e.members)
    zero = ctx.actor_id in e.zero
    fetched: dict[str, Any] = {}
    try:
        if zero:
            shard, micro = TrainBatch([], [], [], []), []
        else:
            try:
                shard, micro, fetched = role._fetch_parts(ta.parts[rank], ta.micro_batches[rank:][:1])
            except (DataPlaneError, ValueError, TypeError, KeyError) as exc:
                raise ToolError("shard_fetch_failed", f"rank {rank}: {type(exc).__name__}: {exc}") from None
        # a joiner's zero gradient is in once the update is due: it then catches up with the core's state
        step_metrics = role.run_step(lambda: _train(trainer, shard, micro, form, fetch))
    finally:
        form.join()  # never leave a formation running into the next step
    if form.formed:
        log.info("elastic_group_formed", generation=e.generation, rank=rank, world_size=len(e.members),
                 form_s=round(form.form_s, 4), waited_s=round(form.waited_s, 4))
    timing = {"group_form_s": form.form_s, "group_wait_s": form.waited_s, "state_fetch_s": 0.0}
    if fetch is not None:
        timing.update(state_fetch_s=fetch.fetched_s, state_wait_s=fetch.waited_s)
    metrics = {**step_metrics, **timing}
    restored = fetch.version if fetch is not None else None
    version = trainer.weights_version
    weights, publish_s, checkpoint = None, 0.0, None
    if rank == 0:
        t0 = time.perf_counter()
        weights = WeightsRef.from_wire(role.publisher.publish(version, trainer.state_dict_for_sync(copy=False)))
        publish_s = time.perf_counter() - t0
        if ta.checkpoint:
            trainer.save_checkpoint(ta.checkpoint, optimizer=ta.checkpoint_optimizer, keep_last=ta.keep_checkpoints)
            checkpoint = ta.checkpoint
    return TrainResult(rank=rank, metrics=metrics, weights_version=version, checksum=role.checksum(), weights=weights,
                       publish_s=publish_s, shard_sequences=len(shard), shard_tokens=sum(shard.lengths()),
                       checkpoint=checkpoint, member=ctx.actor_id, generation=e.generation, restored_version=restored,
                       zero=zero, **fetched).to_wire()
