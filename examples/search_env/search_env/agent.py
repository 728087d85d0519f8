"""The search task as agent code written with the ``openai`` client, the way most agents are written.

:func:`run_agent` is an ordinary OpenAI tool-calling loop: it calls ``chat.completions.create`` with
``tools=[SEARCH_TOOL]``; each tool call the model makes is executed by ``call_tool`` (in a Libra job: the
``search`` tool on an action actor, placed by the broker) and answered with a ``tool`` message; the loop
ends at a reply without tool calls, or after ``max_turns`` model turns, and scores the last reply by exact
match of its ``<answer>`` (:mod:`search_env.env`). Nothing in it knows about Libra except the endpoint's
base URL and the API key, which is the episode's trajectory id.

``retrieve = "fallback"`` does what the environment's option does: when the first reply neither calls the
tool nor answers, the agent searches the question itself and sends the hits as a user message, so an
untrained model still exercises the tool path.

In a job (``job_agent_tiny.toml``): ``[env] entry = "libra.envs.openai_agent"`` with ``[env.options] agent =
"search_env.agent:solve"`` (or ``solve_retrieve_fallback``); the adapter calls ``solve(base_url, api_key,
row)`` with the trajectory id as the API key, and the ``search`` calls go through the trajectory's session
(:func:`trajectory_tool`), so the broker places them on an action actor.

Each turn asks for the sampled token ids (``extra_body={"return_token_ids": True}``, an extension of
Libra's endpoint) and the ``info`` keeps them (``turn_token_ids``) next to the loss-mask-1 runs of what the
endpoint recorded for training (``recorded_token_ids``), so a test can compare them id for id.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from .env import normalize, parse_answer

__all__ = ["SEARCH_TOOL", "SYSTEM_PROMPT", "run_agent", "sampled_spans", "solve", "solve_retrieve_fallback",
           "trajectory_tool"]

SYSTEM_PROMPT = ("Answer the question about a town. You do not know these towns: call the search tool to look "
                 "them up. When you know the answer, reply with <answer>the answer</answer>.")
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search a local encyclopedia of towns; returns the best passages.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                   "required": ["query"]}}}

CallTool = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


async def run_agent(client: Any, model: str, question: str, answer: str, call_tool: CallTool, *,
                    max_turns: int = 3, retrieve: str = "model", topk: int = 3) -> tuple[float, dict[str, Any]]:
    """One episode with ``client`` (an ``openai.AsyncOpenAI``); returns ``(reward, info)``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": f"Question: {question}"}]
    content, searches, forced, ok, turn_ids = "", 0, 0, 0, []
    for turn in range(max_turns):
        resp = await client.chat.completions.create(model=model, messages=messages, tools=[SEARCH_TOOL],
                                                    extra_body={"return_token_ids": True})
        choice = resp.choices[0]
        msg = choice.message
        turn_ids.append(list((choice.model_extra or {}).get("token_ids") or []))
        messages.append(msg.model_dump(exclude_none=True, exclude_unset=True))
        content = msg.content or ""
        if turn == max_turns - 1:
            break
        if msg.tool_calls:
            for tc in msg.tool_calls:
                try:
                    query = str(json.loads(tc.function.arguments or "{}").get("query", ""))
                except (ValueError, AttributeError):
                    query = ""
                out = await call_tool("search", {"query": query or question, "k": topk})
                searches, ok = searches + 1, ok + (not out.get("error"))
                messages.append({"role": "tool", "tool_call_id": tc.id,
                                 "content": str(out.get("text") or out.get("error") or "")})
        elif retrieve == "fallback" and parse_answer(content) is None:
            out = await call_tool("search", {"query": question, "k": topk})
            searches, forced, ok = searches + 1, forced + 1, ok + (not out.get("error"))
            messages.append({"role": "user", "content": f"<information>\n{out.get('text') or out.get('error')}\n"
                                                        "</information>"})
        else:
            break
    got = parse_answer(content)
    correct = got is not None and normalize(got) == normalize(answer)
    return (1.0 if correct else 0.0), {"correct": correct, "formatted": got is not None, "answer": got,
                                       "tool_calls": searches, "tool_ok": ok, "searches": searches, "forced_searches": forced,
                                       "turn_token_ids": turn_ids}


def trajectory_tool(api_key: str) -> CallTool:
    """``call_tool`` for an agent run by ``libra run`` (:mod:`libra.envs.openai_agent`): the tool runs through
    the broker on the trajectory's own session (``session.call_tool``), so the action scheduler places it on
    an action actor and counts it for this trajectory. The agent runs in the episode runner's process, where
    the endpoint serving ``api_key`` lives."""

    async def call(tool: str, args: dict[str, Any]) -> dict[str, Any]:
        from libra.serve import shared_endpoint

        session = (await shared_endpoint()).registry.get(api_key).session
        return await session.call_tool(tool, args, timeout=60.0)

    return call


async def _trajectory_record(client: Any, api_key: str) -> dict[str, Any]:
    """What the endpoint recorded for training (``GET /v1/trajectories/{id}``), read with the same client."""
    return await client.get(f"/trajectories/{api_key}", cast_to=dict)


def sampled_spans(record: dict[str, Any]) -> list[list[int]]:
    """The runs of loss-mask-1 ids in a trajectory record: the ids the model sampled, turn by turn."""
    spans: list[list[int]] = []
    prev = 0
    for tok, m in zip(record["input_ids"], record["loss_mask"]):
        if m and not prev:
            spans.append([])
        if m:
            spans[-1].append(int(tok))
        prev = m
    return spans


async def _solve(base_url: str, api_key: str, row: dict[str, Any], retrieve: str) -> tuple[float, dict[str, Any]]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        reward, info = await run_agent(client, "libra", str(row["question"]), str(row["answer"]),
                                       trajectory_tool(api_key), max_turns=3, retrieve=retrieve)
        # what will train vs what the client was given, turn by turn (the endpoint never re-tokenizes)
        info["recorded_token_ids"] = sampled_spans(await _trajectory_record(client, api_key))
    finally:
        await client.close()
    return reward, info


async def solve(base_url: str, api_key: str, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The agent for ``[env.options] agent = "search_env.agent:solve"``: the model's own tool calls only."""
    return await _solve(base_url, api_key, row, "model")


async def solve_retrieve_fallback(base_url: str, api_key: str, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """As :func:`solve`, and a first reply that neither calls the tool nor answers is followed by a search
    for the question itself (for untrained models, such as the tiny test model)."""
    return await _solve(base_url, api_key, row, "fallback")
