#!/usr/bin/env bash
# The one prepared check for a GPU machine (one H100 or H200, no network), docs/gpu-check.md. The whole script
# stays under GPU_CHECK_BUDGET_S (330 s: a fix and a rerun fit in the session's 15 device minutes): every step
# runs under its own `timeout`, cut to what is left of the budget, and a step that finds too little left is
# skipped and says so. Eight files under OUT_DIR (all of them come back from the device tool):
#   summary.txt         each step's rc / seconds / limit, then the key figures (card, GPU memory during the job,
#                       bf16 loss first/last and share of weights moved, memory before/after the role switch)
#   00-setup.log        carried wheels (.gpu-wheels/, scripts/gpu-wheels.sh) installed into a scratch dir;
#                       nvidia-smi, python, torch/CUDA, transformers, the installed packages
#   01-checks.log       python -m libra.bench.gpu_checks bf16 switch oom on the qwen2-0.5b shape (RESULT lines)
#   02-pytest-gpu.log   pytest tests/gpu, per-test --timeout, -rA (a hang still leaves the summary: SIGINT first)
#   03-job.log          the tiny RL job on the GPU with [actors] weights_transport = "torch" (CUDA IPC between
#                       the GPU slots), then the actors' own records (RUN/actors/*.json) and the job's metrics
#   03-gpu.csv          nvidia-smi --query-gpu=memory.used,utilization.gpu every second while the job runs
#   03-status.jsonl     `libra status --json` every 2 s while the job runs (the actors' NVML samples included)
#   04-bench.log        python -m libra.bench engines (then rollout, if time is left) on the qwen2-0.5b shape
# Usage: scripts/gpu-check.sh OUT_DIR      (from the repository root or anywhere)
#   device tool: command "scripts/gpu-check.sh $OUT", carry [".gpu-wheels"], timeout_s 420
# GPU_CHECK_DRY_RUN=1: the same steps on the CPU (tiny model, no install, no nvidia-smi), to try the script
# anywhere; PYTHON picks the interpreter (default python3). GPU_CHECK_STEPS="pytest-gpu bench-engines" reruns only
# the named steps (setup always runs), for a second run that spends the device minutes on what failed.
set -u
OUT="${1:?usage: scripts/gpu-check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-330}"
STEPS="${GPU_CHECK_STEPS:-}"  # e.g. "pytest-gpu bench-engines": only those (setup always runs); empty: all
SCRATCH="$(mktemp -d /tmp/libra-gpu-check.XXXXXX)"
START=$SECONDS
if [ "$DRY" = 1 ]; then DEV=cpu; SHAPE=(); else DEV=cuda; SHAPE=(--shape qwen2-0.5b); fi
echo "gpu-check $(date -u +%FT%TZ) dry_run=$DRY budget_s=$BUDGET_S commit=$(git rev-parse --short HEAD 2>/dev/null)" \
  >"$OUT/summary.txt"

step() {  # step NAME SECONDS LOG COMMAND...   (a shell function runs its own commands under `limit`)
  local name=$1 secs=$2 log=$3; shift 3
  local left=$((BUDGET_S - (SECONDS - START) - 5)) t0=$SECONDS rc
  if [ -n "$STEPS" ] && [ "$name" != setup ] && [[ " $STEPS " != *" $name "* ]]; then
    echo "$name rc=skipped seconds=0 limit=0 (not in GPU_CHECK_STEPS)" | tee -a "$OUT/summary.txt"
    return 0
  fi
  if [ "$left" -lt 15 ]; then
    echo "$name rc=skipped seconds=0 limit=0 (budget spent)" | tee -a "$OUT/summary.txt"
    return 0
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (limit ${secs}s): $*" >>"$log"
  STEP_SECS=$secs
  if declare -F "$1" >/dev/null; then "$@" >>"$log" 2>&1; else limit "$@" >>"$log" 2>&1; fi
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0)) limit=$secs" | tee -a "$OUT/summary.txt"
  return 0
}
# the current step's time limit (rc 124: ran out); SIGINT first, so pytest and Python print what they have
limit() { timeout -s INT --kill-after=15 "$STEP_SECS" "$@"; }

