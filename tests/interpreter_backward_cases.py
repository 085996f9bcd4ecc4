"""The backward Triton kernels on CPU under ``TRITON_INTERPRET=1``, run in a subprocess by
test_autograd.py (Triton picks the interpreter at import, so the variable must be set first).

Each launcher writes into NaN-poisoned outputs from inputs with NaN in their tail rows, and
is compared with the CPU kernels in float64 (themselves checked against independent
references in test_autograd.py). fp32 everywhere, fp16 on a few layouts: the interpreter's
bf16 ``tl.dot`` is wrong (triton issue 11584).
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_autograd.py with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from moonep_ops.kernels import cpu as cpu_backward  # noqa: E402
from moonep_ops.kernels.triton import configs  # noqa: E402
from .layouts import LAYOUTS, Layout, fill_tail_nan  # noqa: E402
from .reference import TOLERANCE, rel_err  # noqa: E402

# Small K and N keep the interpreter quick while still crossing 16-wide block edges;
# g300_sparse crosses a cu_seqlens scan chunk (BLOCK_G = 256) and has many empty groups.
_KEEP = ("unpadded", "empty_middle", "all_empty", "tail_rows", "nvs0", "g1", "one_segment")
INTERP_LAYOUTS = [lay for lay in LAYOUTS if lay.name in _KEEP] + [
    Layout("odd_sizes", (17, 0, 33), 55, k=35, n=19),
    Layout("g300_sparse", tuple(3 if g % 97 == 5 else 0 for g in range(300)) + (2,), 16, k=8, n=6),
]
IDS = [lay.name for lay in INTERP_LAYOUTS]
FP16_LAYOUTS = ("unpadded", "tail_rows", "odd_sizes")
CASES = [pytest.param(lay, torch.float32, id=f"{lay.name}-fp32") for lay in INTERP_LAYOUTS] + [
    pytest.param(lay, torch.float16, id=f"{lay.name}-fp16") for lay in INTERP_LAYOUTS if lay.name in FP16_LAYOUTS]
GEMM = configs.INTERPRETER_GEMM


def _rows(layout, cols, dtype):
    return fill_tail_nan(torch.randn(layout.nvs, cols).to(dtype), layout.total)


def _weights(layout, n, k, dtype):
    return (torch.randn(layout.num_groups, n, k) / k ** 0.5).to(dtype)


def _poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _f64(*ts):
    return [None if t is None else t.double() for t in ts]


def _assert_close(out, ref, dtype, layout=None):
    assert not torch.isnan(out).any(), "NaN in the output"
    assert rel_err(out, ref) <= TOLERANCE[dtype], f"rel err {rel_err(out, ref):.3g}"
    if layout is not None and out.dim() <= 2:
        assert torch.count_nonzero(out[layout.total:]) == 0, "tail rows are not zero"


# TMA on the transposed view (W_TRANSPOSED): the reduction (layout.n) a multiple of BLOCK_K = 16 and
# 16-byte rows; g300 crosses a cu_seqlens scan chunk.
KN_LAYOUTS = [Layout("kn_tail_empty", (17, 0, 33, 5), 61, k=48, n=32),
              Layout("kn_g300", tuple(3 if g % 97 == 5 else 0 for g in range(300)) + (2,), 16, k=8, n=16)]


@pytest.mark.parametrize("layout", KN_LAYOUTS, ids=[lay.name for lay in KN_LAYOUTS])
def test_dgrad_tma_on_transposed_weights(layout):
    from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm, tma_usable_kn

    dtype = torch.float16
    grad, w = _rows(layout, layout.n, dtype), _weights(layout, layout.n, layout.k, dtype)
    cu = layout.cu_seqlens()
    assert tma_usable_kn(grad, w.transpose(1, 2), GEMM.block_k)
    out = _poisoned(layout.nvs, layout.k, dtype=dtype)
    launch_grouped_gemm(grad, w.transpose(1, 2), cu, out, GEMM, use_tma=True)
    _assert_close(out, cpu_backward.grouped_gemm_dgrad(*_f64(grad, w), cu), dtype, layout)


def test_dgrad_tma_on_transposed_weights_refuses_a_ragged_reduction():
    """A reduction that is not a multiple of BLOCK_K would read the next group's rows."""
    from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm, tma_usable_kn

    layout = Layout("kn_ragged", (5, 7), 12, k=16, n=24)
    grad, w = _rows(layout, layout.n, torch.float16), _weights(layout, layout.n, layout.k, torch.float16)
    assert not tma_usable_kn(grad, w.transpose(1, 2), GEMM.block_k)
    with pytest.raises(ValueError, match="K % BLOCK_K"):
        launch_grouped_gemm(grad, w.transpose(1, 2), layout.cu_seqlens(), _poisoned(12, 16, dtype=torch.float16),
                            GEMM, use_tma=True)


