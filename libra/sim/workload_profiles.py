"""Parameter profiles of the calibrated workload generators (``r2e``, ``search_r1``, ``dapo_math``).

A :class:`WorkloadProfile` is plain data: every number the sampler in ``workloads.py`` draws from.
A :data:`Span` ``(at_step_0, at_last_step)`` is interpolated linearly in the step fraction ``(step /
(steps - 1)) ** drift_shape``, which is how the length distribution drifts over training (the shape
exponent straightens the mean-length curve, since several drifting factors multiply). No sampling code
and no mutable state live here.

Provenance (``docs/papers.md``): the 40,960-token cap, 16 samples per prompt, the 2,048-token
R2E prompt cap, the R2E payload-size thresholds 1000/12000, the per-workload bucket thresholds, the
tool-time ranges and Tangram's elastic parallel fraction 0.6-0.8 come from the sources [W][C], as do
R2E's calibration targets (long tail, tool outcome → length examples, mean length 2.5K → 11.5K). The
episode model, every coefficient, and the Search-R1 / DAPO-Math length targets are guesses [G], tuned
so that ``workload_stats`` reproduces those facts; ``tests/unit/test_sim_workloads.py`` pins them, so a
number here may be retuned as long as those tests pass.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_MODEL_LEN = 40_960
"""Maximum total sequence length (prompt + generated + tool tokens) of Libra's runs [W]."""

Span = tuple[float, float]
"""``(value at step 0, value at the last step)``, interpolated linearly in the (shaped) step fraction."""


def lerp(span: Span, frac: float) -> float:
    """Linear interpolation of ``span`` at ``frac`` in [0, 1]."""
    return span[0] + (span[1] - span[0]) * frac


@dataclass(frozen=True, slots=True)
class ToolKind:
    """One tool the agent calls, with its execution-time distribution and resource needs.

    ``tool_seconds`` is lognormal (``seconds_median``, ``seconds_sigma``) clipped to ``seconds_range``;
    a timed-out call takes the upper bound. With probability ``elastic_prob`` a call is build/test-like:
    its median becomes ``elastic_seconds_median`` and it carries an ``elastic`` spec over
    ``elastic_resource`` with a parallel fraction drawn uniformly from ``parallel_fraction``.
    ``weight`` is the relative choice weight among the tools of the same role; ``demand`` is the demand
    vector copied into every call (``None``: no ``demand`` field).
    """

    name: str
    weight: float
    seconds_median: float
    seconds_sigma: float
    seconds_range: Span
    demand: tuple[tuple[str, float | str], ...] | None = None
    elastic_prob: float = 0.0
    elastic_seconds_median: float = 0.0
    elastic_resource: str = "cpu"
    elastic_max_units: int = 8
    parallel_fraction: Span = (0.6, 0.8)


@dataclass(frozen=True, slots=True)
class PayloadClass:
    """A tool-return size class: lognormal tokens (``median``, ``sigma``) clipped to ``bounds``."""

    median: float
    sigma: float
    bounds: Span


PayloadMix = tuple[Span, Span, Span]
"""Probabilities of the (small, medium, large) payload classes, each a :data:`Span`."""


