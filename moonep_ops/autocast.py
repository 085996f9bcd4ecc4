"""Autocast for the ``moonep`` ops: inside ``torch.autocast`` (CPU or CUDA) the GEMM ops run in the
region's dtype, as ``torch.mm`` does there.

- The GEMM ops (``grouped_gemm``, ``grouped_gemm_silu_mul``, its ``_with_gate_up`` form,
  ``experts``) cast ``x`` (``a``) and the weights to the autocast dtype. ``route_weights`` stays
  fp32 and ``cu_seqlens`` int32 (the ops' contract); float64 tensors are left alone, as autocast
  leaves them.
- ``silu_mul_weight`` casts ``gate`` and ``up`` to the wider of their dtypes when they differ
  (autocast's promote rule for elementwise ops).
- The FP8 ops cast ``x`` (``a``) alone: their e4m3 weights and fp32 scales stay as they are.
- The ``_out`` ops run as called (the output buffer fixes the dtype), and so do the backward ops
  (the backward runs outside the autocast region).

Every op runs with autocast off inside (as ``torch.library.register_autocast`` arranges): a kernel
that calls other ``moonep`` ops gets no second cast.

The casts are ordinary differentiable copies: fp32 master weights get fp32 gradients.
"""

import torch

from .schemas import SCHEMAS, lib, op

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# op -> positions of the operands cast to the autocast dtype (the other ops cast nothing)
LOWER_PRECISION = {
    "grouped_gemm": (0, 1),
    "grouped_gemm_silu_mul": (0, 1, 2),
    "grouped_gemm_silu_mul_with_gate_up": (0, 1, 2),
    "experts": (0, 1, 2, 3),
    "grouped_gemm_fp8": (0,),
    "experts_fp8": (0,),
}
PROMOTE = {"silu_mul_weight": (0, 1)}  # op -> positions cast to the widest of their dtypes


def _castable(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64
            and t.dtype not in _FP8_DTYPES)


def cast(tensors: tuple, dtype: torch.dtype) -> tuple:
    """``tensors`` with each castable one (floating point, not float64, not FP8) in ``dtype``."""
    return tuple(t.to(dtype) if _castable(t) and t.dtype is not dtype else t for t in tensors)


def cast_if_enabled(tensors: tuple) -> tuple:
    """:func:`cast` to the autocast dtype of the first tensor's device where autocast is on there
    (what the ops' autocast kernels do: the public API casts first, so that its own checks see the
    dtypes the ops will). Anything but tensors is left for the checks to name."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    device_type = None if first is None else first.device.type
    if device_type in _AUTOCAST_KEYS and torch.is_autocast_enabled(device_type):
        return cast(tensors, torch.get_autocast_dtype(device_type))
    return tensors


def _promoted(tensors: tuple) -> tuple:
    dtypes = {t.dtype for t in tensors if _castable(t)}
    if len(dtypes) < 2:
        return tensors
    wider = dtypes.pop()
    for dtype in dtypes:
        wider = torch.promote_types(wider, dtype)
    return cast(tensors, wider)


def _kernel(name: str, positions: tuple, device_type: str, promote: bool):
    """The op's autocast kernel for ``device_type``: the operands at ``positions`` cast, then the op
    with this device's autocast key excluded."""
    overload = op(name)
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _AUTOCAST_KEYS[device_type]))

    def run(*args):
        args = list(args)
        chosen = tuple(args[i] for i in positions)
        chosen = _promoted(chosen) if promote else cast(chosen, torch.get_autocast_dtype(device_type))
        for i, t in zip(positions, chosen):
            args[i] = t
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return overload(*args)

    return overload, run


def _register() -> None:
    rules = [(name, LOWER_PRECISION.get(name, PROMOTE.get(name, ())), name in PROMOTE) for name in SCHEMAS]
    for name, positions, promote in rules:
        for device_type, key in _AUTOCAST_KEYS.items():
            overload, run = _kernel(name, positions, device_type, promote)
            lib.impl(name, lambda _keyset, *args, run=run: run(*args), key, with_keyset=True)
            # (the Python dispatcher, which torch.compile's tracing runs, looks here first)
            overload.py_impl(getattr(torch._C.DispatchKey, key))(run)


_register()
