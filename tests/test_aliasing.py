"""``out=`` must not share memory with any input: the line between refused and supported.

``grouped_gemm_out`` and ``experts_out`` (and the wrappers' ``out=``) refuse an ``out`` whose
byte span crosses the span of any input in the same storage (on CUDA many programs read an
input's rows while others write ``out``), with one exception: the experts op's ``out`` may be
``x`` itself (in place). The test is metadata only and conservative: interleaved views whose
elements never meet are refused when their spans cross. Anything disjoint is supported,
including a disjoint view of an input's own storage.
"""

import expecttest
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moonep_ops

from .conftest import DEVICES

NVS, H, I, G = 8, 16, 12, 3
CU = (3, 3, 6)


def _inputs(device="cpu"):
    """``x [NvS, H]``, ``w_gate, w_up [G, I, H]``, ``w_down [G, H, I]``, ``route_weights``, ``cu_seqlens``."""
    return {"x": torch.randn(NVS, H, device=device), "w_gate": torch.randn(G, I, H, device=device),
            "w_up": torch.randn(G, I, H, device=device), "w_down": torch.randn(G, H, I, device=device),
            "route_weights": torch.rand(NVS, device=device),
            "cu_seqlens": torch.tensor(CU, dtype=torch.int32, device=device)}


def _grouped_gemm(t, out):
    """``x [NvS, H]`` against ``w_gate [G, I, H]``: ``out [NvS, I]``."""
    return moonep_ops.grouped_gemm(t["x"], t["w_gate"], t["cu_seqlens"], out=out)


def _experts(t, out):
    return moonep_ops.moonep_experts(t["x"], t["w_gate"], t["w_up"], t["w_down"], t["cu_seqlens"],
                                     t["route_weights"], out=out)


# op -> (call, out's shape, {input: the name the op's errors give it})
OPS = {"grouped_gemm": (_grouped_gemm, (NVS, I), {"x": "a", "w_gate": "w", "cu_seqlens": "cu_seqlens"}),
       "experts": (_experts, (NVS, H), {n: n for n in ("x", "w_gate", "w_up", "w_down", "route_weights",
                                                      "cu_seqlens")})}


def _error(op, t, out):
    fn = OPS[op][0]
    with pytest.raises(RuntimeError) as info:
        fn(t, out)
    return str(info.value)


