"""The layout matrix shared by the op tests: MoonEP-like segment layouts and inputs on them.

A layout is a list of per-group segment sizes plus ``NvS`` (rows in the buffer). Rows at or
past ``sum(sizes)`` are the undefined tail: the inputs hold NaN there.
"""

import dataclasses
import random

import torch


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    sizes: tuple  # rows per group; len(sizes) == G
    nvs: int  # rows in the buffer, >= sum(sizes)
    k: int = 48  # reduction size of the grouped GEMM (H for gate/up)
    n: int = 40  # output columns (I for gate/up)
    padded_to: int = 1  # each non-empty segment's last (padded_to - real) rows are zero padding
    real_rows: tuple = ()  # rows of real data per group when padded

    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def cu_seqlens(self, device="cpu") -> torch.Tensor:
        ends, acc = [], 0
        for s in self.sizes:
            acc += s
            ends.append(acc)
        return torch.tensor(ends, dtype=torch.int32, device=device)

    def __str__(self):
        return self.name


def _padded(name, real, pad, extra_tail, k=48, n=40):
    sizes = tuple(0 if r == 0 else -(-r // pad) * pad for r in real)
    return Layout(name, sizes, sum(sizes) + extra_tail, k, n, pad, tuple(real))


def _seeded_sizes(g, lo, hi, p_empty, seed):
    rng = random.Random(seed)
    return tuple(0 if rng.random() < p_empty else rng.randint(lo, hi) for _ in range(g))


LAYOUTS = [
    Layout("unpadded", (5, 1, 17, 3, 9), 40),
    Layout("empty_leading", (0, 0, 7, 4), 11),
    Layout("empty_trailing", (6, 3, 0, 0), 12),
    Layout("empty_middle", (4, 0, 0, 5, 0, 2), 14),
    Layout("all_empty", (0, 0, 0), 9),
    Layout("one_segment", (23,), 23),
    Layout("tail_rows", (3, 8, 2), 31),
    Layout("nvs0", (0, 0), 0),
    Layout("g1", (13,), 20),
    _padded("moonep_padded", (100, 0, 3, 130, 0, 0), 128, extra_tail=37),
    Layout("g1100", _seeded_sizes(1100, 1, 3, 0.7, seed=0), 1100, k=16, n=8),
    Layout("k1001_n300", (9, 0, 14), 30, k=1001, n=300),
]
LAYOUT_IDS = [layout.name for layout in LAYOUTS]
# Invalid cu_seqlens for the GPU kernels (unspecified values, never a fault or a write past NvS):
# non-monotone, negative, past NvS, and long runs of empty and decreasing ends, which the segment
# walks step over
INVALID_ENDS = {
    "decreasing": [100, 50, 400],
    "negative_then_past": [-5, 300, 200],
    "int32_large": [0, 0, 1 << 24],
    "long_runs": [0] * 300 + [100, 50] + [50] * 300 + [400] + [30] * 40,
}


def fill_tail_nan(t: torch.Tensor, start: int) -> torch.Tensor:
    """Plant NaN in rows ``[start, NvS)``: they are undefined and must never be read."""
    if t.is_floating_point():
        t[start:] = float("nan")
    return t


def zero_padding_rows(layout: Layout, t: torch.Tensor) -> torch.Tensor:
    """Zero the padding rows of each segment (past its ``real_rows``) of ``t`` (rows, or route
    weights: MoonEP's padding has weight 0), in place."""
    start = 0
    for size, real in zip(layout.sizes, layout.real_rows):
        t[start + real:start + size] = 0
        start += size
    return t


def _rows(layout: Layout, cols: int, dtype, device, scale=1.0) -> torch.Tensor:
    """``[NvS, cols]`` random rows, zero padding rows, NaN tail."""
    t = torch.randn(layout.nvs, cols, dtype=torch.float32, device=device) * scale
    if layout.padded_to > 1:
        zero_padding_rows(layout, t)
    t = t.to(dtype)
    return fill_tail_nan(t, layout.total)


def grouped_gemm_inputs(layout: Layout, dtype=torch.float32, device="cpu", *,
                        requires_grad=False):
    """``(a [NvS, K], w [G, N, K], cu_seqlens [G])`` on ``layout``."""
    a = _rows(layout, layout.k, dtype, device)
    w = (torch.randn(layout.num_groups, layout.n, layout.k, device=device) / layout.k ** 0.5).to(dtype)
    cu = layout.cu_seqlens(device)
    return a.requires_grad_(requires_grad), w.requires_grad_(requires_grad), cu


def silu_mul_weight_inputs(layout: Layout, dtype=torch.float32, device="cpu", *,
                           with_weights=True, requires_grad=False):
    """``(gate, up [NvS, N], route_weights [NvS] fp32 or None, cu_seqlens)`` on ``layout``."""
    gate = _rows(layout, layout.n, dtype, device, scale=2.0)
    up = _rows(layout, layout.n, dtype, device)
    rw = None
    if with_weights:
        rw = fill_tail_nan(torch.rand(layout.nvs, device=device, dtype=torch.float32) + 0.1,
                           layout.total)
        if dtype == torch.float64:
            rw = rw.double()
        rw.requires_grad_(requires_grad)
    return gate.requires_grad_(requires_grad), up.requires_grad_(requires_grad), rw, layout.cu_seqlens(device)


def experts_inputs(layout: Layout, dtype=torch.float32, device="cpu", *, with_weights=True):
    """``(x [NvS, H], w_gate, w_up [G, I, H], w_down [G, H, I], cu_seqlens, route_weights)``;
    H = layout.k, I = layout.n."""
    g, h, i = layout.num_groups, layout.k, layout.n
    x = _rows(layout, h, dtype, device)
    w_gate = (torch.randn(g, i, h, device=device) / h ** 0.5).to(dtype)
    w_up = (torch.randn(g, i, h, device=device) / h ** 0.5).to(dtype)
    w_down = (torch.randn(g, h, i, device=device) / i ** 0.5).to(dtype)
    rw = None
    if with_weights:
        rw = fill_tail_nan(torch.rand(layout.nvs, device=device) + 0.1, layout.total)
    return x, w_gate, w_up, w_down, layout.cu_seqlens(device), rw


def fp8_experts_inputs(layout: Layout, dtype=torch.bfloat16, device="cpu", *, with_weights=True):
    """:func:`experts_inputs` with each weight as ``(w_fp8 e4m3fn, fp32 block scale)``
    (quantized by moonep_ops.fp8.quantize_weight): ``(x, (w_gate, scale), (w_up, scale),
    (w_down, scale), cu_seqlens, route_weights)``."""
    from moonep_ops.fp8 import quantize_weight

    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, dtype, device, with_weights=with_weights)
    return (x, quantize_weight(w_gate), quantize_weight(w_up), quantize_weight(w_down), cu, rw)
