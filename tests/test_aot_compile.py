"""Every Triton kernel variant the ops can launch compiles for real GPU targets and fits their
shared memory, checked ahead of time with the installed Triton, no GPU needed
(scripts/aot_compile_check.py). On CI that is the Triton vLLM's torch pins (not the H200's),
so a kernel that the next Triton cannot compile shows up here first.

sm90 in bf16 (TMA and, with MOONEP_OPS_PORTABLE=1, the portable path) and sm86 (the smallest
shared memory of the supported GPUs; sm80's configs are the same) in bf16 and fp32 (fp16 takes
bf16's configs; fp32 takes the same small configs on every GPU, so sm86 bounds its shared
memory); each target is one background subprocess job (tests/subprocess_jobs.py), and so is the
sweep of the Gluon config tables (``--table``). sm100 (Blackwell) and sm120 (consumer Blackwell)
in targeted cases: bf16 on their default paths, two of the check's problems; the FP8 kernels
(sm89+) on sm89 in another.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from moonep_ops.kernels.triton import configs

from . import subprocess_jobs

pytest.importorskip("triton")


def _failed_lines(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if "FAIL" in line or line.startswith("#"))[-4000:]


def _passed_check(args: list[str]) -> str:
    """The output of ``scripts/aot_compile_check.py ARGS`` in a subprocess, which must pass."""
    proc = subprocess.run([sys.executable, "scripts/aot_compile_check.py", *args], cwd=subprocess_jobs.ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, _failed_lines(output) or output[-4000:]
    return output


@pytest.mark.subprocess_job("aot_sm90", "aot_sm86")
def test_every_kernel_variant_compiles_for_sm90_and_sm86():
    for job in ("aot_sm90", "aot_sm86"):
        returncode, output = subprocess_jobs.result(job)
        assert returncode == 0, f"{job}:\n{_failed_lines(output) or output[-4000:]}"
        summary = re.search(r"# (\d+) variants, (\d+) failed", output)
        assert summary and summary.group(2) == "0", output[-4000:]
        assert int(summary.group(1)) >= 40, f"{job}: only {summary.group(1)} variants seen (interception broken?)"
    # The Gluon kernels keep wgmmas in flight while they scale or store: one whose wgmmas ptxas
    # serialized would wait for every MMA instead (the check reports it; here it fails)
    _, output = subprocess_jobs.result("aot_sm90")
    gluon = re.findall(r"^sm90 gluon_grouped_gemm_kernel .*$", output, re.M)
    assert any(" fp8e4nv " in line for line in gluon) and any(" bf16 " in line for line in gluon), \
        "no FP8 or no bf16 Gluon variant compiled for sm90"
    serialized = [line for line in gluon if "WGMMA SERIALIZED" in line]
    assert not serialized, "\n".join(serialized)


@pytest.mark.subprocess_job("aot_table")
def test_every_gluon_variant_the_tables_pick_compiles_for_sm90():
    """``--table``: the Gluon variants of every set of config-table picks over a sweep of model
    sizes (a layout nobody benchmarked may reach any of them) compile within sm90's shared memory,
    their wgmmas pipelined."""
    returncode, output = subprocess_jobs.result("aot_table")
    assert returncode == 0, _failed_lines(output) or output[-4000:]
    summary = re.search(r"# (\d+) variants, (\d+) failed, (\d+) with every wgmma serialized", output)
    assert summary and summary.group(2) == "0", output[-4000:]
    assert int(summary.group(1)) >= 300, f"only {summary.group(1)} variants seen (the sweep shrank?)"
    assert summary.group(3) == "0", "\n".join(line for line in output.splitlines() if "WGMMA SERIALIZED" in line)


def test_sm100_default_path_compiles_on_tcgen05():
    """sm100 takes the Triton kernels with sm90's configs and TMA path (never the sm90-only Gluon
    kernel): in bf16, on the long compute-bound problem (warp-specialized, the largest shared
    memory, where the installed Triton compiles warp specialization for sm100) and the short one
    (flattened loop, TMA stores), forward and backward, every variant compiles, fits 227 KB and its
    GEMMs use tcgen05 MMAs (the check's exit code). About 25 s of one core; the full sm100 matrix:
    ``--targets 100``."""
    args = ["--targets", "100", "--dtypes", "bf16", "--no-portable", "--problems", "0,2"]
    output = _passed_check(args)
    summary = re.search(r"# (\d+) variants, (\d+) failed", output)
    assert summary and summary.group(2) == "0", output[-4000:]
    assert int(summary.group(1)) >= 20, f"only {summary.group(1)} variants seen (interception broken?)"
    kernels = set(re.findall(r"^sm100 (\w+) bf16", output, re.M))
    gemms = {"grouped_gemm_kernel", "grouped_gemm_wgrad_kernel", "grouped_gemm_silu_mul_backward_kernel"}
    assert gemms <= kernels, kernels
    assert "gluon_grouped_gemm_kernel" not in kernels
    if configs.warp_specialization_compiles((10, 0)):
        assert re.search(r"WARP_SPEC=True .*tcgen05 [1-9]", output), output[-4000:]
    else:  # Triton 3.6: the table's next rule (tests/test_triton_configs.py)
        assert "WARP_SPEC=True" not in output


def test_sm120_takes_the_sm89_path_within_its_shared_memory():
    """Consumer Blackwell (sm120: 99 KB per block) runs the portable kernels with sm89's configs:
    on the long compute-bound problem (where sm90 takes its largest tiles) and the short one, every
    variant, FP8 included, compiles for sm120 and fits (the sm90 configs would need up to 205 KB)."""
    args = ["--targets", "120", "--dtypes", "bf16", "--no-portable", "--problems", "0,2"]
    output = _passed_check(args)
    # (the check's exit code covers the MMAs: HMMA in bf16, QMMA in FP8, as on sm89)
    variants = re.findall(r"^sm120 (\w+ \w+) .*USE_TMA=(\w+)", output, re.M)
    assert {"grouped_gemm_kernel bf16", "grouped_gemm_fp8_kernel fp8e4nv"} <= {k for k, _ in variants}, output[-4000:]
    assert all(use_tma == "False" for _, use_tma in variants), output[-4000:]


def test_fp8_kernels_compile_for_sm89_with_e4m3_mmas():
    """The FP8 ops' smallest target, sm89 (99 KiB of shared memory per block, mma.sync on e4m3:
    QMMA), on both config branches (128-row tiles; 64-row tiles where segments average under 16
    rows); sm90 (QGMMA) and sm100 (tcgen05) compile them in the jobs above."""
    args = ["--targets", "89", "--dtypes", "bf16", "--problems", "2,3"]
    output = _passed_check(args)
    fp8 = re.findall(r"^sm89 grouped_gemm_fp8_kernel fp8e4nv .*BLOCK_M=(\d+).* qmma (\d+)", output, re.M)
    assert {block_m for block_m, _ in fp8} == {"64", "128"}, output[-4000:]
    assert all(int(qmma) > 0 for _, qmma in fp8)
    assert re.search(r"^sm89 quantize_rows_kernel bf16", output, re.M)


@pytest.mark.subprocess_job("aot_selftest")
def test_the_check_flags_an_oversized_config_and_a_missing_tensor_core_path():
    returncode, output = subprocess_jobs.result("aot_selftest")
    assert returncode == 0, output[-4000:]


def test_aot_dump_shows_the_sm90_main_loop(tmp_path, capsys, switches):
    """scripts/aot_dump.py (a development tool) compiles the variant a problem takes and reports
    its wgmma pipeline: the fused gate/up kernel issues async wgmma for both products (the Triton
    kernel with ``MOONEP_OPS_GLUON=0``, else the Gluon one)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "aot_dump.py"
    spec = importlib.util.spec_from_file_location("aot_dump", path)
    aot_dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot_dump)
    args = ["--op", "fused", "--rows", "512", "--k", "256", "--n", "128", "--groups", "4"]
    from moonep_ops.kernels.cuda import paths

    if paths.gluon_host() is not None:
        assert aot_dump.main(args + ["--out", str(tmp_path / "gluon")]) == 0
        printed = capsys.readouterr().out
        assert "gluon_grouped_gemm_kernel sm90" in printed and "'FUSED': True" in printed, printed
        assert re.search(r"wgmma\.mma_async [1-9]", printed), printed
    switches(GLUON="0")
    assert aot_dump.main(args + ["--out", str(tmp_path / "triton")]) == 0
    printed = capsys.readouterr().out
    assert "'FUSED': True" in printed and "'USE_TMA': True" in printed, printed
    mma = re.search(r"wgmma\.mma_async (\d+), commit_group (\d+)", printed)
    assert mma and int(mma.group(1)) > 0 and int(mma.group(2)) >= 2, printed
    ptx = list((tmp_path / "triton").glob("*_grouped_gemm_kernel_sm90.ptx"))
    assert ptx and "wgmma.mma_async" in ptx[0].read_text()


