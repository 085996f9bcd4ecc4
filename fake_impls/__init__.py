"""Fake (meta) impls of the ``moonep`` ops, for FakeTensor tracing, torch.compile and AOT.

Each fake runs the same argument checks as the real kernels (metadata only) and returns
an empty tensor with the real kernel's shape, dtype and (contiguous) strides. ``NvS`` may
be symbolic. Imported by ``moonep_ops/__init__.py``, so a user of ``moonep_ops`` always
has them registered.
"""

import torch

from moonep_ops import _checks
from moonep_ops._library import NAMESPACE, lib


def _fake(name: str):
    return torch.library.register_fake(f"{NAMESPACE}::{name}", lib=lib)


@_fake("grouped_gemm")
def grouped_gemm(a, w, cu_seqlens):
    _checks.check_grouped_gemm("grouped_gemm", a, w, cu_seqlens)
    return a.new_empty((a.shape[0], w.shape[1]))


@_fake("grouped_gemm_out")
def grouped_gemm_out(a, w, cu_seqlens, out):
    _checks.check_grouped_gemm("grouped_gemm_out", a, w, cu_seqlens)
    _checks.check_out("grouped_gemm_out", out, (a.shape[0], w.shape[1]), a.dtype, a.device)


@_fake("silu_mul_weight")
def silu_mul_weight(gate, up, route_weights, cu_seqlens):
    _checks.check_silu_mul_weight("silu_mul_weight", gate, up, route_weights, cu_seqlens)
    return gate.new_empty(gate.shape)


@_fake("grouped_gemm_silu_mul")
def grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens):
    _checks.check_grouped_gemm_silu_mul("grouped_gemm_silu_mul", x, w_gate, w_up, route_weights, cu_seqlens)
    return x.new_empty((x.shape[0], w_gate.shape[1]))


@_fake("grouped_gemm_silu_mul_with_gate_up")
def grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens):
    _checks.check_grouped_gemm_silu_mul("grouped_gemm_silu_mul_with_gate_up", x, w_gate, w_up, route_weights,
                                        cu_seqlens)
    shape = (x.shape[0], w_gate.shape[1])
    return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape)


@_fake("experts")
def experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens):
    _checks.check_experts("experts", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    return x.new_empty(x.shape)


@_fake("experts_out")
def experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out):
    _checks.check_experts("experts_out", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    _checks.check_out("experts_out", out, tuple(x.shape), x.dtype, x.device)


from . import backward  # noqa: F401,E402  (fakes of the backward ops)
