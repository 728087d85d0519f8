"""The OpenAI-compatible endpoint on real processes: a broker and a tiny-model rollout actor on loopback, the
real ``openai`` client over HTTP, every turn a ``generate`` through the broker. The tiny model writes random
text, so the first turn's tool call is forced by a stub parser (the Hermes parser itself is tested in
tests/unit/test_serve_endpoint.py); what is checked is that the trajectory that would train holds exactly the
ids the endpoint returned, turn by turn, with their log-probs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from libra.client.aio import AsyncClient  # noqa: E402
from libra.engines.tiny_model import ensure_tiny_model  # noqa: E402
from libra.local import LocalCluster, stop_process  # noqa: E402
from libra.protocol.payloads_job import EpisodeSampling  # noqa: E402
from libra.rl.episode import EpisodeSession  # noqa: E402
from libra.serve import EndpointServer, ParsedTurn  # noqa: E402
from libra.serve.toolcalls import tool_call  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}}}}}]


class FirstTurnCalls:
    """A stub parser: the first turn of each trajectory is a ``lookup`` call, the others are text."""

    markers = ("<tool_call>", "</tool_call>")

    def __init__(self) -> None:
        self.seen = 0

    def parse(self, text: str) -> ParsedTurn:
        self.seen += 1
        return ParsedTurn(None, [tool_call("lookup", {"q": "x"})]) if self.seen == 1 else ParsedTurn(text, [])


def spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from transformers import AutoTokenizer

    model = ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")
    cluster = LocalCluster(cpu_slots=1, actor_args=["--roles", "rollout=1", "--model-dir", str(model),
                                                    "--rollout-batch", "4", "--torch-threads", "1"])
    with cluster:
        cluster.wait_for_actors(1, timeout=120)
        yield cluster, model, AutoTokenizer.from_pretrained(model)


def new_session(client, tok, traj: str) -> EpisodeSession:
    params = EpisodeSampling(max_new_tokens=8, temperature=1.0, max_total_tokens=2000, timeout_s=120)
    return EpisodeSession(client, tok, traj, [], params, lambda: None, [3], seed=5, prompt_id="p")


def test_an_openai_agent_loop_with_a_tool_call_trains_on_the_sampled_ids(rig) -> None:
    cluster, _, tok = rig

    async def scenario():
        async with AsyncClient(cluster.url) as c:
            ep = EndpointServer()
            base = await ep.start()
            s = new_session(c, tok, "agent-1")
            key = ep.registry.register(s, tool_parser=FirstTurnCalls())
            got: list[tuple[list[int], list[float]]] = []
            try:
                async with openai.AsyncOpenAI(base_url=base, api_key=key) as oa:
                    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "find x"}]
                    for turn in range(3):
                        kw = dict(model="tiny", messages=msgs, tools=TOOLS, logprobs=True,
                                  extra_body={"return_token_ids": True})
                        if turn < 2:
                            r = (await oa.chat.completions.create(**kw)).choices[0]
                            got.append((r.model_extra["token_ids"], [x.logprob for x in r.logprobs.content]))
                            msg = r.message
                        else:  # the last turn streamed
                            chunks = [ch async for ch in await oa.chat.completions.create(**kw, stream=True)]
                            last = chunks[-1].choices[0]
                            got.append((last.model_extra["token_ids"],
                                        [x.logprob for x in last.logprobs.content]))
                            msg = SimpleNamespace(tool_calls=None, content="".join(
                                ch.choices[0].delta.content or "" for ch in chunks))
                        if msg.tool_calls:
                            msgs.append(msg.model_dump(exclude_none=True))
                            for call in msg.tool_calls:
                                msgs.append({"role": "tool", "tool_call_id": call.id, "content": "x = 42"})
                        else:
                            msgs += [{"role": "assistant", "content": msg.content},
                                     {"role": "user", "content": "and y?"}]
            finally:
                await ep.stop()
                await s.finish()
            return s, got

    s, got = asyncio.run(scenario())
    assert len(s.versions) == 3 and len(s.context_via) == 3  # three generate turns through the broker
    assert [s.input_ids[a:b] for a, b in spans(s.loss_mask)] == [ids for ids, _ in got]
    assert [s.logprobs[a:b] for a, b in spans(s.loss_mask)] == [lps for _, lps in got]
    # between turns only the template's continuation, with no loss on it: the tool result, then the user
    (a1, b1), (a2, b2), _ = spans(s.loss_mask)
    between = tok.decode(s.input_ids[b1:a2], skip_special_tokens=False)
    assert between.endswith("<|im_start|>tool\nx = 42<|im_end|>\n<|im_start|>assistant\n")


def sync_agent(base_url: str, api_key: str, row: dict) -> tuple[float, dict]:
    """An agent as users write them: the synchronous ``openai`` client, a tool loop, a reward."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    msgs = list(row["prompt"])
    ids = []
    for _ in range(3):
        r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS,
                                           extra_body={"return_token_ids": True}).choices[0]
        ids.append(r.model_extra["token_ids"])
        if not r.message.tool_calls:
            break
        msgs.append(r.message.model_dump(exclude_none=True))
        msgs += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"hit": row["answer"]})}
                 for c in r.message.tool_calls]
    client.close()
    return 1.0, {"sampled": ids, "thread": threading.current_thread().name}


