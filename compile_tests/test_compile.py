"""torch.compile(fullgraph=True) of the experts and of a whole MoE layer, on every backend.

Each test counts what Dynamo did (graph breaks, frames compiled) and checks the compiled result
against eager and against a float64 reference. ``grouped_mm`` is vLLM 0.33's composition, run
through the same tests for comparison.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import moonep_ops
from tests.reference import TOLERANCE, experts_ref, rel_err

from .cases import CASES, IMPLS, experts_inputs
from .conftest import BACKENDS, assert_no_graph_breaks
from .dense_moe import dense_moe_ref
from .moe import MoE, MoEShape, tokens

SHAPE = MoEShape()
TOP1 = MoEShape(topk=1, prefetch=1)  # Llama-4 style: router weight on the input


def _compile(fn, backend):
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True), counter


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl,dtype", CASES)
def test_experts_fullgraph(impl, dtype, backend, fresh_dynamo):
    fn = IMPLS[impl]
    inputs = experts_inputs(SHAPE, dtype)
    live = int(inputs[4][-1])  # cu_seqlens[-1]: rows past it are NaN on input, undefined on output
    eager = fn(*inputs)
    compiled, counter = _compile(fn, backend)
    out = compiled(*inputs)
    assert_no_graph_breaks()
    assert counter.frame_count == 1
    assert out.shape == eager.shape and out.dtype == dtype
    ref = experts_ref(*inputs)
    assert rel_err(out[:live], ref[:live]) <= TOLERANCE[dtype]
    if impl == "moonep":
        # The graph holds only opaque moonep ops: compiled runs the same kernels as eager.
        assert torch.equal(out, eager)
        assert torch.equal(out[live:], torch.zeros_like(out[live:])), "tail rows must be zero"
    else:
        # Inductor fuses the eager silu/mul: equal up to rounding on the rows that are defined.
        assert rel_err(out[:live], eager[:live].double()) <= TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl,dtype", CASES)
def test_experts_out_fullgraph(impl, dtype, backend, fresh_dynamo):
    """``out=``: a mutating op (``experts_out``) must survive functionalization."""
    fn = IMPLS[impl]
    inputs = experts_inputs(SHAPE, dtype)
    live = int(inputs[4][-1])

    def experts_into(x, w_gate, w_up, w_down, cu, rw, out):
        fn(x, w_gate, w_up, w_down, cu, rw, out=out)
        return out.sum()  # something downstream reads the buffer after the write

    compiled, counter = _compile(experts_into, backend)
    out = torch.full_like(inputs[0], float("nan"))  # poison
    total = compiled(*inputs, out)
    assert_no_graph_breaks()
    assert counter.frame_count == 1
    assert rel_err(out[:live], experts_ref(*inputs)[:live]) <= TOLERANCE[dtype]
    if impl == "moonep":
        assert torch.equal(out[live:], torch.zeros_like(out[live:]))
        assert torch.isfinite(total)


def _layer_case(impl, dtype, top1):
    shape = TOP1 if top1 else SHAPE
    return shape, MoE(shape, experts=IMPLS[impl], weights_on_input=top1, dtype=dtype)


def _check_layer(model, x, out, ids, weights, dtype):
    want_out, want_ids, want_weights = model(x)  # eager
    assert torch.equal(ids, want_ids), "compiled routing differs from eager"
    assert rel_err(weights, want_weights.double()) <= 1e-6
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, want_out.double()) <= TOLERANCE[dtype]
    ref = dense_moe_ref(x, model.w_gate, model.w_up, model.w_down, ids, weights,
                        weights_on_input=model.weights_on_input)
    assert rel_err(out, ref) <= TOLERANCE[dtype]


# Inductor compiles of the whole layer cost ~30 s of CPU each (C++ codegen for dispatch); these
# two cover the moonep path and the comparison, eager and aot_eager cover every case.
_INDUCTOR_LAYER_CASES = {
    ("moonep", torch.float32, False),
    ("grouped_mm", torch.bfloat16, False),
}


@pytest.mark.parametrize("top1", [False, True], ids=["topk", "top1_on_input"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl,dtype", CASES)
def test_moe_layer_fullgraph(impl, dtype, backend, top1, fresh_dynamo):
    """router top-k -> dispatch -> experts -> combine as one graph; new routing, no recompile."""
    if backend == "inductor" and (impl, dtype, top1) not in _INDUCTOR_LAYER_CASES:
        pytest.skip("Inductor layer compiles are slow on CPU; _INDUCTOR_LAYER_CASES cover it")
    shape, model = _layer_case(impl, dtype, top1)
    compiled, counter = _compile(model, backend)
    cus = set()
    for step in (1, 2):  # two routings with different cu_seqlens, same NvS
        x = tokens(shape, step, model)
        out, ids, weights = compiled(x)
        _check_layer(model, x, out, ids, weights, dtype)
        cus.add(tuple(model.dispatch(x)[0].cu_seqlens.tolist()))
    assert len(cus) > 1, "the steps should route differently"
    assert_no_graph_breaks()
    assert counter.frame_count == 1, "new routing must not recompile"



def test_compiles_where_only_pt2_compliant_ops_are_allowed(fresh_dynamo):
    """The ops carry ``torch.Tag.pt2_compliant_tag``: Dynamo's ``only_allow_pt2_compliant_ops``
    takes them, forward and backward (and refuses an op without the tag: the control)."""
    inputs = experts_inputs(SHAPE, torch.float32)
    x, w_gate, w_up, w_down, cu, rw = inputs
    leaves = [t.detach().requires_grad_() for t in (w_gate, w_up, w_down)]

    def step(x, w_gate, w_up, w_down):
        return moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw)

    with torch._dynamo.config.patch(only_allow_pt2_compliant_ops=True):
        with torch.no_grad():
            out = torch.compile(step, backend="aot_eager", fullgraph=True)(*inputs[:4])
        assert torch.equal(out, moonep_ops.moonep_experts(*inputs))
        torch.compile(step, backend="aot_eager", fullgraph=True)(x, *leaves).sum().backward()
        assert all(t.grad is not None for t in leaves)

        lib = torch.library.Library("moonep_untagged_control", "FRAGMENT")
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda t: t * 2, "CompositeExplicitAutograd")
        lib.impl("twice", lambda t: torch.empty_like(t), "Meta")
        torch._dynamo.reset()
        with pytest.raises(Exception, match="pt2_compliant"):
            torch.compile(lambda t: torch.ops.moonep_untagged_control.twice(t), backend="eager",
                          fullgraph=True)(x)
