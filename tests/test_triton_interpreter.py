"""The Triton kernels' indexing logic on CPU, under ``TRITON_INTERPRET=1``.

CI has no GPU, so this is where a kernel regression shows up first. The cases live in
``interpreter_cases.py`` and run in a subprocess, because the variable must be set before
Triton is imported (its standard-library ``@jit`` helpers choose the interpreter then); the
subprocess runs in the background while the rest of the suite runs (tests/subprocess_jobs.py).
"""

import pytest

from . import subprocess_jobs

pytest.importorskip("triton")


@pytest.mark.subprocess_job("interpreter_forward")
def test_triton_kernels_under_interpreter():
    if reason := subprocess_jobs.unusable("interpreter_forward"):
        pytest.skip(reason)
    returncode, output = subprocess_jobs.result("interpreter_forward")
    print(output[-4000:])
    assert returncode == 0, output[-12000:]
    assert " passed" in output.strip().splitlines()[-1]
