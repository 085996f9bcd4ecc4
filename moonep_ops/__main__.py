"""``python -m moonep_ops``: check the MoonEP expert path on this machine and report.

``check`` (the default) builds a small problem in MoonEP's layout (segments padded to 128
with zero padding rows, idle experts and unused prefetch slots as empty segments, NaN in
the undefined tail), runs :func:`moonep_ops.moonep_experts` eagerly and under
``torch.compile(fullgraph=True)``, compares both with a float64 reference written here,
counts graph breaks and times both; then the FP8 expert path (e4m3fn weights, 128 x 128 block
scales) on the CPU against a float64 recomputation of its semantics written here. Exit status 1
if any check fails.

``bench`` runs the benchmark suite of a source checkout (``benchmarks/run.py``).
"""

import argparse
import platform
import statistics
import sys
import time

import torch

import moonep_ops

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}

# Idle experts (0 rows) and real rows per weight row: E = 6 experts then B = 2 prefetch
# slots (one used, one empty), as vLLM 0.33's MoonEP backend lays them out.
REAL_ROWS = (100, 0, 37, 200, 0, 5, 64, 0)
TOKEN_PADDING = 128
HIDDEN, INTERMEDIATE = 256, 128


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def build_problem(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """``(x, w_gate, w_up, w_down, cu_seqlens, route_weights, num_real_rows_end)``."""
    gen = torch.Generator().manual_seed(seed)
    g, h, i = len(REAL_ROWS), HIDDEN, INTERMEDIATE
    sizes = [_align_up(r, TOKEN_PADDING) for r in REAL_ROWS]
    end = sum(sizes)
    # A static capacity like MoonEP's NvS bound: every real row plus worst-case padding.
    nvs = _align_up(sum(REAL_ROWS) + (TOKEN_PADDING - 1) * g, TOKEN_PADDING)

    x = torch.randn(nvs, h, generator=gen)
    rw = torch.rand(nvs, generator=gen) + 0.1
    start = 0
    for size, real in zip(sizes, REAL_ROWS):
        x[start + real:start + size] = 0  # dispatch zero-fills padding rows
        start += size
    x[end:] = float("nan")  # the undefined tail: never to be read
    rw[end:] = float("nan")
    w_gate = torch.randn(g, i, h, generator=gen) / h ** 0.5
    w_up = torch.randn(g, i, h, generator=gen) / h ** 0.5
    w_down = torch.randn(g, h, i, generator=gen) / i ** 0.5
    cu = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)

    def dev(t, dt=dtype):
        return t.to(device=device, dtype=dt)

    return (dev(x), dev(w_gate), dev(w_up), dev(w_down), dev(cu, torch.int32),
            dev(rw, torch.float32), end)


