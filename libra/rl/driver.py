"""The RL job client: ``python -m libra run JOB.toml`` hands a job to the broker and follows it.

``run_job(cfg)`` runs a whole job. Without ``broker_url`` it starts a broker and actors on loopback
(:func:`libra.rl.cluster.start_cluster`: engine, ``action`` and ``episode`` slots from ``[actors]``, the
broker's policies from ``[broker]``: by default Libra's, hybrid rollout slots under the Elastic Hybrid Pool,
C-MLFQ routing and Tangram tool placement, written to ``RUN/broker.toml``; ``policy = "static"`` is the fixed
split); with one it joins a running cluster (which must have ``[actors] trainer`` trainer slots, rollout
slots started with the same model and at least one ``episode`` slot; there the running broker's own
configuration holds and ``[broker]`` is not applied).

How the pieces meet:

- This process first loads the environment (``[env] entry``/``name``, ``libra.envs.loader``) and has it
  validate ``[env.options]``: a plug-in that does not import, lacks a required method or rejects an option
  fails the job here with a ``ConfigError`` naming the key, before anything is submitted.
- It builds the dataset rows (``[data] train`` in its seeded epoch order, else the environment's offline
  problem generator; from the saved data cursor with ``resume``; ``libra.rl.data``), the eval rows and the
  job spec (``[rollout]`` sampling limits, ``[grpo]`` variants, ``[eval]``) and sends them to the broker (``JobSubmit``). First it checks that every tool the environment needs
  (its ``required_tools(env_config)``) is offered by a connected actor (``StatusReply.actors[i]
  ["capabilities"]["action"]``); if not, :class:`JobFailed` names the tool and how to get it (for the
  sandboxed code tools: ``sudo apt-get install bubblewrap``; for a user's tool: ``[actors] tools``) and nothing
  is submitted. The loopback cluster's action slots offer the tools of ``[actors] tools`` (``--tools``,
  loaded here first so a bad module fails before any process starts), and its broker places tool calls
  with ``[broker] action_scheduler`` (``libra.rl.broker_table.action_scheduler``). The **broker's job state** (``libra.broker.job_host``) turns
  rows into ``episode`` work under the policy-lag bound, collects GRPO groups, cuts batches and bumps the
  version after each step.
- Episode runners (``--role episode`` slots, ``libra.actors.episode_role``) run the environment's agent
  loop: every model turn is ``generate`` work and every tool call ``action`` work through the broker, so
  C-MLFQ and the action scheduler see every turn. Each runner keeps its finished trajectories on its own
  data-plane server and reports only a ref and a summary.
- At a batch cut the broker computes advantages, and the dispatch policy (``[job] dispatch``; default
  ``lpt``, EARL's layout-aware dispatch) decides which trainer rank trains on which trajectory; each
  rank fetches its trajectories straight from the runners (the bytes never pass through the broker or
  this process). The ranks train with gloo DP; rank 0 publishes the new weights version on its
  data-plane server, and the broker attaches that ref to every later ``generate`` turn; rollout actors
  fetch it from trainer rank 0 between turns (idle ones poll it).
- This process polls the job (``JobPoll``; the reply is read as
  :class:`~libra.protocol.payloads_job.JobPollReply`) and writes ``RUN/metrics.jsonl`` (one record per step,
  including ``dispatch_imbalance`` vs ``dispatch_imbalance_round_robin``, ``shard_fetch_s``,
  ``shard_sources``, and the weight sync of the version the previous step published, as the rollout
  actors report it in ``RUN/actors/``: ``weight_fetch_s``, ``weight_load_s``, ``sync_time_s``,
  ``weight_loads_dataplane``), ``RUN/samples.jsonl`` (a few transcripts per step) and at the end
  ``reward.png``/``throughput.png`` and ``summary.json``. Every failed episode (an exception in the
  environment, a turn nobody could serve) is a line of ``RUN/failures.jsonl`` (``job``, ``seq``, ``group``,
  ``index``, ``error``, ``traceback``); the job goes on without it. If this process stops, the job is
  cancelled. Eval rounds (``[eval]``) come back as ``"kind": "eval"`` records, written to ``metrics.jsonl``
  as they come, summed up in ``summary.json`` (``eval``) and plotted (``eval.png``); a step that saved a
  checkpoint leaves ``RUN/data_cursor.json`` for ``libra run --resume``; a step with no GRPO signal is
  said (``libra.rl.evals``). The broker's decisions (``"kind": "decision"`` records: plans, role switches,
  bucket changes, EHP joins and leaves, out-of-memory re-plans) are terminal lines and ``metrics.jsonl`` rows,
  marked on ``throughput.png`` and counted in ``summary.json`` (``decisions``, ``prediction_error`` of the
  broker's predicted step seconds, ``policy``). ``[rollout] engine`` is the loopback actors' ``LIBRA_ROLLOUT_ENGINE``.
- Every record written to ``metrics.jsonl`` also goes to the trackers ``[job] loggers`` names (TensorBoard, MLflow,
  W&B: ``libra.rl.loggers``), whose packages are imported before any process starts (a missing one is a
  ``LoggerUnavailable`` naming the extra); with GPU actors a step record carries their memory and utilisation
  as the broker's status has them (``gpu_memory_used_bytes_max``, ``gpu_memory_used_bytes_total``,
  ``gpu_utilization_pct_mean``, ``gpu_actors``).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from libra.actors.slot_records import read_slot_records
from libra.config import ConfigError
from libra.envs.loader import env_key
from libra.logging import get_logger
from libra.protocol.payloads_job import EpisodeSpec, JobPollReply
from libra.rl.cluster import check_user_tools, engine_gpu_counts, host_gpus, start_cluster
from libra.rl.config import JobConfig
from libra.rl.data import Cursor, check_data, job_data, resume_point
from libra.rl.evals import eval_summary, handle_record
from libra.rl.loggers import check_installed, gpu_fields
from libra.rl.loggers.fanout import open_run_loggers
from libra.rl.metrics import decision_summary, plot_run, read_metrics, summarize
from libra.rl.progress import JobProgress, children_above_bars, quiet_progress

__all__ = ["JobFailed", "check_tools", "engine_gpu_counts", "host_gpus", "missing_tools", "resolve_model", "run_job",
           "run_job_async"]

log = get_logger("libra.rl")


class JobFailed(RuntimeError):
    """The job could not go on (a train step failed, the cluster died, no progress possible)."""


# How to get a tool that no actor offers, by tool name (the sandboxed code tools need bubblewrap).
_SANDBOX_HINT = ("the sandboxed code tools need bubblewrap: install it with `sudo apt-get install bubblewrap` "
                 "and start again, or, for trusted code only, run without isolation: [actors] allow_unisolated "
                 "= true in the job file (actors started by hand: --allow-unisolated)")
TOOL_HINTS = {"python": _SANDBOX_HINT, "bash": _SANDBOX_HINT, "pytest": _SANDBOX_HINT}


def user_tool_hint(tool: str) -> str:
    """How to offer ``tool`` when it is a tool of the user's own (``libra.actors.tools``)."""
    return (f"{tool!r} is not built in: declare it in a module's LIBRA_TOOLS (libra.actors.tools) and offer it "
            f"with [actors] tools = [\"your_pkg.tools\"] in the job file, a `libra.tools` entry point of an "
            f"installed package, or actors started with `python -m libra.actors --tools your_pkg.tools`")


