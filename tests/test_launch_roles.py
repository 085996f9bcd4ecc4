"""What the CUDA ops ask of the GEMM launchers: kernel, PDL role, handoff, tail (CPU: the launchers
are recorded, not run; the device capability is forced where a test needs sm90)."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")  # (the Triton kernels' module below imports it)

from moonep_ops.kernels.cuda import experts, paths  # noqa: E402
from moonep_ops.kernels.pdl import PdlRole  # noqa: E402
from moonep_ops.kernels.triton import grouped_gemm as triton_gemm  # noqa: E402

NONE, PRIMARY, DEPENDENT = PdlRole.NONE, PdlRole.PRIMARY, PdlRole.DEPENDENT
DEFAULTS = dict(GLUON=None, PORTABLE=None, PDL=None)  # every kernel switch at its default


@pytest.fixture
def recorded(monkeypatch, switches):
    """The Triton launcher's calls: (fused, role)."""
    calls = []
    monkeypatch.setattr(triton_gemm, "run",
                        lambda a, w, w_up, *args, role=NONE, **kw: calls.append((w_up is not None, role)))
    switches(**DEFAULTS)
    return calls


def _experts(h=32, i=16, g=3, nvs=20, dtype=torch.float32, route_weights=None, w_down=None):
    x = torch.randn(nvs, h, dtype=dtype)
    cu = torch.tensor([5, 9, 14], dtype=torch.int32)
    w_down = torch.randn(g, h, i, dtype=dtype) if w_down is None else w_down
    experts.experts_into(x, torch.randn(g, i, h, dtype=dtype), torch.randn(g, i, h, dtype=dtype), w_down,
                         route_weights, cu, torch.empty(nvs, h, dtype=dtype))


def test_experts_pairs_its_gemms_as_primary_and_dependent(recorded):
    _experts()
    assert recorded == [(True, PRIMARY), (False, DEPENDENT)]


def test_pdl_switch_off(recorded, switches):
    switches(PDL="0")
    _experts()
    assert recorded == [(True, NONE), (False, NONE)]


def test_no_dependent_without_a_fused_launch(recorded):
    """I = 0: the fused GEMM launches nothing, so the down GEMM would follow an unknown kernel."""
    _experts(i=0)
    assert recorded == [(True, NONE), (False, NONE)]


# The Gluon kernel (sm90): where the ops send each GEMM. CPU tensors with the capability forced;
# the Gluon launcher is recorded, not run.

def _gluon_or_skip():
    if paths.gluon_host() is None:
        pytest.skip("this Triton has no usable Gluon")


@dataclasses.dataclass
class GluonCall:
    fused: bool
    zero_tail: bool
    role: PdlRole
    cfg: object
    route_weights: object
    idle_weights: object
    handoff: object
    tail_out: bool


@pytest.fixture
def on_sm90(monkeypatch, recorded):
    _gluon_or_skip()
    host = paths.gluon_host()
    monkeypatch.setattr(paths, "capability_of", lambda t: (9, 0))
    monkeypatch.setattr(experts, "_FLAG_TARGETS", {})
    gluon_calls = []

    def run(a, w, w_up, rw, cu, out, choose, *, zero_tail=True, role=NONE, idle_weights=None, tail_out=None,
            handoff=None, key=None):
        cfg = choose(a, w, w_up, out)
        if cfg is None:
            return host.GluonResult.NOT_APPLICABLE
        gluon_calls.append(GluonCall(w_up is not None, zero_tail, role, cfg, rw, idle_weights, handoff,
                                     tail_out is not None))
        return host.GluonResult.RAN

    monkeypatch.setattr(host, "run", run)
    return gluon_calls, recorded


def _roles(calls):
    return [(c.fused, c.zero_tail, c.role) for c in calls]


