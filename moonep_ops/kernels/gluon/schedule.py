"""The Gluon kernel's persistent schedule: which item is where, and whether its upper half is idle.

Work items are (row tile, column tile) pairs of the segments of ``cu_seqlens``, numbered segment
by segment (``GROUP_MAJOR``: the row tiles that share a weight tile run together) or row tile by
row tile; program ``pid`` takes items ``pid + i * num_programs``, or with the row-tile handoff
the next one from a global counter (:func:`.sync.next_item`). The producer and the consumers
each find an item's segment by a forward walk over ``cu_seqlens`` (a program's items only move
forward): no per-item scans. The walks start at the segment of the program's first item, which the
kernel's vector scan of ``cu_seqlens`` finds (:func:`.kernel._totals`; with the handoff, at the first
segment). The walk steps over non-empty segments one scalar load at a time and, with
``SKIP_EMPTY_RUNS`` (the config's ``skip_empty_runs``), over a run of empty ones a whole chunk (one
entry per thread) at a time: with many groups and few live ones (many experts, decode) a load per
empty segment would put hundreds of dependent loads between a program's items. Segment ends
are used as in the Triton kernel (rows masked to ``[0, min(end, NvS))``), so invalid
``cu_seqlens`` give unspecified values, never an out-of-bounds access.

Idle upper halves (``SKIP_IDLE_HALF``): a segment's last row tile whose upper 64 rows all lie past
the segment's end or have weight 0 (``SKIP_BY_WEIGHT``: MoonEP's padding rows) runs its MMAs on
the lower half and stores zeros above. The consumers and, for its half loads, the producer ask
:func:`idle_half` the same question of the same data, so they agree on every tile. The config
table turns it on only where it measures faster: a tile that finishes early breaks the step of
the programs that share its weight tiles. A segment's only row tile shares its weight tiles with
no other, so elsewhere the skip covers those tiles alone (``SKIP_LONE_ONLY``).

Idle tiles (``SKIP_IDLE_TILES``, split rings): on an even grid where the live segments are two row
tiles each (the entry's scan counts them: decode with MoonEP's padding), a segment's last tile
whose rows are all idle is neither loaded nor multiplied, and its rows are stored as zeros;
producer and consumer ask :func:`idle_tile`. The programs then swap items in pairs every other
round (:func:`program_item`, :func:`ring_item`), so that the skipped tiles do not all fall to the
same programs.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def skip_empty(cu_seqlens_ptr, G, group, WARPS: gl.constexpr):
    """The first segment after ``group`` that is not empty (its end above the previous end), or the
    last of the ``32 * WARPS`` segments after ``group`` (or of all) when all of those are empty.
    Returns it and its start and end."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    chunk = group + 1 + gl.arange(0, 32 * WARPS, layout=layout)
    inside = chunk < G
    ends = gl.load(cu_seqlens_ptr + chunk, mask=inside, other=0)
    starts = gl.load(cu_seqlens_ptr + chunk - 1, mask=inside, other=0)
    fallback = gl.minimum(group + 32 * WARPS, G - 1)
    group = gl.min(gl.where(inside & (ends > starts), chunk, fallback), axis=0)
    return group, gl.load(cu_seqlens_ptr + group - 1), gl.load(cu_seqlens_ptr + group)


@gluon.jit
def walk(cu_seqlens_ptr, G, key, scale, group, tiles_before, tiles_through, start, end, BLOCK_M: gl.constexpr,
         WARPS: gl.constexpr, SKIP_EMPTY_RUNS: gl.constexpr):
    """Advance the segment cursor until ``key < tiles_through * scale``. The cursor: the segment
    ``group`` holding rows ``[start, end)``, and the numbers of row tiles before it and through it.
    ``key``: the item with ``scale`` its column tiles per row tile (``GROUP_MAJOR``), else the
    item's row tile with ``scale`` 1. With ``SKIP_EMPTY_RUNS`` runs of empty segments are skipped a
    chunk at a time (:func:`skip_empty`, ``WARPS``: the calling partition's warps); empty segments
    hold no tiles, so the cursor ends where a step per segment would leave it."""
    while (key >= tiles_through * scale) & (group < G - 1):
        group += 1
        start = end
        end = gl.load(cu_seqlens_ptr + group)
        if SKIP_EMPTY_RUNS:
            if (end <= start) & (group < G - 1):
                group, start, end = skip_empty(cu_seqlens_ptr, G, group, WARPS)
        tiles_before = tiles_through
        tiles_through += (gl.maximum(end - start, 0) + BLOCK_M - 1) // BLOCK_M
    return group, tiles_before, tiles_through, start, end


