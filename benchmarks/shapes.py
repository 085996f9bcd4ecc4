"""The six shapes of shared/BASELINE.md and MoonEP-like segment layouts for them.

Layouts are built on the host (benchmarks only): S*K real rows spread with a skew over the
active weight rows, each non-empty segment padded to ``token_padding``, B = 4 prefetch slots,
NvS = align_up(S*K + (token_padding - 1)*2*epn, token_padding), NaN in the tail.
"""

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    num_groups: int  # G = E + B
    topk: int
    tokens: int  # S
    epn: int
    active: int  # weight rows that receive tokens
    weights_on_input: bool = False

    def nvs(self, token_padding: int) -> int:
        raw = self.tokens * self.topk + (token_padding - 1) * 2 * self.epn
        return math.ceil(raw / token_padding) * token_padding


SHAPES = [
    Shape("kimi-k2 EP8 decode S=128", 7168, 2048, 388, 8, 128, 48, 52),
    Shape("kimi-k2 EP8 S=1024", 7168, 2048, 388, 8, 1024, 48, 52),
    Shape("kimi-k2 EP8 prefill S=4096", 7168, 2048, 388, 8, 4096, 48, 52),
    Shape("qwen3-30b-a3b EP1 S=64", 2048, 768, 132, 8, 64, 128, 132),
    Shape("qwen3-30b-a3b EP1 S=2048", 2048, 768, 132, 8, 2048, 128, 132),
    Shape("llama4-scout top-1 S=2048", 5120, 8192, 20, 1, 2048, 16, 20, weights_on_input=True),
]


def segment_sizes(shape: Shape, token_padding: int, seed: int = 0) -> list[int]:
    """Skewed real-row counts over ``shape.active`` weight rows, padded; zeros elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    total = shape.tokens * shape.topk
    # Zipf-like skew: a few hot experts, a long tail; some active rows may stay empty.
    ranks = torch.randperm(shape.active, generator=gen).double() + 1
    probs = ranks ** -0.8
    probs /= probs.sum()
    counts = torch.multinomial(probs, total, replacement=True, generator=gen).bincount(minlength=shape.active)
    # Active rows are spread over the G weight rows (experts then prefetch slots).
    rows = torch.randperm(shape.num_groups, generator=gen)[:shape.active].sort().values
    sizes = [0] * shape.num_groups
    for r, c in zip(rows.tolist(), counts.tolist()):
        sizes[r] = 0 if c == 0 else math.ceil(c / token_padding) * token_padding
    return sizes


def build_problem(shape: Shape, token_padding: int, device="cuda", dtype=torch.bfloat16, seed=0):
    """Inputs for the expert path: x, w_gate, w_up, w_down, cu_seqlens, route_weights."""
    sizes = segment_sizes(shape, token_padding, seed)
    nvs = shape.nvs(token_padding)
    assert sum(sizes) <= nvs, (shape.name, sum(sizes), nvs)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, g = shape.hidden, shape.inter, shape.num_groups
    x = torch.randn(nvs, h, device=device, dtype=dtype, generator=gen)
    x[sum(sizes):] = float("nan")
    w_gate = torch.randn(g, i, h, device=device, dtype=dtype, generator=gen) * h ** -0.5
    w_up = torch.randn(g, i, h, device=device, dtype=dtype, generator=gen) * h ** -0.5
    w_down = torch.randn(g, h, i, device=device, dtype=dtype, generator=gen) * i ** -0.5
    cu = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    rw = None if shape.weights_on_input else torch.rand(nvs, device=device, generator=gen) + 0.1
    return x, w_gate, w_up, w_down, cu, rw, sizes
