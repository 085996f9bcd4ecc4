"""One benchmark shape's expert call, run a few times for a kernel profiler to attach to.

Nothing is timed here: Nsight Compute replays each kernel it profiles, so the figures come from it.
On the H200 the board's clocks must stay unlocked to match the benchmarks (``--clock-control none``).
For example, the speed-of-light of kimi-k2 prefill's two FP8 GEMMs (the first call's kernels are
skipped: they include compilation):

    ncu --clock-control none -k regex:gluon --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        python -m benchmarks.profile --shape 2 --path fp8

Where a kernel's warps wait, per machine instruction (warp-stall samples): record a report, then
print its source page as CSV (a row per instruction: its warp-stall samples, in all and per reason)::

    ncu --clock-control none -k regex:gluon --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        --section SourceCounters -o report python -m benchmarks.profile --shape 4 --padding 1 --path fp8 --calls 2
    ncu -i report.ncu-rep --page source --csv --print-source sass > report.csv

``--path bf16`` runs the bf16 experts op; ``--calls`` sets how many calls run (default 3). FP8
weights are block-major, as the FP8 table's ``fp8`` column runs them (``--fp8-weights gnk``: the
checkpoint's ``[G, N, K]``).
``--case NAME`` runs a layout-sweep case instead of a benchmark shape (its name as the sweep prints
it, e.g. ``--case "qwen3-30b-a3b K8 G1000 epn996 S16 z1.5 p1 s0"``; its own padding, seed and skew).
"""

import argparse

import torch

import moonep_ops
from benchmarks.shapes import SHAPES, build_problem
from benchmarks.sweep import DEFAULT_CASES
from benchmarks.sweep_cases import sweep_cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, default=0, help="index into benchmarks.shapes.SHAPES")
    parser.add_argument("--padding", type=int, default=128, help="token padding of the layout (128 or 1)")
    parser.add_argument("--path", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--fp8-weights", choices=("block-major", "gnk"), default="block-major",
                        help="FP8 weights block-major or in the checkpoint's [G, N, K] layout")
    parser.add_argument("--case", default=None, help="a layout-sweep case by name (benchmarks.sweep_cases)")
    args = parser.parse_args(argv)
    case = sweep_case(args.case, parser) if args.case else None
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if case is None:
        shape, padding, layout = SHAPES[args.shape], args.padding, {}
    else:
        shape, padding, layout = case.shape(), case.token_padding, dict(seed=case.seed, skew=case.skew)
    x, w_gate, w_up, w_down, cu, rw, sizes = build_problem(shape, padding, **layout)
    kwargs = {}
    if args.path == "fp8":
        (w_gate, s_gate), (w_up, s_up), (w_down, s_down) = (moonep_ops.fp8.quantize_weight(w)
                                                            for w in (w_gate, w_up, w_down))
        if args.fp8_weights == "block-major":
            w_gate, w_up, w_down = (moonep_ops.fp8.to_block_major(w) for w in (w_gate, w_up, w_down))
        kwargs = dict(w_gate_scale=s_gate, w_up_scale=s_up, w_down_scale=s_down)
    out = torch.empty_like(x)
    for _ in range(args.calls):
        moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out, **kwargs)
    torch.cuda.synchronize()
    print(f"{shape.name}, padding {padding}, {args.path}: {args.calls} calls, NvS {x.shape[0]}, "
          f"rows in segments {sum(sizes)}")
    return 0


def sweep_case(name: str, parser):
    """The layout-sweep case called ``name`` (the default list, anchors included)."""
    cases = {case.name: case for case in sweep_cases(DEFAULT_CASES)}
    if name not in cases:
        parser.error(f"no layout-sweep case named {name!r} (python -m benchmarks.sweep --list names them)")
    return cases[name]


if __name__ == "__main__":
    raise SystemExit(main())
