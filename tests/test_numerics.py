"""Every op against the float64 reference over the layout matrix, on CPU and CUDA."""

import pytest
import torch

import moonep_ops
from .conftest import DEVICES
from .layouts import (LAYOUT_IDS, LAYOUTS, experts_inputs, grouped_gemm_inputs,
                      silu_mul_weight_inputs)
from .reference import (TOLERANCE, experts_ref, grouped_gemm_ref, grouped_gemm_silu_mul_ref,
                        rel_err, silu_mul_weight_ref)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_close_and_zero_tail(out, ref, layout, dtype):
    assert not torch.isnan(out).any(), "NaN reached the output"
    assert rel_err(out, ref) <= TOLERANCE[dtype], f"rel err {rel_err(out, ref):.3g}"
    tail = out[layout.total:]
    assert torch.equal(tail, torch.zeros_like(tail)), "tail rows are not exactly zero"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_grouped_gemm(layout, dtype, device):
    a, w, cu = grouped_gemm_inputs(layout, dtype, device)
    out = moonep_ops.grouped_gemm(a, w, cu)
    assert out.shape == (layout.nvs, layout.n) and out.dtype == dtype and out.is_contiguous()
    _assert_close_and_zero_tail(out, grouped_gemm_ref(a, w, cu), layout, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_grouped_gemm_out(layout, dtype, device):
    a, w, cu = grouped_gemm_inputs(layout, dtype, device)
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype, device=device)  # poison
    ret = moonep_ops.grouped_gemm(a, w, cu, out=out)
    assert ret is out
    _assert_close_and_zero_tail(out, grouped_gemm_ref(a, w, cu), layout, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_silu_mul_weight(layout, dtype, with_weights, device):
    gate, up, rw, cu = silu_mul_weight_inputs(layout, dtype, device, with_weights=with_weights)
    out = moonep_ops.silu_mul_weight(gate, up, rw, cu)
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    _assert_close_and_zero_tail(out, silu_mul_weight_ref(gate, up, rw, cu), layout, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_grouped_gemm_silu_mul(layout, dtype, with_weights, device):
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype, device, with_weights=with_weights)
    out = moonep_ops.grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)
    assert out.shape == (layout.nvs, layout.n) and out.dtype == dtype and out.is_contiguous()
    _assert_close_and_zero_tail(out, grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu), layout, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_grouped_gemm_silu_mul_with_gate_up(layout, dtype, with_weights, device):
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype, device, with_weights=with_weights)
    act, gate, up = moonep_ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)
    for t in (act, gate, up):
        assert t.shape == (layout.nvs, layout.n) and t.dtype == dtype and t.is_contiguous()
    _assert_close_and_zero_tail(gate, grouped_gemm_ref(x, w_gate, cu), layout, dtype)
    _assert_close_and_zero_tail(up, grouped_gemm_ref(x, w_up, cu), layout, dtype)
    _assert_close_and_zero_tail(act, grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu), layout, dtype)
    # act is the activation of the saved (rounded) gate and up, as the unfused ops compute it.
    _assert_close_and_zero_tail(act, silu_mul_weight_ref(gate, up, rw, cu), layout, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_out", [False, True], ids=["alloc", "out"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_moonep_experts(layout, dtype, use_out, device):
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, dtype, device)
    out = None
    if use_out:
        out = torch.full((layout.nvs, layout.k), float("nan"), dtype=dtype, device=device)
    res = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out)
    if use_out:
        assert res is out
    _assert_close_and_zero_tail(res, experts_ref(x, w_gate, w_up, w_down, cu, rw), layout, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_on_cpu_only_for_gradcheck(device):
    layout = LAYOUTS[0]
    if device == "cpu":
        a, w, cu = grouped_gemm_inputs(layout, torch.float64, device)
        out = moonep_ops.grouped_gemm(a, w, cu)
        assert rel_err(out, grouped_gemm_ref(a, w, cu)) <= TOLERANCE[torch.float64]
    else:
        a, w, cu = grouped_gemm_inputs(layout, torch.float64, device)
        with pytest.raises(RuntimeError, match="a has dtype torch.float64"):
            moonep_ops.grouped_gemm(a, w, cu)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_gemm_silu_mul_with_gate_up_is_the_unfused_ops_on_cpu(dtype):
    """On CPU the training fused op is bitwise two grouped_gemm calls and silu_mul_weight (its
    docstring's promise; on CUDA the tiles' accumulation order may differ)."""
    layout = next(lay for lay in LAYOUTS if lay.name == "moonep_padded")
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype)
    act, gate, up = moonep_ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)
    assert torch.equal(gate, moonep_ops.grouped_gemm(x, w_gate, cu))
    assert torch.equal(up, moonep_ops.grouped_gemm(x, w_up, cu))
    assert torch.equal(act, moonep_ops.silu_mul_weight(gate, up, rw, cu))
