"""The Gluon kernel's producer partition: one warp that issues TMA loads into the ring.

It runs ahead of the consumers across tile boundaries, item after item, stage after stage: it
waits for a stage's ``empty`` barrier (the MMAs that read it finished), sets its ``ready`` barrier
to expect the stage's bytes and issues the loads of ``a``, ``w`` (and ``w_up``) into it. With
``SPLIT_RING`` there are two producers, each loading its consumer's items into its own ring.

Besides the loads:

- The tail's zeros (``PRODUCER_TAIL``): rows ``[cu[-1], NvS)`` of ``zero_desc``'s tensor (this
  kernel's ``out``, or for the experts op's fused GEMM its down GEMM's output) are zeroed by TMA
  stores of a zeroed ``ZERO_ROWS``-row buffer, spread evenly over the program's loads, so that
  they overlap the GEMM instead of forming a write-only phase at the end.
- Programmatic dependent launch (``WAIT_PRIOR``): the first item's weight loads are issued
  before ``griddepcontrol.wait``, its ``a`` loads (the prior kernel's output) after.
- The row-tile handoff (``HANDOFF``, the experts op's down GEMM): items come from a global counter
  instead of the static stride, so that programs which start early (on SMs the fused GEMM's last
  programs left) take more of them; before loading an item's ``a`` the producer waits for its row
  tile's flag instead of for the whole fused grid. An item's id goes to the consumers with its
  first stage; after the last item, each consumer gets an item's worth of empty stages marked -1.
  The grid-wide wait still runs at the end, so that this grid finishes only after the fused one
  (a later kernel ordered after this one needs that).
- Half loads (``SKIP_IDLE_HALF``): the producer makes the consumers' idle-upper-half check itself and
  loads only the lower half of ``a`` for such a tile: its MMAs never read the upper half, so the
  idle rows cost no bytes either.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .schedule import find_item, idle_half, idle_tile, program_item, programs, ring_item, row_tile
from .sync import griddepcontrol_wait, next_item, wait_row_tile, warp_sync


@gluon.jit
def _zero_chunk(zero_desc, zero_buf, chunk, tail_lo, col_chunks):
    """Zero chunk ``chunk`` of the tail: ``ZERO_ROWS`` rows from ``tail_lo``, one column chunk (TMA
    clips it at NvS and at the tensor's width)."""
    ZERO_ROWS: gl.constexpr = zero_desc.block_type.shape[0]
    CHUNK_N: gl.constexpr = zero_desc.block_type.shape[1]
    tma.async_copy_shared_to_global(zero_desc, [tail_lo + (chunk // col_chunks) * ZERO_ROWS,
                                                (chunk % col_chunks) * CHUNK_N], zero_buf)


@gluon.jit
def _load_weights(descs, smem, problem, features, stage, w_row, k0):
    """Stage ``stage``'s weight tiles: ``w`` (and ``w_up``), rows ``[w_row, w_row + BLOCK_N)`` of
    the ``[G*N, K]`` matrix from column ``k0``. Block-major weights (``[G*N*K/128, 128]``, 128 x 128
    tiles: ``w_row`` and ``k0`` multiples of 128) hold that tile in 128 consecutive rows."""
    FUSED: gl.constexpr = features.FUSED
    if features.BLOCK_MAJOR:
        BLOCK: gl.constexpr = descs.w.block_type.shape[1]
        w_row = ((w_row // BLOCK) * (problem.K // BLOCK) + k0 // BLOCK) * BLOCK
        k0 = 0
    tma.async_copy_global_to_shared(descs.w, [w_row, k0], smem.ready.index(stage), smem.w_bufs.index(stage))
    if FUSED:
        tma.async_copy_global_to_shared(descs.w_up, [w_row, k0], smem.ready.index(stage), smem.w_up_bufs.index(stage))


@gluon.jit
def _expect_stage(bar, descs, half, FUSED: gl.constexpr, SKIP_IDLE_HALF: gl.constexpr):
    """``bar`` expects a stage's loads: ``a``'s box (with ``SKIP_IDLE_HALF``, its lower half alone where
    ``half``), the weights' (the byte count must be a constant: one expect per case)."""
    w_bytes: gl.constexpr = descs.w.block_type.nbytes * (2 if FUSED else 1)
    full: gl.constexpr = descs.a.block_type.nbytes + w_bytes
    if SKIP_IDLE_HALF:
        lower: gl.constexpr = descs.a_half.block_type.nbytes + w_bytes
        if half:
            mbarrier.expect(bar, lower)
        else:
            mbarrier.expect(bar, full)
    else:
        mbarrier.expect(bar, full)


@gluon.jit
def _publish_item(item_ids, stage, item):
    """Stage ``stage`` starts item ``item`` (-1: no more items): written by every lane of the
    producer warp before the stage's mbarrier arrive, which publishes it to the consumers."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    item_ids.index(stage).store(gl.full([32], item, gl.int32, layout))
    warp_sync()


@gluon.jit
def _load_item(descs, smem, problem, tiling, features, item, row_lo, w_row, half, ring_pos, prefetched, k_steps,
               zero_done, zero_mine, stages_mine):
    """One item's loads into the ring from position ``ring_pos`` (the first ``prefetched``
    positions already hold their weight loads), with this program's share of tail chunks spread
    over them. With ``HANDOFF`` the item's id goes with its first stage. ``half`` (``SKIP_IDLE_HALF``):
    the tile's upper half is idle, so only the lower half of its ``a`` rows is loaded (the
    ``a_half`` box), the rows its MMAs read. Returns the ring position and the chunks done."""
    pid, num_progs = programs()
    STAGES: gl.constexpr = tiling.STAGES
    for k_step in range(k_steps):
        stage = ring_pos % STAGES
        if ring_pos >= prefetched:
            # mbarriers start with phase 1 complete: the first lap waits on parity 1 and passes.
            mbarrier.wait(smem.empty.index(stage), ((ring_pos // STAGES) & 1) ^ 1)
            if features.HANDOFF:
                if k_step == 0:
                    _publish_item(smem.item_ids, stage, item)
            _expect_stage(smem.ready.index(stage), descs, half, features.FUSED, features.SKIP_IDLE_HALF)
            _load_weights(descs, smem, problem, features, stage, w_row, k_step * tiling.BLOCK_K)
        if features.SKIP_IDLE_HALF:
            if half:
                HALF_M: gl.constexpr = descs.a_half.block_type.shape[0]
                tma.async_copy_global_to_shared(descs.a_half, [row_lo, k_step * tiling.BLOCK_K],
                                                smem.ready.index(stage), smem.a_bufs.index(stage).slice(0, HALF_M))
            else:
                tma.async_copy_global_to_shared(descs.a, [row_lo, k_step * tiling.BLOCK_K], smem.ready.index(stage),
                                                smem.a_bufs.index(stage))
        else:
            tma.async_copy_global_to_shared(descs.a, [row_lo, k_step * tiling.BLOCK_K], smem.ready.index(stage),
                                            smem.a_bufs.index(stage))
        ring_pos += 1
        if features.PRODUCER_TAIL:
            zero_target = gl.minimum(
                ((ring_pos * zero_mine.to(gl.int64)) // gl.maximum(stages_mine, 1)).to(gl.int32), zero_mine)
            while zero_done < zero_target:
                _zero_chunk(descs.zero, smem.zero_buf, pid + zero_done * num_progs, problem.live_end,
                            problem.zero_col_tiles)
                zero_done += 1
    return ring_pos, zero_done


@gluon.jit
def _prefetch_first_item(descs, smem, problem, tiling, features, first, k_steps, segment):
    """PDL (``WAIT_PRIOR``): the weight loads of the program's first item, issued before the wait
    for the prior kernel (its idle check too: the row weights are this call's input). Takes the
    segment cursor at its start; returns it after locating the item, and the stages whose weight
    loads are issued."""
    prefetched = 0
    if first < problem.real_items:
        group, tiles_before, tiles_through, start, end, row_lo, col_tile = find_item(problem, tiling, features, first,
                                                                                     *segment, 1)
        segment = (group, tiles_before, tiles_through, start, end)
        half = idle_half(features.SKIP_IDLE_HALF, features, problem, row_lo, start, end, tiling.BLOCK_M, 1)
        prefetched = gl.minimum(k_steps, tiling.STAGES)
        if features.SKIP_IDLE_TILES:
            if idle_tile(features, problem, row_lo, end, tiling.BLOCK_M, 1):
                prefetched = 0  # a skipped item: the next one starts the ring
        for k_step in range(prefetched):
            _expect_stage(smem.ready.index(k_step), descs, half, features.FUSED, features.SKIP_IDLE_HALF)
            _load_weights(descs, smem, problem, features, k_step, group * problem.N + col_tile * tiling.BLOCK_N,
                          k_step * tiling.BLOCK_K)
    return segment, prefetched


@gluon.jit
def _tail_share(descs, smem, problem, first, stride, k_steps):
    """Zeroes the zero buffer; returns this program's tail chunks (``pid``, ``pid + num_progs``,
    ...) and the ring stages to spread them over (an estimate under ``HANDOFF`` and where idle
    tiles load no stages)."""
    pid, num_progs = programs()
    ZERO_ROWS: gl.constexpr = descs.zero.block_type.shape[0]
    ZERO_N: gl.constexpr = descs.zero.block_type.shape[1]
    zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // ZERO_N, ZERO_N // 8], [1, 1], [1, 0])
    smem.zero_buf.store(gl.zeros([ZERO_ROWS, ZERO_N], descs.zero.dtype, zero_layout))
    fence_async_shared()
    zero_total = gl.cdiv(problem.NUM_ROWS - problem.live_end, ZERO_ROWS) * problem.zero_col_tiles
    zero_mine = gl.cdiv(gl.maximum(zero_total - pid, 0), num_progs)
    stages_mine = gl.cdiv(gl.maximum(problem.real_items - first, 0), stride) * k_steps
    return zero_mine, stages_mine


@gluon.jit
def _end_markers(smem, tiling, ring_pos, k_steps):
    """``HANDOFF``: one end marker per consumer, each a whole item of stages (no loads), so that
    every ring position stays where the consumers expect it."""
    for _ in gl.static_range(tiling.CONSUMERS):
        for k_step in range(k_steps):
            stage = ring_pos % tiling.STAGES
            mbarrier.wait(smem.empty.index(stage), ((ring_pos // tiling.STAGES) & 1) ^ 1)
            if k_step == 0:
                _publish_item(smem.item_ids, stage, -1)
            mbarrier.arrive(smem.ready.index(stage), count=1)
            ring_pos += 1


@gluon.jit
def _load_static_item(descs, smem, problem, tiling, features, item, segment, ring_pos, prefetched, k_steps, zero_done,
                      zero_mine, stages_mine):
    """Item ``item`` of the static schedule: move the segment cursor to it and issue its loads, or
    none for an idle tile (``SKIP_IDLE_TILES``: the consumer stores its zeros without the ring).
    Returns the cursor, the ring position and the tail chunks done."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    group, tiles_before, tiles_through, start, end, row_lo, col_tile = find_item(problem, tiling, features, item,
                                                                                 *segment, 1)
    skip = False
    if features.SKIP_IDLE_TILES:
        skip = idle_tile(features, problem, row_lo, end, BLOCK_M, 1)
    if not skip:
        half = idle_half(features.SKIP_IDLE_HALF, features, problem, row_lo, start, end, BLOCK_M, 1)
        ring_pos, zero_done = _load_item(descs, smem, problem, tiling, features, item, row_lo,
                                         group * problem.N + col_tile * tiling.BLOCK_N, half, ring_pos, prefetched,
                                         k_steps, zero_done, zero_mine, stages_mine)
    return (group, tiles_before, tiles_through, start, end), ring_pos, zero_done


@gluon.jit
def _load_handoff_items(descs, smem, problem, tiling, features, k_steps, zero_mine, stages_mine):
    """``HANDOFF``: the items the counter hands this program, each loaded once its row tile's flag
    is set, then the end markers. Its walks start at the first segment, the cursor written here: a
    constant passed in from the entry is a runtime value on Triton 3.6, and a partition's runtime
    values go through shared memory. Returns the tail chunks done."""
    group, tiles_before, tiles_through, start, end = -1, 0, 0, 0, 0
    zero_done = 0
    ring_pos = 0
    grid_waited = 0
    item = next_item(problem.handoff_ptr)
    while item < problem.real_items:
        group, tiles_before, tiles_through, start, end, row_lo, col_tile = find_item(
            problem, tiling, features, item, group, tiles_before, tiles_through, start, end, 1)
        grid_waited = wait_row_tile(
            problem.handoff_ptr + 1 + row_tile(item, problem.col_tiles, tiles_before, tiles_through,
                                               tiling.GROUP_MAJOR),
            problem.FLAG_TARGET, grid_waited, features.MAX_POLLS)
        half = idle_half(features.SKIP_IDLE_HALF, features, problem, row_lo, start, end, tiling.BLOCK_M, 1)
        ring_pos, zero_done = _load_item(descs, smem, problem, tiling, features, item, row_lo,
                                         group * problem.N + col_tile * tiling.BLOCK_N, half, ring_pos, 0, k_steps,
                                         zero_done, zero_mine, stages_mine)
        item = next_item(problem.handoff_ptr)
    _end_markers(smem, tiling, ring_pos, k_steps)
    return zero_done


@gluon.jit
def _load_static_items(descs, smem, problem, tiling, features, first, stride, segment, prefetched, k_steps, zero_mine,
                       stages_mine, LANE: gl.constexpr):
    """The static schedule's items from ``first``: with ``SPLIT_RING`` ring ``LANE``'s
    (:func:`.schedule.ring_item`), else every ``stride``-th; the segment cursor and the ring start
    where the entry's walk and the PDL prefetch (``prefetched`` stages) left them. Returns the
    tail chunks done."""
    pid, num_progs = programs()
    zero_done = 0
    ring_pos = 0
    if tiling.SPLIT_RING:
        j = 0
        item = first
        while item < problem.real_items:
            segment, ring_pos, zero_done = _load_static_item(descs, smem, problem, tiling, features, item, segment,
                                                             ring_pos, prefetched, k_steps, zero_done, zero_mine,
                                                             stages_mine)
            j += 1
            item = program_item(pid, ring_item(j, problem.spread, LANE), num_progs, problem.spread)
    else:
        for item in range(first, problem.real_items, stride):
            segment, ring_pos, zero_done = _load_static_item(descs, smem, problem, tiling, features, item, segment,
                                                             ring_pos, prefetched, k_steps, zero_done, zero_mine,
                                                             stages_mine)
    return zero_done


@gluon.jit
def producer(descs, smem, problem, tiling, features, LANE: gl.constexpr):
    """The producer partition: this program's items' loads, then the rest of its tail chunks.
    With ``SPLIT_RING``, producer ``LANE`` loads the items of consumer ``LANE`` (every other item
    of the program or alternate pairs, :func:`.schedule.ring_item`) into its own ring, skipping
    idle tiles (``SKIP_IDLE_TILES``), and producer 0 alone zeroes the tail."""
    pid, num_progs = programs()
    if tiling.SPLIT_RING:  # this ring's items (schedule.ring_item)
        first = program_item(pid, ring_item(0, problem.spread, LANE), num_progs, problem.spread)
        stride = 2 * num_progs
    else:
        first = pid
        stride = num_progs
    PRODUCER_TAIL: gl.constexpr = features.PRODUCER_TAIL and LANE == 0
    k_steps = gl.cdiv(problem.K, tiling.BLOCK_K)
    prefetched = 0  # stages whose weight loads were issued before the grid-wide wait
    if not features.HANDOFF:
        # The static schedule's segment cursor (see schedule.walk), from the entry's walk start.
        segment = (problem.walk_group, problem.walk_tiles, problem.walk_tiles, 0, problem.walk_end)
        if features.WAIT_PRIOR:
            segment, prefetched = _prefetch_first_item(descs, smem, problem, tiling, features, first, k_steps, segment)
            griddepcontrol_wait()
    zero_mine = 0
    stages_mine = 0
    if PRODUCER_TAIL:
        zero_mine, stages_mine = _tail_share(descs, smem, problem, first, stride, k_steps)
    if features.HANDOFF:
        zero_done = _load_handoff_items(descs, smem, problem, tiling, features, k_steps, zero_mine, stages_mine)
    else:
        zero_done = _load_static_items(descs, smem, problem, tiling, features, first, stride, segment, prefetched,
                                       k_steps, zero_mine, stages_mine, LANE)
    if PRODUCER_TAIL:
        while zero_done < zero_mine:  # all of it when this program has no real items
            _zero_chunk(descs.zero, smem.zero_buf, pid + zero_done * num_progs, problem.live_end,
                        problem.zero_col_tiles)
            zero_done += 1
        tma.store_wait(0)
    if features.HANDOFF:
        griddepcontrol_wait()
