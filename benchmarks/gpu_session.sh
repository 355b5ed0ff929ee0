#!/usr/bin/env bash
# The project's CUDA tests and benchmarks for one device call: a log and JSON results under $OUT (the
# device tool returns at most 8 files). Steps run in the order given, each under its own time limit, so a
# step that hangs or fails costs only its own slot.
#   usage (on the GPU machine, from the repo root): bash benchmarks/gpu_session.sh STEP...
#   (GPU_TESTS picks gpu_tests' files; LIMIT_<step>=SECONDS overrides a step's limit; SWEEP_BUDGET the small sweep's;
#    GEN_ARGS adds bench_generate arguments (split on spaces, no quotes), e.g.
#    GEN_ARGS="--profile --configs kimi-linear-48b-4l_b1_p512,kimi-linear-48b-4l_b32_p512"; PREFILL_MODEL_ARGS replaces
#    bench_prefill_model's "--systems unimem,old_path", e.g. "--systems unimem --rows 4096 32768"; PREFILL_PROFILE its
#    "--profile-row 32768" (PREFILL_PROFILE= profiles nothing: rows without 32768, e.g. "--rows 1024 --batch 4")
#   steps: gpu_tests (or its three slots gpu_tests_kernels gpu_tests_models gpu_tests_engine) runner_isolation
#          bench_mla_write bench_kda kda_graphs_gpu bench_kda_prefill (ops/kda_graphs: the GPU tests, eager fla vs
#          its graphs) bench_mla_decode sweep_mla_decode_small bench_mla_prefill
#          bench_mla_prefill_sweep bench_mla_prefill_short (issue 20: short chunks, split-K) bench_engine_burst (issue 23:
#          the engine's packed prefill of a burst, BURST_PROMPTS prompts) bench_prefill_model bench_prefill_model_stock (the model-level prefill: unimem and
#          the unrewritten graph, then stock transformers; one 10-minute call each, --deadline-s skips a row
#          that would not fit and the JSON keeps every row measured)
#          sync_audit (every host <-> GPU synchronisation of a chunked prefill and an engine burst, with stacks)
#          prefill_graphs_gpu (UNIMEM_PREFILL_GRAPHS: graphed prefill chunks against the dynamic prefill)
#          demo_real bench_passes bench_state_passes bench_generate
#          bench_serving (continuous batching; SERVE_ARGS replaces its default reduced run, SERVE_LIMIT its limit;
#          the reduced run's arena shrinks with its trace so that memory binds: bench_serving's docstring says why)
#          issue 23's decision, one device call each (bench_serving's docstring, "GPU, issue 23 in three calls", says how
#          this reduced preset departs from the issue and why): bench_serving_rate (--find-rate alone on the stationary
#          trace: the floor 3/s first, halved while unbounded, then bisected up to 6/s, 4 runs; its log's "rate search"
#          line and its JSON's "rate" give SERVE_RATE), bench_serving_stationary and bench_serving_phased (the step
#          check first) run every engine system on their trace at SERVE_RATE (unset: the stationary step searches
#          first, and then its last systems fall past the deadline, as on 2026-12-02), bench_serving_probe (the warm-up,
#          then one request's prefill at a time: generate() vs the engine on the caller's thread vs a started
#          manager, profiled; attributes the ~240 ms per prefill forward the 2026-12-02 trace runs showed),
#          bench_serving_stock (stock
#          generate_batch and stock static cache + compile on the phased trace at SERVE_RATE, default 8). Measured
#          2026-12-02 (fourteenth session): build ~14 s, warm-up 227 s on a new machine and 95 s once its caches are
#          warm, a stationary run at 4/s ~51 s, a phased one ~65 s, the step check ~45 s; 4 rate runs near 3-4.5/s
#          ~170 s; --deadline-s 480 starts no system later, limit 570 s
#          bench_tp tp_example (need 2 GPUs: TP 1 then TP 2 of the 8-layer real-geometry model; the example
#          over NCCL; NVLink multicast off)
#          fp8 (issue 22): fp8_decode_tests fp8_tests bench_mla_write_fp8 bench_mla_decode_fp8 bench_mla_decode_l2
#          bench_mla_decode_l2_fp8 bench_mla_decode_fp8_wgmma bench_mla_decode_l2_fp8_wgmma bench_mla_decode_fp8_wgmma_ab bench_mla_decode_fp8_f16_ab
#          bench_mla_decode_fp8_sweep demo_real_fp8 bench_generate_fp8 (FP8_DECODE_GRID:
#          bench_mla_decode_fp8's grid arguments, default --quick; FP8_DECODE_GRID=" " times the full grid)
#          bench_serving_http (the stationary trace over HTTP vs in-process on the 8-layer model; HTTP_SCALE (0.05),
#          HTTP_DURATION (60 s of arrivals), HTTP_RATE (4/s) shrink or grow it; needs the serve dependencies: carry
#          their wheels in .whl/ where the machine lacks them: starlette uvicorn sse-starlette pydantic pydantic-core
#          (cp312) annotated-types typing-inspection at constraints/ci.txt's versions; the H200 image has anyio, h11,
#          prometheus-client and httpx (the load generator's client falls back to it: httpcore2 needs truststore))
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
# carried wheels: flash-linear-attention (fla_core) goes to a folder of its own that only the steps in FLA_STEPS
# see: it autotunes its KDA kernels on each new shape's first call (~90 s on an H200), which made the test slots
# overrun (tenth session: 21 model tests in 380 s with fla importable, the same tests in ~140 s without)
# (twelfth session: bench_serving and bench_serving_http ran without it, so their prefills took the KDA reference
# path: add them, the engine prefills through the same chunked KDA kernels as generate())
# (sixteenth session: the match is by whole step name, so bench_serving_rate / _probe / _stationary / _phased /
# _stock ran without it through the fifteenth session: every prefill took the pure-torch KDA path, ~5x slower)
FLA_DEFAULT="bench_generate bench_generate_fp8 bench_prefill_model bench_prefill_model_stock bench_kda bench_serving"
FLA_DEFAULT+=" bench_serving_http bench_serving_rate bench_serving_probe bench_serving_stationary bench_serving_phased"
# (eighteenth session: the chunk_kda graphs of ops/kda_graphs, their GPU test against eager fla and their timing)
FLA_DEFAULT+=" kda_graphs_gpu bench_kda_prefill bench_engine_burst"
# (twentieth session: the synchronisation audit runs the production KDA path)
FLA_DEFAULT+=" sync_audit prefill_graphs_gpu"
FLA_STEPS=${FLA_STEPS:-"$FLA_DEFAULT bench_serving_stock"}
if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/site /tmp/site_fla
  others=$(ls .whl/*.whl | grep -v '/fla_core-')
  [ -n "$others" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $others \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  ls .whl/fla_core-*.whl >/dev/null 2>&1 \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_fla .whl/fla_core-*.whl
fi
OUT=${OUT:-/tmp/unimem_out}
mkdir -p "$OUT/json"
LOG="$OUT/session.log"
export TRITON_INTERPRET=0 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
# (nineteenth session) Triton keeps autotuning results on disk, so fla's ~90 s autotune of the KDA kernels is paid by
# the first step of a call that needs it, not by every process (knobs.autotuning.cache; TRITON_CACHE_AUTOTUNING=0 off)
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  PYTHONPATH="$PYTHONPATH:/tmp/site_fla" python3 -c "import fla; print('fla', fla.__version__, '(for: $FLA_STEPS)')" 2>/dev/null \
    || echo "fla not importable"
  git log -1 --format='commit %h %s' 2>/dev/null || true
} | tee -a "$LOG"

run_step() {  # run_step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local override="LIMIT_$name"
  limit=${!override:-$limit}  # LIMIT_<step>=SECONDS overrides a step's time limit
  local start=$(date +%s)
  local pp=$PYTHONPATH
  [[ -d /tmp/site_fla && " $FLA_STEPS " == *" $name "* ]] && pp="$PYTHONPATH:/tmp/site_fla"
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  PYTHONPATH=$pp timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "=== $name rc=$? in $(( $(date +%s) - start ))s" | tee -a "$LOG"
}

# issue 23's reduced serving preset (bench_serving's docstring gives the details): 5% of each trace's requests, not
# 3000 (five systems of 3000 requests take hours, a device call 10 minutes); the arena scaled with them, 0.75 GiB
# not 6 GiB (with 5% of the requests 6 GiB never fills: 14% peak occupancy on 2026-12-01); 32 decode rows; a system
# that has not served its trace 30 s after the last arrival is stopped (what it served is recorded); the engine
# systems in this order, after one warm-up that leaves them no compiles (each run records confounded_by_jit)
# SERVE_BUDGET_GIB / SERVE_MAX_BATCH / SERVE_SCALE change the arena, the decode rows and the share of the traces;
# SERVE_SYSTEMS the engine systems run (in order); SERVE_EXTRA adds bench_serving arguments (split on spaces)
# (2026-12-02, sixteenth session: with fla the 32-row cap, not the 0.75 GiB arena, bound unified admission at
# 17.25/s; the seventeenth session ran SERVE_MAX_BATCH=64: memory bound then, RESULTS.md has it)
SERVE_REDUCED="--scale ${SERVE_SCALE:-0.05} --budget-gib ${SERVE_BUDGET_GIB:-0.75} --max-batch ${SERVE_MAX_BATCH:-32}"
SERVE_REDUCED+=" --drain-timeout-s 30 ${SERVE_EXTRA:-}"  # SERVE_EXTRA: more arguments, e.g. "--max-prefill-rows 4"
SERVE_SYSTEMS=${SERVE_SYSTEMS:-"static0.5,unified,static0.25,static0.75,simbest"}
# 2026-12-02 at 4/s every system served ~2.9 requests/s (overloaded): the search starts at 3/s
SERVE_FIND=${SERVE_FIND:-"--find-rate --rate-lo 3 --rate-hi 6 --rate-iters 4"}
SERVE_AT_RATE=${SERVE_RATE:+--rate $SERVE_RATE}
SERVE_AT_RATE=${SERVE_AT_RATE:-$SERVE_FIND}

# failures print their tracebacks at the end of a run: a per-test limit (pytest-timeout) lets a slow or hung
# test fail alone instead of the step's limit killing the run before its summary
PYTEST="python3 -P -m pytest -q -p no:cacheprovider -rfEs --tb=short"
python3 -c "import pytest_timeout" 2>/dev/null && PYTEST="$PYTEST --timeout=${TEST_TIMEOUT:-200}"

for s in "$@"; do
  case "$s" in
    # fp8_tests and fp8_decode_tests run the fp8 GPU tests in slots of their own
    gpu_tests) run_step gpu_tests 400 $PYTEST ${GPU_TESTS:-tests/gpu --ignore=tests/gpu/test_fp8_gpu.py --ignore=tests/gpu/test_mla_decode_fp8_gpu.py \
                 --ignore=tests/gpu/test_runner_isolation_gpu.py}
               run_step poison_cuda 45 $PYTEST tests/reliability/test_poison.py -k cuda ;;
    # the same files in three slots that each fit a fresh machine's cold compiles (ninth session's timings:
    # kernels ~80 s, models ~330 s, engine ~190 s)
    gpu_tests_kernels) run_step gpu_tests_kernels 150 $PYTEST tests/gpu/test_mla_decode_gpu.py tests/gpu/test_mla_prefill_gpu.py \
                         tests/gpu/test_mla_write_gpu.py tests/gpu/test_state_gpu.py tests/gpu/test_staging_gpu.py
                       run_step poison_cuda 45 $PYTEST tests/reliability/test_poison.py -k cuda ;;
    gpu_tests_models) run_step gpu_tests_models 420 $PYTEST tests/gpu/test_generate_gpu.py tests/gpu/test_runner_gpu.py \
                        tests/gpu/test_sampling_gpu.py tests/gpu/test_passes_gpu.py tests/gpu/test_state_passes_gpu.py ;;
    gpu_tests_engine) run_step gpu_tests_engine 240 $PYTEST tests/gpu/test_engine_gpu.py ;;
    # the illegal memory access of 2026-12-01 (a model's captures, then its death, before the runner tests'):
    # the isolation test (four processes: the order before and after the cuBLAS workspace fix), then the
    # file order that faulted, in one process
    runner_isolation) run_step runner_isolation 420 $PYTEST -rA tests/gpu/test_runner_isolation_gpu.py
                      run_step runner_after_state_passes 420 $PYTEST tests/gpu/test_state_passes_gpu.py \
                        tests/gpu/test_runner_gpu.py ;;
    # every host <-> GPU synchronisation of a chunked generate() and an engine burst, with its Python stack
    sync_audit) run_step sync_audit 300 python3 -P benchmarks/sync_audit.py --out "$OUT/json/sync_audit.json" ;;
    bench_mla_write) run_step bench_mla_write 60 python3 -P benchmarks/bench_mla_write.py --out "$OUT/json/mla_write.json" ;;
    bench_kda) run_step bench_kda 100 python3 -P benchmarks/bench_kda.py --out "$OUT/json/kda.json" ;;
    # twenty-first session: UNIMEM_PREFILL_GRAPHS (prefill chunks of a listed length replay Inductor's CUDA graphs)
    prefill_graphs_gpu) TORCH_LOGS="${TORCH_LOGS:-cudagraphs}" run_step prefill_graphs_gpu 240 \
                          $PYTEST -x tests/gpu/test_prefill_graphs_gpu.py ;;
    kda_graphs_gpu) run_step kda_graphs_gpu 300 $PYTEST tests/gpu/test_state_gpu.py \
                      tests/gpu/test_kda_graphs_model_gpu.py ;;
    bench_kda_prefill) run_step bench_kda_prefill 150 python3 -P benchmarks/bench_kda.py --prefill \
                         --out "$OUT/json/kda_prefill.json" ;;
    bench_mla_decode) run_step bench_mla_decode 200 python3 -P benchmarks/bench_mla_decode.py --out "$OUT/json/mla_decode.json" ;;
    sweep_mla_decode_small) run_step sweep_mla_decode_small 300 python3 -P benchmarks/sweep_mla_decode.py --small-batch \
                              --budget-s "${SWEEP_BUDGET:-260}" --out "$OUT/json/mla_decode_small_sweep.json" ;;
    bench_mla_prefill) run_step bench_mla_prefill 300 python3 -P benchmarks/bench_mla_prefill.py --out "$OUT/json/mla_prefill.json" ;;
    bench_mla_prefill_sweep) run_step bench_mla_prefill_sweep 300 python3 -P benchmarks/bench_mla_prefill.py --quick --sweep \
                               --out "$OUT/json/mla_prefill_sweep.json" ;;
    # issue 20's short chunks: 16 / 64 / 256 queries over 32k of history, split-K off / by the rule / forced;
    # decides mla_prefill.SPLIT_K_AUTO (off until this step has timed it)
    bench_mla_prefill_short) run_step bench_mla_prefill_short 200 python3 -P benchmarks/bench_mla_prefill.py --short \
                               --out "$OUT/json/mla_prefill_short.json" ;;
    bench_prefill_model) run_step bench_prefill_model 540 python3 -P benchmarks/bench_mla_prefill.py \
                           --model kimi-linear-48b-4l ${PREFILL_MODEL_ARGS:---systems unimem,old_path} \
                           ${PREFILL_PROFILE---profile-row 32768} \
                           --deadline-s "$(( ${LIMIT_bench_prefill_model:-540} - 40 ))" --out "$OUT/json/prefill_model.json" ;;
    # issue 23: the engine's prefill of a 32-prompt burst, packed (max_prefill_rows 8) vs one row per forward
    # (nineteenth session: cut at 150 s after an 82 s build on a cold machine; the warm-up bursts compile the packs)
    bench_engine_burst) run_step bench_engine_burst 420 python3 -P benchmarks/bench_mla_prefill.py \
                          --model kimi-linear-48b-4l --systems unimem --rows 1024 --repeats 3 \
                          --engine-burst ${BURST_PROMPTS:-32} --out "$OUT/json/engine_burst.json" ;;
    bench_prefill_model_stock) run_step bench_prefill_model_stock 540 python3 -P benchmarks/bench_mla_prefill.py \
                           --model kimi-linear-48b-4l --systems stock --profile-row 32768 \
                           --deadline-s "$(( ${LIMIT_bench_prefill_model_stock:-540} - 40 ))" \
                           --out "$OUT/json/prefill_model_stock.json" ;;
    demo_real) run_step demo_real 165 python3 -P -m unimem_compile.cli demo --model kimi-linear-48b-4l --device cuda --cudagraphs --json ;;
    bench_passes) run_step bench_passes 200 python3 -P benchmarks/bench_passes.py --out "$OUT/json/passes.json" ;;
    bench_state_passes) run_step bench_state_passes 150 python3 -P benchmarks/bench_state_passes.py --cudagraphs --batches 32 --out "$OUT/json/state_passes.json" ;;
    bench_generate) run_step bench_generate "${GEN_LIMIT:-400}" python3 -P benchmarks/bench_generate.py --out /tmp/gen \
                      --deadline-s "$(( ${GEN_LIMIT:-400} - 30 ))" --bundle "$OUT/json/generate.json" ${GEN_ARGS:-} ;;
    bench_tp) run_step bench_tp_1 "${TP_LIMIT:-290}" python3 -P benchmarks/bench_tp.py --out "$OUT/json/tp1.json" \
                --deadline-s "$(( ${TP_LIMIT:-290} - 20 ))"
              run_step bench_tp_2 "${TP_LIMIT:-290}" env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
                NVSHMEM_DISABLE_NVLS=1 python3 -P -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_tp.py \
                --out "$OUT/json/tp2.json" --baseline "$OUT/json/tp1.json" --deadline-s "$(( ${TP_LIMIT:-290} - 20 ))" ;;
    tp_example) run_step tp_example 120 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
                  python3 -P -m torch.distributed.run --nproc-per-node 2 examples/generate_tp.py --device cuda --json ;;
    # 330 s held both Hopper fp8 schedules' 26 tests (thirteenth session); one schedule is left, with its f16
    # chain, fp32-query and auto checks: 24 tests
    fp8_decode_tests) run_step fp8_decode_tests 330 $PYTEST tests/gpu/test_mla_decode_fp8_gpu.py ;;
    fp8_tests) run_step fp8_tests 300 $PYTEST -s tests/gpu/test_fp8_gpu.py ;;
    bench_mla_write_fp8) run_step bench_mla_write_fp8 90 python3 -P benchmarks/bench_mla_write.py --kv-dtype fp8_e4m3 --out "$OUT/json/" ;;
    # fp8 and bf16 side by side per point; --quick: the issue's points (batch >= 64, context >= 16k) and two short ones
    bench_mla_decode_fp8) run_step bench_mla_decode_fp8 200 python3 -P benchmarks/bench_mla_decode.py --kv-dtype fp8_e4m3 ${FP8_DECODE_GRID:---quick} --out "$OUT/json/" ;;
    # the fp8 kernel's tile settings at batch 64, context 16k (each compiles once); writes mla_decode_sweep_fp8.json
    # the Hopper fp8 kernel by name (kernel="wgmma", what auto runs on an H200) beside the bf16 one:
    # writes mla_decode_<date>_fp8_wgmma.json
    bench_mla_decode_fp8_wgmma) run_step bench_mla_decode_fp8_wgmma 200 python3 -P benchmarks/bench_mla_decode.py --kv-dtype fp8_e4m3 \
                      --kernel wgmma ${FP8_DECODE_GRID:---quick} --out "$OUT/json/" ;;
    bench_mla_decode_l2_fp8_wgmma) run_step bench_mla_decode_l2_fp8_wgmma 60 python3 -P benchmarks/bench_mla_decode.py --l2-ceiling \
                      --kv-dtype fp8_e4m3 --kernel wgmma --out "$OUT/json/" ;;
    # the Hopper fp8 kernel, the portable fp8 kernel and the bf16 Hopper kernel at the --quick fp8 points, then
    # on L2-resident rows (the first run, thirteenth session, timed the Hopper fp8 kernel's two schedules: the
    # one kept was 1.57-1.62x the other)
    bench_mla_decode_fp8_wgmma_ab) run_step bench_mla_decode_fp8_wgmma_ab 150 python3 -P benchmarks/bench_mla_decode.py \
                      --fp8-wgmma-ab --out "$OUT/json/mla_decode_fp8_wgmma_ab.json" ;;
    # the Hopper fp8 kernel's bf16 dequantisation chain (the default) against its f16 one (wgmma_fp8_f16=True,
    # off until this step times it) and the bf16 kernel, same points; decides mla_decode_hopper.FP8_F16_VALUES
    bench_mla_decode_fp8_f16_ab) run_step bench_mla_decode_fp8_f16_ab 150 python3 -P benchmarks/bench_mla_decode.py \
                      --fp8-f16-ab --out "$OUT/json/mla_decode_fp8_f16_ab.json" ;;
    bench_mla_decode_fp8_sweep) run_step bench_mla_decode_fp8_sweep 300 python3 -P benchmarks/bench_mla_decode.py --kv-dtype fp8_e4m3 \
                      --fp8-sweep-only --out "$OUT/json/mla_decode_sweep_fp8.json" ;;
    bench_mla_decode_l2) run_step bench_mla_decode_l2 60 python3 -P benchmarks/bench_mla_decode.py --l2-ceiling --out "$OUT/json/" ;;
    bench_mla_decode_l2_fp8) run_step bench_mla_decode_l2_fp8 60 python3 -P benchmarks/bench_mla_decode.py --l2-ceiling --kv-dtype fp8_e4m3 --out "$OUT/json/" ;;
    demo_real_fp8) run_step demo_real_fp8 200 python3 -P -m unimem_compile.cli demo --model kimi-linear-48b-4l --device cuda --cudagraphs --kv-dtype fp8_e4m3 --json ;;
    bench_generate_fp8) run_step bench_generate_fp8 "${GEN_LIMIT:-400}" python3 -P benchmarks/bench_generate.py --kv-dtype fp8_e4m3 --out /tmp/gen_fp8 \
                      --deadline-s "$(( ${GEN_LIMIT:-400} - 30 ))" --bundle "$OUT/json/generate_fp8.json" ;;
    bench_serving) run_step bench_serving "${SERVE_LIMIT:-570}" python3 -P benchmarks/bench_serving.py \
                     --out "$OUT/json/serving.json" --plots "$OUT" ${SERVE_ARGS:---scale 0.05 --budget-gib 0.75 --max-batch 32 --systems static0.5,unified --traces phased --rate 8 --step-check} ;;
    bench_serving_rate) run_step bench_serving_rate 570 python3 -P benchmarks/bench_serving.py \
                     --out "$OUT/json/serving_rate.json" --plots "$OUT/plots_rate" $SERVE_REDUCED \
                     --traces stationary --systems "" $SERVE_FIND --deadline-s 480 ;;
    bench_serving_probe) run_step bench_serving_probe 570 python3 -P benchmarks/bench_serving.py \
                     --out "$OUT/json/serving_probe.json" $SERVE_REDUCED --traces "" --systems "" --prefill-probe ;;
    bench_serving_stationary) run_step bench_serving_stationary 570 python3 -P benchmarks/bench_serving.py \
                     --out "$OUT/json/serving_stationary.json" --plots "$OUT/plots_stationary" $SERVE_REDUCED \
                     --traces stationary --systems $SERVE_SYSTEMS $SERVE_AT_RATE --deadline-s 480 ;;
    bench_serving_phased) run_step bench_serving_phased 570 python3 -P benchmarks/bench_serving.py \
                     --out "$OUT/json/serving_phased.json" --plots "$OUT/plots_phased" $SERVE_REDUCED \
                     --traces phased --systems $SERVE_SYSTEMS $SERVE_AT_RATE --step-check --deadline-s 480 ;;
    bench_serving_stock) run_step bench_serving_stock 570 python3 -P benchmarks/bench_serving.py \
                     --out "$OUT/json/serving_stock.json" --plots "$OUT/plots_stock" $SERVE_REDUCED \
                     --traces phased --systems stock_cb,stock_static --rate "${SERVE_RATE:-8}" --deadline-s 480 ;;
    bench_serving_http) run_step bench_serving_http 590 python3 -P benchmarks/bench_serving_http.py \
                          --scale "${HTTP_SCALE:-0.05}" --duration "${HTTP_DURATION:-60}" --rate "${HTTP_RATE:-4}" \
                          --out "$OUT/json/serving_http.json" ;;
    *) echo "unknown step $s" | tee -a "$LOG" ;;
  esac
done
