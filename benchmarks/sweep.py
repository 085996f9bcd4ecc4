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

The JSON (``--out``, rewritten after every case, so a run cut short keeps what it measured) holds
``env``, every case and a ``summary`` (:mod:`benchmarks.sweep_summary`: worst case, spread of
efficiency, worst per bound, speedup over vLLM). One line per case is printed as it finishes.

    python -m benchmarks.sweep [--out sweep.json] [--quick] [--cases 120] [--reps 50] [--settle 0.3]
                               [--confirm 8] [--confirm-rounds 2] [--max-seconds S] [--list]
    python -m benchmarks.report --sweep --results sweep.json   # the summary into docs/performance.md
"""

import argparse
import json
import os
import statistics
import time

from .sweep_cases import CASE_SEED, sweep_cases
from .sweep_summary import render, summarize

DEFAULT_CASES = 120
PATH_NAMES = ("vllm", "moonep")  # the first is the reference the second is checked against


def run_case(case, meter, reps: int, settle_s: float) -> dict:
    """One case's record: its layout's figures, each path's timing, the limit, the efficiencies."""
    import torch

    from .paths import PATHS
    from .run import add_efficiencies, floor_us, measure_path
    from .shapes import build_problem

    shape = case.shape()
    x, wg, wu, wd, cu, rw, sizes = build_problem(shape, case.token_padding, seed=case.seed, skew=case.skew)
    floor, flops, nbytes, floor_bound = floor_us(sizes, shape)
    live = sum(sizes)
    rec = {"name": case.name, "model": case.model, "hidden": case.hidden, "inter": case.inter,
           "topk": case.topk, "experts": case.experts, "groups": case.groups, "epn": case.epn,
           "tokens": case.tokens, "skew": case.skew, "token_padding": case.token_padding, "seed": case.seed,
           "nvs": x.shape[0], "rows": live, "nonempty": sum(1 for s in sizes if s),
           "floor_us": floor, "floor_bound": floor_bound, "bytes": nbytes}
    ref = None
    for name in PATH_NAMES:
        rec[name], ref = measure_path(PATHS[name], (x, wg, wu, wd, cu, rw), live, ref, reps, settle_s)
    del x, wg, wu, wd, cu, rw, ref
    torch.cuda.empty_cache()
    rec["limit"] = meter.measure(live, case.hidden, case.inter, nbytes)
    add_efficiencies(rec, PATH_NAMES, flops, nbytes)
    return rec


def run_case_or_error(case, meter, reps: int, settle_s: float) -> dict:
    """:func:`run_case`, or ``{"name", "error"}`` when the case cannot be built or measured (out of
    memory, say): one case does not end the sweep."""
    import torch

    try:
        return run_case(case, meter, reps, settle_s)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    meter.release()
    torch.cuda.empty_cache()
    return {"name": case.name, "error": error}


def confirm_samples(case, meter, reps: int, settle_s: float, rounds: int) -> dict:
    """``rounds`` more samples of one case's ``moonep`` time and limit parts (µs lists under
    ``moonep_us``, ``gemm_us``, ``read_us``), the path and the limit in alternating order."""
    import torch

    from .paths import PATHS
    from .run import floor_us, measure_path
    from .shapes import build_problem

    shape = case.shape()
    problem = build_problem(shape, case.token_padding, seed=case.seed, skew=case.skew)
    sizes = problem[-1]
    live, nbytes = sum(sizes), floor_us(sizes, shape)[2]
    samples = {"moonep_us": [], "gemm_us": [], "read_us": []}

    def path():
        rec, _ = measure_path(PATHS["moonep"], problem[:-1], live, None, reps, settle_s)
        samples["moonep_us"].append(rec["us"])  # (a KeyError if it failed: it ran in the pass)

    def limit():
        samples["gemm_us"].append(meter.gemm_pair_us(live, case.hidden, case.inter))
        samples["read_us"].append(meter.read_us(nbytes)[0])

    for r in range(rounds):
        for step in ((path, limit) if r % 2 == 0 else (limit, path)):
            step()
    del problem
    torch.cuda.empty_cache()
    return samples