setup() {
  if [ "$DRY" = 1 ]; then
    echo "dry run: nothing installed"
  elif compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    limit "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" \
      .gpu-wheels/*.whl || echo "wheel install failed"
  else
    echo "no .gpu-wheels/*.whl: run scripts/gpu-wheels.sh where there is network and carry .gpu-wheels"
  fi
  for deb in .gpu-wheels/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" "$SCRATCH/deb"; done
  command -v nvidia-smi >/dev/null && limit nvidia-smi
  limit "$PY" - <<'PYV'
import sys, torch, transformers
ok = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", ok,
      "devices", torch.cuda.device_count())
print("card", torch.cuda.get_device_name(0) if ok else "cpu",
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB" if ok else "")
print("transformers", transformers.__version__)
for m in ("zmq", "structlog", "pydantic", "msgspec", "pynvml", "pytest_timeout"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "ok"))
    except Exception as exc:  # noqa: BLE001
        print(m, "MISSING", exc)
PYV
  command -v bwrap && bwrap --version
  return 0
}
export PYTHONPATH="$SCRATCH/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SCRATCH/deb/usr/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export LIBRA_CACHE_DIR="$SCRATCH/cache"
step setup 40 "$OUT/00-setup.log" setup

step checks 100 "$OUT/01-checks.log" "$PY" -m libra.bench.gpu_checks bf16 switch oom --device "$DEV" "${SHAPE[@]}"

# GPU-only library warnings (torch, NCCL, transformers) are shown and counted here instead of failing the
# tests as CI's filterwarnings = error would; everything else stays an error. CI's own settings are untouched.
step pytest-gpu 170 "$OUT/02-pytest-gpu.log" "$PY" -m pytest -p no:cacheprovider -rA -v --timeout=120 \
  -W default::UserWarning -W default::FutureWarning tests/gpu

job() {
  local toml="$SCRATCH/arith_tiny_gpu.toml" run="$SCRATCH/run_tiny" url="" t
  # the torch.distributed weights path: CUDA IPC handles between the GPU slots of one host
  sed 's/^\[actors\]$/[actors]\nweights_transport = "torch"/' examples/arith_tiny.toml >"$toml"
  if ! bwrap --ro-bind / / --unshare-all true 2>/dev/null; then  # no usable bubblewrap here: trusted tiny job
    echo "bubblewrap unusable here: running the tiny job with [actors] allow_unisolated = true"
    sed -i 's/^\[actors\]$/[actors]\nallow_unisolated = true/' "$toml"
  fi
  grep -A3 '^\[actors\]' "$toml"
  local sampler=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv -l 1 >"$OUT/03-gpu.csv" 2>&1 &
    sampler=$!
    sleep 1  # the baseline before any slot touches the GPU
  else
    echo "nvidia-smi missing: no GPU samples" >"$OUT/03-gpu.csv"
  fi
  # its own process group, so that nothing of it (broker, supervisor, slots) outlives the step: SIGTERM at the
  # limit (the job unwinds, stopping its cluster), SIGKILL to the whole group 10 s later
  setsid "$PY" -m libra run "$toml" --run-dir "$run" --no-progress &
  local job=$!
  (sleep $((STEP_SECS > 30 ? STEP_SECS - 15 : STEP_SECS)); kill -TERM -- "-$job"; sleep 10; kill -KILL -- "-$job") \
    2>/dev/null &
  local watchdog=$!
  (  # `libra status --json` every 2 s; the broker's endpoint is on its command line (a free port each run)
    while kill -0 "$job" 2>/dev/null; do
      [ -z "$url" ] && url=$(ps -eo args | sed -n 's/.*libra\.broker --bind \([^ ]*\).*/\1/p' | head -1)
      t=$((SECONDS - START))
      if [ -n "$url" ]; then
        s=$(timeout 5 "$PY" -m libra status --broker "$url" --json --timeout 3 2>/dev/null | tr -d '\n')
        [ -n "$s" ] && echo "{\"t\": $t, \"broker\": \"$url\", \"status\": $s}" || echo "{\"t\": $t, \"error\": \"no answer\"}"
      fi
      sleep 2
    done
  ) >"$OUT/03-status.jsonl" 2>/dev/null &
  local poller=$!
  wait "$job"
  local rc=$?
  kill "$watchdog" 2>/dev/null
  kill -KILL -- "-$job" 2>/dev/null  # whatever of the job's group is left
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
  wait "$poller" 2>/dev/null
  echo "== the job's summary and last metrics"
  cat "$run/summary.json" 2>/dev/null; echo
  tail -3 "$run/metrics.jsonl" 2>/dev/null
  echo "== the actors' records (RUN/actors/*.json)"
  for f in "$run"/actors/*.json; do [ -e "$f" ] && { echo "-- $(basename "$f")"; cat "$f"; echo; }; done
  return $rc
}
step job 110 "$OUT/03-job.log" job

step bench-engines 90 "$OUT/04-bench.log" "$PY" -m libra.bench engines --device "$DEV" "${SHAPE[@]}" \
  --batches 1 32 --prompt-len 64 --new-tokens 32 --train-sequences 16 --micro-batch-tokens 4096 --repeats 1
step bench-rollout 60 "$OUT/04-bench.log" "$PY" -m libra.bench rollout --device "$DEV" "${SHAPE[@]}" \
  --requests 128 --new-tokens 64 --batch 32 --threads 4

echo "total seconds=$((SECONDS - START)) budget=$BUDGET_S" | tee -a "$OUT/summary.txt"
echo "-- figures" >>"$OUT/summary.txt"
timeout 30 "$PY" -m libra.bench.gpu_figures "$OUT" >>"$OUT/summary.txt" 2>&1
rm -rf "$SCRATCH"
cat "$OUT/summary.txt"
