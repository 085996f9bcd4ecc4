"""Deterministic block configs of the backward kernels (same rules as :mod:`.configs`: a pure
function of static metadata, no autotuning, nothing queried at import).

sm90 entries come from ``benchmarks/results/tune_backward_h200.json`` (each backward GEMM of
a training step on the BASELINE shapes with S >= 1024, timed against ``torch._grouped_mm``).
"""

import torch

from .configs import INTERPRETER_GEMM, GemmConfig


def dgrad_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                 capability: tuple[int, int] | None, dual: bool = False) -> GemmConfig:
    """M-grouped ``[num_rows, n]`` input gradients (reduction ``k``), single or ``dual``."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return GemmConfig(64, 64, 32, 4, 3)
    if capability >= (9, 0):
        # 128x256 tiles, TMA on the transposed weights (W_KN), from the sweeps
        # (tune_backward_h200*.json): a short single reduction (k <= 2048) overlaps each tile's
        # epilogue with the next tile's loads (flattened loop: qwen3 d act -7%); otherwise 3
        # stages below 32768 rows, 4 above (kimi-k2 S=1024 dual -5%, prefill dual -16%). Within 3%
        # of the best on every single and dual dgrad measured.
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
        return GemmConfig(64, 32, 32, 4, 3)
    return GemmConfig(128, 64, 64, 8, 3)


def wgrad_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                 capability: tuple[int, int] | None) -> GemmConfig:
    """Config of ``dW [G, N, K] = grad_out^T @ a`` per segment: ``block_n`` x ``block_k`` is the
    output tile, ``block_m`` the step over a segment's rows (the reduction)."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return GemmConfig(32, 64, 64, 4, 3)
    if capability >= (9, 0):
        # Best or within 2% on all 8 wgrad measurements: short row steps, 4 warps (more CTAs per
        # SM). On kimi-k2 (336 of 388 groups idle) the kernel runs at ~4 TB/s of output stores:
        # the [G, N, K] gradient's size, not the GEMMs, sets its time there.
        return GemmConfig(32, 128, 128, 4, 3)
    return GemmConfig(32, 128, 128, 8, 3)  # sm80/sm86/sm89: less shared memory
