"""The layout sweep's confirmation of its lowest cases (benchmarks/sweep.py), the GPU replaced."""

import pytest

from benchmarks import sweep
from benchmarks.sweep_cases import Case, sweep_cases


FLOPS = 6 * 1000 * 2048 * 768


def _record(name, moonep_us, gemm_us, read_us, vllm_us=200.0):
    limit_us = max(gemm_us, read_us)
    return {"name": name, "rows": 1000, "hidden": 2048, "inter": 768, "bytes": 4e8, "floor_us": 50.0,
            "limit": {"us": limit_us, "bound": "compute" if gemm_us >= read_us else "memory", "gemm_us": gemm_us,
                      "read_us": read_us, "gemm_tflops": 0.0, "read_tbps": 0.0, "l2_fit": False},
            "vllm": {"us": vllm_us, "eff": 50.0 / vllm_us, "eff_limit": limit_us / vllm_us},
            "moonep": {"us": moonep_us, "eff": 50.0 / moonep_us, "eff_limit": limit_us / moonep_us,
                       "tflops": FLOPS / moonep_us / 1e6, "tbps": 4e8 / moonep_us / 1e6, "err_vs_first": 0.0,
                       "tail_zero": True}}


def _without_gpu(monkeypatch, run_case, confirm):
    """``sweep.main`` with ``run_case`` and ``confirm`` in place of the GPU's timings, no limit
    meter, and a fixed environment."""
    from benchmarks import cli, limit, timing

    monkeypatch.setattr(cli, "require_gpu", lambda parser: None)
    monkeypatch.setattr(sweep, "run_case_or_error", run_case)
    monkeypatch.setattr(sweep, "confirm_samples", confirm)
    monkeypatch.setattr(limit, "LimitMeter", lambda reps, settle_s: None)
    monkeypatch.setattr(timing, "environment", lambda: {"gpu": "G", "torch": "t", "triton": "tr", "python": "p",
                                                        "date": "2026-01-01 00:00 UTC"})


def test_a_confirmed_case_takes_the_medians_of_all_its_samples():
    rec = _record("c", 100.0, 60.0, 50.0)
    sweep.merge_confirmation(rec, {"moonep_us": [90.0, 95.0], "gemm_us": [62.0, 40.0], "read_us": [55.0, 70.0]})
    assert rec["confirm"] == {"moonep_us": [100.0, 90.0, 95.0], "gemm_us": [60.0, 62.0, 40.0],
                              "read_us": [50.0, 55.0, 70.0]}
    ours, lim = rec["moonep"], rec["limit"]
    assert ours["us"] == 95.0 and (lim["gemm_us"], lim["read_us"]) == (60.0, 55.0)
    assert (lim["us"], lim["bound"]) == (60.0, "compute")
    assert ours["eff_limit"] == pytest.approx(60.0 / 95.0) and ours["eff"] == pytest.approx(50.0 / 95.0)
    assert rec["vllm"]["eff_limit"] == pytest.approx(60.0 / 200.0)
    tflops, tbps = FLOPS / 100.0 / 1e6, 4e8 / 100.0 / 1e6  # the pass's rates
    assert ours["tflops"] == pytest.approx(tflops * 100.0 / 95.0) and ours["tbps"] == pytest.approx(tbps * 100.0 / 95.0)
    assert lim["gemm_tflops"] == pytest.approx(FLOPS / 60.0 / 1e6)
    assert lim["read_tbps"] == pytest.approx(4e8 / 55.0 / 1e6)


def test_the_lowest_cases_are_the_timed_ones_lowest_against_the_limit():
    records = [_record("a", 100.0, 90.0, 10.0), _record("b", 100.0, 60.0, 10.0), {"name": "e", "error": "OOM"},
               _record("c", 100.0, 70.0, 10.0)]
    assert [r["name"] for r in sweep.lowest_cases(records, 2)] == ["b", "c"]
    assert sweep.lowest_cases(records, 0) == []


