"""The row-tile handoff of the ``experts`` op's Gluon pair (``GluonConfig.handoff``, Hopper).

The fused GEMM (PDL primary) adds to a flag per row tile of ``act`` as its tiles are stored; the
down GEMM (PDL dependent) takes its items from a global counter and waits per row tile for its
flag instead of for the whole fused grid. What must hold, checked on NaN-poisoned ``act`` and
``out`` with segments skewed so that fused programs finish far apart:

- the down GEMM never reads a row tile of ``act`` early (no NaN; the result bit-equal to the
  pair without PDL, which runs each item the same way);
- every real row tile is signalled exactly by all of its column tiles' threads, no other flag
  moves, and the counter was taken exactly once per item plus once per program (its last try);
- flags that never fill cost time, not a hang or a wrong result (the bounded polls' fallback);
- the op's route with a table that asks for it syncs nothing and replays in a CUDA graph with
  fresh routing (the state buffer is zeroed inside the graph, per replay).
"""

import dataclasses

import pytest
import torch

import moonep_ops

pytest.importorskip("triton")  # (test_cuda_pdl's imports need it)

from moonep_ops.kernels.cuda import experts  # noqa: E402
from moonep_ops.kernels.pdl import PdlRole  # noqa: E402
from .layouts import experts_inputs  # noqa: E402
from .reference import TOLERANCE, experts_ref, rel_err  # noqa: E402
from .test_cuda_capture import _capture, _copy_into  # noqa: E402
from .test_cuda_pdl import GLUON, MANY_GROUPS, SKEWED  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not GLUON, reason="the Gluon kernels need an sm90 GPU and a Triton with Gluon")]

# (fused config, down config, whether the fused GEMM zeroes out's tail): qwen3 S=2048's pair
# (cooperative, idle halves, the tail by the fused producer), ping-pong consumers on both sides
# with idle halves and the down producer's tail, and a split-epilogue down GEMM.
PAIRS = {
    "coop_idle_half_out_tail": (dict(block_n=128, pingpong=False, stages=4, skip_idle_half=True),
                                dict(pingpong=False, stages=6, tail_by_producer=False), True),
    "pingpong_idle_half_producer_tail": (dict(block_n=64, stages=6, pingpong=True),
                                         dict(stages=5, skip_idle_half=True, tail_by_producer=True), False),
    "split_epilogue_down": (dict(block_n=64, stages=6),
                            dict(pingpong=False, block_n=256, stages=4, epilogue_n=128, skip_idle_half=True), False),
}
PROGRAMS = 132


