"""Autograd for the ``moonep`` ops: backward formulas built from the backward ops.

- ``grouped_gemm(a, w, cu)``: ``da[seg] = grad[seg] @ w[g]`` (``grouped_gemm_dgrad``),
  ``dw[g] = grad[seg]^T @ a[seg]`` (``grouped_gemm_wgrad``: fp32 accumulation, exact zeros for
  empty groups). Tail rows of ``grad`` are never read; ``da`` is zero there.
- ``silu_mul_weight(gate, up, rw, cu)``: ``silu_mul_weight_backward`` (fp32; ``d rw`` fp32).
- ``grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)``: gate and up are *recomputed* in the
  backward (``grouped_gemm_silu_mul_backward``: one fused GEMM pass with the activation's
  backward in its epilogue), never saved: the forward keeps only its inputs, so activation
  memory per layer is one ``[NvS, I]`` tensor (the down projection's input) instead of three.
  Then ``dx = d_gate @ w_gate[g] + d_up @ w_up[g]`` (``grouped_gemm_dual_dgrad``, one pass)
  and two ``grouped_gemm_wgrad``.
- ``grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu) -> (act, gate, up)``: the
  fused forward that keeps gate and up for the backward (no recompute): ``d act`` goes through
  ``silu_mul_weight_backward`` on the saved gate/up, plus any gradient that gate or up receive
  directly (usually none: then no add), then one dual dgrad and two wgrads, as above.
- ``experts(x, w_gate, w_up, w_down, rw, cu)`` (the whole inference path in one op): saves only
  its inputs; the backward recomputes ``act`` (one fused forward pass, for ``d w_down``), then
  ``d act = grad @ w_down[g]`` and the recompute backward of ``grouped_gemm_silu_mul`` above.
  ``moonep_experts`` trains through the separate ops instead (saved gate/up by default).
- ``cu_seqlens`` gets no gradient.
- ``grouped_gemm_out`` and ``experts_out`` are not differentiable: they raise if asked to record
  gradients.
- The FP8 ops (``grouped_gemm_fp8``, ``experts_fp8`` and their ``_out`` variants,
  ``INFERENCE_ONLY_OPS``) have no backward: they raise when an input requires grad in grad mode.
- The backward ops themselves are registered as non-differentiable; a double backward
  (``create_graph=True`` through any op of ``DIFFERENTIABLE_OPS``) raises instead of silently
  dropping terms (:func:`_first_order_only` wraps every registered backward).

The backward functions only call ops, so they trace under torch.compile and are CUDA-graph
capture safe (the ops never sync the host).
"""

import torch

from .schemas import NAMESPACE, lib, op
from .schemas import overloads as _ops


BACKWARD_OPS = ("grouped_gemm_dgrad", "grouped_gemm_dual_dgrad", "grouped_gemm_wgrad",
                "silu_mul_weight_backward", "grouped_gemm_silu_mul_backward")


