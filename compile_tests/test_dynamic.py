"""Dynamic NvS: one graph serves every buffer size, with zero recompiles after the first."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.reference import TOLERANCE, experts_ref, rel_err

from .cases import CASES, IMPLS, experts_inputs
from .conftest import assert_no_graph_breaks
from .dense_moe import dense_moe_ref
from .moe import MoE, MoEShape, tokens

SHAPE = MoEShape()
TOKEN_COUNTS = (32, 9, 57, 20)  # NvS = nvs_bound(S): 152, 104, 200, 128


def _mark_nvs_dynamic(inputs):
    x, _, _, _, _, route_weights = inputs
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(route_weights, 0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("impl,dtype", CASES)
def test_experts_dynamic_nvs(impl, dtype, backend, fresh_dynamo):
    fn = IMPLS[impl]
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    seen = set()
    for n in TOKEN_COUNTS:
        inputs = experts_inputs(SHAPE, dtype, num_tokens=n)
        _mark_nvs_dynamic(inputs)
        seen.add(inputs[0].shape[0])
        live = int(inputs[4][-1])
        out = compiled(*inputs)
        assert out.shape == inputs[0].shape
        assert rel_err(out[:live], experts_ref(*inputs)[:live]) <= TOLERANCE[dtype]
        if impl == "moonep":
            assert torch.equal(out, fn(*inputs))
            assert torch.equal(out[live:], torch.zeros_like(out[live:]))
    assert len(seen) == len(TOKEN_COUNTS)
    assert_no_graph_breaks()
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for NvS {sorted(seen)}"
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_size_dynamic(dtype, fresh_dynamo):
    """``torch.compile(dynamic=True)``: NvS, H, I and G all symbolic, one graph for three models."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(IMPLS["moonep"], backend=counter, fullgraph=True, dynamic=True)
    for shape in (SHAPE, MoEShape(hidden=48, inter=40, experts=5), MoEShape(hidden=24, inter=16, experts=7)):
        inputs = experts_inputs(shape, dtype)
        live = int(inputs[4][-1])
        out = compiled(*inputs)
        assert torch.equal(out, IMPLS["moonep"](*inputs))
        assert rel_err(out[:live], experts_ref(*inputs)[:live]) <= TOLERANCE[dtype]
    assert_no_graph_breaks()
    assert counter.frame_count == 1


def test_static_nvs_recompiles_per_size(fresh_dynamo):
    """The control: the counter does see a recompile when NvS is not marked dynamic."""
    fn = IMPLS["moonep"]
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=False)
    for n in TOKEN_COUNTS[:2]:
        compiled(*experts_inputs(SHAPE, torch.float32, num_tokens=n))
    assert counter.frame_count == 2


@pytest.mark.parametrize("backend", ["aot_eager"])
@pytest.mark.parametrize("impl,dtype", CASES[:1] + CASES[2:])
def test_moe_layer_dynamic_tokens(impl, dtype, backend, fresh_dynamo):
    """Dynamic S through the whole layer: NvS = nvs_bound(S) stays symbolic, one graph."""
    model = MoE(SHAPE, experts=IMPLS[impl], dtype=dtype)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for step, n in enumerate(TOKEN_COUNTS):
        x = tokens(SHAPE, step, model, num_tokens=n)
        torch._dynamo.mark_dynamic(x, 0)
        out, ids, weights = compiled(x)
        want, want_ids, _ = model(x)
        assert torch.equal(ids, want_ids)
        assert rel_err(out, want.double()) <= TOLERANCE[dtype]
        ref = dense_moe_ref(x, model.w_gate, model.w_up, model.w_down, ids, weights)
        assert rel_err(out, ref) <= TOLERANCE[dtype]
    assert_no_graph_breaks()
    assert counter.frame_count == 1
