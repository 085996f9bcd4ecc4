"""The Triton kernel behind every forward grouped GEMM and the dgrads: a persistent,
segment-aware GEMM with an optional fused SwiGLU epilogue.

- ``FUSED=False``: ``out[seg_g] = a[seg_g] @ w[g].T``.
- ``DUAL_DGRAD=True``: ``out[seg_g] = a[seg_g] @ w[g].T + a_up[seg_g] @ w_up[g].T`` in one
  accumulator (the fused GEMM's dgrad: ``a`` and ``a_up`` are the gradients of gate and up).
- ``FUSED=True``: ``out[seg_g] = silu(a[seg_g] @ w[g].T) * (a[seg_g] @ w_up[g].T) * rw[seg_g]``;
  each ``a`` tile is loaded once for both projections and the activation is applied to the
  fp32 accumulators, so gate and up are never rounded or written.
- ``FUSED=True, SAVE_GATE_UP=True`` (training forward): also writes gate and up (rounded to the
  output dtype) to ``gate_out`` and ``up_out``, and computes the activation from those
  rounded values, so ``out`` is what ``silu_mul_weight(gate_out, up_out)`` gives.

Schedule. The grid is persistent (about one program per SM, from static shapes only). Each
program first scans ``cu_seqlens`` on the device to count the real row tiles (each segment is
cut into ``cdiv(len, BLOCK_M)`` tiles) and the tail tiles (rows ``[cu[-1], NvS)``), then walks
work items ``(row tile, column tile)`` with stride ``num_programs``; columns vary fastest, so
programs running together share a segment's ``a`` rows and stream its weights once. The tail
tiles (zeros) follow in a second loop on the same stride (``ZERO_TAIL=False`` skips them, for an
intermediate that only these kernels read). Empty segments and the tail cost no GEMM work,
whatever ``NvS`` says. Nothing syncs the host. Hopper schedule knobs (from the config, TMA path
only): ``FLATTEN`` (the software pipeliner issues the next item's loads under this item's
epilogue), ``WARP_SPEC`` (Triton's producer/consumer warp specialization). ``GROUP_MAJOR`` (any
path, ``G <= SMALL_G_MAX`` only) orders the items segment by segment, column tile, then row tile
fastest: the row tiles that share a weight tile are neighbouring items, so they run at the same
time and the weight tile is read from DRAM once.

Programmatic dependent launch (Hopper, the ``experts`` op's pair only; see :func:`make_plan`'s
``role``): the fused GEMM (``LAUNCH_DEPENDENTS``) lets the down GEMM launch at once; the down
GEMM's programs (``WAIT_PRIOR``) start on the SMs the fused programs leave, scan ``cu_seqlens``,
bulk-prefetch their first weight tile into L2 (up to ``SMALL_G_MAX`` groups, weights not
transposed), and execute ``griddepcontrol.wait`` before any load of ``a`` (``act``) or any store;
this takes 1-2% off the memory-bound shapes' whole path.

Main loops, one per operand layout: :func:`_mainloop_tma` (``USE_TMA``: tensor-memory-accelerator
descriptors for ``a`` and the K-contiguous weights, read as one ``[G*N, K]`` matrix),
:func:`_mainloop_tma_transposed` (``W_TRANSPOSED``: the weights are the transposed view of
``[G, K, N]`` storage, the dgrad's, read as ``[G*K, N]`` rows) and :func:`_mainloop_pointers`
(portable: masked pointer loads, sm80+, any strides, any K). TMA loads rows past a segment's end,
which are never stored (GEMM rows are independent). The epilogue (:func:`_epilogue`) applies the
activation and stores masked to the segment, so one segment's tile never writes another's rows;
with ``TMA_STORE`` a tile wholly inside its segment is stored by TMA instead (whole, or in two
column halves).

Safety. Segment ends are clamped to ``[0, NvS]``: invalid ``cu_seqlens`` on CUDA give
unspecified values, never an out-of-bounds access. Addresses are computed in int64.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ... import flags
from ...cache import layout_signature
from .. import launch as direct
from ..pdl import PdlRole
from .configs import GemmConfig

BLOCK_G = 256  # cu_seqlens entries scanned per step when locating a tile's segment (G > SMALL_G_MAX)
SMALL_G_MAX = 1024  # up to this many groups, the schedule lives in registers (see the kernel)


@triton.jit
def locate_tile(cu_ptr, G, t, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Segment of row tile ``t``: (g, first row of the tile, segment end, total real tiles).

    ``g == G`` when ``t`` is past every real tile.
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
def store_tile(out_ptr, res, rows, cols, row_mask, col_mask, stride_om, stride_on):
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
    tl.store(o_ptrs, res, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _zero_tail_item(outs, out_strides, cu_ptr, G, NUM_ROWS, N, j, n_tiles,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SAVE_GATE_UP: tl.constexpr):
    """Tail item ``j`` (row tile ``j // n_tiles``, column tile ``j % n_tiles``): zeros in
    ``out`` (and in gate and up when saving); rows past NvS (``j`` past the last item) are masked.
    ``outs``: the (out, gate_out, up_out) pointers, which share ``out_strides``."""
    out_ptr, gate_out_ptr, up_out_ptr = outs
    stride_om, stride_on = out_strides
    cols = (j % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    zero_tail_tile(out_ptr, cu_ptr, G, NUM_ROWS, j // n_tiles, cols, cols < N, stride_om, stride_on,
                   BLOCK_M, BLOCK_N)
    if SAVE_GATE_UP:
        zero_tail_tile(gate_out_ptr, cu_ptr, G, NUM_ROWS, j // n_tiles, cols, cols < N, stride_om, stride_on,
                       BLOCK_M, BLOCK_N)
        zero_tail_tile(up_out_ptr, cu_ptr, G, NUM_ROWS, j // n_tiles, cols, cols < N, stride_om, stride_on,
                       BLOCK_M, BLOCK_N)


@triton.jit
def _register_schedule(cu_ptr, G, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """All of ``cu_seqlens`` in one block (``G <= BLOCK_G``): the schedule ``(group index,
    segment starts, segment ends, row tiles, exclusive and inclusive tile prefix sums)``, kept in
    registers for the whole persistent loop, and the number of real row tiles."""
    offs_g = tl.arange(0, BLOCK_G)
    g_ends = tl.load(cu_ptr + offs_g, mask=offs_g < G, other=0)
    g_starts = tl.load(cu_ptr + offs_g - 1, mask=(offs_g > 0) & (offs_g < G), other=0)
    g_tiles = tl.cdiv(tl.maximum(g_ends - g_starts, 0), BLOCK_M)
    g_incl = tl.cumsum(g_tiles, 0)
    g_excl = g_incl - g_tiles
    return (offs_g, g_starts, g_ends, g_tiles, g_excl, g_incl), tl.sum(g_tiles, 0)


@triton.jit
def _small_g_segment(t, sched, BLOCK_M: tl.constexpr):
    """Segment of real row tile ``t`` from the in-register schedule: (g, first row, segment end)."""
    offs_g, g_starts, g_ends, _, g_excl, g_incl = sched
    hit = (g_excl <= t) & (t < g_incl)
    g = tl.sum(tl.where(hit, offs_g, 0), 0)
    row_lo = tl.sum(tl.where(hit, g_starts + (t - g_excl) * BLOCK_M, 0), 0)
    seg_end = tl.sum(tl.where(hit, g_ends, 0), 0)
    return g, row_lo, seg_end


@triton.jit
def _small_g_item(item, n_tiles, sched, BLOCK_M: tl.constexpr, GROUP_MAJOR: tl.constexpr):
    """Work item ``item`` from the in-register schedule: (g, first row, segment end, column tile)."""
    if GROUP_MAJOR:
        # Segment g owns items [excl_g * n_tiles, incl_g * n_tiles): column tile, then row tile.
        offs_g, g_starts, g_ends, g_tiles, g_excl, g_incl = sched
        hit = (g_excl * n_tiles <= item) & (item < g_incl * n_tiles)
        g = tl.sum(tl.where(hit, offs_g, 0), 0)
        local = item - tl.sum(tl.where(hit, g_excl, 0), 0) * n_tiles
        count = tl.maximum(tl.sum(tl.where(hit, g_tiles, 0), 0), 1)
        row_lo = tl.sum(tl.where(hit, g_starts, 0), 0) + (local % count) * BLOCK_M
        seg_end = tl.sum(tl.where(hit, g_ends, 0), 0)
        pid_n = local // count
    else:
        pid_n = item % n_tiles
        g, row_lo, seg_end = _small_g_segment(item // n_tiles, sched, BLOCK_M)
    return g, row_lo, seg_end, pid_n


@triton.jit
def _work_item(item, n_tiles, cu_ptr, G, sched, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
               SMALL_G: tl.constexpr, GROUP_MAJOR: tl.constexpr):
    """The tile of work item ``item``: (g, first row, segment end, column tile), from the
    in-register schedule (``SMALL_G``) or a scan of ``cu_seqlens`` (``sched`` is None then)."""
    if SMALL_G:
        g, row_lo, seg_end, pid_n = _small_g_item(item, n_tiles, sched, BLOCK_M, GROUP_MAJOR)
    else:
        pid_n = item % n_tiles
        g, row_lo, seg_end, _ = locate_tile(cu_ptr, G, item // n_tiles, BLOCK_M, BLOCK_G)
    return g, row_lo, seg_end, pid_n


@triton.jit
def _prefetch_rows_l2(ptr, row0, row_end, stride_row, BLOCK_N: tl.constexpr, NBYTES: tl.constexpr):
    """Bulk-prefetch the first ``NBYTES`` of rows ``[row0, row0 + BLOCK_N)`` (clamped below
    ``row_end``) into L2 (sm90 ``cp.async.bulk.prefetch``; a hint: no data reaches the program)."""
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), row_end - 1)
    ptrs = ptr + rows.to(tl.int64) * stride_row
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [ptrs, tl.full((BLOCK_N,), NBYTES, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mainloop_tma(a_desc, w_desc, w_up_desc, a_up_desc, tile, N, K,
                  FUSED: tl.constexpr, DUAL_DGRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """TMA loads, K-contiguous weights: ``w[g]`` (and ``w_up[g]``) read as rows ``g*N + ...`` of
    one ``[G*N, K]`` matrix. Returns the accumulators of ``w`` (and of ``w_up``, FUSED)."""
    g, row_lo, _, pid_n = tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_row = g * N + pid_n * BLOCK_N
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row_lo, k0])
        acc = tl.dot(a, w_desc.load([w_row, k0]).T, acc, input_precision=PRECISION)
        if FUSED:
            acc_up = tl.dot(a, w_up_desc.load([w_row, k0]).T, acc_up, input_precision=PRECISION)
    if DUAL_DGRAD:
        for k0 in range(0, K, BLOCK_K):
            a_up = a_up_desc.load([row_lo, k0])
            acc = tl.dot(a_up, w_up_desc.load([w_row, k0]).T, acc, input_precision=PRECISION)
    return acc, acc_up


@triton.jit
def _mainloop_tma_transposed(a_desc, w_desc, w_up_desc, a_up_desc, tile, K, DUAL_DGRAD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PRECISION: tl.constexpr):
    """TMA loads, weights stored ``[K, N]`` per group (the dgrad's transposed view of
    ``[G, N', K']`` weights): the descriptor reads them as one ``[G*K, N]`` matrix. ``K %
    BLOCK_K == 0`` (the plan checks), so a tile never reaches into the next group's rows."""
    g, row_lo, _, pid_n = tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row_lo, k0])
        acc = tl.dot(a, w_desc.load([g * K + k0, pid_n * BLOCK_N]), acc, input_precision=PRECISION)
    if DUAL_DGRAD:  # + a_up[seg] @ w_up[g] into the same accumulator
        for k0 in range(0, K, BLOCK_K):
            a_up = a_up_desc.load([row_lo, k0])
            acc = tl.dot(a_up, w_up_desc.load([g * K + k0, pid_n * BLOCK_N]), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _mainloop_pointers(a_view, w_view, w_up_view, a_up_ptr, tile, NUM_ROWS, N, K,
                       FUSED: tl.constexpr, DUAL_DGRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Masked pointer loads (sm80+, any strides, any K). ``a_view``: ``a``'s (pointer, row
    stride, K stride), which ``a_up`` shares (the plan checks); ``w_view``, ``w_up_view``:
    (pointer, group, row and K strides). Returns the accumulators of ``w`` (and of ``w_up``, FUSED)."""
    a_ptr, stride_am, stride_ak = a_view
    w_ptr, stride_wg, stride_wn, stride_wk = w_view
    w_up_ptr, stride_w_up_g, stride_w_up_n, stride_w_up_k = w_up_view
    g, row_lo, seg_end, pid_n = tile
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows = row_lo + tl.arange(0, BLOCK_M)
    row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    g64 = g.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    w_ptrs = (w_ptr + g64 * stride_wg + cols[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None].to(tl.int64) * stride_wk)
    w_up_ptrs = (w_up_ptr + g64 * stride_w_up_g + cols[None, :].to(tl.int64) * stride_w_up_n
                 + offs_k[:, None].to(tl.int64) * stride_w_up_k)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (offs_k + k0) < K
        w_mask = k_mask[:, None] & col_mask[None, :]
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=PRECISION)
        if FUSED:
            acc_up = tl.dot(a, tl.load(w_up_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
            w_up_ptrs += BLOCK_K * stride_w_up_k
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if DUAL_DGRAD:
        a_up_ptrs = (a_up_ptr + rows[:, None].to(tl.int64) * stride_am
                     + offs_k[None, :].to(tl.int64) * stride_ak)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (offs_k + k0) < K
            a_up = tl.load(a_up_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_up = tl.load(w_up_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a_up, w_up, acc, input_precision=PRECISION)
            a_up_ptrs += BLOCK_K * stride_ak
            w_up_ptrs += BLOCK_K * stride_w_up_k
    return acc, acc_up


@triton.jit
def _swiglu(gate, up, gate_out_ptr, up_out_ptr, rw_ptr, rows, cols, row_mask, col_mask, stride_om, stride_on,
            HAS_WEIGHTS: tl.constexpr, SAVE_GATE_UP: tl.constexpr):
    """``silu(gate) * up * rw`` in fp32; with ``SAVE_GATE_UP``, gate and up are first rounded to
    the output dtype and stored (``gate_out`` and ``up_out`` share ``out``'s strides: the plan
    checks), and the activation is computed from the rounded values."""
    if SAVE_GATE_UP:
        gate_r = gate.to(gate_out_ptr.dtype.element_ty)
        up_r = up.to(gate_out_ptr.dtype.element_ty)
        store_tile(gate_out_ptr, gate_r, rows, cols, row_mask, col_mask, stride_om, stride_on)
        store_tile(up_out_ptr, up_r, rows, cols, row_mask, col_mask, stride_om, stride_on)
        gate = gate_r.to(tl.float32)
        up = up_r.to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    if HAS_WEIGHTS:
        act = act * tl.load(rw_ptr + rows, mask=row_mask, other=0.0)[:, None]
    return act


@triton.jit
def _epilogue(acc, acc_up, tile, outs, o_desc, out_strides, rw_ptr, NUM_ROWS, N,
              FUSED: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SAVE_GATE_UP: tl.constexpr, TMA_STORE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The activation (FUSED) and the stores of ``tile``. ``outs``: the (out, gate_out, up_out)
    pointers, which share ``out_strides``; ``o_desc``: ``out``'s TMA descriptor (``TMA_STORE``)."""
    _, row_lo, seg_end, pid_n = tile
    out_ptr, gate_out_ptr, up_out_ptr = outs
    stride_om, stride_on = out_strides
    rows = row_lo + tl.arange(0, BLOCK_M)
    row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if FUSED:
        acc = _swiglu(acc, acc_up, gate_out_ptr, up_out_ptr, rw_ptr, rows, cols, row_mask, col_mask,
                      stride_om, stride_on, HAS_WEIGHTS, SAVE_GATE_UP)
    res = acc.to(out_ptr.dtype.element_ty)
    if TMA_STORE > 0:
        if (row_lo >= 0) & (row_lo + BLOCK_M <= seg_end):
            # A tile wholly inside its segment: TMA store (clipped at NvS and N by the descriptor).
            if TMA_STORE == 2:
                halves = tl.split(tl.permute(tl.reshape(res, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                o_desc.store([row_lo, pid_n * BLOCK_N], halves[0])
                o_desc.store([row_lo, pid_n * BLOCK_N + BLOCK_N // 2], halves[1])
            else:
                o_desc.store([row_lo, pid_n * BLOCK_N], res)
        else:
            store_tile(out_ptr, res, rows, cols, row_mask, col_mask, stride_om, stride_on)
    else:
        store_tile(out_ptr, res, rows, cols, row_mask, col_mask, stride_om, stride_on)


@triton.jit
def grouped_gemm_kernel(
    a_ptr, w_ptr, w_up_ptr, a_up_ptr, rw_ptr, out_ptr, gate_out_ptr, up_out_ptr, cu_ptr,
    a_desc, w_desc, w_up_desc, a_up_desc, o_desc,
    G, NUM_ROWS, N, K,
    stride_am, stride_ak, stride_wg, stride_wn, stride_wk, stride_w_up_g, stride_w_up_n, stride_w_up_k,
    stride_om, stride_on,
    FUSED: tl.constexpr, HAS_WEIGHTS: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, SMALL_G: tl.constexpr, PRECISION: tl.constexpr,
    W_TRANSPOSED: tl.constexpr = False, FLATTEN: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
    TMA_STORE: tl.constexpr = 0, DUAL_DGRAD: tl.constexpr = False, SAVE_GATE_UP: tl.constexpr = False,
    ZERO_TAIL: tl.constexpr = True, GROUP_MAJOR: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False, WAIT_PRIOR: tl.constexpr = False, PREFETCH_BYTES: tl.constexpr = 0,
):
    if LAUNCH_DEPENDENTS:
        # Programmatic dependent launch: the next kernel (launched with launch_pdl) may start
        # its programs as SMs free up, instead of after this grid's last program ends.
        gdc_launch_dependents()
    # Totals first: real row tiles (a scan of cu_seqlens) and tail row tiles.
    if SMALL_G:
        # Locating an item's segment is then a few reductions, no loads.
        sched, real_tiles = _register_schedule(cu_ptr, G, BLOCK_M, BLOCK_G)
    else:
        sched = None
        _, _, _, real_tiles = locate_tile(cu_ptr, G, -1, BLOCK_M, BLOCK_G)
    live_end = tl.minimum(tl.maximum(tl.load(cu_ptr + G - 1), 0), NUM_ROWS)
    tail_tiles = tl.cdiv(NUM_ROWS - live_end, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    real_items = real_tiles * n_tiles
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)

    if WAIT_PRIOR:
        # Launched early (PDL) behind the kernel that writes ``a``: everything above reads only
        # cu_seqlens, which that kernel does not write. Warm L2 with this program's first weight
        # tile while it finishes, then wait for it (and its memory) before any load of ``a`` or
        # any store.
        if PREFETCH_BYTES > 0:
            if pid < real_items:
                g0, _, _, pid_n0 = _small_g_item(pid, n_tiles, sched, BLOCK_M, GROUP_MAJOR)
                _prefetch_rows_l2(w_ptr, g0 * N + pid_n0 * BLOCK_N, g0 * N + N, stride_wn, BLOCK_N, PREFETCH_BYTES)
        gdc_wait()

    a_view = (a_ptr, stride_am, stride_ak)
    w_view = (w_ptr, stride_wg, stride_wn, stride_wk)
    w_up_view = (w_up_ptr, stride_w_up_g, stride_w_up_n, stride_w_up_k)
    outs = (out_ptr, gate_out_ptr, up_out_ptr)
    out_strides = (stride_om, stride_on)
    # Real work items (row tile, column tile), columns fastest (GROUP_MAJOR: see the module
    # docstring). FLATTEN lets the software pipeliner issue the next item's loads under this
    # item's epilogue; the epilogue then re-derives its own item from a second counter
    # (``item_c``), so that it does not depend on values of the loop's prologue.
    item_c = pid - num_progs
    for item in tl.range(pid, real_items, num_progs, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        tile = _work_item(item, n_tiles, cu_ptr, G, sched, BLOCK_M, BLOCK_G, SMALL_G, GROUP_MAJOR)
        if USE_TMA and W_TRANSPOSED:
            acc = _mainloop_tma_transposed(a_desc, w_desc, w_up_desc, a_up_desc, tile, K, DUAL_DGRAD,
                                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            acc_up = acc  # unused: never FUSED (the plan checks)
        elif USE_TMA:
            acc, acc_up = _mainloop_tma(a_desc, w_desc, w_up_desc, a_up_desc, tile, N, K, FUSED, DUAL_DGRAD,
                                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        else:
            acc, acc_up = _mainloop_pointers(a_view, w_view, w_up_view, a_up_ptr, tile, NUM_ROWS, N, K, FUSED,
                                             DUAL_DGRAD, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        item_c += num_progs
        if FLATTEN:
            tile = _work_item(item_c, n_tiles, cu_ptr, G, sched, BLOCK_M, BLOCK_G, SMALL_G, GROUP_MAJOR)
        _epilogue(acc, acc_up, tile, outs, o_desc, out_strides, rw_ptr, NUM_ROWS, N,
                  FUSED, HAS_WEIGHTS, SAVE_GATE_UP, TMA_STORE, BLOCK_M, BLOCK_N)

    # Tail items (rows [cu[-1], NvS) get zeros), numbered after the real ones on the same stride.
    # ZERO_TAIL=False leaves them unwritten (an intermediate that only segment-aware kernels read).
    if ZERO_TAIL:
        tail_items = tail_tiles * n_tiles
        first = (pid - real_items % num_progs + num_progs) % num_progs
        for j in range(first, tail_items, num_progs):
            _zero_tail_item(outs, out_strides, cu_ptr, G, NUM_ROWS, N, j, n_tiles, BLOCK_M, BLOCK_N, SAVE_GATE_UP)


def num_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound on real + tail row tiles: each non-empty segment adds at most one
    partial tile, and there are at most ``min(G, NvS)`` of them."""
    return triton.cdiv(num_rows, block_m) + min(num_groups, num_rows)


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, per_sm: int = 1) -> int:
    """A persistent grid's size before its bound by the items: ``per_sm`` programs per SM on CUDA;
    4 for CPU tensors (the interpreter, where a few programs exercise the persistent loop, and the
    ahead-of-time compile check)."""
    if device.type != "cuda":
        return 4
    return num_sms(device.index if device.index is not None else torch.cuda.current_device()) * per_sm


def tma_addressable(t: torch.Tensor) -> bool:
    """What a TMA descriptor needs of a tensor: unit inner stride, 16-byte aligned base and
    outer strides, none of them 0 (a broadcast input, ``row.expand(NvS, H)``, is read through
    pointers instead)."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]))


def tma_usable(a: torch.Tensor, *weights: torch.Tensor) -> bool:
    """TMA loads of ``a`` and the weights; each weight is read as one ``[G*N, K]`` matrix, so
    its groups must be back to back. A descriptor needs every extent > 0 (``K = 0``: no TMA)."""
    return (all(tma_addressable(t) and t.numel() > 0 for t in (a, *weights))
            and all(w.stride(0) == w.shape[1] * w.stride(1) for w in weights))


def is_kn_view(w: torch.Tensor) -> bool:
    """``w [G, N, K]`` is the transposed view of weights stored ``[G, K, N]`` (the dgrad's
    ``w.transpose(1, 2)``), not itself K-contiguous."""
    return w.stride(1) == 1 and w.stride(2) != 1


def tma_usable_kn(a: torch.Tensor, w: torch.Tensor, block_k: int) -> bool:
    """TMA for a transposed view: the storage ``[G*K, N]`` must be aligned and back to back,
    and ``K % block_k == 0`` so that no tile reads across two groups."""
    g, n, k = w.shape
    return (is_kn_view(w) and tma_addressable(a) and a.numel() > 0 and w.numel() > 0 and w.data_ptr() % 16 == 0
            and w.stride(2) > 0 and (w.stride(2) * w.element_size()) % 16 == 0 and w.stride(0) == k * w.stride(2)
            and k % block_k == 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a launch needs that depends on static metadata only."""
    grid: tuple
    ints: tuple  # G, NvS, N, K and the strides, in kernel order
    constexprs: dict
    num_warps: int
    num_stages: int
    descs: tuple  # (shape, strides, block) of a, w, w_up, a_up, out for TMA, or None each
    launch_pdl: bool = False  # launched as a programmatic dependent of the previous kernel

    def args(self, a, w, w_up, a_up, rw, out, gate_out, up_out, cu, descriptors: bool = True) -> list:
        """The runtime arguments; ``descriptors=False``: each TMA descriptor's base tensor in its
        place (what :class:`..launch.DirectLaunch` takes)."""
        bases = [None if geo is None else t for t, geo in zip((a, w, w_up, a_up, out), self.descs)]
        if descriptors:
            bases = [None if geo is None else direct.tensor_descriptor(t, *geo) for t, geo in zip(bases, self.descs)]
        return [a, w, w_up, a_up, rw, out, gate_out, up_out, cu, *bases, *self.ints]


_FIRST_DESC = 9  # index of the first descriptor in Plan.args


def make_plan(a, w, w_up, route_weights, out, cfg: GemmConfig, use_tma: bool, a_up=None, saved=None,
              zero_tail: bool = True, role: PdlRole = PdlRole.NONE) -> Plan:
    """``a_up`` given: the dual dgrad ``out = a @ w[g].T + a_up @ w_up[g].T`` (``a_up`` with
    ``a``'s shape and strides); else ``w_up`` given: the fused SwiGLU GEMM, which with ``saved =
    (gate_out, up_out)`` (``out``'s shape, dtype and strides) also writes gate and up.

    ``role`` (Hopper TMA path only, else ignored; :mod:`..pdl`): a dependent, launched early, scans
    its schedule and prefetches its first weight tile into L2, then waits for the primary before
    touching ``a`` or ``out``."""
    if not use_tma:
        # The schedule knobs are measured (and meant) for the Hopper TMA path only, and PDL is a
        # Hopper feature: elsewhere the pair runs plainly one after the other.
        cfg = dataclasses.replace(cfg, flatten=False, warp_specialize=False, tma_store=0)
        role = PdlRole.NONE
    if cfg.flatten and cfg.tma_store:
        # Triton 3.6 fails to compile a flattened loop around the full/partial store branch.
        raise ValueError("GemmConfig: flatten and tma_store cannot be combined")
    _check_operands(a, w, w_up, out, a_up, saved)
    num_rows, k = a.shape
    g, n, _ = w.shape
    w_up_arg = w if w_up is None else w_up
    dual = a_up is not None
    descs, w_transposed, tma_store = _descriptor_geometry(a, w, w_up, a_up, out, cfg, use_tma)
    small_g = g <= SMALL_G_MAX
    prefetch = 0
    if role is PdlRole.DEPENDENT and small_g and not w_transposed:
        # What the pipeline's first stages read of each weight row (16-byte multiples: TMA).
        prefetch = min(k, cfg.block_k * cfg.num_stages) * w.element_size()
    items_bound = num_row_tiles(num_rows, g, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return Plan(
        grid=(max(1, min(items_bound, persistent_programs(a.device, cfg.programs_per_sm))),),
        ints=(g, num_rows, n, k, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
              w_up_arg.stride(0), w_up_arg.stride(1), w_up_arg.stride(2), out.stride(0), out.stride(1)),
        constexprs=dict(FUSED=w_up is not None and not dual, HAS_WEIGHTS=route_weights is not None, USE_TMA=use_tma,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                        BLOCK_G=max(16, triton.next_power_of_2(g)) if small_g else BLOCK_G,
                        SMALL_G=small_g,
                        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", W_TRANSPOSED=w_transposed,
                        FLATTEN=cfg.flatten, WARP_SPEC=cfg.warp_specialize, TMA_STORE=tma_store, DUAL_DGRAD=dual,
                        SAVE_GATE_UP=saved is not None, ZERO_TAIL=zero_tail,
                        GROUP_MAJOR=cfg.group_major and small_g,
                        LAUNCH_DEPENDENTS=role is PdlRole.PRIMARY, WAIT_PRIOR=role is PdlRole.DEPENDENT,
                        PREFETCH_BYTES=prefetch),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, descs=descs, launch_pdl=role is PdlRole.DEPENDENT,
    )


def _check_operands(a, w, w_up, out, a_up, saved) -> None:
    """The dual GEMM's and the gate/up-saving GEMM's operand rules (the ops' checks ran before)."""
    dual = a_up is not None
    if dual and (w_up is None or a_up.shape != a.shape or a_up.stride() != a.stride() or w_up.shape != w.shape
                 or w_up.stride() != w.stride()):
        raise ValueError("dual GEMM: a_up needs a's shape and strides, w_up w's")
    if saved is not None and (w_up is None or dual or any(
            t.shape != out.shape or t.stride() != out.stride() or t.dtype != out.dtype for t in saved)):
        raise ValueError("saving gate and up needs the fused GEMM and two outputs like out")


def _descriptor_geometry(a, w, w_up, a_up, out, cfg: GemmConfig, use_tma: bool) -> tuple:
    """``(descs, w_transposed, tma_store)``: the (shape, strides, block) of each TMA descriptor of
    ``a, w, w_up, a_up, out`` (None where that operand is read or written by pointer), whether the
    weights are read as a ``[K, N]`` view, and the TMA store's column split (0: none)."""
    num_rows, k = a.shape
    g, n, _ = w.shape
    w_up_arg = w if w_up is None else w_up
    dual = a_up is not None
    a_geo = ([num_rows, k], [a.stride(0), 1], [cfg.block_m, cfg.block_k])
    descs = (None,) * 5
    w_transposed = use_tma and is_kn_view(w)
    if w_transposed:
        if (w_up is not None and not dual) or not tma_usable_kn(a, w, cfg.block_k) or (
                dual and not tma_usable_kn(a_up, w_up_arg, cfg.block_k)):
            raise ValueError("TMA on transposed weights needs a plain or dual GEMM, aligned storage "
                             "and K % BLOCK_K == 0")
        w_geo = ([g * k, n], [w.stride(2), 1], [cfg.block_k, cfg.block_n])
        descs = (a_geo, w_geo, w_geo, a_geo if dual else None, None)
    elif use_tma:
        descs = (a_geo, ([g * n, k], [w.stride(1), 1], [cfg.block_n, cfg.block_k]),
                 ([g * n, k], [w_up_arg.stride(1), 1], [cfg.block_n, cfg.block_k]), a_geo if dual else None, None)
    tma_store = cfg.tma_store if use_tma and tma_addressable(out) else 0
    if tma_store:
        descs = descs[:4] + (([num_rows, n], [out.stride(0), 1], [cfg.block_m, cfg.block_n // tma_store]),)
    return descs, w_transposed, tma_store


def _kernel_args(plan: Plan, a, w, w_up, route_weights, cu_seqlens, out, a_up, saved) -> list:
    """The kernel's runtime arguments: unused operands stand in for the absent ones (``w_up``
    unless fused or dual, ``a_up`` unless dual, route weights, gate and up unless saved)."""
    gate_out, up_out = (out, out) if saved is None else saved
    return plan.args(a, w, w if w_up is None else w_up, a if a_up is None else a_up,
                     a if route_weights is None else route_weights, out, gate_out, up_out, cu_seqlens)


def _compile_and_launch(plan: Plan, a, w, w_up, route_weights, cu_seqlens, out, a_up=None, saved=None):
    """Launch through Triton's JIT (compiling on first use); returns the compiled kernel."""
    args = _kernel_args(plan, a, w, w_up, route_weights, cu_seqlens, out, a_up, saved)
    # The first launch of a plan builds checked descriptors.
    args[_FIRST_DESC:_FIRST_DESC + 5] = [None if geo is None else TensorDescriptor(t, *geo)
                                         for t, geo in zip(args[:4] + [out], plan.descs)]
    options = dict(launch_pdl=True) if plan.launch_pdl else {}
    return grouped_gemm_kernel[plan.grid](*args, **plan.constexprs, num_warps=plan.num_warps,
                                          num_stages=plan.num_stages, **options)


def launch(a: torch.Tensor, w: torch.Tensor, w_up, route_weights, cu_seqlens: torch.Tensor,
           out: torch.Tensor, cfg: GemmConfig, use_tma: bool = False, a_up=None, saved=None,
           zero_tail: bool = True, role: PdlRole = PdlRole.NONE) -> None:
    """Launch with an explicit config (interpreter tests, tuning sweeps); :func:`run` chooses it."""
    if a.shape[0] == 0 or w.shape[1] == 0:
        return
    _compile_and_launch(make_plan(a, w, w_up, route_weights, out, cfg, use_tma, a_up, saved, zero_tail, role),
                        a, w, w_up, route_weights, cu_seqlens, out, a_up, saved)


_PLANS: dict = {}


def run(a, w, w_up, route_weights, cu_seqlens, out, choose, *, a_up=None, saved=None, zero_tail: bool = True,
        role: PdlRole = PdlRole.NONE, key=None) -> None:
    """The CUDA ops' entry. ``choose(a, w, w_up, a_up) -> (GemmConfig, use_tma)`` (a module-level
    function) runs once per static signature and ``MOONEP_OPS_PORTABLE``; later calls reuse the
    plan and the compiled kernel (:mod:`..launch`). ``key``: the caller's static signature of these
    operands, when it has one (it must fix every operand's layout); else this computes one."""
    if a.shape[0] == 0 or w.shape[1] == 0:
        return
    w_up_arg = w if w_up is None else w_up
    rw = a if route_weights is None else route_weights
    a_up_arg = a if a_up is None else a_up
    gate_out, up_out = (out, out) if saved is None else saved
    if key is None:
        key = layout_signature(a, w, w_up_arg, a_up_arg, rw, out, gate_out, up_out, cu_seqlens)
    key = (key, w_up is None, a_up is None, route_weights is None, saved is None, choose, flags.portable_only(),
           zero_tail, role)
    launch = _PLANS.get(key)
    if launch is None:
        plan = make_plan(a, w, w_up, route_weights, out, *choose(a, w, w_up, a_up), a_up, saved, zero_tail, role)
        kernel = _compile_and_launch(plan, a, w, w_up, route_weights, cu_seqlens, out, a_up, saved)
        if direct.enabled() and hasattr(kernel, "run"):
            _PLANS[key] = (plan, direct.DirectLaunch(kernel, plan.grid, list(plan.constexprs.values()),
                                                     direct.descriptor_factories(_FIRST_DESC, plan.descs)))
        return
    plan, launch = launch
    launch(plan.args(a, w, w_up_arg, a_up_arg, rw, out, gate_out, up_out, cu_seqlens, descriptors=False))


def launch_grouped_gemm(a, w, cu_seqlens, out, cfg: GemmConfig, use_tma: bool = False, zero_tail=True,
                        role: PdlRole = PdlRole.NONE) -> None:
    """``out[seg_g] = a[seg_g] @ w[g].T`` (any strides on the portable path)."""
    launch(a, w, None, None, cu_seqlens, out, cfg, use_tma, zero_tail=zero_tail, role=role)


def launch_grouped_gemm_dual(a, w, a_up, w_up, cu_seqlens, out, cfg: GemmConfig, use_tma: bool = False) -> None:
    """``out[seg_g] = a[seg_g] @ w[g].T + a_up[seg_g] @ w_up[g].T`` in one accumulator (the dual
    dgrad passes the gradients of gate and up and the transposed views of w_gate and w_up)."""
    launch(a, w, w_up, None, cu_seqlens, out, cfg, use_tma, a_up=a_up)


def launch_grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens, out, cfg: GemmConfig,
                                 use_tma: bool = False, zero_tail: bool = True, role: PdlRole = PdlRole.NONE) -> None:
    """``out[seg_g] = silu(x @ w_gate[g].T) * (x @ w_up[g].T) * route_weights`` in one pass
    (``zero_tail=False``: rows past ``cu_seqlens[-1]`` are left unwritten)."""
    launch(x, w_gate, w_up, route_weights, cu_seqlens, out, cfg, use_tma, zero_tail=zero_tail, role=role)


def launch_grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens, act, gate, up,
                                              cfg: GemmConfig, use_tma: bool = False) -> None:
    """The fused GEMM that also writes ``gate`` and ``up`` (rounded); ``act`` is computed from them."""
    launch(x, w_gate, w_up, route_weights, cu_seqlens, act, cfg, use_tma, saved=(gate, up))
