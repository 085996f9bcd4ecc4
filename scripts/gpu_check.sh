#!/usr/bin/env bash
# The whole GPU check: the cuda-marked test suites (default kernels, then the Triton and the
# portable sm80 paths on the same GPU), compute-sanitizer, the benchmarks, the long fuzz profile,
# and on request the config tuners.
# Usage on the GPU machine, from the repo root:  bash scripts/gpu_check.sh [STEP...]   (default: all)
#   unit:      pytest -m cuda over tests/ (fuzzing excluded; WORKERS xdist workers, default 8)
#   compile:   pytest -m cuda over compile_tests/ (one worker: torch.compile's own compile workers
#              beside 8 xdist workers make its graph tests crawl)
#   tests:     unit, then compile
#   triton:    the cuda tests again with MOONEP_OPS_GLUON=0 (the Triton kernels on Hopper)
#   portable:  the cuda tests again with MOONEP_OPS_PORTABLE=1 (the sm80 path)
#   sanitize:  compute-sanitizer memcheck + racecheck (scripts/sanitize.sh; results in $OUT/sanitize/;
#              SANITIZE_SECONDS and SANITIZE_RESUME take it in parts: see sanitize.sh)
#   bench:     benchmarks.run (JSON, log, chart, and the README table it gives), then benchmarks.train;
#              BENCH_ARGS adds arguments to benchmarks.run, e.g. "--settle 0 --paddings 128"
#   bench_fp8: benchmarks.fp8, the FP8 table (fp8.json, and the table it gives); BENCH_FP8_ARGS adds
#              arguments, e.g. "--shapes 0,3"
#   fuzz:      the CUDA fuzz, long profile: FUZZ_EXAMPLES per op (default 2000) in FUZZ_SHARDS
#              (default 16) seeded items per op, spread over the xdist workers
#   all:       tests, triton, portable, sanitize, bench, bench_fp8, fuzz, in that order (longer than one
#              10-minute device command: name a few steps per command)
# Only when named:
#   tune:          benchmarks.tune, the Triton forward configs; TUNE_ARGS adds arguments, e.g.
#                  "--schedules --paddings 128 --roles fused_save"
#   tune_backward: benchmarks.tune_backward, the backward configs; TUNE_ROLES picks roles
#   sweep:         benchmarks.sweep, the layout sweep (about 6 minutes, then a minute re-timing its
#                  lowest cases; JSON, log, and its summary into summary.txt); SWEEP_ARGS adds
#                  arguments, e.g. "--quick", or "--case-seed 1" (the held-out list); stops starting cases after SWEEP_SECONDS (default 480),
#                  so that one device command keeps its results
#   sweep_fp8:     benchmarks.sweep --fp8, the same layouts on the FP8 experts op against the bf16 one
#                  and the FP8 limit (sweep_fp8.json; same SWEEP_ARGS and SWEEP_SECONDS).
#                  SWEEP_ARGS="--resume" continues the sweep JSON already in $OUT (e.g. a copy of
#                  the committed results of a run cut short) instead of starting over;
#                  SWEEP_ARGS="--resume --rerun ^h7168-i4096" also re-times its cases of that model
#                  (a regular expression without spaces: SWEEP_ARGS is split on them)
# PYTEST_K / FUZZ_K: a pytest -k filter for the test steps / the fuzz step (a re-run of what a
# change touched).
#
# Results land in $OUT (default ./gpu_out): summary.txt (versions, one line per step, each failed
# test with its message), per pytest step its -v log, junit XML and report log, benchmark JSON,
# logs and chart. BUNDLE=1 packs everything but summary.txt into results.tar.gz.
#
# The GPU machine has no network for pip: wheels carried in .whl/ (gitignored) are installed into
# /tmp/site first. .whl/ must hold the expecttest wheel (the tests import it) and the
# pytest-reportlog wheel (--report-log: one JSON line per test as it finishes, so a run cut by a
# time limit still names its failures; without it the summary's failures come from the -v log).
# Fetch them on a machine with network, from the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl expecttest pytest-reportlog
# A run cut short: python3 scripts/reportlog_failures.py $OUT/reportlog_<step>.jsonl
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the fuzz step hands it to pytest workers
steps=" ${*:-all} "
named() { [[ "$steps" == *" $1 "* ]]; }
want() { named "$1" || named all; }
export PYTHONUNBUFFERED=1
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
HAVE_REPORTLOG=$(python3 -c "import pytest_reportlog" 2>/dev/null && echo 1)
[ -n "$HAVE_REPORTLOG" ] || echo "gpu_check: pytest-reportlog missing (.whl/): failures come from the -v logs" \
  | tee -a "$OUT/summary.txt"
run_pytest() {  # name, pytest args
  local name=$1; shift
  local reportlog="$OUT/reportlog_$name.jsonl"
  local log_args=()
  [ -n "$HAVE_REPORTLOG" ] && log_args=(--report-log="$reportlog")
  # -v: every result is named in the log as it happens (-q with xdist names none until the end).
  python3 -m pytest -v -rfE -p no:cacheprovider --junitxml="$OUT/junit_$name.xml" "${log_args[@]}" "$@" \
    > "$OUT/pytest_$name.log" 2>&1
  local rc=$?
  if [ -n "$HAVE_REPORTLOG" ] && [ -f "$reportlog" ]; then
    python3 scripts/reportlog_failures.py --limit 40 "$reportlog" | tee -a "$OUT/summary.txt"
  else
    grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$OUT/pytest_$name.log" | sort -u | head -n 40 | tee -a "$OUT/summary.txt"
  fi
  echo "pytest[$name] rc=$rc: $(tail -n 1 "$OUT/pytest_$name.log")" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}
