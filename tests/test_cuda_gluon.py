"""The warp-specialized Gluon kernels (sm90), every config shape forced, not only the ones the
config table picks for a problem: ping-pong and cooperative consumers, 64/128/256-column tiles,
both item orders, the plain and the fused GEMM, with and without route weights, with and without
the tail's zeros. Outputs are poisoned with NaN first and compared to float64 references.

The public ops reach these kernels through ``gluon.config.gluon_gemm_config`` (the rest of the
CUDA suite covers that path: capture, sync-free checks, bad input); ``MOONEP_OPS_GLUON=0`` runs
the same suite on the Triton kernels. Which GEMM goes where is pinned on CPU in test_launch_roles.py.
"""

import pytest
import torch

import moonep_ops
from moonep_ops.kernels.cuda import paths
from moonep_ops.kernels.gluon.config import gluon_gemm_config
from .layouts import INVALID_ENDS, Layout, _padded, experts_inputs, grouped_gemm_inputs, zero_padding_rows
from .reference import TOLERANCE, experts_ref, grouped_gemm_ref, grouped_gemm_silu_mul_ref, rel_err

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not SM90, reason="the Gluon kernels need an sm90 GPU"),
              pytest.mark.skipif(SM90 and paths.gluon_host() is None, reason="this Triton has no usable Gluon")]

PLAIN = {
    "pingpong_n128_s5": dict(stages=5),
    "pingpong_rows": dict(stages=4, group_major=False),
    "coop_n128_s6": dict(pingpong=False, stages=6),
    "coop_n256_s3": dict(pingpong=False, block_n=256, stages=3),
    # The tail zeroed by the consumers after their items (the default: by the producer warp).
    "pingpong_tail_by_consumers": dict(stages=5, tail_by_producer=False),
    "coop_tail_by_consumers": dict(pingpong=False, stages=6, tail_by_producer=False),
    "coop_k128_s3": dict(pingpong=False, block_k=128, stages=3),  # BLOCK_K 128 (no table pick uses it)
    # Split epilogues (the tile leaves in two column halves through a half-size buffer, which
    # leaves room for another stage), with the tail zeroed by the producer and by the consumers.
    "coop_n256_s4_split": dict(pingpong=False, block_n=256, stages=4, epilogue_n=128),
    "coop_n256_split_tail_by_consumers": dict(pingpong=False, block_n=256, stages=4, epilogue_n=128,
                                              tail_by_producer=False),
    "pingpong_n128_s6_split": dict(stages=6, epilogue_n=64),
    # Each ping-pong consumer with its own producer warp and half of the ring (main loops at once).
    "pingpong_split_ring": dict(stages=4, split_ring=True),
    "pingpong_split_ring_tail_by_consumers": dict(stages=4, split_ring=True, tail_by_producer=False),
}
FUSED = {
    "pingpong_n64_s6": dict(block_n=64, stages=6),
    "coop_n128_s4": dict(pingpong=False, stages=4),
    "coop_n128_rows": dict(pingpong=False, stages=4, group_major=False),
    "pingpong_n64_k128_s3": dict(block_n=64, block_k=128, stages=3),  # BLOCK_K 128 (no table pick uses it)
    "coop_n128_s4_split": dict(pingpong=False, stages=4, epilogue_n=64),  # a split epilogue
    "pingpong_n64_split_ring": dict(block_n=64, stages=6, split_ring=True),
}
# TMA needs 16-byte row strides: K and N multiples of 8. Partial tiles (segments not multiples of
# 128), empty groups, a tail, N and K not multiples of the blocks, G > 1024 (the chunked scan), a
# reduction longer than the stage ring (the ring wraps inside a tile), and a MoonEP-like layout.
# ``sparse``: runs of empty segments shorter and longer than the schedule's chunk (32 entries a
# warp: 32 for the producer, 128 and 256 for the consumers), exactly 32 and 128 long, leading, and
# a live last segment after a run.
_SPARSE_LIVE = {2: 130, 3: 5, 36: 64, 165: 1, 166: 200, 679: 129, 999: 70, 1130: 3, 1299: 7}
GLUON_LAYOUTS = [
    Layout("skewed", (3072, *([128] * 12), 0, 7), 3072 + 12 * 128 + 7 + 61, k=1024, n=520),
    Layout("odd", (5, 0, 130, 1, 255, 0), 500, k=200, n=72),
    Layout("g1100", tuple((i % 3) * 16 for i in range(1100)), 1100 * 16 + 5, k=256, n=128),
    _padded("moonep_padded", (100, 0, 3, 130, 0, 0, 250), 128, extra_tail=300, k=2048, n=384),
    Layout("all_empty", (0, 0, 0), 300, k=64, n=64),
    Layout("sparse", tuple(_SPARSE_LIVE.get(i, 0) for i in range(1300)), sum(_SPARSE_LIVE.values()) + 40, k=192,
           n=136),
]


