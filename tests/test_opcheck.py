"""``torch.library.opcheck`` on every op over the whole layout matrix, with its default checks.

opcheck checks the registration (schema and alias annotations, autograd registration, fake
impl against the real kernel's sizes/strides/dtype/device, AOT dispatch with dynamic shapes);
it checks no maths: tests/test_numerics.py does that against float64 references.

The inputs are the numerics tests' own: NaN in every tail row (and in ``out`` for the ``_out``
op). opcheck copes as is: the outputs it compares hold no NaN (tails come out zero), and
its mutation check compares inputs with ``allclose(equal_nan=True)``. No input requires grad
here: tests/test_autograd.py opchecks the differentiable ops with grad-requiring inputs (on
fewer layouts, as backward doubles the cost) and the backward ops.
"""

import pytest
import torch

from moonep_ops import fp8
from moonep_ops.schemas import SCHEMAS

from .conftest import DEVICES
from .layouts import LAYOUTS, Layout, experts_inputs, fp8_experts_inputs, grouped_gemm_inputs, silu_mul_weight_inputs

# The checks opcheck runs by default; all of them must run and pass.
DEFAULT_CHECKS = {"test_schema", "test_autograd_registration", "test_faketensor",
                  "test_aot_dispatch_dynamic"}

# Op case -> the op it checks; an op with optional route weights is checked with and without.
OP_CASES = {
    "grouped_gemm": "grouped_gemm",
    "grouped_gemm_out": "grouped_gemm_out",
    "silu_mul_weight": "silu_mul_weight",
    "silu_mul_weight_no_weights": "silu_mul_weight",
    "grouped_gemm_silu_mul": "grouped_gemm_silu_mul",
    "grouped_gemm_silu_mul_no_weights": "grouped_gemm_silu_mul",
    "grouped_gemm_silu_mul_with_gate_up": "grouped_gemm_silu_mul_with_gate_up",
    "grouped_gemm_silu_mul_with_gate_up_no_weights": "grouped_gemm_silu_mul_with_gate_up",
    "experts": "experts",
    "experts_no_weights": "experts",
    "experts_out": "experts_out",
}

# fp32 over every layout; bf16 (the MoonEP dtype) on the MoonEP-shaped and the odd-sized ones.
_BF16_LAYOUTS = {"moonep_padded", "empty_middle", "k1001_n300"}
CASES = [pytest.param(layout, torch.float32, id=f"{layout.name}-fp32") for layout in LAYOUTS] + [
    pytest.param(layout, torch.bfloat16, id=f"{layout.name}-bf16")
    for layout in LAYOUTS if layout.name in _BF16_LAYOUTS
]


def _sample(case, layout, dtype, device):
    """The op overload and its positional arguments."""
    op = getattr(torch.ops.moonep, OP_CASES[case]).default
    with_weights = not case.endswith("_no_weights")
    if case in ("grouped_gemm", "grouped_gemm_out"):
        a, w, cu = grouped_gemm_inputs(layout, dtype, device)
        if case == "grouped_gemm":
            return op, (a, w, cu)
        out = torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype, device=device)
        return op, (a, w, cu, out)
    if case.startswith("silu_mul_weight"):
        gate, up, rw, cu = silu_mul_weight_inputs(layout, dtype, device, with_weights=with_weights)
        return op, (gate, up, rw, cu)
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, dtype, device, with_weights=with_weights)
    if case.startswith("experts"):
        if case == "experts_out":
            return op, (x, w_gate, w_up, w_down, rw, cu, torch.full_like(x, float("nan")))
        return op, (x, w_gate, w_up, w_down, rw, cu)
    return op, (x, w_gate, w_up, rw, cu)


def test_every_op_has_cases():
    # The backward ops are opchecked, with grad-requiring inputs, in test_autograd.py.
    from .test_autograd import BACKWARD_OPS
    covered = set(OP_CASES.values()) | set(FP8_OP_CASES.values()) | set(BACKWARD_OPS)
    assert covered >= set(SCHEMAS), f"no opcheck cases for {sorted(set(SCHEMAS) - covered)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(OP_CASES))
@pytest.mark.parametrize("layout,dtype", CASES)
def test_opcheck(layout, dtype, case, device):
    op, args = _sample(case, layout, dtype, device)
    results = torch.library.opcheck(op, args)  # raises on the first failing check
    assert DEFAULT_CHECKS <= set(results), f"opcheck ran only {sorted(results)}"
    assert all(r == "SUCCESS" for r in results.values()), results


# The FP8 ops: bf16/fp16 activations only, e4m3fn weights with their block scales; opcheck's
# test_schema cannot compare float8 tensors, so _check_schema_bitwise checks the same.
FP8_OP_CASES = {
    "grouped_gemm_fp8": "grouped_gemm_fp8",
    "grouped_gemm_fp8_out": "grouped_gemm_fp8_out",
    "experts_fp8": "experts_fp8",
    "experts_fp8_no_weights": "experts_fp8",
    "experts_fp8_out": "experts_fp8_out",
}
# Block-major weights ([G, N/128, K/128, 128, 128]) need H and I multiples of 128.
BLOCK_MAJOR = Layout("block_major", (70, 0, 9), 90, k=256, n=128)
FP8_CASES = [pytest.param(layout, torch.bfloat16, id=f"{layout.name}-bf16") for layout in LAYOUTS] + [
    pytest.param(layout, torch.float16, id=f"{layout.name}-fp16")
    for layout in LAYOUTS if layout.name == "moonep_padded"
] + [pytest.param(BLOCK_MAJOR, torch.bfloat16, id="block_major-bf16")]


