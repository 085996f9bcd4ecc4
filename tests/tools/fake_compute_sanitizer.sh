#!/usr/bin/env bash
# A stand-in for compute-sanitizer (tests/test_sanitize_script.py): runs nothing on a GPU and
# writes canned reports, so that scripts/sanitize.sh's verdict logic can be tested on CPU.
# racecheck of the cases reports one hazard between the def line of a moonep kernel that calls
# warp_specialize and FAKE_SECOND_LINE (default: the line of its warp_specialize op; "ours": a
# line of the kernel's own code); the control reports the handshake pattern. The lines come from
# scripts/racecheck_triage.py's own search of the sources. FAKE_CASES=1 runs the cases script (on
# CPU), else a one-line stand-in (FAKE_CASES_LINE, default "SANITIZE_CASES ran=1 failed=0").
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
# FILE DEF OP OURS (a moonep kernel file) and CDEF COP (the control's def and op lines).
read -r FILE DEF OP OURS CDEF COP <<<"$(python3 - <<'PY'
import importlib.util
spec = importlib.util.spec_from_file_location("triage", "scripts/racecheck_triage.py")
triage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(triage)
allowed = triage.allowed_lines()
name = sorted(n for n in allowed if n != "racecheck_control.py")[0]
defs, ops = allowed[name]
ours = next(n for n in range(min(defs) + 1, 100000) if n not in defs | ops)
cdefs, cops = allowed["racecheck_control.py"]
print(name, min(defs), min(ops), ours, min(cdefs), min(cops))
PY
)"
second=${FAKE_SECOND_LINE:-$OP}
[ "$second" = ours ] && second=$OURS
run_cases() {
  if [ "${FAKE_CASES:-0}" = 1 ]; then "${args[@]}"; else echo "${FAKE_CASES_LINE:-SANITIZE_CASES ran=1 failed=0}"; fi
}
if [ "$tool" = memcheck ]; then
  run_cases; rc=$?
  echo "========= ERROR SUMMARY: 0 errors" > "$log"; exit $rc
fi
if [[ "$script" == *racecheck_control.py ]]; then
  echo "racecheck control [like_ours]: ok"
  printf '%s\n' "========= Error: Race reported between Read access at _ws_control+0x1a0 in racecheck_control.py:$CDEF" \
    "=========     and Write access at _ws_control+0x730 in racecheck_control.py:$COP [9 hazards]" \
    "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)" > "$log"; exit 99
fi
run_cases
printf '%s\n' "========= Error: Race reported between Read access at kernel+0x140 in $FILE:$DEF" \
  "=========     and Write access at kernel+0x1d60 in $FILE:$second [7 hazards]" \
  "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)" > "$log"
exit 99
