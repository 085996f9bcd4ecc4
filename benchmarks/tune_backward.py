"""Offline sweep of the backward kernels' block configs (``dgrad_config`` and ``wgrad_config`` in
``moonep_ops/kernels/triton/configs.py``).

For each shape of ``shapes.py`` with prefill-sized S (S >= 1024) and each backward GEMM of a
training step, times the committed config (``default``), every candidate, and the
``torch._grouped_mm`` call that does the same work (``torch``), by CUDA-graph replay
(:mod:`benchmarks.timing`) on the MoonEP-like layout. Each candidate's result is first compared
with ``torch._grouped_mm`` on the rows and groups that hold data (``err``), so a config that
breaks a kernel cannot win.

Roles (bf16; G, I, H from the shape; rows from the layout):
  dgrad_down   d act [NvS, I] = grad_out @ w_down[g]            (forward kernel, transposed view)
  dgrad_gate   d x   [NvS, H] = d_gate @ w_gate[g]
  *_tma        the same two with TMA loads of the transposed weights
  dual_dgrad   d x   [NvS, H] = d_gate @ w_gate[g] + d_up @ w_up[g]  (TMA on sm90)
  wgrad_gate   d w_gate [G, I, H] = d_gate[seg]^T @ x[seg]      (and w_up alike)
  wgrad_down   d w_down [G, H, I] = grad_out[seg]^T @ act[seg]
  wgrad_*_tma  the same with the whole row steps TMA-loaded

    python -m benchmarks.tune_backward [--out tune_backward.json] [--reps 10] [--roles a,b]
"""

import argparse
import json
import math

import torch

from moonep_ops.kernels.triton import configs
from moonep_ops.kernels.triton.configs import GemmConfig
from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm, launch_grouped_gemm_dual
from moonep_ops.kernels.triton.grouped_gemm_wgrad import launch_grouped_gemm_wgrad

from . import cli
from .shapes import SHAPES, build_problem
from .timing import environment, median_replay_ms

# (block_m, block_n, block_k, warps, stages). dgrad: the forward kernel's portable path.
DGRAD = [GemmConfig(*c) for c in [
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
    (64, 128, 64, 4, 4), (128, 128, 128, 8, 3),
]] + [  # Hopper schedule knobs (TMA roles only: the pointer path drops them)
    GemmConfig(128, 256, 64, 8, 4, flatten=True), GemmConfig(128, 256, 64, 8, 4, warp_specialize=True),
    GemmConfig(128, 128, 64, 8, 4, flatten=True), GemmConfig(128, 256, 64, 8, 3, warp_specialize=True),
]
# wgrad: block_m is the step over a segment's rows (the reduction), block_n x block_k the tile.
WGRAD = [GemmConfig(*c) for c in [
    (32, 128, 128, 4, 3), (32, 128, 128, 4, 4), (16, 128, 128, 4, 4), (64, 128, 128, 8, 3), (32, 64, 128, 4, 4),
    (64, 128, 256, 8, 3), (32, 128, 128, 4, 5),
]]


def _err(out, ref, live_rows=None, groups=None):
    if live_rows is not None:
        out, ref = out[:live_rows], ref[:live_rows]
    if groups is not None:
        out, ref = out[groups], ref[groups]
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


ROLES = ("dgrad_down", "dgrad_gate", "dgrad_down_tma", "dgrad_gate_tma", "dual_dgrad", "wgrad_gate", "wgrad_down",
         "wgrad_gate_tma", "wgrad_down_tma")  # the keys of roles_for's dict


