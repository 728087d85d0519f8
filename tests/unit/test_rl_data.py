"""``[data]``: datasets from JSONL, Parquet and a ``save_to_disk`` directory through ``datasets``; the seeded
epoch order; the cursor a resumed job continues from; errors naming the file and key; the job file's
``[data]``/``[eval]``/``[rollout]``/``[grpo]`` keys reaching the broker's job spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.broker.job_host import JobSpec
from libra.config import ConfigError
from libra.rl.config import job_from_mapping, load_job
from libra.rl.data import DataOrder, job_data, load_rows, read_cursor, resume_point, write_cursor

datasets = pytest.importorskip("datasets")

RECORDS = [{"question": f"what is {i}+1?", "answer": str(i + 1), "id": i} for i in range(10)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def env_rows(n: int, seed: int) -> list[dict]:
    return [{"prompt": f"env {seed} {i}", "i": i} for i in range(n)]


def cfg(tmp_path: Path, **tables: dict) -> object:
    return job_from_mapping({"job": {"steps": 2, "prompts_per_step": 2, "seed": 5, "run_dir": str(tmp_path / "run")},
                             **tables})


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "disk"])
def test_rows_load_from_every_format_with_the_prompt_under_prompt(tmp_path: Path, fmt: str) -> None:
    ds = datasets.Dataset.from_list(RECORDS)
    path = {"jsonl": lambda: write_jsonl(tmp_path / "d.jsonl", RECORDS),
            "parquet": lambda: (ds.to_parquet(str(tmp_path / "d.parquet")), tmp_path / "d.parquet")[1],
            "disk": lambda: (ds.save_to_disk(str(tmp_path / "d")), tmp_path / "d")[1]}[fmt]()
    rows = load_rows(path, prompt_field="question", answer_field="answer")
    assert [r["id"] for r in rows] == list(range(10))
    assert rows[3]["prompt"] == "what is 3+1?" and rows[3]["question"] == rows[3]["prompt"] and rows[3]["answer"] == "4"


def test_a_json_file_may_hold_one_array_of_records(tmp_path: Path) -> None:
    """A ``.json`` file is JSON Lines or one JSON array of objects (the array was refused as "line 1 is not a
    JSON object"); an element that is not an object is named."""
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps(RECORDS, indent=1))
    rows = load_rows(arr, prompt_field="question", answer_field="answer")
    assert [r["id"] for r in rows] == list(range(10)) and rows[3]["prompt"] == "what is 3+1?"
    lines = write_jsonl(tmp_path / "l.json", RECORDS)
    assert [r["id"] for r in load_rows(lines, prompt_field="question")] == list(range(10))
    (tmp_path / "bad.json").write_text(json.dumps([{"question": "a"}, 7]))
    with pytest.raises(ConfigError, match=r"\[data\] train = '.*bad.json': element 1 of the array is not a JSON object"):
        load_rows(tmp_path / "bad.json", key="train", prompt_field="question")


def test_chat_message_prompts_are_kept(tmp_path: Path) -> None:
    recs = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}]}
            for i in range(3)]
    rows = load_rows(write_jsonl(tmp_path / "c.jsonl", recs), prompt_field="messages")
    assert rows[1]["prompt"][1] == {"role": "user", "content": "q1"}


