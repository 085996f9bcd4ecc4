"""The six shapes of shared/BASELINE.md and MoonEP-like layouts for them, built by the
layout emulator: S*K real rows skewed over the rank's epn experts plus B = 4 prefetch slots,
each non-empty segment padded to ``token_padding``, NvS = align_up(S*K + (token_padding - 1)*2*epn,
token_padding), NaN in the tail. The layout sweep (``sweep.py``) builds its cases the same way,
with other skews and seeds.
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


def build_problem(shape: Shape, token_padding: int, device="cuda", dtype=torch.bfloat16, seed=0, skew=0.8):
    """Inputs for the expert path, laid out by the MoonEP emulator (:mod:`moonep_ops.layout`).

    Each of the ``S`` tokens picks ``K`` distinct experts among this rank's ``epn`` local ones
    with a Zipf-like skew: the expert of popularity rank ``r`` (a random order drawn from ``seed``)
    is weighted ``r ** -skew`` (0: uniform; the six shapes use 0.8). Dispatch adds ``B = G - E``
    prefetch slots for the hottest experts, pads segments to ``token_padding`` and leaves NaN in the
    tail. Weights are random ``[G, ., .]``
    tensors (timing does not depend on whether the slots hold copies). Returns
    ``x, w_gate, w_up, w_down, cu_seqlens, route_weights, sizes`` (``sizes`` per group, host).
    """
    from moonep_ops import layout

    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, g = shape.hidden, shape.inter, shape.num_groups
    num_prefetch = 4
    num_experts = g - num_prefetch
    ranks = torch.randperm(shape.epn, generator=torch.Generator().manual_seed(seed)).double() + 1
    probs = (ranks ** -skew).float().to(device).expand(shape.tokens, -1)
    local = torch.multinomial(probs, shape.topk, replacement=False, generator=gen)
    topk_ids = local + (num_experts - shape.epn) // 2  # the rank's experts: a block of E
    topk_weights = torch.rand(shape.tokens, shape.topk, device=device, generator=gen)
    topk_weights /= topk_weights.sum(-1, keepdim=True)
    x = torch.randn(shape.tokens, h, device=device, dtype=dtype, generator=gen)
    d = layout.dispatch(x, topk_ids, topk_weights, num_experts, num_rows=shape.nvs(token_padding),
                        token_padding=token_padding, num_prefetch=num_prefetch, fill_tail=float("nan"),
                        weights_on_input=shape.weights_on_input)
    # Scaled in place: no second copy of a weight tensor (the sweep's largest reach tens of GB).
    w_gate = torch.randn(g, i, h, device=device, dtype=dtype, generator=gen).mul_(h ** -0.5)
    w_up = torch.randn(g, i, h, device=device, dtype=dtype, generator=gen).mul_(h ** -0.5)
    w_down = torch.randn(g, h, i, device=device, dtype=dtype, generator=gen).mul_(i ** -0.5)
    cu = d.cu_seqlens.tolist()
    sizes = [b - a for a, b in zip([0] + cu[:-1], cu)]
    rw = None if shape.weights_on_input else d.route_weights
    return d.x_nvs, w_gate, w_up, w_down, d.cu_seqlens, rw, sizes
