"""The warp-specialized Gluon kernels (sm90), every config shape forced, not only the ones the
config table picks for a problem: ping-pong and cooperative consumers, 64/128/256-column tiles,
both item orders, the plain and the fused GEMM, with and without route weights, with and without
the tail's zeros. Outputs are poisoned with NaN first and compared to float64 references.

The public ops reach these kernels through ``configs.gluon_gemm_config`` (the rest of the CUDA
suite covers that path: capture, sync-free checks, bad input); ``MOONEP_OPS_GLUON=0`` runs the
same suite on the Triton kernels. Which GEMM goes where is pinned on CPU in test_launch_roles.py.
"""

import pytest
import torch

from moonep_ops.kernels import configs, cuda
from .layouts import Layout, _padded, experts_inputs, grouped_gemm_inputs
from .reference import TOLERANCE, experts_ref, grouped_gemm_ref, grouped_gemm_silu_mul_ref, rel_err

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not SM90, reason="the Gluon kernels need an sm90 GPU"),
              pytest.mark.skipif(SM90 and not cuda._gluon_importable(), reason="this Triton has no usable Gluon")]

PLAIN = {
    "pingpong_n128_s5": dict(stages=5),
    "pingpong_rows": dict(stages=4, group_major=False),
    "coop_n128_s6": dict(pingpong=False, stages=6),
    "coop_n256_s3": dict(pingpong=False, block_n=256, stages=3),
    # The tail zeroed by the consumers after their items (the default: by the producer warp).
    "pingpong_tail_by_consumers": dict(stages=5, tail_by_producer=False),
    "coop_tail_by_consumers": dict(pingpong=False, stages=6, tail_by_producer=False),
    "coop_k128_s3": dict(pingpong=False, block_k=128, stages=3),  # a probe candidate (BLOCK_K 128)
}
FUSED = {
    "pingpong_n64_s6": dict(block_n=64, stages=6),
    "coop_n128_s4": dict(pingpong=False, stages=4),
    "coop_n128_rows": dict(pingpong=False, stages=4, group_major=False),
    "pingpong_n64_k128_s3": dict(block_n=64, block_k=128, stages=3),  # a probe candidate (BLOCK_K 128)
    # Probe candidates: gate and up tiles stacked, one wgmma of 2 * block_n columns.
    "pingpong_n64_stacked": dict(block_n=64, stages=6, stacked=True),
    "coop_n128_stacked": dict(pingpong=False, stages=4, stacked=True),
}
# TMA needs 16-byte row strides: K and N multiples of 8. Partial tiles (segments not multiples of
# 128), empty groups, a tail, N and K not multiples of the blocks, G > 1024 (the chunked scan), a
# reduction longer than the stage ring (the ring wraps inside a tile), and a MoonEP-like layout.
GLUON_LAYOUTS = [
    Layout("skewed", (3072, *([128] * 12), 0, 7), 3072 + 12 * 128 + 7 + 61, k=1024, n=520),
    Layout("odd", (5, 0, 130, 1, 255, 0), 500, k=200, n=72),
    Layout("g1100", tuple((i % 3) * 16 for i in range(1100)), 1100 * 16 + 5, k=256, n=128),
    _padded("moonep_padded", (100, 0, 3, 130, 0, 0, 250), 128, extra_tail=300, k=2048, n=384),
    Layout("all_empty", (0, 0, 0), 300, k=64, n=64),
]


def _launch(a, w, cu, out, w_up=None, rw=None, zero_tail=True, **cfg):
    from moonep_ops.kernels import gluon_grouped_gemm

    gluon_grouped_gemm.launch(a, w, cu, out, 132, w_up=w_up, route_weights=rw, zero_tail=zero_tail, **cfg)
    torch.cuda.synchronize()


@pytest.mark.parametrize("layout", GLUON_LAYOUTS, ids=str)
@pytest.mark.parametrize("cfg", PLAIN.values(), ids=PLAIN.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_plain(layout, cfg, dtype):
    a, w, cu = grouped_gemm_inputs(layout, dtype, "cuda")
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=dtype, device="cuda")
    _launch(a, w, cu, out, **cfg)
    assert rel_err(out[:layout.total], grouped_gemm_ref(a, w, cu)[:layout.total]) <= TOLERANCE[dtype]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


