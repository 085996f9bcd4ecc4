"""What the ``experts`` op asks of the GEMM launcher (CPU: the launcher is recorded, not run)."""

import pytest
import torch

from moonep_ops.kernels import cuda, triton_grouped_gemm


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_grouped_gemm, "run_moe_gemm",
                        lambda a, w, w_up, *args, pdl="", **kw: calls.append((w_up is not None, pdl)))
    return calls


def _experts(h=32, i=16, g=3, nvs=20):
    x = torch.randn(nvs, h)
    cu = torch.tensor([5, 9, 14], dtype=torch.int32)
    cuda.experts_into(x, torch.randn(g, i, h), torch.randn(g, i, h), torch.randn(g, h, i), None, cu,
                      torch.empty(nvs, h))


def test_experts_pairs_its_gemms_as_primary_and_dependent(recorded, monkeypatch):
    monkeypatch.delenv("MOONEP_OPS_NO_PDL", raising=False)
    _experts()
    assert recorded == [(True, "primary"), (False, "dependent")]


def test_no_pdl_switch(recorded, monkeypatch):
    monkeypatch.setenv("MOONEP_OPS_NO_PDL", "1")
    _experts()
    assert recorded == [(True, ""), (False, "")]


def test_no_dependent_without_a_fused_launch(recorded, monkeypatch):
    """I = 0: the fused GEMM launches nothing, so the down GEMM would follow an unknown kernel."""
    monkeypatch.delenv("MOONEP_OPS_NO_PDL", raising=False)
    _experts(i=0)
    assert recorded == [(True, ""), (False, "")]
