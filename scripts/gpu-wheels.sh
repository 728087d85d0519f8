#!/usr/bin/env bash
# Download what the GPU check machine lacks (it has no network) into .gpu-wheels/ (gitignored), for
# scripts/gpu-check.sh to install there: Python 3.12 manylinux x86-64 wheels of Libra's dependencies that the
# machine does not have, and Debian's bubblewrap .deb (the sandboxed python tool needs it).
#   scripts/gpu-wheels.sh [DIR]        (default DIR: .gpu-wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.gpu-wheels}"
mkdir -p "$DIR"
PY="${PYTHON:-.venv/bin/python}"
# what the machine lacked when it was last seen (pyzmq, structlog, pydantic and its parts, msgspec, gguf)
PKGS=(pyzmq structlog pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16" msgspec gguf)
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DIR" "${PKGS[@]}"
if command -v apt-get >/dev/null; then
  (cd "$DIR" && apt-get download bubblewrap) || echo "gpu-wheels: could not download bubblewrap's .deb" >&2
fi
du -sh "$DIR"
ls "$DIR"
