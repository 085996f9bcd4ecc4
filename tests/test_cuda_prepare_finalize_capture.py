"""The device side of MoonEPOpsPrepareAndFinalize (``moonep_ops.vllm.device``) in a CUDA graph.

One MoE layer step as the prepare/finalize and MoonEPOpsExperts run it: stage the tokens, count
them per expert, dispatch, prefetch, segment lengths, the experts op, combine into the output,
all into tensors made once. The MoonEP calls go to the one-device stub (tests/moonep_stub), so
this proves our part and the emulation, not MoonEP's multi-GPU kernels. On CUDA the step is
captured once and replayed with new tokens and routing every step under
``set_sync_debug_mode("error")``; on the CPU it runs eagerly. Each step is checked against a
float64 dense MoE. Needs torch and moonep_ops only (no vLLM).
"""

from dataclasses import dataclass

import pytest
import torch

import moonep_ops
from compile_tests.dense_moe import dense_moe_ref
from moonep_ops.vllm import device

from . import moonep_stub
from .conftest import DEVICES
from .reference import TOLERANCE, rel_err
from .sync import sync_errors

NAN = float("nan")


@dataclass(frozen=True)
class Shape:
    name: str
    topk: int
    weights_on_input: bool
    invalid: int  # routes set to -1 each step
    capacity: int = 256  # S of the Buffer
    tokens: int = 200  # s: rows [s, S) are padding
    hidden: int = 256
    inter: int = 128
    experts: int = 16
    prefetch: int = 4

    def __str__(self):
        return self.name


SHAPES = [Shape("top4", 4, False, invalid=9), Shape("top1_on_input", 1, True, invalid=5)]


class Layer:
    """One MoE layer's persistent tensors and its step, as vLLM would run it on one rank."""

    def __init__(self, moonep, shape: Shape, dev):
        s, h, i, e, b = shape.tokens, shape.hidden, shape.inter, shape.experts, shape.prefetch
        self.shape = shape
        self.buffer = moonep.Buffer(S=shape.capacity, H=h, K=shape.topk, E=e, num_ep_ranks=1,
                                    token_padding=128, B=b)
        self.staging = device.Staging.allocate(shape.capacity, h, shape.topk, e, b,
                                               torch.bfloat16, dev)
        self.zero_copy = device.supports_zero_copy(self.buffer)

        def weights(*size, fan_in):  # [E + B, ...]; the prefetch rows start out NaN
            w = (torch.randn(e, *size) / fan_in ** 0.5).to(torch.bfloat16)
            return torch.cat([w, torch.full((b, *size), NAN, dtype=w.dtype)]).to(dev)

        self.full_weights = (weights(i, h, fan_in=h), weights(i, h, fan_in=h), weights(h, i, fan_in=i))
        self.x = torch.empty(s, h, dtype=torch.bfloat16, device=dev)
        self.topk_ids = torch.empty(s, shape.topk, dtype=torch.int32, device=dev)
        self.topk_weights = torch.empty(s, shape.topk, dtype=torch.float32, device=dev)
        self.expert_out = torch.empty(self.buffer._ctx["NvS"], h, dtype=torch.bfloat16, device=dev)
        self.output = torch.empty(s, h, dtype=torch.bfloat16, device=dev)

    def step(self) -> None:
        d = device.dispatch_step(self.buffer, self.staging, self.full_weights, self.x, self.topk_ids,
                                 self.topk_weights, self.shape.weights_on_input, self.zero_copy)
        cu_seqlens = torch.cumsum(d.segment_lengths, 0, dtype=torch.int32)  # MoonEPOpsExperts.apply
        gate, up, down = self.full_weights
        route = None if self.shape.weights_on_input else d.route_weights_nvs
        moonep_ops.moonep_experts(d.hidden_nvsh, gate, up, down, cu_seqlens, route, out=self.expert_out)
        device.combine_step(self.buffer, d.plan, self.expert_out, self.output)

    def new_batch(self):
        """Fresh tokens and skewed routing (some routes invalid) into the step's inputs."""
        sh = self.shape
        x = torch.randn(sh.tokens, sh.hidden).to(torch.bfloat16)
        logits = torch.randn(sh.tokens, sh.experts) + 3 * torch.rand(sh.experts)
        top, ids = logits.topk(sh.topk, dim=1)
        weights = torch.sigmoid(top) if sh.weights_on_input else top.softmax(dim=1)
        ids = ids.to(torch.int32)
        ids.view(-1)[torch.randperm(ids.numel())[:sh.invalid]] = -1
        for static, new in ((self.x, x), (self.topk_ids, ids), (self.topk_weights, weights)):
            static.copy_(new)
        return x, ids, weights

    def reference(self, x, ids, weights) -> torch.Tensor:
        e = self.shape.experts
        gate, up, down = (w[:e] for w in self.full_weights)
        return dense_moe_ref(x, gate, up, down, ids, weights,
                             weights_on_input=self.shape.weights_on_input)


def capture(layer: Layer) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (Triton JIT, allocator), then capture one step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_errors():  # the graph context synchronizes on entry
        layer.step()
    return graph


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dev", DEVICES)
def test_step_with_new_routing_each_time(monkeypatch, dev, shape):
    layer = Layer(moonep_stub.use(monkeypatch, dev), shape, dev)
    steps = 12 if dev == "cuda" else 3
    graph = None
    if dev == "cuda":
        layer.new_batch()
        graph = capture(layer)
    routing, prefetched = set(), 0
    for step in range(steps):
        batch = layer.new_batch()
        if graph is None:
            layer.step()
        else:
            with sync_errors():
                graph.replay()
            torch.cuda.synchronize()
        ref = layer.reference(*batch)
        assert rel_err(layer.output, ref) <= TOLERANCE[torch.bfloat16], f"step {step}"
        routing.add(tuple(layer.staging.tokens_per_expert.tolist()))
        prefetched += int((layer.staging.segment_lengths[shape.experts:] > 0).sum())
    assert len(routing) == steps, "each step should route differently"
    assert prefetched > 0, "no step used a prefetch slot"
