"""This GPU's sustained limit for one expert-path problem, measured in the benchmark's own run.

The nominal floor (``run.floor_us``) prices the path's FLOPs and bytes at fixed rates. The limit
measures instead what this GPU sustains on work of the same size, under the same protocol as the
paths (:func:`benchmarks.timing.median_replay_ms`: CUDA-graph replays, the same ``reps`` and
``settle_s``, so the same clock and power state under the 700 W cap)::

    limit = max(gemm, read)
    gemm  dense cuBLAS bf16 GEMM pair with the path's FLOPs (6·rows·H·I), one weight each (torch.mm):
          [rows, H] x [H, 2I] -> [rows, 2I], then [rows, I] x [I, H] -> [rows, H]
    read  a read-only reduction (torch.sum) over one bf16 buffer of the path's bytes
          (``floor_us``'s count: each non-empty group's three weights, x and out, route weights)

``rows`` are the rows in segments (padding rows included). Efficiency against the limit is
``limit / time``; the moonep kernels skip padding rows' idle tile halves and may find the weights of
a small problem in L2, so it can exceed 1.

Buffers hold random bf16 values (a GEMM on zeros draws less power and would run faster under the cap)
and are kept between calls, growing as needed. The read buffer is capped at ``READ_CAP_BYTES``
(2 GiB, 40 times the H200's L2): a larger byte count is timed on the cap and scaled linearly, which is
exact to within noise at that size. A byte count that fits in L2 is read from L2 by back-to-back
replays (as the path's own weights then are); the result says so (``l2_fit``).
"""

import torch

from .timing import median_replay_ms

READ_CAP_BYTES = 2 ** 31


def limit_figures(gemm_us: float, read_us: float, flops: float, nbytes: float) -> dict:
    """The limit from its two parts' times: ``us`` (the larger), ``bound`` (which), both parts and
    their rates for ``flops`` FLOPs and ``nbytes`` bytes."""
    return {"us": max(gemm_us, read_us), "bound": "compute" if gemm_us >= read_us else "memory",
            "gemm_us": gemm_us, "read_us": read_us,
            "gemm_tflops": flops / gemm_us / 1e6 if gemm_us else 0.0,
            "read_tbps": nbytes / read_us / 1e6 if read_us else 0.0}


class LimitMeter:
    """Measures :func:`limit <LimitMeter.measure>` for problem after problem, reusing its buffers."""

    def __init__(self, reps: int, settle_s: float, device="cuda"):
        self.reps, self.settle_s, self.device = reps, settle_s, device
        self._buffers: dict[str, torch.Tensor] = {}
        self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size

    def measure(self, rows: int, hidden: int, inter: int, nbytes: int) -> dict:
        """``{"us", "bound", "gemm_us", "read_us", "gemm_tflops", "read_tbps", "read_bytes",
        "l2_fit"}`` for a path of ``rows`` rows, hidden size ``hidden``, intermediate size ``inter``
        and ``nbytes`` bytes moved; ``us`` is the larger part, ``bound`` names it."""
        gemm_us = self.gemm_pair_us(rows, hidden, inter)
        read_us, read_bytes = self.read_us(nbytes)
        return {**limit_figures(gemm_us, read_us, 6 * rows * hidden * inter, nbytes),
                "read_bytes": read_bytes, "l2_fit": nbytes <= self.l2_bytes}

    def gemm_pair_us(self, rows: int, hidden: int, inter: int) -> float:
        """µs of the dense GEMM pair: ``[rows, H] x [H, 2I]`` then ``[rows, I] x [I, H]``."""
        a = self.take("a", rows * hidden).view(rows, hidden)
        w1 = self.take("w1", 2 * inter * hidden).view(2 * inter, hidden)  # [N, K], as the experts' weights
        mid = self.take("mid", rows * 2 * inter).view(rows, 2 * inter)
        a2 = self.take("a2", rows * inter).view(rows, inter)
        w2 = self.take("w2", hidden * inter).view(hidden, inter)
        out = self.take("out", rows * hidden).view(rows, hidden)

        def pair():
            torch.mm(a, w1.t(), out=mid)
            torch.mm(a2, w2.t(), out=out)

        return median_replay_ms(pair, self.reps, self.settle_s) * 1e3

    def read_us(self, nbytes: int) -> tuple[float, int]:
        """µs of a ``torch.sum`` over ``nbytes`` bytes of bf16 (timed on at most ``READ_CAP_BYTES``
        and scaled), and the byte count actually read."""
        read_bytes = min(nbytes, READ_CAP_BYTES) // 2 * 2
        if read_bytes == 0:
            return 0.0, 0
        buf = self.take("read", read_bytes // 2)
        us = median_replay_ms(lambda: torch.sum(buf), self.reps, self.settle_s) * 1e3
        return us * nbytes / read_bytes, read_bytes

    def release(self) -> None:
        """Frees every buffer (the next :meth:`measure` allocates them again)."""
        self._buffers.clear()

    def take(self, name: str, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of buffer ``name``, reallocated (random bf16) when too small."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(name, None)
            buf = torch.randn(max(numel, 1), device=self.device, dtype=torch.bfloat16)
            self._buffers[name] = buf
        return buf[:numel]
