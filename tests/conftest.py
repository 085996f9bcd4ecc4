import zlib

import pytest
import torch

import moonep_ops  # noqa: F401  (registers the ops)

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