def _storage_view(base: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """A contiguous ``shape`` view of ``base``'s storage starting ``offset`` elements in."""
    strides = torch.empty(shape).stride()
    return base.as_strided(shape, strides, base.storage_offset() + offset)


def _refused_cases(device):
    """``(description, op, inputs, out)`` that must be refused."""
    cases = []
    t = _inputs(device)
    buf = torch.randn(NVS * H + H, device=device)
    t["x"] = _storage_view(buf, 0, (NVS, H))
    cases.append(("out one row after x", "grouped_gemm", t, _storage_view(buf, H, (NVS, I))))
    t = _inputs(device)
    cases.append(("out inside w_gate", "grouped_gemm", t, _storage_view(t["w_gate"], 5, (NVS, I))))
    t = _inputs(device)
    buf = torch.randn(NVS * H + H, device=device)
    t["x"] = _storage_view(buf, 0, (NVS, H))
    cases.append(("out one row after x", "experts", t, _storage_view(buf, H, (NVS, H))))
    t = _inputs(device)
    buf = torch.randn(2 * NVS * H, device=device)
    t["x"] = buf.as_strided((NVS, H), (2 * H, 1))  # every other row of buf
    cases.append(("out at x's address with other strides", "experts", t, _storage_view(buf, 0, (NVS, H))))
    t = _inputs(device)
    cases.append(("out inside w_down", "experts", t, _storage_view(t["w_down"], 1, (NVS, H))))
    t = _inputs(device)
    out = torch.zeros(NVS, H, device=device)
    t["route_weights"] = _storage_view(out, NVS * H - NVS, (NVS,))
    cases.append(("out ends in route_weights", "experts", t, out))
    t = _inputs(device)
    out = torch.zeros(NVS, I, device=device)
    t["cu_seqlens"] = out.view(-1)[:G].view(torch.int32)  # zeros: valid, empty segments
    cases.append(("cu_seqlens inside out", "grouped_gemm", t, out))
    t = _inputs(device)
    gap = NVS * I  # out fits between x's first and second row: no shared element, but the spans cross
    buf = torch.randn(NVS * (H + gap), device=device)
    t["x"] = buf.as_strided((NVS, H), (H + gap, 1))
    cases.append(("out in the gap after x's first row (conservative)", "grouped_gemm", t,
                  _storage_view(buf, H, (NVS, I))))
    return cases


class TestOutAliasing(expecttest.TestCase):
    def _messages(self, device):
        return "\n".join(f"{name}: {_error(op, t, out)}" for name, op, t, out in _refused_cases(device))

    def test_refused(self):
        self.assertExpectedInline(self._messages("cpu"), """\
out one row after x: moonep::grouped_gemm_out: out overlaps a in memory; out must not share memory with any input (pass a separate buffer)
out inside w_gate: moonep::grouped_gemm_out: out overlaps w in memory; out must not share memory with any input (pass a separate buffer)
out one row after x: moonep::experts_out: out overlaps x in memory; out must not share memory with any input other than x itself (pass a separate buffer)
out at x's address with other strides: moonep::experts_out: out overlaps x in memory; out must not share memory with any input other than x itself (pass a separate buffer)
out inside w_down: moonep::experts_out: out overlaps w_down in memory; out must not share memory with any input other than x itself (pass a separate buffer)
out ends in route_weights: moonep::experts_out: out overlaps route_weights in memory; out must not share memory with any input other than x itself (pass a separate buffer)
cu_seqlens inside out: moonep::grouped_gemm_out: out overlaps cu_seqlens in memory; out must not share memory with any input (pass a separate buffer)
out in the gap after x's first row (conservative): moonep::grouped_gemm_out: out overlaps a in memory; out must not share memory with any input (pass a separate buffer)""")


@pytest.mark.parametrize("device", DEVICES)
def test_refused_on_every_device(device):
    for name, op, t, out in _refused_cases(device):
        before = out.clone()
        assert "must not share memory with any input" in _error(op, t, out), name
        assert torch.equal(out, before), f"{name}: out written before the refusal"


@pytest.mark.parametrize("device", DEVICES)
def test_experts_in_place_on_x(device):
    """``moonep_experts(..., out=x)``: the result replaces ``x`` (its tail rows become zeros)."""
    t = _inputs(device)
    t["x"][CU[-1]:] = float("nan")  # the undefined tail: never read
    expected = _experts({k: v.clone() for k, v in t.items()}, None)
    x = t["x"]
    assert _experts(t, x) is x
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
def test_disjoint_view_of_an_input_storage_is_supported(op, device):
    fn, out_shape, _ = OPS[op]
    t = _inputs(device)
    expected = fn(t, None)
    numel = out_shape[0] * out_shape[1]
    buf = torch.randn(NVS * H + numel, device=device)  # x, then out, in one storage
    buf[:NVS * H] = t["x"].reshape(-1)
    t["x"] = _storage_view(buf, 0, (NVS, H))
    out = _storage_view(buf, NVS * H, out_shape)
    assert fn(t, out) is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# --- property: refused iff the byte spans of out and an input cross ----------------------------

def _span(offset, shape, strides):
    return offset, offset + 1 + sum((s - 1) * st for s, st in zip(shape, strides))


def _place(shape, transposed: bool, pad: int):
    """Strides of ``shape`` (1-3 dims), ``pad`` elements between its rows, or between its columns
    when ``transposed`` (column-major within each group)."""
    if len(shape) == 1:
        return (1 + pad,)
    rows, cols = shape[-2:]
    inner = (1, rows + pad) if transposed else (cols + pad, 1)
    group = (rows + pad) * cols if transposed else rows * (cols + pad)
    return inner if len(shape) == 2 else (group,) + inner


@st.composite
def aliasing_cases(draw):
    op = draw(st.sampled_from(list(OPS)))
    shared = draw(st.sampled_from([n for n in OPS[op][2] if n != "cu_seqlens"] + [None]))
    return dict(op=op, shared=shared, transposed=draw(st.booleans()), pad=draw(st.integers(0, 3)),
                in_offset=draw(st.integers(0, 64)), out_offset=draw(st.integers(0, 600)))


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(aliasing_cases())
def test_refused_iff_spans_cross(case):
    fn, out_shape, _ = OPS[case["op"]]
    t = _inputs()
    expected = fn({k: v.clone() for k, v in t.items()}, None)
    out_strides = torch.empty(out_shape).stride()
    out_span = _span(case["out_offset"], out_shape, out_strides)
    cross = False
    buf = torch.full((out_span[1],), float("nan"))
    if case["shared"] is not None:
        src = t[case["shared"]]
        strides = _place(src.shape, case["transposed"], case["pad"])
        in_span = _span(case["in_offset"], src.shape, strides)
        buf = torch.full((max(out_span[1], in_span[1]),), float("nan"))
        t[case["shared"]] = buf.as_strided(src.shape, strides, case["in_offset"])
        t[case["shared"]].copy_(src)
        cross = in_span[0] < out_span[1] and out_span[0] < in_span[1]
        in_place = (case["op"] == "experts" and case["shared"] == "x" and case["in_offset"] == case["out_offset"]
                    and tuple(strides) == tuple(out_strides))
        cross = cross and not in_place
    out = buf.as_strided(out_shape, out_strides, case["out_offset"])
    if cross:
        name = OPS[case["op"]][2][case["shared"]]
        assert f"out overlaps {name} in memory" in _error(case["op"], t, out)
    else:
        assert fn(t, out) is out
        # (an input laid out column-major may take another BLAS path: fp32 rounding, not equality)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_place_gives_views_of_distinct_elements():
    for shape in ((NVS,), (NVS, H), (G, I, H)):
        for transposed in (False, True):
            strides = _place(shape, transposed, 2)
            idx = torch.arange(_span(0, shape, strides)[1]).as_strided(shape, strides)
            assert idx.unique().numel() == idx.numel(), (shape, transposed)
