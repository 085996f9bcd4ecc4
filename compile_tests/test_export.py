"""torch.export and AOTInductor: the experts export as one opaque op whose NvS may stay dynamic, a
whole MoE layer (router, dispatch, experts, combine) exports for a fixed token count, and the
exported programs give eager's results on new routing; on the CPU the layer also runs from an
AOTInductor package."""

import pytest
import torch

import moonep_ops
from tests.conftest import DEVICES
from tests.reference import TOLERANCE, experts_ref, rel_err

from . import test_fp8
from .cases import experts_inputs
from .moe import MoE, MoEShape, tokens
from .test_compile import _check_layer

SHAPE = MoEShape()
TOKEN_COUNTS = (32, 9, 57)  # NvS = nvs_bound(S): 152, 104, 200
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


class Experts(torch.nn.Module):
    def forward(self, x, w_gate, w_up, w_down, cu_seqlens, route_weights):
        return moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu_seqlens, route_weights)


class ExpertsFp8(torch.nn.Module):
    def forward(self, *inputs):
        return test_fp8.experts(*inputs)


def _called_ops(program) -> list:
    return [node.target for node in program.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_export_with_a_dynamic_nvs(device, dtype):
    first = experts_inputs(SHAPE, dtype, device)
    nvs = torch.export.Dim("nvs", min=2)
    with torch.no_grad():
        program = torch.export.export(Experts(), first, dynamic_shapes=({0: nvs}, None, None, None, None, {0: nvs}))
        assert _called_ops(program) == [torch.ops.moonep.experts.default]
        exported = program.module()
        for n in TOKEN_COUNTS:
            inputs = experts_inputs(SHAPE, dtype, device, num_tokens=n)
            live = int(inputs[4][-1])
            out = exported(*inputs)
            assert torch.equal(out, moonep_ops.moonep_experts(*inputs))
            assert rel_err(out[:live], experts_ref(*inputs)[:live]) <= TOLERANCE[dtype]
            assert torch.equal(out[live:], torch.zeros_like(out[live:])), "tail rows must be zero"


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_experts_export_with_a_dynamic_nvs(device):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 ops need sm89 or newer")
    nvs = torch.export.Dim("nvs", min=2)
    dynamic = ({0: nvs}, *[None] * 6, {0: nvs}, None)
    with torch.no_grad():
        program = torch.export.export(ExpertsFp8(), test_fp8.fp8_inputs(device), dynamic_shapes=(dynamic,))
        assert _called_ops(program) == [torch.ops.moonep.experts_fp8.default]
        exported = program.module()
        for n in test_fp8.TOKEN_COUNTS:
            inputs = test_fp8.fp8_inputs(device, num_tokens=n)
            assert torch.equal(exported(*inputs), test_fp8.experts(*inputs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_layer_export_takes_new_routing(dtype):
    """The layer exported for one token count: each step routes differently (other ``cu_seqlens``,
    other prefetch slots) through the one program."""
    model = MoE(SHAPE, dtype=dtype)
    with torch.no_grad():
        exported = torch.export.export(model, (tokens(SHAPE, 0, model),)).module()
        assert torch.ops.moonep.experts.default in [node.target for node in exported.graph.nodes]
        cus = set()
        for step in (1, 2, 3):
            x = tokens(SHAPE, step, model)
            _check_layer(model, x, *exported(x), dtype)
            cus.add(tuple(model.dispatch(x)[0].cu_seqlens.tolist()))
    assert len(cus) > 1, "the steps should route differently"


def test_moe_layer_runs_from_an_aot_inductor_package(tmp_path):
    """AOTInductor on the CPU (a C++ compile of the layer): the package, loaded, calls the moonep op
    through the dispatcher and gives eager's routing and output."""
    model = MoE(SHAPE, dtype=torch.float32)
    with torch.no_grad():
        program = torch.export.export(model, (tokens(SHAPE, 0, model),))
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "moe.pt2"))
        runner = torch._inductor.aoti_load_package(path)
        for step in (1, 2):
            x = tokens(SHAPE, step, model)
            _check_layer(model, x, *runner(x), torch.float32)
