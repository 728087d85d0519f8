"""``libra run``'s terminal view, driven by a fake step stream: a step bar and a per-episode bar, log lines
printed above the bars (not into them), nothing at all with ``--no-progress`` (which also switches off
transformers' bars here and in the processes the job starts), and a bar for SmolLM2's one-time conversion."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from libra.logging import configure, console_writer, get_logger
from libra.rl.progress import QUIET_ENV, JobProgress, quiet_progress


def _record(step: int) -> dict:
    return {"step": step, "reward_mean": 0.25 * step, "accuracy": 0.2 * step, "tokens_per_s": 100.0 + step}


def _drive(bar: JobProgress) -> None:
    """Two steps of 8 episodes each, polled as the broker would answer."""
    for collected, training in ((0, False), (3, False), (8, False), (0, True)):
        bar.poll(collected, training)
    bar.step(_record(1))
    bar.poll(5, False)
    bar.write("step 1 had no GRPO signal")


def test_step_and_episode_bars_follow_the_stream() -> None:
    out = io.StringIO()
    with JobProgress("arith", 2, 8, file=out) as bar:
        _drive(bar)
        assert (bar.steps_bar.n, bar.episodes_bar.n, bar.episodes_bar.total) == (1, 5, 8)
    text = out.getvalue()
    for seen in ("libra run arith", "episodes of step 1", "3/8", "8/8", "training", "episodes of step 2", "5/8",
                 "1/2", "reward=0.25", "acc=0.20", "step 1 had no GRPO signal"):
        assert seen in text, (seen, text)
    assert not re.search(r"\bep/s", text)  # the count jumps from poll to poll: a rate would be noise


def test_no_episode_bar_for_a_step_after_the_last() -> None:
    out = io.StringIO()
    with JobProgress("j", 2, 4, file=out) as bar:
        bar.poll(0, True)
        bar.step(_record(1))
        assert not bar.episodes_bar.postfix  # the new step's bar starts clean ...
        drawn = out.getvalue()
        assert "training" not in drawn[drawn.rindex("episodes of step 2"):]  # ... from its first drawing
        bar.poll(0, True)
        bar.step(_record(2))
        assert bar.episodes_bar is None
        bar.poll(3, False)  # a poll after the last step draws nothing more
    assert "episodes of step 3" not in out.getvalue()


def test_episodes_collected_beyond_the_step_are_capped() -> None:
    out = io.StringIO()
    with JobProgress("j", 3, 4, file=out) as bar:
        bar.poll(9, False)  # lag 1: a later step's episodes are collected too
        assert bar.episodes_bar.n == 4
        bar.poll(-1, False)
        assert bar.episodes_bar.n == 0


def test_log_lines_go_above_a_live_bar_and_to_stderr_after(capsys: pytest.CaptureFixture[str]) -> None:
    configure("warning", json=True)
    log = get_logger("test")
    out = io.StringIO()
    with JobProgress("j", 2, 4, file=out) as bar:
        bar.poll(1)
        log.warning("sandbox_evicted", slot="cpu1")
    assert "sandbox_evicted" in out.getvalue()  # through tqdm.write, on the bars' stream
    assert "sandbox_evicted" not in capsys.readouterr().err
    log.warning("after_the_bars")
    assert "after_the_bars" in capsys.readouterr().err
    assert "after_the_bars" not in out.getvalue()


def test_console_writer_gets_whole_lines() -> None:
    from libra.logging import _Stderr

    lines: list[str] = []
    with console_writer(lines.append):
        s = _Stderr()
        s.write("first part ")
        s.write("and the rest")
        s.write("\n")
        s.write("two\nlines\n")
    assert lines == ["first part and the rest", "two", "lines"]


def test_no_progress_draws_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    configure("warning", json=True)
    out = io.StringIO()
    bar = JobProgress("j", 2, 8, enabled=False, file=out)
    _drive(bar)
    bar.close()
    assert out.getvalue() == ""
    err = capsys.readouterr().err
    assert "job_note" in err and "%|" not in err  # the note as a log line, no bar


def test_quiet_progress_switches_transformers_off_and_back() -> None:
    hf_logging = pytest.importorskip("transformers.utils.logging")
    hf_logging.enable_progress_bar()
    before = {k: os.environ.get(k) for k in QUIET_ENV}
    with quiet_progress():
        assert not hf_logging.is_progress_bar_enabled()
        assert all(os.environ[k] == v for k, v in QUIET_ENV.items())
    assert hf_logging.is_progress_bar_enabled()
    assert {k: os.environ.get(k) for k in QUIET_ENV} == before


def test_run_job_without_progress_starts_its_processes_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """What ``libra run --no-progress`` passes on: the environment the cluster's processes inherit; with
    progress, a line says what the minutes before the first step are spent on."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    from libra.rl import driver
    from libra.rl.config import job_from_mapping

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_cluster(*a: Any, **kw: Any) -> None:
        seen.update(env={k: os.environ.get(k) for k in QUIET_ENV}, hf=hf_logging.is_progress_bar_enabled())
        raise Stop

    monkeypatch.setattr(driver, "start_cluster", fake_cluster)
    monkeypatch.setattr(driver, "host_gpus", lambda: (0, "no GPU"))
    monkeypatch.setattr(driver, "resolve_model", lambda name: tmp_path)
    for k in QUIET_ENV:
        monkeypatch.delenv(k, raising=False)
    cfg = job_from_mapping({"job": {"run_dir": str(tmp_path / "run")}})
    for progress, quiet in ((False, True), (True, False)):
        hf_logging.enable_progress_bar()
        with pytest.raises(Stop):
            driver.run_job(cfg, progress=progress)
        assert seen["hf"] is not quiet
        assert seen["env"] == (QUIET_ENV if quiet else {k: None for k in QUIET_ENV})
        assert ("starting a broker and actor slots" in capsys.readouterr().err) is not quiet
    assert all(k not in os.environ for k in QUIET_ENV)  # put back when the job ends


