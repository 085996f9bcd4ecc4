"""The README's performance table, written from the benchmark's JSON (``benchmarks.run --out``).

Renders, for the rows of one segment padding (default 128, the README protocol): a line naming
the GPU, the torch and triton versions, the date and the timing protocol of the run; a markdown
table (shape, NvS, rows in segments, floor µs, vLLM 0.33 µs (eff), moonep µs (eff), speedup);
and the geometric-mean speedup of ``moonep`` over ``vllm``. It replaces the lines between
``<!-- perf-table:begin -->`` and ``<!-- perf-table:end -->`` in the README and nothing else,
so the figures there are never typed by hand. No GPU and no torch needed.

    python -m benchmarks.report [--results benchmarks/results/bench_h200.json] [--readme README.md]
    python -m benchmarks.report --check    # exit 1 if the README's table is not what the JSON gives
    python -m benchmarks.report --stdout   # print the table only (scripts/gpu_check.sh's bench step)

Exits 1, printing the table, if the README has no such pair of markers.
"""

import argparse
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEGIN = "<!-- perf-table:begin -->"
END = "<!-- perf-table:end -->"
BASE, OURS = "vllm", "moonep"  # the paths of benchmarks/paths.py the table compares


def _cell(path: dict) -> str:
    return f"{path['us']:.0f} ({path['eff']:.2f})" if "us" in path else "error"


def render(result: dict, padding: int = 128) -> str:
    """The table and its two lines of context, for the rows of ``result`` with ``token_padding``."""
    rows = [r for r in result["rows"] if r["token_padding"] == padding]
    if not rows:
        raise ValueError(f"no rows with token_padding={padding} in the results")
    env = result["env"]
    settle = f", each path first replayed for {env['settle_s']:g} s" if env.get("settle_s") else ""
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'].split()[0]}; bf16; "
             f"median of {env.get('reps', '?')} CUDA-graph replays{settle}; segments padded to {padding} rows.",
             "",
             "| shape | NvS | rows in segments | floor µs | vLLM 0.33 µs (eff) | moonep µs (eff) | speedup |",
             "|---|---|---|---|---|---|---|"]
    speedups, effs = [], []
    for r in rows:
        base, ours = r.get(BASE, {}), r.get(OURS, {})
        speedup = "–"
        if "us" in base and "us" in ours:
            speedups.append(base["us"] / ours["us"])
            speedup = f"{speedups[-1]:.2f}×"
        if "us" in ours:
            effs.append(ours["eff"])
        lines.append(f"| {r['shape']} | {r['nvs']} | {r['rows']} | {r['floor_us']:.0f} | {_cell(base)} "
                     f"| {_cell(ours)} | {speedup} |")
    lines.append("")
    if speedups:
        geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
        lines.append(f"Geometric-mean speedup {geomean:.2f}× ({min(speedups):.2f}–{max(speedups):.2f}×); "
                     f"efficiency (floor / time) of moonep {min(effs):.2f}–{max(effs):.2f}.")
    else:
        lines.append("No shape ran on both paths.")
    return "\n".join(lines) + "\n"


def _region(lines: list[str]) -> tuple[int, int]:
    """Indices of the begin and end marker lines; ValueError unless each appears once, in order."""
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(f"expected one line {BEGIN!r} followed by one line {END!r} "
                         f"(found {len(begins)} and {len(ends)})")
    return begins[0], ends[0]


def replace_region(text: str, table: str) -> str:
    """``text`` with the lines between the markers replaced by ``table`` (set off by blank lines)."""
    lines = text.splitlines(keepends=True)
    begin, end = _region(lines)
    return "".join(lines[:begin + 1]) + "\n" + table + "\n" + "".join(lines[end:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "bench_h200.json"))
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--padding", type=int, default=128, help="the token_padding whose rows the table shows")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the README's table differs; write nothing")
    mode.add_argument("--stdout", action="store_true", help="print the table; leave the README alone")
    args = parser.parse_args(argv)
    table = render(json.loads(pathlib.Path(args.results).read_text()), args.padding)
    if args.stdout:
        print(table, end="")
        return 0
    readme = pathlib.Path(args.readme)
    text = readme.read_text()
    try:
        new = replace_region(text, table)
    except ValueError as exc:
        print(table, end="")
        print(f"benchmarks.report: {readme}: {exc}; add the two marker lines where the table goes "
              f"(the table is printed above)", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"benchmarks.report: the table in {readme} is not what {args.results} gives; "
                  f"run python -m benchmarks.report", file=sys.stderr)
            return 1
        return 0
    if new != text:
        readme.write_text(new)
        print(f"benchmarks.report: wrote the table of {args.results} into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
