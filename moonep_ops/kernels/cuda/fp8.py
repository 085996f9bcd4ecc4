"""CUDA kernels of the FP8 block-scaled ops (:mod:`moonep_ops.fp8` gives the semantics).

``experts_fp8`` is three launches: ``x``'s live rows quantized once (a Triton kernel), the fused
gate/up GEMM, which writes ``act`` as e4m3 with per-row, per-128-column scales, then the down GEMM
on that ``act``. They launch in stream order, without PDL: the down GEMM's early programs would
only wait for the whole fused grid (the FP8 configs take no row-tile handoff), and a fused GEMM
launched while the quantization finishes ran slower (its programs start staggered). A GEMM that
the config table launches twice (large experts in small buffers: :func:`choose_gluon`) is the
exception: the launch that takes no work is a short scan of ``cu_seqlens``, and its pair's second
launch is a PDL dependent of the first (``MOONEP_OPS_PDL=0``: plain), started as the first's
programs finish. The GEMMs
run on the warp-specialized Gluon kernel on sm90 (as the bf16 ops do, ``MOONEP_OPS_GLUON`` and
``MOONEP_OPS_PORTABLE`` switching it off), else on :mod:`..triton.grouped_gemm_fp8`: e4m3
tensor-core MMAs exist from sm89 (Ada) on, and sm90 reads its weights by TMA unless
``MOONEP_OPS_PORTABLE`` asks for the pointer path that sm89 runs.
"""

import torch

from ... import checks, flags
from ...fp8 import num_blocks, weight_dims
from .paths import capability_of, contiguous, gluon_host, gluon_wanted, on_device
from .validate import SM89_FP8, validate


def choose(a, w, fused: bool):
    """(Fp8Config, use_tma) for ``a @ w[g].T``, measured on the benchmark shapes (H200): 64-row
    tiles in buffers of under 16 rows per group (unpadded decode), with two programs per SM for
    the down GEMM; else 128-row tiles on two warpgroups. 128 columns: one weight-scale block."""
    from ..triton.grouped_gemm_fp8 import Fp8Config, tma_weights

    cap = capability_of(a)
    if a.shape[0] < 16 * w.shape[0]:
        # (four stages of the fused GEMM's 64-row tiles take 120 KiB: over sm89's 99 KiB per block)
        cfg = Fp8Config(64, 128, 4, 4 if cap >= (9, 0) else 3) if fused else Fp8Config(64, 128, 4, 3, programs_per_sm=2)
    else:
        cfg = Fp8Config(128, 128, 8, 3) if fused else Fp8Config(128, 128, 8, 4)
    return cfg, cap >= (9, 0) and not flags.portable_only() and tma_weights(w)


def choose_gluon(a, w, w_up, out):
    """The Gluon kernel's config for e4m3 ``a`` against ``w`` (and ``w_up``: the fused GEMM), or
    the configs of its two launches (``on_multi_tile``), or None where TMA cannot address the
    operands."""
    from ..gluon import config
    from ..triton.grouped_gemm import tma_addressable
    from ..triton.grouped_gemm_fp8 import tma_weights

    weights = (w,) if w_up is None else (w, w_up)
    if not (tma_addressable(a) and a.numel() > 0 and all(tma_weights(t) for t in weights) and tma_addressable(out)):
        return None
    signature = (weight_dims(w)[1], a.shape[1], a.shape[0], w_up is not None)
    first = config.gluon_fp8_config(*signature, groups=w.shape[0])
    second = config.gluon_fp8_multi_tile_config(*signature, groups=w.shape[0])
    return first if second is None else (first, second)


def _gemm(a, a_scale, w, w_scale, w_up, w_up_scale, route_weights, cu, out, out_scale, gluon: bool, *,
          zero_tail=True, key=None, idle_weights=None):
    """One FP8 GEMM launch: the Gluon kernel where ``gluon`` and it applies, else the Triton one.
    ``idle_weights``: zeros mark rows of ``a`` that are zero (the Gluon kernel may skip them)."""
    from ..triton import grouped_gemm_fp8

    if gluon:
        host = gluon_host()
        scales = host.Fp8Scales(a_scale, w_scale, w_scale if w_up is None else w_up_scale, out_scale)
        ran = host.run(a, w, w_up, route_weights, cu, out, choose_gluon, zero_tail=zero_tail, scales=scales,
                       key=key, idle_weights=idle_weights, pair_pdl=flags.pdl())
        if ran is not host.GluonResult.NOT_APPLICABLE:
            return
    grouped_gemm_fp8.run(a, a_scale, w, w_scale, w_up, w_up_scale, route_weights, cu, out, out_scale, choose,
                         zero_tail=zero_tail)