def merge_confirmation(rec: dict, samples: dict) -> None:
    """``rec``'s ``moonep`` time and limit as the medians of its pass and ``samples``
    (:func:`confirm_samples`), its efficiencies and rates recomputed; the samples kept under
    ``"confirm"``."""
    from .limit import limit_figures
    from .run import add_efficiencies

    lim = rec["limit"]
    merged = {"moonep_us": [rec["moonep"]["us"]] + samples["moonep_us"],
              "gemm_us": [lim["gemm_us"]] + samples["gemm_us"], "read_us": [lim["read_us"]] + samples["read_us"]}
    rec["confirm"] = merged
    rec["moonep"]["us"] = statistics.median(merged["moonep_us"])
    flops = 6 * rec["rows"] * rec["hidden"] * rec["inter"]  # the path's and the limit's GEMM pair
    lim.update(limit_figures(statistics.median(merged["gemm_us"]), statistics.median(merged["read_us"]), flops,
                             rec["bytes"]))
    add_efficiencies(rec, [name for name in PATH_NAMES if "us" in rec.get(name, {})], flops, rec["bytes"])


def lowest_cases(records: list, count: int) -> list:
    """The ``count`` timed records lowest against the limit, lowest first."""
    timed = [r for r in records if "eff_limit" in r.get("moonep", {})]
    return sorted(timed, key=lambda r: r["moonep"]["eff_limit"])[:count]


def case_line(i: int, rec: dict) -> str:
    """The printed line of one case."""
    if "error" in rec:
        return f"{i:3d} {rec['name']:<52} ERROR {rec['error'][:100]}"
    lim, ours, base = rec["limit"], rec["moonep"], rec["vllm"]
    head = f"{i:3d} {rec['name']:<52} rows {rec['rows']:>6} limit {lim['us']:7.0f}us {lim['bound'][0]}"
    if "us" not in ours:
        return f"{head} | moonep ERROR {ours['error'][:80]}"
    speedup = f"x{base['us'] / ours['us']:.2f}" if "us" in base else "vllm ERROR"
    return (f"{head} | moonep {ours['us']:7.0f}us lim {ours['eff_limit']:.2f} floor {ours['eff']:.2f} "
            f"{speedup} err {ours['err_vs_first']:.0e}{'' if ours['tail_zero'] else ' TAIL!=0'}"
            f"{' L2' if lim['l2_fit'] else ''}")


def write(path: str, result: dict) -> None:
    """``result`` as JSON at ``path``, replaced atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="only the anchor cases (a smoke run)")
    parser.add_argument("--cases", type=int, default=DEFAULT_CASES, help="cases in all, anchors included")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--settle", type=float, default=0.3,
                        help="seconds of back-to-back replays before each timing (paths and limit)")
    parser.add_argument("--confirm", type=int, default=8, help="the cases lowest against the limit timed again")
    parser.add_argument("--confirm-rounds", type=int, default=2, help="more samples of each such case")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no case after this many seconds (the JSON says how many ran)")
    parser.add_argument("--list", action="store_true", help="print the case list and exit (no GPU)")
    args = parser.parse_args(argv)
    cases = sweep_cases(args.cases, args.quick)
    if args.list:
        for i, case in enumerate(cases):
            print(f"{i:3d} {case.name}")
        return 0
    from .limit import LimitMeter
    from .timing import environment

    env = {**environment(), "reps": args.reps, "settle_s": args.settle, "case_seed": CASE_SEED,
           "cases_listed": len(cases), "quick": args.quick}
    print(f"# {env}", flush=True)
    meter, records, start = LimitMeter(args.reps, args.settle), [], time.perf_counter()
    for i, case in enumerate(cases):
        if args.max_seconds is not None and time.perf_counter() - start > args.max_seconds:
            print(f"# stopped after {i} of {len(cases)} cases (--max-seconds {args.max_seconds:g})")
            break
        case_start = time.perf_counter()
        records.append(run_case_or_error(case, meter, args.reps, args.settle))
        records[-1]["wall_s"] = time.perf_counter() - case_start  # build, compile, check, time
        print(f"{case_line(i, records[-1])} {records[-1]['wall_s']:.1f}s", flush=True)
        env["wall_s"] = time.perf_counter() - start
        if args.out:
            write(args.out, {"env": env, "cases": records, "summary": summarize(records)})
    listed = {case.name: (i, case) for i, case in enumerate(cases)}
    confirmed = 0
    for rec in lowest_cases(records, args.confirm if args.confirm_rounds > 0 else 0):
        index, case = listed[rec["name"]]
        try:
            samples = confirm_samples(case, meter, args.reps, args.settle, args.confirm_rounds)
        except Exception as exc:  # the pass's figures stay
            print(f"# {rec['name']}: not confirmed, {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        merge_confirmation(rec, samples)
        confirmed += 1
        print(f"confirmed {case_line(index, rec)}", flush=True)
    env.update(confirmed=confirmed, confirm_rounds=args.confirm_rounds, wall_s=time.perf_counter() - start)
    result = {"env": env, "cases": records, "summary": summarize(records)}
    if args.out:
        write(args.out, result)
    print(render(result), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
