"""``python -m libra.bench peer_trl [--job FILE] [--seeds 1,2,3] [--steps N] [--json]``: the bundled job's task
(``examples/arith_smollm2.toml``: SmolLM2-135M learning to call a python tool) under Hugging Face TRL's
``GRPOTrainer`` and under ``libra run``, from the same seeds, one after the other in this run (TRL first).

The TRL side is what a user would write with TRL 1.16 (the optional ``peer`` extra: ``pip install
'libra[peer]'``): a ``GRPOTrainer`` with its experimental ``rollout_func`` running the same two-turn episode.
Parity with the Libra job, by construction rather than by copy:

- **episode**: libra's own :func:`libra.envs.arith.episode` coroutine runs unchanged, on a
  :class:`LocalSession` (a :class:`libra.rl.episode.EpisodeSession` whose model turns go to this process's
  model and whose tool calls go to this process's sandbox): the same prompts (``Problem.prompt``, both
  demonstrations), chat template, tool-output message and token layout (``add_messages``), turn caps and
  reward (``score``, ``format_reward`` from the job);
- **tool**: libra's :class:`~libra.engines.sandbox.pool.SandboxPool` (bubblewrap; unisolated only where the
  host has none), the same ``python`` tool the job's action actor runs;
- **problems**: the job's rows (``libra.rl.data.job_data``), in the order the job hands them out, for the
  seed; TRL's sampler is told not to shuffle, so step ``k`` gets rows ``2(k-1)`` and ``2k-1``;
- **objective**: group of ``[grpo] group_size`` and ``[job] prompts_per_step`` prompts a step (one optimiser
  step per generation batch), ``lr`` constant, no KL (``beta = 0``), clip ``[grpo] clip``, token-mean loss
  (``loss_type = "dapo"``), advantages scaled by the group's std, grad norm clipped at ``max_grad_norm``,
  fp32 on the CPU, no gradient checkpointing (TRL's default is on; libra's trainer has none); sampling at
  the job's temperature and top-p with no top-k, ``max_new_tokens`` a turn.
  The tool-output tokens carry ``env_mask = 0`` (no loss), as libra's loss mask.

Threads: the TRL process runs with the job's ``[actors] torch_threads`` (1 in the bundled job), as each Libra
slot does (``--trl-threads 0``: torch's default, one per core). On a shared 2-core host torch's default is
fragile: one batched ``generate`` of the ten first turns took 5 s at load 2.1 and 72 s at load 3.7 with 2
threads (OpenMP threads waiting on each other while another job holds a core).

Generation: the episodes of a step run as asyncio tasks; their model turns are batched (left-padded
``model.generate``) whenever no tool call is in flight, so turn 1 of all ten episodes is one batch and the
second turns another (libra's rollout actor batches too: ``[actors] rollout_batch``).

Per system and seed: **seconds per step** (mean, and steps 2..n), **step 1**, the seconds before it
(TRL: model load and trainer set-up; Libra: its ``total_wall_s`` holds the cluster's start and stop), and
**accuracy per quarter of the steps** (mean, spread as population std, n episodes) with tool calls per
episode, and **accuracy against wall time** (each step's end, seconds from the first step's start). Libra's
step times are the step records' ``step_time_s`` (step 1 from the job's start); TRL's are the seconds between
``on_step_end`` callbacks (step 1 from ``train()``). Printed last: Libra/TRL of the mean seconds per step and of
step 1 per seed, and their means over seeds (< 1: Libra faster). The result object goes to
``--out``/peer_trl.json (and to stdout with ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from libra.bench.output import emit, finite
from libra.rl.episode import EpisodeSession

__all__ = ["Batcher", "LocalSession", "aggregate", "job_problems", "main", "quarters", "system_figures"]

DEFAULT_JOB = "examples/arith_smollm2.toml"


# -- the episode, locally -----------------------------------------------------------------------------------
class Batcher:
    """Model turns of concurrent episodes, answered in batches by ``generate_fn(list of (ids, cap)) ->
    list of token lists``. :meth:`drive` flushes whenever turns wait and no tool call is in flight."""

    def __init__(self, generate_fn: Any) -> None:
        self.generate_fn = generate_fn
        self.pending: list[tuple[list[int], int, asyncio.Future[list[int]]]] = []
        self.in_tool = 0
        self.batches: list[int] = []  # the size of every flushed batch

    async def turn(self, ids: list[int], cap: int) -> list[int]:
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self.pending.append((list(ids), cap, fut))
        return await fut

    def flush(self) -> None:
        batch, self.pending = self.pending, []
        self.batches.append(len(batch))
        try:
            outs = self.generate_fn([(ids, cap) for ids, cap, _ in batch])
        except Exception as exc:  # noqa: BLE001  (every waiting episode gets the failure)
            for *_, fut in batch:
                fut.set_exception(exc)
            return
        for (_, _, fut), toks in zip(batch, outs):
            fut.set_result(list(toks))

    async def drive(self, coros: list[Any]) -> list[Any]:
        tasks = [asyncio.ensure_future(c) for c in coros]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.002)
            if self.pending and self.in_tool == 0:
                self.flush()
        return [t.result() for t in tasks]


class LocalSession(EpisodeSession):
    """An :class:`EpisodeSession` whose turns go to a :class:`Batcher` and whose tool calls go to ``tool_fn(name,
    args) -> dict`` (run on a thread); everything else (messages, masks, turn caps) is libra's own."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: Any, stop_ids: list[int], batcher: Batcher,
                 tool_fn: Any, trajectory: str) -> None:
        super().__init__(client=None, tokenizer=tokenizer, trajectory=trajectory, prompt_ids=prompt_ids,
                         params=params, weights=lambda: None, stop_token_ids=stop_ids, delta=False)
        self._batcher, self._tool_fn = batcher, tool_fn

    async def _request(self, args: Any) -> Any:
        from libra.protocol.payloads_rollout import GenerateResult

        toks = await self._batcher.turn(list(args.prompt_ids), int(args.max_new_tokens))
        stop = bool(toks) and toks[-1] in self.stop_token_ids
        return GenerateResult(token_ids=toks, logprobs=[0.0] * len(toks), finish_reason="stop" if stop else "length",
                              weights_version=0, gen_tokens=len(toks))

    async def call_tool(self, tool: str, args: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        self.tool_calls += 1
        self._batcher.in_tool += 1
        try:
            return await asyncio.to_thread(self._tool_fn, self.trajectory, tool, args)
        except Exception as exc:  # noqa: BLE001  (a failed call is the episode's to see, as through the broker)
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._batcher.in_tool -= 1


def job_problems(cfg: Any, steps: int) -> tuple[Any, list[Any]]:
    """``(env table with its options validated, the first steps x prompts_per_step problems)`` of job ``cfg``
    in the order the job hands its rows out (``libra.rl.data.job_data``: same seed, same problems)."""
    import dataclasses

    from libra.envs.loader import load_env_config, problem_rows
    from libra.rl.data import job_data

    env, options = load_env_config(cfg.env, "peer_trl")
    env_cfg = dataclasses.replace(cfg.env, options=options)
    cfg = dataclasses.replace(cfg, env=env_cfg, job=dataclasses.replace(cfg.job, steps=steps))
    data = job_data(cfg, lambda k, seed: problem_rows(env, k, seed, options))
    return env_cfg, [env.from_row(r) for r in data.rows[: steps * cfg.job.prompts_per_step]]


def run_episodes(problems: list[Any], env_cfg: Any, tokenizer: Any, params: Any, stop_ids: list[int],
                 generate_fn: Any, tool_fn: Any, tag: str = "ep") -> tuple[list[LocalSession], list[tuple[float, dict]]]:
    """One episode per problem (libra's ``arith.episode``), turns batched; the sessions and ``(reward, info)``."""
    from libra.envs.arith import episode

    batcher = Batcher(generate_fn)
    sessions = []
    for i, p in enumerate(problems):
        text = tokenizer.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)  # as libra's episode runner tokenizes
        sessions.append(LocalSession(tokenizer, ids, params, stop_ids, batcher, tool_fn, f"{tag}-{i}"))
    outs = asyncio.run(batcher.drive([episode(s, p, env_cfg) for s, p in zip(sessions, problems)]))
    return sessions, outs


