"""The layout sweep's summary: computed from its cases, and rendered as markdown for the docs.

:func:`summarize` is what ``sweep.py`` stores under ``"summary"`` in its JSON; :func:`render` is the
text that ``python -m benchmarks.report --sweep`` writes into docs/performance.md. Efficiency is the
``moonep`` path's against the measured limit (``eff_limit`` = limit / time) unless said otherwise;
each case's bound is the limit's larger part (compute: the GEMM pair; memory: the read).
No GPU and no torch needed.
"""

import math
import statistics

OURS, BASE = "moonep", "vllm"
ERR_LIMIT = 2e-2  # relative error against the vLLM path above which a case counts as a check failure
WORST_SHOWN = 5


def _timed(cases: list) -> list:
    return [c for c in cases if "us" in c.get(OURS, {}) and "limit" in c]


def _spread(values: list) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _brief(case: dict) -> dict:
    """What the summary says about one case."""
    return {"case": case["name"], "eff_limit": case[OURS]["eff_limit"], "eff_floor": case[OURS]["eff"],
            "bound": case["limit"]["bound"], "us": case[OURS]["us"], "limit_us": case["limit"]["us"]}


def check_failures(cases: list) -> list:
    """Names of the cases whose ``moonep`` output disagrees with vLLM's or has a non-zero tail."""
    bad = []
    for c in cases:
        ours = c.get(OURS, {})
        if "us" in ours and (ours.get("err_vs_first", 0.0) > ERR_LIMIT or not ours.get("tail_zero", True)):
            bad.append(c["name"])
    return bad


def summarize(cases: list) -> dict:
    """Worst case, spread of efficiency (against the limit and the floor), worst case per bound,
    speedup over vLLM, and the cases that failed to run or to check."""
    timed = sorted(_timed(cases), key=lambda c: c[OURS]["eff_limit"])
    summary = {"cases": len(cases), "timed": len(timed),
               "errors": [c["name"] for c in cases if c not in timed],
               "check_failures": check_failures(cases),
               "l2_fit": sum(1 for c in timed if c["limit"].get("l2_fit"))}
    if not timed:
        return summary
    summary["eff_limit"] = _spread([c[OURS]["eff_limit"] for c in timed])
    summary["eff_floor"] = _spread([c[OURS]["eff"] for c in timed])
    summary["worst"] = _brief(timed[0])
    summary["worst_by_bound"] = {}
    for bound in ("compute", "memory"):
        of_bound = [c for c in timed if c["limit"]["bound"] == bound]
        if of_bound:
            summary["worst_by_bound"][bound] = {**_brief(of_bound[0]), "cases": len(of_bound)}
    summary["lowest"] = [_brief(c) for c in timed[:WORST_SHOWN]]
    speedups = [c[BASE]["us"] / c[OURS]["us"] for c in timed if "us" in c.get(BASE, {})]
    if speedups:
        summary["speedup"] = {"geomean": math.exp(sum(map(math.log, speedups)) / len(speedups)),
                              "min": min(speedups), "max": max(speedups)}
    return summary


def _cases(names: list) -> str:
    return f"{len(names)} case{'' if len(names) == 1 else 's'}"


def _confirmed(env: dict) -> str:
    if not env.get("confirmed"):
        return ""
    rounds = env["confirm_rounds"]
    again = "once more" if rounds == 1 else f"{rounds} more times"
    return (f" The {env['confirmed']} cases lowest against the limit were timed {again}, path and limit "
            f"alternating: their figures are the medians of {rounds + 1} samples.")


def render(result: dict) -> str:
    """Markdown for docs/performance.md: the run's context, the spread, the lowest cases."""
    env, s = result["env"], result["summary"]
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'].split()[0]}; bf16; "
             f"{s['cases']} cases (case seed {env.get('case_seed', '?')}); each path and each part of the "
             f"limit replayed for {env.get('settle_s', 0):g} s, then median of {env.get('reps', '?')} "
             f"CUDA-graph replays." + _confirmed(env), ""]
    if "eff_limit" not in s:
        return "\n".join(lines + ["No case ran."]) + "\n"
    e, f = s["eff_limit"], s["eff_floor"]
    lines.append(f"moonep against the measured limit: min {e['min']:.2f}, median {e['median']:.2f}, "
                 f"max {e['max']:.2f} (against the nominal floor: {f['min']:.2f}, {f['median']:.2f}, "
                 f"{f['max']:.2f}).")
    for bound, w in s["worst_by_bound"].items():
        lines.append(f"Worst {bound}-bound case ({w['cases']} cases): {w['case']}, {w['eff_limit']:.2f}.")
    if "speedup" in s:
        sp = s["speedup"]
        lines.append(f"Speedup over vLLM 0.33: geometric mean {sp['geomean']:.2f}× "
                     f"({sp['min']:.2f}–{sp['max']:.2f}×).")
    problems = [f"{_cases(s['errors'])} without a moonep time, an error instead ({', '.join(s['errors'])})"
                if s["errors"] else "",
                f"{_cases(s['check_failures'])} failed the output check ({', '.join(s['check_failures'])})"
                if s["check_failures"] else ""]
    if any(problems):
        lines.append("; ".join(p for p in problems if p) + ".")
    lines += ["", "| lowest cases | limit µs (bound) | moonep µs | vs limit | vs floor |", "|---|---|---|---|---|"]
    for w in s["lowest"]:
        lines.append(f"| {w['case']} | {w['limit_us']:.0f} ({w['bound']}) | {w['us']:.0f} | "
                     f"{w['eff_limit']:.2f} | {w['eff_floor']:.2f} |")
    return "\n".join(lines) + "\n"