def missing_tools(required: list[str], actors: list[dict[str, Any]]) -> list[str]:
    """The tools in ``required`` that no actor in ``actors`` (``StatusReply.actors``) offers as ``action``
    work (``actor["capabilities"]["action"]``)."""
    offered = {name for a in actors for name in ((a.get("capabilities") or {}).get("action") or [])}
    return [t for t in required if t not in offered]


async def check_tools(client: Any, env: Any, env_cfg: Any, job: str, wait_s: float = 5.0) -> None:
    """Raise :class:`JobFailed` when a tool the environment needs (its ``required_tools(env_cfg)``, if it
    declares any) is offered by no connected actor, naming the tool and how to get it. Waits up to
    ``wait_s`` for an action actor that is still connecting."""
    needs = getattr(env, "required_tools", None)
    required = list(needs(env_cfg)) if callable(needs) else []
    if not required:
        return
    deadline = time.monotonic() + wait_s
    while True:
        actors = list((await client.status()).actors)
        missing = missing_tools(required, actors)
        if not missing or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.25)
    if missing:
        offered = sorted({n for a in actors for n in ((a.get("capabilities") or {}).get("action") or [])})
        hints = sorted({TOOL_HINTS.get(t, user_tool_hint(t)) for t in missing})
        raise JobFailed(f"job {job!r} needs the tool(s) {', '.join(repr(t) for t in missing)}, which no connected "
                        f"actor offers (tools offered: {', '.join(offered) or 'none'}; {len(actors)} actor(s)); "
                        + "; ".join(hints))


