"""The loopback cluster ``python -m libra run`` starts when no ``--broker`` is given: a broker and one actor
supervisor on 127.0.0.1 (:class:`~libra.local.LocalCluster`), laid out from ``[actors]`` and ``[broker]``.

The actors: ``[actors] rollout`` engine slots (``hybrid`` under ``[broker] policy = "libra"``, ``rollout``
under ``"static"``: :func:`libra.rl.broker_table.engine_roles`), ``[actors] trainer`` core ``train`` ranks,
``[actors] action`` tool slots offering ``[actors] tools`` and one ``episode`` runner; engine slots go on
GPUs per ``[actors] rollout_gpus``/``trainer_gpus`` (:func:`engine_gpu_counts`). A slot that dies is
restarted with back-off, as on a cluster. The broker gets ``RUN/broker.toml``, the resolved ``[broker]``
table (:func:`libra.rl.broker_table.broker_mapping`: under ``libra`` the ``grp_ehp`` planner with this host's
hardware profile, C-MLFQ and Tangram; under ``static`` no planner and first come first served tool calls),
and leaves its learned C-MLFQ tree in ``RUN/router_state.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libra.logging import get_logger
from libra.rl.broker_table import broker_mapping, broker_toml, engine_roles

__all__ = ["check_user_tools", "engine_gpu_counts", "gpu_names", "host_gpus", "slot_env", "slot_flags", "start_cluster"]

log = get_logger("libra.rl")


def host_gpus() -> tuple[int, str]:
    """``(GPUs on this host, why)`` by NVML (no torch import)."""
    from libra.actors.slots import discover_gpus

    d = discover_gpus()
    return d.count, d.reason


def gpu_names(count: int) -> tuple[str, ...]:
    """The names of this host's GPUs (NVML) when ``count`` says there are any; () otherwise."""
    if not count:
        return ()
    from libra.actors.slots import discover_gpus

    return tuple(discover_gpus().names)


def engine_gpu_counts(a: Any, gpus: tuple[int, str]) -> tuple[int, int, str]:
    """How many rollout and trainer slots of ``[actors]`` ``a`` go on GPUs on a host with ``gpus`` =
    ``(count, why)``: ``auto`` puts all of a role's slots on GPUs when there is one, none when there is none;
    a count is taken as given (the actors run slots without a GPU to go to on the CPU, and say so)."""
    n, why = gpus
    r = (a.rollout if n else 0) if a.rollout_gpus == "auto" else int(a.rollout_gpus)
    t = (a.trainer if n else 0) if a.trainer_gpus == "auto" else int(a.trainer_gpus)
    if not n:
        why = f"{why}: rollout and training run on the CPU" if not r + t else f"{why}: GPU slots fall back to the CPU"
    return r, t, why


def check_user_tools(modules: list[str]) -> None:
    """Load ``[actors] tools`` (and the ``libra.tools`` entry points) here first: a module that does not import,
    a tool declared twice or named like a built-in fails the job before any process starts. Raises
    ``ToolLoadError``."""
    from libra.actors.tools import load_tools

    load_tools(modules)


def slot_flags(cfg: Any, run: Path, model_dir: Path) -> list[str]:
    """The ``libra actors`` flags of job ``cfg``'s slots other than their roles (here, and on every node of a
    multi-node allocation: :mod:`libra.rl.node_launch`)."""
    a = cfg.actors
    out = ["--model-dir", str(model_dir), "--run-dir", str(run), "--torch-threads", str(a.torch_threads),
           "--rollout-batch", str(a.rollout_batch), "--episode-concurrency", str(a.episode_concurrency),
           "--dtype", a.dtype, "--gpu-memory-fraction", str(a.gpu_memory_fraction)]
    if a.allow_unisolated:
        out.append("--allow-unisolated")
    for module in a.tools:  # the action slots offer the user's tools (libra.actors.tools)
        out += ["--tools", module]
    return out


def slot_env(cfg: Any) -> dict[str, str]:
    """The environment job ``cfg``'s actor supervisors add to their own."""
    a = cfg.actors
    env = {"OMP_NUM_THREADS": str(max(1, a.torch_threads)), "TOKENIZERS_PARALLELISM": "false"}
    if a.weights_transport == "torch":
        env["LIBRA_WEIGHTS_TRANSPORT"] = "torch"
    env["LIBRA_ROLLOUT_ENGINE"] = cfg.rollout.engine  # [rollout] engine, for every rollout slot started here
    return env


def start_cluster(cfg: Any, run: Path, model_dir: Path, gpus: tuple[int, str], log_level: str) -> Any:
    """Start the loopback cluster of job ``cfg`` (see the module docstring) and wait for its actors; returns
    the started :class:`~libra.local.LocalCluster` (the caller stops it). ``gpus``: :func:`host_gpus`."""
    from libra.local import LocalCluster

    a = cfg.actors
    gpu_r, gpu_t, why = engine_gpu_counts(a, gpus)
    (log.info if gpu_r + gpu_t else log.warning)("job_engine_placement", rollout_gpu_slots=gpu_r,
                                                 trainer_gpu_slots=gpu_t, reason=why)
    roles, gpu_roles = engine_roles(cfg, gpu_r, gpu_t)
    actor_args = ["--roles", roles, *slot_flags(cfg, run, model_dir)]
    if gpu_roles:
        actor_args += ["--gpu-roles", gpu_roles]
    n = a.rollout + a.trainer + a.action + 1  # + one episode runner
    env = slot_env(cfg)
    broker_args = ["--router-state", str(run / "router_state.json")]
    table, notes = broker_mapping(cfg, gpu_names(gpu_r + gpu_t))
    (run / "broker.toml").write_text(broker_toml(table))  # always: the user sees what the broker ran with
    broker_args += ["--config", str(run / "broker.toml")]
    log.info("job_broker_policy", policy=cfg.broker.policy, decided="; ".join(notes), config=str(run / "broker.toml"))
    if a.action_scheduler != "auto":
        log.warning("deprecated_key", key="[actors] action_scheduler", use="[broker] action_scheduler",
                    value=a.action_scheduler)
    cluster = LocalCluster(cpu_slots=n, actor_args=actor_args, broker_args=broker_args, log_level=log_level,
                           env=env, gpu_slots="auto" if gpu_r + gpu_t else "0")
    # engine slots load their model (and, on a GPU, CUDA) before they say hello: up to 5 minutes, not 1
    cluster.start(wait_actors=n, timeout=300.0)
    return cluster