def _launch(a, w, cu, out, w_up=None, rw=None, zero_tail=True, **cfg):
    from moonep_ops.kernels.gluon import host

    host.launch(a, w, cu, out, 132, w_up=w_up, route_weights=rw, zero_tail=zero_tail, **cfg)
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


@pytest.mark.parametrize("cfg", [FUSED["pingpong_n64_s6"], FUSED["coop_n128_s4"], FUSED["pingpong_n64_split_ring"]],
                         ids=["pingpong", "coop", "split_ring"])
def test_fused_zeroes_its_tail_when_asked(cfg):
    """The fused GEMM's own tail (the ``grouped_gemm_silu_mul`` op zeroes it), by the producer."""
    layout = GLUON_LAYOUTS[3]
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _launch(x, w_gate, cu, out, w_up=w_up, rw=rw, zero_tail=True, **cfg)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    assert rel_err(out[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))


@pytest.mark.parametrize("layout", [GLUON_LAYOUTS[3], GLUON_LAYOUTS[4], GLUON_LAYOUTS[1]], ids=str)
@pytest.mark.parametrize("cfg", [FUSED["pingpong_n64_s6"], FUSED["coop_n128_s4"], FUSED["pingpong_n64_split_ring"]],
                         ids=["pingpong", "coop", "split_ring"])
