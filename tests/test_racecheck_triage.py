"""scripts/racecheck_triage.py: which compute-sanitizer racecheck reports sanitize.sh tolerates.

Only reports of the handshake's shape (Reads at the kernel's ``def`` line, Writes there or at
the line of its ``warp_specialize`` op, nothing unparsed), all counted by parseable summaries,
and with the control kernel showing the same: anything else fails. The reports are written in
racecheck's format against a small source tree made here, so that the rule is tested apart from
where the real kernels' lines happen to be.
"""

import importlib.util
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("racecheck_triage", ROOT / "scripts" / "racecheck_triage.py")
triage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(triage)

# A warp-specialized kernel the way the Gluon GEMM is written: the op inside an `if`.
KERNEL = textwrap.dedent("""\
    @gluon.jit
    def _gemm_kernel(a, PINGPONG: gl.constexpr):
        x = gl.sum(a, 0)
        if PINGPONG:
            gl.warp_specialize([
                (_consumer, (a, x)), (_producer, (a, x)),
            ], [1], [40])
        mbarrier.wait(ready.index(s), 0)
    """)
DEF, IF_WS, CALL, OURS = 2, 4, 5, 8
# The control: a call with no `if` around it is its own op line.
CONTROL = textwrap.dedent("""\
    @gluon.jit
    def _ws_control(out_ptr, n):
        value = gl.sum(n, 0)
        gl.warp_specialize([(_default, (out_ptr, value)), (_worker, (out_ptr, value))], [1], [40])
    """)
CONTROL_DEF, CONTROL_CALL = 2, 4


@pytest.fixture
def root(tmp_path):
    (tmp_path / "moonep_ops" / "kernels").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "moonep_ops" / "kernels" / "gemm.py").write_text(KERNEL)
    (tmp_path / "scripts" / "racecheck_control.py").write_text(CONTROL)
    return tmp_path


def _report(file, first, *others, kinds=("Read", "Write")):
    lines = [f"========= Error: Race reported between {kinds[0]} access at k+0x140 in /src/{file}:{first}"]
    lines += [f"=========     and {kinds[1]} access at k+0x{0x1d60 + i:x} in /src/{file}:{line} [7 hazards]"
              for i, line in enumerate(others)]
    return "\n".join(lines + ["========= "])


def _log(*reports, counted=None):
    n = len(reports) if counted is None else counted
    return "\n".join(["========= COMPUTE-SANITIZER", *reports,
                      f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)"])


CONTROL_LOG = _log(_report("racecheck_control.py", CONTROL_DEF, CONTROL_DEF, CONTROL_CALL))
HANDSHAKE = _report("gemm.py", DEF, DEF, IF_WS)


def _run(root, log, control=CONTROL_LOG):
    (root / "r.log").write_text(log)
    (root / "c.log").write_text(control)
    return triage.main([str(root / "r.log"), "--control", str(root / "c.log"), "--root", str(root)])


def test_the_handshake_lines_are_found(root):
    allowed = triage.allowed_lines(root)
    assert allowed["gemm.py"] == ({DEF}, {IF_WS})  # the `if`, not the call inside it
    assert allowed["racecheck_control.py"] == ({CONTROL_DEF}, {CONTROL_CALL})


def test_two_files_of_one_name_are_not_trusted(root):
    (root / "moonep_ops" / "gemm.py").write_text(KERNEL)
    assert "gemm.py" not in triage.allowed_lines(root)


def test_this_checkout_has_a_kernel_and_the_control_to_triage():
    allowed = triage.allowed_lines()
    assert "racecheck_control.py" in allowed
    assert len(allowed) >= 2, "no moonep_ops file calls warp_specialize: the triage would tolerate nothing"


def test_handshake_reports_pass(root, capsys):
    many = [_report("gemm.py", DEF, DEF, IF_WS), _report("gemm.py", DEF, DEF),
            _report("gemm.py", DEF, IF_WS, DEF, IF_WS)]
    assert _run(root, _log(*many)) == 0
    assert "3 report(s) in Triton's warp-specialization handshake, 0 elsewhere, 3 counted" in capsys.readouterr().out


def test_one_report_moved_to_our_code_fails(root):
    assert _run(root, _log(HANDSHAKE, _report("gemm.py", DEF, DEF, OURS))) == 1


def test_a_read_at_the_op_line_or_a_report_of_one_kind_fails(root):
    assert _run(root, _log(_report("gemm.py", IF_WS, DEF))) == 1
    assert _run(root, _log(_report("gemm.py", DEF, DEF, kinds=("Write", "Write")))) == 1
    assert _run(root, _log(_report("gemm.py", DEF, CALL))) == 1  # the call inside the `if` is not the op line


def test_an_access_line_that_does_not_parse_fails(root):
    broken = HANDSHAKE.replace(f"in /src/gemm.py:{IF_WS}", "in <unknown>", 1)
    assert _run(root, _log(broken)) == 1


def test_any_other_error_block_fails(root):
    crashed = "========= Error: process didn't terminate successfully\n=========     The application may have hit an error"
    assert _run(root, _log(HANDSHAKE, crashed, counted=1)) == 1
    assert _run(root, _log(HANDSHAKE.replace("Error:", "Warning:"))) == 0  # a warning of the same shape


def test_summaries_must_parse_and_count_every_report(root):
    assert _run(root, _log(HANDSHAKE, counted=3)) == 1
    assert _run(root, _log(HANDSHAKE).replace(" warnings)", " warnings, 2 notes)")) == 1
    assert _run(root, HANDSHAKE) == 1  # no summary at all


def test_the_control_must_show_the_handshake_and_nothing_else(root):
    assert _run(root, _log(HANDSHAKE), control=_log()) == 1
    ours = _report("racecheck_control.py", CONTROL_DEF, CONTROL_DEF + 1)
    assert _run(root, _log(HANDSHAKE), control=_log(_report("racecheck_control.py", CONTROL_DEF, CONTROL_CALL),
                                                    ours)) == 1


def test_a_clean_log_passes(root):
    assert _run(root, _log(), control=_log()) == 0
