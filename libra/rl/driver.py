"""The RL job driver: dataset → episodes through the broker → GRPO groups → train steps → weight versions.

``run_job(cfg)`` runs a whole job. Without ``broker_url`` it starts a broker and actors on loopback
(:class:`~libra.local.LocalCluster`: ``rollout``, ``trainer`` and ``action`` slots from ``[actors]``);
with one it joins a running cluster (which must have ``[actors] trainer`` trainer slots and rollout
slots started with the same model directory and ``--run-dir``).

How the pieces meet:

- Episode runners are asyncio tasks in the driver (``libra.rl.episode`` + the environment's
  ``episode`` function). Every model turn is ``generate`` work and every tool call ``action`` work, both
  submitted to the broker with the trajectory id, so C-MLFQ and the action scheduler see every turn.
- :class:`~libra.rl.job.JobState` (pure) decides admission under the policy-lag bound and cuts batches.
- A cut batch is split over the trainer ranks by the dispatch policy (``libra.policies.dispatch``,
  ``[job] dispatch``; default ``lpt``: the largest per-rank token count is minimised, and each rank's
  share is packed into length-sorted micro-batches). Each rank's shard is published on the driver's
  data-plane server (``libra.dataplane``) and one ``train`` work per rank names all shards' refs; each
  rank fetches its own straight from the driver (the broker carries refs, never bytes, and nothing is
  written to the run directory). The ranks train with gloo DP; rank 0 then publishes the new weights
  version on *its* data-plane server and returns the ref. New generate turns name ``{version,
  endpoint, ...}`` and rollout actors fetch it from trainer rank 0 between turns (idle ones poll it).
- Per step, ``RUN/metrics.jsonl`` gets one record (including ``dispatch_imbalance`` vs
  ``dispatch_imbalance_round_robin``, ``shard_fetch_s``, and the weight sync of the version the
  previous step published, as the rollout actors report it: ``weight_fetch_s`` (slowest data-plane
  transfer), ``weight_load_s`` (transfer + copy into the engine), ``sync_time_s`` (its publish + load),
  ``weight_loads_dataplane``); at the end ``reward.png``/``throughput.png`` are
  drawn and ``summary.json`` written. ``RUN/samples.jsonl`` keeps a few transcripts per step.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.dataplane import DataPlaneKeys, DataPlaneServer
from libra.logging import get_logger
from libra.policies.dispatch import plan_dispatch
from libra.rl.config import JobConfig
from libra.rl.episode import EpisodeSession, SamplingParams
from libra.rl.job import Group, JobState, Trajectory
from libra.rl.metrics import MetricsWriter, plot_run, read_metrics, summarize
from libra.rl.shards import encode_shard

__all__ = ["JobFailed", "resolve_model", "run_job", "run_job_async"]

log = get_logger("libra.rl")


class JobFailed(RuntimeError):
    """The job could not go on (a train step failed, the cluster died, no progress possible)."""


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
    return p


@dataclass
class _Live:
    """Mutable per-run counters the episode tasks update."""

    gen_tokens: int = 0


class _Driver:
    def __init__(self, cfg: JobConfig, broker_url: str, run_dir: Path, model_dir: Path, progress: bool) -> None:
        from transformers import AutoTokenizer

        from libra.envs import get_env

        self.cfg = cfg
        self.url = broker_url
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.progress = progress
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.env = get_env(cfg.env.name)
        self.problems = iter(self.env.make_problems(cfg.job.steps * cfg.job.prompts_per_step * 4 + 64,
                                                    cfg.job.seed, max_operand=cfg.env.max_operand,
                                                    ops=cfg.env.ops))
        stop = {self.tok.convert_tokens_to_ids("<|im_end|>"), self.tok.eos_token_id}
        self.stop_ids = sorted(int(t) for t in stop if isinstance(t, int) and t >= 0)
        self.state = JobState(cfg.job.steps, cfg.job.prompts_per_step, cfg.grpo.group_size, cfg.job.max_policy_lag)
        self.weights: dict[str, Any] | None = None
        self.live = _Live()
        self.sem = asyncio.Semaphore(cfg.actors.episode_concurrency)
        self.params = SamplingParams(cfg.env.max_new_tokens, cfg.env.temperature, cfg.env.top_p)
        from libra.local import free_port

        self.master_port = free_port()
        self.expected_rollouts = cfg.actors.rollout
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl")
        self._publish_s: dict[int, float] = {}  # weights version -> rank 0's publish seconds
        self.samples = (run_dir / "samples.jsonl").open("a", encoding="utf-8")

    # ------------------------------------------------------------------ episodes
    async def episode(self, client: Any, g: Group, idx: int) -> Trajectory:
        async with self.sem:
            problem = g.prompt
            text = self.tok.apply_chat_template(problem.prompt, add_generation_prompt=True, tokenize=False)
            prompt_ids = self.tok.encode(text, add_special_tokens=False)
            s = EpisodeSession(client, self.tok, f"{problem.pid}-g{g.gid}-{idx}-{uuid.uuid4().hex[:6]}", prompt_ids,
                               self.params, lambda: self.weights, self.stop_ids,
                               seed=self.cfg.job.seed * 1_000_003 + g.gid * 1000 + idx * 10)
            t0 = time.monotonic()
            try:
                reward, info = await self.env.episode(s, problem, self.cfg.env)
            finally:
                await s.finish()
            self.live.gen_tokens += s.gen_tokens
            info.update({"load_s": s.load_s, "start": t0, "end": time.monotonic(), "texts": s.texts, "question": problem.question,
                         "expected": problem.answer})
            return Trajectory(g.gid, idx, s.input_ids, s.loss_mask, s.logprobs, float(reward), list(s.versions), info)

    # ------------------------------------------------------------------ training
    async def train(self, client: Any, batch: list[Group], step: int) -> dict[str, Any]:
        from libra.engines.grpo import group_advantages

        trajs = [t for g in batch for t in g.trajs]
        adv = group_advantages([t.reward for t in trajs], [t.group for t in trajs],
                               scale_by_std=self.cfg.grpo.scale_by_std).tolist()
        # group_advantages divides float32 rounding noise by a ~0 std when a group's rewards are all equal
        # (e.g. 3 x 5.85 gives 0.30): such a group carries no signal, so its advantages are exactly 0.
        flat = {g.gid for g in batch if len({t.reward for t in g.trajs}) == 1}
        adv = [0.0 if t.group in flat else a for t, a in zip(trajs, adv)]
        ws = self.cfg.actors.trainer
        plan = plan_dispatch([len(t.input_ids) for t in trajs], ws, micro_batch_tokens=self.cfg.grpo.micro_batch_tokens,
                             strategy=self.cfg.job.dispatch)
        naive = plan_dispatch([len(t.input_ids) for t in trajs], ws, strategy="round_robin")
        refs = []
        for r, idx in enumerate(plan.assignment):
            sub = [trajs[i] for i in idx]
            tensors, meta = encode_shard([t.input_ids for t in sub], [t.loss_mask for t in sub],
                                         [t.rollout_logprobs for t in sub], [adv[i] for i in idx], traj_index=idx,
                                         micro_batches=plan.micro_batches[r], step=step, rank=r)
            refs.append(self.dp.publish_state_dict(f"batch/step{step}/rank{r}", tensors, version=step,
                                                   metadata=meta).to_wire())
        every = self.cfg.job.checkpoint_every
        ckpt = str(self.run_dir / "checkpoints" / f"step{step}") if (step == self.cfg.job.steps or
                                                                  (every and step % every == 0)) else None
        g = self.cfg.grpo
        grpo = {"lr": g.lr, "clip_low": g.clip, "kl_coef": g.kl_coef, "max_grad_norm": g.max_grad_norm,
                "micro_batch_tokens": g.micro_batch_tokens}
        t0 = time.monotonic()
        try:
            replies = await asyncio.gather(*[
                client.request("train", "grpo", {"shards": refs, "world_size": ws, "rank": r, "step": step,
                                                 "master_port": self.master_port, "grpo": grpo, "checkpoint": ckpt},
                               timeout=3600.0) for r in range(ws)])
        finally:
            for r in range(ws):
                self.dp.retire(f"batch/step{step}/rank{r}")
        outs = sorted((r.output for r in replies), key=lambda o: o["rank"])
        return {"outs": outs, "train_time_s": time.monotonic() - t0, "trajs": trajs, "plan": plan, "naive": naive}

    # ------------------------------------------------------------------ loop
    async def run(self) -> dict[str, Any]:
        from libra.client.aio import AsyncClient

        client = await AsyncClient(self.url).connect(10.0)
        self.dp = DataPlaneServer(keys=DataPlaneKeys.from_env())
        st = self.state
        pending: dict[asyncio.Task, tuple[str, int]] = {}
        train_task: asyncio.Task | None = None
        t_job = t_last = time.monotonic()
        tokens_last = 0
        bar = None
        if self.progress:
            from tqdm import tqdm  # type: ignore[import-untyped]

            bar = tqdm(total=st.steps, desc=f"libra run {self.cfg.job.name}", unit="step")
        try:
            while not st.finished:
                while st.can_admit():
                    g = st.admit(next(self.problems))
                    for i in range(st.group_size):
                        pending[asyncio.create_task(self.episode(client, g, i))] = ("episode", g.gid)
                if train_task is None:
                    batch = st.cut_batch()
                    if batch is not None:
                        train_task = asyncio.create_task(self.train(client, batch, st.steps_done + 1))
                        pending[train_task] = ("train", -1)
                if not pending:
                    raise JobFailed("no episode or train step in flight and nothing admissible: stuck")
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    kind, gid = pending.pop(task)
                    if kind == "train":
                        train_task = None
                        exc = task.exception()
                        if exc is not None:
                            raise JobFailed(f"train step {st.steps_done + 1} failed: {exc}") from exc
                        res = task.result()
                        lag = [st.version - t.min_version for t in res["trajs"]]
                        versions = sorted({v for t in res["trajs"] for v in t.versions})
                        new_v = int(res["outs"][0]["weights_version"])
                        now = time.monotonic()
                        rec = self._record(res, lag, versions, now - t_last, self.live.gen_tokens - tokens_last)
                        st.step_done(new_v)
                        if isinstance(res["outs"][0].get("weights"), dict):
                            self.weights = res["outs"][0]["weights"]  # a data-plane ref on trainer rank 0
                        self.metrics.write(rec)
                        t_last, tokens_last = now, self.live.gen_tokens
                        if bar is not None:
                            bar.set_postfix(reward=f"{rec['reward_mean']:.2f}", acc=f"{rec['accuracy']:.2f}",
                                            tok_s=f"{rec['tokens_per_s']:.0f}")
                            bar.update(1)
                    else:
                        exc = task.exception()
                        if exc is not None:
                            log.warning("episode_failed", group=gid, error=f"{type(exc).__name__}: {exc}")
                            if gid in st.groups:
                                st.fail(gid)
                            continue
                        traj = task.result()
                        if traj.group in st.groups:
                            st.add(traj)
        finally:
            if bar is not None:
                bar.close()
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            await client.close()
            self.dp.close()
            self.metrics.close()
            self.samples.close()
        rollout_versions = await self._await_rollout_sync(st.version)
        recs = read_metrics(self.run_dir)
        summary = {**summarize(recs), "job": self.cfg.job.name, "total_wall_s": time.monotonic() - t_job,
                   "final_version": st.version, "dropped_groups": st.dropped_groups,
                   "rollout_versions": rollout_versions, "rollout_sync": self._rollout_sync_stats()}
        try:
            summary["plots"] = [str(p) for p in plot_run(self.run_dir)]
        except ImportError as exc:  # matplotlib is in the 'train' extra
            summary["plots"] = []
            log.warning("plots_skipped", error=str(exc))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    async def _await_rollout_sync(self, version: int, timeout: float = 30.0) -> dict[str, int]:
        """Wait until every rollout actor's status file reports ``version`` (idle instances load it on
        their own); returns slot → version as last seen."""
        seen: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while True:
            for f in (self.run_dir / "actors").glob("*.json"):
                try:
                    seen[f.stem] = int(json.loads(f.read_text())["weights_version"])
                except (OSError, ValueError, KeyError):
                    continue
            if (len(seen) >= self.expected_rollouts and all(v >= version for v in seen.values())) \
                    or time.monotonic() >= deadline:
                return seen
            await asyncio.sleep(0.1)

    def _rollout_sync_stats(self) -> dict[str, Any]:
        """Weight loads the rollout actors report in their status files: how many came over the data plane
        (vs the file fallback), failures, and the data-plane fetch / fetch+load seconds of each."""
        fetches: list[dict[str, Any]] = []
        out: dict[str, Any] = {"dataplane_loads": 0, "file_loads": 0, "fetch_errors": 0, "bytes_fetched": 0}
        for f in sorted((self.run_dir / "actors").glob("*.json")):
            try:
                st = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            for k in out:
                out[k] += int(st.get(k, 0))
            fetches += [dict(x, slot=f.stem) for x in st.get("fetches", [])]
        dp = [x for x in fetches if x.get("via") == "dataplane"]
        out["fetch_s_mean"] = statistics.fmean(x["fetch_s"] for x in dp) if dp else None
        out["load_s_mean"] = statistics.fmean(x["load_s"] for x in dp) if dp else None
        out["fetches"] = fetches
        return out

    def _record(self, res: dict[str, Any], lag: list[int], versions: list[int], step_s: float,
                tokens: int) -> dict[str, Any]:
        trajs: list[Trajectory] = res["trajs"]
        outs = res["outs"]
        rewards = [t.reward for t in trajs]
        m = outs[0]["metrics"]
        wait_s = max((0.0, *[float(x) for x in self._load_times(trajs)]))
        prev = self.state.version  # published by the previous step, fetched by rollouts during this one
        loads = [x for x in self._rollout_sync_stats()["fetches"] if x["version"] == prev and x["via"] == "dataplane"]
        load_s = max((float(x["load_s"]) for x in loads), default=0.0)
        publish_prev = self._publish_s.get(prev, 0.0)
        self._publish_s[int(outs[0]["weights_version"])] = float(outs[0].get("publish_s", 0.0))
        plan, naive = res["plan"], res["naive"]
        rec = {
            "step": self.state.steps_done + 1, "weights_version": int(outs[0]["weights_version"]),
            "reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "rewards": rewards,
            "accuracy": statistics.fmean(1.0 if t.info.get("correct") else 0.0 for t in trajs),
            "format_rate": statistics.fmean(1.0 if t.info.get("formatted") else 0.0 for t in trajs),
            "tool_calls_per_episode": statistics.fmean(t.info.get("tool_calls", 0) for t in trajs),
            "turns_per_episode": statistics.fmean(len(t.versions) for t in trajs),
            "sequences": len(trajs), "gen_tokens": tokens, "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "step_time_s": step_s,
            "rollout_time_s": max(t.info["end"] for t in trajs) - min(t.info["start"] for t in trajs),
            "train_time_s": res["train_time_s"],
            "weight_publish_s": float(outs[0].get("publish_s", 0.0)), "weight_sync_version": prev,
            "weight_fetch_s": max((float(x["fetch_s"]) for x in loads), default=0.0), "weight_load_s": load_s,
            "sync_time_s": publish_prev + load_s if loads else 0.0, "weight_loads_dataplane": len(loads),
            "turn_weight_wait_s": wait_s,
            "weights_bytes": int((outs[0].get("weights") or {}).get("bytes", 0)),
            "dispatch": plan.strategy, "rank_tokens": list(plan.rank_tokens),
            "dispatch_imbalance": plan.imbalance, "dispatch_imbalance_round_robin": naive.imbalance,
            "rank_padded_tokens": list(plan.rank_padded_tokens), "micro_batches": [len(m) for m in plan.micro_batches],
            "shard_fetch_s": max(float(o.get("shard_fetch_s", 0.0)) for o in outs),
            "shard_bytes": sum(int(o.get("shard_bytes", 0)) for o in outs),
            "policy_lag_mean": statistics.fmean(lag), "policy_lag_max": max(lag), "versions_seen": versions,
            "turn_versions": [t.versions for t in trajs],
            "loss": m["loss"], "grad_norm": m["grad_norm"], "clip_frac": m["clip_frac"], "kl_mean": m["kl_mean"],
            "checksums": [o["checksum"] for o in outs], "ranks": len(outs),
            "dropped_groups": self.state.dropped_groups,
        }
        for t in trajs[:2]:
            self.samples.write(json.dumps({"step": rec["step"], "question": t.info["question"],
                                           "expected": t.info["expected"], "reward": t.reward,
                                           "versions": t.versions, "texts": t.info["texts"]}) + "\n")
        self.samples.flush()
        return rec

    @staticmethod
    def _load_times(trajs: list[Trajectory]) -> list[float]:
        return [float(x) for t in trajs for x in t.info.get("load_s", [])]


async def run_job_async(cfg: JobConfig, broker_url: str, *, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg`` against the cluster at ``broker_url`` (see the module docstring); returns the summary."""
    run = Path(cfg.job.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text(cfg.to_toml())
    model_dir = resolve_model(cfg.model.name)
    return await _Driver(cfg, broker_url, run, model_dir, progress).run()


def run_job(cfg: JobConfig, broker_url: str | None = None, *, progress: bool = True,
            log_level: str = "warning") -> dict[str, Any]:
    """Run the whole job; starts a loopback cluster unless ``broker_url`` is given."""
    if broker_url is not None:
        return asyncio.run(run_job_async(cfg, broker_url, progress=progress))
    from libra.local import LocalCluster

    run = Path(cfg.job.run_dir).resolve()
    cfg = cfg.with_run_dir(str(run))
    run.mkdir(parents=True, exist_ok=True)
    import shutil

    for stale in ("metrics.jsonl", "samples.jsonl", "summary.json"):
        (run / stale).unlink(missing_ok=True)
    for stale in ("actors", "weights", "batches"):  # a previous run's versions must not leak into this one
        shutil.rmtree(run / stale, ignore_errors=True)
    model_dir = resolve_model(cfg.model.name)
    a = cfg.actors
    actor_args = ["--roles", f"rollout={a.rollout},train={a.trainer},action={a.action}", "--model-dir", str(model_dir),
                  "--run-dir", str(run), "--torch-threads", str(a.torch_threads), "--rollout-batch",
                  str(a.rollout_batch), "--no-restart"]
    if a.allow_unisolated:
        actor_args.append("--allow-unisolated")
    n = a.rollout + a.trainer + a.action
    env = {"OMP_NUM_THREADS": str(max(1, a.torch_threads)), "TOKENIZERS_PARALLELISM": "false"}
    with LocalCluster(cpu_slots=n, actor_args=actor_args, log_level=log_level, env=env) as cluster:
        cluster.wait_for_actors(n, timeout=300.0)
        return asyncio.run(run_job_async(cfg, cluster.url, progress=progress))
