"""benchmarks/report.py: the README's performance table from a benchmark JSON, and the layout
sweep's summary (benchmarks/sweep_summary.py) from a sweep JSON, on CPU.

Small synthetic results (not the committed ones): the table's cells (floor, measured limit and the
efficiency against it), the geometric mean, the eager host cost line, the rows of the other padding
left out, a result without a limit, a README whose text outside the markers stays as it was; the
sweep's worst case, spread and worst per bound; its deterministic case list; the FP8 table of
docs/fp8.md (benchmarks/fp8_table.py) pinned whole, a path that failed shown as a dash, and the
committed docs matching their JSON.
"""

import json

import pytest

from benchmarks import report


def _path(us, floor, limit):
    return {"us": us, "eff": floor / us, "eff_limit": limit / us, "err_vs_first": 0.0, "tail_zero": True}


def _limit(us, bound="memory"):
    return {"us": us, "bound": bound, "gemm_us": us / 2, "read_us": us, "l2_fit": False}


RESULT = {
    "env": {"gpu": "NVIDIA H200", "torch": "2.14.0", "triton": "3.8.0", "date": "2030-01-02 03:04 UTC",
            "reps": 50, "settle_s": 0.0},
    "rows": [
        {"shape": "a S=1", "token_padding": 128, "nvs": 256, "rows": 200, "floor_us": 100.4,
         "limit": _limit(110.0), "vllm": _path(200.0, 100.4, 110.0), "moonep": _path(125.0, 100.4, 110.0)},
        {"shape": "b S=2", "token_padding": 128, "nvs": 512, "rows": 300, "floor_us": 50.0,
         "limit": _limit(45.0, "compute"), "vllm": _path(100.0, 50.0, 45.0), "moonep": _path(50.0, 50.0, 45.0)},
        {"shape": "a S=1", "token_padding": 1, "nvs": 200, "rows": 200, "floor_us": 99.0,
         "limit": _limit(105.0), "vllm": _path(190.0, 99.0, 105.0), "moonep": _path(120.0, 99.0, 105.0)},
    ],
}
README = "# title\n\nintro\n\n<!-- perf-table:begin -->\nold table\n<!-- perf-table:end -->\n\n## next\n"


def test_the_table_says_what_the_json_says():
    text = report.render(RESULT)
    assert text.splitlines()[0].startswith("NVIDIA H200, torch 2.14.0, triton 3.8.0, 2030-01-02;")
    assert "| floor µs | limit µs | vLLM 0.33 µs (eff) | moonep µs (eff) | moonep vs limit | speedup |" in text
    assert "| a S=1 | 256 | 200 | 100 | 110 | 200 (0.50) | 125 (0.80) | 0.88 | 1.60× |" in text
    assert "| b S=2 | 512 | 300 | 50 | 45 | 100 (0.50) | 50 (1.00) | 0.90 | 2.00× |" in text
    assert "| 200 | 200 |" not in text  # the unpadded row
    assert ("Geometric-mean speedup 1.79× (1.60–2.00×); efficiency of moonep against the floor 0.80–1.00, "
            "against the measured limit 0.88–0.90.") in text


def test_the_host_cost_line_comes_from_the_json():
    result = json.loads(json.dumps(RESULT))
    result["host_us"] = {"vllm": 100.0, "moonep": 45.4, "moonep (grad mode)": 60.0}
    assert report.render(result).endswith(
        "Eager host cost per call under `torch.inference_mode()` (a tiny problem, same process): moonep 45 µs, "
        "vLLM 0.33's composition 100 µs (0.45×).\n")
    assert "Eager host cost" not in report.render(RESULT)


def test_a_path_that_failed_is_shown_and_left_out_of_the_mean():
    result = json.loads(json.dumps(RESULT))
    result["rows"][1]["moonep"] = {"error": "RuntimeError: out of memory"}
    text = report.render(result)
    assert "| b S=2 | 512 | 300 | 50 | 45 | 100 (0.50) | error | – | – |" in text
    assert "Geometric-mean speedup 1.60× (1.60–1.60×)" in text
    assert "against the floor 0.80–0.80, against the measured limit 0.88–0.88." in text


