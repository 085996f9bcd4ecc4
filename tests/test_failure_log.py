"""tests/failure_log.py, on CPU: each failure reaches MOONEP_OPS_FAILURE_LOG with its reason while
the run is still going, so a run stopped by a time limit (as gpu_check.sh's are) still says why;
under pytest-xdist each failure is written once."""

import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

CASES = '''
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke: cu_seqlens [3]")

def test_a_passes():
    pass

def test_b_fails():
    assert 1 + 1 == 3, "the dependent GEMM read act too early"

def test_c_errors(broken):
    pass

def test_d_hangs():
    time.sleep(120)
'''


def _start(tmp_path, *args):
    (tmp_path / "test_cases.py").write_text(CASES)
    log = tmp_path / "failures.txt"
    env = {**os.environ, "MOONEP_OPS_FAILURE_LOG": str(log),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run under xdist
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.failure_log",
                             "--rootdir", str(tmp_path), *args, str(tmp_path / "test_cases.py")],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, log


def _lines_once_two_are_in(proc, log, timeout=90.0):
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            lines = log.read_text().splitlines() if log.exists() else []
            if len(lines) >= 2:
                time.sleep(0.5)  # a duplicate would follow at once
                return log.read_text().splitlines()
            time.sleep(0.2)
        pytest.fail(f"fewer than two failures logged in {timeout} s: {lines}")
    finally:
        proc.terminate()  # the hanging test is still running: stop the run as a time limit would
        proc.wait(timeout=30)


def _check(lines):
    assert len(lines) == 2, lines
    failed = next(ln for ln in lines if "test_b_fails" in ln)
    assert failed.startswith("FAILED ") and "test_cases.py::test_b_fails (" in failed, failed
    assert "the dependent GEMM read act too early" in failed, failed
    errored = next(ln for ln in lines if "test_c_errors" in ln)
    assert errored.startswith("ERROR at setup ") and "fixture broke: cu_seqlens [3]" in errored, errored


def test_failures_are_logged_before_the_run_ends(tmp_path):
    proc, log = _start(tmp_path, "-p", "no:xdist")
    _check(_lines_once_two_are_in(proc, log))


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist")
def test_under_xdist_each_failure_is_logged_once(tmp_path):
    proc, log = _start(tmp_path, "-p", "xdist", "-n", "2")
    _check(_lines_once_two_are_in(proc, log))
