"""The ``moonep`` op namespace: every schema, defined once.

We register with ``torch.library.Library`` define/impl (as vLLM does) rather than
``torch.library.custom_op``: an eager call then goes straight from the dispatcher to
the kernel function, without custom_op's Python wrapper layers (see README, "Why
torch.library.Library"). Kernels attach per device in ``moonep_ops/kernels``; fake
impls live in the top-level ``fake_impls`` package.
"""

import types

import torch

NAMESPACE = "moonep"

# One schema per op. Changing one of these changes the op ABI: tests/test_schemas.py pins them.
SCHEMAS: dict[str, str] = {
    "grouped_gemm": "grouped_gemm(Tensor a, Tensor w, Tensor cu_seqlens) -> Tensor",
    "grouped_gemm_out": "grouped_gemm_out(Tensor a, Tensor w, Tensor cu_seqlens, Tensor(a!) out) -> ()",
    "silu_mul_weight": (
        "silu_mul_weight(Tensor gate, Tensor up, Tensor? route_weights, Tensor cu_seqlens) -> Tensor"
    ),
    "grouped_gemm_silu_mul": (
        "grouped_gemm_silu_mul(Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, "
        "Tensor cu_seqlens) -> Tensor"
    ),
    # The fused GEMM for training: also returns gate and up, which the backward needs.
    "grouped_gemm_silu_mul_with_gate_up": (
        "grouped_gemm_silu_mul_with_gate_up(Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, "
        "Tensor cu_seqlens) -> (Tensor act, Tensor gate, Tensor up)"
    ),
    # The whole expert path (inference): the fused gate/up GEMM, then the down GEMM, in one op.
    "experts": (
        "experts(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? route_weights, "
        "Tensor cu_seqlens) -> Tensor"
    ),
    "experts_out": (
        "experts_out(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? route_weights, "
        "Tensor cu_seqlens, Tensor(a!) out) -> ()"
    ),
    # FP8 block-scaled weights (inference only; semantics in moonep_ops/fp8.py): e4m3fn weights,
    # fp32 scales per 128 x 128 block, activations quantized inside per row and 128 columns.
    "grouped_gemm_fp8": "grouped_gemm_fp8(Tensor a, Tensor w, Tensor w_scale, Tensor cu_seqlens) -> Tensor",
    "grouped_gemm_fp8_out": (
        "grouped_gemm_fp8_out(Tensor a, Tensor w, Tensor w_scale, Tensor cu_seqlens, Tensor(a!) out) -> ()"
    ),
    "experts_fp8": (
        "experts_fp8(Tensor x, Tensor w_gate, Tensor w_gate_scale, Tensor w_up, Tensor w_up_scale, "
        "Tensor w_down, Tensor w_down_scale, Tensor? route_weights, Tensor cu_seqlens) -> Tensor"
    ),
    "experts_fp8_out": (
        "experts_fp8_out(Tensor x, Tensor w_gate, Tensor w_gate_scale, Tensor w_up, Tensor w_up_scale, "
        "Tensor w_down, Tensor w_down_scale, Tensor? route_weights, Tensor cu_seqlens, Tensor(a!) out) -> ()"
    ),
    # Backward ops; the autograd formulas that call them live in moonep_ops/autograd.py.
    "grouped_gemm_dgrad": "grouped_gemm_dgrad(Tensor grad_out, Tensor w, Tensor cu_seqlens) -> Tensor",
    "grouped_gemm_dual_dgrad": (
        "grouped_gemm_dual_dgrad(Tensor grad_gate, Tensor grad_up, Tensor w_gate, Tensor w_up, "
        "Tensor cu_seqlens) -> Tensor"
    ),
    "grouped_gemm_wgrad": "grouped_gemm_wgrad(Tensor grad_out, Tensor a, Tensor cu_seqlens) -> Tensor",
    "silu_mul_weight_backward": (
        "silu_mul_weight_backward(Tensor grad, Tensor gate, Tensor up, Tensor? route_weights, "
        "Tensor cu_seqlens) -> (Tensor, Tensor, Tensor)"
    ),
    "grouped_gemm_silu_mul_backward": (
        "grouped_gemm_silu_mul_backward(Tensor grad, Tensor x, Tensor w_gate, Tensor w_up, "
        "Tensor? route_weights, Tensor cu_seqlens) -> (Tensor, Tensor, Tensor)"
    ),
}

lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    # PT2-compliant: every op passes torch.library.opcheck (tests/test_opcheck.py,
    # tests/test_autograd.py), so torch.compile may take it where only such ops are allowed.
    lib.define(_schema, tags=(torch.Tag.pt2_compliant_tag,))


def op(name: str) -> torch._ops.OpOverload:
    """The default overload of ``moonep::<name>``."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


# Every op's default overload, resolved once: attribute lookups on torch.ops cost host time per call.
overloads = types.SimpleNamespace(**{name: op(name) for name in SCHEMAS})
