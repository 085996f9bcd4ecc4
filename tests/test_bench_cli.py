"""The benchmarks' command lines (``benchmarks/cli.py``): a bad ``--shapes``, ``--paddings``,
``--paths`` or ``--roles`` and a machine without a GPU are usage errors (exit 2) naming the option
and what it takes, before anything is built or timed."""

import importlib
import importlib.util

import pytest
import torch

from benchmarks import cli
from benchmarks.shapes import SHAPES

# The tuners import the Triton kernels' modules (Triton comes with torch's CUDA builds).
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the tuners need Triton")


def _usage_error(capsys, tool: str, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"benchmarks.{tool}").main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("tool, argv, message", [
    ("run", ["--shapes", "99"], f"argument --shapes: takes 'all' or indices 0-{len(SHAPES) - 1} into "
                                "benchmarks.shapes.SHAPES separated by commas, got '99'"),
    ("run", ["--shapes", ""], "argument --shapes: takes 'all' or indices"),
    ("run", ["--paddings", "0"], "argument --paddings: takes positive integers separated by commas (e.g. 128,1), "
                                 "got '0'"),
    ("run", ["--paths", "moonep,cublas"], "argument --paths: unknown 'cublas'; takes names out of vllm, "
                                          "moonep_unfused, moonep separated by commas"),
    ("fp8", ["--shapes", "x"], "argument --shapes: takes 'all' or indices"),
    ("ab", ["table", "--paddings", "128,-1"], "argument --paddings: takes positive integers"),
    ("ab", ["table", "--shapes", "-1"], "argument --shapes: takes 'all' or indices"),
    pytest.param("tune", ["--roles", "fused,up"], "argument --roles: unknown 'up'; takes names out of fused, down, "
                 "fused_save", marks=TRITON),
    pytest.param("tune_backward", ["--roles", "wgrad"], "argument --roles: unknown 'wgrad'; takes names out of "
                 "dgrad_down,", marks=TRITON),
    ("train", ["--paths", "x"], "argument --paths: unknown 'x'"),
    ("profile", ["--shape", str(len(SHAPES))], f"argument --shape: takes an index 0-{len(SHAPES) - 1} into "
                                               "benchmarks.shapes.SHAPES"),
])
def test_bad_values_name_the_option(capsys, tool, argv, message):
    assert message in _usage_error(capsys, tool, argv)


@pytest.mark.parametrize("tool, argv", [("run", []), ("fp8", []), ("ab", ["table"]), ("train", []), ("profile", []),
                                        ("sweep", ["--quick"]), pytest.param("tune", [], marks=TRITON),
                                        pytest.param("tune_backward", [], marks=TRITON)])
def test_no_gpu_is_a_usage_error(monkeypatch, capsys, tool, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "error: needs a CUDA GPU" in _usage_error(capsys, tool, argv)


def test_the_types_return_what_the_tools_iterate():
    assert cli.shape_list("all") == list(SHAPES)
    assert cli.shape_list("2,0") == [SHAPES[2], SHAPES[0]]
    assert cli.shape_index("3") == 3
    assert cli.padding_list("128,1") == [128, 1]
    assert cli.names(("a", "b"))("b,a") == ["b", "a"]
