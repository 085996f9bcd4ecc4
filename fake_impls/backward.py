"""Fake impls of the backward ops (see :mod:`moonep_ops.autograd`): the kernels' checks, then
empty contiguous results of the kernels' shapes and dtypes. ``NvS`` may be symbolic."""

import torch

from moonep_ops import _checks_backward as _bchecks

from . import _fake  # defined before fake_impls/__init__.py imports this module


@_fake("grouped_gemm_dgrad")
def grouped_gemm_dgrad(grad_out, w, cu_seqlens):
    _bchecks.check_grouped_gemm_dgrad("grouped_gemm_dgrad", grad_out, w, cu_seqlens)
    return grad_out.new_empty((grad_out.shape[0], w.shape[2]))


@_fake("grouped_gemm_dual_dgrad")
def grouped_gemm_dual_dgrad(grad_gate, grad_up, w_gate, w_up, cu_seqlens):
    _bchecks.check_grouped_gemm_dual_dgrad("grouped_gemm_dual_dgrad", grad_gate, grad_up, w_gate, w_up,
                                           cu_seqlens)
    return grad_gate.new_empty((grad_gate.shape[0], w_gate.shape[2]))


@_fake("grouped_gemm_wgrad")
def grouped_gemm_wgrad(grad_out, a, cu_seqlens):
    _bchecks.check_grouped_gemm_wgrad("grouped_gemm_wgrad", grad_out, a, cu_seqlens)
    return a.new_empty((cu_seqlens.shape[0], grad_out.shape[1], a.shape[1]))


def _activation_grads(rows_like: torch.Tensor, shape):
    d_gate = rows_like.new_empty(shape)
    d_up = rows_like.new_empty(shape)
    d_rw = rows_like.new_empty((shape[0],), dtype=_bchecks.grad_route_weights_dtype(rows_like.dtype))
    return d_gate, d_up, d_rw


@_fake("silu_mul_weight_backward")
def silu_mul_weight_backward(grad, gate, up, route_weights, cu_seqlens):
    _bchecks.check_silu_mul_weight_backward("silu_mul_weight_backward", grad, gate, up, route_weights,
                                            cu_seqlens)
    return _activation_grads(gate, gate.shape)


@_fake("grouped_gemm_silu_mul_backward")
def grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, route_weights, cu_seqlens):
    _bchecks.check_grouped_gemm_silu_mul_backward("grouped_gemm_silu_mul_backward", grad, x, w_gate, w_up,
                                                  route_weights, cu_seqlens)
    return _activation_grads(x, (x.shape[0], w_gate.shape[1]))