def test_smollm2_conversion_shows_its_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from libra.engines import smollm2

    import importlib.util

    real_find_spec = importlib.util.find_spec
    calls: list[bool] = []
    # the conversion's own dependencies are not part of the test install: the stand-in _convert needs neither
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("gguf", "accelerate") else real_find_spec(name, *a))
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: tmp_path / smollm2.GGUF_NAME)
    monkeypatch.setattr(smollm2, "_convert", lambda src, out, progress=False: calls.append(progress))
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    smollm2.ensure_smollm2(tmp_path / "a")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # --no-progress
    smollm2.ensure_smollm2(tmp_path / "b")
    smollm2.ensure_smollm2(tmp_path / "c", progress=True)
    assert calls == [True, False, True]


def test_smollm2_convert_draws_a_bar_of_its_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``_convert`` with stand-ins for transformers' classes: the bar names every stage; none without progress."""
    pytest.importorskip("transformers")
    from libra.engines import smollm2

    class Fake:
        config = type("Cfg", (), {})()
        generation_config = None

        @classmethod
        def from_pretrained(cls, *a: Any, **kw: Any) -> "Fake":
            return cls()

        def __init__(self, *a: Any) -> None:
            pass

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, sd: dict) -> None:
            pass

        def save_pretrained(self, out: Any) -> None:
            pass

    names = ("AutoTokenizer", "AutoModelForCausalLM", "LlamaForCausalLM")
    import transformers  # noqa: F401  (resolve every lazy name first: a later lazy load would put the real ones back)

    for name in names:
        getattr(sys.modules["transformers"], name)
    for name in names:
        monkeypatch.setattr(sys.modules["transformers"], name, Fake)
    smollm2._convert(tmp_path / smollm2.GGUF_NAME, tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "converting SmolLM2 once" in err and f"{len(smollm2.STAGES)}/{len(smollm2.STAGES)}" in err
    for stage in smollm2.STAGES:
        assert stage in err, stage
    smollm2._convert(tmp_path / smollm2.GGUF_NAME, tmp_path, progress=False)
    assert "converting" not in capsys.readouterr().err


def test_the_broker_poll_counts_the_episodes_collected_for_the_next_batch() -> None:
    """``episodes_collected``: finished episodes in groups not yet cut into a batch (the episode bar's count)."""
    from libra.broker.job_host import JobHost, JobSpec

    spec = {"steps": 2, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 0, "world_size": 1, "env": "arith",
            "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
            "master_port": 12345, "checkpoint_dir": "/tmp/ck"}
    h = JobHost("j", JobSpec.from_mapping(spec), [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1}
                                                  for i in range(4)], 0.0)
    works = h.take_work(0.0)
    assert len(works) == 6 and h.poll(0)["episodes_collected"] == 0
    seen = []
    for i, w in enumerate(works):
        out = {"reward": float(i % 2), "versions": [0], "gen_tokens": 4, "tokens": 8 + i,
               "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"t{i}", "version": None, "server_key": None,
                       "bytes": 72}, "info": {"correct": i % 2 == 1, "tool_calls": 0}}
        h.on_reply(w.tag, True, out, "", 1.0)
        seen.append(h.poll(0)["episodes_collected"])
    assert seen == [1, 2, 3, 4, 5, 6]
    assert [w.kind for w in h.take_work(2.0)] == ["train"]  # the batch is cut: its episodes left the count
    assert h.poll(0)["episodes_collected"] == 0 and h.poll(0)["training"] is True


_CHILD = ("import os, sys; sys.stderr.write('child warning json=' + os.environ.get('LIBRA_LOG_JSON', '?') + '\\n'); "
          "sys.stderr.write('bar 1\\rbar 2\\n'); sys.stderr.write('last line without newline')")


def _run_child_inside(route: bool) -> Any:
    import subprocess

    from libra.rl.progress import children_above_bars

    with children_above_bars(route) as pump:
        child = subprocess.Popen([sys.executable, "-c", _CHILD])
    assert child.wait(timeout=120) == 0
    if pump is not None:
        pump.join(timeout=120)
        assert not pump.is_alive()
    return pump


def test_the_job_processes_write_above_the_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIBRA_LOG_JSON", raising=False)
    lines: list[str] = []
    with console_writer(lines.append):
        _run_child_inside(True)
    assert lines == ["child warning json=0", "bar 2", "last line without newline"]
    assert "LIBRA_LOG_JSON" not in os.environ  # only the children's environment had it


def test_the_job_processes_write_to_stderr_without_a_bar(capfd: pytest.CaptureFixture[str]) -> None:
    _run_child_inside(True)
    err = capfd.readouterr().err
    assert "child warning json=0\nbar 2\nlast line without newline\n" in err
    assert _run_child_inside(False) is None  # not routed: the child writes straight to stderr
    assert "bar 1\rbar 2" in capfd.readouterr().err


@pytest.mark.parametrize("env,renderer", [("0", "ConsoleRenderer"), ("1", "JSONRenderer")])
def test_libra_log_json_picks_the_format(env: str, renderer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import structlog

    monkeypatch.setenv("LIBRA_LOG_JSON", env)
    configure("warning")
    assert type(structlog.get_config()["processors"][-1]).__name__ == renderer
    configure("warning", json=True)
