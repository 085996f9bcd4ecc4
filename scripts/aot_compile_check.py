"""Compile every Triton kernel variant the ops can launch, for real GPU targets, on a machine
without a GPU (CI): a kernel that does not compile, or does not fit a target's shared memory,
fails here instead of on the first user's GPU.

How: the registered CUDA functions of the ops (``moonep_ops.kernels.cuda.register``) run on CPU
tensors with the device capability forced to each target, so the config tables and the
TMA/portable choices are exactly the ones a GPU of that capability takes (sm100 and sm103 take the
Hopper configs and the TMA path, (10, 0) >= (9, 0); sm120 runs as sm89,
``paths.config_capability``; the Gluon kernel is sm90-only and must never be picked elsewhere);
``JITFunction.run`` is replaced by an ahead-of-time ``triton.compile`` for that target (Triton's
own specialization of the arguments, nothing launched). Shapes cover every branch of the config
tables (see ``PROBLEMS``), with and without route weights, the in-register and the chunked
``cu_seqlens`` scan, bf16/fp16/fp32, and ``MOONEP_OPS_PORTABLE=1`` on sm90 and newer. ``--table``
instead sweeps the Gluon config tables over model sizes (``TABLE_*``) and compiles, for sm90, the
variants of every distinct set of picks (:func:`table_problems`).

Per unique variant: shared memory (against the target's per-block limit), registers and spill
stores, and the tensor-core instructions of the machine code (from the cubin, via the
``cuobjdump`` bundled with Triton): a bf16/fp16 GEMM kernel must use tcgen05 MMAs (``UTCHMMA``,
or another ``UTC*MMA`` form) on sm100/sm103, ``HGMMA`` (wgmma) on sm90 and ``HMMA`` (mma.sync) on
sm80/sm86/sm89/sm120, and the FP8 GEMM (sm89+ only) tcgen05 MMAs on sm100/sm103, ``QGMMA`` on sm90 and
``QMMA`` on sm89 and sm120, so a Triton or config change that silently drops to a slower instruction path
fails here. Exit code 1 on any compile error, shared-memory overflow, missing tensor-core path or Gluon
kernel outside sm90; spills are reported, not fatal, and so are kernels whose wgmma instructions
ptxas serialized (a wait after each one, where code reads an accumulator that an MMA may still
write). sm100 and sm103 are checked with the installed Triton only (one without their support
fails those targets' compiles).

    python scripts/aot_compile_check.py [--targets 90,100,80,86] [--dtypes bf16,fp16,fp32] [--json out.json]
    python scripts/aot_compile_check.py --targets 100 --dtypes bf16 --no-portable --problems 0,2
    python scripts/aot_compile_check.py --selftest   # the checker flags an oversized config, a missing MMA path
    python scripts/aot_compile_check.py --table      # every Gluon config the tables pick (sm90; minutes)
"""

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime import jit as triton_jit  # noqa: E402

import moonep_ops  # noqa: E402,F401  (registers the ops)
from moonep_ops import flags  # noqa: E402
from moonep_ops.kernels.cuda import fp8 as cuda_fp8, paths, register as cuda  # noqa: E402

# Opt-in shared memory per block (bytes): H100/H200, A100, the consumer/Ada parts and consumer
# Blackwell (sm120: 99 KB, as sm86/sm89), and B200 and B300 (sm100, sm103): NVIDIA's Blackwell
# Tuning Guide, "Unified Shared Memory/L1/Texture Cache" (docs.nvidia.com/cuda/blackwell-tuning-guide):
# 228 KB per SM as on H100, 1 KB of it reserved per thread block, so one block addresses up to
# 227 KB = 232448 B (dynamic, with the opt-in).
SMEM_LIMIT = {100: 232448, 103: 232448, 90: 232448, 80: 166912, 86: 101376, 89: 101376, 120: 101376}

# (name, rows, K, N, G): each hits a different branch of configs.py / configs_backward.py.
PROBLEMS = [
    ("long, compute-bound (warp-specialized)", 32768, 4096, 2048, 8),
    ("long reduction (K = 8192)", 4096, 8192, 512, 4),
    ("short (flattened loop)", 4096, 1024, 768, 16),
    ("many groups (chunked scan)", 2048, 256, 128, 1100),
    # rows of x, act and out not 16-byte aligned: no TMA descriptor, pointer loads and stores with
    # the target's own tiles (sm90 and sm100 take Hopper's), 5 groups
    ("rows not 16-byte aligned (pointer loads)", 1001, 1001, 770, 5),
]


