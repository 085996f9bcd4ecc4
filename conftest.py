"""Shared by tests/ and compile_tests/.

Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads, unless
``OMP_NUM_THREADS`` says otherwise. Without the cap every worker starts one OpenMP thread per
core (15 workers on a 16-core machine: 240 threads), and the float64 references, thousands of
small CPU ops at G = 1100, slow down many times over, enough for a test to outrun a per-test
timeout.
"""
import os

import pytest


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


@pytest.fixture(autouse=True)
def _switches_follow_the_environment():
    """``moonep_ops.flags`` reads the per-call switches once; every test starts from the
    environment and leaves no switch behind (this fixture is torn down after ``monkeypatch``)."""
    from moonep_ops import flags

    flags.reload()
    yield
    flags.reload()


@pytest.fixture
def switches(monkeypatch):
    """Set (a string) or clear (None) ``MOONEP_OPS_<NAME>`` switches for the rest of one test:
    ``switches(PDL="0", PORTABLE=None)``."""
    from moonep_ops import flags

    def set_switches(**values):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(f"MOONEP_OPS_{name}", raising=False)
            else:
                monkeypatch.setenv(f"MOONEP_OPS_{name}", value)
        flags.reload()

    return set_switches
