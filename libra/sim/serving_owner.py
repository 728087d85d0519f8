"""The serving owner of borrowed GPUs: its fleet's capacity, its lending decisions and its SLO violations.

Role: decide, from a serving load trace (:mod:`libra.sim.serving_trace`), when each of the owner's GPUs is
lent to the RL job and when it is reclaimed (with the owner's deadline), and count the serving requests that
miss their SLO, with and without lending. :mod:`libra.sim.borrowed` replays the lending schedule into the
simulated RL cluster (hello / ``OwnerReclaim`` / ``Bid`` to the real ``BrokerState``). Pure: numpy and the
cost model, no I/O, no clocks.

Model (every piece ``modelled-only`` in the runtime's sense; the bench prints that):

- **Capacity per GPU** at the TPOT target, from the same roofline cost model the simulator's rollout
  instances use (:class:`~libra.policies.cost.RolloutCostModel`, TP 1): a request of ``prompt_tokens`` +
  ``output_tokens`` holds a batch slot for ``prefill + output · TPOT``; at ``x`` requests/s per GPU the
  running batch is ``b = x · that`` (Little's law) and ``TPOT = decode_step(b, b · mean context)``, linear in
  ``b`` (``a + k·b``), so ``TPOT(x) = (a + k·x·prefill) / (1 − k·x·output)`` and the capacity is the ``x``
  with ``TPOT = target`` (also capped by the KV cache and ``max_batch``). Prefill interference is ignored.
- **The owner rule decides per GPU** (:class:`~libra.policies.lending.HeadroomRule`, the runtime's rule):
  GPU ``i`` (0-based) reads the TPOT the fleet would have on its first ``i`` GPUs at the arrival rate of the
  last ``window_s`` (the "p99" it is given: the fluid TPOT, no tail), so GPU 0 is never lent and GPU ``i`` is
  lent while ``i`` GPUs serve the load with headroom. A reclaimed GPU serves again ``deadline_s`` (the slot
  may keep its contexts that long) plus ``wake_s`` (the serving engine's weights back from host memory over
  ``host_link_bw``) after the reclaim.
- **Spot-style revocations** (``revocations_per_gpu_hour``, Poisson per lent GPU-hour): the owner takes a
  lent GPU back for its own reasons with ``spot_deadline_s``, and lends it again no sooner than
  ``spot_away_s`` later; it returns to the owner's fleet as after any reclaim.
- **SLO violations**: per bin, the serving GPUs' capacity serves arrivals FIFO (a fluid queue); a request
  that cannot be served in the bin it arrives in (the queue grew past it) violates the SLO. Violations
  attributable to borrowing = violations with lending − violations without, on the same trace and seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from libra.policies.cost import RolloutCostModel
from libra.policies.lending import HeadroomRule
from libra.sim.serving_trace import ServingTrace

__all__ = ["LendEvent", "OwnerRun", "ServingCapacity", "ServingFleet", "run_owner", "slo_violations"]


@dataclass(frozen=True, slots=True)
class ServingFleet:
    """The owner's fleet and rule. Request shape and TPOT target are our parameters (a conversation-like
    request; 50 ms/token, the ``target_ms`` of the runtime's example ``--lend`` spec)."""

    gpus: int = 48
    prompt_tokens: int = 1024
    output_tokens: int = 256
    target_tpot_s: float = 0.05
    lend_below: float = 0.7
    reclaim_above: float = 0.85
    hold_s: float = 30.0
    deadline_s: float = 5.0
    window_s: float = 10.0
    host_link_bw: float = 25e9  # bytes/s host -> GPU (PCIe Gen4 x16, an assumption): the serving engine's wake-up
    revocations_per_gpu_hour: float = 0.0
    spot_deadline_s: float = 30.0
    spot_away_s: float = 600.0
    owner: str = "serving"

    def __post_init__(self) -> None:
        for name in ("gpus", "prompt_tokens", "output_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ServingFleet.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("target_tpot_s", "window_s", "host_link_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServingFleet.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("revocations_per_gpu_hour", "spot_deadline_s", "spot_away_s", "deadline_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ServingFleet.{name} must be >= 0, got {getattr(self, name)!r}")

    def rule(self) -> HeadroomRule:
        return HeadroomRule(self.target_tpot_s, self.lend_below, self.reclaim_above, self.hold_s, self.deadline_s)


@dataclass(frozen=True, slots=True)
class ServingCapacity:
    """The fleet's per-GPU serving arithmetic (see the module docstring)."""

    a: float  # TPOT with an empty batch (s)
    k: float  # TPOT added per running request (s)
    prefill_s: float
    output_tokens: int
    per_gpu_rps: float  # requests/s one GPU serves at the target
    wake_s: float

    @classmethod
    def from_cost_model(cls, cm: RolloutCostModel, fleet: ServingFleet) -> ServingCapacity:
        ctx = fleet.prompt_tokens + fleet.output_tokens / 2
        a0 = float(cm.decode_step(1, 1, ctx))
        k = float(cm.decode_step(1, 2, 2 * ctx)) - a0
        a = a0 - k
        if not (k > 0 and a < fleet.target_tpot_s):
            raise ValueError(f"the TPOT target {fleet.target_tpot_s}s is below one decode step ({a0:.4f}s)")
        p = float(cm.prefill_time(1, fleet.prompt_tokens))
        t = fleet.target_tpot_s
        x = (t - a) / (k * (p + t * fleet.output_tokens))
        hold = p + t * fleet.output_tokens  # seconds a request holds a batch slot at the target
        b_max = min(float(cm.cal.max_batch), float(cm.token_capacity(1)) / (fleet.prompt_tokens + fleet.output_tokens))
        x = min(x, b_max / hold)
        return cls(a, k, p, fleet.output_tokens, x, cm.weight_bytes_per_gpu(1) / fleet.host_link_bw)

    def tpot(self, per_gpu_rps: np.ndarray | float) -> np.ndarray:
        """The fluid TPOT at ``per_gpu_rps`` (``inf`` at or past saturation)."""
        x = np.asarray(per_gpu_rps, dtype=float)
        den = 1 - self.k * x * self.output_tokens
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(den > 0, (self.a + self.k * x * self.prefill_s) / np.where(den > 0, den, 1), np.inf)


@dataclass(frozen=True, slots=True)
class LendEvent:
    """``kind`` ``"lend"`` (the GPU may take rollout work) or ``"reclaim"`` (back within ``deadline_s``)."""

    t: float
    gpu: int
    kind: str
    deadline_s: float = 0.0
    reason: str = ""


@dataclass(slots=True)
class OwnerRun:
    """One run of the owner over a trace."""

    events: list[LendEvent] = field(default_factory=list)
    serving: np.ndarray | None = None  # GPUs serving per bin
    lent: np.ndarray | None = None  # GPUs lent per bin
    lent_gpu_s: float = 0.0
    reclaims: int = 0
    spot_revocations: int = 0


def _window_rate(arrivals: np.ndarray, bins: int, bin_s: float) -> np.ndarray:
    """Arrival rate over the last ``bins`` bins (inclusive) per bin."""
    c = np.concatenate([[0], np.cumsum(arrivals)])
    i = np.arange(1, arrivals.size + 1)
    lo = np.maximum(0, i - bins)
    return (c[i] - c[lo]) / ((i - lo) * bin_s)


def run_owner(trace: ServingTrace, arrivals: np.ndarray, fleet: ServingFleet, cap: ServingCapacity,
              seed: int, lend: bool = True) -> OwnerRun:
    """The owner's decisions over ``trace`` (see the module docstring); ``lend=False``: nothing is lent."""
    bin_s = trace.params.bin_s
    n, g = arrivals.size, fleet.gpus
    run = OwnerRun(serving=np.full(n, g), lent=np.zeros(n, dtype=int))
    if not lend:
        return run
    rule = fleet.rule()
    rate = _window_rate(arrivals, max(1, round(fleet.window_s / bin_s)), bin_s)
    # reading[b, i]: the TPOT GPU i is told in bin b (the fleet on its first i GPUs); GPU 0: inf
    per = np.full((n, g), np.inf)
    per[:, 1:] = rate[:, None] / np.arange(1, g)[None, :]
    reading = cap.tpot(per)
    rng = np.random.default_rng([seed, 0x5B07])
    p_spot = 1 - math.exp(-fleet.revocations_per_gpu_hour * bin_s / 3600.0)
    lent = [False] * g
    since = [-math.inf] * g
    back = [0.0] * g  # serving again from this time
    away = [0.0] * g  # not lent again before this time (spot)
    for b in range(n):
        now = float(trace.t[b])
        spot = rng.random(g) < p_spot if p_spot > 0 else None
        for i in range(1, g):
            r = float(reading[b, i])
            if lent[i] and spot is not None and spot[i]:
                lent[i], since[i] = False, now
                back[i], away[i] = now + fleet.spot_deadline_s + cap.wake_s, now + fleet.spot_away_s
                run.events.append(LendEvent(now, i, "reclaim", fleet.spot_deadline_s, "spot_notice"))
                run.spot_revocations += 1
                continue
            if not lent[i] and now < away[i]:
                continue
            sig = rule.step(lent[i], r if math.isfinite(r) else 1e9, now, since[i])
            if sig.allow and not lent[i]:
                lent[i], since[i] = True, now
                run.events.append(LendEvent(now, i, "lend"))
            elif not sig.allow and lent[i]:
                lent[i], since[i] = False, now
                back[i] = now + sig.deadline_s + cap.wake_s
                run.events.append(LendEvent(now, i, "reclaim", sig.deadline_s, sig.reason))
                run.reclaims += 1
        n_lent = sum(lent)
        run.lent[b] = n_lent
        run.serving[b] = sum(1 for i in range(g) if not lent[i] and back[i] <= now)
        run.lent_gpu_s += n_lent * bin_s
    return run


def slo_violations(arrivals: np.ndarray, serving: np.ndarray, cap: ServingCapacity, bin_s: float) -> int:
    """Requests that could not be served in the bin they arrived in (FIFO fluid queue; module docstring)."""
    backlog = 0.0
    late = 0.0
    per_bin = cap.per_gpu_rps * bin_s
    for a, s in zip(arrivals.tolist(), serving.tolist()):
        backlog = max(0.0, backlog + a - s * per_bin)
        late += min(a, backlog)
    return int(round(late))
