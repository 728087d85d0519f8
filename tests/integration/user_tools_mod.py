"""A user's tool module for the integration tests (``--tools user_tools_mod``, importable with this directory on
``PYTHONPATH``): ``count_words`` declares 2 cores (1 on a one-core host) and reports what it was granted;
``shout`` is a plain record whose handler raises a typed error on bad args; ``grade`` is sandboxed: its handler
runs in the actor and sends the submitted code to the trajectory's bubblewrap sandbox (``ctx.sandbox``)."""

from __future__ import annotations

import os
from typing import Any

from libra.actors.tools import Tool, ToolError, tool

CORES = min(2, len(os.sched_getaffinity(0)))


@tool(cores=CORES, memory_mb=16, description="count the words of args['text']")
def count_words(args: Any, ctx: Any) -> Any:
    return {"words": len(str(args["text"]).split()), "cores": ctx.cores,
            "core_ids": ctx.route.get("core_ids"), "pid": os.getpid()}


def _shout(args: Any, ctx: Any) -> Any:
    if not isinstance(args, dict) or not isinstance(args.get("text"), str):
        raise ToolError("bad_request", "shout needs {'text': str}")
    return args["text"].upper()


@tool(sandboxed=True, description="run args['code'] in the trajectory's sandbox and report where it ran")
def grade(args: Any, ctx: Any) -> Any:
    out = ctx.sandbox.run("python", {"code": args["code"]})
    return {"stdout": out["stdout"], "exit_code": out["exit_code"], "handler_pid": os.getpid()}


LIBRA_TOOLS = [count_words, grade, Tool("shout", _shout, description="upper-case args['text']")]
