"""Shared by tests/ and compile_tests/.

Under pytest-xdist every worker would start torch with one intra-op thread per core: with 15
workers on the GPU machine's 16 cores that is 240 OpenMP threads, and the float64 references
(thousands of small CPU ops for G = 1100) slowed from seconds to minutes, past the GPU suite's
300 s per-test timeout. Each worker gets its share of the cores instead.
"""
import os


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
