"""Seeded, calibrated generators of agentic-RL workload traces (``r2e``, ``search_r1``, ``dapo_math``).

:func:`generate` returns :class:`~libra.traces.TrajectorySpec` lists in submission order (step by
step, GRPO group by group); :func:`workload_stats` (from ``workload_stats.py``) reports the calibration
facts; ``python -m libra.sim.workloads ... --out FILE.jsonl [--stats]`` writes a trace file.

The generator is *causal*: each trajectory is sampled turn by turn from a plan of pending calls, and
each tool-return state (tool, payload size class, status) changes the plan (see
``WorkloadProfile``). A failure raises the failure probability of the next call (the cascade) and
queues 1-3 fix calls, more for a larger error output; a stubborn failure (a test run that keeps
failing) repeats for a number of rounds set by its severity. A large payload grows the context,
lengthens the next turn and may queue another call. The samples of a GRPO group share their prompt's
latent difficulty, which drives the failure rate and the amount of exploration; the prompt's own token
count is only weakly tied to it. Lengths drift with the step fraction. Same arguments and seed →
identical output: numpy ``PCG64`` streams are keyed by seed, prompt and (step, prompt), so a group
does not depend on what else is generated.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import deque
from collections.abc import Sequence

import numpy as np

from libra.traces import ElasticSpec, TrajectorySpec, Turn, size_class, write_trace
from libra.sim.workload_profiles import (
    PROFILES,
    PayloadMix,
    ToolKind,
    WorkloadProfile,
    get_profile,
    lerp,
)
from libra.sim.workload_stats import format_stats, workload_stats

__all__ = ["generate", "generate_group", "main", "workload_stats"]

_SALT_PROMPT = 0x5EED_0001
_SALT_GROUP = 0x5EED_0002


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    return float(median * math.exp(sigma * rng.standard_normal()))


def _fail_prob(base: float, shift: float) -> float:
    """``base`` moved by ``shift`` on the logit scale (0 and 1 stay put)."""
    if base <= 0.0 or base >= 1.0:
        return min(max(base, 0.0), 1.0)
    return _sigmoid(_logit(base) + shift)


def _mix(mix: PayloadMix, frac: float) -> np.ndarray:
    probs = np.array([max(lerp(span, frac), 0.0) for span in mix])
    out: np.ndarray = probs / probs.sum()
    return out


class _TrajectorySampler:
    """Samples one trajectory turn by turn; the pending-call queue is the agent's plan so far.

    Mutation rule: ``sample`` consumes the generator's stream and mutates the plan; one sampler
    samples one trajectory.
    """

    def __init__(self, profile: WorkloadProfile, frac: float, difficulty: float, rng: np.random.Generator) -> None:
        p = self.p = profile
        self.frac = frac
        self.rng = rng
        self.d = difficulty
        noise = rng.standard_normal()
        explore = 0
        if p.explore_tools:
            mean = lerp(p.explore_mean, frac) * math.exp(p.explore_difficulty * difficulty + p.explore_noise * noise)
            explore = p.min_explore + int(mean + rng.random())  # stochastic rounding: E[explore] = mean
        check = bool(p.check_tools) and rng.random() < lerp(p.check_prob, frac)
        self.pending: deque[str] = deque(["explore"] * explore + (["check"] if check else []))
        self.p_fail = {
            "explore": _fail_prob(lerp(p.p_explore_fail, frac), p.fail_difficulty * difficulty),
            "fix": _fail_prob(lerp(p.p_explore_fail, frac), p.fail_difficulty * difficulty),
            "check": _fail_prob(lerp(p.p_check_fail, frac), p.fail_difficulty * difficulty),
        }
        self.p_after_failure = lerp(p.p_fail_after_failure, frac)
        self.prev_status: str | None = None
        self.gen_scale = math.exp(p.gen_difficulty * difficulty)
        self.mix = {
            "explore": _mix(p.payload_explore, frac),
            "check": _mix(p.payload_check_success, frac),
            "failure": _mix(p.payload_failure, frac),
        }
        # A stubborn failure: the next ``rounds`` calls of ``role`` fail again with the same severity.
        self.stubborn: dict[str, tuple[int, int]] = {}
        self.checks = 0

    def _gen_tokens(self, median: float, prev_status: str | None, prev_size: str | None) -> int:
        p = self.p
        mult = 1.0
        if prev_status == "failure":
            mult *= p.after_failure
        elif prev_status == "timeout":
            mult *= p.after_timeout
        if prev_size == "medium":
            mult *= p.after_medium
        elif prev_size == "large":
            mult *= p.after_large
        return max(1, round(_lognormal(self.rng, median * self.gen_scale * mult, p.gen_sigma)))

    def _pick(self, tools: tuple[ToolKind, ...]) -> ToolKind:
        if len(tools) == 1:
            return tools[0]
        weights = np.array([t.weight for t in tools], dtype=float)
        return tools[int(self.rng.choice(len(tools), p=weights / weights.sum()))]

    def _outcome(self, role: str) -> tuple[str, int]:
        """(status, payload class index) of the next call of ``role``."""
        rng, p = self.rng, self.p
        if role in self.stubborn:
            rounds, severity = self.stubborn[role]
            if rounds > 0:
                self.stubborn[role] = (rounds - 1, severity)
                return "failure", severity
            # The stubborn failure is fixed: this call succeeds.
            return "success", int(rng.choice(3, p=self.mix["check" if role == "check" else "explore"]))
        p_fail = self.p_fail[role]
        if self.prev_status not in (None, "success"):
            p_fail = max(p_fail, self.p_after_failure)  # the cascade: errors beget errors
        u = rng.random()
        if u < p.p_timeout:
            return "timeout", 0
        if u < p.p_timeout + p_fail:
            severity = int(rng.choice(3, p=self.mix["failure"]))
            lo, hi = p.stubborn_rounds[severity]
            if role in p.stubborn_roles:
                extra = max(0.0, rng.uniform(lo, hi) + p.stubborn_difficulty * self.d)
                self.stubborn[role] = (int(extra), severity)
            return "failure", severity
        return "success", int(rng.choice(3, p=self.mix["check" if role == "check" else "explore"]))

    def _call(self, gen: int, role: str, status: str, cls_index: int, room: int) -> Turn:
        """A tool-calling turn of ``role`` that ended in ``status``; its payload is at most ``room``."""
        rng, p = self.rng, self.p
        tools = p.check_tools if role == "check" else p.explore_tools if role == "explore" else p.fix_tools
        tool = self._pick(tools)
        cls = p.payload_classes[cls_index]
        lo, hi = cls.bounds
        size_median = cls.median * (p.failure_payload_scale if status == "failure" else 1.0)
        payload = min(round(min(max(_lognormal(rng, size_median, cls.sigma), lo), hi)), room)
        elastic = None
        median = tool.seconds_median
        if tool.elastic_prob > 0 and rng.random() < tool.elastic_prob:
            f_lo, f_hi = tool.parallel_fraction
            fraction = round(float(rng.uniform(f_lo, f_hi)), 3)
            elastic = ElasticSpec(tool.elastic_resource, tool.elastic_max_units, fraction)
            median = tool.elastic_seconds_median
        s_lo, s_hi = tool.seconds_range
        seconds = round(min(max(_lognormal(rng, median, tool.seconds_sigma), s_lo), s_hi), 3)
        if status == "timeout":
            seconds = s_hi
        return Turn(
            gen_tokens=gen,
            tool=tool.name,
            tool_seconds=seconds,
            payload_tokens=payload,
            status=status,
            demand=None if tool.demand is None else dict(tool.demand),
            elastic=elastic,
        )

    def _consequences(self, role: str, status: str, size: str) -> None:
        """Push the calls a tool-return state causes onto the front of the plan."""
        p, rng = self.p, self.rng
        if status != "success":
            # The error output's size is the failure's severity: the fewest fix calls for a short
            # error, the most for a huge log; a timeout counts as a short error.
            lo, hi = p.extra_calls_on_failure
            severity = {"small": 0.0, "medium": 0.5, "large": 1.0}[size] if status == "failure" else 0.0
            extra = lo + int((hi - lo) * severity + 0.5)
            if role == "check":
                if self.checks < p.max_checks:
                    self.pending.appendleft("check")
                    self.pending.extendleft(["fix"] * extra)
            else:
                self.pending.extendleft(["fix"] * extra)
        if size == "large" and rng.random() < p.large_extra_prob:
            self.pending.appendleft("explore" if role == "explore" else "fix")

    def sample(self, prompt_tokens: int) -> tuple[Turn, ...]:
        """Turns of one trajectory whose prompt has ``prompt_tokens`` tokens (valid trace turns)."""
        p = self.p
        small_max, medium_max = p.size_thresholds
        ctx = prompt_tokens
        prev_size: str | None = None
        turns: list[Turn] = []
        while True:
            room = p.max_total - ctx
            final = not self.pending or len(turns) >= p.max_calls
            if not turns:
                median = lerp(p.first_gen_median, self.frac)
            elif final:
                median = lerp(p.final_gen_median, self.frac)
            else:
                median = lerp(p.gen_median, self.frac)
            gen = self._gen_tokens(median, self.prev_status, prev_size)
            # A tool call needs room for its output and at least one more generated token.
            if final or gen >= room - 2:
                turns.append(Turn(gen_tokens=max(1, min(gen, room))))
                return tuple(turns)
            ctx += gen
            role = self.pending.popleft()
            if role == "check":
                self.checks += 1
            status, cls_index = self._outcome(role)
            turn = self._call(gen, role, status, cls_index, p.max_total - ctx - 1)
            turns.append(turn)
            ctx += turn.payload_tokens or 0
            prev_size = size_class(turn.payload_tokens or 0, small_max, medium_max)
            self.prev_status = status
            self._consequences(role, status, prev_size)


def _step_fraction(step: int, steps: int, shape: float = 1.0) -> float:
    """Training progress in [0, 1] of ``step`` out of ``steps``, raised to the profile's ``drift_shape``."""
    return (step / (steps - 1)) ** shape if steps > 1 else 0.0


