#!/usr/bin/env bash
# Download what the GPU check machine lacks (it has no network) into .gpu-wheels/ (gitignored), for
# scripts/gpu-check.sh to install there: Python 3.12 manylinux x86-64 wheels of Libra's dependencies that the
# machine does not have, and Debian's bubblewrap .deb (the sandboxed python tool needs it). The device tool
# copies it along when the call names it: carry: [".gpu-wheels"] (docs/gpu-check.md).
#   scripts/gpu-wheels.sh [DIR]        (default DIR: .gpu-wheels; run where pip has network)
# The machine has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, numpy, msgpack, psutil, tqdm,
# prometheus-client, nvidia-ml-py, pytest, pytest-timeout, hypothesis, safetensors, tokenizers, pyyaml; it
# lacks pyzmq, structlog, pydantic (+ pydantic-core, annotated-types, typing-inspection,
# typing-extensions>=4.16), msgspec, gguf and bubblewrap. pydantic-core is taken at the exact version the
# downloaded pydantic pins (two versions of one package stop the install there). Everything that travels to
# the machine (the working tree and the carried paths) must stay under 64 MiB: checked at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.gpu-wheels}"
PY="${PYTHON:-.venv/bin/python}"
LIMIT_MIB=64
mkdir -p "$DIR"
rm -f "$DIR"/*.whl "$DIR"/*.deb  # one version of each package: a stale second one would stop the install
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform any)
download() { "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR" "$@"; }

download pydantic
PYD=$(ls "$DIR"/pydantic-[0-9]*.whl)
# pydantic's own requirements (without extras), pydantic-core at its exact pin
mapfile -t PYD_REQS < <(unzip -p "$PYD" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' |
                        sed 's/;.*//; s/ //g')
echo "gpu-wheels: pydantic needs ${PYD_REQS[*]}"
download pyzmq structlog msgspec gguf "typing-extensions>=4.16" "${PYD_REQS[@]}"

if command -v apt-get >/dev/null; then
  (cd "$DIR" && apt-get download bubblewrap 2>/dev/null) || echo "gpu-wheels: could not download bubblewrap's .deb" >&2
fi

# every package once
dups=$(ls "$DIR" | sed -n 's/^\([A-Za-z0-9_.]*\)-[0-9].*\.whl$/\1/p' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then echo "gpu-wheels: more than one wheel of: $dups" >&2; exit 1; fi

# the size of what travels: tracked and untracked-not-ignored files plus this directory
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
wheels=$(du -sb "$DIR" | cut -f1)
total=$((tree + wheels))
ls -l "$DIR"
printf 'gpu-wheels: %s holds %.1f MiB; with the working tree (%.1f MiB) %.1f MiB travel (limit %d MiB)\n' \
  "$DIR" "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu-wheels: over the ${LIMIT_MIB} MiB the device tool carries" >&2
  exit 1
fi
