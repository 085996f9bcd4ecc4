"""The ``experts`` op's programmatic dependent launch (Hopper): the down GEMM starts while the
fused GEMM finishes and must not read ``act`` before that kernel is done, nor write rows of
``out`` that are results (the Gluon kernel's consumers may zero tail rows early: no result of the
fused GEMM depends on them, even with ``out`` aliasing ``x``).

The race is made visible: ``act`` is poisoned with NaN before the pair runs, and the segments
are skewed so that some fused programs finish long before others (an early down program that
read ``act`` too soon would pick up NaN). Off Hopper the pair runs plainly; the tests still check
the results there.
"""

import pytest
import torch

import moonep_ops
from moonep_ops import flags

pytest.importorskip("triton")  # (the Triton kernels' module below imports it)

from moonep_ops.kernels.cuda import paths  # noqa: E402
from moonep_ops.kernels.cuda.paths import choose_fused, choose_unfused  # noqa: E402
from moonep_ops.kernels.pdl import PdlRole  # noqa: E402
from moonep_ops.kernels.triton import grouped_gemm as gemm  # noqa: E402
from .layouts import Layout, experts_inputs  # noqa: E402
from .reference import TOLERANCE, experts_ref, rel_err  # noqa: E402
from .test_cuda_capture import _capture, _copy_into  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Whether the ops' route takes the Gluon kernels here (sm90, bf16, TMA-aligned operands).
GLUON = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
         and paths.gluon_host() is not None and flags.gluon() and not flags.portable_only())

# One long segment next to many short ones: the programs of the long one finish last. H and I
# are TMA-aligned, so on Hopper both GEMMs take the TMA path, and the pair uses PDL.
SKEWED = Layout("pdl_skewed", (3072, *([128] * 24), 0, 7), 3072 + 24 * 128 + 7 + 61, k=1024, n=512,
                padded_to=1)
# Short first segments (40 and 100 rows, unpadded): the first items of many programs are tiles
# whose upper half lies past the segment's end, so a dependent down GEMM that skips idle halves
# sizes the weight loads it issues before the wait for such a tile (its `a` loads: half a box).
IDLE_FIRST = Layout("pdl_idle_first", (40, 100, 3072, *([128] * 8), 0, 7), 40 + 100 + 3072 + 8 * 128 + 7 + 61,
                    k=1024, n=512, padded_to=1)
MANY_GROUPS = Layout("pdl_g1100", tuple((i % 3) * 16 for i in range(1100)), 1100 * 16 + 5, k=256, n=128,
                     padded_to=1)


def _ran_on_gluon(call) -> bool:
    """Runs ``call()`` (one GEMM through :mod:`moonep_ops.kernels.cuda.paths`); returns whether the
    Gluon kernel took it (the Gluon host ran and did not decline the operands)."""
    host = paths.gluon_host()
    if host is None:
        call()
        return False
    results = []
    real_run = host.run

    def spy(*args, **kwargs):
        results.append(real_run(*args, **kwargs))
        return results[-1]

    host.run = spy
    try:
        call()
    finally:
        host.run = real_run
    return len(results) == 1 and results[0] is not host.GluonResult.NOT_APPLICABLE


def _pair(x, w_gate, w_up, w_down, rw, cu, act, out, use_pdl=True, kernels="triton"):
    """The pair on the Triton kernels, or (``kernels="ops"``) as the ops route it: on sm90 the
    Gluon kernels, whose dependent down GEMM issues its first weight loads before the wait."""
    act.fill_(float("nan"))
    primary = PdlRole.PRIMARY if use_pdl else PdlRole.NONE
    dependent = PdlRole.DEPENDENT if use_pdl else PdlRole.NONE
    if kernels == "ops":
        on_gluon = (
            _ran_on_gluon(lambda: paths.run_fused(x, w_gate, w_up, rw, cu, act, zero_tail=False, role=primary)),
            _ran_on_gluon(lambda: paths.run_unfused(act, w_down, cu, out, role=dependent)))
        assert all(on_gluon) == GLUON, f"expected the Gluon kernels: {GLUON}, ran on them: {on_gluon}"
        return
    gemm.run(x, w_gate, w_up, rw, cu, act, choose_fused, zero_tail=False, role=primary)
    gemm.run(act, w_down, None, None, cu, out, choose_unfused, role=dependent)


@pytest.mark.parametrize("kernels", ["triton", "ops"])
@pytest.mark.parametrize("layout", [SKEWED, MANY_GROUPS], ids=lambda lay: lay.name)
def test_dependent_down_gemm_waits_for_the_fused_gemm(layout, kernels):
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.empty(layout.nvs, layout.n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(layout.nvs, layout.k, dtype=torch.bfloat16, device="cuda")
    ref = experts_ref(x, w_gate, w_up, w_down, cu, rw)
    plain = torch.empty_like(out)
    _pair(x, w_gate, w_up, w_down, rw, cu, act, plain, use_pdl=False, kernels=kernels)
    for _ in range(20):  # a race shows up in some runs only: give it many chances
        out.fill_(float("nan"))
        _pair(x, w_gate, w_up, w_down, rw, cu, act, out, kernels=kernels)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), "the dependent GEMM read act before the fused GEMM wrote it"
        assert torch.equal(out, plain), "PDL changed the result"
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


