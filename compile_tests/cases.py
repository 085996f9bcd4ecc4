"""What the compile tests run on: the expert implementations, dtypes and dispatched inputs."""

import pytest
import torch

import moonep_ops
from moonep_ops import layout

from . import vllm_composition
from .moe import MoEShape

GROUPED_MM_CPU = vllm_composition.supported(torch.bfloat16, "cpu")

IMPLS = {
    "moonep": moonep_ops.moonep_experts,
    "grouped_mm": vllm_composition.grouped_mm_experts,  # vLLM 0.33's composition
}

# (impl, dtype). torch._grouped_mm's meta only takes bf16 (see test_vllm_composition.py).
CASES = [
    pytest.param("moonep", torch.float32, id="moonep-fp32"),
    pytest.param("moonep", torch.bfloat16, id="moonep-bf16"),
    pytest.param("grouped_mm", torch.bfloat16, id="grouped_mm-bf16",
                 marks=pytest.mark.skipif(not GROUPED_MM_CPU, reason="no torch._grouped_mm on CPU")),
]


def routing(shape: MoEShape, num_tokens=None, device="cpu"):
    """Random top-k routing, skewed towards expert 0 so the prefetch slots get rows."""
    n = shape.tokens if num_tokens is None else num_tokens
    logits = torch.randn(n, shape.experts, device=device)
    logits[:, 0] += 1.0
    weights, ids = logits.softmax(-1).topk(shape.topk, dim=-1)
    return ids, weights


def experts_inputs(shape: MoEShape, dtype, device="cpu", num_tokens=None):
    """``(x_nvs, w_gate, w_up, w_down, cu_seqlens, route_weights)`` from an emulated dispatch,
    NaN in the undefined tail rows, weights already expanded to ``E + B`` rows."""
    n = shape.tokens if num_tokens is None else num_tokens
    ids, weights = routing(shape, n, device)
    x = torch.randn(n, shape.hidden, device=device).to(dtype)
    d = layout.dispatch(x, ids, weights, shape.experts, token_padding=shape.token_padding,
                        num_prefetch=shape.prefetch, fill_tail=float("nan"))
    e, h, i = shape.experts, shape.hidden, shape.inter
    w_gate, w_up = ((torch.randn(e, i, h, device=device) / h ** 0.5).to(dtype) for _ in range(2))
    w_down = (torch.randn(e, h, i, device=device) / i ** 0.5).to(dtype)
    big = [layout.expand_weights(w, d.prefetch_for) for w in (w_gate, w_up, w_down)]
    return (d.x_nvs, *big, d.cu_seqlens, d.route_weights)
