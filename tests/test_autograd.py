"""Autograd of the moonep ops (moonep_ops/autograd.py) and the backward ops behind it.

- gradcheck in float64 on CPU over small copies of the layout matrix (NaN in every tail row:
  gradcheck perturbs those too, and they must neither be read nor get a gradient);
- every gradient against a float64 autograd reference written independently here (a per-row
  weight gather, no segment loops), CPU and CUDA, fp32/bf16/fp16, NaN in the tails of the
  inputs *and* of the incoming gradient; tail rows of input gradients exactly zero, weight
  gradients of empty groups exactly zero;
- opcheck with inputs that require grad; torch.compile(fullgraph=True) of forward + backward;
  CUDA-graph capture of a training step; the non-differentiable paths raise clearly;
- the backward Triton kernels under TRITON_INTERPRET=1 (interpreter_backward_cases.py).
"""

import dataclasses
import functools

import expecttest
import pytest
import torch

import moonep_ops
from moonep_ops.autograd import DIFFERENTIABLE_OPS, INFERENCE_ONLY_OPS
from moonep_ops.schemas import SCHEMAS, op

from . import subprocess_jobs
from .conftest import DEVICES, HAS_CUDA
from .layouts import LAYOUT_IDS, LAYOUTS, Layout, experts_inputs, fill_tail_nan
from .reference import TOLERANCE, rel_err, row_groups

# --- float64 autograd references ---------------------------------------------------------------


def _live(cu_seqlens, num_rows):
    groups = row_groups(cu_seqlens, num_rows)
    return groups, groups < cu_seqlens.numel()


def _masked(t, live):
    """Tail rows replaced by zeros through ``where``: NaN there reaches neither the value nor the
    gradient (where's backward routes the tail's gradient to the zeros)."""
    mask = live.view(-1, *([1] * (t.dim() - 1)))
    return torch.where(mask, t, torch.zeros_like(t))


def ref_grouped_gemm(a, w, cu):
    groups, live = _live(cu, a.shape[0])
    w_rows = w[groups.clamp(max=w.shape[0] - 1)]  # [NvS, N, K]: each row's own weight
    out = torch.einsum("mk,mnk->mn", _masked(a, live), w_rows)
    return _masked(out, live)


def ref_silu_mul_weight(gate, up, rw, cu):
    _, live = _live(cu, gate.shape[0])
    gate, up = _masked(gate, live), _masked(up, live)
    act = gate * torch.sigmoid(gate) * up
    if rw is not None:
        act = act * _masked(rw, live)[:, None]
    return _masked(act, live)


def ref_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu):
    return ref_silu_mul_weight(ref_grouped_gemm(x, w_gate, cu), ref_grouped_gemm(x, w_up, cu), rw, cu)


def ref_gate_up_act(x, w_gate, w_up, rw, cu):
    """``act, gate, up`` side by side (``[NvS, 3n]``): every output of the training fused op."""
    gate, up = ref_grouped_gemm(x, w_gate, cu), ref_grouped_gemm(x, w_up, cu)
    return torch.cat((ref_silu_mul_weight(gate, up, rw, cu), gate, up), dim=1)


def ref_experts(x, w_gate, w_up, w_down, cu, rw):
    return ref_grouped_gemm(ref_grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu), w_down, cu)


def _to64(t):
    if t is None or not t.is_floating_point():
        return t
    return t.detach().to("cpu", torch.float64).requires_grad_(t.requires_grad)


def reference_grads(ref_fn, args, grad_out):
    """float64 gradients of ``ref_fn`` w.r.t. the arguments that require grad (None for others)."""
    args64 = [_to64(t) for t in args]
    diff = [t for t in args64 if t is not None and t.requires_grad]
    out = ref_fn(*args64)
    grads = iter(torch.autograd.grad(out, diff, _to64(grad_out).nan_to_num(0.0), allow_unused=True))
    return [next(grads) if t is not None and t.requires_grad else None for t in args64]


# --- the differentiable paths under test ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: object  # moonep call taking the positional args
    ref: object  # float64 reference taking the same args
    make: object  # (layout, dtype, device) -> args with requires_grad set on the differentiable ones


def _leaf(t, requires_grad=True):
    return None if t is None else t.detach().requires_grad_(requires_grad)


def _rw(rw, dtype):
    """Route weights are fp32, or fp64 next to fp64 rows (gradcheck)."""
    if rw is None:
        return None
    return _leaf(rw.double() if dtype == torch.float64 else rw)


def _gg_args(layout, dtype, device):
    x, w, *_ = experts_inputs(layout, dtype, device)
    return [_leaf(x), _leaf(w), layout.cu_seqlens(device)]


def _smw_args(with_weights):
    def make(layout, dtype, device):
        x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype, device, with_weights=with_weights)
        gate = fill_tail_nan(torch.randn(layout.nvs, layout.n, device=device).mul(2).to(dtype), layout.total)
        up = fill_tail_nan(torch.randn(layout.nvs, layout.n, device=device).to(dtype), layout.total)
        return [_leaf(gate), _leaf(up), _rw(rw, dtype), cu]
    return make


def _fused_args(with_weights):
    def make(layout, dtype, device):
        x, w_gate, w_up, _, cu, rw = experts_inputs(layout, dtype, device, with_weights=with_weights)
        return [_leaf(x), _leaf(w_gate), _leaf(w_up), _rw(rw, dtype), cu]
    return make


def _experts_args(with_weights):
    def make(layout, dtype, device):
        x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, dtype, device, with_weights=with_weights)
        return [_leaf(x), _leaf(w_gate), _leaf(w_up), _leaf(w_down), cu, _rw(rw, dtype)]
    return make


