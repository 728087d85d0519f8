"""Costs a running RL job measured on itself, and the step time they predict. Pure (no clocks, no I/O).

The broker's job host (:mod:`libra.broker.job_train_steps`) feeds :meth:`MeasuredCosts.observe` once per trained
step with what that step measured:

- **rollout tokens/s per instance**: the tokens the step's trajectories generated, over the seconds their
  rollout window lasted, over the rollout instances serving (actors accepting ``generate``) at the time;
- **training tokens/s per rank**: the tokens the trainer ranks trained on (the dispatched trajectory tokens),
  over the seconds of the training attempt that succeeded, over the ranks that trained on data.

Both are kept as an exponentially weighted moving average (weight ``alpha`` on the newest step; the first
step sets them). The first ``warmup`` steps are measured and returned but not kept: their seconds hold one-off
set-up (the trainer's process group and first pass, engines' first batches). On the bundled tiny job step 1
trained in 5.08 s and step 2 in 0.06 s, so a prediction from step 1 was off by 3.8 in log terms. :meth:`MeasuredCosts.predict` turns them into a step's rollout, training and step seconds
for a split (rollout instances, training ranks) and the expected tokens (the last step's, unless given).

The model is linear in both counts: it assumes an instance's throughput does not depend on how many
instances share the rollout, and a rank's does not depend on how many ranks train. That is what the
measurements can support (one split at a time is observed); batching effects are not modelled. The step
time is ``max(rollout, train)`` when rollout and training overlap (an asynchronous pipeline, policy lag
>= 1) and their sum when they alternate (lag 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MeasuredCosts", "StepPrediction", "log_error", "prediction_error"]


@dataclass(frozen=True, slots=True)
class StepPrediction:
    """A step's predicted seconds for one split."""

    rollout_s: float
    train_s: float
    step_s: float
    instances: int
    ranks: int


class MeasuredCosts:
    """See the module docstring. ``overlap``: rollout and training of consecutive steps overlap."""

    def __init__(self, alpha: float = 0.5, overlap: bool = True, warmup: int = 0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"MeasuredCosts: alpha must be within (0, 1], got {alpha!r}")
        if warmup < 0:
            raise ValueError(f"MeasuredCosts: warmup must be >= 0, got {warmup!r}")
        self.alpha = alpha
        self.overlap = overlap
        self.warmup = warmup  # steps measured but not kept (one-off set-up in their seconds)
        self.rollout_tok_s: float | None = None  # per rollout instance (EWMA)
        self.train_tok_s: float | None = None  # per trainer rank (EWMA)
        self.gen_tokens: float | None = None  # the last step's generated tokens
        self.train_tokens: float | None = None  # the last step's trained tokens
        self.steps = 0  # steps observed

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self.alpha * new + (1.0 - self.alpha) * old

    def observe(self, *, gen_tokens: int, rollout_s: float, instances: int, train_tokens: int, train_s: float,
                ranks: int) -> tuple[float | None, float | None]:
        """One step's measurements; returns its own ``(rollout tok/s per instance, train tok/s per rank)``,
        each None when the step cannot measure it (no seconds, no tokens or no instance/rank)."""
        roll = gen_tokens / rollout_s / instances if rollout_s > 0 and instances > 0 and gen_tokens > 0 else None
        train = train_tokens / train_s / ranks if train_s > 0 and ranks > 0 and train_tokens > 0 else None
        if self.steps < self.warmup:  # a warm-up step: reported, not kept
            self.steps += 1
            return roll, train
        if roll is not None:
            self.rollout_tok_s = self._ewma(self.rollout_tok_s, roll)
            self.gen_tokens = float(gen_tokens)
        if train is not None:
            self.train_tok_s = self._ewma(self.train_tok_s, train)
            self.train_tokens = float(train_tokens)
        self.steps += 1
        return roll, train

    @property
    def ready(self) -> bool:
        """Whether both rates have been measured (a prediction can be made)."""
        return self.rollout_tok_s is not None and self.train_tok_s is not None

    def predict(self, instances: int, ranks: int, gen_tokens: float | None = None,
                train_tokens: float | None = None) -> StepPrediction | None:
        """The step's seconds with ``instances`` rollout instances and ``ranks`` training ranks (expected
        tokens: the last step's unless given); None before both rates are measured or for an empty side."""
        if not self.ready or instances < 1 or ranks < 1:
            return None
        assert self.rollout_tok_s is not None and self.train_tok_s is not None
        gen = self.gen_tokens if gen_tokens is None else gen_tokens
        trained = self.train_tokens if train_tokens is None else train_tokens
        roll = (gen or 0.0) / (self.rollout_tok_s * instances)
        train = (trained or 0.0) / (self.train_tok_s * ranks)
        step = max(roll, train) if self.overlap else roll + train
        return StepPrediction(roll, train, step, instances, ranks)

    def move_gain(self, instances: int, ranks: int, to_train: int) -> float | None:
        """Predicted step seconds saved by moving ``to_train`` slots from rollout to training (negative: back
        to rollout); > 0 means the move is predicted faster. None when either split cannot be predicted."""
        now = self.predict(instances, ranks)
        then = self.predict(instances - to_train, ranks + to_train)
        if now is None or then is None:
            return None
        return now.step_s - then.step_s

    def summary(self) -> dict[str, float | int | None]:
        """The current estimates (for step records and the planner's status)."""
        return {"rollout_tok_s_per_instance": self.rollout_tok_s, "train_tok_s_per_rank": self.train_tok_s,
                "gen_tokens": self.gen_tokens, "train_tokens": self.train_tokens, "steps": self.steps,
                "alpha": self.alpha, "overlap": self.overlap}


def log_error(predicted: float | None, measured: float | None) -> float | None:
    """``|log(predicted / measured)|``, or None when either is missing or not positive."""
    if predicted is None or measured is None or predicted <= 0 or measured <= 0:
        return None
    return abs(math.log(predicted / measured))


def prediction_error(pairs: Iterable[tuple[float | None, float | None]]) -> float | None:
    """Mean :func:`log_error` over the ``(predicted, measured)`` pairs that have both; None when none has."""
    errs = [e for e in (log_error(p, m) for p, m in pairs) if e is not None]
    return sum(errs) / len(errs) if errs else None
