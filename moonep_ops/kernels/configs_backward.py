"""Deterministic block configs of the backward kernels (same rules as :mod:`.configs`: a pure
function of static metadata, no autotuning, nothing queried at import).

The M-grouped backward GEMMs (dgrad, the fused activation backward) use the forward configs;
only the K-grouped weight-gradient GEMM has its own shapes.
"""

import torch

from .configs import INTERPRETER_GEMM, GemmConfig


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
