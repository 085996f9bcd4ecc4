"""The Triton kernels' config tables (``moonep_ops.kernels.triton.configs``) where they depend on
the installed Triton: automatic warp specialization only where that release compiles it (the
AOT compile check, ``tests/test_aot_compile.py``, compiles the picks themselves)."""

import pytest
import torch

from moonep_ops.kernels.triton import configs

ROWS = 45056  # kimi-k2 prefill's NvS: its GEMMs are warp-specialized on sm90


@pytest.mark.parametrize("release", [(3, 6), (3, 7), (3, 8)])
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_warp_specialization_only_where_the_release_compiles_it(monkeypatch, release, capability):
    monkeypatch.setattr(configs, "triton_release", lambda: release)
    expected = capability == (9, 0) or release >= (3, 7)
    plain = configs.gemm_config(2048, 7168, ROWS, torch.bfloat16, capability)
    fused = configs.fused_gemm_config(2048, 7168, ROWS, torch.bfloat16, capability)
    assert plain.warp_specialize is expected and fused.warp_specialize is expected
    if not expected:  # the next rules of the table, as on problems below its warp-specialized size
        assert plain == configs.gemm_config(2048, 7168, 8192, torch.bfloat16, capability)
        assert fused == configs.fused_gemm_config(2048, 7168, 8192, torch.bfloat16, capability)


def test_the_release_is_read_from_triton():
    triton = pytest.importorskip("triton")
    assert configs.triton_release() == tuple(int(p) for p in triton.__version__.split(".")[:2])
