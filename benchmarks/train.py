"""Training-step benchmark on one GPU: forward + backward of the expert path.

Paths (same signature ``fn(x, w_gate, w_up, w_down, cu_seqlens, route_weights) -> out``):

- ``moonep``: ``moonep_ops.moonep_experts`` as training calls it: the training fused op
  ``grouped_gemm_silu_mul_with_gate_up`` (one pass over x writes act, gate and up; the backward
  reuses the saved gate/up, one dual dgrad for dx), then the down GEMM.
- ``moonep_unfused``: the same from the public single ops: ``grouped_gemm`` twice,
  ``silu_mul_weight``, ``grouped_gemm``, each with its own derivative (dx as two dgrads and an add).
- ``moonep_recompute``: ``moonep_experts(recompute=True)``: the fused gate/up + activation forward,
  a backward that recomputes gate/up in one fused pass, then one dual dgrad and K-grouped wgrads.
- ``grouped_mm_fn``: what torchtitan/Megatron-style integrations hand-write: an
  ``autograd.Function`` over ``torch._grouped_mm`` (dA = dOut @ W, dW = K-grouped
  ``_grouped_mm(dOut^T, A, offs)``), eager ``silu``/``mul`` under autograd.
- ``grouped_mm_autograd``: the same composition on ``torch._grouped_mm``'s built-in derivative.

Time = median CUDA-graph replay (:mod:`benchmarks.timing`) of
``out = fn(...); torch.autograd.grad(out, [x, weights, rw])``; speed-ups are against ``grouped_mm_fn``.
Gradients are compared with the first path's on live rows / non-empty groups (``err``), and
each path reports whether its tail-row and empty-group gradients are exactly zero.
Default shapes: the shapes of benchmarks/shapes.py with prefill-sized S (S >= 1024);
``--min-tokens`` raises S of every shape instead.

    python -m benchmarks.train [--out train.json] [--reps 20] [--paths moonep,grouped_mm_fn] [--min-tokens 4096]
"""

import argparse
import dataclasses
import json
import math

import torch
import torch.nn.functional as F

import moonep_ops

from . import cli
from .run import measure_ceilings
from .shapes import SHAPES, build_problem
from .timing import environment, median_replay_ms


class GroupedMM(torch.autograd.Function):
    """``out[seg_g] = a[seg_g] @ w[g].T`` on ``torch._grouped_mm``; ``offs`` = cu_seqlens."""

    @staticmethod
    def forward(ctx, a, w, offs):
        ctx.save_for_backward(a, w, offs)
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        a, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        da = torch._grouped_mm(grad, w, offs=offs) if ctx.needs_input_grad[0] else None
        # K-grouped: [N, NvS] x [NvS, K] split along NvS by offs -> [G, N, K].
        dw = torch._grouped_mm(grad.t(), a, offs=offs) if ctx.needs_input_grad[1] else None
        return da, dw, None


def _swiglu(gate, up, rw):
    act = F.silu(gate) * up
    return act if rw is None else act * rw.to(act.dtype)[:, None]


def grouped_mm_fn(x, w_gate, w_up, w_down, cu, rw):
    act = _swiglu(GroupedMM.apply(x, w_gate, cu), GroupedMM.apply(x, w_up, cu), rw)
    return GroupedMM.apply(act, w_down, cu)


def grouped_mm_autograd(x, w_gate, w_up, w_down, cu, rw):
    mm = lambda a, w: torch._grouped_mm(a, w.transpose(1, 2), offs=cu)  # noqa: E731
    return mm(_swiglu(mm(x, w_gate), mm(x, w_up), rw), w_down)


def moonep(x, w_gate, w_up, w_down, cu, rw):
    return moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw)


def moonep_unfused(x, w_gate, w_up, w_down, cu, rw):
    gate, up = moonep_ops.grouped_gemm(x, w_gate, cu), moonep_ops.grouped_gemm(x, w_up, cu)
    return moonep_ops.grouped_gemm(moonep_ops.silu_mul_weight(gate, up, rw, cu), w_down, cu)


def moonep_recompute(x, w_gate, w_up, w_down, cu, rw):
    return moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, recompute=True)


PATHS = {
    "moonep": moonep,
    "moonep_unfused": moonep_unfused,
    "moonep_recompute": moonep_recompute,
    "grouped_mm_fn": grouped_mm_fn,
    "grouped_mm_autograd": grouped_mm_autograd,
}
BASE = "grouped_mm_fn"


def _digest(grads, names, sizes, live):
    """Small slices of the gradients to compare across paths (the weight gradients are tens of
    GB): row gradients on live rows, the four largest groups and two empty groups of each weight."""
    order = sorted(range(len(sizes)), key=lambda g: -sizes[g])
    full = [g for g in order if sizes[g]][:4]
    empty = [g for g, s in enumerate(sizes) if s == 0][:2]
    out, zero = {}, {"tail": True, "empty_groups": True}
    for name, grad in zip(names, grads):
        if grad.dim() == 3:
            out[name] = grad[full].float().clone()
            zero["empty_groups"] &= bool(torch.count_nonzero(grad[empty]) == 0) if empty else True
        else:
            out[name] = grad[:live].float().clone()
            zero["tail"] &= bool(torch.count_nonzero(grad[live:]) == 0)
    return out, zero


