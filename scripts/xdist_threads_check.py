"""Why the GPU suite's G = 1100 tests time out beside other xdist workers (fourteenth session).

The float64 references (``tests/reference.py``) run on the CPU as thousands of small torch ops
for a G = 1100 layout. Each pytest-xdist worker used to start torch with one OpenMP thread per
core, so N workers oversubscribe the cores N times, and every small op's parallel region waits
at a barrier for threads that are descheduled. This runs one G = 1100 reference in N processes
at once, with torch's default thread count and with ``cores // N`` threads (what ``conftest.py``
now gives each worker), and prints each process's time.

    python scripts/xdist_threads_check.py [--procs 6]

One run on the 2-core CPU machine (torch 2.13.0, otherwise idle), 2026-12-01: alone 0.44 s with the
default 2 threads, 0.55 s with 1; six at once, 11.3-16.2 s each with 2 threads, 1.6-2.3 s each with 1.
(On a busy machine all of these grow.)
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def one(threads: int) -> float:
    import torch

    sys.path.insert(0, ROOT)
    from tests.reference import grouped_gemm_silu_mul_ref

    if threads:
        torch.set_num_threads(threads)
    g = 1100
    cu = torch.tensor([(i % 3) * 16 for i in range(g)]).cumsum(0).to(torch.int32)
    rows = g * 16 + 5
    x = torch.randn(rows, 256).bfloat16()
    w = torch.randn(g, 128, 256).bfloat16()
    start = time.perf_counter()
    grouped_gemm_silu_mul_ref(x, w, w, torch.rand(rows), cu)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=6)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(f"{one(args.child):.2f}")
        return
    share = max(1, len(os.sched_getaffinity(0)) // args.procs)  # as conftest.py counts cores
    for label, threads in (("default threads", 0), (f"{share} thread(s) each", share)):
        alone = subprocess.run([sys.executable, __file__, "--child", str(threads)], capture_output=True, text=True,
                               check=True).stdout.strip()
        procs = [subprocess.Popen([sys.executable, __file__, "--child", str(threads)], stdout=subprocess.PIPE,
                                  text=True) for _ in range(args.procs)]
        times = sorted(float(p.communicate()[0].strip()) for p in procs)
        print(f"{label:>20}: alone {alone} s; {args.procs} at once: " + ", ".join(f"{t:.1f}" for t in times) + " s")


if __name__ == "__main__":
    main()
