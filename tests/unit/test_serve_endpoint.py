"""The OpenAI-compatible endpoint (libra.serve) driven by the real ``openai`` client over real HTTP on
loopback, with a real EpisodeSession whose broker client is scripted: the model "samples" fixed token ids, so
a tool call is certain and the recorded ids can be checked against the sampled ones exactly. (The same path
against a real broker and the tiny model: tests/integration/test_serve_broker.py.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from libra.engines.tiny_model import ensure_tiny_model  # noqa: E402
from libra.protocol.payloads_job import EpisodeSampling  # noqa: E402
from libra.protocol.payloads_rollout import GenerateArgs, GenerateResult  # noqa: E402
from libra.rl.episode import EpisodeSession  # noqa: E402
from libra.serve import EndpointServer, TrajectoryRegistry  # noqa: E402
from libra.serve.toolcalls import HermesToolParser, get_tool_parser  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


class ScriptedClient:
    """Answers each ``generate`` with the next scripted text's ids (+ <|im_end|>) and made-up log-probs."""

    def __init__(self, tok, texts: list[str]) -> None:
        self.tok, self.texts, self.seen = tok, list(texts), []

    async def request(self, kind, name, wire, trajectory, timeout=None):
        args = GenerateArgs.from_wire(wire)
        self.seen.append(args)
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [3]
        ids = ids[:args.max_new_tokens]
        lps = [-0.01 * (i + 1) for i in range(len(ids))]
        out = GenerateResult(token_ids=ids, logprobs=lps, finish_reason="stop", weights_version=7,
                             gen_tokens=len(ids))
        return SimpleNamespace(output=out.to_wire())

    async def end_trajectory(self, *a):
        return None


def make_session(tok, texts, traj="t1") -> EpisodeSession:
    params = EpisodeSampling(max_new_tokens=64, max_total_tokens=2000)
    return EpisodeSession(ScriptedClient(tok, texts), tok, traj, [], params, lambda: None, [3])


def run(scenario):
    async def main():
        ep = EndpointServer()
        base = await ep.start()
        try:
            return await scenario(ep, base)
        finally:
            await ep.stop()
    return asyncio.run(main())


def test_a_multi_turn_agent_with_a_tool_call_trains_on_exactly_the_sampled_ids(tok) -> None:
    async def scenario(ep, base):
        s = make_session(tok, [f"Let me add. {CALL}", "Answer: 3"])
        key = ep.registry.register(s)
        sampled: list[list[int]] = []
        async with openai.AsyncOpenAI(base_url=base, api_key=key) as client:
            msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1 + 2?"}]
            r1 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, logprobs=True,
                                                      extra_body={"return_token_ids": True})
            c1 = r1.choices[0]
            assert c1.finish_reason == "tool_calls" and c1.message.content == "Let me add."
            call = c1.message.tool_calls[0]
            assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
            sampled.append(c1.model_extra["token_ids"])
            assert [x.logprob for x in c1.logprobs.content] == pytest.approx([-0.01 * (i + 1) for i in
                                                                              range(len(sampled[0]))])
            msgs += [c1.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "3"}]
            r2 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS,
                                                      extra_body={"return_token_ids": True})
            assert r2.choices[0].message.content == "Answer: 3" and r2.choices[0].finish_reason == "stop"
            sampled.append(r2.choices[0].model_extra["token_ids"])
            rec = (await client.get(f"/trajectories/{key}", cast_to=object))
        return s, sampled, rec

    s, sampled, rec = run(scenario)
    # the session's ids: the templated prompt (mask 0), turn 1 exactly as sampled (mask 1), the tool message
    # through the template's continuation (mask 0), turn 2 exactly as sampled (mask 1)
    spans, cur = [], None
    for i, m in enumerate(s.loss_mask):
        if m and cur is None:
            cur = i
        if not m and cur is not None:
            spans.append((cur, i))
            cur = None
    spans.append((cur, len(s.loss_mask)))
    assert [s.input_ids[a:b] for a, b in spans] == sampled
    assert sampled[0] == tok.encode(f"Let me add. {CALL}", add_special_tokens=False) + [3]
    prompt = tok.apply_chat_template([{"role": "system", "content": "You add numbers."},
                                      {"role": "user", "content": "1 + 2?"}], tools=TOOLS,
                                     add_generation_prompt=True, tokenize=False)
    between = tok.decode(s.input_ids[spans[0][1]:spans[1][0]], skip_special_tokens=False)
    assert tok.decode(s.input_ids[:spans[0][0]], skip_special_tokens=False) == prompt
    assert between == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    assert s.versions == [7, 7] and s.logprobs[spans[1][0]] == pytest.approx(-0.01)
    assert rec["input_ids"] == s.input_ids and rec["loss_mask"] == s.loss_mask and rec["turns"] == 2


