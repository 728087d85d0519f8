"""The ``search`` tool: BM25 over the shipped corpus, run by Libra's action actors.

Declared with Libra's tool contract (:mod:`libra.actors.tools`): one core and 256 MB per call, not
sandboxed (the handler only reads its own index; the model's query is data, never code). Action slots
offer it when started with ``--tools search_env.tools`` (``[actors] tools = ["search_env.tools"]`` in a
job file) or, once this package is installed, through its ``libra.tools`` entry point.

Arguments: ``{"query": str, "k": int}`` (``k`` within [1, 10], default 3). Result: ``{"hits": [{"id",
"title", "text", "score"}, ...], "text": <the hits as the model sees them>, "actor": <the actor that ran
the call>, "cores": <cores granted>, "core_ids": <the cores the broker named, or None>}``. A malformed
call raises ``ToolError("bad_request", ...)``, which the caller sees as a typed failure.

With the environment variable ``SEARCH_ENV_CALL_LOG`` set to a file path, every call also appends one JSON
line (actor, process id, cores, query, hit ids) to that file: how the example's test proves which actor
ran each search.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from libra.actors.tools import ToolError, WorkContext, tool

from .retriever import MAX_K, default_retriever, format_passages

__all__ = ["LIBRA_TOOLS", "search"]

_log_lock = threading.Lock()


@tool(cores=1, memory_mb=256, description="BM25 search over the search_env example's corpus")
def search(args: Any, ctx: WorkContext) -> dict[str, Any]:
    """Search the corpus (see the module docstring)."""
    if not isinstance(args, dict) or not isinstance(args.get("query"), str) or not args["query"].strip():
        raise ToolError("bad_request", "search needs args {'query': <non-empty string>, 'k': <int>}")
    k = args.get("k", 3)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ToolError("bad_request", f"search k must be an integer within [1, {MAX_K}], got {k!r}")
    query = args["query"][:500]
    hits = default_retriever().search(query, k)
    out = {"hits": hits, "text": format_passages(hits), "actor": ctx.actor_id, "cores": ctx.cores,
           "core_ids": ctx.route.get("core_ids") if isinstance(ctx.route, dict) else None}
    path = os.environ.get("SEARCH_ENV_CALL_LOG")
    if path:
        rec = {"actor": ctx.actor_id, "pid": os.getpid(), "cores": ctx.cores, "core_ids": out["core_ids"],
               "trajectory": ctx.trajectory, "query": query, "hits": [h["id"] for h in hits]}
        with _log_lock, open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    return out


LIBRA_TOOLS = [search]
