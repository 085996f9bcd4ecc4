"""Triton fused gate/up grouped GEMM with the activation in its epilogue.

``act[seg_g] = silu(x[seg_g] @ w_gate[g].T) * (x[seg_g] @ w_up[g].T) * route_weights[seg_g]``:
each ``x`` tile is loaded once for both projections, the activation is applied to the fp32
accumulators, and only ``act`` is written. The schedule (tile -> segment, tail zeroing) is the
plain grouped GEMM's: see :mod:`.triton_grouped_gemm`.
"""

import torch
import triton
import triton.language as tl

from .configs import GemmConfig
from .triton_grouped_gemm import BLOCK_G, locate_tile, num_row_tiles, zero_tail_tile


@triton.jit
def _grouped_gemm_silu_mul_kernel(
    x_ptr, wg_ptr, wu_ptr, rw_ptr, out_ptr, cu_ptr,
    G, NUM_ROWS, N, K, NUM_ROW_TILES,
    stride_xm, stride_xk, stride_wg, stride_wn, stride_wk, stride_ug, stride_un, stride_uk,
    stride_om, stride_on,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid % NUM_ROW_TILES
    pid_n = pid // NUM_ROW_TILES
    g, row_lo, seg_end, real_tiles = locate_tile(cu_ptr, G, t, BLOCK_M, BLOCK_G)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if g < G:
        rows = row_lo + tl.arange(0, BLOCK_M)
        row_end = tl.minimum(seg_end, NUM_ROWS)
        row_mask = (rows < row_end) & (rows >= 0)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk
        g64 = g.to(tl.int64)
        wg_ptrs = (wg_ptr + g64 * stride_wg + cols[None, :].to(tl.int64) * stride_wn
                   + offs_k[:, None].to(tl.int64) * stride_wk)
        wu_ptrs = (wu_ptr + g64 * stride_ug + cols[None, :].to(tl.int64) * stride_un
                   + offs_k[:, None].to(tl.int64) * stride_uk)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (offs_k + k0) < K
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            acc_gate = tl.dot(x, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(x, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_uk
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        if HAS_WEIGHTS:
            rw = tl.load(rw_ptr + rows, mask=row_mask, other=0.0)
            act = act * rw[:, None]
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
        tl.store(o_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
    else:
        zero_tail_tile(out_ptr, cu_ptr, G, NUM_ROWS, t - real_tiles, cols, col_mask, stride_om, stride_on,
                       BLOCK_M, BLOCK_N)


def launch_grouped_gemm_silu_mul(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, route_weights,
                                 cu_seqlens: torch.Tensor, out: torch.Tensor, cfg: GemmConfig) -> None:
    num_rows, k = x.shape
    g, n, _ = w_gate.shape
    if num_rows == 0 or n == 0:
        return
    row_tiles = num_row_tiles(num_rows, g, cfg.block_m)
    grid = (row_tiles * triton.cdiv(n, cfg.block_n),)
    has_weights = route_weights is not None
    _grouped_gemm_silu_mul_kernel[grid](
        x, w_gate, w_up, route_weights if has_weights else x, out, cu_seqlens,
        g, num_rows, n, k, row_tiles,
        x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        w_up.stride(0), w_up.stride(1), w_up.stride(2), out.stride(0), out.stride(1),
        HAS_WEIGHTS=has_weights,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_G=BLOCK_G,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
