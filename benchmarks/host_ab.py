"""Eager host cost of two source trees of ``moonep_ops``, in alternating processes.

Host timings on the GPU machine move by up to +-50% between processes, for every path alike
(docs/performance.md), so one benchmark run can rank two trees either way. Here each process
imports ``moonep_ops`` from one tree and times vLLM 0.33's composition and ``moonep_experts`` on
the benchmark's tiny problem in interleaved rounds (``benchmarks.run.host_costs_interleaved``);
the trees alternate, ``--pairs`` times. vLLM's path is the same code in every process: its figure
tells a quiet process from a noisy one.

    python -m benchmarks.host_ab --tree new=. --tree old=../old_tree [--pairs 3] [--out host_ab.jsonl]
"""

import argparse
import json
import os
import subprocess
import sys

# One process: the tree's moonep_ops first on the path, then this checkout's benchmarks package.
_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
import moonep_ops
from benchmarks.paths import PATHS
from benchmarks.run import host_costs_interleaved
costs = host_costs_interleaved({k: PATHS[k] for k in ("vllm", "moonep")}, rounds=9)
print(json.dumps({"moonep_ops": moonep_ops.__file__, **costs}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout holding moonep_ops/")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    trees = [spec.split("=", 1) for spec in args.tree]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for _ in range(args.pairs):
        for name, path in trees:
            done = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(path), here], capture_output=True,
                                  text=True, check=True)
            row = {"tree": name, **json.loads(done.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(f"{name:<6} " + "  ".join(f"{k} {v:6.1f}" for k, v in row.items() if isinstance(v, float)),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
