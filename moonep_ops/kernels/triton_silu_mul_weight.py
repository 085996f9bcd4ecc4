"""Triton kernel for ``silu(gate) * up * route_weight`` over the live rows ``[0, cu[-1])``.

Computed in fp32; tail rows ``[cu[-1], NvS)`` are written as zeros and never read.
"""

import torch
import triton
import triton.language as tl

from .configs import EltwiseConfig


@triton.jit
def _silu_mul_weight_kernel(
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
    _silu_mul_weight_kernel[grid](
        gate, up, route_weights if has_weights else gate, out, cu_seqlens,
        cu_seqlens.shape[0], num_rows, cols,
        gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), out.stride(0),
        HAS_WEIGHTS=has_weights, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols,
        num_warps=cfg.num_warps,
    )
