"""House rules on the shape of the code in ``libra/`` (issue #29), checked on every run.

- **Short functions.** No function or method over 80 lines, counted from its ``def`` line to its last
  line (``end_lineno - lineno + 1``; decorators not counted).
- **No copies beside the code.** No run of 6 or more consecutive significant lines is shared between a
  module of ``libra/bench/`` and a module elsewhere in ``libra/`` (a reference belongs in a test as an
  independent oracle, not as a near-copy of the runtime), nor between the two client shells
  ``libra/client/sync.py`` and ``libra/client/aio.py`` (their common logic belongs in the client core).
  A significant line is a source line stripped of its indentation and trailing comment; blank lines,
  comments, docstrings, import statements, decorators and lines of punctuation only (closing brackets)
  are skipped, so a copy re-indented or with other comments still counts.

Both checkers are also run on made-up offenders, so each test can fail.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "libra"
MAX_FUNCTION_LINES = 80
RUN = 6  # consecutive significant lines that make a copy
BENCH = "libra/bench/"
#: The two client shells: their common logic belongs in the client core, not in both.
CLIENT_SHELLS = ("libra/client/sync.py", "libra/client/aio.py")

#: Functions allowed over the limit, as ``"path::qualified name"`` (none; an entry that is no longer over the
#: limit, or gone, fails the test too, so the list cannot go stale).
LONG_ALLOWED: frozenset[str] = frozenset()


@cache
def _sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}


@cache
def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(src, name) for name, src in _sources().items()}


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement of ``body``, nested ones included (in bodies, branches and handlers)."""
    for st in body:
        yield st
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(st, field, None)
            if inner:
                yield from _statements(inner)


# -- function length ----------------------------------------------------------------------------------


def long_functions(tree: ast.Module, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Qualified name (``Class.method``, ``outer.inner``) -> line count of every function in ``tree``
    longer than ``limit`` lines."""
    found: dict[str, int] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{st.name}"
                if not isinstance(st, ast.ClassDef):
                    n = (st.end_lineno or st.lineno) - st.lineno + 1
                    if n > limit:
                        found[name] = n
                visit(st.body, name + ".")
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    inner = getattr(st, field, None)
                    if inner:
                        visit(inner, prefix)

    visit(tree.body, "")
    return found


def test_the_length_checker_sees_a_long_method() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = f"class A:\n    @staticmethod\n    def long():\n{body}\n\n    def short():\n        pass\n"
    assert long_functions(ast.parse(src)) == {"A.long": MAX_FUNCTION_LINES + 1}
    assert long_functions(ast.parse(src), limit=MAX_FUNCTION_LINES + 1) == {}


def test_no_function_in_libra_over_80_lines() -> None:
    found = {f"{path}::{name}": n for path, tree in _trees().items() for name, n in long_functions(tree).items()}
    over = sorted(f"{k} ({n} lines)" for k, n in found.items() if k not in LONG_ALLOWED)
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them where a part can be named):\n" + \
        "\n".join(over)
    stale = sorted(LONG_ALLOWED - set(found))
    assert not stale, f"LONG_ALLOWED entries no longer over {MAX_FUNCTION_LINES} lines: remove them: {stale}"


# -- copies -------------------------------------------------------------------------------------------


def significant_lines(source: str, tree: ast.Module | None = None) -> list[tuple[int, str]]:
    """``(line number, text)`` of every significant line of ``source`` (see the module docstring). A
    trailing comment is cut at ``"  #"`` (PEP 8's inline comment; the rare string holding it is cut the
    same way in a copy)."""
    tree = tree or ast.parse(source)
    skip: set[int] = set()

    def skip_docstring(body: list[ast.stmt]) -> None:
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            skip.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))

    skip_docstring(tree.body)
    for st in _statements(tree.body):
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            skip.update(range(st.lineno, (st.end_lineno or st.lineno) + 1))
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for d in st.decorator_list:
                skip.update(range(d.lineno, (d.end_lineno or d.lineno) + 1))
            skip_docstring(st.body)
    out = []
    for i, line in enumerate(source.splitlines(), start=1):
        text = line.split("  #", 1)[0].strip()
        if text and i not in skip and not text.startswith("#") and any(c.isalnum() for c in text):
            out.append((i, text))
    return out


def shared_runs(sig: dict[str, list[tuple[int, str]]],
                pairs_of: Callable[[str, str], bool]) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """For every pair of files (name -> :func:`significant_lines`) that ``pairs_of(a, b)`` selects: the
    first lines ``(line in a, line in b)`` of every run of ``RUN`` consecutive significant lines the two
    share. Keys are sorted pairs."""
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in sig.items():
        texts = [t for _i, t in lines]
        for k in range(len(lines) - RUN + 1):
            seen[tuple(texts[k : k + RUN])].append((name, lines[k][0]))
    found: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for where in seen.values():
        for x, (a, la) in enumerate(where):
            for b, lb in where[x + 1 :]:
                if a != b and pairs_of(a, b):
                    key, first = ((a, b), (la, lb)) if a < b else ((b, a), (lb, la))
                    found[key].append(first)
    return {k: sorted(v) for k, v in found.items()}


def _sig(files: dict[str, str]) -> dict[str, list[tuple[int, str]]]:
    return {name: significant_lines(src) for name, src in files.items()}


def no_copy_pair(a: str, b: str) -> bool:
    """The pairs the rule covers: bench and the rest of ``libra/``, and the two client shells."""
    if a.startswith(BENCH) != b.startswith(BENCH):
        return True
    return {a, b} == set(CLIENT_SHELLS)


def test_the_copy_checker_sees_a_copied_block() -> None:
    block = "\n".join(f"    total += values[{i}] * {i}  # step {i}" for i in range(RUN))
    runtime = f'def f(values):\n    """Sum."""\n    total = 0\n{block}\n    return total\n'
    # The same block re-indented, with other comments and a blank line inside, in a bench module.
    copied = "\n".join(f"        total += values[{i}] * {i}" + ("\n" if i == 2 else "") for i in range(RUN))
    bench = f"import os\n\n\nclass Ref:\n    def g(self, values):\n        total = 1\n{copied}\n"
    files = {"libra/x/core.py": runtime, BENCH + "ref.py": bench, "libra/y/other.py": runtime}
    found = shared_runs(_sig(files), no_copy_pair)
    assert set(found) == {("libra/bench/ref.py", "libra/x/core.py"), ("libra/bench/ref.py", "libra/y/other.py")}
    assert found[("libra/bench/ref.py", "libra/x/core.py")] == [(7, 4)]
    # One line fewer than a run is not a copy; the two runtime modules are not a pair the rule covers.
    short = "\n".join(bench.splitlines()[:-1]) + "\n"
    assert shared_runs(_sig({**files, BENCH + "ref.py": short}), no_copy_pair) == {}
    shells = {CLIENT_SHELLS[0]: runtime, CLIENT_SHELLS[1]: runtime.replace("def f", "async def f")}
    assert list(shared_runs(_sig(shells), no_copy_pair)) == [tuple(sorted(CLIENT_SHELLS))]


def test_no_copies_between_bench_and_the_runtime_nor_between_the_client_shells() -> None:
    trees = _trees()
    found = shared_runs({n: significant_lines(src, trees[n]) for n, src in _sources().items()}, no_copy_pair)
    copies = sorted(f"{a}:{runs[0][0]} and {b}:{runs[0][1]} ({len(runs)} shared runs of {RUN} lines)"
                    for (a, b), runs in found.items())
    assert not copies, "copied code (move it to one place, or make the reference an independent oracle):\n" + \
        "\n".join(copies)
