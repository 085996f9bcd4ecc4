"""CUDA kernels of the backward ops (Triton, imported at first call), registered for the
CUDA dispatch key. Argument checks read metadata only; ``MOONEP_OPS_DEBUG=1`` adds the data
checks on ``cu_seqlens``, which sync the host. Nothing else here syncs: every output is
allocated from static shapes and every kernel reads ``cu_seqlens`` on the device.
"""

import torch

from .. import _checks
from .. import _checks_backward as _bchecks
from .._library import lib
from . import configs, configs_backward
from .cuda import _dense, _on_device, capability_of, hopper_tma, portable_only


def _debug_checks(op_name, cu_seqlens, num_rows) -> None:
    if _checks.debug_checks_enabled():
        _checks.check_cu_seqlens_values(op_name, cu_seqlens, num_rows)


def _choose_dgrad(grad_out, w_t, _, _a2=None):
    """Plan chooser for the forward kernel's launch cache (module level: it is part of the key).
    ``w_t`` is the transposed view ``[G, K, N]`` of the weights: on sm90 TMA reads their storage
    as ``[G*N, K]`` rows (``W_KN``) when the reduction is a multiple of ``BLOCK_K``."""
    from .triton_grouped_gemm import tma_usable_kn

    cap = capability_of(grad_out)
    cfg = configs_backward.dgrad_config(w_t.shape[1], w_t.shape[2], grad_out.shape[0], grad_out.dtype, cap)
    return cfg, hopper_tma(cap, grad_out.dtype) and tma_usable_kn(grad_out, w_t, cfg.block_k)


def grouped_gemm_dgrad(grad_out, w, cu_seqlens):
    from .triton_grouped_gemm import run_moe_gemm

    _bchecks.check_grouped_gemm_dgrad("grouped_gemm_dgrad", grad_out, w, cu_seqlens)
    _debug_checks("grouped_gemm_dgrad", cu_seqlens, grad_out.shape[0])
    out = torch.empty((grad_out.shape[0], w.shape[2]), dtype=grad_out.dtype, device=grad_out.device)
    # The forward kernel against the transposed view w[g]^T ([G, K, N], any strides): no copy.
    with _on_device(grad_out):
        run_moe_gemm(grad_out, w.transpose(1, 2), None, None, _dense(cu_seqlens), out, _choose_dgrad,
                     portable_only())
    return out


def _choose_dual_dgrad(grad_gate, wg_t, wu_t, grad_up):
    """Both transposed views on TMA (``W_KN``) when both pairs qualify."""
    from .triton_grouped_gemm import tma_usable_kn

    cap = capability_of(grad_gate)
    cfg = configs_backward.dgrad_config(wg_t.shape[1], wg_t.shape[2], grad_gate.shape[0], grad_gate.dtype, cap,
                                        dual=True)
    return cfg, (hopper_tma(cap, grad_gate.dtype) and tma_usable_kn(grad_gate, wg_t, cfg.block_k)
                 and tma_usable_kn(grad_up, wu_t, cfg.block_k))


def grouped_gemm_dual_dgrad(grad_gate, grad_up, w_gate, w_up, cu_seqlens):
    from .triton_grouped_gemm import run_moe_gemm

    _bchecks.check_grouped_gemm_dual_dgrad("grouped_gemm_dual_dgrad", grad_gate, grad_up, w_gate, w_up,
                                           cu_seqlens)
    _debug_checks("grouped_gemm_dual_dgrad", cu_seqlens, grad_gate.shape[0])
    num_rows, h = grad_gate.shape[0], w_gate.shape[2]
    out = torch.empty((num_rows, h), dtype=grad_gate.dtype, device=grad_gate.device)
    # One persistent pass of the forward kernel (DUAL): both products into one accumulator, over
    # the transposed weight views; the two gradients and the two weights must share strides.
    if grad_up.stride() != grad_gate.stride():
        grad_gate, grad_up = grad_gate.contiguous(), grad_up.contiguous()
    wg_t, wu_t = w_gate.transpose(1, 2), w_up.transpose(1, 2)
    if wu_t.stride() != wg_t.stride():
        wg_t, wu_t = w_gate.contiguous().transpose(1, 2), w_up.contiguous().transpose(1, 2)
    with _on_device(grad_gate):
        run_moe_gemm(grad_gate, wg_t, wu_t, None, _dense(cu_seqlens), out, _choose_dual_dgrad, portable_only(),
                     a2=grad_up)
    return out


