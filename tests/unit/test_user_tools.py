"""Tools of a user's own (``libra.actors.tools``): declaring them (``Tool``, ``@tool``), loading them from a
module's ``LIBRA_TOOLS`` and from the ``libra.tools`` entry points, the errors (a module that does not import,
a tool declared twice, one named like a built-in), and what the actor makes of a declaration (the cores a call
is given, the sandbox a sandboxed tool gets, the declarations sent in the hello labels)."""

from __future__ import annotations

import importlib.metadata
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from libra.actors import __main__ as supervisor
from libra.actors import tools as T
from libra.actors.runtime import build_parser as runtime_parser
from libra.engines.work_context import ToolError, WorkContext
from libra.protocol.payloads_actions import ToolDeclaration, tool_declarations


def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


SEARCH = """
    from libra.actors.tools import Tool, ToolError, tool

    @tool(cores=2, memory_mb=64, description="find words")
    def search(args, ctx):
        if "query" not in args:
            raise ToolError("bad_request", "search needs a query")
        return {"hits": [args["query"]], "cores": ctx.cores}

    LIBRA_TOOLS = [search, Tool("count", lambda args, ctx: len(args), inline=True)]
"""


def ctx(route: dict[str, Any] | None = None) -> WorkContext:
    return WorkContext("w1", "traj-1", 5.0, threading.Event(), "a", 1, route or {})


def test_a_module_declares_decorated_functions_and_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = module(tmp_path, monkeypatch, "ut_search_a", SEARCH)
    loaded = T.load_tools([mod], entry_points=False)
    assert sorted(loaded) == ["count", "search"] and loaded["search"].source == "module ut_search_a"
    s = loaded["search"].tool
    assert (s.cores, s.memory_mb, s.description, s.sandboxed) == (2, 64, "find words", False)
    assert s.declaration() == ToolDeclaration(cores=2, memory_mb=64, description="find words")
    assert loaded["count"].tool.inline is True


def test_the_decorator_works_bare_and_with_a_name() -> None:
    @T.tool
    def plain(args: Any, c: Any) -> Any:
        return args

    renamed = T.tool("web.search", cores=1)(lambda args, c: args)
    assert plain.libra_tool.name == "plain" and plain({"a": 1}, None) == {"a": 1}
    assert renamed.libra_tool.name == "web.search"


def test_bad_declarations_name_the_tool_and_field() -> None:
    fn = lambda args, ctx: None  # noqa: E731
    with pytest.raises(T.ToolLoadError, match=r"tool 'x': `cores`"):
        T.Tool("x", fn, cores=0)
    with pytest.raises(T.ToolLoadError, match=r"tool 'x': `inline`: an inline tool"):
        T.Tool("x", fn, inline=True, sandboxed=True)
    with pytest.raises(T.ToolLoadError, match="tool name 'a b'"):
        T.Tool("a b", fn)
    with pytest.raises(T.ToolLoadError, match="fn must be callable"):
        T.Tool("x", "not a function")  # type: ignore[arg-type]


def test_an_unimportable_module_fails_with_its_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = module(tmp_path, monkeypatch, "ut_broken", "raise RuntimeError('index file missing')\n")
    with pytest.raises(T.ToolLoadError, match=r"module ut_broken: cannot be imported: RuntimeError: index file missing"):
        T.load_tools([mod], entry_points=False)
    with pytest.raises(T.ToolLoadError, match="ModuleNotFoundError: No module named 'ut_nowhere'"):
        T.load_tools(["ut_nowhere.tools"], entry_points=False)
    plain = module(tmp_path, monkeypatch, "ut_plain", "X = 1\n")
    with pytest.raises(T.ToolLoadError, match="declares no LIBRA_TOOLS"):
        T.load_tools([plain], entry_points=False)
    junk = module(tmp_path, monkeypatch, "ut_junk", "LIBRA_TOOLS = [42]\n")
    with pytest.raises(T.ToolLoadError, match="neither a Tool nor a function decorated"):
        T.load_tools([junk], entry_points=False)


