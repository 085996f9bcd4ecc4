"""A/B of the Gluon warp-specialized kernels (:mod:`moonep_ops.kernels.gluon_grouped_gemm`) against
the committed Triton kernel on the six BASELINE shapes (issue 6), per GEMM and for the whole path.

Per shape: the fused gate/up GEMM (``act``'s tail left unwritten, as in the ``experts`` op) with the
committed Triton config, the committed Gluon config (``table``) and each ``FUSED`` Gluon config,
checked against the Triton output on the live rows; the down GEMM (``out`` poisoned with NaN
first) with the Triton config, ``table`` and each ``DOWN`` Gluon config, checked against a float64
reference and for zeros in the tail; then whole paths: the ``experts`` op as committed and the
fastest Gluon fused + Gluon down, paired with PDL as the op pairs them.
All timed as CUDA graphs, interleaved (:func:`benchmarks.probe.time_interleaved`).
Results: ``benchmarks/results/probe_gluon_h200*.json``.

``--ab tail_pdl`` (eleventh session) instead compares, with the committed Gluon configs: the down
GEMM with its tail zeroed by the producer warp (spread over its loads) or by the consumers after
their real items; and the whole ``experts`` op with and without programmatic dependent launch
(``MOONEP_OPS_NO_PDL``), against the explicit pair as the tenth session ran it (no PDL, tail by
the consumers).

Usage: python -m benchmarks.probe_gluon [--shapes 0,1,2,3,4,5] [--paddings 128,1] [--ab tail_pdl] [--out f.json]
"""

import argparse
import contextlib
import dataclasses
import json
import os

import torch

import moonep_ops

from moonep_ops.kernels import configs
from moonep_ops.kernels import gluon_grouped_gemm as gg
from moonep_ops.kernels.triton_grouped_gemm import _num_sms, launch_grouped_gemm, launch_grouped_gemm_silu_mul

from .probe import committed, time_interleaved
from .run import environment
from .shapes import SHAPES, build_problem

# BLOCK_K 128 (eleventh session): twice the bytes per TMA box, for the memory-bound shapes
# (benchmarks/results/dram_layout_h200.json: strided 128x64 boxes stream at 3.8 TB/s, 128x128
# ones at 4.5), at three stages (what fits next to the epilogue buffers). Timed in the twelfth
# session on kimi-k2 S=1024 and qwen3 S=2048 (probe_gluon_h200_candidates.json): +4 to +21%, as
# is the 256-column down GEMM (+3%).
DOWN = {
    "pp_s5": dict(stages=5),
    "coop_n128_s6": dict(pingpong=False, stages=6),
    "coop_n128_k128_s3": dict(pingpong=False, block_k=128, stages=3),
    "coop_n256_s3": dict(pingpong=False, block_n=256, stages=3),
}
FUSED = {
    "pp_n64_s6": dict(block_n=64, stages=6),
    "pp_n64_s5": dict(block_n=64, stages=5),
    "pp_n64_k128_s3": dict(block_n=64, block_k=128, stages=3),
    # gate and up tiles stacked in one buffer: one wgmma of 2 * block_n columns per `a` slice
    # (eleventh session; twelfth: about -1% on those two fused GEMMs, noise on the whole path)
    "pp_n64_s6_stacked": dict(block_n=64, stages=6, stacked=True),
    "coop_n128_s4_stacked": dict(pingpong=False, stages=4, stacked=True),
    "coop_n128_s4": dict(pingpong=False, stages=4),
    "coop_n128_s4_rows": dict(pingpong=False, stages=4, group_major=False),
}


def reference(act, wd, sizes):
    out, lo = [], 0
    for g, n in enumerate(sizes):
        if n:
            out.append(act[lo:lo + n].double() @ wd[g].double().T)
        lo += n
    return torch.cat(out)


def _check_and_time(fns, dst, live, ref, args, row, role):
    ok = {}
    for name, fn in fns.items():
        try:
            dst.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = dst[:live].double().clone()
            err = float((dst[:live].double() - ref).norm() / ref.norm())
            tail_ok = bool((dst[live:] == 0).all()) if role in ("down", "path") else True
            row["errors"][f"{role}:{name}"] = {"rel_err": err, "tail_zero": tail_ok}
            print(f"  {role:<5} {name:<20} rel err {err:.2e} tail zero {tail_ok}", flush=True)
            if err <= 1e-2 and tail_ok:
                ok[name] = fn
        except Exception as exc:  # the failure is the finding
            row["errors"][f"{role}:{name}"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"  {role:<5} {name:<20} ERROR {str(exc)[:300]}", flush=True)
    timed = time_interleaved(ok, args.rounds, args.reps) if args.time else {}
    for name, r in timed.items():
        row["timings"][f"{role}:{name}"] = r
        print(f"  {role:<5} {name:<20} {r['us']:8.1f} us  rounds {' '.join(f'{t:.0f}' for t in r['rounds_us'])}",
              flush=True)
    return timed


