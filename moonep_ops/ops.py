"""Public Python API: thin calls of the ``torch.ops.moonep`` ops.

Schemas live in :mod:`moonep_ops.schemas`, kernels in :mod:`moonep_ops.kernels`, fakes in
the top-level ``fake_impls`` package.
"""

from typing import Optional

import torch

from . import autocast, checks
from .schemas import overloads as _ops

_FP8 = torch.float8_e4m3fn


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor, *,
                 w_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[seg_g] = a[seg_g] @ w[g].T`` for each segment of ``cu_seqlens``.

    Args:
        a: ``[NvS, K]`` rows in segment order.
        w: ``[G, N, K]`` weights (vLLM's ``[E, N, K]`` convention).
        cu_seqlens: ``[G]`` int32 cumulative segment ends (no leading zero).
        w_scale: with ``torch.float8_e4m3fn`` weights (and only then), their fp32 scales per
            128 x 128 block, ``[G, ceil(N/128), ceil(K/128)]``: the call is then the FP8 op
            ``grouped_gemm_fp8`` (``a`` bf16/fp16, quantized per row and 128 columns inside;
            inference only; semantics in :mod:`moonep_ops.fp8`).
        out: optional contiguous ``[NvS, N]`` buffer to write into (not differentiable).

    Returns:
        ``[NvS, N]`` in ``a``'s dtype, accumulated in fp32. Rows at or past
        ``cu_seqlens[-1]`` are zero, and those rows of ``a`` are never read.
    """
    # The FP8 op only with a scale or e4m3fn weights: one cheap test in front of the bf16 path.
    if w_scale is None and not _is_fp8(w):
        if out is None:
            return _ops.grouped_gemm(a, w, cu_seqlens)
        _ops.grouped_gemm_out(a, w, cu_seqlens, out)
        return out
    return _grouped_gemm_fp8(a, w, w_scale, cu_seqlens, out)


def _grouped_gemm_fp8(a, w, w_scale, cu_seqlens, out):
    name = "grouped_gemm_fp8" if out is None else "grouped_gemm_fp8_out"
    checks.check_fp8_weights_and_scales(name, (("w", w),), (("w_scale", w_scale),))
    if out is None:
        return _ops.grouped_gemm_fp8(a, w, w_scale, cu_seqlens)
    _ops.grouped_gemm_fp8_out(a, w, w_scale, cu_seqlens, out)
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
                   out: Optional[torch.Tensor] = None, recompute: bool = False,
                   w_gate_scale: Optional[torch.Tensor] = None, w_up_scale: Optional[torch.Tensor] = None,
                   w_down_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The whole MoonEP expert compute over dispatched rows.

    ``x`` is ``[NvS, H]``, ``w_gate``/``w_up`` are ``[G, I, H]``, ``w_down`` is ``[G, H, I]``.
    Returns ``[NvS, H]`` (written into ``out`` when given); rows at or past
    ``cu_seqlens[-1]`` are zero.

    Without autograd (inference) this is one op, ``moonep::experts`` (``experts_out`` with
    ``out=``): the fused gate/up GEMM with its activation, then the down GEMM on ``act``, which is
    stored in ``x``'s dtype between the two (as :func:`grouped_gemm_silu_mul` returns it); ``act``'s
    tail rows are never written (only the down GEMM reads ``act``, and never there). When a gradient
    is needed, ``recompute=False`` (default) runs :func:`grouped_gemm_silu_mul_with_gate_up`: the
    same fused GEMM, which also writes gate and up (in x's dtype) for autograd to save, as
    torchtitan-style training does (2 x ``[NvS, I]``); the backward reuses them, with one dual
    dgrad for ``dx``. ``recompute=True`` saves neither and recomputes gate/up in the backward
    (less activation memory, slower); docs/training.md gives both paths' speed on the H200.

    FP8: with ``torch.float8_e4m3fn`` weights, pass the three fp32 block scales
    (``w_*_scale [G, ceil(N/128), ceil(K/128)]`` for a weight ``[G, N, K]``); the call is then the
    op ``experts_fp8`` (``experts_fp8_out`` with ``out=``, which may be ``x``): ``x`` bf16/fp16,
    quantized per row and 128 columns inside, as is the activation before the down GEMM
    (semantics in :mod:`moonep_ops.fp8`). Inference only: it raises if an input requires grad in
    grad mode; ``recompute`` does not apply.
    """
    # FP8 weights or any scale: the FP8 op. The bf16 path pays only these four tests.
    if (w_gate_scale is not None or w_up_scale is not None or w_down_scale is not None
            or _is_fp8(w_gate)):
        return _experts_fp8(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights,
                            cu_seqlens, out)
    if out is not None:  # (with a gradient wanted, experts_out's Autograd kernel raises under its name)
        _ops.experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
        return out
    if not _needs_grad(x, w_gate, w_up, w_down, route_weights):
        return _ops.experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    # Training composes the separate ops; bad input still reads as the experts op's error, as
    # without grad (under torch.compile the ops' fakes check: Dynamo cannot trace the lazy messages).
    _check_tensors_or_none(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    x, w_gate, w_up, w_down = autocast.cast_if_enabled((x, w_gate, w_up, w_down))  # (as the op would)
    if not torch.compiler.is_compiling():
        _check_experts_args(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    if recompute or not _needs_grad(x, w_gate, w_up, route_weights):  # (only w_down: nothing to save)
        act = _ops.grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens)
    else:
        act, _, _ = _ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens)
    return _ops.grouped_gemm(act, w_down, cu_seqlens)


def _experts_fp8(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens, out):
    name = "experts_fp8" if out is None else "experts_fp8_out"
    checks.check_fp8_weights_and_scales(name, (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)),
                                        (("w_gate_scale", w_gate_scale), ("w_up_scale", w_up_scale),
                                         ("w_down_scale", w_down_scale)))
    args = (x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens)
    if out is None:
        return _ops.experts_fp8(*args)
    _ops.experts_fp8_out(*args, out)
    return out


def _check_experts_args(x, w_gate, w_up, w_down, route_weights, cu_seqlens) -> None:
    """What ``moonep::experts`` checks, under its name: the metadata, then the values of
    ``cu_seqlens`` where that op reads them (CPU; CUDA with ``MOONEP_OPS_DEBUG=1``)."""
    checks.checked(checks.check_experts, "experts", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    if cu_seqlens.device.type == "cpu":
        checks.check_cu_seqlens_values("experts", cu_seqlens, x.shape[0])
    elif cu_seqlens.device.type == "cuda":
        checks.debug_checks("experts", cu_seqlens, x.shape[0])


def _check_tensors_or_none(*args) -> None:
    if not all(t is None or isinstance(t, torch.Tensor) for t in args):
        _ops.experts(*args)  # raises: the dispatcher names the argument that is not a Tensor


def _is_fp8(w) -> bool:
    # (Anything but a Tensor goes on to the op, whose error names it.)
    return isinstance(w, torch.Tensor) and w.dtype is _FP8


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
