"""CPU kernels of the backward ops: per-segment ``torch.mm`` in fp32 (fp64 for fp64).

Like the forward CPU kernels they read ``cu_seqlens`` on the host and validate it. Rows at
or past ``cu_seqlens[-1]`` are never read; the row-shaped results are zero there.
"""

import torch

from .. import _checks
from .. import _checks_backward as _bchecks
from .._library import lib
from .cpu import grouped_gemm_into, segments


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
    _bchecks.check_grouped_gemm_dgrad("grouped_gemm_dgrad", grad_out, w, cu_seqlens)
    _checks.check_cu_seqlens_values("grouped_gemm_dgrad", cu_seqlens, grad_out.shape[0])
    out = torch.empty((grad_out.shape[0], w.shape[2]), dtype=grad_out.dtype, device=grad_out.device)
    # grad_out[seg] @ w[g] is the forward GEMM against w[g]^T: a transposed view, no copy.
    grouped_gemm_into(grad_out, w.transpose(1, 2), cu_seqlens, out)
    return out


def grouped_gemm_dual_dgrad(grad_gate, grad_up, w_gate, w_up, cu_seqlens):
    _bchecks.check_grouped_gemm_dual_dgrad("grouped_gemm_dual_dgrad", grad_gate, grad_up, w_gate, w_up,
                                           cu_seqlens)
    _checks.check_cu_seqlens_values("grouped_gemm_dual_dgrad", cu_seqlens, grad_gate.shape[0])
    acc = _checks.accum_dtype(grad_gate.dtype)
    out = torch.empty((grad_gate.shape[0], w_gate.shape[2]), dtype=grad_gate.dtype, device=grad_gate.device)
    end = 0
    for g, start, end in segments(cu_seqlens):
        res = grad_gate[start:end].to(acc) @ w_gate[g].to(acc)
        res += grad_up[start:end].to(acc) @ w_up[g].to(acc)
        out[start:end] = res.to(out.dtype)
    out[end:].zero_()
    return out


def grouped_gemm_wgrad(grad_out, a, cu_seqlens):
    _bchecks.check_grouped_gemm_wgrad("grouped_gemm_wgrad", grad_out, a, cu_seqlens)
    _checks.check_cu_seqlens_values("grouped_gemm_wgrad", cu_seqlens, a.shape[0])
    acc = _checks.accum_dtype(a.dtype)
    # Zeros for the groups no segment visits (empty segments).
    out = torch.zeros((cu_seqlens.shape[0], grad_out.shape[1], a.shape[1]), dtype=a.dtype, device=a.device)
    for g, start, end in segments(cu_seqlens):
        out[g] = (grad_out[start:end].to(acc).t() @ a[start:end].to(acc)).to(out.dtype)
    return out


def silu_mul_weight_backward(grad, gate, up, route_weights, cu_seqlens):
    _bchecks.check_silu_mul_weight_backward("silu_mul_weight_backward", grad, gate, up, route_weights,
                                            cu_seqlens)
    _checks.check_cu_seqlens_values("silu_mul_weight_backward", cu_seqlens, gate.shape[0])
    acc = _checks.accum_dtype(gate.dtype)
    end = int(cu_seqlens[-1])
    d_gate = torch.zeros(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.zeros(gate.shape, dtype=gate.dtype, device=gate.device)
    d_rw = torch.zeros(gate.shape[0], dtype=_bchecks.grad_route_weights_dtype(gate.dtype), device=gate.device)
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
    _bchecks.check_grouped_gemm_silu_mul_backward("grouped_gemm_silu_mul_backward", grad, x, w_gate, w_up,
                                                  route_weights, cu_seqlens)
    _checks.check_cu_seqlens_values("grouped_gemm_silu_mul_backward", cu_seqlens, x.shape[0])
    acc = _checks.accum_dtype(x.dtype)
    shape = (x.shape[0], w_gate.shape[1])
    d_gate = torch.zeros(shape, dtype=x.dtype, device=x.device)
    d_up = torch.zeros(shape, dtype=x.dtype, device=x.device)
    d_rw = torch.zeros(x.shape[0], dtype=_bchecks.grad_route_weights_dtype(x.dtype), device=x.device)
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


lib.impl("grouped_gemm_dgrad", grouped_gemm_dgrad, "CPU")
lib.impl("grouped_gemm_dual_dgrad", grouped_gemm_dual_dgrad, "CPU")
lib.impl("grouped_gemm_wgrad", grouped_gemm_wgrad, "CPU")
lib.impl("silu_mul_weight_backward", silu_mul_weight_backward, "CPU")
lib.impl("grouped_gemm_silu_mul_backward", grouped_gemm_silu_mul_backward, "CPU")
