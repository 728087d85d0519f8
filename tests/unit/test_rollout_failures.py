"""The rollout role's failure paths, through the call path a GPU takes (engines with a KV cache of their own, so
the context service passes ``sessions=``): an out-of-memory error frees the cache only after the failed call's
tensors are gone, ``EngineOutOfMemory`` is ``oom`` too, ``EngineCrashed`` is ``engine_failed`` followed by a
rebuilt engine (with a back-off while rebuilding fails), any other engine error keeps the engine, and a prompt
over the engine's context limit fails only its own turn. The real HF engine on the CPU where it matters."""

from __future__ import annotations

import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from libra.actors.rollout_role import RolloutRole
from libra.actors.slot_records import slot_record_path
from libra.actors.tools import ToolError, WorkContext
from libra.engines.device import cuda
from libra.engines.kv_cache import KVCache
from libra.engines.rollout_base import EngineCrashed, EngineOutOfMemory, GenResult
from libra.engines.tiny_model import ensure_tiny_model


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


def ctx(traj: str = "t1") -> WorkContext:
    return WorkContext("w1", traj, 60.0, threading.Event(), "test")


def args(prompt: list[int] | None = None, max_new: int = 4) -> dict[str, Any]:
    return {"prompt_ids": prompt or [5, 6, 7], "max_new_tokens": max_new, "temperature": 1.0, "stop_token_ids": [],
            "seed": 3, "weights": None}


def record(run: Path, slot: str) -> dict:
    return json.loads(slot_record_path(run, slot).read_text())


def failure(role: RolloutRole, a: dict[str, Any], c: WorkContext | None = None) -> tuple[str, str]:
    """The code and message of the ToolError a turn fails with (the exception itself is not kept)."""
    try:
        role.generate(a, c or ctx())
    except ToolError as exc:
        return exc.code, exc.message
    raise AssertionError("the turn did not fail")


