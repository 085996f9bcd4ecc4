"""The Gluon kernel's config table (``gluon_gemm_config``), a pure function of the problem's
static metadata: its picks on the BASELINE shapes, pinned on CPU so that CI sees a changed pick
(the GPU tests in test_cuda_gluon.py force every config shape on the H200; docs/performance.md
gives each rule's measurements), and the config's own validation."""

import dataclasses

import pytest

from moonep_ops.kernels.gluon import config as configs


def skips(cfg) -> str:
    """Which row tiles' idle upper halves the config skips: every segment's last, a segment's only
    one, every segment's last where the kernel finds the live segments short, or none."""
    if not cfg.skip_idle_half:
        return "none"
    return "lone" if cfg.skip_lone_tiles_only else "last" if cfg.skip_on_long_segments else "short"


def test_config_table_picks_each_consumer_scheme():
    """The table's choices on the BASELINE shapes."""
    pick = configs.gluon_gemm_config
    assert not pick(2048, 7168, 45056, fused=True).pingpong  # kimi-k2 prefill gate/up
    assert not pick(2048, 7168, 45056, fused=True).group_major
    assert pick(768, 2048, 33024, fused=True).pingpong  # qwen3 S=64 gate/up
    assert not pick(768, 2048, 48896, fused=True).pingpong  # qwen3 S=2048 gate/up (power-bound)
    assert not pick(768, 2048, 48896, fused=True, groups=132).pingpong  # (370 rows per group)
    # A padded decode buffer as large (qwen3-30b-a3b over 1000 groups: 254 rows per group) keeps
    # S=64's ping-pong config.
    assert pick(768, 2048, 253568, fused=True, groups=1000) == pick(768, 2048, 33024, fused=True, groups=132)
    assert pick(5120, 8192, 6144, fused=False).pingpong  # llama4 down (K = 8192)
    # Long fused reductions (K >= 5120) below 8192 rows: cooperative where the segments fill row
    # tiles (llama4, 307 rows per group padded, 102 unpadded), ping-pong where they are a few rows
    # (kimi-k2 decode unpadded: 20 per group)
    for nvs in (6144, 2048):
        assert pick(8192, 5120, nvs, fused=True, groups=20) == configs.GluonConfig(
            block_n=128, stages=4, pingpong=False, skip_idle_half=True, skip_lone_tiles_only=True)
    assert pick(2048, 7168, 1024, fused=True, groups=52).pingpong
    assert pick(1536, 4096, 6144, fused=True, groups=20).pingpong  # qwen3-235b-sized (H = 4096): ping-pong
    assert not pick(2048, 768, 48896, fused=False).pingpong  # qwen3 down
    for nvs in (13312, 20480, 45056):  # kimi-k2 down (K = 2048): 128x256 tiles, three stages or four
        split = nvs == 20480  # S=1024: four stages and a split epilogue
        assert pick(7168, 2048, nvs, fused=False) == configs.GluonConfig(
            block_n=256, stages=4 if split else 3, pingpong=False, skip_idle_half=True,
            skip_lone_tiles_only=nvs >= 32768, epilogue_n=128 if split else 0)
        assert pick(2048, 7168, nvs, fused=False).block_n == 128  # its unfused gate/up GEMMs
    # H = 7168, I = 4096 (the layout sweep's top-1 and top-8 models): the same 128x256 down tiles
    assert pick(7168, 4096, 69632, fused=False) == configs.GluonConfig(
        block_n=256, stages=3, pingpong=False, skip_idle_half=True, skip_lone_tiles_only=True)
    assert pick(7168, 4096, 1024, fused=False, groups=8) == configs.GluonConfig(
        block_n=256, stages=3, pingpong=False, skip_idle_half=True)
    assert pick(7168, 4096, 1920, fused=False, groups=64).block_n == 128  # padded decode: 30 rows per group
    assert pick(5120, 8192, 6144, fused=False).block_n == 128  # llama4 down (K = 8192): ping-pong 128x128
    assert pick(8192, 5120, 6144, fused=False).block_n == 128  # llama4's unfused gate/up GEMMs
    assert pick(768, 2048, 48896, fused=False).pingpong  # qwen3's unfused gate/up GEMMs
    # The tail's zeros: by the producer warp on long reductions, by the consumers on short ones.
    assert pick(7168, 2048, 13312, fused=False).tail_by_producer  # kimi-k2 decode down
    assert not pick(2048, 768, 48896, fused=False).tail_by_producer  # qwen3 down
    # Idle upper halves of every segment's last row tile skipped only where measured faster:
    # qwen3 S=2048's GEMMs and kimi-k2's down GEMMs below NvS 32768. Elsewhere those of a
    # segment's only row tile alone, except in kimi-k2's cooperative fused GEMMs: there only where
    # the kernel finds the live segments one row tile each (decode: no partner to drift from; where
    # segments span several row tiles, the skip breaks the step of the programs sharing weight tiles).
    for nvs in (8192, 13312, 20480, 45056):
        assert skips(pick(2048, 7168, nvs, fused=True)) == "short"
    assert skips(pick(768, 2048, 48896, fused=True)) == "last"
    assert skips(pick(768, 2048, 33024, fused=True)) == "lone"  # qwen3 S=64 gate/up
    assert skips(pick(2048, 768, 48896, fused=False)) == "last"
    assert skips(pick(2048, 768, 33024, fused=False)) == "lone"
    assert skips(pick(5120, 8192, 6144, fused=False)) == "lone"  # llama4 down (K = 8192)
    assert skips(pick(8192, 5120, 6144, fused=True)) == "lone"  # llama4 gate/up
    # The output's tail zeroed by the fused GEMM: qwen3 S=2048 only.
    assert pick(768, 2048, 48896, fused=True).takes_out_tail
    assert not any(pick(2048, 7168, nvs, fused=True).takes_out_tail for nvs in (13312, 20480, 45056))
    assert not pick(768, 2048, 33024, fused=True).takes_out_tail
    # The row-tile handoff to the down GEMM: kimi-k2 decode's pair and the unpadded S=1024 one
    # (NvS 8192); nowhere else (it costs more than the early start buys there).
    assert pick(2048, 7168, 13312, fused=True).handoff and pick(2048, 7168, 8192, fused=True).handoff
    assert not any(pick(2048, 7168, nvs, fused=True).handoff for nvs in (20480, 32768, 45056))
    assert not any(pick(768, 2048, nvs, fused=True).handoff for nvs in (512, 16384, 33024, 48896))
    assert not any(pick(8192, 5120, nvs, fused=True).handoff for nvs in (2048, 6144))
    assert not any(pick(n, k, nvs, fused=False).handoff for n, k, nvs in ((7168, 2048, 13312), (2048, 768, 48896)))


