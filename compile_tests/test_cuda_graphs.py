"""CUDA graphs: the whole MoE step captured once and replayed with new routing every step.

Router -> dispatch -> experts -> combine is captured (eager, and compiled by Inductor) in one
``torch.cuda.CUDAGraph``, and compiled with ``mode="reduce-overhead"``. Each of 100 steps feeds new
tokens, so new ``topk_ids``, new ``cu_seqlens`` and new prefetch slots with the same ``NvS``; every
step must match the eager layer and the dense float64 reference.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

import moonep_ops
from tests.reference import TOLERANCE, experts_ref, rel_err

from .cases import IMPLS, experts_inputs
from .conftest import CUDA_MARKS, sync_errors
from .dense_moe import dense_moe_ref
from .moe import MoE, MoEShape, tokens

pytestmark = CUDA_MARKS

STEPS = 100
SHAPE = MoEShape(tokens=64, hidden=256, inter=128, experts=8, topk=2, prefetch=2, token_padding=16)
TOP1 = MoEShape(tokens=64, hidden=256, inter=128, experts=8, topk=1, prefetch=1, token_padding=16)


def _grouped_mm_capturable():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


CASES = [
    pytest.param("moonep", torch.bfloat16, SHAPE, id="moonep-bf16"),
    pytest.param("moonep", torch.float32, SHAPE, id="moonep-fp32"),
    pytest.param("moonep", torch.bfloat16, TOP1, id="moonep-bf16-top1_on_input"),
    # Only bf16 on sm90/sm100 keeps torch._grouped_mm off its host-syncing fallback.
    pytest.param("grouped_mm", torch.bfloat16, SHAPE, id="grouped_mm-bf16",
                 marks=pytest.mark.skipif(not _grouped_mm_capturable(),
                                          reason="torch._grouped_mm syncs below sm90 "
                                                 "(test_vllm_composition.py)")),
]

# Each compiled case is an Inductor compile of the whole layer (tens of seconds): fp32 is covered by
# the eager capture and by test_no_host_sync.
COMPILED_CASES = [c for c in CASES if c.id != "moonep-fp32"]


def _model(impl, dtype, shape):
    return MoE(shape, experts=IMPLS[impl], weights_on_input=shape.topk == 1, dtype=dtype,
               device="cuda")


def _capture(fn, *static_inputs):
    """Warm up on a side stream (Triton JIT, cuBLAS), then capture one call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(*static_inputs)
    return graph, static_out


def _check_step(model, x, out, ids, weights, dtype, step):
    want, want_ids, want_weights = model(x)  # eager, same inputs
    assert torch.equal(ids, want_ids), f"step {step}: routing differs from eager"
    assert rel_err(weights, want_weights.double()) <= 1e-6, f"step {step}"
    assert rel_err(out, want.double()) <= TOLERANCE[dtype], f"step {step}: differs from eager"
    ref = dense_moe_ref(x, model.w_gate, model.w_up, model.w_down, ids, weights,
                        weights_on_input=model.weights_on_input)
    assert rel_err(out, ref) <= TOLERANCE[dtype], f"step {step}: differs from the float64 MoE"


def _replay_steps(model, dtype, run_step):
    """``run_step(x) -> (out, ids, weights)`` for 100 steps of fresh tokens; check each."""
    layouts = set()
    for step in range(STEPS):
        x = tokens(model.shape, step, model)
        out, ids, weights = run_step(x)
        _check_step(model, x, out, ids, weights, dtype, step)
        layouts.add(tuple(model.dispatch(x)[0].cu_seqlens.tolist()))
    assert len(layouts) > STEPS // 4, "the routing should change from step to step"


@pytest.mark.parametrize("impl,dtype,shape", CASES)
def test_cuda_graph_of_eager_layer(impl, dtype, shape):
    model = _model(impl, dtype, shape)
    static_x = tokens(shape, 0, model)
    graph, (out, ids, weights) = _capture(model, static_x)

    def run_step(x):
        static_x.copy_(x)
        graph.replay()
        return out, ids, weights

    _replay_steps(model, dtype, run_step)


@pytest.mark.parametrize("impl,dtype,shape", COMPILED_CASES)
def test_cuda_graph_of_compiled_layer(impl, dtype, shape):
    torch._dynamo.reset()
    counters.clear()
    model = _model(impl, dtype, shape)
    compiled = torch.compile(model, fullgraph=True)
    static_x = tokens(shape, 0, model)
    graph, (out, ids, weights) = _capture(compiled, static_x)
    assert not counters["graph_break"]

    def run_step(x):
        static_x.copy_(x)
        graph.replay()
        return out, ids, weights

    _replay_steps(model, dtype, run_step)
    torch._dynamo.reset()


@pytest.mark.parametrize("impl,dtype,shape", COMPILED_CASES)
def test_reduce_overhead(impl, dtype, shape):
    torch._dynamo.reset()
    counters.clear()
    model = _model(impl, dtype, shape)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)

    def run_step(x):
        torch.compiler.cudagraph_mark_step_begin()
        out, ids, weights = compiled(x)
        return out.clone(), ids.clone(), weights.clone()  # the next replay overwrites them

    _replay_steps(model, dtype, run_step)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1, "new routing must not recompile"
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor did not use a CUDA graph"
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values()), "no CUDA graph was recorded"
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_no_host_sync(dtype):
    """moonep_experts, and the whole layer around it, under set_sync_debug_mode("error")."""
    inputs = experts_inputs(SHAPE, dtype, "cuda")
    model = _model("moonep", dtype, SHAPE)
    x = tokens(SHAPE, 1, model)
    moonep_ops.moonep_experts(*inputs)  # warm-up: Triton compiles outside the checked region
    model(x)
    torch.cuda.synchronize()
    with sync_errors():
        out = moonep_ops.moonep_experts(*inputs)
        layer_out, ids, weights = model(x)
    live = int(inputs[4][-1])
    assert rel_err(out[:live], experts_ref(*inputs)[:live]) <= TOLERANCE[dtype]
    assert torch.equal(out[live:], torch.zeros_like(out[live:]))
    ref = dense_moe_ref(x, model.w_gate, model.w_up, model.w_down, ids, weights)
    assert rel_err(layer_out, ref) <= TOLERANCE[dtype]
