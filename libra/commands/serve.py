"""``libra serve``: the OpenAI-compatible endpoint over a running cluster.

::

    libra serve --broker tcp://HOST:5555 --model-dir DIR [--host 127.0.0.1] [--port 8000] [--tool-parser hermes]

Outside ``libra run`` no episode opens trajectories, so the client does::

    POST   /v1/trajectories          {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0,
                                      "max_total_tokens": 4096, "timeout_s": 300, "seed": 0,
                                      "prompt_id": "p-42", "tool_parser": "hermes"}   (every key optional)
           -> 201 {"object": "trajectory", "id": "serve-..."}    the id is the API key of the chat requests
    POST   /v1/chat/completions      (or /v1/completions) with  Authorization: Bearer <id>
    GET    /v1/trajectories/<id>     -> input_ids, loss_mask, logprobs, versions: what to train on
    DELETE /v1/trajectories/<id>     finish it (the rollout router learns its length); returns the record

Every turn goes through the broker's ``generate`` path (C-MLFQ routes it; ``prompt_id`` is the router's
per-prompt key, so the samples of one prompt share a prefix tree) to whatever rollout actors are connected;
the ids and log-probs recorded are exactly what they sampled (:mod:`libra.serve`). The tokenizer and its
chat template come from ``--model-dir`` (the rollout actors' model). CurveZMQ keys come from
``LIBRA_CURVE_SECRET`` / ``LIBRA_BROKER_KEY`` as for every client. The trajectories live in this process
until they are deleted (each holds its ids in memory): they are gone when it stops. Sampling is the
trajectory's (set when it is opened); a request's ``max_tokens`` may only lower a turn's cap.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import Any

__all__ = ["build_parser", "main", "make_opener", "stop_token_ids"]

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "max_total_tokens", "timeout_s")


def build_parser(prog: str = "libra serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve an OpenAI-compatible endpoint "
                                "(/v1/chat/completions, /v1/completions, /v1/trajectories) whose turns run "
                                "on a running Libra cluster, recording the exact sampled token ids.")
    p.add_argument("--broker", required=True, help="broker endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--model-dir", required=True, help="the model's directory (tokenizer and chat template)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0: a free one)")
    p.add_argument("--tool-parser", default="hermes", help="tool-call parser: hermes|qwen|none|pkg.mod:obj")
    p.add_argument("--model-name", default="libra", help="the model id /v1/models lists")
    p.add_argument("--log-level", default="warning", help="debug|info|warning|error")
    return p


def stop_token_ids(tok: Any) -> list[int]:
    """The ids that end a turn: ``<|im_end|>`` when the vocabulary has it, and the eos token."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stop = {im_end if im_end != getattr(tok, "unk_token_id", None) else None, tok.eos_token_id}
    return sorted(int(t) for t in stop if isinstance(t, int) and t >= 0)


def make_opener(client: Any, tok: Any) -> Any:
    """``async opener(body) -> EpisodeSession`` for ``POST /v1/trajectories`` (ValueError on a bad body)."""
    from libra.protocol.payloads_base import PayloadError
    from libra.protocol.payloads_job import EpisodeSampling
    from libra.rl.episode import EpisodeSession

    stops = stop_token_ids(tok)

    async def opener(body: dict[str, Any]) -> Any:
        unknown = sorted(set(body) - {*SAMPLING_KEYS, "seed", "prompt_id", "tool_parser"})
        if unknown:
            raise ValueError(f"unknown trajectory field {unknown[0]!r} (known: {', '.join(SAMPLING_KEYS)}, "
                             "seed, prompt_id, tool_parser)")
        try:
            params = EpisodeSampling.from_wire({k: body[k] for k in SAMPLING_KEYS if k in body})
        except PayloadError as exc:
            raise ValueError(str(exc)) from None
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError("seed must be an integer")
        return EpisodeSession(client, tok, f"serve-{uuid.uuid4().hex[:16]}", [], params, lambda: None, stops,
                              seed=seed, prompt_id=body.get("prompt_id"))

    return opener


async def serve(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from libra.client.aio import AsyncClient
    from libra.transport.security import CurveClient
    from libra.serve import EndpointServer, TrajectoryRegistry

    tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, args.model_dir)
    client = await AsyncClient(args.broker, curve=CurveClient.from_env()).connect(30.0)
    try:
        registry = TrajectoryRegistry(args.model_name, args.tool_parser, opener=make_opener(client, tok))
        server = EndpointServer(registry, args.host, args.port, args.log_level)
        await server.serve_forever(lambda url: print(f"libra serve: {url} (broker {args.broker})", flush=True))
    finally:
        await client.close()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``prog``: how the usage line names the command (``libra serve`` or ``python -m libra serve``)."""
    args = build_parser(*([prog] if prog else [])).parse_args(argv)
    from libra.transport.endpoints import endpoints_problem
    from libra.logging import configure

    if (problem := endpoints_problem(args.broker)) is not None:  # one line, not a traceback from the client
        print(f"libra serve: {problem}", file=sys.stderr)
        return 2
    configure(args.log_level)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0
