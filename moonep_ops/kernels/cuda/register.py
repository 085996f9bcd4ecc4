"""CUDA kernels of every op, registered for the CUDA dispatch key: checks, output allocation,
then the kernel (:mod:`.paths` picks which).

Argument checks read metadata only and run once per static signature; ``MOONEP_OPS_DEBUG=1``
adds the data checks on ``cu_seqlens``, which sync the host. Nothing else syncs: every output is
allocated from static shapes and every kernel reads ``cu_seqlens`` on the device. Triton is
imported at the first call.
"""

import torch

from ... import checks
from ...schemas import SCHEMAS, lib
from ..triton import configs
from .experts import experts_into
from .fp8 import experts_fp8, experts_fp8_out, grouped_gemm_fp8, grouped_gemm_fp8_out  # noqa: F401
from .paths import (capability_of, choose_dgrad, choose_dual_dgrad, choose_fused, contiguous, hopper_tma, on_device,
                    run_fused, run_unfused)
from .validate import validate


def _empty(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def grouped_gemm(a, w, cu_seqlens):
    key = validate(checks.check_grouped_gemm, "grouped_gemm", cu_seqlens, a, w, cu_seqlens)
    out = _empty((a.shape[0], w.shape[1]), a)
    with on_device(a):
        run_unfused(a, w, contiguous(cu_seqlens), out, key=key)
    return out


def grouped_gemm_out(a, w, cu_seqlens, out) -> None:
    key = validate(checks.check_grouped_gemm_out, "grouped_gemm_out", cu_seqlens, a, w, cu_seqlens, out)
    checks.check_grouped_gemm_out_overlap("grouped_gemm_out", a, w, cu_seqlens, out)
    with on_device(a):
        run_unfused(a, w, contiguous(cu_seqlens), out, key=key)


def silu_mul_weight(gate, up, route_weights, cu_seqlens):
    from ..triton.silu_mul_weight import launch_silu_mul_weight

    validate(checks.check_silu_mul_weight, "silu_mul_weight", cu_seqlens,
             gate, up, route_weights, cu_seqlens)
    out = _empty(gate.shape, gate)
    with on_device(gate):
        launch_silu_mul_weight(gate, up, contiguous(route_weights), contiguous(cu_seqlens), out,
                               configs.eltwise_config(gate.shape[1], capability_of(gate)))
    return out


def grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens):
    key = validate(checks.check_grouped_gemm_silu_mul, "grouped_gemm_silu_mul", cu_seqlens,
                   x, w_gate, w_up, route_weights, cu_seqlens)
    out = _empty((x.shape[0], w_gate.shape[1]), x)
    with on_device(x):
        run_fused(x, w_gate, w_up, contiguous(route_weights), contiguous(cu_seqlens), out, key=key)
    return out


def grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens):
    from ..triton import grouped_gemm as triton_gemm

    name = "grouped_gemm_silu_mul_with_gate_up"
    validate(checks.check_grouped_gemm_silu_mul, name, cu_seqlens,
             x, w_gate, w_up, route_weights, cu_seqlens)
    act, gate, up = (_empty((x.shape[0], w_gate.shape[1]), x) for _ in range(3))
    with on_device(x):
        triton_gemm.run(x, w_gate, w_up, contiguous(route_weights), contiguous(cu_seqlens), act, choose_fused,
                        saved=(gate, up))
    return act, gate, up


def experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens):
    key = validate(checks.check_experts, "experts", cu_seqlens,
                   x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    out = _empty(x.shape, x)
    with on_device(x):
        experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out, key=key)
    return out


def experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    key = validate(checks.check_experts_out, "experts_out", cu_seqlens,
                   x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
    checks.check_experts_out_overlap("experts_out", x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
    with on_device(x):
        experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out, key=key)


# Backward ops ----------------------------------------------------------------------------------

def grouped_gemm_dgrad(grad_out, w, cu_seqlens):
    from ..triton import grouped_gemm as triton_gemm

    validate(checks.check_grouped_gemm_dgrad, "grouped_gemm_dgrad", cu_seqlens,
             grad_out, w, cu_seqlens)
    out = _empty((grad_out.shape[0], w.shape[2]), grad_out)
    # The forward kernel against the transposed view w[g]^T ([G, K, N], any strides): no copy.
    with on_device(grad_out):
        triton_gemm.run(grad_out, w.transpose(1, 2), None, None, contiguous(cu_seqlens), out, choose_dgrad)
    return out


def grouped_gemm_dual_dgrad(grad_gate, grad_up, w_gate, w_up, cu_seqlens):
    from ..triton import grouped_gemm as triton_gemm

    name = "grouped_gemm_dual_dgrad"
    validate(checks.check_grouped_gemm_dual_dgrad, name, cu_seqlens,
             grad_gate, grad_up, w_gate, w_up, cu_seqlens)
    out = _empty((grad_gate.shape[0], w_gate.shape[2]), grad_gate)
    # One persistent pass (both products into one accumulator) over the transposed weight views;
    # the two gradients and the two weights must share strides.
    if grad_up.stride() != grad_gate.stride():
        grad_gate, grad_up = grad_gate.contiguous(), grad_up.contiguous()
    wg_t, wu_t = w_gate.transpose(1, 2), w_up.transpose(1, 2)
    if wu_t.stride() != wg_t.stride():
        wg_t, wu_t = w_gate.contiguous().transpose(1, 2), w_up.contiguous().transpose(1, 2)
    with on_device(grad_gate):
        triton_gemm.run(grad_gate, wg_t, wu_t, None, contiguous(cu_seqlens), out, choose_dual_dgrad, a_up=grad_up)
    return out


def grouped_gemm_wgrad(grad_out, a, cu_seqlens):
    from ..triton.grouped_gemm_wgrad import launch_grouped_gemm_wgrad, tma_usable

    validate(checks.check_grouped_gemm_wgrad, "grouped_gemm_wgrad", cu_seqlens, grad_out, a, cu_seqlens)
    n, k = grad_out.shape[1], a.shape[1]
    out = _empty((cu_seqlens.shape[0], n, k), a)
    cap = capability_of(a)
    cfg = configs.wgrad_config(n, k, a.shape[0], a.dtype, cap)
    with on_device(a):
        launch_grouped_gemm_wgrad(grad_out, a, contiguous(cu_seqlens), out, cfg,
                                  use_tma=hopper_tma(cap, a.dtype) and tma_usable(grad_out, a))
    return out


def silu_mul_weight_backward(grad, gate, up, route_weights, cu_seqlens):
    from ..triton.silu_mul_weight import launch_silu_mul_weight_backward

    name = "silu_mul_weight_backward"
    validate(checks.check_silu_mul_weight_backward, name, cu_seqlens,
             grad, gate, up, route_weights, cu_seqlens)
    d_gate, d_up = _empty(gate.shape, gate), _empty(gate.shape, gate)
    d_rw = _empty(gate.shape[0], gate, torch.float32)
    with on_device(gate):
        launch_silu_mul_weight_backward(grad, gate, up, contiguous(route_weights), contiguous(cu_seqlens),
                                        d_gate, d_up, d_rw, configs.eltwise_config(gate.shape[1], capability_of(gate)))
    return d_gate, d_up, d_rw


def grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, route_weights, cu_seqlens):
    from ..triton.grouped_gemm_silu_mul_backward import launch_grouped_gemm_silu_mul_backward, num_col_tiles

    name = "grouped_gemm_silu_mul_backward"
    validate(checks.check_grouped_gemm_silu_mul_backward, name, cu_seqlens,
             grad, x, w_gate, w_up, route_weights, cu_seqlens)
    num_rows, i = x.shape[0], w_gate.shape[1]
    d_gate, d_up = _empty((num_rows, i), x), _empty((num_rows, i), x)
    cfg = configs.fused_backward_config(i, x.shape[1], num_rows, x.dtype, capability_of(x))
    if route_weights is None:
        partials = None
        d_rw = torch.zeros(num_rows, dtype=torch.float32, device=x.device)
    else:
        partials = _empty((num_col_tiles(i, cfg), num_rows), x, torch.float32)
    with on_device(x):
        launch_grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, contiguous(route_weights),
                                              contiguous(cu_seqlens), d_gate, d_up, partials, cfg)
    if partials is not None:
        d_rw = partials.sum(dim=0)  # fixed-order reduction over I tiles: deterministic
    return d_gate, d_up, d_rw


for _name in SCHEMAS:
    lib.impl(_name, globals()[_name], "CUDA")