@dataclass(frozen=True, slots=True)
class WorkloadProfile:
    """Every parameter of one workload's episode model (all token counts are tokens).

    A GRPO group shares a latent difficulty ``d ~ N(0, 1)``; each sample adds private noise ``e``.
    With ``s`` the step fraction raised to ``drift_shape``, an episode is:

    1. **explore**: ``min_explore + round(explore_mean(s) · exp(explore_difficulty·d + explore_noise·e))``
       calls of the explore tools (stochastic rounding);
    2. **check** (with probability ``check_prob(s)``; R2E always): run the tests / verify the answer.
       A failure (or timeout) queues fix calls (``fix_tools``) and another check, up to ``max_checks``;
    3. a final turn without a tool call.

    Tool-return states drive what follows:

    - each call fails with ``sigmoid(logit(p_fail) + fail_difficulty·d)`` (``p_explore_fail`` or
      ``p_check_fail``), raised to ``p_fail_after_failure`` right after a failed call (the cascade);
    - the failure's payload class is its *severity*. It sets how many fix calls it queues (from
      ``extra_calls_on_failure[0]`` for a small error to ``[1]`` for a large one) and, for the roles in
      ``stubborn_roles``, how many more calls of that role will fail the same way
      (``uniform(stubborn_rounds[class]) + stubborn_difficulty·d``, rounded down) before one succeeds;
    - a large payload queues one more call with ``large_extra_prob``;
    - the next turn's generated tokens are scaled by ``after_failure``/``after_timeout`` and
      ``after_medium``/``after_large``.

    Generated tokens per turn are lognormal (``gen_sigma``) around ``first_gen_median`` /
    ``gen_median`` / ``final_gen_median`` × ``exp(gen_difficulty·d)``. Payload sizes are lognormal per
    class (failure outputs ``failure_payload_scale`` × longer), class probabilities from
    ``payload_explore`` / ``payload_check_success`` / ``payload_failure``. An episode ends at
    ``max_total`` tokens (the last turn is cut) or ``max_calls`` calls. ``size_thresholds`` and
    ``bucket_thresholds`` are the C-MLFQ size classes and rollout-bucket limits used to report it;
    ``target_mean_total`` documents the calibrated mean total length at the first and last step.
    """

    name: str
    description: str
    explore_tools: tuple[ToolKind, ...]
    check_tools: tuple[ToolKind, ...]
    fix_tools: tuple[ToolKind, ...]
    # prompt
    prompt_median: float
    prompt_sigma: float
    prompt_bounds: Span
    prompt_difficulty: float
    # episode structure
    min_explore: int
    explore_mean: Span
    explore_difficulty: float
    explore_noise: float
    check_prob: Span
    max_checks: int
    max_calls: int
    # statuses
    p_explore_fail: Span
    p_check_fail: Span
    fail_difficulty: float
    p_fail_after_failure: Span
    stubborn_rounds: tuple[Span, Span, Span]
    stubborn_difficulty: float
    stubborn_roles: tuple[str, ...]
    p_timeout: float
    extra_calls_on_failure: tuple[int, int]
    large_extra_prob: float
    # generated tokens
    first_gen_median: Span
    gen_median: Span
    final_gen_median: Span
    gen_sigma: float
    gen_difficulty: float
    after_failure: float
    after_timeout: float
    after_medium: float
    after_large: float
    # payloads
    payload_explore: PayloadMix
    payload_check_success: PayloadMix
    payload_failure: PayloadMix
    payload_classes: tuple[PayloadClass, PayloadClass, PayloadClass]
    failure_payload_scale: float
    size_thresholds: tuple[int, int]
    bucket_thresholds: tuple[int, ...]
    target_mean_total: Span
    drift_shape: float = 1.0
    max_total: int = MAX_MODEL_LEN


_CPU1: tuple[tuple[str, float | str], ...] = (("cpu", 1),)

_BASH = ToolKind("bash", 1.0, 0.8, 0.6, (0.5, 10.0), demand=_CPU1, elastic_prob=0.08, elastic_seconds_median=3.0)
_PYTEST = ToolKind("python", 1.0, 2.0, 0.6, (0.5, 10.0), demand=_CPU1, elastic_prob=0.85, elastic_seconds_median=3.5)

R2E = WorkloadProfile(
    name="r2e",
    description="R2E-Gym software-engineering agent: explore with bash, run tests with python, fix, re-test",
    explore_tools=(_BASH,),
    check_tools=(_PYTEST,),
    fix_tools=(_BASH,),
    prompt_median=750.0,
    prompt_sigma=0.4,
    prompt_bounds=(200.0, 2048.0),
    prompt_difficulty=0.08,
    min_explore=0,
    explore_mean=(0.05, 0.1),
    explore_difficulty=0.35,
    explore_noise=0.2,
    check_prob=(1.0, 1.0),
    max_checks=8,
    max_calls=40,
    p_explore_fail=(0.03, 0.05),
    p_check_fail=(0.12, 0.52),
    fail_difficulty=0.6,
    p_fail_after_failure=(0.35, 0.4),
    stubborn_rounds=((0.0, 1.0), (1.5, 2.5), (3.0, 5.0)),
    stubborn_difficulty=0.2,
    stubborn_roles=("check",),
    p_timeout=0.03,
    extra_calls_on_failure=(1, 3),
    large_extra_prob=0.5,
    first_gen_median=(250.0, 720.0),
    gen_median=(160.0, 480.0),
    final_gen_median=(150.0, 350.0),
    gen_sigma=0.3,
    gen_difficulty=0.1,
    after_failure=1.6,
    after_timeout=1.3,
    after_medium=1.15,
    after_large=1.4,
    payload_explore=((0.9, 0.8), (0.095, 0.18), (0.005, 0.02)),
    payload_check_success=((0.95, 0.9), (0.05, 0.1), (0.0, 0.0)),
    payload_failure=((0.7, 0.43), (0.29, 0.52), (0.01, 0.05)),
    payload_classes=(
        PayloadClass(250.0, 0.8, (20.0, 1000.0)),
        PayloadClass(1500.0, 0.6, (1001.0, 12000.0)),
        PayloadClass(14000.0, 0.15, (12001.0, 20000.0)),
    ),
    failure_payload_scale=1.3,
    size_thresholds=(1000, 12000),
    bucket_thresholds=(4000, 12000, 30000),
    target_mean_total=(2500.0, 11500.0),
    drift_shape=0.75,
)

_SEARCH = ToolKind("search", 1.0, 0.9, 0.4, (0.5, 2.0), demand=(("service", "search"),))

