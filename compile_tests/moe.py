"""The MoE layer the compile tests run: router top-k -> emulated MoonEP dispatch -> experts -> combine.

One ``nn.Module`` holding the router and the ``[E, ...]`` expert weights. Every forward picks its
own prefetch slots (the hottest experts of the batch, on the device) and copies their weights into
the ``[E + B, ...]`` rows, so the whole step is device work with static shapes: it compiles as one
graph and captures as one CUDA graph, with new routing (new ``cu_seqlens``, same ``NvS``) each call.
"""

from dataclasses import dataclass

import torch

import moonep_ops
from moonep_ops import layout


@dataclass(frozen=True)
class MoEShape:
    tokens: int = 32
    hidden: int = 32  # multiples of 8 keep torch._grouped_mm's 16-byte stride rule happy
    inter: int = 24
    experts: int = 6
    topk: int = 2
    prefetch: int = 2
    token_padding: int = 8

    @property
    def nvs(self) -> int:
        groups = self.experts + self.prefetch
        return layout.nvs_bound(self.tokens, self.topk, max(self.experts, -(-groups // 2)),
                                self.token_padding)


class MoE(torch.nn.Module):
    """``forward(x [S, H]) -> (out [S, H], topk_ids [S, K], topk_weights [S, K])``.

    ``experts`` is ``moonep_ops.moonep_experts`` or anything with its signature (the vLLM 0.33
    composition). Top-1 with ``weights_on_input`` is the Llama-4 style: a sigmoid router weight
    scales the input before dispatch and the experts get ``route_weights=None``.
    """

    def __init__(self, shape: MoEShape, *, experts=moonep_ops.moonep_experts, weights_on_input=False,
                 dtype=torch.float32, device="cpu", fill_tail=float("nan")):
        super().__init__()
        if weights_on_input and shape.topk != 1:
            raise ValueError("weights on the input needs top-1 routing")
        self.shape, self.experts, self.weights_on_input = shape, experts, weights_on_input
        self.fill_tail = fill_tail  # NaN in the undefined tail proves nothing reads it
        e, h, i = shape.experts, shape.hidden, shape.inter

        def param(*size, fan_in):
            t = torch.randn(*size, device=device) / fan_in ** 0.5
            return torch.nn.Parameter(t.to(dtype), requires_grad=False)

        # fp32 router with O(1) logits, so the top-k choices are well separated.
        self.router = torch.nn.Parameter(torch.randn(e, h, device=device) / h ** 0.5 * 4,
                                         requires_grad=False)
        self.w_gate = param(e, i, h, fan_in=h)
        self.w_up = param(e, i, h, fan_in=h)
        self.w_down = param(e, h, i, fan_in=i)

    def route(self, x):
        logits = x.float() @ self.router.T
        if self.shape.topk == 1:
            top, ids = logits.topk(1, dim=-1)
            return ids, torch.sigmoid(top)
        probs, ids = logits.softmax(-1).topk(self.shape.topk, dim=-1)
        return ids, probs / probs.sum(-1, keepdim=True)

    def dispatch(self, x):
        """``(Dispatched, topk_ids, topk_weights)`` for tokens ``x``."""
        s = self.shape
        ids, weights = self.route(x)
        d = layout.dispatch(x, ids, weights, s.experts, token_padding=s.token_padding,
                            num_prefetch=s.prefetch, fill_tail=self.fill_tail,
                            weights_on_input=self.weights_on_input)
        return d, ids, weights

    def forward(self, x):
        d, ids, weights = self.dispatch(x)
        w_gate, w_up, w_down = (layout.expand_weights(w, d.prefetch_for)
                                for w in (self.w_gate, self.w_up, self.w_down))
        route_weights = None if self.weights_on_input else d.route_weights
        y = self.experts(d.x_nvs, w_gate, w_up, w_down, d.cu_seqlens, route_weights)
        return layout.combine(y, d), ids, weights


def tokens(shape: MoEShape, step: int, model: MoE, *, num_tokens=None):
    """Fresh tokens for one step, skewed towards expert ``step % E`` so the prefetch slots and the
    segment sizes change from step to step."""
    n = shape.tokens if num_tokens is None else num_tokens
    x = torch.randn(n, shape.hidden, device=model.w_gate.device)
    hot = model.router[step % shape.experts]
    x = x + 3 * (step % 3) * hot / hot.norm() * torch.rand(n, 1, device=x.device)
    return x.to(model.w_gate.dtype)
