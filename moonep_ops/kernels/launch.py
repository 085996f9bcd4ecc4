"""Direct launches of compiled Triton and Gluon kernels.

Eager host cost matters (vLLM runs MoonEP eagerly): ``JITFunction.run`` re-derives a kernel's
specialization from every argument on every call, and ``TensorDescriptor`` re-validates its
geometry. The launchers memoize a *plan* per static signature (:mod:`moonep_ops.cache`: a finer
key than Triton's own specialization, so the cached compiled kernel is always the one Triton
would pick) and then call the compiled kernel's launcher directly, as ``JITFunction.run`` does
at its end. A Triton without that launcher API takes the normal path;
``MOONEP_OPS_FAST_LAUNCH=0`` (read at import) does the same on purpose.
"""

import dataclasses

from .. import flags

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton too old for this shortcut
    _knobs = _driver = TensorDescriptor = None

ENABLED = _knobs is not None and flags.fast_launch()


if TensorDescriptor is not None:
    _DESC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                      if f.default is not dataclasses.MISSING}


def tensor_descriptor(base, shape, strides, block_shape):
    """A TensorDescriptor without ``__post_init__``'s checks (the caller validated the
    geometry once, when it built the plan); defaults of newer Triton fields kept."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DESC_DEFAULTS)
    desc.base, desc.shape, desc.strides, desc.block_shape = base, shape, strides, block_shape
    return desc


def launch_compiled(kernel, grid: tuple, args: list) -> None:
    """Launch an already compiled kernel with its full argument list (constexprs included)."""
    device = _driver.active.get_current_device()
    stream = _driver.active.get_current_stream(device)
    kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata,
               kernel.launch_metadata(grid, stream, *args),
               _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *args)
