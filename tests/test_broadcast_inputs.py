"""Broadcast inputs, with a stride of 0 (``row.expand(NvS, H)``, one weight matrix expanded over
the groups, one route weight for every row), against the float64 reference on CPU and CUDA. On
sm90 such a tensor is read through pointers, never through a TMA descriptor built over a zero
stride."""

import pytest
import torch

import moonep_ops
from moonep_ops import fp8
from .conftest import DEVICES
from .layouts import Layout
from .reference import TOLERANCE, experts_ref, grouped_gemm_ref, rel_err, silu_mul_weight_ref
from .test_autograd import ref_experts
from .test_fp8 import CUDA_EXPERTS_TOLERANCE, ref_experts_fp8

# H and I multiples of 128 (TMA-sized rows, whole FP8 scale blocks); two empty groups; a tail.
LAYOUT = Layout("broadcast", (128, 0, 256, 64, 0), 512, k=256, n=128)
DTYPES = [torch.float32, torch.bfloat16]

# How a [G, N, K] weight is broadcast: over the groups (stride 0 first), over its rows (stride 0
# second), or one row for everything (both 0: groups still "back to back" for a [G*N, K] view).
WEIGHT_BROADCASTS = {"groups": (0,), "rows": (1,), "everything": (0, 1)}


def _broadcast(t: torch.Tensor, dims) -> torch.Tensor:
    """``t`` with its first slice along each of ``dims`` expanded over that dim (stride 0 where
    the dim has more than one element)."""
    for dim in dims:
        t = t.narrow(dim, 0, 1).expand(t.shape)
    assert all(t.stride(dim) == 0 or t.shape[dim] == 1 for dim in dims)
    return t