def _err(digest, ref):
    num = sum(float((digest[k] - ref[k]).double().norm() ** 2) for k in ref)
    den = sum(float(ref[k].double().norm() ** 2) for k in ref)
    return math.sqrt(num / den) if den else math.sqrt(num)


def run_shape(shape, paths, reps, ceilings):
    x, wg, wu, wd, cu, rw, sizes = build_problem(shape, 128)
    live = sum(sizes)
    inputs = [t.requires_grad_() for t in (x, wg, wu, wd, rw) if t is not None]
    names = ["x", "w_gate", "w_up", "w_down", "route_weights"][:len(inputs)]
    grad_out = torch.randn(x.shape[0], shape.hidden, device="cuda", dtype=torch.bfloat16)
    grad_out[live:] = float("nan")  # undefined rows: a correct backward never reads them
    flops = 9 * 2 * live * shape.hidden * shape.inter  # fwd 3 GEMMs + bwd 6 (recompute not counted)
    floor_us = flops / (ceilings["matmul_tflops"] * 1e12) * 1e6
    # The weight gradients of empty groups must be exactly zero (idle experts, unused prefetch
    # slots): writing them is memory traffic that the FLOP floor does not count.
    empty = sum(1 for s in sizes if s == 0)
    zero_fill_us = empty * 3 * shape.hidden * shape.inter * x.element_size() / 4.2e12 * 1e6
    row = {"shape": shape.name, "tokens": shape.tokens, "nvs": x.shape[0], "rows": live,
           "nonempty": len(sizes) - empty, "floor_us": floor_us, "zero_fill_us_at_4.2TBps": zero_fill_us}
    ref = None
    for name, fn in paths.items():
        def step():
            return torch.autograd.grad(fn(x, wg, wu, wd, cu, rw), inputs, grad_out)
        try:
            digest, zero = _digest(step(), names, sizes, live)
            torch.cuda.synchronize()
            if ref is None:
                ref = digest
            us = median_replay_ms(step, reps) * 1e3
            row[name] = {"us": us, "eff": floor_us / us, "err_vs_first": _err(digest, ref),
                         "finite": all(bool(torch.isfinite(v).all()) for v in digest.values()),
                         "zero_tail": zero["tail"], "zero_empty_groups": zero["empty_groups"]}
        except Exception as exc:  # a path that cannot run a shape is reported, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        torch.cuda.empty_cache()
    return row


def _print_row(row, paths):
    parts = [f"{row['shape']:<28} rows {row['rows']:>6} floor {row['floor_us']:7.0f}us"]
    base = row.get(BASE, {}).get("us")
    for name in paths:
        r = row[name]
        if "error" in r:
            parts.append(f"{name}: ERROR {r['error'][:80]}")
            continue
        speed = f" x{base / r['us']:.2f}" if base else ""
        flags = (("" if r["finite"] else " NONFINITE") + ("" if r["zero_tail"] else " TAIL!=0")
                 + ("" if r["zero_empty_groups"] else " EMPTY-GROUPS!=0"))
        parts.append(f"{name} {r['us']:8.0f}us eff {r['eff']:.2f}{speed} err {r['err_vs_first']:.1e}{flags}")
    print(" | ".join(parts), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--paths", type=cli.names(PATHS), default=",".join(PATHS))
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="raise every shape's S to at least this (default: only shapes with S >= 1024)")
    args = parser.parse_args(argv)
    cli.require_gpu(parser)
    paths = {k: PATHS[k] for k in args.paths}
    if args.min_tokens:
        shapes = [dataclasses.replace(s, tokens=max(s.tokens, args.min_tokens),
                                      name=s.name.split(" S=")[0] + f" S={max(s.tokens, args.min_tokens)}")
                  for s in SHAPES]
    else:
        shapes = [s for s in SHAPES if s.tokens >= 1024]
    env = environment()
    ceilings = measure_ceilings()
    print(f"# {env}  matmul ceiling {ceilings['matmul_tflops']:.0f} TFLOP/s; speed-ups vs {BASE}")
    rows = []
    for shape in shapes:
        row = run_shape(shape, paths, args.reps, ceilings)
        rows.append(row)
        _print_row(row, paths)
    summary = {}
    for name in paths:
        ratios = [r[BASE]["us"] / r[name]["us"] for r in rows
                  if "us" in r.get(name, {}) and "us" in r.get(BASE, {})]
        if ratios:
            summary[name] = {"geomean_speedup_vs_" + BASE: math.exp(sum(map(math.log, ratios)) / len(ratios)),
                             "min_speedup": min(ratios)}
    for name, s in summary.items():
        print(f"# {name}: geomean x{s['geomean_speedup_vs_' + BASE]:.2f}, min x{s['min_speedup']:.2f}")
    result = {"env": env, "ceilings": ceilings, "rows": rows, "summary": summary}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
