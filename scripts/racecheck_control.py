"""A control for compute-sanitizer's racecheck on Gluon kernels: the smallest warp-specialized
kernel (a default partition and one worker warp, each storing to its own global rows, no shared
memory of its own, no mbarriers). Hazards racecheck reports here come from how Triton lowers
``gl.warp_specialize`` (the partitions' state and captured arguments passed through shared
memory between named-barrier rounds), not from moonep_ops' kernels.

Usage on an sm90 GPU: compute-sanitizer --tool racecheck python3 scripts/racecheck_control.py
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


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
def _ws_control(out_ptr, n, vec_ptr, LIKE_OURS: gl.constexpr):
    """``LIKE_OURS``: as the moonep kernel's prologue and partitions are: a cross-warp sum (shared
    memory scratch) whose result the partitions capture, and two worker partitions (4 warps, 1)."""
    if LIKE_OURS:
        scan: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        total = gl.sum(gl.load(vec_ptr + gl.arange(0, 128, layout=scan)), 0)
        base = gl.program_id(0) * 288
        gl.warp_specialize([(_default, (out_ptr, total, base)), (_worker4, (out_ptr, total, base)),
                            (_worker, (out_ptr, total, base))], [4, 1], [232, 40])
    else:
        base = gl.program_id(0) * 160
        gl.warp_specialize([(_default, (out_ptr, n, base)), (_worker, (out_ptr, n, base))], [1], [40])


def main():
    progs, n = 8, 7
    vec = torch.ones(128, dtype=torch.int32, device="cuda")
    out = torch.full((progs * 160, ), -1, dtype=torch.int32, device="cuda")
    _ws_control[(progs, )](out, n, vec, LIKE_OURS=False, num_warps=4)
    torch.cuda.synchronize()
    per = torch.cat([torch.arange(128) + n, torch.arange(32) * 2 + n]).to(torch.int32)
    ok = torch.equal(out.cpu(), per.repeat(progs))
    out = torch.full((progs * 288, ), -1, dtype=torch.int32, device="cuda")
    _ws_control[(progs, )](out, n, vec, LIKE_OURS=True, num_warps=4)
    torch.cuda.synchronize()
    t = 128
    per = torch.cat([torch.arange(128) + t, torch.arange(32) * 2 + t, torch.arange(128) * 3 + t]).to(torch.int32)
    ok = ok and torch.equal(out.cpu(), per.repeat(progs))
    print("racecheck control:", "ok" if ok else "WRONG RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
