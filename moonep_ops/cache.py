"""The static signature of a call: what a metadata check or a launch plan depends on.

Per tensor: sizes, strides, dtype, device and the 16-byte alignment of its data pointer (TMA
descriptors and Triton's specialization depend on it), never the data. Two calls with the same
signature pass the same checks and take the same launch plan, so both are cached by it
(:mod:`moonep_ops.checks`, the kernel launchers); a process sees few signatures, so entries never
expire.
"""


def signature(*tensors) -> tuple:
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                 for t in tensors)