def _with_gate_up_act(x, w_gate, w_up, rw, cu):
    return moonep_ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)[0]


def _with_gate_up_all(x, w_gate, w_up, rw, cu):
    # A loss over gate and up as well: their own gradients join d act's in the backward.
    return torch.cat(moonep_ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu), dim=1)


def _with_gate_up_gate_only(x, w_gate, w_up, rw, cu):
    # A loss on gate alone: act gets no gradient, up's is None (the backward pairs it with zeros).
    return moonep_ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)[1]


def _ref_gate(x, w_gate, w_up, rw, cu):
    return ref_grouped_gemm(x, w_gate, cu) + 0 * ref_grouped_gemm(x, w_up, cu)  # w_up: a zero gradient


def experts_with_gate_up(x, w_gate, w_up, w_down, cu, rw):
    """The expert layer over the training fused op (what a user's training loop would write)."""
    act, _, _ = moonep_ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)
    return moonep_ops.grouped_gemm(act, w_down, cu)


def experts_op(x, w_gate, w_up, w_down, cu, rw):
    """The whole-path op (what moonep_experts runs without grad), differentiated directly."""
    return torch.ops.moonep.experts(x, w_gate, w_up, w_down, rw, cu)


def _experts_op_args(with_weights):
    make = _experts_args(with_weights)

    def reorder(layout, dtype, device):  # the op's argument order: route_weights before cu_seqlens
        x, w_gate, w_up, w_down, cu, rw = make(layout, dtype, device)
        return [x, w_gate, w_up, w_down, rw, cu]
    return reorder


CASES = [
    Case("grouped_gemm", moonep_ops.grouped_gemm, ref_grouped_gemm, _gg_args),
    Case("silu_mul_weight", moonep_ops.silu_mul_weight, ref_silu_mul_weight, _smw_args(True)),
    Case("silu_mul_weight_no_weights", moonep_ops.silu_mul_weight, ref_silu_mul_weight, _smw_args(False)),
    Case("grouped_gemm_silu_mul", moonep_ops.grouped_gemm_silu_mul, ref_grouped_gemm_silu_mul, _fused_args(True)),
    Case("grouped_gemm_silu_mul_no_weights", moonep_ops.grouped_gemm_silu_mul, ref_grouped_gemm_silu_mul,
         _fused_args(False)),
    Case("with_gate_up_act", _with_gate_up_act, ref_grouped_gemm_silu_mul, _fused_args(True)),
    Case("with_gate_up_act_no_weights", _with_gate_up_act, ref_grouped_gemm_silu_mul, _fused_args(False)),
    Case("with_gate_up_all", _with_gate_up_all, ref_gate_up_act, _fused_args(True)),
    Case("with_gate_up_gate_only", _with_gate_up_gate_only, _ref_gate, _fused_args(False)),
    Case("moonep_experts", moonep_ops.moonep_experts, ref_experts, _experts_args(True)),
    Case("moonep_experts_no_weights", moonep_ops.moonep_experts, ref_experts, _experts_args(False)),
    Case("moonep_experts_recompute", functools.partial(moonep_ops.moonep_experts, recompute=True), ref_experts,
         _experts_args(True)),
    Case("experts_with_gate_up", experts_with_gate_up, ref_experts, _experts_args(True)),
    Case("experts_op", experts_op, ref_experts, _experts_args(True)),
    Case("experts_op_no_weights", experts_op, ref_experts, _experts_args(False)),
]
CASE_IDS = [c.name for c in CASES]

# Small copies of the layout matrix for gradcheck (its cost grows with every input element):
# odd K and N, and a MoonEP-style padded layout small enough to perturb element by element.
_SMALL = {"k": 7, "n": 5}
GRAD_LAYOUTS = [dataclasses.replace(lay, **_SMALL) for lay in LAYOUTS
                if lay.name not in ("g1100", "moonep_padded", "k1001_n300")] + [
    Layout("padded_small", (8, 0, 4, 8, 0), 27, k=7, n=5, padded_to=4, real_rows=(6, 0, 1, 8, 0)),
    Layout("g40_sparse", tuple(2 if g % 9 == 4 else 0 for g in range(40)), 12, k=3, n=2),
]
GRAD_LAYOUT_IDS = [lay.name for lay in GRAD_LAYOUTS]


def _differentiable(args):
    return [i for i, t in enumerate(args) if isinstance(t, torch.Tensor) and t.requires_grad]


def _gradcheck(case, layout, fast_mode):
    args = case.make(layout, torch.float64, "cpu")
    idx = _differentiable(args)

    def fn(*diff):
        full = list(args)
        for i, t in zip(idx, diff):
            full[i] = t
        return case.fn(*full)

    return torch.autograd.gradcheck(fn, [args[i] for i in idx], fast_mode=fast_mode)


