"""The layout sweep's summary: computed from its cases, and rendered as markdown for the docs.

:func:`summarize` is what ``sweep.py`` stores under ``"summary"`` in its JSON; :func:`render` is the
text that ``python -m benchmarks.report --sweep`` (``--fp8-sweep``) writes into docs/performance.md
(docs/fp8.md). A sweep's :class:`Kind` names the path it measures and the path it compares that
with: the bf16 sweep the ``moonep`` path against vLLM's (``vllm``), the FP8 sweep the FP8 experts op
(``moonep_fp8``) against the bf16 one (``moonep_bf16``). Efficiency is the measured path's against
the measured limit (``eff_limit`` = limit / time) unless said otherwise; each case's bound is the
limit's larger part (compute: the GEMM pair; memory: the read). No GPU and no torch needed.
"""

import dataclasses
import math
import statistics

WORST_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class Kind:
    ours: str  # the measured path's key in a case's record
    base: str  # the path it is checked against and compared with
    err_key: str  # the measured path's relative error against ``base`` on the live rows
    err_limit: float  # above which a case counts as a check failure
    label: str  # the run's dtypes in the rendered summary
    versus: str  # the speedup over ``base``, as the summary says it


KINDS = {
    "bf16": Kind("moonep", "vllm", "err_vs_first", 2e-2, "bf16", "Speedup over vLLM 0.33"),
    # the FP8 path's quantization error against the bf16 path is about 0.064 on random data (docs/fp8.md)
    "fp8": Kind("moonep_fp8", "moonep_bf16", "err_vs_bf16", 0.1,
                "FP8 (e4m3 weights, block-major, 128 x 128 block scales; bf16 activations)",
                "FP8 against the bf16 experts op"),
}


def _timed(cases: list, kind: Kind) -> list:
    return [c for c in cases if "us" in c.get(kind.ours, {}) and "limit" in c]


def _spread(values: list) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _brief(case: dict, kind: Kind) -> dict:
    """What the summary says about one case (``eff_floor`` where the sweep has a nominal floor)."""
    ours = case[kind.ours]
    brief = {"case": case["name"], "eff_limit": ours["eff_limit"], "bound": case["limit"]["bound"],
             "us": ours["us"], "limit_us": case["limit"]["us"]}
    if "eff" in ours:
        brief["eff_floor"] = ours["eff"]
    return brief


def check_failures(cases: list, kind: Kind = KINDS["bf16"]) -> list:
    """Names of the cases whose measured output disagrees with the base path's (a NaN error
    included) or has a non-zero tail."""
    bad = []
    for c in cases:
        ours = c.get(kind.ours, {})
        if "us" in ours and not (ours.get(kind.err_key, 0.0) <= kind.err_limit and ours.get("tail_zero", True)):
            bad.append(c["name"])
    return bad


def summarize(cases: list, kind: str = "bf16") -> dict:
    """Worst case, spread of efficiency (against the limit, and the floor where there is one), worst
    case per bound, speedup over the base path, and the cases that failed to run or to check."""
    k = KINDS[kind]
    timed = sorted(_timed(cases, k), key=lambda c: c[k.ours]["eff_limit"])
    summary = {"cases": len(cases), "timed": len(timed),
               "errors": [c["name"] for c in cases if c not in timed],
               "check_failures": check_failures(cases, k),
               "l2_fit": sum(1 for c in timed if c["limit"].get("l2_fit"))}
    if not timed:
        return summary
    summary["eff_limit"] = _spread([c[k.ours]["eff_limit"] for c in timed])
    floors = [c[k.ours]["eff"] for c in timed if "eff" in c[k.ours]]
    if floors:
        summary["eff_floor"] = _spread(floors)
    summary["worst"] = _brief(timed[0], k)
    summary["worst_by_bound"] = {}
    for bound in ("compute", "memory"):
        of_bound = [c for c in timed if c["limit"]["bound"] == bound]
        if of_bound:
            summary["worst_by_bound"][bound] = {**_brief(of_bound[0], k), "cases": len(of_bound)}
    summary["lowest"] = [_brief(c, k) for c in timed[:WORST_SHOWN]]
    speedups = [c[k.base]["us"] / c[k.ours]["us"] for c in timed if "us" in c.get(k.base, {})]
    if speedups:
        summary["speedup"] = {"geomean": math.exp(sum(map(math.log, speedups)) / len(speedups)),
                              "min": min(speedups), "max": max(speedups)}
    return summary