def test_tiny_segments_skip_idle_halves_in_every_config():
    """Fewer than 64 rows per group (unpadded decode): the picks skip every segment's last row
    tile's idle upper half, except the cooperative fused config of long reductions, which skips
    where the kernel finds the live segments short (an expert-parallel rank's buffer: most groups
    empty, the live segments one row tile each in decode, several in prefill)."""
    pick = configs.gluon_gemm_config
    for n, k, nvs, g, fused in ((2048, 7168, 1024, 52, True),  # kimi-k2 decode, unpadded
                                (7168, 2048, 1024, 52, False),
                                (768, 2048, 512, 132, True), (2048, 768, 512, 132, False),  # qwen3 S=64
                                (4096, 7168, 32, 132, True), (7168, 4096, 32, 132, False)):  # top-1, 1-row segments
        assert skips(pick(n, k, nvs, fused, groups=g)) == "last"
        if fused and k >= 5120:  # long fused reductions below 8192 rows: ping-pong on tiny segments only
            assert pick(n, k, nvs, fused, groups=g).pingpong and not pick(n, k, nvs, fused).pingpong
            continue
        if k == 4096:  # I = 4096's down GEMM: its 128x256 tiles only from 64 rows per group
            assert pick(n, k, nvs, fused, groups=g).block_n == 128 and pick(n, k, nvs, fused).block_n == 256
            continue
        assert pick(n, k, nvs, fused, groups=g) == dataclasses.replace(pick(n, k, nvs, fused), skip_idle_half=True,
                                                                       skip_lone_tiles_only=False)
    # 64 rows per group and more: the table's own pick, else segments' only row tiles
    assert skips(pick(768, 2048, 33024, True, groups=132)) == "lone"  # qwen3 S=64 padded: 250 per group
    assert skips(pick(2048, 768, 16384, False, groups=132)) == "lone"  # qwen3 S=2048 unpadded: 124
    assert skips(pick(4096, 7168, 1024, True, groups=8)) == "lone"  # 128 per group
    for nvs in (8192, 20480):  # kimi-k2 S=1024 unpadded and padded: G = 388, 52 of them live
        assert pick(2048, 7168, nvs, True, groups=388) == pick(2048, 7168, nvs, True)
        assert skips(pick(2048, 7168, nvs, True, groups=388)) == "short"


