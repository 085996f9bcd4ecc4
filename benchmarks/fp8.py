"""FP8 block-scaled experts on one GPU: this project's FP8 path against its BF16 path and against
the best FP8 grouped GEMM that torch offers, on the six shapes of ``shapes.py``.

Paths, all on the same layout (``shapes.build_problem``), each timed as in ``run.py`` (CUDA-graph
replays after warm-up, ``--settle`` seconds back to back first, median of ``--reps``):

- ``moonep_bf16``: ``moonep_ops.moonep_experts`` on the bf16 weights;
- ``moonep_fp8``: the same with e4m3 weights and 128 x 128 block scales (``moonep_ops.fp8``), the
  weights block-major (``fp8.to_block_major``: the layout the ops stream fastest, and the one the
  vLLM integration holds);
- ``moonep_fp8_row_major``: the same on the checkpoint's ``[G, N, K]`` e4m3 weights;
- ``torch_fp8``: ``torch._scaled_grouped_mm`` with row-wise scales (the weights re-quantized per
  output channel, ``x`` and the activation per row by eager ops), gate and up in one call on the
  concatenated ``[G, 2I, H]`` weights, an eager ``silu(gate) * up * rw``, then the down GEMM.

The limit of the FP8 path is the larger of a dense FP8 cuBLAS GEMM pair of the same FLOPs
(``torch._scaled_mm``, row-wise scales: ``[rows, H] x [H, 2I]`` then ``[rows, I] x [I, H]``) and
a read-only reduction over its bytes (each non-empty group's three e4m3 weights and their scales,
``x`` and ``out`` in bf16, the route weights), both timed under the same protocol. Error: each
FP8 path against the BF16 path on the live rows (the quantization error, not a kernel check; the
tests compare the kernels with float64 references).

    python -m benchmarks.fp8 [--out fp8.json] [--reps 50] [--settle 1] [--paddings 128,1] [--shapes 0,3]
"""

import argparse
import json

import torch
import torch.nn.functional as F

import moonep_ops
from moonep_ops import fp8

from . import cli
from .limit import LimitMeter, limit_figures
from .shapes import build_problem
from .timing import environment, median_replay_ms

E4M3 = torch.float8_e4m3fn


def _rowwise(t: torch.Tensor):
    """e4m3 rows of ``t`` (last dim reduced) and their fp32 scales ``amax / 448`` (eager ops)."""
    amax = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12)
    return (t.float() * (448.0 / amax)).to(E4M3), (amax / 448.0).squeeze(-1)


def _rowwise_weights(*weights):
    """e4m3 ``[G, sum N, K]`` of the weights concatenated along N, and their ``[G, sum N]`` scales
    (one group at a time: fp32 copies of a whole model's experts may not fit)."""
    g = weights[0].shape[0]
    n, k = sum(w.shape[1] for w in weights), weights[0].shape[2]
    q = torch.empty((g, n, k), dtype=E4M3, device=weights[0].device)
    s = torch.empty((g, n), dtype=torch.float32, device=weights[0].device)
    for i in range(g):
        q[i], s[i] = _rowwise(torch.cat([w[i] for w in weights]))
    return q, s


class TorchFp8:
    """The ``torch_fp8`` path's weights: ``w13 [G, 2I, H]`` and ``w2 [G, H, I]`` in e4m3 with one
    scale per output channel."""

    def __init__(self, w_gate, w_up, w_down):
        self.w13, self.s13 = _rowwise_weights(w_gate, w_up)
        self.w2, self.s2 = _rowwise_weights(w_down)
        self.inter = w_gate.shape[1]

    def __call__(self, x, cu, rw, out):
        xq, xs = _rowwise(x)
        gate_up = torch._scaled_grouped_mm(xq, self.w13.transpose(1, 2), xs, self.s13, offs=cu,
                                           out_dtype=torch.bfloat16)
        act = F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
        if rw is not None:
            act = act * rw.to(act.dtype).unsqueeze(-1)
        aq, a_s = _rowwise(act)
        out.copy_(torch._scaled_grouped_mm(aq, self.w2.transpose(1, 2), a_s, self.s2, offs=cu,
                                           out_dtype=torch.bfloat16))