def test_a_tool_declared_twice_names_both_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = module(tmp_path, monkeypatch, "ut_search_b", SEARCH)
    b = module(tmp_path, monkeypatch, "ut_search_c", "from libra.actors.tools import Tool\n"
                                                     "LIBRA_TOOLS = [Tool('search', lambda a, c: 0)]\n")
    with pytest.raises(T.ToolLoadError) as exc:
        T.load_tools([a, b], entry_points=False)
    assert str(exc.value) == "tool 'search' is declared twice: by module ut_search_b and by module ut_search_c"
    assert sorted(T.load_tools([a, a], entry_points=False)) == ["count", "search"]  # one module named twice: once


def test_a_tool_named_like_a_builtin_is_refused_unless_it_says_so(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for builtin in T.BUILTIN_TOOLS:
        mod = module(tmp_path, monkeypatch, f"ut_shadow_{builtin}",
                     f"from libra.actors.tools import Tool\nLIBRA_TOOLS = [Tool({builtin!r}, lambda a, c: 0)]\n")
        with pytest.raises(T.ToolLoadError, match=f"tool '{builtin}' from module {mod} has the name of a built-in"):
            T.load_tools([mod], entry_points=False)
    ok = module(tmp_path, monkeypatch, "ut_shadow_ok",
                "from libra.actors.tools import Tool\nLIBRA_TOOLS = [Tool('echo', lambda a, c: 0, replaces_builtin=True)]\n")
    assert list(T.load_tools([ok], entry_points=False)) == ["echo"]


def entry_points(monkeypatch: pytest.MonkeyPatch, *eps: tuple[str, str]) -> None:
    real = importlib.metadata.entry_points

    def fake(**kw: Any) -> Any:
        if kw.get("group") == T.ENTRY_POINT_GROUP:
            return [importlib.metadata.EntryPoint(name, value, T.ENTRY_POINT_GROUP) for name, value in eps]
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)


def test_entry_points_name_a_module_or_a_callable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = module(tmp_path, monkeypatch, "ut_search_ep", SEARCH)
    module(tmp_path, monkeypatch, "ut_factory", """
        from libra.actors.tools import Tool
        def make():
            return [Tool("lookup", lambda args, ctx: {"found": args}, cores=1, gpu_service="emb")]
    """)
    entry_points(monkeypatch, ("search_pkg", a), ("lookup_pkg", "ut_factory:make"))
    loaded = T.load_tools([])
    assert sorted(loaded) == ["count", "lookup", "search"]
    assert loaded["lookup"].source == "entry point libra.tools:lookup_pkg (ut_factory:make)"
    assert loaded["lookup"].tool.gpu_service == "emb"
    assert sorted(T.load_tools([a])) == ["count", "lookup", "search"]  # --tools and an entry point: read once
    assert T.load_tools([], entry_points=False) == {}


