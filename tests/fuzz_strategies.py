"""Hypothesis strategies and the op table for the property-based tests (tests/test_fuzz.py).

A :class:`Problem` is a short, printable recipe (segment-layout parameters, sizes, dtype,
flags, data seed); its inputs are a pure function of it, so a failing example is rerun by
pasting its repr into :func:`check`. Every op is one :class:`OpSpec` entry in ``OPS``: how
to build its inputs from a problem, how to call it, its float64 reference (tests/reference.py,
independent of the kernels) and which part of its output must be exactly zero.
"""

import dataclasses
import functools
import random
from typing import Callable, Optional

import torch
from hypothesis import note
from hypothesis import strategies as st

import moonep_ops
from moonep_ops.fp8 import quantize_weight
from moonep_ops.schemas import SCHEMAS
from .reference import (TOLERANCE, experts_ref, grouped_gemm_ref, grouped_gemm_silu_mul_ref,
                        rel_err, row_groups, silu_mul_weight_ref)
from .test_fp8 import act_tie_slack, ref_experts_fp8, ref_grouped_gemm_fp8  # the FP8 ops' float64 references

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_G = 2000
MAX_DIM = 1100  # K and N (H and I for the expert path)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Caps that keep one example fast: rows, row-tensor elements, weight elements, and
    the real GEMM work ``cu[-1] * K * N``."""

    rows: int
    row_elems: int
    weight_elems: int
    macs: int


# CPU: the kernel is a per-segment torch.mm and the reference runs in float64 on 2 cores.
CPU_BUDGET = Budget(rows=3072, row_elems=1_000_000, weight_elems=1_500_000, macs=60_000_000)
# CUDA: the kernels are cheap; the float64 reference on the host is what costs.
CUDA_BUDGET = Budget(rows=8192, row_elems=4_000_000, weight_elems=4_000_000, macs=150_000_000)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fuzz case. ``sizes`` and the data are derived deterministically from the fields."""

    num_groups: int
    padded: bool  # segments padded to multiples of 128 with zero rows, as MoonEP does
    p_empty: float  # probability that a run of segments is empty
    max_run: int  # longest run of consecutive empty (or non-empty) segments
    max_real: int  # most real rows in one segment
    layout_seed: int
    max_rows: int  # budget: rows above this are dropped by emptying segments
    tail: int  # NvS - cu[-1]: undefined rows, NaN in the inputs
    k: int  # reduction size (H on the expert path)
    n: int  # output columns (I on the expert path)
    dtype: torch.dtype
    with_weights: bool  # route_weights given, or None
    strided: bool  # data inputs (rows, weights) as non-contiguous views of NaN-filled buffers
    strided_meta: bool  # route_weights and cu_seqlens as every-other-element views
    data_seed: int

    @functools.cached_property
    def _layout(self):
        return make_layout(self.num_groups, 128 if self.padded else 1, self.p_empty, self.max_run,
                           self.max_real, self.layout_seed, self.max_rows)

    @property
    def sizes(self) -> tuple:
        return self._layout[0]

    @property
    def real_rows(self) -> tuple:
        return self._layout[1]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def nvs(self) -> int:
        return self.total + self.tail

    def summary(self) -> str:
        nonempty = sum(1 for s in self.sizes if s)
        return (f"G={self.num_groups} non-empty={nonempty} cu[-1]={self.total} NvS={self.nvs} "
                f"K={self.k} N={self.n} {self.dtype} weights={self.with_weights} strided={self.strided}/"
                f"{self.strided_meta}")


