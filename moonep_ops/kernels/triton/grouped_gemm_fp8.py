"""The FP8 block-scaled grouped GEMM (sm89+): the kernel of the ``*_fp8`` ops.

Semantics (:mod:`moonep_ops.fp8`): weights are e4m3 with one fp32 scale per 128 x 128 block;
the rows of ``a`` are quantized per row and per 128 columns (``s = amax / 448``). ``BLOCK_K`` is
the scale block, so each K step is one e4m3 ``tl.dot`` whose fp32 result is scaled by the row
scales times the weight block's scale and added to the fp32 accumulator.

- :func:`quantize_rows_kernel` quantizes the live rows of ``x`` once (``[NvS, K]`` e4m3 and
  ``[NvS, cdiv(K, 128)]`` scales); the tail rows are neither read nor written.
- :func:`grouped_gemm_fp8_kernel` multiplies e4m3 rows by e4m3 weights: ``out = a @ w[g].T`` in
  ``out``'s dtype, or (``FUSED``) gate and up from one ``a`` tile, whose epilogue computes
  ``silu(gate) * up * rw`` in fp32 and quantizes it per row over the tile's 128 columns (one
  scale group: ``BLOCK_N = 128``), writing e4m3 ``act`` and its scales for the down GEMM.

Schedule and safety as :mod:`.grouped_gemm` (whose schedule helpers this kernel shares): a
persistent grid walks (row tile, column tile) items located by a device-side scan of
``cu_seqlens``; stores are masked to the tile's segment and the tail rows of ``out`` get zeros
(``ZERO_TAIL``). Operands come by TMA (``USE_TMA``, sm90) or masked pointer loads (sm89, any
strides); a scale is 0 for a row outside the segment, so only rows that are never stored can
see another segment's (or the tail's) values.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...cache import layout_signature
from ...fp8 import is_block_major, weight_dims
from .. import launch as direct
from .grouped_gemm import (_register_schedule, _work_item, _zero_tail_item, locate_tile, num_row_tiles, num_sms,
                           persistent_programs, store_tile, SMALL_G_MAX, BLOCK_G)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block_m: int
    block_n: int  # divides 128 (one weight-scale row per tile); 128 for the fused GEMM (its act's scale group)
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1


@triton.jit
def quantize_rows_tile(x):
    """``x`` fp32 ``[BLOCK_M, 128]`` -> (e4m3 tile, fp32 row scales): per row ``s = amax / 448``
    and ``q = e4m3(x * r)`` with ``r = min(448 / amax, FLT_MAX)`` (0 for a row of zeros), IEEE
    divisions per row as in :func:`moonep_ops.fp8.quantize_rows`, one multiply per element."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    recip = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.where(amax > 0, amax, 1.0))
    recip = tl.where(amax > 0, tl.minimum(recip, 3.4028234663852886e38), 0.0)
    return (x * recip[:, None]).to(tl.float8e4nv), scale


@triton.jit
def _load_a_block(a_ptr, a_desc, as_ptr, row_lo, rows, row_mask, kb, K, stride_am, stride_ak, stride_asm,
                  USE_TMA: tl.constexpr):
    """K block ``kb`` of ``a``'s e4m3 rows and their scales (0 outside the segment). TMA reads the
    rows past the segment too: GEMM rows are independent and those rows are never stored."""
    scale = tl.load(as_ptr + rows.to(tl.int64) * stride_asm + kb, mask=row_mask, other=0.0)
    if USE_TMA:
        return a_desc.load([row_lo, kb * 128]), scale
    offs_k = kb * 128 + tl.arange(0, 128)
    ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    return tl.load(ptrs, mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0), scale


