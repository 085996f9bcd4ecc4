"""Kernels per device. Importing this package registers every kernel with the dispatcher.

- :mod:`.cpu`: reference-quality CPU kernels (per-segment ``torch.mm``); CI exercises these.
- :mod:`.cuda`: Triton kernels for NVIDIA GPUs from sm80; Triton is imported at first call.
"""

from . import cpu, cuda  # noqa: F401  (registration side effects)
from . import cpu_backward, cuda_backward  # noqa: F401,E402  (backward ops, issue 7)
