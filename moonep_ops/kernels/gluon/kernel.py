"""Hopper-only grouped GEMM in Gluon (Triton's explicit layer): warp-specialized, persistent.

``out[seg_g] = a[seg_g] @ w[g].T`` for the segments of ``cu_seqlens``, rows ``[cu[-1], NvS)``
of ``out`` set to zero, like the Triton kernel's plain GEMM (:mod:`.triton_grouped_gemm`), whose
schedule this one keeps: a persistent grid, work items (row tile, column tile) numbered segment
by segment (``GROUP_MAJOR``) or row tile by row tile, ``item = pid + i * num_programs``.

What Gluon lets us write that Triton 3.6's compiler does not produce here (measured in
``benchmarks/results/probe_gluon_h200*.json``):

- Warp specialization by hand: a producer warp that only issues TMA loads into a ring of
  ``STAGES`` shared-memory stages, running ahead across tile boundaries, and consumer warpgroups
  that only issue wgmma. Stages are handed over by mbarriers (``ready``: the loads landed;
  ``empty``: the MMAs that read the stage finished).
- Two consumer schemes (``PINGPONG``): two warpgroups on alternate tiles, each owning a whole
  128-row tile, so one's epilogue runs under the other's main loop (the main loops take turns:
  see :func:`_consumer`); or both warpgroups on each tile, 64 rows each (cooperative).
- The fused SwiGLU GEMM (``FUSED``): each ``a`` stage feeds two accumulators (gate, up), and
  ``silu(gate) * up * route_weight`` is applied to them in fp32 before the one store of ``act``.
- An epilogue through shared memory: a tile wholly inside its segment leaves by an asynchronous
  TMA store, waited for only before the buffer is reused; a tile cut by a segment end is read
  back in a coalesced layout and stored with a row mask (stores straight from the wgmma register
  layout were 10-25% slower).
- The tail's zeros (``ZERO_TAIL``): by the consumers after their real items, or
  (``TAIL_BY_PRODUCER``) by the producer warp, TMA stores of a zeroed ``ZERO_ROWS``-row buffer
  spread evenly over its loads, so that they overlap the GEMM instead of forming a write-only
  phase at the end (eleventh session: -2.6% on kimi-k2 decode's down GEMM, whose rows are half
  tail; +2.5% on a K = 768 one, so the config table picks it for long reductions only).
- Programmatic dependent launch (``LAUNCH_DEPENDENTS`` / ``WAIT_PRIOR``, the ``experts`` op's
  pair): the dependent down kernel's producer issues its first item's weight loads, then
  executes ``griddepcontrol.wait`` before its first load of ``a`` (``act``).
- Idle upper halves (``SKIP_IDLE_HALF``): a segment's last row tile whose upper 64 rows all lie
  past the end or have route weight 0 (``SKIP_BY_WEIGHT``: MoonEP's padding; the fused GEMM's
  own weights, or the experts op's passed to its down GEMM) runs its MMAs on the lower half
  (warpgroups split by columns) and stores zeros above. Picked only where measured faster: a
  tile that finishes early breaks the step of the programs sharing its weight tiles. With
  ``HALF_LOADS`` the producer makes the same check and loads only the lower half of such a
  tile's ``a`` rows (a second descriptor, half the box), so the idle rows cost no bytes either.
- Another tensor's tail (``tail_out``): the experts op's fused GEMM zeroes ``out``'s tail rows
  from its producer warp, so that the down GEMM writes only real rows.
- The row-tile handoff (``SIGNAL_ROWS`` / ``HANDOFF``, the experts op's pair where the config
  table asks for it): the fused GEMM adds to a flag per row tile of ``act`` once its stores of a
  tile completed; the dependent down GEMM takes its items from a global counter (so that programs
  which start early, on SMs the fused GEMM's last programs left, take more of them) and waits per
  row tile for its flag instead of for the whole fused grid. Item ids reach the consumers with
  each item's first stage; bounded polls fall back to the grid-wide wait (never a hang).
- A split epilogue (``o_desc``'s block half the tile's columns, ``GluonConfig.epilogue_n``): the
  tile leaves in two column halves through a half-size buffer, which leaves shared memory for
  another stage of the ring (kimi-k2's 128x256 down tiles: four stages instead of three).
- ``STACKED`` (fused, a probe candidate that no table picks yet): the gate and up tiles of a
  stage stacked in one buffer, so that one wgmma of ``2 * BLOCK_N`` columns reads each ``a``
  slice once for both; the accumulator is split in registers for the epilogue.

The segment of an item is found by a forward walk over ``cu_seqlens`` (a program's items only
move forward), with scalar loads: no per-item scans. Segment ends are used as in the Triton
kernel (rows masked to ``[0, min(end, NvS))``), so invalid ``cu_seqlens`` give unspecified values,
never an out-of-bounds access. Nothing syncs the host.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor



@gluon.jit
def _walk(cu_ptr, G, key, scale, g, excl, incl, start, end, BLOCK_M: gl.constexpr):
    """Advance the segment cursor until ``key < incl * scale``: (g, excl, incl, start, end) of the
    segment that holds ``key`` (tile prefix sums ``excl``/``incl``, rows ``[start, end)``)."""
    while (key >= incl * scale) & (g < G - 1):
        g += 1
        start = end
        end = gl.load(cu_ptr + g)
        excl = incl
        incl += (gl.maximum(end - start, 0) + BLOCK_M - 1) // BLOCK_M
    return g, excl, incl, start, end


@gluon.jit
def _item_coords(item, n_tiles, excl, incl, start, BLOCK_M: gl.constexpr, GROUP_MAJOR: gl.constexpr):
    """(first row, column tile) of ``item`` in the segment the cursor holds."""
    if GROUP_MAJOR:
        local = item - excl * n_tiles
        count = gl.maximum(incl - excl, 1)
        return start + (local % count) * BLOCK_M, local // count
    else:
        return start + (item // n_tiles - excl) * BLOCK_M, item % n_tiles


@gluon.jit
def _gdc_wait():
    """``griddepcontrol.wait``: the prior kernel (this one launched as its programmatic dependent)
    has finished and its memory is visible. A no-op without programmatic dependent launch."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    """``griddepcontrol.launch_dependents``: the next kernel, if a programmatic dependent, may launch."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _signal_row_tile(flag_ptr):
    """Row-tile handoff, writer side (``SIGNAL_ROWS``): every consumer thread adds 1 to the row
    tile's flag with release semantics, after its own bulk (TMA) stores completed (``wait_group``
    without ``.read``: written, not only read from shared memory) and a proxy fence that orders
    them before its generic release. Its masked stores are its own generic writes. Whichever thread
    issued a TMA store, the flag reaches its target only after that thread's add."""
    gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; red.release.gpu.global.add.s32 [$1], 1; "
        "mov.u32 $0, 0;", "=r,l", [flag_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _acquire(flag_ptr):
    """A flag read with acquire semantics (gpu scope)."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flag_ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _nanosleep():
    gl.inline_asm_elementwise("nanosleep.u32 128; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _fence_async_global():
    """Generic-proxy reads (the flag) before the async proxy's (TMA loads of ``a``)."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _wait_row_tile(flag_ptr, target, waited, MAX_POLLS: gl.constexpr):
    """Row-tile handoff, reader side (``HANDOFF``): wait until the row tile's flag reaches
    ``target``, polling at most ``MAX_POLLS`` times; past that, fall back to ``griddepcontrol.wait``
    (the whole prior grid done), so that a flag that never fills costs time, never a hang. Returns
    ``waited`` (1 once the grid-wide wait ran: then no flag needs reading any more)."""
    if waited == 0:
        got = _acquire(flag_ptr)
        polls = 0
        while (got < target) & (polls < MAX_POLLS):
            _nanosleep()
            got = _acquire(flag_ptr)
            polls += 1
        if got < target:
            _gdc_wait()
            waited = 1
        _fence_async_global()
    return waited


@gluon.jit
def _next_item(counter_ptr):
    """The next item of the dynamic schedule (``HANDOFF``): lane 0 of the (one-warp) producer takes
    it from the global counter, every lane gets it."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; mov.u32 $0, 0; "
        "@p atom.global.add.u32 $0, [$1], 1; shfl.sync.idx.b32 $0, $0, 0, 0x1f, 0xffffffff; }",
        "=r,l", [counter_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _warp_sync():
    """``bar.warp.sync``: the warp's shared-memory writes ordered before what follows (the item id
    of a stage, written by every lane, before the mbarrier arrive that publishes it)."""
    gl.inline_asm_elementwise("bar.warp.sync 0xffffffff; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _row_tile(item, n_tiles, excl, incl, GROUP_MAJOR: gl.constexpr):
    """Index of ``item``'s row tile among all real row tiles (the same in both kernels of a pair:
    same ``cu_seqlens`` and ``BLOCK_M``)."""
    if GROUP_MAJOR:
        return excl + (item - excl * n_tiles) % gl.maximum(incl - excl, 1)
    else:
        return item // n_tiles


@gluon.jit
def _zero_chunk(z_desc, z_buf, c, tail_lo, n_tiles):
    """Zero chunk ``c`` of the tail: ``ZROWS`` rows from ``tail_lo``, one column tile (TMA clips it
    at NvS and N)."""
    ZROWS: gl.constexpr = z_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = z_desc.block_type.shape[1]
    tma.async_copy_shared_to_global(z_desc, [tail_lo + (c // n_tiles) * ZROWS, (c % n_tiles) * BLOCK_N], z_buf)


@gluon.jit
def _load_weights(w_desc, u_desc, w_bufs, u_bufs, ready, s, w_row, k0, FUSED: gl.constexpr, STACK: gl.constexpr):
    """Stage ``s``'s weight tiles: ``w`` (and ``u``), or with ``STACK`` both into the halves of one
    ``2 * BLOCK_N``-row buffer."""
    if STACK:
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        tma.async_copy_global_to_shared(w_desc, [w_row, k0], ready.index(s), w_bufs.index(s).slice(0, BLOCK_N))
        tma.async_copy_global_to_shared(u_desc, [w_row, k0], ready.index(s), w_bufs.index(s).slice(BLOCK_N, BLOCK_N))
    else:
        tma.async_copy_global_to_shared(w_desc, [w_row, k0], ready.index(s), w_bufs.index(s))
        if FUSED:
            tma.async_copy_global_to_shared(u_desc, [w_row, k0], ready.index(s), u_bufs.index(s))


@gluon.jit
def _expect_stage(bar, a_desc, ah_desc, w_desc, half, FUSED: gl.constexpr, HALF_LOADS: gl.constexpr):
    """``bar`` expects a stage's loads: ``a``'s box (with ``HALF_LOADS``, its lower half alone where
    ``half``), the weights' (the byte count must be a constant: one expect per case)."""
    w_bytes: gl.constexpr = w_desc.block_type.nbytes * (2 if FUSED else 1)
    full: gl.constexpr = a_desc.block_type.nbytes + w_bytes
    if HALF_LOADS:
        lower: gl.constexpr = ah_desc.block_type.nbytes + w_bytes
        if half:
            mbarrier.expect(bar, lower)
        else:
            mbarrier.expect(bar, full)
    else:
        mbarrier.expect(bar, full)


