"""A user's own job end to end through ``run_job`` (what ``python -m libra run`` does) on real processes:
the example outside the package, ``examples/search_env`` (its environment by import path, its ``[data]``
JSONL, its ``search`` tool served by the job's action slot through ``[actors] tools``), with the tiny
random model, two GRPO steps.

The tiny model emits random tokens, so it never writes ``<search>`` by itself: the job file sets
``[env.options] retrieve = "fallback"``, under which the environment searches the question itself after a
first turn that neither searches nor answers (Search-R1's retrieve-first baseline, one turn late). Every
episode therefore runs the ``search`` tool through the broker (``session.call_tool``), deterministically.
The tool appends each call's actor id to ``$SEARCH_ENV_CALL_LOG``, which the actors inherit from this
process: that file proves which slot ran every search. ``libra run`` starts its slots in the order of
``--roles`` (rollout, train, action, episode), so the action slot is ``cpu{rollout + trainer}``.

The same task as agent code written with the ``openai`` client (``search_env/agent.py``, through
``[env] entry = "libra.envs.openai_agent"``): every request is a turn on the runner's endpoint, the agent's
``search`` calls run through its trajectory's session on the action slot, and what trains is what was
sampled. The id-for-id proof has two halves: in every sampled episode the ids the client got back for each
turn (``return_token_ids``) equal the loss-mask-1 runs of the trajectory the runner publishes for the
trainer; and the trainer, at step 1 (trajectories sampled at version 0, trained at version 0), finds an
importance ratio of 1 over exactly the sampled token count. On the tiny model a token's log-prob varies by
about 1.6 nats over the vocabulary, so any shifted or re-tokenized id would move the ratio far from 1.

Also here: a job whose environment needs a tool that no actor serves is refused before it is submitted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from libra.rl.config import load_job
from libra.rl.driver import JobFailed, run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("bm25s", reason="the search example needs bm25s: pip install -e examples/search_env")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "search_env"
JOB = EXAMPLE / "job_tiny.toml"
AGENT_JOB = EXAMPLE / "job_agent_tiny.toml"


@pytest.fixture(scope="module")
def example_importable() -> None:
    """The example package importable here and in every actor (installed or not)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])))
        yield


@pytest.fixture(scope="module")
def search_run(tmp_path_factory: pytest.TempPathFactory, example_importable: None) -> dict:
    tmp = tmp_path_factory.mktemp("search")
    calls = tmp / "search_calls.jsonl"
    cfg = load_job(JOB).with_run_dir(str(tmp / "run"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SEARCH_ENV_CALL_LOG", str(calls))
        t0 = time.monotonic()
        summary = run_job(cfg, progress=False)
        wall = time.monotonic() - t0
    lines = calls.read_text().splitlines() if calls.exists() else []
    return {"cfg": cfg, "summary": summary, "run": tmp / "run", "calls": [json.loads(x) for x in lines],
            "wall_s": wall}


def test_search_example_trains_with_its_data_env_and_tool(search_run: dict) -> None:
    cfg, summary, run = search_run["cfg"], search_run["summary"], search_run["run"]
    recs = [r for r in read_metrics(run) if r.get("kind") in (None, "train")]
    assert [r["step"] for r in recs] == [1, 2] and summary["final_version"] == 2
    assert summary["episodes_failed"] == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("kind") == "eval"] == [2]  # [data] eval, after the last step
    train_questions = {json.loads(x)["question"] for x in (EXAMPLE / "search_env/data/train.jsonl").read_text().splitlines()}
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["question"] in train_questions for s in samples)  # the rows came from [data] train
    for r in recs:
        assert r["sequences"] == cfg.job.prompts_per_step * cfg.grpo.group_size
        # retrieve = "fallback": every episode searched once (turn 1 -> search -> turn 2, max_turns = 2)
        assert r["episode_tool_calls"] == [1] * r["sequences"], r["episode_tool_calls"]
        assert r["tool_success_rate"] == 1.0
    print(f"\nsearch example: {search_run['wall_s']:.1f} s for {len(recs)} steps; step_time_s "
          f"{[round(r['step_time_s'], 2) for r in recs]}; search calls by actor "
          f"{dict(Counter(c['actor'] for c in search_run['calls']))}")


def test_every_search_ran_on_the_action_slot_the_broker_chose(search_run: dict) -> None:
    cfg, calls, run = search_run["cfg"], search_run["calls"], search_run["run"]
    recs = [r for r in read_metrics(run) if r.get("kind") in (None, "train")]
    trained = sum(sum(r["episode_tool_calls"]) for r in recs)
    assert len(calls) >= trained > 0  # episodes beyond the trained ones (lag window) may have searched too
    a = cfg.actors
    action_slots = _action_slots(cfg)
    episode_slot = f"cpu{a.rollout + a.trainer + a.action}"
    slots = {c["actor"].rsplit("/", 1)[-1] for c in calls}
    assert slots <= action_slots and episode_slot not in slots, (slots, action_slots)
    assert len({c["pid"] for c in calls}) == 1  # one action process: the tool ran there, not in the runner
    assert all(c["cores"] == 1 and c["hits"] for c in calls)  # the declared core; BM25 found passages
    questions = {json.loads(x)["question"] for split in ("train", "eval")
                 for x in (EXAMPLE / f"search_env/data/{split}.jsonl").read_text().splitlines()}
    assert {c["query"] for c in calls} <= questions  # the fallback searched the question itself


def test_a_job_needing_a_tool_nobody_serves_is_refused(tmp_path: Path, example_importable: None) -> None:
    cfg = load_job(JOB).with_run_dir(str(tmp_path / "run"))
    cfg = dataclasses.replace(cfg, actors=dataclasses.replace(cfg.actors, tools=[]))  # nobody serves search
    with pytest.raises(JobFailed) as ei:
        run_job(cfg, progress=False)
    msg = str(ei.value)
    assert "'search'" in msg and "no connected actor offers" in msg and "[actors] tools" in msg, msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")


def _action_slots(cfg) -> set[str]:
    a = cfg.actors
    return {f"cpu{a.rollout + a.trainer + i}" for i in range(a.action)}


def test_openai_client_agent_trains_on_exactly_the_sampled_ids(tmp_path: Path, example_importable: None) -> None:
    pytest.importorskip("openai", reason="the agent is written with the openai client: pip install openai")
    calls = tmp_path / "search_calls.jsonl"
    cfg = load_job(AGENT_JOB).with_run_dir(str(tmp_path / "run"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SEARCH_ENV_CALL_LOG", str(calls))
        summary = run_job(cfg, progress=False)
    assert summary["episodes_failed"] == 0 and summary["final_version"] == 2
    recs = [r for r in read_metrics(tmp_path / "run") if r.get("kind") in (None, "train")]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # retrieve fallback, three turns: the agent searched after each of the first two
        assert r["episode_tool_calls"] == [2] * r["sequences"], r["episode_tool_calls"]
        assert r["tool_success_rate"] == 1.0
    first = recs[0]
    assert all(v == 0 for vs in first["turn_versions"] for v in vs)  # sampled at the weights step 1 trains
    assert first["trained_tokens"] == first["gen_tokens"] > 0
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) >= 2
    for smp in samples:
        info = smp["info"]
        assert info["endpoint_turns"] == 3 and len(info["turn_token_ids"]) == 3
        assert all(info["turn_token_ids"]) and info["turn_token_ids"] == info["recorded_token_ids"]
    slots = {json.loads(x)["actor"].rsplit("/", 1)[-1] for x in calls.read_text().splitlines()}
    assert slots and slots <= _action_slots(cfg)
