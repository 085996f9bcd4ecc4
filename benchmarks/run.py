"""Expert-path benchmark on one GPU: every path of ``paths.py`` on every shape of ``shapes.py``.

What the README's performance table reports (``python -m benchmarks.report`` writes that table
from this script's JSON). For each shape and each segment padding, every path runs once (its
output compared with the first path's on the live rows, its tail rows checked for zeros), then
is timed: median of ``--reps`` CUDA-graph replays after warm-up (:mod:`benchmarks.timing`).
Floor = max(FLOPs / 757 TFLOP/s, bytes / 4.2 TB/s), the H200 ceilings of shared/BASELINE.md;
efficiency = floor / time. Limit = this GPU's sustained time for the same FLOPs and bytes, measured
in the same run under the same protocol (:mod:`benchmarks.limit`: a dense cuBLAS GEMM pair, a
read-only reduction); efficiency against it (``eff_limit``) = limit / time. The run also measures
and records this GPU's own ceilings (a dense bf16 matmul and a 4 GiB copy) and each path's eager
host cost per call on a tiny problem.

``--settle SECONDS`` (default 1, the README protocol) replays each path, and each part of the
limit, back to back for that long before its timed replays: under the H200's 700 W cap the heavy
paths lower the SM clock, and without settling a figure depends on what ran before it.

    python -m benchmarks.run [--out results.json] [--reps 50] [--paths vllm,moonep] [--paddings 128,1]
                             [--shapes 0,3] [--settle 0]
    python -m benchmarks.plot results.json chart.png
"""

import argparse
import json
import statistics
import time

import torch

from . import cli
from .limit import LimitMeter
from .paths import PATHS
from .shapes import build_problem
from .timing import environment, median_replay_ms


