"""The single-device MoonEP layout emulator (moonep_ops.layout), checked on the host row by row."""

import bisect
import collections

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moonep_ops
from moonep_ops import layout
from tests.reference import TOLERANCE, rel_err

from .conftest import BACKENDS, CUDA_MARKS, assert_no_graph_breaks, sync_errors
from .dense_moe import dense_moe_ref


def _routing(num_tokens, topk, num_experts, *, device="cpu", hot=None):
    """Distinct experts per token; ``hot`` (an expert id) joins every token's choice."""
    ids = torch.stack([torch.randperm(num_experts)[:topk] for _ in range(num_tokens)])
    if hot is not None:
        has_hot = (ids == hot).any(1)
        ids[~has_hot, 0] = hot
    weights = torch.rand(num_tokens, topk) + 0.05
    return ids.to(device), weights.to(device)


def check_layout(d, x, ids, weights, num_experts, token_padding, *, weights_on_input=False):
    """Every property CONTRACT.md states about MoonEP's layout, by plain loops over the rows."""
    x, ids, weights = x.cpu(), ids.cpu().tolist(), weights.cpu().float()
    num_tokens, topk = len(ids), len(ids[0])
    nvs = d.x_nvs.shape[0]
    cu = d.cu_seqlens.cpu()
    assert cu.dtype == torch.int32 and d.route_weights.dtype == torch.float32
    cu = cu.tolist()
    ends = [0] + cu
    prefetch_for = d.prefetch_for.cpu().tolist()
    assert len(cu) == num_experts + len(prefetch_for)
    x_nvs, rw = d.x_nvs.cpu(), d.route_weights.cpu()
    src, valid, row_of = d.src_token.cpu().tolist(), d.valid.cpu().tolist(), d.row_of.cpu().tolist()

    # Every (token, k) owns one real row, in a segment of its expert or of a slot mirroring it.
    seen = set()
    for s in range(num_tokens):
        for k in range(topk):
            r = row_of[s][k]
            assert r not in seen and 0 <= r < cu[-1]
            seen.add(r)
            g = bisect.bisect_right(cu, r)
            e = ids[s][k]
            assert g == e or (g >= num_experts and prefetch_for[g - num_experts] == e), (s, k, g)
            assert src[r] == s and valid[r]
            assert rw[r].item() == weights[s, k].item()
            want = (x[s].float() * weights[s, k]).to(x.dtype) if weights_on_input else x[s]
            assert torch.equal(x_nvs[r], want)
    assert sum(valid) == num_tokens * topk == len(seen)

    # Segments: real rows first, in (token, k) order, then zero padding up to the next multiple.
    for g in range(len(cu)):
        start, end = ends[g], ends[g + 1]
        assert end >= start
        real = [r for r in range(start, end) if valid[r]]
        assert real == list(range(start, start + len(real)))
        flat = [src[r] * topk + next(k for k in range(topk) if row_of[src[r]][k] == r) for r in real]
        assert flat == sorted(flat)
        assert end - start == -(-len(real) // token_padding) * token_padding  # minimal padding
        for r in range(start + len(real), end):
            assert src[r] == num_tokens and rw[r].item() == 0.0
            assert torch.equal(x_nvs[r], torch.zeros_like(x_nvs[r]))
    for r in range(cu[-1], nvs):
        assert not valid[r] and src[r] == num_tokens


@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(1, 24), topk=st.integers(1, 4), extra_experts=st.integers(0, 5),
       num_prefetch=st.integers(0, 3), token_padding=st.sampled_from([1, 2, 8, 128]),
       skew=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_layout_properties(num_tokens, topk, extra_experts, num_prefetch, token_padding, skew, seed):
    torch.manual_seed(seed)
    num_experts = topk + extra_experts
    num_prefetch = min(num_prefetch, num_experts)
    x = torch.randn(num_tokens, 8)
    ids, weights = _routing(num_tokens, topk, num_experts, hot=0 if skew else None)
    d = layout.dispatch(x, ids, weights, num_experts, token_padding=token_padding,
                        num_prefetch=num_prefetch, fill_tail=float("nan"))
    check_layout(d, x, ids, weights, num_experts, token_padding)
    assert d.x_nvs.shape[0] == layout.nvs_bound(num_tokens, topk, num_experts, token_padding)
    # The tail is NaN (as asked), the padding is not.
    tail = d.x_nvs[d.cu_seqlens[-1]:]
    assert torch.isnan(tail).all() and torch.isnan(d.route_weights[d.cu_seqlens[-1]:]).all()
    assert not torch.isnan(d.x_nvs[:d.cu_seqlens[-1]]).any()


@pytest.mark.parametrize("args,expected", [
    ((5, 3, 4, 1), 15),  # unpadded: exactly S*K
    ((128, 8, 48, 128), 13312),  # kimi-k2 EP8 rows of BASELINE.md
    ((1024, 8, 48, 128), 20480),
    ((4096, 8, 48, 128), 45056),
    ((64, 8, 128, 128), 33024),  # qwen3-30b-a3b EP1
    ((2048, 8, 128, 128), 48896),
    ((2048, 1, 16, 128), 6144),  # llama4-scout top-1
])
def test_nvs_bound(args, expected):
    assert layout.nvs_bound(*args) == expected


def test_empty_groups_repeat_previous_end():
    x = torch.randn(5, 4)
    ids = torch.tensor([[2, 4], [4, 2], [2, 4], [4, 2], [2, 4]])
    w = torch.rand(5, 2)
    d = layout.dispatch(x, ids, w, 6, token_padding=4)
    assert d.cu_seqlens.tolist() == [0, 0, 8, 8, 16, 16]
    check_layout(d, x, ids, w, 6, 4)


def test_route_weights_in_row_order():
    x = torch.randn(3, 4)
    ids = torch.tensor([[1, 0], [0, 1], [1, 0]])
    w = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    d = layout.dispatch(x, ids, w, 2, token_padding=1)
    # Expert 0: (t0,k1), (t1,k0), (t2,k1); expert 1: (t0,k0), (t1,k1), (t2,k0).
    assert d.cu_seqlens.tolist() == [3, 6]
    assert d.src_token.tolist() == [0, 1, 2, 0, 1, 2]
    assert torch.equal(d.route_weights, torch.tensor([0.2, 0.3, 0.6, 0.1, 0.4, 0.5]))
    assert d.row_of.tolist() == [[3, 0], [1, 4], [5, 2]]


def test_prefetch_split():
    """A mirrored expert keeps the first run of its tokens; each slot takes a later, equal run."""
    x = torch.randn(5, 4)
    ids = torch.tensor([[1], [1], [0], [1], [1]])
    w = torch.ones(5, 1)
    one = layout.dispatch(x, ids, w, 3, token_padding=1, prefetch_for=torch.tensor([1]))
    # Expert 1 has tokens 0, 1, 3, 4: two stay, two go to slot 3.
    assert one.cu_seqlens.tolist() == [1, 3, 3, 5]
    assert one.src_token.tolist() == [2, 0, 1, 3, 4]
    two = layout.dispatch(x, ids, w, 3, token_padding=1, prefetch_for=torch.tensor([1, 1]))
    assert two.cu_seqlens.tolist() == [1, 3, 3, 4, 5]  # 4 tokens in 3 runs: 2, 1, 1
    assert two.src_token.tolist() == [2, 0, 1, 3, 4]
    idle = layout.dispatch(x, ids, w, 3, token_padding=1, prefetch_for=torch.tensor([2]))
    assert idle.cu_seqlens.tolist() == [1, 5, 5, 5]  # a slot for an idle expert stays empty
    for d, pf in ((one, [1]), (two, [1, 1]), (idle, [2])):
        check_layout(d, x, ids, w, 3, 1)
        assert d.prefetch_for.tolist() == pf


def test_prefetch_auto_picks_hottest():
    ids, w = _routing(40, 3, 9)
    counts = collections.Counter(ids.flatten().tolist())
    hottest = sorted(range(9), key=lambda e: (-counts[e], e))[:4]
    x = torch.randn(40, 4)
    d = layout.dispatch(x, ids, w, 9, num_prefetch=4, token_padding=8)
    assert d.prefetch_for.tolist() == hottest
    check_layout(d, x, ids, w, 9, 8)
    with pytest.raises(ValueError, match="distinct hot experts"):
        layout.dispatch(torch.randn(4, 4), ids[:4], w[:4], 9, num_prefetch=10)


def test_expand_weights():
    w = torch.randn(5, 3, 2)
    big = layout.expand_weights(w, torch.tensor([4, 0, 4]))
    assert big.shape == (8, 3, 2) and big.is_contiguous()
    assert torch.equal(big[:5], w)
    assert torch.equal(big[5], w[4]) and torch.equal(big[6], w[0]) and torch.equal(big[7], w[4])


def test_combine_never_reads_padding_or_tail():
    x = torch.randn(7, 4)
    ids, w = _routing(7, 2, 5)
    d = layout.dispatch(x, ids, w, 5, token_padding=8, num_prefetch=2)
    y = torch.where(d.valid[:, None], torch.randn(d.num_rows, 4), float("nan"))
    out = layout.combine(y, d, 7)
    want = torch.zeros(7, 4, dtype=torch.float64)
    for r in range(d.num_rows):
        if d.valid[r]:
            want[d.src_token[r]] += y[r].double()
    assert rel_err(out, want) <= TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="num_tokens"):
        layout.combine(y, d, 8)
    with pytest.raises(ValueError) as info:  # before an index past y's rows
        layout.combine(y[:-1], d)
    assert str(info.value) == (f"moonep_ops.layout.combine: y_nvs must be [NvS, H] with NvS = {d.num_rows} (the "
                               f"dispatch's rows), got shape [{d.num_rows - 1}, 4]")