@gluon.jit
def _load_item(a_desc, ah_desc, w_desc, u_desc, z_desc, a_bufs, w_bufs, u_bufs, z_buf, ready, empty, items, item,
               row_lo, w_row, half, cnt, pre, k_iters, z_done, z_mine, stages_mine, live_end, z_tiles,
               BLOCK_K: gl.constexpr, STAGES: gl.constexpr, FUSED: gl.constexpr, TAIL_BY_PRODUCER: gl.constexpr,
               STACK: gl.constexpr, HANDOFF: gl.constexpr, HALF_LOADS: gl.constexpr):
    """One item's loads into the ring from position ``cnt`` (the first ``pre`` positions already
    hold their weight loads), with this program's share of tail chunks spread over them. With
    ``HANDOFF`` the item's id goes with its first stage (``items``), for the consumers. ``half``
    (``HALF_LOADS``): the tile's upper half is idle, so only the lower half of its ``a`` rows is
    loaded (``ah_desc``'s box), the rows its MMAs read."""
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    for kk in range(k_iters):
        s = cnt % STAGES
        if cnt >= pre:
            # mbarriers start with phase 1 complete: the first lap waits on parity 1 and passes.
            mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)
            if HANDOFF:
                if kk == 0:
                    _publish_item(items, s, item)
            _expect_stage(ready.index(s), a_desc, ah_desc, w_desc, half, FUSED, HALF_LOADS)
            _load_weights(w_desc, u_desc, w_bufs, u_bufs, ready, s, w_row, kk * BLOCK_K, FUSED, STACK)
        if HALF_LOADS:
            if half:
                HALF_M: gl.constexpr = ah_desc.block_type.shape[0]
                tma.async_copy_global_to_shared(ah_desc, [row_lo, kk * BLOCK_K], ready.index(s),
                                                a_bufs.index(s).slice(0, HALF_M))
            else:
                tma.async_copy_global_to_shared(a_desc, [row_lo, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
        else:
            tma.async_copy_global_to_shared(a_desc, [row_lo, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
        cnt += 1
        if TAIL_BY_PRODUCER:
            z_target = gl.minimum(((cnt * z_mine.to(gl.int64)) // gl.maximum(stages_mine, 1)).to(gl.int32), z_mine)
            while z_done < z_target:
                _zero_chunk(z_desc, z_buf, pid + z_done * num_progs, live_end, z_tiles)
                z_done += 1
    return cnt, z_done


@gluon.jit
def _publish_item(items, s, item):
    """Stage ``s`` starts item ``item`` (-1: no more items): written by every lane of the producer
    warp before the stage's mbarrier arrive, which publishes it to the consumers."""
    il: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(s).store(gl.full([32], item, gl.int32, il))
    _warp_sync()


@gluon.jit
def _producer(a_desc, ah_desc, w_desc, u_desc, z_desc, a_bufs, w_bufs, u_bufs, z_buf, ready, empty, items, rw_ptr,
              cu_ptr, sched_ptr, G, NUM_ROWS, N, K, FLAG_TARGET, real_items, live_end, n_tiles, z_tiles,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, GROUP_MAJOR: gl.constexpr, FUSED: gl.constexpr, TAIL_BY_PRODUCER: gl.constexpr,
              WAIT_PRIOR: gl.constexpr, STACK: gl.constexpr, HANDOFF: gl.constexpr, CONSUMERS: gl.constexpr,
              MAX_POLLS: gl.constexpr, HALF_LOADS: gl.constexpr, SKIP_BY_WEIGHT: gl.constexpr):
    """TMA loads into the ring, item after item. With ``TAIL_BY_PRODUCER`` it also zeroes this
    program's share of the tail rows of ``z_desc``'s tensor (this kernel's ``out``, or the experts
    op's ``out`` for its fused GEMM: ``z_tiles`` column chunks), by TMA stores of a zeroed
    ``ZROWS``-row buffer spread evenly over its loads: the tail's writes overlap the GEMM instead
    of forming a write-only phase at the end. With ``WAIT_PRIOR`` (launched as a programmatic
    dependent of the kernel that writes ``a``) the first item's weight loads are issued before
    ``griddepcontrol.wait``, its ``a`` loads after.

    ``HANDOFF`` (the experts op's down GEMM, a programmatic dependent of a fused GEMM with
    ``SIGNAL_ROWS``): items come from a global counter (``sched_ptr[0]``) instead of the static
    stride, so that programs which start early (on SMs the fused GEMM's last programs left) take
    more of them; before loading an item's ``a`` the producer waits for its row tile's flag
    (``sched_ptr[1 + row tile]``) instead of the whole fused grid. The item's id goes to the
    consumers with its first stage; after the last, each consumer gets a stage-aligned item of
    empty stages marked -1. The grid-wide wait still runs at the end, so that this grid finishes
    only after the fused one (a later kernel ordered after this one needs that).

    ``HALF_LOADS`` (with the consumers' idle-upper-half skip): the producer makes the consumers'
    check itself (:func:`_idle_half`, the same loads of the same weights, so the same answer) and
    loads only the lower half of ``a`` for such a tile: its MMAs never read the upper half."""
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    k_iters = gl.cdiv(K, BLOCK_K)
    scale = n_tiles if GROUP_MAJOR else 1
    g = -1
    excl = 0
    incl = 0
    start = 0
    end = 0
    pre = 0  # stages whose weight loads were issued before the wait
    if WAIT_PRIOR and not HANDOFF:
        if pid < real_items:
            key0 = pid if GROUP_MAJOR else pid // n_tiles
            g, excl, incl, start, end = _walk(cu_ptr, G, key0, scale, g, excl, incl, start, end, BLOCK_M)
            row_lo0, pid_n0 = _item_coords(pid, n_tiles, excl, incl, start, BLOCK_M, GROUP_MAJOR)
            # (the route weights are this call's input, not the prior kernel's output)
            half0 = _idle_half(HALF_LOADS, rw_ptr, row_lo0, end, NUM_ROWS, BLOCK_M, SKIP_BY_WEIGHT, 1)
            pre = gl.minimum(k_iters, STAGES)
            for kk in range(pre):
                _expect_stage(ready.index(kk), a_desc, ah_desc, w_desc, half0, FUSED, HALF_LOADS)
                _load_weights(w_desc, u_desc, w_bufs, u_bufs, ready, kk, g * N + pid_n0 * BLOCK_N, kk * BLOCK_K,
                              FUSED, STACK)
        _gdc_wait()
    z_mine = 0
    z_done = 0
    stages_mine = 0
    if TAIL_BY_PRODUCER:
        ZROWS: gl.constexpr = z_desc.block_type.shape[0]
        ZBN: gl.constexpr = z_desc.block_type.shape[1]
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // ZBN, ZBN // 8], [1, 1], [1, 0])
        z_buf.store(gl.zeros([ZROWS, ZBN], z_desc.dtype, zl))
        fence_async_shared()
        z_total = gl.cdiv(NUM_ROWS - live_end, ZROWS) * z_tiles
        z_mine = gl.cdiv(gl.maximum(z_total - pid, 0), num_progs)  # chunks pid, pid + num_progs, ...
        # (an estimate under HANDOFF, where the items are dynamic)
        stages_mine = gl.cdiv(gl.maximum(real_items - pid, 0), num_progs) * k_iters
    cnt = 0
    if HANDOFF:
        waited = 0
        item = _next_item(sched_ptr)
        while item < real_items:
            key = item if GROUP_MAJOR else item // n_tiles
            g, excl, incl, start, end = _walk(cu_ptr, G, key, scale, g, excl, incl, start, end, BLOCK_M)
            row_lo, pid_n = _item_coords(item, n_tiles, excl, incl, start, BLOCK_M, GROUP_MAJOR)
            waited = _wait_row_tile(sched_ptr + 1 + _row_tile(item, n_tiles, excl, incl, GROUP_MAJOR), FLAG_TARGET,
                                    waited, MAX_POLLS)
            half = _idle_half(HALF_LOADS, rw_ptr, row_lo, end, NUM_ROWS, BLOCK_M, SKIP_BY_WEIGHT, 1)
            cnt, z_done = _load_item(a_desc, ah_desc, w_desc, u_desc, z_desc, a_bufs, w_bufs, u_bufs, z_buf, ready,
                                     empty, items, item, row_lo, g * N + pid_n * BLOCK_N, half, cnt, pre, k_iters,
                                     z_done, z_mine, stages_mine, live_end, z_tiles, BLOCK_K, STAGES, FUSED,
                                     TAIL_BY_PRODUCER, STACK, HANDOFF, HALF_LOADS)
            item = _next_item(sched_ptr)
        # One end marker per consumer, each a whole item of stages (no loads), so that every ring
        # position stays where the consumers expect it.
        for c in gl.static_range(CONSUMERS):
            for kk in range(k_iters):
                s = cnt % STAGES
                mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)
                if kk == 0:
                    _publish_item(items, s, -1)
                mbarrier.arrive(ready.index(s), count=1)
                cnt += 1
    else:
        for item in range(pid, real_items, num_progs):
            key = item if GROUP_MAJOR else item // n_tiles
            g, excl, incl, start, end = _walk(cu_ptr, G, key, scale, g, excl, incl, start, end, BLOCK_M)
            row_lo, pid_n = _item_coords(item, n_tiles, excl, incl, start, BLOCK_M, GROUP_MAJOR)
            half = _idle_half(HALF_LOADS, rw_ptr, row_lo, end, NUM_ROWS, BLOCK_M, SKIP_BY_WEIGHT, 1)
            cnt, z_done = _load_item(a_desc, ah_desc, w_desc, u_desc, z_desc, a_bufs, w_bufs, u_bufs, z_buf, ready,
                                     empty, items, item, row_lo, g * N + pid_n * BLOCK_N, half, cnt, pre, k_iters,
                                     z_done, z_mine, stages_mine, live_end, z_tiles, BLOCK_K, STAGES, FUSED,
                                     TAIL_BY_PRODUCER, STACK, HANDOFF, HALF_LOADS)
    if TAIL_BY_PRODUCER:
        while z_done < z_mine:  # all of it when this program has no real items
            _zero_chunk(z_desc, z_buf, pid + z_done * num_progs, live_end, z_tiles)
            z_done += 1
        tma.store_wait(0)
    if HANDOFF:
        _gdc_wait()


@gluon.jit
def _store_rows(out_ptr, vals, rows, cols, row_end, N, stride_om):
    """``out[rows, cols] = vals`` for rows in ``[0, row_end)`` and columns below ``N`` (``rows`` and
    ``cols`` in the slices of ``vals``'s layout)."""
    mask = ((rows >= 0) & (rows < row_end))[:, None] & (cols < N)[None, :]
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], vals, mask=mask)


@gluon.jit
def _flush_tile(o_buf, o_desc, out_ptr, row_lo, col0, end, NUM_ROWS, N, stride_om, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """The staged tile in ``o_buf`` (rows from ``row_lo``, columns from ``col0``) to ``out``: a tile
    wholly inside its segment by a TMA store (clipped at NvS and N), a tile cut by its segment's
    end read back in a coalesced layout and stored with a row mask."""
    if (row_lo >= 0) & (row_lo + BLOCK_M <= end):
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row_lo, col0], o_buf)
    else:
        cl: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
        res = o_buf.load(cl)
        rows = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, cl))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, cl))
        _store_rows(out_ptr, res, rows, cols, gl.minimum(end, NUM_ROWS), N, stride_om)


