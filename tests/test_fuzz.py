"""Property-based tests of every op (tests/fuzz_strategies.py: strategies and the op table).

Each example is a random MoonEP-layout problem (G in 1..2000, empty runs, padded or not, a
NaN tail, odd K/N, bf16/fp16/fp32, route weights or None, contiguous or strided inputs),
checked against the float64 reference: no NaN leaked, tail rows exactly zero, output
buffers poisoned. Same properties on CPU and, when there is a GPU, on CUDA.

Profiles (environment):
  MOONEP_OPS_FUZZ=ci (default)  a few hundred examples per op and device, bounded time (CI)
  MOONEP_OPS_FUZZ=long          thousands per op (the GPU script)
  MOONEP_OPS_FUZZ_EXAMPLES=N    overrides the example count of either profile
  MOONEP_OPS_FUZZ_SEED=S        the seed (default fixed, so CI runs are reproducible);
                                "random" draws a fresh one each run
  MOONEP_OPS_FUZZ_SHARDS=M      M test items per op and device, seeds S..S+M-1, each running
                                the example count over M (so pytest-xdist spreads one op)
  MOONEP_OPS_FUZZ_FAILURE_LOG=F every failing example (the first, then hypothesis's shrinks) is
                                appended to file F at once, so a run cut short (a device call's
                                time limit) still says what failed
No example database is kept: a failure prints the problem, a ``check(...)`` repro line and
hypothesis's ``@reproduce_failure`` blob.
"""

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from moonep_ops.schemas import SCHEMAS
from .conftest import DEVICES
from .fuzz_strategies import (CPU_BUDGET, CUDA_BUDGET, KAPPA_TYPICAL, MAX_G, OPS, OPS_BY_NAME, Problem,
                              _as_tuple, check, condition_numbers, make_layout, problems)
from .reference import TOLERANCE, rel_err