# -- figures (pure) -----------------------------------------------------------------------------------------
def quarters(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Four quarters of the step records (``max(1, n // 4)`` steps each; the last takes the rest): per quarter,
    its steps and :func:`libra.rl.metrics.quarter_stats` (accuracy and tool calls: mean, std, n episodes)."""
    from libra.rl.metrics import quarter_stats

    q, out = max(1, len(records) // 4), []
    for k in range(4):
        part = records[k * q:(k + 1) * q] if k < 3 else records[3 * q:]
        if part:
            st = quarter_stats(part)
            out.append({"steps": [r["step"] for r in part], "accuracy": st["accuracy"],
                        "tool_calls_per_episode": st["tool_calls_per_episode"]})
    return out


def system_figures(records: list[dict[str, Any]], before_s: float | None, total_s: float | None) -> dict[str, Any]:
    """One system's figures from its step records (``step``, ``step_time_s``, ``accuracy``, ``episode_correct``,
    ``episode_tool_calls``): seconds per step, step 1, quarters, accuracy against wall time."""
    times = [float(r["step_time_s"]) for r in records]
    walls, acc = [], 0.0
    for t in times:
        acc += t
        walls.append(round(acc, 3))
    return {"steps": len(records), "step_s": [round(t, 3) for t in times],
            "step_s_mean": statistics.fmean(times) if times else None,
            "step_s_mean_2n": statistics.fmean(times[1:]) if len(times) > 1 else None,
            "step1_s": times[0] if times else None, "before_step1_s": before_s, "total_wall_s": total_s,
            "quarters": quarters(records),
            "accuracy_vs_wall": [{"step": r["step"], "wall_s": w, "accuracy": round(float(r["accuracy"]), 4)}
                                 for r, w in zip(records, walls)]}


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a is not None and b else None


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Libra/TRL ratios per seed (mean s/step, steps 2..n, step 1) and their means over the seeds; the last
    quarter's accuracy of each system pooled over seeds (mean, std, n)."""
    keys = {"step_s": "step_s_mean", "step_s_2n": "step_s_mean_2n", "step1": "step1_s"}
    ratios = {s: {k: _ratio(r["libra"].get(f), r["trl"].get(f)) for k, f in keys.items()} for s, r in per_seed.items()}
    means = {k: statistics.fmean(v[k] for v in ratios.values()) for k in keys
             if ratios and all(v[k] is not None for v in ratios.values())}
    last: dict[str, Any] = {}
    for system in ("trl", "libra"):
        qs = [r[system]["quarters"][-1]["accuracy"] for r in per_seed.values() if r[system]["quarters"]]
        n = sum(q["n"] for q in qs)
        mean = sum(q["mean"] * q["n"] for q in qs) / n if n else None
        last[system] = {"mean": mean, "per_seed": [q["mean"] for q in qs], "n": n}
    return {"ratios": ratios, "ratios_mean": means, "last_quarter_accuracy": last}


# -- the TRL run ---------------------------------------------------------------------------------------------
def _hf_generate(model: Any, tok: Any, stop_ids: list[int], temperature: float, top_p: float) -> Any:
    """``fn(list of (ids, cap)) -> token lists``: one left-padded ``model.generate``; each row up to its first
    stop token (kept) and its cap."""
    import torch

    def fn(batch: list[tuple[list[int], int]]) -> list[list[int]]:
        width = max(len(ids) for ids, _ in batch)
        pad = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]
        inp = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=max(c for _, c in batch),
                                 do_sample=temperature > 0, temperature=temperature or None, top_p=top_p, top_k=0,
                                 eos_token_id=stop_ids, pad_token_id=pad, use_cache=True)
        model.train(was_training)
        rows = []
        for (_, cap), seq in zip(batch, out[:, width:].tolist()):
            seq = seq[:cap]
            cut = next((i for i, t in enumerate(seq) if t in stop_ids), None)
            rows.append(seq if cut is None else seq[:cut + 1])
        return rows

    return fn