def test_cooperative_down_gemm_keeps_shared_memory_room_for_long_reductions():
    """Six stages of the cooperative 128x128 down GEMM plus its tail buffer and the handoff's
    barriers overflow the 227 KiB from K = 4096 (the unfused gate/up GEMMs of H = 7168,
    I = 4096; a down GEMM of I = 4096 with H under 4096): five stages there."""
    pick = configs.gluon_gemm_config
    assert pick(4096, 7168, 15616, fused=False) == configs.GluonConfig(stages=5, pingpong=False,
                                                                      skip_idle_half=True, skip_lone_tiles_only=True)
    assert pick(2048, 4096, 12416, fused=False).stages == 5
    assert pick(2048, 768, 33024, fused=False).stages == 6  # qwen3 down: unchanged


def test_epilogue_n_is_the_whole_tile_or_half_of_it():
    assert configs.GluonConfig(block_n=256, epilogue_n=128).epilogue_n == 128
    assert configs.GluonConfig(block_n=256).epilogue_n == 0
    assert configs.GluonConfig(block_n=128, epilogue_n=128).epilogue_n == 128  # the whole tile, as 0
    with pytest.raises(ValueError) as err:
        configs.GluonConfig(block_n=128, epilogue_n=32)
    assert str(err.value) == ("GluonConfig: epilogue_n must be 0 or block_n = 128 (the whole tile) or "
                              "block_n // 2 = 64, got 32")


@pytest.mark.parametrize("fields", [dict(pingpong=False, stages=4), dict(stages=5), dict(stages=4, handoff=True)],
                         ids=["cooperative", "odd_stages", "handoff"])
def test_split_ring_needs_pingpong_even_stages_and_no_handoff(fields):
    """Each ping-pong consumer gets half of the ring; the handoff's dynamic schedule hands items to
    the consumers in turn, which split rings do not have."""
    assert configs.GluonConfig(stages=4, split_ring=True).consumers == 2
    with pytest.raises(ValueError, match="GluonConfig: split_ring needs ping-pong, no handoff and an even number"):
        configs.GluonConfig(split_ring=True, **fields)