# --table: model sizes the Gluon config tables (bf16, FP8) are swept over; one problem per
# distinct set of picks is compiled (H, I: from 2048/256 up past the largest models; G and the rows
# per group around every threshold of the tables; NvS around their absolute ones).
TABLE_HIDDEN = (2048, 2880, 4096, 5120, 6144, 7168, 8192)
TABLE_INTER = (256, 768, 1408, 1536, 2048, 4096, 8192, 14336)
TABLE_GROUPS = (1, 8, 20, 64, 132, 260, 388, 1000)
TABLE_ROWS_PER_GROUP = (1, 16, 47, 48, 63, 64, 100, 250, 256, 257, 512, 4096)
TABLE_NUM_ROWS = (128, 8191, 8192, 12288, 16383, 16384, 32767, 32768, 40959, 40960, 131072)


def table_picks(rows, h, i, g) -> tuple:
    """``(table name, fused, config or None)`` of each Gluon table (bf16, FP8, the FP8 launch pairs'
    second config) for the gate/up and down GEMMs of ``(rows, H, I, G)`` and a plain GEMM by the
    gate weight."""
    from moonep_ops.kernels.gluon import config

    tables = (config.gluon_gemm_config, config.gluon_fp8_config, config.gluon_fp8_multi_tile_config)
    return tuple((table.__name__, fused, table(n, k, rows, fused, groups=g)) for table in tables
                 for fused, n, k in ((True, i, h), (False, h, i), (False, i, h)))


def table_problems() -> list:
    """``(rows, H, I, G)``: for each distinct set of :func:`table_picks` on the sweep, the smallest
    problem that makes them."""
    smallest = {}
    for h, i, g in itertools.product(TABLE_HIDDEN, TABLE_INTER, TABLE_GROUPS):
        for rows in sorted({r * g for r in TABLE_ROWS_PER_GROUP} | set(TABLE_NUM_ROWS)):
            picks = table_picks(rows, h, i, g)
            size = 3 * g * h * i + rows * (2 * h + i)
            if picks not in smallest or size < smallest[picks][0]:
                smallest[picks] = (size, (rows, h, i, g))
    return sorted(problem for _, problem in smallest.values())