def measure_ceilings() -> dict:
    """This GPU's dense bf16 matmul rate (8192^3, TFLOP/s) and copy rate (4 GiB, TB/s read + written)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_replay_ms(lambda: torch.mm(a, b), 20)
    tflops = 2 * n ** 3 / ms / 1e9
    src = torch.randn(2 ** 30, device="cuda")  # 4 GiB, far past L2
    dst = torch.empty_like(src)
    ms = median_replay_ms(lambda: dst.copy_(src), 20)
    tbps = 2 * src.numel() * src.element_size() / ms / 1e9
    del a, b, src, dst
    return {"matmul_tflops": tflops, "copy_tbps": tbps}


def host_costs_interleaved(paths: dict, rounds: int = 7, reps: int = 200) -> dict:
    """Eager host time per call of every path, in both grad modes, measured in interleaved rounds
    (each round times every path once, in a rotated order) so that host load or clock drift hits
    all paths alike; the median over rounds. Keys: ``name`` (inference mode) and ``name (grad mode)``."""
    args = tiny_problem()
    variants = [(name, fn, inference) for inference in (True, False) for name, fn in paths.items()]
    for _, fn, inference in variants:  # warm-up: first-call compiles and plan caches
        with torch.inference_mode(inference):
            for _ in range(20):
                fn(*args)
    torch.cuda.synchronize()
    samples = {i: [] for i in range(len(variants))}
    for r in range(rounds):
        for i in [(r + j) % len(variants) for j in range(len(variants))]:
            _, fn, inference = variants[i]
            with torch.inference_mode(inference):
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(*args)
                samples[i].append((time.perf_counter() - t0) / reps * 1e6)
            torch.cuda.synchronize()
    return {(name if inference else f"{name} (grad mode)"): statistics.median(samples[i])
            for i, (name, _, inference) in enumerate(variants)}


def tiny_problem() -> tuple:
    """Arguments of a path on a problem small enough that its GPU time is negligible."""
    g, h, i, nvs = 4, 128, 128, 256
    x = torch.randn(nvs, h, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(g, i, h, device="cuda", dtype=torch.bfloat16)
    wu = torch.randn(g, i, h, device="cuda", dtype=torch.bfloat16)
    wd = torch.randn(g, h, i, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([64, 128, 192, 256], dtype=torch.int32, device="cuda")
    rw = torch.rand(nvs, device="cuda")
    out = torch.empty(nvs, h, device="cuda", dtype=torch.bfloat16)
    return x, wg, wu, wd, cu, rw, out


# The ceilings shared/BASELINE.md's floors use (measured there on the same kind of H200):
# efficiencies stay comparable with its table. Each run also measures and records its own.
BASELINE_CEILINGS = {"matmul_tflops": 757.0, "copy_tbps": 4.2}


def floor_us(sizes, shape, ceilings=BASELINE_CEILINGS) -> tuple[float, float, float, str]:
    """``(floor µs, FLOPs, bytes, "compute" or "memory")`` of the expert path on segments of ``sizes``:
    three GEMMs over the live rows; each non-empty group's three weights read once, ``x`` read and
    ``out`` written for the live rows, one route weight per row."""
    rows = sum(sizes)
    nonempty = sum(1 for s in sizes if s)
    flops = 2 * rows * shape.hidden * shape.inter * 3
    nvs_rows = rows  # x read and out written for the live rows; the tail costs nothing
    nbytes = (nonempty * 3 * shape.hidden * shape.inter * 2 + 2 * nvs_rows * shape.hidden * 2 + nvs_rows * 4)
    t_flop = flops / (ceilings["matmul_tflops"] * 1e12) * 1e6
    t_byte = nbytes / (ceilings["copy_tbps"] * 1e12) * 1e6
    return max(t_flop, t_byte), flops, nbytes, "compute" if t_flop > t_byte else "memory"


def measure_path(fn, problem: tuple, live: int, ref, reps: int, settle_s: float) -> tuple[dict, object]:
    """Runs one path once, checks it, then times it. Returns its record (``us``, ``err_vs_first``:
    relative error on the live rows against ``ref``, ``tail_zero``; or ``error``) and the reference
    for the next path (this path's live rows when ``ref`` is None). A path that cannot run a
    problem is reported, not fatal."""
    x, hidden = problem[0], problem[1].shape[2]
    out = torch.full((x.shape[0], hidden), float("nan"), device=x.device, dtype=x.dtype)
    try:
        fn(*problem, out)
        torch.cuda.synchronize()
        if ref is None:
            ref, err = out[:live].float(), 0.0
        else:
            err = float((out[:live].float() - ref).norm() / ref.norm())
        tail_zero = bool((out[live:] == 0).all())
        us = median_replay_ms(lambda: fn(*problem, out), reps, settle_s) * 1e3
        return {"us": us, "err_vs_first": err, "tail_zero": tail_zero}, ref
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}, ref


def add_efficiencies(row: dict, paths, flops: float, nbytes: float) -> None:
    """Adds to each timed path of ``row`` its efficiency against the floor (``eff``, where ``row``
    has a ``floor_us``) and against the measured limit (``eff_limit``), and its FLOP and byte rates."""
    for name in paths:
        r = row[name]
        if "us" in r:
            r.update(eff_limit=row["limit"]["us"] / r["us"], tflops=flops / r["us"] / 1e6, tbps=nbytes / r["us"] / 1e6)
            if "floor_us" in row:
                r["eff"] = row["floor_us"] / r["us"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--paths", type=cli.names(PATHS), default=",".join(PATHS))
    parser.add_argument("--paddings", type=cli.padding_list, default="128,1")
    parser.add_argument("--shapes", type=cli.shape_list, default="all", help="comma-separated indices into SHAPES")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds of back-to-back replays of each path before its timed ones")
    args = parser.parse_args(argv)
    cli.require_gpu(parser)
    paths = {k: PATHS[k] for k in args.paths}
    env = {**environment(), "reps": args.reps, "settle_s": args.settle}
    ceilings = measure_ceilings()
    print(f"# {env}  ceilings: {ceilings['matmul_tflops']:.0f} TFLOP/s, {ceilings['copy_tbps']:.2f} TB/s")
    host = host_costs_interleaved(paths)
    print("# eager host cost per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
    meter = LimitMeter(args.reps, args.settle)
    rows = []
    for padding in args.paddings:
        for shape in args.shapes:
            x, wg, wu, wd, cu, rw, sizes = build_problem(shape, padding)
            floor, flops, nbytes, bound = floor_us(sizes, shape)
            live = sum(sizes)
            ref = None
            row = {"shape": shape.name, "token_padding": padding, "nvs": x.shape[0], "rows": live,
                   "nonempty": sum(1 for s in sizes if s), "floor_us": floor, "bound": bound}
            for name, fn in paths.items():
                row[name], ref = measure_path(fn, (x, wg, wu, wd, cu, rw), live, ref, args.reps, args.settle)
            del x, wg, wu, wd
            torch.cuda.empty_cache()
            row["limit"] = meter.measure(live, shape.hidden, shape.inter, nbytes)
            add_efficiencies(row, paths, flops, nbytes)
            rows.append(row)
            _print_row(row, paths)
    result = {"env": env, "measured_ceilings": ceilings, "floor_ceilings": BASELINE_CEILINGS,
              "host_us": host, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _print_row(row, paths):
    lim = row["limit"]
    parts = [f"{row['shape']:<28} pad={row['token_padding']:<3} floor {row['floor_us']:7.0f}us "
             f"limit {lim['us']:7.0f}us ({lim['bound']})"]
    base = row.get("vllm", {}).get("us")
    for name in paths:
        r = row[name]
        if "error" in r:
            parts.append(f"{name}: ERROR {r['error'][:60]}")
        else:
            sp = f" x{base / r['us']:.2f}" if base else ""
            parts.append(f"{name} {r['us']:7.0f}us eff {r['eff']:.2f} lim {r['eff_limit']:.2f}{sp} "
                         f"err {r['err_vs_first']:.1e}"
                         f"{'' if r['tail_zero'] else ' TAIL!=0'}")
    print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
