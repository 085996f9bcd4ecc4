"""Hopper-only grouped GEMM in Gluon (Triton's explicit layer): warp-specialized, persistent.

``out[seg_g] = a[seg_g] @ w[g].T`` for the segments of ``cu_seqlens``, rows ``[cu[-1], NvS)`` of
``out`` set to zero, like the Triton kernel's unfused GEMM; with ``FUSED``, the SwiGLU GEMM
``act = silu(a @ w.T) * (a @ w_up.T) * route_weight``; with ``FP8``, e4m3 rows of ``a`` and
e4m3 weights with their block scales (:mod:`moonep_ops.fp8`; the fused GEMM writes ``act`` as
e4m3 with its row scales, :mod:`.consumer_fp8`). Gluon lets the kernel say what Triton's
compiler does not produce here: one producer warp issuing TMA loads into a ring of shared-memory
stages (:mod:`.producer`), consumer warpgroups issuing wgmma and storing through shared memory
(:mod:`.consumer`), the stages handed over by mbarriers, the schedule of :mod:`.schedule`, and
the launch-to-launch synchronization of :mod:`.sync`.

This module is the entry: totals and where the segment walks start, from a scan of
``cu_seqlens``; the shared-memory allocation, the mbarriers, and the fork into partitions: with
``SPLIT_RING`` two independent pipelines, each a ping-pong consumer with its own producer warp and
half of the stages. Nothing syncs the host.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .bundles import Descriptors, Features, Problem, Scales, SharedMemory, Tiling
from .consumer import consumer
from .producer import producer
from .sync import griddepcontrol_launch_dependents


@gluon.jit
def gluon_grouped_gemm_kernel(a_desc, w_desc, w_up_desc, out_desc, zero_desc, a_half_desc, out_ptr, row_weights_ptr,
                              cu_seqlens_ptr, handoff_ptr, G, NUM_ROWS, N, K, stride_om, ZERO_N, FLAG_TARGET,
                              a_scale_ptr, w_scale_ptr, w_up_scale_ptr, out_scale_ptr, stride_asm, stride_wsg,
                              stride_wsn, stride_usg, stride_usn, stride_osm,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              STAGES: gl.constexpr, BLOCK_G: gl.constexpr, GROUP_MAJOR: gl.constexpr,
                              ZERO_TAIL: gl.constexpr, FUSED: gl.constexpr, HAS_WEIGHTS: gl.constexpr,
                              PINGPONG: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              TAIL_BY_PRODUCER: gl.constexpr, LAUNCH_DEPENDENTS: gl.constexpr,
                              WAIT_PRIOR: gl.constexpr, SKIP_IDLE_HALF: gl.constexpr, SKIP_BY_WEIGHT: gl.constexpr,
                              SKIP_LONE_ONLY: gl.constexpr, SIGNAL_ROWS: gl.constexpr, HANDOFF: gl.constexpr,
                              MAX_POLLS: gl.constexpr, FP8: gl.constexpr,
                              SPLIT_RING: gl.constexpr, SKIP_IDLE_TILES: gl.constexpr, SPLIT_ROWS: gl.constexpr,
                              BLOCK_MAJOR: gl.constexpr, SKIP_EMPTY_RUNS: gl.constexpr, RUN_ON: gl.constexpr,
                              SKIP_ON_LONG_SEGMENTS: gl.constexpr,
                              num_warps: gl.constexpr):
    """Arguments: the TMA descriptors of :func:`.host.descriptors`; ``out`` again as a pointer
    (masked stores); a weight per row of ``a`` (route weights, or zeros marking idle rows);
    ``cu_seqlens``; the row-tile handoff's state (:class:`.host.Handoff`); the sizes; ``ZERO_N``:
    the width of the tensor whose tail the producer zeroes; ``FLAG_TARGET``: a row tile's flag
    once the primary stored all of it; the FP8 block scales and their strides (:class:`.bundles.Scales`).
    Then :class:`.config.GluonConfig` and the launch's role as constexprs (see
    :func:`.host.kernel_args`; ``RUN_ON``: the config's ``on_multi_tile``, 0 for None, 1 for True,
    2 for False; ``SKIP_ON_LONG_SEGMENTS``: the config's ``skip_on_long_segments``)."""
    if LAUNCH_DEPENDENTS:
        # Programmatic dependent launch: the next kernel (the down GEMM, or a launch pair's second)
        # may launch now; its programs take the SMs this grid's programs leave and wait for this
        # grid's memory.
        griddepcontrol_launch_dependents()
    col_tiles = gl.cdiv(N, BLOCK_N)
    # Every item of this program is item pid or later, so its walks may start at that item's segment
    # (not with the row-tile handoff, whose items come from a counter: there they start at the first)
    pid = gl.program_id(0)
    totals = _totals(cu_seqlens_ptr, G, NUM_ROWS, pid if GROUP_MAJOR else pid // col_tiles,
                     col_tiles if GROUP_MAJOR else 1, BLOCK_M, BLOCK_G, SKIP_IDLE_TILES, RUN_ON,
                     SKIP_IDLE_HALF and not SKIP_ON_LONG_SEGMENTS, not HANDOFF,
                     num_warps)
    real_tiles, live_segments, live_end, walk_group, walk_tiles, walk_end, long_segments = totals
    # (A constant 1 where the idle-half skip does not depend on the layout: long_segments is then 0.)
    skip_halves = 1 - long_segments
    spread = 0  # (a constant where the programs never swap items)
    if SKIP_IDLE_TILES:
        spread = _spread(real_tiles, live_segments)
    zero_col_tiles = gl.cdiv(ZERO_N, zero_desc.block_type.shape[1])
    real_items = real_tiles * col_tiles
    tail_items = gl.cdiv(NUM_ROWS - live_end, BLOCK_M) * col_tiles

    descs = Descriptors(a_desc, a_half_desc, w_desc, w_up_desc, zero_desc, out_desc)
    problem = Problem(out_ptr, row_weights_ptr, cu_seqlens_ptr, handoff_ptr, G, NUM_ROWS, N, K, stride_om,
                      FLAG_TARGET, real_items, live_end, tail_items, col_tiles, zero_col_tiles, spread, skip_halves,
                      walk_group, walk_tiles, walk_end)
    scales = Scales(a_scale_ptr, w_scale_ptr, w_up_scale_ptr, out_scale_ptr, stride_asm, stride_wsg, stride_wsn,
                    stride_usg, stride_usn, stride_osm)
    features = Features(FP8, FUSED, HAS_WEIGHTS, ZERO_TAIL and not TAIL_BY_PRODUCER, ZERO_TAIL and TAIL_BY_PRODUCER,
                        SKIP_IDLE_HALF, SKIP_BY_WEIGHT, SKIP_LONE_ONLY, SKIP_IDLE_TILES, WAIT_PRIOR, SIGNAL_ROWS,
                        HANDOFF, MAX_POLLS, BLOCK_MAJOR, SKIP_EMPTY_RUNS)
    # (With SPLIT_RING a partition's ring holds half the stages.)
    tiling = Tiling(BLOCK_M, BLOCK_N, BLOCK_K, STAGES // 2 if SPLIT_RING else STAGES, 2 if PINGPONG else 1,
                    GROUP_MAJOR, SPLIT_RING, SPLIT_ROWS)
    _fork(descs, problem, scales, tiling, features, PRODUCER_REGS, CONSUMER_REGS, num_warps)


