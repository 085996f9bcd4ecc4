"""The generated figures of the docs, written from the benchmarks' JSON: never typed by hand.

The README's performance table (default), from ``benchmarks.run --out``: for the rows of one segment
padding (default 128, the README protocol) a line naming the GPU, the torch and triton versions, the
date and the timing protocol of the run; a markdown table (shape, NvS, rows in segments, floor µs,
limit µs, vLLM 0.33 µs (eff), moonep µs (eff), moonep's efficiency against the limit, speedup); the
geometric-mean speedup of ``moonep`` over ``vllm`` and the range of moonep's efficiencies; the eager
host cost per call of both (``host_us``). Floor: the nominal one (757 TFLOP/s, 4.2 TB/s); limit:
measured in the same run (:mod:`benchmarks.limit`); a run that did not measure it shows "–" there.
It replaces the lines between ``<!-- perf-table:begin -->`` and ``<!-- perf-table:end -->`` in the
README and nothing else.

With ``--sweep``, the layout sweep's summary (``benchmarks.sweep --out``, rendered by
:mod:`benchmarks.sweep_summary`) between ``<!-- sweep-summary:begin -->`` and
``<!-- sweep-summary:end -->`` in docs/performance.md. With ``--fp8``, the FP8 table (``benchmarks.fp8
--out``, rendered by :mod:`benchmarks.fp8_table`) between ``<!-- fp8-table:begin -->`` and
``<!-- fp8-table:end -->`` in docs/fp8.md. With ``--fp8-sweep``, the FP8 layout sweep's summary
(``benchmarks.sweep --fp8 --out``) between ``<!-- fp8-sweep:begin -->`` and ``<!-- fp8-sweep:end -->``
in docs/fp8.md. With ``--heldout-sweep``, the summary of the layout sweep on a held-out list
(``benchmarks.sweep --case-seed 1 --out``) between ``<!-- heldout-sweep:begin -->`` and
``<!-- heldout-sweep:end -->`` in docs/performance.md, and with ``--fp8-heldout-sweep`` the FP8 layout
sweep's on it (``benchmarks.sweep --fp8 --case-seed 1 --out``) between ``<!-- fp8-heldout-sweep:begin -->``
and ``<!-- fp8-heldout-sweep:end -->`` in docs/fp8.md. No GPU and no torch needed.

    python -m benchmarks.report [--results benchmarks/results/bench_h200.json] [--readme README.md]
    python -m benchmarks.report --check    # exit 1 if the README's table is not what the JSON gives
    python -m benchmarks.report --stdout   # print the table only (scripts/gpu_check.sh's bench step)
    python -m benchmarks.report --sweep [--results benchmarks/results/sweep_h200.json]
                                [--readme docs/performance.md] [--check | --stdout]
    python -m benchmarks.report --heldout-sweep [--results benchmarks/results/sweep_heldout_h200.json]
                                        [--readme docs/performance.md] [--check | --stdout]
    python -m benchmarks.report --fp8 [--results benchmarks/results/fp8_h200.json]
                              [--readme docs/fp8.md] [--check | --stdout]
    python -m benchmarks.report --fp8-sweep [--results benchmarks/results/sweep_fp8_h200.json]
                                    [--readme docs/fp8.md] [--check | --stdout]
    python -m benchmarks.report --fp8-heldout-sweep [--results benchmarks/results/sweep_fp8_heldout_h200.json]
                                            [--readme docs/fp8.md] [--check | --stdout]

Exits 1, printing the text, if the file has no such pair of markers.
"""

import argparse
import json
import math
import pathlib
import sys

