"""The README's performance table says what the committed benchmark JSON says.

The table is written by hand from ``benchmarks/results/bench_h200.json``; this test reads both
(no GPU needed) so that a re-run without a README update, or a figure typed wrong, fails CI.
"""

import json
import math
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Performance"):]
    table = section[section.index("| shape | NvS |"):]
    lines = []
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        lines.append([cell.strip() for cell in line.strip("|").split("|")])
    return lines


def _bench() -> dict:
    return json.loads((ROOT / "benchmarks/results/bench_h200.json").read_text())


def _us_eff(cell: str) -> tuple[int, float]:
    m = re.fullmatch(r"(\d+) \((\d\.\d\d)\)", cell)
    assert m, cell
    return int(m.group(1)), float(m.group(2))


def test_readme_table_matches_bench_json():
    padded = [r for r in _bench()["rows"] if r["token_padding"] == 128]
    rows = _readme_rows()
    assert len(rows) == len(padded) == 6
    for cells, r in zip(rows, padded):
        shape, nvs, live, floor, vllm, moonep, speedup = cells
        assert r["shape"].split(" S=")[0] in shape, (shape, r["shape"])
        assert (int(nvs), int(live), int(floor)) == (r["nvs"], r["rows"], round(r["floor_us"])), shape
        for cell, path in ((vllm, "vllm"), (moonep, "moonep")):
            us, eff = _us_eff(cell)
            assert us == round(r[path]["us"]) and eff == round(r[path]["eff"], 2), (shape, path, cell)
        assert speedup == f"{r['vllm']['us'] / r['moonep']['us']:.2f}×", (shape, speedup)


def test_readme_geomean_and_date_match_bench_json():
    bench = _bench()
    padded = [r for r in bench["rows"] if r["token_padding"] == 128]
    geo = math.exp(sum(math.log(r["vllm"]["us"] / r["moonep"]["us"]) for r in padded) / len(padded))
    text = (ROOT / "README.md").read_text()
    assert f"Geometric-mean speedup {geo:.2f}×" in text
    assert bench["env"]["date"] in text.split("## What is verified")[0]  # the table's run