@pytest.mark.parametrize("kernels", ["triton", "ops"])
def test_experts_pdl_graph_replay_with_poisoned_act(kernels):
    """In a CUDA graph (a programmatic edge between the two kernels), replayed with fresh routing."""
    layout = SKEWED
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.empty(layout.nvs, layout.n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(layout.nvs, layout.k, dtype=torch.bfloat16, device="cuda")
    graph, _ = _capture(lambda *t: _pair(*t, kernels=kernels), x, w_gate, w_up, w_down, rw, cu, act, out)
    for seed in range(5):
        torch.manual_seed(seed)
        _copy_into((x, w_gate, w_up, w_down, cu, rw), experts_inputs(layout, torch.bfloat16, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        assert torch.equal(out, moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw))
        assert rel_err(out, experts_ref(x, w_gate, w_up, w_down, cu, rw)) <= TOLERANCE[torch.bfloat16]


# Forced Gluon configs of the pair (the table picks by shape): the dependent down GEMM with the
# tail zeroed by its producer (after the wait) and ping-pong consumers, or by cooperative consumers.
GLUON_PAIRS = {
    "pingpong_down_tail_by_producer": (dict(block_n=64, stages=6), dict(stages=5, tail_by_producer=True)),
    "coop_down_tail_by_consumers": (dict(pingpong=False, stages=4),
                                    dict(pingpong=False, stages=6, tail_by_producer=False)),
    # idle upper halves skipped by the down GEMM (and only the lower half of their act rows loaded),
    # with both kinds of consumers
    "coop_down_idle_half": (dict(pingpong=False, stages=4), dict(pingpong=False, stages=6, skip_idle_half=True)),
    "pingpong_down_idle_half": (dict(block_n=64, stages=6), dict(stages=5, skip_idle_half=True)),
}


@pytest.mark.skipif(not GLUON, reason="the Gluon kernels need an sm90 GPU and a Triton with Gluon")
@pytest.mark.parametrize("layout", [SKEWED, IDLE_FIRST], ids=lambda lay: lay.name)
@pytest.mark.parametrize("configs", GLUON_PAIRS.values(), ids=GLUON_PAIRS.keys())
def test_gluon_dependent_down_gemm_waits_for_the_fused_gemm(configs, layout):
    from moonep_ops.kernels.gluon import host as gg

    fused_cfg, down_cfg = configs
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.empty(layout.nvs, layout.n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(layout.nvs, layout.k, dtype=torch.bfloat16, device="cuda")

    def pair(use_pdl):
        act.fill_(float("nan"))
        gg.launch(x, w_gate, cu, act, 132, w_up=w_up, route_weights=rw, zero_tail=False,
                  role=PdlRole.PRIMARY if use_pdl else PdlRole.NONE, **fused_cfg)
        gg.launch(act, w_down, cu, out, 132, role=PdlRole.DEPENDENT if use_pdl else PdlRole.NONE, idle_weights=rw,
                  **down_cfg)

    pair(False)
    plain = out.clone()
    for _ in range(20):
        out.fill_(float("nan"))
        pair(True)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), "the dependent GEMM read act before the fused GEMM wrote it"
        assert torch.equal(out, plain), "PDL changed the result"
    assert rel_err(out, experts_ref(x, w_gate, w_up, w_down, cu, rw)) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_experts_op_plans_the_pair_as_pdl_on_hopper_only():
    """What the op launches: PDL roles on the Hopper TMA path, plain launches elsewhere."""
    layout = SKEWED
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.empty(layout.nvs, layout.n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(layout.nvs, layout.k, dtype=torch.bfloat16, device="cuda")
    fused = gemm.make_plan(x, w_gate, w_up, rw, act, *choose_fused(x, w_gate, w_up), zero_tail=False,
                           role=PdlRole.PRIMARY)
    down = gemm.make_plan(act, w_down, None, None, out, *choose_unfused(act, w_down, None),
                          role=PdlRole.DEPENDENT)
    hopper = torch.cuda.get_device_capability() >= (9, 0) and choose_unfused(act, w_down, None)[1]
    assert fused.constexprs["LAUNCH_DEPENDENTS"] is bool(hopper)
    assert down.constexprs["WAIT_PRIOR"] is bool(hopper) and down.launch_pdl is bool(hopper)
    if hopper:  # the first pipeline stages of each weight row: 16-byte multiples
        assert down.constexprs["PREFETCH_BYTES"] > 0 and down.constexprs["PREFETCH_BYTES"] % 16 == 0
