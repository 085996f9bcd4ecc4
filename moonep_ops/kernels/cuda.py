"""CUDA kernels (placeholder until the Triton kernels land)."""
