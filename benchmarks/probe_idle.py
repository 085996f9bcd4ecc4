"""Idle upper halves (``GluonConfig.skip_idle_half``), each Gluon GEMM of the experts op alone.

A segment's last row tile whose upper 64 rows all have route weight 0 (MoonEP's padding) or lie
past the end runs its MMAs on the lower half. This probe separates what that costs from what it
saves: per GEMM and shape, interleaved CUDA-graph rounds (cool board) of
- ``off``: the skip compiled out;
- ``on``: the table's kernel (the benchmark's layout: padding rows have weight 0);
- ``on_no_idle``: the same kernel with every padding row's weight set to 1, so that no tile takes
  the half path: the cost of the checks and of the code alone;
and the same three for the fused GEMM in ping-pong 64-column tiles (the other consumer scheme).
Outputs of every variant are checked against ``off`` first.

    python -m benchmarks.probe_idle [--shapes 1,2,0] [--rounds 5] [--reps 10] [--out probe_idle.json]
"""

import argparse
import json

import torch

from moonep_ops.kernels import gluon_grouped_gemm as gg

from .probe import time_interleaved
from .probe_gluon import setup_pair
from .run import environment
from .shapes import SHAPES


def half_tiles(cu: torch.Tensor, weights: torch.Tensor, block_m: int = 128) -> tuple[int, int]:
    """(row tiles, of them with an idle upper half), as the kernels decide it."""
    ends = [0] + cu.tolist()
    w = weights.cpu()
    tiles = idle = 0
    for start, end in zip(ends[:-1], ends[1:]):
        if end <= start:
            continue
        tiles += -(-(end - start) // block_m)
        row_lo = start + (end - start - 1) // block_m * block_m
        upper = w[row_lo + block_m // 2:end]
        idle += int(bool((upper == 0).all()))
    return tiles, idle


def probe_shape(shape, args) -> dict:
    (x, wg, wu, wd, cu, rw, sizes), act, out, sms, (cf, cd), row = setup_pair(shape, 128)
    live = sum(sizes)
    busy = rw.clone()
    busy[:live] = torch.where(busy[:live] == 0, torch.ones_like(busy[:live]), busy[:live])
    row["tiles"], row["idle_tiles"] = half_tiles(cu, rw)
    print(f"  row tiles {row['tiles']}, with an idle upper half {row['idle_tiles']}", flush=True)
    pp = {**cf, "block_n": 64, "stages": 6, "pingpong": True}

    def fused(cfg, skip, weights):
        return lambda: gg.launch(x, wg, cu, act, sms, w_up=wu, route_weights=weights, zero_tail=False,
                                 **{**cfg, "skip_idle_half": skip})

    def down(skip, weights):
        return lambda: gg.launch(act, wd, cu, out, sms, idle_weights=weights, **{**cd, "skip_idle_half": skip})

    groups = {
        "fused": {"off": fused(cf, False, rw), "on": fused(cf, True, rw), "on_no_idle": fused(cf, True, busy)},
        "fused_pp64": {"off": fused(pp, False, rw), "on": fused(pp, True, rw), "on_no_idle": fused(pp, True, busy)},
        "down": {"off": down(False, rw), "on": down(True, rw), "on_no_idle": down(True, busy)},
    }
    row["timings"] = {}
    for gemm, fns in groups.items():
        dst = out if gemm == "down" else act
        if gemm == "down":  # act from the fused GEMM, as the op leaves it
            groups["fused"]["off"]()
        ref = None
        for name, fn in fns.items():
            dst[:live].fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            got = dst[:live].float()
            if ref is None:
                ref = got.clone()
            same = bool(torch.equal(got, ref))
            print(f"  {gemm:<11} {name:<11} equal to off: {same}", flush=True)
            row.setdefault("equal", {})[f"{gemm}/{name}"] = same
        timed = time_interleaved(fns, args.rounds, args.reps)
        row["timings"][gemm] = timed
        base = timed["off"]["us"]
        print("  " + gemm + ": " + "  ".join(f"{n} {t['us']:.1f} us ({t['us'] / base - 1:+.1%})"
                                             for n, t in timed.items()), flush=True)
    del x, wg, wu, wd, act, out
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1,2,0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for i in args.shapes.split(","):
        shape = SHAPES[int(i)]
        if shape.weights_on_input:
            continue  # no route weights: only the end-based skip, which padded layouts never take
        rows.append(probe_shape(shape, args))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
