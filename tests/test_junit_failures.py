"""scripts/junit_failures.py, on CPU: from a real pytest junit XML it names each failed or
errored test with its message (what gpu_check.sh writes into the summary that always comes
back from a device call), and nothing for a passing one."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

CASES = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke: cu_seqlens [3]")

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "the dependent GEMM read act too early"

def test_errors(broken):
    pass
'''


def test_names_failures_and_errors_with_their_messages(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    xml = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"--junitxml={xml}", "--rootdir", str(tmp_path), str(tmp_path / "test_cases.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "junit_failures.py"), str(xml)],
                         capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    assert len(out) == 2, out
    failure = next(line for line in out if "test_fails" in line)
    assert failure.startswith("FAILURE test_cases::test_fails (") and "read act too early" in failure, failure
    error = next(line for line in out if "test_errors" in line)
    assert error.startswith("ERROR test_cases::test_errors (") and "fixture broke" in error, error
    assert not any("test_passes" in line for line in out)
