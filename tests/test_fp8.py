"""The FP8 block-scaled ops (``grouped_gemm_fp8``, ``experts_fp8`` and their ``_out`` variants),
their public API (``w_scale=``, ``w_*_scale=``) and the helpers of moonep_ops/fp8.py.

Every op is compared with a float64 reference written here from the semantics in
moonep_ops/fp8.py (activation quantization in fp32 torch ops, GEMMs in float64, no
moonep_ops helper in the computation), on CPU and CUDA, with NaN in every tail row of the
inputs and NaN in ``out`` before an ``_out`` call. A second set of tests measures the accuracy
of the FP8 path itself against float64 with dequantized weights and unquantized activations.
"""

import functools
import typing

import expecttest
import pytest
import torch

import moonep_ops
from moonep_ops import fp8

from .conftest import DEVICES
from .layouts import INVALID_ENDS, Layout, experts_inputs, fp8_experts_inputs, zero_padding_rows
from .reference import (TOLERANCE, experts_ref, grouped_gemm_ref, rel_err, row_groups,
                        silu_mul_weight_ref)

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16]

# --- the float64 reference -----------------------------------------------------------------------


def ref_quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """float64 values of ``x [R, K]`` after quantization per row and 128-column group: in fp32,
    ``s = amax / 448``, ``q = e4m3fn(x * min(448 / amax, FLT_MAX))`` (0 where amax = 0), value ``q * s``."""
    x32 = x.detach().to("cpu", torch.float32)
    values = torch.empty(x32.shape, dtype=torch.float64)
    flt_max = torch.tensor(torch.finfo(torch.float32).max)
    for start in range(0, x32.shape[1], 128):
        group = x32[:, start:start + 128]
        amax = group.abs().amax(dim=1, keepdim=True)
        s = amax / 448.0
        m = torch.minimum(torch.tensor(448.0) / amax, flt_max)
        q = torch.where(amax > 0, group * m, torch.zeros_like(group)).to(FP8)
        values[:, start:start + 128] = q.double() * s.double()
    return values


