import os
import zlib

import pytest
import torch

import moonep_ops  # noqa: F401  (registers the ops)

from . import subprocess_jobs

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible draw per test: the test id seeds the generator
    # (crc32, unlike hash(), is not salted per process, so pytest-xdist workers agree).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


# --- subprocess suites (tests/subprocess_jobs.py) ----------------------------------------------

def pytest_configure(config):
    config.addinivalue_line("markers", "subprocess_job(name): the test reads the result of a background "
                                       "subprocess job (tests/subprocess_jobs.py)")


def pytest_collection_modifyitems(config, items):
    # Tests that wait for a subprocess job go last, so the in-process tests run beside the jobs.
    items.sort(key=lambda item: item.get_closest_marker("subprocess_job") is not None)


def pytest_collection_finish(session):
    if (session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER")
            or not subprocess_jobs.available()):
        return
    names = [name for item in session.items for mark in item.iter_markers("subprocess_job") for name in mark.args]
    subprocess_jobs.prestart(names)


def pytest_sessionfinish(session, exitstatus):
    subprocess_jobs.stop_all()
