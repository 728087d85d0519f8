"""The HTTP surface (Starlette): OpenAI's routes over a :class:`~.trajectories.TrajectoryRegistry`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``;
``GET /v1/trajectories/{id}`` (what training uses: ids, loss mask, log-probs); with an ``opener``
(``libra serve``) also ``POST /v1/trajectories`` (open one; the reply's ``id`` is the API key) and
``DELETE /v1/trajectories/{id}`` (finish it: the router learns its length, and it is no longer served).

Every error is OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx/5xx
status: 401 ``missing_trajectory``, 404 ``unknown_trajectory``, 400 for a malformed request, 409
``history_mismatch`` (see :mod:`.trajectories`), 502 ``generate_failed`` when the broker could not serve the
turn. ``stream: true`` answers with server-sent events (``data: {chunk}`` ... ``data: [DONE]``): the broker
returns a turn whole, so the chunks (role, then one per token of content, then the tool calls, then the
finish reason, and the usage when ``stream_options.include_usage``) follow once the turn is done.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .messages import EndpointError, trajectory_of
from .trajectories import TrajectoryRegistry, Turn

__all__ = ["build_app"]


def _error(exc: EndpointError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise EndpointError(400, "invalid_json", "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise EndpointError(400, "invalid_json", "the request body must be a JSON object")
    return body


def build_app(registry: TrajectoryRegistry) -> Starlette:
    """The ASGI app serving ``registry``'s trajectories."""

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = await _body(request)
            entry = registry.get(trajectory_of(body, request.headers))
            async with entry.lock:
                resp, turn = await (entry.chat(body) if chat else entry.complete(body))
        except EndpointError as exc:
            return _error(exc)
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            chunks = _chat_chunks(resp, turn, entry) if chat else _completion_chunks(resp)
            return StreamingResponse(_sse(chunks, resp if opts.get("include_usage") else None),
                                     media_type="text/event-stream")
        return JSONResponse(resp)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, True)

    async def completions(request: Request) -> Response:
        return await generate(request, False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": registry.model_name, "object": "model",
                                                         "created": 0, "owned_by": "libra"}]})

    async def read_trajectory(request: Request) -> Response:
        try:
            return JSONResponse(registry.get(request.path_params["tid"]).record())
        except EndpointError as exc:
            return _error(exc)

    async def open_trajectory(request: Request) -> Response:
        try:
            if registry.opener is None:
                raise EndpointError(404, "not_supported", "trajectories are opened by episodes here (libra run); "
                                    "POST /v1/trajectories is offered by libra serve")
            body = await _body(request)
            session = await registry.opener(body)
            key = registry.register(session, tool_parser=body.get("tool_parser"))
        except (ValueError, TypeError) as exc:
            return _error(EndpointError(400, "invalid_request", str(exc)))
        except EndpointError as exc:
            return _error(exc)
        return JSONResponse({"object": "trajectory", "id": key}, status_code=201)

    async def close_trajectory(request: Request) -> Response:
        try:
            if registry.opener is None:
                raise EndpointError(404, "not_supported", "episodes close their own trajectories here (libra run)")
            entry = registry.get(request.path_params["tid"])
            async with entry.lock:
                record = entry.record()
                registry.unregister(request.path_params["tid"])
                await entry.session.finish()
        except EndpointError as exc:
            return _error(exc)
        record["finished"] = True
        return JSONResponse(record)

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/trajectories", open_trajectory, methods=["POST"]),
        Route("/v1/trajectories/{tid:path}", read_trajectory, methods=["GET"]),
        Route("/v1/trajectories/{tid:path}", close_trajectory, methods=["DELETE"]),
    ])


def _deltas(entry: Any, turn: Turn) -> list[str]:
    """The content split per token (incremental decoding; a token that ends mid-character waits)."""
    if turn.content is None:
        return []
    if turn.tool_calls or turn.content != turn.text:
        return [turn.content]
    tok, out, shown, ids = entry.session.tokenizer, [], "", turn.ids
    if ids and turn.finish_reason == "stop":
        ids = ids[:-1]
    for i in range(1, len(ids) + 1):
        text = entry._decode_keeping_markers(ids[:i]) if tok is not None else turn.text
        if text.endswith("\ufffd") or not text.startswith(shown):
            continue
        if len(text) > len(shown):
            out.append(text[len(shown):])
            shown = text
    if shown != turn.content:  # decoding token by token did not add up: send the rest whole
        return [turn.content] if not turn.content.startswith(shown) else out + [turn.content[len(shown):]]
    return out


def _chat_chunks(resp: dict[str, Any], turn: Turn | None, entry: Any) -> list[dict[str, Any]]:
    choice = resp["choices"][0]
    msg = choice["message"]
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None, **extra}]}

    out = [chunk({"role": "assistant", "content": ""})]
    pieces = _deltas(entry, turn) if turn is not None else ([msg["content"]] if msg.get("content") else [])
    out += [chunk({"content": p}) for p in pieces]
    if msg.get("tool_calls"):
        out.append(chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]}))
    last = {k: v for k, v in choice.items() if k in ("logprobs", "token_ids")}
    out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], **last}]})
    return out


def _completion_chunks(resp: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**resp, "choices": [dict(resp["choices"][0])]}]


async def _sse(chunks: list[dict[str, Any]], usage_of: dict[str, Any] | None) -> AsyncIterator[bytes]:
    for c in chunks:
        yield f"data: {json.dumps(c)}\n\n".encode()
    if usage_of is not None:
        tail = {k: usage_of[k] for k in ("id", "created", "model")}
        obj = "chat.completion.chunk" if usage_of["object"] == "chat.completion" else "text_completion"
        yield f"data: {json.dumps({**tail, 'object': obj, 'choices': [], 'usage': usage_of['usage']})}\n\n".encode()
    yield b"data: [DONE]\n\n"