@gluon.jit
def _upper_half_idle(rw_ptr, row_lo, end, NUM_ROWS, BLOCK_M: gl.constexpr, BY_WEIGHT: gl.constexpr,
                     WARPS: gl.constexpr):
    """Whether every row of the tile's upper half ``[row_lo + BLOCK_M/2, row_lo + BLOCK_M)`` lies
    past its segment's end or (``BY_WEIGHT``) has route weight 0: MoonEP's padding rows, whose
    output is zero. A NaN weight is not 0: such a row is computed."""
    HALF: gl.constexpr = BLOCK_M // 2
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    rows = row_lo + HALF + gl.arange(0, HALF, layout=lay)
    live = (rows >= 0) & (rows < gl.minimum(end, NUM_ROWS))
    if BY_WEIGHT:
        live = live & (gl.load(rw_ptr + rows, mask=live, other=0.0) != 0.0)
    return gl.max(live.to(gl.int32), axis=0) == 0


@gluon.jit
def _idle_half(ON: gl.constexpr, rw_ptr, row_lo, end, NUM_ROWS, BLOCK_M: gl.constexpr, BY_WEIGHT: gl.constexpr,
               WARPS: gl.constexpr):
    """Whether the item's tile takes the idle-upper-half path (``ON``: the kernel has it): it is its
    segment's last (only such a tile can hold idle rows) and its upper half is idle. The consumers
    (:func:`_run_item`) and, for half loads, the producer ask this same question of the same data."""
    idle = False
    if ON:
        if row_lo + BLOCK_M >= end:
            idle = _upper_half_idle(rw_ptr, row_lo, end, NUM_ROWS, BLOCK_M, BY_WEIGHT, WARPS)
    return idle


