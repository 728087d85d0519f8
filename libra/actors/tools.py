"""Work handlers an actor can run, by ``(kind, name)``.

A handler is ``fn(args, ctx) -> output`` where ``output`` is anything msgpack can carry. It raises
:class:`ToolError` (with a stable ``code``) for a failure the caller should see as typed; any other
exception becomes ``tool_failed`` with the exception's text. Handlers run on worker threads, never on
the socket thread; long ones should poll ``ctx.cancelled`` (set when the broker revokes the work).

A handler that is constant-time and never blocks may set ``fn.inline = True``: it then runs on the
socket thread, saving the thread hand-off (``echo`` does; anything that touches a disk, a process or
a model must not).

Built-ins on every CPU slot: ``echo`` (returns its args) and ``sleep`` (``{"seconds": s}``).

``WorkContext.cores`` is the number of cores the action scheduler granted (default 1); sandbox tools run
with ``args["cores"]`` when the caller gives one, else ``ctx.cores``, bounded by the pool's cores.
``reward_model`` (``{"service", "text"}`` -> score; see ``libra.engines.services``) is offered when torch
is importable; its model is loaded on the first call, not at actor start.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

from libra.engines.handlers import Handler, ToolError, WorkContext

__all__ = ["Handler", "ToolError", "WorkContext", "action_tools", "builtin_tools", "echo", "sleep"]


def echo(args: Any, ctx: WorkContext) -> Any:
    """Return the arguments unchanged."""
    return args


echo.inline = True  # type: ignore[attr-defined]


def sleep(args: Any, ctx: WorkContext) -> Any:
    """Sleep ``args["seconds"]`` (interruptible by revocation), then return ``{"slept": seconds}``."""
    if not isinstance(args, dict) or not isinstance(args.get("seconds"), (int, float)) or isinstance(args.get("seconds"), bool):
        raise ToolError("bad_request", "sleep needs args {'seconds': <number>}")
    seconds = float(args["seconds"])
    if not 0 <= seconds <= 86_400:
        raise ToolError("bad_request", f"sleep seconds must be within [0, 86400], got {seconds}")
    if ctx.cancelled.wait(seconds):
        raise ToolError("cancelled", "sleep revoked by the broker")
    return {"slept": seconds}


def builtin_tools() -> dict[str, Handler]:
    return {"echo": echo, "sleep": sleep}


def action_tools(enable_sandbox: bool = True, allow_unisolated: bool = False,
                 enable_services: bool = True, service_gpus: int | None = None) -> dict[str, Handler]:
    """All tools a CPU slot offers: the built-ins, plus sandboxed ``python``/``bash``/``pytest`` when
    the sandbox engine is available on this host, plus ``reward_model`` when torch is importable (its
    services on ``service_gpus`` GPUs, default all visible)."""
    tools = builtin_tools()
    if enable_sandbox:
        try:  # the sandbox engine is optional
            from libra.engines.sandbox.errors import SandboxUnavailable
            from libra.engines.sandbox.handlers import sandbox_tools
        except ImportError:
            pass
        else:
            try:
                tools.update(sandbox_tools(allow_unisolated=allow_unisolated))
            except SandboxUnavailable as exc:  # e.g. no bubblewrap: offer no code tools, say why
                from libra.logging import get_logger

                get_logger("libra.actor").warning("code_tools_unavailable", reason=str(exc))
    if enable_services and importlib.util.find_spec("torch") is not None:
        tools["reward_model"] = _lazy_reward_model(service_gpus or None)
    return tools


def _lazy_reward_model(budget: int | None = None) -> Handler:
    """``reward_model`` without importing torch at actor start: the engine loads on the first call."""
    lock = threading.Lock()
    box: dict[str, Handler] = {}

    def reward_model(args: Any, ctx: WorkContext) -> Any:
        with lock:
            if "fn" not in box:
                from libra.engines.services import default_manager, service_tools

                box["fn"] = service_tools(lambda: default_manager(budget))["reward_model"]
        return box["fn"](args, ctx)

    reward_model.__doc__ = "Score args['text'] with model service args['service'] (libra.engines.services)."
    return reward_model