from . import sweep_summary
from .fp8_table import render_fp8
from .protocol import replays_phrase

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEGIN = "<!-- perf-table:begin -->"
END = "<!-- perf-table:end -->"
SWEEP_BEGIN = "<!-- sweep-summary:begin -->"
SWEEP_END = "<!-- sweep-summary:end -->"
FP8_BEGIN = "<!-- fp8-table:begin -->"
FP8_END = "<!-- fp8-table:end -->"
FP8_SWEEP_BEGIN = "<!-- fp8-sweep:begin -->"
FP8_SWEEP_END = "<!-- fp8-sweep:end -->"
HELDOUT_BEGIN = "<!-- heldout-sweep:begin -->"
HELDOUT_END = "<!-- heldout-sweep:end -->"
FP8_HELDOUT_BEGIN = "<!-- fp8-heldout-sweep:begin -->"
FP8_HELDOUT_END = "<!-- fp8-heldout-sweep:end -->"
# each mode's JSON (in benchmarks/results), file, region markers and the option that picks it
MODES = {"readme": ("bench_h200.json", "README.md", BEGIN, END, ""),
         "sweep": ("sweep_h200.json", "docs/performance.md", SWEEP_BEGIN, SWEEP_END, " --sweep"),
         "heldout_sweep": ("sweep_heldout_h200.json", "docs/performance.md", HELDOUT_BEGIN, HELDOUT_END,
                           " --heldout-sweep"),
         "fp8": ("fp8_h200.json", "docs/fp8.md", FP8_BEGIN, FP8_END, " --fp8"),
         "fp8_sweep": ("sweep_fp8_h200.json", "docs/fp8.md", FP8_SWEEP_BEGIN, FP8_SWEEP_END, " --fp8-sweep"),
         "fp8_heldout_sweep": ("sweep_fp8_heldout_h200.json", "docs/fp8.md", FP8_HELDOUT_BEGIN, FP8_HELDOUT_END,
                               " --fp8-heldout-sweep")}
BASE, OURS = "vllm", "moonep"  # the paths of benchmarks/paths.py the table compares


def _cell(path: dict) -> str:
    return f"{path['us']:.0f} ({path['eff']:.2f})" if "us" in path else "error"


def _limit_cells(row: dict, ours: dict) -> tuple[str, str]:
    """The limit µs and moonep's efficiency against it; "–" where the run did not measure one."""
    if "limit" not in row:
        return "–", "–"
    return f"{row['limit']['us']:.0f}", f"{ours['eff_limit']:.2f}" if "eff_limit" in ours else "–"


def render(result: dict, padding: int = 128) -> str:
    """The table and its two lines of context, for the rows of ``result`` with ``token_padding``."""
    rows = [r for r in result["rows"] if r["token_padding"] == padding]
    if not rows:
        raise ValueError(f"no rows with token_padding={padding} in the results")
    env = result["env"]
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'].split()[0]}; bf16; "
             f"{replays_phrase(env)}; segments padded to {padding} rows.",
             "",
             "| shape | NvS | rows in segments | floor µs | limit µs | vLLM 0.33 µs (eff) | moonep µs (eff) "
             "| moonep vs limit | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    speedups, effs, limit_effs = [], [], []
    for r in rows:
        base, ours = r.get(BASE, {}), r.get(OURS, {})
        speedup = "–"
        if "us" in base and "us" in ours:
            speedups.append(base["us"] / ours["us"])
            speedup = f"{speedups[-1]:.2f}×"
        if "us" in ours:
            effs.append(ours["eff"])
            if "eff_limit" in ours:
                limit_effs.append(ours["eff_limit"])
        limit, vs_limit = _limit_cells(r, ours)
        lines.append(f"| {r['shape']} | {r['nvs']} | {r['rows']} | {r['floor_us']:.0f} | {limit} | {_cell(base)} "
                     f"| {_cell(ours)} | {vs_limit} | {speedup} |")
    lines += ["", _summary_line(speedups, effs, limit_effs)]
    host = _host_line(result.get("host_us", {}))
    if host:
        lines += ["", host]
    return "\n".join(lines) + "\n"


def _host_line(host_us: dict) -> str:
    """Eager host cost per call (inference mode, tiny problem) of moonep against vLLM's composition."""
    if BASE not in host_us or OURS not in host_us:
        return ""
    ours, base = host_us[OURS], host_us[BASE]
    return (f"Eager host cost per call under `torch.inference_mode()` (a tiny problem, same process): moonep "
            f"{ours:.0f} µs, vLLM 0.33's composition {base:.0f} µs ({ours / base:.2f}×).")


