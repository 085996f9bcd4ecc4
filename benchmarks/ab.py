"""Gluon config variants against each other on the benchmark shapes (sm90), in alternating rounds.

How a config change is measured before it goes into the table (docs/performance.md, docs/fp8.md):
the experts op on each benchmark shape and padding, once per variant per round, the variants'
order reversed every other round (A B, B A, ...) so that the board's drift falls on all of them;
each sample is the median of CUDA-graph replays after a settle (``benchmarks.timing``), with the
output poisoned before the first call and checked against the first variant's (relative error)
and for a zero tail.

A variant is ``NAME`` or ``NAME:FIELD=VALUE,...``: the config table's pick with those
:class:`~moonep_ops.kernels.gluon.config.GluonConfig` fields replaced (``fused.FIELD`` and
``plain.FIELD``: the gate/up or the down GEMM alone); without fields, the table itself::

    python -m benchmarks.ab table "noskip:skip_idle_half=False" --paddings 128
    python -m benchmarks.ab --fp8 table \\
        "rows:block_m=128,split_ring=False,skip_idle_tiles=False,split_rows=True,fused.stages=4,plain.stages=6" \\
        --shapes 2,5 --rounds 3

``--fp8`` runs the FP8 experts (weights quantized per 128 x 128 block, block-major as the FP8 table's
``fp8`` column runs them; ``--fp8-weights gnk``: the checkpoint's ``[G, N, K]``) and varies the FP8
table.
``--reference FILE`` also checks each problem's first output against a digest of another process's
output kept in FILE, or keeps its own there (how :mod:`benchmarks.ab_code` checks copies of the
package against each other).
``--cases`` runs layout-sweep cases by name instead of the benchmark shapes (a rule must hold on
layouts nobody tuned on)::

    python -m benchmarks.ab table "coop:fused.pingpong=False,fused.block_n=128,fused.stages=4" \
        --cases "llama4 K1 G8 epn4 S2048 z1.5 p1 s2;h7168-i4096 K8 G20 epn16 S512 z0.8 p1 s0" --rounds 6

Prints one line per shape and padding: each variant's samples in µs and their median, then each
variant against the first one as paired ratios (its sample over the first variant's of the same
round: median and range), the measure a config decision rests on; with ``--out``, writes them as
JSON. Nothing here is a result file of the repository. On the H200 identical configs differ by up to
5-7% over two or three rounds at a 0.3 s settle: hence the defaults of six rounds and a 0.6 s settle,
which a change of a few per cent needs.
"""

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import statistics

import torch

from . import cli
from .shapes import build_problem
from .timing import environment

