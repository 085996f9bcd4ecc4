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

``--kernel-times`` needs no outside profiler: it captures ``--calls`` calls in a CUDA graph, replays
it 200 times, then records a few replays with ``torch.profiler`` and prints each of a call's kernels'
median time and the median gaps between them (negative: the next kernel started before this one
ended, as a PDL dependent does, whose time then also holds its wait for the kernel before it:
``MOONEP_OPS_PDL=0`` gives each kernel's own time), in µs. The board is not settled first, so the
figures are for comparing the kernels of one call (where its time goes), not for the tables::

    python -m benchmarks.profile --shape 3 --path fp8 --kernel-times

Where one kernel's time goes inside it, probe copies tell (the package exported by ``python -m
benchmarks.ab_code --export HEAD ../probe``, then one piece of a kernel taken out): run this from a
copy's directory with it first on the path, so that its ``moonep_ops`` is the one imported::

    cd ../probe && PYTHONPATH=$PWD:$OLDPWD python -m benchmarks.profile --shape 3 --path fp8 --kernel-times
"""

import argparse
import statistics

import torch

import moonep_ops
from benchmarks import cli
from benchmarks.shapes import SHAPES, build_problem
from benchmarks.sweep_cases import case_from_name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=cli.shape_index, default=0, help="index into benchmarks.shapes.SHAPES")
    parser.add_argument("--padding", type=int, default=128, help="token padding of the layout (128 or 1)")
    parser.add_argument("--path", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--fp8-weights", choices=("block-major", "gnk"), default="block-major",
                        help="FP8 weights block-major or in the checkpoint's [G, N, K] layout")
    parser.add_argument("--case", default=None, help="a layout-sweep case by name (benchmarks.sweep_cases)")
    parser.add_argument("--kernel-times", action="store_true",
                        help="print each kernel's median time and the gaps between them (torch.profiler)")
    args = parser.parse_args(argv)
    case = sweep_case(args.case, parser) if args.case else None
    if args.kernel_times and args.calls < 2:
        parser.error("--kernel-times needs --calls 2 or more (each replay's first call is left out)")
    cli.require_gpu(parser)
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

    def call():
        moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out, **kwargs)

    print(f"{shape.name}, padding {padding}, {args.path}: {args.calls} calls, NvS {x.shape[0]}, "
          f"rows in segments {sum(sizes)}")
    if args.kernel_times:
        print_kernel_times(call, args.calls)
        return 0
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    return 0


def print_kernel_times(call, calls: int, replays: int = 5) -> None:
    """Each kernel of ``call`` in launch order: its median time and gap (:func:`kernel_times`) over
    ``replays`` graph replays of ``calls`` calls each, after 200 replays."""
    from torch.profiler import ProfilerActivity, profile

    from .timing import capture_graph

    def calls_in_a_row():
        for _ in range(calls):
            call()

    graph = capture_graph(calls_in_a_row)
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    times = kernel_times(kernels, calls, replays)
    if times is None:
        print(f"  {len(kernels)} kernels in {calls * replays} calls: not the same launches in every call")
        return
    span, rows = times
    print(f"  a call: {len(rows)} kernels over {span:.1f} µs (first start to last end)")
    for k, (name, took, gap) in enumerate(rows):
        after = "" if gap is None else f", after a gap of {gap:.1f}"
        print(f"  {k}: {took:8.1f} µs{after}  {name[:90]}")


def kernel_times(kernels, calls: int, replays: int):
    """From ``(start, end, name)`` of every kernel of ``replays`` replays of ``calls`` calls each:
    the median span of a call, and per kernel of a call its name, median time and median gap to
    the kernel before it (None for the first). The first call of each replay is left out (it
    follows the previous replay's end). None where the calls did not launch alike."""
    kernels = sorted(kernels)
    per_call, extra = divmod(len(kernels), calls * replays)
    if per_call == 0 or extra:
        return None
    samples = [kernels[c * per_call:(c + 1) * per_call] for c in range(calls * replays) if c % calls]
    if not samples:
        return None
    names = [k[2] for k in samples[0]]
    if any([k[2] for k in one] != names for one in samples):
        return None
    rows = []
    for k in range(per_call):
        took = statistics.median(one[k][1] - one[k][0] for one in samples)
        gap = statistics.median(one[k][0] - one[k - 1][1] for one in samples) if k else None
        rows.append((names[k], took, gap))
    return statistics.median(one[-1][1] - one[0][0] for one in samples), rows


def sweep_case(name: str, parser):
    """The layout-sweep case called ``name`` (of any draw's list: :func:`case_from_name`)."""
    try:
        return case_from_name(name)
    except ValueError as exc:
        parser.error(f"{exc} (python -m benchmarks.sweep --list names the cases)")


if __name__ == "__main__":
    raise SystemExit(main())