def _prompt(profile: WorkloadProfile, seed: int, index: int) -> tuple[float, int]:
    """(latent difficulty, prompt tokens) of dataset prompt ``index``; a pure function of its arguments."""
    rng = np.random.default_rng([seed, _SALT_PROMPT, index])
    difficulty = float(rng.standard_normal())
    lo, hi = profile.prompt_bounds
    median = profile.prompt_median * math.exp(profile.prompt_difficulty * difficulty)
    raw = _lognormal(rng, median, profile.prompt_sigma)
    return difficulty, round(min(max(raw, lo), hi))


def generate_group(
    profile: WorkloadProfile,
    *,
    step: int,
    steps: int,
    prompt_index: int,
    group_size: int,
    seed: int,
    first_id: int = 0,
) -> list[TrajectorySpec]:
    """The ``group_size`` samples of dataset prompt ``prompt_index`` submitted at ``step`` of ``steps``.

    Trajectory ids are ``t-{first_id + k:06d}``; prompt id ``p-{prompt_index:06d}``; group
    ``{prompt_id}@{step}``. Deterministic in its arguments.
    """
    difficulty, prompt_tokens = _prompt(profile, seed, prompt_index)
    frac = _step_fraction(step, steps, profile.drift_shape)
    rng = np.random.default_rng([seed, _SALT_GROUP, step, prompt_index])
    prompt_id = f"p-{prompt_index:06d}"
    group = f"{prompt_id}@{step}"
    out = []
    for k in range(group_size):
        turns = _TrajectorySampler(profile, frac, difficulty, rng).sample(prompt_tokens)
        out.append(TrajectorySpec(f"t-{first_id + k:06d}", prompt_id, step, group, prompt_tokens, turns))
    return out


