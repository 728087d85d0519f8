"""A user's tool module for the integration tests (``--tools user_tools_mod``, importable with this directory on
``PYTHONPATH``): ``count_words`` declares 2 cores (1 on a one-core host) and reports what it was granted;
``shout`` is a plain record whose handler raises a typed error on bad args."""

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


LIBRA_TOOLS = [count_words, Tool("shout", _shout, description="upper-case args['text']")]
