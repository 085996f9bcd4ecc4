"""Stores of an output tile: masked rows straight from registers, or a tile staged in shared memory."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma


@gluon.jit
def store_rows(out_ptr, vals, rows, cols, row_end, N, stride_om):
    """``out[rows, cols] = vals`` for rows in ``[0, row_end)`` and columns below ``N`` (``rows`` and
    ``cols`` in the slices of ``vals``'s layout)."""
    mask = ((rows >= 0) & (rows < row_end))[:, None] & (cols < N)[None, :]
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], vals, mask=mask)


@gluon.jit
def flush_tile(out_buf, out_desc, problem, row_lo, col0, end, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               WARPS: gl.constexpr):
    """The staged tile in ``out_buf`` (rows from ``row_lo``, columns from ``col0``) to ``out``: a
    tile wholly inside its segment by a TMA store (clipped at NvS and N), a tile cut by its
    segment's end read back in a coalesced layout and stored with a row mask."""
    if (row_lo >= 0) & (row_lo + BLOCK_M <= end):
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row_lo, col0], out_buf)
    else:
        coalesced: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [WARPS, 1], [1, 0])
        res = out_buf.load(coalesced)
        rows = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, coalesced))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, coalesced))
        store_rows(problem.out_ptr, res, rows, cols, gl.minimum(end, problem.NUM_ROWS), problem.N, problem.stride_om)
