"""Public Python API: thin calls of the ``torch.ops.moonep`` ops.

Schemas live in :mod:`moonep_ops.schemas`, kernels in :mod:`moonep_ops.kernels`, fakes in
the top-level ``fake_impls`` package.
"""

from typing import Optional

import torch

from . import checks
from .schemas import overloads as _ops



def grouped_gemm(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor, *,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[seg_g] = a[seg_g] @ w[g].T`` for each segment of ``cu_seqlens``.

    Args:
        a: ``[NvS, K]`` rows in segment order.
        w: ``[G, N, K]`` weights (vLLM's ``[E, N, K]`` convention).
        cu_seqlens: ``[G]`` int32 cumulative segment ends (no leading zero).
        out: optional contiguous ``[NvS, N]`` buffer to write into (not differentiable).

    Returns:
        ``[NvS, N]`` in ``a``'s dtype, accumulated in fp32. Rows at or past
        ``cu_seqlens[-1]`` are zero, and those rows of ``a`` are never read.
    """
    if out is None:
        return _ops.grouped_gemm(a, w, cu_seqlens)
    _ops.grouped_gemm_out(a, w, cu_seqlens, out)
    return out


def silu_mul_weight(gate: torch.Tensor, up: torch.Tensor,
                    route_weights: Optional[torch.Tensor],
                    cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * route_weights[:, None]``, computed in fp32, in ``gate``'s dtype.

    ``route_weights`` is ``[NvS]`` fp32, or None when the router weight was applied to the
    input before dispatch (top-1, Llama-4 style). Rows at or past ``cu_seqlens[-1]`` are
    zero and never read.
    """
    return _ops.silu_mul_weight(gate, up, route_weights, cu_seqlens)


def grouped_gemm_silu_mul(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                          route_weights: Optional[torch.Tensor],
                          cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Fused ``silu(x @ w_gate[g].T) * (x @ w_up[g].T) * route_weights[:, None]`` per segment.

    One grouped GEMM that reads each ``x`` tile once for both projections and applies the
    activation to the fp32 accumulators: gate and up are never rounded or written out.
    Returns ``act [NvS, I]`` in ``x``'s dtype; rows at or past ``cu_seqlens[-1]`` are zero.
    """
    return _ops.grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens)


def grouped_gemm_silu_mul_with_gate_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                                       route_weights: Optional[torch.Tensor], cu_seqlens: torch.Tensor):
    """The fused gate/up GEMM for training: ``(act, gate, up)``, each ``[NvS, I]`` in ``x``'s dtype.

    One pass over ``x`` as in :func:`grouped_gemm_silu_mul`, but gate and up are also written
    (rounded to ``x``'s dtype) and ``act = silu(gate) * up * route_weights[:, None]`` is
    computed from those rounded values, as ``silu_mul_weight`` would: the three outputs are
    what ``grouped_gemm`` twice and ``silu_mul_weight`` give (bitwise on CPU; on CUDA up to the
    GEMM tiles' accumulation order), and the backward reuses the saved gate and up instead of
    recomputing them. Rows at or past ``cu_seqlens[-1]`` are zero.
    """
    return _ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens)


def moonep_experts(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, cu_seqlens: torch.Tensor,
                   route_weights: Optional[torch.Tensor] = None, *,
                   out: Optional[torch.Tensor] = None, recompute: bool = False) -> torch.Tensor:
    """The whole MoonEP expert compute over dispatched rows.

    ``x`` is ``[NvS, H]``, ``w_gate``/``w_up`` are ``[G, I, H]``, ``w_down`` is ``[G, H, I]``.
    Returns ``[NvS, H]`` (written into ``out`` when given); rows at or past
    ``cu_seqlens[-1]`` are zero.

    Without autograd (inference) this is one op, ``moonep::experts`` (``experts_out`` with
    ``out=``): the fused gate/up GEMM with its activation, then the down GEMM; the intermediate
    ``act``'s tail rows are never written (only the down GEMM reads ``act``, and never there). When a gradient
    is needed, ``recompute=False`` (default) runs :func:`grouped_gemm_silu_mul_with_gate_up`: the
    same fused GEMM, which also writes gate and up (in x's dtype) for autograd to save, as
    torchtitan-style training does (2 x ``[NvS, I]``); the backward reuses them, with one dual
    dgrad for ``dx``. ``recompute=True`` saves neither and recomputes gate/up in the backward
    (less activation memory, slower); docs/training.md gives both paths' speed on the H200.
    """
    if not _needs_grad(x, w_gate, w_up, w_down, route_weights):
        if out is None:
            return _ops.experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
        _ops.experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
        return out
    # Training composes the separate ops; bad input still reads as the experts op's error, as
    # without grad (under torch.compile the ops' fakes check: Dynamo cannot trace the lazy messages).
    if not torch.compiler.is_compiling():
        _check_experts_args(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    if recompute or not _needs_grad(x, w_gate, w_up, route_weights):  # (only w_down: nothing to save)
        act = _ops.grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens)
    else:
        act, _, _ = _ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens)
    return grouped_gemm(act, w_down, cu_seqlens, out=out)


def _check_experts_args(x, w_gate, w_up, w_down, route_weights, cu_seqlens) -> None:
    """What ``moonep::experts`` checks, under its name: the metadata, then the values of
    ``cu_seqlens`` where that op reads them (CPU; CUDA with ``MOONEP_OPS_DEBUG=1``)."""
    checks.checked(checks.check_experts, "experts", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    if cu_seqlens.device.type == "cpu":
        checks.check_cu_seqlens_values("experts", cu_seqlens, x.shape[0])
    elif cu_seqlens.device.type == "cuda":
        checks.debug_checks("experts", cu_seqlens, x.shape[0])


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
