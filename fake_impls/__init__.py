"""Fake (meta) impls of the ``moonep`` ops, for FakeTensor tracing, torch.compile and AOT.

Each fake runs the same argument checks as the real kernels (metadata only) and returns
an empty tensor with the real kernel's shape, dtype and (contiguous) strides. ``NvS`` may
be symbolic. Imported by ``moonep_ops/__init__.py``, so a user of ``moonep_ops`` always
has them registered.
"""

import torch

from moonep_ops import checks, fp8
from moonep_ops.schemas import NAMESPACE, lib


def _fake(name: str):
    return torch.library.register_fake(f"{NAMESPACE}::{name}", lib=lib)


@_fake("grouped_gemm")
def grouped_gemm(a, w, cu_seqlens):
    checks.check_grouped_gemm("grouped_gemm", a, w, cu_seqlens)
    return a.new_empty((a.shape[0], w.shape[1]))


@_fake("grouped_gemm_out")
def grouped_gemm_out(a, w, cu_seqlens, out):
    checks.check_grouped_gemm_out("grouped_gemm_out", a, w, cu_seqlens, out)


@_fake("silu_mul_weight")
def silu_mul_weight(gate, up, route_weights, cu_seqlens):
    checks.check_silu_mul_weight("silu_mul_weight", gate, up, route_weights, cu_seqlens)
    return gate.new_empty(gate.shape)


@_fake("grouped_gemm_silu_mul")
def grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens):
    checks.check_grouped_gemm_silu_mul("grouped_gemm_silu_mul", x, w_gate, w_up, route_weights, cu_seqlens)
    return x.new_empty((x.shape[0], w_gate.shape[1]))


@_fake("grouped_gemm_silu_mul_with_gate_up")
def grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens):
    checks.check_grouped_gemm_silu_mul("grouped_gemm_silu_mul_with_gate_up", x, w_gate, w_up, route_weights,
                                        cu_seqlens)
    shape = (x.shape[0], w_gate.shape[1])
    return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape)


@_fake("experts")
def experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens):
    checks.check_experts("experts", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    return x.new_empty(x.shape)


@_fake("experts_out")
def experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out):
    checks.check_experts_out("experts_out", x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)


# FP8 block-scaled ops ------------------------------------------------------------------------

@_fake("grouped_gemm_fp8")
def grouped_gemm_fp8(a, w, w_scale, cu_seqlens):
    checks.check_grouped_gemm_fp8("grouped_gemm_fp8", a, w, w_scale, cu_seqlens)
    return a.new_empty((a.shape[0], fp8.weight_dims(w)[1]))


@_fake("grouped_gemm_fp8_out")
def grouped_gemm_fp8_out(a, w, w_scale, cu_seqlens, out):
    checks.check_grouped_gemm_fp8_out("grouped_gemm_fp8_out", a, w, w_scale, cu_seqlens, out)


@_fake("experts_fp8")
def experts_fp8(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens):
    checks.check_experts_fp8("experts_fp8", x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale,
                             route_weights, cu_seqlens)
    return x.new_empty(x.shape)


@_fake("experts_fp8_out")
def experts_fp8_out(x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_weights, cu_seqlens,
                    out):
    checks.check_experts_fp8_out("experts_fp8_out", x, w_gate, w_gate_scale, w_up, w_up_scale, w_down,
                                 w_down_scale, route_weights, cu_seqlens, out)


# Backward ops --------------------------------------------------------------------------------

@_fake("grouped_gemm_dgrad")
def grouped_gemm_dgrad(grad_out, w, cu_seqlens):
    checks.check_grouped_gemm_dgrad("grouped_gemm_dgrad", grad_out, w, cu_seqlens)
    return grad_out.new_empty((grad_out.shape[0], w.shape[2]))


@_fake("grouped_gemm_dual_dgrad")
def grouped_gemm_dual_dgrad(grad_gate, grad_up, w_gate, w_up, cu_seqlens):
    checks.check_grouped_gemm_dual_dgrad("grouped_gemm_dual_dgrad", grad_gate, grad_up, w_gate, w_up,
                                           cu_seqlens)
    return grad_gate.new_empty((grad_gate.shape[0], w_gate.shape[2]))


@_fake("grouped_gemm_wgrad")
def grouped_gemm_wgrad(grad_out, a, cu_seqlens):
    checks.check_grouped_gemm_wgrad("grouped_gemm_wgrad", grad_out, a, cu_seqlens)
    return a.new_empty((cu_seqlens.shape[0], grad_out.shape[1], a.shape[1]))


def _activation_grads(rows_like: torch.Tensor, shape):
    d_gate = rows_like.new_empty(shape)
    d_up = rows_like.new_empty(shape)
    d_rw = rows_like.new_empty((shape[0],), dtype=checks.grad_route_weights_dtype(rows_like.dtype))
    return d_gate, d_up, d_rw


@_fake("silu_mul_weight_backward")
def silu_mul_weight_backward(grad, gate, up, route_weights, cu_seqlens):
    checks.check_silu_mul_weight_backward("silu_mul_weight_backward", grad, gate, up, route_weights,
                                            cu_seqlens)
    return _activation_grads(gate, gate.shape)


@_fake("grouped_gemm_silu_mul_backward")
def grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, route_weights, cu_seqlens):
    checks.check_grouped_gemm_silu_mul_backward("grouped_gemm_silu_mul_backward", grad, x, w_gate, w_up,
                                                  route_weights, cu_seqlens)
    return _activation_grads(x, (x.shape[0], w_gate.shape[1]))