@pytest.mark.parametrize("layout", GLUON_LAYOUTS, ids=str)
@pytest.mark.parametrize("cfg", FUSED.values(), ids=FUSED.keys())
@pytest.mark.parametrize("with_weights", [True, False], ids=["rw", "no_rw"])
def test_fused(layout, cfg, with_weights):
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda", with_weights=with_weights)
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _launch(x, w_gate, cu, out, w_up=w_up, rw=rw, zero_tail=False, **cfg)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    assert rel_err(out[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.isnan(out[layout.total:]).all(), "zero_tail=False must leave the tail unwritten"


@pytest.mark.parametrize("cfg", [FUSED["pingpong_n64_s6"], FUSED["coop_n128_s4"]], ids=["pingpong", "coop"])
def test_fused_zeroes_its_tail_when_asked(cfg):
    """The fused GEMM's own tail (the ``grouped_gemm_silu_mul`` op zeroes it), by the producer."""
    layout = GLUON_LAYOUTS[3]
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _launch(x, w_gate, cu, out, w_up=w_up, rw=rw, zero_tail=True, **cfg)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    assert rel_err(out[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


def test_invalid_cu_seqlens_do_not_fault():
    """Non-monotone ends past NvS: unspecified values, but no fault and no write out of bounds."""
    layout = Layout("bad", (64, 64, 64), 256, k=128, n=128)
    a, w, _ = grouped_gemm_inputs(layout, torch.bfloat16, "cuda")
    big = torch.full((512, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    out = big[:256]
    for ends in ([100, 50, 400], [-5, 300, 200], [0, 0, 1 << 24]):
        cu = torch.tensor(ends, dtype=torch.int32, device="cuda")
        for cfg in PLAIN.values():
            _launch(a, w, cu, out, **cfg)
    assert torch.equal(big[256:], torch.full_like(big[256:], 7.0)), "a write past NvS"


def test_config_table_picks_each_consumer_scheme():
    """The table's choices on the BASELINE shapes (benchmarks/results/probe_gluon_h200.json)."""
    pick = configs.gluon_gemm_config
    assert not pick(2048, 7168, 45056, fused=True).pingpong  # kimi-k2 prefill gate/up
    assert not pick(2048, 7168, 45056, fused=True).group_major
    assert pick(768, 2048, 33024, fused=True).pingpong  # qwen3 S=64 gate/up
    assert not pick(768, 2048, 48896, fused=True).pingpong  # qwen3 S=2048 gate/up (power-bound)
    assert pick(5120, 8192, 6144, fused=False).pingpong  # llama4 down (K = 8192)
    assert not pick(2048, 768, 48896, fused=False).pingpong  # qwen3 down
    for nvs in (13312, 20480, 45056):  # kimi-k2 down (K = 2048): 128x256 tiles, three stages
        assert pick(7168, 2048, nvs, fused=False) == configs.GluonConfig(block_n=256, stages=3, pingpong=False)
        assert pick(2048, 7168, nvs, fused=False).block_n == 128  # its unfused gate/up GEMMs
    assert pick(8192, 5120, 6144, fused=False).block_n == 128  # llama4's unfused gate/up GEMMs
    assert pick(768, 2048, 48896, fused=False).pingpong  # qwen3's unfused gate/up GEMMs
    # The tail's zeros: by the producer warp on long reductions, by the consumers on short ones.
    assert pick(7168, 2048, 13312, fused=False).tail_by_producer  # kimi-k2 decode down
    assert not pick(2048, 768, 48896, fused=False).tail_by_producer  # qwen3 down


def test_public_ops_same_tensor_for_gate_and_up_and_empty_reduction():
    """Edges of the routing to these kernels: ``w_up is w_gate`` is still the fused GEMM, and an
    empty reduction (K = 0, which TMA cannot describe) takes the Triton kernel: zeros."""
    import moonep_ops

    layout = Layout("edge", (130, 0, 70), 256, k=64, n=64)
    x, w_gate, _, _, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    out = moonep_ops.grouped_gemm_silu_mul(x, w_gate, w_gate, rw, cu)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_gate, rw, cu)
    assert rel_err(out[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    empty = moonep_ops.grouped_gemm(x[:, :0], w_gate[:, :, :0], cu)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_public_ops_through_the_power_bound_configs():
    """The table's wide tiles reached through the public ops (the forced-config tests above launch
    the kernel directly): ``moonep_experts`` with I = 2048 and H = 4104, whose down GEMM
    (K = 2048, N = 4104: a partial last column tile) takes the 128x256 cooperative tiles, and the
    fused op with NvS >= 40960 and H < 4096, which takes the 128x(128+128) cooperative ones.
    Tails are NaN in the inputs; every live row is compared to float64 and the tail must come
    back zero."""
    import moonep_ops

    layout = _padded("down_k2048", (100, 0, 130, 250), 128, extra_tail=300, k=4104, n=2048)
    assert configs.gluon_gemm_config(layout.k, layout.n, layout.nvs, fused=False).block_n == 256
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw)
    ref = experts_ref(x, w_gate, w_up, w_down, cu, rw)
    assert rel_err(out[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))

    layout = Layout("wide_fused", (3000, 0, 128, 7), 40960, k=256, n=320)
    assert not configs.gluon_gemm_config(layout.n, layout.k, layout.nvs, fused=True).pingpong
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = moonep_ops.grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    assert rel_err(act[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(act[layout.total:], torch.zeros_like(act[layout.total:]))
