"""``python -m moonep_ops``'s verdicts (CPU): what :func:`verify` reports as failures, the FP8
line's check passing on the CPU kernels, and the arguments it refuses."""

import pytest
import torch

from moonep_ops.__main__ import check_fp8, main, verify


def _case():
    ref = torch.randn(6, 4, dtype=torch.float64)
    ref[4:] = 0  # rows past cu_seqlens[-1] = 4 are zeros
    return ref, ref.float()


def _failures(out, ref, dtype=torch.float32):
    failures = []
    report = verify("eager", out, ref, dtype, 4, failures)
    assert report.startswith("max abs err ") and "(limit 1e-05)" in report
    return failures


def test_a_correct_output_passes():
    ref, out = _case()
    assert _failures(out, ref) == []


def test_each_defect_is_named():
    ref, out = _case()
    wrong = out.clone()
    wrong[0] *= 2
    (failure,) = _failures(wrong, ref)
    assert failure.startswith("eager: relative error ") and failure.endswith(" > 1e-05")
    leaked = out.clone()
    leaked[5] = float("nan")
    assert _failures(leaked, ref)[0] == "eager: NaN in the output (the tail leaked)"
    assert "eager: rows past cu_seqlens[-1] are not zero" in _failures(leaked, ref)
    assert _failures(out.double(), ref)[0] == "eager: got (6, 4) torch.float64, expected (6, 4) torch.float32"


def test_fp8_line_passes_on_cpu():
    line, failures = check_fp8()
    assert failures == []
    assert line.startswith("fp8 (CPU)   experts with e4m3fn weights against their float64 semantics: max abs err ")


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["check", "--repeats", "-3"], "argument --repeats: must be at least 1, got -3"),
    (["--repeats", "x"], "argument --repeats: must be an integer, got 'x'"),
    (["--device", "cuda"], "--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False)"),
])
def test_bad_arguments_are_usage_errors(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"error: {message}")
