"""What the Gluon kernel hands its partitions, bundled (Triton ``@aggregate`` classes).

:class:`Descriptors` (global memory through TMA), :class:`SharedMemory` (the ring, the epilogue
and zero buffers, the mbarriers), :class:`Problem` (pointers and runtime sizes), :class:`Scales`
(the FP8 block scales), and the compile-time :class:`Tiling` and :class:`Features`. The
constexprs travel as ``gl.constexpr`` fields of an aggregate: in a tuple variable they would be
turned into tensors on assignment.

A worker partition's arguments, flattened field by field, become the ``warp_specialize`` op's
captures in that order (values that no partition reads are dropped), and the generated code
follows that order: the consumers take the shared memory first, the producer the descriptors
first, and reordering fields or arguments changes the machine code, not what it computes.
"""

from typing import Union

from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

# A runtime integer, or a constant where Triton specialized the argument (e.g. one equal to 1).
Int = Union[gl.tensor, gl.constexpr]


@constexpr_function
def _field(value):
    """A Triton value as given; a constant (unwrapped by ``constexpr_function``) as a constexpr."""
    return value if isinstance(value, base_value) else gl.constexpr(value)


@aggregate
class Descriptors:
    """TMA descriptors: ``a`` by row tile and (``SKIP_IDLE_HALF``) by half a row tile (else None),
    ``w`` and ``w_up`` as ``[G * N, K]`` (block-major FP8 weights: ``[G*N*K/128, 128]``), the tensor
    whose tail the producer zeroes by chunk of ``ZERO_ROWS`` rows, ``out`` by epilogue block (the
    whole tile, half its columns for a split epilogue, or half its rows with ``SPLIT_ROWS``)."""
    a: tma.tensor_descriptor
    a_half: Union[tma.tensor_descriptor, gl.constexpr]
    w: tma.tensor_descriptor
    w_up: tma.tensor_descriptor
    zero: tma.tensor_descriptor
    out: tma.tensor_descriptor

    @constexpr_function
    def __init__(self, a, a_half, w, w_up, zero, out):
        self.a = a
        self.a_half = _field(a_half)
        self.w = w
        self.w_up = w_up
        self.zero = zero
        self.out = out


@aggregate
class SharedMemory:
    """The ring of ``STAGES`` stages (``a``, ``w``, ``w_up`` tiles; ``ready``: a stage's loads
    landed; ``empty``: the MMAs that read it finished; with ``HANDOFF`` the id of the item a stage
    starts), one epilogue buffer per consumer, the producer's zero buffer, and the two consumers'
    ``turn`` barriers. Buffers a config does not use alias another one."""
    a_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    w_up_bufs: gl.shared_memory_descriptor
    out_bufs: gl.shared_memory_descriptor
    zero_buf: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    item_ids: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, a_bufs, w_bufs, w_up_bufs, out_bufs, zero_buf, ready, empty, turn, item_ids):
        self.a_bufs = a_bufs
        self.w_bufs = w_bufs
        self.w_up_bufs = w_up_bufs
        self.out_bufs = out_bufs
        self.zero_buf = zero_buf
        self.ready = ready
        self.empty = empty
        self.turn = turn
        self.item_ids = item_ids


