"""The serving process's HTTP surface (Starlette): OpenAI-style completions over one local model.

Routes: ``POST /v1/completions`` (``prompt`` as text or token ids), ``POST /v1/chat/completions``
(``messages`` through the tokenizer's chat template), ``GET /v1/models``, ``GET /load`` (the reading of
:mod:`.window`), ``GET /healthz``. Request fields: ``max_tokens`` (16), ``temperature`` (1.0), ``top_p``
(1.0), ``seed``, ``stream`` (server-sent events: one chunk per token as it is decoded, its text empty while it ends inside a character), ``ignore_eos`` (vLLM's
name: do not stop at the tokenizer's eos; load generators use it for fixed lengths); ``model`` and ``n`` = 1
are accepted and anything else is ignored. Errors are OpenAI's error JSON (400 for a bad request).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from libra.engines.rollout_base import GenRequest, GenResult
from libra.serve.messages import EndpointError

from .batcher import Batcher, Pending

__all__ = ["build_app"]

_ids = itertools.count(1)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise EndpointError(400, "invalid_value", f"{key} must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


class _Model:
    """The tokenizer-side of a request: its prompt ids, its sampling settings, the text of its tokens."""

    def __init__(self, tokenizer: Any, name: str, max_len: int | None, vocab: int) -> None:
        self.tok, self.name, self.max_len, self.vocab = tokenizer, name, max_len, vocab

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise EndpointError(400, "invalid_value", "messages must be a non-empty list of objects", "messages")
            try:
                ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # the template's own complaint
                raise EndpointError(400, "invalid_value", f"messages: {exc}", "messages") from None
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return list(self.tok.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < self.vocab for t in prompt):
            return list(prompt)
        raise EndpointError(400, "invalid_value", "prompt must be a non-empty string or a list of token ids "
                            f"in [0, {self.vocab})", "prompt")

    def request(self, body: dict[str, Any], chat: bool) -> GenRequest:
        ids = self.prompt_ids(body, chat)
        limit = self.max_len or 1 << 20
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise EndpointError(400, "invalid_value", f"max_tokens must be an int >= 1, got {max_tokens!r}",
                                "max_tokens")
        if len(ids) + max_tokens > limit:
            raise EndpointError(400, "context_length_exceeded", f"prompt ({len(ids)}) + max_tokens ({max_tokens}) "
                                f"exceeds the model's {limit} positions", "max_tokens")
        if body.get("n", 1) != 1:
            raise EndpointError(400, "invalid_value", "only n=1 is served", "n")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise EndpointError(400, "invalid_value", f"seed must be an int, got {seed!r}", "seed")
        eos = self.tok.eos_token_id
        stops = () if body.get("ignore_eos") or eos is None else (int(eos),)
        return GenRequest(ids, max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 10.0),
                          top_p=_number(body, "top_p", 1.0, 1e-9, 1.0), stop_token_ids=stops, seed=seed)

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _choice(chat: bool, text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    msg = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
    return {"index": 0, "delta" if delta else "message": msg, "logprobs": None, "finish_reason": finish}


def _envelope(model: _Model, rid: str, chat: bool, stream: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model.name}


def _usage(res: GenResult) -> dict[str, int]:
    n = len(res.token_ids)
    return {"prompt_tokens": res.num_prompt_tokens, "completion_tokens": n, "total_tokens": res.num_prompt_tokens + n}


async def _sse(model: _Model, p: Pending, rid: str, chat: bool) -> AsyncIterator[str]:
    head = _envelope(model, rid, chat, True)
    ids: list[int] = []
    sent = ""
    assert p.tokens is not None
    while (tok := await p.tokens.get()) is not None:
        ids.append(tok)
        text = model.text(ids)
        piece = "" if text.endswith("\ufffd") else text[len(sent):]  # half a character: wait for the rest
        sent += piece
        yield f"data: {json.dumps({**head, 'choices': [_choice(chat, piece, None, True)]})}\n\n"  # a chunk a token
    try:
        res = await p.done
    except Exception as exc:
        err = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "generate_failed"}}
        yield f"data: {json.dumps(err)}\n\n"
        return
    final = {**head, "choices": [_choice(chat, model.text(ids)[len(sent):], res.finish_reason, True)],
             "usage": _usage(res)}
    yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"


def build_app(batcher: Batcher, tokenizer: Any, model_name: str) -> Starlette:
    """The ASGI app over ``batcher``'s engine; ``tokenizer`` encodes prompts and decodes completions."""
    eng = batcher.engine
    model = _Model(tokenizer, model_name, eng.max_model_len, eng.vocab_size)

    async def generate(request: Request, chat: bool) -> Response:
        try:
            try:
                body = await request.json()
            except ValueError:
                raise EndpointError(400, "invalid_json", "the request body is not JSON") from None
            if not isinstance(body, dict):
                raise EndpointError(400, "invalid_json", "the request body must be a JSON object")
            req = model.request(body, chat)
        except EndpointError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids)}"
        p = batcher.submit(req, stream=bool(body.get("stream")))
        if p.tokens is not None:
            return StreamingResponse(_sse(model, p, rid, chat), media_type="text/event-stream")
        try:
            res = await p.done
        except Exception as exc:
            err = EndpointError(500, "generate_failed", str(exc), kind="server_error")
            return JSONResponse(err.body(), status_code=500)
        doc = {**_envelope(model, rid, chat, False),
               "choices": [_choice(chat, model.text(res.token_ids), res.finish_reason, False)], "usage": _usage(res)}
        return JSONResponse(doc)

    async def completions(request: Request) -> Response:
        return await generate(request, False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                         "owned_by": "libra"}]})

    async def load(request: Request) -> Response:
        return JSONResponse(batcher.reading())

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ])
