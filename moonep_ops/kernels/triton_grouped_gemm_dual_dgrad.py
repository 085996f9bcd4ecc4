"""Triton M-grouped GEMM for the input gradient of the fused gate/up projection:
``dx[seg_g] = d_gate[seg_g] @ w_gate[g] + d_up[seg_g] @ w_up[g]``.

Both products go into one fp32 accumulator (one pass over ``dx``: no second ``[NvS, H]``
output and no add). ``w_*`` are ``[G, I, H]`` used non-transposed: the reduction runs over
``I``, the output columns over ``H``. The tile -> segment schedule and the tail zeroing are
the forward grouped GEMM's (:func:`.triton_grouped_gemm.locate_tile`): rows of ``d_gate`` and
``d_up`` outside every segment are never read, ``dx`` is zero there. Addresses are int64.
"""

import torch
import triton
import triton.language as tl

from .configs import GemmConfig
from .triton_grouped_gemm import BLOCK_G, locate_tile, num_row_tiles, zero_tail_tile


@triton.jit
def _accumulate(acc, a_ptr, w_ptr, rows, row_mask, cols, col_mask, g64, K,
                stride_am, stride_ak, stride_wg, stride_wk, stride_wn,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += a[rows, :] @ w[g, :, cols]`` over the reduction ``K``."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    w_ptrs = (w_ptr + g64 * stride_wg + offs_k[:, None].to(tl.int64) * stride_wk
              + cols[None, :].to(tl.int64) * stride_wn)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (offs_k + k0) < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _grouped_gemm_dual_dgrad_kernel(
    ga_ptr, gb_ptr, wa_ptr, wb_ptr, out_ptr, cu_ptr,
    G, NUM_ROWS, N, K, NUM_ROW_TILES,
    stride_gam, stride_gak, stride_gbm, stride_gbk,
    stride_wag, stride_wak, stride_wan, stride_wbg, stride_wbk, stride_wbn,
    stride_om, stride_on,
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
        row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
        g64 = g.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _accumulate(acc, ga_ptr, wa_ptr, rows, row_mask, cols, col_mask, g64, K,
                          stride_gam, stride_gak, stride_wag, stride_wak, stride_wan, BLOCK_K, PRECISION)
        acc = _accumulate(acc, gb_ptr, wb_ptr, rows, row_mask, cols, col_mask, g64, K,
                          stride_gbm, stride_gbk, stride_wbg, stride_wbk, stride_wbn, BLOCK_K, PRECISION)
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
    else:
        zero_tail_tile(out_ptr, cu_ptr, G, NUM_ROWS, t - real_tiles, cols, col_mask, stride_om, stride_on,
                       BLOCK_M, BLOCK_N)


def launch_grouped_gemm_dual_dgrad(grad_gate: torch.Tensor, grad_up: torch.Tensor, w_gate: torch.Tensor,
                                   w_up: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor,
                                   cfg: GemmConfig) -> None:
    num_rows, i = grad_gate.shape
    g, _, h = w_gate.shape
    if num_rows == 0 or h == 0:
        return
    row_tiles = num_row_tiles(num_rows, g, cfg.block_m)
    grid = (row_tiles * triton.cdiv(h, cfg.block_n),)
    _grouped_gemm_dual_dgrad_kernel[grid](
        grad_gate, grad_up, w_gate, w_up, out, cu_seqlens,
        g, num_rows, h, i, row_tiles,
        grad_gate.stride(0), grad_gate.stride(1), grad_up.stride(0), grad_up.stride(1),
        w_gate.stride(0), w_gate.stride(1), w_gate.stride(2), w_up.stride(0), w_up.stride(1), w_up.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_G=BLOCK_G,
        PRECISION="ieee" if grad_gate.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