PROFILE = os.environ.get("MOONEP_OPS_FUZZ", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"MOONEP_OPS_FUZZ must be 'ci' or 'long', got {PROFILE!r}")
_DEFAULT_EXAMPLES = {"ci": 200, "long": 2000}
_COMMON = dict(
    deadline=None,  # example time varies with size and with Triton's first-call JIT
    print_blob=True,
    database=None,  # reproducibility comes from the seed, not from a local example file
    # The autouse seeding fixture in conftest is harmless here (data comes from each
    # problem's own generator); large-G draws are legitimately slow to generate.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)
SHARDS = int(os.environ.get("MOONEP_OPS_FUZZ_SHARDS", "1"))
if SHARDS < 1:
    raise ValueError(f"MOONEP_OPS_FUZZ_SHARDS must be >= 1, got {SHARDS}")
for _name, _count in _DEFAULT_EXAMPLES.items():
    _total = int(os.environ.get("MOONEP_OPS_FUZZ_EXAMPLES", _count))
    settings.register_profile(f"moonep-fuzz-{_name}", max_examples=-(-_total // SHARDS), **_COMMON)
FUZZ_SETTINGS = settings.get_profile(f"moonep-fuzz-{PROFILE}")

_SEED = os.environ.get("MOONEP_OPS_FUZZ_SEED", "20261130")


@pytest.fixture(autouse=True)
def _one_cpu_thread(request):
    """CPU examples are small: one intra-op thread avoids OpenMP fork/join and spin-wait
    costs that made them ~100x slower on a busy 2-core machine (measured). CUDA runs keep
    the default threads for the host-side float64 reference."""
    params = getattr(request.node, "callspec", None)
    if params is None or params.params.get("device") != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _log_failure(item: str, problem, exc: Exception) -> None:
    path = os.environ.get("MOONEP_OPS_FUZZ_FAILURE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{item}: {problem!r}: {type(exc).__name__}: {str(exc)[:500]}\n")


def _seeded(fn, shard):
    """A fixed seed (not ``derandomize``): the same examples every CI run, and a nightly or a
    developer can vary it without touching the code. Shard i runs seed S+i."""
    return fn if _SEED == "random" else seed(int(_SEED) + shard)(fn)


@pytest.mark.parametrize("shard", range(SHARDS), ids=[f"shard{i}" for i in range(SHARDS)])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", OPS, ids=[spec.name for spec in OPS])
def test_fuzz(spec, device, shard):
    budget = CUDA_BUDGET if device == "cuda" else CPU_BUDGET

    # The property is built per item so that each shard gets its own seed.
    @FUZZ_SETTINGS
    @given(data=st.data())
    def prop(data):
        problem = data.draw(problems(budget, spec.dtypes), label="problem")
        try:
            check(spec, problem, device)
        except Exception as exc:
            _log_failure(f"{spec.name}[{device}, shard{shard}]", problem, exc)
            raise

    _seeded(prop, shard)()


def _p(num_groups, *, padded=False, p_empty=0.3, max_run=4, max_real=20, tail=5, k=24, n=40,
       dtype=torch.float32, with_weights=True, strided=False, strided_meta=False, layout_seed=0,
       max_rows=3072, data_seed=1):
    return Problem(num_groups, padded, p_empty, max_run, max_real, layout_seed, max_rows, tail,
                   k, n, dtype, with_weights, strided, strided_meta, data_seed=data_seed)


# Corners the random search reaches only by luck; every op runs each of them.
EDGE_CASES = {
    "nvs0": _p(3, p_empty=1.0, tail=0),
    "all_empty_with_tail": _p(5, p_empty=1.0, tail=17),
    "g1_no_tail": _p(1, p_empty=0.0, tail=0),
    "k1_n1": _p(4, k=1, n=1),
    "k1100_n1100_few_rows": _p(2, max_real=3, k=1100, n=1100, dtype=torch.bfloat16, max_rows=6),
    "g2000_sparse_padded": _p(MAX_G, padded=True, p_empty=0.95, max_run=64, k=16, n=24, dtype=torch.bfloat16),
    "g2000_dense_unpadded": _p(MAX_G, p_empty=0.0, max_real=1, k=8, n=8, dtype=torch.float16),
    "strided_no_weights": _p(7, strided=True, with_weights=False, k=33, n=17, dtype=torch.bfloat16),
    "strided_route_weights_and_cu": _p(9, strided_meta=True, k=20, n=12, dtype=torch.float16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
@pytest.mark.parametrize("spec", OPS, ids=[spec.name for spec in OPS])
def test_edge_cases(spec, case, device):
    problem = EDGE_CASES[case]
    if problem.dtype not in spec.dtypes:  # the FP8 ops take 16-bit activations only
        problem = dataclasses.replace(problem, dtype=spec.dtypes[0])
    check(spec, problem, device)


def test_every_op_has_a_fuzz_entry():
    """A new op in moonep_ops/schemas.py needs its one-entry OpSpec in fuzz_strategies.py."""
    fuzzed = {spec.moonep_op for spec in OPS}
    assert set(SCHEMAS) <= fuzzed, f"no fuzz entry for {sorted(set(SCHEMAS) - fuzzed)}"


def test_edge_cases_are_what_they_claim():
    assert EDGE_CASES["nvs0"].nvs == 0
    assert EDGE_CASES["all_empty_with_tail"].total == 0 < EDGE_CASES["all_empty_with_tail"].nvs
    sparse = EDGE_CASES["g2000_sparse_padded"]
    assert sparse.num_groups == 2000 and 0 < sparse.total and all(s % 128 == 0 for s in sparse.sizes)
    assert sum(1 for s in sparse.sizes if s) < 200
    assert all(s == 1 for s in EDGE_CASES["g2000_dense_unpadded"].sizes)


def test_strategy_covers_the_space():
    """The strategy must keep reaching the corners the issue lists; a refactor that
    silently narrowed it would make test_fuzz pass without testing much."""
    seen = []

    @seed(0)
    @settings(max_examples=400, **_COMMON)
    @given(problems(CPU_BUDGET))
    def collect(p):
        seen.append(p)

    collect()
    groups = [p.num_groups for p in seen]
    assert min(groups) == 1 and max(groups) > 1024 and sum(g <= 8 for g in groups) > 40
    assert any(p.padded and p.total > 0 for p in seen) and any(not p.padded and p.total > 0 for p in seen)
    assert any(p.nvs == 0 for p in seen) and any(p.tail == 0 < p.total for p in seen)
    assert sum(p.tail > 0 for p in seen) > len(seen) // 3
    assert any(0 in p.sizes[1:-1] and p.total > 0 for p in seen), "no empty segment between non-empty ones"
    assert any(p.sizes[0] == 0 and p.total > 0 for p in seen) and any(p.sizes[-1] == 0 and p.total > 0 for p in seen)
    assert max(p.k for p in seen) > 512 and max(p.n for p in seen) > 512
    assert any(p.k % 8 and p.n % 8 for p in seen) and any(p.k == 1 for p in seen)
    assert {p.dtype for p in seen} == {torch.bfloat16, torch.float16, torch.float32}
    assert {p.with_weights for p in seen} == {p.strided for p in seen} == {p.strided_meta for p in seen} == {True, False}
    for p in seen:  # and never past the budget (a tail of up to 8 rows may go over it)
        assert p.total <= CPU_BUDGET.rows and p.nvs <= CPU_BUDGET.rows + 8
        assert p.nvs * max(p.k, p.n) <= CPU_BUDGET.row_elems
        assert p.num_groups * p.k * p.n <= CPU_BUDGET.weight_elems
        assert p.total * p.k * p.n <= CPU_BUDGET.macs


def test_make_layout_trims_to_budget():
    sizes, real = make_layout(1500, 128, 0.0, 8, 300, seed=3, max_rows=4096)
    assert sum(sizes) <= 4096 and len(sizes) == 1500
    assert all(s % 128 == 0 and (s == 0) == (r == 0) and s - 128 < r <= s for s, r in zip(sizes, real))


# Found by the long profile on the H200: correct results that miss the float64
# reference by more than the fixed tolerance because the output is a sum that cancels (K = 1,
# one live row): CPU kernels miss it alike. check() widens the bound by the condition number.
_ONE_LIVE_ROW = dict(padded=True, p_empty=0.0, max_run=1, max_real=1, k=1, max_rows=8192)
ILL_CONDITIONED = {
    "experts_k1_one_row_tile": ("moonep_experts", _p(1, tail=0, n=618, dtype=torch.bfloat16, with_weights=False,
                                                      data_seed=111, **_ONE_LIVE_ROW)),
    "d_rw_cancels": ("silu_mul_weight_backward", _p(1, tail=1, n=432, data_seed=4145, **_ONE_LIVE_ROW)),
    # The H200 long profile again: one live row's d route_weights, a sum of 1001
    # products; the CUDA kernel's error (2.1e-4) is below the CPU kernel's (2.3e-4), but a
    # one-draw condition number came out at 65 (the bound needed 85): condition_numbers now
    # takes the root mean square of KAPPA_DRAWS draws.
    "d_rw_long_sum": ("grouped_gemm_silu_mul_backward",
                      _p(1, tail=1, n=1001, data_seed=789, **dict(_ONE_LIVE_ROW, k=95))),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(ILL_CONDITIONED))
def test_ill_conditioned_cases(case, device):
    name, p = ILL_CONDITIONED[case]
    spec = OPS_BY_NAME[name]
    t = spec.inputs(p, "cpu")
    assert max(condition_numbers(spec, t, _as_tuple(spec.ref(t)), p.dtype)) > 3 * KAPPA_TYPICAL
    check(spec, p, device)


# CPU fuzz draws with a random seed: one live segment, K = 1, bf16. Each output is one sum of N
# products of ``act``, which the kernels store in bf16, and the sum cancels: rounding ``act``
# alone moves the float64 result by 0.9% (N = 3, one row) and 1.7% (N = 398, 39 rows), where
# perturbing the inputs alone puts the typical error at 1.01% and 1.42%.
ROUNDED_ACT = {
    "three_products": _p(3, padded=True, p_empty=0.9, max_run=1, max_real=1, layout_seed=5351, tail=0, k=1, n=3,
                         dtype=torch.bfloat16, strided=True, strided_meta=True, data_seed=1398356),
    "long_sums": _p(1, p_empty=0.0, max_run=1, max_real=61, layout_seed=398, tail=1198, k=1, n=398,
                    dtype=torch.bfloat16, with_weights=False, data_seed=17379),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(ROUNDED_ACT))
def test_a_rounded_intermediate_widens_the_bound(case, device):
    """The rounding of ``act`` counts in the condition number, and where one rounding still passes
    the typical error, the output must match float64 with ``act`` rounded as the op stores it."""
    p = ROUNDED_ACT[case]
    spec = OPS_BY_NAME["experts"]
    t = spec.inputs(p, "cpu")
    refs = _as_tuple(spec.ref(t))
    inputs_only = condition_numbers(dataclasses.replace(spec, rounded_ref=None), t, refs, p.dtype)[0]
    assert condition_numbers(spec, t, refs, p.dtype)[0] > 1.2 * inputs_only
    check(spec, p, device)
    check(OPS_BY_NAME["moonep_experts"], p, device)


def test_a_wrong_intermediate_still_fails(monkeypatch):
    """The rounded reference excuses the rounding, not a wrong answer: a result 5% off (as from an
    ``act`` 5% off) fails on the same problem."""
    p = ROUNDED_ACT["long_sums"]
    spec = OPS_BY_NAME["experts"]

    def wrong_call(t):
        return dataclasses.replace(spec, rounded_ref=None).ref(
            {**t, "w_down": t["w_down"].double() * 1.05}).to(p.dtype)

    with pytest.raises(AssertionError, match="against float64 with the intermediate rounded"):
        check(dataclasses.replace(spec, call=wrong_call), p, "cpu")


# A CPU fuzz draw with a random seed: K = 1 and e4m3 weights make exact ratios between act's
# elements, so scaled act values fall on the midpoint between two e4m3 codes (168, between 160 and
# 176). Computed in fp32, 21 of them round the other way than from float64: 1.2% off the float64
# semantics, 0.12% (the bf16 output's rounding) off them once the ties are allowed either way.
E4M3_TIES = _p(8, p_empty=0.25, max_run=9, max_real=256, layout_seed=287, tail=1, k=1, n=176,
               dtype=torch.bfloat16, data_seed=410)


@pytest.mark.parametrize("device", DEVICES)
def test_act_rounding_ties_are_room_not_error(device):
    spec = OPS_BY_NAME["experts_fp8"]
    t = spec.inputs(E4M3_TIES, "cpu")
    slack, = _as_tuple(spec.slack(t, "cpu"))
    assert (slack > 0).any()
    assert rel_err(spec.call(t), spec.ref(t)) > TOLERANCE[torch.bfloat16], "the case no longer needs the room"
    check(spec, E4M3_TIES, device)
    check(OPS_BY_NAME["experts_fp8_out"], E4M3_TIES, device)


def test_a_wrong_fp8_answer_still_fails():
    """The ties' room excuses their rounding, not a wrong answer: 5% off fails on the same problem."""
    spec = OPS_BY_NAME["experts_fp8"]
    wrong = dataclasses.replace(spec, call=lambda t: spec.call(t) * 1.05)
    with pytest.raises(AssertionError, match="rel err"):
        check(wrong, E4M3_TIES, "cpu")


def test_condition_numbers_are_stable():
    """The estimate that widens the bound must not hinge on one lucky draw: for a scalar
    output (one live row's d route_weights) independent seeds agree within 2.5x."""
    name, p = ILL_CONDITIONED["d_rw_long_sum"]
    spec = OPS_BY_NAME[name]
    t = spec.inputs(p, "cpu")
    refs = _as_tuple(spec.ref(t))
    kappas = [condition_numbers(spec, t, refs, p.dtype, seed=s)[2] for s in (0, 10 ** 6, 2 * 10 ** 6)]
    assert max(kappas) < 2.5 * min(kappas), kappas


@pytest.mark.parametrize("name", ["grouped_gemm", "moonep_experts", "silu_mul_weight_backward"])
def test_typical_problems_are_well_conditioned(name):
    """The widened bound must stay the exception: random problems keep the fixed tolerance."""
    spec = OPS_BY_NAME[name]
    kappas = []

    @seed(1)
    @settings(max_examples=25, **_COMMON)
    @given(problems(CPU_BUDGET, spec.dtypes))
    def collect(p):
        if p.total:
            t = spec.inputs(p, "cpu")
            kappas.extend(condition_numbers(spec, t, _as_tuple(spec.ref(t)), p.dtype))

    collect()
    assert len(kappas) >= 10 and sum(k <= KAPPA_TYPICAL for k in kappas) >= 0.9 * len(kappas), sorted(kappas)


def test_a_wrong_answer_still_fails():
    """A 5% error on a well-conditioned problem is not excused by the condition number."""
    spec = OPS_BY_NAME["grouped_gemm"]
    wrong = dataclasses.replace(spec, call=lambda t: spec.call(t) * 1.05)
    with pytest.raises(AssertionError, match="rel err"):
        check(wrong, _p(4, k=64, n=48, dtype=torch.bfloat16), "cpu")
