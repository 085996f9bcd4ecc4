"""The Triton kernels' indexing logic on CPU, under ``TRITON_INTERPRET=1``.

CI has no GPU, so this is where a kernel regression shows up first. The cases live in
``interpreter_cases.py`` and run in a subprocess, because the variable must be set before
Triton is imported (its standard-library ``@jit`` helpers choose the interpreter then).
"""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interpreter_cases.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
