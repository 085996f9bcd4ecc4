"""torch.compile(fullgraph=True) of the FP8 block-scaled experts: no graph breaks on any backend, the
``out=`` form through functionalization, and one graph for every NvS (dynamic), each compiled result
equal to eager (the graph holds the opaque FP8 ops) and close to the float64 semantics."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import moonep_ops
from moonep_ops import fp8
from tests.conftest import DEVICES
from tests.reference import TOLERANCE, rel_err
from tests.test_fp8 import CUDA_EXPERTS_TOLERANCE, ref_experts_fp8

from .cases import experts_inputs
from .conftest import BACKENDS, assert_no_graph_breaks
from .moe import MoEShape

# H and I multiples of 16: on sm90 the operands are TMA-addressable (the Gluon FP8 kernel)
SHAPE = MoEShape(hidden=256, inter=144)
TOKEN_COUNTS = (32, 9, 57, 20)


def fp8_inputs(device, num_tokens=None):
    """``(x, w_gate, scale, w_up, scale, w_down, scale, route_weights, cu_seqlens)`` from an emulated
    dispatch (NaN tail rows), the weights quantized per 128 x 128 block."""
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(SHAPE, torch.bfloat16, num_tokens=num_tokens)
    (qg, sg), (qu, su), (qd, sd) = (fp8.quantize_weight(w) for w in (w_gate, w_up, w_down))
    return tuple(t.to(device) for t in (x, qg, sg, qu, su, qd, sd, rw, cu))


def experts(x, w_gate, sg, w_up, su, w_down, sd, rw, cu):
    return moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, w_gate_scale=sg, w_up_scale=su,
                                     w_down_scale=sd)


def _check_compiled(fn, backend, inputs, device):
    """``fn`` compiled with ``fullgraph=True``: one frame, no graph break, the checks of :func:`_check`."""
    counter = CompileCounterWithBackend(backend)
    out = torch.compile(fn, backend=counter, fullgraph=True)(*inputs)
    assert_no_graph_breaks()
    assert counter.frame_count == 1
    _check(out, experts(*inputs), inputs, device)


def _check(out, eager, inputs, device):
    live = int(inputs[-1][-1])
    assert out.shape == eager.shape and out.dtype == torch.bfloat16
    assert torch.equal(out, eager), "the compiled graph runs the same kernels as eager"
    assert torch.equal(out[live:], torch.zeros_like(out[live:])), "tail rows must be zero"
    tolerance = CUDA_EXPERTS_TOLERANCE if device == "cuda" else TOLERANCE[torch.bfloat16]
    assert rel_err(out[:live], ref_experts_fp8(*inputs)[:live]) <= tolerance


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_fp8_fullgraph(backend, device, fresh_dynamo):
    _check_compiled(experts, backend, fp8_inputs(device), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_experts_fp8_out_fullgraph(backend, device, fresh_dynamo):
    """``out=``: the mutating ``experts_fp8_out`` must survive functionalization."""
    inputs = fp8_inputs(device)

    def experts_into(*args):
        out = torch.full_like(args[0], float("nan"))
        x, w_gate, sg, w_up, su, w_down, sd, rw, cu = args
        moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out, w_gate_scale=sg, w_up_scale=su,
                                  w_down_scale=sd)
        return out

    _check_compiled(experts_into, backend, inputs, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_experts_fp8_dynamic_nvs(backend, device, fresh_dynamo):
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(experts, backend=counter, fullgraph=True)
    seen = set()
    for n in TOKEN_COUNTS:
        inputs = fp8_inputs(device, num_tokens=n)
        torch._dynamo.mark_dynamic(inputs[0], 0)  # x
        torch._dynamo.mark_dynamic(inputs[7], 0)  # route_weights
        seen.add(inputs[0].shape[0])
        _check(compiled(*inputs), experts(*inputs), inputs, device)
    assert len(seen) == len(TOKEN_COUNTS)
    assert_no_graph_breaks()
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for NvS {sorted(seen)}"
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_major_weights_fullgraph(backend, device, fresh_dynamo):
    """Block-major weights (H and I multiples of 128): one graph, no break, the fakes' output
    shapes from the weights' ``[G, N, K]``, the row-major call's result bit for bit."""
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(MoEShape(hidden=256, inter=384), torch.bfloat16)
    (qg, sg), (qu, su), (qd, sd) = (fp8.quantize_weight(w) for w in (w_gate, w_up, w_down))
    row_major = tuple(t.to(device) for t in (x, qg, sg, qu, su, qd, sd, rw, cu))
    blocked = list(row_major)
    for i in (1, 3, 5):
        blocked[i] = fp8.to_block_major(row_major[i])

    def layer(x, w_gate, sg, w_up, su, w_down, sd, rw, cu):
        y = experts(x, w_gate, sg, w_up, su, w_down, sd, rw, cu)
        return y, moonep_ops.grouped_gemm(y, w_gate, cu, w_scale=sg)

    counter = CompileCounterWithBackend(backend)
    y, gate = torch.compile(layer, backend=counter, fullgraph=True)(*blocked)
    assert_no_graph_breaks()
    assert counter.frame_count == 1
    assert gate.shape == (x.shape[0], 384)
    eager_y, eager_gate = layer(*row_major)
    assert torch.equal(y, eager_y) and torch.equal(gate, eager_gate)
