"""A lower-overhead launch path for our Triton kernels (eager host cost matters: vLLM runs
MoonEP eagerly today).

``JITFunction.run`` re-derives the kernel's specialization from every argument on every call.
We key compiled kernels by a *finer* key of our own: the exact value of every int argument,
the dtype and 16-byte alignment of every tensor, the full geometry of every tensor
descriptor, the constexprs and launch options. Equal keys imply equal Triton
specializations, so a cached kernel is always the one Triton itself would pick. The first
call of a key goes through Triton (compiling if needed); later calls call the compiled
kernel's launcher directly, as ``JITFunction.run`` does at its end. Any Triton without that
launcher API falls back to the normal path.
"""

import torch
import triton

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - older Triton
    _knobs = _driver = None


def _arg_key(arg):
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, (int, float, bool, str)) or arg is None:
        return arg
    base = getattr(arg, "base", None)  # TensorDescriptor
    if base is not None:
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), getattr(arg, "padding", None))
    return None  # unknown kind: not cacheable


class FastLauncher:
    def __init__(self, jit_fn):
        self.fn = jit_fn
        self.names = list(jit_fn.arg_names)
        self.cache = {}
        self.enabled = _knobs is not None and _driver is not None

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int):
        if not self.enabled or args[0].device.type != "cuda":
            self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            return
        key = (args[0].device.index, num_warps, num_stages, tuple(constexprs.values()),
               tuple(_arg_key(a) for a in args))
        kernel = self.cache.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            if kernel is not None and hasattr(kernel, "run") and None not in key[-1]:
                self.cache[key] = kernel
            return
        full = list(args) + [constexprs[name] for name in self.names[len(args):]]
        device = _driver.active.get_current_device()
        stream = _driver.active.get_current_stream(device)
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *full),
                   _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *full)


__all__ = ["FastLauncher", "triton"]
