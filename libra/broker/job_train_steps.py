"""The training half of the broker's RL job host (:class:`libra.broker.job_host.JobHost`). Pure.

- **Steps.** When a batch is cut, the host computes the group-relative advantages, asks the dispatch policy
  which rank trains on which trajectory and with which micro-batches, and submits one ``train`` work per rank
  (tag ``train:{step}:{rank}``; a retry: ``train:{step}:{rank}:a{n}``). Under ``grp_ehp`` the Elastic Hybrid
  Pool gives each attempt its group (:mod:`libra.broker.ehp`).
- **Out of memory → re-plan, never a crash.** A rank whose reply is the trainer's ``oom`` failure
  (``TrainStepFailed`` code ``oom``: the reply's ``tool_code``, or ``(oom)`` in its error text) does not fail
  the job: the host counts it in :attr:`TrainSteps.train_ooms` (the broker core forwards each to its planner's
  ``train_out_of_memory``, so the next planning round re-plans the layout), writes an ``oom_replan`` decision
  record, and retries the same step on the same trajectories with micro-batches half the size of the
  largest one that ran out (each retry halves again), under new tags: a late reply of the failed attempt
  names an older attempt and is ignored. The failed attempt's other ranks are not cancelled: the trainer
  all-reduces its failure flags, so every rank of the attempt fails the same step on its own and replies (a
  cancel would free an actor the broker still believes busy in the collective). When every micro-batch of the
  attempt that ran out was already one trajectory, the step cannot be split further and the job fails,
  saying so. Any other failure fails the job as before; an elastic step's failure always calls the pool's
  ``step_failed`` (the retry forms a new group generation).
- **Measured costs and predictions.** Each trained step feeds a
  :class:`~libra.policies.planner.measured.MeasuredCosts` (rollout tokens/s per instance, training tokens/s per
  rank); before a step's first attempt the host predicts its rollout, training and step seconds from the
  costs of the steps before it and the current split (``rollout_instances`` the broker last counted, the ranks
  that train on data, EHP members included). The Elastic Hybrid Pool gets the same costs to decide borrows
  and releases (``ElasticPool.plan_step``'s ``costs``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from libra.policies.parallelism.dispatch import plan_dispatch
from libra.policies.planner.measured import MeasuredCosts
from libra.protocol.payloads_refs import DataRef
from libra.protocol.payloads_train import ElasticArgs, TrainArgs, TrainPart

from .job_records import decision_record, step_record
from .job_groups import Group, zero_variance

__all__ = ["JobWork", "TrainSteps", "group_advantages", "is_oom"]

FAILED = "failed"


@dataclass(frozen=True, slots=True)
class JobWork:
    """One piece of work the host wants submitted. ``tag`` comes back with its reply. ``pin``: the only
    actor id that may take it (an elastic step's train work is pinned to its member)."""

    tag: str
    kind: str
    name: str
    args: dict[str, Any]
    trajectory: str | None
    timeout_s: float
    pin: str = ""


def group_advantages(rewards: list[float], groups: list[int], *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> list[float]:
    """``(r - mean_g) / (std_g + eps)`` (unbiased std) per group, or ``r - mean_g``; 0 for a group whose
    rewards are all equal or that has one member. Same contract as ``libra.engines.grpo.group_advantages``."""
    by: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        by.setdefault(g, []).append(float(r))
    stats = {}
    for g, rs in by.items():
        flat = len(rs) < 2 or len(set(rs)) == 1
        stats[g] = (statistics.fmean(rs), 0.0 if flat else statistics.stdev(rs), flat)
    out = []
    for r, g in zip(rewards, groups):
        mean, std, flat = stats[g]
        out.append(0.0 if flat else (r - mean) / (std + eps) if scale_by_std else r - mean)
    return out


def is_oom(code: str, error: str) -> bool:
    """Whether a failed train reply is the trainer's out-of-memory failure (its tool code, or the
    ``TrainStepFailed`` text ``train step failed (oom) ...``)."""
    return code == "oom" or "(oom)" in (error or "")


def _parse_tag(tag: str) -> tuple[int, int, int] | None:
    """``train:{step}:{rank}[:a{attempt}]`` → (step, rank, attempt), None when malformed."""
    parts = tag.split(":")
    try:
        attempt = int(parts[3][1:]) if len(parts) == 4 and parts[3].startswith("a") else 0
        if len(parts) not in (3, 4):
            return None
        return int(parts[1]), int(parts[2]), attempt
    except (IndexError, ValueError):
        return None


class TrainSteps:
    """The training steps of a ``JobHost`` (a mixin: the host owns ``spec``, ``state``, ``elastic`` ...)."""

    spec: Any
    state: Any
    elastic: Any
    weights: dict[str, Any] | None
    records: list[dict[str, Any]]
    phase: str
    error: str
    finished_at: float | None
    started_at: float
    _outbox: list[JobWork]
    _train: dict[str, Any] | None

    def _init_training(self) -> None:
        self.costs = MeasuredCosts(overlap=self.spec.max_policy_lag >= 1, warmup=1)  # step 1: set-up
        self.rollout_instances = 0  # actors accepting generate, as the broker last counted them
        self.train_ooms = 0  # out-of-memory failures of train steps (the broker forwards them to its planner)
        self._last_step: dict[str, Any] | None = None  # the newest step record
        self._pool_seen: int | None = None  # the pool's decisions already recorded (None: none looked at yet)

    def decide(self, what: str, text: str, detail: dict[str, Any] | None, now: float) -> None:
        """Add a decision record (``libra.broker.job_records.decision_record``) for the step being prepared."""
        step = self.spec.step_offset + self.state.steps_done + 1
        self.records.append(decision_record(what, step, now - self.started_at, text, detail))

    def _fail(self, why: str, now: float) -> None:
        self._train = None
        self.phase, self.error, self.finished_at = FAILED, why, now

    # ------------------------------------------------------------------ a step's attempts
    def _start_train(self, batch: list[Group], now: float) -> None:
        s, st = self.spec, self.state
        trajs = [t for g in batch for t in g.trajs]
        adv = group_advantages([t.reward for t in trajs], [t.group for t in trajs], scale_by_std=s.scale_by_std)
        step = s.step_offset + st.steps_done + 1
        ckpt = ""
        last = step == s.step_offset + s.steps
        if s.checkpoint_dir and (last or (s.checkpoint_every and step % s.checkpoint_every == 0)):
            ckpt = f"{s.checkpoint_dir.rstrip('/')}/step{step}"
        self._train = {"step": step, "trajs": trajs, "adv": adv, "t0": now, "checkpoint": ckpt, "attempt": 0,
                       "oom_retries": 0, "mbt": s.micro_batch_tokens, "prediction": None,
                       "zero_groups": sum(1 for g in batch if zero_variance(g)), "groups": len(batch),
                       "window": dict(st.window)}
        self._submit_attempt(now)

    def _plan_group(self, step: int) -> Any:
        """The EHP's group for this attempt (core ranks, then hybrid replicas), None without the pool."""
        if self.elastic is None:
            return None
        w, last = self.weights or {}, self._last_step or {}
        known = bool(w.get("endpoint")) and w.get("transport") is None  # the joiners' state source
        return self.elastic.plan_step(step, self.spec.world_size, known,
                                      last.get("rollout_time_s") or None, last.get("train_time_s") or None,
                                      costs=self.costs, instances=self.rollout_instances)

    def _submit_attempt(self, now: float) -> None:
        s, tr = self.spec, self._train
        assert tr is not None
        step, trajs, adv = tr["step"], tr["trajs"], tr["adv"]
        if self.elastic is not None and self._pool_seen is None:  # an earlier job's decisions are not ours
            self._pool_seen = len(self.elastic.decisions)
        group = self._plan_group(step)
        if group is not None:
            self._pool_decisions(now)
        n_train = len(group.trainers) if group else s.world_size
        lengths = [t.tokens for t in trajs]
        plan = plan_dispatch(lengths, n_train, micro_batch_tokens=tr["mbt"], strategy=s.dispatch)
        naive = plan_dispatch(lengths, n_train, strategy="round_robin")
        parts = [[TrainPart(ref=DataRef.from_wire(trajs[i].ref), advantage=adv[i], index=i) for i in idx]
                 for idx in plan.assignment]
        micro = [[list(mb) for mb in mbs] for mbs in plan.micro_batches]
        elastic = None
        if group is not None:  # zero-gradient members get no trajectories
            by = dict(zip(group.trainers, zip(parts, micro)))
            parts = [by[a][0] if a in by else [] for a in group.members]
            micro = [by[a][1] if a in by else [] for a in group.members]
            src = None
            if group.joining:
                w = self.weights or {}
                src = DataRef(endpoint=w["endpoint"], name=group.snapshot, server_key=w.get("server_key"))
            elastic = ElasticArgs(generation=group.generation, members=list(group.members), zero=list(group.zero),
                                  joining=list(group.joining), join_from=src, snapshot=group.snapshot if src else None)
        world = len(parts) if group else s.world_size
        if tr["attempt"] == 0:  # from the costs of the steps before this one only
            tr["prediction"] = self.costs.predict(self.rollout_instances, n_train)
        tr.update(plan=plan, naive=naive, group=group, world=world, outs={}, attempts={}, ta0=now, n_train=n_train,
                  lengths=lengths)
        suffix = f":a{tr['attempt']}" if tr["attempt"] else ""
        for r in range(world):
            args = TrainArgs(parts=parts, micro_batches=micro, world_size=world, rank=r, step=step,
                             master_port=s.master_port, grpo=s.grpo, checkpoint=tr["checkpoint"] or None,
                             checkpoint_optimizer=s.checkpoint_optimizer, keep_checkpoints=s.keep_checkpoints,
                             elastic=elastic, job=self.name)
            pin = group.members[r] if group is not None else ""  # only that member may take its rank's work
            self._outbox.append(JobWork(f"train:{step}:{r}{suffix}", "train", "grpo", args.to_wire(), None,
                                        s.train_timeout_s, pin))

    def _pool_decisions(self, now: float) -> None:
        """The pool's borrows and releases not recorded yet (a failed step's releases included) as
        ``ehp_join`` / ``ehp_leave`` decision records."""
        seen, self._pool_seen = self._pool_seen or 0, len(self.elastic.decisions)
        for d in self.elastic.decisions[seen:]:
            what = "ehp_join" if d["action"] == "borrow" else "ehp_leave"
            verb = "joins training" if what == "ehp_join" else "goes back to rollout"
            self.decide(what, f"EHP: hybrid actor {d['actor']} {verb} ({d['reason']})", dict(d), now)

    # ------------------------------------------------------------------ replies
    def _on_train(self, tag: str, ok: bool, out: Any, error: str, now: float, attempts: int = 1,
                  code: str = "") -> None:
        tr = self._train
        parsed = _parse_tag(tag)
        if tr is None or parsed is None or parsed[0] != tr["step"] or parsed[2] != tr["attempt"]:
            return  # another step's or an earlier attempt's late reply
        rank = parsed[1]  # an elastic step's work of rank r is pinned to members[r]
        group = tr["group"]
        if not ok or not isinstance(out, dict):
            if group is not None:
                self.elastic.step_failed(group)
            if not ok and is_oom(code, error):
                self._out_of_memory(rank, error, now)
            else:
                self._fail(f"train step {tr['step']} failed on rank {rank}: {error or 'bad reply'}", now)
            return
        tr["outs"][rank] = out
        tr["attempts"][rank] = attempts
        if len(tr["outs"]) < tr["world"]:
            return
        self._train = None
        outs = [tr["outs"].get(r, {}) for r in range(tr["world"])]
        if group is not None:
            self.elastic.step_done(group, {group.members[r]: o for r, o in enumerate(outs)})
        try:
            new_v = int(outs[0]["weights_version"])
            rec = step_record(self, tr, outs, now)
            rec.update(self._cost_record(tr, rec, now))
            self.state.step_done(new_v)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            self._fail(f"train step {tr['step']}: {exc}", now)
            return
        if isinstance(outs[0].get("weights"), dict):
            self.weights = outs[0]["weights"]
        self.records.append(rec)
        self._last_step = rec
        self._maybe_eval(now)  # type: ignore[attr-defined]

    def _out_of_memory(self, rank: int, error: str, now: float) -> None:
        """Rank ``rank`` of the current attempt ran out of memory: retry with smaller micro-batches, or fail
        when every micro-batch already held one trajectory (see the module docstring)."""
        tr = self._train
        assert tr is not None
        self.train_ooms += 1
        lengths, mbs = tr["lengths"], [mb for rank_mbs in tr["plan"].micro_batches for mb in rank_mbs]
        assignment = tr["plan"].assignment
        sizes = [len(mb) * max(lengths[assignment[r][p]] for p in mb)
                 for r, rank_mbs in enumerate(tr["plan"].micro_batches) for mb in rank_mbs if mb]
        if max((len(mb) for mb in mbs), default=0) <= 1:
            first = (error or "").partition("\n")[0][:300]
            self._fail(f"train step {tr['step']} ran out of memory on rank {rank} with one trajectory per "
                       f"micro-batch (micro_batch_tokens {tr['mbt']}, longest trajectory {max(lengths)} tokens) "
                       f"after {tr['oom_retries']} retries with smaller micro-batches: the batch cannot be split "
                       f"further; give the trainer more memory (more ranks, a larger TP) or shorter sequences. "
                       f"The rank said: {first}", now)
            return
        was = tr["mbt"]
        tr["mbt"] = max(1, min(was, max(sizes)) // 2)
        tr["attempt"] += 1
        tr["oom_retries"] += 1
        self.decide("oom_replan", f"train step {tr['step']} ran out of memory on rank {rank}: retry {tr['attempt']} "
                    f"with micro-batches of at most {tr['mbt']} tokens (was {was}); the planner re-plans",
                    {"rank": rank, "attempt": tr["attempt"], "micro_batch_tokens": tr["mbt"],
                     "was_micro_batch_tokens": was, "largest_micro_batch_tokens": max(sizes)}, now)
        self._submit_attempt(now)

    def _cost_record(self, tr: dict[str, Any], rec: dict[str, Any], now: float) -> dict[str, Any]:
        """The step's measured costs (fed to :attr:`costs`), its prediction and its OOM retries."""
        roll, train = self.costs.observe(gen_tokens=rec["gen_tokens"], rollout_s=rec["rollout_time_s"],
                                         instances=self.rollout_instances, train_tokens=sum(tr["lengths"]),
                                         train_s=now - tr["ta0"], ranks=tr["n_train"])
        p = tr["prediction"]
        return {"oom_retries": tr["oom_retries"], "micro_batch_tokens": tr["mbt"],
                "rollout_instances": self.rollout_instances, "train_ranks": tr["n_train"],
                "rollout_tok_s_per_instance": roll, "train_tok_s_per_rank": train,
                "measured_costs": self.costs.summary(),
                "predicted_rollout_s": None if p is None else p.rollout_s,
                "predicted_train_s": None if p is None else p.train_s,
                "predicted_step_s": None if p is None else p.step_s}