@aggregate
class Problem:
    """Pointers and runtime sizes. ``out_ptr``: the output (masked stores); ``row_weights_ptr``:
    a weight per row of ``a`` (route weights, or zeros marking idle rows); ``cu_seqlens_ptr``: the
    segment ends; ``handoff_ptr``: the row-tile handoff's item counter, then one flag per row tile
    (see :mod:`.sync`). ``real_items``: items of real rows; ``live_end``: the tail's first row;
    ``tail_items``: the tail's items; ``col_tiles``: column tiles per row tile;
    ``zero_col_tiles``: column chunks of the tail the producer zeroes; ``spread``: 1 where idle
    tiles are skipped and the programs swap items in pairs every other round (``SKIP_IDLE_TILES``
    on an even grid; :func:`.schedule.program_item`), else 0. ``skip_halves``: 0 where the kernel
    found the live segments long and its config skips idle upper halves only elsewhere
    (``skip_on_long_segments`` False), else 1. ``walk_group``, ``walk_tiles``,
    ``walk_end``: the segment cursor the program's walks start from (:func:`.kernel._totals`; not read
    with the row-tile handoff, whose partitions start at the first segment)."""
    out_ptr: gl.tensor
    row_weights_ptr: gl.tensor
    cu_seqlens_ptr: gl.tensor
    handoff_ptr: gl.tensor
    G: Int
    NUM_ROWS: Int
    N: Int
    K: Int
    stride_om: Int
    FLAG_TARGET: Int
    real_items: Int
    live_end: Int
    tail_items: Int
    col_tiles: Int
    zero_col_tiles: Int
    spread: Int
    skip_halves: Int
    walk_group: Int
    walk_tiles: Int
    walk_end: Int

    @constexpr_function
    def __init__(self, out_ptr, row_weights_ptr, cu_seqlens_ptr, handoff_ptr, G, NUM_ROWS, N, K, stride_om,
                 FLAG_TARGET, real_items, live_end, tail_items, col_tiles, zero_col_tiles, spread, skip_halves,
                 walk_group, walk_tiles, walk_end):
        self.out_ptr = out_ptr
        self.row_weights_ptr = row_weights_ptr
        self.cu_seqlens_ptr = cu_seqlens_ptr
        self.handoff_ptr = handoff_ptr
        self.G = _field(G)
        self.NUM_ROWS = _field(NUM_ROWS)
        self.N = _field(N)
        self.K = _field(K)
        self.stride_om = _field(stride_om)
        self.FLAG_TARGET = _field(FLAG_TARGET)
        self.real_items = _field(real_items)
        self.live_end = _field(live_end)
        self.tail_items = _field(tail_items)
        self.col_tiles = _field(col_tiles)
        self.zero_col_tiles = _field(zero_col_tiles)
        self.spread = _field(spread)
        self.skip_halves = _field(skip_halves)
        self.walk_group = _field(walk_group)
        self.walk_tiles = _field(walk_tiles)
        self.walk_end = _field(walk_end)


@aggregate
class Scales:
    """FP8 (``FP8``) block scales, fp32, each with a contiguous last dimension: ``a``'s per row and
    128 columns ``[NvS, cdiv(K, 128)]``, the weights' per 128 x 128 block ``[G, cdiv(N, 128),
    cdiv(K, 128)]``, and (the fused GEMM) those the epilogue writes for ``act`` ``[NvS, cdiv(N,
    128)]``. A bf16/fp16 kernel gets placeholders that it never reads."""
    a_ptr: gl.tensor
    w_ptr: gl.tensor
    w_up_ptr: gl.tensor
    out_ptr: gl.tensor
    stride_am: Int
    stride_wg: Int
    stride_wn: Int
    stride_ug: Int
    stride_un: Int
    stride_om: Int

    @constexpr_function
    def __init__(self, a_ptr, w_ptr, w_up_ptr, out_ptr, stride_am, stride_wg, stride_wn, stride_ug, stride_un,
                 stride_om):
        self.a_ptr = a_ptr
        self.w_ptr = w_ptr
        self.w_up_ptr = w_up_ptr
        self.out_ptr = out_ptr
        self.stride_am = _field(stride_am)
        self.stride_wg = _field(stride_wg)
        self.stride_wn = _field(stride_wn)
        self.stride_ug = _field(stride_ug)
        self.stride_un = _field(stride_un)
        self.stride_om = _field(stride_om)


