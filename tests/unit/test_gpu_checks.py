"""The GPU check's programs (``libra.bench.gpu_checks``) run on the CPU on the tiny model, so that what
``scripts/gpu-check.sh`` runs on a GPU cannot rot unseen; and ``bench engines`` reads its clocks only after
the device has finished its work (``torch.cuda.synchronize`` on CUDA), for our engines and the baselines alike."""

from __future__ import annotations

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
