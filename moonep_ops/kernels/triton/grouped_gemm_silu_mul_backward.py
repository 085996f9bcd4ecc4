"""Triton backward of the fused gate/up GEMM + activation, by recomputation.

For each ``(row tile, I tile)`` the kernel recomputes ``gate = x @ w_gate[g].T`` and
``up = x @ w_up[g].T`` in fp32 exactly as the forward does (so neither is ever stored, in
the forward or here), loads the incoming ``grad`` tile and writes

    d_gate = grad * rw * up * sig(gate) * (1 + gate * (1 - sig(gate)))
    d_up   = grad * rw * silu(gate)

and, with route weights, this I tile's share of ``d_rw = sum_i grad * silu(gate) * up`` into
``partials[pid_n, rows]``; the caller sums the partials over I tiles (a fixed order: the
result is deterministic, no atomics). One program per (row tile, I tile), row tiles fastest; a
row tile's segment is found as in the forward grouped GEMM (:func:`.grouped_gemm.locate_tile`),
and tail programs write zeros to all outputs.
"""

import torch
import triton
import triton.language as tl

from .configs import GemmConfig
from .grouped_gemm import BLOCK_G, locate_tile, num_row_tiles, zero_tail_tile


@triton.jit
def grouped_gemm_silu_mul_backward_kernel(
    grad_ptr, x_ptr, w_gate_ptr, w_up_ptr, rw_ptr, d_gate_ptr, d_up_ptr, partials_ptr, cu_ptr,
    G, NUM_ROWS, N, K, NUM_ROW_TILES,
    stride_gm, stride_gn, stride_xm, stride_xk, stride_wg, stride_wn, stride_wk,
    stride_w_up_g, stride_w_up_n, stride_w_up_k, stride_om, stride_on, stride_pn,
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
        row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
        rows64 = rows[:, None].to(tl.int64)
        cols64 = cols[None, :].to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows64 * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk
        g64 = g.to(tl.int64)
        w_gate_ptrs = w_gate_ptr + g64 * stride_wg + cols64 * stride_wn + offs_k[:, None].to(tl.int64) * stride_wk
        w_up_ptrs = (w_up_ptr + g64 * stride_w_up_g + cols64 * stride_w_up_n
                     + offs_k[:, None].to(tl.int64) * stride_w_up_k)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (offs_k + k0) < K
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            gate = tl.dot(x, tl.load(w_gate_ptrs, mask=w_mask, other=0.0), gate, input_precision=PRECISION)
            up = tl.dot(x, tl.load(w_up_ptrs, mask=w_mask, other=0.0), up, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_gate_ptrs += BLOCK_K * stride_wk
            w_up_ptrs += BLOCK_K * stride_w_up_k
        mask = row_mask[:, None] & col_mask[None, :]
        grad = tl.load(grad_ptr + rows64 * stride_gm + cols64 * stride_gn, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        weighted = grad
        if HAS_WEIGHTS:
            weighted = grad * tl.load(rw_ptr + rows, mask=row_mask, other=0.0)[:, None]
        d_up = weighted * silu
        d_gate = weighted * up * sig * (1.0 + gate * (1.0 - sig))
        o_off = rows64 * stride_om + cols64 * stride_on
        tl.store(d_gate_ptr + o_off, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
        tl.store(d_up_ptr + o_off, d_up.to(d_up_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHTS:
            # Row sums as a dot with ones, not tl.sum: Triton's reduction lets every lane of a
            # butterfly write its own (bitwise different) fp32 sum to one shared-memory slot, a
            # write-write race that racecheck reports (triton-lang/triton#7264) and a source of
            # last-bit nondeterminism. The FMA dot ("ieee") sums each row in one thread, in order.
            ones = tl.full((BLOCK_N, 16), 1.0, dtype=tl.float32)
            part = tl.dot(grad * silu * up, ones, input_precision="ieee")  # every column = the row sum
            c16 = tl.arange(0, 16)
            tl.store(partials_ptr + pid_n.to(tl.int64) * stride_pn + rows[:, None] + c16[None, :] * 0, part,
                     mask=row_mask[:, None] & (c16[None, :] == 0))
    else:
        j = t - real_tiles
        zero_tail_tile(d_gate_ptr, cu_ptr, G, NUM_ROWS, j, cols, col_mask, stride_om, stride_on, BLOCK_M, BLOCK_N)
        zero_tail_tile(d_up_ptr, cu_ptr, G, NUM_ROWS, j, cols, col_mask, stride_om, stride_on, BLOCK_M, BLOCK_N)
        if HAS_WEIGHTS:
            tail_lo = tl.minimum(tl.maximum(tl.load(cu_ptr + G - 1), 0), NUM_ROWS)
            rows = tail_lo + j * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(partials_ptr + pid_n.to(tl.int64) * stride_pn + rows, tl.zeros((BLOCK_M,), dtype=tl.float32),
                     mask=(rows < NUM_ROWS) & (rows >= tail_lo))


def num_col_tiles(n: int, cfg: GemmConfig) -> int:
    """Rows of the ``d_rw`` partials buffer: one per I tile."""
    return triton.cdiv(n, cfg.block_n)


def launch_grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, route_weights, cu_seqlens,
                                          d_gate, d_up, partials, cfg: GemmConfig) -> None:
    """Writes ``d_gate``, ``d_up`` (contiguous ``[NvS, I]``) and, with route weights,
    ``partials [num_col_tiles, NvS]`` fp32 (sum over dim 0 gives ``d_rw``)."""
    num_rows, k = x.shape
    g, n, _ = w_gate.shape
    if num_rows == 0 or n == 0:
        return
    row_tiles = num_row_tiles(num_rows, g, cfg.block_m)
    grid = (row_tiles * triton.cdiv(n, cfg.block_n),)
    has_weights = route_weights is not None
    grouped_gemm_silu_mul_backward_kernel[grid](
        grad, x, w_gate, w_up, route_weights if has_weights else x, d_gate, d_up,
        partials if has_weights else d_gate, cu_seqlens,
        g, num_rows, n, k, row_tiles,
        grad.stride(0), grad.stride(1), x.stride(0), x.stride(1),
        w_gate.stride(0), w_gate.stride(1), w_gate.stride(2), w_up.stride(0), w_up.stride(1), w_up.stride(2),
        d_gate.stride(0), d_gate.stride(1), partials.stride(0) if has_weights else 0,
        HAS_WEIGHTS=has_weights,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_G=BLOCK_G,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