def _sandbox_tool(pool: Any) -> Any:
    def fn(traj: str, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        try:
            return pool.run(traj, tool, args)
        finally:
            pool.release(traj)
    return fn


def _trl_config(cfg: Any, steps: int, seed: int, out: Path, max_tokens: int) -> Any:
    """TRL's GRPOConfig for the job (see the module docstring)."""
    from trl import GRPOConfig

    g = cfg.grpo
    return GRPOConfig(output_dir=str(out / "trl"), max_steps=steps, num_generations=g.group_size,
                      per_device_train_batch_size=cfg.job.prompts_per_step * g.group_size,
                      gradient_accumulation_steps=1, steps_per_generation=1, learning_rate=g.lr,
                      lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=g.clip, loss_type="dapo",
                      scale_rewards="group", gradient_checkpointing=False, max_grad_norm=g.max_grad_norm,
                      use_cpu=True, bf16=False, fp16=False, seed=seed, shuffle_dataset=False, logging_steps=1,
                      report_to=[], save_strategy="no", disable_tqdm=True, max_completion_length=max_tokens,
                      dataloader_num_workers=0)


def run_trl(cfg: Any, seed: int, steps: int, out: Path, threads: int | None = None) -> dict[str, Any]:
    """The job's task under TRL's GRPOTrainer (see the module docstring) with ``threads`` torch threads (None:
    the job's ``[actors] torch_threads``; 0: torch's default); its figures and step records."""
    t0 = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from libra.engines.sandbox.pool import SandboxPool
    from libra.engines.sandbox.isolation import find_bwrap
    from libra.protocol.payloads_job import EpisodeSampling
    from libra.rl.driver import job_spec, resolve_model

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    threads = cfg.actors.torch_threads if threads is None else threads
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model_dir = resolve_model(cfg.model.name)
    env_cfg, problems = job_problems(cfg, steps)
    by_question = {p.question: p for p in problems}
    params = EpisodeSampling.from_wire(job_spec(cfg, model_dir, out, 0)["episode"]["sampling"])
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    stop_ids = sorted(t for t in {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
                      if isinstance(t, int) and t >= 0)  # as libra's episode runner
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pool = SandboxPool(allow_unisolated=find_bwrap() is None)
    gen = _hf_generate(model, tok, stop_ids, params.temperature, params.top_p)
    records: list[dict[str, Any]] = []

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        t = time.perf_counter()
        probs = [by_question[m[-1]["content"]] for m in prompts]  # TRL repeats each prompt group_size times
        sessions, outs = run_episodes(probs, env_cfg, tok, params, stop_ids, gen, _sandbox_tool(pool),
                                      tag=f"s{len(records)}")
        rewards = [float(r) for r, _ in outs]
        records.append({"step": len(records) + 1, "rewards": rewards, "reward_mean": statistics.fmean(rewards),
                        "episode_correct": [int(bool(i.get("correct"))) for _, i in outs],
                        "episode_tool_calls": [int(i.get("tool_calls", 0)) for _, i in outs],
                        "episode_tool_ok": [int(i.get("tool_ok", 0)) for _, i in outs],
                        "gen_tokens": sum(s.gen_tokens for s in sessions),
                        "rollout_time_s": round(time.perf_counter() - t, 3)})
        records[-1]["accuracy"] = statistics.fmean(records[-1]["episode_correct"])
        n = [len(s.prompt_ids) for s in sessions]
        return {"prompt_ids": [s.input_ids[:k] for s, k in zip(sessions, n)],
                "completion_ids": [s.input_ids[k:] for s, k in zip(sessions, n)],
                "env_mask": [s.loss_mask[k:] for s, k in zip(sessions, n)], "logprobs": None,
                "libra_reward": rewards}

    def reward(prompts: Any, completions: Any, libra_reward: list[float], **_: Any) -> list[float]:
        return list(libra_reward)

    marks: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())

    args = _trl_config(cfg, steps, seed, out, params.max_total_tokens)
    ds = Dataset.from_list([{"prompt": p.prompt} for p in problems])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          rollout_func=rollout_func, callbacks=[Clock()])
    before = time.perf_counter() - t0
    try:
        trainer.train()
    finally:
        pool.close()
    for r, (a, b) in zip(records, zip(marks, marks[1:])):
        r["step_time_s"] = b - a
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for r, h in zip(records, logs):
        r["loss"], r["grad_norm"] = h.get("loss"), h.get("grad_norm")
    fig = system_figures(records, round(before, 2), round(time.perf_counter() - t0, 2))
    fig["torch_threads"] = torch.get_num_threads()
    return {**fig, "records": records}