def make_layout(num_groups, pad, p_empty, max_run, max_real, seed, max_rows):
    """Segment sizes in runs of empty / non-empty segments, then trimmed to ``max_rows`` by
    emptying segments (which only adds empty runs). Returns ``(sizes, real_rows)``."""
    rng = random.Random(seed)
    real = []
    while len(real) < num_groups:
        run = min(rng.randint(1, max_run), num_groups - len(real))
        empty = rng.random() < p_empty
        real += [0 if empty else rng.randint(1, max_real) for _ in range(run)]
    if p_empty < 1 and not any(real):  # "all empty" only when asked for (p_empty == 1)
        real[rng.randrange(num_groups)] = rng.randint(1, max_real)
    sizes = [-(-r // pad) * pad for r in real]
    nonempty = [g for g, s in enumerate(sizes) if s]
    rng.shuffle(nonempty)
    total = sum(sizes)
    for g in nonempty:
        if total <= max_rows:
            break
        total -= sizes[g]
        sizes[g] = real[g] = 0
    return tuple(sizes), tuple(real)


@st.composite
def problems(draw, budget: Budget, dtypes=DTYPES):
    """Random problems within ``budget``: any G in 1..2000 (small ones more often), empty runs,
    padded or not, a NaN tail, K and N in 1..1100 (odd sizes included)."""
    num_groups = draw(st.one_of(st.integers(1, 8), st.integers(1, 300), st.integers(1, MAX_G)))
    padded = draw(st.booleans())
    p_empty = draw(st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.9, 1.0]))
    max_run = draw(st.integers(1, 64))
    max_real = draw(st.integers(1, 300))
    layout_seed = draw(st.integers(0, 2 ** 32 - 1))
    max_rows = budget.rows
    sizes, _ = make_layout(num_groups, 128 if padded else 1, p_empty, max_run, max_real, layout_seed, max_rows)
    total = sum(sizes)
    tail = draw(st.one_of(st.just(0), st.integers(1, 8), st.integers(0, max(0, budget.rows - total))))
    rows = max(total + tail, 1)
    # K first, then N: both bounded so every tensor and the GEMM work fit the budget.
    k_max = max(1, min(MAX_DIM, budget.row_elems // rows, budget.weight_elems // num_groups,
                       budget.macs // max(total, 1)))
    k = draw(st.integers(1, k_max))
    n_max = max(1, min(MAX_DIM, budget.row_elems // rows, budget.weight_elems // (num_groups * k),
                       budget.macs // max(total * k, 1)))
    n = draw(st.integers(1, n_max))
    p = Problem(num_groups, padded, p_empty, max_run, max_real, layout_seed, max_rows, tail, k, n,
                draw(st.sampled_from(dtypes)), draw(st.booleans()), draw(st.booleans()), draw(st.booleans()),
                draw(st.integers(0, 2 ** 31 - 1)))
    note(p.summary())
    return p


# ---------------------------------------------------------------------------------------------
# Inputs. Random data from a generator seeded by the problem, made on the CPU then moved, so a
# problem gives the same inputs on every device.


def _place(t: torch.Tensor, device, strided: bool) -> torch.Tensor:
    """``t`` on ``device``; with ``strided``, as a non-contiguous view of a poisoned buffer
    (the kernels must follow the strides and never read the gaps)."""
    t = t.to(device)
    if not strided or t.numel() == 0:
        return t
    fill = float("nan") if t.is_floating_point() else -7
    if t.dim() == 1:  # every other element
        return torch.full((2 * t.shape[0],), fill, dtype=t.dtype, device=device)[::2].copy_(t)
    if t.dim() == 2:  # rows padded by 3 elements (an odd row stride)
        buf = torch.full((t.shape[0], t.shape[1] + 3), fill, dtype=t.dtype, device=device)
        return buf[:, :t.shape[1]].copy_(t)
    # 3-D weights: the last two dims stored transposed
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


class _Maker:
    """Random tensors for one problem (CPU generator, then :func:`_place`)."""

    def __init__(self, p: Problem, device):
        self.p, self.device = p, device
        self.gen = torch.Generator().manual_seed(p.data_seed)

    def _padding_and_tail(self, t, tail_value):
        """Zero the padding rows of each segment and fill the tail ``[cu[-1], NvS)``."""
        start = 0
        for size, real in zip(self.p.sizes, self.p.real_rows):
            t[start + real:start + size] = 0
            start += size
        t[self.p.total:] = tail_value
        return t

    def rows(self, cols, scale=1.0):
        """``[NvS, cols]``: random real rows, zero padding rows, NaN tail."""
        t = torch.randn(self.p.nvs, cols, generator=self.gen) * scale
        t = self._padding_and_tail(t, float("nan"))
        return _place(t.to(self.p.dtype), self.device, self.p.strided)

    def weights(self, g, n, k):
        w = torch.randn(g, n, k, generator=self.gen) / k ** 0.5
        return _place(w.to(self.p.dtype), self.device, self.p.strided)

    def route_weights(self):
        """``[NvS]`` fp32 in [0.1, 1.1) on real rows, 0 on padding rows (as MoonEP's dispatch
        writes), NaN in the tail; None when the problem has no route weights."""
        if not self.p.with_weights:
            return None
        rw = self._padding_and_tail(torch.rand(self.p.nvs, generator=self.gen) + 0.1, float("nan"))
        return _place(rw, self.device, self.p.strided_meta)

    def cu_seqlens(self):
        ends, acc = [], 0
        for s in self.p.sizes:
            acc += s
            ends.append(acc)
        return _place(torch.tensor(ends, dtype=torch.int32), self.device, self.p.strided_meta)


def gemm_inputs(p: Problem, device) -> dict:
    """a ``[NvS, K]``, w ``[G, N, K]``, and grad ``[NvS, N]`` for the backward GEMMs."""
    m = _Maker(p, device)
    return dict(a=m.rows(p.k), w=m.weights(p.num_groups, p.n, p.k), cu=m.cu_seqlens(), grad=m.rows(p.n))


def act_inputs(p: Problem, device) -> dict:
    """gate, up, grad ``[NvS, N]``, route weights, cu_seqlens."""
    m = _Maker(p, device)
    return dict(gate=m.rows(p.n, scale=2.0), up=m.rows(p.n), rw=m.route_weights(), cu=m.cu_seqlens(),
                grad=m.rows(p.n))


def experts_inputs(p: Problem, device) -> dict:
    """x ``[NvS, H=K]``, w_gate/w_up ``[G, I=N, H]``, w_down ``[G, H, I]``, grad and grad_up ``[NvS, I]``."""
    m = _Maker(p, device)
    g, h, i = p.num_groups, p.k, p.n
    return dict(x=m.rows(h), w_gate=m.weights(g, i, h), w_up=m.weights(g, i, h),
                w_down=m.weights(g, h, i), rw=m.route_weights(), cu=m.cu_seqlens(),
                grad=m.rows(i), grad_up=m.rows(i))


FP8_DTYPES = (torch.bfloat16, torch.float16)  # the activation dtypes of the FP8 ops


def _fp8_weight(m: _Maker, g, n, k) -> tuple:
    """``(w e4m3fn [G, N, K], scale fp32)`` from random weights (moonep_ops.fp8.quantize_weight);
    strided: rows of a buffer with NaN rows between them (K stays contiguous, as CUDA requires)."""
    w, scale = quantize_weight(torch.randn(g, n, k, generator=m.gen) / k ** 0.5)
    w, scale = w.to(m.device), scale.to(m.device)
    if m.p.strided and w.numel():
        buf = torch.full((g, 2 * n, k), float("nan"), device=m.device).to(w.dtype)
        w = buf[:, ::2].copy_(w)
    return w, scale


def fp8_gemm_inputs(p: Problem, device) -> dict:
    """a ``[NvS, K]``, e4m3fn w ``[G, N, K]`` and its w_scale."""
    m = _Maker(p, device)
    a = m.rows(p.k)
    w, w_scale = _fp8_weight(m, p.num_groups, p.n, p.k)
    return dict(a=a, w=w, w_scale=w_scale, cu=m.cu_seqlens())


def fp8_experts_inputs(p: Problem, device) -> dict:
    """x ``[NvS, H=K]``, e4m3fn w_gate/w_up ``[G, I=N, H]``, w_down ``[G, H, I]``, their scales."""
    m = _Maker(p, device)
    g, h, i = p.num_groups, p.k, p.n
    x = m.rows(h)
    (w_gate, sg), (w_up, su), (w_down, sd) = (_fp8_weight(m, *shape) for shape in ((g, i, h), (g, i, h), (g, h, i)))
    return dict(x=x, w_gate=w_gate, w_gate_scale=sg, w_up=w_up, w_up_scale=su, w_down=w_down, w_down_scale=sd,
                rw=m.route_weights(), cu=m.cu_seqlens())


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A NaN-filled output buffer: any element the op fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def poison_allocator(outputs, device) -> None:
    """On CUDA, leave NaN-filled blocks of the outputs' sizes in the caching allocator, so the
    op's own ``torch.empty`` outputs most likely reuse them: a row a kernel forgets to write
    then shows up as NaN instead of a lucky zero. (Best effort; a no-op on CPU.)"""
    if torch.device(device).type == "cuda":
        blocks = [poisoned(shape, dtype, device) for shape, dtype in outputs]
        del blocks


# ---------------------------------------------------------------------------------------------
# Float64 references for the backward ops: the forward references of tests/reference.py,
# differentiated by autograd in float64 (independent of the kernels).


def _f64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def wgrad_ref(grad, a, cu):
    """``dw[g] = grad[seg_g]^T @ a[seg_g]``, zero for empty groups; tail rows never used."""
    groups = row_groups(cu, a.shape[0])
    g64, a64 = _f64(grad), _f64(a)
    out = torch.zeros(cu.numel(), grad.shape[1], a.shape[1], dtype=torch.float64)
    for g in torch.unique(groups).tolist():
        if g < cu.numel():
            mask = groups == g
            out[g] = g64[mask].T @ a64[mask]
    return out


def _act_backward_ref(grad, gate64, up64, rw, cu):
    """d gate, d up, d route_weights of ``silu(gate) * up * rw`` by float64 autograd, tail rows
    (and the NaN planted there) masked out first; d rw is zeros when rw is None.
    (reference.silu_mul_weight_ref detaches its inputs, so the formula is written out here.)"""
    live = (row_groups(cu, gate64.shape[0]) < cu.numel())[:, None]
    gate64 = torch.where(live, gate64, 0).requires_grad_()
    up64 = torch.where(live, up64, 0).requires_grad_()
    act = gate64 * torch.sigmoid(gate64) * up64
    wrt = [gate64, up64]
    if rw is not None:
        rw64 = torch.where(live[:, 0], _f64(rw), 0).requires_grad_()
        act = act * rw64[:, None]
        wrt.append(rw64)
    grads = torch.autograd.grad((act * torch.where(live, _f64(grad), 0)).sum(), wrt)
    d_rw = grads[2] if rw is not None else torch.zeros(gate64.shape[0], dtype=torch.float64)
    return grads[0], grads[1], d_rw


def silu_mul_weight_backward_ref(t):
    return _act_backward_ref(t["grad"], _f64(t["gate"]), _f64(t["up"]), t["rw"], t["cu"])


def grouped_gemm_silu_mul_backward_ref(t):
    gate = grouped_gemm_ref(t["x"], t["w_gate"], t["cu"])
    up = grouped_gemm_ref(t["x"], t["w_up"], t["cu"])
    return _act_backward_ref(t["grad"], gate, up, t["rw"], t["cu"])


# ---------------------------------------------------------------------------------------------
# The op table.


def tail_rows(p: Problem, outs) -> list:
    """Rows ``[cu[-1], NvS)`` of every output: the default region that must be exactly zero."""
    return [o[p.total:] for o in outs]


def empty_groups(p: Problem, outs) -> list:
    """For ``[G, ...]`` outputs (weight gradients): the groups with an empty segment."""
    empty = torch.tensor([s == 0 for s in p.sizes], device=outs[0].device)
    return [o[empty] for o in outs]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op under fuzz. Adding an op is one entry in ``OPS``.

    ``call`` returns a tensor or a tuple of tensors, ``ref`` the float64 counterparts,
    ``outputs(p)`` the expected ``(shape, dtype)`` of each, ``zeros(p, outs)`` the parts that
    must be exactly zero. ``op`` names the ``moonep`` op exercised directly (None for a
    composite of the public API); an entry whose op is not defined is left out.
    ``rounded_ref(t, perturb)``: ``ref`` with each intermediate that the kernels store in the
    input dtype (the expert path's ``act``) passed through ``perturb``, so that
    :func:`condition_numbers` perturbs it as it perturbs the inputs; None: there is none.
    ``slack(t, device)``: per output, how far each element may lie from ``ref`` within the op's
    semantics (the FP8 experts: ``act``'s e4m3 rounding ties), taken off before the bound; None:
    no such room.
    """

    name: str
    inputs: Callable[[Problem, object], dict]
    call: Callable[[dict], object]
    ref: Callable[[dict], object]
    outputs: Callable[[Problem], tuple]
    zeros: Callable[[Problem, list], list] = tail_rows
    op: Optional[str] = "__name__"
    dtypes: tuple = DTYPES
    rounded_ref: Optional[Callable[[dict, Callable], object]] = None
    slack: Optional[Callable[[dict, str], object]] = None

    @property
    def moonep_op(self) -> Optional[str]:
        return self.name if self.op == "__name__" else self.op


def _ops():
    return torch.ops.moonep


def _gg_out(t):
    out = poisoned((t["a"].shape[0], t["w"].shape[1]), t["a"].dtype, t["a"].device)
    ret = moonep_ops.grouped_gemm(t["a"], t["w"], t["cu"], out=out)
    assert ret is out, "grouped_gemm(out=) must return out"
    return out


def _experts_out_op(t):
    x = t["x"]
    out = poisoned(x.shape, x.dtype, x.device)
    _ops().experts_out(x, t["w_gate"], t["w_up"], t["w_down"], t["rw"], t["cu"], out)
    return out


def _experts_out(t):
    x = t["x"]
    out = poisoned(x.shape, x.dtype, x.device)
    ret = moonep_ops.moonep_experts(x, t["w_gate"], t["w_up"], t["w_down"], t["cu"], t["rw"], out=out)
    assert ret is out, "moonep_experts(out=) must return out"
    return out


_FP8_EXPERTS_ARGS = ("x", "w_gate", "w_gate_scale", "w_up", "w_up_scale", "w_down", "w_down_scale", "rw", "cu")


def _fp8_experts_args(t) -> tuple:
    return tuple(t[name] for name in _FP8_EXPERTS_ARGS)


def _gg8_out_op(t):
    out = poisoned((t["a"].shape[0], t["w"].shape[1]), t["a"].dtype, t["a"].device)
    _ops().grouped_gemm_fp8_out(t["a"], t["w"], t["w_scale"], t["cu"], out)
    return out


def _experts8_out(t):
    x = t["x"]
    out = poisoned(x.shape, x.dtype, x.device)
    ret = moonep_ops.moonep_experts(x, t["w_gate"], t["w_up"], t["w_down"], t["cu"], t["rw"], out=out,
                                    w_gate_scale=t["w_gate_scale"], w_up_scale=t["w_up_scale"],
                                    w_down_scale=t["w_down_scale"])
    assert ret is out, "moonep_experts(out=) must return out"
    return out


def _ref_gg8(t):
    return ref_grouped_gemm_fp8(t["a"], t["w"], t["w_scale"], t["cu"])


def _ref_experts8(t):
    return ref_experts_fp8(*_fp8_experts_args(t))


# How close (relative) to an e4m3 rounding tie an element of act must lie to round either way: the
# CPU's fp32 act is a few ulps from float64. On CUDA, whose MMAs add at about 13 bits, the same
# window covers exact ties (common with a few K elements) and leaves the bound as tight as without
# it elsewhere: 2^-10 would excuse about 2% at I = 768 (2^-16: 0.06%).
_TIE_WINDOW = 2.0 ** -16


def _experts8_slack(t, device):
    return act_tie_slack(*_fp8_experts_args(t), window=_TIE_WINDOW)


def _rows(cols):
    """One ``[NvS, cols(p)]`` output in the problem's dtype."""
    return lambda p: (((p.nvs, cols(p)), p.dtype),)


def _act_grads(p):
    """d gate, d up ``[NvS, N]`` in the problem's dtype; d route_weights ``[NvS]`` fp32."""
    return (((p.nvs, p.n), p.dtype), ((p.nvs, p.n), p.dtype), ((p.nvs,), torch.float32))


_N, _K = (lambda p: p.n), (lambda p: p.k)


def _experts_ref(t: dict) -> torch.Tensor:
    """The expert path in float64."""
    return experts_ref(t["x"], t["w_gate"], t["w_up"], t["w_down"], t["cu"], t["rw"])


def _experts_rounded_ref(t: dict, perturb: Callable) -> torch.Tensor:
    """The expert path in float64 with ``act`` (stored in the input dtype between the two GEMMs)
    passed through ``perturb``."""
    act = perturb(grouped_gemm_silu_mul_ref(t["x"], t["w_gate"], t["w_up"], t["rw"], t["cu"]))
    return grouped_gemm_ref(act, t["w_down"], t["cu"])


_ALL_OPS = [
    # forward ops
    OpSpec("grouped_gemm", gemm_inputs,
           lambda t: moonep_ops.grouped_gemm(t["a"], t["w"], t["cu"]),
           lambda t: grouped_gemm_ref(t["a"], t["w"], t["cu"]), _rows(_N)),
    OpSpec("grouped_gemm_out", gemm_inputs, _gg_out,
           lambda t: grouped_gemm_ref(t["a"], t["w"], t["cu"]), _rows(_N)),
    OpSpec("silu_mul_weight", act_inputs,
           lambda t: moonep_ops.silu_mul_weight(t["gate"], t["up"], t["rw"], t["cu"]),
           lambda t: silu_mul_weight_ref(t["gate"], t["up"], t["rw"], t["cu"]), _rows(_N)),
    OpSpec("grouped_gemm_silu_mul", experts_inputs,
           lambda t: moonep_ops.grouped_gemm_silu_mul(t["x"], t["w_gate"], t["w_up"], t["rw"], t["cu"]),
           lambda t: grouped_gemm_silu_mul_ref(t["x"], t["w_gate"], t["w_up"], t["rw"], t["cu"]), _rows(_N)),
    OpSpec("grouped_gemm_silu_mul_with_gate_up", experts_inputs,
           lambda t: moonep_ops.grouped_gemm_silu_mul_with_gate_up(t["x"], t["w_gate"], t["w_up"], t["rw"], t["cu"]),
           lambda t: (grouped_gemm_silu_mul_ref(t["x"], t["w_gate"], t["w_up"], t["rw"], t["cu"]),
                      grouped_gemm_ref(t["x"], t["w_gate"], t["cu"]), grouped_gemm_ref(t["x"], t["w_up"], t["cu"])),
           lambda p: (((p.nvs, p.n), p.dtype),) * 3),
    # the whole expert path in one op (what moonep_experts runs without grad), allocating and out=
    OpSpec("experts", experts_inputs,
           lambda t: _ops().experts(t["x"], t["w_gate"], t["w_up"], t["w_down"], t["rw"], t["cu"]),
           _experts_ref, _rows(_K), rounded_ref=_experts_rounded_ref),
    OpSpec("experts_out", experts_inputs, _experts_out_op,
           _experts_ref, _rows(_K), rounded_ref=_experts_rounded_ref),
    # the public expert path (fused gate/up + down GEMM), allocating and out=
    OpSpec("moonep_experts", experts_inputs,
           lambda t: moonep_ops.moonep_experts(t["x"], t["w_gate"], t["w_up"], t["w_down"], t["cu"], t["rw"]),
           _experts_ref, _rows(_K), op=None, rounded_ref=_experts_rounded_ref),
    OpSpec("moonep_experts_out", experts_inputs, _experts_out,
           _experts_ref, _rows(_K), op=None, rounded_ref=_experts_rounded_ref),
    # FP8 block-scaled weights (16-bit activations only): the op or the public API, allocating and out=
    OpSpec("grouped_gemm_fp8", fp8_gemm_inputs,
           lambda t: moonep_ops.grouped_gemm(t["a"], t["w"], t["cu"], w_scale=t["w_scale"]),
           _ref_gg8, _rows(_N), dtypes=FP8_DTYPES),
    OpSpec("grouped_gemm_fp8_out", fp8_gemm_inputs, _gg8_out_op, _ref_gg8, _rows(_N), dtypes=FP8_DTYPES),
    OpSpec("experts_fp8", fp8_experts_inputs, lambda t: _ops().experts_fp8(*_fp8_experts_args(t)),
           _ref_experts8, _rows(_K), dtypes=FP8_DTYPES, slack=_experts8_slack),
    OpSpec("experts_fp8_out", fp8_experts_inputs, _experts8_out, _ref_experts8, _rows(_K), dtypes=FP8_DTYPES,
           slack=_experts8_slack),
    # backward ops
    OpSpec("grouped_gemm_dgrad", gemm_inputs,
           lambda t: _ops().grouped_gemm_dgrad(t["grad"], t["w"], t["cu"]),
           lambda t: grouped_gemm_ref(t["grad"], t["w"].transpose(1, 2), t["cu"]), _rows(_K)),
    OpSpec("grouped_gemm_dual_dgrad", experts_inputs,
           lambda t: _ops().grouped_gemm_dual_dgrad(t["grad"], t["grad_up"], t["w_gate"], t["w_up"], t["cu"]),
           lambda t: (grouped_gemm_ref(t["grad"], t["w_gate"].transpose(1, 2), t["cu"])
                      + grouped_gemm_ref(t["grad_up"], t["w_up"].transpose(1, 2), t["cu"])), _rows(_K)),
    OpSpec("grouped_gemm_wgrad", gemm_inputs,
           lambda t: _ops().grouped_gemm_wgrad(t["grad"], t["a"], t["cu"]),
           lambda t: wgrad_ref(t["grad"], t["a"], t["cu"]),
           lambda p: (((p.num_groups, p.n, p.k), p.dtype),), zeros=empty_groups),
    OpSpec("silu_mul_weight_backward", act_inputs,
           lambda t: _ops().silu_mul_weight_backward(t["grad"], t["gate"], t["up"], t["rw"], t["cu"]),
           silu_mul_weight_backward_ref, _act_grads),
    OpSpec("grouped_gemm_silu_mul_backward", experts_inputs,
           lambda t: _ops().grouped_gemm_silu_mul_backward(t["grad"], t["x"], t["w_gate"], t["w_up"], t["rw"],
                                                           t["cu"]),
           grouped_gemm_silu_mul_backward_ref, _act_grads),
]
# Entries for ops that this checkout does not define are left out; test_fuzz checks the
# converse (every defined op has an entry), so nothing goes unfuzzed silently.
OPS = [spec for spec in _ALL_OPS if spec.moonep_op is None or spec.moonep_op in SCHEMAS]
OPS_BY_NAME = {spec.name: spec for spec in OPS}


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def refuses_strided_meta(p: Problem, err: RuntimeError) -> bool:
    """Refusing non-contiguous route_weights / cu_seqlens with a clear error is acceptable."""
    return p.strided_meta and "contiguous" in str(err)


# Unit roundoff of each input dtype: the size of the relative perturbation below.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
# Condition numbers up to this are what random, well-conditioned problems show (at most 3 over
# 40 CI-strategy draws of every op; test_typical_problems_are_well_conditioned keeps it so);
# the bound scales above it.
KAPPA_TYPICAL = 4.0


# Random draws behind each condition number: one draw of a scalar output (one live row's
# d route_weights) is |N(0, s)|-like and came out anywhere from 117 to 1410 for the same output
# (the H200 fuzz failed one at 65); the root mean square of 16 falls below 0.6 of the true
# scale with probability about 1% (chi-square, 16 degrees of freedom).
KAPPA_DRAWS = 16


def condition_numbers(spec, t: dict, refs, dtype, seed: int = 0, draws: int = KAPPA_DRAWS) -> list:
    """Relative condition number of each output: how far the float64 reference moves (relative
    norm, in units of the dtype's roundoff ``u``, root mean square over ``draws`` draws) when
    every floating input is multiplied by ``1 + u*U(-1, 1)``. About 1 for well-conditioned
    outputs; large where sums cancel (K = 1, one live row, a route-weight gradient that sums to
    almost nothing), and there any correct fp32-accumulating kernel misses the float64 result by
    about ``kappa * u``, so the fixed tolerance is scaled by ``kappa / KAPPA_TYPICAL``. An
    intermediate that the kernels round to the input dtype (``spec.rounded_ref``) is perturbed
    the same way: its rounding is one more such error."""
    eta = UNIT_ROUNDOFF.get(dtype)
    if eta is None:
        return [0.0] * len(refs)

    def perturbed(value, draw_seed):
        gen = torch.Generator(device=value.device).manual_seed(draw_seed)
        noise = torch.rand(value.shape, generator=gen, device=value.device, dtype=torch.float64)
        return value.double() * (1 + eta * (2 * noise - 1))

    squares = [0.0] * len(refs)
    for d in range(draws):
        moved = {}
        for i, (name, value) in enumerate(t.items()):
            if torch.is_tensor(value) and value.is_floating_point():
                value = perturbed(value, seed + 1000 * d + i)
            moved[name] = value
        if spec.rounded_ref is None:
            outs = spec.ref(moved)
        else:
            outs = spec.rounded_ref(moved, lambda value: perturbed(value, seed + 1000 * d + 999))
        for j, (m, r) in enumerate(zip(_as_tuple(outs), refs)):
            squares[j] += (rel_err(m, r) / eta) ** 2
    return [(sq / draws) ** 0.5 for sq in squares]


def _rel_err_beyond(out, ref, slack) -> float:
    """:func:`rel_err` of ``out`` with each element's distance from ``ref`` less ``slack`` (not
    below zero)."""
    ref64 = ref.detach().to("cpu", torch.float64)
    excess = ((out.detach().to("cpu", torch.float64) - ref64).abs() - slack).clamp(min=0)
    return rel_err(ref64 + excess, ref64)


def check(spec, p: Problem, device="cpu", *, repeat: Optional[bool] = None):
    """Run ``spec`` on problem ``p`` and assert every property; returns the relative errors.

    Properties: each output's shape/dtype/device and contiguity; no NaN anywhere (NaN sits in
    every input's tail, and output buffers are poisoned); the zero region (tail rows, or the
    empty groups of a weight gradient) exactly 0; within the dtype's tolerance of the float64
    reference; on CUDA, a second call is bitwise equal (determinism).
    """
    if isinstance(spec, str):
        spec = OPS_BY_NAME[spec]
    where = f"{spec.name} on {device}: {p.summary()}\n  repro: check({spec.name!r}, {p!r}, {device!r})"
    t = spec.inputs(p, device)
    expected = spec.outputs(p)
    poison_allocator(expected, device)
    try:
        outs = _as_tuple(spec.call(t))
    except RuntimeError as err:
        if refuses_strided_meta(p, err):
            return None
        raise AssertionError(f"raised {err!r}; {where}") from err
    assert len(outs) == len(expected), f"{len(outs)} outputs, expected {len(expected)}; {where}"
    for i, (out, (shape, dtype)) in enumerate(zip(outs, expected)):
        assert tuple(out.shape) == tuple(shape), f"output {i}: shape {tuple(out.shape)} != {shape}; {where}"
        assert out.dtype == dtype, f"output {i}: dtype {out.dtype} != {dtype}; {where}"
        assert out.is_contiguous(), f"output {i} not contiguous; {where}"
        assert out.device.type == torch.device(device).type, f"output {i} on {out.device}; {where}"
        nan = torch.isnan(out)
        assert not nan.any(), f"output {i}: {int(nan.sum())} NaN elements; {where}"
    for i, zero in enumerate(spec.zeros(p, outs)):
        assert torch.equal(zero, torch.zeros_like(zero)), f"output {i}: zero region not exactly zero; {where}"
    errs = []
    refs = _as_tuple(spec.ref(t))
    kappas = None
    for i, (out, ref) in enumerate(zip(outs, refs)):
        err = rel_err(out, ref)
        tol = TOLERANCE[p.dtype]
        if err > tol and spec.slack is not None:  # the error beyond the semantics' own room
            err = _rel_err_beyond(out, ref, _as_tuple(spec.slack(t, device))[i])
        if err > tol:  # an ill-conditioned output earns a wider bound (condition_numbers)
            kappas = kappas or condition_numbers(spec, t, refs, p.dtype)
            tol *= max(1.0, kappas[i] / KAPPA_TYPICAL)
            if err > tol and spec.rounded_ref is not None:
                # The bound is a typical error, and one rounding of a cancelling sum's terms can
                # pass it: then the output must match float64 with that rounding (the op's
                # semantics: the intermediate stored in the input dtype) within the fixed bound.
                rounded = _as_tuple(spec.rounded_ref(t, lambda value: value.to(p.dtype).double()))[i]
                err_rounded = rel_err(out, rounded)
                assert err_rounded <= TOLERANCE[p.dtype], (
                    f"output {i}: rel err {err:.3g} > {tol:.3g} (condition number {kappas[i]:.3g}), and "
                    f"{err_rounded:.3g} against float64 with the intermediate rounded; {where}")
            else:
                assert err <= tol, (f"output {i}: rel err {err:.3g} > {tol:.3g} (condition number "
                                    f"{kappas[i]:.3g}); {where}")
        errs.append(err)
    if repeat if repeat is not None else torch.device(device).type == "cuda":
        again = _as_tuple(spec.call(t))
        for i, (a, b) in enumerate(zip(again, outs)):
            assert torch.equal(a, b), f"output {i}: a second call differs (nondeterministic); {where}"
    return errs