@aggregate
class Tiling:
    """Tile shape, ring depth (of a partition's ring: half the stages with ``SPLIT_RING``),
    consumers (2: ping-pong, 1: cooperative), ``SPLIT_RING`` (each ping-pong consumer has its own
    producer and ring), ``SPLIT_ROWS`` (both ping-pong consumers on every item, each on half its
    rows) and item order."""
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_K: gl.constexpr
    STAGES: gl.constexpr
    CONSUMERS: gl.constexpr
    GROUP_MAJOR: gl.constexpr
    SPLIT_RING: gl.constexpr
    SPLIT_ROWS: gl.constexpr

    @constexpr_function
    def __init__(self, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, GROUP_MAJOR, SPLIT_RING=False, SPLIT_ROWS=False):
        self.BLOCK_M = _field(BLOCK_M)
        self.BLOCK_N = _field(BLOCK_N)
        self.BLOCK_K = _field(BLOCK_K)
        self.STAGES = _field(STAGES)
        self.CONSUMERS = _field(CONSUMERS)
        self.GROUP_MAJOR = _field(GROUP_MAJOR)
        self.SPLIT_RING = _field(SPLIT_RING)
        self.SPLIT_ROWS = _field(SPLIT_ROWS)


@aggregate
class Features:
    """The kernel's switches (the entry's flags of the same names; ``CONSUMER_TAIL`` and
    ``PRODUCER_TAIL``: who zeroes the tail rows, if anyone), the handoff's bound on polls, and
    ``BLOCK_MAJOR``: the weights are block-major FP8 (:mod:`moonep_ops.fp8`), their descriptors
    ``[G*N*K/128, 128]`` matrices; ``SKIP_EMPTY_RUNS``: the segment walk's chunked steps over
    empty segments (:func:`.schedule.walk`)."""
    FP8: gl.constexpr
    FUSED: gl.constexpr
    HAS_WEIGHTS: gl.constexpr
    CONSUMER_TAIL: gl.constexpr
    PRODUCER_TAIL: gl.constexpr
    SKIP_IDLE_HALF: gl.constexpr
    SKIP_BY_WEIGHT: gl.constexpr
    SKIP_LONE_ONLY: gl.constexpr
    SKIP_IDLE_TILES: gl.constexpr
    WAIT_PRIOR: gl.constexpr
    SIGNAL_ROWS: gl.constexpr
    HANDOFF: gl.constexpr
    MAX_POLLS: gl.constexpr
    BLOCK_MAJOR: gl.constexpr
    SKIP_EMPTY_RUNS: gl.constexpr

    @constexpr_function
    def __init__(self, FP8, FUSED, HAS_WEIGHTS, CONSUMER_TAIL, PRODUCER_TAIL, SKIP_IDLE_HALF, SKIP_BY_WEIGHT,
                 SKIP_LONE_ONLY, SKIP_IDLE_TILES, WAIT_PRIOR, SIGNAL_ROWS, HANDOFF, MAX_POLLS, BLOCK_MAJOR,
                 SKIP_EMPTY_RUNS):
        self.FP8 = _field(FP8)
        self.FUSED = _field(FUSED)
        self.HAS_WEIGHTS = _field(HAS_WEIGHTS)
        self.CONSUMER_TAIL = _field(CONSUMER_TAIL)
        self.PRODUCER_TAIL = _field(PRODUCER_TAIL)
        self.SKIP_IDLE_HALF = _field(SKIP_IDLE_HALF)
        self.SKIP_BY_WEIGHT = _field(SKIP_BY_WEIGHT)
        self.SKIP_LONE_ONLY = _field(SKIP_LONE_ONLY)
        self.SKIP_IDLE_TILES = _field(SKIP_IDLE_TILES)
        self.WAIT_PRIOR = _field(WAIT_PRIOR)
        self.SIGNAL_ROWS = _field(SIGNAL_ROWS)
        self.HANDOFF = _field(HANDOFF)
        self.MAX_POLLS = _field(MAX_POLLS)
        self.BLOCK_MAJOR = _field(BLOCK_MAJOR)
        self.SKIP_EMPTY_RUNS = _field(SKIP_EMPTY_RUNS)
