"""Triton kernels of ``act = silu(gate) * up * route_weight`` over the live rows ``[0, cu[-1])``,
forward and backward. Computed in fp32; tail rows ``[cu[-1], NvS)`` are never read and get zeros.

The backward runs one program per ``BLOCK_R`` rows over all columns, so that
``d_rw[r] = sum_i grad * silu(gate) * up`` is reduced inside the program in a fixed order
(deterministic, no atomics); ``d_rw`` is all zeros without route weights.
"""

import torch
import triton
import triton.language as tl

from .configs import EltwiseConfig


@triton.jit
def silu_mul_weight_kernel(
    gate_ptr, up_ptr, rw_ptr, out_ptr, cu_ptr,
    G, NUM_ROWS, COLS,
    stride_gm, stride_gc, stride_um, stride_uc, stride_om,
    HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    live_end = tl.minimum(tl.load(cu_ptr + G - 1), NUM_ROWS)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < COLS
    live = (rows < live_end)[:, None] & col_mask[None, :]
    rows64 = rows[:, None].to(tl.int64)
    cols64 = cols[None, :].to(tl.int64)
    gate = tl.load(gate_ptr + rows64 * stride_gm + cols64 * stride_gc, mask=live, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + rows64 * stride_um + cols64 * stride_uc, mask=live, other=0.0).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    if HAS_WEIGHTS:
        rw = tl.load(rw_ptr + rows, mask=rows < live_end, other=0.0)
        act = act * rw[:, None]
    act = tl.where(live, act, 0.0)
    tl.store(out_ptr + rows64 * stride_om + cols64, act.to(out_ptr.dtype.element_ty),
             mask=(rows < NUM_ROWS)[:, None] & col_mask[None, :])


def launch_silu_mul_weight(gate: torch.Tensor, up: torch.Tensor, route_weights, cu_seqlens: torch.Tensor,
                           out: torch.Tensor, cfg: EltwiseConfig) -> None:
    num_rows, cols = gate.shape
    if num_rows == 0 or cols == 0:
        return
    grid = (triton.cdiv(num_rows, cfg.block_rows), triton.cdiv(cols, cfg.block_cols))
    has_weights = route_weights is not None
    silu_mul_weight_kernel[grid](
        gate, up, route_weights if has_weights else gate, out, cu_seqlens,
        cu_seqlens.shape[0], num_rows, cols,
        gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), out.stride(0),
        HAS_WEIGHTS=has_weights, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols,
        num_warps=cfg.num_warps,
    )


@triton.jit
def silu_mul_weight_backward_kernel(
    grad_ptr, gate_ptr, up_ptr, rw_ptr, d_gate_ptr, d_up_ptr, d_rw_ptr, cu_ptr,
    G, NUM_ROWS, COLS,
    stride_rm, stride_rc, stride_gm, stride_gc, stride_um, stride_uc, stride_om, stride_oc,
    HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    live_end = tl.minimum(tl.maximum(tl.load(cu_ptr + G - 1), 0), NUM_ROWS)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live_row = rows < live_end
    in_buffer = rows < NUM_ROWS
    rows64 = rows[:, None].to(tl.int64)
    if HAS_WEIGHTS:
        rw = tl.load(rw_ptr + rows, mask=live_row, other=0.0)
    d_rw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, COLS, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < COLS
        cols64 = cols[None, :].to(tl.int64)
        live = live_row[:, None] & col_mask[None, :]
        grad = tl.load(grad_ptr + rows64 * stride_rm + cols64 * stride_rc, mask=live, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + rows64 * stride_gm + cols64 * stride_gc, mask=live, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + rows64 * stride_um + cols64 * stride_uc, mask=live, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        weighted = grad
        if HAS_WEIGHTS:
            weighted = grad * rw[:, None]
            d_rw += tl.sum(grad * silu * up, axis=1)
        d_up = tl.where(live, weighted * silu, 0.0)
        d_gate = tl.where(live, weighted * up * sig * (1.0 + gate * (1.0 - sig)), 0.0)
        o_off = rows64 * stride_om + cols64 * stride_oc
        store_mask = in_buffer[:, None] & col_mask[None, :]
        tl.store(d_gate_ptr + o_off, d_gate.to(d_gate_ptr.dtype.element_ty), mask=store_mask)
        tl.store(d_up_ptr + o_off, d_up.to(d_up_ptr.dtype.element_ty), mask=store_mask)
    tl.store(d_rw_ptr + rows, tl.where(live_row, d_rw, 0.0), mask=in_buffer)


def launch_silu_mul_weight_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, route_weights,
                                    cu_seqlens: torch.Tensor, d_gate: torch.Tensor, d_up: torch.Tensor,
                                    d_rw: torch.Tensor, cfg: EltwiseConfig) -> None:
    """``d_gate``/``d_up`` share strides (both contiguous); ``d_rw`` is ``[NvS]`` fp32."""
    num_rows, cols = gate.shape
    if num_rows == 0:
        return
    has_weights = route_weights is not None
    silu_mul_weight_backward_kernel[(triton.cdiv(num_rows, cfg.block_rows),)](
        grad, gate, up, route_weights if has_weights else gate, d_gate, d_up, d_rw, cu_seqlens,
        cu_seqlens.shape[0], num_rows, cols,
        grad.stride(0), grad.stride(1), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
        d_gate.stride(0), d_gate.stride(1),
        HAS_WEIGHTS=has_weights, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols,
        num_warps=cfg.num_warps,
    )
