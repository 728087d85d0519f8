"""A serving load trace for the borrowed-GPU simulation: diurnal with bursts, generated from documented parameters.

Role: the request arrivals of the inference-serving owner whose GPUs the RL job borrows
(:mod:`libra.sim.serving_owner`, ``python -m libra.bench borrowed``). Pure: numpy on a seeded generator, no
I/O, no clocks.

Shape and where it comes from (qualitative shapes only; every number below is a parameter of ours, stated
as such, not a figure read off those traces):

- a daily cycle: production LLM inference load rises in the working day and falls at night, as the Azure LLM
  inference traces show (2023: Patel et al., "Splitwise", ISCA 2024; 2024: the week-long trace of
  Stojkovic et al., "DynamoLLM", HPCA 2025) and as ROSE and RLBoost describe the spare capacity of serving
  fleets they harvest (docs/papers.md §6). Modelled as a cosine: rate ``mean · (1 + a·cos(2π(t − peak_s)/day))``
  with ``a = (1 − trough_ratio)/(1 + trough_ratio)``, so peak / trough = ``1 / trough_ratio``;
- bursts on top: BurstGPT (Wang et al., 2024, the Azure-OpenAI GPT service's logs) reports request
  arrivals far burstier than a Poisson process at the scale of minutes. Modelled as burst episodes starting
  as a Poisson process (``bursts_per_hour``), each multiplying the rate by ``burst_factor`` for an
  exponentially distributed time (mean ``burst_mean_s``), switched on at once (the worst case for an owner
  that has lent GPUs away);
- arrivals within a bin of ``bin_s`` seconds are Poisson with the bin's rate.

Defaults (:class:`ServingTraceParams`): peak at 14:00, trough = 0.3 × peak, peak diurnal load = 0.55 of the
fleet's capacity at its latency target (the fleet is provisioned for the peak with its bursts: 0.55 × 1.6 =
0.88 of capacity), 2 bursts an hour of mean 120 s at 1.6 × the rate. The rates are given as a fraction of
the fleet's capacity; :mod:`libra.sim.serving_owner` turns it into requests/s with the roofline cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DAY_S", "ServingTrace", "ServingTraceError", "ServingTraceParams", "serving_trace"]

DAY_S = 86_400.0


class ServingTraceError(ValueError):
    """A trace parameter out of range (the message names it)."""


@dataclass(frozen=True, slots=True)
class ServingTraceParams:
    """See the module docstring. ``peak_load`` is the diurnal peak as a fraction of the fleet's capacity."""

    peak_load: float = 0.55
    trough_ratio: float = 0.3
    peak_s: float = 14 * 3600.0
    bursts_per_hour: float = 2.0
    burst_factor: float = 1.6
    burst_mean_s: float = 120.0
    bin_s: float = 2.0

    def __post_init__(self) -> None:
        checks = (("peak_load", self.peak_load > 0), ("trough_ratio", 0 < self.trough_ratio <= 1),
                  ("bursts_per_hour", self.bursts_per_hour >= 0), ("burst_factor", self.burst_factor >= 1),
                  ("burst_mean_s", self.burst_mean_s > 0), ("bin_s", self.bin_s > 0),
                  ("peak_s", math.isfinite(self.peak_s)))
        for name, ok in checks:
            if not ok:
                raise ServingTraceError(f"ServingTraceParams.{name} out of range: {getattr(self, name)!r}")

    @property
    def amplitude(self) -> float:
        return (1 - self.trough_ratio) / (1 + self.trough_ratio)

    @property
    def mean_load(self) -> float:
        """The day's mean diurnal load (bursts excluded)."""
        return self.peak_load / (1 + self.amplitude)

    def diurnal(self, t: np.ndarray) -> np.ndarray:
        """The diurnal load (fraction of capacity) at times ``t`` (seconds from midnight of day 0)."""
        return self.mean_load * (1 + self.amplitude * np.cos(2 * math.pi * (t - self.peak_s) / DAY_S))


@dataclass(frozen=True, slots=True)
class ServingTrace:
    """Per-bin load: ``t[i]`` the bin's start, ``load[i]`` the rate (fraction of capacity) in it, ``burst[i]``
    whether a burst was on, ``bursts`` the episodes ``(start_s, end_s)``."""

    params: ServingTraceParams
    t: np.ndarray
    load: np.ndarray
    burst: np.ndarray
    bursts: tuple[tuple[float, float], ...]

    @property
    def horizon_s(self) -> float:
        return float(self.t.size * self.params.bin_s)

    def arrivals(self, capacity_rps: float, seed: int) -> np.ndarray:
        """Requests arriving in each bin for a fleet of ``capacity_rps`` requests/s at its target (Poisson)."""
        if not capacity_rps > 0:
            raise ServingTraceError(f"capacity_rps must be > 0, got {capacity_rps!r}")
        rng = np.random.default_rng([seed, 0x5E7])
        return rng.poisson(self.load * capacity_rps * self.params.bin_s)


def serving_trace(params: ServingTraceParams, horizon_s: float, seed: int, start_s: float = 0.0) -> ServingTrace:
    """The trace over ``[start_s, start_s + horizon_s)`` (time of day counted from midnight of day 0)."""
    if not (math.isfinite(horizon_s) and horizon_s > 0):
        raise ServingTraceError(f"horizon_s must be > 0, got {horizon_s!r}")
    n = max(1, math.ceil(horizon_s / params.bin_s))
    t = start_s + np.arange(n) * params.bin_s
    rng = np.random.default_rng([seed, 0xB0B])
    burst = np.zeros(n, dtype=bool)
    episodes: list[tuple[float, float]] = []
    if params.bursts_per_hour > 0:
        k = int(rng.poisson(params.bursts_per_hour * horizon_s / 3600.0))
        starts = np.sort(rng.uniform(0.0, horizon_s, size=k))
        lengths = rng.exponential(params.burst_mean_s, size=k)
        for s, d in zip(starts, lengths):
            a, b = int(s // params.bin_s), int(math.ceil((s + d) / params.bin_s))
            burst[a:b] = True
            episodes.append((start_s + float(s), start_s + float(s + d)))
    load = params.diurnal(t) * np.where(burst, params.burst_factor, 1.0)
    return ServingTrace(params, t, load, burst, tuple(episodes))