def test_main_confirms_the_lowest_cases_and_says_so(monkeypatch, tmp_path, capsys):
    from benchmarks import sweep_summary

    cases = sweep_cases(120, quick=True)
    effs = {case.name: 0.5 + 0.1 * i for i, case in enumerate(cases)}
    confirmed = []

    def fake_run_case(case, meter, reps, settle_s, kind):
        assert kind == "bf16"
        return _record(case.name, 100.0, 100.0 * effs[case.name], 10.0)

    def fake_confirm(case, meter, reps, settle_s, rounds, kind):
        confirmed.append((case.name, rounds))
        if case.name == cases[2].name:
            raise RuntimeError("gone")
        return {"moonep_us": [80.0] * rounds, "gemm_us": [100.0 * effs[case.name]] * rounds,
                "read_us": [10.0] * rounds}

    _without_gpu(monkeypatch, fake_run_case, fake_confirm)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--quick", "--confirm", "3", "--confirm-rounds", "4", "--out", str(out)]) == 0
    assert confirmed == [(case.name, 4) for case in cases[:3]]
    text = capsys.readouterr().out
    assert f"# {cases[2].name}: not confirmed, RuntimeError: gone" in text
    import json

    result = json.loads(out.read_text())
    by_name = {rec["name"]: rec for rec in result["cases"]}
    assert by_name[cases[0].name]["moonep"]["us"] == 80.0 and "confirm" in by_name[cases[1].name]
    assert by_name[cases[2].name]["moonep"]["us"] == 100.0 and "confirm" not in by_name[cases[2].name]
    assert "confirm" not in by_name[cases[3].name]
    assert (result["env"]["confirmed"], result["env"]["confirm_rounds"]) == (2, 4)  # (the third failed)
    assert ("The 2 cases lowest against the limit were timed 4 more times, path and limit alternating: their "
            "figures are the medians of 5 samples.") in sweep_summary.render(result)


def test_resume_runs_the_rest_and_confirms_only_the_unconfirmed(monkeypatch, tmp_path, capsys):
    import json

    from benchmarks import sweep_summary

    cases = sweep_cases(120, quick=True)
    effs = {case.name: 0.5 + 0.1 * i for i, case in enumerate(cases)}
    ran, confirmed = [], []

    def fake_run_case(case, meter, reps, settle_s, kind):
        ran.append(case.name)
        return _record(case.name, 100.0, 100.0 * effs[case.name], 10.0)

    def fake_confirm(case, meter, reps, settle_s, rounds, kind):
        confirmed.append(case.name)
        return {"moonep_us": [100.0] * rounds, "gemm_us": [100.0 * effs[case.name]] * rounds,
                "read_us": [10.0] * rounds}

    _without_gpu(monkeypatch, fake_run_case, fake_confirm)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--quick", "--confirm", "2", "--out", str(out)]) == 0
    first = json.loads(out.read_text())  # a run cut short after the cases 1 and 3, which it confirmed
    kept = [first["cases"][1], first["cases"][3]]
    kept[0].pop("confirm")
    kept[1]["confirm"] = {"moonep_us": [100.0] * 3, "gemm_us": [100.0 * effs[cases[3].name]] * 3,
                          "read_us": [10.0] * 3}
    out.write_text(json.dumps({**first, "env": {**first["env"], "confirmed": 1}, "cases": kept}))
    ran.clear(), confirmed.clear()
    assert sweep.main(["--quick", "--confirm", "2", "--out", str(out), "--resume"]) == 0
    assert ran == [case.name for i, case in enumerate(cases) if i not in (1, 3)]
    assert confirmed == [cases[0].name, cases[1].name]  # the two lowest; the third-lowest stays as it was
    result = json.loads(out.read_text())
    assert sorted(rec["name"] for rec in result["cases"]) == sorted(case.name for case in cases)
    assert (result["env"]["runs"], result["env"]["confirmed"]) == (2, 3)
    assert ("Measured in 2 runs, each continuing the last; each run's cases lowest against the limit so far were "
            "timed 2 more times, path and limit alternating: the 3 such cases' figures are the medians of 3 "
            "samples.") in sweep_summary.render(result)
    with pytest.raises(SystemExit, match=r"--resume: .* holds another sweep \(kind 'bf16' there, 'fp8' here\)"):
        sweep.main(["--quick", "--fp8", "--out", str(out), "--resume"])


