"""The house rules of the repository, checked on every run (see ARCHITECTURE.md, "Rules").

- The runtime never imports the lab: importing the broker, the actors, the client or the CLI loads no
  ``libra.sim`` or ``libra.bench`` module, and no runtime module names them in an import statement.
- No import cycle anywhere in ``libra/``: every import statement counts, including imports inside functions
  and under ``TYPE_CHECKING`` (a lazy import that closes a cycle is still a cycle of responsibilities).
- Every source file under 500 lines, in ``libra/`` and ``tests/``.
- The repository explains itself: nothing points outside it (to the workspace's notes).
- ``BENCHMARKS.md`` is short and starts with the table of current results.
- Every command-line entry point answers ``--help``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "libra"
MAX_LINES = 500  # a file must stay under this many lines
#: Packages and modules that are the lab, not the runtime: the simulator and the benchmarks.
LAB = ("libra.sim", "libra.bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is a module of the package, or None (third party)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every import statement in its source."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            deps: set[str | None] = set()
            if isinstance(node, ast.Import):
                deps = {_resolve(a.name, modules) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    full = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                # ``from pkg import name`` imports the submodule ``pkg.name`` where there is one, else ``pkg``.
                deps = {f"{full}.{a.name}" if f"{full}.{a.name}" in modules else _resolve(full, modules)
                        for a in node.names}
            graph[mod].update(d for d in deps if d is not None and d != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_libra() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in libra/ (each line one cycle):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_source_file_over_500_lines() -> None:
    long = []
    for path in sorted([*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        n = len(path.read_text().splitlines())
        if n >= MAX_LINES:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, f"files of {MAX_LINES} lines or more:\n" + "\n".join(long)


def test_every_source_compiles_without_a_warning() -> None:
    """Python 3.12 turns an invalid escape such as ``\\s`` in a docstring into a SyntaxWarning, which the suite's
    ``filterwarnings = error`` makes a collection error (the first GPU run, on 3.12, could not import four test
    files); 3.11 only warns at compile time, silently. Compiling with warnings as errors catches it here."""
    bad = []
    for path in sorted([*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(), str(path), "exec", dont_inherit=True)
            except (SyntaxError, SyntaxWarning, DeprecationWarning) as e:
                bad.append(f"{path.relative_to(ROOT)}: {e}")
    assert not bad, "\n".join(bad)


def _is_lab(mod: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in LAB)


def test_runtime_modules_never_import_the_lab() -> None:
    graph = import_graph()
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() if not _is_lab(m) for d in deps if _is_lab(d))
    assert not bad, "runtime code imports the simulator or the benchmarks:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["libra.broker.server", "libra.actors.runtime", "libra.client", "libra.cli"])
def test_importing_the_runtime_loads_no_lab_module(module: str) -> None:
    code = (f"import sys, {module}\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('libra.sim', 'libra.bench')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded: {out.stdout.split()}"


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / f for f in out.stdout.decode().split("\0") if f]


def test_nothing_points_outside_the_repository() -> None:
    # The patterns are built so that this file does not match itself.
    needles = ["../" + "shared", "shared" + "/", "research" + "-notes"]
    hits = []
    for path in _tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if any(n in line for n in needles):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits[:50])


def test_benchmarks_md_is_short_and_starts_with_the_results_table() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.encode()) < 25_000, f"BENCHMARKS.md is {len(text.encode())} bytes (limit 25,000)"
    first_table = next((line for line in text.splitlines() if line.lstrip().startswith("|")), "")
    header = [c.strip().lower() for c in first_table.strip().strip("|").split("|")]
    for column in ("measure", "command", "result", "target", "met", "real", "commit"):
        assert any(column in h for h in header), f"the first table of BENCHMARKS.md lacks a {column!r} column: {header}"
    before = text.split(first_table, 1)[0]
    assert before.count("\n## ") == 0, "BENCHMARKS.md must start with the table of current results"


HELP_COMMANDS = [
    ["libra"], ["libra", "status"], ["libra", "keys"], ["libra", "demo"], ["libra", "run"], ["libra", "plan"],
    ["libra", "tree"], ["libra", "dashboard"], ["libra.dashboard"], ["libra", "broker"], ["libra", "actors"], ["libra", "sim"], ["libra", "bench"], ["libra.broker"], ["libra.actors"], ["libra.sim"], ["libra.sim.workloads"], ["libra.bench"], ["libra.serving"],
    ["libra.rl.node_launch"],
]


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=lambda a: " ".join(a))
def test_every_entry_point_answers_help(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"python -m {' '.join(argv)} --help exited {out.returncode}: {out.stderr[-500:]}"
    assert "usage" in out.stdout.lower(), out.stdout[:300]