def roles_for(shape, x, wg, wu, wd, cu, sizes):
    """``name -> (candidates, committed config, run(cfg), torch_run(), output buffer, where)``;
    ``where`` says which part of the output to compare (``_err``'s keywords)."""
    nvs, live = x.shape[0], sum(sizes)
    h, i = shape.hidden, shape.inter
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None  # None: the interpreter's table
    like = dict(device=x.device, dtype=x.dtype)
    full = [g for g, s in enumerate(sizes) if s][:8]  # groups compared (weight grads are large)

    def rows(n):
        t = torch.randn(nvs, n, **like)
        t[live:] = float("nan")  # undefined rows: never read
        return t

    grad_out, d_gate, d_up, act = rows(h), rows(i), rows(i), rows(i)

    def dgrad(grad, w, tma=False):  # [NvS, N] @ w[g] ([G, N, K]) -> [NvS, K]
        out = torch.empty(nvs, w.shape[2], **like)
        cfg = configs.dgrad_config(w.shape[2], w.shape[1], nvs, x.dtype, cap)
        return (DGRAD, cfg, lambda c: launch_grouped_gemm(grad, w.transpose(1, 2), cu, out, c, tma),
                lambda: torch._grouped_mm(grad, w, offs=cu), out, dict(live_rows=live))

    def wgrad(grad, a, tma=False):  # grad[seg]^T @ a[seg] -> [G, N, K]
        out = torch.empty(cu.shape[0], grad.shape[1], a.shape[1], **like)
        cfg = configs.wgrad_config(grad.shape[1], a.shape[1], nvs, x.dtype, cap)
        return (WGRAD, cfg, lambda c: launch_grouped_gemm_wgrad(grad, a, cu, out, c, tma),
                lambda: torch._grouped_mm(grad.t(), a, offs=cu), out, dict(groups=full))

    out_h = torch.empty(nvs, h, **like)
    return {
        "dgrad_down": dgrad(grad_out, wd),
        "dgrad_gate": dgrad(d_gate, wg),
        "dgrad_down_tma": dgrad(grad_out, wd, tma=True),
        "dgrad_gate_tma": dgrad(d_gate, wg, tma=True),
        "dual_dgrad": (DGRAD, configs.dgrad_config(h, i, nvs, x.dtype, cap, dual=True),
                       lambda c: launch_grouped_gemm_dual(d_gate, wg.transpose(1, 2), d_up, wu.transpose(1, 2), cu,
                                                          out_h, c, cap is not None and cap >= (9, 0)),
                       lambda: torch._grouped_mm(d_gate, wg, offs=cu) + torch._grouped_mm(d_up, wu, offs=cu),
                       out_h, dict(live_rows=live)),
        "wgrad_gate": wgrad(d_gate, x),
        "wgrad_down": wgrad(grad_out, act),
        "wgrad_gate_tma": wgrad(d_gate, x, tma=True),
        "wgrad_down_tma": wgrad(grad_out, act, tma=True),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--roles", type=cli.names(ROLES), default=",".join(ROLES))
    args = parser.parse_args(argv)
    cli.require_gpu(parser)
    wanted = args.roles
    results = []
    for shape in [s for s in SHAPES if s.tokens >= 1024]:
        x, wg, wu, wd, cu, rw, sizes = build_problem(shape, 128)
        live = sum(sizes)
        flops = 2 * live * shape.hidden * shape.inter  # one [rows, H] x [H, I] GEMM
        for name, (cands, default, run, ref_run, out, where) in roles_for(shape, x, wg, wu, wd, cu, sizes).items():
            if name not in wanted:
                continue
            ref = ref_run()
            torch_us = median_replay_ms(ref_run, args.reps) * 1e3
            role_flops = flops * (2 if name == "dual_dgrad" else 1)
            timings = []
            for label, cfg in [("default", default)] + [("candidate", c) for c in cands if c != default]:
                try:
                    out.fill_(float("nan"))
                    run(cfg)
                    err = _err(out, ref, **where)
                    us = median_replay_ms(lambda: run(cfg), args.reps) * 1e3 if err <= 2e-2 else math.inf
                except Exception as exc:  # e.g. out of shared memory: not a candidate
                    err, us = math.nan, math.inf
                    print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                timings.append({"cfg": list(cfg.__dict__.values()), "label": label, "us": us, "err": err,
                                "tflops": role_flops / us / 1e6 if math.isfinite(us) else 0.0})
            best = min(timings, key=lambda r: r["us"])
            print(f"{shape.name:<28} {name:<11} torch {torch_us:8.0f}us | default {timings[0]['us']:8.0f}us "
                  f"| best {best['us']:8.0f}us {best['cfg']} ({best['tflops']:.0f} TFLOP/s)", flush=True)
            results.append({"shape": shape.name, "role": name, "rows": live, "torch_us": torch_us,
                            "timings": timings})
            del ref
        del x, wg, wu, wd
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