def generate(
    name: str,
    steps: int,
    prompts_per_step: int,
    group_size: int = 16,
    seed: int = 0,
    *,
    dataset_size: int | None = None,
    profile: WorkloadProfile | None = None,
) -> list[TrajectorySpec]:
    """Generate ``steps × prompts_per_step × group_size`` trajectories of workload ``name``.

    Order: step, then group, then sample. Prompts are dataset rows drawn in order; with
    ``dataset_size`` they wrap around (a later epoch revisits a prompt with the same difficulty and
    prompt length), otherwise every group has a fresh prompt. ``profile`` overrides the named profile
    (for experiments). Raises ValueError for an unknown name or a non-positive count.
    """
    prof = profile if profile is not None else get_profile(name)
    for arg, value in (("steps", steps), ("prompts_per_step", prompts_per_step), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    if dataset_size is not None and (isinstance(dataset_size, bool) or dataset_size < 1):
        raise ValueError(f"dataset_size must be a positive integer or None, got {dataset_size!r}")
    out: list[TrajectorySpec] = []
    for step in range(steps):
        for i in range(prompts_per_step):
            index = step * prompts_per_step + i
            if dataset_size is not None:
                index %= dataset_size
            group = generate_group(
                prof, step=step, steps=steps, prompt_index=index, group_size=group_size, seed=seed, first_id=len(out)
            )
            out.extend(group)
    return out


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False,
        prog="python -m libra.sim.workloads",
        description="Generate a calibrated agentic-RL workload trace (JSON Lines, see docs/trace-format.md).",
    )
    ap.add_argument("--workload", required=True, choices=sorted(PROFILES), help="workload profile")
    ap.add_argument("--steps", type=int, default=20, help="RL steps (lengths drift over them; default 20)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (GRPO groups) per step (default 8)")
    ap.add_argument("--group-size", type=int, default=16, help="samples per prompt (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--dataset-size", type=int, default=None, help="dataset rows; prompts repeat after it")
    ap.add_argument("--out", default=None, help="output .jsonl file (omit to only print --stats)")
    ap.add_argument("--stats", action="store_true", help="print the calibration statistics table")
    ap.add_argument("--json", action="store_true", help="with --stats: print them as one JSON object")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad arguments, via argparse)."""
    ap = _build_parser()
    args = ap.parse_args(argv)
    if args.out is None and not args.stats:
        ap.error("nothing to do: give --out FILE and/or --stats")
    try:
        trajs = generate(
            args.workload, args.steps, args.prompts, args.group_size, args.seed, dataset_size=args.dataset_size
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.out is not None:
        n = write_trace(args.out, trajs)
        print(f"wrote {n} trajectories to {args.out}", file=sys.stderr)
    if args.stats:
        prof = get_profile(args.workload)
        stats = workload_stats(trajs, bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds)
        if args.json:
            print(json.dumps(stats))
        else:
            print(format_stats(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
