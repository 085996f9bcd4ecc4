"""Deterministic block configs for the Triton kernels.

No autotuning at call time (it cannot run inside CUDA-graph capture, and it would make a
call's cost depend on history): a config is a pure function of the problem's static
metadata ``(N, K, NvS, dtype, device capability)``. Nothing here queries CUDA at import.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1  # persistent grid size = SMs * programs_per_sm
    # Hopper schedule knobs of the persistent forward kernel (ignored elsewhere):
    flatten: bool = False  # software-pipeline across tiles (next tile's loads under this epilogue)
    warp_specialize: bool = False  # producer/consumer warps (Triton's automatic warp specialization)
    tma_store: int = 0  # full tiles stored by TMA in this many column pieces (0: masked stores only)
    group_major: bool = False  # items segment by segment, row tiles fastest (a weight tile's readers together)


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """Config of the warp-specialized Gluon kernel (:mod:`.gluon_grouped_gemm`, sm90 only)."""
    block_n: int = 128
    stages: int = 5
    pingpong: bool = True  # two consumer warpgroups on alternate tiles (else both on each tile)
    group_major: bool = True
    block_m: int = 128
    block_k: int = 64
    producer_regs: int = 40
    consumer_regs: int = 232
    tail_by_producer: bool = True  # the producer warp zeroes the tail, spread over its loads
    stacked: bool = False  # fused: gate and up tiles stacked, one wgmma of 2 * block_n columns (a probe candidate)
    # a segment's last row tile whose upper 64 rows are idle (past the end, or route weight 0:
    # MoonEP's padding) runs its MMAs on the lower half only and stores zeros above
    skip_idle_half: bool = False
    # with skip_idle_half: the producer loads only the lower half of such a tile's `a` rows (the
    # rows its MMAs read), so that the idle rows cost no DRAM or L2 bytes either
    half_loads: bool = True
    # fused GEMM of the experts op: its producer warp also zeroes the down GEMM's output tail (spread
    # over its loads, while the GEMM computes), so that the down GEMM writes only real rows
    takes_out_tail: bool = False
    # columns per epilogue store (0: the whole tile; block_n / 2: a split epilogue, whose half-size
    # buffer leaves shared memory for another stage of the ring)
    epilogue_n: int = 0
    # fused GEMM of the experts op: hand act to the down GEMM row tile by row tile (its programs take
    # items dynamically and start on finished row tiles instead of waiting for this whole grid)
    handoff: bool = False
    # columns per TMA store of the producer's zero buffer (TAIL_BY_PRODUCER; 0: the epilogue's),
    # 2 KiB a store: 256 makes 4 x 256 boxes, whose rows leave in one 512-byte piece each
    zero_cols: int = 0

    def __post_init__(self):
        if self.epilogue_n not in (0, self.block_n, self.block_n // 2):
            raise ValueError(f"GluonConfig: epilogue_n must be 0 or block_n = {self.block_n} (the whole tile) or "
                             f"block_n // 2 = {self.block_n // 2}, got {self.epilogue_n}")
        if self.zero_cols not in (0, 64, 128, 256):
            raise ValueError(f"GluonConfig: zero_cols must be 0, 64, 128 or 256, got {self.zero_cols}")


@dataclasses.dataclass(frozen=True)
class EltwiseConfig:
    block_rows: int
    block_cols: int
    num_warps: int


# Small blocks for TRITON_INTERPRET=1 on CPU tensors: the interpreter runs numpy per block,
# so small tiles keep tests quick while still crossing block edges on odd sizes.
INTERPRETER_GEMM = GemmConfig(16, 16, 16, 1, 1)
INTERPRETER_ELTWISE = EltwiseConfig(16, 16, 1)


def gemm_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                capability: tuple[int, int] | None) -> GemmConfig:
    """Block config for a grouped GEMM producing ``[num_rows, n]`` with reduction ``k``.

    ``capability`` is None for the interpreter (CPU tensors).
    """
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        # fp32 operands take twice the shared memory per element; IEEE fp32 dots are slow anyway.
        return GemmConfig(64, 64, 32, 4, 3)
    if capability >= (9, 0):
        # benchmarks/results/tune_schedules_h200.json (down GEMM of the six BASELINE shapes):
        # warp specialization wins on long compute-bound problems (kimi-k2 prefill: -12%), the
        # flattened loop (next tile's loads under this epilogue) on the rest (-2..-7%), BLOCK_K 128
        # on a long reduction (llama4 down, K = 8192: -4%). Hopper-only knobs: the portable
        # path drops them (see triton_grouped_gemm._plan).
        # Segment-major item order (group_major: the row tiles that share a weight tile run
        # together) cut kimi-k2 S=1024 -5% and llama4 -2% on this GEMM; with warp
        # specialization it loses (benchmarks/results/probe_h200_group_major*.json).
        if num_rows >= 32768 and k >= 2048:
            return GemmConfig(128, 256, 64, 8, 4, warp_specialize=True)
        if k >= 8192:
            return GemmConfig(128, 128, 128, 8, 3, group_major=True)
        return GemmConfig(128, 256, 64, 8, 4, flatten=True, group_major=True)
    return GemmConfig(128, 128, 32, 8, 3)  # sm80/sm86/sm89: ~100-164 KB of shared memory


def fused_gemm_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                      capability: tuple[int, int] | None) -> GemmConfig:
    """Config for the fused gate/up GEMM: two accumulators, so half the columns per tile."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return GemmConfig(64, 32, 32, 4, 3)
    if capability >= (9, 0):
        # benchmarks/results/tune_schedules_h200.json: warp specialization on long compute-bound
        # problems (kimi-k2 prefill: -8%), TMA stores of whole tiles (in two halves) elsewhere
        # (-1..-10%; best or within 1% on the other five shapes).
        # group_major: kimi-k2 S=1024 -7%, llama4 -5% here (see gemm_config).
        if num_rows >= 32768 and k >= 4096:
            return GemmConfig(128, 128, 64, 8, 3, warp_specialize=True)
        return GemmConfig(128, 128, 64, 8, 4, tma_store=2, group_major=True)
    return GemmConfig(128, 64, 64, 8, 3)  # 96 KB of shared memory: fits sm86/sm89 too


