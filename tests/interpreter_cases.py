"""Cases for the Triton kernels on CPU tensors, run by test_triton_interpreter.py in a
subprocess with ``TRITON_INTERPRET=1`` (Triton's own ``@jit`` helpers pick the interpreter
when Triton is imported, so the variable must be set before that). fp32/fp16 only: the
interpreter's bf16 ``tl.dot`` is wrong (triton issue 11584).
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_triton_interpreter.py with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from moonep_ops.kernels.triton import configs  # noqa: E402
from .layouts import (LAYOUTS, Layout, experts_inputs, grouped_gemm_inputs,  # noqa: E402
                      silu_mul_weight_inputs)
from .reference import (TOLERANCE, grouped_gemm_ref, grouped_gemm_silu_mul_ref, rel_err,  # noqa: E402
                        silu_mul_weight_ref)

# g1100 takes minutes in the interpreter; g600_sparse crosses several cu_seqlens scan
# chunks (BLOCK_G = 256) with a small grid instead.
INTERP_LAYOUTS = [lay for lay in LAYOUTS if lay.name != "g1100"] + [
    Layout("g600_sparse", tuple(3 if g % 97 == 5 else 0 for g in range(600)) + (2,), 40, k=20, n=24),
    # More groups than the in-register schedule holds (SMALL_G_MAX = 1024): the chunked scan.
    Layout("g1100_sparse", tuple(2 if g % 211 == 7 else 0 for g in range(1100)) + (1,), 24, k=20, n=24),
]


@pytest.fixture(scope="module")
def interpreted():
    from moonep_ops.kernels.triton import grouped_gemm, silu_mul_weight

    return grouped_gemm, silu_mul_weight, grouped_gemm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", INTERP_LAYOUTS, ids=[lay.name for lay in INTERP_LAYOUTS])
def test_grouped_gemm_interpreted(interpreted, layout, dtype):
    gemm = interpreted[0]
    a, w, cu = grouped_gemm_inputs(layout, dtype)
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype)
    gemm.launch_grouped_gemm(a, w, cu, out, configs.INTERPRETER_GEMM)
    assert not torch.isnan(out).any()
    assert rel_err(out, grouped_gemm_ref(a, w, cu)) <= TOLERANCE[dtype]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_grouped_gemm_interpreted_strided(interpreted):
    """Non-contiguous a and w (transposed storage) go through the stride arguments."""
    gemm = interpreted[0]
    layout = LAYOUTS[0]
    a, w, cu = grouped_gemm_inputs(layout, torch.float32)
    a_t = a.t().contiguous().t()
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.full((layout.nvs, layout.n), float("nan"))
    gemm.launch_grouped_gemm(a_t, w_t, cu, out, configs.INTERPRETER_GEMM)
    assert rel_err(out, grouped_gemm_ref(a, w, cu)) <= TOLERANCE[torch.float32]


def test_broadcast_inputs_interpreted(interpreted):
    """Inputs with a stride of 0 (one row over NvS, one weight row for every group and row), the
    pointer path that sm90 gives them too (no TMA over a zero stride): plain and fused GEMM."""
    gemm = interpreted[0]
    layout = Layout("broadcast", (5, 0, 9, 3), 20, k=24, n=16)
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.float32)
    x, w_gate = x[:1].expand(x.shape), w_gate[:1, :1].expand(w_gate.shape)
    assert not gemm.tma_usable(x, w_gate)
    out = torch.full((layout.nvs, layout.n), float("nan"))
    gemm.launch_grouped_gemm(x, w_gate, cu, out, configs.INTERPRETER_GEMM)
    assert rel_err(out, grouped_gemm_ref(x, w_gate, cu)) <= TOLERANCE[torch.float32]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))
    out = torch.full((layout.nvs, layout.n), float("nan"))
    gemm.launch_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu, out, configs.INTERPRETER_GEMM)
    assert rel_err(out, grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)) <= TOLERANCE[torch.float32]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", INTERP_LAYOUTS, ids=[lay.name for lay in INTERP_LAYOUTS])
def test_silu_mul_weight_interpreted(interpreted, layout, dtype, with_weights):
    act = interpreted[1]
    gate, up, rw, cu = silu_mul_weight_inputs(layout, dtype, with_weights=with_weights)
    out = torch.full_like(gate, float("nan"))
    act.launch_silu_mul_weight(gate, up, rw, cu, out, configs.INTERPRETER_ELTWISE)
    assert not torch.isnan(out).any()
    assert rel_err(out, silu_mul_weight_ref(gate, up, rw, cu)) <= TOLERANCE[dtype]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_invalid_cu_seqlens_stay_in_bounds(interpreted):
    """cu_seqlens[-1] > NvS (invalid, unchecked on CUDA) must not write past the buffer."""
    gemm = interpreted[0]
    a = torch.randn(20, 8)
    w = torch.randn(2, 4, 8)
    cu = torch.tensor([5, 50], dtype=torch.int32)
    storage = torch.full((30, 4), 7.0)
    out = storage[:20]
    gemm.launch_grouped_gemm(a, w, cu, out, configs.INTERPRETER_GEMM)
    assert torch.equal(storage[20:], torch.full((10, 4), 7.0)), "wrote past NvS"
    assert rel_err(out[:5], a[:5].double() @ w[0].double().T) <= 1e-5


# The fused kernel is the slowest to interpret: fp32 everywhere, fp16 on a few layouts.
FUSED_CASES = [(lay, torch.float32) for lay in INTERP_LAYOUTS] + [
    (lay, torch.float16) for lay in INTERP_LAYOUTS if lay.name in ("unpadded", "tail_rows", "g600_sparse", "g1100_sparse")]


@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("layout,dtype", FUSED_CASES, ids=[f"{lay.name}-{dt}" for lay, dt in FUSED_CASES])
def test_grouped_gemm_silu_mul_interpreted(interpreted, layout, dtype, with_weights):
    fused = interpreted[2]
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype, with_weights=with_weights)
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype)
    fused.launch_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu, out, configs.INTERPRETER_GEMM)
    assert not torch.isnan(out).any()
    assert rel_err(out, grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)) <= TOLERANCE[dtype]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_fused_without_tail_zeroing_leaves_the_tail_alone(interpreted):
    """``zero_tail=False`` (the experts op's intermediate act): the live rows are the same, bitwise,
    and the tail rows keep what they held (never written)."""
    gemm = interpreted[0]
    layout = next(lay for lay in INTERP_LAYOUTS if lay.name == "tail_rows")
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.float32)
    full = torch.full((layout.nvs, layout.n), float("nan"))
    partial = full.clone()
    gemm.launch_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu, full, configs.INTERPRETER_GEMM)
    gemm.launch_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu, partial, configs.INTERPRETER_GEMM, zero_tail=False)
    assert layout.total < layout.nvs
    assert torch.equal(partial[:layout.total], full[:layout.total])
    assert torch.isnan(partial[layout.total:]).all()
    assert torch.equal(full[layout.total:], torch.zeros_like(full[layout.total:]))


SAVE_CASES = [(lay, torch.float32) for lay in INTERP_LAYOUTS if lay.name != "g1100_sparse"] + [
    (lay, torch.float16) for lay in INTERP_LAYOUTS if lay.name in ("unpadded", "tail_rows", "g600_sparse")]


def _check_saved_outputs(act, gate, up, x, w_gate, w_up, rw, cu, layout, dtype):
    """gate and up are the two projections; act is silu_mul_weight of those *rounded* values
    (so it matches the unfused ops); every tail row of all three is zero."""
    for t in (act, gate, up):
        assert not torch.isnan(t).any()
        assert torch.equal(t[layout.total:], torch.zeros_like(t[layout.total:]))
    assert rel_err(gate, grouped_gemm_ref(x, w_gate, cu)) <= TOLERANCE[dtype]
    assert rel_err(up, grouped_gemm_ref(x, w_up, cu)) <= TOLERANCE[dtype]
    assert rel_err(act, silu_mul_weight_ref(gate, up, rw, cu)) <= TOLERANCE[dtype]
    assert rel_err(act, grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("layout,dtype", SAVE_CASES, ids=[f"{lay.name}-{dt}" for lay, dt in SAVE_CASES])
def test_grouped_gemm_silu_mul_with_gate_up_interpreted(interpreted, layout, dtype, with_weights):
    gemm = interpreted[0]
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype, with_weights=with_weights)
    act, gate, up = (torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype) for _ in range(3))
    gemm.launch_grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu, act, gate, up, configs.INTERPRETER_GEMM)
    _check_saved_outputs(act, gate, up, x, w_gate, w_up, rw, cu, layout, dtype)


def test_saving_gate_up_needs_matching_outputs(interpreted):
    gemm = interpreted[0]
    layout = LAYOUTS[0]
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.float32)
    act = torch.empty(layout.nvs, layout.n)
    with pytest.raises(ValueError, match="saving gate and up"):
        gemm.launch_grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu, act, act.t().contiguous().t(), act,
                                                       configs.INTERPRETER_GEMM)


def test_cuda_impls_accept_strided_cu_seqlens_and_route_weights():
    """The registered CUDA functions (run here on CPU tensors through the interpreter) must give
    the same result for strided views of cu_seqlens/route_weights as for dense copies: the
    kernels index both as dense vectors (found by the CUDA fuzz run on the H200)."""
    from moonep_ops.kernels.cuda import register as fwd
    from moonep_ops.kernels.cuda import register as bwd

    g, n, k, nvs = 3, 5, 7, 20
    cu = torch.tensor([4, 99, 9, 99, 15, 99], dtype=torch.int32)[::2]
    rw = (torch.rand(2 * nvs) + 0.1)[::2]
    grad, gate, up = torch.randn(nvs, n), torch.randn(nvs, n), torch.randn(nvs, n)
    x, w, w2 = torch.randn(nvs, k), torch.randn(g, n, k), torch.randn(g, n, k)
    cases = {
        "grouped_gemm": (fwd.grouped_gemm, (x, w, cu)),
        "grouped_gemm_silu_mul": (fwd.grouped_gemm_silu_mul, (x, w, w2, rw, cu)),
        "grouped_gemm_silu_mul_with_gate_up": (fwd.grouped_gemm_silu_mul_with_gate_up, (x, w, w2, rw, cu)),
        "silu_mul_weight": (fwd.silu_mul_weight, (gate, up, rw, cu)),
        "grouped_gemm_dgrad": (bwd.grouped_gemm_dgrad, (grad, w, cu)),
        "grouped_gemm_dual_dgrad": (bwd.grouped_gemm_dual_dgrad, (grad, 2 * grad, w, w2, cu)),
        "grouped_gemm_wgrad": (bwd.grouped_gemm_wgrad, (grad, x, cu)),
        "silu_mul_weight_backward": (bwd.silu_mul_weight_backward, (grad, gate, up, rw, cu)),
        "grouped_gemm_silu_mul_backward": (bwd.grouped_gemm_silu_mul_backward, (grad, x, w, w2, rw, cu)),
    }
    for name, (fn, args) in cases.items():
        dense = [a.contiguous() for a in args]
        got, want = fn(*args), fn(*dense)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for o, r in zip(got, want):
            assert torch.allclose(o, r), name


# The Hopper schedule knobs (TMA loads and stores, flattened or warp-specialized persistent
# loop): the interpreter ignores the scheduling hints but runs the same indexing, including the
# split between TMA-stored full tiles and masked partial ones. fp16: TMA needs 16-byte rows.
SCHEDULES = [
    configs.GemmConfig(16, 16, 16, 1, 1, tma_store=1),
    configs.GemmConfig(16, 32, 16, 1, 1, warp_specialize=True, tma_store=2),
    configs.GemmConfig(16, 16, 16, 1, 1, flatten=True),
    configs.GemmConfig(16, 16, 16, 1, 1, flatten=True, group_major=True),
    configs.GemmConfig(16, 16, 16, 1, 1, tma_store=1, group_major=True),
]
SCHEDULE_LAYOUTS = [lay for lay in INTERP_LAYOUTS if lay.name in ("unpadded", "tail_rows", "moonep_padded", "one_segment")]


@pytest.mark.parametrize("fused", [False, True, "save"], ids=["plain", "fused", "fused_save"])
@pytest.mark.parametrize("cfg", SCHEDULES, ids=["tma_store", "ws_tma_store_halves", "flatten", "flatten_group_major",
                                                "tma_store_group_major"])
@pytest.mark.parametrize("layout", SCHEDULE_LAYOUTS, ids=[lay.name for lay in SCHEDULE_LAYOUTS])
def test_schedules_interpreted(interpreted, layout, cfg, fused):
    gemm = interpreted[0]
    dtype = torch.float16
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype, with_weights=True)
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype)
    assert gemm.tma_usable(x, w_gate, w_up) and gemm.tma_addressable(out)
    if fused == "save":
        gate, up = torch.full_like(out, float("nan")), torch.full_like(out, float("nan"))
        gemm.launch_grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu, out, gate, up, cfg, use_tma=True)
        _check_saved_outputs(out, gate, up, x, w_gate, w_up, rw, cu, layout, dtype)
        return
    if fused:
        gemm.launch_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu, out, cfg, use_tma=True)
        ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    else:
        gemm.launch_grouped_gemm(x, w_gate, cu, out, cfg, use_tma=True)
        ref = grouped_gemm_ref(x, w_gate, cu)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) <= TOLERANCE[dtype]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("layout", SCHEDULE_LAYOUTS, ids=[lay.name for lay in SCHEDULE_LAYOUTS])
def test_group_major_portable_interpreted(interpreted, layout, fused):
    """``group_major`` is an item order, not a Hopper knob: the portable path keeps it too."""
    gemm = interpreted[0]
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.float32, with_weights=True)
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=torch.float32)
    cfg = configs.GemmConfig(16, 16, 16, 1, 1, group_major=True)
    if fused:
        gemm.launch_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu, out, cfg)
        ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    else:
        gemm.launch_grouped_gemm(x, w_gate, cu, out, cfg)
        ref = grouped_gemm_ref(x, w_gate, cu)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_group_major_needs_the_register_schedule(interpreted):
    """Past SMALL_G_MAX groups the item's segment is found by a scan: row-major order only."""
    gemm = interpreted[0]
    x = torch.randn(64, 16)
    out = torch.empty(64, 16)
    cfg = configs.GemmConfig(16, 16, 16, 1, 1, group_major=True)
    for g, want in ((gemm.SMALL_G_MAX, True), (gemm.SMALL_G_MAX + 1, False)):
        plan = gemm.make_plan(x, torch.randn(g, 16, 16), None, None, out, cfg, False)
        assert plan.constexprs["GROUP_MAJOR"] is want


def test_flatten_with_tma_store_is_refused(interpreted):
    """Triton 3.6 cannot compile that pair (found by the H200 sweep): a clear error, not a crash."""
    gemm = interpreted[0]
    x, w, cu = grouped_gemm_inputs(LAYOUTS[0], torch.float16)
    out = torch.empty(LAYOUTS[0].nvs, LAYOUTS[0].n, dtype=torch.float16)
    with pytest.raises(ValueError, match="flatten and tma_store"):
        gemm.launch_grouped_gemm(x, w, cu, out, configs.GemmConfig(16, 16, 16, 1, 1, flatten=True, tma_store=1),
                                 use_tma=True)


@pytest.mark.parametrize("groups_per_program, width, max_row_blocks", [(1, 1, 8192), (8, 1, 8192), (8, 4, 8192),
                                                                     (3, 8, 8192), (8, 4, 2)])
@pytest.mark.parametrize("with_weights", [False, True], ids=["all_rows", "route_weights"])
def test_fp8_row_quantization_reads_the_rows_it_should(with_weights, groups_per_program, width, max_row_blocks):
    """The FP8 experts' quantization of ``x`` (the sm89+ kernel): the scales of the live rows;
    with route weights, a row of weight 0 (NaN in it here) and the tail neither read nor written.
    ``max_row_blocks`` 2: two programs per column run step over the seven row blocks.
    Only the scales and the untouched rows are compared: the interpreter converts to e4m3 with its
    own rounding (some elements one binade off), so the e4m3 values are checked on the GPU."""
    from moonep_ops import fp8
    from moonep_ops.kernels.triton.grouped_gemm_fp8 import quantize_rows

    x = torch.randn(50, 1100, dtype=torch.float16)  # 9 column groups: with 8 per program, two runs
    x[37:] = float("nan")  # the tail
    cu = torch.tensor([10, 10, 37], dtype=torch.int32)
    rw = torch.rand(50) + 0.1
    rw[5:9] = rw[32:37] = 0.0  # rows 32-39 (37-39 the tail): a whole 8-row block with nothing to quantize
    if with_weights:
        x[5:9] = x[32:37] = float("nan")
    q = torch.full((50, 1100), 1.0).to(torch.float8_e4m3fn)
    scale = torch.full((50, 9), -1.0)
    quantize_rows(x, cu, q, scale, rw if with_weights else None, groups_per_program, width, max_row_blocks)
    _, ref_scale = fp8.quantize_rows(x[:37].float())
    if with_weights:
        for lo, hi in ((5, 9), (32, 37)):
            assert torch.equal(q[lo:hi].float(), torch.ones(hi - lo, 1100))
            assert torch.equal(scale[lo:hi], torch.full((hi - lo, 9), -1.0))
            ref_scale[lo:hi] = -1.0
    assert torch.equal(scale[:37], ref_scale)
    assert torch.equal(q[37:].float(), torch.ones(13, 1100)) and torch.equal(scale[37:], torch.full((13, 9), -1.0))


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_fp8_gemm_block_major_weights(fused):
    """The FP8 GEMM's pointer path (sm89) on block-major weights: every output the row-major
    weights give, bit for bit (the same values in the same order), against the float64 reference
    within the interpreter's e4m3 rounding, the tail zero."""
    from moonep_ops import fp8
    from moonep_ops.kernels.triton import grouped_gemm_fp8 as kernel

    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([10, 10, 37], dtype=torch.int32)
    q, s = fp8.quantize_rows(torch.randn(40, 384, generator=gen))
    w, w_scale = fp8.quantize_weight(torch.randn(3, 256, 384, generator=gen) / 20)
    up = fp8.quantize_weight(torch.randn(3, 256, 384, generator=gen) / 20) if fused else (None, None)
    rw = torch.rand(40, generator=gen)

    def run(layout):
        out = torch.full((40, 256), float("nan")).to(torch.float8_e4m3fn if fused else torch.float16)
        out_scale = torch.full((40, 2), float("nan")) if fused else None
        w_up = None if up[0] is None else layout(up[0])
        kernel.run(q, s, layout(w), w_scale, w_up, up[1], rw if fused else None, cu, out, out_scale,
                   lambda *_: (kernel.Fp8Config(16, 128 if fused else 64, 4, 1), False))
        return out.float(), out_scale

    row_major, blocked = run(lambda t: t), run(fp8.to_block_major)
    assert torch.equal(row_major[0], blocked[0])
    assert not torch.isnan(row_major[0][:37]).any()
    if fused:
        assert torch.equal(row_major[1][:37], blocked[1][:37])
    else:
        assert torch.equal(row_major[0][37:], torch.zeros(3, 256))
        ref = grouped_gemm_ref(q.double() * s.double().repeat_interleave(128, 1), fp8.dequantize_weight(w, w_scale),
                               cu)
        assert rel_err(row_major[0][:37], ref[:37]) <= TOLERANCE[torch.float16]
