#!/usr/bin/env bash
# One device call that runs every CUDA test and benchmark of the project and leaves a log and the JSON
# results under $OUT (the device tool returns at most 8 files). Steps run in priority order, each under
# its own time limit, so a step that hangs or fails costs only its own slot.
#   usage (on the GPU machine, from the repo root): bash benchmarks/gpu_session.sh [step ...]
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
OUT=${OUT:-/tmp/unimem_out}
mkdir -p "$OUT/json"
LOG="$OUT/session.log"
export TRITON_INTERPRET=0

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local start=$(date +%s)
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "=== $name rc=$? in $(( $(date +%s) - start ))s" | tee -a "$LOG"
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla not importable"
} | tee -a "$LOG"

ONLY="${*:-}"
step gpu_tests 300 python3 -P -m pytest -q -p no:cacheprovider -rs tests/gpu
step bench_mla_write 90 python3 -P benchmarks/bench_mla_write.py --out "$OUT/json/mla_write.json"
step bench_kda 150 python3 -P benchmarks/bench_kda.py --out "$OUT/json/kda.json"
step bench_mla_decode 120 python3 -P benchmarks/bench_mla_decode.py --out "$OUT/json/mla_decode.json"
step demo_real 300 python3 -P -m unimem_compile.cli demo --model kimi-linear-48b-4l --device cuda --cudagraphs --json
tail -n 3 "$LOG"