def _check_module():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    try:
        import aot_compile_check
    finally:
        sys.path.pop(0)
    return aot_compile_check


def test_the_table_sweep_reaches_every_config_the_benchmarks_pick():
    """``--table`` compiles the Gluon configs its sweep of model sizes picks; every config that the
    benchmark's shapes and the layout sweep's lists (the tuned one and the held-out one) pick is
    among them, so a table branch those reach and the sweep does not fails here."""
    from benchmarks.shapes import SHAPES
    from benchmarks.sweep import DEFAULT_CASES
    from benchmarks.sweep_cases import sweep_cases

    aot = _check_module()

    def picks(rows, h, i, g):
        return {pick for pick in aot.table_picks(rows, h, i, g) if pick[2] is not None}

    problems = aot.table_problems()
    assert problems
    swept = set().union(*(picks(*problem) for problem in problems))
    cases = sweep_cases(DEFAULT_CASES) + sweep_cases(DEFAULT_CASES, seed=1)  # (held out: --case-seed 1)
    benchmarked = [(s.nvs(p), s.hidden, s.inter, s.num_groups) for s in SHAPES for p in (128, 1)]
    benchmarked += [(c.shape().nvs(c.token_padding), c.hidden, c.inter, c.groups) for c in cases]
    missed = {(name, fused, cfg, problem) for problem in benchmarked
              for name, fused, cfg in picks(*problem) - swept}
    assert not missed, sorted(missed, key=str)[:5]


