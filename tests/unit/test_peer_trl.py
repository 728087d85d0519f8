"""``bench peer_trl``'s pure parts: the local episode (libra's arith episode on a LocalSession: same prompts, tool
call, token layout and reward as the job), the problems in the job's order, and the figures. TRL itself is
needed only by the last test (skipped without it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from libra.bench.peer_trl import aggregate, job_problems, quarters, run_episodes, system_figures  # noqa: E402
from libra.envs import arith  # noqa: E402
from libra.protocol.payloads_job import EpisodeSampling  # noqa: E402
from libra.rl.config import load_job  # noqa: E402
from libra.rl.episode import template_continuation  # noqa: E402

JOB = Path(__file__).resolve().parents[2] / "examples" / "arith_smollm2.toml"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from libra.engines.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def scripted(tok, stop: int, *, call_tool: bool):
    """A model that calls the tool with the question's product (or answers at once), then copies the output."""
    calls: list[int] = []

    def fn(batch):
        calls.append(len(batch))
        out = []
        for ids, cap in batch:
            text = tok.decode(ids)
            last_user = text.rsplit("<|im_start|>user\n", 1)[1]
            if last_user.startswith("Output:"):
                reply = f"Answer: {last_user.split()[1]}"
            else:
                a, b = re.findall(r"has (\d+) boxes with (\d+)", text)[-1]
                reply = f"```python\nprint({a} * {b})\n```" if call_tool else "Answer: 7"
            out.append((tok.encode(reply, add_special_tokens=False) + [stop])[:cap])
        return out

    return fn, calls


def fake_tool(seen: list):
    def fn(traj, tool, args):
        seen.append((traj, tool, args))
        a, b = re.fullmatch(r"print\((\d+) \* (\d+)\)", args["code"]).groups()
        return {"stdout": f"{int(a) * int(b)}\n", "stderr": "", "exit_code": 0}
    return fn


def test_problems_are_the_jobs_rows_in_order_for_the_seed() -> None:
    cfg = load_job(JOB)
    env_cfg, probs = job_problems(cfg, 3)
    want = arith.make_problems(6, cfg.job.seed, **env_cfg.options)
    assert [p.question for p in probs] == [p.question for p in want] and len(probs) == 3 * cfg.job.prompts_per_step
    assert all(p.style == "tool_demo" and p.demos == 2 for p in probs)
    import dataclasses

    _, other = job_problems(dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, seed=2)), 3)
    assert [p.question for p in other] != [p.question for p in probs]


def test_two_turn_episode_matches_libras_layout_and_reward(tok) -> None:
    cfg = load_job(JOB)
    env_cfg, probs = job_problems(cfg, 1)
    group = [p for p in probs for _ in range(cfg.grpo.group_size)]
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    gen, calls = scripted(tok, stop, call_tool=True)
    seen: list = []
    params = EpisodeSampling(max_new_tokens=env_cfg.max_new_tokens)
    sessions, outs = run_episodes(group, env_cfg, tok, params, [stop], gen, fake_tool(seen))
    assert calls == [10, 10]  # turn 1 of all ten episodes in one batch, then their second turns
    assert [r for r, _ in outs] == [1.0] * 10 and all(i["tool_calls"] == 1 and i["tool_ok"] == 1 for _, i in outs)
    assert {a["timeout_s"] for _, _, a in seen} == {env_cfg.options["tool_timeout_s"]}
    s, p = sessions[0], group[0]
    prompt = tok.encode(tok.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    a, b = re.findall(r"has (\d+) boxes with (\d+)", p.question)[-1]
    turn1 = tok.encode(f"```python\nprint({a} * {b})\n```", add_special_tokens=False) + [stop]
    env = tok.encode(template_continuation(tok, [{"role": "user", "content": arith.format_tool_output(
        {"stdout": f"{p.answer}\n", "exit_code": 0})}]), add_special_tokens=False)
    env = env[1:] if env[0] == stop else env  # the sampled stop token stands for the template's
    turn2 = tok.encode(f"Answer: {p.answer}", add_special_tokens=False) + [stop]
    assert s.input_ids == prompt + turn1 + env + turn2
    assert s.loss_mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)


def test_an_answer_without_a_tool_call_is_one_turn_and_scored_by_libra(tok) -> None:
    cfg = load_job(JOB)
    env_cfg, probs = job_problems(cfg, 1)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    gen, calls = scripted(tok, stop, call_tool=False)
    seen: list = []
    _, outs = run_episodes(probs, env_cfg, tok, EpisodeSampling(max_new_tokens=24), [stop], gen, fake_tool(seen))
    assert calls == [2] and not seen
    assert all(r == 0.0 and i["tool_calls"] == 0 and i["formatted"] for r, i in outs)  # format_reward is 0


def _records(acc: list[float], step_s: list[float]) -> list[dict]:
    return [{"step": i + 1, "step_time_s": t, "accuracy": a, "episode_correct": [1] * int(a * 10) + [0] * (10 - int(a * 10)),
             "episode_tool_calls": [1] * 10} for i, (a, t) in enumerate(zip(acc, step_s))]


def test_figures_quarters_and_ratios() -> None:
    trl = system_figures(_records([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.5, 0.5], [80, 60, 60, 60, 60, 60, 60, 60]), 5.0, 600.0)
    assert trl["step_s_mean"] == 62.5 and trl["step_s_mean_2n"] == 60.0 and trl["step1_s"] == 80
    assert [q["steps"] for q in trl["quarters"]] == [[1, 2], [3, 4], [5, 6], [7, 8]]
    first, last = trl["quarters"][0]["accuracy"], trl["quarters"][-1]["accuracy"]
    assert first["n"] == 20 and first["mean"] == pytest.approx(0.3) and last["mean"] == 0.5 and last["std"] == 0.5
    assert [p["wall_s"] for p in trl["accuracy_vs_wall"]][:3] == [80, 140, 200]
    assert [q["steps"] for q in quarters(_records([1.0] * 5, [1.0] * 5))] == [[1], [2], [3], [4, 5]]
    lib = system_figures(_records([0.0] * 8, [120, 55, 55, 55, 55, 55, 55, 55]), None, 700.0)
    agg = aggregate({1: {"trl": trl, "libra": lib}, 2: {"trl": trl, "libra": trl}})
    assert agg["ratios"][1]["step1"] == 1.5 and agg["ratios"][2]["step_s"] == 1.0
    assert agg["ratios_mean"]["step_s_2n"] == pytest.approx((55 / 60 + 1) / 2)
    assert agg["last_quarter_accuracy"]["libra"] == {"mean": 0.25, "per_seed": [0.0, 0.5], "n": 40}


def test_trl_offers_the_rollout_hook_the_bench_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    trl = pytest.importorskip("trl")
    import importlib
    import inspect

    # under pytest tests/vllm (a directory) imports as a package "vllm" with no version, which TRL's vllm probe
    # cannot parse; the bench never
    # uses vllm
    monkeypatch.setattr(importlib.import_module("trl.import_utils"), "is_vllm_available", lambda *a, **k: False)

    assert "rollout_func" in inspect.signature(trl.GRPOTrainer.__init__).parameters
    assert {"loss_type", "beta", "scale_rewards", "steps_per_generation", "shuffle_dataset"} <= set(
        inspect.signature(trl.GRPOConfig.__init__).parameters)