def test_fp8_configs():
    """The FP8 GEMMs: 128-deep K blocks (the scale block), 128 columns (one weight-scale block; the
    fused GEMM's act scale group), two ping-pong consumers. Under 64 rows per group (decode), or
    with small experts up to 256 rows per group (or an unknown group count): 64-row items on split
    rings, two stages each for the fused GEMM, four for the plain one, idle tiles skipped where the
    kernel finds two-tile segments. Elsewhere both consumers on each 128-row item (split rows), four
    stages for the fused GEMM and six for the plain one, idle upper halves of lone tiles skipped
    except for large experts in buffers of 32768 rows and more. From 256 groups the segment walk
    steps over runs of empty segments a chunk at a time."""
    pick = configs.gluon_fp8_config
    ring = dict(block_m=64, block_n=128, block_k=128, pingpong=True, split_ring=True, tail_by_producer=True,
                skip_idle_tiles=True)
    # kimi-k2 decode, S=1024 and under 64 rows per group; qwen3-30b-a3b unpadded S=64, padded S=64
    # (250 rows per group), at 256 rows per group, unpadded S=4096 (248), with no group count
    for nvs, groups, n, k in ((13312, 388, 2048, 7168), (20480, 388, 2048, 7168), (1024, 388, 2048, 7168),
                              (1500, 104, 2048, 7168), (512, 132, 1536, 2048), (33024, 132, 1536, 2048),
                              (16384, 64, 1536, 2048), (32768, 132, 1536, 2048), (48896, 0, 1536, 2048)):
        runs = groups >= 256
        # (large experts from 48 rows per group: two launches)
        paired = False if n * k >= configs.LARGE_EXPERT and nvs >= 48 * groups else None
        assert pick(n, k, nvs, fused=True, groups=groups) == configs.GluonConfig(stages=4, skip_empty_runs=runs,
                                                                                 on_multi_tile=paired, **ring)
        plain = dict(ring, tail_by_producer=n >= 2048)  # (the down GEMM's reduction is I)
        assert pick(k, n, nvs, fused=False, groups=groups) == configs.GluonConfig(stages=8, skip_empty_runs=runs,
                                                                                  on_multi_tile=paired, **plain)
    rows = dict(block_m=128, block_n=128, block_k=128, pingpong=True, split_rows=True, tail_by_producer=True,
                skip_lone_tiles_only=True)
    # kimi-k2 prefill, S=1024 at 64 rows per group, llama4, with no group count; qwen3-30b-a3b padded
    # S=2048 (370 rows per group), just above 256 rows per group, and a prefill-sized buffer
    for nvs, groups, n, k, skip in ((45056, 388, 2048, 7168, False), (32768, 388, 2048, 7168, False),
                                    (24832, 388, 2048, 7168, True), (6144, 20, 8192, 5120, True),
                                    (2048, 20, 8192, 5120, True), (45056, 0, 2048, 7168, False),
                                    (48896, 132, 1536, 2048, True), (16448, 64, 1536, 2048, True),
                                    (163072, 388, 1536, 2048, True)):
        rows_here = dict(rows, skip_idle_half=skip, skip_empty_runs=groups >= 256)
        assert pick(n, k, nvs, fused=True, groups=groups) == configs.GluonConfig(stages=4, **rows_here)
        plain = dict(rows_here, tail_by_producer=n >= 2048)  # (the down GEMM's reduction is I)
        assert pick(k, n, nvs, fused=False, groups=groups) == configs.GluonConfig(stages=6, **plain)
    assert not pick(2048, 768, 48896, fused=False, groups=132).tail_by_producer  # qwen3 down: K = 768
    # runs of empty segments stepped over a chunk at a time from 256 groups (kimi-k2's 388, the
    # layout sweep's 260 and 1000), one at a time below (qwen3-30b-a3b's 132) and with no group count
    assert [pick(1536, 2048, 512 * g, fused=True, groups=g).skip_empty_runs for g in (0, 132, 255, 256, 1000)] == [
        False, False, False, True, True]


def test_fp8_gemms_of_large_experts_in_tiny_buffers_launch_twice():
    """Large experts from 48 to 64 rows per group, in buffers of more than 128 rows: split rings
    for segments of one 128-row tile or partly empty tiles (decode, unpadded), then split rows,
    without the idle-half skip, for segments of several full tiles (an expert-parallel rank's
    padded prefill); the kernels decide. Elsewhere one launch, and the second config is None."""
    second = configs.gluon_fp8_multi_tile_config
    rows = dict(block_m=128, block_n=128, block_k=128, pingpong=True, split_rows=True, on_multi_tile=True)
    # kimi-k2 S=1024 padded (52.8 rows per group), at 48 rows per group, llama4 (57.6)
    for nvs, groups, n, k in ((20480, 388, 2048, 7168), (18624, 388, 2048, 7168), (1152, 20, 8192, 5120)):
        for fused, stages, (n_here, k_here) in ((True, 4, (n, k)), (False, 6, (k, n))):
            assert configs.gluon_fp8_config(n_here, k_here, nvs, fused, groups=groups).on_multi_tile is False
            assert second(n_here, k_here, nvs, fused, groups=groups) == configs.GluonConfig(
                stages=stages, tail_by_producer=k_here >= 2048, skip_empty_runs=groups >= 256, **rows)
    # kimi-k2 decode (padded: 34.3 rows per group), unpadded S=1024 (21.1), just under 48 rows per
    # group; 128 rows or fewer (no segment of two tiles), 64 rows per group and more, small experts,
    # no group count
    for nvs, groups, n, k in ((13312, 388, 2048, 7168), (8192, 388, 2048, 7168), (18623, 388, 2048, 7168),
                              (128, 2, 2048, 7168), (24832, 388, 2048, 7168), (512, 132, 1536, 2048),
                              (33024, 132, 1536, 2048), (13312, 0, 2048, 7168)):
        assert configs.gluon_fp8_config(n, k, nvs, True, groups=groups).on_multi_tile is None
        assert second(n, k, nvs, True, groups=groups) is None


