import zlib

import pytest
import torch
from torch._dynamo.utils import counters

import moonep_ops  # noqa: F401  (registers the ops)
from tests.sync import sync_errors  # noqa: F401  (shared with the compile tests)

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]
BACKENDS = ["eager", "aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Reproducible per test (crc32, unlike hash(), is not salted per process).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture
def fresh_dynamo():
    """Empty Dynamo caches and counters, so a test can count its own graphs and breaks."""
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def assert_no_graph_breaks():
    breaks = dict(counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"