@gluon.jit
def _tile(a_bufs, w_bufs, u_bufs, wide_bufs, o_buf, ready, empty, turn, o_desc, out_ptr, rw_ptr, sched_ptr, pending,
          row_lo, col0, end, NUM_ROWS, N, stride_om, cnt, k_iters, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FUSED: gl.constexpr, HAS_WEIGHTS: gl.constexpr,
          STACK: gl.constexpr, SIGNAL_ROWS: gl.constexpr, PARITY: gl.constexpr, CONSUMERS: gl.constexpr,
          WARPS: gl.constexpr):
    """One item: the main loop over the ring from position ``cnt``, the fused epilogue, the store.
    ``ROWS == BLOCK_M / 2``: the upper half is idle (:func:`_upper_half_idle`), so the MMAs read
    only the lower half of each ``a`` stage (the warpgroups split the columns instead of the rows)
    and the upper half is stored as zeros. ``SIGNAL_ROWS``: before its own stores, this item
    signals the row tile ``pending`` of this consumer's previous item (-1: none), whose stores have
    had a whole main loop to complete, so that no store is waited for early."""
    if ROWS == BLOCK_M:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPS // 4],
                                                             instr_shape=[16, BLOCK_N // (WARPS // 4), 16])
    wide_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, 2 * BLOCK_N, 16])
    if STACK:
        acc_w = gl.zeros([ROWS, 2 * BLOCK_N], gl.float32, wide_layout)
    else:
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
        acc_u = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
    for kk in range(k_iters):
        s = cnt % STAGES
        mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
        if ROWS == BLOCK_M:
            a_s = a_bufs.index(s)
        else:
            a_s = a_bufs.index(s).slice(0, ROWS)
        # At most this step's MMAs in flight: the previous step's are done, so its stage can be refilled.
        if STACK:
            acc_w = warpgroup_mma(a_s, wide_bufs.index(s).permute((1, 0)), acc_w, is_async=True)
            acc_w = warpgroup_mma_wait(1, deps=(acc_w, ))
        else:
            acc = warpgroup_mma(a_s, w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            if FUSED:
                acc_u = warpgroup_mma(a_s, u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                acc, acc_u = warpgroup_mma_wait(2, deps=(acc, acc_u))
            else:
                acc = warpgroup_mma_wait(1, deps=(acc, ))
        mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        cnt += 1
    if CONSUMERS == 2:
        mbarrier.arrive(turn.index(1 - PARITY), count=1)  # every stage of this item has landed
    if STACK:
        acc_w = warpgroup_mma_wait(0, deps=(acc_w, ))
        # Columns [0, BLOCK_N) are gate, [BLOCK_N, 2 * BLOCK_N) up: in the wgmma layout the
        # top column bit is a register bit, so the split moves no data (asserted).
        gate, up = gl.split(gl.permute(gl.reshape(acc_w, [ROWS, 2, BLOCK_N]), [0, 2, 1]))
        acc = gl.convert_layout(gate, acc_layout, assert_trivial=True)
        acc_u = gl.convert_layout(up, acc_layout, assert_trivial=True)
    elif FUSED:
        acc, acc_u = warpgroup_mma_wait(0, deps=(acc, acc_u))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
    if FUSED:  # silu(gate) * up * route weight on the fp32 accumulators
        acc = acc / (1.0 + gl.exp(-acc)) * acc_u
        if HAS_WEIGHTS:
            rows = row_lo + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
            rmask = (rows >= 0) & (rows < gl.minimum(end, NUM_ROWS))
            acc = acc * gl.load(rw_ptr + rows, mask=rmask, other=0.0)[:, None]
    if SIGNAL_ROWS:
        if pending >= 0:
            _signal_row_tile(sched_ptr + 1 + pending)
    EPI_N: gl.constexpr = o_desc.block_type.shape[1]
    if EPI_N == BLOCK_N:
        tma.store_wait(0)  # the previous store has read o_buf
        if ROWS == BLOCK_M:
            o_buf.store(acc.to(o_desc.dtype))
        else:
            o_buf.slice(0, ROWS).store(acc.to(o_desc.dtype))
            o_buf.slice(ROWS, BLOCK_M - ROWS).store(gl.zeros([BLOCK_M - ROWS, BLOCK_N], o_desc.dtype, acc_layout))
        _flush_tile(o_buf, o_desc, out_ptr, row_lo, col0, end, NUM_ROWS, N, stride_om, BLOCK_M, BLOCK_N, WARPS)
    elif ROWS == BLOCK_M:
        # Split epilogue (o_buf holds half the tile's columns, so that the ring gets another stage):
        # the halves leave one after the other. In the wgmma layout the top column bit is a
        # register bit, so the split moves no data (asserted).
        gl.static_assert(2 * EPI_N == BLOCK_N, "the split epilogue stores two halves")
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, EPI_N, 16])
        lo, hi = gl.split(gl.permute(gl.reshape(acc.to(o_desc.dtype), [ROWS, 2, EPI_N]), [0, 2, 1]))
        tma.store_wait(0)
        o_buf.store(gl.convert_layout(lo, half_layout, assert_trivial=True))
        _flush_tile(o_buf, o_desc, out_ptr, row_lo, col0, end, NUM_ROWS, N, stride_om, BLOCK_M, EPI_N, WARPS)
        tma.store_wait(0)
        o_buf.store(gl.convert_layout(hi, half_layout, assert_trivial=True))
        _flush_tile(o_buf, o_desc, out_ptr, row_lo, col0 + EPI_N, end, NUM_ROWS, N, stride_om, BLOCK_M, EPI_N, WARPS)
    else:
        # An idle-upper-half tile with a split epilogue: its warpgroups hold different columns, so
        # it is stored straight from registers (rare tiles), zeros above, masked at the segment end.
        live_end = gl.minimum(end, NUM_ROWS)
        _store_rows(out_ptr, acc.to(o_desc.dtype), row_lo + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout)),
                    col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)), live_end, N, stride_om)
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [WARPS, 1], [1, 0])
        _store_rows(out_ptr, gl.zeros([BLOCK_M - ROWS, BLOCK_N], o_desc.dtype, zl),
                    row_lo + ROWS + gl.arange(0, BLOCK_M - ROWS, layout=gl.SliceLayout(1, zl)),
                    col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, zl)), live_end, N, stride_om)


