"""Layout sweep: the ``moonep`` path against this GPU's measured limit over many MoE layouts.

The six shapes of the README's table are a few points; this runs a deterministic list of layouts
(:mod:`benchmarks.sweep_cases`: five models from H = 2048 to 7168 and I = 768 to 8192, top-1 and
top-8, G = 8 to 1000, Zipf skews 0, 0.8 and 1.5, three seeds, segments padded to 128 rows or not,
S = 16 to 8192). Per case, as in ``run.py``: the layout is built by ``shapes.build_problem``; the
``vllm`` path then the ``moonep`` path run once (moonep's output checked against vLLM's on the live
rows, its tail for zeros) and are timed; then the limit is measured (:mod:`benchmarks.limit`).
Every timing replays back to back for ``--settle`` seconds before its ``--reps`` timed replays
(:mod:`benchmarks.timing`).

Default ``--settle 0.3``, not the 1 s of ``run.py --settle 1``: each case has four settled timings
(two paths, the two parts of the limit), and at 1 s each the settling alone of the default 120
cases would take 8 minutes. With 0.3 s a case takes about 3 s (build, check, five warm-ups, settle
and 50 timed replays of each), the default list about 6 minutes on an H200. 0.3 s is at least 20
replays even of the longest cases; a figure read at 0.3 s can lie a few percent below its 1 s
steady state on the power-bound cases (the clock is still coming down), alike for the paths and the
limit, so their ratio moves less than either.

One sample per case is noisy (identical configs differ by 5-7% between runs on the H200), and the
lowest of 120 noisy figures lies low. So the pass ends by timing the ``--confirm`` cases lowest
against the limit ``--confirm-rounds`` more times, the ``moonep`` path and the limit's two parts in
alternating order; those cases' figures are then the medians of all their samples (the record keeps
the samples under ``"confirm"``).

``--fp8`` sweeps the FP8 experts op instead (:mod:`benchmarks.fp8`: e4m3 weights with 128 x 128
block scales, block-major): per case the bf16 experts op (``moonep_bf16``), then the FP8 one
(``moonep_fp8``, checked against it on the live rows: the quantization error, and its tail for
zeros), and the FP8 limit (a dense FP8 cuBLAS GEMM pair and a read of the FP8 path's bytes); its
lowest cases are confirmed the same way.

The JSON (``--out``, rewritten after every case, so a run cut short keeps what it measured) holds
``env``, every case and a ``summary`` (:mod:`benchmarks.sweep_summary`: worst case, spread of
efficiency, worst per bound, speedup over the base path). One line per case is printed as it
finishes. ``--resume`` continues the sweep in an existing ``--out`` (a run that ``--max-seconds``
cut short, on the same GPU kind): it keeps that file's cases, runs the rest of the list, and then
confirms those of the lowest cases of all (``--confirm``) that the earlier run did not confirm.
``--rerun REGEX`` (with ``--resume``) drops the kept cases whose names match the regular expression
first, so that they run again: after a change that touched only some layouts (a config rule for one
model), those are re-timed without the rest; the JSON's ``env`` and the rendered summary say which.

    python -m benchmarks.sweep [--out sweep.json] [--fp8] [--quick] [--cases 120] [--reps 50] [--settle 0.3]
                               [--confirm 8] [--confirm-rounds 2] [--max-seconds S] [--resume [--rerun REGEX]]
                               [--case-seed N] [--list]
    python -m benchmarks.report --sweep --results sweep.json   # the summary into docs/performance.md
    python -m benchmarks.report --fp8-sweep --results sweep_fp8.json   # the FP8 sweep's into docs/fp8.md
    python -m benchmarks.sweep --case-seed 1 --out sweep_heldout.json    # a held-out list of layouts
    python -m benchmarks.report --heldout-sweep --results sweep_heldout.json   # into docs/performance.md
    python -m benchmarks.sweep --fp8 --case-seed 1 --out sweep_fp8_heldout.json
    python -m benchmarks.report --fp8-heldout-sweep --results sweep_fp8_heldout.json   # into docs/fp8.md
"""

