"""benchmarks/ab.py on CPU: variant specs parsed into GluonConfig field replacements (for both
GEMMs or one), bad specs refused with the variant and the field named, the alternating round
order, the config table replaced for the duration of a variant and restored after, and the output
digests that processes check each other's outputs against."""

import pytest
import torch

from benchmarks import ab, cli
from benchmarks.shapes import SHAPES
from moonep_ops.kernels.gluon import config


@pytest.fixture(autouse=True)
def _no_gpu_needed(monkeypatch):
    # Every run here is faked (``run_case`` or the timing replaced): main's GPU check stays out.
    monkeypatch.setattr(cli, "require_gpu", lambda parser: None)


def test_a_name_alone_is_the_table():
    variant = ab.parse_variant("table")
    assert variant == ab.Variant("table")
    cfg = config.gluon_fp8_config(2048, 7168, 45056, fused=True, groups=388)
    assert variant.apply(cfg, fused=True) is cfg


def test_fields_for_both_gemms_or_one():
    variant = ab.parse_variant("rows:split_ring=False,skip_idle_tiles=False,block_m=128,split_rows=True,"
                               "fused.stages=4,plain.stages=6")
    assert variant.both == dict(split_ring=False, skip_idle_tiles=False, block_m=128, split_rows=True)
    assert (variant.fused, variant.plain) == (dict(stages=4), dict(stages=6))
    ring = config.gluon_fp8_config(2048, 7168, 13312, fused=True, groups=388)
    assert ring.split_ring
    fused, plain = variant.apply(ring, fused=True), variant.apply(ring, fused=False)
    assert (fused.split_rows, fused.block_m, fused.stages, plain.stages) == (True, 128, 4, 6)
    assert variant.apply(None, fused=True) is None  # a GEMM the Gluon kernel does not take


def test_a_variant_that_breaks_a_config_rule_fails_when_applied():
    variant = ab.parse_variant("bad:split_rows=True")
    ring = config.gluon_fp8_config(2048, 7168, 13312, fused=True, groups=388)
    with pytest.raises(ValueError, match="GluonConfig: split_rows needs ping-pong on one ring"):
        variant.apply(ring, fused=True)


