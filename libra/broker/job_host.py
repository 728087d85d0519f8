"""The broker's RL job host: dataset rows → ``episode`` work → GRPO groups → ``train`` work → versions.

Pure (no I/O, no clocks: time comes in as ``now``). :class:`~libra.broker.state.BrokerState` owns one
:class:`JobHost` per submitted job (``JobSubmit``), submits the work the host asks for as ordinary
broker work (so it is queued, leased, retried and failed like any other) and hands it every reply.

The flow, per the design's RL job:

- **Episodes.** While :class:`~libra.broker.job_groups.JobState` admits (policy-lag bound), each new GRPO
  group becomes ``group_size`` ``episode`` works (name: the environment) carrying the dataset row, the
  group/index and a seed. An episode runner (``libra.actors.episode_role``) runs the agent loop through
  the broker — every model turn is ``generate`` work routed by C-MLFQ, every tool call ``action`` work —
  keeps the trajectory's tensors on its own data-plane server and replies with a small summary: reward,
  versions, token counts and the data-plane ``ref``.
- **Training.** When a batch is cut, the host computes the group-relative advantages from the rewards
  (the same formula as :func:`libra.engines.grpo.group_advantages`), asks the dispatch policy
  (``libra.policies.parallelism.dispatch``, EARL's layout-aware dispatch: balance tokens per rank) which rank trains on
  which trajectory, and submits one ``train`` work per rank naming, for every rank, the refs of its
  trajectories with their advantages and micro-batches. Each rank fetches its trajectories straight from
  the runners that hold them: the broker decides who gets what; the bytes never pass through it.
- **Elastic steps.** Under ``allocation = "grp_ehp"`` (:mod:`libra.broker.ehp`) each step asks the
  Elastic Hybrid Pool for its group: core ranks then hybrid replicas, a generation, and who contributes
  zeros (a joining replica: no trajectories; it loads rank 0's state first). Every work of the step carries
  the same group (``ElasticArgs``), the dispatch spreads the trajectories over the members that train, and
  the work of rank ``r`` is pinned to ``members[r]`` (``JobWork.pin``): no other actor may take it, and it
  fails (the step fails, the pool drops the step's generation) when that actor is gone. The step record names the members, the generation, the
  joiners' restored versions and each member's state-fetch and group-formation seconds.
- **Versions.** Rank 0's reply carries the new weights ref; the broker then attaches it to every
  ``generate`` turn it assigns that names no weights (rollout instances load it between turns).
- **Filter.** With ``filter_zero_variance`` a group whose rewards are all equal is dropped and another
  prompt admitted, at most ``max_extra_groups`` per step (:mod:`libra.broker.job_groups`); every step record
  says how many of the step's completed groups had zero variance (``zero_variance_share``), how many were
  filtered, and ``no_signal`` when every group it trains on has zero advantage.
- **Eval.** With ``eval_rows``, after every ``eval_every`` steps and after the last one an eval round
  (:mod:`libra.broker.job_eval_rounds`) runs the eval rows as ``episode`` work that is counted, never batched; its
  ``"kind": "eval"`` record joins the step records, and the job is done only after the last round.
- **Data position.** Row ``i`` handed out is ``rows[i % len(rows)]``; every record carries
  ``data_position`` = ``row_offset`` + rows handed out so far, and a step record names its ``checkpoint``
  (""): the client saves both so a resumed job (``step_offset``, ``row_offset``) continues the data order.
- **Progress.** One record per trained step (rewards, throughput, lag, dispatch balance, trainer
  metrics, a few transcripts, measured costs and the predicted step time) is kept, and one decision record
  (``"kind": "decision"``) per plan, role switch, bucket change, EHP join or leave and out-of-memory re-plan
  (:mod:`libra.broker.job_records`); ``JobPoll`` returns the records after a cursor (all kinds share one
  list, so none is lost or repeated) and the job's totals: ``oom_retries``, ``decisions`` ({what: count})
  and ``prediction_error`` (mean |log(predicted / measured)| step seconds).
- **Training** (steps, elastic groups, out-of-memory retries, measured costs) lives in
  :mod:`libra.broker.job_train_steps`.

Failure semantics: an episode that fails (after the broker's retries) makes its group smaller (a group of
fewer than 2 is dropped and re-admitted) and its error text (the runner's error line and traceback) is kept
for ``JobPoll`` (``failures``: those after the client's newest record); as many failures in a row as
``max(16, 2 x group_size x prompts_per_step)`` fail the job (an environment that fails every episode);
a ``train`` work that fails fails the job with the rank's error
(state ``failed``), except a trainer's out-of-memory failure, which retries the step with smaller micro-batches
and makes the broker's planner re-plan (:mod:`libra.broker.job_train_steps`); a cancelled job cancels its
outstanding work. Nothing is dropped silently: every
dropped group is counted in ``dropped_groups``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libra.config import ConfigError, from_mapping
from libra.policies.parallelism.dispatch import STRATEGIES
from libra.protocol.payloads_base import PayloadError
from libra.protocol.payloads_job import EpisodeArgs, EpisodeResult, EpisodeSpec

from .job_eval_rounds import EvalRounds
from .job_records import job_totals
from .job_groups import JobState, Trajectory
from .job_train_steps import JobWork, TrainSteps, group_advantages

__all__ = ["JobHost", "JobSpec", "JobWork", "group_advantages"]

RUNNING, DONE, FAILED, CANCELLED = "running", "done", "failed", "cancelled"


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job's settings as the broker needs them (the client builds it from the job file)."""

    steps: int
    prompts_per_step: int
    group_size: int
    max_policy_lag: int
    world_size: int  # trainer ranks; one train work per rank per step
    env: str  # episode work name: the environment episode runners run
    episode: dict[str, Any] = field(default_factory=dict)  # passed verbatim to runners (model dir, sampling, env)
    grpo: dict[str, Any] = field(default_factory=dict)  # passed verbatim to trainer ranks
    dispatch: str = "lpt"
    micro_batch_tokens: int = 4096
    scale_by_std: bool = True
    seed: int = 0
    master_port: int = 0
    checkpoint_dir: str = ""  # "" = no checkpoints
    checkpoint_every: int = 0  # 0: only after the last step
    checkpoint_optimizer: bool = False  # include the optimizer state (8 bytes a parameter with AdamW)
    keep_checkpoints: int = 2  # keep the newest this many checkpoints (0: all)
    episode_timeout_s: float = 1800.0
    train_timeout_s: float = 3600.0
    samples_per_step: int = 2
    filter_zero_variance: bool = False  # drop zero-variance groups and admit others (job_groups)
    max_extra_groups: int = 8  # ... at most this many per step
    step_offset: int = 0  # a resumed job: steps are numbered from step_offset + 1 (checkpoints too)
    row_offset: int = 0  # a resumed job: the data position of rows[0]
    eval_rows: list[dict[str, Any]] = field(default_factory=list)  # the eval set ([]: no eval rounds)
    eval_every: int = 0  # steps between eval rounds (0: only after the last step)
    eval_greedy: bool = True
    eval_k: int = 0  # sampled eval episodes per prompt (pass@k)
    eval_temperature: float = 1.0

    @classmethod
    def from_mapping(cls, data: Any) -> JobSpec:
        """Validate a ``JobSubmit.spec``; raises :class:`~libra.config.ConfigError` naming the key."""
        if not isinstance(data, dict):
            raise ConfigError("job spec must be a mapping")
        spec = from_mapping(cls, data, "job spec")
        problems = [f"{k} must be >= 1, got {getattr(spec, k)}" for k in
                    ("steps", "prompts_per_step", "world_size", "micro_batch_tokens") if getattr(spec, k) < 1]
        if spec.group_size < 2:
            problems.append(f"group_size must be >= 2, got {spec.group_size}")
        if spec.max_policy_lag < 0:
            problems.append(f"max_policy_lag must be >= 0, got {spec.max_policy_lag}")
        if min(spec.max_extra_groups, spec.step_offset, spec.row_offset, spec.eval_every, spec.eval_k) < 0:
            problems.append("max_extra_groups, step_offset, row_offset, eval_every and eval_k must be >= 0")
        if spec.keep_checkpoints < 0:
            problems.append(f"keep_checkpoints must be >= 0 (0: keep all), got {spec.keep_checkpoints}")
        if spec.dispatch not in STRATEGIES:
            problems.append(f"dispatch must be one of {', '.join(STRATEGIES)}, got {spec.dispatch!r}")
        if not (spec.episode_timeout_s > 0 and spec.train_timeout_s > 0):
            problems.append("episode_timeout_s and train_timeout_s must be > 0")
        if not spec.env:
            problems.append("env must name the environment")
        if problems:
            raise ConfigError("job spec: " + "; ".join(problems))
        return spec