def grouped_gemm_wgrad(grad_out, a, cu_seqlens):
    from .triton_grouped_gemm_wgrad import launch_grouped_gemm_wgrad, tma_usable

    _bchecks.check_grouped_gemm_wgrad("grouped_gemm_wgrad", grad_out, a, cu_seqlens)
    _debug_checks("grouped_gemm_wgrad", cu_seqlens, a.shape[0])
    n, k = grad_out.shape[1], a.shape[1]
    out = torch.empty((cu_seqlens.shape[0], n, k), dtype=a.dtype, device=a.device)
    cap = capability_of(a)
    cfg = configs_backward.wgrad_config(n, k, a.shape[0], a.dtype, cap)
    with _on_device(a):
        launch_grouped_gemm_wgrad(grad_out, a, _dense(cu_seqlens), out, cfg,
                                  use_tma=hopper_tma(cap, a.dtype) and tma_usable(grad_out, a))
    return out


def silu_mul_weight_backward(grad, gate, up, route_weights, cu_seqlens):
    from .triton_silu_mul_weight_backward import launch_silu_mul_weight_backward

    _bchecks.check_silu_mul_weight_backward("silu_mul_weight_backward", grad, gate, up, route_weights,
                                            cu_seqlens)
    _debug_checks("silu_mul_weight_backward", cu_seqlens, gate.shape[0])
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_rw = torch.empty(gate.shape[0], dtype=torch.float32, device=gate.device)
    cfg = configs.eltwise_config(gate.shape[1], capability_of(gate))
    with _on_device(gate):
        launch_silu_mul_weight_backward(grad, gate, up, _dense(route_weights), _dense(cu_seqlens),
                                        d_gate, d_up, d_rw, cfg)
    return d_gate, d_up, d_rw


def grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, route_weights, cu_seqlens):
    from .triton_grouped_gemm_silu_mul_backward import launch_grouped_gemm_silu_mul_backward, num_col_tiles

    _bchecks.check_grouped_gemm_silu_mul_backward("grouped_gemm_silu_mul_backward", grad, x, w_gate, w_up,
                                                  route_weights, cu_seqlens)
    _debug_checks("grouped_gemm_silu_mul_backward", cu_seqlens, x.shape[0])
    num_rows, i = x.shape[0], w_gate.shape[1]
    d_gate = torch.empty((num_rows, i), dtype=x.dtype, device=x.device)
    d_up = torch.empty((num_rows, i), dtype=x.dtype, device=x.device)
    cfg = configs_backward.fused_backward_config(i, x.shape[1], num_rows, x.dtype, capability_of(x))
    if route_weights is None:
        partials = None
        d_rw = torch.zeros(num_rows, dtype=torch.float32, device=x.device)
    else:
        partials = torch.empty((num_col_tiles(i, cfg), num_rows), dtype=torch.float32, device=x.device)
    with _on_device(x):
        launch_grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, _dense(route_weights),
                                              _dense(cu_seqlens), d_gate, d_up, partials, cfg)
    if partials is not None:
        d_rw = partials.sum(dim=0)  # fixed-order reduction over I tiles: deterministic
    return d_gate, d_up, d_rw


lib.impl("grouped_gemm_dgrad", grouped_gemm_dgrad, "CUDA")
lib.impl("grouped_gemm_dual_dgrad", grouped_gemm_dual_dgrad, "CUDA")
lib.impl("grouped_gemm_wgrad", grouped_gemm_wgrad, "CUDA")
lib.impl("silu_mul_weight_backward", silu_mul_weight_backward, "CUDA")
lib.impl("grouped_gemm_silu_mul_backward", grouped_gemm_silu_mul_backward, "CUDA")