def test_overflow_is_caught():
    x = torch.randn(6, 4)
    ids = torch.arange(6)[:, None] % 3  # three experts, two tokens each: 3 segments of 8 rows
    w = torch.ones(6, 1)
    layout.dispatch(x, ids, w, 3, token_padding=8, num_rows=24)  # fits exactly
    with pytest.raises(RuntimeError, match="do not fit"):
        layout.dispatch(x, ids, w, 3, token_padding=8, num_rows=23)
    with pytest.raises(ValueError, match="cannot hold"):
        layout.dispatch(x, ids, w, 3, token_padding=8, num_rows=5)


@pytest.mark.parametrize("change, message", [
    (dict(ids=[[0, 9], [1, 2]]), "topk_ids must lie in [0, num_experts = 4)"),  # (the assert's RuntimeError)
    (dict(ids=[[0, -1], [1, 2]]), "topk_ids must lie in [0, num_experts = 4)"),
    (dict(ids=[[0.0, 1.0], [1.0, 2.0]]), "topk_ids must hold integers, got torch.float32"),
    (dict(ids=[[0, 1]]), "topk_ids must be [S, K] with S = 2 (x's rows), got shape [1, 2]"),
    (dict(weights=[[0.5, 0.5]]), "topk_weights must be shaped like topk_ids [2, 2], got [1, 2]"),
    (dict(token_padding=0), "num_experts and token_padding must be at least 1 and num_prefetch at least 0, got 4, 0 "
                            "and 0"),
])
def test_bad_dispatch_arguments_are_named(change, message):
    """Before any indexing (ids out of range: an assert, as the segments' fit, so no host read)."""
    ids = torch.tensor(change.get("ids", [[0, 1], [1, 2]]))
    weights = torch.tensor(change.get("weights", [[0.5, 0.5], [0.5, 0.5]]))
    with pytest.raises(RuntimeError if "lie in" in message else ValueError) as info:
        layout.dispatch(torch.randn(2, 8), ids, weights, 4, token_padding=change.get("token_padding", 8))
    assert str(info.value) == f"moonep_ops.layout.dispatch: {message}"