class JobHost(TrainSteps):
    """One running job. The broker calls :meth:`take_work`, :meth:`on_reply`, :meth:`cancel`, :meth:`poll`."""

    def __init__(self, name: str, spec: JobSpec, rows: list[Any], now: float) -> None:
        if not rows:
            raise ConfigError("job has no dataset rows")
        try:
            self._episode = EpisodeSpec.from_wire(spec.episode)  # handed to every episode runner
        except PayloadError as exc:
            raise ConfigError(f"job spec: {exc}") from None
        self.name = name
        self.submit_request = ""  # the JobSubmit request id (a resubmission is answered, not re-run)
        self.spec = spec
        self.rows = rows
        self.state = JobState(spec.steps, spec.prompts_per_step, spec.group_size, spec.max_policy_lag,
                              filter_zero_variance=spec.filter_zero_variance, max_extra_groups=spec.max_extra_groups)
        self.evals = EvalRounds(name, spec.eval_rows, self._episode, greedy=spec.eval_greedy, k=spec.eval_k,
                                temperature=spec.eval_temperature, seed=spec.seed)
        self.phase = RUNNING
        self.error = ""
        self.records: list[dict[str, Any]] = []
        self.weights: dict[str, Any] | None = None
        self.started_at = now
        self.finished_at: float | None = None
        self.gen_tokens = 0
        self.episodes_failed = 0
        self.failures: list[dict[str, Any]] = []  # one per failed episode: seq, group, index, error
        self._failed_in_a_row = 0
        self._outbox: list[JobWork] = []
        self._live: dict[str, tuple[int, int, float]] = {}  # episode tag -> (group, index, admitted at)
        self._train: dict[str, Any] | None = None
        self._t_last = now
        self._tokens_last = 0
        self._n = 0
        self.elastic: Any = None  # the broker's ElasticPool (libra.broker.ehp) under allocation grp_ehp
        self._init_training()

    # ------------------------------------------------------------------ driving
    @property
    def active(self) -> bool:
        return self.phase == RUNNING

    def take_work(self, now: float) -> list[JobWork]:
        """Admit what the lag bound allows, cut a batch if one is ready; the work to submit now. Admission
        runs again after the cut: a cut drops the complete groups that went stale (or kept fewer than 2
        trajectories), and their places must be admitted now, for when nothing is outstanding no reply will
        come to call this again (the job would wait for ever)."""
        st = self.state
        self._admit(now)
        if self.active and self._train is None and (self.elastic is None or self.elastic.ready(self.spec.world_size)):
            batch = st.cut_batch()
            if batch is not None:
                self._start_train(batch, now)
            self._admit(now)
        out, self._outbox = self._outbox, []
        return out

    def _admit(self, now: float) -> None:
        st, s = self.state, self.spec
        while self.active and not st.finished and st.can_admit():
            g = st.admit(self.rows[st.admitted % len(self.rows)])
            for i in range(st.group_size):
                self._n += 1
                tag = f"ep:{g.gid}:{i}:{self._n}"
                self._live[tag] = (g.gid, i, now)
                args = EpisodeArgs(job=self.name, row=g.prompt, group=g.gid, index=i,
                                   seed=s.seed * 1_000_003 + g.gid * 1000 + i * 10, episode=self._episode)
                self._outbox.append(JobWork(tag, "episode", s.env, args.to_wire(), f"job:{self.name}/g{g.gid}/{i}",
                                            s.episode_timeout_s))

    def on_reply(self, tag: str, ok: bool, output: Any, error: str, now: float, attempts: int = 1,
                 code: str = "") -> None:
        """The one reply of work ``tag`` (its output if ``ok``, else the error text; ``attempts``: the
        broker's count of starts of that work; ``code``: a failed tool's own code, e.g. ``oom``)."""
        if tag.startswith("ep:"):
            self._on_episode(tag, ok, output, error, now)
        elif tag.startswith("ev:"):
            rec = self.evals.on_reply(tag, ok, output, now)
            if rec is not None:
                self.records.append({**rec, "data_position": self.spec.row_offset + self.state.admitted})
        elif tag.startswith("train:"):
            self._on_train(tag, ok, output, error, now, attempts, code)
        if self.active and self.state.finished and not self.evals.live:
            self.phase = DONE
            self.finished_at = now

    def cancel(self, why: str, now: float) -> None:
        if self.active:
            self.phase = CANCELLED
            self.error = why
            self.finished_at = now

    def outstanding(self) -> bool:
        return bool(self._live) or self._train is not None or bool(self.evals.live)

    def _maybe_eval(self, now: float) -> None:
        """Start the eval round due after the step just recorded (every ``eval_every`` steps, and the last)."""
        s = self.spec
        step = s.step_offset + self.state.steps_done
        if not self.evals.enabled or self.evals.running(step):
            return
        if self.state.finished or (s.eval_every and step % s.eval_every == 0):
            for tag, args, traj in self.evals.start(step, self.state.version, now):
                self._outbox.append(JobWork(tag, "episode", s.env, args, traj, s.episode_timeout_s))

    # ------------------------------------------------------------------ episodes
    def _on_episode(self, tag: str, ok: bool, out: Any, error: str, now: float) -> None:
        gid, idx, admitted = self._live.pop(tag, (-1, -1, now))
        st = self.state
        if gid < 0 or gid not in st.groups:
            return  # the group was dropped meanwhile
        t = self._trajectory(gid, idx, out) if ok else None
        if t is None:  # recorded (bounded text) for the driver's RUN/failures.jsonl; the group goes on smaller
            cap = 8192 if len(self.failures) < 1000 else 500
            self.failures.append({"seq": self.episodes_failed, "group": gid, "index": idx,
                                  "error": (error or "malformed episode result")[:cap]})
            self.episodes_failed += 1
            self._failed_in_a_row += 1
            st.fail(gid)
            if self._failed_in_a_row >= max(16, 2 * self.spec.group_size * self.spec.prompts_per_step):
                self.phase, self.finished_at = FAILED, now
                self.error = (f"{self._failed_in_a_row} episodes in a row failed (see failures.jsonl); the last: "
                              + (error or "malformed episode result").partition("\n")[0][:500])
            return
        self._failed_in_a_row = 0
        t.admitted_at, t.done_at = admitted, now
        self.gen_tokens += t.gen_tokens
        st.add(t)

    @staticmethod
    def _trajectory(gid: int, idx: int, out: Any) -> Trajectory | None:
        """The runner's summary (an :class:`EpisodeResult`) as a Trajectory, or None when it is malformed
        (counted as a failure)."""
        try:
            res = EpisodeResult.from_wire(out)
        except PayloadError:
            return None
        t = Trajectory(gid, idx, res.tokens, res.gen_tokens, res.reward, res.versions, res.ref.to_wire(), res.info)
        return t if t.tokens > 0 else None

    # ------------------------------------------------------------------ views
    def poll(self, cursor: int, limit: int | None = None) -> dict[str, Any]:
        """What ``JobPoll`` answers (see the message's docstring): at most ``limit`` records from ``cursor``."""
        c = max(0, cursor)  # failures after the newest record the client has (at most 256 a poll)
        page = self.records[c:] if limit is None else self.records[c:c + limit]
        f0 = next((int(r["episodes_failed"]) for r in reversed(self.records[:c]) if "episodes_failed" in r), 0)
        return {"failures": self.failures[f0:f0 + 256],
                "job": self.name, "state": self.phase, "error": self.error, "steps": self.spec.steps,
                "steps_done": self.state.steps_done, "version": self.state.version, "weights": self.weights,
                "records": page, "next_cursor": c + len(page), "more": c + len(page) < len(self.records),
                "dropped_groups": self.state.dropped_groups, "episodes_failed": self.episodes_failed,
                "episodes_running": len(self._live) + self.evals.live, "training": self._train is not None,
                "episodes_collected": sum(len(g.trajs) for g in self.state.groups.values()),
                **job_totals(self.records)}

    def summary(self) -> dict[str, Any]:
        """One line for ``python -m libra status``."""
        return {"state": self.phase, "steps_done": self.state.steps_done, "steps": self.spec.steps,
                "version": self.state.version, "episodes_running": len(self._live),
                "training": self._train is not None, "error": self.error, **job_totals(self.records)}