@pytest.mark.parametrize("layout,dtype", CASES)
def test_dgrad_through_the_forward_launcher(layout, dtype):
    from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm

    grad, w = _rows(layout, layout.n, dtype), _weights(layout, layout.n, layout.k, dtype)
    cu = layout.cu_seqlens()
    out = _poisoned(layout.nvs, layout.k, dtype=dtype)
    launch_grouped_gemm(grad, w.transpose(1, 2), cu, out, GEMM)
    _assert_close(out, cpu_backward.grouped_gemm_dgrad(*_f64(grad, w), cu), dtype, layout)


@pytest.mark.parametrize("layout,dtype", CASES)
def test_dual_dgrad(layout, dtype):
    """The forward kernel's DUAL_DGRAD mode over the transposed weight views (pointer loads)."""
    from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm_dual

    g_gate, g_up = _rows(layout, layout.n, dtype), _rows(layout, layout.n, dtype)
    w_gate, w_up = _weights(layout, layout.n, layout.k, dtype), _weights(layout, layout.n, layout.k, dtype)
    cu = layout.cu_seqlens()
    out = _poisoned(layout.nvs, layout.k, dtype=dtype)
    launch_grouped_gemm_dual(g_gate, w_gate.transpose(1, 2), g_up, w_up.transpose(1, 2), cu, out, GEMM)
    ref = cpu_backward.grouped_gemm_dual_dgrad(*_f64(g_gate, g_up, w_gate, w_up), cu)
    _assert_close(out, ref, dtype, layout)


@pytest.mark.parametrize("layout", KN_LAYOUTS, ids=[lay.name for lay in KN_LAYOUTS])
def test_dual_dgrad_tma_on_transposed_weights(layout):
    """DUAL_DGRAD with TMA loads of both gradients and both transposed weight views (W_TRANSPOSED)."""
    from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm_dual

    dtype = torch.float16
    g_gate, g_up = _rows(layout, layout.n, dtype), _rows(layout, layout.n, dtype)
    w_gate, w_up = _weights(layout, layout.n, layout.k, dtype), _weights(layout, layout.n, layout.k, dtype)
    cu = layout.cu_seqlens()
    out = _poisoned(layout.nvs, layout.k, dtype=dtype)
    launch_grouped_gemm_dual(g_gate, w_gate.transpose(1, 2), g_up, w_up.transpose(1, 2), cu, out, GEMM, use_tma=True)
    ref = cpu_backward.grouped_gemm_dual_dgrad(*_f64(g_gate, g_up, w_gate, w_up), cu)
    _assert_close(out, ref, dtype, layout)


def test_dual_refuses_mismatched_strides():
    from moonep_ops.kernels.triton.grouped_gemm import launch_grouped_gemm_dual

    layout = INTERP_LAYOUTS[0]
    g_gate = _rows(layout, layout.n, torch.float32)
    g_up = _rows(layout, layout.n, torch.float32).t().contiguous().t()
    w = _weights(layout, layout.n, layout.k, torch.float32)
    with pytest.raises(ValueError, match="a_up needs a's shape and strides"):
        launch_grouped_gemm_dual(g_gate, w.transpose(1, 2), g_up, w.transpose(1, 2), layout.cu_seqlens(),
                                 _poisoned(layout.nvs, layout.k, dtype=torch.float32), GEMM)


@pytest.mark.parametrize("layout,dtype", CASES)
def test_wgrad(layout, dtype):
    from moonep_ops.kernels.triton.grouped_gemm_wgrad import launch_grouped_gemm_wgrad

    grad, a = _rows(layout, layout.n, dtype), _rows(layout, layout.k, dtype)
    cu = layout.cu_seqlens()
    out = _poisoned(layout.num_groups, layout.n, layout.k, dtype=dtype)
    launch_grouped_gemm_wgrad(grad, a, cu, out, GEMM)
    _assert_close(out, cpu_backward.grouped_gemm_wgrad(*_f64(grad, a), cu), dtype)
    empty = [g for g, s in enumerate(layout.sizes) if s == 0]
    assert torch.count_nonzero(out[empty]) == 0, "empty groups must get exactly zero"


WGRAD_TMA_LAYOUTS = [lay for lay in INTERP_LAYOUTS if lay.name in ("unpadded", "one_segment", "empty_middle")] + [
    Layout("whole_steps", (32, 0, 48, 7), 90, k=24, n=40)]