@pytest.mark.parametrize("layout", GRAD_LAYOUTS, ids=GRAD_LAYOUT_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradcheck_fast(case, layout):
    """Random-projection gradcheck (v^T J u against finite differences) over the small matrix."""
    assert _gradcheck(case, layout, fast_mode=True)


_FULL_LAYOUTS = [lay for lay in GRAD_LAYOUTS if lay.name in ("empty_middle", "tail_rows", "g1")]
_FULL_CASES = [c for c in CASES if "experts" not in c.name]


@pytest.mark.parametrize("layout", _FULL_LAYOUTS, ids=[lay.name for lay in _FULL_LAYOUTS])
@pytest.mark.parametrize("case", _FULL_CASES, ids=[c.name for c in _FULL_CASES])
def test_gradcheck_full_jacobian(case, layout):
    """Element-by-element gradcheck (every Jacobian entry, tail rows included) on a few layouts."""
    assert _gradcheck(case, layout, fast_mode=False)


def test_gradcheck_notices_a_wrong_gradient():
    """The fast gradcheck above is only worth running if it fails on a slightly wrong backward."""
    class Scaled(torch.autograd.Function):
        """grouped_gemm with its weight gradient off by 1 %."""

        @staticmethod
        def forward(ctx, a, w, cu):
            ctx.save_for_backward(a, w, cu)
            return op("grouped_gemm")(a, w, cu)

        @staticmethod
        def backward(ctx, grad):
            a, w, cu = ctx.saved_tensors
            return op("grouped_gemm_dgrad")(grad, w, cu), op("grouped_gemm_wgrad")(grad, a, cu) * 1.01, None

    layout = next(lay for lay in GRAD_LAYOUTS if lay.name == "g1")
    a, w, cu = _gg_args(layout, torch.float64, "cpu")
    assert torch.autograd.gradcheck(lambda a, w: Scaled.apply(a, w, cu), (a, w), fast_mode=True,
                                    raise_exception=False) is False


# --- gradients against the float64 reference, every layout, CPU and CUDA ----------------------

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run_backward(case, layout, dtype, device):
    args = case.make(layout, dtype, device)
    out = case.fn(*args)
    grad_out = fill_tail_nan(torch.randn(out.shape, device=device).to(dtype), layout.total)
    idx = _differentiable(args)
    grads = torch.autograd.grad(out, [args[i] for i in idx], grad_out)
    return args, idx, grads, grad_out


def _check_grads(case, layout, dtype, args, idx, grads, grad_out, tol=None):
    refs = reference_grads(case.ref, args, grad_out)
    empty = [g for g, s in enumerate(layout.sizes) if s == 0]
    for i, grad in zip(idx, grads):
        arg = args[i]
        assert grad.shape == arg.shape and grad.dtype == arg.dtype and grad.device == arg.device
        assert not torch.isnan(grad).any(), f"NaN in the gradient of argument {i}"
        err = rel_err(grad, refs[i])
        assert err <= (tol or TOLERANCE[dtype]), f"argument {i}: rel err {err:.3g}"
        if arg.dim() == 3:  # a weight: empty groups get exactly zero
            assert torch.count_nonzero(grad[empty]) == 0, "non-zero weight gradient for an empty group"
        else:  # rows: the tail gets exactly zero
            assert torch.count_nonzero(grad[layout.total:]) == 0, "non-zero gradient in tail rows"


# A chained bf16/fp16 backward rounds every intermediate (act, d_act, d_gate, d_up) once.
_CHAIN_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_grads_vs_float64_reference(case, layout, dtype, device):
    args, idx, grads, grad_out = _run_backward(case, layout, dtype, device)
    tol = _CHAIN_TOL[dtype] if "experts" in case.name else None
    _check_grads(case, layout, dtype, args, idx, grads, grad_out, tol)


def _moonep_ops_called(fn):
    """``fn()``'s result and the names of the ``moonep::`` ops it dispatched, in call order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    with Recorder() as rec:
        result = fn()
    return result, [name for name in rec.names if name.startswith("moonep::")]


# Backward ops that moonep_experts' two training paths run for dx alone (no wgrad: frozen weights).
DX_ONLY_BACKWARD = {
    False: {"moonep::grouped_gemm_dgrad", "moonep::silu_mul_weight_backward",
            "moonep::grouped_gemm_dual_dgrad"},  # saved gate/up (grouped_gemm_silu_mul_with_gate_up)
    True: {"moonep::grouped_gemm_dgrad", "moonep::grouped_gemm_silu_mul_backward",
           "moonep::grouped_gemm_dual_dgrad"},  # recomputed gate/up
}


@pytest.mark.parametrize("recompute", [False, True])
def test_only_requested_gradients_are_computed(recompute):
    """A frozen weight (requires_grad=False) skips its wgrad; the input still gets its gradient."""
    layout = LAYOUTS[0]
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.float32)
    x.requires_grad_()
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, recompute=recompute)
    grad_out = torch.randn_like(out)
    (dx,), called = _moonep_ops_called(lambda: torch.autograd.grad(out, (x,), grad_out))
    assert set(called) == DX_ONLY_BACKWARD[recompute], called
    ref = reference_grads(ref_experts, [x, w_gate, w_up, w_down, cu, rw], grad_out)[0]
    assert rel_err(dx, ref) <= TOLERANCE[torch.float32]


def test_saved_path_without_input_grad_skips_the_dual_dgrad():
    """Weights train, the input is frozen (a first layer's input): moonep_experts' saved-gate/up
    path computes the three weight gradients and d act, but no dx (no dual dgrad)."""
    layout = LAYOUTS[0]
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.float32)
    weights = [w.requires_grad_() for w in (w_gate, w_up, w_down)]
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw)
    grad_out = torch.randn_like(out)
    grads, called = _moonep_ops_called(lambda: torch.autograd.grad(out, weights, grad_out))
    assert "moonep::grouped_gemm_dual_dgrad" not in called, called
    assert called.count("moonep::grouped_gemm_wgrad") == 3, called
    refs = reference_grads(ref_experts, [x, w_gate, w_up, w_down, cu, rw], grad_out)
    for got, i in zip(grads, (1, 2, 3)):
        assert rel_err(got, refs[i]) <= TOLERANCE[torch.float32]


# --- the backward ops directly: determinism, dtypes ------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_backward_ops_are_deterministic(device):
    layout = next(lay for lay in LAYOUTS if lay.name == "moonep_padded")
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.bfloat16, device)
    grad = torch.randn(layout.nvs, layout.n, device=device).to(torch.bfloat16)
    bwd = op("grouped_gemm_silu_mul_backward")
    first = bwd(grad, x, w_gate, w_up, rw, cu)
    again = bwd(grad, x, w_gate, w_up, rw, cu)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    wg = op("grouped_gemm_wgrad")
    assert torch.equal(wg(first[0], x, cu), wg(first[0], x, cu))
    assert first[2].dtype == torch.float32 and first[2].shape == (layout.nvs,)


@pytest.mark.parametrize("device", DEVICES)
def test_route_weight_gradient_is_zero_without_weights(device):
    layout = LAYOUTS[0]
    gate = torch.randn(layout.nvs, layout.n, device=device)
    up = torch.randn(layout.nvs, layout.n, device=device)
    grad = torch.randn(layout.nvs, layout.n, device=device)
    d_gate, d_up, d_rw = op("silu_mul_weight_backward")(grad, gate, up, None, layout.cu_seqlens(device))
    assert d_rw.dtype == torch.float32 and torch.count_nonzero(d_rw) == 0
    assert torch.count_nonzero(d_gate[:layout.total]) > 0


# --- opcheck with inputs that require grad ----------------------------------------------------

DEFAULT_CHECKS = {"test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"}
_OPCHECK_LAYOUTS = ["unpadded", "empty_middle", "all_empty", "nvs0", "g1", "k1001_n300"]
OPCHECK_CASES = [pytest.param(lay, torch.float32, id=f"{lay.name}-fp32")
                 for lay in LAYOUTS if lay.name in _OPCHECK_LAYOUTS] + [
    pytest.param(lay, torch.bfloat16, id=f"{lay.name}-bf16") for lay in LAYOUTS if lay.name == "moonep_padded"]


def _opcheck(overload, args):
    results = torch.library.opcheck(overload, args)
    assert DEFAULT_CHECKS <= set(results), f"opcheck ran only {sorted(results)}"
    assert all(r == "SUCCESS" for r in results.values()), results


_DIFF_OPS = {
    "grouped_gemm": _gg_args,
    "silu_mul_weight": _smw_args(True),
    "silu_mul_weight_no_weights": _smw_args(False),
    "grouped_gemm_silu_mul": _fused_args(True),
    "grouped_gemm_silu_mul_no_weights": _fused_args(False),
    "grouped_gemm_silu_mul_with_gate_up": _fused_args(True),
    "grouped_gemm_silu_mul_with_gate_up_no_weights": _fused_args(False),
    "experts": _experts_op_args(True),
    "experts_no_weights": _experts_op_args(False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_DIFF_OPS))
@pytest.mark.parametrize("layout,dtype", OPCHECK_CASES)
def test_opcheck_differentiable_ops_with_grad(layout, dtype, name, device):
    args = _DIFF_OPS[name](layout, dtype, device)
    _opcheck(op(name.removesuffix("_no_weights")), args)


def _backward_op_args(name, layout, dtype, device):
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, dtype, device)
    rows = lambda cols: _leaf(fill_tail_nan(torch.randn(layout.nvs, cols, device=device).to(dtype),  # noqa: E731
                                            layout.total))
    x, w_gate, w_up, w_down, rw = map(_leaf, (x, w_gate, w_up, w_down, rw))
    if name == "grouped_gemm_dgrad":
        return (rows(layout.n), w_gate, cu)
    if name == "grouped_gemm_dual_dgrad":
        return (rows(layout.n), rows(layout.n), w_gate, w_up, cu)
    if name == "grouped_gemm_wgrad":
        return (rows(layout.n), x, cu)
    if name == "silu_mul_weight_backward":
        return (rows(layout.n), rows(layout.n), rows(layout.n), rw, cu)
    return (rows(layout.n), x, w_gate, w_up, rw, cu)


BACKWARD_OPS = ["grouped_gemm_dgrad", "grouped_gemm_dual_dgrad", "grouped_gemm_wgrad",
                "silu_mul_weight_backward", "grouped_gemm_silu_mul_backward"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", BACKWARD_OPS)
@pytest.mark.parametrize("layout,dtype", OPCHECK_CASES)
def test_opcheck_backward_ops(layout, dtype, name, device):
    _opcheck(op(name), _backward_op_args(name, layout, dtype, device))


def test_backward_ops_have_no_derivative():
    """Their outputs do not require grad even when inputs do; a double backward through a moonep
    op raises rather than returning a gradient that silently misses terms."""
    layout = LAYOUTS[0]
    args = _backward_op_args("grouped_gemm_wgrad", layout, torch.float64, "cpu")
    assert not op("grouped_gemm_wgrad")(*args).requires_grad
    a, w, cu = _gg_args(layout, torch.float64, "cpu")
    out = moonep_ops.grouped_gemm(a, w, cu)
    with pytest.raises(RuntimeError, match=r"moonep::grouped_gemm: double backward"):
        torch.autograd.grad(out, (a, w), torch.randn_like(out).requires_grad_(), create_graph=True)


# --- grouped_gemm_out (and moonep_experts(out=...)) stay non-differentiable ---------------------

def test_out_variant_refuses_grad():
    layout = LAYOUTS[0]
    a, w, cu = _gg_args(layout, torch.float32, "cpu")
    out = torch.empty(layout.nvs, layout.n)
    with pytest.raises(RuntimeError, match=r"moonep::grouped_gemm_out is not differentiable"):
        moonep_ops.grouped_gemm(a, w, cu, out=out)
    x, w_gate, w_up, w_down, cu, rw = _experts_args(True)(layout, torch.float32, "cpu")
    out = torch.full((layout.nvs, layout.k), float("nan"))
    # Named as the op the call is (not the down GEMM of a training composition), before any GEMM runs.
    refusal = r"moonep::experts_out is not differentiable.*moonep_experts without out="
    with pytest.raises(RuntimeError, match=refusal):
        moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, out=out)
    assert out.isnan().all()
    with pytest.raises(RuntimeError, match=r"moonep::experts_out is not differentiable"):
        torch.ops.moonep.experts_out(x, w_gate, w_up, w_down, rw, cu, torch.empty(layout.nvs, layout.k))


def test_torch_func_transforms():
    """``torch.func.grad`` reaches torch's own refusal (autograd registered with
    ``torch.library.register_autograd`` has no functorch rule), not an error inside this package;
    ``torch.func.vmap`` runs through torch's per-example fallback and equals the loop."""
    layout = LAYOUTS[0]
    x, w_gate, w_up, w_down, cu, rw = _experts_args(False)(layout, torch.float32, "cpu")
    for recompute in (False, True):
        with pytest.raises(RuntimeError, match="to use an autograd.Function with functorch transforms"):
            torch.func.grad(lambda w: moonep_ops.moonep_experts(x, w, w_up, w_down, cu, rw,
                                                                recompute=recompute).sum())(w_gate)
    batch = torch.stack([x, x.flip(1)])
    out = torch.func.vmap(lambda xx: moonep_ops.moonep_experts(xx, w_gate, w_up, w_down, cu, rw))(batch)
    for i in range(2):
        assert torch.equal(out[i], moonep_ops.moonep_experts(batch[i], w_gate, w_up, w_down, cu, rw))


def test_out_variant_without_grad_still_writes_and_bumps_version():
    layout = LAYOUTS[0]
    a, w, cu = _gg_args(layout, torch.float32, "cpu")
    out = torch.full((layout.nvs, layout.n), float("nan"))
    with torch.no_grad():
        moonep_ops.grouped_gemm(a, w, cu, out=out)
    assert torch.equal(out, moonep_ops.grouped_gemm(a.detach(), w.detach(), cu))
    # Plain tensors, grad mode on: allowed; the in-place write is visible to autograd's checks.
    version = out._version
    moonep_ops.grouped_gemm(a.detach(), w.detach(), cu, out=out)
    assert out._version > version and not out.requires_grad


# --- torch.compile(fullgraph=True) of forward + backward ----------------------------------------

def _recording_backend(graphs):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind):
        def compile_fn(gm, example_inputs):
            graphs.append((kind, gm.code))
            return make_boxed_func(gm.forward)
        return compile_fn

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


