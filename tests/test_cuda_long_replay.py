"""A long CUDA-graph replay of the expert path, as a serving engine drives it.

One graph of ``moonep_ops.moonep_experts(..., out=)`` is captured on static buffers, then
replayed for ``MOONEP_OPS_REPLAY_STEPS`` (default 1000) steps. Every step brings new routing
(new ``cu_seqlens``, same ``NvS``), new route weights, new activations and new prefetch
slots, from the one-device MoonEP dispatch (moonep_ops.layout), copied into the buffers the
graph reads. Each step's replayed output must be bitwise equal to an eager call on the same
buffers, with exactly-zero tail rows; every 100 steps it is also checked against the float64
references (per row and per token, after combine).

The rig itself (routing, dispatch, references) also runs eagerly on CPU in CI, so a mistake in
the rig shows up before the GPU run.
"""

import os
import random

import pytest
import torch

import moonep_ops
from moonep_ops import layout
from .reference import TOLERANCE, experts_ref, rel_err

HAS_CUDA = torch.cuda.is_available()
STEPS = int(os.environ.get("MOONEP_OPS_REPLAY_STEPS", "1000"))
SPOT_EVERY = 100

E, B = 16, 4  # experts, prefetch slots: G = E + B weight rows
H, I = 256, 192
S_MAX = 96  # tokens per step at most (the capacity the graph was captured for)


def token_ref(x, topk_ids, topk_w, w_gate, w_up, w_down, weights_on_input):
    """Float64 MoE on tokens: ``out[s] = sum_k w_k * f_e(x_s)`` (or ``f_e(w_k * x_s)`` when the
    weight is applied on the input), ``f_e(x) = (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T``."""
    x64 = x.double().cpu()
    ids, tw = topk_ids.cpu(), topk_w.double().cpu()
    wg, wu, wd = (w.double().cpu() for w in (w_gate, w_up, w_down))
    out = torch.zeros_like(x64)
    for k in range(ids.shape[1]):
        for e in torch.unique(ids[:, k]).tolist():
            rows = ids[:, k] == e
            xs = x64[rows] * tw[rows, k, None] if weights_on_input else x64[rows]
            gate, up = xs @ wg[e].T, xs @ wu[e].T
            y = (gate * torch.sigmoid(gate) * up) @ wd[e].T
            out[rows] += y if weights_on_input else y * tw[rows, k, None]
    return out


