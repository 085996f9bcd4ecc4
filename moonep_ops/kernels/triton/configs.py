"""Block configs of the Triton kernels, forward and backward, and the tables that pick them.

No autotuning at call time (it cannot run inside CUDA-graph capture, and it would make a call's
cost depend on history): a config is a pure function of the problem's static metadata
``(N, K, NvS, dtype, device capability)`` and the installed Triton release; ``capability`` is
None for the interpreter (CPU tensors). Nothing here queries CUDA at import.
``tests/test_configs.py`` pins the picks; ``benchmarks/tune.py`` and ``tune_backward.py``
measure candidates, docs/performance.md gives each rule's measurements.
"""

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1  # persistent grid size = SMs * programs_per_sm
    # Hopper schedule knobs of the persistent GEMM kernel (the TMA path only):
    flatten: bool = False  # software-pipeline across tiles (next tile's loads under this epilogue)
    warp_specialize: bool = False  # producer/consumer warps (Triton's automatic warp specialization)
    tma_store: int = 0  # full tiles stored by TMA in this many column pieces (0: masked stores only)
    group_major: bool = False  # items segment by segment, row tiles fastest (a weight tile's readers together)


@dataclasses.dataclass(frozen=True)
class EltwiseConfig:
    block_rows: int
    block_cols: int
    num_warps: int


# Small blocks for TRITON_INTERPRET=1 on CPU tensors: the interpreter runs numpy per block,
# so small tiles keep tests quick while still crossing block edges on odd sizes.
INTERPRETER_GEMM = GemmConfig(16, 16, 16, 1, 1)
INTERPRETER_ELTWISE = EltwiseConfig(16, 16, 1)

# fp32 operands take twice the shared memory per element (and IEEE fp32 dots are slow anyway).
_FP32_GEMM = GemmConfig(64, 64, 32, 4, 3)
_FP32_TWO_ACCUMULATORS = GemmConfig(64, 32, 32, 4, 3)


@functools.cache
def triton_release() -> tuple[int, int]:
    """The installed Triton's (major, minor) (imported here only once a CUDA config is asked for)."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def warp_specialization_compiles(capability: tuple[int, int]) -> bool:
    """Whether Triton's automatic warp specialization compiles the GEMM kernel for ``capability``:
    on sm90 with every supported Triton; on sm100 from Triton 3.7 (3.6, torch 2.11's, fails in its
    ``NVWSInsertAref`` pass there; ``scripts/aot_compile_check.py --targets 100`` shows it)."""
    return capability < (10, 0) or triton_release() >= (3, 7)


def gemm_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                capability: tuple[int, int] | None) -> GemmConfig:
    """A grouped GEMM producing ``[num_rows, n]`` with reduction ``k``."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return _FP32_GEMM
    if capability >= (9, 0):
        # Warp specialization on long compute-bound problems, a long reduction in BLOCK_K 128,
        # else the flattened loop; segment-major items where warp specialization is off.
        if num_rows >= 32768 and k >= 2048 and warp_specialization_compiles(capability):
            return GemmConfig(128, 256, 64, 8, 4, warp_specialize=True)
        if k >= 8192:
            return GemmConfig(128, 128, 128, 8, 3, group_major=True)
        return GemmConfig(128, 256, 64, 8, 4, flatten=True, group_major=True)
    return GemmConfig(128, 128, 32, 8, 3)  # sm80/sm86/sm89: ~100-164 KB of shared memory


def fused_gemm_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                      capability: tuple[int, int] | None) -> GemmConfig:
    """The fused gate/up GEMM: two accumulators, so half the columns per tile."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return _FP32_TWO_ACCUMULATORS
    if capability >= (9, 0):
        # Warp specialization on long compute-bound problems, TMA stores of whole tiles elsewhere.
        if num_rows >= 32768 and k >= 4096 and warp_specialization_compiles(capability):
            return GemmConfig(128, 128, 64, 8, 3, warp_specialize=True)
        return GemmConfig(128, 128, 64, 8, 4, tma_store=2, group_major=True)
    return GemmConfig(128, 64, 64, 8, 3)  # 96 KB of shared memory: fits sm86/sm89 too


def dgrad_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                 capability: tuple[int, int] | None, dual: bool = False) -> GemmConfig:
    """M-grouped ``[num_rows, n]`` input gradients (reduction ``k``), single or ``dual``."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return _FP32_GEMM
    if capability >= (9, 0):
        # 128x256 tiles with TMA on the transposed weights: a short single reduction overlaps each
        # tile's epilogue with the next tile's loads; otherwise 3 stages below 32768 rows, 4 above.
        if k <= 2048 and not dual:
            return GemmConfig(128, 256, 64, 8, 4, flatten=True)
        return GemmConfig(128, 256, 64, 8, 3 if num_rows < 32768 else 4)
    return GemmConfig(128, 128, 32, 8, 3)


def fused_backward_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                          capability: tuple[int, int] | None) -> GemmConfig:
    """Recomputed gate/up (two fp32 accumulators) plus the activation backward epilogue."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return _FP32_TWO_ACCUMULATORS
    return GemmConfig(128, 64, 64, 8, 3)


def wgrad_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                 capability: tuple[int, int] | None) -> GemmConfig:
    """``dW [G, N, K] = grad_out^T @ a`` per segment: ``block_n`` x ``block_k`` is the output
    tile, ``block_m`` the step over a segment's rows (the reduction)."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return GemmConfig(32, 64, 64, 4, 3)
    if capability >= (9, 0):
        return GemmConfig(32, 128, 128, 4, 3)  # short row steps, 4 warps: more CTAs per SM
    return GemmConfig(32, 128, 128, 8, 3)  # sm80/sm86/sm89: less shared memory


def eltwise_config(cols: int, capability: tuple[int, int] | None) -> EltwiseConfig:
    if capability is None:
        return INTERPRETER_ELTWISE
    return EltwiseConfig(16, 256 if cols >= 256 else 128, 4)