def ref_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 ``w[g, n, k] * scale[g, n // 128, k // 128]`` (an index gather per element)."""
    _, n, k = w.shape
    block_row, block_col = torch.arange(n) // 128, torch.arange(k) // 128
    per_element = scale.detach().to("cpu", torch.float64)[:, block_row][:, :, block_col]
    return w.detach().to("cpu").double() * per_element


def _live_quantized(rows: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """``ref_quantized_rows`` of the live rows, zeros in the tail (NaN there is never touched)."""
    live = row_groups(cu_seqlens, rows.shape[0]) < cu_seqlens.numel()
    values = torch.zeros(rows.shape, dtype=torch.float64)
    values[live] = ref_quantized_rows(rows.detach().cpu()[live])
    return values


def ref_grouped_gemm_fp8(a, w, w_scale, cu_seqlens) -> torch.Tensor:
    return grouped_gemm_ref(_live_quantized(a, cu_seqlens), ref_weight(w, w_scale), cu_seqlens)


def _ref_act(x, w_gate, w_gate_scale, w_up, w_up_scale, route_weights, cu_seqlens) -> torch.Tensor:
    """The experts' float64 ``act`` (before its quantization)."""
    x_q = _live_quantized(x, cu_seqlens)
    gate = grouped_gemm_ref(x_q, ref_weight(w_gate, w_gate_scale), cu_seqlens)
    up = grouped_gemm_ref(x_q, ref_weight(w_up, w_up_scale), cu_seqlens)
    return silu_mul_weight_ref(gate, up, route_weights, cu_seqlens)


def ref_experts_fp8(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights,
                    cu_seqlens) -> torch.Tensor:
    act = _ref_act(x, w_gate, w_gate_scale, w_up, w_up_scale, route_weights, cu_seqlens)
    return grouped_gemm_ref(_live_quantized(act, cu_seqlens), ref_weight(w_down, w_down_scale), cu_seqlens)


def act_tie_slack(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens,
                  window: float) -> torch.Tensor:
    """How far the experts' output may lie from :func:`ref_experts_fp8` because of ``act``'s elements
    near an e4m3 rounding tie: an element whose scaled value ``act / s`` lies within ``window``
    (relative) of the midpoint between two e4m3 values may round either way once ``act`` is
    computed in fp32 rather than float64 (exact ties are common with a few K elements: e4m3
    weights hold exact ratios). Per output element, the sum over such elements of the e4m3 step
    times ``s`` times ``|w_down|``; zero where there is none."""
    act = _ref_act(x, w_gate, w_gate_scale, w_up, w_up_scale, route_weights, cu_seqlens)
    live = row_groups(cu_seqlens, act.shape[0]) < cu_seqlens.numel()
    steps = torch.zeros_like(act)
    for start in range(0, act.shape[1], 128):
        group = act[live, start:start + 128].float()
        amax = group.abs().amax(dim=1, keepdim=True).double()
        scaled = torch.where(amax > 0, group.double() * 448.0 / amax, torch.zeros_like(group.double())).abs()
        # e4m3's spacing at |scaled|: 2^(exponent - 3), and 2^-9 among the subnormals (below 2^-6)
        spacing = torch.exp2(torch.floor(torch.log2(scaled.clamp(min=2.0 ** -6))) - 3)
        frac = scaled / spacing - torch.floor(scaled / spacing)
        tie = (frac - 0.5).abs() * spacing <= window * scaled
        steps[live, start:start + 128] = torch.where(tie, spacing * amax / 448.0, torch.zeros_like(spacing))
    return grouped_gemm_ref(steps, ref_weight(w_down, w_down_scale).abs(), cu_seqlens)


# --- layouts: H = k, I = n; odd sizes unless the name says otherwise ----------------------------

LAYOUTS = [
    Layout("unpadded", (5, 1, 17, 3, 9), 40, k=200, n=136),
    Layout("empty_segments", (0, 4, 0, 0, 7, 0), 15, k=200, n=136),
    Layout("one_row_segments", (1, 1, 0, 1), 5, k=200, n=136),
    Layout("padded_128", (128, 0, 128, 256, 0), 549, k=200, n=136, padded_to=128, real_rows=(100, 0, 3, 130, 0)),
    Layout("g1", (13,), 20, k=200, n=136),
    Layout("all_tail", (0, 0, 0), 9, k=200, n=136),
    Layout("nvs0", (0, 0), 0, k=200, n=136),
    Layout("multiples_of_128", (70, 0, 60), 140, k=256, n=384),
    Layout("k_below_one_block", (6, 9), 17, k=16, n=8),
    Layout("many_k_blocks", (40, 3), 50, k=1001, n=130),
    # TMA-addressable sizes (multiples of 16) that end in a partial scale block: a column tile of
    # the fused GEMM runs past I into the next group's weight rows, which act's scales must ignore
    Layout("partial_scale_blocks", (70, 0, 60, 9), 150, k=256, n=144),
]
LAYOUT_IDS = [layout.name for layout in LAYOUTS]
# Padding rows as MoonEP's dispatch writes them (zero rows of route weight 0, given by the tests):
# 64-row tiles of nothing but padding, and tiles that mix both.
MOONEP_PADDING = Layout("moonep_padding", (128, 0, 128, 256, 128), 677, k=256, n=144, padded_to=128,
                        real_rows=(100, 0, 3, 130, 64))
# Decode as MoonEP lays it out: every live segment one padded 128-row block (two 64-row tiles, the
# upper one often all padding), empty segments between them (other ranks' experts: under 64 rows
# per group), enough items for a full grid. On an sm90 GPU with an even SM count the Gluon kernels
# skip the idle tiles, the programs swapping items in pairs every other round (GluonConfig.skip_idle_tiles).
_DECODE_REAL = tuple(0 if g % 7 == 3 or g % 2 else (g * 37) % 127 + 1 for g in range(160))
MOONEP_DECODE = Layout("moonep_decode", tuple(128 if r else 0 for r in _DECODE_REAL),
                       128 * sum(map(bool, _DECODE_REAL)) + 33, k=256, n=384, padded_to=128, real_rows=_DECODE_REAL)


def _gemm_args(layout, dtype, device):
    """``(a, w, w_scale, cu_seqlens)``: x against w_gate."""
    x, (w, scale), _, _, cu, _ = fp8_experts_inputs(layout, dtype, device)
    return x, w, scale, cu


def _experts_args(layout, dtype, device, with_weights=True):
    """The op's arguments: ``(x, w_gate, scale, w_up, scale, w_down, scale, route_weights, cu)``."""
    x, gate, up, down, cu, rw = fp8_experts_inputs(layout, dtype, device, with_weights=with_weights)
    return (x, *gate, *up, *down, rw, cu)


# Hopper's e4m3 tensor-core MMA adds each 32-deep step's products at reduced precision (about 13
# mantissa bits after aligning them to the largest; the DeepSeek-V3 report measured the same): the
# CUDA GEMM stays within bf16 rounding of the exact semantics (about 3e-3), but the experts op
# re-quantizes act, where such differences flip e4m3 codes of elements near a rounding boundary.
CUDA_EXPERTS_TOLERANCE = 2.5e-2


def _experts_tolerance(device):
    return CUDA_EXPERTS_TOLERANCE if device == "cuda" else None


def _check(out, ref, layout, dtype, device, tolerance=None):
    assert out.dtype == dtype and out.is_contiguous() and out.device.type == torch.device(device).type
    assert not torch.isnan(out).any(), "NaN reached the output"
    err = rel_err(out, ref)
    assert err <= (tolerance or TOLERANCE[dtype]), f"rel err {err:.3g}"
    tail = out[layout.total:]
    assert torch.equal(tail, torch.zeros_like(tail)), "tail rows are not exactly zero"
    _check_padding_rows_zero(out, layout)


def _check_padding_rows_zero(out, layout):
    """A zero row quantizes to zero (s = 0): its output row is exactly zero."""
    start = 0
    for size, real in zip(layout.sizes, layout.real_rows):
        pad = out[start + real:start + size]
        assert torch.equal(pad, torch.zeros_like(pad)), "a padding row is not exactly zero"
        start += size


def _nan_like(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _nan_scratch(shape, dtype, device):
    """A buffer between the CUDA launches handed out full of NaN (e4m3 included)."""
    return torch.full(shape, float("nan"), device=device).to(dtype)


# --- the ops against the reference ----------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_grouped_gemm_fp8(layout, dtype, device):
    a, w, scale, cu = _gemm_args(layout, dtype, device)
    out = moonep_ops.grouped_gemm(a, w, cu, w_scale=scale)
    assert out.shape == (layout.nvs, layout.n)
    _check(out, ref_grouped_gemm_fp8(a, w, scale, cu), layout, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_grouped_gemm_fp8_out(layout, dtype, device):
    a, w, scale, cu = _gemm_args(layout, dtype, device)
    out = _nan_like((layout.nvs, layout.n), dtype, device)
    assert moonep_ops.grouped_gemm(a, w, cu, w_scale=scale, out=out) is out
    _check(out, ref_grouped_gemm_fp8(a, w, scale, cu), layout, dtype, device)
    again = _nan_like((layout.nvs, layout.n), dtype, device)
    torch.ops.moonep.grouped_gemm_fp8_out(a, w, scale, cu, again)
    assert torch.equal(again, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_experts_fp8(layout, dtype, with_weights, device):
    args = _experts_args(layout, dtype, device, with_weights)
    x, w_gate, sg, w_up, su, w_down, sd, rw, cu = args
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, w_gate_scale=sg, w_up_scale=su,
                                    w_down_scale=sd)
    assert out.shape == x.shape
    _check(out, ref_experts_fp8(*args), layout, dtype, device, _experts_tolerance(device))
    assert torch.equal(torch.ops.moonep.experts_fp8(*args), out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "out_is_x"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_experts_fp8_out(layout, dtype, in_place, device):
    args = _experts_args(layout, dtype, device)
    x, w_gate, sg, w_up, su, w_down, sd, rw, cu = args
    ref = ref_experts_fp8(*args)
    out = x if in_place else _nan_like(x.shape, dtype, device)
    ret = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out, w_gate_scale=sg, w_up_scale=su,
                                    w_down_scale=sd)
    assert ret is out
    _check(out, ref, layout, dtype, device, _experts_tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_fp8_on_moonep_padding(dtype, device):
    """Padding rows as MoonEP's dispatch writes them: zero rows of route weight 0 (64-row tiles of
    nothing but padding, and tiles that mix both)."""
    layout = MOONEP_PADDING
    args = _experts_args(layout, dtype, device)
    x, w_gate, sg, w_up, su, w_down, sd, rw, cu = args
    zero_padding_rows(layout, rw)
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, w_gate_scale=sg, w_up_scale=su,
                                    w_down_scale=sd)
    _check(out, ref_experts_fp8(*args), layout, dtype, device, _experts_tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
def test_experts_fp8_on_moonep_decode(monkeypatch, device):
    """Decode-sized padded segments (idle 64-row tiles skipped on sm90), against the reference,
    with the buffers between the launches handed out full of NaN: a skipped tile whose rows the
    down GEMM read would change the result."""
    from moonep_ops.kernels.cuda import fp8 as cuda_fp8

    layout = MOONEP_DECODE
    args = _experts_args(layout, torch.bfloat16, device)
    zero_padding_rows(layout, args[-2])
    out = torch.ops.moonep.experts_fp8(*args)
    _check(out, ref_experts_fp8(*args), layout, torch.bfloat16, device, _experts_tolerance(device))
    x, w_gate, scale, cu = args[0], args[1], args[2], args[-1]
    _check(torch.ops.moonep.grouped_gemm_fp8(x, w_gate, scale, cu), ref_grouped_gemm_fp8(x, w_gate, scale, cu),
           layout, torch.bfloat16, device)
    if device == "cuda":
        monkeypatch.setattr(cuda_fp8, "_scratch", _nan_scratch)
        assert torch.equal(torch.ops.moonep.experts_fp8(*args), out)


# --- block-major weights ---------------------------------------------------------------------------

# Layouts whose H and I are multiples of 128 (block-major weights need them)
BLOCK_MAJOR_LAYOUTS = [LAYOUTS[LAYOUT_IDS.index("multiples_of_128")], MOONEP_DECODE,
                       Layout("three_k_blocks", (70, 0, 1, 200), 300, k=384, n=256)]


def _block_major(args):
    """The experts op's arguments with its three weights block-major."""
    x, wg, sg, wu, su, wd, sd, rw, cu = args
    return (x, fp8.to_block_major(wg), sg, fp8.to_block_major(wu), su, fp8.to_block_major(wd), sd, rw, cu)


def test_block_major_layout():
    w = torch.randn(2, 256, 384)
    blocked = fp8.to_block_major(w)
    assert blocked.shape == (2, 2, 3, 128, 128) and blocked.is_contiguous()
    assert torch.equal(blocked[1, 1, 2], w[1, 128:, 256:])
    assert torch.equal(fp8.from_block_major(blocked), w)
    assert fp8.weight_dims(blocked) == fp8.weight_dims(w) == (2, 256, 384)
    q, scale = fp8.quantize_weight(w)
    assert torch.equal(fp8.dequantize_weight(fp8.to_block_major(q), scale), fp8.dequantize_weight(q, scale))
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8.to_block_major(torch.zeros(1, 100, 128))
    with pytest.raises(ValueError, match=r"must be \[G, N/128"):
        fp8.from_block_major(torch.zeros(1, 2, 2, 128, 64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", BLOCK_MAJOR_LAYOUTS, ids=[layout.name for layout in BLOCK_MAJOR_LAYOUTS])
def test_block_major_weights(layout, device):
    """Block-major weights: the reference's result, and the row-major call's bit for bit (the
    same values in the same order), through every op and the public API."""
    args = _experts_args(layout, torch.bfloat16, device)
    if layout.padded_to > 1:
        zero_padding_rows(layout, args[-2])
    x, wg, sg, wu, su, wd, sd, rw, cu = blocked = _block_major(args)
    out = torch.ops.moonep.experts_fp8(*blocked)
    _check(out, ref_experts_fp8(*args), layout, torch.bfloat16, device, _experts_tolerance(device))
    assert torch.equal(out, torch.ops.moonep.experts_fp8(*args))
    into = _nan_like(x.shape, x.dtype, device)
    torch.ops.moonep.experts_fp8_out(*blocked, into)
    assert torch.equal(into, out)
    public = moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd)
    assert torch.equal(public, out)
    gemm = torch.ops.moonep.grouped_gemm_fp8(x, wg, sg, cu)
    _check(gemm, ref_grouped_gemm_fp8(x, args[1], sg, cu), layout, torch.bfloat16, device)
    assert torch.equal(gemm, torch.ops.moonep.grouped_gemm_fp8(x, args[1], sg, cu))
    into = _nan_like((layout.nvs, layout.n), x.dtype, device)
    moonep_ops.grouped_gemm(x, wg, cu, w_scale=sg, out=into)
    assert torch.equal(into, gemm)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_block_major_weights(device):
    """Block-major weights whose blocks are not back to back (a view of a wider buffer; on CUDA the
    pointer path of the Triton kernel): the same output as contiguous ones."""
    layout = BLOCK_MAJOR_LAYOUTS[-1]
    args = _block_major(_experts_args(layout, torch.bfloat16, device))

    def strided(w):
        wide = torch.zeros(*w.shape[:4], 192, dtype=w.dtype, device=w.device)
        wide[..., :128] = w
        return wide[..., :128]

    views = list(args)
    for i in (1, 3, 5):
        views[i] = strided(args[i])
        assert not views[i].is_contiguous()
    assert torch.equal(torch.ops.moonep.experts_fp8(*views), torch.ops.moonep.experts_fp8(*args))
    x, cu = args[0], args[-1]
    assert torch.equal(torch.ops.moonep.grouped_gemm_fp8(x, views[1], args[2], cu),
                       torch.ops.moonep.grouped_gemm_fp8(x, args[1], args[2], cu))


# The Gluon FP8 configs (sm90), each forced whatever the table picks: 64-row items on split rings
# (with the idle-tile skip), 128-row items split between the consumers (with and without the
# idle-upper-half skip of lone tiles). Layouts whose sizes TMA cannot address run the Triton kernel.
# Each item scheme with each segment walk: one segment end at a time, or runs of empty segments a
# chunk at a time (skip_empty_runs)
GLUON_FP8_CONFIGS = {
    "split_ring": dict(block_m=64, stages=(4, 8), split_ring=True, skip_idle_tiles=True, skip_empty_runs=False),
    "split_ring_chunked_walk": dict(block_m=64, stages=(4, 8), split_ring=True, skip_idle_tiles=True),
    "split_rows_idle_halves": dict(block_m=128, stages=(4, 6), split_rows=True, skip_idle_half=True,
                                   skip_lone_tiles_only=True, skip_empty_runs=False),
    "split_rows": dict(block_m=128, stages=(4, 6), split_rows=True),
}
# Many groups, few live (an expert-parallel rank in decode): runs of empty segments longer than the
# walk's chunks (a segment end per thread: 32 in the producer warp, 128 in a consumer warpgroup),
# and an empty last group
LONG_EMPTY_RUNS = Layout("long_empty_runs", tuple(40 if g in (0, 97, 250, 299) else 0 for g in range(300)) + (0,),
                         200, k=256, n=256)
# An expert-parallel rank in decode, unpadded: its experts' segments after a run of empty ones (the
# other ranks' experts), then another run before the prefetch slots. Each program's walks start at
# its first item's segment, which the kernel's scan of cu_seqlens finds.
EP_RANK_DECODE = Layout("ep_rank_decode", tuple(3 if 56 <= g < 72 else 2 if g >= 128 else 0 for g in range(132)),
                        56 + 20, k=256, n=256)
_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.cuda
@pytest.mark.skipif(not _SM90, reason="the Gluon FP8 kernels need an sm90 GPU")
@pytest.mark.parametrize("config", GLUON_FP8_CONFIGS, ids=list(GLUON_FP8_CONFIGS))
@pytest.mark.parametrize("layout", LAYOUTS + [MOONEP_PADDING, MOONEP_DECODE, LONG_EMPTY_RUNS, EP_RANK_DECODE],
                         ids=LAYOUT_IDS + [MOONEP_PADDING.name, MOONEP_DECODE.name, LONG_EMPTY_RUNS.name,
                                           EP_RANK_DECODE.name])
def test_gluon_fp8_configs(monkeypatch, layout, config):
    """Both FP8 GEMMs of the experts op and the plain one under each config, against the
    reference, MoonEP's padding rows of route weight 0, the buffers between launches full of NaN."""
    fields = dict(block_n=128, block_k=128, pingpong=True, **GLUON_FP8_CONFIGS[config])
    launched = _forced_fp8_table(monkeypatch, fields, second=False)
    args = _experts_args(layout, torch.bfloat16, "cuda")
    if layout.padded_to > 1:
        zero_padding_rows(layout, args[-2])
    out = torch.ops.moonep.experts_fp8(*args)
    _check(out, ref_experts_fp8(*args), layout, torch.bfloat16, "cuda", CUDA_EXPERTS_TOLERANCE)
    x, w_gate, scale, cu = args[0], args[1], args[2], args[-1]
    gemm = torch.ops.moonep.grouped_gemm_fp8(x, w_gate, scale, cu)
    _check(gemm, ref_grouped_gemm_fp8(x, w_gate, scale, cu), layout, torch.bfloat16, "cuda")
    if layout.k % 16 == 0 and layout.n % 16 == 0 and layout.nvs:  # every operand TMA-addressable
        assert {launch.fused for launch in launched} == {False, True}, "the forced configs did not reach both GEMMs"
    if layout.k % 128 == 0 and layout.n % 128 == 0:  # block-major weights: the same loads, bit for bit
        launched.clear()
        blocked = _block_major(args)
        assert torch.equal(torch.ops.moonep.experts_fp8(*blocked), out)
        assert torch.equal(torch.ops.moonep.grouped_gemm_fp8(x, blocked[1], scale, cu), gemm)
        if layout.nvs:
            assert {launch.fused for launch in launched} == {False, True}, \
                "block-major weights did not reach both Gluon GEMMs"


# The shared invalid ends, the long runs followed by a live last segment
FP8_INVALID_ENDS = dict(INVALID_ENDS, long_runs=INVALID_ENDS["long_runs"] + [30, 30, 31])


@pytest.mark.cuda
@pytest.mark.skipif(not _SM90, reason="the Gluon FP8 kernels need an sm90 GPU")
@pytest.mark.parametrize("config", GLUON_FP8_CONFIGS, ids=list(GLUON_FP8_CONFIGS))
def test_gluon_fp8_invalid_cu_seqlens_do_not_fault(monkeypatch, config):
    """Invalid ``cu_seqlens`` under each config: unspecified values, but no fault and no write
    past NvS (the outputs are the first 256 rows of larger buffers)."""
    fields = dict(block_n=128, block_k=128, pingpong=True, **GLUON_FP8_CONFIGS[config])
    launched = _forced_fp8_table(monkeypatch, fields, second=False)
    for ends in FP8_INVALID_ENDS.values():
        layout = Layout("invalid", (0,) * len(ends), 256, k=256, n=256)
        args = list(_experts_args(layout, torch.bfloat16, "cuda"))
        args[-1] = torch.tensor(ends, dtype=torch.int32, device="cuda")
        x_big = torch.full((512, layout.k), 7.0, dtype=torch.bfloat16, device="cuda")
        gemm_big = torch.full((512, layout.n), 7.0, dtype=torch.bfloat16, device="cuda")
        torch.ops.moonep.experts_fp8_out(*args, x_big[:256])
        torch.ops.moonep.grouped_gemm_fp8_out(args[0], args[1], args[2], args[-1], gemm_big[:256])
        torch.cuda.synchronize()
        assert torch.equal(x_big[256:], torch.full_like(x_big[256:], 7.0)), "a write past NvS"
        assert torch.equal(gemm_big[256:], torch.full_like(gemm_big[256:], 7.0)), "a write past NvS"
    assert {launch.fused for launch in launched} == {False, True}, "the forced configs did not reach both GEMMs"


# The two kinds of layout of a GEMM that the config table launches twice. The second launch's
# (on_multi_tile=True): live segments of 2.5 full 128-row tiles on average (MoonEP's padding; so is
# MOONEP_PADDING, at 1.25). The first launch's: segments of one tile (MOONEP_DECODE), or of two
# tiles on average whose last tiles are partly empty (below).
MULTI_TILE = Layout("multi_tile", (384, 0, 256, 128, 0, 512), 1280 + 77, k=256, n=256, padded_to=128,
                    real_rows=(300, 0, 200, 90, 0, 450))
PARTIAL_TILES = Layout("partial_tiles", (300, 0, 150, 7), 457 + 40, k=256, n=256)
# No live segment: the first launch's kind (it zeroes the whole buffer)
NO_LIVE_ROWS = Layout("no_live_rows", (0, 0, 0), 70, k=256, n=256)
SPLIT_RING_FP8 = dict(block_m=64, block_n=128, block_k=128, stages=(4, 8), pingpong=True, split_ring=True,
                      skip_idle_tiles=True)
SPLIT_ROWS_FP8 = dict(block_m=128, block_n=128, block_k=128, stages=(4, 6), pingpong=True, split_rows=True)


class Launch(typing.NamedTuple):
    """A Gluon launch compiled: its config's ``on_multi_tile``, and whether it is a fused GEMM."""
    on_multi_tile: bool | None
    fused: bool


def _forced_fp8_table(monkeypatch, first_fields, second=True):
    """The FP8 table forced to one config (``first_fields``; stages: the fused GEMM's, the plain
    one's), the buffers between the experts op's launches full of NaN, and with ``second`` the
    table's second launch derived from it; returns the list of the launches compiled (a
    :class:`Launch` each)."""
    from moonep_ops import flags
    from moonep_ops.kernels.cuda import fp8 as cuda_fp8
    from moonep_ops.kernels.cuda import paths
    from moonep_ops.kernels.gluon import config as gluon_config, host

    if paths.gluon_host() is None or flags.portable_only() or not flags.gluon():
        pytest.skip("the Gluon kernels are off or unusable here")

    def pick(n, k, num_rows, fused, groups=0):
        stages = first_fields["stages"][0 if fused else 1]
        return gluon_config.GluonConfig(**dict(first_fields, stages=stages, tail_by_producer=k >= 256))

    launched = []
    first_run = host._first_run

    def recording_first_run(*args):
        launched.append(Launch(args[6].on_multi_tile, args[2] is not None))  # (the config; w_up)
        return first_run(*args)

    monkeypatch.setattr(gluon_config, "gluon_fp8_config", pick)
    if not second:
        monkeypatch.setattr(gluon_config, "gluon_fp8_multi_tile_config", lambda *args, **kwargs: None)
    monkeypatch.setattr(host, "_first_run", recording_first_run)
    monkeypatch.setattr(host, "_PLANS", {})
    monkeypatch.setattr(cuda_fp8, "_scratch", _nan_scratch)
    return launched


def _nan_outputs(args):
    """``experts_fp8_out`` and ``grouped_gemm_fp8_out`` (x against w_gate) into outputs full of NaN."""
    out = torch.full_like(args[0], float("nan"))
    torch.ops.moonep.experts_fp8_out(*args, out)
    x, w_gate, scale, cu = args[0], args[1], args[2], args[-1]
    n = fp8.weight_dims(w_gate)[1]  # (block-major weights hold N / 128 in dim 1)
    gemm = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    torch.ops.moonep.grouped_gemm_fp8_out(x, w_gate, scale, cu, gemm)
    return out, gemm


@pytest.mark.cuda
@pytest.mark.skipif(not _SM90, reason="the Gluon FP8 kernels need an sm90 GPU")
@pytest.mark.parametrize("layout", [MOONEP_DECODE, PARTIAL_TILES, NO_LIVE_ROWS, MOONEP_PADDING, MULTI_TILE],
                         ids=[MOONEP_DECODE.name, PARTIAL_TILES.name, NO_LIVE_ROWS.name, MOONEP_PADDING.name,
                              MULTI_TILE.name])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_two_launches_of_a_gemm_compute_it_once(monkeypatch, layout, pdl):
    """A GEMM launched twice (split rings for short live segments, split rows for segments of
    several full 128-row tiles; each kernel decides from ``cu_seqlens`` which of the two it is),
    the second a programmatic dependent of the first or launched plainly: outputs and buffers
    full of NaN first, each of the experts op's GEMMs and the plain one against the reference,
    the tail zeroed once."""
    from moonep_ops import flags

    monkeypatch.setenv(flags.PDL, "1" if pdl else "0")
    monkeypatch.setattr(flags, "_current", None)  # (read again from the environment; restored after)
    launched = _forced_fp8_table(monkeypatch, dict(SPLIT_RING_FP8, on_multi_tile=False))
    args = _experts_args(layout, torch.bfloat16, "cuda")
    if layout.padded_to > 1:
        zero_padding_rows(layout, args[-2])
    out, gemm = _nan_outputs(args)
    assert [launch.on_multi_tile for launch in launched] == [False, True] * 3, "the GEMMs did not run as launch pairs"
    _check(out, ref_experts_fp8(*args), layout, torch.bfloat16, "cuda", CUDA_EXPERTS_TOLERANCE)
    x, w_gate, scale, cu = args[0], args[1], args[2], args[-1]
    _check(gemm, ref_grouped_gemm_fp8(x, w_gate, scale, cu), layout, torch.bfloat16, "cuda")
    if layout.k % 128 == 0 and layout.n % 128 == 0:  # block-major weights: the same loads, bit for bit
        blocked_out, blocked_gemm = _nan_outputs(_block_major(args))
        assert [launch.on_multi_tile for launch in launched] == [False, True] * 6
        assert torch.equal(blocked_out, out) and torch.equal(blocked_gemm, gemm)


@pytest.mark.cuda
@pytest.mark.skipif(not _SM90, reason="the Gluon FP8 kernels need an sm90 GPU")
@pytest.mark.parametrize("layout,fields", [(MOONEP_DECODE, dict(SPLIT_ROWS_FP8, on_multi_tile=True)),
                                           (PARTIAL_TILES, dict(SPLIT_ROWS_FP8, on_multi_tile=True)),
                                           (MOONEP_PADDING, dict(SPLIT_RING_FP8, on_multi_tile=False)),
                                           (MULTI_TILE, dict(SPLIT_RING_FP8, on_multi_tile=False))],
                         ids=["decode_rows_launch", "partial_tiles_rows_launch", "padding_rings_launch",
                              "multi_tile_rings_launch"])
def test_a_launch_on_the_other_kind_of_layout_writes_nothing(monkeypatch, layout, fields):
    """One launch of a pair alone, on a layout of the other launch's kind: no output row and no
    tail row is written (the outputs stay NaN)."""
    launched = _forced_fp8_table(monkeypatch, fields, second=False)
    args = _experts_args(layout, torch.bfloat16, "cuda")
    if layout.padded_to > 1:
        zero_padding_rows(layout, args[-2])
    out, gemm = _nan_outputs(args)
    assert [launch.on_multi_tile for launch in launched] == [fields["on_multi_tile"]] * 3
    assert torch.isnan(out).all() and torch.isnan(gemm).all(), "a launch wrote on the other kind of layout"


@pytest.mark.parametrize("device", DEVICES[1:])
def test_experts_fp8_does_not_read_rows_of_route_weight_zero(device):
    """On CUDA the quantization of ``x`` neither reads nor writes a row of route weight 0
    (MoonEP's padding) and the fused epilogue zeroes its ``act`` row: NaN there changes no output,
    which equals the call on zero padding rows bit for bit."""
    layout = MOONEP_PADDING
    args = _experts_args(layout, torch.bfloat16, device)
    rw = zero_padding_rows(layout, args[-2])
    clean = torch.ops.moonep.experts_fp8(*args)
    pad = torch.zeros(layout.nvs, dtype=torch.bool, device=device)
    pad[:layout.total] = rw[:layout.total] == 0
    garbage = args[0].masked_fill(pad[:, None], float("nan"))
    assert torch.equal(torch.ops.moonep.experts_fp8(garbage, *args[1:]), clean)


@pytest.mark.parametrize("device", DEVICES)
def test_experts_fp8_out_op_in_place(device):
    layout = LAYOUTS[LAYOUT_IDS.index("padded_128")]
    args = _experts_args(layout, torch.bfloat16, device)
    expected = torch.ops.moonep.experts_fp8(*args)
    x = args[0]
    torch.ops.moonep.experts_fp8_out(*args, x)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("device", DEVICES[1:])
def test_buffers_between_launches_are_written_before_read(monkeypatch, layout, device):
    """The CUDA ops' buffers between launches (``x``'s e4m3 rows and scales, ``act`` and its
    scales) handed out full of NaN: a kernel that used a row or scale the kernel before it did not
    write (another segment's, the tail's, a column group past I) would change the result. The rows
    of ``x`` of route weight 0 stay unwritten: their products are discarded."""
    from moonep_ops.kernels.cuda import fp8 as cuda_fp8

    args = _experts_args(layout, torch.bfloat16, device)
    x, w_gate, scale, cu = args[0], args[1], args[2], args[-1]

    def both():
        return torch.ops.moonep.experts_fp8(*args), torch.ops.moonep.grouped_gemm_fp8(x, w_gate, scale, cu)

    plain = both()
    monkeypatch.setattr(cuda_fp8, "_scratch", _nan_scratch)
    for out, ref in zip(both(), plain):
        assert torch.equal(out, ref)  # (NaN never equals NaN)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_weights(device):
    """CPU takes any strides; CUDA wants each weight's and each scale's last dimension contiguous
    (rows of a larger buffer are fine: vLLM's MoonEP layout pads each group's scales). The values,
    not the layout, decide the result."""
    layout = LAYOUTS[LAYOUT_IDS.index("unpadded")]
    args = list(_experts_args(layout, torch.bfloat16, device))
    expected = torch.ops.moonep.experts_fp8(*args)
    for i in (1, 3, 5):  # each weight as rows of a buffer with NaN gaps between them
        w = args[i]
        buf = torch.full((w.shape[0], w.shape[1] + 3, w.shape[2]), float("nan"), device=device).to(FP8)
        args[i] = buf[:, 2:w.shape[1] + 2].copy_(w)
        assert not args[i].is_contiguous() and args[i].stride(-1) == 1
    assert torch.equal(torch.ops.moonep.experts_fp8(*args), expected)
    for i in (2, 4, 6):  # each scale as rows of a buffer whose groups and rows are padded with NaN
        s = args[i]
        buf = torch.full((s.shape[0], s.shape[1] + 2, s.shape[2] + 5), float("nan"), device=device)
        args[i] = buf[:, 1:s.shape[1] + 1, :s.shape[2]].copy_(s)
        assert not args[i].is_contiguous() and args[i].stride(-1) == 1
    assert torch.equal(torch.ops.moonep.experts_fp8(*args), expected)
    if torch.device(device).type == "cpu":
        for i in (1, 3, 5):
            args[i] = args[i].transpose(1, 2).contiguous().transpose(1, 2)  # K not innermost
        assert torch.equal(torch.ops.moonep.experts_fp8(*args), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_output_range(device):
    """fp16 activations of a larger magnitude: scales follow the data, nothing saturates."""
    layout = LAYOUTS[LAYOUT_IDS.index("unpadded")]
    x, w, scale, cu = _gemm_args(layout, torch.float16, device)
    x = x * 100
    out = moonep_ops.grouped_gemm(x, w, cu, w_scale=scale)
    _check(out, ref_grouped_gemm_fp8(x, w, scale, cu), layout, torch.float16, device)


# --- accuracy of the FP8 path itself ---------------------------------------------------------------

# Measured on CPU (this test's data, seeds 0-4; relative error in the Frobenius norm against
# float64 with dequantized weights and unquantized activations; the bf16 ops, against float64
# with their own weights, give 0.002 on the same data):
#   activations                  grouped_gemm_fp8   experts_fp8
#   normal                       0.026              0.043-0.044
#   student-t, 2 dof             0.013-0.016        0.022-0.026
#   normal, 1 % outliers x 100   0.011-0.012        0.028-0.030
ACCURACY_BOUND = {"grouped_gemm_fp8": 0.035, "experts_fp8": 0.055}
ACCURACY_LAYOUT = Layout("accuracy", (300, 0, 200, 129), 640, k=512, n=384)


def heavy_tailed_rows(kind, shape, gen):
    normal = torch.randn(shape, generator=gen)
    if kind == "normal":
        return normal
    if kind == "student_t2":  # z / sqrt(chi2_2 / 2), and chi2_2 / 2 is an Exp(1) draw
        return normal / torch.empty(shape).exponential_(generator=gen).sqrt()
    outlier = torch.rand(shape, generator=gen) < 0.01
    return torch.where(outlier, normal * 100, normal)


def accuracy(kind, device="cpu", seed=0):
    """``{op: relative error}`` of the FP8 ops on ``kind`` activations against float64 with
    dequantized weights and unquantized activations."""
    layout = ACCURACY_LAYOUT
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    _, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.float32, "cpu")
    x = heavy_tailed_rows(kind, (layout.nvs, layout.k), gen).to(torch.bfloat16)
    x[layout.total:] = float("nan")
    (wg, sg), (wu, su), (wd, sd) = (fp8.quantize_weight(w) for w in (w_gate, w_up, w_down))
    on = functools.partial(torch.Tensor.to, device=device)
    args = [None if t is None else on(t) for t in (x, wg, sg, wu, su, wd, sd, rw, cu)]
    out_gemm = moonep_ops.grouped_gemm(args[0], args[1], args[8], w_scale=args[2])
    out_experts = torch.ops.moonep.experts_fp8(*args)
    deq = [ref_weight(w, s) for w, s in ((wg, sg), (wu, su), (wd, sd))]
    return {"grouped_gemm_fp8": rel_err(out_gemm, grouped_gemm_ref(x, deq[0], cu)),
            "experts_fp8": rel_err(out_experts, experts_ref(x, *deq, cu, rw))}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["normal", "student_t2", "outliers"])
def test_accuracy_against_unquantized_float64(kind, device):
    errors = accuracy(kind, device)
    for op, err in errors.items():
        assert err <= ACCURACY_BOUND[op], f"{op} on {kind} data: rel err {err:.4f} > {ACCURACY_BOUND[op]}"
    # Not better than FP8 can be either: a path that skipped quantization would pass the bound.
    assert errors["grouped_gemm_fp8"] >= 0.005, errors


# --- moonep_ops.fp8 -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 200, 136), (1, 128, 256), (2, 5, 7), (2, 0, 130)], ids=str)
def test_quantize_weight(shape):
    w = torch.randn(shape, dtype=torch.float64).to(torch.bfloat16)
    w[0, :64, :64] = 0  # zeros: a whole block of the small shapes
    q, scale = fp8.quantize_weight(w)
    g, n, k = shape
    assert q.dtype == FP8 and q.shape == shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (g, -(-n // 128), -(-k // 128))
    assert scale.shape == fp8.scale_shape(shape)
    # scale = amax of the block / 448, each block's largest element maps to +-448.
    for gi in range(g):
        for nb in range(scale.shape[1]):
            for kb in range(scale.shape[2]):
                block = w[gi, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128].float()
                assert scale[gi, nb, kb] == block.abs().max() / 448.0
    # Round trip: within half an e4m3 step (relative 2^-4; absolute 2^-10 * scale below the normal range).
    back = fp8.dequantize_weight(q, scale)
    assert back.dtype == torch.float32 and back.shape == shape
    step = ref_weight(torch.ones(shape), scale).float()  # each element's block scale
    bound = torch.maximum(w.float().abs() * 2 ** -4, step * 2 ** -10)
    assert bool(((back - w.float()).abs() <= bound).all())
    assert torch.equal(back, ref_weight(q, scale).float())
    if n and k:
        assert float(rel_err(back, w.double())) < 0.03


def test_quantize_weight_zero_block():
    w = torch.zeros(1, 130, 5)
    w[0, 128:, :] = 3.0
    q, scale = fp8.quantize_weight(w)
    assert scale[0, 0, 0] == 0 and torch.count_nonzero(q[0, :128].float()) == 0
    assert torch.equal(fp8.dequantize_weight(q, scale), w)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton quantization kernel runs on CUDA")
@pytest.mark.parametrize("max_row_blocks", [8192, 5])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("groups_per_program", [1, 3, 8])
def test_cuda_row_quantization_matches_the_semantics(groups_per_program, width, max_row_blocks):
    """The CUDA quantization of ``x`` (a program per row block and run of column groups, or with
    ``max_row_blocks`` 5 five programs per run stepping over the 38 row blocks) against
    :func:`fp8.quantize_rows` on the live rows of route weight other than 0; the rows of weight 0
    (NaN here) and the tail keep the bytes they had."""
    from moonep_ops.kernels.triton.grouped_gemm_fp8 import quantize_rows

    x = torch.randn(300, 1100, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([40, 40, 250], dtype=torch.int32, device="cuda")
    rw = torch.rand(300, device="cuda") + 0.1
    rw[64:128] = rw[7] = 0.0  # whole row blocks of padding, and a lone row
    x[64:128] = x[7] = float("nan")
    q = torch.full((300, 1100), 2.0, device="cuda").to(FP8)
    s = torch.full((300, 9), -1.0, device="cuda")
    quantize_rows(x, cu, q, s, rw, groups_per_program, width=width, max_row_blocks=max_row_blocks)
    read = (torch.arange(300, device="cuda") < 250) & (rw != 0)
    expected_q, expected_s = fp8.quantize_rows(x[read])
    assert torch.equal(q[read].float(), expected_q.float()) and torch.equal(s[read], expected_s)
    assert (q[~read].float() == 2.0).all() and (s[~read] == -1.0).all()


@pytest.mark.parametrize("rows, k, grid, strided", [
    (65152, 7168, (5851, 7), True),  # top-8 over 260 groups of kimi-k2's size, S=16: capped programs
    (253568, 2048, (8192, 2), True),  # top-8 over 1000 groups of qwen3-30b-a3b's size, S=64: capped rows
    (13312, 7168, (1664, 7), False),  # the benchmark's padded kimi-k2 decode
    (33024, 2048, (4128, 2), False),  # the benchmark's padded qwen3-30b-a3b S=64
    (45056, 7168, (5632, 7), False),  # the benchmark's padded kimi-k2 prefill: its largest grid
])
def test_row_quantization_grid_stays_within_max_programs(monkeypatch, rows, k, grid, strided):
    """The quantization's grid: a program per 8-row block and run of up to eight column groups,
    at most ``MAX_ROW_BLOCKS`` row blocks and ``MAX_PROGRAMS`` programs; a capped grid's programs
    step over the other row blocks (``STRIDED``). Launches recorded on meta tensors: no kernel runs."""
    pytest.importorskip("triton")
    from moonep_ops.kernels.triton import grouped_gemm_fp8

    launches = []

    class Recorder:
        def __getitem__(self, launch_grid):
            return lambda *args, **constexprs: launches.append((launch_grid, constexprs["STRIDED"]))

    monkeypatch.setattr(grouped_gemm_fp8, "quantize_rows_kernel", Recorder())
    x = torch.empty(rows, k, dtype=torch.bfloat16, device="meta")
    q = torch.empty(rows, k, dtype=FP8, device="meta")
    scale = torch.empty(rows, -(-k // 128), device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    grouped_gemm_fp8.quantize_rows(x, cu, q, scale, torch.empty(rows, device="meta"))
    assert launches == [(grid, strided)]
    assert grid[0] <= grouped_gemm_fp8.MAX_ROW_BLOCKS and grid[0] * grid[1] <= grouped_gemm_fp8.MAX_PROGRAMS


@pytest.mark.parametrize("cols", [1, 127, 128, 200, 1001])
def test_quantize_rows(cols):
    x = torch.randn(9, cols).to(torch.bfloat16)
    x[3] = 0
    q, s = fp8.quantize_rows(x)
    assert q.dtype == FP8 and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (9, -(-cols // 128))
    assert torch.count_nonzero(s[3]) == 0 and torch.count_nonzero(q[3].float()) == 0
    values = q.double() * s.double().repeat_interleave(128, dim=1)[:, :cols]
    assert torch.equal(values, ref_quantized_rows(x))
    assert float(q.float().abs().max()) == 448.0  # each group's largest element maps to +-448


def test_quantize_rows_multiplies_by_the_group_reciprocal():
    """s = amax / 448 and q = x * (448 / amax), each quotient a true fp32 division per group."""
    x = torch.tensor([[3.0, 1.1, -0.7, 2.9]])
    q, s = fp8.quantize_rows(x)
    assert s[0, 0] == torch.tensor(3.0) / 448.0
    assert torch.equal(q.float(), (x * (torch.tensor(448.0) / torch.tensor(3.0))).to(FP8).float())


def test_quantize_rows_subnormal_group_stays_finite():
    """A group whose amax is subnormal: 448 / amax overflows fp32, the multiplier is bounded."""
    x = torch.tensor([[1e-40, -5e-41, 0.0]])
    q, s = fp8.quantize_rows(x)
    assert torch.isfinite(q.float()).all()
    flt_max = torch.tensor(torch.finfo(torch.float32).max)
    assert torch.equal(q.float(), (x * flt_max).to(FP8).float())  # the bounded multiplier
    assert s[0, 0] == torch.tensor(1e-40) / torch.tensor(448.0)


def test_helpers_refuse_wrong_ranks():
    with pytest.raises(ValueError, match="quantize_weight: w must be 3-D"):
        fp8.quantize_weight(torch.randn(4, 4))
    with pytest.raises(ValueError, match="quantize_rows: x must be 2-D"):
        fp8.quantize_rows(torch.randn(4))
    with pytest.raises(ValueError, match="dequantize_weight: expected"):
        fp8.dequantize_weight(torch.randn(1, 4, 4).to(FP8), torch.ones(1, 2, 1))


def test_helpers_refuse_what_is_not_a_tensor():
    calls = [(fp8.quantize_weight, ([1.0],)), (fp8.quantize_rows, ([1.0],)), (fp8.to_block_major, (None,)),
             (fp8.from_block_major, (3,)), (fp8.dequantize_weight, (torch.ones(1, 4, 4).to(FP8), [1.0]))]
    messages = []
    for fn, args in calls:
        with pytest.raises(TypeError) as info:
            fn(*args)
        messages.append(str(info.value))
    assert messages == ["quantize_weight: w must be a Tensor, got list",
                        "quantize_rows: x must be a Tensor, got list",
                        "to_block_major: w must be a Tensor, got NoneType",
                        "from_block_major: w must be a Tensor, got int",
                        "dequantize_weight: scale must be a Tensor, got list"]


def test_exported_from_the_package():
    assert moonep_ops.fp8 is fp8 and fp8.BLOCK == 128
    assert {"quantize_weight", "dequantize_weight", "quantize_rows", "BLOCK"} <= set(fp8.__all__)


# --- inference only ---------------------------------------------------------------------------------

def _small_args(device="cpu"):
    layout = LAYOUTS[LAYOUT_IDS.index("unpadded")]
    return _experts_args(layout, torch.bfloat16, device)


def _error(fn):
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


class TestInferenceOnly(expecttest.TestCase):
    def test_refused_with_grad(self):
        x, wg, sg, wu, su, wd, sd, rw, cu = _small_args()
        x.requires_grad_()
        scales = dict(w_gate_scale=sg, w_up_scale=su, w_down_scale=sd)
        lines = [
            _error(lambda: moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, **scales)),
            _error(lambda: moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, recompute=True, **scales)),
            _error(lambda: moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=torch.empty_like(x), **scales)),
            _error(lambda: moonep_ops.grouped_gemm(x, wg, cu, w_scale=sg)),
            _error(lambda: torch.ops.moonep.grouped_gemm_fp8(x, wg, sg, cu)),
            _error(lambda: torch.ops.moonep.grouped_gemm_fp8_out(x, wg, sg, cu, x.new_empty(x.shape[0], wg.shape[1]))),
            _error(lambda: torch.ops.moonep.experts_fp8(x.detach(), wg, sg, wu, su, wd, sd,
                                                        rw.detach().requires_grad_(), cu)),
        ]
        self.assertExpectedInline("\n".join(lines), """\
moonep::experts_fp8: FP8 weights are inference-only (no backward); call it under torch.no_grad() / inference_mode or with tensors that do not require grad
moonep::experts_fp8: FP8 weights are inference-only (no backward); call it under torch.no_grad() / inference_mode or with tensors that do not require grad
moonep::experts_fp8_out: FP8 weights are inference-only (no backward); call it under torch.no_grad() / inference_mode or with tensors that do not require grad
moonep::grouped_gemm_fp8: FP8 weights are inference-only (no backward); call it under torch.no_grad() / inference_mode or with tensors that do not require grad
moonep::grouped_gemm_fp8: FP8 weights are inference-only (no backward); call it under torch.no_grad() / inference_mode or with tensors that do not require grad
moonep::grouped_gemm_fp8_out: FP8 weights are inference-only (no backward); call it under torch.no_grad() / inference_mode or with tensors that do not require grad
moonep::experts_fp8: FP8 weights are inference-only (no backward); call it under torch.no_grad() / inference_mode or with tensors that do not require grad""")

    def test_runs_without_grad(self):
        args = list(_small_args())
        expected = torch.ops.moonep.experts_fp8(*args)
        args[0] = args[0].detach().requires_grad_()
        with torch.no_grad():
            assert torch.equal(torch.ops.moonep.experts_fp8(*args), expected)
        with torch.inference_mode():
            assert torch.equal(torch.ops.moonep.experts_fp8(*args), expected)
        out = torch.ops.moonep.experts_fp8(args[0].detach(), *args[1:])  # grad mode, nothing requires grad
        assert not out.requires_grad and torch.equal(out, expected)

    def test_out_variants_bump_the_version(self):
        x, wg, sg, wu, su, wd, sd, rw, cu = _small_args()
        out = torch.empty(x.shape[0], wg.shape[1], dtype=x.dtype)
        version = out._version
        torch.ops.moonep.grouped_gemm_fp8_out(x, wg, sg, cu, out)
        assert out._version > version
        out = torch.empty_like(x)
        version = out._version
        moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd)
        assert out._version > version


# --- torch.compile ------------------------------------------------------------------------------------

def test_compile_fullgraph():
    """The fakes trace the FP8 path: the same output as eager, no graph break, a new NvS reuses the graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def layer(x, w_gate, sg, w_up, su, w_down, sd, rw, cu):
        y = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, w_gate_scale=sg, w_up_scale=su,
                                      w_down_scale=sd)
        return moonep_ops.grouped_gemm(y, w_gate, cu, w_scale=sg)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for name in ("unpadded", "empty_segments"):
        args = _experts_args(LAYOUTS[LAYOUT_IDS.index(name)], torch.bfloat16, "cpu")
        with torch.no_grad():
            assert torch.equal(compiled(*args), layer(*args))
    assert dict(counters["graph_break"]) == {}