def test_rerun_times_again_the_kept_cases_it_matches(monkeypatch, tmp_path, capsys):
    """``--resume --rerun REGEX``: the kept cases whose names match run again (new figures, no old
    confirmation), the others keep theirs; ``env`` and the summary say which run re-timed which."""
    import json

    from benchmarks import sweep_summary

    cases = sweep_cases(120, quick=True)
    ran, times = [], {}

    def fake_run_case(case, meter, reps, settle_s, kind):
        ran.append(case.name)
        return _record(case.name, times.get(case.name, 100.0), 60.0, 10.0)

    _without_gpu(monkeypatch, fake_run_case, lambda *args: {"moonep_us": [], "gemm_us": [], "read_us": []})
    out = tmp_path / "sweep.json"
    assert sweep.main(["--quick", "--confirm-rounds", "0", "--out", str(out)]) == 0
    ran.clear()
    times[cases[2].name] = 80.0
    pattern = "^" + cases[2].name.replace(" ", r"\s")
    assert sweep.main(["--quick", "--confirm-rounds", "0", "--out", str(out), "--resume", "--rerun", pattern]) == 0
    assert ran == [cases[2].name]
    result = json.loads(out.read_text())
    by_name = {rec["name"]: rec for rec in result["cases"]}
    assert len(by_name) == len(cases) and by_name[cases[2].name]["moonep"]["us"] == 80.0
    assert by_name[cases[1].name]["moonep"]["us"] == 100.0
    assert result["env"]["reruns"] == [{"run": 2, "pattern": pattern, "cases": 1}]
    assert f"Run 2 re-timed the 1 case matching `{pattern}`." in sweep_summary.render(result)
    with pytest.raises(SystemExit, match=r"--rerun '\(': not a regular expression"):
        sweep.main(["--quick", "--out", str(out), "--resume", "--rerun", "("])
    with pytest.raises(SystemExit):
        sweep.main(["--quick", "--out", str(out), "--rerun", "x"])
    assert "--rerun needs --resume" in capsys.readouterr().err


def test_a_case_seed_sweeps_the_held_out_list_and_resumes_only_it(monkeypatch, tmp_path):
    import json

    ran = []

    def fake_run_case(case, meter, reps, settle_s, kind):
        ran.append(case.name)
        return _record(case.name, 100.0, 60.0, 10.0)

    _without_gpu(monkeypatch, fake_run_case, lambda *args: {"moonep_us": [], "gemm_us": [], "read_us": []})
    out = tmp_path / "sweep.json"
    assert sweep.main(["--cases", "8", "--case-seed", "1", "--confirm-rounds", "0", "--out", str(out)]) == 0
    assert ran == [case.name for case in sweep_cases(8, seed=1)] != [case.name for case in sweep_cases(8)]
    assert json.loads(out.read_text())["env"]["case_seed"] == 1
    with pytest.raises(SystemExit, match=r"holds another sweep \(case_seed 1 there, 0 here\)"):
        sweep.main(["--cases", "8", "--out", str(out), "--resume"])


def test_a_long_rerun_pattern_is_left_to_the_json():
    from benchmarks import sweep_summary

    records = [_record(case.name, 100.0, 60.0, 10.0) for case in sweep_cases(120, quick=True)]
    long_pattern = "|".join(case.name for case in sweep_cases(120, quick=True))
    env = {"gpu": "G", "torch": "t", "triton": "tr", "date": "d", "reps": 50, "settle_s": 0.3, "runs": 3,
           "reruns": [{"run": 2, "pattern": "^kimi", "cases": 1}, {"run": 3, "pattern": long_pattern, "cases": 5}]}
    text = sweep_summary.render({"env": env, "cases": records, "summary": sweep_summary.summarize(records)})
    assert "Run 2 re-timed the 1 case matching `^kimi`. Run 3 re-timed the 5 cases matching a pattern kept in " \
           "the JSON." in text and long_pattern not in text


def test_no_confirmation_is_rendered_as_none():
    from benchmarks import sweep_summary

    env = {"gpu": "G", "torch": "t", "triton": "tr", "date": "2026-01-01 00:00 UTC", "settle_s": 0.3, "reps": 50}
    result = {"env": env, "cases": [], "summary": sweep_summary.summarize([])}
    assert "lowest against the limit were timed" not in sweep_summary.render(result)


