"""A/B timing of forward GEMM configs (issue 6), robust to the GPU's drift.

``benchmarks.tune`` times candidates one after another; on the H200 two runs of the same
kernel a minute apart differ by up to 10% (clocks, power), more than the differences being
sought. Here every candidate is captured in its own CUDA graph first, then timed in
``--rounds`` rounds, each replaying every candidate ``--reps`` times in a shuffled order;
a candidate's time is the median over rounds of its per-round median. Each candidate's output
is checked against the committed config's on the live rows first.

Per shape (padding 128 unless ``--paddings``): the fused gate/up GEMM and the down GEMM with the
committed config and with ``FUSED`` / ``DOWN`` below (the fused ones leave ``act``'s tail
unwritten, as the ``experts`` op does; ``committed_zero_tail`` writes it), then whole paths
(fused then down in one graph, all checked to give the same ``out``): ``zero_act_tail`` (the
two public ops composed), ``no_pdl`` (the fused GEMM then the down GEMM, plainly), ``pdl`` (what
the ``experts`` op runs on Hopper: the down GEMM a programmatic dependent launch of the fused one,
warming L2 with its first weight tile), ``pdl_no_prefetch`` and the fastest config of each role.
Results so far: ``benchmarks/results/probe_h200_*.json`` and ``scripts/gpu_check_results.md``.
``--mode profile`` runs each role once with the committed configs (for ``ncu``).
Usage: python -m benchmarks.probe [--shapes 0,1,2,3,4,5] [--out probe.json]
"""

import argparse
import dataclasses
import json
import random
import statistics

import torch

from moonep_ops.kernels import configs
from moonep_ops.kernels.configs import GemmConfig
from moonep_ops.kernels import triton_grouped_gemm as gemm
from moonep_ops.kernels.triton_grouped_gemm import launch_grouped_gemm, launch_grouped_gemm_silu_mul

from .run import capture_graph, environment
from .shapes import SHAPES, build_problem

CAP = (9, 0)

# name -> GemmConfig, or a function of the committed config; "committed" is added per shape
# (configs.py's pick). Earlier sweeps (probe_h200_configs.json, probe_h200_k128.json,
# probe_h200_pair.json): 256-row tiles lose everywhere, BLOCK_K 128 helps the memory-bound
# shapes only, pair tiles (two row tiles per weight tile load) lose 6-27%; segment-major item
# order (group_major) cuts kimi-k2 S=1024 by 9-13%; with warp specialization
# it loses (probe_h200_group_major_ws.json); two CTAs per SM (smaller tiles, 2 stages) lose
# 0-30% on the memory-bound shapes (probe_h200_2cta.json).
# Ninth session: the output's tail zeros written by TMA stores of a zero tile, or by the PDL
# dependent before its wait, were no faster (probe_h200_tma_tail.json, probe_h200_tail_first.json;
# the tail is bound by the DRAM write rate): both removed from the kernel.
FUSED = {}
DOWN = {}


def committed(role, shape, nvs) -> GemmConfig:
    if role == "fused":
        return configs.fused_gemm_config(shape.inter, shape.hidden, nvs, torch.bfloat16, CAP)
    return configs.gemm_config(shape.hidden, shape.inter, nvs, torch.bfloat16, CAP)


def _resolve(cand, committed_cfg) -> GemmConfig:
    return cand if isinstance(cand, GemmConfig) else cand(committed_cfg)


def time_interleaved(fns: dict, rounds: int, reps: int) -> dict:
    """name -> {"us": median over rounds of the per-round median, "rounds_us": [...]}."""
    graphs = {name: capture_graph(fn, warmup=2) for name, fn in fns.items()}
    per_round = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        order = list(graphs)
        random.Random(r).shuffle(order)
        for name in order:
            graph = graphs[name]
            graph.replay()
            times = []
            for _ in range(reps):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            per_round[name].append(statistics.median(times))
    del graphs
    return {name: {"us": statistics.median(v), "rounds_us": v} for name, v in per_round.items()}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="time", choices=["time", "profile"])
    parser.add_argument("--shapes", default="0,1,2,3,4,5")
    parser.add_argument("--paddings", default="128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = []
    for padding in [int(p) for p in args.paddings.split(",")]:
        for idx in [int(i) for i in args.shapes.split(",")]:
            results.append(_probe_shape(SHAPES[idx], padding, args))
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "method": __doc__, "results": results}, f, indent=1)


