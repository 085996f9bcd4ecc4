"""The failures and errors of a pytest report log (``pytest --report-log=FILE``, pytest-reportlog).

The report log gets one JSON line per test phase as it finishes, so a run cut short (a device
call's time limit, a crash) still names every failure up to that point. scripts/gpu_check.sh
writes one per pytest step and puts this script's output in its summary; for a cut run:

    python3 scripts/reportlog_failures.py [--limit 40] gpu_out/reportlog_cuda_unit.jsonl

Prints ``FAILED <test>: <message>`` (``ERROR`` for a failed setup, teardown or collection) per
report, at most ``--limit`` of them per file, then ``<n> failed, <m> errors in <file>
(finished|cut short)``. Exits 1 if any.
"""

import argparse
import json
import sys


def _message(report: dict) -> str:
    longrepr = report.get("longrepr")
    if isinstance(longrepr, dict):
        crash = longrepr.get("reprcrash") or {}
        if crash.get("message"):
            return crash["message"]
        longrepr = longrepr.get("longrepr")
    lines = [line for line in str(longrepr or "").splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def failures(lines) -> tuple[list[str], bool]:
    """(one line per failed report, whether the run finished)."""
    out, finished = [], False
    for line in lines:
        try:
            report = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a killed run
            continue
        kind = report.get("$report_type")
        finished |= "exitstatus" in report  # pytest's closing record
        if kind not in ("TestReport", "CollectReport") or report.get("outcome") != "failed":
            continue
        label = "FAILED" if kind == "TestReport" and report.get("when") == "call" else "ERROR"
        message = " ".join(_message(report).split())[:300]
        out.append(f"{label} {report.get('nodeid') or '(collection)'}: {message}")
    return out, finished


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reportlogs", nargs="+")
    parser.add_argument("--limit", type=int, default=None, help="failures printed per file at most")
    args = parser.parse_args(argv)
    status = 0
    for path in args.reportlogs:
        with open(path, errors="replace") as f:
            found, finished = failures(f)
        for line in found[:args.limit]:
            print(line)
        n_failed = sum(line.startswith("FAILED") for line in found)
        print(f"{n_failed} failed, {len(found) - n_failed} errors in {path} "
              f"({'finished' if finished else 'cut short'})")
        status |= bool(found)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