@gluon.jit
def _totals(cu_seqlens_ptr, G, NUM_ROWS, key, scale, BLOCK_M: gl.constexpr, BLOCK_G: gl.constexpr,
            SKIP_IDLE_TILES: gl.constexpr, RUN_ON: gl.constexpr, CLASSIFY: gl.constexpr, FIND_START: gl.constexpr,
            num_warps: gl.constexpr):
    """From a vector scan of ``cu_seqlens`` (every partition gets the results as scalars): the
    real row tiles this launch takes, the live segments (counted where a config asks), the tail's
    first row, where the segment walks start (:func:`.schedule.walk`) and, with ``CLASSIFY``,
    whether the live segments are long (else 0). The walks start with ``FIND_START`` at the cursor
    one step before the segment of ``key`` (``key`` and ``scale`` as there), as group, tiles and
    end, else before the first segment. A walk from there steps over the empty segments ahead of
    its first item (decode on an expert-parallel rank: the other ranks' experts, then the prefetch
    slots) without a dependent load each."""
    scan_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    real_tiles = 0
    live_segments = 0
    tiles_64 = 0
    tiles_128 = 0
    walk_group = G  # (G: not found, the program has no item)
    walk_tiles = 0
    walk_end = 0
    for c in range(0, G, BLOCK_G):
        offs = c + gl.arange(0, BLOCK_G, layout=scan_layout)
        ends = gl.load(cu_seqlens_ptr + offs, mask=offs < G, other=0)
        starts = gl.load(cu_seqlens_ptr + offs - 1, mask=(offs > 0) & (offs < G), other=0)
        tiles = (gl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
        if FIND_START:
            through = real_tiles + gl.associative_scan(tiles, 0, _add)
            found = gl.min(gl.where((offs < G) & (key < through * scale), offs, G), 0)
            take = (walk_group == G) & (found < G)
            walk_tiles = gl.where(take, gl.sum(gl.where(offs == found, through - tiles, 0), 0), walk_tiles)
            walk_end = gl.where(take, gl.sum(gl.where(offs == found, starts, 0), 0), walk_end)
            walk_group = gl.where(take, found, walk_group)
        real_tiles += gl.sum(tiles, 0)
        if SKIP_IDLE_TILES or RUN_ON != 0 or CLASSIFY:
            live_segments += gl.sum((ends > starts).to(gl.int32), 0)
        if RUN_ON != 0:
            tiles_64 += gl.sum((gl.maximum(ends - starts, 0) + 63) // 64, 0)
        if RUN_ON != 0 or CLASSIFY:
            tiles_128 += gl.sum((gl.maximum(ends - starts, 0) + 127) // 128, 0)
    live_end = gl.minimum(gl.maximum(gl.load(cu_seqlens_ptr + G - 1), 0), NUM_ROWS)
    long_segments = 0
    if CLASSIFY:
        # Long segments: more than 1.25 row tiles of 128 per live segment on average (decode's
        # segments of a few rows, padded or not, hold one tile each, a hot expert's a few more).
        long_segments = (4 * tiles_128 > 5 * live_segments).to(gl.int32)
    if RUN_ON != 0:
        # One of a GEMM's two launches (the config's ``on_multi_tile``): it takes the whole GEMM,
        # tail included, where the layout is its kind, else no item and no tail row. RUN_ON 1: live
        # segments of more than one 128-row tile on average whose tiles hold rows in both 64-row
        # halves (at least 15 in 16 of the halves hold rows; MoonEP's 128-row padding: all);
        # RUN_ON 2: the others.
        multi_tile = ((tiles_128 > live_segments) & (8 * tiles_64 >= 15 * tiles_128)).to(gl.int32)
        mine = multi_tile if RUN_ON == 1 else 1 - multi_tile
        real_tiles = real_tiles * mine
        live_end = live_end + (NUM_ROWS - live_end) * (1 - mine)
    if FIND_START:
        walk_group = gl.where(walk_group == G, 0, walk_group) - 1
    else:
        walk_group = -1
    return real_tiles, live_segments, live_end, walk_group, walk_tiles, walk_end, long_segments


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _spread(real_tiles, live_segments):
    """1 where the programs swap items in pairs every other round (:func:`.schedule.program_item`)
    so that idle tiles are skipped evenly: live segments of two row tiles (1.75-2 on average:
    decode, 128-row padded segments of a few rows), on an even grid."""
    num_progs = gl.num_programs(0)
    two_tiles = (real_tiles <= 2 * live_segments) & (4 * real_tiles >= 7 * live_segments)
    return (two_tiles & (num_progs % 2 == 0) & (num_progs > 1)).to(gl.int32)


@gluon.jit
def _fork(descs, problem, scales, tiling, features, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
          num_warps: gl.constexpr):
    """The shared memory and its mbarriers, then the fork into the producer and consumer
    partitions: with ``SPLIT_RING`` two pipelines, consumer c and producer c on ring c."""
    RING: gl.constexpr = tiling.STAGES
    a_bufs, w_bufs, w_up_bufs = _ring_buffers(descs.a, descs.w, descs.w_up, RING, features.FUSED)
    if tiling.SPLIT_RING:  # the second consumer's ring
        a_bufs_1, w_bufs_1, w_up_bufs_1 = _ring_buffers(descs.a, descs.w, descs.w_up, RING, features.FUSED)
    # The epilogue buffers: a whole tile, or half its columns (a split epilogue), or half its rows
    # (SPLIT_ROWS)
    out_box: gl.constexpr = descs.out.block_type.shape
    out_bufs = gl.allocate_shared_memory(descs.out.dtype, [tiling.CONSUMERS, out_box[0], out_box[1]],
                                         descs.out.layout)
    if features.PRODUCER_TAIL:
        zero_buf = gl.allocate_shared_memory(descs.zero.dtype, descs.zero.block_type.shape, descs.zero.layout)
    else:
        zero_buf = out_bufs.index(0)  # unused
    if features.HANDOFF:  # each stage's item id (dynamic schedule), written by the producer
        item_ids = gl.allocate_shared_memory(gl.int32, [RING, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        item_ids = zero_buf  # unused
    ready, empty = _ring_barriers(RING, 2 if tiling.SPLIT_ROWS else 1)  # SPLIT_ROWS: both consumers release a stage
    if tiling.SPLIT_RING or tiling.SPLIT_ROWS:
        # No turns to take. (An unused barrier's memory may be reused for Triton's handshake with
        # the worker warps, and its init would then look like a race to racecheck.)
        turn = empty
    else:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    smem = SharedMemory(a_bufs, w_bufs, w_up_bufs, out_bufs, zero_buf, ready, empty, turn, item_ids)
    # (The consumers' tuples are written out: `args + (0, num_warps)` would pass plain ints, not constexprs.)
    if tiling.SPLIT_RING:
        ready_1, empty_1 = _ring_barriers(RING)
        smem_1 = SharedMemory(a_bufs_1, w_bufs_1, w_up_bufs_1, out_bufs, zero_buf, ready_1, empty_1, turn, item_ids)
        gl.warp_specialize([(consumer, (smem, descs, problem, scales, tiling, features, 0, num_warps)),
                            (consumer, (smem_1, descs, problem, scales, tiling, features, 1, num_warps)),
                            (producer, (descs, smem, problem, tiling, features, 0)),
                            (producer, (descs, smem_1, problem, tiling, features, 1))],
                           [num_warps, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif tiling.CONSUMERS == 2:  # two one-warpgroup consumers: alternate items, taking turns (or each item's halves)
        gl.warp_specialize([(consumer, (smem, descs, problem, scales, tiling, features, 0, num_warps)),
                            (consumer, (smem, descs, problem, scales, tiling, features, 1, num_warps)),
                            (producer, (descs, smem, problem, tiling, features, 0))],
                           [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:  # one two-warpgroup consumer
        gl.warp_specialize([(consumer, (smem, descs, problem, scales, tiling, features, 0, num_warps)),
                            (producer, (descs, smem, problem, tiling, features, 0))], [1], [PRODUCER_REGS])


@gluon.jit
def _ring_buffers(a_desc, w_desc, w_up_desc, RING: gl.constexpr, FUSED: gl.constexpr):
    """A ring's ``RING`` stages of ``a``, ``w`` and (``FUSED``) ``w_up`` tiles, each one TMA box
    (``w_up``'s box is ``w``'s)."""
    a_box: gl.constexpr = a_desc.block_type.shape
    w_box: gl.constexpr = w_desc.block_type.shape
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [RING, a_box[0], a_box[1]], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [RING, w_box[0], w_box[1]], w_desc.layout)
    if FUSED:
        w_up_bufs = gl.allocate_shared_memory(w_up_desc.dtype, [RING, w_box[0], w_box[1]], w_up_desc.layout)
    else:
        w_up_bufs = w_bufs  # unused
    return a_bufs, w_bufs, w_up_bufs


@gluon.jit
def _ring_barriers(RING: gl.constexpr, RELEASES: gl.constexpr = 1):
    """A ring's ``ready`` and ``empty`` mbarriers, one of each per stage, initialized; a stage is
    empty once ``RELEASES`` consumers released it."""
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=RELEASES)
    return ready, empty
