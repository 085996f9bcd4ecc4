"""Eager host cost per call: ``torch.library.Library`` define/impl vs ``torch.library.custom_op``.

Two measurements, each path timed in the same interleaved rounds so machine load hits all alike:

1. ``moonep::grouped_gemm`` on a tiny CPU problem, and a ``custom_op`` twin that runs the very
   same CPU kernel function; the kernel function called directly is the floor.
2. The registration alone: an op whose kernel only returns a preallocated tensor, registered
   both ways, so the figure is dispatcher entry plus each API's Python wrapper layers.

Single-threaded, so OpenMP hand-offs do not drown the microseconds.

    python benchmarks/host_overhead.py [--number 2000] [--repeat 15]
"""

import argparse
import platform
import statistics
import sys
import timeit

import torch

import moonep_ops
from moonep_ops.kernels import cpu as cpu_kernels

_BENCH_NS = "moonep_bench"


def _register_twins(out: torch.Tensor):
    """The custom_op twin of grouped_gemm, and a no-op registered both ways."""
    @torch.library.custom_op(f"{_BENCH_NS}::grouped_gemm", mutates_args=(), device_types="cpu")
    def grouped_gemm(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.grouped_gemm(a, w, cu_seqlens)

    @grouped_gemm.register_fake
    def _(a, w, cu_seqlens):
        return a.new_empty((a.shape[0], w.shape[1]))

    @torch.library.custom_op(f"{_BENCH_NS}::noop_custom_op", mutates_args=(), device_types="cpu")
    def noop_custom_op(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return out

    lib = torch.library.Library(_BENCH_NS, "FRAGMENT")
    lib.define("noop_library(Tensor a, Tensor w, Tensor cu_seqlens) -> Tensor")
    lib.impl("noop_library", lambda a, w, cu_seqlens: out, "CPU")
    return grouped_gemm, noop_custom_op, lib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timing sample")
    parser.add_argument("--repeat", type=int, default=15, help="timing rounds")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    a = torch.randn(4, 8)
    w = torch.randn(2, 8, 8)
    cu = torch.tensor([1, 3], dtype=torch.int32)
    noop_out = torch.empty(4, 8)
    twin, noop_custom, lib = _register_twins(noop_out)  # noqa: F841 (lib keeps the ops alive)
    library_op = torch.ops.moonep.grouped_gemm.default
    twin_op = getattr(torch.ops, _BENCH_NS).grouped_gemm.default
    noop_lib_op = getattr(torch.ops, _BENCH_NS).noop_library.default
    noop_custom_op = getattr(torch.ops, _BENCH_NS).noop_custom_op.default

    groups = {
        "grouped_gemm, a[4, 8] w[2, 8, 8] (whole call)": {
            "kernel function called directly (floor)": lambda: cpu_kernels.grouped_gemm(a, w, cu),
            "Library: torch.ops.moonep.grouped_gemm.default": lambda: library_op(a, w, cu),
            "Library: moonep_ops.grouped_gemm (public API)": lambda: moonep_ops.grouped_gemm(a, w, cu),
            "custom_op: calling the CustomOpDef": lambda: twin(a, w, cu),
            "custom_op: torch.ops.<ns>.<op>.default": lambda: twin_op(a, w, cu),
        },
        "no-op kernel (registration overhead alone)": {
            "Library: torch.ops.<ns>.<op>.default": lambda: noop_lib_op(a, w, cu),
            "custom_op: calling the CustomOpDef": lambda: noop_custom(a, w, cu),
            "custom_op: torch.ops.<ns>.<op>.default": lambda: noop_custom_op(a, w, cu),
        },
    }
    expected = cpu_kernels.grouped_gemm(a, w, cu)
    for name, fn in groups["grouped_gemm, a[4, 8] w[2, 8, 8] (whole call)"].items():
        assert torch.equal(fn(), expected), name  # every path computes the same thing
    for name, fn in groups["no-op kernel (registration overhead alone)"].items():
        assert fn() is noop_out, name

    samples = {(g, n): [] for g, paths in groups.items() for n in paths}
    for _ in range(args.repeat):  # interleaved rounds
        for (g, n), acc in samples.items():
            acc.append(timeit.timeit(groups[g][n], number=args.number) / args.number * 1e6)

    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}, 1 thread; "
          f"us per call: median (min) of {args.repeat} rounds x {args.number} calls")
    for g, paths in groups.items():
        print(f"  {g}")
        for n in paths:
            s = samples[(g, n)]
            print(f"    {n:<52} {statistics.median(s):7.2f} ({min(s):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
