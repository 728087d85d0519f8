"""The job file's ``[broker]`` table (:class:`~libra.rl.config.BrokerTable`): how it is checked and what it
becomes in the loopback cluster ``python -m libra run`` starts.

Checked at load time (:func:`check_broker_table`, called by :func:`libra.rl.config.job_from_mapping`) with the
validators the broker core itself runs when it starts: the router registry and the router's own parameters
(``make_router``), the buckets (``BucketSpec``, ascending ``max_tokens``), the action-scheduler registry
(``make_action_scheduler``), ``[broker.planner]`` through ``EhpSettings.from_planner``,
``PlannerSettings.from_dict`` and a ``PlannerLoop`` built from it (cost profiles, allocator knobs, re-planner
arguments), and ``[broker.engines]`` through ``check_engine_settings``. A bad value fails ``libra run`` before
any process starts, with a :class:`~libra.config.ConfigError` naming the table and the key.

What each policy becomes (:func:`broker_mapping`, :func:`engine_roles`):

- ``policy = "libra"``: the ``[actors] rollout`` slots start as ``hybrid`` slots (rollout until the Elastic
  Hybrid Pool borrows them), the ``[actors] trainer`` slots as the core ``train`` ranks; the broker gets
  ``[broker.planner] allocation = "grp_ehp"`` (the job's group size and batch, the hardware profile of this host:
  ``cpu`` without a GPU), the router (C-MLFQ) and Tangram for tool calls. The buckets stay the one default
  bucket unless ``[broker] buckets`` says otherwise (with ``[grpo] parallel = "fsdp"`` the default allocation is
  ``grp``: the pool joins whole data-parallel replicas, so the trainer split stays fixed): rollout slots only get a bucket from a plan's directive,
  and the GRP rounds plan GPU slots only, so on CPU slots every instance serves the first bucket and more
  buckets would change no placement (the dispatcher serves a bucket nobody serves from any instance).
- ``policy = "static"``: today's fixed split: ``rollout`` and ``train`` slots, no planner, tool calls first
  come first served (Tangram when ``[actors] tools`` names user tools).

The resolved table is written to ``RUN/broker.toml`` (:func:`broker_toml`) and passed with ``--config``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from libra.config import ConfigError

__all__ = ["POLICIES", "action_scheduler", "broker_mapping", "broker_toml", "check_broker_table", "engine_roles",
           "hardware_profile", "planner_mapping", "with_policy"]

POLICIES = ("libra", "static")
LOOPBACK_HEARTBEAT_S = 2.0  # the loopback broker's heartbeat (liveness 3: an actor silent 6 s is expired)
#: GPU name fragments (NVML's device name, upper case) → the bundled hardware profile.
_GPU_PROFILES = (("H200", "h200"), ("H100", "h100"), ("A800", "a800"))


def _fail(where: str, text: str) -> ConfigError:
    return ConfigError(f"{where}: {text}")


def check_broker_table(cfg: Any, where: str) -> None:
    """Validate ``cfg.broker`` (a :class:`~libra.rl.config.JobConfig`'s) with the broker core's validators;
    raises :class:`ConfigError` naming the table and key."""
    b = cfg.broker
    if b.policy not in POLICIES:
        raise _fail(where, f"[broker] policy: unknown policy {b.policy!r} (known: {', '.join(POLICIES)})")
    from libra.policies.routing.baselines import make_router

    try:
        make_router(b.router, **dict(b.router_params))
    except (ValueError, TypeError) as exc:
        raise _fail(where, f"[broker] router: {exc}") from None
    _check_buckets(b.buckets, where)
    action_scheduler(cfg, where)
    if b.policy == "static" and b.planner:
        raise _fail(where, "[broker.planner]: policy = \"static\" runs without a planner (fixed roles); remove "
                           "[broker.planner] or set [broker] policy = \"libra\"")
    if b.policy == "libra":
        try:
            planner = planner_mapping(cfg, "cpu")
        except ConfigError as exc:
            raise _fail(where, str(exc)) from None
        _check_planner(planner, b.planner, where)
    from libra.broker.plan_rounds import check_engine_settings

    try:
        check_engine_settings(dict(b.engines))
    except ValueError as exc:
        raise _fail(where, str(exc)) from None


def _check_buckets(buckets: list[dict[str, Any]], where: str) -> None:
    from libra.policies.routing.interface import BucketSpec

    specs = []
    for i, b in enumerate(buckets):
        try:
            specs.append(BucketSpec(**b))
        except TypeError as exc:
            raise _fail(where, f"[broker] buckets[{i}]: need name, tp and max_tokens ({exc})") from None
        except ValueError as exc:  # ClusterViewError
            raise _fail(where, f"[broker] buckets[{i}]: {exc}") from None
    tops = [s.max_tokens for s in specs]
    if any(a >= b for a, b in zip(tops, tops[1:])):
        raise _fail(where, f"[broker] buckets must ascend by max_tokens: got {tops}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise _fail(where, f"[broker] buckets: names must differ, got {names}")


def action_scheduler(cfg: Any, where: str = "job") -> str:
    """How the broker places tool calls: ``"fcfs"`` or an action scheduler's name (see the module docstring).
    ``[broker] action_scheduler`` wins; ``[actors] action_scheduler`` (deprecated) is used when the former is
    ``auto``; the two set to different schedulers is an error."""
    from libra.policies.actions.registry import ACTION_SCHEDULERS

    b, a = cfg.broker.action_scheduler, cfg.actors.action_scheduler
    if b not in ("auto", "fcfs", *ACTION_SCHEDULERS):
        raise _fail(where, f"[broker] action_scheduler: unknown scheduler {b!r} (known: auto, fcfs, "
                           f"{', '.join(ACTION_SCHEDULERS)})")
    if b != "auto" and a != "auto" and a != b:
        raise _fail(where, f"[broker] action_scheduler = {b!r} and the deprecated [actors] action_scheduler = "
                           f"{a!r} disagree: keep only [broker] action_scheduler")
    if b != "auto":
        return b
    if a != "auto":
        return a
    if cfg.broker.policy == "libra":
        return "tangram"
    return "tangram" if cfg.actors.tools else "fcfs"


def hardware_profile(gpu_names: tuple[str, ...] | list[str]) -> tuple[str, str]:
    """``(profile, why)``: ``cpu`` without a GPU, else the bundled profile of the first GPU's model; a GPU with
    no bundled profile gets the broker's default (``a800``) and ``why`` says so."""
    if not gpu_names:
        return "cpu", "no GPU on this host: the cpu profile"
    name = str(gpu_names[0])
    for fragment, profile in _GPU_PROFILES:
        if fragment in name.upper():
            return profile, f"{name}: the {profile} profile"
    return "a800", (f"{name} has no bundled hardware profile (h100, h200, a800): the a800 profile is used; "
                    "set [broker.planner] hardware to a profile file for this GPU")


_ELASTIC_PARALLEL = ("ddp", "auto")  # the trainer layouts an elastic (EHP) group can join (actors.elastic_train)


def _default_allocation(cfg: Any) -> str:
    """``grp_ehp``, or ``grp`` when ``[grpo] parallel`` shards the model (FSDP): the pool joins whole replicas."""
    return "grp_ehp" if cfg.grpo.parallel in _ELASTIC_PARALLEL else "grp"


def planner_mapping(cfg: Any, hardware: str) -> dict[str, Any]:
    """The ``[broker.planner]`` table the broker gets under ``policy = "libra"``: the job file's keys over the
    defaults (``grp_ehp``; ``hardware`` ``auto`` → ``hardware``; ``model`` ``auto`` → the ``[model] name``'s
    bundled cost profile when there is one; the job's group size and per-step batch; ``objective`` moved
    into ``params``)."""
    from libra.policies.cost import known_models

    p = dict(cfg.broker.planner)
    out: dict[str, Any] = {"allocation": p.pop("allocation", _default_allocation(cfg))}
    if out["allocation"] == "grp_ehp" and cfg.grpo.parallel not in _ELASTIC_PARALLEL:
        raise ConfigError(f"[broker.planner] allocation = \"grp_ehp\" needs [grpo] parallel = ddp or auto (the "
                          f"Elastic Hybrid Pool joins whole data-parallel replicas), got {cfg.grpo.parallel!r}: "
                          f"use allocation = \"grp\" or [grpo] parallel = \"ddp\"")
    hw = p.pop("hardware", "auto")
    out["hardware"] = hardware if hw == "auto" else hw
    model = p.pop("model", "auto")
    if model != "auto":
        out["model"] = model
    elif cfg.model.name in known_models():
        out["model"] = cfg.model.name
    g = cfg.grpo.group_size
    out["group_size"] = p.pop("group_size", g)
    out["batch"] = p.pop("batch", g * cfg.job.prompts_per_step)
    if "objective" in p:
        params = dict(p.get("params") or {})
        if "objective" in params:
            raise ConfigError("[broker.planner] objective: given twice (also in [broker.planner] params)")
        p["params"] = {**params, "objective": p.pop("objective")}
    return {**out, **p}


def _check_planner(planner: dict[str, Any], given: dict[str, Any], where: str) -> None:
    """``planner`` (:func:`planner_mapping`) through the broker's own checks, errors named by table and key."""
    from libra.broker.ehp import ALLOCATION, from_planner_config
    from libra.broker.plan_decider import BROKER_ALLOCATORS, PlannerLoop, PlannerSettings

    known = {f.name for f in dataclasses.fields(PlannerSettings)} | {"ehp", "objective"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise _fail(where, f"[broker.planner]: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    alloc = planner["allocation"]
    if alloc not in (ALLOCATION, *BROKER_ALLOCATORS, "colocated"):
        raise _fail(where, f"[broker.planner] allocation: unknown allocation {alloc!r} (known: {ALLOCATION}, "
                           f"{', '.join(BROKER_ALLOCATORS)})")
    if "ehp" in given and alloc != ALLOCATION:
        raise _fail(where, f"[broker.planner.ehp]: the Elastic Hybrid Pool runs under allocation = "
                           f"\"{ALLOCATION}\", not {alloc!r}")
    try:
        rest, _ = from_planner_config(planner)
        PlannerLoop(PlannerSettings.from_dict(rest))
    except ValueError as exc:  # ConfigError (ehp) is one
        text = str(exc)
        for core, table in (("broker.planner.ehp: ", "[broker.planner.ehp] "), ("broker planner: ", "[broker.planner] ")):
            if text.startswith(core):
                text = table + text[len(core):]
                break
        else:
            text = f"[broker.planner] {text}"
        raise _fail(where, text) from None


def broker_mapping(cfg: Any, gpu_names: tuple[str, ...] | list[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """``([broker] table for the broker's --config, notes)`` of a checked job (see the module docstring)."""
    b = cfg.broker
    sched = action_scheduler(cfg)
    # a loopback cluster on a loaded laptop: a slot whose heartbeat thread is starved for 3 s (1 s x liveness 3) was
    # expired mid-step at load 4.5, and the Elastic Hybrid Pool's step pinned to it failed the job; 2 s x 3 = 6 s
    out: dict[str, Any] = {"heartbeat_s": LOOPBACK_HEARTBEAT_S, "router": b.router}
    if b.router_params:
        out["router_params"] = dict(b.router_params)
    if b.buckets:
        out["buckets"] = [dict(x) for x in b.buckets]
    out["action_scheduler"] = "" if sched == "fcfs" else sched
    notes = [f"policy {b.policy}", f"router {b.router}", f"{len(b.buckets) or 1} bucket(s)",
             f"tool calls: {sched}"]
    if b.policy == "libra":
        hw, why = hardware_profile(gpu_names)
        out["planner"] = planner_mapping(cfg, hw)
        notes.append(f"planner {out['planner']['allocation']} ({why})")
    if b.engines:
        out["engines"] = dict(b.engines)
    return out, notes


def broker_toml(table: dict[str, Any]) -> str:
    """``table`` as a TOML ``[broker]`` table, its sub-tables as ``[broker.X]`` sections."""
    from libra.rl.toml_out import toml_value

    lines: list[str] = []

    def section(name: str, body: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in body.items() if not isinstance(v, dict))
        lines.append("")
        for k, v in body.items():
            if isinstance(v, dict):
                section(f"{name}.{k}", v)

    section("broker", table)
    return "\n".join(lines)


def engine_roles(cfg: Any, gpu_rollout: int, gpu_trainer: int) -> tuple[str, str | None]:
    """``(--roles, --gpu-roles or None)`` of the loopback actors: under ``libra`` the rollout slots are
    ``hybrid``, under ``static`` ``rollout``; the trainer slots are ``train`` (the core ranks) under both."""
    a = cfg.actors
    engine = "hybrid" if cfg.broker.policy == "libra" else "rollout"
    cpu = f"{engine}={a.rollout - gpu_rollout},train={a.trainer - gpu_trainer},action={a.action},episode=1"
    gpu = f"{engine}={gpu_rollout},train={gpu_trainer}" if gpu_rollout + gpu_trainer else None
    return cpu, gpu


def with_policy(cfg: Any, policy: str) -> Any:
    """``cfg`` under ``policy`` (``libra`` or ``static``), checked."""
    new = dataclasses.replace(cfg, broker=dataclasses.replace(cfg.broker, policy=policy))
    check_broker_table(new, "job")
    return new