TABLE = "table"


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named set of field replacements: for both GEMMs, for the gate/up one, for the down one."""
    name: str
    both: dict = dataclasses.field(default_factory=dict)
    fused: dict = dataclasses.field(default_factory=dict)
    plain: dict = dataclasses.field(default_factory=dict)

    def apply(self, cfg, fused: bool):
        """``cfg`` (the table's pick for one GEMM) with this variant's fields; None stays None."""
        fields = {**self.both, **(self.fused if fused else self.plain)}
        return cfg if cfg is None or not fields else dataclasses.replace(cfg, **fields)


def parse_variant(spec: str) -> Variant:
    """``NAME`` or ``NAME:FIELD=VALUE,...`` (values are Python literals: ``True``, ``4``)."""
    from moonep_ops.kernels.gluon.config import GluonConfig

    name, _, body = spec.partition(":")
    if not name:
        raise ValueError(f"benchmarks.ab: a variant needs a name, got {spec!r}")
    known = {f.name for f in dataclasses.fields(GluonConfig)}
    parts = {"both": {}, "fused": {}, "plain": {}}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        scope, _, field = key.rpartition(".")
        if not sep or scope not in ("", "fused", "plain") or field not in known:
            raise ValueError(f"benchmarks.ab: {item!r} in variant {name!r} is not [fused.|plain.]FIELD=VALUE with a "
                             f"GluonConfig field ({', '.join(sorted(known))})")
        try:
            parts[scope or "both"][field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"benchmarks.ab: the value of {key!r} in variant {name!r} is not a Python literal: "
                             f"{value!r}") from None
    return Variant(name, **parts)


def round_order(variants: list, round_index: int) -> list:
    """The variants of round ``round_index``: as given in even rounds, reversed in odd ones."""
    return list(variants) if round_index % 2 == 0 else list(reversed(variants))


@contextlib.contextmanager
def table_replaced(variant: Variant, fp8: bool):
    """The config table (bf16 or FP8) replaced by ``variant``'s, and no launch plan or handoff
    target kept across the change (both hold what the config they were made with asked for)."""
    from moonep_ops.kernels.cuda import experts
    from moonep_ops.kernels.gluon import config, host

    attr = "gluon_fp8_config" if fp8 else "gluon_gemm_config"
    table = getattr(config, attr)

    def pick(n, k, num_rows, fused, groups=0):
        return variant.apply(table(n, k, num_rows, fused, groups=groups), fused)

    setattr(config, attr, pick)
    host._PLANS.clear()
    experts._FLAG_TARGETS.clear()
    try:
        yield
    finally:
        setattr(config, attr, table)
        host._PLANS.clear()
        experts._FLAG_TARGETS.clear()


def _experts_call(shape, padding, fp8: bool, layout: dict, block_major: bool = True):
    """``(call, out, live rows)`` for the experts op on one benchmark problem (``layout``: the
    emulator's ``seed`` and ``skew`` where they are not its defaults; ``block_major``: FP8 weights
    block-major, as the FP8 table's ``fp8`` column and the layout sweep run them, else ``[G, N, K]``)."""
    import moonep_ops
    from moonep_ops import fp8 as fp8_ops

    x, wg, wu, wd, cu, rw, sizes = build_problem(shape, padding, **layout)
    out = torch.empty_like(x)
    if not fp8:
        return (lambda: moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out)), out, sum(sizes)
    (qg, sg), (qu, su), (qd, sd) = (fp8_ops.quantize_weight(w) for w in (wg, wu, wd))
    del wg, wu, wd
    if block_major:
        qg, qu, qd = (fp8_ops.to_block_major(w) for w in (qg, qu, qd))
    return (lambda: moonep_ops.moonep_experts(x, qg, qu, qd, cu, rw, out=out, w_gate_scale=sg, w_up_scale=su,
                                              w_down_scale=sd)), out, sum(sizes)


def output_digest(out: torch.Tensor) -> torch.Tensor:
    """``out``'s rows against eight fixed random vectors (fp32, on the CPU): small enough to keep
    for another process, and its relative distance to another output's digest is about the
    outputs' own."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(out.shape[1], 8, generator=gen).to(out.device)
    return (out.float() @ probe).cpu()


def check_reference(reference: dict, key: str, out: torch.Tensor) -> str | None:
    """Checks ``out`` against the digest kept under ``key`` in ``reference`` (another process's
    output of the same problem), or keeps its own there first. Returns an error, or None."""
    digest = output_digest(out)
    if key not in reference:
        reference[key] = digest
        return None
    ref = reference[key]
    err = float((digest - ref).norm() / ref.norm()) if ref.shape == digest.shape else float("inf")
    return f"rel err {err:.3g} against the reference" if not err <= 1e-2 else None


def run_case(shape, padding, variants, fp8: bool, rounds: int, reps: int, settle_s: float,
             layout: dict | None = None, reference: dict | None = None, block_major: bool = True) -> dict:
    """Every variant ``rounds`` times on one shape and padding; samples in µs per variant. With
    ``reference`` the first output is also checked against (or kept as) the digest another process
    kept of the same problem (:func:`check_reference`)."""
    from .fp8 import time_path

    call, out, live = _experts_call(shape, padding, fp8, layout or {}, block_major)
    row = {"shape": shape.name, "token_padding": padding, "samples": {v.name: [] for v in variants}, "errors": {},
           "rounds": []}
    ref = None
    for r in range(rounds):
        row["rounds"].append({})
        for variant in round_order(variants, r):
            with table_replaced(variant, fp8):
                rec = time_path(call, out, live, ref, reps, settle_s)
            if "us" not in rec:
                row["errors"][variant.name] = rec["error"]
                continue
            if ref is None:
                ref = out[:live].float().clone()
                if reference is not None:
                    key = f"{shape.name} | padding {padding} | {sorted((layout or {}).items())}"
                    error = check_reference(reference, key, ref)
                    if error:
                        row["errors"][variant.name] = error
            row["samples"][variant.name].append(rec["us"])
            row["rounds"][-1][variant.name] = rec["us"]
            if rec["err_vs_bf16"] > 1e-2 or not rec["tail_zero"]:
                row["errors"][variant.name] = f"rel err {rec['err_vs_bf16']:.3g}, zero tail {rec['tail_zero']}"
    return row


def sweep_problems(names: str) -> list:
    """``(shape, padding, layout)`` of the layout-sweep cases named in ``names`` (``;`` between)."""
    from .sweep_cases import case_from_name

    problems = []
    for name in filter(None, (n.strip() for n in names.split(";"))):
        try:
            case = case_from_name(name)
        except ValueError as exc:
            raise ValueError(f"benchmarks.ab: {exc} (python -m benchmarks.sweep --list prints the cases)") from None
        problems.append((case.shape(), case.token_padding, {"seed": case.seed, "skew": case.skew}))
    return problems


def paired_ratios(row, base: str) -> dict:
    """Per other variant, its sample over ``base``'s in each round where both have one: ``(median,
    lowest, highest)``, or None where no round has both."""
    ratios = {}
    for name in row["samples"]:
        if name == base:
            continue
        pairs = [r[name] / r[base] for r in row["rounds"] if name in r and base in r]
        ratios[name] = (statistics.median(pairs), min(pairs), max(pairs)) if pairs else None
    return ratios


def _line(row) -> str:
    cells = []
    for name, samples in row["samples"].items():
        med = f"{statistics.median(samples):7.0f}" if samples else "    n/a"
        cells.append(f"{name} {med} ({' '.join(f'{s:.0f}' for s in samples)})")
    base = next(iter(row["samples"]))
    for name, ratio in paired_ratios(row, base).items():
        cells.append(f"{name}/{base} " + ("n/a" if ratio is None else "{:.3f} ({:.3f}-{:.3f})".format(*ratio)))
    bad = "".join(f" | {name}: {err[:80]}" for name, err in row["errors"].items())
    return f"{row['shape']:<28} pad={row['token_padding']:<3} | " + " | ".join(cells) + bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="NAME or NAME:FIELD=VALUE,... (see above); 'table' alone: the "
                                                    "table itself")
    parser.add_argument("--fp8", action="store_true", help="the FP8 experts and the FP8 config table")
    parser.add_argument("--shapes", type=cli.shape_list, default="all",
                        help="comma-separated indices into benchmarks.shapes.SHAPES")
    parser.add_argument("--paddings", type=cli.padding_list, default="128,1")
    parser.add_argument("--cases", default=None, help="layout-sweep case names separated by ';' (python -m "
                                                      "benchmarks.sweep --list): these instead of the shapes")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--settle", type=float, default=0.6, help="seconds of replays before each sample")
    parser.add_argument("--out", default=None, help="JSON file for the samples")
    parser.add_argument("--fp8-weights", choices=("block-major", "gnk"), default="block-major",
                        help="with --fp8: the weights block-major (as the FP8 table's fp8 column and the layout sweep) "
                             "or in the checkpoint's [G, N, K] layout")
    parser.add_argument("--reference", default=None,
                        help="a file of output digests: each problem's first output is checked against the digest "
                             "kept there, or kept there where there is none (benchmarks.ab_code's copies)")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(spec) for spec in args.variants]
    except ValueError as exc:
        parser.error(str(exc))
    if len({v.name for v in variants}) != len(variants):
        parser.error("variant names must differ")
    if args.cases:
        try:
            problems = sweep_problems(args.cases)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        problems = [(shape, p, {}) for p in args.paddings for shape in args.shapes]
    cli.require_gpu(parser)
    rows = []
    reference = None
    if args.reference:
        reference = torch.load(args.reference) if os.path.exists(args.reference) else {}
    with torch.inference_mode():
        for shape, padding, layout in problems:
            rows.append(run_case(shape, padding, variants, args.fp8, args.rounds, args.reps, args.settle, layout,
                                 reference, args.fp8_weights == "block-major"))
            print(_line(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if args.reference:
        torch.save(reference, args.reference)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": {**environment(), "reps": args.reps, "settle_s": args.settle, "fp8": args.fp8,
                               "variants": args.variants}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
