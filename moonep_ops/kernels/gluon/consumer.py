"""The Gluon kernel's consumer partitions: the wgmma main loop over the ring, and the epilogue.

Two schemes (``CONSUMERS``): two warpgroups on alternate items, each owning a whole 128-row tile,
so that one's epilogue runs under the other's main loop (ping-pong); or both warpgroups on each
tile, 64 rows each (cooperative). In ping-pong the main loops also take turns explicitly
(``turn``): a consumer waits for the other one's main loop to end before waiting on its own first
stage; without that, a consumer could wait on a stage a whole lap of the ring ahead, which a
parity wait cannot tell from the current lap. With ``SPLIT_RING`` each consumer has its own ring
and producer (:mod:`.kernel`), so the two main loops run at once and need no turns. With
``SPLIT_ROWS`` (the FP8 GEMMs) both consumers take every item of one ring, each its own 64 rows of
the 128-row tile, and each releases a stage on its own (``empty`` counts two arrivals): no turns
either.

The main loop keeps at most one step's MMAs in flight: once a step's MMAs are issued it waits for
the previous step's and releases their stage (``empty``) to the producer. The fused SwiGLU GEMM
(``FUSED``) feeds each ``a`` stage to two accumulators (gate, up) and applies
``silu(gate) * up * route_weight`` to them in fp32 before the one store of ``act``.

The epilogue goes through shared memory: a tile wholly inside its segment leaves by an
asynchronous TMA store, waited for only before the buffer is reused; a tile cut by a segment end
is read back in a coalesced layout and stored with a row mask (faster than stores straight from
the wgmma register layout). A split epilogue (``out_desc``'s block half the tile's columns) sends
the tile in two column halves through a half-size buffer, which leaves shared memory for another
stage of the ring. An idle upper half (:mod:`.schedule`) runs the MMAs on the lower 64 rows, the
warpgroups splitting the columns instead, and stores zeros above. An idle tile (``SKIP_IDLE_TILES``,
the FP8 GEMMs) takes no ring stages: it runs the epilogue of an empty product (zeros), and each
consumer counts the items loaded into its ring to find its next item's first stage.

The row-tile handoff's writer side (``SIGNAL_ROWS``): a consumer signals the row tile of its
previous item before its next item's stores, so that no store is waited for early. With
``HANDOFF`` the item ids arrive with each item's first stage; -1 ends the consumer's items.
``CONSUMER_TAIL``: the consumers zero the tail rows after their real items.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .consumer_fp8 import tile_fp8
from .schedule import find_item, idle_half, idle_tile, program_item, programs, ring_item, row_tile
from .store import flush_tile, store_rows
from .sync import signal_row_tile


@gluon.jit
def _tile(smem, out_buf, descs, problem, tiling, features, pending, row_lo, col0, end, ring_pos, k_steps,
          ROWS: gl.constexpr, PARITY: gl.constexpr, WARPS: gl.constexpr):
    """One item: the main loop over the ring from position ``ring_pos``, the fused epilogue, the
    store. ``ROWS == BLOCK_M / 2``: the upper half is idle, so the MMAs read only the lower half of
    each ``a`` stage (the warpgroups split the columns instead of the rows) and the upper half is
    stored as zeros. ``SIGNAL_ROWS``: before its own stores, the item signals the row tile
    ``pending`` of this consumer's previous item (-1: none), whose stores have had a whole main
    loop to complete."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    if ROWS == BLOCK_M:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPS // 4],
                                                             instr_shape=[16, BLOCK_N // (WARPS // 4), 16])
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)  # gate (FUSED) or the plain product
    acc_up = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
    acc, acc_up = _mainloop(smem, tiling, features, ring_pos, k_steps, acc, acc_up, ROWS, PARITY)
    if features.FUSED:  # silu(gate) * up * route weight on the fp32 accumulators
        acc = acc / (1.0 + gl.exp(-acc)) * acc_up
        if features.HAS_WEIGHTS:
            rows = row_lo + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
            row_mask = (rows >= 0) & (rows < gl.minimum(end, problem.NUM_ROWS))
            acc = acc * gl.load(problem.row_weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    if features.SIGNAL_ROWS:
        if pending >= 0:
            signal_row_tile(problem.handoff_ptr + 1 + pending)
    _store_tile(acc, out_buf, descs.out, problem, row_lo, col0, end, acc_layout, ROWS, BLOCK_M, BLOCK_N, WARPS)


@gluon.jit
def _mainloop(smem, tiling, features, ring_pos, k_steps, acc, acc_up, ROWS: gl.constexpr, PARITY: gl.constexpr):
    """The wgmma main loop over ``k_steps`` stages from ring position ``ring_pos`` into ``acc``
    (and ``acc_up``, FUSED), each stage released once its MMAs are done; in ping-pong on one ring,
    the other consumer's turn once every stage of the item has landed."""
    STAGES: gl.constexpr = tiling.STAGES
    FUSED: gl.constexpr = features.FUSED
    for k_step in range(k_steps):
        stage = ring_pos % STAGES
        mbarrier.wait(smem.ready.index(stage), (ring_pos // STAGES) & 1)
        if ROWS == tiling.BLOCK_M:
            a_stage = smem.a_bufs.index(stage)
        else:
            a_stage = smem.a_bufs.index(stage).slice(0, ROWS)
        # At most this step's MMAs in flight: the previous step's are done, so its stage can be refilled.
        acc = warpgroup_mma(a_stage, smem.w_bufs.index(stage).permute((1, 0)), acc, is_async=True)
        if FUSED:
            acc_up = warpgroup_mma(a_stage, smem.w_up_bufs.index(stage).permute((1, 0)), acc_up, is_async=True)
            acc, acc_up = warpgroup_mma_wait(2, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma_wait(1, deps=(acc, ))
        mbarrier.arrive(smem.empty.index((ring_pos + STAGES - 1) % STAGES), count=1, pred=k_step > 0)
        ring_pos += 1
    if tiling.CONSUMERS == 2 and not tiling.SPLIT_RING:
        mbarrier.arrive(smem.turn.index(1 - PARITY), count=1)  # every stage of this item has landed
    if FUSED:
        acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(smem.empty.index((ring_pos + STAGES - 1) % STAGES), count=1)
    return acc, acc_up


@gluon.jit
def _store_tile(acc, out_buf, out_desc, problem, row_lo, col0, end, acc_layout: gl.constexpr, ROWS: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
    """``acc`` (``ROWS`` rows; zeros below ``BLOCK_M``) to ``out`` in its dtype: through ``out_buf``
    whole or in two column halves (a split epilogue), or for an idle-upper-half tile with a split
    epilogue straight from registers."""
    EPI_N: gl.constexpr = out_desc.block_type.shape[1]
    if EPI_N == BLOCK_N:
        tma.store_wait(0)  # the previous store has read out_buf
        if ROWS == BLOCK_M:
            out_buf.store(acc.to(out_desc.dtype))
        else:
            out_buf.slice(0, ROWS).store(acc.to(out_desc.dtype))
            out_buf.slice(ROWS, BLOCK_M - ROWS).store(gl.zeros([BLOCK_M - ROWS, BLOCK_N], out_desc.dtype, acc_layout))
        flush_tile(out_buf, out_desc, problem, row_lo, col0, end, BLOCK_M, BLOCK_N, WARPS)
    elif ROWS == BLOCK_M:
        # Split epilogue: the halves leave one after the other. In the wgmma layout the top column
        # bit is a register bit, so the split moves no data (asserted). Each half is rounded to the
        # output dtype just before its store: rounding the whole tile first makes Triton 3.8's
        # build serialize every wgmma of the kernel (ptxas C7514; scripts/aot_compile_check.py).
        gl.static_assert(2 * EPI_N == BLOCK_N, "the split epilogue stores two halves")
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, EPI_N, 16])
        lo, hi = gl.split(gl.permute(gl.reshape(acc, [ROWS, 2, EPI_N]), [0, 2, 1]))
        tma.store_wait(0)
        out_buf.store(gl.convert_layout(lo.to(out_desc.dtype), half_layout, assert_trivial=True))
        flush_tile(out_buf, out_desc, problem, row_lo, col0, end, BLOCK_M, EPI_N, WARPS)
        tma.store_wait(0)
        out_buf.store(gl.convert_layout(hi.to(out_desc.dtype), half_layout, assert_trivial=True))
        flush_tile(out_buf, out_desc, problem, row_lo, col0 + EPI_N, end, BLOCK_M, EPI_N, WARPS)
    else:
        # An idle-upper-half tile with a split epilogue: its warpgroups hold different columns, so
        # it is stored straight from registers (rare tiles), zeros above, masked at the segment end.
        live_end = gl.minimum(end, problem.NUM_ROWS)
        store_rows(problem.out_ptr, acc.to(out_desc.dtype),
                   row_lo + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout)),
                   col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)), live_end, problem.N,
                   problem.stride_om)
        zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [WARPS, 1], [1, 0])
        store_rows(problem.out_ptr, gl.zeros([BLOCK_M - ROWS, BLOCK_N], out_desc.dtype, zero_layout),
                   row_lo + ROWS + gl.arange(0, BLOCK_M - ROWS, layout=gl.SliceLayout(1, zero_layout)),
                   col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, zero_layout)), live_end, problem.N,
                   problem.stride_om)


