"""Real processes on loopback (issue #19): EARL's selector in the broker moves two GPU-named rollout actors into one
TP-2 group through directives when the generate turns' context grows, and a real HF rollout actor re-bids as
its KV cache fills with growing contexts, the broker's credit following."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from libra.client import Client
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import free_port

from .procs import stop_all

pytestmark = pytest.mark.integration

PROC = str(Path(__file__).with_name("rollout_actor_proc.py"))

# a800 / qwen3-30b-a3b on 2 GPUs at 8 responses: TP 1 below ~20.5K tokens of context, TP 2 above
EARL_CONFIG = """
[broker]
router = "least_loaded"

[broker.planner]
allocation = "grp"
hardware = "a800"
model = "qwen3-30b-a3b"
interval_s = 1000000.0
parallelism = "earl"

[broker.planner.earl]
interval_s = 1.0
min_turns = 4
window = 6
loads = [8]
configs = [1, 2]
"""


def _broker(tmp_path: Path, config: str) -> tuple[str, subprocess.Popen]:
    cfg = tmp_path / "broker.toml"
    cfg.write_text(config)
    url = f"tcp://127.0.0.1:{free_port()}"
    return url, subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--config", str(cfg),
                                  "--heartbeat-s", "0.5", "--log-level", "warning"])


def _wait(what: str, cond, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_growing_context_moves_rollout_actors_into_a_tp2_group(tmp_path: Path) -> None:
    url, broker = _broker(tmp_path, EARL_CONFIG)
    procs = [broker] + [subprocess.Popen([sys.executable, PROC, "standin", url, f"gpu{k}"]) for k in range(2)]
    try:
        with Client(url, connect_timeout=30) as c:
            _wait("two actors", lambda: len(c.status().actors) == 2)
            ids = itertools.count()

            def turns(context: int, count: int) -> list[dict]:
                outs = []
                for _ in range(count):
                    tid = f"t{next(ids)}"
                    r = c.request("generate", "", {"prompt_ids": [5] * context, "max_new_tokens": 1},
                                  trajectory=tid, timeout=30)
                    c.end_trajectory(tid, total_output_tokens=1)
                    outs.append(r.output)
                return outs

            short = turns(1_000, 6)
            time.sleep(2.5)  # EARL decided at least once on the short contexts: nothing moves
            assert all(a["role"] == {} for a in c.status().actors)
            assert all(o["group"] == {} for o in short)

            def grouped():
                roles = [a["role"] for a in c.status().actors]
                ok = all(r.get("tp") == 2 for r in roles) and len({r.get("group") for r in roles}) == 1
                return roles if ok else None

            stop = threading.Event()

            def load() -> int:  # long-context turns keep coming while the actors switch: none may fail
                done = 0
                while not stop.is_set():
                    turns(30_000, 1)
                    done += 1
                return done

            with ThreadPoolExecutor(3) as pool:
                workers = [pool.submit(load) for _ in range(3)]
                try:
                    _wait("a TP-2 group", grouped, 30)
                    time.sleep(1.0)
                finally:
                    stop.set()
                assert sum(w.result() for w in workers) >= 6
            roles = _wait("a TP-2 group", grouped, 30)
            assert sorted(r["rank"] for r in roles) == [0, 1]
            earl = c.status().stats["planner"]["earl"]  # what `libra status --json` shows
            assert earl["switches"] == 1 and earl["average_context"] > 20_000
            assert [d for d in earl["decisions"] if d["reason"] == "switch"][-1]["tp"] == 2

            def switched():
                s = c.status()
                return s if sorted(len(a["kinds"]) for a in s.actors) == [0, 1] else None

            st = _wait("the switch to finish", switched, 30)
            leader = next(a for a in st.actors if a["kinds"])
            assert leader["role"]["rank"] == 0 and leader["kinds"] == ["generate"]  # the member bids for nothing
            after = turns(30_000, 2)
            assert all(o["group"]["tp"] == 2 and o["actor"] == leader["id"] for o in after)  # the group's leader serves
    finally:
        stop_all(procs)


def test_a_rollout_actor_rebids_as_its_kv_cache_fills(tmp_path: Path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    url, broker = _broker(tmp_path, '[broker]\nrouter = "least_loaded"\n')
    per_token = 2 * 2 * 1 * 32 * 4 + 4  # tiny model: 2 layers x (K, V) x 1 KV head x 32 dims x fp32, plus the id
    env = {**__import__("os").environ, "KV_BUDGET_BYTES": str(400 * per_token), "LIBRA_KV_REBID_THRESHOLD": "0.1"}
    procs = [broker, subprocess.Popen([sys.executable, PROC, "hf", url, "gpu0", str(model)], env=env)]
    try:
        with Client(url, connect_timeout=30) as c:
            _wait("the actor", lambda: len(c.status().actors) == 1, 120)
            assert c.status().actors[0]["capacity"] == 8

            def turn(traj: str, n_tokens: int) -> None:
                c.request("generate", "", {"prompt_ids": [(i % 50) + 1 for i in range(n_tokens)],
                                           "max_new_tokens": 2, "seed": 1}, trajectory=traj, timeout=60)

            for k in range(4):  # short contexts: 4 x ~22 tokens fill a fifth of the budget, 8 still fit
                turn(f"s{k}", 20)
            time.sleep(1.0)
            assert c.status().actors[0]["capacity"] == 8
            for k in range(4):  # long contexts: each ~152 tokens, the cache holds two of them
                turn(f"l{k}", 150)
            def lowered() -> int:
                cap = c.status().actors[0]["capacity"]
                return cap if cap < 8 else 0

            cap = _wait("a lower credit", lowered, 30)
            assert 1 <= cap <= 3  # about 400 / 152 contexts of the current size fit
    finally:
        stop_all(procs)
