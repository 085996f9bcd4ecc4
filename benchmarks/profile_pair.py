"""The experts op (fused GEMM, then the down GEMM) on BASELINE shapes, for a profiler to attach to.

Each shape: ``--warmup`` calls (first-call compiles), a device sync, then ``--calls`` calls. Run it
under Nsight Compute with ``--nvtx --nvtx-include "profile/"``: the timed calls run inside an NVTX
push/pop range named ``profile`` (``scripts/gpu_check.sh ncu`` does that), or alone to check
that it runs.

    python -m benchmarks.profile_pair [--shapes 4,1] [--warmup 2] [--calls 1]
"""

import argparse

import torch

import moonep_ops

from .shapes import SHAPES, build_problem


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4,1")
    parser.add_argument("--padding", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--calls", type=int, default=1)
    args = parser.parse_args(argv)
    for i in args.shapes.split(","):
        shape = SHAPES[int(i)]
        x, wg, wu, wd, cu, rw, sizes = build_problem(shape, args.padding)
        out = torch.empty(x.shape[0], shape.hidden, device="cuda", dtype=torch.bfloat16)
        live = sum(sizes)
        with torch.inference_mode():
            for _ in range(args.warmup):
                moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
            for _ in range(args.calls):
                moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        print(f"{shape.name}: NvS {x.shape[0]}, live rows {live}, non-empty groups {sum(1 for s in sizes if s)}",
              flush=True)
        del x, wg, wu, wd, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