import argparse
import functools
import json
import os
import re
import statistics
import time

from . import cli
from .sweep_cases import CASE_SEED, sweep_cases
from .sweep_summary import KINDS, render, summarize

DEFAULT_CASES = 120


def path_names(kind: str) -> tuple:
    """A sweep's two paths: the reference, then the measured path checked against it."""
    return KINDS[kind].base, KINDS[kind].ours


def case_fields(case, nvs: int, sizes) -> dict:
    """The figures of one case's layout that its record starts with."""
    return {"name": case.name, "model": case.model, "hidden": case.hidden, "inter": case.inter,
            "topk": case.topk, "experts": case.experts, "groups": case.groups, "epn": case.epn,
            "tokens": case.tokens, "skew": case.skew, "token_padding": case.token_padding, "seed": case.seed,
            "nvs": nvs, "rows": sum(sizes), "nonempty": sum(1 for s in sizes if s)}


def run_case(case, meter, reps: int, settle_s: float, kind: str = "bf16") -> dict:
    """One case's record: its layout's figures, each path's timing, the limit, the efficiencies."""
    if kind == "fp8":
        return run_case_fp8(case, meter, reps, settle_s)
    import torch

    from .paths import PATHS
    from .run import add_efficiencies, floor_us, measure_path
    from .shapes import build_problem

    shape = case.shape()
    x, wg, wu, wd, cu, rw, sizes = build_problem(shape, case.token_padding, seed=case.seed, skew=case.skew)
    floor, flops, nbytes, floor_bound = floor_us(sizes, shape)
    live = sum(sizes)
    rec = {**case_fields(case, x.shape[0], sizes), "floor_us": floor, "floor_bound": floor_bound, "bytes": nbytes}
    ref = None
    for name in path_names("bf16"):
        rec[name], ref = measure_path(PATHS[name], (x, wg, wu, wd, cu, rw), live, ref, reps, settle_s)
    del x, wg, wu, wd, cu, rw, ref
    torch.cuda.empty_cache()
    rec["limit"] = meter.measure(live, case.hidden, case.inter, nbytes)
    add_efficiencies(rec, path_names("bf16"), flops, nbytes)
    return rec


def fp8_problem(case):
    """One case's FP8 problem: ``(x, weights, scales, cu, rw, sizes, bf16 weights)``, the e4m3
    weights block-major."""
    from moonep_ops import fp8

    from .shapes import build_problem

    x, wg, wu, wd, cu, rw, sizes = build_problem(case.shape(), case.token_padding, seed=case.seed, skew=case.skew)
    weights, scales = [], []
    for w in (wg, wu, wd):  # one row-major e4m3 copy at a time (the largest cases hold 64 GiB of bf16)
        q, scale = fp8.quantize_weight(w)
        weights.append(fp8.to_block_major(q))
        scales.append(scale)
        del q
    return x, tuple(weights), tuple(scales), cu, rw, sizes, (wg, wu, wd)


def run_case_fp8(case, meter, reps: int, settle_s: float) -> dict:
    """One case's record on the FP8 path (``--fp8``): the bf16 and the FP8 experts op, the FP8 limit."""
    import torch

    from . import fp8 as fp8_bench
    from .run import add_efficiencies

    x, weights, scales, cu, rw, sizes, (wg, wu, wd) = fp8_problem(case)
    shape, live = case.shape(), sum(sizes)
    nbytes = fp8_bench.fp8_bytes(sizes, shape)
    rec = {**case_fields(case, x.shape[0], sizes), "bytes": nbytes}
    out = torch.empty_like(x)
    rec["moonep_bf16"] = fp8_bench.time_path(fp8_bench.bf16_experts(x, wg, wu, wd, cu, rw, out), out, live, None,
                                             reps, settle_s)
    ref = out[:live].float().clone()
    del wg, wu, wd
    rec["moonep_fp8"] = fp8_bench.time_path(fp8_bench.fp8_experts(x, weights, scales, cu, rw, out), out, live, ref,
                                            reps, settle_s)
    del x, weights, scales, cu, rw, out, ref
    torch.cuda.empty_cache()
    rec["limit"] = fp8_bench.fp8_limit(meter, live, case.hidden, case.inter, nbytes)
    add_efficiencies(rec, path_names("fp8"), 6 * live * case.hidden * case.inter, nbytes)
    return rec


