"""Typed payloads of RL jobs: ``episode`` work (:class:`EpisodeArgs` with its :class:`EpisodeSpec` and
:class:`EpisodeSampling`, the reply :class:`EpisodeResult`) and the ``JobPoll`` reply
(:class:`JobPollReply`).

No I/O. The broker's job host (``libra.broker.job_host``) builds ``EpisodeArgs`` for every member of a GRPO
group; an episode runner (``libra.actors.episode_role``) parses them (a malformed mapping is a
``bad_request`` failure) and replies with an ``EpisodeResult``; the job driver (``libra.rl.driver``)
reads ``JobPollReply``. The job's own settings (``JobSubmit.spec``) are validated by the broker's
``libra.broker.job_host.JobSpec``; its ``episode`` entry is an :class:`EpisodeSpec` handed to runners verbatim,
and ``JobSubmit.rows`` are the dataset rows (one mapping per prompt, the environment's ``to_row`` form).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .payloads_base import Payload
from .payloads_refs import DataRef

__all__ = ["EpisodeArgs", "EpisodeResult", "EpisodeSampling", "EpisodeSpec", "JobPollReply"]

NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class EpisodeSampling(Payload, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an episode samples its model turns (every turn's ``generate`` args take these)."""

    WHAT = "episode sampling"
    OMIT_DEFAULT = ("max_new_tokens", "temperature", "top_p", "max_total_tokens", "timeout_s")

    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 48
    """Most tokens one turn may generate."""
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_total_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1024
    """The whole trajectory's token budget (prompt, turns and tool output): each turn is capped to fit."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0
    """How long one turn may take, queueing included."""


class EpisodeSpec(Payload, frozen=True, kw_only=True):
    """The job-wide part of every episode's args (``JobSubmit.spec["episode"]``)."""

    WHAT = "episode spec"
    OMIT_DEFAULT = ("env_config", "sampling", "model_dir")  # the job file's settings, as written

    env_config: dict[str, Any] = msgspec.field(default_factory=dict)
    """``libra.rl.config.EnvConfig`` fields: the environment (``entry`` or ``name``), its ``options``
    (``[env.options]``), ``reward``, ``max_turns``; loaded and validated by the runner (``libra.envs.loader``)."""
    sampling: EpisodeSampling = msgspec.field(default_factory=EpisodeSampling)
    """How turns sample."""
    model_dir: str | None = None
    """The tokenizer's directory, used when it exists on the runner (else the slot's ``--model-dir``)."""


class EpisodeArgs(Payload, frozen=True, kw_only=True):
    """The args of one ``episode`` work (name: the environment), one member of a GRPO group."""

    WHAT = "episode args"
    OMIT_DEFAULT = ("group", "index")

    row: dict[str, Any]
    """The dataset row: a mapping the environment's ``from_row`` turns into its problem."""
    job: str = "job"
    """The job's name (part of the trajectory's data-plane name)."""
    group: NonNeg | None = None
    """The GRPO group's id."""
    index: NonNeg | None = None
    """This episode's position in its group."""
    seed: int = 0
    """Seeds the episode's turns (turn k uses ``seed + k``)."""
    episode: EpisodeSpec = msgspec.field(default_factory=EpisodeSpec)
    """Environment config, sampling and tokenizer location."""


class EpisodeResult(Payload, frozen=True, kw_only=True):
    """An episode runner's reply: a small summary; the trajectory's tensors (token ids, loss mask,
    rollout log-probs) stay on the runner's data-plane server under ``ref`` until a trainer fetches them."""

    WHAT = "episode result"

    reward: float
    """The environment's reward for the episode."""
    versions: list[NonNeg]
    """The weights version each model turn ran on, in order (the oldest sets the trajectory's version)."""
    gen_tokens: NonNeg
    """Tokens the model generated over all turns."""
    tokens: NonNeg
    """The whole sequence's length (prompt, turns, tool output): what dispatch balances."""
    ref: DataRef
    """Where the trajectory's tensors are (``traj/JOB/gG/I/WORK`` on the runner's server)."""
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    """The environment's own info (``correct``, ``formatted``, ``tool_calls``, ...) plus the decoded turns
    (``texts``), ``question``/``expected``, ``start``/``end`` wall-clock times, ``load_s`` (per turn:
    weights fetch+load seconds the rollout paid) and ``runner`` (the slot)."""


class JobPollReply(Payload, frozen=True, kw_only=True):
    """The output of the broker's Reply to ``JobPoll``."""

    WHAT = "job poll reply"
    OMIT_DEFAULT = ("failures", "oom_retries", "decisions", "prediction_error", "episodes_collected", "more")

    job: str
    """The job's name."""
    state: str
    """``running``, ``done``, ``failed`` or ``cancelled``."""
    error: str = ""
    """Why the job failed or was cancelled."""
    steps: NonNeg = 0
    """Steps the job runs in all."""
    steps_done: NonNeg = 0
    """Steps trained so far."""
    version: NonNeg = 0
    """The newest published policy version."""
    weights: dict[str, Any] | None = None
    """The newest weights ref (see :class:`~libra.protocol.payloads_refs.WeightsRef`), None before step 1."""
    records: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """From the poll's cursor on: one record per trained step (no ``kind``), eval records (``"kind": "eval"``)
    and decision records (``"kind": "decision"``, ``libra.broker.job_records``), in the order they were made."""
    next_cursor: NonNeg = 0
    """The cursor of the next poll."""
    more: bool = False
    """Records after ``next_cursor`` are waiting (the poll's ``limit`` cut this page): poll again at once."""
    dropped_groups: NonNeg = 0
    """GRPO groups dropped (too few members, or beyond the policy-lag bound)."""
    episodes_failed: NonNeg = 0
    """Episodes that failed after the broker's retries."""
    failures: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """The failed episodes after the newest record the poll's cursor has seen (at most 256): ``seq`` (the
    failure's number in the job, from 0), ``group``, ``index`` and ``error`` (the runner's error line, then
    the traceback; at most 8 KiB). A client dedups them by ``seq`` (the driver: ``RUN/failures.jsonl``)."""
    episodes_running: NonNeg = 0
    """Episodes in flight now."""
    episodes_collected: NonNeg = 0
    """Finished episodes in groups not yet cut into a batch: the next step's so far (with a policy-lag
    bound above 0 also a later step's). ``libra run``'s per-episode bar."""
    training: bool = False
    """Whether a step is being trained now."""
    oom_retries: NonNeg = 0
    """Training attempts retried with smaller micro-batches after a trainer ran out of memory (all steps)."""
    decisions: dict[str, int] = msgspec.field(default_factory=dict)
    """The job's decision records (``"kind": "decision"``) by ``what``: how many."""
    prediction_error: float | None = None
    """Mean |log(predicted / measured)| step seconds over the steps that had a prediction (None: none yet)."""
