"""Where vLLM 0.33's composition (three torch._grouped_mm + eager silu/mul) breaks, next to moonep.

The shared suites (test_compile, test_dynamic, test_fx_graph, test_cuda_graphs) run the composition
where it works; these tests pin down, as observed behaviour, the places where it does not. If a torch
release fixes one, its test fails and docs/compile.md needs updating.
"""

import pytest
import torch

import moonep_ops
from tests.reference import TOLERANCE, experts_ref, grouped_gemm_ref, rel_err

from . import vllm_composition
from .cases import GROUPED_MM_CPU, experts_inputs
from .conftest import CUDA_MARKS, DEVICES, sync_errors
from .moe import MoEShape

SHAPE = MoEShape()


def _needs_grouped_mm(device):
    if device == "cpu" and not GROUPED_MM_CPU:
        pytest.skip("no torch._grouped_mm on CPU in this torch")


def _on_poisoned_block(fn, rows, cols, dtype, device, attempts=10):
    """Run ``fn`` right after freeing a NaN block of the size of its output, so that the allocator
    (glibc or the CUDA caching allocator) is likely to hand that block back for the output.
    Returns the output, or None when the allocator never reused the block."""
    for _ in range(attempts):
        poison = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
        ptr = poison.data_ptr()
        del poison
        out = fn()
        if out.data_ptr() == ptr:
            return out
    return None


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mm_leaves_tail_rows_unwritten(device):
    """torch._grouped_mm never writes rows past offs[-1] (vLLM's docstring says zero-filled)."""
    _needs_grouped_mm(device)
    a = torch.randn(40, 32, device=device).to(torch.bfloat16)
    w = (torch.randn(4, 24, 32, device=device) / 32 ** 0.5).to(torch.bfloat16)
    cu = torch.tensor([5, 5, 17, 25], dtype=torch.int32, device=device)
    out = _on_poisoned_block(lambda: vllm_composition.grouped_mm(a, w, cu), 40, 24, torch.bfloat16,
                             device)
    if out is None:
        pytest.skip("the allocator did not hand back the poisoned block; not observable here")
    assert rel_err(out[:25], grouped_gemm_ref(a, w, cu)[:25]) <= TOLERANCE[torch.bfloat16]
    assert torch.isnan(out[25:]).all(), "tail rows were written: torch changed, update the docs"


@pytest.mark.parametrize("device", DEVICES)
def test_moonep_zeroes_tail_rows_on_a_poisoned_block(device):
    """The same trap for moonep_ops.grouped_gemm: its tail comes out zero."""
    a = torch.randn(40, 32, device=device).to(torch.bfloat16)
    w = (torch.randn(4, 24, 32, device=device) / 32 ** 0.5).to(torch.bfloat16)
    cu = torch.tensor([5, 5, 17, 25], dtype=torch.int32, device=device)
    out = _on_poisoned_block(lambda: moonep_ops.grouped_gemm(a, w, cu), 40, 24, torch.bfloat16,
                             device)
    if out is None:
        out = moonep_ops.grouped_gemm(a, w, cu)
    assert rel_err(out[:25], grouped_gemm_ref(a, w, cu)[:25]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[25:], torch.zeros_like(out[25:]))


def test_grouped_mm_compile_rejects_fp32(fresh_dynamo):
    """Eager CPU runs an fp32 composition, but torch._grouped_mm's meta takes bf16 only, so
    torch.compile fails; moonep_experts compiles fp32 (test_compile.py)."""
    _needs_grouped_mm("cpu")
    inputs = experts_inputs(SHAPE, torch.float32)
    live = int(inputs[4][-1])
    eager = vllm_composition.grouped_mm_experts(*inputs)
    assert rel_err(eager[:live], experts_ref(*inputs)[:live]) <= TOLERANCE[torch.float32]
    compiled = torch.compile(vllm_composition.grouped_mm_experts, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="BF16|BFloat16"):
        compiled(*inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mm_rejects_unaligned_rows(device):
    """Row strides must be multiples of 16 bytes (bf16 H = 36 is 72 bytes); moonep takes any size."""
    _needs_grouped_mm(device)
    shape = MoEShape(hidden=36)
    inputs = experts_inputs(shape, torch.bfloat16, device)
    with pytest.raises(RuntimeError, match="16 bytes"):
        vllm_composition.grouped_mm_experts(*inputs)
    live = int(inputs[4][-1].item())
    out = moonep_ops.moonep_experts(*inputs)
    assert rel_err(out[:live], experts_ref(*inputs)[:live]) <= TOLERANCE[torch.bfloat16]


def _fast_path(dtype) -> bool:
    """torch._grouped_mm's sync-free CUTLASS path: bf16 on sm90 / sm100 only."""
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] in (9, 10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=CUDA_MARKS)])
def test_grouped_mm_fallback_syncs(_, dtype):
    """Off the fast path, torch._grouped_mm copies offs to the host: a sync, so no CUDA graph."""
    inputs = experts_inputs(MoEShape(hidden=64, inter=32), dtype, "cuda")
    vllm_composition.grouped_mm_experts(*inputs)  # warm-up (cuBLAS handles, workspaces)
    moonep_ops.moonep_experts(*inputs)
    torch.cuda.synchronize()
    if _fast_path(dtype):
        with sync_errors():
            vllm_composition.grouped_mm_experts(*inputs)
    else:
        with pytest.raises(RuntimeError, match="synchroniz"), sync_errors():
            vllm_composition.grouped_mm_experts(*inputs)
    with sync_errors():  # moonep never syncs, whatever the dtype or GPU
        moonep_ops.moonep_experts(*inputs)
    torch.cuda.synchronize()
