"""How fast can a kernel stream weights from DRAM, by weight layout? (issue 6: the qwen3 gap)

The forward GEMMs read each weight tile as TMA boxes of ``BLOCK_N`` rows x ``BLOCK_K`` columns
out of ``[G*N, K]`` storage: per box, ``BLOCK_N`` pieces of ``2*BLOCK_K`` bytes, ``2*K`` bytes
apart. The memory-bound shapes (qwen3) run at 3.5-3.8 TB/s in those kernels. This probe streams
the same bytes with nothing else to do (a TMA-pipelined persistent loop that sums every element),
in the kernels' layout and in a packed one where each box is one contiguous block, to tell
whether a packed weight layout could buy DRAM bandwidth, and measures the write and copy rates.
On the H200 (``benchmarks/results/dram_layout_h200.json``): reads 4.4-4.5 TB/s, the kernels'
128x64 boxes in their order 4.1 TB/s (packed +7%), writes 3.35 TB/s, copy 2.76 TB/s.

Rows: ``strided BMxBK`` (the kernels' layout, K = --k), ``packed BMxBK`` (the same boxes, each
contiguous), ``slab_strided``/``slab_packed BMxBK`` (the GEMMs' order: each program streams its
own row tile's k tiles, 132 slabs at once; strided boxes or each box contiguous), ``plain
BLOCK/programs`` (contiguous vectorized loads, no TMA), ``torch copy`` (``dst.copy_(src)``:
bytes read + written) and ``torch zero_`` (bytes written). Median of --reps CUDA-graph replays
after warm-up; ``sum_err`` checks each kernel read every byte once.
Usage: python -m benchmarks.dram_layout [--gib 1] [--k 2048] [--out dram_layout.json]
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _stream_kernel(desc, partial_ptr, n_row_tiles, n_k_tiles, BM: tl.constexpr, BK: tl.constexpr):
    # One flat, software-pipelined loop over (row tile, k tile) boxes for both layouts: the first
    # version nested the loops, so the packed layout (one k tile per row) ran unpipelined.
    pid = tl.program_id(0)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for i in tl.range(pid, n_row_tiles * n_k_tiles, tl.num_programs(0), num_stages=4):
        t = i // n_k_tiles
        kk = i - t * n_k_tiles
        acc += desc.load([t * BM, kk * BK]).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _slab_kernel(desc, partial_ptr, n_row_tiles, n_k_tiles, PACKED: tl.constexpr, BM: tl.constexpr,
                 BK: tl.constexpr):
    # The GEMMs' order: each program reads all k tiles of its own row tile, then its next row tile,
    # so 132 programs stream 132 separate slabs at once (the flat loop above has them side by side
    # in one slab). PACKED: box (t, kk) is the contiguous block (t * n_k_tiles + kk) of [*, BK].
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    mine = tl.cdiv(n_row_tiles - pid, num_progs)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for j in tl.range(0, mine * n_k_tiles, num_stages=4):
        t = pid + (j // n_k_tiles) * num_progs
        kk = j % n_k_tiles
        if PACKED:
            acc += desc.load([(t * n_k_tiles + kk) * BM, 0]).to(tl.float32)
        else:
            acc += desc.load([t * BM, kk * BK]).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def slab_sum(weights: torch.Tensor, bm: int, bk: int, packed: bool, programs: int,
             partial: torch.Tensor) -> None:
    """Sum of ``weights [R, K]`` in the GEMMs' per-program slab order, strided or packed boxes."""
    rows, cols = weights.shape
    t2d = weights.view(-1, bk) if packed else weights
    desc = TensorDescriptor(t2d, list(t2d.shape), [t2d.stride(0), 1], [bm, bk])
    _slab_kernel[(programs,)](desc, partial, rows // bm, cols // bk, PACKED=packed, BM=bm, BK=bk,
                              num_warps=8)


@triton.jit
def _plain_stream_kernel(src_ptr, partial_ptr, n_blocks, BLOCK: tl.constexpr):
    # The same sum with ordinary vectorized loads (no TMA): the read ceiling without descriptors.
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.range(pid, n_blocks, tl.num_programs(0), num_stages=4):
        offs = i * BLOCK + tl.arange(0, BLOCK)  # int32: 1 GiB of bf16 is 2^29 elements
        acc += tl.load(src_ptr + offs).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(acc, 0))