def run_case_or_error(case, meter, reps: int, settle_s: float, kind: str = "bf16") -> dict:
    """:func:`run_case`, or ``{"name", "error"}`` when the case cannot be built or measured (out of
    memory, say): one case does not end the sweep."""
    import torch

    try:
        return run_case(case, meter, reps, settle_s, kind)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    meter.release()
    torch.cuda.empty_cache()
    return {"name": case.name, "error": error}


def confirm_samples(case, meter, reps: int, settle_s: float, rounds: int, kind: str = "bf16") -> dict:
    """``rounds`` more samples of one case's measured path (``moonep``, or ``moonep_fp8`` with
    ``kind`` fp8) and limit parts (µs lists under ``<path>_us``, ``gemm_us``, ``read_us``), the path
    and the limit in alternating order."""
    import torch

    path_us, gemm_pair_us, sizes, nbytes = _confirm_timers(case, meter, kind, reps, settle_s)
    live, key = sum(sizes), f"{KINDS[kind].ours}_us"
    samples = {key: [], "gemm_us": [], "read_us": []}

    def path():
        samples[key].append(path_us())

    def limit():
        samples["gemm_us"].append(gemm_pair_us(live, case.hidden, case.inter))
        samples["read_us"].append(meter.read_us(nbytes)[0])

    for r in range(rounds):
        for step in ((path, limit) if r % 2 == 0 else (limit, path)):
            step()
    del path_us  # (its problem's tensors)
    torch.cuda.empty_cache()
    return samples


def _confirm_timers(case, meter, kind: str, reps: int, settle_s: float):
    """For one case of sweep ``kind``: a timer of its measured path (µs, settled, median of replays;
    it holds the case's problem; a path that fails raises: it ran in the pass), the limit's GEMM
    pair timer ``(rows, hidden, inter) -> µs``, the segment sizes and the path's bytes."""
    import torch

    if kind == "fp8":
        from .fp8 import fp8_bytes, fp8_experts, fp8_gemm_pair_us, time_path

        x, weights, scales, cu, rw, sizes, _ = fp8_problem(case)
        out = torch.empty_like(x)
        call = fp8_experts(x, weights, scales, cu, rw, out)
        return ((lambda: time_path(call, out, sum(sizes), None, reps, settle_s)["us"]),
                functools.partial(fp8_gemm_pair_us, meter), sizes, fp8_bytes(sizes, case.shape()))
    from .paths import PATHS
    from .run import floor_us, measure_path
    from .shapes import build_problem

    *problem, sizes = build_problem(case.shape(), case.token_padding, seed=case.seed, skew=case.skew)
    return ((lambda: measure_path(PATHS["moonep"], tuple(problem), sum(sizes), None, reps, settle_s)[0]["us"]),
            meter.gemm_pair_us, sizes, floor_us(sizes, case.shape())[2])


def merge_confirmation(rec: dict, samples: dict, kind: str = "bf16") -> None:
    """``rec``'s measured path's time and limit as the medians of its pass and ``samples``
    (:func:`confirm_samples`), its efficiencies and rates recomputed; the samples kept under
    ``"confirm"``."""
    from .limit import limit_figures
    from .run import add_efficiencies

    ours, lim = KINDS[kind].ours, rec["limit"]
    merged = {f"{ours}_us": [rec[ours]["us"]] + samples[f"{ours}_us"],
              "gemm_us": [lim["gemm_us"]] + samples["gemm_us"], "read_us": [lim["read_us"]] + samples["read_us"]}
    rec["confirm"] = merged
    rec[ours]["us"] = statistics.median(merged[f"{ours}_us"])
    flops = 6 * rec["rows"] * rec["hidden"] * rec["inter"]  # the path's and the limit's GEMM pair
    lim.update(limit_figures(statistics.median(merged["gemm_us"]), statistics.median(merged["read_us"]), flops,
                             rec["bytes"]))
    add_efficiencies(rec, [name for name in path_names(kind) if "us" in rec.get(name, {})], flops, rec["bytes"])