def _fp8_record(name, fp8_us, gemm_us, read_us, bf16_us=300.0, err=0.064):
    limit_us = max(gemm_us, read_us)
    return {"name": name, "rows": 1000, "hidden": 2048, "inter": 768, "bytes": 2e8,
            "limit": {"us": limit_us, "bound": "compute" if gemm_us >= read_us else "memory", "gemm_us": gemm_us,
                      "read_us": read_us, "gemm_tflops": 0.0, "read_tbps": 0.0, "l2_fit": False},
            "moonep_bf16": {"us": bf16_us, "eff_limit": limit_us / bf16_us, "err_vs_bf16": 0.0, "tail_zero": True},
            "moonep_fp8": {"us": fp8_us, "eff_limit": limit_us / fp8_us, "tflops": FLOPS / fp8_us / 1e6,
                           "tbps": 2e8 / fp8_us / 1e6, "err_vs_bf16": err, "tail_zero": True}}


def test_an_fp8_case_confirms_its_fp8_time_and_has_no_floor():
    rec = _fp8_record("c", 100.0, 60.0, 50.0)
    sweep.merge_confirmation(rec, {"moonep_fp8_us": [90.0, 95.0], "gemm_us": [62.0, 40.0], "read_us": [55.0, 70.0]},
                             "fp8")
    assert rec["confirm"]["moonep_fp8_us"] == [100.0, 90.0, 95.0]
    ours = rec["moonep_fp8"]
    assert ours["us"] == 95.0 and ours["eff_limit"] == pytest.approx(60.0 / 95.0) and "eff" not in ours
    assert rec["moonep_bf16"]["eff_limit"] == pytest.approx(60.0 / 300.0)
    assert ours["tflops"] == pytest.approx(FLOPS / 95.0 / 1e6)
    assert [r["name"] for r in sweep.lowest_cases([_fp8_record("a", 100.0, 90.0, 1.0), rec], 1, "fp8")] == ["c"]


def test_the_fp8_summary_compares_with_the_bf16_path():
    from benchmarks import sweep_summary

    cases = [_fp8_record("a", 100.0, 80.0, 10.0), _fp8_record("b", 200.0, 100.0, 120.0, bf16_us=300.0),
             _fp8_record("c", 50.0, 45.0, 10.0, err=0.3), {"name": "d", "error": "OutOfMemoryError"}]
    s = sweep_summary.summarize(cases, "fp8")
    assert s["timed"] == 3 and s["errors"] == ["d"] and s["check_failures"] == ["c"]
    nan = _fp8_record("e", 100.0, 80.0, 10.0, err=float("nan"))  # (the output, or the bf16 reference, NaN)
    assert sweep_summary.check_failures([nan], sweep_summary.KINDS["fp8"]) == ["e"]
    bf16 = _record("f", 100.0, 80.0, 10.0)
    assert sweep_summary.check_failures([bf16]) == []
    bf16["moonep"]["err_vs_first"] = float("nan")
    assert sweep_summary.check_failures([bf16]) == ["f"]
    assert s["worst"]["case"] == "b" and "eff_floor" not in s and "eff_floor" not in s["worst"]
    assert s["speedup"]["min"] == pytest.approx(1.5) and s["speedup"]["max"] == pytest.approx(6.0)
    env = {"gpu": "G", "torch": "t", "triton": "tr", "date": "2026-01-01 00:00 UTC", "settle_s": 0.3, "reps": 50,
           "kind": "fp8"}
    text = sweep_summary.render({"env": env, "cases": cases, "summary": s})
    assert "; FP8 (e4m3 weights, block-major, 128 x 128 block scales; bf16 activations); 4 cases" in text
    assert "moonep_fp8 against the measured limit: min 0.60, median 0.80, max 0.90." in text
    assert "FP8 against the bf16 experts op: geometric mean" in text
    assert "1 case without a moonep_fp8 time, an error instead (d); 1 case failed the output check (c)." in text
    assert "| lowest cases | limit µs (bound) | moonep_fp8 µs | vs limit |\n|---|---|---|---|\n" in text
    assert "| b | 120 (memory) | 200 | 0.60 |\n" in text


