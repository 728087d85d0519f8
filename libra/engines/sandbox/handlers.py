"""The sandbox tools as actor work handlers: ``sandbox_tools()`` wires a :class:`SandboxPool` to the
``fn(args, ctx)`` contract of :mod:`libra.engines.work_context`."""

from __future__ import annotations

import atexit
from collections.abc import Callable, Mapping
from typing import Any

from libra.engines.work_context import ToolError
from libra.engines.sandbox.errors import SandboxError
from libra.engines.sandbox.pool import SandboxPool
from libra.engines.sandbox.tools import TOOLS

__all__ = ["sandbox_tools"]


# Sandbox error codes as the actor reports them (the client maps ``timeout``/``bad_request``/``busy``/
# ``cancelled`` to its own typed errors; the rest arrive as ``ToolFailed`` with this tool code).
_ACTOR_CODES = {"denied": "bad_request"}


def sandbox_tools(*, allow_unisolated: bool = False, pool: Any = None, **pool_options: Any) -> dict[str, Any]:
    """Work handlers ``{"python", "bash", "pytest"}`` for an actor (``libra.engines.work_context`` contract).

    Each handler is ``fn(args, ctx)`` with ``ctx`` a ``libra.engines.work_context.WorkContext``: it runs the tool
    in ``ctx.trajectory``'s sandbox (a throw-away one, released afterwards, when the call has no
    trajectory), pinned to the route's ``core_ids`` when the broker placed it (else ``ctx.cores`` cores
    the pool picks), with ``timeout_s`` defaulting to ``ctx.budget_s`` (capped at the pool's maximum), kills
    the action when ``ctx.cancelled`` is set, and raises ``ToolError(code, message)`` for every
    :class:`SandboxError` (``denied`` becomes ``bad_request``). The pool (one per actor process) is
    created here unless given, so a host without bubblewrap fails now with :class:`SandboxUnavailable`;
    it is closed at interpreter exit. ``pool_options`` go to :class:`SandboxPool`.

    Before running, a handler hands the route's ``release`` (trajectories that ended whose sandboxes this actor
    holds, sent by the broker: ``libra.broker.sandbox_release``) to ``pool.finished``, which retires them in the
    background; each handler's ``release_finished(route)`` does only that (for a sandboxed user tool)."""

    if pool is None:
        pool = SandboxPool(allow_unisolated=allow_unisolated, **pool_options)
        atexit.register(pool.close)

    def release_finished(route: Any) -> None:
        done = route.get("release") if isinstance(route, Mapping) else None
        if isinstance(done, list) and done:
            pool.finished([t for t in done if isinstance(t, str) and t])

    def make(name: str) -> Callable[[Any, Any], Any]:
        def handler(args: Any, ctx: Any) -> Any:
            cores = getattr(ctx, "cores", 1)
            route = getattr(ctx, "route", None) or {}
            release_finished(route)
            core_ids = route.get("core_ids")  # the broker's exact cores
            if isinstance(args, Mapping) and "cores" in args:
                args = dict(args)
                cores, core_ids = args.pop("cores"), None
            if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
                raise ToolError("bad_request", f"{name}: cores must be a positive integer, got {cores!r}")
            if core_ids is not None and (not isinstance(core_ids, list) or not core_ids):
                raise ToolError("bad_request", f"{name}: route core_ids must be a non-empty list, got {core_ids!r}")
            if isinstance(args, Mapping) and "timeout_s" not in args and ctx.budget_s and ctx.budget_s > 0:
                args = {**args, "timeout_s": min(float(ctx.budget_s), pool.limits.max_timeout_s)}
            traj = ctx.trajectory or f"work-{ctx.work_id}"
            try:
                return pool.run(traj, name, args, cores=len(core_ids) if core_ids else cores, core_ids=core_ids,
                                cancel=ctx.cancelled)  # bounded by the pool
            except SandboxError as exc:
                raise ToolError(_ACTOR_CODES.get(exc.code, exc.code), str(exc)) from exc
            finally:
                if not ctx.trajectory:
                    pool.release(traj)

        handler.__name__ = handler.__qualname__ = f"sandbox_{name}"
        handler.__doc__ = f"Run the sandboxed {name!r} tool (see libra.engines.sandbox.tools)."
        handler.release_finished = release_finished  # type: ignore[attr-defined]
        return handler

    return {name: make(name) for name in sorted(TOOLS)}

