"""CUDA-only: capture safety (no host sync, graph capture/replay) and large-size addressing."""

import pytest
import torch

import moonep_ops
from .layouts import Layout, experts_inputs, grouped_gemm_inputs, silu_mul_weight_inputs
from .reference import TOLERANCE, experts_ref, grouped_gemm_ref, rel_err, silu_mul_weight_ref
from .sync import sync_errors

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NVS = 640
# Two layouts with the same G and NvS but different segments: a graph captured on one
# must replay correctly on the other after an in-place copy of the inputs.
LAYOUT_A = Layout("capture_a", (128, 0, 256, 0, 128, 0), NVS, k=96, n=80, padded_to=1)
LAYOUT_B = Layout("capture_b", (0, 384, 0, 7, 0, 200), NVS, k=96, n=80, padded_to=1)


def _copy_into(dst, src):
    for d, s in zip(dst, src):
        if d is not None:
            d.copy_(s)


def _capture(fn, *args):
    """Warm up on a side stream, capture ``fn(*args)`` in a graph; return (graph, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)  # compiles the Triton kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grouped_gemm_graph_replay_with_new_routing(dtype):
    inputs = grouped_gemm_inputs(LAYOUT_A, dtype, "cuda")
    graph, out = _capture(moonep_ops.grouped_gemm, *inputs)
    for layout in (LAYOUT_B, LAYOUT_A, LAYOUT_B):
        new = grouped_gemm_inputs(layout, dtype, "cuda")
        _copy_into(inputs, new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moonep_ops.grouped_gemm(*new))
        assert rel_err(out, grouped_gemm_ref(*new)) <= TOLERANCE[dtype]


def test_grouped_gemm_out_graph_replay():
    a, w, cu = grouped_gemm_inputs(LAYOUT_A, torch.bfloat16, "cuda")
    out = torch.empty(NVS, LAYOUT_A.n, dtype=torch.bfloat16, device="cuda")
    graph, _ = _capture(lambda *args: moonep_ops.grouped_gemm(*args, out=out), a, w, cu)
    new = grouped_gemm_inputs(LAYOUT_B, torch.bfloat16, "cuda")
    _copy_into((a, w, cu), new)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, grouped_gemm_ref(*new)) <= 1e-2
    assert torch.equal(out[LAYOUT_B.total:], torch.zeros_like(out[LAYOUT_B.total:]))


@pytest.mark.parametrize("with_weights", [True, False])
def test_silu_mul_weight_graph_replay(with_weights):
    inputs = silu_mul_weight_inputs(LAYOUT_A, torch.bfloat16, "cuda", with_weights=with_weights)
    graph, out = _capture(moonep_ops.silu_mul_weight, *inputs)
    new = silu_mul_weight_inputs(LAYOUT_B, torch.bfloat16, "cuda", with_weights=with_weights)
    _copy_into(inputs, new)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moonep_ops.silu_mul_weight(*new))
    assert rel_err(out, silu_mul_weight_ref(*new)) <= 1e-2


@pytest.mark.parametrize("with_weights", [True, False])
def test_grouped_gemm_silu_mul_with_gate_up_graph_replay_and_no_sync(with_weights):
    x, w_gate, w_up, _, cu, rw = experts_inputs(LAYOUT_A, torch.bfloat16, "cuda", with_weights=with_weights)
    inputs = (x, w_gate, w_up, rw, cu)
    graph, outs = _capture(moonep_ops.grouped_gemm_silu_mul_with_gate_up, *inputs)
    nx, nwg, nwu, _, ncu, nrw = experts_inputs(LAYOUT_B, torch.bfloat16, "cuda", with_weights=with_weights)
    new = (nx, nwg, nwu, nrw, ncu)
    _copy_into(inputs, new)
    for t in outs:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = moonep_ops.grouped_gemm_silu_mul_with_gate_up(*new)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(outs, eager):
        assert torch.equal(got, want)
    act, gate, up = outs
    assert rel_err(gate, grouped_gemm_ref(nx, nwg, ncu)) <= TOLERANCE[torch.bfloat16]
    assert rel_err(up, grouped_gemm_ref(nx, nwu, ncu)) <= TOLERANCE[torch.bfloat16]
    assert rel_err(act, silu_mul_weight_ref(gate, up, nrw, ncu)) <= TOLERANCE[torch.bfloat16]


def test_experts_graph_replay_and_no_sync():
    inputs = experts_inputs(LAYOUT_A, torch.bfloat16, "cuda")
    out = torch.empty(NVS, LAYOUT_A.k, dtype=torch.bfloat16, device="cuda")

    def step(*args):
        return moonep_ops.moonep_experts(*args, out=out)

    graph, _ = _capture(step, *inputs)
    new = experts_inputs(LAYOUT_B, torch.bfloat16, "cuda")
    _copy_into(inputs, new)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, experts_ref(*new)) <= 1e-2

    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = moonep_ops.moonep_experts(*new)
        eager_out = torch.empty_like(eager)
        moonep_ops.moonep_experts(*new, out=eager_out)
        moonep_ops.moonep_experts(*new[:-1], None)  # route weights applied on the input
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(eager, out)
    assert torch.equal(eager_out, out)


def _rows_ref(a, w, cu_list, rows):
    """float64 result for selected rows, computed on the GPU (the full reference is too big)."""
    import bisect
    res = []
    for r in rows:
        g = bisect.bisect_right(cu_list, r)
        res.append(a[r].double() @ w[g].double().T)
    return torch.stack(res)


@pytest.mark.parametrize("case", ["many_rows", "many_groups"])
def test_large_sizes_no_int32_overflow(case):
    """NvS*K and G*N*K beyond 2**31 elements: 64-bit addressing in the kernels."""
    if case == "many_rows":
        nvs, k, n, g = 262144, 8320, 128, 4
        sizes = [65536, 0, 131072, 65536 - 200]
    else:
        nvs, k, n, g = 8192, 640, 1024, 4096
        sizes = [3 if i % 4 == 0 else 0 for i in range(g - 1)]
        sizes.append(nvs - sum(sizes) - 64)
    free = torch.cuda.mem_get_info()[0]
    if free < 12 * 2 ** 30:
        pytest.skip("needs 12 GiB of free GPU memory")
    a = torch.randn(nvs, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    assert max(a.numel(), w.numel()) > 2 ** 31
    cu_list = torch.tensor(sizes).cumsum(0).tolist()
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    a[cu_list[-1]:] = float("nan")
    out = moonep_ops.grouped_gemm(a, w, cu)
    torch.cuda.synchronize()
    last = cu_list[-1]
    rows = [0, 1, cu_list[0] - 1, last // 2, last - 2, last - 1]
    rows = sorted({r for r in rows if 0 <= r < last})
    ref = _rows_ref(a, w, cu_list, rows)
    got = out[rows].double()
    assert float((got - ref).norm() / ref.norm()) <= 1e-2
    assert not torch.isnan(out).any()
    assert torch.count_nonzero(out[last:]) == 0


# FP8 block-scaled experts: layouts with K and N multiples of 128 (the TMA path on sm90).
FP8_LAYOUT_A = Layout("fp8_capture_a", (128, 0, 256, 0, 128, 0), NVS, k=256, n=384, padded_to=1)
FP8_LAYOUT_B = Layout("fp8_capture_b", (0, 384, 0, 7, 0, 200), NVS, k=256, n=384, padded_to=1)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs sm89+")
@pytest.mark.parametrize("pair", [False, True], ids=["table", "launch_pair"])
@pytest.mark.parametrize("block_major", [False, True], ids=["row_major", "block_major"])
@pytest.mark.parametrize("with_weights", [True, False])
def test_experts_fp8_graph_replay_with_new_routing_and_no_sync(monkeypatch, with_weights, block_major, pair):
    """Captured once, replayed with new segments, rows and route weights each step: matches the
    eager call bitwise and the float64 reference; the tail is zero; no call syncs the host. The
    weights row-major or block-major (the reference reads the row-major ones). With ``pair`` (sm90)
    each GEMM is the config table's launch pair, split rings then split rows as a PDL dependent:
    layout A is the split rows launch's kind (segments of full 128-row tiles), B the split rings'
    (partly empty tiles), so the replays switch between the launches that work."""
    from moonep_ops import fp8

    from .layouts import fp8_experts_inputs
    from .test_fp8 import _SM90, CUDA_EXPERTS_TOLERANCE, SPLIT_RING_FP8, _forced_fp8_table, ref_experts_fp8

    if pair and not _SM90:
        pytest.skip("the launch pair is the Gluon FP8 kernels' (sm90)")
    launched = _forced_fp8_table(monkeypatch, dict(SPLIT_RING_FP8, on_multi_tile=False)) if pair else None

    def flat(inputs, layout=lambda w: w):  # (x, scaled weights..., cu, rw) -> the op's argument order
        x, (wg, sg), (wu, su), (wd, sd), cu, rw = inputs
        return [x, layout(wg), sg, layout(wu), su, layout(wd), sd, rw, cu]

    weights = fp8.to_block_major if block_major else (lambda w: w)

    args = flat(fp8_experts_inputs(FP8_LAYOUT_A, torch.bfloat16, "cuda", with_weights=with_weights), weights)
    out = torch.empty_like(args[0])

    def step(x, wg, sg, wu, su, wd, sd, rw, cu):
        return moonep_ops.moonep_experts(x, wg, wu, wd, cu, rw, out=out, w_gate_scale=sg, w_up_scale=su,
                                         w_down_scale=sd)

    step(*args)  # compiles the kernels
    assert launched is None or [launch.on_multi_tile for launch in launched] == [False, True] * 2, \
        "the GEMMs did not run as launch pairs"
    with sync_errors():
        step(*args)  # a warm eager call syncs nothing
    graph, _ = _capture(step, *args)
    for layout in (FP8_LAYOUT_B, FP8_LAYOUT_A, FP8_LAYOUT_B):
        inputs = fp8_experts_inputs(layout, torch.bfloat16, "cuda", with_weights=with_weights)
        new = flat(inputs, weights)
        _copy_into(args, new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.ops.moonep.experts_fp8(*new)
        assert torch.equal(out, eager)
        assert rel_err(out, ref_experts_fp8(*flat(inputs))) <= CUDA_EXPERTS_TOLERANCE
        assert torch.equal(out[layout.total:], torch.zeros_like(out[layout.total:]))