@pytest.mark.parametrize("layout", WGRAD_TMA_LAYOUTS, ids=str)
def test_wgrad_tma(layout):
    """Whole row steps by TMA, the partial last step by masked loads (rows past a segment are
    another group's: they must not enter the sum). fp16: TMA needs 16-byte rows."""
    from moonep_ops.kernels.triton.grouped_gemm_wgrad import launch_grouped_gemm_wgrad, tma_usable

    dtype = torch.float16
    grad, a = _rows(layout, layout.n, dtype), _rows(layout, layout.k, dtype)
    assert tma_usable(grad, a)
    assert not tma_usable(grad[:0], a[:0]), "NvS = 0 must take the pointer path (found on the H200)"
    cu = layout.cu_seqlens()
    out = _poisoned(layout.num_groups, layout.n, layout.k, dtype=dtype)
    launch_grouped_gemm_wgrad(grad, a, cu, out, GEMM, use_tma=True)
    _assert_close(out, cpu_backward.grouped_gemm_wgrad(*_f64(grad, a), cu), dtype)
    empty = [g for g, s in enumerate(layout.sizes) if s == 0]
    assert torch.count_nonzero(out[empty]) == 0, "empty groups must get exactly zero"


def test_wgrad_strided_inputs():
    """Column-major grad_out and a go through the stride arguments."""
    from moonep_ops.kernels.triton.grouped_gemm_wgrad import launch_grouped_gemm_wgrad

    layout = INTERP_LAYOUTS[0]
    grad = _rows(layout, layout.n, torch.float32).t().contiguous().t()
    a = _rows(layout, layout.k, torch.float32).t().contiguous().t()
    cu = layout.cu_seqlens()
    out = _poisoned(layout.num_groups, layout.n, layout.k, dtype=torch.float32)
    launch_grouped_gemm_wgrad(grad, a, cu, out, GEMM)
    _assert_close(out, cpu_backward.grouped_gemm_wgrad(*_f64(grad, a), cu), torch.float32)


def test_wgrad_broadcast_rows():
    """A broadcast ``a`` (one row over NvS, stride 0: the backward of an expanded input) takes the
    pointer loads, never a TMA descriptor over a zero stride."""
    from moonep_ops.kernels.triton.grouped_gemm_wgrad import launch_grouped_gemm_wgrad, tma_usable

    layout = Layout("broadcast", (17, 0, 33, 5), 61, k=48, n=32)
    grad = _rows(layout, layout.n, torch.float16)
    a = torch.randn(1, layout.k).to(torch.float16).expand(layout.nvs, layout.k)
    assert tma_usable(grad, a.contiguous()) and not tma_usable(grad, a)
    cu = layout.cu_seqlens()
    out = _poisoned(layout.num_groups, layout.n, layout.k, dtype=torch.float16)
    launch_grouped_gemm_wgrad(grad, a, cu, out, GEMM)
    _assert_close(out, cpu_backward.grouped_gemm_wgrad(*_f64(grad, a), cu), torch.float16)


def test_wgrad_invalid_cu_seqlens_stay_in_bounds():
    """cu_seqlens past NvS (unchecked on CUDA) must not read past the buffers."""
    from moonep_ops.kernels.triton.grouped_gemm_wgrad import launch_grouped_gemm_wgrad

    storage_a = torch.full((30, 8), float("nan"))
    storage_a[:20] = torch.randn(20, 8)
    storage_g = torch.full((30, 4), float("nan"))
    storage_g[:20] = torch.randn(20, 4)
    a, grad = storage_a[:20], storage_g[:20]
    cu = torch.tensor([5, 50], dtype=torch.int32)
    out = _poisoned(2, 4, 8, dtype=torch.float32)
    launch_grouped_gemm_wgrad(grad, a, cu, out, GEMM)
    assert not torch.isnan(out).any(), "read past NvS"
    assert rel_err(out[1], grad[5:].double().T @ a[5:].double()) <= 1e-5


@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("layout,dtype", CASES)
def test_grouped_gemm_silu_mul_backward(layout, dtype, with_weights):
    from moonep_ops.kernels.triton.grouped_gemm_silu_mul_backward import (
        launch_grouped_gemm_silu_mul_backward, num_col_tiles)

    grad, x = _rows(layout, layout.n, dtype), _rows(layout, layout.k, dtype)
    w_gate, w_up = _weights(layout, layout.n, layout.k, dtype), _weights(layout, layout.n, layout.k, dtype)
    rw = fill_tail_nan(torch.rand(layout.nvs) + 0.1, layout.total) if with_weights else None
    cu = layout.cu_seqlens()
    d_gate = _poisoned(layout.nvs, layout.n, dtype=dtype)
    d_up = _poisoned(layout.nvs, layout.n, dtype=dtype)
    partials = _poisoned(num_col_tiles(layout.n, GEMM), layout.nvs, dtype=torch.float32)
    launch_grouped_gemm_silu_mul_backward(grad, x, w_gate, w_up, rw, cu, d_gate, d_up,
                                          partials if with_weights else None, GEMM)
    ref = cpu_backward.grouped_gemm_silu_mul_backward(*_f64(grad, x, w_gate, w_up, rw), cu)
    _assert_close(d_gate, ref[0], dtype, layout)
    _assert_close(d_up, ref[1], dtype, layout)
    if with_weights:
        _assert_close(partials.sum(0), ref[2], dtype, layout)