def setup_pair(shape, padding):
    """The shape's problem, NaN-poisoned ``act`` and ``out``, the SM count, the committed Gluon
    configs (fused, down) as dicts, and the result row, announced."""
    x, wg, wu, wd, cu, rw, sizes = build_problem(shape, padding)
    nvs, live = x.shape[0], sum(sizes)
    act = torch.full((nvs, shape.inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = torch.empty(nvs, shape.hidden, device="cuda", dtype=torch.bfloat16)
    tables = (dataclasses.asdict(configs.gluon_gemm_config(shape.inter, shape.hidden, nvs, fused=True)),
              dataclasses.asdict(configs.gluon_gemm_config(shape.hidden, shape.inter, nvs, fused=False)))
    row = {"shape": shape.name, "padding": padding, "nvs": nvs, "live": live, "errors": {}, "timings": {}}
    print(f"{shape.name} pad={padding}: NvS {nvs}, live rows {live}", flush=True)
    return (x, wg, wu, wd, cu, rw, sizes), act, out, _num_sms(torch.cuda.current_device()), tables, row


def probe_shape(shape, padding, args) -> dict:
    (x, wg, wu, wd, cu, rw, sizes), act, out, sms, (table_f, table_d), row = setup_pair(shape, padding)
    live = sum(sizes)
    cfg_f, cfg_d = committed("fused", shape, x.shape[0]), committed("down", shape, x.shape[0])

    # The committed Gluon configs join the candidates; a candidate that does not name the tail
    # scheme takes the committed one's, so that it differs from the table in its own knobs only.
    fused_cands = {"table": table_f, **FUSED}
    down_cands = {"table": table_d, **{n: {"tail_by_producer": table_d["tail_by_producer"], **kw}
                                       for n, kw in DOWN.items()}}

    def g_fused(kw, pdl=""):
        return lambda: gg.launch(x, wg, cu, act, sms, w_up=wu, route_weights=rw, zero_tail=False, pdl=pdl, **kw)

    def g_down(kw, pdl=""):
        return lambda: gg.launch(act, wd, cu, out, sms, pdl=pdl, idle_weights=rw, **kw)

    t_fused = lambda: launch_grouped_gemm_silu_mul(x, wg, wu, rw, cu, act, cfg_f, True, zero_tail=False)  # noqa: E731
    t_down = lambda: launch_grouped_gemm(act, wd, cu, out, cfg_d, True)  # noqa: E731
    fused = _check_and_time({"triton": t_fused, **{n: g_fused(kw) for n, kw in fused_cands.items()}}, act, live,
                            None, args, row, "fused")
    t_fused()
    ref = reference(act, wd, sizes)
    down = _check_and_time({"triton": t_down, **{n: g_down(kw) for n, kw in down_cands.items()}}, out, live, ref,
                           args, row, "down")
    if args.time and fused and down:
        bf = min((n for n in fused if n != "triton"), key=lambda n: fused[n]["us"])
        bd = min((n for n in down if n != "triton"), key=lambda n: down[n]["us"])
        # Whole paths as the experts op runs them: the down GEMM a programmatic dependent.
        paths = {
            "experts_op": lambda: moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out),
            f"gluon:{bf}+{bd}": lambda: (g_fused(fused_cands[bf], "primary")(),
                                         g_down(down_cands[bd], "dependent")()),
        }
        _check_and_time(paths, out, live, ref, args, row, "path")
    return row


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def probe_tail_pdl(shape, padding, args) -> dict:
    (x, wg, wu, wd, cu, rw, sizes), act, out, sms, (cf, cd), row = setup_pair(shape, padding)
    live = sum(sizes)
    row.update(fused_config=cf, down_config=cd)
    gg.launch(x, wg, cu, act, sms, w_up=wu, route_weights=rw, zero_tail=False, **cf)
    down = {
        "tail_by_producer": lambda: gg.launch(act, wd, cu, out, sms, **{**cd, "tail_by_producer": True}),
        "tail_by_consumers": lambda: gg.launch(act, wd, cu, out, sms, **{**cd, "tail_by_producer": False}),
    }
    ref = reference(act, wd, sizes)
    _check_and_time(down, out, live, ref, args, row, "down")

    def op(no_pdl):
        def run():
            with _env("MOONEP_OPS_NO_PDL", "1" if no_pdl else "0"):
                moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out)
        return run

    def tenth():
        gg.launch(x, wg, cu, act, sms, w_up=wu, route_weights=rw, zero_tail=False, **{**cf, "tail_by_producer": False})
        gg.launch(act, wd, cu, out, sms, **{**cd, "tail_by_producer": False})

    paths = {"experts_op": op(False), "experts_op_no_pdl": op(True), "tenth_session_pair": tenth}
    _check_and_time(paths, out, live, ref, args, row, "path")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0,1,2,3,4,5")
    parser.add_argument("--paddings", default="128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-time", dest="time", action="store_false")
    parser.add_argument("--ab", default="", choices=["", "tail_pdl"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    probe = probe_tail_pdl if args.ab == "tail_pdl" else probe_shape
    results = []
    for padding in [int(p) for p in args.paddings.split(",")]:
        for idx in [int(i) for i in args.shapes.split(",")]:
            results.append(probe(SHAPES[idx], padding, args))
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "method": __doc__, "down": DOWN, "fused": FUSED, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