def reference(x, w_gate, w_up, w_down, cu_seqlens, route_weights) -> torch.Tensor:
    """The expert path in float64 on the CPU, one boolean row mask per group."""
    x, wg, wu, wd, rw = (t.detach().to("cpu", torch.float64)
                         for t in (x, w_gate, w_up, w_down, route_weights))
    ends = cu_seqlens.to("cpu", torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(x.shape[0])
    out = torch.zeros(x.shape[0], wd.shape[1], dtype=torch.float64)
    for g in range(wg.shape[0]):
        mask = (rows >= starts[g]) & (rows < ends[g])
        if not bool(mask.any()):
            continue
        xs = x[mask]
        gate, up = xs @ wg[g].T, xs @ wu[g].T
        act = gate * torch.sigmoid(gate) * up * rw[mask, None]
        out[mask] = act @ wd[g].T
    return out


def _quantized_rows64(rows: torch.Tensor) -> torch.Tensor:
    """float64 values of ``rows`` quantized as the FP8 ops do: in fp32, per row and 128 columns,
    ``s = amax / 448`` and ``e4m3fn(x / s)`` (0 where s = 0), value ``q * s``."""
    rows = rows.float()
    values = torch.empty(rows.shape, dtype=torch.float64)
    for c in range(0, rows.shape[1], 128):
        group = rows[:, c:c + 128]
        s = group.abs().amax(dim=1, keepdim=True) / 448.0
        q = torch.where(s > 0, group / s, torch.zeros_like(group)).to(torch.float8_e4m3fn)
        values[:, c:c + 128] = q.double() * s.double()
    return values


def _weight64(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w[g, n, k] * scale[g, n // 128, k // 128]`` in float64."""
    n, k = w.shape[1:]
    return w.double() * scale.double()[:, torch.arange(n) // 128][:, :, torch.arange(k) // 128]


def fp8_reference(x, fp8_weights, cu_seqlens, route_weights) -> torch.Tensor:
    """The FP8 expert path in float64 on the CPU: ``x`` and ``act`` quantized per row and 128
    columns, weights ``(w, scale)`` dequantized per 128 x 128 block, no other rounding."""
    (wg, sg), (wu, su), (wd, sd) = ((w.cpu(), s.cpu()) for w, s in fp8_weights)
    wg, wu, wd = _weight64(wg, sg), _weight64(wu, su), _weight64(wd, sd)
    ends = cu_seqlens.to("cpu", torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    out = torch.zeros(x.shape, dtype=torch.float64)
    for g in range(wg.shape[0]):
        start, end = int(starts[g]), int(ends[g])
        if end <= start:
            continue
        xs = _quantized_rows64(x[start:end].cpu())
        gate, up = xs @ wg[g].T, xs @ wu[g].T
        act = gate * torch.sigmoid(gate) * up * route_weights[start:end, None].cpu().double()
        out[start:end] = _quantized_rows64(act) @ wd[g].T
    return out


def check_fp8() -> tuple:
    """``(report line, failures)`` of the FP8 expert path on the CPU (bf16 activations)."""
    cpu = torch.device("cpu")
    x, w_gate, w_up, w_down, cu, rw, end = build_problem(cpu, torch.bfloat16, seed=1)
    fp8_weights = [moonep_ops.fp8.quantize_weight(w) for w in (w_gate, w_up, w_down)]
    (wg, sg), (wu, su), (wd, sd) = fp8_weights
    with torch.inference_mode():
        out = moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd)
    failures = []
    report = verify("fp8", out, fp8_reference(x, fp8_weights, cu, rw), torch.bfloat16, end, failures)
    unquantized = rel_err(out, reference(x, w_gate, w_up, w_down, cu, rw))
    line = (f"fp8 (CPU)   experts with e4m3fn weights against their float64 semantics: {report}; "
            f"rel err {unquantized:.3g} against the unquantized float64 path (information)")
    return line, failures


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = out.detach().to("cpu", torch.float64) - ref
    return float(diff.norm() / ref.norm())


def time_per_call(fn, device: torch.device, repeats: int, inner: int = 5,
                  budget_s: float = 3.0) -> tuple:
    """Median seconds per call over up to ``repeats`` batches of ``inner`` calls (after
    warm-up), stopping early after ``budget_s`` (at least 3 batches). Returns (median, batches)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    sync()
    samples = []
    start = time.perf_counter()
    while len(samples) < repeats and (len(samples) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples), len(samples)


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _kernel_path(device: torch.device, dtype: torch.dtype, cap=None) -> str:
    """Which forward kernels this device and dtype take (where the operands allow TMA)."""
    if device.type != "cuda":
        return "CPU kernels (per-segment torch.mm)"
    from moonep_ops import flags
    from moonep_ops.kernels.cuda import paths

    cap = paths.config_capability(cap or torch.cuda.get_device_capability(device))
    if paths.gluon_wanted(cap, dtype):
        return "forward GEMMs on the warp-specialized Gluon kernels (MOONEP_OPS_GLUON=0: the Triton ones)"
    if paths.hopper_tma(cap, dtype):
        return "Triton kernels with TMA loads" + ("" if flags.pdl() else ", no PDL")
    return "portable Triton kernels"


def _versions(device: torch.device) -> list:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    else:
        name = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return [f"device      {name}",
            f"versions    python {platform.python_version()}, torch {torch.__version__}, "
            f"triton {triton_version}, moonep_ops {moonep_ops.__version__}"]


def _compile(fn, device: torch.device, args):
    """Compile with Inductor and run once; on CPU fall back to aot_eager if Inductor cannot
    build (no C++ compiler, say). Returns (compiled fn, backend, note, first-call seconds)."""
    from torch._dynamo.utils import counters

    note = ""
    for backend in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        t0 = time.perf_counter()
        try:
            compiled(*args)
        except Exception as e:  # noqa: BLE001 (reported, then retried or re-raised)
            if backend != "inductor" or device.type != "cpu":
                raise
            first_line = (str(e).splitlines() or [""])[0][:120]
            note = f"inductor failed on CPU ({type(e).__name__}: {first_line}); fell back to aot_eager"
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return compiled, backend, note, time.perf_counter() - t0
    raise AssertionError("unreachable")


def _device_and_dtype(args) -> tuple:
    """The check's device and dtype from ``--device`` and ``--dtype`` ("auto": CUDA and bf16 where
    a GPU is visible, else the CPU and fp32)."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    return device, dtype


def verify(label: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, end: int, failures: list) -> str:
    """The report of ``out`` against the float64 ``ref``; what is wrong goes to ``failures``: shape
    or dtype, NaN (a leaked tail), the relative error over ``TOLERANCE``, rows past ``end`` not zero."""
    tol = TOLERANCE[dtype]
    err = rel_err(out, ref)
    max_abs = float((out.detach().to("cpu", torch.float64) - ref).abs().max())
    if out.shape != ref.shape or out.dtype != dtype:
        failures.append(f"{label}: got {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {dtype}")
    if bool(torch.isnan(out).any()):
        failures.append(f"{label}: NaN in the output (the tail leaked)")
    if not err <= tol:
        failures.append(f"{label}: relative error {err:.3g} > {tol:g}")
    if bool(out[end:].ne(0).any()):
        failures.append(f"{label}: rows past cu_seqlens[-1] are not zero")
    return f"max abs err {max_abs:.3g}, rel err {err:.3g} (limit {tol:g})"


def check(args) -> int:
    from torch._dynamo.utils import counters

    device, dtype = _device_and_dtype(args)
    x, w_gate, w_up, w_down, cu, rw, end = build_problem(device, dtype)
    ref = reference(x, w_gate, w_up, w_down, cu, rw)
    inputs = (x, w_gate, w_up, w_down, cu, rw)
    failures = []
    eager_report = verify("eager", moonep_ops.moonep_experts(*inputs), ref, dtype, end, failures)

    compiled, backend, note, first_call_s = _compile(moonep_ops.moonep_experts, device, inputs)
    graph_breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    compiled_report = verify("compiled", compiled(*inputs), ref, dtype, end, failures)
    if graph_breaks:
        failures.append(f"compiled: {graph_breaks} graph break(s): {dict(counters['graph_break'])}")

    eager_s, eager_n = time_per_call(lambda: moonep_ops.moonep_experts(*inputs), device, args.repeats)
    compiled_s, compiled_n = time_per_call(lambda: compiled(*inputs), device, args.repeats)

    g = w_gate.shape[0]
    lines = _versions(device) + [
        f"problem     NvS={x.shape[0]} H={x.shape[1]} I={w_gate.shape[1]} G={g} {dtype}, "
        f"rows in segments {end} (real {sum(REAL_ROWS)}, padded to {TOKEN_PADDING}), "
        f"{sum(1 for r in REAL_ROWS if r == 0)} empty groups, NaN tail of {x.shape[0] - end} rows",
        f"kernels     {_kernel_path(device, dtype)}",
        f"eager       {eager_report}",
        f"compiled    {compiled_report}; backend {backend}, first call {first_call_s:.2f} s"
        + (f"\n            note: {note}" if note else ""),
        f"graphs      {graphs} graph(s), {graph_breaks} graph break(s)",
        f"time/call   eager {_fmt_s(eager_s)}, compiled {_fmt_s(compiled_s)} "
        f"(median of {eager_n} and {compiled_n} batches of 5 calls)",
    ]
    fp8_line, fp8_failures = check_fp8()
    lines.append(fp8_line)
    failures += fp8_failures
    print("moonep_ops check")
    for line in lines:
        print("  " + line)
    for f in failures:
        print(f"  FAIL {f}")
    print("  result      " + ("FAILED" if failures else "OK"))
    return 1 if failures else 0


def bench(args) -> int:
    try:
        import benchmarks.run as bench_run
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.run"):
            raise
        print("moonep_ops bench: no benchmarks/run.py found. The benchmarks live in the source "
              "checkout, not in the installed package: run `python -m moonep_ops bench` from the "
              "repository root.", file=sys.stderr)
        return 2
    if not hasattr(bench_run, "main"):
        print("moonep_ops bench: benchmarks/run.py has no main(argv) yet.", file=sys.stderr)
        return 2
    return int(bench_run.main(args.bench_args) or 0)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moonep_ops", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    p_check = sub.add_parser("check", help="eager and compiled expert path vs a float64 reference (default)")
    # (no help option of its own: --help goes on to benchmarks/run.py with the other arguments)
    sub.add_parser("bench", add_help=False,
                   help="run benchmarks/run.py from a source checkout (other arguments go to it)")
    for p, suppress in ((parser, False), (p_check, True)):
        # The subcommand's copies must not overwrite what was given before "check".
        def default(value):
            return argparse.SUPPRESS if suppress else value
        p.add_argument("--device", default=default("auto"), choices=["auto", "cpu", "cuda"])
        p.add_argument("--dtype", default=default("auto"), choices=["auto", "bf16", "fp16", "fp32"])
        p.add_argument("--repeats", type=_at_least_one, default=default(20),
                       help="at most this many timing batches of 5 calls (median reported)")
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra
        return bench(args)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False)")
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
