"""scripts/reportlog_failures.py on a real pytest report log: what scripts/gpu_check.sh puts in its
summary, for a finished run and for one cut short."""

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pytest_reportlog")

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("reportlog_failures", ROOT / "scripts" / "reportlog_failures.py")
reportlog_failures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reportlog_failures)

CASES = textwrap.dedent("""\
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_passes():
        pass

    def test_fails():
        assert 1 == 2, "one is not two"

    def test_setup_fails(broken):
        pass
    """)


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reportlog")
    (tmp / "test_cases.py").write_text(CASES)
    path = tmp / "log.jsonl"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--report-log={path}",
                    str(tmp / "test_cases.py")], cwd=tmp, capture_output=True, timeout=120)
    return path


def test_failures_and_errors_are_named_with_their_messages(log, capsys):
    assert reportlog_failures.main([str(log)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FAILED test_cases.py::test_fails: AssertionError: one is not two")
    assert out[1] == "ERROR test_cases.py::test_setup_fails: RuntimeError: fixture broke"
    assert out[2] == f"1 failed, 1 errors in {log} (finished)"


def test_a_run_cut_short_still_names_what_finished(log, tmp_path, capsys):
    lines = log.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:-2]) + lines[-2][:20])  # no closing record, a half-written line
    assert reportlog_failures.main(["--limit", "1", str(cut)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("FAILED test_cases.py::test_fails")
    assert out[1].endswith("(cut short)")
