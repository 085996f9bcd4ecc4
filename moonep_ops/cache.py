"""The static signature of a call: what a metadata check or a launch plan depends on.

Never the data: two calls with the same signature pass the same checks and take the same launch
plan, so both are cached by it (:mod:`moonep_ops.checks`, the kernel launchers); a process sees
few signatures, so entries never expire.
"""


def signature(*tensors) -> tuple:
    """What the metadata checks read: per tensor its sizes, strides, dtype, device and the 16-byte
    alignment of its data pointer (None stays None)."""
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                  for t in tensors])


def layout_signature(first, *tensors) -> tuple:
    """What a launch plan reads of checked operands: the first tensor's dtype and device (the
    checks tie the others' to them) and per tensor its sizes, strides and 16-byte alignment (TMA
    descriptors and Triton's specialization depend on it)."""
    return (first.dtype, first.device, first.shape, first.stride(), first.data_ptr() % 16,
            *[None if t is None else (t.shape, t.stride(), t.data_ptr() % 16) for t in tensors])
