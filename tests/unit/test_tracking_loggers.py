"""``[job] loggers`` (libra.rl.loggers): the config checks, the record → scalars mapping, and each tracker's
files read back with its package's own reader (TensorBoard's EventAccumulator, MLflow's client, W&B's
``leet inspect``); a missing package is a typed error before anything starts."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from libra.config import ConfigError
from libra.rl.config import job_from_mapping, load_job
from libra.rl.driver import run_job
from libra.rl.loggers import LoggerUnavailable, check_installed, gpu_fields, record_view
from libra.rl.loggers import fanout
from libra.rl.loggers.fanout import open_run_loggers
from tracking_readers import mlflow_metric, mlflow_run, tensorboard_scalars, tensorboard_texts, wandb_history

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"
STEP = {"step": 2, "reward_mean": 0.25, "reward_std": 0.1, "accuracy": 0.5, "tool_calls_per_episode": 1.5,
        "tool_success_rate": None, "policy_lag_max": 1, "policy_lag_mean": 0.5, "rollout_time_s": 1.25,
        "train_time_s": 0.5, "step_time_s": 2.0, "turn_weight_wait_s": 0.0, "group_wait_s": [0.1, 0.3],
        "tokens_per_s": 100.0, "predicted_step_s": 4.0, "weights_version": 2, "no_signal": False,
        "rewards": [0.0, 0.5], "checksums": ["ab", "ab"], "loss": float("nan")}


@pytest.fixture(autouse=True)
def _offline_trackers(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The trackers' defaults: W&B offline, MLflow in the run directory, nothing from the user's setup."""
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DISABLED", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path_factory.mktemp("wandb-cache")))  # its service's log


def test_loggers_default_to_jsonl_and_are_written_back_to_the_resolved_config() -> None:
    cfg = load_job(EXAMPLE)
    assert cfg.job.loggers == ["jsonl"]
    cfg = job_from_mapping({"job": {"loggers": ["jsonl", "tensorboard", "mlflow", "wandb"]}})
    assert 'loggers = ["jsonl", "tensorboard", "mlflow", "wandb"]' in cfg.to_toml()


@pytest.mark.parametrize(("loggers", "says"), [
    (["jsonl", "neptune"], "unknown logger(s) 'neptune' (known: jsonl, tensorboard, mlflow, wandb)"),
    (["wandb", "wandb"], "'wandb' given more than once"),
    ("wandb", "Input should be a valid list"),
])
def test_a_bad_loggers_list_is_refused_at_load(loggers: object, says: str) -> None:
    with pytest.raises(ConfigError, match="loggers") as err:
        job_from_mapping({"job": {"loggers": loggers}}, "job.toml")
    assert says in str(err.value) and "job.toml" in str(err.value)


@pytest.mark.parametrize(("name", "module"), [("wandb", "wandb"), ("mlflow", "mlflow"),
                                              ("tensorboard", "tensorboard")])
def test_a_missing_package_names_the_logger_and_the_extra(monkeypatch: pytest.MonkeyPatch, name: str,
                                                          module: str) -> None:
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # "not installed": its import fails
    with pytest.raises(LoggerUnavailable) as err:
        check_installed(["jsonl", name])
    assert isinstance(err.value, ConfigError)  # `libra run` says it in one line
    assert f"{name!r} needs the {module!r} package" in str(err.value)
    assert "pip install 'libra[tracking]'" in str(err.value)
    check_installed(["jsonl"])  # jsonl needs nothing


def test_run_job_refuses_a_missing_tracker_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    cfg = load_job(EXAMPLE).with_run_dir(str(run))
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, loggers=["jsonl", "wandb"]))
    with pytest.raises(LoggerUnavailable, match="libra\\[tracking\\]"):
        run_job(cfg, progress=False)
    assert not run.exists()  # no run directory, no broker, no actors


def test_a_step_record_maps_to_the_same_scalar_names_for_every_tracker() -> None:
    step, scalars, texts = record_view(STEP)
    assert step == 2 and texts == {}
    assert scalars["reward/mean"] == 0.25 and scalars["episode/accuracy"] == 0.5
    assert scalars["tools/calls_per_episode"] == 1.5 and "tools/success_rate" not in scalars  # None: left out
    assert scalars["lag/policy_lag_max"] == 1.0 and scalars["time/rollout_s"] == 1.25
    assert scalars["time/train_s"] == 0.5 and scalars["time/group_wait_s"] == 0.3
    assert scalars["throughput/tokens_per_s"] == 100.0 and "train/loss" not in scalars  # not finite
    assert scalars["planner/predicted_step_s"] == 4.0 and scalars["planner/measured_step_s"] == 2.0
    assert scalars["planner/prediction_log_error"] == pytest.approx(math.log(2.0))
    assert all(isinstance(v, float) for v in scalars.values())
    ev = record_view({"kind": "eval", "step": 3, "greedy_accuracy": 0.5, "pass@1": 0.25, "pass@4": 0.75,
                      "prompts": 4})
    assert ev == (3, {"eval/greedy_accuracy": 0.5, "eval/pass_at_1": 0.25, "eval/pass_at_4": 0.75}, {})
    dec = record_view({"kind": "decision", "what": "plan", "step": 1, "t": 2.5, "text": "plan: 2 rollout",
                       "detail": {"rollout": 2}})
    assert dec == (1, {}, {"decisions/plan": 'plan: 2 rollout (2.5 s into the job)\n{"rollout": 2}'})
    assert record_view({"kind": "something_new", "step": 1}) is None


