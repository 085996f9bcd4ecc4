"""Eager host cost per call: ``torch.library.Library`` define/impl vs ``torch.library.custom_op``.

Every path is timed in the same interleaved rounds, so machine load hits all alike, and in two
grad modes: grad enabled (training code, eager scripts; no input requires grad here) and
``torch.inference_mode()`` (how vLLM runs models), where the dispatcher skips autograd kernels.

1. Whole call: ``moonep::grouped_gemm`` as this package registers it, and a ``custom_op`` twin
   running the very same CPU kernel function, on a tiny problem; the kernel function called
   directly is the floor.
2. Registration alone: an op whose kernel only returns a preallocated tensor, registered with
   ``Library`` define/impl or ``custom_op``, each with and without ``register_autograd``.

Single-threaded, so OpenMP hand-offs do not drown the microseconds.

    python benchmarks/host_overhead.py [--number 2000] [--repeat 15]
"""

import argparse
import contextlib
import platform
import statistics
import sys
import time

import torch

import moonep_ops
from moonep_ops.kernels import cpu as cpu_kernels

NS = "moonep_bench"
SIG = "(Tensor a, Tensor w, Tensor cu_seqlens) -> Tensor"


def _backward(ctx, grad):
    return grad, None, None  # never runs here: only the registration's forward cost matters


def _register(noop_out: torch.Tensor):
    """The twins, in the ``moonep_bench`` namespace. Returns the Library (keep it alive)."""
    lib = torch.library.Library(NS, "FRAGMENT")

    @torch.library.custom_op(f"{NS}::grouped_gemm", mutates_args=(), device_types="cpu")
    def grouped_gemm(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.grouped_gemm(a, w, cu_seqlens)

    @grouped_gemm.register_fake
    def _(a, w, cu_seqlens):
        return a.new_empty((a.shape[0], w.shape[1]))

    for name, autograd in (("noop_custom_op", False), ("noop_custom_op_autograd", True)):
        @torch.library.custom_op(f"{NS}::{name}", mutates_args=(), device_types="cpu")
        def noop(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
            return noop_out

        if autograd:
            noop.register_autograd(_backward)

    for name, autograd in (("noop_library", False), ("noop_library_autograd", True)):
        lib.define(name + SIG)
        lib.impl(name, lambda a, w, cu_seqlens: noop_out, "CPU")
        if autograd:
            torch.library.register_autograd(f"{NS}::{name}", _backward, lib=lib)
    return lib


def _timed(fn, number: int, mode) -> float:
    with mode():
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - t0) / number * 1e6


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
    lib = _register(noop_out)  # noqa: F841 (keeps the twins registered)
    bench = getattr(torch.ops, NS)

    gg = torch.ops.moonep.grouped_gemm.default
    has_autograd = torch._C._dispatch_has_kernel_for_dispatch_key("moonep::grouped_gemm", "Autograd")
    groups = {
        "grouped_gemm, a[4, 8] w[2, 8, 8] (whole call)": {
            "kernel function called directly (floor)": lambda: cpu_kernels.grouped_gemm(a, w, cu),
            "Library: torch.ops.moonep.grouped_gemm.default"
            + (" (+ autograd)" if has_autograd else ""): lambda: gg(a, w, cu),
            "Library: moonep_ops.grouped_gemm (public API)": lambda: moonep_ops.grouped_gemm(a, w, cu),
            "custom_op twin: torch.ops.moonep_bench.grouped_gemm": lambda: bench.grouped_gemm(a, w, cu),
        },
        "no-op kernel (registration overhead alone)": {
            "Library define/impl": lambda: bench.noop_library(a, w, cu),
            "Library define/impl + register_autograd": lambda: bench.noop_library_autograd(a, w, cu),
            "custom_op": lambda: bench.noop_custom_op(a, w, cu),
            "custom_op + register_autograd": lambda: bench.noop_custom_op_autograd(a, w, cu),
        },
    }
    expected = cpu_kernels.grouped_gemm(a, w, cu)
    for g, paths in groups.items():
        for name, fn in paths.items():
            res = fn()  # every path computes the same thing
            assert (res is noop_out) if g.startswith("no-op") else torch.equal(res, expected), name

    modes = {"grad enabled": contextlib.nullcontext, "inference_mode": torch.inference_mode}
    samples = {(g, n, m): [] for g, paths in groups.items() for n in paths for m in modes}
    for _ in range(args.repeat):  # interleaved rounds
        for (g, n, m), acc in samples.items():
            acc.append(_timed(groups[g][n], args.number, modes[m]))

    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}, 1 thread; us per call, "
          f"median (min) of {args.repeat} rounds x {args.number} calls")
    header = "".join(f"{m:>20}" for m in modes)
    for g, paths in groups.items():
        print(f"  {g:<58}{header}")
        for n in paths:
            cells = "".join(
                f"{statistics.median(s):>12.2f} ({min(s):5.2f})"
                for s in (samples[(g, n, m)] for m in modes))
            print(f"    {n:<56}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
