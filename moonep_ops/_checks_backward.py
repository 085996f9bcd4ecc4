"""Argument checks of the backward ops, shared by their kernels and fakes.

Same rules as :mod:`moonep_ops._checks` (metadata only, never a host sync, symbolic sizes
deferred by ``torch._check``), built from its helpers; a file of its own so the forward
checks and these can change independently.
"""

import torch

from ._checks import (_check, _check_cu_seqlens_meta, _check_dtype, _check_same_device, _check_same_dtype, _fail,
                      _shape, check_grouped_gemm_silu_mul, check_silu_mul_weight)


def _check_same_shape_dtype(op_name: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    _check(
        t.dim() == ref.dim() and all(a == b for a, b in zip(t.shape, ref.shape)),
        _fail(op_name, lambda: f"{name} has shape {_shape(t)} but {ref_name} has shape {_shape(ref)}; "
              "they must match"),
    )
    _check_same_dtype(op_name, name, t, ref_name, ref)


def check_grouped_gemm_dgrad(op_name: str, grad_out: torch.Tensor, w: torch.Tensor,
                             cu_seqlens: torch.Tensor) -> None:
    """``grad_out [NvS, N]``, ``w [G, N, K]``, ``cu_seqlens [G]``."""
    _check(grad_out.dim() == 2,
           _fail(op_name, lambda: f"grad_out must be 2-D [NvS, N], got shape {_shape(grad_out)}"))
    _check(w.dim() == 3, _fail(op_name, lambda: f"w must be 3-D [G, N, K], got shape {_shape(w)}"))
    _check(w.shape[0] >= 1, _fail(op_name, lambda: f"w must have G >= 1 groups, got shape {_shape(w)}"))
    _check(
        grad_out.shape[1] == w.shape[1],
        _fail(op_name, lambda: f"grad_out is [NvS, N] = {_shape(grad_out)} and w is [G, N, K] = {_shape(w)}: "
              "N must match (grad_a = grad_out @ w[g])"),
    )
    _check_dtype(op_name, "grad_out", grad_out)
    _check_same_dtype(op_name, "w", w, "grad_out", grad_out)
    _check_same_device(op_name, "grad_out", grad_out, w=w, cu_seqlens=cu_seqlens)
    _check_cu_seqlens_meta(op_name, cu_seqlens, w.shape[0])


def check_grouped_gemm_dual_dgrad(op_name: str, grad_gate: torch.Tensor, grad_up: torch.Tensor,
                                  w_gate: torch.Tensor, w_up: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """``grad_gate``, ``grad_up [NvS, I]``; ``w_gate``, ``w_up [G, I, H]``; ``cu_seqlens [G]``."""
    check_grouped_gemm_dgrad(op_name, grad_gate, w_gate, cu_seqlens)
    _check_same_shape_dtype(op_name, "grad_up", grad_up, "grad_gate", grad_gate)
    _check_same_shape_dtype(op_name, "w_up", w_up, "w_gate", w_gate)
    _check_same_device(op_name, "grad_gate", grad_gate, grad_up=grad_up, w_up=w_up)


def check_grouped_gemm_wgrad(op_name: str, grad_out: torch.Tensor, a: torch.Tensor,
                             cu_seqlens: torch.Tensor) -> None:
    """``grad_out [NvS, N]``, ``a [NvS, K]``, ``cu_seqlens [G]`` (G is taken from cu_seqlens)."""
    _check(grad_out.dim() == 2,
           _fail(op_name, lambda: f"grad_out must be 2-D [NvS, N], got shape {_shape(grad_out)}"))
    _check(a.dim() == 2, _fail(op_name, lambda: f"a must be 2-D [NvS, K], got shape {_shape(a)}"))
    _check(
        grad_out.shape[0] == a.shape[0],
        _fail(op_name, lambda: f"grad_out is [NvS, N] = {_shape(grad_out)} and a is [NvS, K] = {_shape(a)}: "
              "NvS must match (grad_w[g] = grad_out[seg].T @ a[seg])"),
    )
    _check_dtype(op_name, "grad_out", grad_out)
    _check_same_dtype(op_name, "a", a, "grad_out", grad_out)
    _check_same_device(op_name, "grad_out", grad_out, a=a, cu_seqlens=cu_seqlens)
    _check_cu_seqlens_meta(op_name, cu_seqlens)


def check_silu_mul_weight_backward(op_name: str, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                                   route_weights, cu_seqlens: torch.Tensor) -> None:
    check_silu_mul_weight(op_name, gate, up, route_weights, cu_seqlens)
    _check_same_shape_dtype(op_name, "grad", grad, "gate", gate)
    _check_same_device(op_name, "gate", gate, grad=grad)


def check_grouped_gemm_silu_mul_backward(op_name: str, grad: torch.Tensor, x: torch.Tensor,
                                         w_gate: torch.Tensor, w_up: torch.Tensor, route_weights,
                                         cu_seqlens: torch.Tensor) -> None:
    check_grouped_gemm_silu_mul(op_name, x, w_gate, w_up, route_weights, cu_seqlens)
    expected = (x.shape[0], w_gate.shape[1])
    _check(
        grad.dim() == 2 and grad.shape[0] == expected[0] and grad.shape[1] == expected[1],
        _fail(op_name, lambda: f"grad has shape {_shape(grad)}, expected [NvS, I] = "
              f"[{expected[0]}, {expected[1]}] (the forward output's shape)"),
    )
    _check_same_dtype(op_name, "grad", grad, "x", x)
    _check_same_device(op_name, "x", x, grad=grad)


def grad_route_weights_dtype(dtype: torch.dtype) -> torch.dtype:
    """``d route_weights`` is returned in the accumulation dtype: fp32, fp64 for fp64 rows."""
    return torch.float64 if dtype == torch.float64 else torch.float32