def test_a_cuda_oom_is_freed_after_the_failed_calls_tensors_are_gone(tiny: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU twin of tests/gpu/test_placement_gpu.py's OOM test: the same stand-in on the real HF engine."""
    role = RolloutRole(str(tiny), str(tmp_path), "cpu0", max_batch=8, window_s=0.0)
    eng = role.engine
    real = eng.generate
    allocated: list[weakref.ref] = []
    at_free: list[bool] = []

    def first_call_allocates_too_much(reqs, **kwargs):  # the real call passes sessions=
        if not allocated:
            held = torch.empty(1 << 20)  # the batch's working memory, held by this frame when the error rises
            allocated.append(weakref.ref(held))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real(reqs, **kwargs)

    monkeypatch.setattr(cuda, "free_cuda_cache", lambda: at_free.append(allocated[0]() is None))
    eng.generate = first_call_allocates_too_much
    code, msg = failure(role, args())
    assert code == "oom" and "8 -> 4" in msg
    assert at_free == [True]  # the cache was freed only once the failed call's tensor was released
    assert (role.max_batch, eng.max_batch_size, role.ooms) == (4, 4, 1)
    out = role.generate(args(), ctx())  # the same engine serves the next turn, through the session path
    assert len(out["token_ids"]) == 4 and eng.context("t1") is not None
    rec = record(tmp_path, "cpu0")
    assert rec["ooms"] == 1 and rec["max_batch"] == 4
    assert rec["memory_releases"][-1]["why"] == "oom" and rec["memory_releases"][-1]["after"]["rss_bytes"] > 0
    role.close()


class Fake:
    """A rollout engine with a KV cache of its own (the context service passes ``sessions=``, as to the HF
    engine); ``fail`` is raised by its next call."""

    weights_version = 0
    max_model_len = 64

    def __init__(self, fail: BaseException | None = None) -> None:
        self.max_batch_size, self.fail, self.calls, self.closed = 32, fail, 0, False
        self.kv_cache = KVCache(1 << 20)

    def generate(self, reqs: list, sessions: list | None = None) -> list[GenResult]:
        self.calls += 1
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        return [GenResult([1, 2], [-0.1, -0.2], "length", 0) for _ in reqs]

    def close(self) -> None:
        self.closed = True


def role_with(engine: Fake, run: Path, factory: Any = None) -> RolloutRole:
    more = {"engine_factory": factory} if factory is not None else {}
    return RolloutRole("/no/model", str(run), "gpu0", max_batch=32, window_s=0.0, engine=engine, **more)


def test_engine_out_of_memory_is_oom_and_lowers_the_engines_batch(tmp_path: Path) -> None:
    engine = Fake(EngineOutOfMemory("the vLLM worker ran out of device memory"))
    role = role_with(engine, tmp_path)
    code, msg = failure(role, args())
    assert code == "oom" and "32 -> 16" in msg and "EngineOutOfMemory" in msg
    assert (role.max_batch, engine.max_batch_size) == (16, 16)
    assert role.generate(args(), ctx())["token_ids"] == [1, 2]
    role.close()


def test_a_crashed_engine_fails_its_batch_and_is_rebuilt_before_the_next(tmp_path: Path) -> None:
    dead = Fake(EngineCrashed("the engine core died"))
    built: list[Fake] = []

    def factory() -> Fake:
        built.append(Fake())
        return built[-1]

    role = role_with(dead, tmp_path, factory)
    gone = weakref.ref(dead)
    code, msg = failure(role, args())
    assert code == "engine_failed" and "crashed" in msg and "EngineCrashed" in msg
    assert dead.closed and len(built) == 1 and role.engine is built[0]
    del dead
    assert gone() is None  # nothing of the role holds the dead engine
    out = role.generate(args(), ctx())
    assert out["token_ids"] == [1, 2] and built[0].calls == 1
    rec = record(tmp_path, "gpu0")
    assert rec["engine_restarts"] == 1 and rec["memory_releases"][-1]["why"] == "engine_crashed"
    role.close()
    assert built[0].closed


def test_a_failed_rebuild_backs_off_then_builds(tmp_path: Path) -> None:
    tries: list[str] = []

    def factory() -> Fake:
        tries.append("try")
        if len(tries) == 1:
            raise RuntimeError("CUDA out of memory while loading the model")
        return Fake()

    role = role_with(Fake(EngineCrashed("worker died")), tmp_path, factory)
    assert failure(role, args())[0] == "engine_failed"
    code, msg = failure(role, args())  # within the back-off: no second try yet
    assert code == "engine_failed" and "next try in" in msg and tries == ["try"]
    assert record(tmp_path, "gpu0")["restart_errors"] == 1 and role.engine is None
    role.BACKOFF_S = (0.0, 0.0)  # the back-off over: the next batch rebuilds
    role._restart = (0.0, 0.0)
    assert role.generate(args(), ctx())["token_ids"] == [1, 2] and tries == ["try", "try"]
    assert record(tmp_path, "gpu0")["engine_restarts"] == 1
    role.close()


def test_any_other_engine_error_fails_the_batch_and_keeps_the_engine(tmp_path: Path) -> None:
    engine = Fake(RuntimeError("a bug in the engine"))
    role = role_with(engine, tmp_path, lambda: pytest.fail("no rebuild for an ordinary failure"))
    assert failure(role, args()) == ("engine_failed", "RuntimeError: a bug in the engine")
    assert role.engine is engine and not engine.closed
    assert role.generate(args(), ctx())["token_ids"] == [1, 2]
    role.close()


def test_an_over_long_prompt_fails_only_its_own_turn(tiny: Path, tmp_path: Path) -> None:
    role = RolloutRole(str(tiny), str(tmp_path), "cpu0", max_batch=8, window_s=0.0)
    eng = role.engine
    assert eng.max_model_len == 2048  # the tiny model's max_position_embeddings
    real, gate, entered = eng.generate, threading.Event(), threading.Event()

    def gated(reqs, **kwargs):  # the first batch waits, so the next turns queue up and share one batch
        entered.set()
        assert gate.wait(120)
        return real(reqs, **kwargs)

    eng.generate = gated
    long = args(list(range(5, 5 + 2046)), max_new=4)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(role.generate, args(), ctx("t0"))
        assert entered.wait(120)
        turns = [pool.submit(role.generate, a, ctx(f"t{i}")) for i, a in enumerate((args(), long, args()), 1)]
        deadline = time.monotonic() + 120
        while role._q.qsize() + sum(f.done() for f in turns) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        assert len(first.result(120)["token_ids"]) == 4
        with pytest.raises(ToolError) as exc:
            turns[1].result(120)
        ok = [turns[0].result(120), turns[2].result(120)]
    assert exc.value.code == "context_too_long"
    assert "2046" in exc.value.message and "2050" in exc.value.message and "max_model_len (2048)" in exc.value.message
    assert all(len(o["token_ids"]) == 4 and o["batch"] == 2 for o in ok)  # its batch ran without it
    assert role.stats["context_too_long"] == 1  # in the record from its next write
    role.close()


def test_close_releases_the_engine_and_is_idempotent(tiny: Path, tmp_path: Path) -> None:
    role = RolloutRole(str(tiny), str(tmp_path), "cpu0", max_batch=4, window_s=0.0)
    role.generate(args(), ctx())
    engine, model = weakref.ref(role.engine), weakref.ref(role.engine.model)
    role.close()
    role.close()
    assert role.engine is None and engine() is None and model() is None
    assert not role._thread.is_alive()
    assert failure(role, args())[0] == "engine_failed"  # a closed instance answers, it never hangs
    assert record(tmp_path, "cpu0")["memory_releases"][-1]["why"] == "close"
