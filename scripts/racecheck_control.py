"""The control kernel of the sanitizer run's racecheck triage (scripts/racecheck_triage.py).

The smallest warp-specialized Gluon kernels, with no moonep code: each partition stores to its
own global rows; no shared memory of their own, no mbarriers. Hazards racecheck reports here
come from how Triton lowers ``gl.warp_specialize`` (each worker warp's partition index and the
captured arguments are passed through shared memory between named-barrier rounds), not from
moonep_ops' kernels. ``scripts/sanitize.sh`` runs the ``like_ours`` variant under racecheck when
the cases' racecheck reports errors: the triage tolerates those reports only while this control
shows the same pattern.

Variants (on an H200 with Triton 3.6.0 and compute-sanitizer 2025.3.1):
- ``like_ours`` (default): a cross-warp sum before ``warp_specialize`` whose result the partitions
  capture, and two worker partitions (4 warps and 1), as the moonep Gluon GEMM has: racecheck
  reports the worker warps' read of their partition index (after ``barrier.sync 1``) against the
  default warps' writes of it (before the same barrier), i.e. hazards on accesses that named
  barrier orders. The likely cause: racecheck's barrier bookkeeping does not follow the partial
  barrier 0 of the sum (``BAR.SYNC 0x0, 0x80``, the default warps only) before the handshake.
- ``prologue``: the sum alone (one worker): reports too, so the sum's partial barrier is the
  ingredient; ``two_workers``: two workers, no sum; ``simple``: neither. Both clean.

Usage on an sm90 GPU:
    compute-sanitizer --tool racecheck python3 scripts/racecheck_control.py [variant]
"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

VARIANTS = {"simple": (False, False), "prologue": (True, False), "two_workers": (False, True),
            "like_ours": (True, True)}
ROW = 288  # output ints per program: 128 (default) + 32 (1-warp worker) + 128 (4-warp worker)


@gluon.jit
def _default(out_ptr, n, base):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=layout)
    gl.store(out_ptr + base + offs, offs + n)


@gluon.jit
def _worker(out_ptr, n, base):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs = gl.arange(0, 32, layout=layout)
    gl.store(out_ptr + base + 128 + offs, offs * 2 + n)


@gluon.jit
def _worker4(out_ptr, n, base):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=layout)
    gl.store(out_ptr + base + 160 + offs, offs * 3 + n)


@gluon.jit
def _ws_control(out_ptr, n, vec_ptr, PROLOGUE: gl.constexpr, TWO_WORKERS: gl.constexpr):
    base = gl.program_id(0) * 288
    if PROLOGUE:  # a cross-warp sum (shared-memory scratch, a barrier over the 4 default warps)
        scan: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        value = gl.sum(gl.load(vec_ptr + gl.arange(0, 128, layout=scan)), 0)
    else:
        value = n
    if TWO_WORKERS:
        gl.warp_specialize([(_default, (out_ptr, value, base)), (_worker4, (out_ptr, value, base)),
                            (_worker, (out_ptr, value, base))], [4, 1], [232, 40])
    else:
        gl.warp_specialize([(_default, (out_ptr, value, base)), (_worker, (out_ptr, value, base))], [1], [40])


def main(argv) -> int:
    variant = argv[0] if argv else "like_ours"
    prologue, two_workers = VARIANTS[variant]
    progs, n = 8, 7
    vec = torch.ones(128, dtype=torch.int32, device="cuda")
    out = torch.full((progs * ROW, ), -1, dtype=torch.int32, device="cuda")
    _ws_control[(progs, )](out, n, vec, PROLOGUE=prologue, TWO_WORKERS=two_workers, num_warps=4)
    torch.cuda.synchronize()
    v = 128 if prologue else n
    parts = [torch.arange(128) + v, torch.arange(32) * 2 + v,
             torch.arange(128) * 3 + v if two_workers else torch.full((128, ), -1)]
    ok = torch.equal(out.cpu(), torch.cat(parts).to(torch.int32).repeat(progs))
    print(f"racecheck control [{variant}]:", "ok" if ok else "WRONG RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
