#!/usr/bin/env bash
# The whole GPU check: the cuda-marked suites (default path, then the portable sm80 path on the
# same GPU), the long fuzz profile, compute-sanitizer, and the benchmarks.
# Usage on the GPU machine, from the repo root:  bash scripts/gpu_check.sh [STEP...]
#   tests:    pytest -m cuda over tests/ (fuzzing excluded, 8 xdist workers), then compile_tests/
#             (one worker): the steps unit and compile, which fit one device call each
#   triton:   the cuda tests again with MOONEP_OPS_GLUON=0 (the Triton kernels on Hopper)
#   portable: the cuda tests again with MOONEP_OPS_PORTABLE=1 (the sm80 path)
#   fuzz:     the CUDA fuzz, long profile: FUZZ_EXAMPLES per op (default 2000) in FUZZ_SHARDS
#             (default 16) seeded items per op, spread over the xdist workers
#   sanitize: compute-sanitizer memcheck + racecheck (scripts/sanitize.sh)
#   bench:    benchmarks (expert path, training) with JSON and chart; BENCH_ARGS adds e.g. "--settle 1"
#             (each path replayed 1 s before it is timed: its steady state under the power cap)
#   tune:     the backward kernels' config sweep (benchmarks.tune_backward; only when named, not in all)
#   schedules: the forward kernel's Hopper schedule sweep (benchmarks.tune --schedules; only when named;
#             SCHEDULE_ROLES picks roles, e.g. fused_save)
#   probe:    where the forward GEMMs' time goes (benchmarks.probe: tail, knobs, row strides; only when
#             named; PROBE_SHAPES picks shapes), then Nsight Compute on the committed kernels (NCU=0: skip)
#   gluon:    the Gluon kernels against the Triton ones per GEMM and whole path (benchmarks.probe_gluon;
#             only when named; PROBE_SHAPES, PADDINGS, GLUON_AB=tail_pdl as in that module)
#   power:    power draw, SM clock and per-call time, cool and sustained (benchmarks.power; only
#             when named; PROBE_SHAPES picks shapes, POWER_ARGS adds e.g. "--ab energy --seconds 1")
#   ncu:      Nsight Compute on the experts op's two Gluon kernels (benchmarks.profile_pair, the
#             calls in its NVTX range "profile"; only when named; PROBE_SHAPES picks shapes, default 4,1)
#   dram:     DRAM rates (benchmarks.dram_layout: reads in the kernels' strided TMA boxes vs
#             contiguous ones, plain loads, a copy, writes alone; only when named)
#   PYTEST_K / FUZZ_K: a pytest -k filter for the tests/portable steps / the fuzz step (a re-run
#             of what a change touched)
#   all:      every step (longer than one 10-minute device command: split it across calls)
# Steps run in the order tests, portable, sanitize, bench, fuzz (the open-ended one last).
# Results land in $OUT (or ./gpu_out): junit XML, logs, benchmark JSON and PNG, summary.txt.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the fuzz step hands it to pytest workers
steps=" ${*:-all} "
want() { [[ "$steps" == *" $1 "* || "$steps" == *" all "* ]]; }
export PYTHONUNBUFFERED=1
# expecttest is not on the GPU image: carried as a wheel in .whl/ (see README).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# Everything here needs a GPU: a machine without one would "pass" by skipping every test.
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_check: no CUDA GPU visible" | tee "$OUT/summary.txt"; exit 2; }
status=0
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT/summary.txt"
run_pytest() {  # name, extra env..., pytest args
  local name=$1; shift
  # -v: every result is named in the log as it happens (a run cut by the call's time limit
  # still names its failures; -q with xdist names none until the end).
  # MOONEP_OPS_FAILURE_LOG (tests/failure_log.py): each failure and its reason (an assertion or a
  # timeout) lands in the summary as it happens, even when the call's time limit stops the run.
  MOONEP_OPS_FAILURE_LOG="$OUT/summary.txt" \
    python3 -m pytest -v -rfE -p no:cacheprovider --junitxml="$OUT/junit_$name.xml" "$@" > "$OUT/pytest_$name.log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$OUT/pytest_$name.log" | sort -u | head -n 20
  echo "pytest[$name] rc=$rc: $(tail -n 1 "$OUT/pytest_$name.log")" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}