@pytest.mark.parametrize("spec, message", [
    (":stages=4", "benchmarks.ab: a variant needs a name, got ':stages=4'"),
    ("v:stage=4", "benchmarks.ab: 'stage=4' in variant 'v' is not [fused.|plain.]FIELD=VALUE with a GluonConfig "
                  "field ("),
    ("v:down.stages=4", "benchmarks.ab: 'down.stages=4' in variant 'v' is not [fused.|plain.]FIELD=VALUE"),
    ("v:stages", "benchmarks.ab: 'stages' in variant 'v' is not [fused.|plain.]FIELD=VALUE"),
    ("v:pingpong=yes", "benchmarks.ab: the value of 'pingpong' in variant 'v' is not a Python literal: 'yes'"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ValueError) as err:
        ab.parse_variant(spec)
    assert str(err.value).startswith(message)


def test_a_bad_spec_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        ab.main(["table", "v:stage=4"])
    assert info.value.code == 2
    assert "error: benchmarks.ab: 'stage=4' in variant 'v' is not" in capsys.readouterr().err


def test_rounds_alternate_the_order():
    assert [ab.round_order(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"],
                                                                      ["a", "b", "c"]]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_table_is_replaced_for_a_variant_and_restored(fp8):
    from moonep_ops.kernels.cuda import experts, paths

    host = paths.gluon_host()
    if host is None:
        pytest.skip("this Triton has no usable Gluon")
    name = "gluon_fp8_config" if fp8 else "gluon_gemm_config"
    table = getattr(config, name)
    host._PLANS["stale"] = object()
    experts._FLAG_TARGETS["stale"] = 1  # a handoff target asked for by the table's config
    with ab.table_replaced(ab.parse_variant("v:stages=3"), fp8):
        assert "stale" not in host._PLANS and "stale" not in experts._FLAG_TARGETS
        assert getattr(config, name)(2048, 7168, 45056, True, groups=388).stages == 3
        host._PLANS["made under the variant"] = object()
        experts._FLAG_TARGETS["made under the variant"] = 0
    assert getattr(config, name) is table and not host._PLANS and not experts._FLAG_TARGETS


def test_run_case_times_each_variant_under_its_table_in_alternating_rounds(monkeypatch):
    """The glue of one case, the GPU replaced: each sample is taken with its variant's table in
    place, the first variant's output is the reference of the others, and a variant whose output
    is off or that fails is reported beside its samples."""
    import torch

    from benchmarks import fp8 as fp8_bench
    from moonep_ops.kernels.cuda import paths

    if paths.gluon_host() is None:
        pytest.skip("this Triton has no usable Gluon")
    out = torch.zeros(4)
    seen = []

    def fake_time_path(fn, out_, live, ref, reps, settle_s):
        stages = config.gluon_fp8_config(2048, 7168, 45056, True, groups=388).stages
        seen.append((stages, ref is None))
        if stages == 2:
            return {"error": "RuntimeError: no"}
        return {"us": 100.0 + stages, "err_vs_bf16": 0.5 if stages == 3 else 0.0, "tail_zero": True}

    monkeypatch.setattr(fp8_bench, "time_path", fake_time_path)
    monkeypatch.setattr(ab, "_experts_call", lambda shape, padding, fp8, layout, block_major: (lambda: None, out, 4))
    variants = [ab.parse_variant(s) for s in ("table", "three:stages=3", "two:stages=2")]
    row = ab.run_case(SHAPES[0], 128, variants, fp8=True, rounds=2, reps=1, settle_s=0.0)
    table_stages = config.gluon_fp8_config(2048, 7168, 45056, True, groups=388).stages
    assert [s for s, _ in seen] == [table_stages, 3, 2, 2, 3, table_stages]
    assert [first for _, first in seen] == [True] + [False] * 5
    assert row["samples"] == {"table": [100.0 + table_stages] * 2, "three": [103.0, 103.0], "two": []}
    assert row["errors"] == {"three": "rel err 0.5, zero tail True", "two": "RuntimeError: no"}
    assert row["rounds"] == [{"table": 100.0 + table_stages, "three": 103.0}] * 2
    line = ab._line(row)
    assert "table" in line and "two     n/a" in line and "two/table n/a" in line


def test_paired_ratios_pair_the_samples_of_each_round():
    """Each variant over the first one round by round (the board's drift cancels within a round),
    rounds where either failed left out."""
    row = {"samples": {"a": [100.0, 120.0, 90.0], "b": [95.0, 99.0], "c": []},
           "rounds": [{"a": 100.0, "b": 95.0}, {"a": 120.0}, {"a": 90.0, "b": 99.0}]}
    ratios = ab.paired_ratios(row, "a")
    assert ratios["c"] is None
    assert ratios["b"] == pytest.approx((1.025, 0.95, 1.1))
    assert "b/a 1.025 (0.950-1.100)" in ab._line({**row, "shape": "s", "token_padding": 1, "errors": {}})


def test_sweep_cases_by_name_keep_their_layout():
    """``--cases``: each named layout-sweep case with its padding, seed and skew; a name that is
    no case is refused with a pointer to the list."""
    from benchmarks.sweep_cases import sweep_cases

    first, second = sweep_cases(120)[:2]
    problems = ab.sweep_problems(f"{first.name}; {second.name};")
    assert [(shape.name, shape.hidden, padding, layout) for shape, padding, layout in problems] == [
        (case.name, case.hidden, case.token_padding, {"seed": case.seed, "skew": case.skew})
        for case in (first, second)]
    with pytest.raises(ValueError, match=r"not a layout-sweep case name: 'kimi' .*\(python -m benchmarks.sweep --list"):
        ab.sweep_problems("kimi")


def test_a_case_of_the_held_out_list_is_named_as_any_other():
    from benchmarks.sweep_cases import sweep_cases

    held_out = next(case for case in sweep_cases(120, seed=1) if case not in sweep_cases(120))
    [(shape, padding, layout)] = ab.sweep_problems(held_out.name)
    assert (shape.name, shape.num_groups, shape.topk, padding, layout) == (
        held_out.name, held_out.groups, held_out.topk, held_out.token_padding,
        {"seed": held_out.seed, "skew": held_out.skew})


def _recording_run_case(record):
    """A stand-in for :func:`ab.run_case` that hands its arguments to ``record`` and returns one
    sample."""
    def run_case(shape, padding, variants, fp8, rounds, reps, settle_s, layout=None, reference=None,
                 block_major=True):
        record(shape=shape, padding=padding, layout=layout, rounds=rounds, reference=reference,
               block_major=block_major)
        return {"shape": shape.name, "token_padding": padding, "samples": {"table": [1.0]}, "errors": {},
                "rounds": [{"table": 1.0}]}
    return run_case


def test_main_runs_the_named_cases_instead_of_the_shapes(monkeypatch):
    from benchmarks.sweep_cases import sweep_cases

    case = sweep_cases(120)[3]
    calls = []

    monkeypatch.setattr(ab, "run_case", _recording_run_case(
        lambda shape, padding, layout, rounds, **_: calls.append((shape.name, padding, layout, rounds))))
    assert ab.main(["table", "--cases", case.name, "--rounds", "6"]) == 0
    assert calls == [(case.name, case.token_padding, {"seed": case.seed, "skew": case.skew}, 6)]
    with pytest.raises(SystemExit):
        ab.main(["table", "--cases", "no such case"])


@pytest.mark.parametrize("args, block_major", [([], True), (["--fp8-weights", "gnk"], False),
                                               (["--fp8-weights", "block-major"], True)])
def test_fp8_weights_are_block_major_unless_asked(monkeypatch, args, block_major):
    """The FP8 experts run on block-major weights, as the FP8 table's fp8 column and the layout
    sweep run them; ``--fp8-weights gnk`` runs the checkpoint's [G, N, K] layout."""
    seen = []

    monkeypatch.setattr(ab, "run_case", _recording_run_case(lambda block_major, **_: seen.append(block_major)))
    assert ab.main(["table", "--fp8", "--shapes", "0", "--paddings", "128", "--rounds", "1", *args]) == 0
    assert seen == [block_major]


def test_benchmarks_ab_keeps_the_reference_across_processes(tmp_path, monkeypatch):
    """``benchmarks.ab --reference FILE`` hands each problem's run the digests FILE holds and
    writes back what it added, so that the next process (the next copy) finds them."""
    seen = []

    def record(shape, padding, reference, **_):
        seen.append(sorted(reference))
        ab.check_reference(reference, f"{shape.name} {padding}", torch.ones(4, 16))

    monkeypatch.setattr(ab, "run_case", _recording_run_case(record))
    path = str(tmp_path / "reference.pt")
    args = ["table", "--shapes", "0", "--paddings", "128", "--rounds", "1", "--reference", path]
    assert ab.main(args) == 0
    assert ab.main(args) == 0
    name = SHAPES[0].name
    assert seen == [[], [f"{name} 128"]]
    assert list(torch.load(path)) == [f"{name} 128"]


def test_outputs_are_checked_against_the_first_processs_digest():
    """The first output of a problem is kept as a digest; later ones (other processes: other
    copies) are checked against it within 1e-2, as the outputs themselves would be."""
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(300, 512, generator=gen).to(torch.bfloat16)
    reference = {}
    assert ab.check_reference(reference, "s | padding 128", out) is None
    assert set(reference) == {"s | padding 128"} and reference["s | padding 128"].shape == (300, 8)
    assert ab.check_reference(reference, "s | padding 128", out.clone()) is None
    near = out.float() + 1e-3 * torch.randn(300, 512, generator=gen)
    assert ab.check_reference(reference, "s | padding 128", near) is None
    wrong = out.float() + 0.1 * torch.randn(300, 512, generator=gen)
    error = ab.check_reference(reference, "s | padding 128", wrong)
    assert error is not None and error.endswith("against the reference")
    assert 0.05 < float(error.split()[2]) < 0.2  # about the outputs' own distance, 0.1
    assert ab.check_reference(reference, "s | padding 128", out[:299]) == "rel err inf against the reference"
    assert ab.check_reference(reference, "s | padding 128", torch.full_like(out, float("nan"))) is not None
