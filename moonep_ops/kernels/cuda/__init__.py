"""CUDA: op registration (:mod:`.register`), kernel-path choice (:mod:`.paths`), and the experts
op's GEMM pair (:mod:`.experts`)."""

from . import register  # noqa: F401  (registers the CUDA kernels)