def test_fused_zeroes_the_tail_of_another_tensor(layout, cfg):
    """``tail_out`` (the experts op's ``out``, zeroed by the fused GEMM's producer while it computes):
    its tail rows come back zero, in all its columns (520: not a multiple of the block); its live
    rows and ``act``'s tail are left alone (NaN stays NaN); ``act`` is right."""
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = torch.full((layout.nvs, layout.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    other = torch.full((layout.nvs, 520), float("nan"), dtype=torch.bfloat16, device="cuda")
    _launch(x, w_gate, cu, act, w_up=w_up, rw=rw, zero_tail=False, tail_out=other, **cfg)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    if layout.total:
        assert rel_err(act[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.isnan(act[layout.total:]).all() and torch.isnan(other[:layout.total]).all()
    assert torch.equal(other[layout.total:], torch.zeros_like(other[layout.total:]))
    with pytest.raises(ValueError, match="zeroes one tail"):
        _launch(x, w_gate, cu, act, w_up=w_up, rw=rw, zero_tail=True, tail_out=other, **cfg)


def test_invalid_cu_seqlens_do_not_fault():
    """Non-monotone ends past NvS: unspecified values, but no fault and no write out of bounds."""
    layout = Layout("bad", (64, 64, 64), 256, k=128, n=128)
    a, w, _ = grouped_gemm_inputs(layout, torch.bfloat16, "cuda")
    big = torch.full((512, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    out = big[:256]
    for ends in INVALID_ENDS.values():
        cu = torch.tensor(ends, dtype=torch.int32, device="cuda")
        for cfg in PLAIN.values():
            _launch(a, w, cu, out, **cfg)
    assert torch.equal(big[256:], torch.full_like(big[256:], 7.0)), "a write past NvS"


def test_public_ops_same_tensor_for_gate_and_up_and_empty_reduction():
    """Edges of the routing to these kernels: ``w_up is w_gate`` is still the fused GEMM, and an
    empty reduction (K = 0, which TMA cannot describe) takes the Triton kernel: zeros."""
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
    layout = _padded("down_k2048", (100, 0, 130, 250), 128, extra_tail=300, k=4104, n=2048)
    assert gluon_gemm_config(layout.k, layout.n, layout.nvs, fused=False).block_n == 256
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw)
    ref = experts_ref(x, w_gate, w_up, w_down, cu, rw)
    assert rel_err(out[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))

    layout = Layout("wide_fused", (3000, 0, 128, 7), 40960, k=256, n=320)
    assert not gluon_gemm_config(layout.n, layout.k, layout.nvs, fused=True).pingpong
    x, w_gate, w_up, _, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    act = moonep_ops.grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    assert rel_err(act[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(act[layout.total:], torch.zeros_like(act[layout.total:]))


# Idle upper halves (GluonConfig.skip_idle_half): a segment's last row tile whose rows
# [row_lo + 64, row_lo + 128) all lie past the segment's end or have route weight 0 (MoonEP's
# padding) runs its MMAs on the lower half and stores zeros above. Rows with weight 0 hold NaN
# here, so a skipped row reads 0 and a computed one NaN (NaN * 0): the test sees which were
# skipped, not only that the live rows are right.
# Segments: a 256-row one with weights ending at row 140 (its second tile's upper half idle), a
# live row at the last (127) and at the first (64) row of an upper half (computed), a tile with 11
# live rows (idle), an empty group, unpadded ends at 100 (computed) and 40 rows (past the end:
# idle), a segment with no live row (its upper half idle, its lower half computed).
IDLE_SEGMENTS = ((256, range(0, 140)), (128, [*range(0, 64), 127]), (128, range(0, 65)), (0, ()),
                 (128, range(0, 11)), (100, range(0, 100)), (40, range(0, 40)), (128, ()))
IDLE_CONFIGS = {"plain_pingpong": (False, PLAIN["pingpong_n128_s5"]), "plain_coop": (False, PLAIN["coop_n128_s6"]),
                "plain_coop_n256": (False, PLAIN["coop_n256_s3"]),
                "plain_coop_n256_split": (False, PLAIN["coop_n256_s4_split"]),
                "plain_pingpong_split": (False, PLAIN["pingpong_n128_s6_split"]),
                "fused_coop_split": (True, FUSED["coop_n128_s4_split"]),
                "fused_pingpong": (True, FUSED["pingpong_n64_s6"]), "fused_coop": (True, FUSED["coop_n128_s4"]),
                # only segments' only row tiles (the 256-row segment's idle half is computed)
                "fused_pingpong_lone": (True, dict(FUSED["pingpong_n64_s6"], skip_lone_tiles_only=True)),
                "fused_coop_lone": (True, dict(FUSED["coop_n128_s4"], skip_lone_tiles_only=True)),
                "plain_coop_lone": (False, dict(PLAIN["coop_n128_s6"], skip_lone_tiles_only=True))}


def _idle_problem(lone_only, k=256, n=384, tail=50, segments=IDLE_SEGMENTS):
    """``(layout, weights [NvS] fp32, skipped [NvS] bool)``: weight 0 (and NaN rows in the caller's
    input) outside each segment's live rows, NaN in the tail; ``skipped``: the rows the kernels
    must skip (``lone_only``: in segments of one row tile alone)."""
    sizes = tuple(size for size, _ in segments)
    layout = Layout("idle", sizes, sum(sizes) + tail, k=k, n=n)
    rw = torch.zeros(layout.nvs)
    skipped = torch.zeros(layout.nvs, dtype=torch.bool)
    start = 0
    for size, live in segments:
        for r in live:
            rw[start + r] = torch.rand(()).item() + 0.1
        if size and (size <= 128 or not lone_only):
            row_lo = start + (size - 1) // 128 * 128  # the last row tile
            upper = range(row_lo + 64, min(row_lo + 128, start + size))
            if all(rw[r] == 0 for r in upper):
                skipped[row_lo + 64:start + size] = True
        start += size
    rw[layout.total:] = float("nan")
    return layout, rw.cuda(), skipped.cuda()


def _idle_inputs(layout, rw):
    """The experts op's inputs for ``layout``, garbage (NaN) in ``x``'s rows whose weight is 0."""
    x, w_gate, w_up, _, cu, _ = experts_inputs(layout, torch.bfloat16, "cuda")
    return x.masked_fill((rw == 0)[:, None], float("nan")), w_gate, w_up, cu


def _idle_launch(fused, layout, x, w_gate, w_up, cu, rw, **cfg):
    """The fused (with route weights ``rw``) or plain (``rw`` marking idle rows) GEMM of ``cfg`` into a
    NaN-poisoned output, its live rows checked against the float64 reference and its tail zero."""
    from moonep_ops.kernels.gluon import host

    out = torch.full((layout.nvs, layout.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    clean = x.masked_fill((rw == 0)[:, None], 0.0)
    if fused:
        host.launch(x, w_gate, cu, out, 132, w_up=w_up, route_weights=rw, **cfg)
        ref = grouped_gemm_silu_mul_ref(clean, w_gate, w_up, rw, cu)
    else:
        host.launch(x, w_gate, cu, out, 132, idle_weights=rw, **cfg)
        ref = grouped_gemm_ref(clean, w_gate, cu)
    torch.cuda.synchronize()
    live = (rw != 0) & ~torch.isnan(rw)
    assert rel_err(out[live], ref[live.cpu()]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))
    return out


@pytest.mark.parametrize("name", IDLE_CONFIGS)
def test_idle_upper_halves_are_skipped_exactly_where_they_should(name):
    fused, cfg = IDLE_CONFIGS[name]
    layout, rw, skipped = _idle_problem(cfg.get("skip_lone_tiles_only", False))
    idle = (rw == 0)[:, None]
    x, w_gate, w_up, cu = _idle_inputs(layout, rw)
    assert 0 < int(skipped.sum()) < int(idle.sum())  # some zero-weight rows skipped, some computed
    outs = {skip: _idle_launch(fused, layout, x, w_gate, w_up, cu, rw, **dict(cfg, skip_idle_half=skip))
            for skip in (True, False)}
    computed = idle[:, 0] & ~skipped
    computed[layout.total:] = False
    assert torch.equal(outs[True][skipped], torch.zeros_like(outs[True][skipped])), "a skipped row was not zero"
    assert torch.isnan(outs[True][computed]).all(), "a row of a busy upper half (or a lower half) was skipped"
    assert torch.isnan(outs[False][:layout.total][idle[:layout.total, 0]]).all(), "skip_idle_half=False skipped a row"
    live = ~idle[:, 0]
    live[layout.total:] = False
    assert torch.equal(outs[True][live], outs[False][live]), "the skip changed a live row"


# The idle-half skip gated by the kernel's scan of ``cu_seqlens``: with ``skip_on_long_segments=False``
# no half is skipped where the live segments average more than 1.25 row tiles of 128. Layouts as
# (segments, long): IDLE_SEGMENTS has 7 live segments in 8 row tiles of 128 rows (not long); without
# its 256-row segment, 6 in 6; its 256- and 40-row segments alone, 2 in 3 (long).
GATE_LAYOUTS = {"mixed": (IDLE_SEGMENTS, False), "single_tiles": (IDLE_SEGMENTS[1:], False),
                "long_segments": ((IDLE_SEGMENTS[0], IDLE_SEGMENTS[6]), True)}


@pytest.mark.parametrize("layout_name", GATE_LAYOUTS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_idle_halves_are_skipped_only_where_segments_are_short_when_gated(layout_name, fused):
    segments, long_segments = GATE_LAYOUTS[layout_name]
    layout, rw, skipped = _idle_problem(lone_only=False, segments=segments)
    idle = (rw == 0)[:, None]
    x, w_gate, w_up, cu = _idle_inputs(layout, rw)
    cfg = dict(FUSED["coop_n128_s4"] if fused else PLAIN["coop_n128_s6"], skip_idle_half=True,
               skip_on_long_segments=False)
    out = _idle_launch(fused, layout, x, w_gate, w_up, cu, rw, **cfg)
    assert 0 < int(skipped.sum())
    computed = idle[:, 0] & ~skipped
    computed[layout.total:] = False
    assert torch.isnan(out[computed]).all(), "a row of a busy upper half (or a lower half) was skipped"
    if long_segments:
        assert torch.isnan(out[skipped]).all(), "an idle half was skipped on a layout of long segments"
    else:
        assert torch.equal(out[skipped], torch.zeros_like(out[skipped])), "an idle half was computed"


def test_public_ops_on_moonep_padding_with_zero_weights():
    """The public ops on MoonEP layouts whose padding rows are zero with weight 0 (as dispatch
    writes them), where the config table skips idle upper halves: ``moonep_experts`` whose down
    GEMM (K = 2048, N = 4096, NvS < 32768; a split epilogue at NvS 16384) skips by the route
    weights (and from NvS 8192 its fused GEMM too, whose scan finds these segments of about one row
    tile each; at NvS 13312 with the row-tile handoff), and the fused op at
    NvS >= 40960 (H < 4096), whose experts op's down GEMM skips as well. float64 references, zero
    tails, zero padding rows."""
    # NvS 1068; NvS 13312, where the fused GEMM skips too (and hands its row tiles to the down GEMM);
    # NvS 16384, where the down GEMM also has a split epilogue (four stages). Five live segments in
    # six row tiles of 128: short enough for the long fused GEMM's gated skip (at most 1.25 tiles each).
    for extra_tail, split in ((300, False), (13312 - 768, False), (16384 - 768, True)):
        layout = _padded("padded_rw0", (100, 0, 130, 50, 65, 20), 128, extra_tail=extra_tail, k=4096, n=2048)
        cfg = gluon_gemm_config(layout.k, layout.n, layout.nvs, fused=False)
        assert cfg.skip_idle_half and (cfg.epilogue_n == 128) == split
        fused_cfg = gluon_gemm_config(layout.n, layout.k, layout.nvs, fused=True)
        gated_skip = fused_cfg.skip_idle_half and not fused_cfg.skip_on_long_segments
        assert gated_skip == (layout.nvs >= 8192) and fused_cfg.handoff == (layout.nvs == 13312)
        _assert_experts_match(layout, *_padding_weighted_inputs(layout))

    layout = _padded("wide_fused_rw0", (3000, 0, 100, 7), 128, extra_tail=40960 - 3328, k=256, n=320)
    cfg = gluon_gemm_config(layout.n, layout.k, layout.nvs, fused=True)
    assert cfg.skip_idle_half and cfg.takes_out_tail
    assert gluon_gemm_config(layout.k, layout.n, layout.nvs, fused=False).skip_idle_half  # its down GEMM
    x, w_gate, w_up, w_down, cu, rw = _padding_weighted_inputs(layout)
    pad = rw[:layout.total] == 0
    act = moonep_ops.grouped_gemm_silu_mul(x, w_gate, w_up, rw, cu)
    ref = grouped_gemm_silu_mul_ref(x, w_gate, w_up, rw, cu)
    assert rel_err(act[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(act[layout.total:], torch.zeros_like(act[layout.total:]))
    assert torch.equal(act[:layout.total][pad], torch.zeros_like(act[:layout.total][pad]))
    # the experts op: its output's tail zeroed by the fused GEMM, the down GEMM writing real rows only
    from .fuzz_strategies import poison_allocator

    poison_allocator([((layout.nvs, layout.k), torch.bfloat16), ((layout.nvs, layout.n), torch.bfloat16)], "cuda")
    _assert_experts_match(layout, x, w_gate, w_up, w_down, cu, rw)


def test_experts_of_i4096_take_wide_down_tiles():
    """I = 4096 (K = 4096 in the down GEMM, N >= 4096) from 64 rows per group: the down GEMM runs
    cooperative 128x256 tiles with the idle-half skip, as kimi-k2's does; float64 reference, zero
    tail, zero padding rows."""
    layout = _padded("i4096", (100, 0, 130, 250, 65), 128, extra_tail=300, k=4096, n=4096)
    cfg = gluon_gemm_config(layout.k, layout.n, layout.nvs, fused=False, groups=layout.num_groups)
    assert (cfg.block_n, cfg.pingpong, cfg.skip_idle_half) == (256, False, True)
    _assert_experts_match(layout, *_padding_weighted_inputs(layout))


def _padding_weighted_inputs(layout):
    """bf16 experts inputs of ``layout`` on the GPU, its padding rows zero with route weight 0 (as
    dispatch writes them)."""
    x, w_gate, w_up, w_down, cu, rw = experts_inputs(layout, torch.bfloat16, "cuda")
    return x, w_gate, w_up, w_down, cu, zero_padding_rows(layout, rw)


def _assert_experts_match(layout, x, w_gate, w_up, w_down, cu, rw):
    """``moonep_experts`` against the float64 reference on the live rows; its tail and the padding
    rows (route weight 0) exactly zero."""
    out = moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw)
    ref = experts_ref(x, w_gate, w_up, w_down, cu, rw)
    assert rel_err(out[:layout.total], ref[:layout.total]) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))
    pad = rw[:layout.total] == 0
    assert torch.equal(out[:layout.total][pad], torch.zeros_like(out[:layout.total][pad]))
