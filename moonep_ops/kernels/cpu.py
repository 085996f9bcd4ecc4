"""CPU kernels of every op, forward and backward: a per-segment loop over ``torch.mm``,
accumulated in fp32 (fp64 for fp64). They are the reference the CUDA kernels are tested against.
The FP8 ops follow moonep_ops/fp8.py exactly, in fp32 (one matmul per 128-wide K block).

The CPU path may read ``cu_seqlens`` on the host, so it also validates its values.
Rows at or past ``cu_seqlens[-1]`` are never read and come out as zeros.
"""

import torch
import torch.nn.functional as F

from .. import checks
from ..fp8 import BLOCK, from_block_major, is_block_major, quantize_rows, weight_dims
from ..schemas import SCHEMAS, lib


def _validate(check, op_name: str, cu_seqlens, *args) -> None:
    """``check(op_name, *args)`` (metadata), then the values of ``cu_seqlens`` against the rows of
    ``args[0]``: the CPU path reads them anyway, so it validates them too."""
    check(op_name, *args)
    checks.check_cu_seqlens_values(op_name, cu_seqlens, args[0].shape[0])


def segments(cu_seqlens: torch.Tensor):
    """Yield ``(g, start, end)`` for every non-empty segment (host-side, CPU only)."""
    start = 0
    for g, end in enumerate(cu_seqlens.tolist()):
        if end > start:
            yield g, start, end
        start = end


def grouped_gemm_into(a, w, cu_seqlens, out) -> None:
    """``out[seg_g] = a[seg_g] @ w[g].T``; tail rows set to zero."""
    acc = checks.accum_dtype(a.dtype)
    end = 0
    for g, start, end in segments(cu_seqlens):
        out[start:end] = torch.mm(a[start:end].to(acc), w[g].to(acc).t()).to(out.dtype)
    # Rows before the last end that no segment covers do not exist (segments tile [0, cu[-1])),
    # so zeroing the tail is all that is left.
    out[end:].zero_()


def grouped_gemm(a, w, cu_seqlens):
    _validate(checks.check_grouped_gemm, "grouped_gemm", cu_seqlens, a, w, cu_seqlens)
    out = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    grouped_gemm_into(a, w, cu_seqlens, out)
    return out


def grouped_gemm_out(a, w, cu_seqlens, out) -> None:
    _validate(checks.check_grouped_gemm_out, "grouped_gemm_out", cu_seqlens, a, w, cu_seqlens, out)
    checks.check_grouped_gemm_out_overlap("grouped_gemm_out", a, w, cu_seqlens, out)
    grouped_gemm_into(a, w, cu_seqlens, out)


def silu_mul_weight(gate, up, route_weights, cu_seqlens):
    _validate(checks.check_silu_mul_weight, "silu_mul_weight", cu_seqlens,
              gate, up, route_weights, cu_seqlens)
    return silu_mul_weight_unchecked(gate, up, route_weights, cu_seqlens)


def silu_mul_weight_unchecked(gate, up, route_weights, cu_seqlens):
    """``silu(gate) * up * rw`` on the live rows, zeros in the tail (arguments already checked)."""
    acc = checks.accum_dtype(gate.dtype)
    end = int(cu_seqlens[-1])
    out = torch.zeros_like(gate, memory_format=torch.contiguous_format)
    act = torch.nn.functional.silu(gate[:end].to(acc)) * up[:end].to(acc)
    if route_weights is not None:
        act = act * route_weights[:end, None].to(acc)
    out[:end] = act.to(gate.dtype)
    return out


def grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens):
    """Fused gate/up projections and activation: gate and up stay in the accumulation dtype."""
    _validate(checks.check_grouped_gemm_silu_mul, "grouped_gemm_silu_mul", cu_seqlens,
              x, w_gate, w_up, route_weights, cu_seqlens)
    return _grouped_gemm_silu_mul_unchecked(x, w_gate, w_up, route_weights, cu_seqlens)


