"""``python -m libra.serving``: the serving owner's own serving process (see the package docstring).

Prints ``libra.serving: http://HOST:PORT (model NAME)`` on stdout once it listens (``--port 0``: a free
port); serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

EXTRA_HINT = "pip install 'libra[serve,rollout]' (starlette, uvicorn, torch, transformers)"
#: Random-initialised local models (:mod:`libra.engines.tiny_model`) by name: ``tiny`` is the tests' default
#: model; ``small`` is wide enough that a decode step's cost grows with the batch on a CPU thread.
TINY_PRESETS = {"tiny": {}, "small": {"num_layers": 6, "hidden_size": 768, "intermediate_size": 2048,
                                      "num_heads": 12, "num_kv_heads": 4}}


class MissingExtra(ImportError):
    """A package the serving process needs is not installed (the message names the extra)."""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "python -m libra.serving", description=(
        "A local OpenAI-style serving process over the HF engine, with GET /load (p50/p99 time per output "
        "token over a sliding window): the owner a serving-load lender reads (docs/lending.md)."))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a transformers model directory (loaded offline)")
    src.add_argument("--tiny", choices=sorted(TINY_PRESETS), help="a random-initialised local model, built once")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="0: a free port (printed)")
    p.add_argument("--cpu-threads", type=int, default=0, metavar="N",
                   help="torch threads (this process's share of a CPU machine); 0: torch's default")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--window-s", type=float, default=10.0, help="the /load window in seconds (default 10)")
    p.add_argument("--name", default=None, help="the model name the API reports (default: the directory's)")
    p.add_argument("--log-level", default="warning")
    return p


def _load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    try:
        import starlette  # noqa: F401
        import torch
        import transformers  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MissingExtra(f"libra.serving needs {exc.name}: {EXTRA_HINT}") from None
    from transformers import AutoTokenizer

    from libra.engines.hf_rollout import HFRolloutEngine
    from libra.engines.tiny_model import TinyModelSpec, ensure_tiny_model

    if args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set in this process
            pass
    path = args.model or str(ensure_tiny_model(spec=TinyModelSpec(**TINY_PRESETS[args.tiny])))
    engine = HFRolloutEngine(path, max_batch_size=args.max_batch_size, kv_cache_bytes=0)
    name = args.name or (f"tiny-{args.tiny}" if args.tiny else path.rstrip("/").rsplit("/", 1)[-1])
    return engine, AutoTokenizer.from_pretrained(path), name


async def serve(args: argparse.Namespace) -> None:
    from libra.serve.server import EndpointServer

    from .app import build_app
    from .batcher import Batcher
    from .window import LoadWindow

    engine, tok, name = await asyncio.to_thread(_load, args)
    batcher = Batcher(engine, asyncio.get_running_loop(), LoadWindow(args.window_s), args.max_batch_size)
    app = build_app(batcher, tok, name)

    class Server(EndpointServer):  # the endpoint's bind and uvicorn set-up, with this app
        def _config(self) -> Any:
            import uvicorn

            return uvicorn.Config(app, log_config=None, log_level=self.log_level, access_log=False,
                                  lifespan="off", timeout_graceful_shutdown=5)

    server = Server(host=args.host, port=args.port, log_level=args.log_level)
    try:
        await server.serve_forever(lambda url: print(
            f"libra.serving: http://{server.host}:{server.port} (model {name})", flush=True))
    finally:
        await asyncio.to_thread(batcher.close)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, v in (("--max-batch-size", args.max_batch_size), ("--window-s", args.window_s)):
        if not v > 0:
            print(f"libra.serving: {flag} must be > 0, got {v}", file=sys.stderr)
            return 2
    from libra.logging import configure

    configure(args.log_level)
    try:
        asyncio.run(serve(args))
    except MissingExtra as exc:
        print(f"libra.serving: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