def fp8_bytes(sizes, shape) -> int:
    """Bytes the FP8 path must move: each non-empty group's e4m3 weights and block scales, ``x``
    and ``out`` (bf16) for the live rows, a route weight per row."""
    h, i, rows = shape.hidden, shape.inter, sum(sizes)
    blocks = 2 * -(-i // 128) * -(-h // 128) + -(-h // 128) * -(-i // 128)
    per_group = 3 * h * i + 4 * blocks
    return sum(1 for s in sizes if s) * per_group + 2 * rows * h * 2 + rows * 4


def fp8_limit(meter: LimitMeter, rows: int, hidden: int, inter: int, nbytes: int) -> dict:
    """The FP8 path's limit (:func:`benchmarks.limit.limit_figures`): the dense FP8 GEMM pair of
    ``rows`` rows and a read of ``nbytes`` bytes (:func:`fp8_bytes`), the larger of the two."""
    gemm_us = fp8_gemm_pair_us(meter, rows, hidden, inter)
    read_us, _ = meter.read_us(nbytes)
    return {**limit_figures(gemm_us, read_us, 6 * rows * hidden * inter, nbytes), "bytes": nbytes}


def fp8_gemm_pair_us(meter: LimitMeter, rows: int, hidden: int, inter: int) -> float:
    """µs of the dense FP8 GEMM pair with row-wise scales (cuBLAS ``_scaled_mm``)."""
    a = meter.take("a", rows * hidden).view(rows, hidden).to(E4M3)
    w1 = meter.take("w1", 2 * inter * hidden).view(2 * inter, hidden).to(E4M3)
    a2 = meter.take("a2", rows * inter).view(rows, inter).to(E4M3)
    w2 = meter.take("w2", hidden * inter).view(hidden, inter).to(E4M3)
    sa, sa2 = torch.ones(rows, 1, device="cuda"), torch.ones(rows, 1, device="cuda")
    s1, s2 = torch.ones(1, 2 * inter, device="cuda"), torch.ones(1, hidden, device="cuda")

    def pair():
        torch._scaled_mm(a, w1.t(), sa, s1, out_dtype=torch.bfloat16)
        torch._scaled_mm(a2, w2.t(), sa2, s2, out_dtype=torch.bfloat16)

    return median_replay_ms(pair, meter.reps, meter.settle_s) * 1e3


def time_path(fn, out, live, ref, reps, settle_s) -> dict:
    out.fill_(float("nan"))
    try:
        fn()
        torch.cuda.synchronize()
        err = float((out[:live].float() - ref).norm() / ref.norm()) if ref is not None else 0.0
        rec = {"err_vs_bf16": err, "tail_zero": bool((out[live:] == 0).all())}
        rec["us"] = median_replay_ms(fn, reps, settle_s) * 1e3
        return rec
    except Exception as exc:  # a path that cannot run a shape is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def bf16_experts(x, wg, wu, wd, cu, rw, out):
    """The bf16 experts op on one problem, as a call that writes ``out``."""
    return lambda: moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out)


def fp8_experts(x, weights, scales, cu, rw, out):
    """The FP8 experts op on e4m3 ``weights`` (gate, up, down) and their block ``scales``, as a call
    that writes ``out``."""
    (qg, qu, qd), (sg, su, sd) = weights, scales
    return lambda: moonep_ops.moonep_experts(x, qg, qu, qd, cu, rw, out=out, w_gate_scale=sg, w_up_scale=su,
                                             w_down_scale=sd)


def run_shape(shape, padding, meter, reps, settle_s) -> dict:
    x, wg, wu, wd, cu, rw, sizes = build_problem(shape, padding)
    live = sum(sizes)
    (qg, sg), (qu, su), (qd, sd) = (fp8.quantize_weight(w) for w in (wg, wu, wd))
    torch_fp8 = TorchFp8(wg, wu, wd)
    out = torch.empty_like(x)
    row = {"shape": shape.name, "token_padding": padding, "nvs": x.shape[0], "rows": live}  # rows in segments
    row["moonep_bf16"] = time_path(bf16_experts(x, wg, wu, wd, cu, rw, out), out, live, None, reps, settle_s)
    ref = out[:live].float().clone()
    del wg, wu, wd
    scales = (sg, su, sd)
    row["moonep_fp8_row_major"] = time_path(fp8_experts(x, (qg, qu, qd), scales, cu, rw, out), out, live, ref,
                                            reps, settle_s)
    qg, qu, qd = (fp8.to_block_major(w) for w in (qg, qu, qd))
    row["moonep_fp8"] = time_path(fp8_experts(x, (qg, qu, qd), scales, cu, rw, out), out, live, ref, reps,
                                  settle_s)
    row["torch_fp8"] = time_path(lambda: torch_fp8(x, cu, rw, out), out, live, ref, reps, settle_s)
    del qg, qu, qd, torch_fp8
    torch.cuda.empty_cache()
    row["limit"] = fp8_limit(meter, live, shape.hidden, shape.inter, fp8_bytes(sizes, shape))
    for name in ("moonep_bf16", "moonep_fp8", "moonep_fp8_row_major", "torch_fp8"):
        if "us" in row[name]:
            row[name]["eff_limit"] = row["limit"]["us"] / row[name]["us"]
    return row


def _print_row(row) -> None:
    def us(name):
        return row[name].get("us", float("nan"))
    b, f, r, t = us("moonep_bf16"), us("moonep_fp8"), us("moonep_fp8_row_major"), us("torch_fp8")
    print(f"{row['shape']:<28} pad={row['token_padding']:<3} limit {row['limit']['us']:7.0f}us "
          f"({row['limit']['bound']}) | bf16 {b:7.0f} | fp8 {f:7.0f} x{b / f:.2f} vs bf16, x{t / f:.2f} vs torch, "
          f"eff {row['moonep_fp8'].get('eff_limit', float('nan')):.2f}, "
          f"err {row['moonep_fp8'].get('err_vs_bf16', 0):.1e}"
          f" | fp8 [G, N, K] {r:7.0f}"
          f" | torch_fp8 {t:7.0f} {row['torch_fp8'].get('error', '')[:60]}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--paddings", type=cli.padding_list, default="128,1")
    parser.add_argument("--shapes", type=cli.shape_list, default="all", help="comma-separated indices into SHAPES")
    args = parser.parse_args(argv)
    cli.require_gpu(parser)
    meter = LimitMeter(args.reps, args.settle)
    rows = []
    with torch.inference_mode():
        for padding in args.paddings:
            for shape in args.shapes:
                rows.append(run_shape(shape, padding, meter, args.reps, args.settle))
                _print_row(rows[-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": {**environment(), "reps": args.reps, "settle_s": args.settle}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
