"""A pytest plugin: with ``MOONEP_OPS_FAILURE_LOG=FILE``, every failed or errored test is appended
to FILE the moment its report arrives, with the ``E`` lines of its message (or the last line, as
for pytest-timeout's "Timeout >300.0s") and its duration.

Why: ``gpu_check.sh`` runs inside a device call with a hard time limit. When the limit stops a
run, pytest never prints its summary or writes its junit XML, and a ``-v`` log under xdist names a
failure without saying why (fourteenth session). This file already holds the reason.
Loaded by the root ``conftest.py``; under pytest-xdist only the controller writes (it receives
every worker's reports).
"""

import os


def _reason(report, max_lines: int = 3) -> str:
    text = report.longreprtext or ""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if not lines:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()][-1:]
    return " | ".join(lines[:max_lines])[:500]


def pytest_runtest_logreport(report):
    path = os.environ.get("MOONEP_OPS_FAILURE_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not report.failed:
        return
    kind = "FAILED" if report.when == "call" else f"ERROR at {report.when}"
    with open(path, "a") as f:
        f.write(f"{kind} {report.nodeid} ({report.duration:.1f} s): {_reason(report)}\n")