def run_libra(cfg: Any, seed: int, steps: int, run: Path, log_level: str) -> dict[str, Any]:
    """The job under ``libra run`` (``[broker] policy = "libra"``), as ``bench job`` runs it; its figures."""
    from libra.bench.job import run_policy
    from libra.rl.metrics import read_metrics

    ns = argparse.Namespace(seed=seed, steps=steps, log_level=log_level)
    res = run_policy(cfg, "libra", run, ns)
    records = read_metrics(run)
    fig = system_figures(records, None, res["total_wall_s"])
    fig["episodes_failed"] = res.get("episodes_failed")
    fig["run_dir"] = str(run)
    return fig


# -- the bench ----------------------------------------------------------------------------------------------
def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _guard(fn: Any, *a: Any) -> dict[str, Any]:
    """``fn(*a)``, or ``{"error": ...}`` when the run failed (the other system and seeds still run)."""
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001  (a failed run is a result: it is reported, not raised)
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.rl.config import load_job

    cfg = load_job(args.job)
    steps = args.steps or cfg.job.steps
    root = Path(args.out).resolve()
    res: dict[str, Any] = {"job": str(args.job), "steps": steps, "seeds": args.seeds, "cpus": os.cpu_count(),
                           "order": ["trl", "libra"], "per_seed": {}, "load": {}}
    for seed in args.seeds:
        load = {"before_trl": _load()}
        trl = _guard(run_trl, cfg, seed, steps, root / f"seed{seed}", args.trl_threads)
        load["before_libra"] = _load()
        lib = _guard(run_libra, cfg, seed, steps, root / f"seed{seed}" / "libra", args.log_level)
        load["after"] = _load()
        res["per_seed"][seed] = {"trl": trl, "libra": lib}
        res["load"][seed] = load
    res["failed"] = {s: {k: v["error"] for k, v in r.items() if "error" in v} for s, r in res["per_seed"].items()
                     if any("error" in v for v in r.values())}
    res.update(aggregate({s: r for s, r in res["per_seed"].items() if s not in res["failed"]}))
    root.mkdir(parents=True, exist_ok=True)
    (root / "peer_trl.json").write_text(json.dumps(finite(res), indent=1))
    res["result_file"] = str(root / "peer_trl.json")
    return res


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _quarter(q: dict[str, Any]) -> str:
    a = q["accuracy"]
    return f"{_f(a['mean'], 2)}±{_f(a['std'], 2)} (n {a['n']})"