class ReplayRig:
    """Static buffers of one captured graph, and the routing that refills them each step."""

    def __init__(self, device, dtype, topk, weights_on_input, seed=0):
        self.device, self.dtype, self.topk = device, dtype, topk
        self.weights_on_input = weights_on_input
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)

        def weights(n, k):
            return (torch.randn(E, n, k, generator=gen) / k ** 0.5).to(dtype).to(device)

        # Expert weights [E, ...]; the buffers hold G = E + B rows, the last B refilled each step
        # with copies of that step's hot experts (what MoonEP's prefetch_weight does).
        self.experts = (weights(I, H), weights(I, H), weights(H, I))
        self.w_bufs = tuple(torch.cat([w, w[:B]]).contiguous() for w in self.experts)
        self.nvs = layout.nvs_bound(S_MAX, topk, max(E, -(-(E + B) // 2)))
        self.x = torch.zeros(self.nvs, H, dtype=dtype, device=device)
        self.rw = torch.zeros(self.nvs, dtype=torch.float32, device=device)
        self.cu = torch.zeros(E + B, dtype=torch.int32, device=device)
        self.out = torch.zeros(self.nvs, H, dtype=dtype, device=device)

    @property
    def route_weights(self):
        return None if self.weights_on_input else self.rw

    def experts_call(self, out=None):
        return moonep_ops.moonep_experts(self.x, *self.w_bufs, self.cu, self.route_weights, out=out)

    def new_step(self):
        """New tokens and routing: a random batch size and one of four skews (uniform, Zipf,
        everything on one expert, a few experts), dispatched into the static buffers."""
        s = self.rng.randint(1, S_MAX)
        gen = torch.Generator().manual_seed(self.rng.getrandbits(31))
        bias = torch.zeros(E)
        kind = self.rng.randrange(4)
        if kind == 1:
            bias = 3.0 * -torch.log(torch.arange(1, E + 1, dtype=torch.float32))[torch.randperm(E, generator=gen)]
        elif kind == 2:
            bias[self.rng.randrange(E)] = 50.0
        elif kind == 3:
            bias[torch.randperm(E, generator=gen)[:self.topk + 1]] = 8.0
        scores = torch.randn(s, E, generator=gen) + bias
        topk_w, topk_ids = scores.softmax(-1).topk(self.topk, dim=-1)
        x = torch.randn(s, H, generator=gen).to(self.dtype)
        x, topk_w, topk_ids = x.to(self.device), topk_w.to(self.device), topk_ids.to(self.device)
        d = layout.dispatch(x, topk_ids, topk_w, E, num_rows=self.nvs, num_prefetch=B,
                            fill_tail=float("nan"), weights_on_input=self.weights_on_input)
        self.x.copy_(d.x_nvs)
        self.rw.copy_(d.route_weights)
        self.cu.copy_(d.cu_seqlens)
        for buf, w in zip(self.w_bufs, self.experts):
            buf[E:].copy_(w.index_select(0, d.prefetch_for))
        return d, (x, topk_ids, topk_w)

    def tail_is_zero(self, out) -> bool:
        tail = torch.arange(self.nvs, device=self.device)[:, None] >= self.cu[-1]
        return bool((torch.where(tail, out, 0) == 0).all())  # NaN != 0, so NaN fails too

    def spot_check(self, out, d, tokens):
        """Rows against the float64 expert reference; tokens (after combine) against the float64
        MoE on the original experts, which also proves the prefetch slots mirror the right ones."""
        tol = TOLERANCE[self.dtype]
        err = rel_err(out, experts_ref(self.x, *self.w_bufs, self.cu, self.route_weights))
        assert err <= tol, f"rows vs float64 reference: rel err {err:.3g}"
        x, ids, tw = tokens
        combined = layout.combine(out, d)
        err = rel_err(combined, token_ref(x, ids, tw, *self.experts, self.weights_on_input))
        assert err <= tol, f"tokens vs float64 MoE: rel err {err:.3g}"


VARIANTS = {
    "route_weights_top4": dict(topk=4, weights_on_input=False),
    "weights_on_input_top1": dict(topk=1, weights_on_input=True),  # Llama-4 style
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rig_eager_on_cpu(variant):
    """The rig on CPU, eagerly: routing, dispatch into the buffers, references."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: OpenMP fork/join dominates on a busy 2-core machine
    try:
        rig = ReplayRig("cpu", torch.float32, **VARIANTS[variant])
        for _ in range(3):
            d, tokens = rig.new_step()
            rig.out.fill_(float("nan"))
            rig.experts_call(out=rig.out)
            assert rig.tail_is_zero(rig.out)
            rig.spot_check(rig.out, d, tokens)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_long_graph_replay(variant):
    rig = ReplayRig("cuda", torch.bfloat16, **VARIANTS[variant])
    rig.new_step()
    # Warm up on a side stream (Triton compiles here, outside capture), then capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rig.experts_call(out=rig.out)
        rig.experts_call(out=rig.out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rig.experts_call(out=rig.out)

    layouts = []
    for step in range(STEPS):
        d, tokens = rig.new_step()
        rig.out.fill_(float("nan"))  # poison: every row must be rewritten by the replay
        graph.replay()
        eager = rig.experts_call()
        assert torch.equal(rig.out, eager), f"step {step}: replay differs from eager on the same inputs"
        assert rig.tail_is_zero(rig.out), f"step {step}: tail rows not zero"
        if step % SPOT_EVERY == 0 or step == STEPS - 1:
            rig.spot_check(rig.out, d, tokens)
        layouts.append(tuple(rig.cu.tolist()))  # after the checks: test-side bookkeeping
    torch.cuda.synchronize()
    # The routing did vary: many distinct layouts. (Counted on the whole cu_seqlens: with
    # segments padded to 128, cu[-1] alone takes only a dozen values over 1000 steps.)
    assert len(set(layouts)) > min(STEPS, 50) // 2, "routing hardly changed between steps"