def test_a_run_without_the_limit_shows_dashes():
    result = json.loads(json.dumps(RESULT))
    for row in result["rows"]:
        del row["limit"]
        for name in ("vllm", "moonep"):
            del row[name]["eff_limit"]
    text = report.render(result)
    assert "| a S=1 | 256 | 200 | 100 | – | 200 (0.50) | 125 (0.80) | – | 1.60× |" in text
    assert text.endswith("efficiency of moonep against the floor 0.80–1.00.\n")


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
    assert text.endswith("0.88–0.90.\n\n<!-- perf-table:end -->\n\n## next\n")
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


def _case(name, us, limit_us, bound, floor_us, vllm_us, err=1e-3):
    return {"name": name, "rows": 128, "limit": _limit(limit_us, bound), "floor_us": floor_us,
            "vllm": {"us": vllm_us, "eff": floor_us / vllm_us, "eff_limit": limit_us / vllm_us},
            "moonep": {**_path(us, floor_us, limit_us), "err_vs_first": err}}


SWEEP = {
    "env": {**RESULT["env"], "settle_s": 0.3, "case_seed": 0},
    "cases": [
        _case("m K8 G1000 S64", 100.0, 80.0, "memory", 70.0, 200.0),
        _case("m K8 G64 S8192", 100.0, 90.0, "compute", 85.0, 150.0),
        _case("m K1 G8 S16", 10.0, 6.0, "memory", 5.0, 10.0, err=0.5),
        _case("m K8 G132 S4096", 100.0, 95.0, "compute", 90.0, 100.0),
        {"name": "m K8 G388 S8192", "error": "OutOfMemoryError: CUDA out of memory"},
    ],
}
SWEEP_DOC = "# Performance\n\n<!-- sweep-summary:begin -->\nold\n<!-- sweep-summary:end -->\n\n## next\n"


def test_the_sweep_summary_names_the_worst_cases():
    from benchmarks import sweep_summary

    s = sweep_summary.summarize(SWEEP["cases"])
    assert (s["cases"], s["timed"]) == (5, 4)
    assert s["errors"] == ["m K8 G388 S8192"] and s["check_failures"] == ["m K1 G8 S16"]
    assert s["worst"]["case"] == "m K1 G8 S16" and s["worst"]["eff_limit"] == pytest.approx(0.6)
    assert s["eff_limit"] == pytest.approx({"min": 0.6, "median": 0.85, "max": 0.95})
    assert s["worst_by_bound"]["compute"]["case"] == "m K8 G64 S8192"
    assert s["worst_by_bound"]["compute"]["cases"] == 2
    assert s["worst_by_bound"]["memory"]["case"] == "m K1 G8 S16"
    assert s["speedup"]["min"] == pytest.approx(1.0) and s["speedup"]["max"] == pytest.approx(2.0)
    text = sweep_summary.render({**SWEEP, "summary": s})
    assert "5 cases (case seed 0); each path and each part of the limit replayed for 0.3 s" in text
    assert "moonep against the measured limit: min 0.60, median 0.85, max 0.95" in text
    assert "Worst compute-bound case (2 cases): m K8 G64 S8192, 0.90." in text
    assert ("1 case without a moonep time, an error instead (m K8 G388 S8192); "
            "1 case failed the output check (m K1 G8 S16).") in text
    assert "| m K1 G8 S16 | 6 (memory) | 10 | 0.60 | 0.50 |" in text
    cut_short = sweep_summary.render({**SWEEP, "env": {**SWEEP["env"], "cases_listed": 120}, "summary": s})
    assert "5 of the 120 listed cases (case seed 0; the run's time limit stopped the rest);" in cut_short


def test_main_writes_the_sweep_summary_into_its_doc(tmp_path):
    from benchmarks import sweep_summary

    results, doc = tmp_path / "sweep.json", tmp_path / "performance.md"
    results.write_text(json.dumps({**SWEEP, "summary": sweep_summary.summarize(SWEEP["cases"])}))
    doc.write_text(SWEEP_DOC)
    args = ["--sweep", "--results", str(results), "--doc", str(doc)]
    assert report.main(args + ["--check"]) == 1
    assert report.main(args) == 0
    text = doc.read_text()
    assert text.startswith("# Performance\n\n<!-- sweep-summary:begin -->\n\nNVIDIA H200")
    assert text.endswith("|\n\n<!-- sweep-summary:end -->\n\n## next\n")
    assert report.main(args + ["--check"]) == 0


