"""CPU kernels of every op, forward and backward: a per-segment loop over ``torch.mm``,
accumulated in fp32 (fp64 for fp64). They are the reference the CUDA kernels are tested against.

The CPU path may read ``cu_seqlens`` on the host, so it also validates its values.
Rows at or past ``cu_seqlens[-1]`` are never read and come out as zeros.
"""

import torch

from .. import checks
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