def test_gpu_memory_comes_from_the_gpu_actors_samples() -> None:
    actors = [{"id": "h/gpu0", "gpu": {"index": 0.0, "memory_used_bytes": 3 * 2**30, "memory_total_bytes": 8 * 2**30,
                                       "utilization_pct": 50.0}},
              {"id": "h/gpu1", "gpu": {"index": 1.0, "memory_used_bytes": 1 * 2**30, "utilization_pct": 10.0}},
              {"id": "h/cpu0", "gpu": {}}]
    fields = gpu_fields(actors)
    assert fields == {"gpu_memory_used_bytes_max": 3 * 2**30, "gpu_memory_used_bytes_total": 4 * 2**30,
                      "gpu_utilization_pct_mean": 30.0, "gpu_actors": 2}
    _, scalars, _ = record_view({**STEP, **fields})
    assert scalars["gpu/memory_used_gib_max"] == 3.0 and scalars["gpu/memory_used_gib_total"] == 4.0
    assert scalars["gpu/utilization_pct_mean"] == 30.0 and scalars["gpu/actors"] == 2.0
    assert gpu_fields([{"id": "h/cpu0", "gpu": {}}]) == {}  # a CPU host's records are left as they are


def _records() -> list[dict]:
    recs = [{**STEP, "step": s, "reward_mean": 0.1 * s} for s in (1, 2, 3)]
    recs.insert(2, {"kind": "decision", "what": "plan", "step": 2, "t": 1.0, "text": "plan A", "detail": {}})
    recs.append({"kind": "eval", "step": 3, "greedy_accuracy": 0.5, "pass@4": 0.75})
    recs.append({"kind": "decision", "what": "plan", "step": 1, "t": 9.0, "text": "plan B", "detail": {}})  # late
    return recs


def test_every_tracker_writes_what_its_own_reader_reads_back(tmp_path: Path) -> None:
    recs = _records()
    loggers = open_run_loggers(["jsonl", "tensorboard", "mlflow", "wandb"], tmp_path, "unit",
                               {"job": {"name": "unit", "loggers": ["jsonl"]}, "env": {"options": {"a@b": 1}}})
    assert sorted(loggers.locations()) == ["mlflow", "tensorboard", "wandb"]
    for r in recs:
        loggers.write(r)
    loggers.close()
    # metrics.jsonl is written as it always was: one sorted-key JSON line per record, all of them
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [json.dumps(r, sort_keys=True) for r in recs]
    want = [(s, 0.1 * s) for s in (1, 2, 3)]  # the records' reward_mean
    tb = tensorboard_scalars(tmp_path)
    assert [(s, pytest.approx(v)) for s, v in tb["reward/mean"]] == want
    assert tb["eval/pass_at_4"] == [(3, 0.75)] and tb["planner/predicted_step_s"][0] == (1, 4.0)
    assert [t for _, t in tensorboard_texts(tmp_path)["decisions/plan"]] == ["plan A (1.0 s into the job)",
                                                                             "plan B (9.0 s into the job)"]
    assert mlflow_metric(tmp_path, "unit", "reward/mean") == want
    assert mlflow_metric(tmp_path, "unit", "eval/pass_at_4") == [(3, 0.75)]
    client, run_id = mlflow_run(tmp_path, "unit")
    run = client.get_run(run_id)
    assert run.data.params["job.name"] == "unit" and run.data.params["env.options.a_b"] == "1"
    assert run.info.status == "FINISHED"
    text = Path(client.download_artifacts(run_id, "decisions/plan.txt", str(tmp_path / "dl"))).read_text()
    assert text.splitlines() == ["step 2: plan A (1.0 s into the job)", "step 1: plan B (9.0 s into the job)"]
    hist = wandb_history(tmp_path)
    assert sorted(hist) == [1, 2, 3]
    assert [(s, hist[s]["reward/mean"]) for s in (1, 2, 3)] == want
    assert hist[3]["eval/pass_at_4"] == 0.75 and hist[3]["decisions/plan"].startswith("plan B")  # late: newest step


class _Broken:
    name, location = "broken", "nowhere"

    def __init__(self, *_: object) -> None:
        self.closed = 0

    def log_step(self, *_: object) -> None:
        raise OSError("disk gone")

    def close(self) -> None:
        self.closed += 1


def test_a_tracker_that_fails_is_dropped_and_the_run_directory_keeps_every_record(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fanout.ADAPTERS, "broken", _Broken)
    loggers = open_run_loggers(["jsonl", "broken"], tmp_path, "unit", {})
    (broken,) = loggers.trackers
    for r in _records():
        loggers.write(r)
    loggers.close()
    assert loggers.trackers == [] and broken.closed == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(_records())


def test_a_tracker_that_cannot_start_is_a_typed_error_and_closes_the_others(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[_Broken] = []

    def fine(*args: object) -> _Broken:
        opened.append(_Broken(*args))
        return opened[-1]

    def fails(*_: object) -> None:
        raise PermissionError("read-only run directory")

    monkeypatch.setitem(fanout.ADAPTERS, "tensorboard", fine)
    monkeypatch.setitem(fanout.ADAPTERS, "mlflow", fails)
    with pytest.raises(LoggerUnavailable, match="'mlflow' could not start its run.*read-only run directory"):
        open_run_loggers(["tensorboard", "mlflow"], tmp_path, "unit", {})
    assert [t.closed for t in opened] == [1]


def test_the_end_of_run_report_says_where_each_tracker_wrote() -> None:
    from libra.cli import format_summary

    text = format_summary({"job": "j", "loggers": {"tensorboard": "runs/j/tensorboard",
                                                   "wandb": "runs/j/wandb/offline-run-1"}}, "runs/j")
    assert "trackers ([job] loggers): tensorboard runs/j/tensorboard, wandb runs/j/wandb/offline-run-1" in text
    assert "trackers" not in format_summary({"job": "j", "loggers": {}}, "runs/j")
