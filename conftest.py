"""Shared by tests/ and compile_tests/.

- ``tests.failure_log``: with ``MOONEP_OPS_FAILURE_LOG=FILE`` every failure is written to FILE as
  it happens (``gpu_check.sh`` points it at its summary).
- Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads, unless
  ``OMP_NUM_THREADS`` says otherwise. Without it every worker starts one OpenMP thread per core
  (15 workers on the GPU machine's 16 cores: 240 threads), and the float64 references, thousands
  of small CPU ops at G = 1100, slow down many times over (``scripts/xdist_threads_check.py``
  shows it on a CPU machine); the likely cause of a G = 1100 test outrunning the GPU suite's 300 s
  per-test timeout in the fourteenth session.
"""
import os

pytest_plugins = ["tests.failure_log"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(max(1, min(torch.get_num_threads(), _cores() // workers)))
