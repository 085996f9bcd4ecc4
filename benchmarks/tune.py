"""Offline sweep of the Triton forward GEMMs' block configs (the tables of
``moonep_ops/kernels/triton/configs.py``: ``gemm_config``, ``fused_gemm_config``).

For each shape of ``shapes.py`` and each GEMM role of the expert path (``fused``: the gate/up GEMM
with the SwiGLU epilogue; ``down``; ``fused_save``: the training fused GEMM that also writes gate
and up), times every candidate config, with portable loads and with TMA, by CUDA-graph replay
(:mod:`benchmarks.timing`) on the MoonEP-like layout, and prints the best two.
``--schedules`` sweeps the Hopper schedule knobs instead (TMA loads with TMA stores, a flattened
or warp-specialized persistent loop: ``SCHEDULES``); each candidate's output must equal the
role's first schedule's bit for bit, or it is not timed.

The Triton kernels run on sm80/sm86/sm89, under ``MOONEP_OPS_PORTABLE=1``, and on sm90 where no
Gluon config applies (``MOONEP_OPS_GLUON=0``, fp16/fp32, the backward).

    python -m benchmarks.tune [--out tune.json] [--schedules] [--paddings 128] [--roles fused,down]
                              [--shapes 0,3] [--tma-only] [--reps 20]
"""

import argparse
import dataclasses
import itertools
import json

import torch

from moonep_ops.kernels.triton.configs import GemmConfig
from moonep_ops.kernels.triton.grouped_gemm import (launch_grouped_gemm, launch_grouped_gemm_silu_mul,
                                                    launch_grouped_gemm_silu_mul_with_gate_up)

from . import cli
from .shapes import build_problem
from .timing import environment, median_replay_ms

FUSED = [GemmConfig(*c) for c in [
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 128, 8, 3), (128, 64, 64, 8, 4),
    (64, 128, 64, 4, 4), (128, 128, 32, 8, 5),
]]
PLAIN = [GemmConfig(*c) for c in [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4),
    (64, 256, 64, 8, 4), (128, 256, 32, 8, 6),
]]


def _variants(base, *knobs):
    return [dataclasses.replace(GemmConfig(*base[:5], *base[5:]), **k) for k in knobs]


_PLAIN_K, _TS1, _TS2 = {}, {"tma_store": 1}, {"tma_store": 2}
_FL = {"flatten": True}  # (flatten with tma_store does not compile with Triton 3.6)
_WS, _WS2 = {"warp_specialize": True}, {"warp_specialize": True, "tma_store": 2}
# role -> candidates (all TMA-loaded); the first is the reference the others are checked against.
_FUSED_SCHEDULES = (_variants((128, 128, 64, 8, 4), _PLAIN_K, _TS1, _TS2, _FL, _WS, _WS2)
                    + _variants((128, 128, 64, 8, 3), _TS1, _FL, _WS, _WS2)
                    + _variants((128, 64, 64, 8, 4, 2), _PLAIN_K, _TS1))
SCHEDULES = {
    "fused": _FUSED_SCHEDULES,
    "fused_save": _FUSED_SCHEDULES,
    "down": (_variants((128, 256, 64, 8, 4), _PLAIN_K, _TS2, _FL, _WS, _WS2)
             + _variants((128, 256, 64, 8, 3), _TS1, _TS2, _FL, _WS2)
             + _variants((128, 128, 64, 8, 3, 2), _PLAIN_K, _TS1)
             + _variants((128, 128, 128, 8, 3), _PLAIN_K, _FL, _WS)),
}


def time_role(role: str, cands, tmas, fn, out: torch.Tensor, schedules: bool, reps: int):
    """Each (candidate, TMA) pair's median replay time (``inf`` where it cannot run), fastest first;
    with ``schedules`` each is first checked bit for bit against the first candidate's output.
    None when that first candidate fails."""
    if schedules:
        try:
            fn(cands[0], True)
        except Exception as exc:
            print(f"  {role} reference schedule failed: {type(exc).__name__}: {str(exc)[:300]}")
            return None
        ref = out.clone()
    timings = []
    for cfg, tma in itertools.product(cands, tmas):
        try:
            if schedules:  # a schedule that changes the result cannot win
                out.fill_(float("nan"))
                fn(cfg, tma)
                if not torch.equal(out, ref):
                    raise RuntimeError(f"output differs from the reference schedule's "
                                       f"(max diff {(out.float() - ref.float()).abs().max():.3g})")
            us = median_replay_ms(lambda: fn(cfg, tma), reps) * 1e3
        except Exception as exc:  # e.g. out of shared memory: not a candidate
            us = float("inf")
            print(f"  {role} {cfg} tma={tma}: {type(exc).__name__}: {str(exc)[:120]}")
        timings.append({"cfg": list(cfg.__dict__.values()), "tma": tma, "us": us})
    return sorted(timings, key=lambda r: r["us"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--paddings", type=cli.padding_list, default="128,1")
    parser.add_argument("--tma-only", action="store_true")
    parser.add_argument("--schedules", action="store_true", help="sweep SCHEDULES (TMA only)")
    parser.add_argument("--shapes", type=cli.shape_list, default="all", help="comma-separated indices into SHAPES")
    parser.add_argument("--roles", type=cli.names(("fused", "down", "fused_save")), default="fused,down",
                        help="comma-separated: fused, down, fused_save")
    args = parser.parse_args(argv)
    cli.require_gpu(parser)
    results = []
    for padding, shape in itertools.product(args.paddings, args.shapes):
        x, wg, wu, wd, cu, rw, sizes = build_problem(shape, padding)
        act = torch.randn(x.shape[0], shape.inter, device="cuda", dtype=torch.bfloat16)
        out_i = torch.empty(x.shape[0], shape.inter, device="cuda", dtype=torch.bfloat16)
        out_h = torch.empty(x.shape[0], shape.hidden, device="cuda", dtype=torch.bfloat16)
        gate, up = torch.empty_like(out_i), torch.empty_like(out_i)
        roles = {  # role -> (candidates, launch of one config, its output)
            "fused": (FUSED, lambda cfg, tma: launch_grouped_gemm_silu_mul(x, wg, wu, rw, cu, out_i, cfg, tma), out_i),
            "down": (PLAIN, lambda cfg, tma: launch_grouped_gemm(act, wd, cu, out_h, cfg, tma), out_h),
            "fused_save": (FUSED, lambda cfg, tma: launch_grouped_gemm_silu_mul_with_gate_up(
                x, wg, wu, rw, cu, out_i, gate, up, cfg, tma), out_i),
        }
        for role in args.roles:
            cands, fn, out = roles[role]
            if args.schedules:
                cands, tmas = SCHEDULES[role], (True,)
            else:
                tmas = (True,) if args.tma_only else (False, True)
            timings = time_role(role, cands, tmas, fn, out, args.schedules, args.reps)
            if timings is None:
                continue
            if args.schedules:
                for r in timings:
                    print(f"  {role:<5} {r['us']:8.1f}us {r['cfg']}")
            best, second = timings[0], timings[1]
            print(f"{shape.name:<28} pad={padding:<3} {role:<5} best {best['us']:7.0f}us {best['cfg']} "
                  f"tma={best['tma']} | 2nd {second['us']:7.0f}us {second['cfg']} tma={second['tma']}", flush=True)
            results.append({"shape": shape.name, "padding": padding, "role": role, "timings": timings})
        del x, wg, wu, wd, act, gate, up
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