def gluon_gemm_config(n: int, k: int, num_rows: int, fused: bool) -> GluonConfig:
    """Config of the Gluon kernel (Hopper, bf16/fp16) for ``[num_rows, n]`` with reduction ``k``.

    benchmarks/results/probe_gluon_h200.json (the six BASELINE shapes, padded and unpadded):
    ping-pong consumers (a warpgroup per 128-row tile, one's epilogue under the other's main loop)
    win where tiles are short or the problem is memory-bound; both warpgroups on one tile
    (cooperative, 64 rows each) on the long compute-bound fused GEMMs (kimi-k2 S=1024 and prefill)
    and on the plain GEMMs with short reductions (qwen3's down GEMM, K = 768) or few rows.

    Wider cooperative tiles where the board runs at its power cap (thirteenth session,
    benchmarks/results/power_h200_ab_*.json: the experts op's pair with candidate overrides,
    interleaved for 1 s each on a hot GPU; under the cap the time follows the energy per call,
    and a wider tile reads fewer L2 bytes per FLOP: 3/256 operand elements per multiply-add
    instead of 1/64). Only where they were measured:
    - plain GEMMs in 128x256 tiles where 2048 <= K < 4096 and N >= 4096, i.e. kimi-k2's down GEMM
      (K = 2048, N = 7168): S=1024 -1.8%, prefill -1.1%, decode +0.1%. The same tiles lost on
      qwen3's down GEMM (K = 768) at S=64, +2.8%, and on llama4's (K = 8192), +1.4%; the gate/up
      GEMMs of the unfused path were not measured under load with them. A cool-board probe had
      ranked them +3% on kimi-k2 S=1024: cool, the narrow tile's extra stages win; hot, the bytes.
    - the fused GEMM in 128x(128+128) tiles for large capacities with H < 4096 (num_rows >= 40960:
      qwen3 S=2048 -1.3%; at S=64, NvS 33024, the same tiles stacked were +3.5%).

    Idle upper halves (``skip_idle_half``, fifteenth session, benchmarks/results/probe_idle_h200.json
    and power_h200_ab_idle_half*.json): a segment's last row tile whose upper 64 rows all have
    route weight 0 (MoonEP's padding) or lie past the end runs its MMAs on the lower half. Such a
    tile finishes early and its program runs ahead of the programs that share its next weight
    tiles through L2 (segment-major items stay in step only while every item costs the same), so
    where segments span several row tiles the skip costs DRAM reads: +8% on kimi-k2 S=1024's
    fused GEMM, +13% at prefill, +30% in ping-pong tiles. Picked where it measured a gain and no
    such loss: the cooperative fused GEMM at NvS >= 40960 with H < 4096 (qwen3 S=2048: -2.0%) and
    kimi-k2's down GEMMs below NvS 32768 (decode -1.3%, S=1024 -2.4%). kimi-k2 decode's fused GEMM
    also gained (-1.8%, segments of one row tile each) but shares its config with unpadded
    S=1024's (NvS 8192), which lost 7%: not picked.

    The experts op's output tail zeroed by the fused GEMM's producer while it computes
    (``takes_out_tail``, fifteenth session, benchmarks/results/power_h200_ab_out_tail*.json)
    instead of by the down GEMM: qwen3 S=2048 -0.7% (cool) / -1.7% (sustained), where the fused
    GEMM leaves DRAM write bandwidth and the down GEMM's tail is half its output; +0.6 to +3.4%
    on kimi-k2 decode and S=1024 and on qwen3 S=64, flat on prefill and llama4: picked for the
    NvS >= 40960 fused tiles only.

    A split epilogue for kimi-k2 S=1024's down GEMM (``epilogue_n``, sixteenth session,
    benchmarks/results/power_h200_ab_split_epilogue*.json): its 128x256 tiles leave in two column
    halves through a 32 KiB buffer, which makes room for a fourth stage. Nsight Compute had shown
    that GEMM at 70% of DRAM and 55% of SM throughput, i.e. short of loads in flight. Against three
    stages: S=1024 -2.6% cool, -0.2% sustained; decode +0.6% / +0.1% and prefill +0.9% / -0.6%,
    so only 16384 <= NvS < 32768 takes it.

    The row-tile handoff to the down GEMM (``handoff``, seventeenth session,
    benchmarks/results/power_h200_ab_handoff*.json): kimi-k2 decode -2.1% cool, -2.3% sustained;
    flat on unpadded kimi-k2 S=1024 (NvS 8192, the same fused config) and padded S=1024; +0.9 to
    +1.7% sustained on prefill, both qwen3 shapes and llama4 (the per-row-tile signals, the
    state's memset and the dynamic schedule cost more there than the early start buys), so only
    the fused config with H >= 4096 below NvS 16384 takes it. The producers' zeros in 4 x 256
    boxes (``zero_cols``, power_h200_ab_zero_box*): within 0.2% sustained everywhere: not picked.

    Half loads (``half_loads``, eighteenth session, benchmarks/results/power_h200_ab_half_loads*.json):
    a tile that skips its idle upper half no longer loads that half's rows of ``a`` either (on by
    default with the skip: fewer DRAM and L2 bytes; -0.6% sustained on qwen3 S=2048, -0.7% on
    kimi-k2 S=1024). With it, two skips the table had left out now gain: qwen3 S=2048's down GEMM
    (NvS >= 40960 with K < 2048; -0.8% sustained, -2.5% cool, where whole loads had cost +1.3%) and
    kimi-k2 decode's fused GEMM (12288 <= NvS < 16384 with H >= 4096; -5.1% sustained, -2.9% cool:
    its segments are one row tile each, so no tile has a partner to drift from). Unpadded kimi-k2
    S=1024 (NvS 8192, the same fused branch) lost 7% with the whole-load skip and stays out.

    The tail's zeros (benchmarks/results/probe_gluon_h200_tail_pdl.json): written by the producer
    warp between its loads where the reduction is long (K >= 2048: kimi-k2 decode's down GEMM,
    half of whose rows are tail, -2.6%), by the consumers after their items where it is short
    (qwen3's K = 768: the producer's small stores were +2.5% there).
    """
    tail_by_producer = k >= 2048
    if fused:
        if k >= 4096 and num_rows >= 8192:
            return GluonConfig(block_n=128, stages=4, pingpong=False, group_major=num_rows < 32768,
                               tail_by_producer=tail_by_producer, handoff=num_rows < 16384,
                               skip_idle_half=12288 <= num_rows < 16384)
        if num_rows >= 40960:
            return GluonConfig(block_n=128, stages=4, pingpong=False, tail_by_producer=tail_by_producer,
                               skip_idle_half=True, takes_out_tail=True)
        # two accumulators of 64 columns per warpgroup
        return GluonConfig(block_n=64, stages=6, tail_by_producer=tail_by_producer)
    if 2048 <= k < 4096 and n >= 4096:
        # 48 KiB per stage and a 64 KiB output buffer: three stages fit; four with a split
        # epilogue (a 32 KiB buffer, the tile stored in two column halves), picked where it gained
        split = 16384 <= num_rows < 32768
        return GluonConfig(block_n=256, stages=4 if split else 3, pingpong=False, tail_by_producer=tail_by_producer,
                           skip_idle_half=num_rows < 32768, epilogue_n=128 if split else 0)
    if k >= 8192 or (num_rows >= 32768 and k >= 2048):
        return GluonConfig(block_n=128, stages=5, tail_by_producer=tail_by_producer)
    return GluonConfig(block_n=128, stages=6, pingpong=False, tail_by_producer=tail_by_producer,
                       skip_idle_half=num_rows >= 40960)


def eltwise_config(cols: int, capability: tuple[int, int] | None) -> EltwiseConfig:
    if capability is None:
        return INTERPRETER_ELTWISE
    return EltwiseConfig(16, 256 if cols >= 256 else 128, 4)