def _cases(count: int) -> str:
    return f"{count} case{'' if count == 1 else 's'}"


def _confirmed(env: dict) -> str:
    if not env.get("confirmed"):
        return ""
    rounds = env["confirm_rounds"]
    again = "once more" if rounds == 1 else f"{rounds} more times"
    if env.get("runs", 1) > 1:
        return (f" Measured in {env['runs']} runs, each continuing the last; each run's cases lowest against the "
                f"limit so far were timed {again}, path and limit alternating: the {env['confirmed']} such cases' "
                f"figures are the medians of {rounds + 1} samples.")
    return (f" The {env['confirmed']} cases lowest against the limit were timed {again}, path and limit "
            f"alternating: their figures are the medians of {rounds + 1} samples.")


# A --rerun pattern longer than this is left to the JSON (its env's "reruns"): the summary names
# how many cases each run re-timed.
SHOWN_PATTERN = 80


def _reruns(env: dict) -> str:
    """Which run re-timed which kept cases (``benchmarks.sweep --rerun``)."""
    return "".join(f" Run {r['run']} re-timed the {_cases(r['cases'])} matching "
                   + (f"`{r['pattern']}`." if len(r["pattern"]) <= SHOWN_PATTERN else "a pattern kept in the JSON.")
                   for r in env.get("reruns", []))


def _case_count(env: dict, summary: dict) -> str:
    seed, listed = env.get("case_seed", "?"), env.get("cases_listed", summary["cases"])
    if listed <= summary["cases"]:
        return f"{summary['cases']} cases (case seed {seed})"
    return f"{summary['cases']} of the {listed} listed cases (case seed {seed}; the run's time limit stopped the rest)"


def render(result: dict) -> str:
    """Markdown for the docs: the run's context, the spread, the lowest cases."""
    env, s = result["env"], result["summary"]
    k = KINDS[env.get("kind", "bf16")]
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'].split()[0]}; {k.label}; "
             f"{_case_count(env, s)}; each path and each part of the "
             f"limit replayed for {env.get('settle_s', 0):g} s, then median of {env.get('reps', '?')} "
             f"CUDA-graph replays." + _confirmed(env) + _reruns(env), ""]
    if "eff_limit" not in s:
        return "\n".join(lines + ["No case ran."]) + "\n"
    e, f = s["eff_limit"], s.get("eff_floor")
    floor = f" (against the nominal floor: {f['min']:.2f}, {f['median']:.2f}, {f['max']:.2f})" if f else ""
    lines.append(f"{k.ours} against the measured limit: min {e['min']:.2f}, median {e['median']:.2f}, "
                 f"max {e['max']:.2f}{floor}.")
    for bound, w in s["worst_by_bound"].items():
        lines.append(f"Worst {bound}-bound case ({w['cases']} cases): {w['case']}, {w['eff_limit']:.2f}.")
    if "speedup" in s:
        sp = s["speedup"]
        lines.append(f"{k.versus}: geometric mean {sp['geomean']:.2f}× ({sp['min']:.2f}–{sp['max']:.2f}×).")
    problems = [f"{_cases(len(s['errors']))} without a {k.ours} time, an error instead ({', '.join(s['errors'])})"
                if s["errors"] else "",
                f"{_cases(len(s['check_failures']))} failed the output check ({', '.join(s['check_failures'])})"
                if s["check_failures"] else ""]
    if any(problems):
        lines.append("; ".join(p for p in problems if p) + ".")
    with_floor = all("eff_floor" in w for w in s["lowest"])
    head = f"| lowest cases | limit µs (bound) | {k.ours} µs | vs limit |" + (" vs floor |" if with_floor else "")
    lines += ["", head, "|---" * (5 if with_floor else 4) + "|"]
    for w in s["lowest"]:
        lines.append(f"| {w['case']} | {w['limit_us']:.0f} ({w['bound']}) | {w['us']:.0f} | {w['eff_limit']:.2f} |"
                     + (f" {w['eff_floor']:.2f} |" if with_floor else ""))
    return "\n".join(lines) + "\n"
