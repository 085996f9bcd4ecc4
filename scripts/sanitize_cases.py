"""Small problems of every moonep op on CUDA, for scripts/sanitize.sh to run under
compute-sanitizer (memcheck, racecheck). Triton compiles each kernel at its first call, so
compiling and running happen here, in the one sanitized process.

The ops and their checks come from the fuzz suite's op table (tests/fuzz_strategies.py), so
a new op with a fuzz entry is sanitized too. Each problem has tail rows (NaN in the inputs),
empty groups (leading, inner, trailing), segments longer than one row tile, odd sizes; bf16
and fp32; on Hopper the default path (the Gluon forward kernels on sm90), the Triton TMA path
(``MOONEP_OPS_GLUON=0``) and the portable path. Then every op with bad cu_seqlens
values (decreasing, negative, past NvS, int32 extremes): unspecified results, but no
out-of-bounds access. Every case is also checked against the float64 reference. On sm90, the
Gluon paths that only large problems take (idle upper halves, another tensor's tail, split
epilogues, the experts op's row-tile handoff, a PDL dependent whose first items skip idle halves),
and the split rings that only the FP8 configs take, forced on bf16.
From sm89, the FP8 ops on their test layouts (the Gluon and the Triton FP8 kernels on sm90).

Prints one line per case and ``SANITIZE_CASES ran=<n> failed=<m> done=<d> left=<l>``; exits 1 if
any failed. ``--device cpu`` runs the same cases on the CPU kernels (a dry run of this script);
``--only TEXT`` runs the cases whose names contain TEXT (a re-run of what a change touched, e.g.
``--only fp8``). Under the sanitizers the whole set takes longer than one GPU command may run, so a
run is taken in parts: ``--max-seconds S`` starts no case after S seconds (the rest are counted as
left), and ``--done LOG`` skips the cases that an earlier part's output LOG records as ok (counted as
done).
"""

import argparse
import dataclasses
import math
import os
import pathlib
import re
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

import moonep_ops  # noqa: E402,F401
from moonep_ops import flags  # noqa: E402
from tests.fuzz_strategies import OPS, Problem, check  # noqa: E402
from tests.test_bad_input_cuda import BAD_VALUES, base_tensors, cu_tensor, value_calls  # noqa: E402


def _problem(num_groups, *, p_empty, max_real, tail, k, n, dtype, padded=False, max_run=3,
             strided=False, strided_meta=False, with_weights=True, layout_seed=0):
    return Problem(num_groups, padded, p_empty, max_run, max_real, layout_seed, 8192, tail, k, n, dtype,
                   with_weights, strided, strided_meta, data_seed=7)


def problems(dtype):
    """Small, but past every boundary the kernels have: several row/column tiles, partial tiles,
    K not a multiple of BLOCK_K, G past the in-register schedule (1024), strided views."""
    return {
        # TMA-eligible for bf16 (16-byte rows); empty runs; a 37-row NaN tail
        "mixed": _problem(7, p_empty=0.5, max_real=300, tail=37, k=72, n=200, dtype=dtype, layout_seed=1),
        # odd sizes (portable path), no route weights
        "odd": _problem(5, p_empty=0.3, max_real=40, tail=5, k=33, n=17, dtype=dtype, with_weights=False,
                        layout_seed=2),
        # MoonEP padding, G > 1024 (the chunked cu_seqlens scan), mostly empty
        "padded_g1100": _problem(1100, padded=True, p_empty=0.97, max_run=40, max_real=200, tail=130,
                                 k=64, n=48, dtype=dtype, layout_seed=3),
        # non-contiguous inputs (data, route weights, cu_seqlens)
        "strided": _problem(4, p_empty=0.25, max_real=50, tail=9, k=40, n=24, dtype=dtype, strided=True,
                            strided_meta=True, layout_seed=4),
        # every segment empty: only the tail
        "all_empty": _problem(3, p_empty=1.0, max_real=1, tail=20, k=16, n=16, dtype=dtype),
    }