def test_experts_on_sm90_takes_the_gluon_kernels_with_pdl(on_sm90):
    gluon_calls, triton_calls = on_sm90
    _experts(h=64, i=32, dtype=torch.bfloat16)
    assert _roles(gluon_calls) == [(True, False, PRIMARY), (False, True, DEPENDENT)]
    assert triton_calls == []


def test_experts_hands_off_row_tiles_only_where_the_fused_config_asks(on_sm90, monkeypatch):
    """The row-tile handoff: one zeroed state buffer for both GEMMs of a call, with the flag target
    (each of the fused GEMM's column tiles, 256 threads); by default (the table's configs for this
    small problem) no handoff."""
    from moonep_ops.kernels.gluon import config

    gluon_calls, _ = on_sm90
    _experts(h=64, i=32, dtype=torch.bfloat16)
    assert [c.handoff for c in gluon_calls] == [None, None]
    table = config.gluon_gemm_config
    monkeypatch.setattr(config, "gluon_gemm_config", lambda n, k, rows, fused, groups=0: dataclasses.replace(
        table(n, k, rows, fused, groups), **(dict(handoff=True, pingpong=False, block_n=128) if fused else {})))
    monkeypatch.setattr(experts, "_FLAG_TARGETS", {})
    gluon_calls.clear()
    _experts(h=64, i=32, dtype=torch.bfloat16)
    fused, down = gluon_calls
    assert fused.handoff is down.handoff and fused.handoff is not None
    state = fused.handoff.state
    assert state.dtype == torch.int32 and not state.any()
    assert state.numel() == 1 + triton_gemm.num_row_tiles(20, 3, 128)
    assert fused.handoff.flag_target == 1 * 256  # I = 32: one 128-column tile, 8 warps


def test_experts_down_gemm_gets_the_route_weights_as_idle_rows(on_sm90):
    """The down GEMM learns which rows of ``act`` are zero (route weight 0: MoonEP's padding) from
    the route weights the fused GEMM applied, so that both skip the same idle upper halves; a plain
    GEMM gets none."""
    gluon_calls, _ = on_sm90
    rw = torch.rand(20)
    _experts(h=64, i=32, dtype=torch.bfloat16, route_weights=rw)
    fused, down = gluon_calls
    assert fused.route_weights is rw and fused.idle_weights is None
    assert down.route_weights is None and down.idle_weights is rw
    gluon_calls.clear()
    x, w = torch.randn(20, 64, dtype=torch.bfloat16), torch.randn(3, 32, 64, dtype=torch.bfloat16)
    paths.run_unfused(x, w, torch.tensor([5, 9, 14], dtype=torch.int32), torch.empty(20, 32, dtype=torch.bfloat16))
    assert [(c.route_weights, c.idle_weights) for c in gluon_calls] == [(None, None)]


def test_gluon_pair_without_pdl(on_sm90, switches):
    gluon_calls, _ = on_sm90
    switches(PDL="0")
    _experts(h=64, i=32, dtype=torch.bfloat16)
    assert _roles(gluon_calls) == [(True, False, NONE), (False, True, NONE)]


def test_gluon_fused_then_triton_down_is_asked_for_the_pdl_pair(on_sm90):
    """``w_down`` rows TMA cannot address (72-byte row stride): the down GEMM takes the Triton
    kernel and is asked to be the dependent of the Gluon fused GEMM right before it (the Triton
    launcher's pointer path drops the role and launches plainly, which is always safe)."""
    gluon_calls, triton_calls = on_sm90
    w_down = torch.randn(3, 64, 32 + 4, dtype=torch.bfloat16)[:, :, :32]
    _experts(h=64, i=32, dtype=torch.bfloat16, w_down=w_down)
    assert _roles(gluon_calls) == [(True, False, PRIMARY)]
    assert triton_calls == [(False, DEPENDENT)]


