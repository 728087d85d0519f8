"""A trajectory's context stays on its rollout instance and follows it when the instance goes: a real broker,
two rollout actor supervisors (tiny HF model), an EpisodeSession sending deltas through the broker with its
context published on a data-plane server. Actor A serves turns 0-1; A's supervisor stops; the broker reroutes
the trajectory to B (``Assign.route["mode"] == "reprefill"``), B fetches the ids over the data plane and
re-prefills, and the trajectory continues with the same tokens and log-probs as one that never moved."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from libra.client.aio import AsyncClient
from libra.dataplane import DataPlaneServer
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import LocalCluster, stop_process
from libra.protocol.payloads_job import EpisodeSampling
from libra.rl.episode import EpisodeSession

pytestmark = pytest.mark.integration

PROMPT = "<|im_start|>user\nwhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"


def session(client, tok, server, traj) -> EpisodeSession:
    params = EpisodeSampling(max_new_tokens=6, temperature=1.0, max_total_tokens=1000, timeout_s=120)
    return EpisodeSession(client, tok, traj, tok.encode(PROMPT), params, lambda: None, [1], seed=11,
                          prompt_id="p", context_server=server)


async def run_turns(s: EpisodeSession, n: int) -> None:
    for _ in range(n):
        await s.generate()
        s.add_user(f"tool output {len(s.versions)}: 42")


def test_a_trajectory_continues_exactly_on_another_instance_after_its_own_goes(tmp_path) -> None:
    from transformers import AutoTokenizer

    model = ensure_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model)
    common = ["--roles", "rollout=1", "--model-dir", str(model), "--rollout-batch", "4", "--torch-threads", "1"]
    cluster = LocalCluster(cpu_slots=1, actor_args=[*common, "--actor-id-prefix", "a"])
    procs: list[subprocess.Popen] = []
    with cluster, DataPlaneServer() as server:
        cluster.wait_for_actors(1, timeout=120)

        async def scenario() -> tuple[EpisodeSession, EpisodeSession]:
            async with AsyncClient(cluster.url) as c:
                moved = session(c, tok, server, "moved")
                await run_turns(moved, 2)  # on A
                procs.append(subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", cluster.url,
                                               "--cpu-slots", "1", "--gpu-slots", "0", "--log-level", "warning",
                                               *common, "--actor-id-prefix", "b"]))
                await asyncio.to_thread(cluster.wait_for_actors, 2, 120)
                await asyncio.to_thread(stop_process, cluster.actors, 15.0)  # A goes
                ids = {a["id"] for a in (await asyncio.to_thread(cluster.status)).actors}
                while any("/a-" in i for i in ids):
                    await asyncio.sleep(0.2)
                    ids = {a["id"] for a in (await asyncio.to_thread(cluster.status)).actors}
                await run_turns(moved, 2)  # on B: rerouted, context fetched over the data plane
                await moved.finish()
                still = session(c, tok, server, "still")
                await run_turns(still, 4)  # all on B
                await still.finish()
                return moved, still

        try:
            moved, still = asyncio.run(scenario())
        finally:
            for p in procs:
                stop_process(p, 15.0)
    assert moved.context_via == ["new", "cache", "ids", "cache"]
    assert still.context_via == ["new", "cache", "cache", "cache"]
    assert moved.input_ids == still.input_ids
    assert moved.logprobs == pytest.approx(still.logprobs, abs=1e-4)


KV_CONFIG = """
[broker]
router = "la_mlfq"
router_params = { choose_mode = "kv" }
buckets = [{ name = "short", tp = 1, max_tokens = 10 }, { name = "long", tp = 1, max_tokens = 100000 }]
"""


async def run_turns_with_tool(c: AsyncClient, s: EpisodeSession, n: int) -> None:
    """Turns with a tool call through the broker in between: the router decides again at each tool return."""
    for _ in range(n):
        await s.generate()
        await c.call_tool("echo", {"stdout": "x" * 80}, trajectory=s.trajectory)  # ~20 response tokens
        s.add_user(f"tool output {len(s.versions)}: 42")


def test_a_trajectory_demoted_to_another_bucket_takes_its_kv_cache_along(tmp_path) -> None:
    """Migration while the source lives (``Assign.route["mode"] == "kv"``): LA-MLFQ demotes the trajectory
    from bucket ``short`` (actor A) to ``long`` (actor B) at its first tool return; B fetches A's KV cache over
    A's data plane instead of re-prefilling, and the trajectory continues as one that stayed on A throughout."""
    from transformers import AutoTokenizer

    from libra.client import Client

    model = ensure_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model)
    cfg = tmp_path / "broker.toml"
    cfg.write_text(KV_CONFIG)
    cluster = LocalCluster(cpu_slots=3, broker_args=["--config", str(cfg)],
                           actor_args=["--roles", "rollout=2,action=1", "--model-dir", str(model),
                                       "--rollout-batch", "4", "--torch-threads", "1"])
    with cluster, DataPlaneServer() as server:
        cluster.wait_for_actors(3, timeout=120)

        async def scenario() -> tuple[EpisodeSession, EpisodeSession]:
            async with AsyncClient(cluster.url) as c:
                still = session(c, tok, server, "still")  # both rollout actors in "short": nowhere to demote to
                await run_turns_with_tool(c, still, 4)
                await still.finish()
                with Client(cluster.url) as sync:
                    rollout = sorted(a["id"] for a in sync.status().actors if "generate" in a["kinds"])
                    b = rollout[1]
                    sync.direct(b, ["generate"], config={"role": "rollout", "bucket": "long"})
                    while not any(a["id"] == b and a["role"].get("bucket") == "long" for a in sync.status().actors):
                        await asyncio.sleep(0.1)
                moved = session(c, tok, server, "moved")
                await run_turns_with_tool(c, moved, 4)
                await moved.finish()
                return still, moved

        still, moved = asyncio.run(scenario())
    assert still.context_via == ["new", "cache", "cache", "cache"]
    assert moved.context_via == ["new", "kv", "cache", "cache"]
    assert moved.input_ids == still.input_ids
    assert moved.logprobs == pytest.approx(still.logprobs, abs=1e-4)
