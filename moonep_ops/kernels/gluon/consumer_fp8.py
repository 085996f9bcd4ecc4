"""The Gluon kernel's FP8 item (``FP8``): e4m3 MMAs whose fp32 results are block-scaled per K step.

A ring stage holds one 128-deep K block of the e4m3 rows of ``a`` and of the weight tile(s): the
scale block (:mod:`moonep_ops.fp8`), so each step's partial product is scaled by the rows' scales
times the weight block's scale and added to an fp32 accumulator. The plain GEMM takes the K
blocks two at a time and keeps the second block's MMA in flight while it scales the first's product
(two partial products in registers), so that that scale step runs on the CUDA cores while the
tensor cores work. No MMA stays in flight from one loop iteration to the next: its registers would
then be copied while it runs, and ptxas would serialize every wgmma of the kernel (waiting for each
one as it is issued; ``scripts/aot_compile_check.py`` reports a kernel so compiled). The fused
GEMM holds two accumulators already, and a fourth ``[64, 128]`` fp32 tile per warpgroup would not
fit the registers: it runs each MMA (gate, then up) to completion before scaling its product. Both
leave their tensor cores idle while they scale; in the FP8 configs the two ping-pong consumers'
main loops run at once (each on its own ring, ``SPLIT_RING``, or each on its own 64 rows of every
item of one ring, ``SPLIT_ROWS``), so that the other consumer's MMAs run then. An idle half
(``SPLIT_ROWS``: the upper 64 rows of a segment's only row tile, all past the end or of route
weight 0) releases its stages unread and stores the zeros of an empty product.

The epilogue of the plain GEMM rounds to ``out``'s dtype; the fused GEMM's computes
``silu(gate) * up * route_weight`` and quantizes it per row over the tile's 128 columns (its one
scale group: ``BLOCK_N = 128``), columns past ``N`` counted as zeros, and writes e4m3 ``act`` and
its row scales. Stores go as in :mod:`.consumer` (TMA for whole tiles, masked rows otherwise).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .store import flush_tile

E4M3_MAX = gl.constexpr(448.0)
FLT_MAX = gl.constexpr(3.4028234663852886e38)


@gluon.jit
def quantization_scales(amax):
    """Per row of ``amax`` (fp32): ``s = amax / 448`` and ``m = min(448 / amax, FLT_MAX)`` (0 for
    a row of zeros), the two divisions IEEE-rounded as in :func:`moonep_ops.fp8.quantize_rows`;
    the row quantizes as ``e4m3(x * m)``."""
    scale = gl.div_rn(amax, gl.full(amax.shape, E4M3_MAX, gl.float32, amax.type.layout))
    recip = gl.div_rn(gl.full(amax.shape, E4M3_MAX, gl.float32, amax.type.layout), gl.where(amax > 0, amax, 1.0))
    return scale, gl.where(amax > 0, gl.minimum(recip, FLT_MAX), 0.0)


@gluon.jit
def _stage(smem, ring_pos, STAGES: gl.constexpr):
    """Wait for ring position ``ring_pos``'s loads; returns its stage index."""
    stage = ring_pos % STAGES
    mbarrier.wait(smem.ready.index(stage), (ring_pos // STAGES) & 1)
    return stage


@gluon.jit
def _release_stages(smem, ring_pos, k_steps, STAGES: gl.constexpr):
    """Releases an item's stages unread (each once loaded: a release may not run a lap ahead)."""
    for k_step in range(k_steps):
        stage = (ring_pos + k_step) % STAGES
        mbarrier.wait(smem.ready.index(stage), ((ring_pos + k_step) // STAGES) & 1)
        mbarrier.arrive(smem.empty.index(stage), count=1)


@gluon.jit
def _a_rows(smem, stage, ROW0: gl.constexpr, ROWS: gl.constexpr):
    """Rows ``[ROW0, ROW0 + ROWS)`` of stage ``stage``'s ``a`` tile."""
    a_stage = smem.a_bufs.index(stage)
    if ROWS != a_stage.shape[0]:
        a_stage = a_stage.slice(ROW0, ROWS)
    return a_stage


@gluon.jit
def _plain_mainloop(smem, a_scales, row_mask, w_scales, ring_pos, k_steps, acc, STAGES: gl.constexpr,
                    ROW0: gl.constexpr):
    """``acc += (a_k @ w_k.T) * a_scale_k * w_scale_k`` over the K blocks, two at a time: block
    k+1's MMA in flight while block k's product is scaled (none in flight across iterations)."""
    zeros = gl.zeros_like(acc)
    for k_step in range(0, k_steps - 1, 2):
        stage = _stage(smem, ring_pos + k_step, STAGES)
        first = warpgroup_mma(_a_rows(smem, stage, ROW0, acc.shape[0]), smem.w_bufs.index(stage).permute((1, 0)),
                              zeros, use_acc=False, is_async=True)
        stage_1 = _stage(smem, ring_pos + k_step + 1, STAGES)
        second = warpgroup_mma(_a_rows(smem, stage_1, ROW0, acc.shape[0]),
                               smem.w_bufs.index(stage_1).permute((1, 0)), zeros, use_acc=False, is_async=True)
        scale = gl.load(a_scales + k_step, mask=row_mask, other=0.0) * gl.load(w_scales + k_step)
        scale_1 = gl.load(a_scales + k_step + 1, mask=row_mask, other=0.0) * gl.load(w_scales + k_step + 1)
        first = warpgroup_mma_wait(1, deps=(first, ))
        mbarrier.arrive(smem.empty.index(stage), count=1)
        acc += first * scale[:, None]
        second = warpgroup_mma_wait(0, deps=(second, ))
        mbarrier.arrive(smem.empty.index(stage_1), count=1)
        acc += second * scale_1[:, None]
    if k_steps % 2:
        stage = _stage(smem, ring_pos + k_steps - 1, STAGES)
        last = warpgroup_mma(_a_rows(smem, stage, ROW0, acc.shape[0]), smem.w_bufs.index(stage).permute((1, 0)),
                             zeros, use_acc=False, is_async=True)
        scale = gl.load(a_scales + k_steps - 1, mask=row_mask, other=0.0) * gl.load(w_scales + k_steps - 1)
        last = warpgroup_mma_wait(0, deps=(last, ))
        mbarrier.arrive(smem.empty.index(stage), count=1)
        acc += last * scale[:, None]
    return acc


@gluon.jit
def _fused_mainloop(smem, a_scales, row_mask, w_scales, u_scales, ring_pos, k_steps, acc, acc_up,
                    STAGES: gl.constexpr, ROW0: gl.constexpr):
    """Gate and up accumulators over the K blocks: per block the gate MMA and its scaling, then
    the up MMA and its scaling (one partial product in registers)."""
    part = gl.zeros_like(acc)
    for k_step in range(k_steps):
        stage = _stage(smem, ring_pos + k_step, STAGES)
        a_stage = _a_rows(smem, stage, ROW0, acc.shape[0])
        part = warpgroup_mma(a_stage, smem.w_bufs.index(stage).permute((1, 0)), part, use_acc=False, is_async=True)
        a_scale = gl.load(a_scales + k_step, mask=row_mask, other=0.0)
        gate_scale = a_scale * gl.load(w_scales + k_step)
        up_scale = a_scale * gl.load(u_scales + k_step)
        part = warpgroup_mma_wait(0, deps=(part, ))
        acc += part * gate_scale[:, None]
        part = warpgroup_mma(a_stage, smem.w_up_bufs.index(stage).permute((1, 0)), part, use_acc=False,
                             is_async=True)
        part = warpgroup_mma_wait(0, deps=(part, ))
        mbarrier.arrive(smem.empty.index(stage), count=1)
        acc_up += part * up_scale[:, None]
    return acc, acc_up


@gluon.jit
def _fused_epilogue(acc, acc_up, out_buf, problem, scales, features, rows, row_mask, col0, acc_layout: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """``act = silu(gate) * up * route_weight`` quantized per row over the tile's 128 columns (one
    scale group): the e4m3 tile into ``out_buf``, its row scales to ``act``'s scales."""
    act = acc / (1.0 + gl.exp(-acc)) * acc_up
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    # Columns past N hold the next group's weight rows (TMA reads [G*N, K]): not in the group.
    keep = (cols < problem.N)[None, :]
    if features.HAS_WEIGHTS:
        # Rows of weight 0 are 0 whatever their products: their rows of the input were not written.
        row_weights = gl.load(problem.row_weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
        act = act * row_weights
        keep = keep & (row_weights != 0.0)
    act = gl.where(keep, act, 0.0)
    scale, recip = quantization_scales(gl.max(gl.abs(act), axis=1))
    gl.store(scales.out_ptr + rows.to(gl.int64) * scales.stride_om + col0 // 128, scale, mask=row_mask)
    tma.store_wait(0)  # the previous store has read out_buf
    out_buf.store((act * recip[:, None]).to(gl.float8e4nv))


@gluon.jit
def _tile_rows(problem, scales, row_lo, end, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """The tile's rows, which of them lie in the segment, and their scale rows (loaded masked)."""
    rows = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    row_mask = (rows >= 0) & (rows < gl.minimum(end, problem.NUM_ROWS))
    return rows, row_mask, scales.a_ptr + rows.to(gl.int64) * scales.stride_am


@gluon.jit
def tile_fp8(smem, out_buf, descs, problem, scales, tiling, features, group, row_lo, col0, end, ring_pos, k_steps,
             idle, ROW0: gl.constexpr, BLOCK_M: gl.constexpr, PARITY: gl.constexpr, WARPS: gl.constexpr):
    """One FP8 item: the scaled main loop over the ring from ``ring_pos``, the epilogue, the store,
    on the ``BLOCK_M`` rows from ``row_lo`` (rows ``ROW0`` on of each stage's ``a`` tile). ``idle``:
    every row is idle (past the end or of weight 0), so the stages are released unread and the
    epilogue stores the zeros of an empty product."""
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    STAGES: gl.constexpr = tiling.STAGES
    gl.static_assert(tiling.BLOCK_K == 128, "an FP8 ring stage is one 128-deep scale block")
    gl.static_assert(BLOCK_N <= 128, "an FP8 column tile lies in one weight-scale block")
    gl.static_assert(BLOCK_N == 128 or not features.FUSED, "a fused FP8 tile is one scale group of act")
    w_block = group.to(gl.int64) * scales.stride_wg + (col0 // 128) * scales.stride_wn
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    rows, row_mask, a_scales = _tile_rows(problem, scales, row_lo, end, acc_layout, BLOCK_M)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    if features.FUSED:
        u_block = group.to(gl.int64) * scales.stride_ug + (col0 // 128) * scales.stride_un
        acc_up = acc
        if idle:
            _release_stages(smem, ring_pos, k_steps, STAGES)
        else:
            acc, acc_up = _fused_mainloop(smem, a_scales, row_mask, scales.w_ptr + w_block,
                                          scales.w_up_ptr + u_block, ring_pos, k_steps, acc, acc, STAGES, ROW0)
        if tiling.CONSUMERS == 2 and not (tiling.SPLIT_RING or tiling.SPLIT_ROWS):
            mbarrier.arrive(smem.turn.index(1 - PARITY), count=1)
        _fused_epilogue(acc, acc_up, out_buf, problem, scales, features, rows, row_mask, col0, acc_layout, BLOCK_N)
    else:
        if idle:
            _release_stages(smem, ring_pos, k_steps, STAGES)
        else:
            acc = _plain_mainloop(smem, a_scales, row_mask, scales.w_ptr + w_block, ring_pos, k_steps, acc, STAGES,
                                  ROW0)
        if tiling.CONSUMERS == 2 and not (tiling.SPLIT_RING or tiling.SPLIT_ROWS):
            mbarrier.arrive(smem.turn.index(1 - PARITY), count=1)
        tma.store_wait(0)  # the previous store has read out_buf
        out_buf.store(acc.to(descs.out.dtype))
    flush_tile(out_buf, descs.out, problem, row_lo, col0, end, BLOCK_M, BLOCK_N, WARPS)
