"""scripts/sanitize.sh's verdict, on CPU: a stand-in sanitizer (tests/tools/fake_compute_sanitizer.sh)
writes canned reports. Racecheck reports wholly in Triton's warp-specialization handshake, with
the control reproducing them, pass; one that touches the kernel's own code fails, and so does a
failed case."""

import os
import pathlib
import re
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


def _cases(only, *args):
    """The case script's dry run on CPU (``--device cpu``): its output."""
    proc = subprocess.run([sys.executable, "scripts/sanitize_cases.py", "--device", "cpu", "--only", only, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_the_cases_run_each_op_in_its_own_dtypes():
    """The case script's dry run on CPU, FP8 cases only: the FP8 ops are run with the activation
    dtypes they take (bf16/fp16), never fp32, which they refuse."""
    output = _cases("fp8")
    summary = output.strip().splitlines()[-1]
    assert re.fullmatch(r"SANITIZE_CASES ran=[1-9][0-9]* failed=0 done=0 left=0", summary), summary
    assert "float32" not in output


def test_only_filter_keeps_its_spaces(tmp_path):
    """``SANITIZE_ONLY`` reaches the cases script as one ``--only`` argument: "mixed experts_fp8"
    runs the cases whose names contain that text, and nothing else."""
    rc, summary = _sanitize(tmp_path, FAKE_CASES="1", SANITIZE_TOOLS="memcheck", SANITIZE_CASES_ARGS="--device cpu",
                            SANITIZE_ONLY="mixed experts_fp8")
    assert rc == 0, summary
    cases = [line for line in (tmp_path / "sanitize" / "memcheck.cases.log").read_text().splitlines()
             if line.startswith("[")]
    assert cases and all(" mixed experts_fp8" in line for line in cases), cases


def test_the_cases_skip_what_an_earlier_part_passed_and_stop_at_the_time_limit(tmp_path):
    """``--done LOG`` skips the cases LOG records as ok (not a failed one); ``--max-seconds`` starts
    no case after the limit and counts the rest as left."""
    whole = _cases("mixed")
    ran = int(re.search(r"ran=(\d+)", whole).group(1))
    lines = [line for line in whole.splitlines() if line.startswith("[")]
    assert len(lines) == ran >= 4
    earlier = tmp_path / "part1.cases.log"
    failed = lines[2].replace(": ok", ": FAILED")
    earlier.write_text("\n".join([lines[0], lines[1], failed, "SANITIZE_CASES ran=3 failed=1"]) + "\n")
    resumed = _cases("mixed", "--done", str(earlier))
    assert f"SANITIZE_CASES ran={ran - 2} failed=0 done=2 left=0" in resumed
    assert lines[0].split("] ")[1] not in resumed and failed.split("] ")[1].split(":")[0] in resumed
    assert f"SANITIZE_CASES ran=0 failed=0 done=0 left={ran}" in _cases("mixed", "--max-seconds", "1e-9")


def test_a_run_in_parts(tmp_path):
    """``SANITIZE_SECONDS`` cuts a run into parts (exit 3 while cases are left) and
    ``SANITIZE_RESUME=1`` runs what the earlier parts left, keeping their logs; a part cut short
    (no sanitizer summary) runs again, and an earlier part's failure stands."""
    env = dict(FAKE_CASES="1", SANITIZE_TOOLS="memcheck", SANITIZE_CASES_ARGS="--device cpu",
               SANITIZE_ONLY="mixed experts_fp8")
    rc, summary = _sanitize(tmp_path, SANITIZE_SECONDS="1e-9", **env)
    assert rc == 3 and "ran=0 failed=0 done=0 left=2; incomplete: SANITIZE_RESUME=1 runs the 2 cases left" in summary
    assert "sanitize status=3" in summary
    rc, summary = _sanitize(tmp_path, SANITIZE_RESUME="1", **env)
    assert rc == 0 and "ran=2 failed=0 done=0 left=0" in summary.splitlines()[-2], summary
    assert "left=2; incomplete" in summary  # the earlier part's lines are kept
    sanitize = tmp_path / "sanitize"
    assert (sanitize / "memcheck.part1.cases.log").is_file() and (sanitize / "memcheck.cases.log").is_file()
    rc, summary = _sanitize(tmp_path, SANITIZE_RESUME="1", **env)
    assert rc == 0 and "ran=0 failed=0 done=2 left=0" in summary.splitlines()[-2], summary
    assert "ran=2" in (sanitize / "memcheck.part2.cases.log").read_text()
    (sanitize / "memcheck.part2.log").write_text("")  # as if that part had been cut short
    rc, summary = _sanitize(tmp_path, SANITIZE_RESUME="1", **env)
    assert "memcheck.part2.cases.log has no sanitizer summary (cut short): its cases run again" in summary
    assert rc == 0 and "ran=2 failed=0 done=0 left=0" in summary.splitlines()[-2], summary
    rc, summary = _sanitize(tmp_path, SANITIZE_RESUME="1", FAKE_CASES_LINE="SANITIZE_CASES ran=1 failed=1",
                            **{**env, "FAKE_CASES": "0"})
    assert rc == 1, summary
    rc, summary = _sanitize(tmp_path, SANITIZE_RESUME="1", **env)
    assert rc == 1 and summary.splitlines()[-1] == "sanitize status=1", summary