def test_main_with_fp8_sweeps_the_fp8_path(monkeypatch, tmp_path):
    import json

    from benchmarks import report

    kinds = []

    def fake_run_case(case, meter, reps, settle_s, kind):
        kinds.append(kind)
        return _fp8_record(case.name, 100.0, 70.0, 10.0)

    def fake_confirm(case, meter, reps, settle_s, rounds, kind):
        kinds.append(kind)
        return {"moonep_fp8_us": [90.0] * rounds, "gemm_us": [70.0] * rounds, "read_us": [10.0] * rounds}

    _without_gpu(monkeypatch, fake_run_case, fake_confirm)
    out, doc = tmp_path / "sweep_fp8.json", tmp_path / "fp8.md"
    assert sweep.main(["--fp8", "--quick", "--confirm", "1", "--out", str(out)]) == 0
    assert set(kinds) == {"fp8"} and len(kinds) == len(sweep_cases(120, quick=True)) + 1
    result = json.loads(out.read_text())
    assert result["env"]["kind"] == "fp8" and result["summary"]["speedup"]["min"] == pytest.approx(3.0)
    assert sum("confirm" in rec for rec in result["cases"]) == 1
    doc.write_text("# FP8\n\n<!-- fp8-sweep:begin -->\nold\n<!-- fp8-sweep:end -->\n")
    args = ["--fp8-sweep", "--results", str(out), "--doc", str(doc)]
    assert report.main(args + ["--check"]) == 1 and report.main(args) == 0 and report.main(args + ["--check"]) == 0
    assert "moonep_fp8 against the measured limit: min 0.70" in doc.read_text()


class _CpuMeter:
    """The limit meter's read, without a GPU: 40 µs whatever the bytes."""

    def read_us(self, nbytes):
        return 40.0, nbytes


@pytest.fixture
def fp8_sweep_on_cpu(monkeypatch):
    """The FP8 sweep's case code on the CPU: the problem built there, every timing 100 µs (the path
    still runs once and is checked), the FP8 GEMM pair 50 µs."""
    import torch

    from benchmarks import fp8 as fp8_bench
    from benchmarks import shapes

    build = shapes.build_problem
    monkeypatch.setattr(shapes, "build_problem", lambda *args, **kw: build(*args, **{**kw, "device": "cpu"}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(fp8_bench, "median_replay_ms", lambda fn, reps, settle_s: 0.1)
    monkeypatch.setattr(fp8_bench, "fp8_gemm_pair_us", lambda meter, rows, hidden, inter: 50.0)
    return Case("small", 256, 128, 8, 8, 8, 16, 0.8, 128, 0)


def test_an_fp8_case_runs_both_paths_and_measures_the_fp8_limit(fp8_sweep_on_cpu):
    from benchmarks import fp8 as fp8_bench

    case = fp8_sweep_on_cpu
    rec = sweep.run_case(case, _CpuMeter(), 20, 0.0, "fp8")
    assert rec["name"] == case.name and rec["rows"] > 0 and rec["nvs"] >= rec["rows"]
    sizes = [1] * (rec["nonempty"] - 1) + [rec["rows"] - rec["nonempty"] + 1]  # (fp8_bytes counts and sums)
    assert rec["bytes"] == fp8_bench.fp8_bytes(sizes, case.shape())
    assert rec["limit"]["us"] == 50.0 and rec["limit"]["bound"] == "compute" and rec["limit"]["read_us"] == 40.0
    for name in ("moonep_bf16", "moonep_fp8"):
        assert rec[name]["us"] == pytest.approx(100.0) and rec[name]["tail_zero"]
        assert rec[name]["eff_limit"] == pytest.approx(0.5) and "eff" not in rec[name]
    assert rec["moonep_bf16"]["err_vs_bf16"] == 0.0
    assert 0.01 < rec["moonep_fp8"]["err_vs_bf16"] < 0.1  # the quantization error, not a wrong result
    line = sweep.case_line(0, rec, "fp8")
    assert " | moonep_fp8     100us lim 0.50 x1.00 err " in line and "TAIL" not in line
    samples = sweep.confirm_samples(case, _CpuMeter(), 20, 0.0, 2, "fp8")
    assert samples == {"moonep_fp8_us": [100.0, 100.0], "gemm_us": [50.0, 50.0], "read_us": [40.0, 40.0]}
