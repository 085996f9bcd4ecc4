"""Inline-PTX synchronization of the Gluon kernel: PDL, the row-tile handoff, the item counter.

- Programmatic dependent launch (the ``experts`` op's pair): the primary lets its dependent launch
  early (``griddepcontrol.launch_dependents``); the dependent waits for the whole primary grid and
  its memory (``griddepcontrol.wait``) before it reads what the primary wrote.
- The row-tile handoff, a finer wait than the grid-wide one: the primary adds to a flag per row
  tile of its output once that tile's stores completed (a release add after the bulk stores and a
  proxy fence); the dependent polls the flag with acquire loads, a bounded number of times, and
  falls back to the grid-wide wait, so that a flag that never fills costs time, never a hang.
- The dependent's dynamic schedule: lane 0 of the one-warp producer takes the next item from a
  global counter and shares it with the warp.

Gluon has no builtins for these, so each is ``inline_asm_elementwise`` on scalars; the ones with
no result write a dummy register (the op needs an output).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def griddepcontrol_wait():
    """The prior kernel (this one launched as its programmatic dependent) has finished and its
    memory is visible. A no-op without programmatic dependent launch."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def griddepcontrol_launch_dependents():
    """The next kernel, if a programmatic dependent, may launch."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def signal_row_tile(flag_ptr):
    """Row-tile handoff, writer side (``SIGNAL_ROWS``): every consumer thread adds 1 to the row
    tile's flag with release semantics, after its own bulk (TMA) stores completed (``wait_group``
    without ``.read``: written, not only read from shared memory) and a proxy fence that orders
    them before its generic release. Its masked stores are its own generic writes. Whichever thread
    issued a TMA store, the flag reaches its target only after that thread's add."""
    gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; red.release.gpu.global.add.s32 [$1], 1; "
        "mov.u32 $0, 0;", "=r,l", [flag_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def load_acquire(flag_ptr):
    """A flag read with acquire semantics (gpu scope)."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flag_ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def nanosleep():
    gl.inline_asm_elementwise("nanosleep.u32 128; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def fence_async_global():
    """Generic-proxy reads (the flag) before the async proxy's (TMA loads of ``a``)."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def wait_row_tile(flag_ptr, target, grid_waited, MAX_POLLS: gl.constexpr):
    """Row-tile handoff, reader side (``HANDOFF``): wait until the row tile's flag reaches
    ``target``, polling at most ``MAX_POLLS`` times; past that, fall back to ``griddepcontrol.wait``
    (the whole prior grid done). Returns ``grid_waited``: 1 once the grid-wide wait ran, after which
    no flag needs reading any more."""
    if grid_waited == 0:
        got = load_acquire(flag_ptr)
        polls = 0
        while (got < target) & (polls < MAX_POLLS):
            nanosleep()
            got = load_acquire(flag_ptr)
            polls += 1
        if got < target:
            griddepcontrol_wait()
            grid_waited = 1
        fence_async_global()
    return grid_waited


@gluon.jit
def next_item(counter_ptr):
    """The next item of the dynamic schedule (``HANDOFF``): lane 0 of the (one-warp) producer takes
    it from the global counter, every lane gets it."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; mov.u32 $0, 0; "
        "@p atom.global.add.u32 $0, [$1], 1; shfl.sync.idx.b32 $0, $0, 0, 0x1f, 0xffffffff; }",
        "=r,l", [counter_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def warp_sync():
    """``bar.warp.sync``: the warp's shared-memory writes ordered before what follows (the item id
    of a stage, written by every lane, before the mbarrier arrive that publishes it)."""
    gl.inline_asm_elementwise("bar.warp.sync 0xffffffff; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)
