"""The layout sweep's confirmation of its lowest cases (benchmarks/sweep.py), the GPU replaced."""

import pytest

from benchmarks import sweep
from benchmarks.sweep_cases import sweep_cases


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
    from benchmarks import limit, sweep_summary, timing

    cases = sweep_cases(120, quick=True)
    effs = {case.name: 0.5 + 0.1 * i for i, case in enumerate(cases)}
    confirmed = []

    def fake_run_case(case, meter, reps, settle_s):
        return _record(case.name, 100.0, 100.0 * effs[case.name], 10.0)

    def fake_confirm(case, meter, reps, settle_s, rounds):
        confirmed.append((case.name, rounds))
        if case.name == cases[2].name:
            raise RuntimeError("gone")
        return {"moonep_us": [80.0] * rounds, "gemm_us": [100.0 * effs[case.name]] * rounds,
                "read_us": [10.0] * rounds}

    monkeypatch.setattr(sweep, "run_case_or_error", fake_run_case)
    monkeypatch.setattr(sweep, "confirm_samples", fake_confirm)
    monkeypatch.setattr(limit, "LimitMeter", lambda reps, settle_s: None)
    monkeypatch.setattr(timing, "environment", lambda: {"gpu": "G", "torch": "t", "triton": "tr", "python": "p",
                                                        "date": "2026-01-01 00:00 UTC"})
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


def test_no_confirmation_is_rendered_as_none():
    from benchmarks import sweep_summary

    env = {"gpu": "G", "torch": "t", "triton": "tr", "date": "2026-01-01 00:00 UTC", "settle_s": 0.3, "reps": 50}
    result = {"env": env, "cases": [], "summary": sweep_summary.summarize([])}
    assert "lowest against the limit were timed" not in sweep_summary.render(result)
