"""The job-file reference, generated from the config dataclasses so that it cannot drift.

``python -m libra.rl.config_doc > docs/job-file.md`` writes it; ``tests/unit/test_job_file_doc.py`` fails
when ``docs/job-file.md`` differs from :func:`render`. One section per table of ``libra.rl.config`` (in the
loader's order) with the class docstring, then one row per key: its type, its default (as TOML) and what it
means, taken from ``field(metadata={"doc": ...})`` when a field has one, else from the comment on the
field's line, else from the comment lines right above it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import sys
import tokenize
from typing import Any

from libra.rl import config as job_config

__all__ = ["field_docs", "render"]


def _comments(src: str) -> dict[int, str]:
    """Line number → the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@functools.cache
def _source() -> tuple[list[str], dict[int, str], list[ast.ClassDef]]:
    """``libra.rl.config``'s lines, comments and classes, read and parsed once."""
    src = inspect.getsource(job_config)
    classes = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef)]
    return src.splitlines(), _comments(src), classes


def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` → its documentation (see the module docstring)."""
    lines, comments, classes = _source()
    (node,) = [n for n in classes if n.name == cls.__name__]
    docs: dict[str, str] = {}
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        text = comments.get(item.lineno, "")
        if not text:  # a comment block right above the field
            above, n = [], item.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments.get(n, ""))
                n -= 1
            text = " ".join(above)
        docs[item.target.id] = text
    for f in dataclasses.fields(cls):
        if f.metadata.get("doc"):
            docs[f.name] = str(f.metadata["doc"])
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole reference as Markdown."""
    out = ["# Job-file reference", "",
           "Generated from the dataclasses of `libra/rl/config.py` by "
           "`python -m libra.rl.config_doc > docs/job-file.md`: do not edit it by hand "
           "(`tests/unit/test_job_file_doc.py` fails when it is out of date).", "",
           inspect.cleandoc(job_config.__doc__ or ""), ""]
    for table, cls in job_config._TABLES.items():
        out += [f"## `[{table}]`", "", inspect.cleandoc(cls.__doc__ or ""), "",
                "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = _cell(job_config.toml_value(_default(f)))
            out.append(f"| `{f.name}` | `{_cell(str(f.type))}` | `{default}` | {_cell(docs.get(f.name, ''))} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