def test_a_launch_pair_takes_no_handoff():
    """Each launch of a pair writes a whole GEMM or nothing: no row-tile handoff between them."""
    assert configs.GluonConfig(on_multi_tile=True).on_multi_tile
    with pytest.raises(ValueError, match="GluonConfig: on_multi_tile \\(one of two launches\\) needs no handoff"):
        configs.GluonConfig(on_multi_tile=False, handoff=True)


def test_a_launch_pair_is_a_pdl_pair_or_plain():
    """A GEMM's pair of launches: the second a programmatic dependent of the first, or both plain;
    one launch keeps the caller's role, and a pair takes none of its own."""
    from moonep_ops.kernels.cuda import paths
    from moonep_ops.kernels.pdl import PdlRole

    host = paths.gluon_host()
    if host is None:
        pytest.skip("this Triton has no usable Gluon")
    assert host._roles(2, PdlRole.NONE, True) == (PdlRole.PRIMARY, PdlRole.DEPENDENT)
    assert host._roles(2, PdlRole.NONE, False) == (PdlRole.NONE, PdlRole.NONE)
    assert host._roles(1, PdlRole.DEPENDENT, True) == (PdlRole.DEPENDENT,)
    with pytest.raises(ValueError, match="a GEMM's launches: one, or a pair without a PDL role of its own; got 2 "
                                         "launches in role primary"):
        host._roles(2, PdlRole.PRIMARY, True)


@pytest.mark.parametrize("on_multi_tile, run_on", [(None, 0), (True, 1), (False, 2)])
def test_on_multi_tile_reaches_the_kernel(on_multi_tile, run_on):
    """The kernel's ``RUN_ON`` constexpr is the config's ``on_multi_tile`` (CPU tensors: nothing
    launches)."""
    cfg = configs.GluonConfig(block_m=64, block_n=128, block_k=128, stages=8, split_ring=True,
                              on_multi_tile=on_multi_tile)
    args, _, _ = _plain_fp8_gemm(cfg)
    assert args["RUN_ON"] == run_on


@pytest.mark.parametrize("fields", [dict(pingpong=False), dict(split_ring=True, stages=4), dict(block_m=64),
                                    dict(handoff=True), dict(split_ring=True, stages=4, skip_idle_tiles=True)],
                         ids=["cooperative", "split_ring", "64_rows", "handoff", "idle_tiles"])
def test_split_rows_needs_pingpong_on_one_ring_and_128_rows(fields):
    """Both consumers take each item's halves of one ring's stages: ping-pong consumers, one ring,
    128-row tiles, no handoff (its consumers take turns) and no idle-tile skip (64-row tiles)."""
    assert configs.GluonConfig(stages=4, split_rows=True).consumers == 2
    with pytest.raises(ValueError) as err:
        configs.GluonConfig(split_rows=True, **fields)
    assert str(err.value).startswith("GluonConfig: split_rows needs ping-pong on one ring, 128-row tiles, no "
                                     "handoff and no skip_idle_tiles, got ")


@pytest.mark.parametrize("fields", [dict(stages=4), dict(stages=4, split_ring=True, skip_idle_half=True)],
                         ids=["one_ring", "idle_halves"])
def test_skip_idle_tiles_needs_split_rings_and_no_idle_halves(fields):
    """A skipped tile takes no ring stages: each consumer counts its own ring's items, which only
    split rings give it; a tile is skipped whole or computed (no idle halves)."""
    assert configs.GluonConfig(stages=4, split_ring=True, skip_idle_tiles=True).skip_idle_tiles
    with pytest.raises(ValueError) as err:
        configs.GluonConfig(skip_idle_tiles=True, **fields)
    assert str(err.value).startswith("GluonConfig: skip_idle_tiles needs split rings and no skip_idle_half, got ")


@pytest.mark.parametrize("skip, lone, on_long", [(False, False, True), (True, False, True), (True, True, True),
                                                 (True, False, False)])
