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
    # A different but reproducible draw per test: the test id seeds the generator.
    seed = abs(hash(request.node.nodeid)) % (2 ** 31)
    torch.manual_seed(seed)
    yield