def lowest_cases(records: list, count: int, kind: str = "bf16") -> list:
    """The ``count`` timed records lowest against the limit, lowest first."""
    ours = KINDS[kind].ours
    timed = [r for r in records if "eff_limit" in r.get(ours, {})]
    return sorted(timed, key=lambda r: r[ours]["eff_limit"])[:count]


def case_line(i: int, rec: dict, kind: str = "bf16") -> str:
    """The printed line of one case."""
    if "error" in rec:
        return f"{i:3d} {rec['name']:<52} ERROR {rec['error'][:100]}"
    k = KINDS[kind]
    lim, ours, base = rec["limit"], rec[k.ours], rec[k.base]
    head = f"{i:3d} {rec['name']:<52} rows {rec['rows']:>6} limit {lim['us']:7.0f}us {lim['bound'][0]}"
    if "us" not in ours:
        return f"{head} | {k.ours} ERROR {ours['error'][:80]}"
    speedup = f"x{base['us'] / ours['us']:.2f}" if "us" in base else f"{k.base} ERROR"
    floor = f" floor {ours['eff']:.2f}" if "eff" in ours else ""
    return (f"{head} | {k.ours} {ours['us']:7.0f}us lim {ours['eff_limit']:.2f}{floor} "
            f"{speedup} err {ours[k.err_key]:.0e}{'' if ours['tail_zero'] else ' TAIL!=0'}"
            f"{' L2' if lim.get('l2_fit') else ''}")