# Training paths of the expert layer: moonep_experts' two, and the training fused op composed
# by hand; each with the backward ops its compiled backward graph must show.
TRAINING_PATHS = {
    "saved": functools.partial(moonep_ops.moonep_experts, recompute=False),
    "recompute": functools.partial(moonep_ops.moonep_experts, recompute=True),
    "with_gate_up": experts_with_gate_up,
}
BACKWARD_GRAPH_OPS = {
    "saved": ("grouped_gemm_dgrad", "grouped_gemm_wgrad", "silu_mul_weight_backward", "grouped_gemm_dual_dgrad"),
    "recompute": ("grouped_gemm_dgrad", "grouped_gemm_wgrad", "grouped_gemm_silu_mul_backward",
                  "grouped_gemm_dual_dgrad"),
    "with_gate_up": ("grouped_gemm_dgrad", "grouped_gemm_wgrad", "silu_mul_weight_backward",
                     "grouped_gemm_dual_dgrad"),
}


@pytest.mark.parametrize("path", list(TRAINING_PATHS))
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_forward_backward_no_graph_break(backend, path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layout = next(lay for lay in LAYOUTS if lay.name == "empty_middle")
    graphs = []
    experts = TRAINING_PATHS[path]
    compiled = torch.compile(experts, fullgraph=True,
                             backend=_recording_backend(graphs) if backend == "aot_eager" else backend)
    for lay in (layout, dataclasses.replace(layout, sizes=(1, 6, 0, 2, 0, 3), nvs=15)):  # new NvS, routing
        args = _experts_args(True)(lay, torch.float32, "cpu")
        out = compiled(*args)
        grad_out = torch.randn_like(out)
        idx = _differentiable(args)
        grads = torch.autograd.grad(out, [args[i] for i in idx], grad_out)
        eager_args = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in args]
        eager_out = experts(*eager_args)
        eager_grads = torch.autograd.grad(eager_out, [eager_args[i] for i in idx], grad_out)
        assert rel_err(out.detach(), eager_out.detach().double()) <= 1e-6
        for g, e in zip(grads, eager_grads):
            assert rel_err(g, e.double()) <= 1e-6
        _check_grads(CASES[CASE_IDS.index("moonep_experts")], lay, torch.float32, args, idx, grads, grad_out)
    assert dict(counters["graph_break"]) == {}
    if graphs:
        backward = "\n".join(code for kind, code in graphs if kind == "backward")
        for name in BACKWARD_GRAPH_OPS[path]:
            assert f"moonep.{name}" in backward, f"{name} missing from the compiled backward graph"
        if path in ("saved", "with_gate_up"):
            # gate and up get no gradient of their own: no zeros materialized, nothing added.
            assert "aten.add" not in backward and "aten.zeros" not in backward, backward