def _check_user_tools(modules: list[str]) -> None:
    """:func:`libra.rl.cluster.check_user_tools`, its error as :class:`JobFailed` naming ``[actors] tools``."""
    from libra.actors.tools import ToolLoadError

    try:
        check_user_tools(modules)
    except ToolLoadError as exc:
        raise JobFailed(f"[actors] tools: {exc}") from None


def resolve_model(name: str) -> Path:
    """``tiny`` / ``smollm2`` / a checkpoint directory → a directory ``from_pretrained`` can load."""
    if name == "tiny":
        from libra.engines.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    if name == "smollm2":
        from libra.engines.smollm2 import ensure_smollm2

        return ensure_smollm2()
    p = Path(name).expanduser()
    if not (p / "config.json").is_file():
        raise JobFailed(f"[model] name {name!r} is neither 'tiny', 'smollm2' nor a checkpoint directory "
                        "with a config.json")
    try:  # episodes render every prompt with the tokenizer's chat template
        tok_cfg = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").is_file() else {}
    except ValueError as exc:
        raise JobFailed(f"[model] name {name!r}: tokenizer_config.json is not valid JSON ({exc})") from None
    if not (tok_cfg.get("chat_template") or (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file()):
        raise JobFailed(f"[model] name {name!r}: the tokenizer has no chat template (no chat_template in "
                        "tokenizer_config.json, no chat_template.jinja): use an instruct/chat checkpoint or add one")
    return p


def job_spec(cfg: JobConfig, model_dir: Path, run_dir: Path, master_port: int) -> dict[str, Any]:
    """The ``JobSubmit`` spec of a job file (see :class:`libra.broker.job_host.JobSpec`)."""
    j, g, e = cfg.job, cfg.grpo, cfg.env
    return {
        "steps": j.steps, "prompts_per_step": j.prompts_per_step, "group_size": g.group_size,
        "max_policy_lag": j.max_policy_lag, "world_size": cfg.actors.trainer, "env": env_key(e)[1],
        "episode": EpisodeSpec.from_wire({  # validated here, before the broker hands it to every runner
            "model_dir": str(model_dir), "env_config": {f: getattr(e, f) for f in e.__dataclass_fields__},
            "sampling": {"max_new_tokens": e.max_new_tokens, "temperature": e.temperature, "top_p": e.top_p,
                         "max_total_tokens": cfg.rollout.max_total_tokens, "timeout_s": cfg.rollout.turn_timeout_s}}).to_wire(),
        "grpo": {"lr": g.lr, "clip_low": g.clip, "kl_coef": g.kl_coef, "max_grad_norm": g.max_grad_norm,
                 "micro_batch_tokens": g.micro_batch_tokens, "parallel": g.parallel, "aggregation": g.loss_agg,
                 **({"clip_high": g.clip_high} if g.clip_high > 0 else {}),
                 **({"master_addr": g.master_addr} if g.master_addr else {})},
        "dispatch": j.dispatch, "micro_batch_tokens": g.micro_batch_tokens, "scale_by_std": g.scale_by_std,
        "seed": j.seed, "master_port": master_port, "checkpoint_dir": str(run_dir / "checkpoints"),
        "checkpoint_every": j.checkpoint_every, "checkpoint_optimizer": j.checkpoint_optimizer,
        "keep_checkpoints": j.keep_checkpoints, "filter_zero_variance": g.filter_zero_variance,
        "max_extra_groups": g.max_extra_groups, "eval_every": cfg.eval.every, "eval_greedy": cfg.eval.greedy,
        "eval_k": cfg.eval.k, "eval_temperature": cfg.eval.temperature,
    }


class _Driver:
    def __init__(self, cfg: JobConfig, broker_url: str, run_dir: Path, model_dir: Path, progress: bool,
                 resume: Cursor | None = None) -> None:
        import dataclasses

        from libra.envs.loader import load_env_config, problem_rows
        from libra.local import free_port

        # the plug-in is loaded and its options validated here, before anything is submitted (ConfigError)
        self.env, options = load_env_config(cfg.env, "job")
        cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, options=options))
        self.cfg = cfg
        self.url = broker_url
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.progress = progress
        # [data] train in its seeded order, else the env's problems; from the saved cursor when resuming
        self.data = job_data(cfg, lambda k, seed: problem_rows(self.env, k, seed, options), cursor=resume)
        self.rows = self.data.rows
        self.failures = (run_dir / "failures.jsonl").open("a", encoding="utf-8")
        self._failures_seen = -1  # the newest failure seq written
        self.spec = {**job_spec(cfg, model_dir, run_dir, free_port()), **self.data.spec()}
        self.expected_rollouts = cfg.actors.rollout
        self._publish_s: dict[int, float] = {}  # weights version -> rank 0's publish seconds
        self.samples = (run_dir / "samples.jsonl").open("a", encoding="utf-8")
        try:  # RUN/metrics.jsonl and the [job] loggers trackers (libra.rl.loggers): one write per record
            self.metrics = open_run_loggers(cfg.job.loggers, run_dir, cfg.job.name, cfg.to_mapping(),
                                            resume_step=resume.step if resume is not None else None)
        except BaseException:
            self.samples.close()
            self.failures.close()
            raise

    async def run(self) -> dict[str, Any]:
        from libra.client.aio import AsyncClient

        name = self.cfg.job.name
        client = await AsyncClient(self.url).connect(10.0)
        try:  # before anything is submitted: a job whose tool no actor offers would only learn to fail
            await check_tools(client, self.env, self.cfg.env, name)
        except BaseException:
            await client.close()
            self.metrics.close()
            self.samples.close()
            self.failures.close()
            raise
        t_job = time.monotonic()
        bar = JobProgress(name, self.data.steps, self.cfg.job.prompts_per_step * self.cfg.grpo.group_size,
                          enabled=self.progress)
        cursor, st, finished = 0, JobPollReply(job=name, state="running"), False
        try:
            try:
                await client.job_submit(name, self.spec, self.rows)
            except Exception as exc:  # noqa: BLE001  (the broker's answer says what is wrong)
                raise JobFailed(f"the broker refused job {name!r}: {exc}") from exc
            while True:
                st = JobPollReply.from_wire(await client.job_poll(name, cursor))
                self._write_failures(st.failures)
                for rec in st.records:
                    if handle_record(rec, self.run_dir, self.data, self.metrics, bar.write):
                        continue  # an eval or decision record (libra.rl.evals)
                    rec.update(await _gpu_memory(client))
                    self._write(rec)
                    bar.step(rec)
                bar.poll(st.episodes_collected, st.training)
                cursor = st.next_cursor
                if st.more:  # the reply was one page (JobPoll.limit): the rest at once, before the state counts
                    continue
                if st.state == "done":
                    finished = True
                    break
                if st.state != "running":
                    finished = True
                    raise JobFailed(f"job {name!r} {st.state}: {st.error}")
                await asyncio.sleep(0.25)
        finally:
            bar.close()
            if not finished:  # interrupted here: do not leave the job running in the broker
                try:
                    await client.job_poll(name, cursor, cancel=True, timeout=5.0)
                except Exception:  # noqa: BLE001
                    pass
            await client.close()
            self.metrics.close()
            self.samples.close()
            self.failures.close()
        rollout_versions = await self._await_rollout_sync(st.version)
        recs = read_metrics(self.run_dir)
        summary = {**summarize(recs), "job": name, "policy": self.cfg.broker.policy,
                   "broker_config": str(self.run_dir / "broker.toml") if (self.run_dir / "broker.toml").is_file() else None,
                   **decision_summary(recs, read_metrics(self.run_dir, "decision")),
                   "total_wall_s": time.monotonic() - t_job,
                   "final_version": st.version, "dropped_groups": st.dropped_groups,
                   "episodes_failed": st.episodes_failed, "job_state_in": "broker",
                   "rollout_versions": rollout_versions, "rollout_sync": self._rollout_sync_stats(),
                   "eval": eval_summary(read_metrics(self.run_dir, "eval")), "loggers": self.metrics.locations()}
        try:
            summary["plots"] = [str(p) for p in plot_run(self.run_dir)]
        except ImportError as exc:  # matplotlib is in the 'train' extra
            summary["plots"] = []
            log.warning("plots_skipped", error=str(exc))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _write_failures(self, failures: list[dict[str, Any]]) -> None:
        """Append the failed episodes not written yet to ``RUN/failures.jsonl`` (job, group, index, error,
        traceback; the broker sends each until a newer record, so they are deduplicated by ``seq``)."""
        from libra.envs.contract import split_failure

        for f in failures:
            if int(f.get("seq", -1)) <= self._failures_seen:
                continue
            self._failures_seen = int(f["seq"])
            error, tb = split_failure(str(f.get("error", "")))
            self.failures.write(json.dumps({"job": self.cfg.job.name, "seq": f["seq"], "group": f.get("group"),
                                            "index": f.get("index"), "error": error, "traceback": tb}) + "\n")
        self.failures.flush()

    def _write(self, rec: dict[str, Any]) -> None:
        """Add what only this host sees (rollout actors' weight loads in RUN/actors/) and write the record."""
        samples = rec.pop("samples", [])
        prev = int(rec["weight_sync_version"])  # published by the previous step, fetched during this one
        loads = [x for x in self._rollout_sync_stats()["fetches"] if x["version"] == prev and x["via"] == "dataplane"]
        load_s = max((float(x["load_s"]) for x in loads), default=0.0)
        self._publish_s[int(rec["weights_version"])] = float(rec.get("weight_publish_s", 0.0))
        rec.update({"weight_fetch_s": max((float(x["fetch_s"]) for x in loads), default=0.0), "weight_load_s": load_s,
                    "sync_time_s": self._publish_s.get(prev, 0.0) + load_s if loads else 0.0,
                    "weight_loads_dataplane": len(loads)})
        self.metrics.write(rec)
        for smp in samples:
            self.samples.write(json.dumps({"step": rec["step"], **smp}) + "\n")
        self.samples.flush()

    async def _await_rollout_sync(self, version: int, timeout: float = 30.0) -> dict[str, int | None]:
        """Wait until every rollout actor's status file reports ``version`` (idle instances load it on
        their own); returns actor id → version as last seen (records are keyed by actor, ``HOST/SLOT``:
        the same slot name on two hosts is two instances, :mod:`libra.actors.slot_records`). An instance that
        was never sent a weights ref (``knows_publisher`` false: every turn ran before the first publish)
        cannot follow, so it is not waited for; a record whose process is gone (the slot died and its
        supervisor is restarting it) is stale, so its actor is waited for until the new process writes its
        own. A hybrid slot the Elastic Hybrid Pool holds in training is no rollout instance now (not waited
        for, not listed); one released back to rollout whose record has no version yet builds its engine
        with its next turn, which carries the newest weights (listed as None, not waited for)."""
        import psutil

        seen: dict[str, int | None] = {}
        stuck: set[str] = set()  # never sent a ref: cannot follow
        dead: set[str] = set()  # the record's process is gone: its restart has not written one yet
        deadline = time.monotonic() + timeout
        while True:
            training: set[str] = set()  # hybrid slots the pool holds in training: not rollout instances now
            for aid, rec in read_slot_records(self.run_dir).items():  # one per actor: HOST/SLOT, not the slot
                try:
                    if rec.get("role") == "train":
                        training.add(aid)
                        seen.pop(aid, None)
                        continue
                    v = rec.get("weights_version")
                    seen[aid] = None if v is None and rec.get("role") == "rollout" else int(v)
                except (ValueError, KeyError, TypeError):
                    continue
                gone = isinstance(rec.get("pid"), int) and not psutil.pid_exists(rec["pid"])
                (dead.add if gone else dead.discard)(aid)
                (stuck.add if rec.get("knows_publisher") is False else stuck.discard)(aid)
            synced = all((v is None or v >= version or a in stuck) and a not in dead for a, v in seen.items())
            if (len(seen) + len(training) >= self.expected_rollouts and synced) or time.monotonic() >= deadline:
                return seen
            await asyncio.sleep(0.1)

    def _rollout_sync_stats(self) -> dict[str, Any]:
        """Weight loads the rollout actors report in their status files: how many came over the data plane
        (vs the file fallback), failures, and the data-plane fetch / fetch+load seconds of each."""
        fetches: list[dict[str, Any]] = []
        out: dict[str, Any] = {"dataplane_loads": 0, "torch_loads": 0, "file_loads": 0, "fetch_errors": 0,
                               "bytes_fetched": 0}
        for aid, st in read_slot_records(self.run_dir).items():
            for k in out:
                out[k] += int(st.get(k, 0))
            fetches += [dict(x, slot=st.get("slot"), actor_id=aid) for x in st.get("fetches", [])]
        dp = [x for x in fetches if x.get("via") in ("dataplane", "torch")]
        out["fetch_s_mean"] = statistics.fmean(x["fetch_s"] for x in dp) if dp else None
        out["load_s_mean"] = statistics.fmean(x["load_s"] for x in dp) if dp else None
        out["fetches"] = fetches
        return out


