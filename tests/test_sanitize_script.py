"""scripts/sanitize.sh's verdict, on CPU: a stand-in sanitizer (tests/tools/fake_compute_sanitizer.sh)
writes canned reports. Racecheck reports wholly in Triton's warp-specialization handshake, with
the control reproducing them, pass; one that touches the kernel's own code fails, and so does a
failed case."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "tools" / "fake_compute_sanitizer.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _sanitize(tmp_path, **env):
    python_dir = str(pathlib.Path(sys.executable).parent)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SANITIZE_", "FAKE_"))}
    run_env = {**inherited, "OUT": str(tmp_path), "COMPUTE_SANITIZER": str(FAKE),
               "PATH": python_dir + os.pathsep + os.environ.get("PATH", ""), **env}
    proc = subprocess.run(["bash", "scripts/sanitize.sh"], cwd=ROOT, env=run_env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, (tmp_path / "sanitize" / "summary.txt").read_text()


def test_handshake_reports_reproduced_by_the_control_pass(tmp_path):
    rc, summary = _sanitize(tmp_path)
    assert rc == 0, summary
    assert "1 report(s) in Triton's warp-specialization handshake, 0 elsewhere" in summary
    assert "control: 1 handshake, 0 elsewhere -> ok" in summary
    assert "sanitize status=0" in summary


def test_a_report_in_our_code_fails(tmp_path):
    rc, summary = _sanitize(tmp_path, FAKE_SECOND_LINE="ours")
    assert rc == 1, summary
    assert "0 report(s) in Triton's warp-specialization handshake, 1 elsewhere" in summary
    assert "sanitize status=1" in summary


def test_handshake_reports_with_a_failed_case_fail(tmp_path):
    rc, summary = _sanitize(tmp_path, FAKE_CASES_LINE="SANITIZE_CASES ran=2 failed=1")
    assert rc == 1, summary
    assert "-> ok" in summary  # the triage alone would pass; the failed case does not
    assert "sanitize status=1" in summary


def test_the_cases_run_each_op_in_its_own_dtypes():
    """The case script's dry run on CPU (``--device cpu``), FP8 cases only: the FP8 ops are run
    with the activation dtypes they take (bf16/fp16), never fp32, which they refuse."""
    proc = subprocess.run([sys.executable, "scripts/sanitize_cases.py", "--device", "cpu", "--only", "fp8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("SANITIZE_CASES ran=") and summary.endswith(" failed=0")
    assert int(summary.split("ran=")[1].split()[0]) > 0
    assert "float32" not in proc.stdout


def test_only_filter_keeps_its_spaces(tmp_path):
    """``SANITIZE_ONLY`` reaches the cases script as one ``--only`` argument: "mixed experts_fp8"
    runs the cases whose names contain that text, and nothing else."""
    rc, summary = _sanitize(tmp_path, FAKE_CASES="1", SANITIZE_TOOLS="memcheck", SANITIZE_CASES_ARGS="--device cpu",
                            SANITIZE_ONLY="mixed experts_fp8")
    assert rc == 0, summary
    cases = [line for line in (tmp_path / "sanitize" / "memcheck.cases.log").read_text().splitlines()
             if line.startswith("[")]
    assert cases and all(" mixed experts_fp8" in line for line in cases), cases