SEARCH_R1 = WorkloadProfile(
    name="search_r1",
    description="Search-R1 multi-turn retrieval QA: search calls returning passages, then an answer",
    explore_tools=(_SEARCH,),
    check_tools=(),
    fix_tools=(_SEARCH,),
    prompt_median=300.0,
    prompt_sigma=0.35,
    prompt_bounds=(80.0, 1024.0),
    prompt_difficulty=0.05,
    min_explore=1,
    explore_mean=(0.5, 1.6),
    explore_difficulty=0.5,
    explore_noise=0.2,
    check_prob=(0.0, 0.0),
    max_checks=0,
    max_calls=16,
    p_explore_fail=(0.1, 0.25),
    p_check_fail=(0.0, 0.0),
    fail_difficulty=0.8,
    p_fail_after_failure=(0.3, 0.35),
    stubborn_rounds=((1.0, 1.9), (2.0, 2.9), (3.0, 3.9)),
    stubborn_difficulty=0.3,
    stubborn_roles=("explore", "fix"),
    p_timeout=0.02,
    extra_calls_on_failure=(1, 2),
    large_extra_prob=0.5,
    first_gen_median=(350.0, 750.0),
    gen_median=(200.0, 500.0),
    final_gen_median=(180.0, 400.0),
    gen_sigma=0.3,
    gen_difficulty=0.1,
    after_failure=1.6,
    after_timeout=1.3,
    after_medium=1.15,
    after_large=1.4,
    payload_explore=((0.8, 0.7), (0.19, 0.27), (0.01, 0.03)),
    payload_check_success=((1.0, 1.0), (0.0, 0.0), (0.0, 0.0)),
    payload_failure=((0.6, 0.5), (0.38, 0.46), (0.02, 0.04)),
    payload_classes=(
        PayloadClass(400.0, 0.4, (20.0, 500.0)),
        PayloadClass(1500.0, 0.6, (501.0, 5000.0)),
        PayloadClass(7000.0, 0.3, (5001.0, 15000.0)),
    ),
    failure_payload_scale=1.0,
    size_thresholds=(500, 5000),
    bucket_thresholds=(5000, 15000, 40960),
    target_mean_total=(3000.0, 12000.0),
    drift_shape=0.8,
)

_PYCHECK = ToolKind("python", 1.0, 0.3, 0.6, (0.1, 1.0), demand=_CPU1)

DAPO_MATH = WorkloadProfile(
    name="dapo_math",
    description="DAPO-Math-17K competition math: one long reasoning turn, an optional python check",
    explore_tools=(),
    check_tools=(_PYCHECK,),
    fix_tools=(_PYCHECK,),
    prompt_median=180.0,
    prompt_sigma=0.4,
    prompt_bounds=(40.0, 1024.0),
    prompt_difficulty=0.08,
    min_explore=0,
    explore_mean=(0.0, 0.0),
    explore_difficulty=0.0,
    explore_noise=0.0,
    check_prob=(0.3, 0.5),
    max_checks=4,
    max_calls=8,
    p_explore_fail=(0.2, 0.25),
    p_check_fail=(0.2, 0.25),
    fail_difficulty=0.6,
    p_fail_after_failure=(0.25, 0.3),
    stubborn_rounds=((0.0, 1.5), (1.0, 2.5), (2.0, 3.0)),
    stubborn_difficulty=0.3,
    stubborn_roles=("check",),
    p_timeout=0.02,
    extra_calls_on_failure=(0, 0),
    large_extra_prob=0.0,
    first_gen_median=(2300.0, 5600.0),
    gen_median=(600.0, 1200.0),
    final_gen_median=(500.0, 1000.0),
    gen_sigma=0.5,
    gen_difficulty=0.25,
    after_failure=1.6,
    after_timeout=1.3,
    after_medium=1.15,
    after_large=1.4,
    payload_explore=((0.97, 0.97), (0.03, 0.03), (0.0, 0.0)),
    payload_check_success=((0.97, 0.97), (0.03, 0.03), (0.0, 0.0)),
    payload_failure=((0.8, 0.8), (0.2, 0.2), (0.0, 0.0)),
    payload_classes=(
        PayloadClass(60.0, 0.8, (5.0, 500.0)),
        PayloadClass(900.0, 0.5, (501.0, 5000.0)),
        PayloadClass(6000.0, 0.2, (5001.0, 15000.0)),
    ),
    failure_payload_scale=1.0,
    size_thresholds=(500, 5000),
    bucket_thresholds=(5000, 15000, 40960),
    target_mean_total=(3000.0, 8000.0),
    drift_shape=0.85,
)

PROFILES: dict[str, WorkloadProfile] = {p.name: p for p in (R2E, SEARCH_R1, DAPO_MATH)}
"""The registered workloads by name."""


def get_profile(name: str) -> WorkloadProfile:
    """The profile registered under ``name``; raises ValueError naming the known workloads."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown workload: {name!r} (known: {known})") from None