# --- CUDA: capture a training step, replay with new routing and data -------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_weights", [True, False], ids=["route_weights", "no_weights"])
def test_training_step_cuda_graph_replay(with_weights):
    nvs = 640
    layout_a = Layout("capture_a", (128, 0, 256, 0, 128, 0), nvs, k=96, n=80)
    layout_b = Layout("capture_b", (0, 384, 0, 7, 0, 200), nvs, k=96, n=80)
    make = _experts_args(with_weights)
    args = make(layout_a, torch.bfloat16, "cuda")
    idx = _differentiable(args)
    grad_out = torch.randn(nvs, layout_a.k, device="cuda", dtype=torch.bfloat16)

    def step():
        out = moonep_ops.moonep_experts(*args)
        return torch.autograd.grad(out, [args[i] for i in idx], grad_out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the Triton kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = step()

    for layout in (layout_b, layout_a, layout_b):
        new = make(layout, torch.bfloat16, "cuda")
        new_grad_out = fill_tail_nan(torch.randn(nvs, layout.k, device="cuda").to(torch.bfloat16), layout.total)
        with torch.no_grad():
            for dst, src in zip(args, new):
                if dst is not None:
                    dst.copy_(src)
            grad_out.copy_(new_grad_out)
            for g in static_grads:
                g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.autograd.grad(moonep_ops.moonep_experts(*new), [new[i] for i in idx], new_grad_out)
        for g, e in zip(static_grads, eager):
            assert torch.equal(g, e), "replayed gradients differ from an eager step on the same inputs"
        _check_grads(CASES[-2] if with_weights else CASES[-1], layout, torch.bfloat16, new, idx,
                     static_grads, new_grad_out, _CHAIN_TOL[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_training_step_does_not_sync():
    layout = next(lay for lay in LAYOUTS if lay.name == "moonep_padded")
    args = _experts_args(True)(layout, torch.bfloat16, "cuda")
    idx = _differentiable(args)
    grad_out = torch.randn(layout.nvs, layout.k, device="cuda", dtype=torch.bfloat16)
    torch.autograd.grad(moonep_ops.moonep_experts(*args), [args[i] for i in idx], grad_out)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(moonep_ops.moonep_experts(*args), [args[i] for i in idx], grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_wgrad_large_sizes_no_int32_overflow():
    """NvS*K beyond 2**31 elements in the K-grouped kernel: 64-bit addressing."""
    if torch.cuda.mem_get_info()[0] < 12 * 2 ** 30:
        pytest.skip("needs 12 GiB of free GPU memory")
    nvs, k, n = 262144, 8320, 16
    sizes = [65536, 0, 131072, 65536 - 200]
    a = torch.randn(nvs, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(nvs, n, device="cuda", dtype=torch.bfloat16)
    assert a.numel() > 2 ** 31
    cu = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    last = sum(sizes)
    a[last:] = float("nan")
    dw = op("grouped_gemm_wgrad")(grad, a, cu)
    starts = [0, 65536, 65536, 196608]
    for g, (s, size) in enumerate(zip(starts, sizes)):
        if size == 0:
            assert torch.count_nonzero(dw[g]) == 0
            continue
        ref = grad[s:s + size].double().T @ a[s:s + size, -64:].double()  # last K columns: far addresses
        assert float((dw[g, :, -64:].double() - ref).norm() / ref.norm()) <= 1e-2


# --- the backward Triton kernels under TRITON_INTERPRET=1 ------------------------------------

@pytest.mark.subprocess_job("interpreter_backward")
def test_backward_triton_kernels_under_interpreter():
    # A subprocess (TRITON_INTERPRET must be set before Triton is imported), run in the background
    # beside the rest of the suite (tests/subprocess_jobs.py).
    pytest.importorskip("triton")
    if reason := subprocess_jobs.unusable("interpreter_backward"):
        pytest.skip(reason)
    returncode, output = subprocess_jobs.result("interpreter_backward")
    print(output[-4000:])
    assert returncode == 0, output[-12000:]
    last = output.strip().splitlines()[-1]
    assert " passed" in last and " skipped" not in last


# --- argument checks of the backward ops: eager and fake raise the same message --------------

def _bad_inputs():
    nvs, n, k, g = 8, 6, 5, 3
    cu = torch.tensor([3, 3, 6], dtype=torch.int32)
    rows = lambda cols, dtype=torch.float32: torch.randn(nvs, cols).to(dtype)  # noqa: E731
    w = torch.randn(g, n, k)
    return [
        ("grouped_gemm_dgrad", (rows(n + 1), w, cu), "N must match"),
        ("grouped_gemm_dgrad", (rows(n), w, cu[:2]), "cu_seqlens has 2 entries but w has G = 3"),
        ("grouped_gemm_dgrad", (rows(n, torch.bfloat16), w, cu), "w has dtype torch.float32 but grad_out"),
        ("grouped_gemm_dual_dgrad", (rows(n), rows(n + 1), w, w, cu), "grad_up has shape [8, 7] but grad_gate"),
        ("grouped_gemm_dual_dgrad", (rows(n), rows(n), w, w[:, :, :4], cu), "w_up has shape [3, 6, 4] but w_gate"),
        ("grouped_gemm_wgrad", (rows(n), torch.randn(nvs + 1, k), cu), "NvS must match"),
        ("grouped_gemm_wgrad", (rows(n), rows(k), cu.long()), "cu_seqlens must be int32"),
        ("silu_mul_weight_backward", (rows(n + 1), rows(n), rows(n), None, cu), "grad has shape [8, 7] but gate"),
        ("silu_mul_weight_backward", (rows(n), rows(n), rows(n), torch.rand(nvs - 1), cu),
         "route_weights must be [NvS] = [8]"),
        ("grouped_gemm_silu_mul_backward", (rows(n), rows(k), w, torch.randn(g, n, k + 1), None, cu),
         "w_up has shape [3, 6, 6] but w_gate has shape [3, 6, 5]"),
        ("grouped_gemm_silu_mul_backward", (rows(n + 1), rows(k), w, w, None, cu),
         "grad has shape [8, 7], expected [NvS, I] = [8, 6]"),
    ]


@pytest.mark.parametrize("mode", ["eager", "fake"])
@pytest.mark.parametrize("case", _bad_inputs(), ids=[f"{c[0]}-{i}" for i, c in enumerate(_bad_inputs())])
def test_backward_ops_reject_bad_input(case, mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, args, message = case
    if mode == "fake":
        fake = FakeTensorMode()
        args = tuple(fake.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args)
        with fake, pytest.raises(RuntimeError, match=f"moonep::{name}: .*{_re(message)}"):
            op(name)(*args)
    else:
        with pytest.raises(RuntimeError, match=f"moonep::{name}: .*{_re(message)}"):
            op(name)(*args)


def _re(text):
    import re
    return re.escape(text)


def test_bad_input_reads_the_same_with_grad():
    """Training takes the fused op that saves gate/up; its errors still name moonep_experts' arguments."""
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(LAYOUTS[0], torch.float32)
    messages = []
    for grad in (False, True):
        with pytest.raises(RuntimeError) as info:
            moonep_ops.moonep_experts(x.detach().requires_grad_(grad), w_gate, w_up[:, :-1], w_down, cu, rw)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "w_up" in messages[0], messages


# --- double backward: refused on every differentiable op and path ------------------------------

def _double_backward_inputs():
    """float64 ``(x, w_gate, w_up, w_down, route_weights, cu_seqlens)``, no tails: G=2, H=6, I=4."""
    x = torch.randn(8, 6, dtype=torch.float64)
    w_gate, w_up = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(2, 4, 6, dtype=torch.float64)
    w_down = torch.randn(2, 6, 4, dtype=torch.float64)
    return x, w_gate, w_up, w_down, torch.rand(8, dtype=torch.float64), torch.tensor([3, 7], dtype=torch.int32)


def _db_grouped_gemm(x, w_gate, w_up, w_down, rw, cu):
    return moonep_ops.grouped_gemm(x, w_gate, cu)


def _db_silu_mul_weight(x, w_gate, w_up, w_down, rw, cu):
    # gate and up from x and the weights by elementwise torch ops, so each "needs" set reaches them.
    return moonep_ops.silu_mul_weight(x[:, :4] * w_gate[0, :, 0], x[:, 2:] * w_up[0, :, 0], rw, cu)


def _db_grouped_gemm_silu_mul(x, w_gate, w_up, w_down, rw, cu):
    return moonep_ops.grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)


def _db_with_gate_up(x, w_gate, w_up, w_down, rw, cu):
    return moonep_ops.grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, rw, cu)[0]


def _db_experts(x, w_gate, w_up, w_down, rw, cu):
    return torch.ops.moonep.experts(x, w_gate, w_up, w_down, rw, cu)


def _db_moonep_experts(recompute):
    def run(x, w_gate, w_up, w_down, rw, cu):
        return moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw, recompute=recompute)
    return run


# (differentiable op, path) -> call over _double_backward_inputs(); every op in DIFFERENTIABLE_OPS
# needs at least one path here (test_every_differentiable_op_has_a_double_backward_entry).
DOUBLE_BACKWARD_PATHS = {
    ("grouped_gemm", "grouped_gemm"): _db_grouped_gemm,
    ("silu_mul_weight", "silu_mul_weight"): _db_silu_mul_weight,
    ("grouped_gemm_silu_mul", "grouped_gemm_silu_mul"): _db_grouped_gemm_silu_mul,
    ("grouped_gemm_silu_mul_with_gate_up", "grouped_gemm_silu_mul_with_gate_up"): _db_with_gate_up,
    ("grouped_gemm_silu_mul_with_gate_up", "moonep_experts"): _db_moonep_experts(False),
    ("grouped_gemm_silu_mul", "moonep_experts(recompute=True)"): _db_moonep_experts(True),
    ("experts", "torch.ops.moonep.experts"): _db_experts,
}
# "weights": w_gate, w_up, w_down and route_weights.
_NEEDS = {"x": (0,), "w_gate, w_up": (1, 2), "weights": (1, 2, 3, 4)}


_LOSSES = {"sum": lambda y: y.sum(), "square": lambda y: (y ** 2).sum()}


def _double_backward_error(path, needs, loss):
    """The error of a gradient penalty through ``path``, or "no error" when the first-order gradient
    is a constant (nothing it depends on requires grad: then no graph is owed)."""
    args = list(_double_backward_inputs())
    for i in _NEEDS[needs]:
        args[i].requires_grad_()
    diff = [t for t in args if t.requires_grad]
    y = DOUBLE_BACKWARD_PATHS[path](*args)
    try:
        grads = torch.autograd.grad(_LOSSES[loss](y), diff, create_graph=True, allow_unused=True)
    except RuntimeError as e:
        return str(e)
    assert not any(g is not None and g.requires_grad for g in grads)
    return "no error"


class TestDoubleBackward(expecttest.TestCase):
    def test_refused_on_every_op_and_path(self):
        lines = [f"{path[1]}, {needs} need grad, {loss} loss: {_double_backward_error(path, needs, loss)}"
                 for path in DOUBLE_BACKWARD_PATHS for needs in _NEEDS for loss in _LOSSES]
        text = "\n".join(lines).replace(" (create_graph=True through this op) is not supported; differentiate "
                                         "a first-order gradient only", "")
        self.assertExpectedInline(text, """\
grouped_gemm, x need grad, sum loss: no error
grouped_gemm, x need grad, square loss: moonep::grouped_gemm: double backward
grouped_gemm, w_gate, w_up need grad, sum loss: no error
grouped_gemm, w_gate, w_up need grad, square loss: moonep::grouped_gemm: double backward
grouped_gemm, weights need grad, sum loss: no error
grouped_gemm, weights need grad, square loss: moonep::grouped_gemm: double backward
silu_mul_weight, x need grad, sum loss: moonep::silu_mul_weight: double backward
silu_mul_weight, x need grad, square loss: moonep::silu_mul_weight: double backward
silu_mul_weight, w_gate, w_up need grad, sum loss: moonep::silu_mul_weight: double backward
silu_mul_weight, w_gate, w_up need grad, square loss: moonep::silu_mul_weight: double backward
silu_mul_weight, weights need grad, sum loss: moonep::silu_mul_weight: double backward
silu_mul_weight, weights need grad, square loss: moonep::silu_mul_weight: double backward
grouped_gemm_silu_mul, x need grad, sum loss: moonep::grouped_gemm_silu_mul: double backward
grouped_gemm_silu_mul, x need grad, square loss: moonep::grouped_gemm_silu_mul: double backward
grouped_gemm_silu_mul, w_gate, w_up need grad, sum loss: moonep::grouped_gemm_silu_mul: double backward
grouped_gemm_silu_mul, w_gate, w_up need grad, square loss: moonep::grouped_gemm_silu_mul: double backward
grouped_gemm_silu_mul, weights need grad, sum loss: moonep::grouped_gemm_silu_mul: double backward
grouped_gemm_silu_mul, weights need grad, square loss: moonep::grouped_gemm_silu_mul: double backward
grouped_gemm_silu_mul_with_gate_up, x need grad, sum loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
grouped_gemm_silu_mul_with_gate_up, x need grad, square loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
grouped_gemm_silu_mul_with_gate_up, w_gate, w_up need grad, sum loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
grouped_gemm_silu_mul_with_gate_up, w_gate, w_up need grad, square loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
grouped_gemm_silu_mul_with_gate_up, weights need grad, sum loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
grouped_gemm_silu_mul_with_gate_up, weights need grad, square loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
moonep_experts, x need grad, sum loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
moonep_experts, x need grad, square loss: moonep::grouped_gemm: double backward
moonep_experts, w_gate, w_up need grad, sum loss: moonep::grouped_gemm_silu_mul_with_gate_up: double backward
moonep_experts, w_gate, w_up need grad, square loss: moonep::grouped_gemm: double backward
moonep_experts, weights need grad, sum loss: moonep::grouped_gemm: double backward
moonep_experts, weights need grad, square loss: moonep::grouped_gemm: double backward
moonep_experts(recompute=True), x need grad, sum loss: moonep::grouped_gemm_silu_mul: double backward
moonep_experts(recompute=True), x need grad, square loss: moonep::grouped_gemm: double backward
moonep_experts(recompute=True), w_gate, w_up need grad, sum loss: moonep::grouped_gemm_silu_mul: double backward
moonep_experts(recompute=True), w_gate, w_up need grad, square loss: moonep::grouped_gemm: double backward
moonep_experts(recompute=True), weights need grad, sum loss: moonep::grouped_gemm: double backward
moonep_experts(recompute=True), weights need grad, square loss: moonep::grouped_gemm: double backward
torch.ops.moonep.experts, x need grad, sum loss: moonep::experts: double backward
torch.ops.moonep.experts, x need grad, square loss: moonep::experts: double backward
torch.ops.moonep.experts, w_gate, w_up need grad, sum loss: moonep::experts: double backward
torch.ops.moonep.experts, w_gate, w_up need grad, square loss: moonep::experts: double backward
torch.ops.moonep.experts, weights need grad, sum loss: moonep::experts: double backward
torch.ops.moonep.experts, weights need grad, square loss: moonep::experts: double backward""")

    def test_message(self):
        self.assertExpectedInline(_double_backward_error(("experts", "torch.ops.moonep.experts"), "x", "sum"), """moonep::experts: double backward (create_graph=True through this op) is not supported; differentiate a first-order gradient only""")


def test_every_differentiable_op_has_a_double_backward_entry():
    covered = {op_name for op_name, _ in DOUBLE_BACKWARD_PATHS}
    assert covered == set(DIFFERENTIABLE_OPS), set(DIFFERENTIABLE_OPS) ^ covered
    # Every other op is a backward op, an out variant, or inference only (the FP8 ops).
    out_variants = {n for n in SCHEMAS if n.endswith("_out")}
    differentiable = set(SCHEMAS) - set(BACKWARD_OPS) - out_variants - set(INFERENCE_ONLY_OPS)
    assert differentiable == set(DIFFERENTIABLE_OPS)
    assert not set(INFERENCE_ONLY_OPS) & set(DIFFERENTIABLE_OPS)


def test_inference_only_ops_have_their_refusing_autograd_kernel():
    """Without an Autograd kernel an op called with grad-requiring inputs would return outputs
    silently cut from the graph; tests/test_fp8.py checks the refusal itself."""
    assert set(INFERENCE_ONLY_OPS) <= set(SCHEMAS)
    for name in INFERENCE_ONLY_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"moonep::{name}", "Autograd"), name


@pytest.mark.parametrize("path", list(DOUBLE_BACKWARD_PATHS), ids=[p[1] for p in DOUBLE_BACKWARD_PATHS])
def test_first_order_backward_in_grad_mode_still_works(path):
    """A plain backward runs with grad mode off even when called in grad mode: not refused, and
    float64 gradcheck of the first-order gradient passes."""
    args = list(_double_backward_inputs())
    idx = (0, 1, 2, 3, 4)
    fn = DOUBLE_BACKWARD_PATHS[path]

    def call(*diff):
        full = list(args)
        for i, t in zip(idx, diff):
            full[i] = t
        return fn(*full)

    diff = [args[i].clone().requires_grad_() for i in idx]
    with torch.enable_grad():
        call(*diff).sum().backward()
    assert any(t.grad is not None for t in diff)
    assert torch.autograd.gradcheck(call, diff, fast_mode=True)