def test_the_openai_agent_environment_runs_a_users_agent_against_the_runners_endpoint(rig) -> None:
    from libra.envs import openai_agent
    from libra.serve import shared_endpoint

    cluster, _, tok = rig
    cfg = SimpleNamespace(max_turns=3, reward="", options=openai_agent.validate_options({
        "agent": f"{__name__}:sync_agent", "tool_parser": f"{__name__}:FirstTurnCalls"}))
    problem = openai_agent.from_row({"prompt": "what is x?", "answer": 42})

    async def scenario():
        async with AsyncClient(cluster.url) as c:
            s = new_session(c, tok, "job/ep-1")
            reward, info = await openai_agent.episode(s, problem, cfg)
            ep = await shared_endpoint()
            left = len(ep.registry)
            await ep.stop()
            await s.finish()
            return s, reward, info, left

    s, reward, info, left = asyncio.run(scenario())
    assert reward == 1.0 and info["endpoint_turns"] == len(info["sampled"]) == 2 and info["tool_call_turns"] == 1
    assert info["tool_calls"] == 1  # the job's tool calls per episode count the calls the model made
    assert info["thread"] != "MainThread" and left == 0  # a sync agent ran in a thread; the session is gone
    assert [s.input_ids[a:b] for a, b in spans(s.loss_mask)] == info["sampled"]
    assert '{"hit": 42}' in tok.decode(s.input_ids, skip_special_tokens=False)
    # what a trainer rank gets: the runner's published tensors (encode_trajectory) merged into a TrainBatch
    from libra.rl.shards import encode_trajectory, merge_trajectories

    batch = merge_trajectories([encode_trajectory(s.input_ids, s.loss_mask, s.logprobs)], [1.0])
    ids, mask = batch.input_ids[0], batch.loss_mask[0]
    assert [ids[a:b] for a, b in spans(mask)] == info["sampled"]  # byte for byte the ids the agent got back
    assert batch.rollout_logprobs[0] == pytest.approx(s.logprobs, abs=1e-6)


def test_libra_serve_opens_serves_and_returns_trajectories(rig) -> None:
    import httpx2

    cluster, model, _ = rig
    proc = subprocess.Popen([sys.executable, "-m", "libra", "serve", "--broker", cluster.url, "--model-dir",
                             str(model), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("libra serve: http://"), line
        base = line.split()[2]
        with httpx2.Client(base_url=base, timeout=120) as http:
            opened = http.post("/trajectories", json={"max_new_tokens": 6, "prompt_id": "p-1"})
            assert opened.status_code == 201
            tid = opened.json()["id"]
            bad = http.post("/trajectories", json={"temprature": 1.0})
            assert bad.status_code == 400 and "temprature" in bad.json()["error"]["message"]
            no_id = http.post("/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert no_id.status_code == 401 and no_id.json()["error"]["code"] == "missing_trajectory"
            with openai.OpenAI(base_url=base, api_key=tid) as oa:
                r = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               extra_body={"return_token_ids": True})
            rec = http.get(f"/trajectories/{tid}").json()
            closed = http.delete(f"/trajectories/{tid}")
            gone = http.get(f"/trajectories/{tid}")
        ids = r.choices[0].model_extra["token_ids"]
        assert 1 <= len(ids) <= 6 and [rec["input_ids"][a:b] for a, b in spans(rec["loss_mask"])] == [ids]
        assert closed.status_code == 200 and closed.json()["finished"] is True
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_trajectory"
    finally:
        stop_process(proc, 10.0)
        proc.stdout.close()