def test_errors_are_openai_shaped_and_name_the_problem(tok) -> None:
    async def scenario(ep, base):
        s = make_session(tok, ["hello", "again"])
        key = ep.registry.register(s)
        out = {}
        msgs = [{"role": "user", "content": "hi"}]
        async with openai.AsyncOpenAI(base_url=base, api_key="not-a-trajectory", max_retries=0) as bad:
            with pytest.raises(openai.NotFoundError) as e:
                await bad.chat.completions.create(model="m", messages=msgs)
            out["unknown"] = e.value
        async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                                      default_headers={"Authorization": ""}) as none:
            with pytest.raises(openai.AuthenticationError) as e:
                await none.chat.completions.create(model="m", messages=msgs)
            out["missing"] = e.value
        async with openai.AsyncOpenAI(base_url=base, api_key="ignored", max_retries=0) as c:
            r1 = await c.chat.completions.create(model="m", messages=msgs, extra_body={"trajectory": key})
            again = await c.chat.completions.create(model="m", messages=msgs, extra_body={"trajectory": key})
            assert again.id == r1.id  # a retry is answered from the record, not sampled again
            edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "edited"},
                      {"role": "user", "content": "go on"}]
            with pytest.raises(openai.ConflictError) as e:
                await c.chat.completions.create(model="m", messages=edited, extra_headers={"X-Libra-Trajectory": key})
            out["edited"] = e.value
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="m", messages=msgs, n=2, extra_body={"trajectory": key})
            out["n"] = e.value
        out["ids"] = list(s.input_ids)
        return out

    out = run(scenario)
    assert out["unknown"].status_code == 404 and out["unknown"].code == "unknown_trajectory"
    assert "not-a-trajectory" in out["unknown"].message
    assert out["missing"].status_code == 401 and out["missing"].code == "missing_trajectory"
    assert out["edited"].code == "history_mismatch" and "messages[1]" in out["edited"].message
    assert out["n"].code == "unsupported_n"


def test_streaming_chunks_add_up_to_the_response(tok) -> None:
    async def scenario(ep, base):
        s = make_session(tok, ["The answer is 42.", f"ok {CALL}"])
        key = ep.registry.register(s)
        async with openai.AsyncOpenAI(base_url=base, api_key=key) as c:
            msgs = [{"role": "user", "content": "q"}]
            stream = await c.chat.completions.create(model="m", messages=msgs, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            msgs += [{"role": "assistant", "content": "The answer is 42."}, {"role": "user", "content": "tool?"}]
            stream2 = await c.chat.completions.create(model="m", messages=msgs, stream=True)
            chunks2 = [ch async for ch in stream2]
        return s, chunks, chunks2

    s, chunks, chunks2 = run(scenario)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "The answer is 42."
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1  # really chunked
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(tok.encode("The answer is 42.")) + 1
    calls = [tc for ch in chunks2 if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["add"] and chunks2[-1].choices[0].finish_reason == "tool_calls"
    assert sum(s.loss_mask) == len(tok.encode("The answer is 42.")) + len(tok.encode(f"ok {CALL}")) + 2


def test_completions_append_the_new_text_after_the_sampled_ids(tok) -> None:
    async def scenario(ep, base):
        s = make_session(tok, [" 42", " 7"])
        key = ep.registry.register(s)
        async with openai.AsyncOpenAI(base_url=base, api_key=key) as c:
            r1 = await c.completions.create(model="m", prompt="12 + 30 =", logprobs=1)
            p2 = "12 + 30 =" + r1.choices[0].text + "\n3 + 4 ="
            r2 = await c.completions.create(model="m", prompt=p2)
            with pytest.raises(openai.ConflictError):
                await c.completions.create(model="m", prompt="13 + 30 = 42\n3 + 4 = 7\n1 + 1 =")
        return s, r1, r2

    s, r1, r2 = run(scenario)
    assert r1.choices[0].text == " 42" and r2.choices[0].text == " 7"
    assert len(r1.choices[0].logprobs.token_logprobs) == len(tok.encode(" 42")) + 1
    expect = (tok.encode("12 + 30 =") + tok.encode(" 42") + [3] + tok.encode("\n3 + 4 =", add_special_tokens=False)
              + tok.encode(" 7") + [3])
    assert s.input_ids == expect


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("no call here", "no call here", []),
    (f"before {CALL} after", "before  after", [("add", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "parameters": {"x": [1]}}',
     None, [("f", {}), ("g", {"x": [1]})]),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
])
def test_hermes_parser(text, content, calls) -> None:
    got = HermesToolParser().parse(text)
    assert got.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got.tool_calls)


