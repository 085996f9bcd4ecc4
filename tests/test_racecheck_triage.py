"""scripts/racecheck_triage.py: which compute-sanitizer racecheck reports sanitize.sh tolerates.

Only reports whose every access is at a line of Triton's warp-specialization handshake (the
kernel's ``def`` line, its ``warp_specialize`` call or the ``if`` around it), all of them
printed, and with the control kernel showing the same: anything else fails. The logs here are
in racecheck's format (copied from the H200 run of the twelfth session), with this checkout's
line numbers found independently, by searching the source text.
"""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("racecheck_triage", ROOT / "scripts" / "racecheck_triage.py")
triage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(triage)


def _line_of(path: pathlib.Path, pattern: str) -> int:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if re.search(pattern, line):
            return number
    raise AssertionError(f"{pattern!r} not in {path}")


GEMM = ROOT / "moonep_ops" / "kernels" / "gluon_grouped_gemm.py"
CONTROL = ROOT / "scripts" / "racecheck_control.py"
DEF = _line_of(GEMM, r"^def _ws_grouped_gemm_kernel\(")
IF_WS = _line_of(GEMM, r"^    if PINGPONG:$")
CONSUMER = _line_of(GEMM, r"mbarrier\.wait\(ready\.index\(s\)")  # a line of our own code
CONTROL_DEF = _line_of(CONTROL, r"^def _ws_control\(")
CONTROL_IF = _line_of(CONTROL, r"^    if TWO_WORKERS:$")


def _report(kernel, file, first, *others):
    lines = [f"========= Error: Race reported between Read access at {kernel}+0x140 in {file}:{first}"]
    lines += [f"=========     and Write access at {kernel}+0x{0x1d60 + i:x} in {file}:{line} [7 hazards]"
              for i, line in enumerate(others)]
    return "\n".join(lines + ["========= "])


def _log(*reports, counted=None):
    n = len(reports) if counted is None else counted
    return "\n".join(["========= COMPUTE-SANITIZER", *reports,
                      f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)"])


CONTROL_LOG = _log(_report("_ws_control", "racecheck_control.py", CONTROL_DEF, CONTROL_DEF, CONTROL_IF))
HANDSHAKE = _report("_ws_grouped_gemm_kernel", "gluon_grouped_gemm.py", DEF, DEF, IF_WS)


def _run(tmp_path, log, control=CONTROL_LOG):
    (tmp_path / "r.log").write_text(log)
    (tmp_path / "c.log").write_text(control)
    return triage.main([str(tmp_path / "r.log"), "--control", str(tmp_path / "c.log")])


def test_the_handshake_lines_are_found():
    allowed = triage.allowed_lines()
    assert {DEF, IF_WS} <= allowed["gluon_grouped_gemm.py"]
    assert CONSUMER not in allowed["gluon_grouped_gemm.py"]
    assert {CONTROL_DEF, CONTROL_IF} <= allowed["racecheck_control.py"]


def test_handshake_reports_reproduced_by_the_control_pass(tmp_path, capsys):
    assert _run(tmp_path, _log(HANDSHAKE, HANDSHAKE)) == 0
    assert "2 report(s) in Triton's warp-specialization handshake, 0 elsewhere" in capsys.readouterr().out


def test_a_report_touching_our_code_fails(tmp_path):
    ours = _report("_ws_grouped_gemm_kernel", "gluon_grouped_gemm.py", DEF, CONSUMER)
    assert _run(tmp_path, _log(HANDSHAKE, ours)) == 1


def test_handshake_reports_without_the_control_showing_them_fail(tmp_path):
    assert _run(tmp_path, _log(HANDSHAKE), control=_log()) == 1


def test_reports_left_unprinted_fail(tmp_path):
    assert _run(tmp_path, _log(HANDSHAKE, counted=3)) == 1


def test_a_clean_log_passes(tmp_path):
    assert _run(tmp_path, _log(), control=_log()) == 0