def _requires_grad(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def _first_order_only(name: str, backward):
    """``backward``, refusing a double backward: with ``create_graph=True`` the backward runs in
    grad mode, and if a gradient or a saved tensor requires grad the result would need a graph that
    the backward ops (no derivative) cannot build. Outside create_graph grad mode is off: no cost."""
    def first_order_backward(ctx, *grads):
        if torch.is_grad_enabled() and _requires_grad(*grads, *ctx.saved_tensors):
            raise RuntimeError(f"{NAMESPACE}::{name}: double backward (create_graph=True through this op) "
                               "is not supported; differentiate a first-order gradient only")
        return backward(ctx, *grads)

    return first_order_backward


# grouped_gemm ---------------------------------------------------------------------------

def _grouped_gemm_setup(ctx, inputs, output):
    a, w, cu_seqlens = inputs
    need_a, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # Save only what the requested gradients read: da needs w, dw needs a.
    ctx.save_for_backward(a if need_w else None, w if need_a else None, cu_seqlens)


def _grouped_gemm_backward(ctx, grad):
    a, w, cu_seqlens = ctx.saved_tensors
    da = _ops.grouped_gemm_dgrad(grad, w, cu_seqlens) if ctx.needs_input_grad[0] else None
    dw = _ops.grouped_gemm_wgrad(grad, a, cu_seqlens) if ctx.needs_input_grad[1] else None
    return da, dw, None


# silu_mul_weight ------------------------------------------------------------------------

def _silu_mul_weight_setup(ctx, inputs, output):
    gate, up, route_weights, cu_seqlens = inputs
    ctx.save_for_backward(gate, up, route_weights, cu_seqlens)


def _silu_mul_weight_backward_fn(ctx, grad):
    gate, up, route_weights, cu_seqlens = ctx.saved_tensors
    d_gate, d_up, d_rw = _ops.silu_mul_weight_backward(grad, gate, up, route_weights, cu_seqlens)
    need = ctx.needs_input_grad
    return (d_gate if need[0] else None, d_up if need[1] else None,
            d_rw if route_weights is not None and need[2] else None, None)


# grouped_gemm_silu_mul ------------------------------------------------------------------

def _gate_up_input_grads(need, d_gate, d_up, x, w_gate, w_up, cu_seqlens):
    """``(dx, d w_gate, d w_up)`` of the gate/up projections from their output gradients, each
    only if ``need`` (the first three of ``ctx.needs_input_grad``) asks: one dual dgrad, two wgrads."""
    dx = _ops.grouped_gemm_dual_dgrad(d_gate, d_up, w_gate, w_up, cu_seqlens) if need[0] else None
    dw_gate = _ops.grouped_gemm_wgrad(d_gate, x, cu_seqlens) if need[1] else None
    dw_up = _ops.grouped_gemm_wgrad(d_up, x, cu_seqlens) if need[2] else None
    return dx, dw_gate, dw_up


def _fused_setup(ctx, inputs, output):
    x, w_gate, w_up, route_weights, cu_seqlens = inputs
    ctx.save_for_backward(x, w_gate, w_up, route_weights, cu_seqlens)


def _fused_backward(ctx, grad):
    x, w_gate, w_up, route_weights, cu_seqlens = ctx.saved_tensors
    d_gate, d_up, d_rw = _ops.grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, route_weights, cu_seqlens)
    need = ctx.needs_input_grad
    dx, dw_gate, dw_up = _gate_up_input_grads(need, d_gate, d_up, x, w_gate, w_up, cu_seqlens)
    drw = d_rw if route_weights is not None and need[3] else None
    return dx, dw_gate, dw_up, drw, None


def _fused_saved_setup(ctx, inputs, output):
    x, w_gate, w_up, route_weights, cu_seqlens = inputs
    _, gate, up = output
    need_x, need_wg, need_wu = ctx.needs_input_grad[:3]
    # gate and up are outputs mainly so that the backward can read them; a gradient of their
    # own is rare, so unused ones arrive as None instead of materialized zeros.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x if need_wg or need_wu else None, w_gate if need_x else None,
                          w_up if need_x else None, gate, up, route_weights, cu_seqlens)


def _fused_saved_backward(ctx, d_act, d_gate_direct, d_up_direct):
    x, w_gate, w_up, gate, up, route_weights, cu_seqlens = ctx.saved_tensors
    d_gate = d_up = d_rw = None
    if d_act is not None:
        d_gate, d_up, d_rw = _ops.silu_mul_weight_backward(d_act, gate, up, route_weights, cu_seqlens)
    d_gate = _add_grads(d_gate, d_gate_direct)
    d_up = _add_grads(d_up, d_up_direct)
    need = ctx.needs_input_grad
    drw = d_rw if route_weights is not None and need[3] else None
    if d_gate is None and d_up is None:
        return None, None, None, drw, None
    # The dual dgrad and the wgrads take both; one alone (a direct gradient of gate or up only)
    # pairs with zeros.
    d_gate = torch.zeros_like(gate) if d_gate is None else d_gate
    d_up = torch.zeros_like(up) if d_up is None else d_up
    dx, dw_gate, dw_up = _gate_up_input_grads(need, d_gate, d_up, x, w_gate, w_up, cu_seqlens)
    return dx, dw_gate, dw_up, drw, None