@dataclasses.dataclass
class Selection:
    """Which cases run: those whose names contain ``only``, less the cases an earlier part of the run
    recorded as ok (``done``), until ``deadline`` (``time.monotonic()``); the others are counted."""
    only: str = ""
    done: frozenset = frozenset()
    deadline: float = math.inf
    skipped_done: int = 0
    left: int = 0

    def wants(self, name: str) -> bool:
        if self.only not in name:
            return False
        if name in self.done:
            self.skipped_done += 1
            return False
        if time.monotonic() >= self.deadline:
            self.left += 1
            return False
        return True


SELECTION = Selection()  # set by main() from the command line
_OK_LINE = re.compile(r"^\[\s*[0-9.]+s\] (.+): ok$")


def cases_done(logs) -> frozenset:
    """The names of the cases that these earlier outputs of this script record as ok."""
    names = set()
    for log in logs:
        for line in pathlib.Path(log).read_text().splitlines():
            match = _OK_LINE.match(line)
            if match:
                names.add(match.group(1))
    return frozenset(names)


def _run(name, fn, results):
    if not SELECTION.wants(name):
        return
    t0 = time.perf_counter()
    try:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        status = "ok"
    except Exception:  # record and go on: the sanitizer should see every case
        status = "FAILED\n" + traceback.format_exc()
    results.append((name, status == "ok"))
    print(f"[{time.perf_counter() - t0:7.2f}s] {name}: {status}", flush=True)


def _set_mode(mode: str) -> None:
    os.environ["MOONEP_OPS_PORTABLE"] = "1" if mode == "portable" else "0"
    os.environ["MOONEP_OPS_GLUON"] = "0" if mode == "triton" else "1"
    flags.reload()


# FP8 layouts (tests/test_fp8.py): few-row segments, padded segments, empty segments, a partial
# scale block, all rows in the tail. Their experts are small, so on sm90 the table gives them split
# rings; the FP8 Gluon configs forced on MoonEP's padding add 128-row items split between the
# consumers (the table's pick for large experts).
FP8_LAYOUTS = ("unpadded", "padded_128", "empty_segments", "partial_scale_blocks", "all_tail")