def _randn(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _rows(dtype, device, cols):
    """A single random row as ``[NvS, cols]`` (the tail holds it too: only NaN-free data can be
    broadcast)."""
    return _broadcast(_randn(LAYOUT.nvs, cols, dtype=dtype, device=device), (0,))


def _route_weights(device):
    return _broadcast(torch.rand(LAYOUT.nvs, device=device) + 0.1, (0,))


def _check(out, ref, dtype, tolerance=None):
    assert not torch.isnan(out).any(), "NaN reached the output"
    assert rel_err(out, ref) <= (tolerance or TOLERANCE[dtype]), f"rel err {rel_err(out, ref):.3g}"
    tail = out[LAYOUT.total:]
    assert torch.equal(tail, torch.zeros_like(tail)), "tail rows are not exactly zero"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight", [None, *WEIGHT_BROADCASTS])
def test_grouped_gemm(weight, dtype, device):
    g, n, k = LAYOUT.num_groups, LAYOUT.n, LAYOUT.k
    a = _rows(dtype, device, k)
    w = _randn(g, n, k, dtype=dtype, device=device, scale=k ** -0.5)
    if weight is not None:
        w = _broadcast(w, WEIGHT_BROADCASTS[weight])
    cu = LAYOUT.cu_seqlens(device)
    _check(moonep_ops.grouped_gemm(a, w, cu), grouped_gemm_ref(a, w, cu), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_weight(dtype, device):
    gate, up = _rows(dtype, device, LAYOUT.n), _randn(LAYOUT.nvs, LAYOUT.n, dtype=dtype, device=device)
    rw, cu = _route_weights(device), LAYOUT.cu_seqlens(device)
    _check(moonep_ops.silu_mul_weight(gate, up, rw, cu), silu_mul_weight_ref(gate, up, rw, cu), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight", list(WEIGHT_BROADCASTS))
def test_experts(weight, dtype, device):
    """Every input broadcast at once: the fused gate/up GEMM and the down GEMM both see them."""
    g, h, i = LAYOUT.num_groups, LAYOUT.k, LAYOUT.n
    dims = WEIGHT_BROADCASTS[weight]
    x = _rows(dtype, device, h)
    w_gate = _broadcast(_randn(g, i, h, dtype=dtype, device=device, scale=h ** -0.5), dims)
    w_up = _randn(g, i, h, dtype=dtype, device=device, scale=h ** -0.5)
    w_down = _broadcast(_randn(g, h, i, dtype=dtype, device=device, scale=i ** -0.5), dims)
    rw, cu = _route_weights(device), LAYOUT.cu_seqlens(device)
    ref = experts_ref(x, w_gate, w_up, w_down, cu, rw)
    _check(moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw), ref, dtype)
    out = torch.full((LAYOUT.nvs, h), float("nan"), dtype=dtype, device=device)  # poison
    moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out)
    _check(out, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight", list(WEIGHT_BROADCASTS))
def test_experts_fp8(weight, device):
    """FP8 weights broadcast with their scales, a broadcast row and route weight."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    g, h, i = LAYOUT.num_groups, LAYOUT.k, LAYOUT.n
    dims = WEIGHT_BROADCASTS[weight]
    x = _rows(torch.bfloat16, device, h)
    w_gate, gate_scale = (_broadcast(t, dims) for t in fp8.quantize_weight(
        _randn(g, i, h, dtype=torch.float32, device=device, scale=h ** -0.5)))
    w_up, up_scale = fp8.quantize_weight(_randn(g, i, h, dtype=torch.float32, device=device, scale=h ** -0.5))
    w_down, down_scale = (_broadcast(t, dims) for t in fp8.quantize_weight(
        _randn(g, h, i, dtype=torch.float32, device=device, scale=i ** -0.5)))
    rw, cu = _route_weights(device), LAYOUT.cu_seqlens(device)
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, w_gate_scale=gate_scale,
                                    w_up_scale=up_scale, w_down_scale=down_scale)
    ref = ref_experts_fp8(x, w_gate, gate_scale, w_up, up_scale, w_down, down_scale, rw, cu)
    _check(out, ref, torch.bfloat16, CUDA_EXPERTS_TOLERANCE if device == "cuda" else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_backward(dtype, device):
    """Gradients reach the broadcast leaves (one row, one gate and one down matrix for all groups;
    the weight gradient kernels read the broadcast rows) as float64 autograd computes them."""
    g, h, i = LAYOUT.num_groups, LAYOUT.k, LAYOUT.n
    leaves = [_randn(1, h, dtype=dtype, device=device), _randn(1, i, h, dtype=dtype, device=device, scale=h ** -0.5),
              _randn(g, i, h, dtype=dtype, device=device, scale=h ** -0.5),
              _randn(1, h, i, dtype=dtype, device=device, scale=i ** -0.5), torch.rand(1, device=device) + 0.1]
    grad_out = _randn(LAYOUT.nvs, h, dtype=dtype, device=device)
    cu = LAYOUT.cu_seqlens(device)

    def grads(fn, tensors):
        tensors = [t.detach().requires_grad_() for t in tensors]
        x, w_gate, w_up, w_down, rw = tensors
        out = fn(x.expand(LAYOUT.nvs, h), w_gate.expand(g, i, h), w_up, w_down.expand(g, h, i), cu,
                 rw.expand(LAYOUT.nvs))
        return torch.autograd.grad(out, tensors, grad_out.to(out.device, out.dtype))

    leaves64 = [t.detach().cpu().double() for t in leaves]
    refs = grads(ref_experts, leaves64)
    got = grads(moonep_ops.moonep_experts, leaves)
    for name, got_grad, ref in zip(("x", "w_gate", "w_up", "w_down"), got, refs):
        assert not torch.isnan(got_grad).any(), f"NaN in the gradient of {name}"
        assert rel_err(got_grad, ref) <= TOLERANCE[dtype], f"{name}: rel err {rel_err(got_grad, ref):.3g}"
    # The route weight's gradient is one sum over every live row of terms of either sign, which can
    # nearly cancel. Each row's term carries its own rounding, so the sum's error is bounded by the
    # terms' norm (float64 autograd with one route weight per row), not by the sum.
    rw_terms = grads(ref_experts, [*leaves64[:4], leaves64[4].expand(LAYOUT.nvs).clone()])[4]
    rw_err = abs(float(got[4]) - float(refs[4])) / float(rw_terms.norm())
    assert rw_err <= TOLERANCE[dtype], f"route weight: error {rw_err:.3g} of its per-row terms' norm"
