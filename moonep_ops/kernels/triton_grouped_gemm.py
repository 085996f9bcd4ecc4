"""Triton grouped GEMM over MoonEP segments: ``out[seg_g] = a[seg_g] @ w[g].T``.

Grid: ``cdiv(NvS, BLOCK_M) + min(G, NvS)`` row tiles times ``cdiv(N, BLOCK_N)`` column tiles,
from static shapes only. That bounds the real tile count: each non-empty segment adds at
most one partial tile, and there are at most ``min(G, NvS)`` of them. Each program finds its
segment on the device by scanning ``cu_seqlens`` (chunked cumsum of per-segment tile counts);
programs past the last real tile zero the tail rows ``[cu[-1], NvS)``. Nothing syncs the host.

Rows outside ``[0, NvS)`` are never touched even if ``cu_seqlens`` is invalid (ends are
clamped), so bad data on CUDA gives unspecified values, never an out-of-bounds access.
Addresses are computed in int64.
"""

import torch
import triton
import triton.language as tl

from .configs import GemmConfig

BLOCK_G = 256  # cu_seqlens entries scanned per step when locating a tile's segment


@triton.jit
def locate_tile(cu_ptr, G, t, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Segment of row tile ``t``: (g, first row of the tile, segment end, total real tiles).

    ``g == G`` when ``t`` is past every real tile (it then indexes a tail tile).
    """
    g_sel = G
    base_sel = 0
    carry = 0
    for c in range(0, G, BLOCK_G):
        offs = c + tl.arange(0, BLOCK_G)
        ends = tl.load(cu_ptr + offs, mask=offs < G, other=0)
        starts = tl.load(cu_ptr + offs - 1, mask=(offs > 0) & (offs < G), other=0)
        tiles = tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M)
        incl = tl.cumsum(tiles, 0) + carry
        excl = incl - tiles
        hit = (excl <= t) & (t < incl)
        n_hit = tl.sum(hit.to(tl.int32), 0)
        g_sel = tl.where(n_hit > 0, tl.sum(tl.where(hit, offs, 0), 0), g_sel)
        base_sel = tl.where(n_hit > 0, tl.sum(tl.where(hit, excl, 0), 0), base_sel)
        carry += tl.sum(tiles, 0)
    seg_start = tl.load(cu_ptr + g_sel - 1, mask=(g_sel > 0) & (g_sel < G), other=0)
    seg_end = tl.load(cu_ptr + g_sel, mask=g_sel < G, other=0)
    row_lo = seg_start + (t - base_sel) * BLOCK_M
    return g_sel, row_lo, seg_end, carry


@triton.jit
def zero_tail_tile(out_ptr, cu_ptr, G, NUM_ROWS, j, cols, col_mask, stride_om, stride_on,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write zeros to tail tile ``j``: rows ``[cu[-1] + j*BLOCK_M, ...)`` below NvS (never read)."""
    tail_lo = tl.minimum(tl.maximum(tl.load(cu_ptr + G - 1), 0), NUM_ROWS)
    rows = tail_lo + j * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (rows < NUM_ROWS) & (rows >= tail_lo)
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    tl.store(o_ptrs, zeros, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, cu_ptr,
    G, NUM_ROWS, N, K, NUM_ROW_TILES,
    stride_am, stride_ak, stride_wg, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    # Row tiles vary fastest: neighbouring programs share a column tile of w[g] (L2 reuse).
    t = pid % NUM_ROW_TILES
    pid_n = pid // NUM_ROW_TILES
    g, row_lo, seg_end, real_tiles = locate_tile(cu_ptr, G, t, BLOCK_M, BLOCK_G)

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if g < G:
        rows = row_lo + tl.arange(0, BLOCK_M)
        row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        w_ptrs = (w_ptr + g.to(tl.int64) * stride_wg + cols[None, :].to(tl.int64) * stride_wn
                  + offs_k[:, None].to(tl.int64) * stride_wk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (offs_k + k0) < K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
    else:
        zero_tail_tile(out_ptr, cu_ptr, G, NUM_ROWS, t - real_tiles, cols, col_mask, stride_om, stride_on,
                       BLOCK_M, BLOCK_N)


def num_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound on real + tail row tiles (see the module docstring)."""
    return triton.cdiv(num_rows, block_m) + min(num_groups, num_rows)


def launch_grouped_gemm(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor,
                        out: torch.Tensor, cfg: GemmConfig) -> None:
    num_rows, k = a.shape
    g, n, _ = w.shape
    if num_rows == 0 or n == 0:
        return
    row_tiles = num_row_tiles(num_rows, g, cfg.block_m)
    grid = (row_tiles * triton.cdiv(n, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, cu_seqlens,
        g, num_rows, n, k, row_tiles,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_G=BLOCK_G,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
