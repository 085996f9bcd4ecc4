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


# The Gluon kernels (sm90): where the ops send each GEMM. CPU tensors with the capability forced;
# the Gluon launcher is recorded, not run.

def _gluon_or_skip():
    if not cuda._gluon_importable():
        pytest.skip("this Triton has no usable Gluon")


@pytest.fixture
def on_sm90(monkeypatch, recorded):
    _gluon_or_skip()
    from moonep_ops.kernels import gluon_grouped_gemm

    monkeypatch.setattr(cuda, "capability_of", lambda t: (9, 0))
    gluon_calls = []

    def run_gluon_gemm(a, w, w_up, rw, cu, out, choose, zero_tail=True, pdl="", idle_weights=None, tail_out=None,
                       sched=None, flag_target=0):
        cfg = choose(a, w, w_up, out)
        if cfg is None:
            return False
        gluon_calls.append((w_up is not None, zero_tail, pdl, cfg, rw, idle_weights, sched, flag_target))
        return True

    monkeypatch.setattr(gluon_grouped_gemm, "run_gluon_gemm", run_gluon_gemm)
    for var in ("MOONEP_OPS_GLUON", "MOONEP_OPS_PORTABLE", "MOONEP_OPS_NO_PDL"):
        monkeypatch.delenv(var, raising=False)
    return gluon_calls, recorded


def _experts_bf16(h=64, i=32, g=3, nvs=20):
    x = torch.randn(nvs, h, dtype=torch.bfloat16)
    cu = torch.tensor([5, 9, 14], dtype=torch.int32)
    ws = [torch.randn(g, i, h, dtype=torch.bfloat16), torch.randn(g, i, h, dtype=torch.bfloat16),
          torch.randn(g, h, i, dtype=torch.bfloat16)]
    cuda.experts_into(x, *ws, None, cu, torch.empty(nvs, h, dtype=torch.bfloat16))


def test_experts_on_sm90_takes_the_gluon_kernels_with_pdl(on_sm90):
    gluon_calls, triton_calls = on_sm90
    _experts_bf16()
    assert [call[:3] for call in gluon_calls] == [(True, False, "primary"), (False, True, "dependent")]
    assert triton_calls == []


def test_experts_hands_off_row_tiles_only_where_the_fused_config_asks(on_sm90, monkeypatch):
    """The row-tile handoff: one zeroed state buffer for both GEMMs of a call, the down GEMM told the
    flag target (each of the fused GEMM's column tiles, 256 threads); by default (the table's
    configs for this small problem) no handoff."""
    import dataclasses

    from moonep_ops.kernels import configs as cfgs

    gluon_calls, _ = on_sm90
    _experts_bf16()
    assert [call[6:] for call in gluon_calls] == [(None, 0), (None, 0)]
    table = cfgs.gluon_gemm_config
    monkeypatch.setattr(cfgs, "gluon_gemm_config", lambda n, k, rows, fused: dataclasses.replace(
        table(n, k, rows, fused), **(dict(handoff=True, pingpong=False, block_n=128) if fused else {})))
    monkeypatch.setattr(cuda, "_HANDOFF", {})
    gluon_calls.clear()
    _experts_bf16()
    (_, _, _, _, _, _, fused_sched, _), (_, _, _, _, _, _, down_sched, target) = gluon_calls
    assert fused_sched is down_sched and fused_sched is not None
    assert fused_sched.dtype == torch.int32 and not fused_sched.any()
    assert fused_sched.numel() == 1 + triton_grouped_gemm.num_row_tiles(20, 3, 128)
    assert target == 1 * 256  # I = 32: one 128-column tile, 8 warps


def test_experts_down_gemm_gets_the_route_weights_as_idle_rows(on_sm90):
    """The down GEMM learns which rows of ``act`` are zero (route weight 0: MoonEP's padding) from
    the route weights the fused GEMM applied, so that both skip the same idle upper halves; the
    unfused path's plain GEMMs get none."""
    gluon_calls, _ = on_sm90
    g, h, i, nvs = 3, 64, 32, 20
    x = torch.randn(nvs, h, dtype=torch.bfloat16)
    cu = torch.tensor([5, 9, 14], dtype=torch.int32)
    rw = torch.rand(nvs)
    ws = [torch.randn(g, i, h, dtype=torch.bfloat16), torch.randn(g, i, h, dtype=torch.bfloat16),
          torch.randn(g, h, i, dtype=torch.bfloat16)]
    cuda.experts_into(x, *ws, rw, cu, torch.empty(nvs, h, dtype=torch.bfloat16))
    (_, _, _, _, fused_rw, fused_idle, _, _), (_, _, _, _, down_rw, down_idle, _, _) = gluon_calls
    assert fused_rw is rw and fused_idle is None
    assert down_rw is None and down_idle is rw
    gluon_calls.clear()
    cuda.grouped_gemm_into(x, ws[0], cu, torch.empty(nvs, i, dtype=torch.bfloat16))
    assert [call[4:6] for call in gluon_calls] == [(None, None)]