@gluon.jit
def _compute_tile(smem, out_buf, descs, problem, scales, tiling, features, pending, group, row_lo, col0, end, ring_pos,
                  k_steps, idle_upper, PARITY: gl.constexpr, WARPS: gl.constexpr):
    """An item's tile from the ring: FP8, on the lower half (``idle_upper``) or whole."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    if features.FP8 and tiling.SPLIT_ROWS:
        # This consumer's half of the rows; the upper consumer skips an idle upper half (its
        # producer loaded the lower half alone).
        HALF: gl.constexpr = BLOCK_M // 2
        tile_fp8(smem, out_buf, descs, problem, scales, tiling, features, group, row_lo + PARITY * HALF, col0, end,
                 ring_pos, k_steps, idle_upper & (PARITY == 1), PARITY * HALF, HALF, PARITY, WARPS)
    elif features.FP8:
        tile_fp8(smem, out_buf, descs, problem, scales, tiling, features, group, row_lo, col0, end, ring_pos, k_steps,
                 False, 0, BLOCK_M, PARITY, WARPS)
    elif features.SKIP_IDLE_HALF:
        if idle_upper:
            _tile(smem, out_buf, descs, problem, tiling, features, pending, row_lo, col0, end, ring_pos, k_steps,
                  BLOCK_M // 2, PARITY, WARPS)
        else:
            _tile(smem, out_buf, descs, problem, tiling, features, pending, row_lo, col0, end, ring_pos, k_steps,
                  BLOCK_M, PARITY, WARPS)
    else:
        _tile(smem, out_buf, descs, problem, tiling, features, pending, row_lo, col0, end, ring_pos, k_steps, BLOCK_M,
              PARITY, WARPS)


@gluon.jit
def _run_item(smem, out_buf, descs, problem, scales, tiling, features, pending, segment, item, i, slot, k_steps,
              TURN_AFTER_CHECK: gl.constexpr, PARITY: gl.constexpr, WARPS: gl.constexpr):
    """The consumer's local item ``i`` (global id ``item``; ``slot``: the items loaded into its
    ring before it): move the segment cursor ``segment`` (see :func:`.schedule.walk`) to its
    segment, check for an idle upper half or an idle tile, run it on the matching rows. Returns the
    cursor, the item's row tile and whether it used the ring (1) or was skipped (0)."""
    GROUP_MAJOR: gl.constexpr = tiling.GROUP_MAJOR
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    SKIP_HALF: gl.constexpr = features.SKIP_IDLE_HALF
    group, tiles_before, tiles_through, start, end, row_lo, col_tile = find_item(problem, tiling, features, item,
                                                                                 *segment, WARPS)
    # With TURN_AFTER_CHECK the idle check (a load of 64 weights) is made before waiting for this
    # consumer's turn (with a dynamic schedule the turn comes first: the item id is in the ring).
    idle_upper = idle_half(SKIP_HALF, features, problem, row_lo, start, end, BLOCK_M, WARPS)
    if SKIP_HALF and not tiling.SPLIT_RING:
        if TURN_AFTER_CHECK:
            mbarrier.wait(smem.turn.index(PARITY), ((i // 2) & 1) ^ (1 - PARITY))
    ring_pos = slot * k_steps  # the ring position of this item's first stage (the producer's count)
    col0 = col_tile * tiling.BLOCK_N
    used = gl.to_tensor(1)
    steps = k_steps
    if features.SKIP_IDLE_TILES:
        # An idle tile takes no stage (its producer loaded none) and runs the item's code on no K
        # steps: the epilogue stores the zeros of an empty product. One code path: a separate
        # zero store enlarges the kernel, and where a program has one or two items its code runs
        # cold, the instruction-cache misses costing more than an empty epilogue.
        idle = idle_tile(features, problem, row_lo, end, BLOCK_M, WARPS)
        used = 1 - idle.to(gl.int32)
        steps = k_steps * used
    _compute_tile(smem, out_buf, descs, problem, scales, tiling, features, pending, group, row_lo, col0, end, ring_pos,
                  steps, idle_upper, PARITY, WARPS)
    return (group, tiles_before, tiles_through, start, end), row_tile(item, problem.col_tiles, tiles_before,
                                                                      tiles_through, GROUP_MAJOR), used


@gluon.jit
def _handoff_items(smem, out_buf, descs, problem, scales, tiling, features, k_steps, PARITY: gl.constexpr,
                   WARPS: gl.constexpr):
    """``HANDOFF``: the items whose ids come with their first stage, this consumer's every
    ``CONSUMERS``-th ring position, until the end marker (-1), whose stages it releases like an
    item's. Its walks start at the first segment, the cursor written here as in the producer
    (:func:`.producer._load_handoff_items`). Returns the row tile not yet signalled."""
    STAGES: gl.constexpr = tiling.STAGES
    CONSUMERS: gl.constexpr = tiling.CONSUMERS
    segment = (-1, 0, 0, 0, 0)
    pending = -1
    item_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    i = PARITY
    item = 0
    while item >= 0:
        if CONSUMERS == 2:
            mbarrier.wait(smem.turn.index(PARITY), ((i // 2) & 1) ^ (1 - PARITY))
        ring_pos = i * k_steps
        mbarrier.wait(smem.ready.index(ring_pos % STAGES), (ring_pos // STAGES) & 1)
        item = gl.max(smem.item_ids.index(ring_pos % STAGES).load(item_layout), 0)
        if item >= 0:
            segment, pending, _ = _run_item(smem, out_buf, descs, problem, scales, tiling, features, pending,
                                            segment, item, i, i, k_steps, False, PARITY, WARPS)
            i += CONSUMERS
        else:
            for k_step in range(k_steps):  # the end marker's stages, released like an item's
                mbarrier.wait(smem.ready.index((ring_pos + k_step) % STAGES),
                              ((ring_pos + k_step) // STAGES) & 1)
                mbarrier.arrive(smem.empty.index((ring_pos + k_step) % STAGES), count=1)
            if CONSUMERS == 2:
                mbarrier.arrive(smem.turn.index(1 - PARITY), count=1)
    return pending


@gluon.jit
def _zero_tail_items(descs, problem, tiling, PARITY: gl.constexpr, WARPS: gl.constexpr):
    """``CONSUMER_TAIL``: this consumer's tail items (rows ``[cu[-1], NvS)`` get zeros), numbered
    after the real ones on the same stride; masked stores, waited for by the caller."""
    pid, num_progs = programs()
    CONSUMERS: gl.constexpr = tiling.CONSUMERS
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [WARPS, 1], [1, 0])
    zeros = gl.zeros([BLOCK_M, BLOCK_N], descs.out.dtype, zero_layout)
    first = (pid - problem.real_items % num_progs + num_progs) % num_progs
    for j in range(first + PARITY * num_progs, problem.tail_items, CONSUMERS * num_progs):
        rows = problem.live_end + (j // problem.col_tiles) * BLOCK_M + gl.arange(
            0, BLOCK_M, layout=gl.SliceLayout(1, zero_layout))
        cols = (j % problem.col_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, zero_layout))
        store_rows(problem.out_ptr, zeros, rows, cols, problem.NUM_ROWS, problem.N,
                   problem.stride_om)  # rows >= live_end >= 0


@gluon.jit
def consumer(smem, descs, problem, scales, tiling, features, PARITY: gl.constexpr, WARPS: gl.constexpr):
    """Consumer ``PARITY`` of ``CONSUMERS`` (``WARPS`` warps: one warpgroup in ping-pong, two in the
    cooperative scheme): the program's local items ``i = PARITY (mod CONSUMERS)`` (``SPLIT_ROWS``:
    every item, on its half of the rows; ``SPLIT_RING``: its ring's, :func:`.schedule.ring_item`),
    the last row-tile signal, its share of the tail's zeros."""
    CONSUMERS: gl.constexpr = tiling.CONSUMERS
    out_buf = smem.out_bufs.index(PARITY)
    pid, num_progs = programs()
    k_steps = gl.cdiv(problem.K, tiling.BLOCK_K)
    # the segment cursor (schedule.walk) of the static schedules
    segment = (problem.walk_group, problem.walk_tiles, problem.walk_tiles, 0, problem.walk_end)
    pending = -1  # SIGNAL_ROWS: the row tile of this consumer's last stored item, not yet signalled
    if features.HANDOFF:
        pending = _handoff_items(smem, out_buf, descs, problem, scales, tiling, features, k_steps, PARITY, WARPS)
    elif tiling.SPLIT_ROWS:  # every item of the program, on this consumer's half of the rows
        n_local = gl.cdiv(gl.maximum(problem.real_items - pid, 0), num_progs)
        for i in range(0, n_local):
            segment, pending, _ = _run_item(smem, out_buf, descs, problem, scales, tiling, features, pending,
                                            segment, pid + i * num_progs, i, i, k_steps, False, PARITY, WARPS)
    elif tiling.SPLIT_RING:  # this ring's items (schedule.ring_item); idle tiles skip the ring
        slot = 0
        j = 0
        i = ring_item(0, problem.spread, PARITY)
        item = program_item(pid, i, num_progs, problem.spread)
        while item < problem.real_items:  # (ids rise with i: program_item)
            segment, pending, used = _run_item(smem, out_buf, descs, problem, scales, tiling, features, pending,
                                               segment, item, i, slot, k_steps, False, PARITY, WARPS)
            slot += used
            j += 1
            i = ring_item(j, problem.spread, PARITY)
            item = program_item(pid, i, num_progs, problem.spread)
    else:
        n_local = gl.cdiv(gl.maximum(problem.real_items - pid, 0), num_progs)
        for i in range(PARITY, n_local, CONSUMERS):
            if CONSUMERS == 2 and not features.SKIP_IDLE_HALF:
                # Fresh mbarriers count as having completed a phase of parity 1: consumer 0 starts.
                mbarrier.wait(smem.turn.index(PARITY), ((i // 2) & 1) ^ (1 - PARITY))
            segment, pending, _ = _run_item(smem, out_buf, descs, problem, scales, tiling, features, pending,
                                            segment, pid + i * num_progs, i, i, k_steps, CONSUMERS == 2, PARITY,
                                            WARPS)
    if features.SIGNAL_ROWS:
        if pending >= 0:
            signal_row_tile(problem.handoff_ptr + 1 + pending)

    if features.CONSUMER_TAIL:
        _zero_tail_items(descs, problem, tiling, PARITY, WARPS)
    tma.store_wait(0)