def _summary_line(speedups: list, effs: list, limit_effs: list) -> str:
    """The geometric-mean speedup and the ranges of moonep's efficiencies."""
    if not speedups:
        return "No shape ran on both paths."
    geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
    against_limit = (f", against the measured limit {min(limit_effs):.2f}–{max(limit_effs):.2f}"
                     if limit_effs else "")
    return (f"Geometric-mean speedup {geomean:.2f}× ({min(speedups):.2f}–{max(speedups):.2f}×); "
            f"efficiency of moonep against the floor {min(effs):.2f}–{max(effs):.2f}{against_limit}.")


def _region(lines: list[str], begin: str, end: str) -> tuple[int, int]:
    """Indices of the begin and end marker lines; ValueError unless each appears once, in order."""
    begins = [i for i, line in enumerate(lines) if line.strip() == begin]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(f"expected one line {begin!r} followed by one line {end!r} "
                         f"(found {len(begins)} and {len(ends)})")
    return begins[0], ends[0]


def replace_region(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the lines between the markers replaced by ``table`` (set off by blank lines)."""
    lines = text.splitlines(keepends=True)
    first, last = _region(lines, begin, end)
    return "".join(lines[:first + 1]) + "\n" + table + "\n" + "".join(lines[last:])


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--sweep", action="store_true",
                       help="the layout sweep's summary into docs/performance.md instead of the README table")
    which.add_argument("--heldout-sweep", action="store_true",
                       help="the held-out layout sweep's summary into docs/performance.md instead of the README table")
    which.add_argument("--fp8", action="store_true", help="the FP8 table into docs/fp8.md instead of the README table")
    which.add_argument("--fp8-sweep", action="store_true",
                       help="the FP8 layout sweep's summary into docs/fp8.md instead of the README table")
    which.add_argument("--fp8-heldout-sweep", action="store_true",
                       help="the FP8 held-out layout sweep's summary into docs/fp8.md instead of the README table")
    parser.add_argument("--results", default=None,
                        help="the JSON (default benchmarks/results/bench_h200.json, sweep_h200.json, "
                             "sweep_heldout_h200.json, fp8_h200.json, sweep_fp8_h200.json or "
                             "sweep_fp8_heldout_h200.json)")
    parser.add_argument("--readme", "--doc", dest="readme", default=None,
                        help="the file to write (default README.md, docs/performance.md or docs/fp8.md)")
    parser.add_argument("--padding", type=int, default=128, help="the token_padding whose rows the table shows")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the file's text differs; write nothing")
    mode.add_argument("--stdout", action="store_true", help="print the text; leave the file alone")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    # (each mode but the README's is the option of its name: --fp8-sweep sets args.fp8_sweep)
    mode = next((name for name in MODES if name != "readme" and getattr(args, name)), "readme")
    json_name, doc, begin, end, flag = MODES[mode]
    results = pathlib.Path(args.results or ROOT / "benchmarks" / "results" / json_name)
    target = pathlib.Path(args.readme or ROOT / doc)
    if not results.is_file():
        print(f"benchmarks.report: no results at {results}", file=sys.stderr)
        return 1
    result = json.loads(results.read_text())
    if mode == "readme":
        table = render(result, args.padding)
    else:
        table = render_fp8(result) if mode == "fp8" else sweep_summary.render(result)
    if args.stdout:
        print(table, end="")
        return 0
    return _write(target, table, begin, end, results, args.check, flag)


def _write(target: pathlib.Path, table: str, begin: str, end: str, results, check: bool, flag: str) -> int:
    """Puts ``table`` between the markers of ``target`` (with ``check``: only compares); 0 or 1."""
    text = target.read_text()
    try:
        new = replace_region(text, table, begin, end)
    except ValueError as exc:
        print(table, end="")
        print(f"benchmarks.report: {target}: {exc}; add the two marker lines where the text goes "
              f"(the text is printed above)", file=sys.stderr)
        return 1
    if check:
        if new != text:
            print(f"benchmarks.report: the text in {target} is not what {results} gives; "
                  f"run python -m benchmarks.report{flag}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        target.write_text(new)
        print(f"benchmarks.report: wrote the text of {results} into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