def table(out: dict[str, Any]) -> str:
    """The result object as text."""
    lines = [f"bench peer_trl: {out['job']}, {out['steps']} steps, seeds {out['seeds']}, TRL then Libra per seed "
             f"({out['cpus']} CPUs)"]
    for seed, r in out["per_seed"].items():
        lines += ["", f"seed {seed} (load 1/5/15 min: {out['load'][seed]})"]
        if seed in out["failed"]:
            lines += [f"{k} failed: {e}" for k, e in out["failed"][seed].items()]
            lines += [f"{k}: step s {v['step_s']}, accuracy vs wall {v['accuracy_vs_wall']}" for k, v in r.items()
                      if "error" not in v]
            continue
        lines.append(f"{'':30s}{'TRL':>22s}{'Libra':>22s}")

        def row(label: str, key: str, nd: int = 2, r: dict = r) -> None:
            lines.append(f"{label:30s}{_f(r['trl'].get(key), nd):>22s}{_f(r['libra'].get(key), nd):>22s}")

        row("s/step, mean", "step_s_mean")
        row("s/step, steps 2..n", "step_s_mean_2n")
        row("step 1 (s)", "step1_s")
        row("before step 1 (s)", "before_step1_s")
        row("total wall (s)", "total_wall_s", 1)
        for k in range(max(len(r["trl"]["quarters"]), len(r["libra"]["quarters"]))):
            cells = [_quarter(r[s]["quarters"][k]) if k < len(r[s]["quarters"]) else "-" for s in ("trl", "libra")]
            lines.append(f"{'accuracy, quarter ' + str(k + 1):30s}{cells[0]:>22s}{cells[1]:>22s}")
        for s in ("trl", "libra"):
            lines.append(f"{s}: step s {r[s]['step_s']}; accuracy vs wall "
                         + ", ".join(f"{p['wall_s']:.0f}s:{p['accuracy']:.2f}" for p in r[s]["accuracy_vs_wall"]))
        q = out["ratios"][seed]
        lines.append(f"Libra/TRL: s/step {_f(q['step_s'])} (steps 2..n {_f(q['step_s_2n'])}), step 1 {_f(q['step1'])}")
    m, last = out["ratios_mean"], out["last_quarter_accuracy"]
    lines += ["", f"mean over seeds, Libra/TRL: s/step {_f(m.get('step_s'))} (steps 2..n {_f(m.get('step_s_2n'))}), "
                  f"step 1 {_f(m.get('step1'))}  (< 1: Libra faster)",
              "last-quarter accuracy pooled over seeds: " + "; ".join(
                  f"{s} {_f(v['mean'], 2)} (n {v['n']}, per seed {[round(x, 2) for x in v['per_seed']]})"
                  for s, v in last.items()),
              "TRL step 1 counts from train(); 'before step 1' is its model load and trainer set-up. Libra step 1 "
              "counts from the job's start; its total wall holds the cluster's start and stop."]
    return "\n".join(lines)


def _seeds(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be integers separated by commas, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("--seeds names no seed")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.bench peer_trl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--job", default=DEFAULT_JOB, help=f"the job file (default {DEFAULT_JOB})")
    p.add_argument("--seeds", type=_seeds, default=[1, 2, 3], help="comma-separated seeds (default 1,2,3)")
    p.add_argument("--steps", type=int, help="steps per run (default: the job file's)")
    p.add_argument("--out", default="runs/bench_peer_trl", help="run directories and peer_trl.json go here")
    p.add_argument("--trl-threads", type=int, help="torch threads of the TRL process (default: the job's [actors] "
                   "torch_threads, as each Libra slot has; 0: torch's default, one per core)")
    p.add_argument("--log-level", default="warning", help="the Libra cluster's log level")
    p.add_argument("--json", action="store_true", help="print the result object as JSON")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    try:
        import trl  # noqa: F401
    except ModuleNotFoundError:
        print("bench peer_trl needs TRL: pip install 'libra[peer]' (trl==1.16.0)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(res, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
