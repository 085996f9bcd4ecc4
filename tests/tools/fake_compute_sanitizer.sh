#!/usr/bin/env bash
# A stand-in for compute-sanitizer (tests/test_sanitize_script.py): runs nothing on a GPU and
# writes canned reports, so that scripts/sanitize.sh's verdict logic can be tested on CPU.
# racecheck of the cases reports one hazard between the Gluon GEMM's def line and
# FAKE_SECOND_LINE (default: the line of the `if` around its warp_specialize; "ours": a line of
# the consumer's own code); the control reports the handshake pattern in its like_ours and
# prologue variants. FAKE_CASES=1 runs the cases script (on CPU), else a one-line stand-in
# (FAKE_CASES_LINE, default "SANITIZE_CASES ran=1 failed=0").
if [ "$1" = "--version" ]; then echo "fake sanitizer"; echo "Version 0"; exit 0; fi
tool=""; log=""; args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool=$2; shift 2;;
    --log-file) log=$2; shift 2;;
    --print-limit|--error-exitcode) shift 2;;
    *) args+=("$1"); shift;;
  esac
done
script=${args[1]}
GEMM=moonep_ops/kernels/gluon_grouped_gemm.py
DEF=$(grep -n "^def _ws_grouped_gemm_kernel(" $GEMM | cut -d: -f1)
IFWS=$(grep -n "^    if PINGPONG:$" $GEMM | cut -d: -f1)
OURS=$(grep -n "mbarrier.wait(ready.index(s)" $GEMM | head -1 | cut -d: -f1)
CDEF=$(grep -n "^def _ws_control(" scripts/racecheck_control.py | cut -d: -f1)
CIF=$(grep -n "^    if TWO_WORKERS:$" scripts/racecheck_control.py | cut -d: -f1)
second=${FAKE_SECOND_LINE:-$IFWS}
[ "$second" = ours ] && second=$OURS
run_cases() {
  if [ "${FAKE_CASES:-0}" = 1 ]; then "${args[@]}"; else echo "${FAKE_CASES_LINE:-SANITIZE_CASES ran=1 failed=0}"; fi
}
if [ "$tool" = memcheck ]; then
  run_cases; rc=$?
  echo "========= ERROR SUMMARY: 0 errors" > "$log"; exit $rc
fi
if [[ "$script" == *racecheck_control.py ]]; then
  echo "racecheck control: ok"
  if [ "${args[2]:-like_ours}" = like_ours ] || [ "${args[2]:-}" = prologue ]; then
    printf '%s\n' "========= Error: Race reported between Read access at _ws_control+0x1a0 in racecheck_control.py:$CDEF" \
      "=========     and Write access at _ws_control+0x730 in racecheck_control.py:$CIF [9 hazards]" \
      "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)" > "$log"; exit 99
  fi
  echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" > "$log"; exit 0
fi
run_cases
printf '%s\n' "========= Error: Race reported between Read access at _ws_grouped_gemm_kernel+0x140 in gluon_grouped_gemm.py:$DEF" \
  "=========     and Write access at _ws_grouped_gemm_kernel+0x1d60 in gluon_grouped_gemm.py:$second [7 hazards]" \
  "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)" > "$log"
exit 99