# A hung test must not eat the whole device call (pytest-timeout is on the GPU image).
TIMEOUT_ARGS=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "-p timeout --timeout 300")
SERIAL_ARGS=$TIMEOUT_ARGS
# Most of the suite's time is Triton JIT compiles (CPU-bound): pytest-xdist workers share the GPU and
# the on-disk kernel cache. WORKERS=0 runs in one process.
if [ "${WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  TIMEOUT_ARGS="$TIMEOUT_ARGS -p xdist -n ${WORKERS:-8}"
fi
K_ARGS=(${PYTEST_K:+-k "$PYTEST_K"})
# The suite in two halves, one device call each (the whole of it ran past 10 minutes on the H200
# once the Gluon tests came in: tenth session); "tests" runs both.
if want tests || [[ "$steps" == *" unit "* ]]; then
  run_pytest cuda_unit -m cuda $TIMEOUT_ARGS "${K_ARGS[@]}" --ignore=tests/test_fuzz.py tests
fi
if want tests || [[ "$steps" == *" compile "* ]]; then
  # One worker: under 8 xdist workers (each with Inductor's own compile workers) the compiled-layer
  # graph tests did not finish in 270 s; alone they take seconds (eleventh session).
  run_pytest cuda_compile -m cuda $SERIAL_ARGS "${K_ARGS[@]}" compile_tests
fi
if want triton; then
  # The Triton kernels on Hopper (MOONEP_OPS_GLUON=0: no warp-specialized Gluon kernels).
  MOONEP_OPS_GLUON=0 run_pytest cuda_triton -m cuda $TIMEOUT_ARGS --ignore=tests/test_fuzz.py \
    -k "not long_replay${PYTEST_K:+ and ($PYTEST_K)}" tests
fi
if want portable; then
  # The portable (sm80) path on the same GPU: MOONEP_OPS_PORTABLE=1 turns the Hopper TMA loads off.
  MOONEP_OPS_PORTABLE=1 run_pytest cuda_portable -m cuda $TIMEOUT_ARGS --ignore=tests/test_fuzz.py \
    -k "not long_replay${PYTEST_K:+ and ($PYTEST_K)}" tests
fi
if want sanitize; then
  bash scripts/sanitize.sh 2>&1 | tail -n 16
  rc=${PIPESTATUS[0]}
  echo "sanitize rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
fi
if want bench; then
  python3 -m benchmarks.run ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -n 16
  rc=${PIPESTATUS[0]}
  echo "bench rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
  python3 -m benchmarks.plot "$OUT/bench.json" "$OUT/bench.png" || echo "plot failed (matplotlib?)"
  if [ -f benchmarks/train.py ]; then
    python3 -m benchmarks.train --out "$OUT/train.json" 2>&1 | tee "$OUT/train.log" | tail -n 10
    rc=${PIPESTATUS[0]}
    echo "train bench rc=$rc" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
  fi
fi
if [[ "$steps" == *" schedules "* ]]; then
  timeout ${SCHEDULES_TIMEOUT:-330} python3 -m benchmarks.tune --schedules --paddings ${PADDINGS:-128} \
    ${SCHEDULE_ROLES:+--roles $SCHEDULE_ROLES} --out "$OUT/tune_schedules.json" 2>&1 | tee "$OUT/tune_schedules.log" | grep -v "^  " | tail -n 24
  rc=${PIPESTATUS[0]}
  echo "tune --schedules rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
fi
if [[ "$steps" == *" gluon "* ]]; then
  timeout ${GLUON_TIMEOUT:-420} python3 -m benchmarks.probe_gluon --paddings ${PADDINGS:-128,1} \
    ${PROBE_SHAPES:+--shapes $PROBE_SHAPES} ${GLUON_AB:+--ab $GLUON_AB} --out "$OUT/probe_gluon.json" 2>&1 | tee "$OUT/probe_gluon.log" | grep -v "tail zero True" | tail -n 60
  rc=${PIPESTATUS[0]}
  echo "probe_gluon rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
fi
if [[ "$steps" == *" power "* ]]; then
  timeout ${POWER_TIMEOUT:-240} python3 -m benchmarks.power --shapes ${PROBE_SHAPES:-0,1,2,3,4,5} ${POWER_ARGS:-} \
    --out "$OUT/power.json" 2>&1 | tee "$OUT/power.log"
  rc=${PIPESTATUS[0]}
  echo "power rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
fi
if [[ "$steps" == *" dram "* ]]; then
  timeout ${DRAM_TIMEOUT:-240} python3 -m benchmarks.dram_layout --out "$OUT/dram_layout.json" 2>&1 | tee "$OUT/dram_layout.log"
  rc=${PIPESTATUS[0]}
  echo "dram_layout rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
fi
if [[ "$steps" == *" probe "* ]]; then
  timeout ${PROBE_TIMEOUT:-420} python3 -m benchmarks.probe --shapes ${PROBE_SHAPES:-0,1,2,3,4,5} --out "$OUT/probe.json" 2>&1 \
    | tee "$OUT/probe.log" | tail -n 60
  rc=${PIPESTATUS[0]}
  echo "probe rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
  if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:_moe_gemm_kernel --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats \
      --section Occupancy python3 -m benchmarks.probe --mode profile --shapes ${PROBE_SHAPES:-0,1,2,3,4,5} \
      > "$OUT/ncu.txt" 2>&1
    echo "ncu rc=$? ($(grep -c 'Duration' "$OUT/ncu.txt") kernels)" | tee -a "$OUT/summary.txt"
  fi
fi
if [[ "$steps" == *" ncu "* ]]; then
  timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --nvtx --nvtx-include "profile/" \
    -k regex:_ws_grouped_gemm_kernel --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    python3 -m benchmarks.profile_pair --shapes ${PROBE_SHAPES:-4,1} > "$OUT/ncu_pair.txt" 2>&1
  echo "ncu rc=$? ($(grep -c 'Duration' "$OUT/ncu_pair.txt") kernels)" | tee -a "$OUT/summary.txt"
fi
if [[ "$steps" == *" tune "* ]]; then
  timeout ${TUNE_TIMEOUT:-300} python3 -m benchmarks.tune_backward ${TUNE_ROLES:+--roles $TUNE_ROLES} --out "$OUT/tune_backward.json" 2>&1 | tee "$OUT/tune_backward.log" | tail -n 24
  rc=${PIPESTATUS[0]}
  echo "tune_backward rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
fi
if want fuzz; then
  # Long profile: FUZZ_EXAMPLES per op and device, split over FUZZ_SHARDS seeds so the xdist
  # workers share one op's examples; one host thread per worker for the float64 reference.
  # Failing examples go to fuzz_failures.txt as they happen (a run cut short keeps them).
  OMP_NUM_THREADS=1 MOONEP_OPS_FUZZ=long MOONEP_OPS_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-2000} \
    MOONEP_OPS_FUZZ_FAILURE_LOG="$OUT/fuzz_failures.txt" \
    MOONEP_OPS_FUZZ_SHARDS=${FUZZ_SHARDS:-16} run_pytest fuzz_long -m cuda $TIMEOUT_ARGS ${FUZZ_K:+-k "$FUZZ_K"} tests/test_fuzz.py
fi
echo "gpu_check status=$status" | tee -a "$OUT/summary.txt"
# The device tool brings back at most 8 files: with BUNDLE=1 everything goes into one archive
# (summary.txt stays beside it).
if [ "${BUNDLE:-0}" = 1 ]; then
  tar czf /tmp/gpu_check_results.tar.gz -C "$OUT" . && mv /tmp/gpu_check_results.tar.gz "$OUT/results.tar.gz" \
    && find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name results.tar.gz -exec rm -rf {} +
fi
exit $status