def test_idle_half_switches_reach_the_kernel(skip, lone, on_long):
    """The kernel's ``SKIP_IDLE_HALF``, ``SKIP_LONE_ONLY`` and ``SKIP_ON_LONG_SEGMENTS`` constexprs are the
    config's fields (CPU tensors: the arguments are built, nothing launches)."""
    import torch

    from moonep_ops.kernels.cuda import paths

    host = paths.gluon_host()
    if host is None:
        pytest.skip("this Triton has no usable Gluon")
    a, w = torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(2, 128, 64, dtype=torch.bfloat16)
    out, cu = torch.empty(256, 128, dtype=torch.bfloat16), torch.tensor([100, 256], dtype=torch.int32)
    cfg = configs.GluonConfig(skip_idle_half=skip, skip_lone_tiles_only=lone, skip_on_long_segments=on_long)
    args = host.kernel_args(a, w, None, None, cu, out, cfg, host.descriptors(a, w, w, out, cfg, None))
    # (The producer loads the lower half alone through the half-tile descriptor: passed iff skipping.)
    assert (args["SKIP_IDLE_HALF"], args["SKIP_LONE_ONLY"], args["a_half_desc"] is not None) == (skip, lone, skip)
    assert args["SKIP_ON_LONG_SEGMENTS"] == on_long


def _plain_fp8_gemm(cfg):
    """A plain FP8 GEMM's CPU operands under ``cfg`` (nothing launches): the Gluon host module,
    its kernel arguments, its descriptors, and the error message the same config gets for bf16
    operands (None if accepted)."""
    import torch

    from moonep_ops.kernels.cuda import paths

    host = paths.gluon_host()
    if host is None:
        pytest.skip("this Triton has no usable Gluon")
    cu = torch.tensor([100, 256], dtype=torch.int32)
    a, w = torch.empty(256, 128, dtype=torch.float8_e4m3fn), torch.empty(2, 128, 128, dtype=torch.float8_e4m3fn)
    out = torch.empty(256, 128, dtype=torch.bfloat16)
    scales = host.Fp8Scales(torch.ones(256, 1), torch.ones(2, 1, 1), torch.ones(2, 1, 1))
    descs = host.descriptors(a, w, w, out, cfg, None)
    args = host.kernel_args(a, w, None, None, cu, out, cfg, descs, scales=scales)
    a, w = a.to(torch.bfloat16), w.to(torch.bfloat16)
    try:
        host.kernel_args(a, w, None, None, cu, out, cfg, host.descriptors(a, w, w, out, cfg, None))
        bf16_error = None
    except ValueError as err:
        bf16_error = str(err)
    return args, descs, bf16_error


def test_skip_idle_tiles_reaches_the_kernel_of_fp8_gemms_only():
    """The FP8 configs' ``skip_idle_tiles`` is the kernel's ``SKIP_IDLE_TILES``; the bf16 GEMMs
    (128-row tiles, which skip idle upper halves instead) refuse it (CPU tensors: the arguments are
    built, nothing launches)."""
    cfg = configs.gluon_fp8_config(128, 128, 64, fused=False, groups=2)  # under 64 rows per group
    args, _, bf16_error = _plain_fp8_gemm(cfg)
    assert (args["SKIP_IDLE_TILES"], args["SPLIT_RING"], args["FP8"]) == (True, True, True)
    assert bf16_error == "skip_idle_tiles: the FP8 GEMMs' 64-row tiles only, without the row-tile handoff"


def test_split_rows_reaches_the_kernel_of_fp8_gemms_only():
    """``split_rows`` is the kernel's ``SPLIT_ROWS``, each consumer storing 64-row halves (the
    output descriptor's box); the bf16 GEMMs refuse it (CPU tensors: nothing launches)."""
    cfg = configs.GluonConfig(block_m=128, block_n=128, block_k=128, stages=6, split_rows=True)
    args, descs, bf16_error = _plain_fp8_gemm(cfg)
    assert descs[3].block_shape == [64, 128]
    assert (args["SPLIT_ROWS"], args["SPLIT_RING"], args["PINGPONG"], args["BLOCK_M"]) == (True, False, True, 128)
    assert bf16_error == "split_rows: the FP8 GEMMs only"