def test_an_entry_point_clashing_with_a_module_or_failing_is_named(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a = module(tmp_path, monkeypatch, "ut_search_d", SEARCH)
    module(tmp_path, monkeypatch, "ut_factory2", "from libra.actors.tools import Tool\n"
                                                 "def make():\n    return [Tool('search', lambda a, c: 0)]\n")
    entry_points(monkeypatch, ("other", "ut_factory2:make"))
    with pytest.raises(T.ToolLoadError, match=r"'search' is declared twice: by module ut_search_d and by entry "
                                              r"point libra.tools:other \(ut_factory2:make\)"):
        T.load_tools([a])
    entry_points(monkeypatch, ("gone", "ut_gone_pkg:make"))
    with pytest.raises(T.ToolLoadError, match="entry point libra.tools:gone .*cannot load it: ModuleNotFoundError"):
        T.load_tools([])


def test_the_actor_gives_a_call_its_declared_cores_unless_the_broker_granted_some() -> None:
    t = T.Tool("work", lambda args, ctx: ctx.cores, cores=3)
    handlers, decls, skipped = T.user_handlers({"work": T.LoadedTool(t, "module m")}, {}, host_cores=4)
    assert handlers["work"]({}, ctx()) == 3  # first come first served: the declaration
    assert handlers["work"]({}, ctx({"cores": 2, "core_ids": [0, 1]})) == 1  # the broker's grant (ctx.cores) wins
    assert tool_declarations({"tool_decls": decls}) == {"work": ToolDeclaration(cores=3)} and not skipped
    with pytest.raises(T.ToolLoadError, match=r"declares cores=3, more than this actor's 2 core\(s\)"):
        T.user_handlers({"work": T.LoadedTool(t, "module m")}, {}, host_cores=2)
    big = T.Tool("big", lambda a, c: 0, memory_mb=10_000)
    with pytest.raises(T.ToolLoadError, match="memory_mb=10000, more than this host's 512 MB"):
        T.user_handlers({"big": T.LoadedTool(big, "module m")}, {}, host_cores=1, host_memory_mb=512)


def test_a_sandboxed_tool_runs_its_code_through_the_trajectory_sandbox_or_is_not_offered() -> None:
    ran: list[tuple[Any, str | None]] = []

    def fake_python(args: Any, c: WorkContext) -> Any:
        ran.append((args, c.trajectory))
        return {"stdout": "4\n"}

    def grade(args: Any, c: WorkContext) -> Any:
        return c.sandbox.run("python", {"code": args["code"]})["stdout"].strip()

    t = T.LoadedTool(T.Tool("grade", grade, sandboxed=True), "module m")
    handlers, decls, skipped = T.user_handlers({"grade": t}, {"python": fake_python, "echo": T.echo}, host_cores=1)
    assert handlers["grade"]({"code": "print(2+2)"}, ctx()) == "4"
    assert ran == [({"code": "print(2+2)"}, "traj-1")] and decls["grade"]["sandboxed"] is True
    with pytest.raises(ToolError, match="'node' is not a sandbox tool"):
        T.SandboxAccess({"python": fake_python}, ctx()).run("node", {})
    handlers, decls, skipped = T.user_handlers({"grade": t}, {"echo": T.echo}, host_cores=1)  # no sandbox here
    assert handlers == {} and decls == {} and skipped == ["grade (sandboxed, and this actor runs no sandbox)"]


def test_the_commands_take_tools_and_the_supervisor_refuses_a_bad_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    args = runtime_parser().parse_args(["--broker", "tcp://x:1", "--slot", "cpu0", "--tools", "a.b", "--tools", "c"])
    assert args.tools == ["a.b", "c"]
    assert supervisor.build_parser().parse_args(["--broker", "tcp://x:1", "--tools", "a.b"]).tools == ["a.b"]
    rc = supervisor.main(["--broker", "tcp://127.0.0.1:1", "--cpu-slots", "1", "--gpu-slots", "0",
                          "--tools", "ut_missing_tools_mod"])
    assert rc == 2
    assert "module ut_missing_tools_mod: cannot be imported: ModuleNotFoundError" in capsys.readouterr().err


def test_the_supervisor_refuses_a_tool_wanting_more_cores_than_the_host_has(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    mod = module(tmp_path, monkeypatch, "ut_greedy", "from libra.actors.tools import Tool\n"
                                                     "LIBRA_TOOLS = [Tool('greedy', lambda a, c: 0, cores=100000)]\n")
    rc = supervisor.main(["--broker", "tcp://127.0.0.1:1", "--cpu-slots", "1", "--gpu-slots", "0", "--tools", mod])
    assert rc == 2 and "tool 'greedy' from module ut_greedy declares cores=100000, more than" in capsys.readouterr().err