@gluon.jit
def item_coords(item, col_tiles, tiles_before, tiles_through, start, BLOCK_M: gl.constexpr,
                GROUP_MAJOR: gl.constexpr):
    """(first row, column tile) of ``item`` in the segment the cursor holds."""
    if GROUP_MAJOR:
        local = item - tiles_before * col_tiles
        count = gl.maximum(tiles_through - tiles_before, 1)
        return start + (local % count) * BLOCK_M, local // count
    else:
        return start + (item // col_tiles - tiles_before) * BLOCK_M, item % col_tiles


@gluon.jit
def find_item(problem, tiling, features, item, group, tiles_before, tiles_through, start, end, WARPS: gl.constexpr):
    """Move the segment cursor to ``item``'s segment (``WARPS``: the calling partition's): returns
    the new cursor, then the item's first row and column tile."""
    key = item if tiling.GROUP_MAJOR else item // problem.col_tiles
    scale = problem.col_tiles if tiling.GROUP_MAJOR else 1
    group, tiles_before, tiles_through, start, end = walk(problem.cu_seqlens_ptr, problem.G, key, scale, group,
                                                          tiles_before, tiles_through, start, end, tiling.BLOCK_M,
                                                          WARPS, features.SKIP_EMPTY_RUNS)
    row_lo, col_tile = item_coords(item, problem.col_tiles, tiles_before, tiles_through, start, tiling.BLOCK_M,
                                   tiling.GROUP_MAJOR)
    return group, tiles_before, tiles_through, start, end, row_lo, col_tile


@gluon.jit
def row_tile(item, col_tiles, tiles_before, tiles_through, GROUP_MAJOR: gl.constexpr):
    """Index of ``item``'s row tile among all real row tiles (the same in both kernels of a pair:
    same ``cu_seqlens`` and ``BLOCK_M``)."""
    if GROUP_MAJOR:
        return tiles_before + (item - tiles_before * col_tiles) % gl.maximum(tiles_through - tiles_before, 1)
    else:
        return item // col_tiles


@gluon.jit
def rows_idle(row_weights_ptr, lo, end, NUM_ROWS, ROWS: gl.constexpr, BY_WEIGHT: gl.constexpr, WARPS: gl.constexpr):
    """Whether every row of ``[lo, lo + ROWS)`` lies past its segment's end or (``BY_WEIGHT``) has
    weight 0: MoonEP's padding rows, whose output is zero. A NaN weight is not 0: such a row is
    computed."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    rows = lo + gl.arange(0, ROWS, layout=layout)
    live = (rows >= 0) & (rows < gl.minimum(end, NUM_ROWS))
    if BY_WEIGHT:
        live = live & (gl.load(row_weights_ptr + rows, mask=live, other=0.0) != 0.0)
    return gl.max(live.to(gl.int32), axis=0) == 0


@gluon.jit
def idle_half(ON: gl.constexpr, features, problem, row_lo, start, end, BLOCK_M: gl.constexpr, WARPS: gl.constexpr):
    """Whether the item's tile takes the idle-upper-half path (``ON``: the kernel has it): it is
    its segment's last (only such a tile can hold idle rows; with ``SKIP_LONE_ONLY`` its segment's
    only one), the launch skips halves on this layout (``problem.skip_halves``) and its upper half
    is idle."""
    idle = False
    if ON:
        candidate = (row_lo + BLOCK_M >= end) & (problem.skip_halves != 0)
        if features.SKIP_LONE_ONLY:
            candidate = candidate & (row_lo == start)
        if candidate:
            idle = rows_idle(problem.row_weights_ptr, row_lo + BLOCK_M // 2, end, problem.NUM_ROWS, BLOCK_M // 2,
                             features.SKIP_BY_WEIGHT, WARPS)
    return idle


@gluon.jit
def idle_tile(features, problem, row_lo, end, BLOCK_M: gl.constexpr, WARPS: gl.constexpr):
    """Whether the item's tile is skipped (``SKIP_IDLE_TILES``, where the kernel chose to spread
    the items): it is its segment's last and all its rows are idle."""
    idle = False
    if features.SKIP_IDLE_TILES:
        if (row_lo + BLOCK_M >= end) & (problem.spread != 0):
            idle = rows_idle(problem.row_weights_ptr, row_lo, end, problem.NUM_ROWS, BLOCK_M, features.SKIP_BY_WEIGHT,
                             WARPS)
    return idle


@gluon.jit
def programs():
    """This program's id and the number of programs (every program takes items)."""
    return gl.program_id(0), gl.num_programs(0)


@gluon.jit
def program_item(pid, i, num_progs, spread):
    """The id of program ``pid``'s ``i``-th item: ``pid + i * num_progs``, or with ``spread`` (1,
    on an even grid) ``(pid ^ 1) + i * num_progs`` for odd ``i``: every other round the programs
    swap items in pairs. Group-major items of two-tile segments alternate between lower and upper
    tiles; with the plain stride on an even grid every item of a program would be an upper tile or
    every one a lower tile (so skipping the idle upper tiles would leave half the programs without
    work), with the swap a program's items alternate."""
    return (pid ^ (i & spread)) + i * num_progs


@gluon.jit
def ring_item(j, spread, RING: gl.constexpr):
    """With split rings, the program's local item (:func:`program_item`) that ring ``RING`` takes
    ``j``-th: every other one (0, 2, 4, ... and 1, 3, 5, ...), or with ``spread`` (1) alternate
    pairs (0, 3, 4, 7, ... and 1, 2, 5, 6, ...), so that where a program's items alternate between
    lower and upper tiles each ring's do too."""
    return 2 * j + (RING ^ (j & spread))