def test_the_held_out_sweep_has_its_own_region_of_the_same_doc(tmp_path):
    from benchmarks import sweep_summary

    held_out = {**SWEEP, "env": {**SWEEP["env"], "case_seed": 1}}
    results, doc = tmp_path / "sweep.json", tmp_path / "performance.md"
    results.write_text(json.dumps({**held_out, "summary": sweep_summary.summarize(SWEEP["cases"])}))
    doc.write_text(SWEEP_DOC + "<!-- heldout-sweep:begin -->\nold\n<!-- heldout-sweep:end -->\n")
    assert report.main(["--heldout-sweep", "--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(SWEEP_DOC)  # the default list's region untouched
    region = text.split("<!-- heldout-sweep:begin -->")[1]
    assert "old" not in region and "(case seed 1)" in region


def test_the_sweep_case_list_is_fixed_and_covers_every_axis():
    from benchmarks import sweep_cases

    from benchmarks.sweep import DEFAULT_CASES

    cases = sweep_cases.sweep_cases(DEFAULT_CASES)
    assert cases == sweep_cases.sweep_cases(DEFAULT_CASES) and len(set(cases)) == DEFAULT_CASES
    assert cases[:len(sweep_cases.ANCHORS)] == sweep_cases.sweep_cases(0, quick=True)
    assert {c.topk for c in cases} == {1, 8}
    assert min(c.groups for c in cases) == 8 and max(c.groups for c in cases) == 1000
    assert {c.skew for c in cases} == set(sweep_cases.SKEWS)
    assert {c.token_padding for c in cases} == {1, 128}
    assert {c.tokens for c in cases} == set(sweep_cases.TOKENS)
    assert {(c.hidden, c.inter) for c in cases} == {(m.hidden, m.inter) for m in sweep_cases.MODELS}
    for c in cases:
        assert c.topk <= c.epn <= c.experts
        assert 3 * c.groups * c.hidden * c.inter * 2 <= sweep_cases.WEIGHT_CAP_BYTES


def test_another_case_seed_draws_another_list_of_the_same_axes():
    """``--case-seed``: a held-out list, the anchors first, every axis still covered."""
    from benchmarks import sweep_cases

    from benchmarks.sweep import DEFAULT_CASES

    default, held_out = sweep_cases.sweep_cases(DEFAULT_CASES), sweep_cases.sweep_cases(DEFAULT_CASES, seed=1)
    anchors = len(sweep_cases.ANCHORS)
    assert held_out[:anchors] == default[:anchors] and len(set(held_out)) == DEFAULT_CASES
    assert len(set(held_out[anchors:]) & set(default[anchors:])) < 10
    assert {c.tokens for c in held_out} == set(sweep_cases.TOKENS)
    assert {(c.hidden, c.inter) for c in held_out} == {(m.hidden, m.inter) for m in sweep_cases.MODELS}


def test_a_case_name_gives_back_its_case():
    from benchmarks import sweep_cases

    for case in sweep_cases.sweep_cases(120) + sweep_cases.sweep_cases(120, seed=1):
        assert sweep_cases.case_from_name(case.name) == case
    for bad in ("kimi", "gpt K8 G20 epn16 S512 z0.8 p1 s1", "kimi-k2 K8 G20 epn16 S512 z0.80 p1 s1",
                "kimi-k2 K8 G20 epn40 S512 z0.8 p1 s1", "kimi-k2 K8 G20 epn16 S512 z0.8 p0 s1"):
        with pytest.raises(ValueError, match=f"not a layout-sweep case name: '{bad}'"):
            sweep_cases.case_from_name(bad)


def _fp8_path(us, limit_us):
    return {"err_vs_bf16": 0.06, "tail_zero": True, "us": us, "eff_limit": limit_us / us}


FP8_RESULT = {
    "env": {"gpu": "NVIDIA H200", "torch": "2.14.0", "triton": "3.8.0", "date": "2030-01-02 03:04 UTC",
            "reps": 30, "settle_s": 0.5},
    "rows": [
        {"shape": "a S=1", "token_padding": 128, "nvs": 256, "rows": 200, "limit": _limit(50.4),
         "moonep_bf16": _fp8_path(110.0, 50.4), "moonep_fp8": _fp8_path(100.0, 50.4),
         "moonep_fp8_row_major": _fp8_path(105.0, 50.4), "torch_fp8": _fp8_path(250.0, 50.4)},
        {"shape": "b S=2", "token_padding": 1, "nvs": 300, "rows": 300, "limit": _limit(60.0, "compute"),
         "moonep_bf16": _fp8_path(90.0, 60.0), "moonep_fp8": _fp8_path(75.0, 60.0),
         "torch_fp8": {"error": "RuntimeError: not supported"}},
    ],
}
FP8_DOC = "# FP8\n\n<!-- fp8-table:begin -->\nold\n<!-- fp8-table:end -->\n\n## Limits\n"


def test_the_fp8_table_is_pinned():
    assert report.render_fp8(FP8_RESULT) == (
        "NVIDIA H200, torch 2.14.0, triton 3.8.0, 2030-01-02; median of 30 CUDA-graph replays, "
        "each path and the limit first replayed for 0.5 s.\n"
        "\n"
        "| shape | padding | bf16 | fp8 | fp8 [G, N, K] | torch | fp8 vs bf16 | fp8 vs torch | limit µs | fp8 vs limit |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        "| a S=1 | 128 | 110 | 100 | 105 | 250 | 1.10x | 2.50x | 50 (memory) | 0.50 |\n"
        "| b S=2 | 1 | 90 | 75 | – | – | 1.20x | – | 60 (compute) | 0.80 |\n"
        "\n"
        "fp8 against bf16: 1.20-1.20x (padding 1), 1.10-1.10x (padding 128); against torch 2.50-2.50x; "
        "against the limit 0.50-0.80.\n")


def test_the_fp8_table_without_env_or_fp8_times():
    result = {"env": {}, "rows": [{**FP8_RESULT["rows"][1], "moonep_fp8": {"error": "OutOfMemoryError"}}]}
    assert report.render_fp8(result) == (
        "| shape | padding | bf16 | fp8 | fp8 [G, N, K] | torch | fp8 vs bf16 | fp8 vs torch | limit µs | fp8 vs limit |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        "| b S=2 | 1 | 90 | – | – | – | – | – | 60 (compute) | – |\n"
        "\n"
        "No shape ran on the fp8 path.\n")


def test_main_writes_the_fp8_table_into_its_doc(tmp_path, capsys):
    results, doc = tmp_path / "fp8.json", tmp_path / "fp8.md"
    results.write_text(json.dumps(FP8_RESULT))
    doc.write_text(FP8_DOC)
    args = ["--fp8", "--results", str(results), "--doc", str(doc)]
    assert report.main(args + ["--check"]) == 1
    assert "run python -m benchmarks.report --fp8" in capsys.readouterr().err
    assert doc.read_text() == FP8_DOC
    assert report.main(args + ["--stdout"]) == 0
    assert capsys.readouterr().out == report.render_fp8(FP8_RESULT)
    assert report.main(args) == 0
    assert doc.read_text() == FP8_DOC.replace("old\n", "\n" + report.render_fp8(FP8_RESULT) + "\n")
    assert report.main(args + ["--check"]) == 0


@pytest.mark.parametrize("mode", [[], ["--sweep"], ["--heldout-sweep"], ["--fp8"], ["--fp8-sweep"],
                                  ["--fp8-heldout-sweep"]])
def test_each_committed_doc_matches_its_json(mode):
    assert report.main(mode + ["--check"]) == 0


def test_sweep_and_fp8_exclude_each_other():
    with pytest.raises(SystemExit):
        report.main(["--sweep", "--fp8", "--stdout"])
