"""Every Triton kernel variant the ops can launch compiles for real GPU targets and fits their
shared memory, checked ahead of time with the installed Triton, no GPU needed
(scripts/aot_compile_check.py). On CI that is the Triton vLLM's torch pins (not the H200's),
so a kernel that the next Triton cannot compile shows up here first.

sm90 in bf16 (TMA and, with MOONEP_OPS_PORTABLE=1, the portable path) and sm86 (the smallest
shared memory of the supported GPUs; sm80's configs are the same) in bf16 and fp32 (fp16 takes
bf16's configs; fp32 takes the same small configs on every GPU, so sm86 bounds its shared
memory); the two targets compile in parallel subprocesses (about two minutes on CI).
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "aot_compile_check.py")


def _run(*args):
    return subprocess.Popen([sys.executable, SCRIPT, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "TRITON_INTERPRET": "0"})


def _failed_lines(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if "FAIL" in line or line.startswith("#"))[-4000:]


def test_every_kernel_variant_compiles_for_sm90_and_sm86():
    procs = {target: _run("--targets", target, "--dtypes", dtypes) for target, dtypes in (("90", "bf16"),
                                                                                        ("86", "bf16,fp32"))}
    for target, proc in procs.items():
        output, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, f"sm{target}:\n{_failed_lines(output) or output[-4000:]}"
        summary = re.search(r"# (\d+) variants, (\d+) failed", output)
        assert summary and summary.group(2) == "0", output[-4000:]
        assert int(summary.group(1)) >= 40, f"sm{target}: only {summary.group(1)} variants seen (interception broken?)"


def test_the_check_flags_an_oversized_config():
    proc = _run("--selftest")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