def _real_row_tiles(cu, block_m=128):
    sizes = torch.diff(cu.long(), prepend=cu.new_zeros(1).long()).clamp(min=0)
    return int(((sizes + block_m - 1) // block_m).sum())


def _launch_pair(gg, x, w_gate, w_up, w_down, rw, cu, act, out, fused_cfg, down_cfg, takes_tail, handoff=None,
                 use_pdl=True):
    act.fill_(float("nan"))
    gg.launch(x, w_gate, cu, act, PROGRAMS, w_up=w_up, route_weights=rw, zero_tail=False,
              role=PdlRole.PRIMARY if use_pdl else PdlRole.NONE, tail_out=out if takes_tail else None, handoff=handoff,
              **fused_cfg)
    gg.launch(act, w_down, cu, out, PROGRAMS, role=PdlRole.DEPENDENT if use_pdl else PdlRole.NONE, idle_weights=rw,
              zero_tail=not takes_tail, handoff=handoff, **down_cfg)


@pytest.mark.parametrize("layout", [SKEWED, MANY_GROUPS], ids=lambda lay: lay.name)
@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
def test_row_tile_handoff(pair, layout, repeats=20):
    from moonep_ops.kernels.gluon import host as gg
    from moonep_ops.kernels.gluon.config import GluonConfig

    fused_cfg, down_cfg, takes_tail = pair
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.empty(layout.nvs, layout.n, dtype=torch.bfloat16, device="cuda")
    out = torch.full((layout.nvs, layout.k), float("nan"), dtype=torch.bfloat16, device="cuda")
    target = gg.flag_target(GluonConfig(**fused_cfg), layout.n)
    _launch_pair(gg, x, w_gate, w_up, w_down, rw, cu, act, out, fused_cfg, down_cfg, takes_tail, use_pdl=False)
    plain = out.clone()
    real = _real_row_tiles(cu)
    items = real * -(-layout.k // GluonConfig(**down_cfg).block_n)
    for _ in range(repeats):  # a race shows up in some runs only: give it many chances
        out.fill_(float("nan"))
        sched = gg.handoff_state(layout.nvs, w_gate.shape[0], 128, "cuda")
        _launch_pair(gg, x, w_gate, w_up, w_down, rw, cu, act, out, fused_cfg, down_cfg, takes_tail,
                     gg.Handoff(sched, target))
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), "the down GEMM read a row tile of act before it was signalled"
        assert torch.equal(out, plain), "the handoff changed the result"
        flags = sched[1:]
        assert torch.equal(flags[:real], torch.full_like(flags[:real], target)), flags[:real].unique()
        assert not flags[real:].any()
        assert int(sched[0]) == items + PROGRAMS, (int(sched[0]), items)  # each program's last try too
    assert rel_err(out, experts_ref(x, w_gate, w_up, w_down, cu, rw)) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_flags_that_never_fill_fall_back_to_the_grid_wait():
    """The fused GEMM launched without the handoff: the down GEMM polls a bounded number of times
    per call, then waits for the whole fused grid: the right result, no hang."""
    from moonep_ops.kernels.gluon import host as gg

    layout = SKEWED
    fused_cfg, down_cfg, _ = PAIRS["coop_idle_half_out_tail"]
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.full((layout.nvs, layout.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = torch.full((layout.nvs, layout.k), float("nan"), dtype=torch.bfloat16, device="cuda")
    sched = gg.handoff_state(layout.nvs, w_gate.shape[0], 128, "cuda")
    gg.launch(x, w_gate, cu, act, PROGRAMS, w_up=w_up, route_weights=rw, zero_tail=False, role=PdlRole.PRIMARY,
              **fused_cfg)
    gg.launch(act, w_down, cu, out, PROGRAMS, role=PdlRole.DEPENDENT, idle_weights=rw,
              handoff=gg.Handoff(sched, flag_target=1), **down_cfg)
    torch.cuda.synchronize()
    assert not sched[1:].any()
    assert not torch.isnan(out).any()
    assert rel_err(out, experts_ref(x, w_gate, w_up, w_down, cu, rw)) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_handoff_needs_a_pdl_pair():
    from moonep_ops.kernels.gluon import host as gg

    layout = SKEWED
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.empty(layout.nvs, layout.n, dtype=torch.bfloat16, device="cuda")
    sched = gg.handoff_state(layout.nvs, w_gate.shape[0], 128, "cuda")
    with pytest.raises(ValueError, match="between a PDL primary and its dependent"):
        gg.launch(x, w_gate, cu, act, PROGRAMS, handoff=gg.Handoff(sched))


@pytest.mark.parametrize("pair", ["coop_idle_half_out_tail", "pingpong_idle_half_producer_tail"])
def test_experts_op_handoff_route(monkeypatch, pair):
    """The op's route with a table that asks for the handoff: no host sync, and a CUDA graph
    replayed with fresh routing."""
    from moonep_ops.kernels.gluon import config as cfgs
    from moonep_ops.kernels.gluon import host as gg

    fused_over, down_over, takes_tail = PAIRS[pair]
    table = cfgs.gluon_gemm_config

    def with_handoff(n, k, num_rows, fused, groups=0):
        cfg = table(n, k, num_rows, fused, groups)
        over = dict(fused_over, handoff=True, takes_out_tail=takes_tail) if fused else down_over
        return dataclasses.replace(cfg, **over)

    monkeypatch.setattr(cfgs, "gluon_gemm_config", with_handoff)
    monkeypatch.setattr(gg, "_PLANS", {})
    monkeypatch.setattr(experts, "_FLAG_TARGETS", {})
    layout = SKEWED
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    buffers = []
    real_state = gg.handoff_state
    monkeypatch.setattr(gg, "handoff_state", lambda *a: buffers.append(real_state(*a)) or buffers[-1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(buffers) == 1, "the op did not take the handoff"
    real = _real_row_tiles(cu)
    assert torch.equal(buffers[0][1:1 + real],
                       torch.full_like(buffers[0][1:1 + real], gg.flag_target(cfgs.GluonConfig(**fused_over),
                                                                              layout.n)))
    assert rel_err(out, experts_ref(x, w_gate, w_up, w_down, cu, rw)) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))
    static_out = torch.empty_like(out)
    graph, _ = _capture(lambda *t: moonep_ops.moonep_experts(*t[:6], out=t[6]), x, w_gate, w_up, w_down, cu, rw,
                        static_out)
    for seed in range(5):
        torch.manual_seed(100 + seed)
        _copy_into((x, w_gate, w_up, w_down, cu, rw), experts_inputs(layout, torch.bfloat16, "cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(static_out).any()
        assert rel_err(static_out, experts_ref(x, w_gate, w_up, w_down, cu, rw)) <= TOLERANCE[torch.bfloat16]
        assert torch.equal(static_out[layout.total:], torch.zeros_like(static_out[layout.total:]))