run_tool() {  # name, command...: output to $OUT/name.log, its tail to the terminal
  local name=$1; shift
  "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 24
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc" | tee -a "$OUT/summary.txt"
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
if want tests || named unit; then
  run_pytest cuda_unit -m cuda $TIMEOUT_ARGS "${K_ARGS[@]}" --ignore=tests/test_fuzz.py tests
fi
if want tests || named compile; then
  run_pytest cuda_compile -m cuda $SERIAL_ARGS "${K_ARGS[@]}" compile_tests
fi
if want triton; then
  MOONEP_OPS_GLUON=0 run_pytest cuda_triton -m cuda $TIMEOUT_ARGS --ignore=tests/test_fuzz.py \
    -k "not long_replay${PYTEST_K:+ and ($PYTEST_K)}" tests
fi
if want portable; then
  MOONEP_OPS_PORTABLE=1 run_pytest cuda_portable -m cuda $TIMEOUT_ARGS --ignore=tests/test_fuzz.py \
    -k "not long_replay${PYTEST_K:+ and ($PYTEST_K)}" tests
fi
if want sanitize; then
  OUT="$OUT" bash scripts/sanitize.sh 2>&1 | tail -n 16
  rc=${PIPESTATUS[0]}
  echo "sanitize rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
fi
if want bench; then
  run_tool bench python3 -m benchmarks.run ${BENCH_ARGS:-} --out "$OUT/bench.json"
  if [ -f "$OUT/bench.json" ]; then
    python3 -m benchmarks.plot "$OUT/bench.json" "$OUT/bench.png" || echo "plot failed (matplotlib?)"
    python3 -m benchmarks.report --results "$OUT/bench.json" --stdout | tee -a "$OUT/summary.txt"
  fi
  run_tool train python3 -m benchmarks.train --out "$OUT/train.json"
fi
if want bench_fp8; then
  run_tool bench_fp8 python3 -m benchmarks.fp8 ${BENCH_FP8_ARGS:-} --out "$OUT/fp8.json"
  [ -f "$OUT/fp8.json" ] && python3 -m benchmarks.report --fp8 --results "$OUT/fp8.json" --stdout \
    | tee -a "$OUT/summary.txt"
fi
if named sweep; then
  run_tool sweep python3 -m benchmarks.sweep --max-seconds "${SWEEP_SECONDS:-480}" ${SWEEP_ARGS:-} --out "$OUT/sweep.json"
  [ -f "$OUT/sweep.json" ] && python3 -m benchmarks.report --sweep --results "$OUT/sweep.json" --stdout \
    | tee -a "$OUT/summary.txt"
fi
if named sweep_fp8; then
  run_tool sweep_fp8 python3 -m benchmarks.sweep --fp8 --max-seconds "${SWEEP_SECONDS:-480}" ${SWEEP_ARGS:-} \
    --out "$OUT/sweep_fp8.json"
  [ -f "$OUT/sweep_fp8.json" ] && python3 -m benchmarks.report --fp8-sweep --results "$OUT/sweep_fp8.json" --stdout \
    | tee -a "$OUT/summary.txt"
fi
if named tune; then
  run_tool tune timeout ${TUNE_TIMEOUT:-330} python3 -m benchmarks.tune ${TUNE_ARGS:-} --out "$OUT/tune.json"
fi
if named tune_backward; then
  run_tool tune_backward timeout ${TUNE_TIMEOUT:-330} python3 -m benchmarks.tune_backward \
    ${TUNE_ROLES:+--roles $TUNE_ROLES} --out "$OUT/tune_backward.json"
fi
if want fuzz; then
  # FUZZ_EXAMPLES per op and device, split over FUZZ_SHARDS seeds so the xdist workers share one
  # op's examples; one host thread per worker for the float64 reference. Failing examples go to
  # fuzz_failures.txt as they happen (a run cut short keeps them).
  OMP_NUM_THREADS=1 MOONEP_OPS_FUZZ=long MOONEP_OPS_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-2000} \
    MOONEP_OPS_FUZZ_FAILURE_LOG="$OUT/fuzz_failures.txt" \
    MOONEP_OPS_FUZZ_SHARDS=${FUZZ_SHARDS:-16} run_pytest fuzz_long -m cuda $TIMEOUT_ARGS ${FUZZ_K:+-k "$FUZZ_K"} tests/test_fuzz.py
fi
echo "gpu_check status=$status" | tee -a "$OUT/summary.txt"
if [ "${BUNDLE:-0}" = 1 ]; then
  tar czf /tmp/gpu_check_bundle.tar.gz -C "$OUT" . && mv /tmp/gpu_check_bundle.tar.gz "$OUT/results.tar.gz" \
    && find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name results.tar.gz -exec rm -rf {} +
fi
exit $status
