"""The expert-path implementations the benchmark compares, all with one signature:
``fn(x, w_gate, w_up, w_down, cu_seqlens, route_weights, out) -> None`` (writes ``out``)."""

import torch
import torch.nn.functional as F

import moonep_ops


def vllm_composition(x, w_gate, w_up, w_down, cu, rw, out):
    """vLLM 0.33's MoonEP expert compute (three torch._grouped_mm, eager activation)."""
    gate = torch._grouped_mm(x, w_gate.transpose(1, 2), offs=cu)
    up = torch._grouped_mm(x, w_up.transpose(1, 2), offs=cu)
    act = F.silu(gate)
    act.mul_(up)
    if rw is not None:
        act.mul_(rw.to(act.dtype).unsqueeze(-1))
    out.copy_(torch._grouped_mm(act, w_down.transpose(1, 2), offs=cu))


def moonep_unfused(x, w_gate, w_up, w_down, cu, rw, out):
    gate = moonep_ops.grouped_gemm(x, w_gate, cu)
    up = moonep_ops.grouped_gemm(x, w_up, cu)
    act = moonep_ops.silu_mul_weight(gate, up, rw, cu)
    moonep_ops.grouped_gemm(act, w_down, cu, out=out)


def moonep_experts(x, w_gate, w_up, w_down, cu, rw, out):
    moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out)


PATHS = {
    "vllm": vllm_composition,
    "moonep_unfused": moonep_unfused,
    "moonep": moonep_experts,
}
