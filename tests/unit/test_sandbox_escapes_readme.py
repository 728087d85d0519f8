"""Issue 28 item 5: what the README says about sandbox escapes is what happens.

A network or filesystem escape is refused by the OS inside the sandbox: the python tool returns a normal
result (no ``ToolError`` raised, so the client gets no ``ToolFailed``) whose ``exit_code`` is not 0 and whose
``stderr`` holds the OS error; the README's paragraph says exactly that."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def python_tool() -> Iterator[Any]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    from libra.engines.sandbox.handlers import sandbox_tools
    from libra.engines.sandbox.pool import SandboxPool

    with SandboxPool(warm=0, max_sandboxes=2) as pool:
        yield sandbox_tools(pool=pool)["python"]


def _run(tool: Any, code: str) -> dict[str, Any]:
    ctx = SimpleNamespace(cores=1, route={}, budget_s=20.0, trajectory="escape", work_id="w",
                          cancelled=threading.Event())
    return tool({"code": code}, ctx)  # a ToolError here would reach the client as ToolFailed


def test_a_socket_to_the_internet_is_a_result_with_the_os_error(python_tool: Any) -> None:
    out = _run(python_tool, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert out["exit_code"] != 0 and out["killed"] is None
    assert "OSError" in out["stderr"] and "Network is unreachable" in out["stderr"], out["stderr"]


def test_a_write_to_etc_is_a_result_with_the_os_error(python_tool: Any) -> None:
    out = _run(python_tool, "open('/etc/x', 'w').write('x')")
    assert out["exit_code"] != 0 and out["killed"] is None
    assert "Read-only file system: '/etc/x'" in out["stderr"], out["stderr"]
    assert not Path("/etc/x").exists()


def test_the_readme_says_what_happens() -> None:
    text = " ".join(README.read_text().split())
    assert "network and filesystem escapes come back as `ToolFailed`" not in text.lower()
    assert "ends with `exit_code` 1 and the OS error in `stderr`" in text
