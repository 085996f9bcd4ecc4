"""Configs of the warp-specialized Gluon kernel (sm90, bf16/fp16) and the table that picks them.

A config is a pure function of static metadata (no autotuning: it cannot run inside CUDA-graph
capture). ``tests/test_configs.py`` pins the picks; docs/performance.md gives each rule's
measurements.
"""

import dataclasses

# Registers per thread of the warp-specialized partitions (setmaxnreg): the producer warp issues
# TMA loads and needs few; a consumer warpgroup holds up to two fp32 accumulators and a product.
PRODUCER_REGS = 40
CONSUMER_REGS = 232


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    block_n: int = 128
    stages: int = 5  # shared-memory ring depth
    pingpong: bool = True  # two consumer warpgroups on alternate tiles (else both on each tile)
    group_major: bool = True  # items segment by segment: the row tiles sharing a weight tile run together
    block_m: int = 128
    block_k: int = 64
    tail_by_producer: bool = True  # the producer warp zeroes the tail, spread over its loads
    # a segment's last row tile whose upper 64 rows are idle (past the end, or route weight 0:
    # MoonEP's padding) runs its MMAs on the lower half only and stores zeros above; its producer
    # loads only the lower half of its `a` rows
    skip_idle_half: bool = False
    # with skip_idle_half: only where the tile is its segment's only row tile. No other row tile
    # reads its weight tiles, so finishing early puts no program that shares them out of step
    skip_lone_tiles_only: bool = False
    # with skip_idle_half: also where the kernel's scan of cu_seqlens finds live segments of more
    # than 1.25 row tiles of 128 on average; False: there the launch skips no half (it skips on
    # decode-like layouts only: segments of one row tile, a hot expert's few more)
    skip_on_long_segments: bool = True
    # fused GEMM of the experts op: its producer also zeroes the down GEMM's output tail
    takes_out_tail: bool = False
    # columns per epilogue store (0: the whole tile; block_n / 2: a split epilogue, whose
    # half-size buffer leaves shared memory for another stage of the ring)
    epilogue_n: int = 0
    # fused GEMM of the experts op: hand act to the down GEMM row tile by row tile
    handoff: bool = False
    # ping-pong: each consumer has its own producer warp and half of the ring, so that the two
    # main loops run at once instead of taking turns
    split_ring: bool = False
    # the FP8 GEMMs (64-row tiles, split rings): on an even grid where the live segments are two
    # row tiles each (decode), a segment's last row tile whose rows are all idle (past the end, or
    # weight 0) is neither loaded nor multiplied (its rows are stored as zeros), and the programs
    # swap items in pairs every other round (schedule.program_item)
    skip_idle_tiles: bool = False
    # ping-pong consumers on the same items, each on its own 64 rows of the 128-row tile: both
    # read each stage's weight tiles (half the weight bytes per FLOP of 64-row items), and each
    # releases the stage on its own, so neither waits for the other's scaling (the FP8 GEMMs)
    split_rows: bool = False
    # the segment walk steps over a run of empty segments a chunk at a time (one segment end per
    # thread; schedule.skip_empty) instead of one load per segment
    skip_empty_runs: bool = True
    # one of two launches of a GEMM, each taking the whole GEMM (tail included) where the layout is
    # its kind and nothing otherwise (the kernel counts tiles in its scan of cu_seqlens): True where
    # the live segments average more than one 128-row tile and those tiles hold rows in both 64-row
    # halves (MoonEP's 128-row padding), False elsewhere, None: one launch
    on_multi_tile: bool | None = None

    def __post_init__(self):
        if self.split_rows and (not self.pingpong or self.split_ring or self.handoff or self.skip_idle_tiles
                                or self.block_m != 128):
            raise ValueError(f"GluonConfig: split_rows needs ping-pong on one ring, 128-row tiles, no handoff and no "
                             f"skip_idle_tiles, got pingpong={self.pingpong}, split_ring={self.split_ring}, "
                             f"block_m={self.block_m}, handoff={self.handoff}, skip_idle_tiles={self.skip_idle_tiles}")
        if self.skip_idle_tiles and (not self.split_ring or self.skip_idle_half):
            raise ValueError(f"GluonConfig: skip_idle_tiles needs split rings and no skip_idle_half, got "
                             f"split_ring={self.split_ring}, skip_idle_half={self.skip_idle_half}")
        if self.split_ring and (not self.pingpong or self.handoff or self.stages % 2):
            raise ValueError(f"GluonConfig: split_ring needs ping-pong, no handoff and an even number of stages, got "
                             f"pingpong={self.pingpong}, handoff={self.handoff}, stages={self.stages}")
        if self.on_multi_tile is not None and self.handoff:
            raise ValueError("GluonConfig: on_multi_tile (one of two launches) needs no handoff")
        if self.epilogue_n not in (0, self.block_n, self.block_n // 2):
            raise ValueError(f"GluonConfig: epilogue_n must be 0 or block_n = {self.block_n} (the whole tile) or "
                             f"block_n // 2 = {self.block_n // 2}, got {self.epilogue_n}")

    @property
    def consumers(self) -> int:
        return 2 if self.pingpong else 1

    @property
    def num_warps(self) -> int:
        """Warps of the default (consumer) partition: one warpgroup per consumer in ping-pong,
        two warpgroups sharing each tile otherwise."""
        return 4 if self.pingpong else 8


# Buffers with fewer rows than this per group (segments of a few rows: decode without padding,
# many experts) skip the idle upper halves of their row tiles: most tiles are one segment's only
# tile, mostly idle, and the skip halves their loads of ``a`` and their MMAs (on the layout sweep's
# such cases, 0.55-0.67 of the measured limit before, 0.66-0.93 after). Not in the fused GEMM of
# long reductions in large buffers (``_long_fused``): there a buffer of an expert-parallel rank has
# few rows per group (most groups are other ranks' experts, empty) while its live segments span
# several row tiles, and the skip breaks the step of the programs that share weight tiles (kimi-k2
# S=1024: +7%). Elsewhere the skip is taken where the table below measured it faster, and otherwise on
# segments' only row tiles alone (``skip_lone_tiles_only``): no other row tile shares their weight
# tiles, so such a tile finishing early puts no program out of step. Padded decode has mostly such
# tiles (a 128-row segment with a few real rows); unpadded layouts, some (on the layout sweep's
# cases that had no skip: -2 to -9% on padded decode and unpadded qwen3-sized shapes, the rest within
# noise; the skip of every segment's last tile lost up to 13% on unpadded compute-bound ones).
TINY_SEGMENT_ROWS = 64
# Rows per group above which a buffer of small experts holds segments of several row tiles: two
# 128-row tiles. MoonEP's padding reserves up to 2 x 127 rows per expert, so padded decode buffers
# sit at or just under it (qwen3 S=64: 250 rows per group, a layout-sweep case of 16 real rows per
# group: 256; unpadded qwen3 S=4096 over 132 groups: 248). In the FP8 GEMMs, 64-row items on split
# rings keep both consumers on live tiles there (split rows: 6%, 2% and 4% slower on those); above
# it split rows read each weight tile once for both consumers (6-12% faster on padded qwen3 S=512
# to 8192 and the layout sweep's padded qwen3-30b cases of 272-420 rows per group;
# docs/fp8_measurements.md). The bf16 fused GEMM of large buffers keeps ping-pong at or under it
# (a padded decode buffer of 1000 groups: 7% faster than the cooperative tiles of prefill).
MULTI_TILE_ROWS = 256


def gluon_gemm_config(n: int, k: int, num_rows: int, fused: bool, groups: int = 0) -> GluonConfig:
    """The config for ``[num_rows, n]`` outputs with reduction ``k`` (``fused``: the gate/up GEMM)
    over ``groups`` segments (0: unknown)."""
    tiny = num_rows < TINY_SEGMENT_ROWS * groups
    decode_sized = groups > 0 and num_rows <= MULTI_TILE_ROWS * groups  # (groups 0: unknown)
    cfg = _table_config(n, k, num_rows, fused, tiny, decode_sized)
    if not cfg.skip_idle_half and not (fused and _long_fused(k, num_rows)):
        cfg = dataclasses.replace(cfg, skip_idle_half=True, skip_lone_tiles_only=not tiny)
    return cfg


def _long_fused(k: int, num_rows: int) -> bool:
    """The fused GEMM's cooperative config of long reductions in large buffers (kimi-k2), whose
    idle-half skip is its own."""
    return k >= 4096 and num_rows >= 8192


def _table_config(n: int, k: int, num_rows: int, fused: bool, tiny: bool, decode_sized: bool) -> GluonConfig:
    # The producer zeroes the tail between its loads where the reduction is long; with a short
    # one its small stores cost more than the consumers' zeros after their items.
    tail_by_producer = k >= 2048
    if fused:
        if _long_fused(k, num_rows):
            # Long compute-bound fused tiles: cooperative. The handoff gains only on decode-sized
            # kimi-k2 buffers; the idle-half skip only where segments are one row tile each (decode,
            # padded or not), which the kernel's scan of cu_seqlens tells: on segments of several
            # tiles a row tile finishing early puts the others sharing its weight tiles out of step.
            return GluonConfig(block_n=128, stages=4, pingpong=False, group_major=num_rows < 32768,
                               tail_by_producer=tail_by_producer, handoff=num_rows < 16384,
                               skip_idle_half=True, skip_on_long_segments=False)
        if k >= 5120 and not tiny:
            # Smaller buffers of long reductions whose segments fill row tiles (llama4; H = 7168
            # with few groups): cooperative too, with the lone-tile skip below. At H = 4096
            # (qwen3-235b) it gained nowhere, so those keep ping-pong.
            return GluonConfig(block_n=128, stages=4, pingpong=False, tail_by_producer=tail_by_producer)
        if num_rows >= 40960 and not decode_sized:
            # Large prefill buffers with H < 4096: cooperative 128x(128+128) tiles; the output tail
            # is zeroed here, where the fused GEMM leaves DRAM write bandwidth. Padded decode
            # buffers of many groups (segments of one 128-row tile) keep ping-pong's 64-column
            # accumulators, as in smaller buffers.
            return GluonConfig(block_n=128, stages=4, pingpong=False, tail_by_producer=tail_by_producer,
                               skip_idle_half=True, takes_out_tail=True)
        # two accumulators of 64 columns per warpgroup
        return GluonConfig(block_n=64, stages=6, tail_by_producer=tail_by_producer)
    if n >= 4096 and (2048 <= k < 4096 or (k == 4096 and not tiny)):
        # The down GEMMs of H = 7168 (kimi-k2's I = 2048; I = 4096 from 64 rows per group): 128x256
        # tiles read fewer L2 bytes per FLOP (energy under the power cap). 48 KiB per stage and a
        # 64 KiB output buffer: three stages fit; four with a split epilogue (a 32 KiB buffer),
        # which gains where 16384 <= NvS < 32768. At I = 4096 in padded decode buffers (about 30
        # rows per group) the wide tiles' half as many items lost; at K = 8192 (llama4) they
        # gained nothing.
        split = 16384 <= num_rows < 32768
        return GluonConfig(block_n=256, stages=4 if split else 3, pingpong=False, tail_by_producer=tail_by_producer,
                           skip_idle_half=num_rows < 32768, epilogue_n=128 if split else 0)
    if k >= 8192 or (num_rows >= 32768 and k >= 2048):
        return GluonConfig(block_n=128, stages=5, tail_by_producer=tail_by_producer)
    # Six 32 KiB stages and the 32 KiB output buffer leave 3 KiB of the 227 KiB; the producer's
    # tail buffer and the handoff's barriers need more than that once K reaches 4096 (no
    # benchmark shape: the unfused gate/up GEMMs of H = 7168, I = 4096), so such reductions take five.
    return GluonConfig(block_n=128, stages=5 if k >= 4096 else 6, pingpong=False, tail_by_producer=tail_by_producer,
                       skip_idle_half=num_rows >= 40960)


# Weight elements per group (N x K) from which the FP8 GEMMs split 128-row items between their
# consumers in any buffer of ``TINY_SEGMENT_ROWS`` rows per group or more (kimi-k2: 14.7M, llama4:
# 42M). Smaller experts (qwen3-30b-a3b: 1.6M and 3.1M, qwen3-235b-a22b's down GEMM: 6.3M) do so only
# in buffers of more than ``MULTI_TILE_ROWS`` rows per group.
LARGE_EXPERT = 8 << 20
# Rows per group from which the FP8 GEMMs of large experts under ``TINY_SEGMENT_ROWS`` rows per group
# are two launches (split rings, then split rows; the kernels' scan picks the one that works). The
# launch that takes nothing costs a few µs; below this the buffers measured were decode (segments of
# one 128-row tile, where the split rings work), and the pair cost 0.7-2.8% there (kimi-k2 decode,
# 34.3 rows per group padded; layout-sweep cases of 3.9 and 32.0). From 51.2 rows per group the padded
# buffers measured hold segments of several full tiles, where split rows gained 0.7-6.2% (docs/fp8_measurements.md).
PAIRED_ROWS = 48
# Groups from which the FP8 GEMMs' segment walk steps over runs of empty segments a chunk at a time
# (``skip_empty_runs``). Buffers of many groups hold long runs of empty ones in decode, and a load
# per empty segment cost 19-36% on the layout sweep's cases of G = 260 and 1000 (36-128 live) and 4%
# on kimi-k2 decode (G = 388, 52 live). With fewer groups the walk is short and the chunk's
# registers (spills in the FP8 kernels) cost more: 5-7% on qwen3-30b-a3b S=64 (G = 132, none empty).
MANY_GROUPS = 256


def gluon_fp8_config(n: int, k: int, num_rows: int, fused: bool, groups: int = 0) -> GluonConfig:
    """The config of the FP8 GEMMs (e4m3 ``a`` and weights with block scales): 128-deep K blocks
    (one scale block per stage) and 128 columns (one weight-scale block; the fused GEMM's act scale
    group), on two ping-pong consumers. A consumer's tensor cores idle while it scales a K block's
    product, so the two consumers' main loops run at once, each scaling under the other's MMAs:

    - ``split_rows`` for large experts (``LARGE_EXPERT`` weight elements per group and more: the
      long items of kimi-k2, llama4) in buffers of ``TINY_SEGMENT_ROWS`` rows per group or more, and
      for smaller experts in buffers of more than ``MULTI_TILE_ROWS`` rows per group: both consumers
      on every 128-row item, each on its own 64 rows, one ring whose weight tiles both read: half the
      weight bytes per FLOP of 64-row items (0.6x the L2 bytes in the gate/up GEMM, 0.67x in the
      down GEMM). Four 48 KiB stages (gate/up GEMM) or six 32 KiB ones (down GEMM). A segment's only
      row tile with an idle upper half runs on the lower consumer alone, its producer loading the
      lower half (``skip_idle_half``, ``skip_lone_tiles_only``), except for large experts in buffers
      of 32768 rows and more (prefill), where the check's registers (48 against 24 B of stack in the
      gate/up GEMM) cost more than the skipped halves save.
    - ``split_ring`` elsewhere: decode (MoonEP's 128-row padded segments of a few rows each, or
      unpadded segments of a few rows: under ``TINY_SEGMENT_ROWS`` rows per group) and small
      experts in buffers of up to ``MULTI_TILE_ROWS`` rows per group. 64-row items on each
      consumer's own half of the ring and producer, one consumer's epilogue under the other's main
      loop, and a segment's idle last 64-row tile skipped where the live segments hold two such
      tiles each, on an even grid (``skip_idle_tiles``). On padded decode both consumers then work on
      live tiles, where split rows would leave the upper consumer idle.
    - both, for large experts from ``PAIRED_ROWS`` to ``TINY_SEGMENT_ROWS`` rows per group (and
      more than 128 rows): the rows per group do not tell padded decode (segments of one 128-row
      tile, where the split rings win) or unpadded buffers (segments whose last tile is partly
      empty, where 64-row items multiply fewer rows) from a padded expert-parallel rank's prefill
      (segments of several full tiles, where split rows win), so such a GEMM is two launches
      (``on_multi_tile``, :func:`gluon_fp8_multi_tile_config`), and each kernel's scan of
      ``cu_seqlens`` decides which of the two does the work.

    Either way, runs of empty segments are stepped over a chunk at a time in buffers of
    ``MANY_GROUPS`` groups and more (``skip_empty_runs``), one segment at a time in smaller ones.

    docs/fp8_measurements.md gives the measurements."""
    large = n * k >= LARGE_EXPERT
    chunked_walk = groups >= MANY_GROUPS
    tiny = num_rows < TINY_SEGMENT_ROWS * groups
    multi_tile = groups > 0 and num_rows > MULTI_TILE_ROWS * groups  # (groups 0: unknown)
    if tiny or not (large or multi_tile):
        # (a buffer of up to 128 rows holds no segment of two 128-row tiles)
        paired = large and tiny and num_rows >= PAIRED_ROWS * groups and num_rows > 128
        return GluonConfig(block_m=64, block_n=128, block_k=128, stages=4 if fused else 8, pingpong=True,
                           split_ring=True, tail_by_producer=k >= 2048, skip_idle_tiles=True,
                           skip_empty_runs=chunked_walk, on_multi_tile=False if paired else None)
    long_items = large and num_rows >= 32768
    return GluonConfig(block_m=128, block_n=128, block_k=128, stages=4 if fused else 6, pingpong=True,
                       split_rows=True, tail_by_producer=k >= 2048, skip_idle_half=not long_items,
                       skip_lone_tiles_only=True, skip_empty_runs=chunked_walk)


def gluon_fp8_multi_tile_config(n: int, k: int, num_rows: int, fused: bool, groups: int = 0) -> GluonConfig | None:
    """The second launch of an FP8 GEMM whose :func:`gluon_fp8_config` is the split rings' launch
    (``on_multi_tile=False``), else None: split rows, without the idle-half skip, for layouts
    whose live segments average more than one full 128-row tile."""
    first = gluon_fp8_config(n, k, num_rows, fused, groups=groups)
    if first.on_multi_tile is not False:
        return None
    return GluonConfig(block_m=128, block_n=128, block_k=128, stages=4 if fused else 6, pingpong=True,
                       split_rows=True, tail_by_producer=k >= 2048, skip_empty_runs=first.skip_empty_runs,
                       on_multi_tile=True)