def test_default_bound_fits_worst_case():
    """Every group (experts and slots) holding one row: the most padding the bound must absorb."""
    e = 6
    ids = (torch.arange(2 * e) % e)[:, None]  # two tokens per expert; each slot takes one
    d = layout.dispatch(torch.randn(2 * e, 4), ids, torch.rand(2 * e, 1), e, token_padding=8,
                        prefetch_for=torch.arange(e))
    assert d.cu_seqlens[-1].item() == 2 * e * 8
    assert d.num_rows == layout.nvs_bound(2 * e, 1, e, 8) >= 2 * e * 8


@pytest.mark.parametrize("token_padding", [1, 8, 128])
@pytest.mark.parametrize("num_prefetch", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_experts_combine_matches_dense_moe(dtype, num_prefetch, token_padding):
    s, h, i, e, k = 20, 16, 24, 6, 3
    x = torch.randn(s, h).to(dtype)
    ids, w = _routing(s, k, e, hot=1)
    w_gate, w_up = ((torch.randn(e, i, h) / h ** 0.5).to(dtype) for _ in range(2))
    w_down = (torch.randn(e, h, i) / i ** 0.5).to(dtype)
    d = layout.dispatch(x, ids, w, e, token_padding=token_padding, num_prefetch=num_prefetch,
                        fill_tail=float("nan"))
    big = [layout.expand_weights(t, d.prefetch_for) for t in (w_gate, w_up, w_down)]
    y = moonep_ops.moonep_experts(d.x_nvs, *big, d.cu_seqlens, d.route_weights)
    out = layout.combine(y, d, s)
    assert out.dtype == dtype and out.shape == (s, h)
    assert rel_err(out, dense_moe_ref(x, w_gate, w_up, w_down, ids, w)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_top1_weights_on_input(dtype):
    s, h, i, e = 24, 16, 8, 4
    x = torch.randn(s, h).to(dtype)
    ids, w = _routing(s, 1, e)
    w_gate, w_up = ((torch.randn(e, i, h) / h ** 0.5).to(dtype) for _ in range(2))
    w_down = (torch.randn(e, h, i) / i ** 0.5).to(dtype)
    d = layout.dispatch(x, ids, w, e, token_padding=8, weights_on_input=True, fill_tail=float("nan"))
    check_layout(d, x, ids, w, e, 8, weights_on_input=True)
    y = moonep_ops.moonep_experts(d.x_nvs, w_gate, w_up, w_down, d.cu_seqlens, None)
    ref = dense_moe_ref(x, w_gate, w_up, w_down, ids, w, weights_on_input=True)
    assert rel_err(layout.combine(y, d), ref) <= TOLERANCE[dtype]
    # Weighting the output instead is a different function: the test can tell them apart.
    assert rel_err(layout.combine(y, d), dense_moe_ref(x, w_gate, w_up, w_down, ids, w)) > 1e-2


def _dispatch_combine(x, ids, w, fill_tail=float("nan")):
    d = layout.dispatch(x, ids, w, 5, token_padding=4, num_prefetch=2, fill_tail=fill_tail)
    fields = (d.x_nvs, d.route_weights, d.cu_seqlens, d.src_token, d.valid, d.row_of, d.prefetch_for)
    return fields + (layout.combine(d.x_nvs * 2, d),)


@pytest.mark.parametrize("fill_tail", [float("nan"), None], ids=["nan_tail", "garbage_tail"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_compiles_fullgraph(backend, fill_tail, fresh_dynamo):
    if backend == "inductor" and fill_tail is not None:
        pytest.skip("the Inductor layer tests (test_compile.py) compile the NaN-tail dispatch")
    x = torch.randn(9, 8)
    ids, w = _routing(9, 2, 5, hot=3)
    compiled = torch.compile(_dispatch_combine, backend=backend, fullgraph=True)
    got, want = compiled(x, ids, w, fill_tail), _dispatch_combine(x, ids, w, fill_tail)
    live = int(want[2][-1])
    for name, g, t in zip(("x_nvs", "route_weights"), got[:2], want[:2]):
        if fill_tail is None:  # the uninitialised tail may differ
            g, t = g[:live], t[:live]
        assert torch.allclose(g, t, rtol=0, atol=0, equal_nan=True), name
    for g, t in zip(got[2:], want[2:]):
        assert torch.equal(g, t)
    check_layout(layout.Dispatched(*got[:-1]), x, ids, w, 5, 4)
    assert_no_graph_breaks()


@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=CUDA_MARKS)])
def test_dispatch_is_sync_free_and_capturable(_):
    x = torch.randn(33, 16, device="cuda")
    ids, w = _routing(33, 2, 5, device="cuda", hot=2)
    _dispatch_combine(x, ids, w)  # warm-up outside capture
    with sync_errors():
        _dispatch_combine(x, ids, w)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _dispatch_combine(x, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        static = _dispatch_combine(x, ids, w)
    for step in range(20):
        new_ids, new_w = _routing(33, 2, 5, device="cuda", hot=step % 5)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        for got, want in zip(static, _dispatch_combine(x, ids, w)):
            assert torch.allclose(got, want, equal_nan=True, rtol=0, atol=0)
        check_layout(layout.Dispatched(*static[:-1]), x, ids, w, 5, 4)
