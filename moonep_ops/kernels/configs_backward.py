"""Deterministic block configs of the backward kernels (same rules as :mod:`.configs`: a pure
function of static metadata, no autotuning, nothing queried at import).

The backward kernels use masked pointer loads (no TMA), so on sm90 they take the portable
tile shapes (3 stages, 128x128 or 128x64 tiles: about 96 KB of shared memory), not the
forward's TMA-sized ones.
"""

import torch

from .configs import INTERPRETER_GEMM, GemmConfig


def dgrad_config(n: int, k: int, num_rows: int, dtype: torch.dtype,
                 capability: tuple[int, int] | None) -> GemmConfig:
    """M-grouped ``[num_rows, n]`` input gradients (reduction ``k``), single or dual."""
    if capability is None:
        return INTERPRETER_GEMM
    if dtype == torch.float32:
        return GemmConfig(64, 64, 32, 4, 3)
    if capability >= (9, 0):
        return GemmConfig(128, 128, 64, 8, 3)
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
        return GemmConfig(64, 128, 128, 8, 3)
    return GemmConfig(32, 128, 128, 8, 3)  # sm80/sm86/sm89: less shared memory