def test_the_sparse_arena_hands_out_disjoint_storage_past_the_machines_memory():
    """``--table``'s tensors: real CPU storages, contiguous, 1 KiB-aligned and disjoint, even where
    each passes the memory a plain allocation could get (nothing touches them)."""
    aot = _check_module()
    with aot.sparse_arena():
        tensors = [aot._empty(1000, 4096, 4096, dtype=torch.bfloat16) for _ in range(3)]  # 34 GB each
        tensors.append(aot._empty(7, 3, dtype=torch.float32))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(t.is_contiguous() and t.data_ptr() % 1024 == 0 for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert aot._ALLOCATE is torch.empty  # (restored when the arena closes)


@pytest.mark.parametrize("argv, message", [
    (["--targets", "90,91"], "--targets: 91 not among 80, 86, 89, 90, 100, 103, 120"),
    (["--dtypes", "int8"], "--dtypes: int8 not among bf16, fp16, fp32"),
    (["--problems", "0,99"], "--problems: 99 not among 0, 1, 2, 3, 4"),
])
def test_the_check_refuses_unknown_targets_dtypes_and_problems(argv, message, capsys):
    """Before compiling anything (an unknown target aborted inside LLVM)."""
    aot_compile_check = _check_module()
    with pytest.raises(SystemExit) as info:
        aot_compile_check.main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"error: {message}")
