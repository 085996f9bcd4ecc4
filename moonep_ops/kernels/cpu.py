"""CPU kernels: a per-segment loop over ``torch.mm``, accumulated in fp32 (fp64 for fp64).

The CPU path may read ``cu_seqlens`` on the host, so it also validates its values.
Rows at or past ``cu_seqlens[-1]`` are never read and come out as zeros.
"""

import torch

from .. import _checks
from .._library import lib


def segments(cu_seqlens: torch.Tensor):
    """Yield ``(g, start, end)`` for every non-empty segment (host-side, CPU only)."""
    start = 0
    for g, end in enumerate(cu_seqlens.tolist()):
        if end > start:
            yield g, start, end
        start = end


def grouped_gemm_into(a, w, cu_seqlens, out) -> None:
    """``out[seg_g] = a[seg_g] @ w[g].T``; tail rows set to zero."""
    acc = _checks.accum_dtype(a.dtype)
    end = 0
    for g, start, end in segments(cu_seqlens):
        out[start:end] = torch.mm(a[start:end].to(acc), w[g].to(acc).t()).to(out.dtype)
    # Rows before the last end that no segment covers do not exist (segments tile [0, cu[-1])),
    # so zeroing the tail is all that is left.
    out[end:].zero_()


def grouped_gemm(a, w, cu_seqlens):
    _checks.check_grouped_gemm("grouped_gemm", a, w, cu_seqlens)
    _checks.check_cu_seqlens_values("grouped_gemm", cu_seqlens, a.shape[0])
    out = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    grouped_gemm_into(a, w, cu_seqlens, out)
    return out


def grouped_gemm_out(a, w, cu_seqlens, out) -> None:
    _checks.check_grouped_gemm("grouped_gemm_out", a, w, cu_seqlens)
    _checks.check_out("grouped_gemm_out", out, (a.shape[0], w.shape[1]), a.dtype, a.device)
    _checks.check_cu_seqlens_values("grouped_gemm_out", cu_seqlens, a.shape[0])
    grouped_gemm_into(a, w, cu_seqlens, out)


def silu_mul_weight(gate, up, route_weights, cu_seqlens):
    _checks.check_silu_mul_weight("silu_mul_weight", gate, up, route_weights, cu_seqlens)
    _checks.check_cu_seqlens_values("silu_mul_weight", cu_seqlens, gate.shape[0])
    return silu_mul_weight_unchecked(gate, up, route_weights, cu_seqlens)


def silu_mul_weight_unchecked(gate, up, route_weights, cu_seqlens):
    """``silu(gate) * up * rw`` on the live rows, zeros in the tail (arguments already checked)."""
    acc = _checks.accum_dtype(gate.dtype)
    end = int(cu_seqlens[-1])
    out = torch.zeros_like(gate, memory_format=torch.contiguous_format)
    act = torch.nn.functional.silu(gate[:end].to(acc)) * up[:end].to(acc)
    if route_weights is not None:
        act = act * route_weights[:end, None].to(acc)
    out[:end] = act.to(gate.dtype)
    return out


def grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens):
    """Fused gate/up projections and activation: gate and up stay in the accumulation dtype."""
    _checks.check_grouped_gemm_silu_mul("grouped_gemm_silu_mul", x, w_gate, w_up, route_weights, cu_seqlens)
    _checks.check_cu_seqlens_values("grouped_gemm_silu_mul", cu_seqlens, x.shape[0])
    return _grouped_gemm_silu_mul_unchecked(x, w_gate, w_up, route_weights, cu_seqlens)


def _grouped_gemm_silu_mul_unchecked(x, w_gate, w_up, route_weights, cu_seqlens):
    acc = _checks.accum_dtype(x.dtype)
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
    _checks.check_grouped_gemm_silu_mul(name, x, w_gate, w_up, route_weights, cu_seqlens)
    _checks.check_cu_seqlens_values(name, cu_seqlens, x.shape[0])
    shape = (x.shape[0], w_gate.shape[1])
    gate = torch.empty(shape, dtype=x.dtype, device=x.device)
    up = torch.empty(shape, dtype=x.dtype, device=x.device)
    grouped_gemm_into(x, w_gate, cu_seqlens, gate)
    grouped_gemm_into(x, w_up, cu_seqlens, up)
    return silu_mul_weight_unchecked(gate, up, route_weights, cu_seqlens), gate, up


def experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens):
    _checks.check_experts("experts", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    _checks.check_cu_seqlens_values("experts", cu_seqlens, x.shape[0])
    out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    _experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
    return out


def experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    _checks.check_experts("experts_out", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    _checks.check_out("experts_out", out, (x.shape[0], x.shape[1]), x.dtype, x.device)
    _checks.check_cu_seqlens_values("experts_out", cu_seqlens, x.shape[0])
    _experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)


def _experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    act = _grouped_gemm_silu_mul_unchecked(x, w_gate, w_up, route_weights, cu_seqlens)
    grouped_gemm_into(act, w_down, cu_seqlens, out)


lib.impl("grouped_gemm", grouped_gemm, "CPU")
lib.impl("grouped_gemm_out", grouped_gemm_out, "CPU")
lib.impl("silu_mul_weight", silu_mul_weight, "CPU")
lib.impl("grouped_gemm_silu_mul", grouped_gemm_silu_mul, "CPU")
lib.impl("grouped_gemm_silu_mul_with_gate_up", grouped_gemm_silu_mul_with_gate_up, "CPU")
lib.impl("experts", experts, "CPU")
lib.impl("experts_out", experts_out, "CPU")
