"""Dump the compiled code of the forward kernel variant a problem takes, without a GPU.

Runs one CUDA op on CPU tensors with the device capability forced (as scripts/aot_compile_check.py
does), compiles the kernels it would launch (Triton, or on sm90 the Gluon one) ahead of time for
that target, writes their TTGIR and PTX to ``--out`` and prints their constexprs, shared memory,
registers and the wgmma/mma pipeline shape of the PTX (async MMA instructions, commit groups, wait
depths): a quick look at what a config change does to the main loop before spending device time on it.

    python scripts/aot_dump.py --op fused --rows 48896 --k 2048 --n 768 --groups 132   # qwen3 gate/up
    python scripts/aot_dump.py --op unfused --rows 20480 --k 2048 --n 7168 --groups 388 --arch 80
    python scripts/aot_dump.py --op unfused ... --config "128, 128, 64, 8, 3, programs_per_sm=2"  # not the table's
"""

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aot_compile_check as aot  # noqa: E402  (also puts the repo root on sys.path)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from moonep_ops.kernels.cuda import register as cuda  # noqa: E402


class KeepingCompiler(aot.Compiler):
    """Compiles like aot.Compiler but keeps the compiled kernels (in launch order)."""

    def __init__(self, target):
        super().__init__(target)
        self.kept = []

    def run(self, fn, *args, grid, warmup, **kwargs):
        source, _, options, consts = self.specialize(fn, args, kwargs)
        compiled = triton.compile(source, target=self.target, options=options.__dict__)
        self.kept.append((fn.fn.__name__, consts, options, compiled))


def _pipeline_summary(ptx: str) -> str:
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    return (f"wgmma.mma_async {len(re.findall(r'wgmma.mma_async', ptx))}, "
            f"commit_group {len(re.findall(r'wgmma.commit_group', ptx))}, wait_group depths {waits}, "
            f"mma.sync {len(re.findall(r'mma.sync.aligned', ptx))}, "
            f"cp.async.bulk.tensor loads {len(re.findall(r'cp.async.bulk.tensor.[0-9]d.shared', ptx))}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", choices=["unfused", "fused", "fused_save", "experts"], default="fused",
                        help="experts: the fused GEMM then the down GEMM (its PDL dependent on Hopper)")
    parser.add_argument("--rows", type=int, required=True, help="NvS")
    parser.add_argument("--k", type=int, required=True, help="reduction size (H for gate/up)")
    parser.add_argument("--n", type=int, required=True, help="output columns (I for gate/up)")
    parser.add_argument("--groups", type=int, required=True, help="G")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--portable", action="store_true", help="MOONEP_OPS_PORTABLE=1")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--out", default="aot_dump")
    parser.add_argument("--config", default=None,
                        help="a GemmConfig to compile instead of the table's, "
                             'e.g. "128, 64, 64, 8, 3, programs_per_sm=2"')
    args = parser.parse_args(argv)
    if args.config:
        from moonep_ops.kernels.triton import configs
        forced = eval(f"configs.GemmConfig({args.config})", {"configs": configs})
        configs.gemm_config = configs.fused_gemm_config = lambda *a, **k: forced

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    compiler = KeepingCompiler(GPUTarget("cuda", args.arch, 128 if args.arch >= 90 else 32))
    rows, k, n, g = args.rows, args.k, args.n, args.groups
    cu = torch.linspace(rows // (2 * g), rows // 2, g).to(torch.int32)  # never read: nothing runs
    x, rw = torch.empty(rows, k, dtype=dtype), torch.empty(rows, dtype=torch.float32)
    w_gate, w_up = torch.empty(g, n, k, dtype=dtype), torch.empty(g, n, k, dtype=dtype)
    with aot.forced_capability((args.arch // 10, args.arch % 10), compiler, args.portable):
        if args.op == "unfused":
            cuda.grouped_gemm(x, w_gate, cu)
        elif args.op == "fused":
            cuda.grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)
        elif args.op == "fused_save":
            cuda.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)
        else:
            cuda.experts(x, w_gate, w_up, torch.empty(g, k, n, dtype=dtype), rw, cu)
    os.makedirs(args.out, exist_ok=True)
    for i, (name, consts, options, compiled) in enumerate(compiler.kept):
        stem = os.path.join(args.out, f"{i}_{name}_sm{args.arch}")
        for ext in ("ttgir", "ptx"):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(compiled.asm[ext])
        usage = aot._resource_usage(compiled.asm.get("cubin"))
        knobs = {key: value for key, value in consts.items() if key.isupper() and not key.startswith("STRIDE")}
        print(f"{name} sm{args.arch}: num_warps {options.num_warps}, num_stages {options.num_stages}, "
              f"shared {compiled.metadata.shared} B, {usage}")
        print(f"  {knobs}")
        print(f"  {_pipeline_summary(compiled.asm['ptx'])}")
        print(f"  -> {stem}.ttgir, .ptx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
