"""The CUDA functions' validation of a call: the op's argument checks and the device's capability
floor once per static signature (metadata only, no sync), and the values of ``cu_seqlens`` when
``MOONEP_OPS_DEBUG`` asks for them (they sync the host)."""

import functools

from ... import checks
from . import paths

# (lowest capability, what needs it): the bf16/fp16/fp32 kernels need sm80 (bf16 MMAs, the shared
# memory their configs take), the FP8 ones sm89 (e4m3 MMAs).
SM80 = ((8, 0), "the CUDA kernels need an NVIDIA GPU of compute capability 8.0 or newer (sm80+)")
SM89_FP8 = ((8, 9), "FP8 (e4m3) matrix multiply needs a GPU of compute capability 8.9 or newer")


def validate(check, op_name: str, cu_seqlens, *args, floor=SM80) -> tuple:
    """``check(op_name, *args)``, then ``floor`` against the device of ``args[0]``, once per static
    signature; the debug data checks. Returns the signature (the launch plans' key)."""
    key = checks.checked(_on_a_supported_gpu(check, floor), op_name, *args)
    checks.debug_checks(op_name, cu_seqlens, args[0].shape[0])
    return key


@functools.cache
def _on_a_supported_gpu(check, floor):
    """``check``, then the capability of the device its first tensor is on (the signature the check
    is cached by holds the device). A bad argument thus gets its own message first. CPU tensors
    (the AOT compile check) have no capability to check."""
    lowest, needs = floor

    def check_here(op_name: str, *args) -> None:
        check(op_name, *args)
        capability = paths.capability_of(args[0])
        if capability is not None and capability < lowest:
            raise RuntimeError(f"moonep::{op_name}: {needs}; this one is {capability[0]}.{capability[1]}")

    return check_here
