"""The ops inside ``torch.autocast`` (moonep_ops/autocast.py): each GEMM op casts its operands to the
region's dtype and gives what it gives on those cast operands outside the region; route weights,
float64 and FP8 weights stay; training with fp32 master weights gets fp32 gradients equal to those
of an explicit cast; torch.compile traces the same. CPU, and CUDA when present."""

import pytest
import torch

import moonep_ops
from moonep_ops import fp8

from .conftest import DEVICES
from .reference import experts_ref, rel_err

H, I, G, NVS = 64, 48, 4, 40
ENDS = (7, 7, 20, 33)  # an empty segment; rows past 33 are the tail
AUTOCAST = torch.bfloat16
ops = torch.ops.moonep


def _inputs(device, dtype=torch.float32):
    x = torch.randn(NVS, H, device=device).to(dtype)
    w_gate, w_up = (torch.randn(G, I, H, device=device).div(H ** 0.5).to(dtype) for _ in range(2))
    w_down = torch.randn(G, H, I, device=device).div(I ** 0.5).to(dtype)
    return x, w_gate, w_up, w_down, torch.tensor(ENDS, dtype=torch.int32, device=device), torch.rand(NVS, device=device)


def _in_autocast(device, fn, *args):
    with torch.autocast(device, dtype=AUTOCAST):
        return fn(*args)


def _cast(*tensors):
    return tuple(t.to(AUTOCAST) for t in tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_ops_run_in_the_autocast_dtype(device):
    x, wg, wu, wd, cu, rw = _inputs(device)
    cases = [
        (ops.grouped_gemm, (x, wg, cu), (0, 1)),
        (ops.grouped_gemm_silu_mul, (x, wg, wu, rw, cu), (0, 1, 2)),
        (ops.grouped_gemm_silu_mul_with_gate_up, (x, wg, wu, rw, cu), (0, 1, 2)),
        (ops.experts, (x, wg, wu, wd, rw, cu), (0, 1, 2, 3)),
    ]
    for op, args, cast in cases:
        got = _in_autocast(device, op, *args)
        want = op(*[a.to(AUTOCAST) if i in cast else a for i, a in enumerate(args)])
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.dtype == AUTOCAST, op
            assert torch.equal(g, w), op


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_operands_take_the_autocast_dtype(device):
    """bf16 activations (from an autocast matmul) with fp32 master weights: one dtype inside."""
    x, wg, wu, wd, cu, rw = _inputs(device)
    got = _in_autocast(device, moonep_ops.moonep_experts, x.to(AUTOCAST), wg, wu, wd, cu, rw)
    assert torch.equal(got, moonep_ops.moonep_experts(*_cast(x, wg, wu, wd), cu, rw))
    live = ENDS[-1]
    assert rel_err(got[:live], experts_ref(x, wg, wu, wd, cu, rw)[:live]) <= 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_weight_promotes_and_float64_stays(device):
    x, wg, wu, wd, cu, rw = _inputs(device)
    gate, up = torch.randn(NVS, I, device=device).to(AUTOCAST), torch.randn(NVS, I, device=device)
    got = _in_autocast(device, moonep_ops.silu_mul_weight, gate, up, rw, cu)
    assert got.dtype == torch.float32 and torch.equal(got, moonep_ops.silu_mul_weight(gate.float(), up, rw, cu))
    if device == "cpu":  # (the CUDA ops take no float64)
        args64 = [t.double() for t in (x, wg, wu, wd)]
        got = _in_autocast(device, moonep_ops.moonep_experts, *args64, cu, rw)
        assert got.dtype == torch.float64 and torch.equal(got, moonep_ops.moonep_experts(*args64, cu, rw))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_ops_cast_the_activations_alone(device):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 ops need sm89 or newer")
    x, wg, wu, wd, cu, rw = _inputs(device)
    (qg, sg), (qu, su), (qd, sd) = (fp8.quantize_weight(w) for w in (wg, wu, wd))

    def experts(x):
        return moonep_ops.moonep_experts(x, qg, qu, qd, cu, rw, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd)

    got = _in_autocast(device, experts, x)
    assert got.dtype == AUTOCAST and torch.equal(got, experts(x.to(AUTOCAST)))
    got = _in_autocast(device, lambda: moonep_ops.grouped_gemm(x, qg, cu, w_scale=sg))
    assert torch.equal(got, moonep_ops.grouped_gemm(x.to(AUTOCAST), qg, cu, w_scale=sg))


@pytest.mark.parametrize("device", DEVICES)
def test_out_ops_run_as_called(device):
    x, wg, wu, wd, cu, rw = _inputs(device)
    out = torch.full((NVS, H), float("nan"), device=device)
    _in_autocast(device, lambda: moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out))
    assert torch.equal(out, moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
def test_fp32_master_weights_get_the_gradients_of_an_explicit_cast(device, recompute):
    x, wg, wu, wd, cu, rw = _inputs(device)
    grad = torch.randn(NVS, H, device=device)

    def grads(fn):
        leaves = [t.detach().requires_grad_() for t in (x, wg, wu, wd)]
        fn(*leaves).float().backward(grad)
        return [t.grad for t in leaves]

    in_region = grads(lambda *t: _in_autocast(
        device, lambda: moonep_ops.moonep_experts(*t, cu, rw, recompute=recompute)))
    explicit = grads(lambda *t: moonep_ops.moonep_experts(*_cast(*t), cu, rw, recompute=recompute))
    for got, want in zip(in_region, explicit):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_in_the_region_equals_eager(device):
    """Inference and a training step (fp32 master weights), one graph each."""
    x, wg, wu, wd, cu, rw = _inputs(device)
    torch._dynamo.reset()

    def step(x, wg, wu, wd):
        with torch.autocast(device, dtype=AUTOCAST):
            return moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x, wg, wu, wd), step(x, wg, wu, wd))
    grads = []
    for fn in (step, compiled):
        leaves = [t.detach().requires_grad_() for t in (wg, wu, wd)]
        fn(x, *leaves).float().sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
