"""Kernels per device; importing this package registers every kernel with the dispatcher.

- :mod:`.cpu`: reference-quality CPU kernels (per-segment ``torch.mm``), forward and backward.
- :mod:`.cuda`: CUDA registration and kernel-path choice; the kernels themselves are in
  :mod:`.triton` (any GPU from sm80) and :mod:`.gluon` (sm90), imported at the first call.
"""

from . import cpu, cuda  # noqa: F401  (registration side effects)
