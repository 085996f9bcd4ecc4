"""Every Triton kernel variant the ops can launch compiles for real GPU targets and fits their
shared memory, checked ahead of time with the installed Triton, no GPU needed
(scripts/aot_compile_check.py). On CI that is the Triton vLLM's torch pins (not the H200's),
so a kernel that the next Triton cannot compile shows up here first.

sm90 in bf16 (TMA and, with MOONEP_OPS_PORTABLE=1, the portable path) and sm86 (the smallest
shared memory of the supported GPUs; sm80's configs are the same) in bf16 and fp32 (fp16 takes
bf16's configs; fp32 takes the same small configs on every GPU, so sm86 bounds its shared
memory); each target is one background subprocess job (tests/subprocess_jobs.py).
"""

import re

import pytest

from . import subprocess_jobs

pytest.importorskip("triton")


def _failed_lines(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if "FAIL" in line or line.startswith("#"))[-4000:]


@pytest.mark.subprocess_job("aot_sm90", "aot_sm86")
def test_every_kernel_variant_compiles_for_sm90_and_sm86():
    for job in ("aot_sm90", "aot_sm86"):
        returncode, output = subprocess_jobs.result(job)
        assert returncode == 0, f"{job}:\n{_failed_lines(output) or output[-4000:]}"
        summary = re.search(r"# (\d+) variants, (\d+) failed", output)
        assert summary and summary.group(2) == "0", output[-4000:]
        assert int(summary.group(1)) >= 40, f"{job}: only {summary.group(1)} variants seen (interception broken?)"


@pytest.mark.subprocess_job("aot_selftest")
def test_the_check_flags_an_oversized_config():
    returncode, output = subprocess_jobs.result("aot_selftest")
    assert returncode == 0, output[-4000:]
