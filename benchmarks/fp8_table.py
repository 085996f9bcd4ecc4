"""The FP8 performance table of docs/fp8.md, rendered from ``benchmarks.fp8 --out``'s JSON.

:func:`render_fp8` is the text that ``python -m benchmarks.report --fp8`` writes into docs/fp8.md: a
line naming the GPU, the versions and the timing protocol of the run (what ``env`` holds of them),
one table row per JSON row in file order, and the ranges of the FP8 path's speedups and efficiency.
The FP8 path (``fp8``) runs block-major weights; ``fp8 [G, N, K]`` is the same op on the
checkpoint's row-major weights. A path that did not run shows "–". No GPU and no torch needed.
"""

from .protocol import replays_phrase

BF16, FP8, FP8_ROW_MAJOR, TORCH = "moonep_bf16", "moonep_fp8", "moonep_fp8_row_major", "torch_fp8"
HEADER = ("| shape | padding | bf16 | fp8 | fp8 [G, N, K] | torch | fp8 vs bf16 | fp8 vs torch | limit µs "
          "| fp8 vs limit |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
DASH = "–"


def _env_line(env: dict) -> str:
    """GPU, versions, date; replays and settle time: the parts of the README table's first line that ``env`` has."""
    run = [env["gpu"]] if "gpu" in env else []
    run += [f"{name} {env[name]}" for name in ("torch", "triton") if name in env]
    run += [env["date"].split()[0]] if "date" in env else []
    parts = [", ".join(run)] if run else []
    if "reps" in env:
        parts.append(replays_phrase(env))
    return "; ".join(parts) + "." if parts else ""


def _ratio(row: dict, slow: str, fast: str):
    """``slow``'s time over ``fast``'s; None where either path has no time."""
    if "us" in row.get(slow, {}) and "us" in row.get(fast, {}):
        return row[slow]["us"] / row[fast]["us"]
    return None


def _row(r: dict) -> str:
    us = [f"{r[p]['us']:.0f}" if "us" in r.get(p, {}) else DASH for p in (BF16, FP8, FP8_ROW_MAJOR, TORCH)]
    ratios = [f"{x:.2f}x" if x is not None else DASH for x in (_ratio(r, BF16, FP8), _ratio(r, TORCH, FP8))]
    limit = f"{r['limit']['us']:.0f} ({r['limit']['bound']})" if "limit" in r else DASH
    eff = f"{r[FP8]['eff_limit']:.2f}" if "eff_limit" in r.get(FP8, {}) else DASH
    return f"| {r['shape']} | {r['token_padding']} | {' | '.join(us)} | {' | '.join(ratios)} | {limit} | {eff} |"


def _span(values: list, unit: str = "") -> str:
    return f"{min(values):.2f}-{max(values):.2f}{unit}"


def _summary(rows: list) -> str:
    """Ranges of fp8 against bf16 (per padding), against torch and against the limit, over the rows that ran."""
    by_padding = {}
    for r in rows:
        if _ratio(r, BF16, FP8) is not None:
            by_padding.setdefault(r["token_padding"], []).append(_ratio(r, BF16, FP8))
    vs_torch = [x for x in (_ratio(r, TORCH, FP8) for r in rows) if x is not None]
    effs = [r[FP8]["eff_limit"] for r in rows if "eff_limit" in r.get(FP8, {})]
    parts = []
    if by_padding:
        parts.append("fp8 against bf16: " + ", ".join(f"{_span(v, 'x')} (padding {p})"
                                                       for p, v in sorted(by_padding.items())))
    if vs_torch:
        parts.append(f"against torch {_span(vs_torch, 'x')}")
    if effs:
        parts.append(f"against the limit {_span(effs)}")
    return "; ".join(parts) + "." if parts else "No shape ran on the fp8 path."


def render_fp8(result: dict) -> str:
    """The run's line, the table and the summary line, for every row of ``result``."""
    env_line = _env_line(result.get("env", {}))
    lines = [env_line, ""] if env_line else []
    lines += [HEADER] + [_row(r) for r in result["rows"]] + ["", _summary(result["rows"])]
    return "\n".join(lines) + "\n"