def _quantized_rows(x, cu, route_weights=None):
    """e4m3 rows of ``x`` and their scales (live rows only; the tail stays unwritten and unread,
    and so do rows of route weight 0)."""
    from ..triton.grouped_gemm_fp8 import quantize_rows

    q = _scratch(x.shape, torch.float8_e4m3fn, x.device)
    scale = _scratch((x.shape[0], num_blocks(x.shape[1])), torch.float32, x.device)
    quantize_rows(x, cu, q, scale, route_weights)
    return q, scale


def _scratch(shape, dtype, device) -> torch.Tensor:
    """A buffer between two launches, written before its values are used (one seam: the tests
    poison it). The e4m3 rows of ``x`` of route weight 0 are never written: the fused epilogue
    discards their products."""
    return torch.empty(shape, dtype=dtype, device=device)


def gemm_into(a, w, w_scale, cu_seqlens, out, key=None) -> None:
    cu = contiguous(cu_seqlens)
    a_q, a_scale = _quantized_rows(a, cu)
    _gemm(a_q, a_scale, w, w_scale, None, None, None, cu, out, None, gluon_wanted(capability_of(a), a.dtype),
          key=key)


def experts_into(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens,
                 out, key=None) -> None:
    cu = contiguous(cu_seqlens)
    num_rows, inter = x.shape[0], weight_dims(w_gate)[1]
    if inter == 0:  # no act: every output row is an empty sum
        out.zero_()
        return
    route_weights = contiguous(route_weights)
    # A row of route weight 0 (MoonEP's padding) has act = 0: the quantization neither reads nor
    # writes it (in padded decode most rows), and the fused GEMM's epilogue zeroes its act row.
    x_q, x_scale = _quantized_rows(x, cu, route_weights)
    act = _scratch((num_rows, inter), torch.float8_e4m3fn, x.device)
    act_scale = _scratch((num_rows, num_blocks(inter)), torch.float32, x.device)
    # act's tail rows are never written: the down GEMM never reads rows past cu_seqlens[-1].
    gluon = gluon_wanted(capability_of(x), x.dtype)
    _gemm(x_q, x_scale, w_gate, w_gate_scale, w_up, w_up_scale, route_weights, cu, act, act_scale, gluon,
          zero_tail=False, key=key)
    # act's rows of route weight 0 are zero: the down GEMM may skip them (idle tiles).
    _gemm(act, act_scale, w_down, w_down_scale, None, None, None, cu, out, None, gluon, key=key,
          idle_weights=route_weights)


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def grouped_gemm_fp8(a, w, w_scale, cu_seqlens):
    key = validate(checks.check_grouped_gemm_fp8, "grouped_gemm_fp8", cu_seqlens, a, w, w_scale, cu_seqlens,
                   floor=SM89_FP8)
    out = _empty((a.shape[0], weight_dims(w)[1]), a)
    with on_device(a):
        _gemm_or_zeros(a, w, w_scale, cu_seqlens, out, key)
    return out


def grouped_gemm_fp8_out(a, w, w_scale, cu_seqlens, out) -> None:
    key = validate(checks.check_grouped_gemm_fp8_out, "grouped_gemm_fp8_out", cu_seqlens, a, w, w_scale,
                   cu_seqlens, out, floor=SM89_FP8)
    checks.check_grouped_gemm_fp8_out_overlap("grouped_gemm_fp8_out", a, w, w_scale, cu_seqlens, out)
    with on_device(a):
        _gemm_or_zeros(a, w, w_scale, cu_seqlens, out, key)


def _gemm_or_zeros(a, w, w_scale, cu_seqlens, out, key) -> None:
    if a.shape[1] == 0:  # K = 0: every row is an empty sum
        out.zero_()
    else:
        gemm_into(a, w, w_scale, cu_seqlens, out, key)


def experts_fp8(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens):
    args = (x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens)
    key = validate(checks.check_experts_fp8, "experts_fp8", cu_seqlens, *args, floor=SM89_FP8)
    out = _empty(x.shape, x)
    with on_device(x):
        _experts_or_zeros(*args, out, key=key)
    return out


def experts_fp8_out(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens,
                    out) -> None:
    args = (x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens)
    key = validate(checks.check_experts_fp8_out, "experts_fp8_out", cu_seqlens, *args, out, floor=SM89_FP8)
    checks.check_experts_fp8_out_overlap("experts_fp8_out", *args, out)
    with on_device(x):
        _experts_or_zeros(*args, out, key=key)


def _experts_or_zeros(*args, key) -> None:
    if args[-1].numel():  # (H = 0 or NvS = 0: nothing to write)
        experts_into(*args, key=key)