@gluon.jit
def _run_item(a_bufs, w_bufs, u_bufs, wide_bufs, o_buf, ready, empty, turn, o_desc, out_ptr, rw_ptr, cu_ptr, sched_ptr,
              pending, G, NUM_ROWS, N, stride_om, item, i, k_iters, n_tiles, g, excl, incl, start, end,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_MAJOR: gl.constexpr,
              FUSED: gl.constexpr, HAS_WEIGHTS: gl.constexpr, STACK: gl.constexpr, HALF: gl.constexpr,
              SKIP_BY_WEIGHT: gl.constexpr, SIGNAL_ROWS: gl.constexpr, TURN_AFTER_CHECK: gl.constexpr,
              PARITY: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr):
    """The consumer's local item ``i`` (global id ``item``): find its segment, check for an idle
    upper half, run it. Returns the segment cursor and the item's row tile."""
    key = item if GROUP_MAJOR else item // n_tiles
    scale = n_tiles if GROUP_MAJOR else 1
    g, excl, incl, start, end = _walk(cu_ptr, G, key, scale, g, excl, incl, start, end, BLOCK_M)
    row_lo, pid_n = _item_coords(item, n_tiles, excl, incl, start, BLOCK_M, GROUP_MAJOR)
    # With TURN_AFTER_CHECK the idle check (a load of 64 weights) is made before waiting for this
    # consumer's turn (with a dynamic schedule the turn comes first: the item id is in the ring).
    idle_upper = _idle_half(HALF, rw_ptr, row_lo, end, NUM_ROWS, BLOCK_M, SKIP_BY_WEIGHT, WARPS)
    if HALF:
        if TURN_AFTER_CHECK:
            mbarrier.wait(turn.index(PARITY), ((i // 2) & 1) ^ (1 - PARITY))
    cnt = i * k_iters  # the ring position of this item's first stage (the producer's count)
    if HALF:
        if idle_upper:
            _tile(a_bufs, w_bufs, u_bufs, wide_bufs, o_buf, ready, empty, turn, o_desc, out_ptr, rw_ptr, sched_ptr,
                  pending, row_lo, pid_n * BLOCK_N, end, NUM_ROWS, N, stride_om, cnt, k_iters, BLOCK_M // 2, BLOCK_M,
                  BLOCK_N, STAGES, FUSED, HAS_WEIGHTS, STACK, SIGNAL_ROWS, PARITY, CONSUMERS, WARPS)
        else:
            _tile(a_bufs, w_bufs, u_bufs, wide_bufs, o_buf, ready, empty, turn, o_desc, out_ptr, rw_ptr, sched_ptr,
                  pending, row_lo, pid_n * BLOCK_N, end, NUM_ROWS, N, stride_om, cnt, k_iters, BLOCK_M, BLOCK_M,
                  BLOCK_N, STAGES, FUSED, HAS_WEIGHTS, STACK, SIGNAL_ROWS, PARITY, CONSUMERS, WARPS)
    else:
        _tile(a_bufs, w_bufs, u_bufs, wide_bufs, o_buf, ready, empty, turn, o_desc, out_ptr, rw_ptr, sched_ptr,
              pending, row_lo, pid_n * BLOCK_N, end, NUM_ROWS, N, stride_om, cnt, k_iters, BLOCK_M, BLOCK_M, BLOCK_N,
              STAGES, FUSED, HAS_WEIGHTS, STACK, SIGNAL_ROWS, PARITY, CONSUMERS, WARPS)
    return g, excl, incl, start, end, _row_tile(item, n_tiles, excl, incl, GROUP_MAJOR)


@gluon.jit
def _consumer(a_bufs, w_bufs, u_bufs, wide_bufs, o_bufs, ready, empty, turn, items, o_desc, out_ptr, rw_ptr, cu_ptr,
              sched_ptr, G, NUM_ROWS, N, K, stride_om, real_items, live_end, tail_items, n_tiles,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GROUP_MAJOR: gl.constexpr, ZERO_TAIL: gl.constexpr, FUSED: gl.constexpr, HAS_WEIGHTS: gl.constexpr,
              STACK: gl.constexpr, SKIP_IDLE_HALF: gl.constexpr, SKIP_BY_WEIGHT: gl.constexpr,
              SIGNAL_ROWS: gl.constexpr, HANDOFF: gl.constexpr, PARITY: gl.constexpr, CONSUMERS: gl.constexpr,
              WARPS: gl.constexpr):
    """Consumer ``PARITY`` of ``CONSUMERS``: the program's local items ``i = PARITY (mod CONSUMERS)``.

    One consumer (``CONSUMERS == 1``, ``WARPS == 8``): both warpgroups share each tile, 64 rows
    each. Two (ping-pong, ``WARPS == 4`` each): a warpgroup owns a whole tile; the producer fills
    the ring in item order, so one warpgroup's main loop runs while the other one's epilogue does.
    ``ZERO_TAIL`` here: the consumers zero the tail rows after their real items (the kernel's
    ``TAIL_BY_PRODUCER`` gives that job to the producer instead).
    The main loops also take turns explicitly (``turn``): a consumer waits for the other one's
    main loop to end before waiting on its own first stage. Without that, a consumer could wait
    on a stage a whole lap of the ring ahead, and a parity wait cannot tell that lap from the
    current one.
    ``HANDOFF``: the item ids come with each item's first stage (``items``, see :func:`_producer`);
    a consumer waits for its turn, then for that stage, and stops at the end marker (-1), after
    releasing the marker's stages and handing the turn on.
    """
    o_buf = o_bufs.index(PARITY)
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    k_iters = gl.cdiv(K, BLOCK_K)
    HALF: gl.constexpr = SKIP_IDLE_HALF and not STACK
    g = -1
    excl = 0
    incl = 0
    start = 0
    end = 0
    pending = -1  # SIGNAL_ROWS: the row tile of this consumer's last stored item, not yet signalled
    if HANDOFF:
        il: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        i = PARITY
        item = 0
        while item >= 0:
            if CONSUMERS == 2:
                mbarrier.wait(turn.index(PARITY), ((i // 2) & 1) ^ (1 - PARITY))
            cnt = i * k_iters
            mbarrier.wait(ready.index(cnt % STAGES), (cnt // STAGES) & 1)
            item = gl.max(items.index(cnt % STAGES).load(il), 0)
            if item >= 0:
                g, excl, incl, start, end, pending = _run_item(
                    a_bufs, w_bufs, u_bufs, wide_bufs, o_buf, ready, empty, turn, o_desc, out_ptr, rw_ptr, cu_ptr,
                    sched_ptr, pending, G, NUM_ROWS, N, stride_om, item, i, k_iters, n_tiles, g, excl, incl, start,
                    end, BLOCK_M, BLOCK_N, STAGES, GROUP_MAJOR, FUSED, HAS_WEIGHTS, STACK, HALF, SKIP_BY_WEIGHT,
                    SIGNAL_ROWS, False, PARITY, CONSUMERS, WARPS)
                i += CONSUMERS
            else:
                for kk in range(k_iters):  # the end marker's stages, released like an item's
                    mbarrier.wait(ready.index((cnt + kk) % STAGES), ((cnt + kk) // STAGES) & 1)
                    mbarrier.arrive(empty.index((cnt + kk) % STAGES), count=1)
                if CONSUMERS == 2:
                    mbarrier.arrive(turn.index(1 - PARITY), count=1)
    else:
        n_local = gl.cdiv(gl.maximum(real_items - pid, 0), num_progs)
        for i in range(PARITY, n_local, CONSUMERS):
            if CONSUMERS == 2 and not HALF:
                # Fresh mbarriers count as having completed a phase of parity 1: consumer 0 starts.
                mbarrier.wait(turn.index(PARITY), ((i // 2) & 1) ^ (1 - PARITY))
            g, excl, incl, start, end, pending = _run_item(
                a_bufs, w_bufs, u_bufs, wide_bufs, o_buf, ready, empty, turn, o_desc, out_ptr, rw_ptr, cu_ptr,
                sched_ptr, pending, G, NUM_ROWS, N, stride_om, pid + i * num_progs, i, k_iters, n_tiles, g, excl,
                incl, start, end, BLOCK_M, BLOCK_N, STAGES, GROUP_MAJOR, FUSED, HAS_WEIGHTS, STACK, HALF,
                SKIP_BY_WEIGHT, SIGNAL_ROWS, CONSUMERS == 2, PARITY, CONSUMERS, WARPS)
    if SIGNAL_ROWS:
        if pending >= 0:
            _signal_row_tile(sched_ptr + 1 + pending)

    if ZERO_TAIL:
        # Tail items (rows [cu[-1], NvS) get zeros), numbered after the real ones on the same stride.
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [WARPS, 1], [1, 0])
        zeros = gl.zeros([BLOCK_M, BLOCK_N], o_desc.dtype, zl)
        first = (pid - real_items % num_progs + num_progs) % num_progs
        for j in range(first + PARITY * num_progs, tail_items, CONSUMERS * num_progs):
            rows = live_end + (j // n_tiles) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, zl))
            cols = (j % n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, zl))
            _store_rows(out_ptr, zeros, rows, cols, NUM_ROWS, N, stride_om)  # rows >= live_end >= 0
    tma.store_wait(0)


@gluon.jit
def grouped_gemm_kernel(a_desc, w_desc, u_desc, o_desc, z_desc, ah_desc, out_ptr, rw_ptr, cu_ptr, sched_ptr, G,
                            NUM_ROWS, N, K, stride_om, Z_N, FLAG_TARGET, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            BLOCK_K: gl.constexpr,
                            STAGES: gl.constexpr, BLOCK_G: gl.constexpr, GROUP_MAJOR: gl.constexpr,
                            ZERO_TAIL: gl.constexpr, FUSED: gl.constexpr, HAS_WEIGHTS: gl.constexpr,
                            PINGPONG: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, TAIL_BY_PRODUCER: gl.constexpr,
                            LAUNCH_DEPENDENTS: gl.constexpr, WAIT_PRIOR: gl.constexpr, STACKED: gl.constexpr,
                            SKIP_IDLE_HALF: gl.constexpr, SKIP_BY_WEIGHT: gl.constexpr, SIGNAL_ROWS: gl.constexpr,
                            HANDOFF: gl.constexpr, MAX_POLLS: gl.constexpr, HALF_LOADS: gl.constexpr,
                            num_warps: gl.constexpr):
    if LAUNCH_DEPENDENTS:
        # Programmatic dependent launch: the next kernel (the down GEMM) may launch now; its
        # programs take the SMs this grid's programs leave and wait for this grid's memory.
        _gdc_launch_dependents()
    # Totals from a vector scan of cu_seqlens, and the tail's first row (every partition gets them
    # as scalars).
    scan_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    real_tiles = 0
    for c in range(0, G, BLOCK_G):
        offs = c + gl.arange(0, BLOCK_G, layout=scan_layout)
        ends = gl.load(cu_ptr + offs, mask=offs < G, other=0)
        starts = gl.load(cu_ptr + offs - 1, mask=(offs > 0) & (offs < G), other=0)
        real_tiles += gl.sum((gl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M, 0)
    live_end = gl.minimum(gl.maximum(gl.load(cu_ptr + G - 1), 0), NUM_ROWS)
    n_tiles = gl.cdiv(N, BLOCK_N)
    z_tiles = gl.cdiv(Z_N, z_desc.block_type.shape[1])  # column chunks of the tail the producer zeroes
    real_items = real_tiles * n_tiles
    tail_items = gl.cdiv(NUM_ROWS - live_end, BLOCK_M) * n_tiles

    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    CONSUMER_TAIL: gl.constexpr = ZERO_TAIL and not TAIL_BY_PRODUCER
    PRODUCER_TAIL: gl.constexpr = ZERO_TAIL and TAIL_BY_PRODUCER
    STACK: gl.constexpr = FUSED and STACKED
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if STACK:
        # Gate rows over up rows in one buffer per stage: one wgmma of 2 * BLOCK_N columns reads
        # each `a` slice once for both projections.
        wide_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
        w_bufs = wide_bufs  # the producer takes each stage's halves
        u_bufs = wide_bufs
    else:
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        if FUSED:
            u_bufs = gl.allocate_shared_memory(u_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], u_desc.layout)
        else:
            u_bufs = w_bufs  # unused
        wide_bufs = w_bufs  # unused
    # The epilogue buffer: a whole tile, or half its columns (a split epilogue)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, BLOCK_M, o_desc.block_type.shape[1]], o_desc.layout)
    if PRODUCER_TAIL:
        z_buf = gl.allocate_shared_memory(z_desc.dtype, z_desc.block_type.shape, z_desc.layout)
    else:
        z_buf = o_bufs.index(0)  # unused
    if HANDOFF:  # each stage's item id (dynamic schedule), written by the producer
        items = gl.allocate_shared_memory(gl.int32, [STAGES, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        items = z_buf  # unused
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    # (Argument lists written out: constexprs inside a tuple variable reach a partition as tensors.)
    if PINGPONG:
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, u_bufs, wide_bufs, o_bufs, ready, empty, turn, items, o_desc, out_ptr,
                         rw_ptr, cu_ptr, sched_ptr, G, NUM_ROWS, N, K, stride_om, real_items, live_end, tail_items,
                         n_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_MAJOR, CONSUMER_TAIL, FUSED, HAS_WEIGHTS,
                         STACK, SKIP_IDLE_HALF, SKIP_BY_WEIGHT, SIGNAL_ROWS, HANDOFF,
                         0, 2, num_warps)),
            (_consumer, (a_bufs, w_bufs, u_bufs, wide_bufs, o_bufs, ready, empty, turn, items, o_desc, out_ptr,
                         rw_ptr, cu_ptr, sched_ptr, G, NUM_ROWS, N, K, stride_om, real_items, live_end, tail_items,
                         n_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_MAJOR, CONSUMER_TAIL, FUSED, HAS_WEIGHTS,
                         STACK, SKIP_IDLE_HALF, SKIP_BY_WEIGHT, SIGNAL_ROWS, HANDOFF,
                         1, 2, num_warps)),
            (_producer, (a_desc, ah_desc, w_desc, u_desc, z_desc, a_bufs, w_bufs, u_bufs, z_buf, ready, empty, items,
                         rw_ptr, cu_ptr, sched_ptr, G, NUM_ROWS, N, K, FLAG_TARGET, real_items, live_end, n_tiles,
                         z_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_MAJOR, FUSED, PRODUCER_TAIL, WAIT_PRIOR,
                         STACK, HANDOFF, CONSUMERS, MAX_POLLS, HALF_LOADS, SKIP_BY_WEIGHT)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, u_bufs, wide_bufs, o_bufs, ready, empty, turn, items, o_desc, out_ptr,
                         rw_ptr, cu_ptr, sched_ptr, G, NUM_ROWS, N, K, stride_om, real_items, live_end, tail_items,
                         n_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_MAJOR, CONSUMER_TAIL, FUSED, HAS_WEIGHTS,
                         STACK, SKIP_IDLE_HALF, SKIP_BY_WEIGHT, SIGNAL_ROWS, HANDOFF,
                         0, 1, num_warps)),
            (_producer, (a_desc, ah_desc, w_desc, u_desc, z_desc, a_bufs, w_bufs, u_bufs, z_buf, ready, empty, items,
                         rw_ptr, cu_ptr, sched_ptr, G, NUM_ROWS, N, K, FLAG_TARGET, real_items, live_end, n_tiles,
                         z_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_MAJOR, FUSED, PRODUCER_TAIL, WAIT_PRIOR,
                         STACK, HANDOFF, CONSUMERS, MAX_POLLS, HALF_LOADS, SKIP_BY_WEIGHT)),
        ], [1], [PRODUCER_REGS])
