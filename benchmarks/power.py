"""Power, SM clock and per-call time of the expert paths under sustained load.

Why the compute-heavy shapes stop below 0.8 of the floor (issue 6): the benchmark's medians come
from a warm GPU, and a first replay on a cool one is faster. Per shape and path: the GPU idles
``--idle`` seconds, then a CUDA graph of one call is replayed back to back for ``--seconds``
(CUDA events between replays, one host sync at the end) while ``nvidia-smi`` samples power draw,
SM clock, temperature and the active clock-event reasons every 50 ms. Reported: the per-call
time of the first replays (cool) and the median over the last half of the window (sustained),
mean power and SM clock over that half, the board's energy per call there (power x time), and
the clock-event reasons seen in it. First, the same
for a dense bf16 ``torch.mm`` (8192^3) and a 4 GiB copy: the ceilings under the same load.

``--ab SET`` instead compares candidates under the same sustained load, the GPU hot
throughout: the experts op's Gluon pair with the committed configs ("table") and with the
overrides of ``AB_SETS[SET]`` ("stacked": the fused GEMM's gate/up tiles stacked, one 64x256
wgmma per warpgroup, fewer shared-memory reads; "energy": that and other tile shapes of either
GEMM; "combo": the winners of "energy", alone and together; "idle_half": idle upper halves
skipped in neither GEMM or in both; "out_tail": the output's tail zeroed by the fused GEMM or by
the down GEMM; "split_epilogue": kimi-k2's down GEMM with three stages, with and without a split
epilogue, against the table's; "qwen_s2048": 128x256 down tiles and stacked fused tiles there;
"handoff": the row-tile handoff between the two GEMMs on and off; "zero_box": the producers' tail
zeros in 4 x 256 boxes; "half_loads": idle upper halves' `a` rows loaded or not, and the skip where
the table does not take it).
``--cool`` times the same candidates in interleaved short bursts instead (benchmarks/probe.py's
rounds: a cool board's ranking). Under the power cap the board's
energy per call decides the time, and that can rank candidates differently from a cool-board
probe. The overrides apply to the table as it is when run: the committed results
(``power_h200_ab_energy.json``, ``power_h200_ab_combo.json``) were measured against the eleventh
session's table, so on today's table some candidates equal it (and are skipped) or differ.
Per round (shuffled order) each candidate replays back to back for
``--seconds``; reported per candidate: the median over rounds of its slots' median per-call time
(the first tenth of each slot skipped), and the board power, energy per call and SM clock over
its slots. Results are checked against the first candidate before timing.

Usage: python -m benchmarks.power [--shapes 1,4] [--paths vllm,moonep]
    [--seconds 4] [--idle 3] [--out power.json]
       python -m benchmarks.power --ab SET [--cool] [--shapes 1,4]
           [--rounds 5] [--seconds 1]
"""

import argparse
import json
import random
import statistics
import subprocess
import threading
import time

import torch

from .paths import PATHS
from .run import capture_graph, environment, floor_us
from .shapes import SHAPES, build_problem

# power.draw.instant where the driver has it: power.draw is a one-second average on Hopper.
POWER_FIELDS = ("power.draw.instant", "power.draw")
OTHER_FIELDS = ("clocks.sm", "temperature.gpu", "clocks_event_reasons.active")


def _gpu_selector() -> list[str]:
    """``-i <PCI bus id>`` of the current CUDA device (nvidia-smi's numbering can differ from
    CUDA's), or nothing when torch does not expose the bus id."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        return ["-i", f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"]
    except AttributeError:
        return []


def _query(fields, extra=()) -> list[str]:
    cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()


def _fields(select) -> tuple[tuple, list]:
    """(the first power field this driver answers with a number, then the others; the GPU
    selector that worked: ``select``, else none, for a single-GPU machine)."""
    for sel in (select, []) if select else ([], ):
        for power in POWER_FIELDS:
            try:
                out = _query((power, *OTHER_FIELDS), sel)
                if len(out) != 1:
                    continue  # several GPUs answered: samples would mix them
                float(out[0].split(",")[0])
                return (power, *OTHER_FIELDS), sel
            except (subprocess.CalledProcessError, ValueError, IndexError):
                continue
    raise RuntimeError(f"nvidia-smi answers none of {POWER_FIELDS} with {OTHER_FIELDS} for one GPU here")


class Sampler:
    """``nvidia-smi`` every 50 ms in the background; samples stamped with host time on arrival."""

    def __init__(self, fields, select):
        self.fields = fields
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                      "-lms", "50", *select], stdout=subprocess.PIPE, text=True, bufsize=1)
        self.samples = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(self.fields):
                continue
            try:
                self.samples.append((time.time(), float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
            except ValueError:
                continue

    def window(self, t0, t1):
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def _one_replay_us(graph) -> float:
    """One replay's time after a warm one: the estimate that sizes a stretch of replays."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _back_to_back(graph, seconds: float, est_us: float) -> tuple[list, float, float]:
    """(per-replay µs, host start, host end) of back-to-back replays for about ``seconds``: CUDA
    events between them, one host sync at the end."""
    reps = max(20, int(seconds * 1e6 / max(est_us, 1.0)))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    t0 = time.time()
    events[0].record()
    for i in range(reps):
        graph.replay()
        events[i + 1].record()
    events[-1].synchronize()
    t1 = time.time()
    return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(reps)], t0, t1


