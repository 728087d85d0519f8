#!/usr/bin/env bash
# The one prepared check for a GPU machine (one H100, no network): about 7 minutes at most, every step under
# its own `timeout`, logs under OUT_DIR (eight files at most, so that all of them come back):
#   00-install.log   carried wheels (.gpu-wheels/, from scripts/gpu-wheels.sh) installed into a scratch dir
#   01-versions.log  nvidia-smi, python, torch/CUDA, transformers
#   02-pytest-gpu.log  pytest tests/gpu
#   03-job.log + 03-gpu-apps.csv  the tiny RL job (examples/arith_tiny.toml) on the GPU while
#                    `nvidia-smi --query-compute-apps=pid,used_memory --format=csv` is sampled every second
#   04-bench-engines.log  python -m libra.bench engines --device cuda --shape qwen2-0.5b (ours vs direct)
#   05-bench-rollout.log  python -m libra.bench rollout --device cuda --shape qwen2-0.5b (behind Libra vs direct)
#   summary.txt      each step's exit status and seconds
# Usage: scripts/gpu-check.sh OUT_DIR      (from the repository root or anywhere)
set -u
OUT="${1:?usage: scripts/gpu-check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SCRATCH="$(mktemp -d /tmp/libra-gpu-check.XXXXXX)"
: >"$OUT/summary.txt"

step() {  # step NAME SECONDS LOG COMMAND...   (a shell function runs its own commands under `limit`)
  local name=$1 secs=$2 log=$3; shift 3
  local t0=$SECONDS rc
  echo "== $name: $*" >>"$log"
  STEP_SECS=$secs
  if declare -F "$1" >/dev/null; then "$@" >>"$log" 2>&1; else limit "$@" >>"$log" 2>&1; fi
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0)) limit=$secs" | tee -a "$OUT/summary.txt"
  return 0
}
limit() { timeout --kill-after=10 "$STEP_SECS" "$@"; }  # the current step's time limit (rc 124: ran out)

install() {
  if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    limit "$PY" -m pip install --no-index --no-deps --target "$SCRATCH/site" .gpu-wheels/*.whl
  else
    echo "no .gpu-wheels/*.whl: run scripts/gpu-wheels.sh first where there is network (installing nothing)"
  fi
  for deb in .gpu-wheels/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" "$SCRATCH/deb"; done
  echo "PYTHONPATH=$SCRATCH/site:$PWD"
}
step install 20 "$OUT/00-install.log" install
export PYTHONPATH="$SCRATCH/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SCRATCH/deb/usr/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

versions() {
  limit nvidia-smi
  limit "$PY" - <<'PYV'
import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__)
for m in ("zmq", "structlog", "pydantic", "msgspec", "pynvml"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "ok"))
    except Exception as exc:  # noqa: BLE001
        print(m, "MISSING", exc)
PYV
  command -v bwrap && bwrap --version
}
step versions 20 "$OUT/01-versions.log" versions

step pytest-gpu 60 "$OUT/02-pytest-gpu.log" "$PY" -m pytest -q -p no:cacheprovider tests/gpu

job() {
  local toml=examples/arith_tiny.toml
  if ! bwrap --ro-bind / / --unshare-all true 2>/dev/null; then  # no usable bubblewrap here: trusted tiny job
    echo "bubblewrap unusable here: running the tiny job with [actors] allow_unisolated = true"
    toml="$SCRATCH/arith_tiny_gpu.toml"
    sed 's/^\[actors\]$/[actors]\nallow_unisolated = true/' examples/arith_tiny.toml >"$toml"
  fi
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv -l 1 >"$OUT/03-gpu-apps.csv" 2>&1 &
  local sampler=$!
  # its own process group, so that nothing of it (broker, supervisor, slots) outlives the step: SIGTERM at the
  # limit (the job unwinds, stopping its cluster), SIGKILL to the whole group 10 s later
  setsid "$PY" -m libra run "$toml" --run-dir "$SCRATCH/run_tiny" &
  local job=$!
  (sleep $((STEP_SECS - 12)); kill -TERM -- "-$job"; sleep 10; kill -KILL -- "-$job") 2>/dev/null &
  local watchdog=$!
  wait "$job"
  local rc=$?
  kill "$watchdog" 2>/dev/null
  kill -KILL -- "-$job" 2>/dev/null  # whatever of the job's group is left
  kill "$sampler" 2>/dev/null
  echo "GPU processes seen while the job ran (pid,used_memory):"
  grep -v '^pid' "$OUT/03-gpu-apps.csv" | sort -u | head -40
  tail -3 "$SCRATCH/run_tiny/metrics.jsonl" 2>/dev/null
  return $rc
}
step job 110 "$OUT/03-job.log" job

step bench-engines 100 "$OUT/04-bench-engines.log" "$PY" -m libra.bench engines --device cuda --shape qwen2-0.5b \
  --batches 1 8 32 --prompt-len 64 --new-tokens 64 --train-sequences 16 --micro-batch-tokens 4096 --repeats 2
step bench-rollout 110 "$OUT/05-bench-rollout.log" "$PY" -m libra.bench rollout --device cuda --shape qwen2-0.5b \
  --requests 128 --new-tokens 64 --batch 32 --threads 4

rm -rf "$SCRATCH"
cat "$OUT/summary.txt"