def _grouped_gemm_silu_mul_unchecked(x, w_gate, w_up, route_weights, cu_seqlens):
    acc = checks.accum_dtype(x.dtype)
    out = torch.empty((x.shape[0], w_gate.shape[1]), dtype=x.dtype, device=x.device)
    end = 0
    for g, start, end in segments(cu_seqlens):
        rows = x[start:end].to(acc)
        act = torch.nn.functional.silu(rows @ w_gate[g].to(acc).t()) * (rows @ w_up[g].to(acc).t())
        if route_weights is not None:
            act = act * route_weights[start:end, None].to(acc)
        out[start:end] = act.to(out.dtype)
    out[end:].zero_()
    return out


def grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens):
    """Gate and up as two grouped GEMMs (rounded to x's dtype), then the activation of those
    rounded values: bitwise what the unfused ops give."""
    name = "grouped_gemm_silu_mul_with_gate_up"
    _validate(checks.check_grouped_gemm_silu_mul, name, cu_seqlens,
              x, w_gate, w_up, route_weights, cu_seqlens)
    shape = (x.shape[0], w_gate.shape[1])
    gate = torch.empty(shape, dtype=x.dtype, device=x.device)
    up = torch.empty(shape, dtype=x.dtype, device=x.device)
    grouped_gemm_into(x, w_gate, cu_seqlens, gate)
    grouped_gemm_into(x, w_up, cu_seqlens, up)
    return silu_mul_weight_unchecked(gate, up, route_weights, cu_seqlens), gate, up


def experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens):
    _validate(checks.check_experts, "experts", cu_seqlens,
              x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    _experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
    return out


def experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    _validate(checks.check_experts_out, "experts_out", cu_seqlens,
              x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
    checks.check_experts_out_overlap("experts_out", x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
    _experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)


def _experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    act = _grouped_gemm_silu_mul_unchecked(x, w_gate, w_up, route_weights, cu_seqlens)
    grouped_gemm_into(act, w_down, cu_seqlens, out)


# FP8 block-scaled ops (semantics: moonep_ops/fp8.py) ------------------------------------------

def _fp8_segment_gemm(q_a, s_a, w, w_scale) -> torch.Tensor:
    """One segment's ``[m, N]`` fp32 result of the FP8 GEMM rule: per 128-wide K block, the sum
    of the fp8 products (a matmul of the fp8 values cast to fp32), times the row scale and the
    weight block's scale; then the blocks' sum, in fp32. ``q_a [m, K]`` e4m3fn, ``s_a [m, KB]``,
    ``w [N, K]`` e4m3fn, ``w_scale [ceil(N/128), KB]``."""
    m, k = q_a.shape
    n = w.shape[0]
    kb = s_a.shape[1]
    pad = kb * BLOCK - k  # zeros in the partial last block add nothing
    a_blocks = F.pad(q_a.float(), (0, pad)).reshape(m, kb, BLOCK).transpose(0, 1)  # [KB, m, 128]
    w_blocks = F.pad(w.float(), (0, pad)).reshape(n, kb, BLOCK).permute(1, 2, 0)  # [KB, 128, N]
    block_sums = torch.bmm(a_blocks, w_blocks)  # [KB, m, N]
    w_scale_per_col = w_scale.repeat_interleave(BLOCK, 0)[:n].t()  # [KB, N]
    return (block_sums * s_a.t()[:, :, None] * w_scale_per_col[:, None, :]).sum(0)


def _fp8_gemm_into(q, s, w, w_scale, cu_seqlens, out) -> None:
    """``out[seg_g]`` = the FP8 GEMM of the quantized live rows ``(q, s)`` with ``w[g]``, rounded
    to out's dtype once; tail rows set to zero."""
    end = 0
    for g, start, end in segments(cu_seqlens):
        out[start:end] = _fp8_segment_gemm(q[start:end], s[start:end], w[g], w_scale[g]).to(out.dtype)
    out[end:].zero_()


def _row_major(w: torch.Tensor) -> torch.Tensor:
    """A weight ``[G, N, K]`` (a copy of a block-major one: the same values)."""
    return from_block_major(w) if is_block_major(w) else w


def _live_rows(cu_seqlens) -> int:
    return int(cu_seqlens[-1])


def grouped_gemm_fp8(a, w, w_scale, cu_seqlens):
    _validate(checks.check_grouped_gemm_fp8, "grouped_gemm_fp8", cu_seqlens, a, w, w_scale, cu_seqlens)
    out = torch.empty((a.shape[0], weight_dims(w)[1]), dtype=a.dtype, device=a.device)
    _grouped_gemm_fp8_into(a, w, w_scale, cu_seqlens, out)
    return out


def grouped_gemm_fp8_out(a, w, w_scale, cu_seqlens, out) -> None:
    _validate(checks.check_grouped_gemm_fp8_out, "grouped_gemm_fp8_out", cu_seqlens, a, w, w_scale, cu_seqlens, out)
    checks.check_grouped_gemm_fp8_out_overlap("grouped_gemm_fp8_out", a, w, w_scale, cu_seqlens, out)
    _grouped_gemm_fp8_into(a, w, w_scale, cu_seqlens, out)


def _grouped_gemm_fp8_into(a, w, w_scale, cu_seqlens, out) -> None:
    q, s = quantize_rows(a[:_live_rows(cu_seqlens)])
    _fp8_gemm_into(q, s, _row_major(w), w_scale, cu_seqlens, out)


def experts_fp8(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens):
    args = (x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens)
    _validate(checks.check_experts_fp8, "experts_fp8", cu_seqlens, *args)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _experts_fp8_into(*args, out)
    return out


def experts_fp8_out(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens,
                    out) -> None:
    args = (x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens, out)
    _validate(checks.check_experts_fp8_out, "experts_fp8_out", cu_seqlens, *args)
    checks.check_experts_fp8_out_overlap("experts_fp8_out", *args)
    _experts_fp8_into(*args)


def _experts_fp8_into(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights,
                      cu_seqlens, out) -> None:
    w_gate, w_up, w_down = _row_major(w_gate), _row_major(w_up), _row_major(w_down)
    # x is quantized (read in full) before out is written: out may be x itself.
    q_x, s_x = quantize_rows(x[:_live_rows(cu_seqlens)])
    act = torch.empty((q_x.shape[0], w_gate.shape[1]), dtype=torch.float32, device=x.device)
    for g, start, end in segments(cu_seqlens):  # the segments tile the live rows
        rows = (q_x[start:end], s_x[start:end])
        gate = _fp8_segment_gemm(*rows, w_gate[g], w_gate_scale[g])
        up = _fp8_segment_gemm(*rows, w_up[g], w_up_scale[g])
        seg_act = F.silu(gate) * up
        if route_weights is not None:
            seg_act = seg_act * route_weights[start:end, None]
        act[start:end] = seg_act
    q_act, s_act = quantize_rows(act)
    _fp8_gemm_into(q_act, s_act, w_down, w_down_scale, cu_seqlens, out)


# Backward ops --------------------------------------------------------------------------------

def silu_mul_backward_rows(grad, gate, up, route_weights):
    """``d gate, d up, d route_weights`` of ``silu(gate) * up * rw`` for live rows, in the
    inputs' (accumulation) dtype. ``route_weights`` is ``[rows]`` or None."""
    sig = torch.sigmoid(gate)
    silu = gate * sig
    weighted = grad if route_weights is None else grad * route_weights[:, None]
    d_up = weighted * silu
    # d silu(g)/dg = sig * (1 + g * (1 - sig))
    d_gate = weighted * up * sig * (1 + gate * (1 - sig))
    d_rw = None if route_weights is None else (grad * silu * up).sum(dim=1)
    return d_gate, d_up, d_rw


def grouped_gemm_dgrad(grad_out, w, cu_seqlens):
    _validate(checks.check_grouped_gemm_dgrad, "grouped_gemm_dgrad", cu_seqlens,
              grad_out, w, cu_seqlens)
    out = torch.empty((grad_out.shape[0], w.shape[2]), dtype=grad_out.dtype, device=grad_out.device)
    # grad_out[seg] @ w[g] is the forward GEMM against w[g]^T: a transposed view, no copy.
    grouped_gemm_into(grad_out, w.transpose(1, 2), cu_seqlens, out)
    return out


def grouped_gemm_dual_dgrad(grad_gate, grad_up, w_gate, w_up, cu_seqlens):
    _validate(checks.check_grouped_gemm_dual_dgrad, "grouped_gemm_dual_dgrad", cu_seqlens,
              grad_gate, grad_up, w_gate, w_up, cu_seqlens)
    acc = checks.accum_dtype(grad_gate.dtype)
    out = torch.empty((grad_gate.shape[0], w_gate.shape[2]), dtype=grad_gate.dtype, device=grad_gate.device)
    end = 0
    for g, start, end in segments(cu_seqlens):
        res = grad_gate[start:end].to(acc) @ w_gate[g].to(acc)
        res += grad_up[start:end].to(acc) @ w_up[g].to(acc)
        out[start:end] = res.to(out.dtype)
    out[end:].zero_()
    return out


def grouped_gemm_wgrad(grad_out, a, cu_seqlens):
    _validate(checks.check_grouped_gemm_wgrad, "grouped_gemm_wgrad", cu_seqlens, grad_out, a, cu_seqlens)
    acc = checks.accum_dtype(a.dtype)
    # Zeros for the groups no segment visits (empty segments).
    out = torch.zeros((cu_seqlens.shape[0], grad_out.shape[1], a.shape[1]), dtype=a.dtype, device=a.device)
    for g, start, end in segments(cu_seqlens):
        out[g] = (grad_out[start:end].to(acc).t() @ a[start:end].to(acc)).to(out.dtype)
    return out


def silu_mul_weight_backward(grad, gate, up, route_weights, cu_seqlens):
    _validate(checks.check_silu_mul_weight_backward, "silu_mul_weight_backward", cu_seqlens,
              grad, gate, up, route_weights, cu_seqlens)
    acc = checks.accum_dtype(gate.dtype)
    end = int(cu_seqlens[-1])
    d_gate = torch.zeros(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.zeros(gate.shape, dtype=gate.dtype, device=gate.device)
    d_rw = torch.zeros(gate.shape[0], dtype=checks.grad_route_weights_dtype(gate.dtype), device=gate.device)
    rw = None if route_weights is None else route_weights[:end].to(acc)
    dg, du, dr = silu_mul_backward_rows(grad[:end].to(acc), gate[:end].to(acc), up[:end].to(acc), rw)
    d_gate[:end] = dg.to(d_gate.dtype)
    d_up[:end] = du.to(d_up.dtype)
    if dr is not None:
        d_rw[:end] = dr.to(d_rw.dtype)
    return d_gate, d_up, d_rw


def grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, route_weights, cu_seqlens):
    """Recomputes gate and up per segment (in the accumulation dtype, as the fused forward
    does) and applies the activation's backward to them."""
    _validate(checks.check_grouped_gemm_silu_mul_backward, "grouped_gemm_silu_mul_backward", cu_seqlens,
              grad, x, w_gate, w_up, route_weights, cu_seqlens)
    acc = checks.accum_dtype(x.dtype)
    shape = (x.shape[0], w_gate.shape[1])
    d_gate = torch.zeros(shape, dtype=x.dtype, device=x.device)
    d_up = torch.zeros(shape, dtype=x.dtype, device=x.device)
    d_rw = torch.zeros(x.shape[0], dtype=checks.grad_route_weights_dtype(x.dtype), device=x.device)
    for g, start, end in segments(cu_seqlens):
        rows = x[start:end].to(acc)
        gate = rows @ w_gate[g].to(acc).t()
        up = rows @ w_up[g].to(acc).t()
        rw = None if route_weights is None else route_weights[start:end].to(acc)
        dg, du, dr = silu_mul_backward_rows(grad[start:end].to(acc), gate, up, rw)
        d_gate[start:end] = dg.to(d_gate.dtype)
        d_up[start:end] = du.to(d_up.dtype)
        if dr is not None:
            d_rw[start:end] = dr.to(d_rw.dtype)
    return d_gate, d_up, d_rw


for _name in SCHEMAS:
    lib.impl(_name, globals()[_name], "CPU")