def sustained(fn, seconds: float, sampler: Sampler) -> dict:
    graph = capture_graph(fn)
    us, t0, t1 = _back_to_back(graph, seconds, _one_replay_us(graph))
    reps = len(us)
    # The replays run back to back from about t0 to t1, so the second half of the wall time and
    # the second half of the replays (the sustained median) are about the same stretch.
    half = (t0 + t1) / 2
    window = sampler.window(half, t1)
    if not window:
        alive = sampler.proc.poll() is None
        print(f"# power: no nvidia-smi samples in the window (sampler {'running' if alive else 'exited'})", flush=True)
    reasons = sorted({s[4] for s in window})
    power = statistics.mean(s[1] for s in window) if window else None
    sustained_us = statistics.median(us[reps // 2:])
    return {"reps": reps, "first_us": statistics.median(us[:5]), "sustained_us": sustained_us,
            # board energy per call at the sustained rate: what decides speed under the power cap
            "joules_per_call": power * sustained_us * 1e-6 if power else None,
            "seconds": t1 - t0, "power_w": power,
            "sm_mhz": statistics.mean(s[2] for s in window) if window else None,
            "temp_c": max(s[3] for s in window) if window else None, "clock_event_reasons": reasons,
            "samples": len(window)}


def _slot(graph, seconds: float, est_us: float, sampler: Sampler) -> dict:
    """One candidate's slot: back-to-back replays for about ``seconds``; the first tenth skipped."""
    us, t0, t1 = _back_to_back(graph, seconds, est_us)
    window = sampler.window(t0 + (t1 - t0) / 10, t1)
    return {"us": statistics.median(us[len(us) // 10:]), "power": [w[1] for w in window], "mhz": [w[2] for w in window]}


def sustained_ab(fns: dict, rounds: int, seconds: float, sampler: Sampler) -> dict:
    """name -> sustained per-call time (median over rounds), power, energy per call, SM clock;
    candidates interleaved in shuffled order, after one slot of heating."""
    graphs = {name: capture_graph(fn) for name, fn in fns.items()}
    est = {name: _one_replay_us(graph) for name, graph in graphs.items()}
    first = next(iter(graphs))
    _slot(graphs[first], seconds, est[first], sampler)  # heat the board before the first round
    slots = {name: [] for name in graphs}
    for r in range(rounds):
        order = list(graphs)
        random.Random(r).shuffle(order)
        for name in order:
            slots[name].append(_slot(graphs[name], seconds, est[name], sampler))
    out = {}
    for name, v in slots.items():
        us = statistics.median(s["us"] for s in v)
        power = [p for s in v for p in s["power"]]
        mhz = [m for s in v for m in s["mhz"]]
        watts = statistics.mean(power) if power else None
        out[name] = {"us": us, "rounds_us": [s["us"] for s in v], "power_w": watts,
                     "joules_per_call": watts * us * 1e-6 if watts else None,
                     "sm_mhz": statistics.mean(mhz) if mhz else None}
    return out


# A down GEMM in 128x256 cooperative tiles, four stages and a split epilogue (two candidates use it)
_DOWN_N256_S4_SPLIT = {"block_n": 256, "stages": 4, "pingpong": False, "epilogue_n": 128}

# Candidate sets of ``--ab``: name -> (fused GEMM overrides, down GEMM overrides) of the
# committed Gluon configs. Cool-board probes (benchmarks/probe_gluon.py, short bursts) ranked
# these by time; under the power cap what counts is energy per call, which can rank them
# differently (a wider tile reads fewer L2 bytes per FLOP but fits fewer stages).
AB_SETS = {
    "stacked": {"stacked": ({"stacked": True}, {})},
    "energy": {
        "stacked": ({"stacked": True}, {}),
        "fused_coop128": ({"block_n": 128, "stages": 4, "pingpong": False}, {}),
        "fused_pp64": ({"block_n": 64, "stages": 6, "pingpong": True}, {}),
        "down_coop256": ({}, {"block_n": 256, "stages": 3, "pingpong": False}),
        "down_pp128": ({}, {"block_n": 128, "stages": 5, "pingpong": True}),
        "down_coop128": ({}, {"block_n": 128, "stages": 6, "pingpong": False}),
    },
    # The winners of "energy" (thirteenth session, shapes 1 and 4), alone and together.
    "combo": {
        "stacked": ({"stacked": True}, {}),
        "down_coop256": ({}, {"block_n": 256, "stages": 3, "pingpong": False}),
        "stacked_down256": ({"stacked": True}, {"block_n": 256, "stages": 3, "pingpong": False}),
        "coop128_stacked": ({"block_n": 128, "stages": 4, "pingpong": False, "stacked": True}, {}),
        "coop128_stacked_down256": ({"block_n": 128, "stages": 4, "pingpong": False, "stacked": True},
                                    {"block_n": 256, "stages": 3, "pingpong": False}),
    },
    # Idle upper halves (fifteenth session): the MMAs of a segment's last row tile's upper 64
    # rows skipped where they all have route weight 0 (MoonEP's padding) or lie past the end,
    # in neither GEMM or in both (the table: where measured faster).
    "idle_half": {
        "no_skip": ({"skip_idle_half": False}, {"skip_idle_half": False}),
        "all_skip": ({"skip_idle_half": True}, {"skip_idle_half": True}),
    },
    # The down GEMM's output tail zeroed by the fused GEMM's producer warp while it computes
    # (fifteenth session), or by the down GEMM (its consumers or producer, as its config says).
    "out_tail": {
        "fused_takes_tail": ({"takes_out_tail": True}, {}),
        "down_keeps_tail": ({"takes_out_tail": False}, {}),
    },
    # Split epilogue (sixteenth session): kimi-k2's down GEMM in 128x256 tiles with three stages
    # and the whole-tile buffer, and with three stages and the split epilogue (its cost alone),
    # against the table's (four stages, split, when measured; now only at S=1024, so on the other
    # shapes "down_s3" is the table's own config and is skipped).
    "split_epilogue": {
        "down_s3": ({}, {"stages": 3, "epilogue_n": 0}),
        "down_s3_split": ({}, {"stages": 3, "epilogue_n": 128}),
    },
    # qwen3 S=2048 (sixteenth session): its down GEMM in 128x256 tiles (three stages, or four with
    # a split epilogue) and the fused GEMM's stacked gate/up tiles, alone and together.
    "qwen_s2048": {
        "down_n256_s3": ({}, {"block_n": 256, "stages": 3, "pingpong": False}),
        "down_n256_s4_split": ({}, _DOWN_N256_S4_SPLIT),
        "fused_stacked": ({"stacked": True}, {}),
        "stacked_down_n256_s4_split": ({"stacked": True}, _DOWN_N256_S4_SPLIT),
    },
    # The row-tile handoff (seventeenth session): the down GEMM's programs take items from a
    # counter and start on row tiles of act the fused GEMM has signalled, instead of waiting for
    # its whole grid (its last partial wave); with the table's tiles, on or off ("handoff" in
    # the fused config: the op's switch).
    "handoff": {
        "handoff": ({"handoff": True}, {}),
        "no_handoff": ({"handoff": False}, {}),
    },
    # The producers' tail zeros in 4 x 256 boxes (512-byte rows, unswizzled) instead of 8 x 128
    # (two 128-byte swizzled pieces per row): the fused GEMM's share of out's tail (qwen3 S=2048),
    # the down GEMM's own (kimi-k2), or both.
    "zero_box": {
        "fused_zero256": ({"zero_cols": 256}, {}),
        "down_zero256": ({}, {"zero_cols": 256}),
        "both_zero256": ({"zero_cols": 256}, {"zero_cols": 256}),
    },
    # Half loads (eighteenth session): an idle-upper-half tile's producer loads only the lower half
    # of its `a` rows (the table, where it skips), or the whole box as before ("full_loads"); and
    # the skip where the table does not take it, now with half loads: qwen3 S=2048's down GEMM
    # (+1.3% with whole loads, fifteenth session), kimi-k2 decode's fused GEMM (-1.8% then).
    "half_loads": {
        "full_loads": ({"half_loads": False}, {"half_loads": False}),
        "down_skip": ({}, {"skip_idle_half": True}),
        "fused_skip": ({"skip_idle_half": True}, {}),
    },
}


def config_candidates(shape, padding, ab: str) -> tuple[dict, torch.Tensor, int, float]:
    """The experts op's Gluon pair (PDL as the op pairs them) with the committed configs
    ("table"), then each candidate of ``AB_SETS[ab]`` that differs from it; the output buffer,
    its live rows and the floor."""
    from moonep_ops.kernels import gluon_grouped_gemm as gg
    from moonep_ops.kernels.configs import GluonConfig

    from .probe_gluon import setup_pair

    (x, wg, wu, wd, cu, rw, sizes), act, out, sms, (cf, cd), _ = setup_pair(shape, padding)

    def pair(fused_cfg, down_cfg):
        # as the op pairs them: a fused config with takes_out_tail zeroes out's tail, the down GEMM not
        took = fused_cfg.get("takes_out_tail", False)
        # the row-tile handoff: a zeroed state buffer per call, as the op allocates it
        target = gg.flag_target(GluonConfig(**fused_cfg), wg.shape[1]) if fused_cfg.get("handoff") else 0

        def run():
            sched = gg.handoff_buffer(x.shape[0], wg.shape[0], 128, x.device) if target else None
            gg.launch(x, wg, cu, act, sms, w_up=wu, route_weights=rw, zero_tail=False, pdl="primary",
                      tail_out=out if took else None, sched=sched, **fused_cfg)
            gg.launch(act, wd, cu, out, sms, pdl="dependent", idle_weights=rw, zero_tail=not took, sched=sched,
                      flag_target=target, **down_cfg)
        return run

    fns, seen = {"table": pair(cf, cd)}, [(cf, cd)]
    for name, (f_over, d_over) in AB_SETS[ab].items():
        cfgs = ({**cf, **f_over}, {**cd, **d_over})
        if cfgs not in seen:  # the table's own config under another name
            seen.append(cfgs)
            fns[name] = pair(*cfgs)
    return fns, out, sum(sizes), floor_us(sizes, shape)[0]


def _shapes(spec: str) -> list:
    return [SHAPES[int(i)] for i in spec.split(",") if i.strip()]


def run_ab(args, sampler, record) -> None:
    for shape in _shapes(args.shapes):
        fns, out, live, floor = config_candidates(shape, args.padding, args.ab)
        ref, ok = None, {}
        for name, fn in fns.items():  # every candidate checked against the first before timing
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = out[:live].float().clone()
            err = float((out[:live].float() - ref).norm() / ref.norm())
            tail_zero = bool((out[live:] == 0).all())
            if err <= 1e-2 and tail_zero and not torch.isnan(out[:live]).any():
                ok[name] = fn
            print(f"{shape.name:<28} {name:<14} rel err vs first {err:.1e}  tail zero {tail_zero}", flush=True)
        time.sleep(args.idle)
        if args.cool:  # interleaved short bursts (benchmarks/probe.py): the cool board's ranking
            from .probe import time_interleaved

            results = time_interleaved(ok, args.rounds, 10)
        else:
            results = sustained_ab(ok, args.rounds, args.seconds, sampler)
        for name, r in results.items():
            r.update(shape=shape.name, padding=args.padding, path=name, floor_us=floor, eff=floor / r["us"],
                     **({"cool": True} if args.cool else {}))
            record(r)
            line = (f"{shape.name:<28} {name:<16} {'cool' if args.cool else 'sustained'} {r['us']:8.1f} us "
                    f"(eff {r['eff']:.2f})  rounds {' '.join(f'{t:.0f}' for t in r['rounds_us'])}")
            if not args.cool:
                line += (f"  {_num(r['power_w'], '5.0f')} W  "
                         f"{_num(r['joules_per_call'] and r['joules_per_call'] * 1e3, '6.1f')} mJ/call  "
                         f"{_num(r['sm_mhz'], '5.0f')} MHz")
            print(line, flush=True)
        del fns, out, ref
        torch.cuda.empty_cache()


def _num(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="1,4")
    parser.add_argument("--paths", default="vllm,moonep")
    parser.add_argument("--padding", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ab", default="", choices=["", *AB_SETS])
    parser.add_argument("--cool", action="store_true", help="--ab: interleaved short bursts instead of sustained slots")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    fields, select = _fields(_gpu_selector())
    limits = _query(("power.limit", "power.max_limit", "clocks.max.sm", "clocks.applications.graphics"), select)
    env = {**environment(), "power_limit_w,max_limit_w,max_sm_mhz,app_sm_mhz": limits, "sampled": fields,
           "nvidia_smi_select": select}
    print(f"# {env}", flush=True)
    sampler = Sampler(fields, select)
    rows = []

    def record(r):  # written after every row: a run cut by a timeout keeps what it measured
        rows.append(r)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"env": env, "method": __doc__, "rows": rows}, f, indent=1)

    try:
        if args.ab:
            run_ab(args, sampler, record)
            return
        # The ceilings under the same load: a dense bf16 matmul (the kind of work the floor's 757
        # TFLOP/s prices) and a 4 GiB copy, sustained like the paths.
        n = 8192
        a, b, c = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        time.sleep(args.idle)
        r = sustained(lambda: torch.mm(a, b, out=c), args.seconds, sampler)
        r.update(shape=f"torch.mm {n}^3 bf16", path="cublas", tflops_first=2 * n ** 3 / r["first_us"] / 1e6,
                 tflops_sustained=2 * n ** 3 / r["sustained_us"] / 1e6)
        record(r)
        print(f"{r['shape']:<28} {'cublas':<18} first {r['tflops_first']:6.0f} TFLOP/s  sustained "
              f"{r['tflops_sustained']:6.0f} TFLOP/s  {_num(r['power_w'], '5.0f')} W  {_num(r['sm_mhz'], '5.0f')} MHz  "
              f"reasons {r['clock_event_reasons']}", flush=True)
        del a, b, c
        src = torch.randn(2 ** 30, device="cuda")
        dst = torch.empty_like(src)
        time.sleep(args.idle)
        r = sustained(lambda: dst.copy_(src), args.seconds, sampler)
        r.update(shape="copy 4 GiB fp32", path="copy", tbps_first=2 * src.nbytes / r["first_us"] / 1e6,
                 tbps_sustained=2 * src.nbytes / r["sustained_us"] / 1e6)
        record(r)
        print(f"{r['shape']:<28} {'copy':<18} first {r['tbps_first']:6.2f} TB/s  sustained {r['tbps_sustained']:6.2f} "
              f"TB/s  {_num(r['power_w'], '5.0f')} W  {_num(r['sm_mhz'], '5.0f')} MHz  reasons {r['clock_event_reasons']}",
              flush=True)
        del src, dst
        torch.cuda.empty_cache()
        for shape in _shapes(args.shapes):
            x, wg, wu, wd, cu, rw, sizes = build_problem(shape, args.padding)
            floor = floor_us(sizes, shape)[0]
            out = torch.empty(x.shape[0], shape.hidden, device="cuda", dtype=torch.bfloat16)
            for name in args.paths.split(","):
                fn = PATHS[name]
                time.sleep(args.idle)
                r = sustained(lambda: fn(x, wg, wu, wd, cu, rw, out), args.seconds, sampler)
                r.update(shape=shape.name, padding=args.padding, path=name, floor_us=floor,
                         eff_first=floor / r["first_us"], eff_sustained=floor / r["sustained_us"])
                record(r)
                print(f"{shape.name:<28} {name:<18} first {r['first_us']:8.1f} us (eff {r['eff_first']:.2f})  "
                      f"sustained {r['sustained_us']:8.1f} us (eff {r['eff_sustained']:.2f})  "
                      f"{_num(r['power_w'], '5.0f')} W  "
                      f"{_num(r['joules_per_call'] and r['joules_per_call'] * 1e3, '6.1f')} mJ/call  "
                      f"{_num(r['sm_mhz'], '5.0f')} MHz  {r['temp_c']} C  "
                      f"reasons {r['clock_event_reasons']}", flush=True)
            del x, wg, wu, wd, out
            torch.cuda.empty_cache()
    finally:
        sampler.stop()


if __name__ == "__main__":
    main()
