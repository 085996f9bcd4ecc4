"""scripts/racecheck_triage.py: which compute-sanitizer racecheck reports sanitize.sh tolerates.

Only reports of the handshake's shape (Reads at the kernel's ``def`` line, Writes there or at
the line of its ``warp_specialize`` op, nothing unparsed), all counted by parseable summaries,
and with the control kernel showing the same: anything else fails. The main fixture is the real
racecheck log of the H200 run of the twelfth session (``tests/data/racecheck_h200_session12.log``,
41 reports), its line numbers (those of commit be01161) mapped to this checkout's, found
independently by searching the source text.
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
CALL = _line_of(GEMM, r"^        gl\.warp_specialize\(\[$")
CONSUMER = _line_of(GEMM, r"mbarrier\.wait\(ready\.index\(s\)")  # a line of the kernel's own code
CONTROL_DEF = _line_of(CONTROL, r"^def _ws_control\(")
CONTROL_IF = _line_of(CONTROL, r"^    if TWO_WORKERS:$")

# The real log names be01161's lines: 382 (the def) and 442 (the `if PINGPONG:`).
REAL = (ROOT / "tests" / "data" / "racecheck_h200_session12.log").read_text()
REAL = REAL.replace("gluon_grouped_gemm.py:382", f"gluon_grouped_gemm.py:{DEF}").replace(
    "gluon_grouped_gemm.py:442", f"gluon_grouped_gemm.py:{IF_WS}")


def _report(file, first, *others, kinds=("Read", "Write")):
    lines = [f"========= Error: Race reported between {kinds[0]} access at k+0x140 in {file}:{first}"]
    lines += [f"=========     and {kinds[1]} access at k+0x{0x1d60 + i:x} in {file}:{line} [7 hazards]"
              for i, line in enumerate(others)]
    return "\n".join(lines + ["========= "])


def _log(*reports, counted=None):
    n = len(reports) if counted is None else counted
    return "\n".join(["========= COMPUTE-SANITIZER", *reports,
                      f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)"])


CONTROL_LOG = _log(_report("racecheck_control.py", CONTROL_DEF, CONTROL_DEF, CONTROL_IF))
HANDSHAKE = _report("gluon_grouped_gemm.py", DEF, DEF, IF_WS)


def _run(tmp_path, log, control=CONTROL_LOG):
    (tmp_path / "r.log").write_text(log)
    (tmp_path / "c.log").write_text(control)
    return triage.main([str(tmp_path / "r.log"), "--control", str(tmp_path / "c.log")])


def test_the_handshake_lines_are_found():
    allowed = triage.allowed_lines()
    assert allowed["gluon_grouped_gemm.py"] == ({DEF}, {IF_WS})  # not the call's own line, nor ours
    assert CALL not in allowed["gluon_grouped_gemm.py"][1] and CONSUMER not in allowed["gluon_grouped_gemm.py"][1]
    assert allowed["racecheck_control.py"] == ({CONTROL_DEF}, {CONTROL_IF})


def test_the_real_h200_log_is_all_handshake(tmp_path, capsys):
    assert _run(tmp_path, REAL) == 0
    assert "41 report(s) in Triton's warp-specialization handshake, 0 elsewhere, 41 counted" in capsys.readouterr().out


def test_one_real_report_moved_to_our_code_fails(tmp_path):
    moved = REAL.replace(f"+0x5b50 in gluon_grouped_gemm.py:{IF_WS}", f"+0x5b50 in gluon_grouped_gemm.py:{CONSUMER}", 1)
    assert moved != REAL
    assert _run(tmp_path, moved) == 1


def test_a_read_at_the_op_line_or_a_report_of_one_kind_fails(tmp_path):
    assert _run(tmp_path, _log(_report("gluon_grouped_gemm.py", IF_WS, DEF, kinds=("Read", "Write")))) == 1
    assert _run(tmp_path, _log(_report("gluon_grouped_gemm.py", DEF, DEF, kinds=("Write", "Write")))) == 1
    assert _run(tmp_path, _log(_report("gluon_grouped_gemm.py", DEF, CALL))) == 1


def test_an_access_line_that_does_not_parse_fails(tmp_path):
    broken = HANDSHAKE.replace(f"in gluon_grouped_gemm.py:{IF_WS}", "in <unknown>", 1)
    assert _run(tmp_path, _log(broken)) == 1


def test_any_other_error_block_fails(tmp_path):
    crashed = "========= Error: process didn't terminate successfully\n=========     The application may have hit an error"
    assert _run(tmp_path, _log(HANDSHAKE, crashed, counted=1)) == 1
    assert _run(tmp_path, _log(HANDSHAKE.replace("Error:", "Warning:"))) == 0  # a warning of the same shape


def test_summaries_must_parse_and_count_every_report(tmp_path):
    assert _run(tmp_path, _log(HANDSHAKE, counted=3)) == 1
    assert _run(tmp_path, _log(HANDSHAKE).replace(" warnings)", " warnings, 2 notes)")) == 1
    assert _run(tmp_path, HANDSHAKE) == 1  # no summary at all


def test_the_control_must_show_the_handshake_and_nothing_else(tmp_path):
    assert _run(tmp_path, _log(HANDSHAKE), control=_log()) == 1
    ours = _report("racecheck_control.py", CONTROL_DEF, CONTROL_DEF + 3)
    assert _run(tmp_path, _log(HANDSHAKE), control=_log(_report("racecheck_control.py", CONTROL_DEF, CONTROL_IF),
                                                        ours)) == 1


def test_a_clean_log_passes(tmp_path):
    assert _run(tmp_path, _log(), control=_log()) == 0
