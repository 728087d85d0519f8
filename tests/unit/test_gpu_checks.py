"""The GPU check's programs (``libra.bench.gpu_checks``) run on the CPU on the tiny model, so that what
``scripts/gpu-check.sh`` runs on a GPU cannot rot unseen; and ``bench engines`` reads its clocks only after
the device has finished its work (``torch.cuda.synchronize`` on CUDA), for our engines and the baselines alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from libra.bench import engines, gpu_checks


def test_bf16_learning_check_loss_falls_and_weights_move_as_in_fp32(tmp_path) -> None:
    res = gpu_checks.bf16_learning(device="cpu", steps=5, lr=1e-5, n_seq=4, prompt_len=8, new_tokens=16,
                                   scratch=tmp_path)
    assert res["ok"], res
    assert res["master_fp32"] and res["param_dtypes"] == ["float32"]  # bf16 compute, fp32 master weights
    assert len(res["losses"]) == 5 and res["loss_last"] < res["loss_first"]
    assert res["moved_share_first_step"] >= 0.8 * res["fp32_moved_share_first_step"] > 0.5


def test_switch_check_frees_each_roles_model_by_reference_counting(tmp_path) -> None:
    res = gpu_checks.switch_memory(device="cpu", scratch=tmp_path)
    assert res["ok"], res
    assert res["freed_without_gc"] == {"rollout_model": True, "rollout_engine": True, "trainer_model": True}
    assert res["train_weights_version"] == 1
    assert set(res["memory_mib"]) == {"start", "rollout", "rollout_closed", "train", "train_closed",
                                      "rollout_again", "end"}
    assert all("rss" in m for m in res["memory_mib"].values())


def test_oom_check_fails_the_step_typed_and_the_trainer_trains_on(tmp_path) -> None:
    res = gpu_checks.trainer_oom(device="cpu", scratch=tmp_path)
    assert res["ok"], res
    assert res["is_oom"] and res["version_unchanged"] and res["recovered"]
    assert res["error_type"] is not None and "out of memory" in res["error"]


def test_a_check_that_raises_is_a_failed_record_and_the_cli_rejects_unknown_checks(tmp_path, monkeypatch,
                                                                                    capsys) -> None:
    def boom(**_: object) -> dict:
        raise RuntimeError("no engine")

    monkeypatch.setattr(gpu_checks, "trainer_oom", boom)
    (res,) = gpu_checks.run_checks(["oom"], shape=None, device="cpu", scratch=tmp_path)
    assert res["ok"] is False and res["error"] == "RuntimeError: no engine"
    assert 'RESULT {"check": "oom"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        gpu_checks.main(["bf16", "nonsense", "--device", "cpu"])
    assert exc.value.code == 2


def test_timed_synchronises_a_cuda_device_before_each_clock_read(monkeypatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    monkeypatch.setattr(engines, "_clock", lambda: events.append("clock") or float(len(events)))
    out, secs = engines.timed(lambda: events.append("work") or 7, "cuda:0")
    assert out == 7 and secs > 0
    assert events == ["sync cuda:0", "clock", "work", "sync cuda:0", "clock"]
    events.clear()
    engines.timed(lambda: events.append("work"), "cpu")
    assert events == ["clock", "work", "clock"]  # nothing to wait for on the CPU


def test_every_clock_read_of_bench_engines_follows_a_device_sync(monkeypatch) -> None:
    """Ours and the baselines: each timed region reads the clock right after the device was synchronised."""
    events: list[str] = []
    monkeypatch.setattr(engines, "sync", lambda device: events.append("sync"))
    monkeypatch.setattr(engines, "_clock", lambda: events.append("clock") or float(len(events)))
    from libra.engines.tiny_model import ensure_tiny_model

    model_dir = str(ensure_tiny_model())
    rows = engines.bench_rollout(model_dir, [2], prompt_len=4, new_tokens=3, repeats=2, device="cpu")
    train = engines.bench_train(model_dir, n_seq=4, prompt_len=4, new_tokens=4, micro_tokens=64, repeats=2,
                                device="cpu")
    assert rows[0]["ours_tok_s"] > 0 and train["floor_step_s"] > 0
    clocks = [i for i, e in enumerate(events) if e == "clock"]
    assert len(clocks) == 2 * 2 * 2 * 2  # (rollout, train) x (ours, baseline) x repeats x (start, stop)
    assert all(events[i - 1] == "sync" for i in clocks)
    src = Path(engines.__file__).read_text()
    assert src.count("perf_counter") == 1  # the module's one clock is `_clock`: no clock read bypasses timed()


def test_figures_reads_each_file_of_a_gpu_check_run_and_survives_missing_ones(tmp_path) -> None:
    from libra.bench.gpu_figures import figures

    (tmp_path / "summary.txt").write_text("setup rc=0 seconds=3 limit=40\njob rc=0 seconds=80 limit=110\n")
    (tmp_path / "00-setup.log").write_text("python 3.12.3 torch 2.11.0\ncard NVIDIA H100 80GB HBM3 79.2 GiB\n")
    bf16 = {"check": "bf16", "ok": True, "model": "qwen2-0.5b", "device": "cuda:0", "param_dtypes": ["float32"],
            "loss_first": -0.05, "loss_last": -0.2, "steps": 5, "lr": 1e-5, "moved_share_first_step": 0.81,
            "fp32_moved_share_first_step": 0.82, "bf16_over_fp32": 0.988}
    mem = {s: {"allocated": a} for s, a in (("start", 0.0), ("rollout", 1100.0), ("rollout_closed", 8.0),
                                             ("train", 9000.0), ("train_closed", 40.0), ("rollout_again", 1130.0),
                                             ("end", 40.0))}
    switch = {"check": "switch", "ok": True, "model": "qwen2-0.5b", "slot": "gpu0", "memory_mib": mem,
              "freed_without_gc": {"rollout_model": True}, "memory_returned": {"after_train": True},
              "actor_record": {"role_switches": [{"switch": 1, "role": "train", "released": ["rollout"],
                                                  "memory_before": {"allocated_bytes": 1100 * 2**20},
                                                  "memory_after": {"allocated_bytes": 8 * 2**20},
                                                  "gc_needed": False}]}}
    (tmp_path / "01-checks.log").write_text("noise\nRESULT " + json.dumps(bf16) + "\nRESULT " + json.dumps(switch)
                                            + '\nRESULT {"check": "oom", "ok": false, "error": "boom"}\n')
    (tmp_path / "02-pytest-gpu.log").write_text("FAILED tests/gpu/test_x.py::test_y - AssertionError\n"
                                                "==== 1 failed, 17 passed, 2 warnings in 80.1s ====\n")
    (tmp_path / "03-gpu.csv").write_text("timestamp, memory.used [MiB], memory.total [MiB], utilization.gpu [%]\n"
                                         "2026/01/01 00:00:00.000, 2 MiB, 81559 MiB, 0 %\n"
                                         "2026/01/01 00:00:01.000, 5200 MiB, 81559 MiB, 40 %\n")
    actor = {"id": "h/gpu0", "kinds": ["generate"], "gpu": {"memory_used_bytes": 5000 * 2**20}}
    (tmp_path / "03-status.jsonl").write_text(json.dumps({"t": 3, "status": {"actors": [actor]}}) + "\n"
                                              + json.dumps({"t": 5, "error": "no answer"}) + "\n")
    (tmp_path / "03-job.log").write_text("== the actors' records (RUN/actors/*.json)\n-- gpu0.json\n"
                                         + json.dumps({"torch_loads": 3, "dataplane_loads": 0}) + "\n")
    text = "\n".join(figures(tmp_path))
    assert "card: NVIDIA H100 80GB HBM3" in text
    assert "loss -0.0500 -> -0.2000 over 5 steps" in text and "moved by step 1 81.0%, fp32 82.0%" in text
    assert "rollout 1100.0" in text and "train_closed 40.0" in text and "1100 -> 8 MiB" in text
    assert "oom: FAILED: boom" in text
    assert "1 failed, 17 passed, 2 warnings" in text and "FAILED tests/gpu/test_x.py::test_y" in text
    assert "2 MiB before the job, peak 5200 MiB (+5198); utilisation peak 40 %" in text
    assert "1/2 samples answered" in text and "h/gpu0 5000" in text
    assert "job rc 0; 1 actor records; weight loads {'torch_loads': 3" in text
    assert "bench: n/a (FileNotFoundError" in text  # 04-bench.log missing: a line, not a failure
