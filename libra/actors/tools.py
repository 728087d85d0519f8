"""Work handlers an actor can run, by ``(kind, name)``, and the public contract for tools of a user's own.

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

Tools of a user's own (public contract)
---------------------------------------
A module declares its tools in a module-level list ``LIBRA_TOOLS``; each entry is a :class:`Tool` record or
a function decorated with :func:`tool`::

    from libra.actors.tools import Tool, ToolError, tool

    @tool(cores=2, memory_mb=512, description="BM25 search over the corpus")
    def search(args, ctx):               # args: what session.call_tool("search", args) sent
        if not isinstance(args, dict) or "query" not in args:
            raise ToolError("bad_request", "search needs {'query': str}")
        return {"hits": [...]}           # anything msgpack carries

    LIBRA_TOOLS = [search, Tool("lookup", lookup_fn, description="...")]

The tool's name is ``Tool.name`` (the function's ``__name__`` with :func:`tool` unless ``name=`` is given).
Actors offer them with ``python -m libra.actors --tools pkg.mod`` (repeatable; every action slot imports
the modules), ``[actors] tools = ["pkg.mod"]`` in a job file for ``libra run``, or by installing a package
with an entry point in the ``libra.tools`` group, which every action slot loads (its value names a module
holding ``LIBRA_TOOLS``, or ``pkg.mod:fn``, a callable returning such a list). :func:`load_tools` does the
loading and refuses, with a :class:`ToolLoadError` naming the module or entry point: a module that does not
import (with the import's own error), one without ``LIBRA_TOOLS``, an entry that is not a tool, a tool name
declared twice (naming both sources), and a tool named like a built-in (``python``, ``bash``, ``pytest``,
``echo``, ``sleep``, ``reward_model``) unless it says ``replaces_builtin=True``.

What a declaration means (each is sent to the broker in the actor's hello labels as a
:class:`~libra.protocol.payloads_actions.ToolDeclaration`):

- ``cores``: the cores one call is granted. With an action scheduler (``[broker] action_scheduler =
  "tangram"``) the broker places the call on an action actor with that many free cores, counts them as held
  while it runs and names them in ``ctx.route["core_ids"]``; ``ctx.cores`` is the grant. With the default
  first-come-first-served dispatch the actor sets ``ctx.cores`` to the declared count, but nothing in the
  broker keeps calls from sharing cores. A declaration above the host's cores is refused at load.
- ``memory_mb``: advertised to the broker and checked at load against the host's memory (a tool that cannot
  fit is refused); not enforced while the handler runs (it runs in the actor process).
- ``gpu_service``: the calls are GPU-service calls of that service, placed like ``reward_model``'s (on a GPU
  action actor that offers the tool, evict-on-execution; ``ctx.route["service"]`` names the replica and
  cell); without such an actor a CPU actor runs them like any tool.
- ``sandboxed``: the handler's own Python code runs in the actor process, **not** in the sandbox; it gets
  ``ctx.sandbox``, whose ``run(tool, args)`` runs ``python``/``bash``/``pytest`` in the call's trajectory's
  bubblewrap sandbox (the same warm sandbox and workspace the built-in code tools use, on the granted
  cores). Put everything untrusted (model-written code, commands) through ``ctx.sandbox``. A host whose
  actors cannot run sandboxes (no bubblewrap, no ``--allow-unisolated``) does not offer sandboxed tools and
  logs why, exactly as for the built-in code tools.
- ``inline``: a constant-time handler that runs on the actor's socket thread (see above; not with the
  others).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from libra.engines.work_context import Handler, ToolError, WorkContext
from libra.protocol.payloads_actions import ToolDeclaration
from libra.protocol.payloads_base import PayloadError

__all__ = ["BUILTIN_TOOLS", "ENTRY_POINT_GROUP", "Handler", "LoadedTool", "SandboxAccess", "Tool", "ToolError",
           "ToolLoadError", "WorkContext", "action_slot_tools", "action_tools", "builtin_tools", "echo",
           "host_memory_mb", "load_tools", "sleep", "tool", "user_handlers"]

#: Names of the tools Libra's actors offer themselves: a user tool may take one only with ``replaces_builtin``.
BUILTIN_TOOLS = ("python", "bash", "pytest", "echo", "sleep", "reward_model")
#: The entry-point group whose entries name modules (or callables) declaring tools.
ENTRY_POINT_GROUP = "libra.tools"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")


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


# ---------------------------------------------------------------------------------------- tools of a user's own
class ToolLoadError(ValueError):
    """A tool declaration or a tool module that cannot be used; the message names the module or entry point."""


@dataclass(frozen=True)
class Tool:
    """One user tool: its name, its handler ``fn(args, ctx) -> output`` and what one call needs (see the
    module docstring). Checked when built: a bad field raises :class:`ToolLoadError` naming the tool."""

    name: str
    fn: Handler
    cores: int = 1
    memory_mb: int | None = None
    gpu_service: str | None = None
    sandboxed: bool = False
    inline: bool = False
    description: str = ""
    replaces_builtin: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ToolLoadError(f"tool name {self.name!r}: must start with a letter or _ and hold only letters, "
                                "digits, _ . - (at most 128 characters)")
        if not callable(self.fn):
            raise ToolLoadError(f"tool {self.name!r}: fn must be callable as fn(args, ctx), got {self.fn!r}")
        self.declaration()  # checks the resources

    def declaration(self) -> ToolDeclaration:
        """The declaration sent to the broker (raises :class:`ToolLoadError` naming the field)."""
        try:
            return ToolDeclaration.from_wire({"cores": self.cores, "memory_mb": self.memory_mb,
                                              "gpu_service": self.gpu_service, "sandboxed": self.sandboxed,
                                              "inline": self.inline, "description": self.description})
        except PayloadError as exc:
            raise ToolLoadError(f"tool {self.name!r}: `{exc.field}`: {exc.detail}" if exc.field
                                else f"tool {self.name!r}: {exc.detail}") from None


def tool(name: str | Handler | None = None, **declared: Any) -> Any:
    """Decorator: ``@tool(cores=2, description=...)`` (or bare ``@tool``) declares the function as a tool (named
    ``name`` or the function's ``__name__``; keywords as :class:`Tool`'s). The function is returned unchanged,
    with its :class:`Tool` in ``fn.libra_tool``; list it in the module's ``LIBRA_TOOLS``."""

    def wrap(fn: Handler) -> Handler:
        label = name if isinstance(name, str) else getattr(fn, "__name__", "")
        fn.libra_tool = Tool(label, fn, **declared)  # type: ignore[attr-defined]
        return fn

    return wrap(name) if callable(name) else wrap