async def _gpu_memory(client: Any) -> dict[str, Any]:
    """The GPU actors' memory and utilisation now (``libra.rl.loggers.records.gpu_fields`` of the broker's
    status), added to a step record; {} without GPU actors or when the status does not come."""
    try:
        return gpu_fields(list((await client.status(timeout=2.0)).actors))
    except Exception:  # noqa: BLE001 - a missing sample leaves the record as it is
        return {}


def start_point(cfg: JobConfig, run: Path, resume: bool) -> tuple[Cursor | None, Path]:
    """``(data cursor, model directory)`` a job starts from: ``[model] name`` from the beginning, or with
    ``resume`` the cursor and checkpoint the run saved last (:func:`libra.rl.data.resume_point`)."""
    if not resume:
        return None, resolve_model(cfg.model.name)
    try:
        return resume_point(run, cfg.job.steps)
    except ConfigError as exc:
        raise JobFailed(str(exc)) from None


async def run_job_async(cfg: JobConfig, broker_url: str, *, progress: bool = True,
                        resume: bool = False) -> dict[str, Any]:
    """Run ``cfg`` against the cluster at ``broker_url`` (see the module docstring); returns the summary.
    ``resume``: continue the run in ``[job] run_dir`` from its last checkpoint and data cursor."""
    run = Path(cfg.job.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cursor, model_dir = start_point(cfg, run, resume)
    (run / "config.toml").write_text(cfg.to_toml())
    try:
        driver = _Driver(cfg, broker_url, run, model_dir, progress, cursor)
    except ConfigError as exc:  # the dataset or the environment: named by file and key
        raise JobFailed(str(exc)) from None
    return await driver.run()


def clear_driver_files(run: Path, resume: bool) -> None:
    """Remove what an earlier run of the driver left in ``run`` (created if missing): its summary and, unless
    ``resume``, its metrics, samples, failures and tracker run ids, which this run would otherwise continue."""
    run.mkdir(parents=True, exist_ok=True)
    # trackers.json: the tracker runs a resumed run continues (libra.rl.loggers.adapters); a fresh run starts new ones
    for stale in ("summary.json",) + (() if resume else ("metrics.jsonl", "samples.jsonl", "failures.jsonl",
                                                         "trackers.json")):
        (run / stale).unlink(missing_ok=True)


def run_job(cfg: JobConfig, broker_url: str | None = None, *, progress: bool = True,
            log_level: str = "warning", resume: bool = False) -> dict[str, Any]:
    """Run the whole job; starts a loopback cluster unless ``broker_url`` is given. ``resume``: continue the
    run in ``[job] run_dir`` (its metrics are kept) from its last checkpoint, in the same data order.
    Without ``progress`` no bar is drawn here or by the processes it starts (:func:`quiet_progress`)."""
    if not progress:
        with quiet_progress():
            return _run_job(cfg, broker_url, progress=False, log_level=log_level, resume=resume)
    return _run_job(cfg, broker_url, progress=True, log_level=log_level, resume=resume)


def _run_job(cfg: JobConfig, broker_url: str | None, *, progress: bool, log_level: str, resume: bool) -> dict[str, Any]:
    from libra.envs.loader import load_env_config

    load_env_config(cfg.env, "job")  # a broken plug-in (ConfigError naming the key) fails before any process starts
    check_installed(cfg.job.loggers)  # a [job] loggers tracker whose package is missing: LoggerUnavailable, here
    if broker_url is not None:  # a running cluster: its slots' files in the run directory are theirs
        clear_driver_files(Path(cfg.job.run_dir), resume)
        return asyncio.run(run_job_async(cfg, broker_url, progress=progress, resume=resume))
    run = Path(cfg.job.run_dir).resolve()
    cfg = cfg.with_run_dir(str(run))
    import shutil

    clear_driver_files(run, resume)
    for stale in ("router_state.json", "broker.toml"):
        (run / stale).unlink(missing_ok=True)
    for stale in ("actors", "weights", "batches"):  # a previous run's versions must not leak into this one
        shutil.rmtree(run / stale, ignore_errors=True)
    _, model_dir = start_point(cfg, run, resume)
    try:  # a missing or malformed dataset fails here, before any process starts
        check_data(cfg)
    except ConfigError as exc:
        raise JobFailed(str(exc)) from None
    _check_user_tools(cfg.actors.tools)
    if progress:  # the slots load the model before they register: minutes on a CPU, with nothing else to show
        a = cfg.actors
        print(f"libra run: starting a broker and actor slots on loopback ({a.rollout} rollout, {a.trainer} "
              f"trainer, {a.action} tool, 1 episode runner); each loads the model before the first step",
              file=sys.stderr, flush=True)
    with children_above_bars(progress and sys.stderr.isatty()) as pump:  # their warnings print above the bars
        cluster = start_cluster(cfg, run, model_dir, host_gpus(), log_level)
    try:
        return asyncio.run(run_job_async(cfg, cluster.url, progress=progress, resume=resume))
    finally:
        cluster.stop()
        if pump is not None:
            pump.join(timeout=2.0)  # the children's last lines
