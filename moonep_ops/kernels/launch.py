"""Direct launches of compiled Triton and Gluon kernels.

Eager host cost matters (vLLM runs MoonEP eagerly): ``JITFunction.run`` re-derives a kernel's
specialization from every argument on every call, ``TensorDescriptor`` re-validates its geometry,
and Triton's launcher encodes every TMA descriptor again on every launch. The GEMM modules
memoize a *plan* per static signature (:mod:`moonep_ops.cache`: a finer key than Triton's own
specialization, so the cached compiled kernel is always the one Triton would pick) and launch
through a :class:`DirectLaunch`, which calls the compiled kernel's launcher as ``JITFunction.run``
does at its end. Where Triton's launcher has the form this module knows (:func:`_raw_launcher`),
the encoded descriptors are cached by base address (weights never change, and the caching
allocator hands ``x``, ``act`` and ``out`` the same blocks call after call) and passed to the
kernel's C entry point directly. A Triton without that launcher API takes the normal path;
``MOONEP_OPS_FAST_LAUNCH=0`` does the same on purpose.
"""

import dataclasses
import functools
import inspect
from typing import Callable

from .. import flags

try:
    import triton
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton too old for this shortcut
    triton = _knobs = _driver = TensorDescriptor = None


def enabled() -> bool:
    """Whether plans launch their compiled kernels directly (else through Triton's JIT each call)."""
    return _knobs is not None and flags.fast_launch()


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


def descriptor_factories(first_index: int, geometries) -> dict:
    """:class:`DirectLaunch`'s ``descriptors`` for Triton TMA descriptors passed as consecutive
    arguments from ``first_index`` on, one ``(shape, strides, block)`` geometry each (None: that
    argument is no descriptor)."""
    return {first_index + i: functools.partial(_descriptor_on, geo) for i, geo in enumerate(geometries)
            if geo is not None}


def _descriptor_on(geometry, base):
    return tensor_descriptor(base, *geometry)


def launch_compiled(kernel, grid: tuple, args: list) -> None:
    """Launch an already compiled kernel with its full argument list (constexprs included)
    through Triton's launcher object."""
    device = _driver.active.get_current_device()
    stream = _driver.active.get_current_stream(device)
    kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata,
               kernel.launch_metadata(grid, stream, *args),
               _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *args)


# Triton releases whose launcher this module calls below its descriptor wrapper (their
# ``CudaLauncher.launch`` closes over the C entry point, the descriptors' argument indices and
# their metadata, and the entry point takes 13 base arguments, then the expanded kernel arguments).
_RAW_LAUNCHER_RELEASES = ("3.5.", "3.6.")
_RAW_BASE_ARGS = 13
_CACHED_DESCRIPTORS = 16  # per descriptor slot; more base addresses than this and the slot starts over


def _raw_launcher(kernel):
    """``(entry point, descriptor indices, descriptor metadata, encode)`` of a compiled kernel's
    launcher when it has the known form and needs no scratch memory, else None."""
    if triton is None or not triton.__version__.startswith(_RAW_LAUNCHER_RELEASES):
        return None
    run = getattr(kernel, "run", None)
    wrapper = getattr(run, "launch", None)
    code = getattr(wrapper, "__code__", None)
    if code is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    try:
        module = inspect.getmodule(type(run))
        encode = module.make_tensordesc_arg
        if module._BASE_ARGS_FORMAT_LEN != _RAW_BASE_ARGS or len(inspect.signature(encode).parameters) != 2:
            return None
        closure = dict(zip(code.co_freevars, (cell.cell_contents for cell in wrapper.__closure__ or ())))
    except (AttributeError, TypeError, ValueError):
        return None
    if set(closure) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or not closure["tensordesc_meta"]:
        return None
    return closure["launcher"], sorted(closure["tensordesc_indices"]), closure["tensordesc_meta"], encode


def _hooked(hook) -> bool:
    """Whether a launch hook is set: a callable, or a chain of them (newer Triton) that is not empty.
    With one, launches take Triton's launcher, which builds the launch metadata hooks receive."""
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLaunch:
    """One compiled kernel with its grid and constexprs fixed by a plan.

    ``descriptors`` maps each descriptor argument's index to a function that builds its
    descriptor from the base tensor; a call passes the base tensors at those indices. With the
    known launcher form, each slot keeps the encoded descriptors of the last few base addresses
    (the plan fixes shape, strides and block) and the kernel's entry point is called directly."""

    def __init__(self, kernel, grid: tuple, constexprs: list, descriptors: dict[int, Callable]):
        self.kernel, self.grid, self.constexprs = kernel, grid, list(constexprs)
        self.descriptors = dict(descriptors)
        raw = _raw_launcher(kernel)
        if raw is not None and raw[1] != sorted(self.descriptors):
            raw = None  # (a descriptor Triton decomposed, or one this plan does not know)
        self._raw = raw
        if raw is not None:
            self._encoded = {index: {} for index in sorted(self.descriptors)}  # in argument order
            self._meta = dict(zip(raw[1], raw[2]))
            self._base = (kernel.function, kernel.run.launch_cooperative_grid, kernel.run.launch_pdl, None, None,
                          kernel.packed_metadata, None, None, None)

    @property
    def caches_descriptors(self) -> bool:
        return self._raw is not None

    def __call__(self, args: list) -> None:
        if self._raw is None or _hooked(_knobs.runtime.launch_enter_hook) or _hooked(_knobs.runtime.launch_exit_hook):
            for index, make in self.descriptors.items():
                args[index] = make(args[index])
            launch_compiled(self.kernel, self.grid, args + self.constexprs)
            return
        expanded = []
        start = 0
        for index, cache in self._encoded.items():
            expanded += args[start:index]
            base = args[index]
            encoded = cache.get(base.data_ptr())
            if encoded is None:
                encoded = self._encode(index, base, cache)
            expanded += encoded
            start = index + 1
        expanded += args[start:]
        device = _driver.active.get_current_device()
        self._raw[0](self.grid[0], 1, 1, _driver.active.get_current_stream(device), *self._base, *expanded,
                     *self.constexprs)

    def _encode(self, index: int, base, cache: dict) -> list:
        if len(cache) >= _CACHED_DESCRIPTORS:
            cache.clear()
        encoded = self._raw[3](self.descriptors[index](base), self._meta[index])
        cache[base.data_ptr()] = encoded
        return encoded