def test_tool_parser_is_pluggable() -> None:
    assert isinstance(get_tool_parser("qwen"), HermesToolParser)
    assert get_tool_parser("none").parse(CALL).tool_calls == []
    assert isinstance(get_tool_parser("libra.serve.toolcalls:HermesToolParser"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="cannot be loaded"):
        get_tool_parser("libra.serve.toolcalls:Missing")
    reg = TrajectoryRegistry(tool_parser="none")
    assert reg.tool_parser.parse(CALL).content == CALL


def test_openai_agent_options_name_the_bad_key() -> None:
    from libra.envs import openai_agent
    from libra.envs.contract import OptionsError

    ok = openai_agent.validate_options({"agent": "libra.serve.toolcalls:tool_call"})
    assert ok["tool_parser"] == "hermes" and ok["tools"] == [] and ok["timeout_s"] == 600.0
    for opts, key, text in [({}, "agent", "required"),
                            ({"agent": "no_such_pkg.mod:fn"}, "agent", "cannot load"),
                            ({"agent": "libra.serve.toolcalls"}, "agent", "not an import path"),
                            ({"agent": "libra.serve.toolcalls:tool_call", "tool_parser": "xml"}, "tool_parser",
                             "unknown tool parser"),
                            ({"agent": "libra.serve.toolcalls:tool_call", "tools": [3]}, "tools", "tool names"),
                            ({"agent": "libra.serve.toolcalls:tool_call", "agnet": 1}, "agnet", "unknown option")]:
        with pytest.raises(OptionsError, match=text) as e:
            openai_agent.validate_options(opts)
        assert e.value.key == key
    with pytest.raises(ValueError, match=r"\[data\]"):
        openai_agent.make_problems(2, 0, **ok)
    p = openai_agent.from_row({"prompt": "hi", "answer": 1})
    assert p.prompt == [{"role": "user", "content": "hi"}] and openai_agent.to_row(p) == {"prompt": "hi", "answer": 1}


# A template of our own in the style of tool-calling chat models: tools listed in the system turn, the
# assistant's tool calls rendered after its content, tool results wrapped in a user turn, and a rule that
# depends on position (only the last assistant turn gets an empty think block), which a whole re-render
# would apply differently as the conversation grows.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "TOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{% if loop.last %}<think></think>{% endif %}"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}{% if m.content == 'refuse' %}{{ raise_exception('no such tool result') }}"
    "{% endif %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_tool_calling_template_renders_tools_once_and_continues_after_the_sampled_call(tok) -> None:
    import copy

    ttok = copy.deepcopy(tok)
    ttok.chat_template = TOOL_TEMPLATE

    async def scenario(ep, base):
        s = make_session(ttok, [CALL, "Answer: 3", "x"])
        key = ep.registry.register(s)
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as c:
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"}]
            with pytest.raises(openai.BadRequestError, match="template_error|cannot render"):  # refused first
                await c.chat.completions.create(model="m", messages=[*msgs, {"role": "tool", "content": "refuse"}])
            r1 = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)  # ...and still fresh
            call = r1.choices[0].message.tool_calls[0]
            msgs += [r1.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "3"}]
            await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            with pytest.raises(openai.ConflictError, match="tools differ"):
                await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS[:0] or None)
            msgs += [{"role": "assistant", "content": "Answer: 3"}, {"role": "tool", "tool_call_id": "z",
                                                                     "content": "refuse"}]
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        return s, e.value

    s, err = run(scenario)
    text = ttok.decode(s.input_ids, skip_special_tokens=False)
    assert text.count("TOOLS:") == 1 and '"name": "add"' in text.split("<|im_start|>user")[0]
    # the sampled call stays as sampled; the tool result follows through the template's own continuation
    assert text.endswith(CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>3</tool_response><|im_end|>\n"
                                "<|im_start|>assistant\nAnswer: 3<|im_end|>")
    assert "<think>" not in text
    assert err.code == "template_error" and "no such tool result" in err.message


@pytest.mark.parametrize("stops", [[3], [1], [1, 3]])
@pytest.mark.parametrize("tail", [[], [3], [1]])  # a turn cut by max_new_tokens, or ended on a stop token
def test_add_user_through_the_template_gives_the_ids_the_chatml_continuation_gave(tok, stops, tail) -> None:
    from libra.rl.episode import chat_continuation

    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    s = EpisodeSession(None, tok, "t", prompt, EpisodeSampling(), lambda: None, stops)
    turn = tok.encode("some words 42", add_special_tokens=False) + tail
    s.input_ids += turn
    s.loss_mask += [1] * len(turn)
    s.logprobs += [0.0] * len(turn)
    n = len(s.input_ids)
    s.add_user("tool output: 7")
    before = tok.encode(chat_continuation("user", "tool output: 7"), add_special_tokens=False)
    if turn[-1] not in stops:
        before = stops[:1] + before
    assert s.input_ids[n:] == before and s.loss_mask[n:] == [0] * len(before)
