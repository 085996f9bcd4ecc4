"""The Triton kernel behind every forward grouped GEMM: a persistent, segment-aware GEMM
with an optional fused SwiGLU epilogue.

- ``FUSED=False``: ``out[seg_g] = a[seg_g] @ w[g].T``.
- ``DUAL=True``: ``out[seg_g] = a[seg_g] @ w[g].T + a2[seg_g] @ w_up[g].T`` (the dual dgrad).
- ``FUSED=True``: ``out[seg_g] = silu(a[seg_g] @ w[g].T) * (a[seg_g] @ w_up[g].T) * rw[seg_g]``;
  each ``a`` tile is loaded once for both projections and the activation is applied to the
  fp32 accumulators, so gate and up are never rounded or written.
- ``FUSED=True, SAVE=True`` (training forward): also writes gate and up (rounded to the
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

Programmatic dependent launch (Hopper, the ``experts`` op's pair only; see ``_plan``'s ``pdl``):
the fused GEMM (``LAUNCH_DEPENDENTS``) lets the down GEMM launch at once; the down GEMM's programs
(``WAIT_PRIOR``) start on the SMs the fused programs leave, scan ``cu_seqlens``, bulk-prefetch
their first weight tile into L2, and execute ``griddepcontrol.wait`` before any load of ``a``
(``act``) or any store. Measured −1 to −2% on the memory-bound shapes' whole path.

Loads. Portable path: masked pointer loads (sm80+, any strides, any K). Hopper path
(``USE_TMA``): tensor-memory-accelerator descriptors for ``a`` and ``w`` (rows past a segment's
end are loaded but never stored: GEMM rows are independent); ``W_KN``: the weights are the
transposed view of ``[G, K, N]`` storage (the dgrad), read as ``[G*K, N]`` rows. Stores are
masked to the segment, so one segment's tile never writes another's rows; with ``TMA_STORE``
a tile wholly inside its segment is stored by TMA instead (whole, or in two column halves).

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
from ...cache import signature
from .. import launch
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
def _zero_tail_item(out_ptr, gate_out_ptr, up_out_ptr, cu_ptr, G, NUM_ROWS, N, j, n_tiles, stride_om, stride_on,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SAVE: tl.constexpr):
    """Tail item ``j`` (row tile ``j // n_tiles``, column tile ``j % n_tiles``): zeros in
    ``out`` (and in gate and up when saving); rows past NvS (``j`` past the last item) are masked."""
    cols = (j % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    zero_tail_tile(out_ptr, cu_ptr, G, NUM_ROWS, j // n_tiles, cols, cols < N, stride_om, stride_on,
                   BLOCK_M, BLOCK_N)
    if SAVE:
        zero_tail_tile(gate_out_ptr, cu_ptr, G, NUM_ROWS, j // n_tiles, cols, cols < N, stride_om, stride_on,
                       BLOCK_M, BLOCK_N)
        zero_tail_tile(up_out_ptr, cu_ptr, G, NUM_ROWS, j // n_tiles, cols, cols < N, stride_om, stride_on,
                       BLOCK_M, BLOCK_N)


@triton.jit
def _small_g_segment(t, offs_g, g_starts, g_ends, g_excl, g_incl, BLOCK_M: tl.constexpr):
    """Segment of real row tile ``t`` from the in-register schedule: (g, first row, segment end)."""
    hit = (g_excl <= t) & (t < g_incl)
    g = tl.sum(tl.where(hit, offs_g, 0), 0)
    row_lo = tl.sum(tl.where(hit, g_starts + (t - g_excl) * BLOCK_M, 0), 0)
    seg_end = tl.sum(tl.where(hit, g_ends, 0), 0)
    return g, row_lo, seg_end


@triton.jit
def _small_g_item(item, n_tiles, offs_g, g_starts, g_ends, g_tiles, g_excl, g_incl,
                  BLOCK_M: tl.constexpr, GROUP_MAJOR: tl.constexpr):
    """Work item ``item`` from the in-register schedule: (g, first row, segment end, column tile)."""
    if GROUP_MAJOR:
        # Segment g owns items [excl_g * n_tiles, incl_g * n_tiles): column tile, then row tile.
        hit = (g_excl * n_tiles <= item) & (item < g_incl * n_tiles)
        g = tl.sum(tl.where(hit, offs_g, 0), 0)
        local = item - tl.sum(tl.where(hit, g_excl, 0), 0) * n_tiles
        count = tl.maximum(tl.sum(tl.where(hit, g_tiles, 0), 0), 1)
        row_lo = tl.sum(tl.where(hit, g_starts, 0), 0) + (local % count) * BLOCK_M
        seg_end = tl.sum(tl.where(hit, g_ends, 0), 0)
        pid_n = local // count
    else:
        pid_n = item % n_tiles
        g, row_lo, seg_end = _small_g_segment(item // n_tiles, offs_g, g_starts, g_ends, g_excl, g_incl, BLOCK_M)
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
def _moe_gemm_kernel(
    a_ptr, w_ptr, u_ptr, a2_ptr, rw_ptr, out_ptr, gate_out_ptr, up_out_ptr, cu_ptr,
    a_desc, w_desc, u_desc, a2_desc, o_desc,
    G, NUM_ROWS, N, K,
    stride_am, stride_ak, stride_wg, stride_wn, stride_wk, stride_ug, stride_un, stride_uk,
    stride_om, stride_on,
    FUSED: tl.constexpr, HAS_WEIGHTS: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, SMALL_G: tl.constexpr, PRECISION: tl.constexpr,
    W_KN: tl.constexpr = False, FLATTEN: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
    TMA_STORE: tl.constexpr = 0, DUAL: tl.constexpr = False, SAVE: tl.constexpr = False,
    ZERO_TAIL: tl.constexpr = True, GROUP_MAJOR: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False, WAIT_PRIOR: tl.constexpr = False, PREFETCH_BYTES: tl.constexpr = 0,
):
    if LAUNCH_DEPENDENTS:
        # Programmatic dependent launch: the next kernel (launched with launch_pdl) may start
        # its programs as SMs free up, instead of after this grid's last program ends.
        gdc_launch_dependents()
    # Totals first: real row tiles (a scan of cu_seqlens) and tail row tiles.
    if SMALL_G:
        # All of cu_seqlens fits one block: keep the tile prefix sums in registers for the
        # whole persistent loop, so locating an item's segment is a few reductions, no loads.
        offs_g = tl.arange(0, BLOCK_G)
        g_ends = tl.load(cu_ptr + offs_g, mask=offs_g < G, other=0)
        g_starts = tl.load(cu_ptr + offs_g - 1, mask=(offs_g > 0) & (offs_g < G), other=0)
        g_tiles = tl.cdiv(tl.maximum(g_ends - g_starts, 0), BLOCK_M)
        g_incl = tl.cumsum(g_tiles, 0)
        g_excl = g_incl - g_tiles
        real_tiles = tl.sum(g_tiles, 0)
    else:
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
                g0, _, _, pid_n0 = _small_g_item(pid, n_tiles, offs_g, g_starts, g_ends, g_tiles, g_excl, g_incl,
                                                 BLOCK_M, GROUP_MAJOR)
                _prefetch_rows_l2(w_ptr, g0 * N + pid_n0 * BLOCK_N, g0 * N + N, stride_wn, BLOCK_N, PREFETCH_BYTES)
        gdc_wait()

    offs_k = tl.arange(0, BLOCK_K)
    # Real work items (row tile, column tile), columns fastest (GROUP_MAJOR: see the module
    # docstring). FLATTEN lets the software pipeliner issue the next item's loads under this
    # item's epilogue; the epilogue then re-derives its own item from a second counter
    # (``item_c``), so that it does not depend on values of the loop's prologue.
    item_c = pid - num_progs
    for item in tl.range(pid, real_items, num_progs, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        if SMALL_G:
            g, row_lo, seg_end, pid_n = _small_g_item(item, n_tiles, offs_g, g_starts, g_ends, g_tiles, g_excl,
                                                      g_incl, BLOCK_M, GROUP_MAJOR)
        else:
            pid_n = item % n_tiles
            g, row_lo, seg_end, _ = locate_tile(cu_ptr, G, item // n_tiles, BLOCK_M, BLOCK_G)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA and W_KN:
            # w[g] is stored [K, N] (the dgrad's transposed view of [G, N', K'] weights): the
            # descriptor reads it as one [G*K, N] matrix. K % BLOCK_K == 0 (the plan checks), so a
            # tile never reaches into the next group's rows.
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([row_lo, k0])
                acc = tl.dot(a, w_desc.load([g * K + k0, pid_n * BLOCK_N]), acc, input_precision=PRECISION)
            if DUAL:  # + a2[seg] @ u[g] into the same accumulator (the dual dgrad)
                for k0 in range(0, K, BLOCK_K):
                    a2 = a2_desc.load([row_lo, k0])
                    acc = tl.dot(a2, u_desc.load([g * K + k0, pid_n * BLOCK_N]), acc, input_precision=PRECISION)
        elif USE_TMA:
            w_row = g * N + pid_n * BLOCK_N
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([row_lo, k0])
                acc = tl.dot(a, w_desc.load([w_row, k0]).T, acc, input_precision=PRECISION)
                if FUSED:
                    acc_up = tl.dot(a, u_desc.load([w_row, k0]).T, acc_up, input_precision=PRECISION)
            if DUAL:
                for k0 in range(0, K, BLOCK_K):
                    a2 = a2_desc.load([row_lo, k0])
                    acc = tl.dot(a2, u_desc.load([w_row, k0]).T, acc, input_precision=PRECISION)
        else:
            rows = row_lo + tl.arange(0, BLOCK_M)
            row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            g64 = g.to(tl.int64)
            a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
            w_ptrs = (w_ptr + g64 * stride_wg + cols[None, :].to(tl.int64) * stride_wn
                      + offs_k[:, None].to(tl.int64) * stride_wk)
            u_ptrs = (u_ptr + g64 * stride_ug + cols[None, :].to(tl.int64) * stride_un
                      + offs_k[:, None].to(tl.int64) * stride_uk)
            for k0 in range(0, K, BLOCK_K):
                k_mask = (offs_k + k0) < K
                w_mask = k_mask[:, None] & col_mask[None, :]
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=PRECISION)
                if FUSED:
                    acc_up = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_up,
                                    input_precision=PRECISION)
                    u_ptrs += BLOCK_K * stride_uk
                a_ptrs += BLOCK_K * stride_ak
                w_ptrs += BLOCK_K * stride_wk
            if DUAL:  # a2 has a's strides (the plan checks)
                a2_ptrs = (a2_ptr + rows[:, None].to(tl.int64) * stride_am
                           + offs_k[None, :].to(tl.int64) * stride_ak)
                for k0 in range(0, K, BLOCK_K):
                    k_mask = (offs_k + k0) < K
                    a2 = tl.load(a2_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    u = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                    acc = tl.dot(a2, u, acc, input_precision=PRECISION)
                    a2_ptrs += BLOCK_K * stride_ak
                    u_ptrs += BLOCK_K * stride_uk
        # Epilogue.
        item_c += num_progs
        if FLATTEN:
            if SMALL_G:
                g, row_lo, seg_end, pid_n = _small_g_item(item_c, n_tiles, offs_g, g_starts, g_ends, g_tiles,
                                                          g_excl, g_incl, BLOCK_M, GROUP_MAJOR)
            else:
                pid_n = item_c % n_tiles
                g, row_lo, seg_end, _ = locate_tile(cu_ptr, G, item_c // n_tiles, BLOCK_M, BLOCK_G)
        rows = row_lo + tl.arange(0, BLOCK_M)
        row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if FUSED:
            if SAVE:  # gate_out and up_out share out's strides (the plan checks)
                gate_r = acc.to(out_ptr.dtype.element_ty)
                up_r = acc_up.to(out_ptr.dtype.element_ty)
                store_tile(gate_out_ptr, gate_r, rows, cols, row_mask, col_mask, stride_om, stride_on)
                store_tile(up_out_ptr, up_r, rows, cols, row_mask, col_mask, stride_om, stride_on)
                acc = gate_r.to(tl.float32)
                acc_up = up_r.to(tl.float32)
            acc = acc * tl.sigmoid(acc) * acc_up
            if HAS_WEIGHTS:
                acc = acc * tl.load(rw_ptr + rows, mask=row_mask, other=0.0)[:, None]
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

    # Tail items (rows [cu[-1], NvS) get zeros), numbered after the real ones on the same stride.
    # ZERO_TAIL=False leaves them unwritten (an intermediate that only segment-aware kernels read).
    if ZERO_TAIL:
        tail_items = tail_tiles * n_tiles
        first = (pid - real_items % num_progs + num_progs) % num_progs
        for j in range(first, tail_items, num_progs):
            _zero_tail_item(out_ptr, gate_out_ptr, up_out_ptr, cu_ptr, G, NUM_ROWS, N, j, n_tiles,
                            stride_om, stride_on, BLOCK_M, BLOCK_N, SAVE)


def num_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound on real + tail row tiles: each non-empty segment adds at most one
    partial tile, and there are at most ``min(G, NvS)`` of them."""
    return triton.cdiv(num_rows, block_m) + min(num_groups, num_rows)


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_addressable(t: torch.Tensor) -> bool:
    """What a TMA descriptor needs of a tensor: unit inner stride, 16-byte aligned base and
    outer strides."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]))


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
            and (w.stride(2) * w.element_size()) % 16 == 0 and w.stride(0) == k * w.stride(2) and k % block_k == 0)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a launch needs that depends on static metadata only."""
    grid: tuple
    ints: tuple  # G, NvS, N, K and the strides, in kernel order
    constexprs: dict
    num_warps: int
    num_stages: int
    descs: tuple  # (shape, strides, block) of a, w, w_up, a2, out for TMA, or None each
    launch_pdl: bool = False  # launched as a programmatic dependent of the previous kernel

    def args(self, a, w, u, a2, rw, out, gate_out, up_out, cu) -> list:
        descs = [None if geo is None else launch.tensor_descriptor(t, *geo)
                 for t, geo in zip((a, w, u, a2, out), self.descs)]
        return [a, w, u, a2, rw, out, gate_out, up_out, cu, *descs, *self.ints]


_FIRST_DESC = 9  # index of the first descriptor in _Plan.args


def _plan(a, w, w_up, route_weights, out, cfg: GemmConfig, use_tma: bool, a2=None, saved=None,
          zero_tail: bool = True, role: PdlRole = PdlRole.NONE) -> _Plan:
    """``a2`` given: the dual GEMM ``out = a @ w[g].T + a2 @ w_up[g].T`` (``a2`` with ``a``'s
    shape and strides); else ``w_up`` given: the fused SwiGLU GEMM, which with ``saved =
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
    num_rows, k = a.shape
    g, n, _ = w.shape
    items_bound = num_row_tiles(num_rows, g, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if a.device.type == "cuda":
        programs = num_sms(a.device.index if a.device.index is not None else torch.cuda.current_device())
        programs *= cfg.programs_per_sm
    else:
        programs = 4  # interpreter: a few programs, so the persistent loop is exercised
    u = w if w_up is None else w_up
    dual = a2 is not None
    if dual and (w_up is None or a2.shape != a.shape or a2.stride() != a.stride() or u.shape != w.shape
                 or u.stride() != w.stride()):
        raise ValueError("dual GEMM: a2 needs a's shape and strides, w_up w's")
    if saved is not None and (w_up is None or dual or any(
            t.shape != out.shape or t.stride() != out.stride() or t.dtype != out.dtype for t in saved)):
        raise ValueError("saving gate and up needs the fused GEMM and two outputs like out")
    a_geo = ([num_rows, k], [a.stride(0), 1], [cfg.block_m, cfg.block_k])
    descs = (None,) * 5
    w_kn = use_tma and is_kn_view(w)
    if w_kn:
        if (w_up is not None and not dual) or not tma_usable_kn(a, w, cfg.block_k) or (
                dual and not tma_usable_kn(a2, u, cfg.block_k)):
            raise ValueError("TMA on transposed weights needs a plain or dual GEMM, aligned storage "
                             "and K % BLOCK_K == 0")
        w_geo = ([g * k, n], [w.stride(2), 1], [cfg.block_k, cfg.block_n])
        descs = (a_geo, w_geo, w_geo, a_geo if dual else None, None)
    elif use_tma:
        descs = (a_geo, ([g * n, k], [w.stride(1), 1], [cfg.block_n, cfg.block_k]),
                 ([g * n, k], [u.stride(1), 1], [cfg.block_n, cfg.block_k]), a_geo if dual else None, None)
    tma_store = cfg.tma_store if use_tma and tma_addressable(out) else 0
    if tma_store:
        descs = descs[:4] + (([num_rows, n], [out.stride(0), 1], [cfg.block_m, cfg.block_n // tma_store]),)
    small_g = g <= SMALL_G_MAX
    prefetch = 0
    if role is PdlRole.DEPENDENT and small_g and not w_kn:
        # What the pipeline's first stages read of each weight row (16-byte multiples: TMA).
        prefetch = min(k, cfg.block_k * cfg.num_stages) * w.element_size()
    return _Plan(
        grid=(max(1, min(items_bound, programs)),),
        ints=(g, num_rows, n, k, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
              u.stride(0), u.stride(1), u.stride(2), out.stride(0), out.stride(1)),
        constexprs=dict(FUSED=w_up is not None and not dual, HAS_WEIGHTS=route_weights is not None, USE_TMA=use_tma,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                        BLOCK_G=max(16, triton.next_power_of_2(g)) if small_g else BLOCK_G,
                        SMALL_G=small_g,
                        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", W_KN=w_kn,
                        FLATTEN=cfg.flatten, WARP_SPEC=cfg.warp_specialize, TMA_STORE=tma_store, DUAL=dual,
                        SAVE=saved is not None, ZERO_TAIL=zero_tail,
                        GROUP_MAJOR=cfg.group_major and small_g,
                        LAUNCH_DEPENDENTS=role is PdlRole.PRIMARY, WAIT_PRIOR=role is PdlRole.DEPENDENT,
                        PREFETCH_BYTES=prefetch),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, descs=descs, launch_pdl=role is PdlRole.DEPENDENT,
    )


def _launch(plan: _Plan, a, w, w_up, route_weights, cu_seqlens, out, a2=None, saved=None):
    """Launch through Triton's JIT (compiling on first use); returns the compiled kernel."""
    u = w if w_up is None else w_up
    a2 = a if a2 is None else a2
    gate_out, up_out = (out, out) if saved is None else saved
    args = plan.args(a, w, u, a2, a if route_weights is None else route_weights, out, gate_out, up_out,
                     cu_seqlens)
    # The first launch of a plan builds checked descriptors.
    args[_FIRST_DESC:_FIRST_DESC + 5] = [None if geo is None else TensorDescriptor(t, *geo)
                                         for t, geo in zip((a, w, u, a2, out), plan.descs)]
    options = dict(launch_pdl=True) if plan.launch_pdl else {}
    return _moe_gemm_kernel[plan.grid](*args, **plan.constexprs, num_warps=plan.num_warps,
                                       num_stages=plan.num_stages, **options)


def launch_moe_gemm(a: torch.Tensor, w: torch.Tensor, w_up, route_weights, cu_seqlens: torch.Tensor,
                    out: torch.Tensor, cfg: GemmConfig, use_tma: bool = False, a2=None, saved=None,
                    zero_tail: bool = True, role: PdlRole = PdlRole.NONE) -> None:
    """Launch with an explicit config (interpreter tests, tuning sweeps)."""
    if a.shape[0] == 0 or w.shape[1] == 0:
        return
    _launch(_plan(a, w, w_up, route_weights, out, cfg, use_tma, a2, saved, zero_tail, role), a, w, w_up,
            route_weights, cu_seqlens, out, a2, saved)


_PLANS: dict = {}


def run(a, w, w_up, route_weights, cu_seqlens, out, choose, *, a2=None, saved=None, zero_tail: bool = True,
        role: PdlRole = PdlRole.NONE) -> None:
    """The CUDA ops' entry. ``choose(a, w, w_up, a2) -> (GemmConfig, use_tma)`` (a module-level
    function) runs once per static signature and ``MOONEP_OPS_PORTABLE``; later calls reuse the
    plan and the compiled kernel (:mod:`..launch`)."""
    if a.shape[0] == 0 or w.shape[1] == 0:
        return
    u = w if w_up is None else w_up
    rw = a if route_weights is None else route_weights
    a2_arg = a if a2 is None else a2  # the kernel's a2 argument (unused unless dual)
    gate_out, up_out = (out, out) if saved is None else saved  # unused unless saving
    key = (signature(a, w, u, a2_arg, rw, out, gate_out, up_out, cu_seqlens), w_up is None, a2 is None,
           route_weights is None, saved is None, choose, flags.portable_only(), zero_tail, role)
    entry = _PLANS.get(key)
    if entry is None:
        plan = _plan(a, w, w_up, route_weights, out, *choose(a, w, w_up, a2), a2, saved, zero_tail, role)
        kernel = _launch(plan, a, w, w_up, route_weights, cu_seqlens, out, a2, saved)
        if launch.ENABLED and hasattr(kernel, "run"):
            _PLANS[key] = (plan, kernel, list(plan.constexprs.values()))
        return
    plan, kernel, constexpr_values = entry
    args = plan.args(a, w, u, a2_arg, rw, out, gate_out, up_out, cu_seqlens)
    launch.launch_compiled(kernel, plan.grid, args + constexpr_values)


def launch_grouped_gemm(a, w, cu_seqlens, out, cfg: GemmConfig, use_tma: bool = False, zero_tail=True,
                        role: PdlRole = PdlRole.NONE) -> None:
    """``out[seg_g] = a[seg_g] @ w[g].T`` (any strides on the portable path)."""
    launch_moe_gemm(a, w, None, None, cu_seqlens, out, cfg, use_tma, zero_tail=zero_tail, role=role)


def launch_grouped_gemm_dual(a, w, a2, w2, cu_seqlens, out, cfg: GemmConfig, use_tma: bool = False) -> None:
    """``out[seg_g] = a[seg_g] @ w[g].T + a2[seg_g] @ w2[g].T`` in one accumulator (the dual dgrad
    passes the transposed views of w_gate and w_up)."""
    launch_moe_gemm(a, w, w2, None, cu_seqlens, out, cfg, use_tma, a2=a2)


def launch_grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens, out, cfg: GemmConfig,
                                 use_tma: bool = False, zero_tail: bool = True, role: PdlRole = PdlRole.NONE) -> None:
    """``out[seg_g] = silu(x @ w_gate[g].T) * (x @ w_up[g].T) * route_weights`` in one pass
    (``zero_tail=False``: rows past ``cu_seqlens[-1]`` are left unwritten)."""
    launch_moe_gemm(x, w_gate, w_up, route_weights, cu_seqlens, out, cfg, use_tma, zero_tail=zero_tail, role=role)


def launch_grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens, act, gate, up,
                                              cfg: GemmConfig, use_tma: bool = False) -> None:
    """The fused GEMM that also writes ``gate`` and ``up`` (rounded); ``act`` is computed from them."""
    launch_moe_gemm(x, w_gate, w_up, route_weights, cu_seqlens, act, cfg, use_tma, saved=(gate, up))