class Compiler:
    """Replaces ``JITFunction.run``: compile for ``target`` and record, never launch."""

    def __init__(self, target: GPUTarget):
        self.target = target
        self.backend = make_backend(target)
        self.binders = {}
        self.variants = {}  # key -> record

    def specialize(self, fn, args, kwargs):
        """Triton's own specialization of a launch's arguments: ``(source, signature, options, consts)``."""
        binder = self.binders.get(fn)
        if binder is None:
            binder = self.binders[fn] = triton_jit.create_function_from_signature(fn.signature, fn.params,
                                                                                  self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        consts = {fn.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
        source_cls = ASTSource
        if getattr(fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as source_cls
        return source_cls(fn, signature, constexprs, attrs), signature, options, consts

    def run(self, fn, *args, grid, warmup, **kwargs):
        source, signature, options, consts = self.specialize(fn, args, kwargs)
        key = (fn.fn.__name__, repr(sorted(signature.items())), repr(sorted(consts.items(), key=str)),
               options.num_warps, options.num_stages)
        if key in self.variants:
            return None
        dtype = next((t[1:] for t in signature.values() if isinstance(t, str) and t.startswith("*")), "?")
        if consts.get("FP8"):  # the Gluon kernel's operands are descriptors: its first pointer is `out`
            dtype = "fp8e4nv"
        record = {"kernel": fn.fn.__name__, "target": f"sm{self.target.arch}", "dtype": dtype,
                  "num_warps": options.num_warps,
                  "num_stages": options.num_stages,
                  "constexprs": {k: v for k, v in consts.items() if k.isupper() and not k.startswith("stride")}}
        start = time.time()
        try:
            compiled = triton.compile(source, target=self.target, options=options.__dict__)
            record.update(shared=compiled.metadata.shared, **_resource_usage(compiled.asm.get("cubin")))
        except Exception as exc:  # the failure is the finding
            if os.environ.get("AOT_TRACEBACK"):
                import traceback
                traceback.print_exc()
            # The message, not the caret line under the source excerpt that closes a CompilationError.
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip(" ^")]
            record["error"] = f"{type(exc).__name__}: {' | '.join(lines[-3:])[:400]}"
        record["compile_s"] = round(time.time() - start, 2)
        self.variants[key] = record
        return None  # no launch; the launchers' caches see no runnable kernel and keep nothing


def _resource_usage(cubin) -> dict:
    """Registers, spill stack and tensor-core instruction counts of a cubin, read by Triton's
    bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    # The instructions alone (no addresses, no encodings): equal hashes mean the same machine code.
    code = "\n".join(m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s*([^;]*);", sass))
    # Tensor-core instructions: HMMA (mma.sync, sm80+), HGMMA (wgmma, sm90), their e4m3 forms QMMA
    # (sm89) and QGMMA (sm90), and the tcgen05 MMAs of
    # sm100 (UTCHMMA for f16/bf16/tf32; UTCQMMA, UTCIMMA, UTCOMMA for the fp8/int8/block-scaled kinds),
    # issued from uniform registers on shared-memory descriptors into tensor memory.
    # ptxas serializes every wgmma of a kernel (C7514: waits for each one as it is issued) when a
    # non-wgmma instruction touches an in-flight accumulator; the machine code then has a wait per
    # wgmma, where a pipelined kernel has one per group of them.
    hgmma, qgmma = len(re.findall(r"\bHGMMA\.", sass)), len(re.findall(r"\bQGMMA\.", sass))
    serialized = hgmma + qgmma > 0 and len(re.findall(r"\bWARPGROUP\.DEPBAR\b", sass)) >= hgmma + qgmma
    return {"registers": int(regs.group(1)) if regs else None, "stack_bytes": int(stack.group(1)) if stack else None,
            "wgmma_serialized": serialized,
            "hgmma": hgmma, "hmma": len(re.findall(r"\bHMMA\.", sass)),
            "qgmma": qgmma, "qmma": len(re.findall(r"\bQMMA\.", sass)),
            "tcgen05": len(re.findall(r"\bUTC[A-Z]*MMA\b", sass)),
            "sass_sha1": hashlib.sha1(code.encode()).hexdigest()[:12]}


# The GEMM kernels (tl.dot): bf16/fp16 operands must reach the tensor cores.
GEMM_KERNELS = ("grouped_gemm_kernel", "gluon_grouped_gemm_kernel", "grouped_gemm_wgrad_kernel",
                "grouped_gemm_silu_mul_backward_kernel", "grouped_gemm_fp8_kernel")


# The targets --targets takes: the CUDA architectures the kernels are built for (sm80 up).
TARGETS = ("80", "86", "89", "90", "100", "103", "120")


# The tensor-core path a bf16/fp16 GEMM must take per target: (record key, what the SASS shows).
TCGEN05_PATH = ("tcgen05", "tcgen05 MMA (UTC*MMA)")  # sm100, sm103
TENSOR_CORE_PATH = {"sm100": TCGEN05_PATH, "sm103": TCGEN05_PATH, "sm90": ("hgmma", "HGMMA")}
HMMA_PATH = ("hmma", "HMMA")  # sm80, sm86, sm89
# The FP8 GEMM's e4m3 MMAs (the FP8 ops run from sm89 on).
FP8_TENSOR_CORE_PATH = {"sm100": TCGEN05_PATH, "sm103": TCGEN05_PATH, "sm90": ("qgmma", "QGMMA"),
                        "sm89": ("qmma", "QMMA"), "sm120": ("qmma", "QMMA")}


def _tensor_core_error(r):
    if r["kernel"].startswith("gluon_") and r["target"] != "sm90":
        return f"the sm90-only Gluon kernel was picked for {r['target']}"
    # (the FP8 GEMM's first pointer, and so its recorded dtype, is its e4m3 rows)
    if r["kernel"] not in GEMM_KERNELS or r["dtype"] not in ("bf16", "fp16", "fp8e4nv") or "hmma" not in r:
        return None
    if r["dtype"] == "fp8e4nv":
        key, name = FP8_TENSOR_CORE_PATH.get(r["target"], ("?", f"an e4m3 MMA on {r['target']}"))
    else:
        key, name = TENSOR_CORE_PATH.get(r["target"], HMMA_PATH)
    if not r.get(key):
        return f"no {name} instruction: the GEMM does not use the {r['target']} tensor-core path"
    return None


@contextlib.contextmanager
def forced_capability(capability, compiler: Compiler, portable: bool):
    """The ops' CUDA functions see ``capability`` for CPU tensors; Triton compiles instead of launching."""
    saved = (paths.capability_of, cuda.capability_of, cuda_fp8.capability_of, triton_jit.JITFunction.run,
             os.environ.get("MOONEP_OPS_PORTABLE"))
    as_taken = paths.config_capability(capability)  # (sm120 takes sm89's path and configs)
    paths.capability_of = cuda.capability_of = cuda_fp8.capability_of = lambda t: as_taken
    triton_jit.JITFunction.run = lambda fn, *args, **kwargs: compiler.run(fn, *args, **kwargs)
    os.environ["MOONEP_OPS_PORTABLE"] = "1" if portable else "0"
    flags.reload()
    try:
        yield
    finally:
        (paths.capability_of, cuda.capability_of, cuda_fp8.capability_of, triton_jit.JITFunction.run,
         portable_env) = saved
        if portable_env is None:
            os.environ.pop("MOONEP_OPS_PORTABLE", None)
        else:
            os.environ["MOONEP_OPS_PORTABLE"] = portable_env
        flags.reload()


_ALLOCATE = torch.empty  # (replaced by a sparse arena's allocator in --table)


def _empty(*shape, dtype):
    return _ALLOCATE(shape, dtype=dtype)  # never read: nothing is launched


@contextlib.contextmanager
def sparse_arena(size: int = 1 << 40):
    """``_empty`` carves its tensors from a sparse file mapped shared (disjoint, contiguous,
    1 KiB-aligned, never touched): problems whose weights pass this machine's memory still get
    real CPU storages, where a plain allocation that large is refused."""
    global _ALLOCATE
    with tempfile.NamedTemporaryFile(prefix="moonep_aot_") as f:
        f.truncate(size)
        pool = torch.from_file(f.name, shared=True, size=size, dtype=torch.uint8)
        offset = 0

        def allocate(shape, dtype):
            nonlocal offset
            nbytes = math.prod(shape) * dtype.itemsize
            if offset + nbytes > size:
                raise MemoryError(f"sparse arena: {offset + nbytes} B needed, {size} B mapped")
            tensor = pool[offset:offset + nbytes].view(dtype).view(shape)
            offset += -(-nbytes // 1024) * 1024
            return tensor

        saved, _ALLOCATE = _ALLOCATE, allocate
        try:
            yield
        finally:
            _ALLOCATE = saved


def run_all_ops(rows, k, n, g, dtype) -> None:
    """Every CUDA op function once with and once without route weights (x [rows, k], weights [g, n, k])."""
    cu = torch.linspace(rows // (2 * g), rows // 2, g).to(torch.int32)  # ends <= rows: a tail
    x, grad_k = _empty(rows, k, dtype=dtype), _empty(rows, k, dtype=dtype)
    w_gate, w_up, w_down = _empty(g, n, k, dtype=dtype), _empty(g, n, k, dtype=dtype), _empty(g, k, n, dtype=dtype)
    gate, up, grad_n = _empty(rows, n, dtype=dtype), _empty(rows, n, dtype=dtype), _empty(rows, n, dtype=dtype)
    for rw in (torch.empty(rows, dtype=torch.float32), None):
        cuda.grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)
        cuda.experts_out(x, w_gate, w_up, w_down, rw, cu, _empty(rows, k, dtype=dtype))  # act's tail unwritten
        cuda.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)
        cuda.silu_mul_weight(gate, up, rw, cu)
        cuda.silu_mul_weight_backward(grad_n, gate, up, rw, cu)
        cuda.grouped_gemm_silu_mul_backward(grad_n, x, w_gate, w_up, rw, cu)
    cuda.grouped_gemm(gate, w_down, cu)  # the down GEMM: [rows, n] x [g, k, n]
    cuda.grouped_gemm(x, w_gate, cu)
    cuda.grouped_gemm_out(x, w_gate, cu, _empty(rows, n, dtype=dtype))
    cuda.grouped_gemm_dgrad(grad_n, w_gate, cu)
    cuda.grouped_gemm_dgrad(grad_k, w_down, cu)
    cuda.grouped_gemm_dual_dgrad(grad_n, grad_n, w_gate, w_up, cu)
    cuda.grouped_gemm_wgrad(grad_n, x, cu)
    cuda.grouped_gemm_wgrad(grad_k, gate, cu)


def run_fp8_ops(rows, k, n, g, dtype, block_major: bool = False) -> None:
    """The FP8 ops (sm89+, bf16/fp16 rows) once with and once without route weights: the row
    quantization and both FP8 GEMMs of the experts op, and the plain FP8 GEMM; with
    ``block_major``, the experts op (with route weights) and the plain GEMM on block-major weights
    too."""
    from moonep_ops.fp8 import scale_shape

    cu = torch.linspace(rows // (2 * g), rows // 2, g).to(torch.int32)
    x = _empty(rows, k, dtype=dtype)
    w_gate, w_up, w_down = (_empty(*shape, dtype=torch.float8_e4m3fn) for shape in ((g, n, k), (g, n, k), (g, k, n)))
    s_gate, s_up, s_down = (_empty(*scale_shape(w.shape), dtype=torch.float32) for w in (w_gate, w_up, w_down))
    for rw in (torch.empty(rows, dtype=torch.float32), None):
        cuda.experts_fp8_out(x, w_gate, s_gate, w_up, s_up, w_down, s_down, rw, cu, _empty(rows, k, dtype=dtype))
    cuda.grouped_gemm_fp8(x, w_gate, s_gate, cu)
    if block_major and k % 128 == 0 and n % 128 == 0:
        b_gate, b_up = (_empty(g, n // 128, k // 128, 128, 128, dtype=torch.float8_e4m3fn) for _ in range(2))
        b_down = _empty(g, k // 128, n // 128, 128, 128, dtype=torch.float8_e4m3fn)
        cuda.experts_fp8_out(x, b_gate, s_gate, b_up, s_up, b_down, s_down, torch.empty(rows, dtype=torch.float32),
                             cu, _empty(rows, k, dtype=dtype))
        cuda.grouped_gemm_fp8(x, b_gate, s_gate, cu)


def run_table_problem(rows, h, i, g) -> None:
    """The launches whose Gluon configs the tables pick by problem (sm90): the experts op with and
    without route weights (its GEMM pair, the row-tile handoff where picked), the fused and the plain
    GEMM alone, in bf16 and with FP8 weights."""
    cu = torch.linspace(rows // (2 * g), rows // 2, g).to(torch.int32)
    x, act = _empty(rows, h, dtype=torch.bfloat16), _empty(rows, i, dtype=torch.bfloat16)
    w_gate, w_up, w_down = (_empty(*shape, dtype=torch.bfloat16) for shape in ((g, i, h), (g, i, h), (g, h, i)))
    for rw in (torch.empty(rows, dtype=torch.float32), None):
        cuda.experts_out(x, w_gate, w_up, w_down, rw, cu, _empty(rows, h, dtype=torch.bfloat16))
    cuda.grouped_gemm_silu_mul(x, w_gate, w_up, torch.empty(rows, dtype=torch.float32), cu)
    cuda.grouped_gemm(x, w_gate, cu)
    cuda.grouped_gemm(act, w_down, cu)
    run_fp8_ops(rows, h, i, g, torch.bfloat16)


def check_table() -> list:
    """Every variant the Gluon tables pick on the ``TABLE_*`` sweep, compiled for sm90."""
    compiler = Compiler(GPUTarget("cuda", 90, 32))
    problems = table_problems()
    print(f"# {len(problems)} problems of distinct table picks", flush=True)
    with forced_capability((9, 0), compiler, portable=False):
        if paths.gluon_host() is None:
            raise RuntimeError("--table: this Triton has no usable Gluon")
        for rows, h, i, g in problems:
            with sparse_arena():
                run_table_problem(rows, h, i, g)
    return list(compiler.variants.values())


# Gluon configs the GPU tests force, whether or not the table picks them for PROBLEMS:
# (fused, GluonConfig fields). sm90 only.
GLUON_CANDIDATES = [
    (True, dict(pingpong=False, stages=4)),  # the table's pick for NvS >= 40960, H < 4096 (qwen3 S=2048)
    (True, dict(block_n=64, block_k=128, stages=3)),
    (False, dict(pingpong=False, block_k=128, stages=3)),
    (False, dict(pingpong=False, block_n=256, stages=3)),
    (False, dict(stages=5, tail_by_producer=False)),
    # split epilogues (two column halves through a half-size buffer), with the idle-half path too
    (False, dict(pingpong=False, block_n=256, stages=4, epilogue_n=128, skip_idle_half=True)),
    (False, dict(pingpong=False, block_n=256, stages=4, epilogue_n=128, tail_by_producer=False)),
    (False, dict(stages=6, epilogue_n=64, skip_idle_half=True)),
    (True, dict(pingpong=False, stages=4, epilogue_n=64, skip_idle_half=True)),
    # idle upper halves of segments' only row tiles alone
    (True, dict(block_n=64, stages=6, skip_idle_half=True, skip_lone_tiles_only=True)),
    (False, dict(pingpong=False, stages=6, skip_idle_half=True, skip_lone_tiles_only=True)),
    # idle upper halves only where the kernel's scan finds the live segments short
    (True, dict(pingpong=False, stages=4, skip_idle_half=True, skip_on_long_segments=False)),
]

# The experts op's down GEMM as a programmatic dependent without the handoff (its first item's
# weight loads issued before the wait), with idle halves: the producer's check of that first item
# sizes those stages' loads.
PDL_CANDIDATES = [
    (False, dict(pingpong=False, block_n=256, stages=3, skip_idle_half=True)),
    (False, dict(stages=5, skip_idle_half=True)),
]


# The row-tile handoff of the experts op's pair (GluonConfig.handoff): the fused GEMM signalling
# row tiles (PDL primary), the down GEMM with its dynamic schedule waiting for them (dependent), in
# both consumer schemes, with idle halves, the producer's tail, a split epilogue.
HANDOFF_CANDIDATES = [
    (True, dict(pingpong=False, stages=4, skip_idle_half=True)),
    (True, dict(block_n=64, stages=6)),
    (False, dict(pingpong=False, stages=6, tail_by_producer=False)),
    (False, dict(stages=5)),
    (False, dict(stages=5, skip_idle_half=True)),
    (False, dict(pingpong=False, block_n=256, stages=4, epilogue_n=128, skip_idle_half=True)),
]


# FP8 Gluon configs the GPU tests force (tests/test_fp8.py) beyond the table's picks for PROBLEMS:
# 128-row items split between the consumers, with the idle-upper-half skip of lone tiles (the
# table's pick for large experts under 32768 rows) and with the tail zeroed by the consumers.
GLUON_FP8_CANDIDATES = [
    (True, dict(stages=4, split_rows=True, skip_idle_half=True, skip_lone_tiles_only=True)),
    (False, dict(stages=6, split_rows=True, skip_idle_half=True, skip_lone_tiles_only=True)),
    (False, dict(stages=6, split_rows=True, tail_by_producer=False)),
    # a GEMM as two launches (on_multi_tile; the table's for large experts in tiny buffers), each
    # of which may take nothing
    (True, dict(block_m=64, stages=4, split_ring=True, skip_idle_tiles=True, on_multi_tile=False)),
    (False, dict(block_m=64, stages=8, split_ring=True, skip_idle_tiles=True, on_multi_tile=False)),
    (True, dict(stages=4, split_rows=True, on_multi_tile=True)),
    (False, dict(stages=6, split_rows=True, on_multi_tile=True)),
]


def run_gluon_fp8_candidates() -> None:
    from moonep_ops.fp8 import num_blocks, scale_shape
    from moonep_ops.kernels.gluon import host as gluon_host

    rows, k, n, g = 4096, 2048, 768, 8
    cu = torch.linspace(rows // (2 * g), rows // 2, g).to(torch.int32)
    a, a_scale = _empty(rows, k, dtype=torch.float8_e4m3fn), _empty(rows, num_blocks(k), dtype=torch.float32)
    w, w_scale = _empty(g, n, k, dtype=torch.float8_e4m3fn), _empty(*scale_shape((g, n, k)), dtype=torch.float32)
    for fused, cfg in GLUON_FP8_CANDIDATES:
        out = _empty(rows, n, dtype=torch.float8_e4m3fn if fused else torch.bfloat16)
        out_scale = _empty(rows, num_blocks(n), dtype=torch.float32) if fused else None
        gluon_host.launch(a, w, cu, out, 4, w_up=w if fused else None,
                          route_weights=torch.empty(rows, dtype=torch.float32) if fused else None,
                          idle_weights=None if fused else torch.empty(rows, dtype=torch.float32), zero_tail=not fused,
                          scales=gluon_host.Fp8Scales(a_scale, w_scale, w_scale, out_scale),
                          **{"block_m": 128, "block_k": 128, **cfg})


def run_gluon_candidates(dtype) -> None:
    from moonep_ops.kernels.gluon import host as gluon_host
    from moonep_ops.kernels.pdl import PdlRole

    rows, k, n, g = 4096, 2048, 768, 8
    cu = torch.linspace(rows // (2 * g), rows // 2, g).to(torch.int32)
    for fused, cfg in GLUON_CANDIDATES:
        w = _empty(g, n, k, dtype=dtype)
        gluon_host.launch(_empty(rows, k, dtype=dtype), w, cu, _empty(rows, n, dtype=dtype), 4,
                                  w_up=w if fused else None,
                                  route_weights=torch.empty(rows, dtype=torch.float32) if fused else None, **cfg)
    for _, cfg in PDL_CANDIDATES:
        w = _empty(g, n, k, dtype=dtype)
        gluon_host.launch(_empty(rows, k, dtype=dtype), w, cu, _empty(rows, n, dtype=dtype), 4,
                                  idle_weights=torch.empty(rows, dtype=torch.float32), role=PdlRole.DEPENDENT, **cfg)
    sched = torch.empty(64, dtype=torch.int32)
    for fused, cfg in HANDOFF_CANDIDATES:
        w = _empty(g, n, k, dtype=dtype)
        rw = torch.empty(rows, dtype=torch.float32)
        gluon_host.launch(_empty(rows, k, dtype=dtype), w, cu, _empty(rows, n, dtype=dtype), 4,
                                  w_up=w if fused else None, route_weights=rw if fused else None,
                                  idle_weights=None if fused else rw, zero_tail=not fused,
                                  role=PdlRole.PRIMARY if fused else PdlRole.DEPENDENT,
                                  handoff=gluon_host.Handoff(sched, 3 * 256), **cfg)


def check_target(arch: int, dtypes, portable: bool, problems=PROBLEMS) -> list:
    capability = (arch // 10, arch % 10)
    compiler = Compiler(GPUTarget("cuda", arch, 32))
    with forced_capability(capability, compiler, portable):
        for index, (_, rows, k, n, g) in enumerate(problems):
            for dtype in dtypes:
                run_all_ops(rows, k, n, g, dtype)
                if capability >= (8, 9) and dtype != torch.float32:
                    # block-major weights on the first problem only: the same kernels, other loads
                    run_fp8_ops(rows, k, n, g, dtype, block_major=index == 0 and dtype == torch.bfloat16)
        if arch == 90 and not portable and paths.gluon_host() is not None:
            for dtype in dtypes:
                if dtype != torch.float32:
                    run_gluon_candidates(dtype)
            run_gluon_fp8_candidates()
    records = list(compiler.variants.values())
    for r in records:
        r["portable"] = portable
    return records


def _report(records) -> int:
    failures = 0
    for r in records:
        limit = SMEM_LIMIT.get(int(r["target"][2:]))
        if "error" not in r and limit is not None and r["shared"] > limit:
            r["error"] = f"shared memory {r['shared']} B > {limit} B per block on {r['target']}"
        if "error" not in r and _tensor_core_error(r):
            r["error"] = _tensor_core_error(r)
        failures += "error" in r
        knobs = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
        status = f"FAIL {r['error']}" if "error" in r else (
            f"smem {r['shared']:>6} B  regs {r.get('registers')}  stack {r.get('stack_bytes')} B  "
            f"hgmma {r.get('hgmma')} hmma {r.get('hmma')} qgmma {r.get('qgmma')} qmma {r.get('qmma')} "
            f"tcgen05 {r.get('tcgen05')}{'  WGMMA SERIALIZED' if r.get('wgmma_serialized') else ''}")
        print(f"{r['target']}{' portable' if r.get('portable') else ''} {r['kernel']} {r['dtype']} w{r['num_warps']} "
              f"s{r['num_stages']} [{knobs}]: {status}", flush=True)
    serialized = sum(bool(r.get("wgmma_serialized")) for r in records)
    print(f"# {len(records)} variants, {failures} failed, {serialized} with every wgmma serialized by ptxas")
    return failures


def _compile_one(arch: int, cfg) -> dict:
    """The record of one bf16 grouped GEMM with ``cfg`` on the TMA path, compiled for ``arch``."""
    from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm

    compiler = Compiler(GPUTarget("cuda", arch, 32))
    a, w = _empty(1024, 1024, dtype=torch.bfloat16), _empty(4, 512, 1024, dtype=torch.bfloat16)
    cu = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    with forced_capability((arch // 10, arch % 10), compiler, portable=False):
        launch_grouped_gemm(a, w, cu, _empty(1024, 512, dtype=torch.bfloat16), cfg, use_tma=True)
    (record,) = compiler.variants.values()
    return record


def selftest() -> int:
    """A config too large for the shared memory of sm90 and sm100 (5 stages of 256x256x128 tiles)
    must be flagged on both; a GEMM that fits compiles for sm100 with tcgen05 MMAs and passes, and
    the same record without them fails; the tensor-core rule of each target on synthetic records."""
    from moonep_ops.kernels.triton.configs import GemmConfig

    oversized = [_compile_one(arch, GemmConfig(256, 256, 128, 8, 5)) for arch in (90, 100)]
    flagged = _report(oversized)
    print("selftest:", "ok (flagged on sm90 and sm100)" if flagged == 2 else
          "FAILED: the oversized config was not flagged on every target")
    # A real sm100 record: its SASS must show tcgen05 MMAs (the regex matches cuobjdump's names),
    # and the record with them removed must fail.
    fits = _compile_one(100, GemmConfig(128, 128, 64, 4, 3))
    sm100_ok = _report([fits]) == 0 and fits.get("tcgen05", 0) > 0
    without = {k: v for k, v in fits.items() if k != "error"}
    sm100_ok = sm100_ok and _report([dict(without, tcgen05=0)]) == 1
    print("selftest: sm100 tcgen05 rule on a compiled GEMM", "ok" if sm100_ok else "FAILED")
    # The tensor-core rule on synthetic records: sm100 wants tcgen05, sm90 HGMMA, sm86 HMMA; the
    # Gluon kernel belongs to sm90 only; the FP8 GEMM wants QGMMA on sm90, QMMA on sm89.
    record = {"kernel": "grouped_gemm_kernel", "dtype": "bf16", "target": "sm90", "hgmma": 0, "hmma": 16, "tcgen05": 0}
    sm100 = dict(record, target="sm100")
    fp8 = dict(record, kernel="grouped_gemm_fp8_kernel", dtype="fp8e4nv", hmma=0, qgmma=0, qmma=0)
    rules_ok = (_tensor_core_error(record) is not None
                and _tensor_core_error(dict(record, hgmma=8)) is None
                and _tensor_core_error(dict(record, tcgen05=8)) is not None
                and _tensor_core_error(dict(record, target="sm86")) is None
                and _tensor_core_error(dict(record, target="sm86", hmma=0, hgmma=8)) is not None
                and _tensor_core_error(dict(record, dtype="fp32", hmma=0)) is None
                and _tensor_core_error(sm100) is not None
                and _tensor_core_error(dict(sm100, hmma=0, hgmma=8)) is not None
                and _tensor_core_error(dict(sm100, tcgen05=8)) is None
                and _tensor_core_error(dict(sm100, kernel="grouped_gemm_wgrad_kernel", hmma=0)) is not None
                and _tensor_core_error(dict(sm100, dtype="fp32", hmma=0)) is None
                and _tensor_core_error(dict(sm100, kernel="gluon_grouped_gemm_kernel", tcgen05=8)) is not None
                and _tensor_core_error(dict(record, kernel="gluon_grouped_gemm_kernel", hgmma=8)) is None
                and _tensor_core_error(dict(fp8, hgmma=8)) is not None
                and _tensor_core_error(dict(fp8, qgmma=8)) is None
                and _tensor_core_error(dict(fp8, target="sm89", qmma=8)) is None
                and _tensor_core_error(dict(fp8, target="sm89", hmma=8)) is not None
                and _tensor_core_error(dict(fp8, target="sm100", tcgen05=8)) is None)
    print("selftest: tensor-core rules", "ok" if rules_ok else "FAILED")
    return 0 if flagged == 2 and sm100_ok and rules_ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="90,100,103,80,86,89,120")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--problems", default=None,
                        help="indices into PROBLEMS, comma-separated (default: all)")
    parser.add_argument("--no-portable", action="store_true",
                        help="skip the MOONEP_OPS_PORTABLE=1 pass of sm90+ targets")
    parser.add_argument("--json", default=None)
    parser.add_argument("--selftest", action="store_true")
    parser.add_argument("--table", action="store_true",
                        help="instead of --targets, --dtypes, --problems: every Gluon config the tables pick "
                             "on a sweep of model sizes, for sm90")
    args = parser.parse_args(argv)
    if args.selftest:
        return selftest()
    known_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    targets, dtype_names = args.targets.split(","), args.dtypes.split(",")
    problem_ids = [] if args.problems is None else args.problems.split(",")
    for values, known, option in ((targets, TARGETS, "--targets"), (dtype_names, known_dtypes, "--dtypes"),
                                  (problem_ids, [str(i) for i in range(len(PROBLEMS))], "--problems")):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"{option}: {', '.join(unknown)} not among {', '.join(known)}")
    dtypes = [known_dtypes[d] for d in dtype_names]
    problems = PROBLEMS if args.problems is None else [PROBLEMS[int(i)] for i in problem_ids]
    print(f"# triton {triton.__version__}, torch {torch.__version__}")
    if args.table:
        records = check_table()
    else:
        records = []
        for arch in (int(t) for t in targets):
            for portable in ((False, True) if arch >= 90 and not args.no_portable else (False,)):
                records += check_target(arch, dtypes, portable, problems)
    failures = _report(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "torch": torch.__version__, "variants": records}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