def test_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[data\] train = '.*nope.jsonl': no such file"):
        load_rows(tmp_path / "nope.jsonl", key="train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(ConfigError, match=r"\[data\] eval = '.*bad.jsonl': line 3 is not valid JSON"):
        load_rows(bad, key="eval")
    good = write_jsonl(tmp_path / "g.jsonl", RECORDS)
    with pytest.raises(ConfigError, match=r"prompt_field = 'prompt'.*g.jsonl.*fields: question, answer, id"):
        load_rows(good, prompt_field="prompt")
    with pytest.raises(ConfigError, match=r"answer_field = 'solution'.*no such field"):
        load_rows(good, prompt_field="question", answer_field="solution")
    with pytest.raises(ConfigError, match=r"row 1: prompt_field 'id' must hold a string or a list of chat messages"):
        load_rows(good, prompt_field="id")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unknown format"):
        load_rows(tmp_path / "x.csv")


def test_order_is_shuffled_by_seed_per_epoch_and_epochs_cover_every_row() -> None:
    rows = [{"i": i} for i in range(10)]
    a = [r["i"] for r in DataOrder(rows, seed=1, epochs=2).take(0)]
    assert a == [r["i"] for r in DataOrder(rows, seed=1, epochs=2).take(0)]  # same seed, same order
    assert a != [r["i"] for r in DataOrder(rows, seed=2, epochs=2).take(0)]
    assert len(a) == 20 and sorted(a[:10]) == sorted(a[10:]) == list(range(10)) and a[:10] != a[10:]
    assert [r["i"] for r in DataOrder(rows, seed=1, shuffle=False).take(0)] == list(range(10))
    o = DataOrder(rows, seed=1, epochs=3)
    assert o.locate(23) == (2, 3) and o.take(23, 4) == o.take(0)[23:27]


def test_job_data_from_a_file_then_resumed_from_the_saved_cursor_continues_the_order(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    c = cfg(tmp_path, data={"train": str(f), "prompt_field": "question", "epochs": 3})
    full = job_data(c, env_rows)
    ids = [r["id"] for r in full.rows]
    assert len(ids) == 30 and ids[:10] != list(range(10))  # all 3 epochs fit the budget; shuffled
    ck = tmp_path / "run" / "checkpoints" / "step1"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text("{}")
    (ck / "model.safetensors").write_bytes(b"")
    write_cursor(tmp_path / "run", full.cursor(13, 1, str(ck)))  # what a step-1 record with a checkpoint leaves
    cur, model = resume_point(tmp_path / "run", c.job.steps)
    assert (cur.epoch, cur.index, cur.step) == (1, 3, 1) and model == ck
    resumed = job_data(c, env_rows, cursor=cur)
    assert [r["id"] for r in resumed.rows] == ids[13:]
    assert resumed.spec() == {"steps": 1, "step_offset": 1, "row_offset": 13, "eval_rows": []}


def test_resume_without_a_cursor_or_past_the_end_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data_cursor.json does not exist"):
        resume_point(tmp_path, 3)
    order = DataOrder([{"i": 0}], seed=0)
    write_cursor(tmp_path, order.cursor(3, 3, str(tmp_path)))
    assert read_cursor(tmp_path).position == 3
    with pytest.raises(ConfigError, match="already trained step 3"):
        resume_point(tmp_path, 3)


def test_without_data_the_env_problems_are_the_rows_and_too_little_data_is_refused(tmp_path: Path) -> None:
    d = job_data(cfg(tmp_path, eval={"prompts": 3}), env_rows)
    assert d.rows == env_rows(2 * 2 * 4 + 64, 5)  # as before [data] existed
    assert len(d.eval_rows) == 3 and d.eval_rows[0]["prompt"] != d.rows[0]["prompt"]  # another seed
    f = write_jsonl(tmp_path / "small.jsonl", RECORDS[:3])
    with pytest.raises(ConfigError, match=r"\[data\] train = .*3 rows x epochs 1.*needs 4.*raise \[data\] epochs"):
        job_data(cfg(tmp_path, data={"train": str(f), "prompt_field": "question"}), env_rows)


def test_the_job_file_chooses_sampling_context_engine_and_grpo_variants(tmp_path: Path) -> None:
    from libra.rl.driver import job_spec

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    job = tmp_path / "job.toml"
    job.write_text('[data]\ntrain = "d.jsonl"\neval = "d.jsonl"\nprompt_field = "question"\n'
                   '[eval]\nevery = 2\nk = 3\ntemperature = 1\n'
                   '[rollout]\nengine = "vllm"\nmax_total_tokens = 512\n'
                   '[env]\ntemperature = 0.7\ntop_p = 0.9\nmax_new_tokens = 20\n'
                   '[grpo]\nloss_agg = "seq_mean_token_mean"\nclip_high = 0.28\nfilter_zero_variance = true\n')
    c = load_job(job)
    assert c.data.train == str(tmp_path / "d.jsonl")  # relative to the job file
    spec = job_spec(c, tmp_path, tmp_path, 1)
    assert spec["episode"]["sampling"] == {"max_new_tokens": 20, "temperature": 0.7, "top_p": 0.9,
                                           "max_total_tokens": 512}
    assert spec["grpo"]["aggregation"] == "seq_mean_token_mean" and spec["grpo"]["clip_high"] == 0.28
    data = job_data(c, env_rows)
    js = JobSpec.from_mapping({**spec, **data.spec(), "env": "arith"})
    assert js.filter_zero_variance and js.eval_every == 2 and js.eval_k == 3 and len(js.eval_rows) == 10
    for bad, needle in (({"rollout": {"engine": "sglang"}}, r"\[rollout\] engine"),
                        ({"grpo": {"loss_agg": "sum"}}, r"\[grpo\] loss_agg"), ({"data": {"epochs": 0}}, "epochs")):
        with pytest.raises(ConfigError, match=needle):
            job_from_mapping(bad)


def test_rollout_engine_of_the_job_file_reaches_the_actors_libra_run_starts(tmp_path: Path, monkeypatch) -> None:
    import libra.local
    from libra.rl import driver

    seen = {}

    class Stop(Exception):
        pass

    class FakeCluster:
        def __init__(self, **kw: object) -> None:
            seen.update(kw)

        def start(self, **kw: object) -> None:
            raise Stop

    monkeypatch.setattr(libra.local, "LocalCluster", FakeCluster)
    monkeypatch.setattr(driver, "host_gpus", lambda: (0, "no GPU"))
    monkeypatch.delenv("LIBRA_ROLLOUT_ENGINE", raising=False)
    with pytest.raises(Stop):
        driver.run_job(cfg(tmp_path, rollout={"engine": "vllm"}), progress=False)
    assert seen["env"]["LIBRA_ROLLOUT_ENGINE"] == "vllm"


def test_a_dataset_error_fails_libra_run_before_any_process_starts(tmp_path: Path, monkeypatch) -> None:
    import libra.local
    from libra.rl import driver

    monkeypatch.setattr(libra.local, "LocalCluster", None)  # never reached
    monkeypatch.setattr(driver, "host_gpus", lambda: (0, "no GPU"))
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(driver.JobFailed, match=r"\[data\] train = .*t.jsonl.*line 2 is not valid JSON"):
        driver.run_job(cfg(tmp_path, data={"train": str(bad)}), progress=False)


def test_model_directory_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    from libra.rl.driver import JobFailed, resolve_model

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(JobFailed, match=r"\[model\] name .* has no chat template"):
        resolve_model(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_handle_record_writes_evals_says_no_signal_and_saves_the_cursor_at_checkpoints(tmp_path: Path) -> None:
    from libra.rl.evals import eval_summary, handle_record
    from libra.rl.metrics import MetricsWriter, read_metrics

    data = job_data(cfg(tmp_path), env_rows)
    said: list[str] = []
    m = MetricsWriter(tmp_path / "metrics.jsonl")
    ev = {"kind": "eval", "step": 2, "prompts": 3, "k": 2, "greedy_accuracy": 0.5, "pass@1": 0.25, "pass@2": 0.5}
    assert handle_record(dict(ev), tmp_path, data, m, said.append) is True
    step = {"step": 2, "no_signal": True, "batch_zero_variance_groups": 2, "filtered_groups": 8,
            "zero_variance_share": 1.0, "checkpoint": "/ck/step2", "data_position": 7}
    assert handle_record(step, tmp_path, data, m, said.append) is False  # the driver writes step records
    m.close()
    assert said[0].startswith("eval after step 2 (3 prompts): greedy_accuracy 0.500, pass@1 0.250, pass@2 0.500")
    assert "step 2 trained on no signal" in said[1] and "max_extra_groups" in said[1]
    assert read_metrics(tmp_path, "eval") == [ev] and read_metrics(tmp_path) == []
    cur = read_cursor(tmp_path)
    assert (cur.position, cur.step, cur.checkpoint) == (7, 2, "/ck/step2")
    s = eval_summary([ev, {**ev, "step": 4, "pass@2": 1.0}])
    assert s["rounds"] == 2 and s["first"]["pass@2"] == 0.5 and s["last"] == {**s["last"], "step": 4, "pass@2": 1.0}
