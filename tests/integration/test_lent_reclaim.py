"""A lent rollout slot reclaimed by its owner mid-trajectory, with real processes on loopback: a broker, a lent
supervisor (``--lend owner=spot,kind=notice,file=F``) and an owned one (tiny HF model), episode sessions sending
deltas through the broker.

1. A trajectory runs two turns on the lent slot; the owner drops a notice (30 s). The broker stops giving the
   slot work and the trajectory's next turn runs on the owned slot, which fetches the KV from the lent slot
   (``context_via == "kv"``); once it has, the broker says ``ContextsMoved`` and the slot frees its engine long
   before the deadline (the broker times it: ``handback_slack_s``).
2. The notice is removed: the slot rebuilds its engine and bids again.
3. A long turn runs on the lent slot when a 0.5 s notice arrives: it cannot finish by the hand-back point, so
   the slot cancels it and hands it back; the broker runs it on the owned slot.

Every trajectory ends with the same tokens and log-probs as a reference run only on the owned slot; no turn is
lost or completed twice (the broker's completed count is the number of turns; the cancelled run's late result,
if any, is stale)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from libra.client import Client
from libra.client.aio import AsyncClient
from libra.dataplane import DataPlaneServer
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import LocalCluster, stop_process
from libra.protocol.payloads_job import EpisodeSampling
from libra.rl.episode import EpisodeSession

pytestmark = pytest.mark.integration

PROMPT = "<|im_start|>user\nwhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"


def session(client, tok, server, traj, new_tokens: int = 6) -> EpisodeSession:
    params = EpisodeSampling(max_new_tokens=new_tokens, temperature=1.0, max_total_tokens=1900, timeout_s=120)
    return EpisodeSession(client, tok, traj, tok.encode(PROMPT), params, lambda: None, [], seed=11,
                          prompt_id="p", context_server=server)


async def run_turns(s: EpisodeSession, n: int) -> None:
    for _ in range(n):
        await s.generate()
        s.add_user(f"tool output {len(s.versions)}: 42")


def actor(status, prefix: str) -> dict:
    (a,) = [a for a in status.actors if f"/{prefix}-" in a["id"]]
    return a


async def until(c: Client, what, timeout: float = 60.0) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = await asyncio.to_thread(c.status)
        if what(st):
            return st
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting: {st.actors} {st.stats.get('lending')}")


def test_a_reclaimed_lent_slot_hands_its_trajectories_over_and_comes_back(tmp_path) -> None:
    from transformers import AutoTokenizer

    model = ensure_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model)
    notice = tmp_path / "reclaim"
    common = ["--roles", "rollout=1", "--model-dir", str(model), "--rollout-batch", "4", "--torch-threads", "1"]
    cluster = LocalCluster(cpu_slots=1, actor_args=[*common, "--actor-id-prefix", "lent",
                                                    "--lend", f"owner=spot,kind=notice,file={notice}"])
    procs: list[subprocess.Popen] = []
    with cluster, DataPlaneServer() as server, Client(cluster.url) as sync:
        cluster.wait_for_actors(1, timeout=120)
        procs.append(subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", cluster.url, "--cpu-slots",
                                       "1", "--gpu-slots", "0", "--log-level", "warning", *common,
                                       "--actor-id-prefix", "own"]))

        async def scenario() -> dict:
            await asyncio.to_thread(cluster.wait_for_actors, 2, 120)
            own = actor(sync.status(), "own")["id"]
            sync.direct(own, [], config={"role": "none"})  # the owned slot idles: the turns go to the lent one
            await until(sync, lambda st: not actor(st, "own")["kinds"])
            async with AsyncClient(cluster.url) as c:
                moved = session(c, tok, server, "moved")
                await run_turns(moved, 2)  # on the lent slot
                sync.direct(own, ["generate"], config={"role": "rollout"})
                await until(sync, lambda st: "generate" in actor(st, "own")["kinds"])
                notice.write_text(json.dumps({"deadline_s": 30, "reason": "spot_notice"}))
                await until(sync, lambda st: st.stats.get("lending", {}).get("reclaims") == 1)
                await run_turns(moved, 2)  # on the owned slot: the KV came from the lent one
                st = await until(sync, lambda st: st.stats["lending"]["handback_slack_s"])
                first_slack = st.stats["lending"]["handback_slack_s"][0]
                notice.unlink()  # lent again: it rebuilds its engine and bids
                await until(sync, lambda st: "generate" in actor(st, "lent")["kinds"])
                sync.direct(own, [], config={"role": "none"})
                await until(sync, lambda st: not actor(st, "own")["kinds"])
                cut = session(c, tok, server, "cut", new_tokens=1500)
                turn = asyncio.ensure_future(cut.generate())
                await until(sync, lambda st: actor(st, "lent")["load"] == 1)
                t0 = time.monotonic()
                notice.write_text(json.dumps({"deadline_s": 0.5}))  # hand-back point 0.4 s from now
                sync.direct(own, ["generate"], config={"role": "rollout"})
                await turn  # handed back at the hand-back point, run again on the owned slot
                print("cut turn took", time.monotonic() - t0)
                cut.add_user("tool output 1: 42")
                await run_turns(cut, 1)
                await moved.finish()
                await cut.finish()
                refs = []
                for traj, n, new in (("moved_ref", 4, 6), ("cut_ref", 2, 1500)):  # the owned slot only
                    ref = session(c, tok, server, traj, new_tokens=new)
                    if new > 6:
                        await ref.generate()
                        ref.add_user("tool output 1: 42")
                        n -= 1
                    await run_turns(ref, n)
                    await ref.finish()
                    refs.append(ref)
                st = await until(sync, lambda st: len(st.stats["lending"]["handback_slack_s"]) == 2)
                return {"moved": moved, "cut": cut, "refs": refs, "stats": st.stats, "first_slack": first_slack}

        try:
            r = asyncio.run(scenario())
        finally:
            for p in procs:
                stop_process(p, 15.0)
    moved, cut, (moved_ref, cut_ref) = r["moved"], r["cut"], r["refs"]
    lending, stats = r["stats"]["lending"], r["stats"]
    assert moved.context_via == ["new", "cache", "kv", "cache"]  # the KV moved from the reclaimed slot
    assert moved.input_ids == moved_ref.input_ids and cut.input_ids == cut_ref.input_ids
    assert moved.logprobs == pytest.approx(moved_ref.logprobs, abs=1e-4)
    assert cut.logprobs == pytest.approx(cut_ref.logprobs, abs=1e-4)
    assert lending["reclaims"] == 2 and lending["lent_again"] == 1 and lending["moved_kv"] >= 1
    assert lending["contexts_moved"] >= 1
    assert r["first_slack"] > 20.0  # released once the contexts moved, long before the 30 s deadline
    assert stats["handbacks"] >= 1  # the long turn came back from the slot ...
    turns = 4 + 2 + 4 + 2  # ... and every turn completed exactly once
    assert stats["completed"] == turns and stats["failed"] == 0