def _experts_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _experts_backward(ctx, grad):
    x, w_gate, w_up, w_down, route_weights, cu_seqlens = ctx.saved_tensors
    need = ctx.needs_input_grad
    dw_down = None
    if need[3]:
        with torch.no_grad():
            act = _ops.grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens)
        dw_down = _ops.grouped_gemm_wgrad(grad, act, cu_seqlens)
    if not any(need[:3]) and not (route_weights is not None and need[4]):
        return None, None, None, dw_down, None, None
    d_act = _ops.grouped_gemm_dgrad(grad, w_down, cu_seqlens)
    d_gate, d_up, d_rw = _ops.grouped_gemm_silu_mul_backward(d_act, x, w_gate, w_up, route_weights, cu_seqlens)
    dx, dw_gate, dw_up = _gate_up_input_grads(need, d_gate, d_up, x, w_gate, w_up, cu_seqlens)
    drw = d_rw if route_weights is not None and need[4] else None
    return dx, dw_gate, dw_up, dw_down, drw, None


def _add_grads(a, b):
    if a is None:
        return b
    return a if b is None else a + b


# op name -> (backward, setup_context); every one refuses a double backward.
DIFFERENTIABLE_OPS = {
    "grouped_gemm": (_grouped_gemm_backward, _grouped_gemm_setup),
    "silu_mul_weight": (_silu_mul_weight_backward_fn, _silu_mul_weight_setup),
    "grouped_gemm_silu_mul": (_fused_backward, _fused_setup),
    "grouped_gemm_silu_mul_with_gate_up": (_fused_saved_backward, _fused_saved_setup),
    "experts": (_experts_backward, _experts_setup),
}
for _name, (_backward, _setup) in DIFFERENTIABLE_OPS.items():
    torch.library.register_autograd(f"{NAMESPACE}::{_name}", _first_order_only(_name, _backward),
                                    setup_context=_setup, lib=lib)


# Non-differentiable ops: explicit Autograd kernels ---------------------------------------

def _redispatch_below_autograd(overload, keyset, args):
    with torch._C._AutoDispatchBelowAutograd():
        return overload.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def _out_variant_autograd(name: str, functional: str):  # functional: what to call instead
    """Autograd kernel of a ``*_out`` op: raise when a gradient is asked for, else run it and bump
    ``out``'s version (the kernel wrote it behind autograd's back, as any in-place op does)."""
    overload = op(name)

    def kernel(keyset, *args):
        out = args[-1]
        if torch.is_grad_enabled() and _requires_grad(*args):
            raise RuntimeError(
                f"{NAMESPACE}::{name} is not differentiable (it writes into `out`), but an input "
                f"requires grad. For training call {functional} without out=, "
                "or run under torch.no_grad().")
        _redispatch_below_autograd(overload, keyset, args)
        torch.autograd.graph.increment_version(out)

    return kernel


def _nondifferentiable(name: str):
    overload = op(name)

    def kernel(keyset, *args):
        # Outputs do not require grad: the caller (a backward formula) owns the derivative.
        return _redispatch_below_autograd(overload, keyset, args)

    return kernel


lib.impl("grouped_gemm_out", _out_variant_autograd("grouped_gemm_out", "moonep_ops.grouped_gemm / moonep_experts"),
         "Autograd", with_keyset=True)
lib.impl("experts_out", _out_variant_autograd("experts_out", "moonep_ops.moonep_experts"), "Autograd", with_keyset=True)
for _name in BACKWARD_OPS:
    lib.impl(_name, _nondifferentiable(_name), "Autograd", with_keyset=True)


# FP8 ops: inference only -------------------------------------------------------------------

INFERENCE_ONLY_OPS = ("grouped_gemm_fp8", "grouped_gemm_fp8_out", "experts_fp8", "experts_fp8_out")


def _inference_only(name: str):
    """Autograd kernel of an FP8 op: raise when a gradient is asked for (there is no backward
    through a quantized GEMM here), else run it with outputs that do not require grad; an ``_out``
    op also bumps ``out``'s version, as the other out ops do."""
    overload = op(name)
    writes_out = name.endswith("_out")

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and _requires_grad(*args):
            raise RuntimeError(
                f"{NAMESPACE}::{name}: FP8 weights are inference-only (no backward); call it under "
                "torch.no_grad() / inference_mode or with tensors that do not require grad")
        result = _redispatch_below_autograd(overload, keyset, args)
        if writes_out:
            torch.autograd.graph.increment_version(args[-1])
        return result

    return kernel


for _name in INFERENCE_ONLY_OPS:
    lib.impl(_name, _inference_only(_name), "Autograd", with_keyset=True)