def test_gluon_pair_without_pdl(on_sm90, monkeypatch):
    gluon_calls, _ = on_sm90
    monkeypatch.setenv("MOONEP_OPS_NO_PDL", "1")
    _experts_bf16()
    assert [call[:3] for call in gluon_calls] == [(True, False, ""), (False, True, "")]


def test_gluon_fused_then_triton_down_is_asked_for_the_pdl_pair(on_sm90):
    """``w_down`` rows TMA cannot address (72-byte row stride): the down GEMM takes the Triton
    kernel and is asked to be the dependent of the Gluon fused GEMM right before it (the Triton
    launcher's pointer path drops the role and launches plainly, which is always safe)."""
    gluon_calls, triton_calls = on_sm90
    g, h, i, nvs = 3, 64, 32, 20
    x = torch.randn(nvs, h, dtype=torch.bfloat16)
    cu = torch.tensor([5, 9, 14], dtype=torch.int32)
    w_down = torch.randn(g, h, i + 4, dtype=torch.bfloat16)[:, :, :i]
    cuda.experts_into(x, torch.randn(g, i, h, dtype=torch.bfloat16), torch.randn(g, i, h, dtype=torch.bfloat16),
                      w_down, None, cu, torch.empty(nvs, h, dtype=torch.bfloat16))
    assert [call[:3] for call in gluon_calls] == [(True, False, "primary")]
    assert triton_calls == [(False, "dependent")]


def test_gluon_switch_off_gives_the_triton_pair_with_pdl(on_sm90, monkeypatch):
    gluon_calls, triton_calls = on_sm90
    monkeypatch.setenv("MOONEP_OPS_GLUON", "0")
    _experts_bf16()
    assert gluon_calls == [] and triton_calls == [(True, "primary"), (False, "dependent")]


def test_operands_tma_cannot_address_take_the_triton_kernels(on_sm90):
    """H = 60: 120-byte rows, not a multiple of 16 bytes; fp32: never the Gluon kernels."""
    gluon_calls, triton_calls = on_sm90
    _experts_bf16(h=60)
    assert gluon_calls == [] and triton_calls == [(True, "primary"), (False, "dependent")]
    x, w, cu = torch.randn(20, 64), torch.randn(3, 32, 64), torch.tensor([5, 9, 14], dtype=torch.int32)
    cuda.grouped_gemm_into(x, w, cu, torch.empty(20, 32))
    assert gluon_calls == [] and triton_calls[-1] == (False, "")


def test_gluon_usable_reads_metadata_only(monkeypatch):
    _gluon_or_skip()
    for var in ("MOONEP_OPS_GLUON", "MOONEP_OPS_PORTABLE"):
        monkeypatch.delenv(var, raising=False)
    a = torch.randn(256, 64, dtype=torch.bfloat16)
    w = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    out = torch.empty(256, 32, dtype=torch.bfloat16)
    assert cuda._gluon_usable((9, 0), a, out, w)
    assert not cuda._gluon_usable((10, 0), a, out, w)  # no wgmma on Blackwell
    assert not cuda._gluon_usable((8, 0), a, out, w)
    assert not cuda._gluon_usable((9, 0), a.float(), out.float(), w.float())
    assert not cuda._gluon_usable((9, 0), a[:, :0], out, w[:, :, :0])  # K = 0
    odd = torch.randn(256, 68, dtype=torch.bfloat16)[:, :64]  # 136-byte rows
    assert not cuda._gluon_usable((9, 0), odd, out, w)
    monkeypatch.setenv("MOONEP_OPS_GLUON", "0")
    assert not cuda._gluon_usable((9, 0), a, out, w)
    monkeypatch.setenv("MOONEP_OPS_GLUON", "1")
    monkeypatch.setenv("MOONEP_OPS_PORTABLE", "1")
    assert not cuda._gluon_usable((9, 0), a, out, w)


