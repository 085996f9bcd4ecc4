"""Triton K-grouped GEMM for weight gradients: ``dW[g] = grad_out[seg_g]^T @ a[seg_g]``.

Output ``[G, N, K]``. Grid: one program per ``(g, N tile, K tile)``, from static shapes
(``G = cu_seqlens.shape[0]``). Each program reads its segment's bounds from ``cu_seqlens`` on
the device and loops over the segment's rows in ``BLOCK_M`` steps, accumulating in fp32; an
empty segment runs no iteration and stores zeros. Rows outside every segment (the tail
``[cu[-1], NvS)``) are never loaded, so NaN there cannot leak in. Segment bounds are clamped
to ``[0, NvS]`` (invalid ``cu_seqlens`` give unspecified values, never an out-of-bounds
access); addresses are int64. Nothing syncs the host.

Config fields: ``block_m`` is the reduction step over rows, ``block_n``/``block_k`` the
output tile.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import GemmConfig
from .grouped_gemm import tma_addressable


@triton.jit
def grouped_gemm_wgrad_kernel(
    grad_ptr, a_ptr, out_ptr, cu_ptr, grad_desc, a_desc,
    G, NUM_ROWS, N, K,
    stride_gm, stride_gn, stride_am, stride_ak, stride_og, stride_on, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # Tiles of one group are neighbours: they read the same segment rows (L2 reuse).
    g = pid // (n_tiles * k_tiles)
    tile = pid % (n_tiles * k_tiles)
    pid_n = tile // k_tiles
    pid_k = tile % k_tiles

    seg_end = tl.minimum(tl.maximum(tl.load(cu_ptr + g), 0), NUM_ROWS)
    seg_start = tl.load(cu_ptr + g - 1, mask=g > 0, other=0)
    seg_start = tl.minimum(tl.maximum(seg_start, 0), seg_end)

    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = cols_n < N
    k_mask = cols_k < K
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    m_first = seg_start
    if USE_TMA:
        # Whole BLOCK_M steps inside the segment by TMA (columns past N read as zeros); the
        # partial last step, if any, by the masked loads below (rows past the segment must be 0).
        m_first = seg_start + (seg_end - seg_start) // BLOCK_M * BLOCK_M
        for m0 in range(seg_start, m_first, BLOCK_M):
            grad_t = grad_desc.load([m0, pid_n * BLOCK_N]).T
            acc = tl.dot(grad_t, a_desc.load([m0, pid_k * BLOCK_K]), acc, input_precision=PRECISION)
    for m0 in range(m_first, seg_end, BLOCK_M):
        rows = m0 + offs_m
        row_mask = rows < seg_end
        rows64 = rows.to(tl.int64)
        # grad_out^T tile [BLOCK_N, BLOCK_M], a tile [BLOCK_M, BLOCK_K].
        grad_t = tl.load(grad_ptr + rows64[None, :] * stride_gm + cols_n[:, None].to(tl.int64) * stride_gn,
                      mask=n_mask[:, None] & row_mask[None, :], other=0.0)
        a = tl.load(a_ptr + rows64[:, None] * stride_am + cols_k[None, :].to(tl.int64) * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(grad_t, a, acc, input_precision=PRECISION)
    o_ptrs = (out_ptr + g.to(tl.int64) * stride_og + cols_n[:, None].to(tl.int64) * stride_on
              + cols_k[None, :].to(tl.int64) * stride_ok)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def tma_usable(*ts: torch.Tensor) -> bool:
    """16-byte aligned rows with unit inner stride, and at least one row (a descriptor of an
    empty [0, N] matrix is invalid: NvS = 0 takes the pointer path, which stores the zeros)."""
    return all(t.shape[0] > 0 and tma_addressable(t) for t in ts)


def launch_grouped_gemm_wgrad(grad_out: torch.Tensor, a: torch.Tensor, cu_seqlens: torch.Tensor,
                              out: torch.Tensor, cfg: GemmConfig, use_tma: bool = False) -> None:
    """``out[g] = grad_out[seg_g]^T @ a[seg_g]`` for every ``g``; zeros for empty segments.
    ``use_tma`` (sm90, 16-byte aligned rows) loads the segments' whole row steps by TMA."""
    num_rows, n = grad_out.shape
    k = a.shape[1]
    g = cu_seqlens.shape[0]
    if g == 0 or n == 0 or k == 0:
        return
    grid = (g * triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k),)
    descs = (None, None)
    if use_tma:
        descs = (TensorDescriptor(grad_out, list(grad_out.shape), [grad_out.stride(0), 1], [cfg.block_m, cfg.block_n]),
                 TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [cfg.block_m, cfg.block_k]))
    grouped_gemm_wgrad_kernel[grid](
        grad_out, a, out, cu_seqlens, *descs,
        g, num_rows, n, k,
        grad_out.stride(0), grad_out.stride(1), a.stride(0), a.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", USE_TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
