"""benchmarks/report.py: the README's performance table from a benchmark JSON, on CPU.

A small synthetic result (not the committed one): the table's cells, the geometric mean, the
rows of the other padding left out, and a README whose text outside the markers stays as it was.
"""

import json

import pytest

from benchmarks import report


def _path(us, floor):
    return {"us": us, "eff": floor / us, "err_vs_first": 0.0, "tail_zero": True}


RESULT = {
    "env": {"gpu": "NVIDIA H200", "torch": "2.14.0", "triton": "3.8.0", "date": "2030-01-02 03:04 UTC",
            "reps": 50, "settle_s": 0.0},
    "rows": [
        {"shape": "a S=1", "token_padding": 128, "nvs": 256, "rows": 200, "floor_us": 100.4,
         "vllm": _path(200.0, 100.4), "moonep": _path(125.0, 100.4)},
        {"shape": "b S=2", "token_padding": 128, "nvs": 512, "rows": 300, "floor_us": 50.0,
         "vllm": _path(100.0, 50.0), "moonep": _path(50.0, 50.0)},
        {"shape": "a S=1", "token_padding": 1, "nvs": 200, "rows": 200, "floor_us": 99.0,
         "vllm": _path(190.0, 99.0), "moonep": _path(120.0, 99.0)},
    ],
}
README = "# title\n\nintro\n\n<!-- perf-table:begin -->\nold table\n<!-- perf-table:end -->\n\n## next\n"


def test_the_table_says_what_the_json_says():
    text = report.render(RESULT)
    assert text.splitlines()[0].startswith("NVIDIA H200, torch 2.14.0, triton 3.8.0, 2030-01-02;")
    assert "| a S=1 | 256 | 200 | 100 | 200 (0.50) | 125 (0.80) | 1.60× |" in text
    assert "| b S=2 | 512 | 300 | 50 | 100 (0.50) | 50 (1.00) | 2.00× |" in text
    assert "| 200 | 200 |" not in text  # the unpadded row
    assert "Geometric-mean speedup 1.79× (1.60–2.00×); efficiency (floor / time) of moonep 0.80–1.00." in text


def test_a_path_that_failed_is_shown_and_left_out_of_the_mean():
    result = json.loads(json.dumps(RESULT))
    result["rows"][1]["moonep"] = {"error": "RuntimeError: out of memory"}
    text = report.render(result)
    assert "| b S=2 | 512 | 300 | 50 | 100 (0.50) | error | – |" in text
    assert "Geometric-mean speedup 1.60× (1.60–1.60×)" in text


def test_only_the_region_between_the_markers_is_replaced(tmp_path):
    new = report.replace_region(README, "TABLE\n")
    assert new == README.replace("old table\n", "\nTABLE\n\n")
    assert report.replace_region(new, "TABLE\n") == new  # idempotent


def test_main_writes_then_checks(tmp_path):
    results, readme = tmp_path / "bench.json", tmp_path / "README.md"
    results.write_text(json.dumps(RESULT))
    readme.write_text(README)
    args = ["--results", str(results), "--readme", str(readme)]
    assert report.main(args + ["--check"]) == 1  # the old table
    assert readme.read_text() == README  # --check writes nothing
    assert report.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nintro\n\n<!-- perf-table:begin -->\n\nNVIDIA H200")
    assert text.endswith("0.80–1.00.\n\n<!-- perf-table:end -->\n\n## next\n")
    assert report.main(args + ["--check"]) == 0


@pytest.mark.parametrize("text", ["# no markers\n", README.replace("<!-- perf-table:end -->\n", ""),
                                  README + "<!-- perf-table:begin -->\n"])
def test_missing_or_repeated_markers_print_the_table_and_fail(tmp_path, capsys, text):
    results, readme = tmp_path / "bench.json", tmp_path / "README.md"
    results.write_text(json.dumps(RESULT))
    readme.write_text(text)
    assert report.main(["--results", str(results), "--readme", str(readme)]) == 1
    out, err = capsys.readouterr()
    assert "| a S=1 |" in out and "perf-table:begin" in err
    assert readme.read_text() == text