def test_self_check_names_the_kernel_path(monkeypatch):
    """``python -m moonep_ops`` reports which forward kernels the device takes."""
    from moonep_ops.__main__ import _kernel_path

    for var in ("MOONEP_OPS_GLUON", "MOONEP_OPS_PORTABLE", "MOONEP_OPS_NO_PDL"):
        monkeypatch.delenv(var, raising=False)
    gpu = torch.device("cuda")
    assert _kernel_path(torch.device("cpu"), torch.float32).startswith("CPU kernels")
    assert _kernel_path(gpu, torch.bfloat16, (8, 0)) == "portable Triton kernels"
    assert _kernel_path(gpu, torch.float32, (9, 0)) == "portable Triton kernels"
    if cuda._gluon_importable():
        assert "Gluon" in _kernel_path(gpu, torch.bfloat16, (9, 0))
    monkeypatch.setenv("MOONEP_OPS_GLUON", "0")
    assert _kernel_path(gpu, torch.bfloat16, (9, 0)) == "Triton kernels with TMA loads"


def test_gluon_launcher_refuses_an_unknown_pdl_role():
    _gluon_or_skip()
    from moonep_ops.kernels import gluon_grouped_gemm

    a, w = torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(2, 64, 64, dtype=torch.bfloat16)
    cu = torch.tensor([100, 200], dtype=torch.int32)
    with pytest.raises(ValueError, match="pdl must be one of"):
        gluon_grouped_gemm.run_gluon_gemm(a, w, None, None, cu, torch.empty(256, 64, dtype=torch.bfloat16),
                                          lambda *args: None, pdl="yes")


def test_empty_reduction_takes_no_tma():
    """K = 0: a TMA descriptor needs every extent > 0 (the Triton kernel built one and failed
    on the H200, eleventh session); the pointer path computes the zeros."""
    a, w = torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(2, 64, 64, dtype=torch.bfloat16)
    assert triton_grouped_gemm.tma_usable(a, w)
    assert not triton_grouped_gemm.tma_usable(a[:, :0], w[:, :, :0])
    assert not cuda._use_tma((9, 0), a[:, :0], w[:, :, :0])
    w_kn = torch.empty(2, 64, 64, dtype=torch.bfloat16).transpose(1, 2)  # the dgrad's transposed view
    assert triton_grouped_gemm.tma_usable_kn(a, w_kn, 64)
    assert not triton_grouped_gemm.tma_usable_kn(a[:0], w_kn[:0], 64)


def test_down_gemm_zeroes_the_tail_unless_the_fused_gemm_took_it(monkeypatch):
    """The experts op's output tail is zeroed exactly once: by the fused Gluon GEMM when its config
    takes it (``run_gluon_gemm`` answers ``TOOK_TAIL``), else by the down GEMM, on whichever
    kernel that runs (a Triton down GEMM after a Gluon fused one included)."""
    _gluon_or_skip()
    from moonep_ops.kernels import gluon_grouped_gemm

    monkeypatch.setattr(cuda, "capability_of", lambda t: (9, 0))
    for var in ("MOONEP_OPS_GLUON", "MOONEP_OPS_PORTABLE", "MOONEP_OPS_NO_PDL"):
        monkeypatch.delenv(var, raising=False)
    for takes, down_on_gluon in ((True, True), (False, True), (True, False)):
        calls = []

        def run_gluon_gemm(a, w, w_up, rw, cu, out, choose, zero_tail=True, pdl="", idle_weights=None,
                           tail_out=None, sched=None, flag_target=0):
            if w_up is None and not down_on_gluon:
                return False
            calls.append(("gluon", w_up is not None, zero_tail, tail_out is not None))
            return gluon_grouped_gemm.TOOK_TAIL if w_up is not None and takes and tail_out is not None else True

        monkeypatch.setattr(gluon_grouped_gemm, "run_gluon_gemm", run_gluon_gemm)
        monkeypatch.setattr(triton_grouped_gemm, "run_moe_gemm",
                            lambda a, w, w_up, *args, zero_tail=True, pdl="", **kw:
                            calls.append(("triton", w_up is not None, zero_tail, False)))
        _experts_bf16()
        down = "gluon" if down_on_gluon else "triton"
        assert calls == [("gluon", True, False, True), (down, False, not takes, False)], (takes, down_on_gluon)