@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
@pytest.mark.parametrize("layout,dtype", CASES)
def test_silu_mul_weight_backward(layout, dtype, with_weights):
    from moonep_ops.kernels.triton.silu_mul_weight import launch_silu_mul_weight_backward

    grad, gate, up = (_rows(layout, layout.n, dtype) for _ in range(3))
    rw = fill_tail_nan(torch.rand(layout.nvs) + 0.1, layout.total) if with_weights else None
    cu = layout.cu_seqlens()
    d_gate = _poisoned(layout.nvs, layout.n, dtype=dtype)
    d_up = _poisoned(layout.nvs, layout.n, dtype=dtype)
    d_rw = _poisoned(layout.nvs, dtype=torch.float32)
    launch_silu_mul_weight_backward(grad, gate, up, rw, cu, d_gate, d_up, d_rw, configs.INTERPRETER_ELTWISE)
    ref = cpu_backward.silu_mul_weight_backward(*_f64(grad, gate, up, rw), cu)
    _assert_close(d_gate, ref[0], dtype, layout)
    _assert_close(d_up, ref[1], dtype, layout)
    if with_weights:
        _assert_close(d_rw, ref[2], dtype, layout)
    else:
        assert torch.count_nonzero(d_rw) == 0 and not torch.isnan(d_rw).any()


def _op_args(name, layout, dtype):
    """Arguments of backward op ``name`` on ``layout`` (NaN in every tail row)."""
    rows = lambda cols: _rows(layout, cols, dtype)  # noqa: E731
    w_gate, w_up = _weights(layout, layout.n, layout.k, dtype), _weights(layout, layout.n, layout.k, dtype)
    rw = fill_tail_nan(torch.rand(layout.nvs) + 0.1, layout.total)
    cu = layout.cu_seqlens()
    return {
        "grouped_gemm_dgrad": (rows(layout.n), w_gate, cu),
        "grouped_gemm_dual_dgrad": (rows(layout.n), rows(layout.n), w_gate, w_up, cu),
        "grouped_gemm_wgrad": (rows(layout.n), rows(layout.k), cu),
        "silu_mul_weight_backward": (rows(layout.n), rows(layout.n), rows(layout.n), rw, cu),
        "grouped_gemm_silu_mul_backward": (rows(layout.n), rows(layout.k), w_gate, w_up, rw, cu),
    }[name]


@pytest.mark.parametrize("layout", [lay for lay in INTERP_LAYOUTS if lay.name in ("tail_rows", "g300_sparse")],
                         ids=["tail_rows", "g300_sparse"])
@pytest.mark.parametrize("name", ["grouped_gemm_dgrad", "grouped_gemm_dual_dgrad", "grouped_gemm_wgrad",
                                  "silu_mul_weight_backward", "grouped_gemm_silu_mul_backward"])
def test_cuda_op_bodies(name, layout):
    """The registered CUDA implementations end to end (checks, allocation, config choice, launch,
    the d_rw reduction), run on CPU tensors: only the device differs from a GPU call."""
    from moonep_ops.kernels.cuda import register as cuda_backward

    args = _op_args(name, layout, torch.float32)
    got = getattr(cuda_backward, name)(*args)
    ref = getattr(cpu_backward, name)(*_f64(*args[:-1]), args[-1])
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        assert g.dtype == (torch.float32 if g.dim() == 1 else args[0].dtype)
        _assert_close(g, r, torch.float32, layout if g.dim() <= 2 and name != "grouped_gemm_wgrad" else None)


def test_tune_backward_roles():
    """benchmarks/tune_backward.py on a tiny CPU problem: each role's kernel at its committed
    config agrees with the torch._grouped_mm call it is timed against (the sweep's own check)."""
    from benchmarks.shapes import Shape, build_problem
    from benchmarks.tune_backward import _err, roles_for

    shape = Shape("tiny", hidden=32, inter=16, num_groups=10, topk=2, tokens=8, epn=4, active=4)
    x, w_gate, w_up, w_down, cu, _, sizes = build_problem(shape, 4, device="cpu", dtype=torch.float32)
    roles = roles_for(shape, x, w_gate, w_up, w_down, cu, sizes)
    assert sorted(roles) == ["dgrad_down", "dgrad_down_tma", "dgrad_gate", "dgrad_gate_tma", "dual_dgrad",
                             "wgrad_down", "wgrad_down_tma", "wgrad_gate", "wgrad_gate_tma"]
    for name, (_, default, run, torch_run, out, where) in roles.items():
        out.fill_(float("nan"))
        run(default)
        assert _err(out, torch_run(), **where) <= 1e-5, name