def test_gluon_switch_off_gives_the_triton_pair_with_pdl(on_sm90, switches):
    gluon_calls, triton_calls = on_sm90
    switches(GLUON="0")
    _experts(h=64, i=32, dtype=torch.bfloat16)
    assert gluon_calls == [] and triton_calls == [(True, PRIMARY), (False, DEPENDENT)]


def test_operands_tma_cannot_address_take_the_triton_kernels(on_sm90):
    """H = 60: 120-byte rows, not a multiple of 16 bytes; fp32: never the Gluon kernel."""
    gluon_calls, triton_calls = on_sm90
    _experts(h=60, i=32, dtype=torch.bfloat16)
    assert gluon_calls == [] and triton_calls == [(True, PRIMARY), (False, DEPENDENT)]
    x, w = torch.randn(20, 64), torch.randn(3, 32, 64)
    paths.run_unfused(x, w, torch.tensor([5, 9, 14], dtype=torch.int32), torch.empty(20, 32))
    assert gluon_calls == [] and triton_calls[-1] == (False, NONE)


def test_gluon_choice_reads_metadata_only(monkeypatch, switches):
    _gluon_or_skip()
    switches(**DEFAULTS)
    a = torch.randn(256, 64, dtype=torch.bfloat16)
    w = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    out = torch.empty(256, 32, dtype=torch.bfloat16)

    def usable(cap, a, out, w):
        monkeypatch.setattr(paths, "capability_of", lambda t: cap)
        return paths.choose_gluon_unfused(a, w, None, out) is not None

    assert usable((9, 0), a, out, w)
    assert not usable((10, 0), a, out, w)  # no wgmma on Blackwell
    assert not usable((8, 0), a, out, w)
    assert not usable((9, 0), a.float(), out.float(), w.float())
    assert not usable((9, 0), a[:, :0], out, w[:, :, :0])  # K = 0
    odd = torch.randn(256, 68, dtype=torch.bfloat16)[:, :64]  # 136-byte rows
    assert not usable((9, 0), odd, out, w)
    switches(GLUON="0")
    assert not usable((9, 0), a, out, w)
    switches(GLUON="1")
    switches(PORTABLE="1")
    assert not usable((9, 0), a, out, w)


def test_self_check_names_the_kernel_path(switches):
    """``python -m moonep_ops`` reports which forward kernels the device takes."""
    from moonep_ops.__main__ import _kernel_path

    switches(**DEFAULTS)
    gpu = torch.device("cuda")
    assert _kernel_path(torch.device("cpu"), torch.float32).startswith("CPU kernels")
    assert _kernel_path(gpu, torch.bfloat16, (8, 0)) == "portable Triton kernels"
    assert _kernel_path(gpu, torch.float32, (9, 0)) == "portable Triton kernels"
    if paths.gluon_host() is not None:
        assert "Gluon" in _kernel_path(gpu, torch.bfloat16, (9, 0))
    switches(GLUON="0")
    assert _kernel_path(gpu, torch.bfloat16, (9, 0)) == "Triton kernels with TMA loads"
    assert _kernel_path(gpu, torch.bfloat16, (12, 0)) == "portable Triton kernels"


@pytest.mark.parametrize("device, taken", [((8, 0), (8, 0)), ((8, 9), (8, 9)), ((9, 0), (9, 0)), ((10, 0), (10, 0)),
                                           ((10, 3), (10, 3)), ((12, 0), (8, 9)), ((12, 1), (8, 9))])
def test_consumer_blackwell_runs_as_sm89(device, taken):
    """sm120/sm121 (99 KB of shared memory per block, mma.sync) take sm89's path and configs, not
    the sm90 class's (227 KB: TMA, the H200's tiles); the AOT check compiles them for sm120."""
    assert paths.config_capability(device) == taken
    assert paths.config_capability(None) is None