@triton.jit
def _load_w_block(w_ptr, w_desc, g, col0, cols, col_mask, kb, N, K, strides, USE_TMA: tl.constexpr,
                  BLOCK_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr):
    """K block ``kb`` of ``w[g]``'s rows ``cols`` (from ``col0``, within one 128-row block) as a
    ``[128, BLOCK_N]`` e4m3 tile. ``strides``: group, 128-row block, 128-deep K block, row and K
    element (a ``[G, N, K]`` weight's make its blocks 128 rows and 128 elements apart)."""
    stride_g, stride_nb, stride_kb, stride_n, stride_k = strides
    if USE_TMA:
        if BLOCK_MAJOR:  # ``[G*N*K/128, 128]``: each 128 x 128 block is 128 consecutive rows
            block = (g * (N // 128) + col0 // 128) * (K // 128) + kb
            return w_desc.load([block * 128 + col0 % 128, 0]).T
        return w_desc.load([g * N + col0, kb * 128]).T  # ``[G*N, K]`` rows; columns past N are never stored
    offs_k = tl.arange(0, 128)
    block = (w_ptr + g.to(tl.int64) * stride_g + (col0 // 128).to(tl.int64) * stride_nb
             + tl.cast(kb, tl.int64) * stride_kb)
    ptrs = block + (cols[None, :] % 128).to(tl.int64) * stride_n + offs_k[:, None].to(tl.int64) * stride_k
    return tl.load(ptrs, mask=(kb * 128 + offs_k < K)[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _mainloop(a_view, w_view, w_up_view, tile, NUM_ROWS, N, K, FUSED: tl.constexpr,
              USE_TMA: tl.constexpr, BLOCK_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The scaled accumulators of ``a @ w[g].T`` (and of ``a @ w_up[g].T``, FUSED) for ``tile``.
    Views: ``a``: (ptr, scales ptr, row stride, K stride, scales row stride); weights: (ptr,
    descriptor, scales ptr, strides as :func:`_load_w_block` takes them, scale group/row
    strides)."""
    a_ptr, a_desc, as_ptr, stride_am, stride_ak, stride_asm = a_view
    w_ptr, w_desc, ws_ptr, w_strides, stride_wsg, stride_wsn = w_view
    u_ptr, u_desc, us_ptr, u_strides, stride_usg, stride_usn = w_up_view
    g, row_lo, seg_end, pid_n = tile
    rows = row_lo + tl.arange(0, BLOCK_M)
    row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    n_block = (pid_n * BLOCK_N) // 128  # BLOCK_N divides 128: one weight-scale row per tile
    g64 = g.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        a, a_scale = _load_a_block(a_ptr, a_desc, as_ptr, row_lo, rows, row_mask, kb, K, stride_am, stride_ak,
                                   stride_asm, USE_TMA)
        w = _load_w_block(w_ptr, w_desc, g, pid_n * BLOCK_N, cols, col_mask, kb, N, K, w_strides, USE_TMA,
                          BLOCK_MAJOR, BLOCK_N)
        # (one multiply of the partial product: a scale per row times the tile's block scale)
        acc += tl.dot(a, w) * (a_scale * tl.load(ws_ptr + g64 * stride_wsg + n_block * stride_wsn + kb))[:, None]
        if FUSED:
            u = _load_w_block(u_ptr, u_desc, g, pid_n * BLOCK_N, cols, col_mask, kb, N, K, u_strides, USE_TMA,
                              BLOCK_MAJOR, BLOCK_N)
            u_scale = tl.load(us_ptr + g64 * stride_usg + n_block * stride_usn + kb)
            acc_up += tl.dot(a, u) * (a_scale * u_scale)[:, None]
    return acc, acc_up


@triton.jit
def _epilogue(acc, acc_up, tile, out_ptr, out_scale_ptr, rw_ptr, NUM_ROWS, N, stride_om, stride_on, stride_osm,
              FUSED: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """FUSED: ``act = silu(gate) * up * rw`` quantized to e4m3 with its row scales (column block
    ``pid_n``); else ``acc`` rounded to ``out``'s dtype. Stores are masked to the segment."""
    _, row_lo, seg_end, pid_n = tile
    rows = row_lo + tl.arange(0, BLOCK_M)
    row_mask = (rows < tl.minimum(seg_end, NUM_ROWS)) & (rows >= 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if FUSED:
        act = acc * tl.sigmoid(acc) * acc_up
        keep = col_mask[None, :]
        if HAS_WEIGHTS:
            # Rows of weight 0 are 0 whatever their products: their rows of ``a`` were not written.
            rw = tl.load(rw_ptr + rows, mask=row_mask, other=0.0)[:, None]
            act = act * rw
            keep = keep & (rw != 0.0)
        # Columns past N are no part of the scale group: TMA reads them from the next group's
        # weight rows (``[G*N, K]``), the pointer path as zeros.
        q, scale = quantize_rows_tile(tl.where(keep, act, 0.0))
        store_tile(out_ptr, q, rows, cols, row_mask, col_mask, stride_om, stride_on)
        tl.store(out_scale_ptr + rows.to(tl.int64) * stride_osm + pid_n, scale, mask=row_mask)
    else:
        store_tile(out_ptr, acc.to(out_ptr.dtype.element_ty), rows, cols, row_mask, col_mask, stride_om, stride_on)


@triton.jit
def grouped_gemm_fp8_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w_up_ptr, w_up_scale_ptr, rw_ptr, out_ptr, out_scale_ptr, cu_ptr,
    a_desc, w_desc, w_up_desc,
    G, NUM_ROWS, N, K,
    stride_am, stride_ak, stride_asm,
    stride_wg, stride_wnb, stride_wkb, stride_wn, stride_wk, stride_wsg, stride_wsn,
    stride_ug, stride_unb, stride_ukb, stride_un, stride_uk, stride_usg, stride_usn,
    stride_om, stride_on, stride_osm,
    FUSED: tl.constexpr, HAS_WEIGHTS: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SMALL_G: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
):
    if SMALL_G:
        sched, real_tiles = _register_schedule(cu_ptr, G, BLOCK_M, BLOCK_G)
    else:
        sched = None
        _, _, _, real_tiles = locate_tile(cu_ptr, G, -1, BLOCK_M, BLOCK_G)
    n_tiles = tl.cdiv(N, BLOCK_N)
    real_items = real_tiles * n_tiles
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    a_view = (a_ptr, a_desc, a_scale_ptr, stride_am, stride_ak, stride_asm)
    w_view = (w_ptr, w_desc, w_scale_ptr, (stride_wg, stride_wnb, stride_wkb, stride_wn, stride_wk), stride_wsg,
              stride_wsn)
    u_view = (w_up_ptr, w_up_desc, w_up_scale_ptr, (stride_ug, stride_unb, stride_ukb, stride_un, stride_uk),
              stride_usg, stride_usn)
    for item in tl.range(pid, real_items, num_progs):
        tile = _work_item(item, n_tiles, cu_ptr, G, sched, BLOCK_M, BLOCK_G, SMALL_G, False)
        acc, acc_up = _mainloop(a_view, w_view, u_view, tile, NUM_ROWS, N, K, FUSED, USE_TMA, BLOCK_MAJOR,
                                BLOCK_M, BLOCK_N)
        _epilogue(acc, acc_up, tile, out_ptr, out_scale_ptr, rw_ptr, NUM_ROWS, N, stride_om, stride_on,
                  stride_osm, FUSED, HAS_WEIGHTS, BLOCK_M, BLOCK_N)
    if ZERO_TAIL:  # rows [cu[-1], NvS) of out get zeros, items numbered after the real ones
        live_end = tl.minimum(tl.maximum(tl.load(cu_ptr + G - 1), 0), NUM_ROWS)
        tail_items = tl.cdiv(NUM_ROWS - live_end, BLOCK_M) * n_tiles
        first = (pid - real_items % num_progs + num_progs) % num_progs
        for j in range(first, tail_items, num_progs):
            _zero_tail_item((out_ptr, out_ptr, out_ptr), (stride_om, stride_on), cu_ptr, G, NUM_ROWS, N, j, n_tiles,
                            BLOCK_M, BLOCK_N, False)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, cu_ptr, rw_ptr, G, NUM_ROWS, K, stride_xm, stride_xk, stride_qm,
                         stride_sm, BLOCK_R: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, WIDTH: tl.constexpr,
                         BY_WEIGHT: tl.constexpr, STRIDED: tl.constexpr):
    """e4m3 rows of ``x`` and their scales, per 128 columns, for rows below ``cu_seqlens[-1]``
    only (the tail is neither read nor written). ``BY_WEIGHT``: rows whose route weight is 0
    (MoonEP's padding) are neither read nor written either: the fused GEMM's epilogue writes their
    ``act`` rows as zeros whatever their products. Program (row block, run of
    ``GROUPS_PER_PROGRAM`` column groups), loaded ``WIDTH`` groups at a time: in padded decode most
    row blocks hold only padding, and their programs return after one load of route weights.
    ``STRIDED``: the grid has fewer row blocks than the buffer, and program ``p`` takes row blocks
    ``p``, ``p`` plus the grid's row blocks, ... up to ``cu_seqlens[-1]``."""
    live_end = tl.minimum(tl.maximum(tl.load(cu_ptr + G - 1), 0), NUM_ROWS)
    if STRIDED:
        for block in range(tl.program_id(0), tl.cdiv(live_end, BLOCK_R), tl.num_programs(0)):
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            _quantize_row_block(x_ptr, q_ptr, s_ptr, rw_ptr, rows, live_end, K, stride_xm, stride_xk, stride_qm,
                                stride_sm, BLOCK_R, GROUPS_PER_PROGRAM, WIDTH, BY_WEIGHT)
    else:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        if tl.program_id(0) * BLOCK_R < live_end:
            _quantize_row_block(x_ptr, q_ptr, s_ptr, rw_ptr, rows, live_end, K, stride_xm, stride_xk, stride_qm,
                                stride_sm, BLOCK_R, GROUPS_PER_PROGRAM, WIDTH, BY_WEIGHT)


@triton.jit
def _quantize_row_block(x_ptr, q_ptr, s_ptr, rw_ptr, rows, live_end, K, stride_xm, stride_xk, stride_qm, stride_sm,
                        BLOCK_R: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, WIDTH: tl.constexpr,
                        BY_WEIGHT: tl.constexpr):
    """A row block's ``BLOCK_R`` ``rows`` below ``live_end`` (and of route weight other than 0),
    this program's run of column groups."""
    read = rows < live_end
    if BY_WEIGHT:
        read = read & (tl.load(rw_ptr + rows, mask=read, other=0.0) != 0.0)
    if tl.max(read.to(tl.int32), axis=0) != 0:
        rows64 = rows[:, None].to(tl.int64)
        num_groups = tl.cdiv(K, 128)
        kb0 = tl.program_id(1) * GROUPS_PER_PROGRAM
        for kb in range(kb0, tl.minimum(kb0 + GROUPS_PER_PROGRAM, num_groups), WIDTH):
            cols = kb * 128 + tl.arange(0, WIDTH * 128)
            mask = read[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0)
            # One 128-column group per row of the reshaped tile.
            q, scale = quantize_rows_tile(tl.reshape(x.to(tl.float32), (BLOCK_R * WIDTH, 128)))
            tl.store(q_ptr + rows64 * stride_qm + cols[None, :], tl.reshape(q, (BLOCK_R, WIDTH * 128)), mask=mask)
            groups = kb + tl.arange(0, WIDTH)
            tl.store(s_ptr + rows64 * stride_sm + groups[None, :], tl.reshape(scale, (BLOCK_R, WIDTH)),
                     mask=read[:, None] & (groups < num_groups)[None, :])


# The quantization's grid at most: 8192 row blocks (65536 rows) and 40960 programs (row blocks
# times column runs: 5851 row blocks at K = 7168, seven runs). Larger buffers hold mostly padding
# reserve past cu_seqlens[-1] in decode (a top-8 call of 512 rows over 1000 groups: 253568 rows; of
# 128 rows over 260 groups of kimi-k2's size: 65152), where a program per row block and run
# launched tens of thousands that found nothing to do. Every benchmark shape's grid fits (at most
# 39424 programs, padded kimi-k2 prefill): there a capped grid's programs stepping over the live
# row blocks took 1-2 µs longer (docs/fp8_measurements.md).
MAX_ROW_BLOCKS = 8192
MAX_PROGRAMS = 40960


def quantize_rows(x, cu_seqlens, q, scale, route_weights=None, groups_per_program=None, width=4,
                  max_row_blocks=None) -> None:
    """``q`` (e4m3, contiguous ``[NvS, K]``) and ``scale`` (fp32 ``[NvS, cdiv(K, 128)]``) from the
    live rows of ``x``. ``route_weights`` (the experts op's, contiguous): a row of weight 0 is
    left unread and unwritten (stale bytes: the fused epilogue zeroes its ``act`` row).
    ``groups_per_program``: the 128-column groups of a program (None: by the grid's size), rounded
    up to a multiple of ``width``, the groups of one load (a power of 2). ``max_row_blocks``: the
    grid's row blocks at most (a program then takes every so many; None: ``MAX_ROW_BLOCKS``, or
    fewer where the grid would pass ``MAX_PROGRAMS``)."""
    num_rows, k = x.shape
    if num_rows == 0 or k == 0:
        return
    # 8-row blocks: a padded decode segment's few real rows fill most of one. Four groups a load: a
    # program's loads are not one dependent round trip per group (docs/fp8_measurements.md).
    block_r, groups = 8, triton.cdiv(k, 128)
    row_blocks = triton.cdiv(num_rows, block_r)
    if groups_per_program is None:
        # Up to 8 groups a program where one per group would be over 16 programs per SM (padded
        # decode: tens of thousands, most with nothing to do, whose waves were most of the
        # kernel's time); fewer programs would leave SMs idle on short unpadded calls.
        sms = num_sms(x.device.index) if x.is_cuda else 1
        groups_per_program = max(1, min(8, row_blocks * groups // (16 * sms)))
    per_program = min(groups_per_program, groups)
    width = min(width, triton.next_power_of_2(per_program))
    per_program = triton.cdiv(per_program, width) * width
    runs = triton.cdiv(groups, per_program)
    if max_row_blocks is None:
        max_row_blocks = min(MAX_ROW_BLOCKS, MAX_PROGRAMS // runs)
    grid = (min(row_blocks, max_row_blocks), runs)
    quantize_rows_kernel[grid](x, q, scale, cu_seqlens, x if route_weights is None else route_weights,
                               cu_seqlens.shape[0], num_rows, k, x.stride(0), x.stride(1), q.stride(0),
                               scale.stride(0), BLOCK_R=block_r, GROUPS_PER_PROGRAM=per_program, WIDTH=width,
                               BY_WEIGHT=route_weights is not None, STRIDED=row_blocks > max_row_blocks, num_warps=4)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a launch needs that depends on static metadata only."""
    grid: tuple
    ints: tuple  # G, NvS, N, K and the strides, in kernel order
    constexprs: dict
    num_warps: int
    num_stages: int
    geos: tuple  # (shape, strides, block) of the TMA views of a, w, w_up, or None

    def args(self, a, a_scale, w, w_scale, w_up, w_up_scale, rw, out, out_scale, cu, descriptor=None):
        """The runtime arguments; ``descriptor`` None: each TMA descriptor's base tensor in its
        place (what :class:`..launch.DirectLaunch` takes)."""
        descs = [None if geo is None else t if descriptor is None else descriptor(t, *geo)
                 for t, geo in zip((a, w, w_up), self.geos)]
        return [a, a_scale, w, w_scale, w_up, w_up_scale, rw, out, out_scale, cu, *descs, *self.ints]


_FIRST_DESC = 10  # index of the first descriptor in Plan.args


def tma_weights(w: torch.Tensor) -> bool:
    """TMA reads ``w [G, N, K]`` as one ``[G*N, K]`` matrix: K contiguous, groups back to back,
    16-byte aligned rows (a row stride of 0, a broadcast weight, reads through pointers), no empty
    extent; a block-major weight as one ``[G*N*K/128, 128]`` matrix: contiguous."""
    if is_block_major(w):
        return w.numel() > 0 and w.is_contiguous() and w.data_ptr() % 16 == 0
    return (w.numel() > 0 and w.stride(2) == 1 and w.stride(0) == w.shape[1] * w.stride(1)
            and w.stride(1) > 0 and w.stride(1) % 16 == 0 and w.data_ptr() % 16 == 0)


def weight_strides(w: torch.Tensor) -> tuple:
    """The strides :func:`_load_w_block` takes: group, 128-row block, 128-deep K block, row, K
    element."""
    if is_block_major(w):
        return tuple(w.stride())
    return w.stride(0), 128 * w.stride(1), 128 * w.stride(2), w.stride(1), w.stride(2)


def weight_geometry(w: torch.Tensor, block_n: int) -> tuple:
    """(shape, strides, block) of the TMA view of ``w`` (see :func:`tma_weights`)."""
    g, n, k = weight_dims(w)
    if is_block_major(w):
        return [g * n * k // 128, 128], [128, 1], [block_n, 128]
    return [g * n, k], [w.stride(1), 1], [block_n, 128]


def make_plan(a, a_scale, w, w_scale, w_up, w_up_scale, route_weights, out, out_scale, cfg: Fp8Config,
              use_tma: bool, zero_tail: bool) -> Plan:
    num_rows, k = a.shape
    g, n, _ = weight_dims(w)
    fused = w_up is not None
    if 128 % cfg.block_n or (fused and cfg.block_n != 128):
        raise ValueError("Fp8Config: BLOCK_N divides 128 (the weight-scale block) and is 128 for the fused GEMM "
                         "(its activation's scale group)")
    u, us = (w, w_scale) if w_up is None else (w_up, w_up_scale)
    o_s = out if out_scale is None else out_scale
    items_bound = num_row_tiles(num_rows, g, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    small_g = g <= SMALL_G_MAX
    use_tma = use_tma and a.stride(1) == 1 and a.stride(0) % 16 == 0 and a.data_ptr() % 16 == 0
    w_geo = weight_geometry(w, cfg.block_n)
    return Plan(
        grid=(max(1, min(items_bound, persistent_programs(a.device, cfg.programs_per_sm))),),
        ints=(g, num_rows, n, k, a.stride(0), a.stride(1), a_scale.stride(0),
              *weight_strides(w), w_scale.stride(0), w_scale.stride(1),
              *weight_strides(u), us.stride(0), us.stride(1),
              out.stride(0), out.stride(1), o_s.stride(0)),
        constexprs=dict(FUSED=fused, HAS_WEIGHTS=route_weights is not None,
                        USE_TMA=use_tma, BLOCK_MAJOR=is_block_major(w), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        BLOCK_G=max(16, triton.next_power_of_2(g)) if small_g else BLOCK_G, SMALL_G=small_g,
                        ZERO_TAIL=zero_tail),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        geos=(([num_rows, k], [a.stride(0), 1], [cfg.block_m, 128]), w_geo, w_geo) if use_tma else (None,) * 3,
    )


_PLANS: dict = {}


def run(a, a_scale, w, w_scale, w_up, w_up_scale, route_weights, cu_seqlens, out, out_scale, choose, *,
        zero_tail: bool = True) -> None:
    """One GEMM launch on e4m3 rows ``a`` with their ``a_scale``. ``w_up`` given: the fused GEMM,
    writing e4m3 ``out`` and its scales ``out_scale`` (``[NvS, cdiv(N, 128)]`` fp32). ``choose(a,
    w, fused) -> (Fp8Config, use_tma)`` runs once per static signature."""
    if a.shape[0] == 0 or w.shape[1] == 0:
        return
    fused = w_up is not None
    u, us = (w_up, w_up_scale) if fused else (w, w_scale)
    operands = (a, a_scale, w, w_scale, u, us, a if route_weights is None else route_weights, out,
                out if out_scale is None else out_scale, cu_seqlens)
    # (the operands' first tensor is e4m3 for every call: out's dtype specializes the kernel too)
    key = (layout_signature(*operands), out.dtype, choose, zero_tail, fused, route_weights is None)
    entry = _PLANS.get(key)
    if entry is None:
        plan = make_plan(a, a_scale, w, w_scale, w_up, w_up_scale, route_weights, out, out_scale,
                         *choose(a, w, fused), zero_tail)
        args = plan.args(*operands, descriptor=TensorDescriptor)  # checked descriptors, first launch only
        kernel = grouped_gemm_fp8_kernel[plan.grid](*args, **plan.constexprs, num_warps=plan.num_warps,
                                                    num_stages=plan.num_stages)
        if direct.enabled() and hasattr(kernel, "run"):
            _PLANS[key] = (plan, direct.DirectLaunch(kernel, plan.grid, list(plan.constexprs.values()),
                                                     direct.descriptor_factories(_FIRST_DESC, plan.geos)))
        return
    plan, launch = entry
    launch(plan.args(*operands))