def write(path: str, result: dict) -> None:
    """``result`` as JSON at ``path``, replaced atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def resumed(path: str, env: dict) -> tuple:
    """The cases and env of the earlier run of this sweep at ``path`` (``--resume``), its env counting
    one more run; none and ``env`` where there is no such file."""
    if not os.path.exists(path):
        return [], env
    with open(path) as f:
        prior = json.load(f)
    keys = ("kind", "gpu", "torch", "triton", "case_seed", "cases_listed", "quick", "reps", "settle_s")
    differ = [f"{key} {prior['env'].get(key)!r} there, {env[key]!r} here" for key in keys
              if prior["env"].get(key, "bf16" if key == "kind" else None) != env[key]]
    if differ:
        raise SystemExit(f"benchmarks.sweep: --resume: {path} holds another sweep ({'; '.join(differ)})")
    return prior["cases"], {**prior["env"], "runs": prior["env"].get("runs", 1) + 1}


def dropped(records: list, env: dict, pattern: str) -> tuple:
    """``records`` without the cases whose names match ``pattern`` (``--rerun``), and ``env``
    noting that this run re-times them (under ``"reruns"``: the run, the pattern, the count)."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise SystemExit(f"benchmarks.sweep: --rerun {pattern!r}: not a regular expression ({exc})") from None
    kept = [rec for rec in records if not regex.search(rec["name"])]
    rerun = {"run": env.get("runs", 1), "pattern": pattern, "cases": len(records) - len(kept)}
    return kept, {**env, "reruns": env.get("reruns", []) + [rerun]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fp8", action="store_true", help="the FP8 experts op against the bf16 one and the FP8 limit")
    parser.add_argument("--quick", action="store_true", help="only the anchor cases (a smoke run)")
    parser.add_argument("--cases", type=int, default=DEFAULT_CASES, help="cases in all, anchors included")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--settle", type=float, default=0.3,
                        help="seconds of back-to-back replays before each timing (paths and limit)")
    parser.add_argument("--confirm", type=int, default=8, help="the cases lowest against the limit timed again")
    parser.add_argument("--confirm-rounds", type=int, default=2, help="more samples of each such case")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no case after this many seconds (the JSON says how many ran)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the sweep in --out: keep its cases, run the rest of the list")
    parser.add_argument("--rerun", default=None, metavar="REGEX",
                        help="with --resume: run again the kept cases whose names match this regular expression")
    parser.add_argument("--case-seed", type=int, default=CASE_SEED,
                        help=f"the draw's seed (default {CASE_SEED}; another: a held-out list of layouts)")
    parser.add_argument("--list", action="store_true", help="print the case list and exit (no GPU)")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.resume and not args.out:
        parser.error("--resume needs --out (the sweep to continue)")
    if args.rerun is not None and not args.resume:
        parser.error("--rerun needs --resume (the sweep whose cases it re-times)")
    cases = sweep_cases(args.cases, args.quick, args.case_seed)
    if args.list:
        for i, case in enumerate(cases):
            print(f"{i:3d} {case.name}")
        return 0
    cli.require_gpu(parser)
    from .limit import LimitMeter
    from .timing import environment

    kind = "fp8" if args.fp8 else "bf16"
    env = {**environment(), "kind": kind, "reps": args.reps, "settle_s": args.settle, "case_seed": args.case_seed,
           "cases_listed": len(cases), "quick": args.quick}
    records = []
    if args.resume:
        records, env = resumed(args.out, env)
    if args.rerun is not None:
        records, env = dropped(records, env, args.rerun)
    print(f"# {env}", flush=True)
    meter, start, earlier_s = LimitMeter(args.reps, args.settle), time.perf_counter(), env.get("wall_s", 0.0)
    _run_cases(cases, records, env, meter, args, kind, start, earlier_s)
    _confirm_lowest(cases, records, meter, args, kind)
    env.update(confirmed=sum("confirm" in rec for rec in records), confirm_rounds=args.confirm_rounds,
               wall_s=earlier_s + time.perf_counter() - start)
    result = {"env": env, "cases": records, "summary": summarize(records, kind)}
    if args.out:
        write(args.out, result)
    print(render(result), end="")
    return 0


def _run_cases(cases, records, env, meter, args, kind: str, start: float, earlier_s: float) -> None:
    """Times the listed cases not in ``records`` yet, appending each (and rewriting ``--out``),
    until ``--max-seconds``."""
    done = {rec["name"] for rec in records}
    for i, case in enumerate(cases):
        if case.name in done:
            continue
        if args.max_seconds is not None and time.perf_counter() - start > args.max_seconds:
            print(f"# stopped after {len(records)} of {len(cases)} cases (--max-seconds {args.max_seconds:g})")
            break
        case_start = time.perf_counter()
        records.append(run_case_or_error(case, meter, args.reps, args.settle, kind))
        records[-1]["wall_s"] = time.perf_counter() - case_start  # build, compile, check, time
        print(f"{case_line(i, records[-1], kind)} {records[-1]['wall_s']:.1f}s", flush=True)
        env["wall_s"] = earlier_s + time.perf_counter() - start
        if args.out:
            write(args.out, {"env": env, "cases": records, "summary": summarize(records, kind)})


def _confirm_lowest(cases, records, meter, args, kind: str) -> None:
    """Times the ``--confirm`` cases lowest against the limit ``--confirm-rounds`` more times
    (those an earlier run confirmed keep their samples)."""
    listed = {case.name: (i, case) for i, case in enumerate(cases)}
    for rec in lowest_cases(records, args.confirm if args.confirm_rounds > 0 else 0, kind):
        if "confirm" in rec:  # (by the run that --resume continues)
            continue
        index, case = listed[rec["name"]]
        try:
            samples = confirm_samples(case, meter, args.reps, args.settle, args.confirm_rounds, kind)
        except Exception as exc:  # the pass's figures stay
            print(f"# {rec['name']}: not confirmed, {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        merge_confirmation(rec, samples, kind)
        print(f"confirmed {case_line(index, rec, kind)}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
