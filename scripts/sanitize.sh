#!/usr/bin/env bash
# The sanitizer run: every CUDA kernel of moonep_ops under compute-sanitizer (memcheck, racecheck),
# on the small problems of scripts/sanitize_cases.py (each also checked against its reference).
# Usage on the GPU machine, from the repo root:  bash scripts/sanitize.sh  (or gpu_check.sh sanitize,
# which first installs the wheels of .whl/: the cases import the test helpers, which need expecttest)
# Env: OUT (default gpu_out): results go to $OUT/sanitize/ (one log per tool, summary.txt);
#      SANITIZE_TOOLS (default "memcheck racecheck"; synccheck and initcheck also work);
#      COMPUTE_SANITIZER (path to the binary, if it is not found on its own);
#      SANITIZE_CASES_ARGS (extra arguments for sanitize_cases.py, e.g. "--device cpu" for a dry run);
#      SANITIZE_ONLY (one --only argument for it, spaces kept: e.g. "default fp8", a re-run of a change).
# Exits non-zero if a tool reports any error ("ERROR SUMMARY: N errors" or racecheck's
# "(E errors, ...)" with N, E > 0, or no summary at all: a crashed run is not a clean one), or
# if a case failed its numerics check or did not run. Excepted: racecheck reports that lie wholly
# in Triton's warp-specialization handshake, while a control kernel with no moonep code
# reproduces them (scripts/racecheck_triage.py, scripts/racecheck_control.py).
# tests/test_sanitize_script.py checks this verdict logic on CPU with a stand-in sanitizer.
set -uo pipefail
OUT=${OUT:-gpu_out}
dir="$OUT/sanitize"
mkdir -p "$dir"
tools=${SANITIZE_TOOLS:-memcheck racecheck}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
# Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees the real
# bounds of each buffer (a read past a tensor into its cached neighbour would go unnoticed).
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

san=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
if [ -z "$san" ]; then
  for c in /usr/local/cuda/bin/compute-sanitizer $(ls -d /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | sort -V -r); do
    [ -x "$c" ] && san=$c && break
  done
fi
if [ -z "$san" ] || [ ! -x "$san" ]; then
  echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)" | tee "$dir/summary.txt"
  exit 2
fi
{ echo "date: $(date -u +%FT%TZ)"; echo "sanitizer: $san"; "$san" --version | tail -n 2; } | tee "$dir/summary.txt"

status=0
for tool in $tools; do
  log="$dir/$tool.log"
  t0=$(date +%s)
  # The sanitizer report goes to $log; the cases' own output (one line per case) to $tool.cases.log.
  "$san" --tool "$tool" --log-file "$log" --print-limit 1000 --error-exitcode 99 \
    python3 scripts/sanitize_cases.py ${SANITIZE_CASES_ARGS:-} ${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"} \
    > "$dir/$tool.cases.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  # memcheck/synccheck/initcheck end with "ERROR SUMMARY: N errors"; racecheck with
  # "RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)". Count the errors of both.
  summaries=$(grep -Eo "(ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: .*\([0-9]+ error)" "$log" || true)
  errors=$(echo "$summaries" | grep -Eo "[0-9]+ error" | grep -Eo "[0-9]+" | awk '{s += $1} END {print s + 0}')
  warnings=$(grep -Eo "RACECHECK SUMMARY: .*" "$log" | grep -Eo "[0-9]+ warning" | grep -Eo "[0-9]+" | awk '{s += $1} END {print s + 0}')
  cases=$(grep -E "^SANITIZE_CASES" "$dir/$tool.cases.log" || echo "SANITIZE_CASES missing (crashed?)")
  line="$tool: rc=$rc errors=$errors racecheck_warnings=$warnings (${secs}s) $cases"
  tolerated=0
  if [ "$tool" = racecheck ] && [ "$errors" -ne 0 ] && [ -n "$summaries" ]; then
    # Reports in Triton's warp-specialization handshake (not our code; reproduced by a control
    # kernel with no moonep code) are tolerated when they are all there is: scripts/racecheck_triage.py.
    "$san" --tool racecheck --log-file "$dir/racecheck_control.log" --print-limit 1000 \
      python3 scripts/racecheck_control.py > "$dir/racecheck_control.cases.log" 2>&1
    triage=$(python3 scripts/racecheck_triage.py "$log" --control "$dir/racecheck_control.log")
    triage_rc=$?
    line="$line; $triage"
    if [ "$triage_rc" -eq 0 ] && [[ "$cases" == *" failed=0"* ]] && [ "$rc" -eq 99 ]; then
      tolerated=1
    fi
  fi
  if [ -z "$summaries" ]; then
    line="$line; no ERROR SUMMARY in $log"
    status=1
  elif [ "$tolerated" -eq 0 ] && { [ "$errors" -ne 0 ] || [ "$rc" -ne 0 ]; }; then
    status=1
  fi
  echo "$line" | tee -a "$dir/summary.txt"
  # The first reported error, for the summary (the full report is in $log).
  if [ "$errors" != 0 ]; then
    grep -m 1 -A 12 -E "^========= (Invalid|Error|Race|Barrier|Uninitialized)" "$log" | tee -a "$dir/summary.txt"
  fi
  grep -E ": FAILED" "$dir/$tool.cases.log" | head -n 20 | tee -a "$dir/summary.txt"
done
echo "sanitize status=$status" | tee -a "$dir/summary.txt"
exit $status