def stream_sum(t2d: torch.Tensor, bm: int, bk: int, programs: int, partial: torch.Tensor) -> None:
    """Sum of ``t2d [R, C]`` read in ``(bm, bk)`` TMA boxes by ``programs`` persistent programs."""
    rows, cols = t2d.shape
    desc = TensorDescriptor(t2d, [rows, cols], [t2d.stride(0), 1], [bm, bk])
    _stream_kernel[(programs,)](desc, partial, rows // bm, cols // bk, BM=bm, BK=bk, num_warps=8)


def plain_sum(flat: torch.Tensor, block: int, programs: int, partial: torch.Tensor) -> None:
    """Sum of contiguous ``flat`` (a multiple of ``block`` elements) by ``programs`` programs."""
    _plain_stream_kernel[(programs,)](flat, partial, flat.numel() // block, BLOCK=block, num_warps=8)


def main(argv=None):
    from .run import _median_graph_ms, environment
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0, help="bytes streamed (far above L2)")
    parser.add_argument("--k", type=int, default=2048, help="row length of the strided layout (qwen3: H = 2048)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not 0 < args.gib < 4:
        parser.error(f"--gib must be in (0, 4) (the plain kernel indexes in int32), got {args.gib}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = int(args.gib * 2**30) // (2 * args.k) // 256 * 256
    weights = torch.rand(rows, args.k, device="cuda").to(torch.bfloat16)  # positive: a well-conditioned sum
    nbytes = weights.numel() * 2
    ref = weights.double().sum().item()
    partial = torch.empty(2 * sms, device="cuda", dtype=torch.float32)
    print(f"# {environment()}  {nbytes / 1e9:.2f} GB, K = {args.k}, {sms} programs", flush=True)
    results = []

    def measure(label, fn, n_partials=sms, **row):
        """Check that ``fn`` summed every byte once (into ``n_partials`` partial sums), time it
        (``fn`` is captured in a graph here, so loop variables may be closed over), record a row."""
        fn()
        err = abs(partial[:n_partials].double().sum().item() - ref) / abs(ref)
        us = _median_graph_ms(fn, args.reps) * 1e3
        results.append({**row, "us": us, "tbps": nbytes / us / 1e6, "sum_err": err})
        print(f"{label:<22} {us:8.1f} us  {nbytes / us / 1e6:.2f} TB/s  sum err {err:.1e}", flush=True)

    for bm, bk in ((128, 64), (128, 128), (256, 64), (64, 256)):
        layouts = {"strided": weights,  # box = bm rows of 2*bk bytes, 2*K bytes apart
                   "packed": weights.view(-1, bk)}  # the same bytes seen as [R*K/bk, bk]: boxes contiguous
        for name, t2d in layouts.items():
            measure(f"{name} {bm}x{bk}", lambda: stream_sum(t2d, bm, bk, sms, partial), layout=name, bm=bm, bk=bk)
    for bm, bk in ((128, 64), (256, 64), (128, 128)):
        for packed in (False, True):
            name = "slab_packed" if packed else "slab_strided"
            measure(f"{name} {bm}x{bk}", lambda: slab_sum(weights, bm, bk, packed, sms, partial), layout=name,
                    bm=bm, bk=bk)
    for block, programs in ((8192, sms), (8192, 2 * sms), (16384, sms)):
        measure(f"plain {block}/{programs}", lambda: plain_sum(weights.view(-1), block, programs, partial),
                programs, layout="plain", block=block, programs=programs)
    dst = torch.empty_like(weights)
    us = _median_graph_ms(lambda: dst.copy_(weights), args.reps) * 1e3
    results.append({"layout": "torch copy", "us": us, "tbps": 2 * nbytes / us / 1e6})
    print(f"torch copy          {us:8.1f} us  {2 * nbytes / us / 1e6:.2f} TB/s (read + write)", flush=True)
    # Writes alone (the output tail's zeros are a write-only stream).
    us = _median_graph_ms(dst.zero_, args.reps) * 1e3
    results.append({"layout": "torch zero_", "us": us, "tbps": nbytes / us / 1e6})
    print(f"torch zero_         {us:8.1f} us  {nbytes / us / 1e6:.2f} TB/s (write)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "method": __doc__, "bytes": nbytes, "k": args.k,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