def _fp8_sample(case, layout, dtype, device):
    op = getattr(torch.ops.moonep, FP8_OP_CASES[case]).default
    x, gate, up, down, cu, rw = fp8_experts_inputs(layout, dtype, device, with_weights=not case.endswith("_no_weights"))
    if layout is BLOCK_MAJOR:
        gate, up, down = ((fp8.to_block_major(w), scale) for w, scale in (gate, up, down))
    if case.startswith("grouped_gemm"):
        args = (x, *gate, cu)  # x [NvS, H] against w_gate [G, I, H]
        if case.endswith("_out"):
            args += (torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype, device=device),)
        return op, args
    args = (x, *gate, *up, *down, rw, cu)
    if case.endswith("_out"):
        args += (torch.full_like(x, float("nan")),)
    return op, args


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _check_schema_bitwise(op, args) -> None:
    """What opcheck's test_schema checks, compared bitwise: its before/after comparison of the
    inputs uses allclose, which has no float8 kernel. Only the arguments the schema marks as
    written may change, and a returned tensor shares no memory with any argument."""
    arguments = op._schema.arguments
    written = {a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write}
    tensors = {a.name: t for a, t in zip(arguments, args) if isinstance(t, torch.Tensor)}
    before = {name: _bytes(t) for name, t in tensors.items()}
    result = op(*args)
    for name, t in tensors.items():
        unchanged = torch.equal(_bytes(t), before[name])
        if name in written:
            assert not unchanged or t.numel() == 0, f"{name} is marked written but was not"
        else:
            assert unchanged, f"{name} changed but the schema does not mark it written"
    if isinstance(result, torch.Tensor) and result.numel():
        assert not any(t.numel() and torch._C._overlaps(result, t) for t in tensors.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(FP8_OP_CASES))
@pytest.mark.parametrize("layout,dtype", FP8_CASES)
def test_opcheck_fp8(layout, dtype, case, device):
    op, args = _fp8_sample(case, layout, dtype, device)
    checks = sorted(DEFAULT_CHECKS - {"test_schema"})
    results = torch.library.opcheck(op, args, test_utils=checks)
    assert set(checks) <= set(results), f"opcheck ran only {sorted(results)}"
    assert all(r == "SUCCESS" for r in results.values()), results
    _check_schema_bitwise(op, args)


# opcheck compares a fake's strides on CPU tensors from torch 2.13 on (pytorch/pytorch#183002);
# before, on CUDA tensors only.
_STRIDES_CHECKED_ON_CPU = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def test_opcheck_catches_a_wrong_fake():
    """opcheck is only worth running if it notices a fake that lies: one with wrong strides."""
    if _STRIDES_CHECKED_ON_CPU:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        pytest.skip("this torch's opcheck compares strides on CUDA tensors only, and there is no GPU")
    lib = torch.library.Library("moonep_opcheck_selftest", "FRAGMENT")
    try:
        lib.define("gg(Tensor a, Tensor w, Tensor cu_seqlens) -> Tensor")
        for key in ("CPU", "CUDA"):
            lib.impl("gg", torch.ops.moonep.grouped_gemm.default, key)

        @torch.library.register_fake("moonep_opcheck_selftest::gg", lib=lib)
        def _(a, w, cu_seqlens):
            return a.new_empty((w.shape[1], a.shape[0])).t()  # transposed: not the kernel's strides

        layout = next(layout for layout in LAYOUTS if layout.name == "unpadded")
        results = torch.library.opcheck(torch.ops.moonep_opcheck_selftest.gg.default,
                                        grouped_gemm_inputs(layout, device=device), raise_exception=False)
    finally:
        lib._destroy()  # unregister, so a rerun in the same process can define it again
    assert results["test_schema"] == "SUCCESS"
    assert results["test_faketensor"] != "SUCCESS"
    assert "stride" in str(results["test_faketensor"]).lower()


def test_bitwise_schema_check_catches_an_undeclared_write():
    """_check_schema_bitwise is only worth running if it notices a kernel that writes an input its
    schema does not mark as written (here: the FP8 weight)."""
    lib = torch.library.Library("moonep_schema_selftest", "FRAGMENT")
    try:
        lib.define("scale_in_place(Tensor a, Tensor w) -> Tensor")

        def writes_w(a, w):
            w.view(torch.uint8).add_(1)
            return a.clone()

        lib.impl("scale_in_place", writes_w, "CPU")
        op = torch.ops.moonep_schema_selftest.scale_in_place.default
        w = torch.randn(2, 3).to(torch.float8_e4m3fn)
        with pytest.raises(AssertionError, match="w changed but the schema does not mark it written"):
            _check_schema_bitwise(op, (torch.randn(2, 3), w))
    finally:
        lib._destroy()
