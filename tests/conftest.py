"""Shared fixtures. HF hub access is disabled for every test (nothing may be downloaded)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Models the tests build (the tiny random model) go to a temporary cache, not the user's ~/.cache/libra;
# subprocesses the tests start inherit it. Removed when the test session ends.
if "LIBRA_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="libra-test-cache-")
    os.environ["LIBRA_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
