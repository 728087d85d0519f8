"""A lent rollout slot whose owner is a real serving process (``python -m libra.serving``): while the owner's
p99 time per token leaves headroom the slot serves a trajectory; a saturating load on the owner makes the
serving owner reclaim it (reason ``slo_headroom_low``), and the trajectory continues on the job's own slot with
the same tokens and log-probs as one that never left it. The target is set from the owner's measured low-load
p99 (no wall-clock threshold)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from libra.bench.serving_load import serving_load  # noqa: E402
from libra.client import Client  # noqa: E402
from libra.client.aio import AsyncClient  # noqa: E402
from libra.dataplane import DataPlaneServer  # noqa: E402
from libra.engines.tiny_model import ensure_tiny_model  # noqa: E402
from libra.local import LocalCluster, stop_process  # noqa: E402

from .serving_proc import load_reading, serving_process  # noqa: E402
from .test_lent_reclaim import actor, run_turns, session, until  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "Hello there, how are you today?"


def test_the_serving_owner_reclaims_its_gpu_under_load_and_the_trajectory_moves(tmp_path) -> None:
    from transformers import AutoTokenizer

    model = ensure_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model)
    common = ["--roles", "rollout=1", "--model-dir", str(model), "--rollout-batch", "4", "--torch-threads", "1"]
    with serving_process(tmp_path) as (url, _):
        low = serving_load(url, 2.0, 3.0, prompt=PROMPT, max_tokens=32, seed=1)
        assert low.failed == 0
        target_ms = 1.5 * 1000 * load_reading(url)["p99_tpot_s"]
        spec = f"owner=fleet,kind=serving,url={url},target_ms={target_ms:.3f},hold_s=600,deadline_s=10,timeout_ms=2000"
        cluster = LocalCluster(cpu_slots=1, actor_args=[*common, "--actor-id-prefix", "lent", "--lend", spec])
        procs: list[subprocess.Popen] = []
        with cluster, DataPlaneServer() as server, Client(cluster.url) as sync:
            cluster.wait_for_actors(1, timeout=120)
            procs.append(subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", cluster.url,
                                           "--cpu-slots", "1", "--gpu-slots", "0", "--log-level", "warning",
                                           *common, "--actor-id-prefix", "own"]))

            async def scenario() -> tuple:
                await asyncio.to_thread(cluster.wait_for_actors, 2, 120)
                own = actor(sync.status(), "own")["id"]
                sync.direct(own, [], config={"role": "none"})
                await until(sync, lambda st: not actor(st, "own")["kinds"])
                async with AsyncClient(cluster.url) as c:
                    moved = session(c, tok, server, "moved")
                    await run_turns(moved, 2)  # on the lent slot, while the owner is calm
                    sync.direct(own, ["generate"], config={"role": "rollout"})
                    await until(sync, lambda st: "generate" in actor(st, "own")["kinds"])
                    high = threading.Thread(target=serving_load, args=(url, 30.0, 6.0),
                                            kwargs={"prompt": PROMPT, "max_tokens": 32, "seed": 2})
                    high.start()
                    st = await until(sync, lambda st: st.stats.get("lending", {}).get("reclaims") == 1, timeout=90)
                    await asyncio.to_thread(high.join)
                    await run_turns(moved, 2)  # on the job's own slot
                    await moved.finish()
                    ref = session(c, tok, server, "ref")
                    await run_turns(ref, 4)
                    await ref.finish()
                    return moved, ref, st.stats

            try:
                moved, ref, stats = asyncio.run(scenario())
            finally:
                for p in procs:
                    stop_process(p, 15.0)
    assert moved.context_via[:2] == ["new", "cache"] and moved.context_via[2] in ("kv", "ids")
    assert moved.input_ids == ref.input_ids
    assert moved.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert stats["lending"]["reclaims"] == 1 and stats["failed"] == 0
    (why,) = [r["reason"] for r in stats["lending"]["reclaimed"].values()]
    assert why == "slo_headroom_low"  # the owner's p99 left no headroom (not an unreachable owner)