def _with_monkeypatch(test, *args) -> None:
    """A test that takes pytest's ``monkeypatch`` fixture, called with a fresh one (undone after)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        test(monkeypatch, *args)


def _fp8_cases(mode: str, results) -> None:
    """The FP8 ops on CUDA against their float64 references (tests/test_fp8.py's checks)."""
    from tests import test_fp8 as tf

    for name in FP8_LAYOUTS:
        layout = tf.LAYOUTS[tf.LAYOUT_IDS.index(name)]
        _run(f"{mode} fp8 {name} experts", lambda: tf.test_experts_fp8(layout, torch.bfloat16, True, "cuda"),
             results)
        _run(f"{mode} fp8 {name} grouped_gemm_out",
             lambda: tf.test_grouped_gemm_fp8_out(layout, torch.bfloat16, "cuda"), results)
    # decode's two-tile padded segments: the sm90 kernels skip idle tiles, swapping items in pairs
    _run(f"{mode} fp8 moonep_decode experts", lambda: _with_monkeypatch(tf.test_experts_fp8_on_moonep_decode, "cuda"),
         results)
    _run(f"{mode} fp8 moonep_padding experts",
         lambda: tf.test_experts_fp8_on_moonep_padding(torch.bfloat16, "cuda"), results)
    # block-major weights (TMA on contiguous blocks; the Triton kernel's pointer path on strided ones)
    for layout in tf.BLOCK_MAJOR_LAYOUTS:
        _run(f"{mode} fp8 block_major {layout.name}", lambda: tf.test_block_major_weights(layout, "cuda"), results)
    _run(f"{mode} fp8 block_major strided", lambda: tf.test_strided_block_major_weights("cuda"), results)
    if mode == "default" and torch.cuda.get_device_capability() == (9, 0):
        for config in tf.GLUON_FP8_CONFIGS:  # (split rows: lone tiles' idle upper halves skipped, or not)
            _run(f"{mode} fp8 gluon {config} moonep_padding",
                 lambda: _with_monkeypatch(tf.test_gluon_fp8_configs, tf.MOONEP_PADDING, config), results)
            # (its sizes are multiples of 128: row-major, then block-major weights)
            _run(f"{mode} fp8 gluon {config} moonep_decode",
                 lambda: _with_monkeypatch(tf.test_gluon_fp8_configs, tf.MOONEP_DECODE, config), results)
        # a GEMM as two launches, each deciding from cu_seqlens whether it takes the GEMM or nothing
        for layout in (tf.MOONEP_DECODE, tf.PARTIAL_TILES, tf.MULTI_TILE):
            _run(f"{mode} fp8 gluon launch pair {layout.name}",
                 lambda: _with_monkeypatch(tf.test_two_launches_of_a_gemm_compute_it_once, layout, True), results)
        for layout, fields in ((tf.MOONEP_DECODE, dict(tf.SPLIT_ROWS_FP8, on_multi_tile=True)),
                               (tf.PARTIAL_TILES, dict(tf.SPLIT_ROWS_FP8, on_multi_tile=True)),
                               (tf.MULTI_TILE, dict(tf.SPLIT_RING_FP8, on_multi_tile=False))):
            _run(f"{mode} fp8 gluon lone launch of a pair {layout.name}",
                 lambda: _with_monkeypatch(tf.test_a_launch_on_the_other_kind_of_layout_writes_nothing, layout,
                                           fields), results)


def _op_cases(modes, device, results) -> None:
    """Every op of the fuzz table on the sanitizer problems, in each mode; the FP8 layouts from sm89."""
    for mode in modes:
        _set_mode(mode)
        for dtype in (torch.bfloat16, torch.float32):
            if mode != "default" and dtype == torch.float32:
                continue  # fp32 never takes the TMA or Gluon path: nothing new to run
            for pname, p in problems(dtype).items():
                for spec in OPS:
                    if spec.moonep_op is None:
                        continue  # composites of the public API: the same kernels again
                    if dtype not in spec.dtypes:
                        continue  # (the FP8 ops take bf16/fp16 activations only)
                    _run(f"{mode} {str(dtype)[6:]} {pname} {spec.name}",
                         lambda: check(spec, p, device, repeat=False), results)
        if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
            _fp8_cases(mode, results)


def _gluon_cases(results) -> None:
    """Gluon kernel paths the config table takes only on large problems (or only for FP8), forced on
    small ones (tests/test_cuda_gluon.py's cases, their checks included): idle upper halves, skipped
    by segment end and by route weight 0, the fused GEMM zeroing another tensor's tail, split
    epilogues, split rings, the row-tile handoff, a PDL dependent."""
    from tests import test_cuda_gluon as tg
    from tests import test_cuda_handoff as th
    from tests import test_cuda_pdl as tp

    _set_mode("default")
    for name in tg.IDLE_CONFIGS:
        _run(f"bf16 gluon idle_half {name}", lambda: tg.test_idle_upper_halves_are_skipped_exactly_where_they_should(
            name), results)
    for name in ("pingpong_n64_s6", "coop_n128_s4"):
        _run(f"bf16 gluon tail_out {name}", lambda: tg.test_fused_zeroes_the_tail_of_another_tensor(
            tg.GLUON_LAYOUTS[3], tg.FUSED[name]), results)
    # split epilogues on partial tiles (segments cut mid-tile, N not a multiple of the tile)
    for name in ("coop_n256_s4_split", "coop_n256_split_tail_by_consumers", "pingpong_n128_s6_split"):
        _run(f"bf16 gluon split {name}", lambda: tg.test_plain(tg.GLUON_LAYOUTS[1], tg.PLAIN[name], torch.bfloat16),
             results)
    _run("bf16 gluon split fused", lambda: tg.test_fused(tg.GLUON_LAYOUTS[1], tg.FUSED["coop_n128_s4_split"], True),
         results)
    # split rings (each ping-pong consumer with its own producer warp and ring; the FP8 GEMMs'
    # configs), wrapping inside a tile on the odd layout
    for name in ("pingpong_split_ring", "pingpong_split_ring_tail_by_consumers"):
        _run(f"bf16 gluon split_ring {name}",
             lambda: tg.test_plain(tg.GLUON_LAYOUTS[1], tg.PLAIN[name], torch.bfloat16), results)
    _run("bf16 gluon split_ring fused", lambda: tg.test_fused(tg.GLUON_LAYOUTS[1], tg.FUSED["pingpong_n64_split_ring"],
                                                          True), results)
    # the experts op's row-tile handoff: flags in global memory, items through shared memory
    for name, pair in th.PAIRS.items():
        _run(f"bf16 gluon handoff {name}", lambda: th.test_row_tile_handoff(pair, th.MANY_GROUPS, repeats=2), results)
    # a PDL dependent down GEMM whose first items skip idle halves (half loads before its wait)
    _run("bf16 gluon pdl idle_first", lambda: tp.test_gluon_dependent_down_gemm_waits_for_the_fused_gemm(
        tp.GLUON_PAIRS["coop_down_idle_half"], tp.IDLE_FIRST), results)


def _bad_cu_cases(modes, device, results) -> None:
    """Invalid cu_seqlens values: the CUDA kernels must stay in bounds (no values to check). On every
    path: the portable one's GEMMs load through pointers, where no TMA unit bounds a stray row."""
    for mode in modes:
        _set_mode(mode)
        for bad, ends in BAD_VALUES.items():
            b = base_tensors(device, torch.bfloat16)
            calls = value_calls(b, cu_tensor(b, ends))
            for op, (fn, args) in calls.items():
                if device == "cpu":
                    continue  # the CPU kernels raise on these (tests/test_bad_input_cuda.py checks it)
                _run(f"{mode} bad_cu_{bad} {op}", lambda: fn(*args), results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", default="", help="run only the cases whose names contain this text")
    parser.add_argument("--done", action="append", default=[], metavar="LOG",
                        help="skip the cases that this earlier output records as ok (repeatable)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no case after this many seconds (0: no limit); the rest are counted as left")
    args = parser.parse_args()
    device = args.device
    SELECTION.only = args.only
    SELECTION.done = cases_done(args.done)
    if args.max_seconds > 0:
        SELECTION.deadline = time.monotonic() + args.max_seconds
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("sanitize_cases.py: no CUDA device")
    modes = ["default"]
    if device == "cuda" and torch.cuda.get_device_capability() >= (9, 0):
        modes.append("triton")  # MOONEP_OPS_GLUON=0: the Triton kernels where sm90 takes Gluon ones
        modes.append("portable")  # MOONEP_OPS_PORTABLE=1: the sm80 path on the same GPU
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
          + f", PYTORCH_NO_CUDA_MEMORY_CACHING={os.environ.get('PYTORCH_NO_CUDA_MEMORY_CACHING')}", flush=True)
    results = []
    _op_cases(modes, device, results)
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        from moonep_ops.kernels.cuda import paths

        if paths.gluon_host() is not None:
            _gluon_cases(results)
    _bad_cu_cases(modes, device, results)
    _set_mode("default")
    failed = [name for name, ok in results if not ok]
    print(f"SANITIZE_CASES ran={len(results)} failed={len(failed)} done={SELECTION.skipped_done} left={SELECTION.left}",
          flush=True)
    for name in failed:
        print(f"  failed: {name}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