def _probe_shape(shape, padding, args) -> dict:
    x, wg, wu, wd, cu, rw, sizes = build_problem(shape, padding)
    nvs, live = x.shape[0], sum(sizes)
    act = torch.empty(nvs, shape.inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(nvs, shape.hidden, device="cuda", dtype=torch.bfloat16)

    def fused(cfg, zero_tail=False):
        return lambda: launch_grouped_gemm_silu_mul(x, wg, wu, rw, cu, act, cfg, True, zero_tail=zero_tail)

    def down(cfg, pdl=""):
        return lambda: launch_grouped_gemm(act, wd, cu, out, cfg, True, pdl=pdl)

    def pdl_path(prefetch):
        def run():
            saved = gemm.PREFETCH_FIRST_WEIGHT_TILE
            gemm.PREFETCH_FIRST_WEIGHT_TILE = prefetch
            try:
                launch_grouped_gemm_silu_mul(x, wg, wu, rw, cu, act, cfg_f, True, zero_tail=False, pdl="primary")
                down(cfg_d, "dependent")()
            finally:
                gemm.PREFETCH_FIRST_WEIGHT_TILE = saved
        return run

    cfg_f, cfg_d = committed("fused", shape, nvs), committed("down", shape, nvs)
    if args.mode == "profile":
        fused(cfg_f)()
        down(cfg_d)()
        torch.cuda.synchronize()
        return {}
    print(f"{shape.name} pad={padding}: NvS {nvs}, live rows {live}", flush=True)
    row = {"shape": shape.name, "padding": padding, "nvs": nvs, "live": live, "roles": {}, "paths": {}}
    cands = {
        "fused": {"committed_zero_tail": (cfg_f, True), "committed": (cfg_f, False),
                  **{k: (_resolve(v, cfg_f), False) for k, v in FUSED.items()}},
        "down": {"committed": (cfg_d, None), **{k: (_resolve(v, cfg_d), None) for k, v in DOWN.items()}},
    }
    best = {}
    for role, role_cands in cands.items():
        dst = act if role == "fused" else out
        fns, ref = {}, None
        for name, (cfg, zero_tail) in role_cands.items():
            fn = fused(cfg, zero_tail) if role == "fused" else down(cfg)
            try:
                dst.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                if ref is None:
                    ref = dst[:live].float().clone()
                err = float((dst[:live].float() - ref).norm() / ref.norm())
                if not err <= 1e-2:
                    raise RuntimeError(f"wrong result: rel err {err:.3g} vs committed")
                fns[name] = fn
            except Exception as exc:
                row["roles"].setdefault(role, {})[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"  {role:<5} {name:<22} ERROR {str(exc)[:150]}", flush=True)
        timed = time_interleaved(fns, args.rounds, args.reps)
        for name, r in timed.items():
            r["cfg"] = dataclasses.asdict(role_cands[name][0])
            print(f"  {role:<5} {name:<22} {r['us']:8.1f} us  rounds {' '.join(f'{t:.0f}' for t in r['rounds_us'])}",
                  flush=True)
        row["roles"].setdefault(role, {}).update(timed)
        best[role] = min((n for n in timed if n != "committed_zero_tail"), key=lambda n: timed[n]["us"])
    bf, bd = cands["fused"][best["fused"]][0], cands["down"][best["down"]][0]
    paths = {"zero_act_tail": lambda: (fused(cfg_f, True)(), down(cfg_d)()),
             "no_pdl": lambda: (fused(cfg_f)(), down(cfg_d)()),
             "pdl": pdl_path(True), "pdl_no_prefetch": pdl_path(False),
             f"best:{best['fused']}+{best['down']}": lambda: (fused(bf)(), down(bd)())}
    ref = None
    for name, fn in paths.items():  # every path writes the same ``out`` (tail zeros included)
        act.fill_(float("nan"))
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float().clone()
        err = float((out.float() - ref).norm() / ref.norm())
        print(f"  path  {name:<40} rel err vs the first path {err:.2e}", flush=True)
        if not err <= 1e-6:
            raise RuntimeError(f"path {name}: wrong result (rel err {err:.3g})")
    for name, r in time_interleaved(paths, args.rounds, args.reps).items():
        row["paths"][name] = r
        print(f"  path  {name:<40} {r['us']:8.1f} us  rounds {' '.join(f'{t:.0f}' for t in r['rounds_us'])}",
              flush=True)
    return row


if __name__ == "__main__":
    main()