@dataclass(frozen=True)
class LoadedTool:
    """A tool and where it was declared (``module pkg.mod``, ``entry point libra.tools:NAME (value)``)."""

    tool: Tool
    source: str


def _as_tool(entry: Any, source: str) -> Tool:
    if isinstance(entry, Tool):
        return entry
    t = getattr(entry, "libra_tool", None)
    if isinstance(t, Tool):
        return t
    raise ToolLoadError(f"{source}: LIBRA_TOOLS holds {entry!r}, which is neither a Tool nor a function "
                        "decorated with @libra.actors.tools.tool")


def _import(module: str, source: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module's: report its text
        raise ToolLoadError(f"{source}: cannot be imported: {type(exc).__name__}: {exc}") from None


def _module_tools(module: str, source: str) -> list[Tool]:
    mod = _import(module, source)
    entries = getattr(mod, "LIBRA_TOOLS", None)
    if entries is None:
        raise ToolLoadError(f"{source}: module {module!r} declares no LIBRA_TOOLS list (see libra.actors.tools)")
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
        raise ToolLoadError(f"{source}: LIBRA_TOOLS must be a list of tools, got {type(entries).__name__}")
    return [_as_tool(e, source) for e in entries]


def _entry_point_tools(ep: Any) -> tuple[str, list[Tool]]:
    source = f"entry point {ENTRY_POINT_GROUP}:{ep.name} ({ep.value})"
    module, _, attr = str(ep.value).partition(":")
    if not attr:
        return source, _module_tools(module.strip(), source)
    try:
        obj = ep.load()
    except Exception as exc:  # noqa: BLE001
        raise ToolLoadError(f"{source}: cannot load it: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise ToolLoadError(f"{source}: names {obj!r}, which is not a callable returning tools")
    try:
        entries = obj()
    except Exception as exc:  # noqa: BLE001
        raise ToolLoadError(f"{source}: calling it raised {type(exc).__name__}: {exc}") from None
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
        raise ToolLoadError(f"{source}: must return a list of tools, got {type(entries).__name__}")
    return source, [_as_tool(e, source) for e in entries]


def load_tools(modules: Sequence[str] = (), *, entry_points: bool = True) -> dict[str, LoadedTool]:
    """The user tools declared by ``modules`` (``--tools``; each imported, its ``LIBRA_TOOLS`` read) and, with
    ``entry_points``, by the installed ``libra.tools`` entry points; see the module docstring for the errors
    (:class:`ToolLoadError`). A module named twice is read once."""
    found: dict[str, LoadedTool] = {}
    batches: list[tuple[str, list[Tool]]] = []
    for module in dict.fromkeys(modules):
        if not isinstance(module, str) or not module.strip():
            raise ToolLoadError(f"--tools: expected a module name such as 'my_pkg.tools', got {module!r}")
        source = f"module {module.strip()}"
        batches.append((source, _module_tools(module.strip(), source)))
    if entry_points:
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.value.partition(":")[0].strip() in modules and ":" not in ep.value:
                continue  # the same module given with --tools too: read once
            batches.append(_entry_point_tools(ep))
    for source, tools in batches:
        for t in tools:
            if t.name in BUILTIN_TOOLS and not t.replaces_builtin:
                raise ToolLoadError(f"tool {t.name!r} from {source} has the name of a built-in tool; rename it, "
                                    "or declare it with replaces_builtin=True to serve it in the built-in's place")
            if t.name in found:
                raise ToolLoadError(f"tool {t.name!r} is declared twice: by {found[t.name].source} and by {source}")
            found[t.name] = LoadedTool(t, source)
    return found


class SandboxAccess:
    """``ctx.sandbox`` of a sandboxed user tool: :meth:`run` runs a code tool in the call's sandbox."""

    def __init__(self, code_tools: dict[str, Handler], ctx: WorkContext) -> None:
        self._tools, self._ctx = code_tools, ctx

    def run(self, tool_name: str, args: dict[str, Any]) -> Any:
        """Run ``python``/``bash``/``pytest`` with ``args`` (their usual args) in the trajectory's bubblewrap
        sandbox, on the cores granted to this call; raises :class:`ToolError` as those tools do."""
        fn = self._tools.get(tool_name)
        if fn is None:
            raise ToolError("bad_request", f"ctx.sandbox.run: {tool_name!r} is not a sandbox tool "
                                           f"(known: {', '.join(sorted(self._tools)) or 'none on this actor'})")
        return fn(args, self._ctx)

    def release_finished(self) -> None:
        """Hand the route's finished trajectories (``ActionRoute.release``) to the sandbox pool, as the built-in
        code tools do before they run (the broker sends them with sandbox calls only, this one included)."""
        fn = next(iter(self._tools.values()), None)
        release = getattr(fn, "release_finished", None)
        if release is not None:
            release(getattr(self._ctx, "route", None))


def _bind(t: Tool, code_tools: dict[str, Handler]) -> Handler:
    fn, cores, sandboxed = t.fn, t.cores, t.sandboxed

    def handler(args: Any, ctx: WorkContext) -> Any:
        if "cores" not in ctx.route:  # placed first come first served: the declaration is the grant
            ctx.cores = cores
        if sandboxed:
            ctx.sandbox = SandboxAccess(code_tools, ctx)
            ctx.sandbox.release_finished()
        return fn(args, ctx)

    handler.inline = t.inline  # type: ignore[attr-defined]
    handler.__name__ = t.name
    handler.__doc__ = t.description or getattr(fn, "__doc__", None)
    return handler


def user_handlers(loaded: dict[str, LoadedTool], offered: dict[str, Handler], *, host_cores: int,
                  host_memory_mb: int | None = None) -> tuple[dict[str, Handler], dict[str, Any], list[str]]:
    """``(handlers, declarations for the hello labels, tools not offered here with why)`` of the user tools
    ``loaded``, next to the tools ``offered`` already (whose ``python``/``bash``/``pytest`` sandboxed tools
    use). Raises :class:`ToolLoadError` for a tool that can never run on this host (more cores or memory
    than it has)."""
    code = {n: offered[n] for n in ("python", "bash", "pytest") if n in offered}
    handlers: dict[str, Handler] = {}
    decls: dict[str, Any] = {}
    skipped: list[str] = []
    for name, lt in loaded.items():
        t = lt.tool
        if t.cores > host_cores:
            raise ToolLoadError(f"tool {name!r} from {lt.source} declares cores={t.cores}, more than this "
                                f"actor's {host_cores} core(s)")
        if t.memory_mb is not None and host_memory_mb is not None and t.memory_mb > host_memory_mb:
            raise ToolLoadError(f"tool {name!r} from {lt.source} declares memory_mb={t.memory_mb}, more than "
                                f"this host's {host_memory_mb} MB")
        if t.sandboxed and not code:
            skipped.append(f"{name} (sandboxed, and this actor runs no sandbox)")
            continue
        handlers[name] = _bind(t, code)
        decls[name] = t.declaration().to_wire()
    return handlers, decls, skipped


def host_memory_mb() -> int | None:
    """Physical memory of this host in MB (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20))
    except (ValueError, OSError, AttributeError):
        return None


def action_slot_tools(modules: Sequence[str], *, enable_sandbox: bool, allow_unisolated: bool,
                      service_gpus: int | None, host_cores: int, entry_points: bool = True
                      ) -> tuple[dict[str, Handler], dict[str, Any]]:
    """What an action slot offers: :func:`action_tools` plus the user tools of ``modules`` and the entry
    points (:func:`load_tools`, :func:`user_handlers`), and the user tools' declarations for its hello labels.
    Raises :class:`ToolLoadError`."""
    loaded = load_tools(modules, entry_points=entry_points)
    tools = action_tools(enable_sandbox=enable_sandbox, allow_unisolated=allow_unisolated,
                         service_gpus=service_gpus)
    mine, decls, skipped = user_handlers(loaded, tools, host_cores=host_cores, host_memory_mb=host_memory_mb())
    if skipped:
        from libra.logging import get_logger

        get_logger("libra.actor").warning("user_tools_unavailable", tools=skipped,
                                          reason="sandboxed tools need the sandbox (bubblewrap or --allow-unisolated)")
    return {**tools, **mine}, decls


def handlers_for_tools(tools: dict[str, Handler]) -> dict[tuple[str, str], Handler]:
    return {("action", name): fn for name, fn in tools.items()}