def test_empty_reduction_takes_no_tma(monkeypatch, switches):
    """K = 0: a TMA descriptor needs every extent > 0; the pointer path computes the zeros."""
    switches(PORTABLE=None)
    monkeypatch.setattr(paths, "capability_of", lambda t: (9, 0))
    a, w = torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(2, 64, 64, dtype=torch.bfloat16)
    assert triton_gemm.tma_usable(a, w)
    assert not triton_gemm.tma_usable(a[:, :0], w[:, :, :0])
    assert paths.choose_unfused(a, w, None)[1]
    assert not paths.choose_unfused(a[:, :0], w[:, :, :0], None)[1]
    w_kn = torch.empty(2, 64, 64, dtype=torch.bfloat16).transpose(1, 2)  # the dgrad's transposed view
    assert triton_gemm.tma_usable_kn(a, w_kn, 64)
    assert not triton_gemm.tma_usable_kn(a[:0], w_kn[:0], 64)


def test_broadcast_inputs_take_no_tma(monkeypatch, switches):
    """A stride of 0 (``row.expand(NvS, H)``, a weight expanded over groups or rows): the pointer
    path reads it; no TMA descriptor is built over a zero stride (tests/test_broadcast_inputs.py
    checks the results)."""
    from moonep_ops.kernels.triton.grouped_gemm_fp8 import tma_weights

    switches(PORTABLE=None)
    monkeypatch.setattr(paths, "capability_of", lambda t: (9, 0))
    a, w = torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(2, 64, 64, dtype=torch.bfloat16)
    a_row, w_row = a[:1].expand(256, 64), w[:1, :1].expand(2, 64, 64)  # strides (0, 1) and (0, 0, 1)
    for a_, w_ in ((a_row, w), (a, w_row), (a, w[:1].expand(2, 64, 64))):
        assert not triton_gemm.tma_usable(a_, w_)
        assert not paths.choose_unfused(a_, w_, None)[1]
    w_kn = torch.empty(2, 64, 64, dtype=torch.bfloat16)[:, :1].expand(2, 64, 64).transpose(1, 2)
    assert triton_gemm.is_kn_view(w_kn) and not triton_gemm.tma_usable_kn(a, w_kn, 64)
    w8 = torch.empty(2, 128, 128, dtype=torch.float8_e4m3fn)
    assert tma_weights(w8) and not tma_weights(w8[:, :1].expand(2, 128, 128))


def test_down_gemm_zeroes_the_tail_unless_the_fused_gemm_took_it(monkeypatch, switches):
    """The experts op's output tail is zeroed exactly once: by the fused Gluon GEMM when its config
    takes it (``RAN_AND_ZEROED_TAIL_OUT``), else by the down GEMM, on whichever kernel that runs (a
    Triton down GEMM after a Gluon fused one included)."""
    _gluon_or_skip()
    host = paths.gluon_host()
    monkeypatch.setattr(paths, "capability_of", lambda t: (9, 0))
    switches(**DEFAULTS)
    for takes, down_on_gluon in ((True, True), (False, True), (True, False)):
        calls = []

        def run(a, w, w_up, rw, cu, out, choose, *, zero_tail=True, role=NONE, idle_weights=None, tail_out=None,
                handoff=None, key=None):
            if w_up is None and not down_on_gluon:
                return host.GluonResult.NOT_APPLICABLE
            calls.append(("gluon", w_up is not None, zero_tail, tail_out is not None))
            if w_up is not None and takes and tail_out is not None:
                return host.GluonResult.RAN_AND_ZEROED_TAIL_OUT
            return host.GluonResult.RAN

        monkeypatch.setattr(host, "run", run)
        monkeypatch.setattr(triton_gemm, "run", lambda a, w, w_up, *args, zero_tail=True, role=NONE, **kw:
                            calls.append(("triton", w_up is not None, zero_tail, False)))
        _experts(h=64, i=32, dtype=torch.bfloat16)
        down = "gluon" if down_on_gluon else "triton"
        assert calls == [("gluon", True, False, True), (down, False, not takes, False)], (takes, down_on_gluon)
