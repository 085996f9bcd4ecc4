#!/usr/bin/env bash
# The sanitizer run: every CUDA kernel of moonep_ops under compute-sanitizer (memcheck, racecheck),
# on the small problems of scripts/sanitize_cases.py (each also checked against its reference).
# Usage on the GPU machine, from the repo root:  bash scripts/sanitize.sh  (or gpu_check.sh sanitize,
# which first installs the wheels of .whl/: the cases import the test helpers, which need expecttest)
# Env: OUT (default gpu_out): results go to $OUT/sanitize/ (one log per tool, summary.txt);
#      SANITIZE_TOOLS (default "memcheck racecheck"; synccheck and initcheck also work);
#      COMPUTE_SANITIZER (path to the binary, if it is not found on its own);
#      SANITIZE_CASES_ARGS (extra arguments for sanitize_cases.py, e.g. "--device cpu" for a dry run);
#      SANITIZE_ONLY (one --only argument for it, spaces kept: e.g. "default fp8", a re-run of a change);
#      SANITIZE_SECONDS (each tool starts no case after this many seconds; the rest are left for a
#        later part: the whole set takes longer than one GPU command may run. A case started just
#        before the limit can take over a minute (a forced FP8 config on the decode layout: about
#        65 s under memcheck), and a part cut short counts for nothing: leave two minutes);
#      SANITIZE_RESUME=1 (continue the run in $OUT/sanitize/, e.g. a copy of the last part's: each
#        tool's logs move to <tool>.part<k>.log and .cases.log, and the cases those record as ok are
#        skipped, unless the part's sanitizer log has no summary (cut short, never judged);
#        summary.txt is appended to, and an earlier part's failure stands).
# Exits 1 if a tool reports any error ("ERROR SUMMARY: N errors" or racecheck's
# "(E errors, ...)" with N, E > 0, or no summary at all: a crashed run is not a clean one), or
# if a case failed its numerics check or did not run. Excepted: racecheck reports that lie wholly
# in Triton's warp-specialization handshake, while a control kernel with no moonep code
# reproduces them (scripts/racecheck_triage.py, scripts/racecheck_control.py). Exits 3 if it
# found nothing wrong but cases were left (SANITIZE_SECONDS): SANITIZE_RESUME=1 runs them.
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
status=0
incomplete=0
summary_tee=(tee "$dir/summary.txt")
if [ -n "${SANITIZE_RESUME:-}" ] && [ -f "$dir/summary.txt" ]; then
  summary_tee=(tee -a "$dir/summary.txt")
  grep -q "^sanitize status=1$" "$dir/summary.txt" && status=1  # an earlier part's failure stands
fi
{ echo "date: $(date -u +%FT%TZ)"; echo "sanitizer: $san"; "$san" --version | tail -n 2; } | "${summary_tee[@]}"

for tool in $tools; do
  log="$dir/$tool.log"
  done_args=()
  if [ -n "${SANITIZE_RESUME:-}" ]; then
    if [ -f "$dir/$tool.cases.log" ]; then
      part=1
      while [ -e "$dir/$tool.part$part.cases.log" ]; do part=$((part + 1)); done
      mv "$dir/$tool.cases.log" "$dir/$tool.part$part.cases.log"
      [ -f "$log" ] && mv "$log" "$dir/$tool.part$part.log"
    fi
    for earlier in "$dir/$tool".part*.cases.log; do
      [ -f "$earlier" ] || continue
      # A part cut short (no sanitizer summary) was never judged: its cases run again.
      if grep -qE "(ERROR|RACECHECK) SUMMARY" "${earlier%.cases.log}.log" 2>/dev/null; then
        done_args+=(--done "$earlier")
      else
        echo "$tool: $(basename "$earlier") has no sanitizer summary (cut short): its cases run again" \
          | tee -a "$dir/summary.txt"
      fi
    done
  fi
  t0=$(date +%s)
  # The sanitizer report goes to $log; the cases' own output (one line per case) to $tool.cases.log.
  "$san" --tool "$tool" --log-file "$log" --print-limit 1000 --error-exitcode 99 \
    python3 scripts/sanitize_cases.py ${SANITIZE_CASES_ARGS:-} ${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"} \
    ${done_args[@]+"${done_args[@]}"} ${SANITIZE_SECONDS:+--max-seconds "$SANITIZE_SECONDS"} \
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
  [[ "$cases" == *" failed=0"* ]] || status=1  # (the cases script also exits 1 then)
  left=$(echo "$cases" | grep -Eo "left=[0-9]+" | grep -Eo "[0-9]+")
  if [ "${left:-0}" -gt 0 ]; then
    line="$line; incomplete: SANITIZE_RESUME=1 runs the $left cases left"
    incomplete=1
  fi
  echo "$line" | tee -a "$dir/summary.txt"
  # The first reported error, for the summary (the full report is in $log).
  if [ "$errors" != 0 ]; then
    grep -m 1 -A 12 -E "^========= (Invalid|Error|Race|Barrier|Uninitialized)" "$log" | tee -a "$dir/summary.txt"
  fi
  grep -E ": FAILED" "$dir/$tool.cases.log" | head -n 20 | tee -a "$dir/summary.txt"
done
[ "$status" -eq 0 ] && [ "$incomplete" -eq 1 ] && status=3
echo "sanitize status=$status" | tee -a "$dir/summary.txt"
exit $status
