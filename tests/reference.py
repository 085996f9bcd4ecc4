"""Float64 references, written independently of the kernels under test.

They find each row's group with ``searchsorted`` and work on boolean row masks, where the
kernels walk segment boundaries; tail rows are masked out before any arithmetic, so NaN
planted there cannot leak into the reference either.
"""

import torch


def row_groups(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index of each row, ``G`` for tail rows (at or past ``cu_seqlens[-1]``)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    rows = torch.arange(num_rows, dtype=torch.int64)
    return torch.searchsorted(cu, rows, right=True)


def grouped_gemm_ref(a, w, cu_seqlens) -> torch.Tensor:
    a64 = a.detach().to("cpu", torch.float64)
    w64 = w.detach().to("cpu", torch.float64)
    groups = row_groups(cu_seqlens, a.shape[0])
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    for g in torch.unique(groups).tolist():
        if g >= w.shape[0]:
            continue  # tail
        mask = groups == g
        out[mask] = a64[mask] @ w64[g].T
    return out


def silu_mul_weight_ref(gate, up, route_weights, cu_seqlens) -> torch.Tensor:
    g64 = gate.detach().to("cpu", torch.float64)
    u64 = up.detach().to("cpu", torch.float64)
    live = row_groups(cu_seqlens, gate.shape[0]) < cu_seqlens.numel()
    out = torch.zeros_like(g64)
    act = g64[live] / (1 + torch.exp(-g64[live])) * u64[live]
    if route_weights is not None:
        act = act * route_weights.detach().to("cpu", torch.float64)[live, None]
    out[live] = act
    return out


def grouped_gemm_silu_mul_ref(x, w_gate, w_up, route_weights, cu_seqlens) -> torch.Tensor:
    gate = grouped_gemm_ref(x, w_gate, cu_seqlens)
    up = grouped_gemm_ref(x, w_up, cu_seqlens)
    return silu_mul_weight_ref(gate, up, route_weights, cu_seqlens)


def experts_ref(x, w_gate, w_up, w_down, cu_seqlens, route_weights=None) -> torch.Tensor:
    """The whole expert path in float64 (no rounding of intermediates)."""
    act = grouped_gemm_silu_mul_ref(x, w_gate, w_up, route_weights, cu_seqlens)
    return grouped_gemm_ref(act, w_down, cu_seqlens)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN anywhere gives NaN, which fails any bound)."""
    ref = ref.detach().to("cpu", torch.float64)
    diff = out.detach().to("cpu", torch.float64) - ref
    denom = ref.norm()
    if denom == 0:
        return float(diff.norm())
    return float(diff.norm() / denom)


TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}
