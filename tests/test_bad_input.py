"""Every bad input the ops must refuse, with its message pinned.

Each metadata error is raised twice: eagerly (the CPU kernel, or the Meta kernel when a
tensor is on ``meta``) and by the fake impl under ``FakeTensorMode`` (what torch.compile
runs), and the two messages must be identical, so eager and compiled code fail alike.
Fake tensors may claim ``cuda`` without a GPU, which lets CPU CI check the CUDA-only rules
(no float64, cuda/cpu mixes); the ``cuda``-marked tests repeat them on a real GPU.
The data checks on ``cu_seqlens`` (decreasing, negative, past ``NvS``) exist on CPU only:
the fakes must not read data, and the CUDA path must not sync to read it.
"""

import contextlib
import functools
import unittest
import unittest.mock

import expecttest
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moonep_ops
from moonep_ops import checks
from moonep_ops.kernels import cpu as cpu_kernels

from .conftest import HAS_CUDA

gg = torch.ops.moonep.grouped_gemm.default
gg_out = torch.ops.moonep.grouped_gemm_out.default
smw = torch.ops.moonep.silu_mul_weight.default
ggsm = torch.ops.moonep.grouped_gemm_silu_mul.default
ggsm_gu = torch.ops.moonep.grouped_gemm_silu_mul_with_gate_up.default

NVS, K, N, G = 8, 16, 12, 3


def _cu(ends=(3, 3, 6), dtype=torch.int32, device="cpu"):
    return torch.tensor(ends, dtype=dtype, device=device)


def _gg_args(device="cpu", dtype=torch.float32):
    a = torch.randn(NVS, K, device=device).to(dtype)
    w = torch.randn(G, N, K, device=device).to(dtype)
    return a, w, _cu(device=device)


def _smw_args(device="cpu", dtype=torch.float32):
    gate = torch.randn(NVS, N, device=device).to(dtype)
    up = torch.randn(NVS, N, device=device).to(dtype)
    rw = torch.rand(NVS, device=device)
    return gate, up, rw, _cu(device=device)


def _ggsm_args(device="cpu", dtype=torch.float32):
    """``(x [NvS, H=K], w_gate, w_up [G, I=N, H], route_weights, cu_seqlens)``."""
    x = torch.randn(NVS, K, device=device).to(dtype)
    w_gate = torch.randn(G, N, K, device=device).to(dtype)
    w_up = torch.randn(G, N, K, device=device).to(dtype)
    return x, w_gate, w_up, torch.rand(NVS, device=device), _cu(device=device)


def _fake_call(fn, args, *, cuda=()):
    """Call ``fn`` on fake copies of ``args`` (``None`` and non-tensors pass through);
    positions in ``cuda`` become fake CUDA tensors (no GPU needed)."""
    mode = FakeTensorMode()
    with mode:
        fake = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and i in cuda:
                # Created inside the mode: a fake CUDA tensor needs no CUDA build.
                a = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
            elif isinstance(a, torch.Tensor):
                a = mode.from_tensor(a)
            fake.append(a)
        return fn(*fake)


@contextlib.contextmanager
def _no_sync():
    """On CUDA: any host sync inside raises, so a check that synced would show a different error."""
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


class BadInputCase(expecttest.TestCase):
    def raises(self, fn, *args, fake=True, eager_ctx=contextlib.nullcontext):
        """The eager error message; with ``fake``, checks the fake impl raises the same one."""
        with self.assertRaises(RuntimeError) as eager, eager_ctx():
            fn(*args)
        msg = str(eager.exception)
        if fake:
            with self.assertRaises(RuntimeError) as faked:
                _fake_call(fn, args)
            self.assertEqual(str(faked.exception), msg)
        return msg

    def raises_fake(self, fn, *args, cuda=()):
        """The fake impl's message when the tensors at positions ``cuda`` are on (fake) CUDA."""
        with self.assertRaises(RuntimeError) as faked:
            _fake_call(fn, args, cuda=cuda)
        return str(faked.exception)


class TestGroupedGemmBadInput(BadInputCase):
    def test_a_wrong_rank(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a[None], w, cu),
            """moonep::grouped_gemm: a must be 2-D [NvS, K], got shape [1, 8, 16]""")
        self.assertExpectedInline(
            self.raises(gg, a[0], w, cu),
            """moonep::grouped_gemm: a must be 2-D [NvS, K], got shape [16]""")

    def test_w_wrong_rank(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a, w[0], cu),
            """moonep::grouped_gemm: w must be 3-D [G, N, K], got shape [12, 16]""")
        self.assertExpectedInline(
            self.raises(gg, a, w[None], cu),
            """moonep::grouped_gemm: w must be 3-D [G, N, K], got shape [1, 3, 12, 16]""")

    def test_w_no_groups(self):
        a, w, _ = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a, w[:0], _cu(())),
            """moonep::grouped_gemm: w must have G >= 1 groups, got shape [0, 12, 16]""")

    def test_k_mismatch(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a[:, :K - 1], w, cu),
            """moonep::grouped_gemm: a is [NvS, K] = [8, 15] and w is [G, N, K] = [3, 12, 16]: K must match (out = a @ w[g].T)""")

    def test_cu_seqlens_not_int32(self):
        a, w, _ = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a, w, _cu(dtype=torch.int64)),
            """moonep::grouped_gemm: cu_seqlens must be int32, got torch.int64""")
        self.assertExpectedInline(
            self.raises(gg, a, w, _cu(dtype=torch.float32)),
            """moonep::grouped_gemm: cu_seqlens must be int32, got torch.float32""")

    def test_cu_seqlens_not_1d(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a, w, cu[:, None]),
            """moonep::grouped_gemm: cu_seqlens must be 1-D [G], got shape [3, 1]""")
        self.assertExpectedInline(
            self.raises(gg, a, w, cu[0]),
            """moonep::grouped_gemm: cu_seqlens must be 1-D [G], got shape []""")

    def test_cu_seqlens_length_not_g(self):
        a, w, _ = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a, w, _cu((3, 6))),
            """moonep::grouped_gemm: cu_seqlens has 2 entries but w has G = 3 groups (w.shape[0]); they must match""")
        self.assertExpectedInline(
            self.raises(gg, a, w, _cu((1, 2, 3, 6))),
            """moonep::grouped_gemm: cu_seqlens has 4 entries but w has G = 3 groups (w.shape[0]); they must match""")

    def test_dtype_mismatch(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a, w.bfloat16(), cu),
            """moonep::grouped_gemm: w has dtype torch.bfloat16 but a has dtype torch.float32; they must match""")
        self.assertExpectedInline(
            self.raises(gg, a.half(), w, cu),
            """moonep::grouped_gemm: w has dtype torch.float32 but a has dtype torch.float16; they must match""")

    def test_unsupported_dtype(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg, a.long(), w.long(), cu),
            """moonep::grouped_gemm: a has dtype torch.int64, expected one of torch.bfloat16, torch.float16, torch.float32, torch.float64 on cpu""")
        self.assertExpectedInline(
            self.raises(gg, a.bool(), w.bool(), cu),
            """moonep::grouped_gemm: a has dtype torch.bool, expected one of torch.bfloat16, torch.float16, torch.float32, torch.float64 on cpu""")

    def test_float64_refused_on_cuda(self):
        a, w, cu = _gg_args(dtype=torch.float64)
        self.assertExpectedInline(
            self.raises_fake(gg, a, w, cu, cuda=(0, 1, 2)),
            """moonep::grouped_gemm: a has dtype torch.float64, expected one of torch.bfloat16, torch.float16, torch.float32 on cuda""")

    def test_device_mismatch(self):
        a, w, cu = _gg_args()
        # meta against cpu stands in for cuda against cpu on a machine without a GPU.
        self.assertExpectedInline(
            self.raises(gg, a, w.to("meta"), cu),
            """moonep::grouped_gemm: w is on meta but a is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises(gg, a, w, cu.to("meta")),
            """moonep::grouped_gemm: cu_seqlens is on meta but a is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises(gg, a.to("meta"), w, cu),
            """moonep::grouped_gemm: w is on cpu but a is on meta; all tensors must be on one device""")

    def test_device_mismatch_in_cpu_kernel(self):
        # Mixed with meta, the dispatcher picks the Meta kernel; the CPU kernel checks too.
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(cpu_kernels.grouped_gemm, a, w.to("meta"), cu, fake=False),
            """moonep::grouped_gemm: w is on meta but a is on cpu; all tensors must be on one device""")

    def test_cuda_cpu_mix_fake(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises_fake(gg, a, w, cu, cuda=(0, 1)),
            """moonep::grouped_gemm: cu_seqlens is on cpu but a is on cuda:0; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises_fake(gg, a, w, cu, cuda=(0,)),
            """moonep::grouped_gemm: w is on cpu but a is on cuda:0; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises_fake(gg, a, w, cu, cuda=(1, 2)),
            """moonep::grouped_gemm: w is on cuda:0 but a is on cpu; all tensors must be on one device""")


class TestGroupedGemmOutBadInput(BadInputCase):
    def test_input_checks_shared_with_grouped_gemm(self):
        a, w, cu = _gg_args()
        out = torch.empty(NVS, N)
        self.assertExpectedInline(
            self.raises(gg_out, a[:, :K - 1], w, cu, out),
            """moonep::grouped_gemm_out: a is [NvS, K] = [8, 15] and w is [G, N, K] = [3, 12, 16]: K must match (out = a @ w[g].T)""")
        self.assertExpectedInline(
            self.raises(gg_out, a, w, _cu((3, 6)), out),
            """moonep::grouped_gemm_out: cu_seqlens has 2 entries but w has G = 3 groups (w.shape[0]); they must match""")

    def test_out_wrong_shape(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, torch.empty(NVS, N + 1)),
            """moonep::grouped_gemm_out: out has shape [8, 13], expected [8, 12]""")
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, torch.empty(NVS - 1, N)),
            """moonep::grouped_gemm_out: out has shape [7, 12], expected [8, 12]""")
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, torch.empty(NVS * N)),
            """moonep::grouped_gemm_out: out has shape [96], expected [8, 12]""")

    def test_out_wrong_dtype(self):
        a, w, cu = _gg_args()
        out = torch.empty(NVS, N, dtype=torch.bfloat16)
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, out),
            """moonep::grouped_gemm_out: out has dtype torch.bfloat16, expected torch.float32""")

    def test_out_wrong_device(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, torch.empty(NVS, N, device="meta")),
            """moonep::grouped_gemm_out: out is on meta, expected cpu""")
        self.assertExpectedInline(
            self.raises_fake(gg_out, a, w, cu, torch.empty(NVS, N), cuda=(3,)),
            """moonep::grouped_gemm_out: out is on cuda:0, expected cpu""")

    def test_out_not_contiguous(self):
        a, w, cu = _gg_args()
        out = torch.empty(N, NVS).t()
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, out),
            """moonep::grouped_gemm_out: out must be contiguous, got shape [8, 12] with strides [1, 8]""")
        out = torch.empty(NVS, 2 * N)[:, ::2]
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, out),
            """moonep::grouped_gemm_out: out must be contiguous, got shape [8, 12] with strides [24, 2]""")

    def test_public_api_out(self):
        # moonep_ops.grouped_gemm(..., out=) goes through the same op.
        a, w, cu = _gg_args()
        out = torch.empty(NVS, N, dtype=torch.float16)
        self.assertExpectedInline(
            self.raises(lambda *t: moonep_ops.grouped_gemm(*t[:3], out=t[3]), a, w, cu, out),
            """moonep::grouped_gemm_out: out has dtype torch.float16, expected torch.float32""")


class TestSiluMulWeightBadInput(BadInputCase):
    def test_gate_wrong_rank(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate[0], up[0], rw, cu),
            """moonep::silu_mul_weight: gate must be 2-D [NvS, I], got shape [12]""")
        self.assertExpectedInline(
            self.raises(smw, gate[None], up[None], rw, cu),
            """moonep::silu_mul_weight: gate must be 2-D [NvS, I], got shape [1, 8, 12]""")

    def test_gate_up_shape_mismatch(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate, up[:, :N - 1], rw, cu),
            """moonep::silu_mul_weight: up has shape [8, 11] but gate has shape [8, 12]; they must match""")
        self.assertExpectedInline(
            self.raises(smw, gate, up[:NVS - 1], rw, cu),
            """moonep::silu_mul_weight: up has shape [7, 12] but gate has shape [8, 12]; they must match""")
        self.assertExpectedInline(
            self.raises(smw, gate, up[None], rw, cu),
            """moonep::silu_mul_weight: up has shape [1, 8, 12] but gate has shape [8, 12]; they must match""")

    def test_gate_up_dtype_mismatch(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate, up.bfloat16(), rw, cu),
            """moonep::silu_mul_weight: up has dtype torch.bfloat16 but gate has dtype torch.float32; they must match""")

    def test_unsupported_dtype(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate.int(), up.int(), rw, cu),
            """moonep::silu_mul_weight: gate has dtype torch.int32, expected one of torch.bfloat16, torch.float16, torch.float32, torch.float64 on cpu""")

    def test_float64_refused_on_cuda(self):
        gate, up, _, cu = _smw_args(dtype=torch.float64)
        self.assertExpectedInline(
            self.raises_fake(smw, gate, up, None, cu, cuda=(0, 1, 3)),
            """moonep::silu_mul_weight: gate has dtype torch.float64, expected one of torch.bfloat16, torch.float16, torch.float32 on cuda""")

    def test_route_weights_wrong_length(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw[:NVS - 1], cu),
            """moonep::silu_mul_weight: route_weights must be [NvS] = [8] (one per row of gate), got shape [7]""")
        self.assertExpectedInline(
            self.raises(smw, gate, up, torch.rand(NVS + 1), cu),
            """moonep::silu_mul_weight: route_weights must be [NvS] = [8] (one per row of gate), got shape [9]""")
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw[:, None], cu),
            """moonep::silu_mul_weight: route_weights must be [NvS] = [8] (one per row of gate), got shape [8, 1]""")

    def test_route_weights_not_fp32(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw.bfloat16(), cu),
            """moonep::silu_mul_weight: route_weights must be float32, got torch.bfloat16""")
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw.double(), cu),
            """moonep::silu_mul_weight: route_weights must be float32, got torch.float64""")
        # The MoonEP case: bf16 activations, route weights still fp32 (and nothing else).
        self.assertExpectedInline(
            self.raises(smw, gate.bfloat16(), up.bfloat16(), rw.bfloat16(), cu),
            """moonep::silu_mul_weight: route_weights must be float32, got torch.bfloat16""")

    def test_cu_seqlens_bad_metadata(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw, cu.long()),
            """moonep::silu_mul_weight: cu_seqlens must be int32, got torch.int64""")
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw, cu[:, None]),
            """moonep::silu_mul_weight: cu_seqlens must be 1-D [G], got shape [3, 1]""")
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw, cu[:0]),
            """moonep::silu_mul_weight: cu_seqlens must have at least one segment, got shape [0]""")

    def test_device_mismatch(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            self.raises(smw, gate, up.to("meta"), rw, cu),
            """moonep::silu_mul_weight: up is on meta but gate is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw.to("meta"), cu),
            """moonep::silu_mul_weight: route_weights is on meta but gate is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises(smw, gate, up, None, cu.to("meta")),
            """moonep::silu_mul_weight: cu_seqlens is on meta but gate is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises_fake(smw, gate, up, rw, cu, cuda=(0, 1, 3)),
            """moonep::silu_mul_weight: route_weights is on cpu but gate is on cuda:0; all tensors must be on one device""")


class TestGroupedGemmSiluMulBadInput(BadInputCase):
    def test_x_w_gate_checks(self):
        # x / w_gate follow grouped_gemm's rules; errors use this op's argument names.
        x, wg, wu, rw, cu = _ggsm_args()
        self.assertExpectedInline(
            self.raises(ggsm, x[None], wg, wu, rw, cu),
            """moonep::grouped_gemm_silu_mul: x must be 2-D [NvS, K], got shape [1, 8, 16]""")
        self.assertExpectedInline(
            self.raises(ggsm, x[:, :K - 1], wg, wu, rw, cu),
            """moonep::grouped_gemm_silu_mul: x is [NvS, K] = [8, 15] and w_gate is [G, N, K] = [3, 12, 16]: K must match (out = x @ w_gate[g].T)""")
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu, rw, _cu((3, 6))),
            """moonep::grouped_gemm_silu_mul: cu_seqlens has 2 entries but w_gate has G = 3 groups (w_gate.shape[0]); they must match""")
        self.assertExpectedInline(
            self.raises(ggsm, x.long(), wg.long(), wu.long(), rw, cu),
            """moonep::grouped_gemm_silu_mul: x has dtype torch.int64, expected one of torch.bfloat16, torch.float16, torch.float32, torch.float64 on cpu""")

    def test_w_up_shape_mismatch(self):
        x, wg, wu, rw, cu = _ggsm_args()
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu[:, :N - 1], rw, cu),
            """moonep::grouped_gemm_silu_mul: w_up has shape [3, 11, 16] but w_gate has shape [3, 12, 16]; they must match ([G, I, H])""")
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu[:G - 1], rw, cu),
            """moonep::grouped_gemm_silu_mul: w_up has shape [2, 12, 16] but w_gate has shape [3, 12, 16]; they must match ([G, I, H])""")
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu[0], rw, cu),
            """moonep::grouped_gemm_silu_mul: w_up has shape [12, 16] but w_gate has shape [3, 12, 16]; they must match ([G, I, H])""")

    def test_w_up_dtype_mismatch(self):
        x, wg, wu, rw, cu = _ggsm_args()
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu.bfloat16(), rw, cu),
            """moonep::grouped_gemm_silu_mul: w_up has dtype torch.bfloat16 but x has dtype torch.float32; they must match""")

    def test_route_weights(self):
        x, wg, wu, rw, cu = _ggsm_args()
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu, rw[:NVS - 1], cu),
            """moonep::grouped_gemm_silu_mul: route_weights must be [NvS] = [8] (one per row of x), got shape [7]""")
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu, rw.bfloat16(), cu),
            """moonep::grouped_gemm_silu_mul: route_weights must be float32, got torch.bfloat16""")

    def test_device_mismatch(self):
        x, wg, wu, rw, cu = _ggsm_args()
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu.to("meta"), rw, cu),
            """moonep::grouped_gemm_silu_mul: w_up is on meta but x is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises(ggsm, x, wg, wu, rw.to("meta"), cu),
            """moonep::grouped_gemm_silu_mul: route_weights is on meta but x is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises_fake(ggsm, x, wg, wu, rw, cu, cuda=(0, 1, 2, 4)),
            """moonep::grouped_gemm_silu_mul: route_weights is on cpu but x is on cuda:0; all tensors must be on one device""")

    def test_float64_refused_on_cuda(self):
        x, wg, wu, _, cu = _ggsm_args(dtype=torch.float64)
        self.assertExpectedInline(
            self.raises_fake(ggsm, x, wg, wu, None, cu, cuda=(0, 1, 2, 4)),
            """moonep::grouped_gemm_silu_mul: x has dtype torch.float64, expected one of torch.bfloat16, torch.float16, torch.float32 on cuda""")


class TestGroupedGemmSiluMulWithGateUpBadInput(BadInputCase):
    """The training variant shares grouped_gemm_silu_mul's rules; its errors carry its own name."""

    def test_shapes(self):
        x, wg, wu, rw, cu = _ggsm_args()
        self.assertExpectedInline(
            self.raises(ggsm_gu, x[:, :K - 1], wg, wu, rw, cu),
            """moonep::grouped_gemm_silu_mul_with_gate_up: x is [NvS, K] = [8, 15] and w_gate is [G, N, K] = [3, 12, 16]: K must match (out = x @ w_gate[g].T)""")
        self.assertExpectedInline(
            self.raises(ggsm_gu, x, wg, wu[:, :N - 1], rw, cu),
            """moonep::grouped_gemm_silu_mul_with_gate_up: w_up has shape [3, 11, 16] but w_gate has shape [3, 12, 16]; they must match ([G, I, H])""")
        self.assertExpectedInline(
            self.raises(ggsm_gu, x, wg, wu, rw[:NVS - 1], cu),
            """moonep::grouped_gemm_silu_mul_with_gate_up: route_weights must be [NvS] = [8] (one per row of x), got shape [7]""")
        self.assertExpectedInline(
            self.raises(ggsm_gu, x, wg, wu, rw, _cu((3, 6))),
            """moonep::grouped_gemm_silu_mul_with_gate_up: cu_seqlens has 2 entries but w_gate has G = 3 groups (w_gate.shape[0]); they must match""")

    def test_dtypes_and_devices(self):
        x, wg, wu, rw, cu = _ggsm_args()
        self.assertExpectedInline(
            self.raises(ggsm_gu, x, wg, wu.bfloat16(), rw, cu),
            """moonep::grouped_gemm_silu_mul_with_gate_up: w_up has dtype torch.bfloat16 but x has dtype torch.float32; they must match""")
        self.assertExpectedInline(
            self.raises_fake(ggsm_gu, x, wg, wu, rw, cu, cuda=(0, 1, 2, 4)),
            """moonep::grouped_gemm_silu_mul_with_gate_up: route_weights is on cpu but x is on cuda:0; all tensors must be on one device""")
        x64, wg64, wu64, _, cu = _ggsm_args(dtype=torch.float64)
        self.assertExpectedInline(
            self.raises_fake(ggsm_gu, x64, wg64, wu64, None, cu, cuda=(0, 1, 2, 4)),
            """moonep::grouped_gemm_silu_mul_with_gate_up: x has dtype torch.float64, expected one of torch.bfloat16, torch.float16, torch.float32 on cuda""")


class TestCuSeqlensValuesCpu(BadInputCase):
    """Data checks, CPU only. The fakes must accept these (they cannot see values)."""

    def _all_ops(self, cu):
        a, w, _ = _gg_args()
        gate, up, rw, _ = _smw_args()
        out = torch.empty(NVS, N)
        msgs = [self.raises(gg, a, w, cu, fake=False),
                self.raises(gg_out, a, w, cu, out, fake=False),
                self.raises(smw, gate, up, rw, cu, fake=False),
                self.raises(smw, gate, up, None, cu, fake=False),
                self.raises(ggsm, a, w, w, rw, cu, fake=False),
                self.raises(ggsm_gu, a, w, w, rw, cu, fake=False)]
        # The fakes pass and give the real kernels' metadata: no data read at trace time.
        self.assertEqual(_fake_call(gg, (a, w, cu)).shape, (NVS, N))
        self.assertIsNone(_fake_call(gg_out, (a, w, cu, out)))
        self.assertEqual(_fake_call(smw, (gate, up, rw, cu)).shape, (NVS, N))
        self.assertEqual(_fake_call(ggsm, (a, w, w, rw, cu)).shape, (NVS, N))
        self.assertEqual([t.shape for t in _fake_call(ggsm_gu, (a, w, w, rw, cu))], [(NVS, N)] * 3)
        # One message per op, differing only in the op name.
        self.assertEqual(len({m.split(": ", 1)[1] for m in msgs}), 1, msgs)
        return msgs[0]

    def test_decreasing(self):
        self.assertExpectedInline(
            self._all_ops(_cu((4, 2, 6))),
            """moonep::grouped_gemm: cu_seqlens must be non-decreasing, got cu_seqlens[0] = 4 > cu_seqlens[1] = 2""")

    def test_negative(self):
        self.assertExpectedInline(
            self._all_ops(_cu((-1, 2, 6))),
            """moonep::grouped_gemm: cu_seqlens must be non-negative, got cu_seqlens[0] = -1""")

    def test_last_end_past_nvs(self):
        self.assertExpectedInline(
            self._all_ops(_cu((3, 3, NVS + 1))),
            """moonep::grouped_gemm: cu_seqlens[-1] = 9 exceeds NvS = 8 (the number of rows)""")

    def test_last_end_equal_nvs_is_fine(self):
        a, w, _ = _gg_args()
        out = gg(a, w, _cu((3, 3, NVS)))
        self.assertFalse(out.isnan().any())


class TestCompiledRaisesTheSameMessage(BadInputCase):
    def test_k_mismatch_under_compile(self):
        a, w, cu = _gg_args()
        a = a[:, :K - 1].contiguous()
        eager = self.raises(gg, a, w, cu)
        torch._dynamo.reset()
        compiled = torch.compile(moonep_ops.grouped_gemm, fullgraph=True, backend="eager")
        with self.assertRaises(Exception) as cm:
            compiled(a, w, cu)
        self.assertIn(eager, str(cm.exception))


@pytest.mark.cuda
@unittest.skipUnless(HAS_CUDA, "needs a CUDA GPU")
class TestCudaBadInput(BadInputCase):
    """The same rules on a real GPU, under sync-debug 'error' so a check that synced would show."""

    def test_float64_refused(self):
        a, w, cu = _gg_args("cuda", torch.float64)
        self.assertExpectedInline(
            self.raises(gg, a, w, cu, eager_ctx=_no_sync),
            """moonep::grouped_gemm: a has dtype torch.float64, expected one of torch.bfloat16, torch.float16, torch.float32 on cuda""")

    def test_cu_seqlens_on_cpu(self):
        a, w, _ = _gg_args("cuda")
        cu = _cu()
        self.assertExpectedInline(
            self.raises(gg, a, w, cu, eager_ctx=_no_sync),
            """moonep::grouped_gemm: cu_seqlens is on cpu but a is on cuda:0; all tensors must be on one device""")

    def test_w_on_cpu(self):
        a, _, cu = _gg_args("cuda")
        w = torch.randn(G, N, K)
        self.assertExpectedInline(
            self.raises(gg, a, w, cu, eager_ctx=_no_sync),
            """moonep::grouped_gemm: w is on cpu but a is on cuda:0; all tensors must be on one device""")

    def test_out_on_cpu(self):
        a, w, cu = _gg_args("cuda")
        out = torch.empty(NVS, N)
        self.assertExpectedInline(
            self.raises(gg_out, a, w, cu, out, eager_ctx=_no_sync),
            """moonep::grouped_gemm_out: out is on cpu, expected cuda:0""")

    def test_route_weights_on_cpu(self):
        gate, up, _, cu = _smw_args("cuda")
        rw = torch.rand(NVS)
        self.assertExpectedInline(
            self.raises(smw, gate, up, rw, cu, eager_ctx=_no_sync),
            """moonep::silu_mul_weight: route_weights is on cpu but gate is on cuda:0; all tensors must be on one device""")

    def test_none_for_a_required_tensor(self):
        a, w, cu = _gg_args("cuda")
        x, wg, wu, wd, rw, cu_e = (t.cuda() for t in _experts_args())
        for fn, args, names in ((moonep_ops.grouped_gemm, (a, w, cu), {0: "a", 1: "w", 2: "cu"}),
                                (moonep_ops.moonep_experts, (x, wg, wu, wd, cu_e, rw),
                                 {0: "x", 1: "w_gate", 2: "w_up", 3: "w_down", 4: "cu"})):
            cpu_args = tuple(t.cpu() for t in args)
            self.assertEqual(_none_messages(self, fn, args, names, fake=False),
                             _none_messages(self, fn, cpu_args, names, fake=False))

    def test_k_mismatch(self):
        a, w, cu = _gg_args("cuda")
        self.assertExpectedInline(
            self.raises(gg, a[:, :K - 1], w, cu, eager_ctx=_no_sync),
            """moonep::grouped_gemm: a is [NvS, K] = [8, 15] and w is [G, N, K] = [3, 12, 16]: K must match (out = a @ w[g].T)""")


class TestMoonepExpertsBadInput(BadInputCase):
    def test_w_down_wrong_shape_is_named(self):
        x = torch.randn(NVS, K)
        w_gate, w_up = torch.randn(G, N, K), torch.randn(G, N, K)
        w_down = torch.randn(G, N, K)  # [G, I, H] instead of [G, H, I]
        with self.assertRaises(RuntimeError) as ctx:
            moonep_ops.moonep_experts(x, w_gate, w_up, w_down, _cu())
        self.assertExpectedInline(str(ctx.exception), """moonep::experts: w_down must be [G, H, I] = [3, 16, 12] (G, I from w_gate, H from x), got shape [3, 12, 16]""")


experts_op = torch.ops.moonep.experts.default
experts_out_op = torch.ops.moonep.experts_out.default


def _experts_args(dtype=torch.float32):
    x, wg, wu, rw, cu = _ggsm_args(dtype=dtype)
    return x, wg, wu, torch.randn(G, K, N, dtype=dtype), rw, cu


class TestExpertsBadInput(BadInputCase):
    """The whole-path op checks the fused GEMM's arguments and w_down; its errors carry its name."""

    def test_shapes(self):
        x, wg, wu, wd, rw, cu = _experts_args()
        self.assertExpectedInline(
            self.raises(experts_op, x, wg, wu[:, :N - 1], wd, rw, cu),
            """moonep::experts: w_up has shape [3, 11, 16] but w_gate has shape [3, 12, 16]; they must match ([G, I, H])""")
        self.assertExpectedInline(
            self.raises(experts_op, x, wg, wu, wd[:, :, :N - 1], rw, cu),
            """moonep::experts: w_down must be [G, H, I] = [3, 16, 12] (G, I from w_gate, H from x), got shape [3, 16, 11]""")
        self.assertExpectedInline(
            self.raises(experts_op, x, wg, wu, wd, rw, _cu((3, 6))),
            """moonep::experts: cu_seqlens has 2 entries but w_gate has G = 3 groups (w_gate.shape[0]); they must match""")

    def test_dtypes_and_devices(self):
        x, wg, wu, wd, rw, cu = _experts_args()
        self.assertExpectedInline(
            self.raises(experts_op, x, wg, wu, wd.double(), rw, cu),
            """moonep::experts: w_down has dtype torch.float64 but x has dtype torch.float32; they must match""")
        self.assertExpectedInline(
            self.raises_fake(experts_op, x, wg, wu, wd, rw, cu, cuda=(0, 1, 2, 4, 5)),
            """moonep::experts: w_down is on cpu but x is on cuda:0; all tensors must be on one device""")

    def test_out(self):
        x, wg, wu, wd, rw, cu = _experts_args()
        self.assertExpectedInline(
            self.raises(experts_out_op, x, wg, wu, wd, rw, cu, torch.empty(NVS, N)),
            """moonep::experts_out: out has shape [8, 12], expected [8, 16]""")
        self.assertExpectedInline(
            self.raises(experts_out_op, x, wg, wu, wd, rw, cu, torch.empty(K, NVS).t()),
            """moonep::experts_out: out must be contiguous, got shape [8, 16] with strides [1, 8]""")


def _replaced_messages(case, fn, args, names, value, fake):
    """``(name, message)`` of ``fn(*args)`` with each of ``names`` (positions of ``args``) replaced
    by ``value``."""
    for i, name in names.items():
        bad = list(args)
        bad[i] = value
        yield name, case.raises(fn, *bad, fake=fake)


def _none_messages(case, fn, args, names, fake=True):
    """``fn(*args)`` with each of ``names`` replaced by None, one line each."""
    return "\n".join(f"{name}=None: {msg}" for name, msg in _replaced_messages(case, fn, args, names, None, fake))


class TestNoneForARequiredTensor(BadInputCase):
    """None where a Tensor is required: the op and the argument named, eager and fake alike."""

    def test_grouped_gemm(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(_none_messages(self, moonep_ops.grouped_gemm, (a, w, cu), {0: "a", 1: "w", 2: "cu"}), """\
a=None: moonep::grouped_gemm: a must be a Tensor, got None
w=None: moonep::grouped_gemm: w must be a Tensor, got None
cu=None: moonep::grouped_gemm: cu_seqlens must be a Tensor, got None""")
        self.assertExpectedInline(
            _none_messages(self, gg_out, (a, w, cu, torch.empty(NVS, N)), {3: "out"}), """out=None: moonep::grouped_gemm_out: out must be a Tensor, got None""")

    def test_silu_mul_weight(self):
        gate, up, rw, cu = _smw_args()
        self.assertExpectedInline(
            _none_messages(self, moonep_ops.silu_mul_weight, (gate, up, rw, cu), {0: "gate", 1: "up", 3: "cu"}),
            """\
gate=None: moonep::silu_mul_weight: gate must be a Tensor, got None
up=None: moonep::silu_mul_weight: up must be a Tensor, got None
cu=None: moonep::silu_mul_weight: cu_seqlens must be a Tensor, got None""")

    def test_fused(self):
        names = {0: "x", 1: "w_gate", 2: "w_up", 4: "cu"}
        self.assertExpectedInline(
            _none_messages(self, moonep_ops.grouped_gemm_silu_mul, _ggsm_args(), names), """\
x=None: moonep::grouped_gemm_silu_mul: x must be a Tensor, got None
w_gate=None: moonep::grouped_gemm_silu_mul: w_gate must be a Tensor, got None
w_up=None: moonep::grouped_gemm_silu_mul: w_up must be a Tensor, got None
cu=None: moonep::grouped_gemm_silu_mul: cu_seqlens must be a Tensor, got None""")
        self.assertExpectedInline(
            _none_messages(self, moonep_ops.grouped_gemm_silu_mul_with_gate_up, _ggsm_args(), names), """\
x=None: moonep::grouped_gemm_silu_mul_with_gate_up: x must be a Tensor, got None
w_gate=None: moonep::grouped_gemm_silu_mul_with_gate_up: w_gate must be a Tensor, got None
w_up=None: moonep::grouped_gemm_silu_mul_with_gate_up: w_up must be a Tensor, got None
cu=None: moonep::grouped_gemm_silu_mul_with_gate_up: cu_seqlens must be a Tensor, got None""")

    def test_moonep_experts_with_and_without_grad(self):
        x, wg, wu, wd, rw, cu = _experts_args()
        names = {0: "x", 1: "w_gate", 2: "w_up", 3: "w_down", 4: "cu"}
        no_grad = _none_messages(self, moonep_ops.moonep_experts, (x, wg, wu, wd, cu, rw), names)
        self.assertExpectedInline(no_grad, """\
x=None: moonep::experts: x must be a Tensor, got None
w_gate=None: moonep::experts: w_gate must be a Tensor, got None
w_up=None: moonep::experts: w_up must be a Tensor, got None
w_down=None: moonep::experts: w_down must be a Tensor, got None
cu=None: moonep::experts: cu_seqlens must be a Tensor, got None""")
        # With grad the wrapper composes the training ops; the messages must not change.
        args = (x, wg.detach().requires_grad_(), wu, wd.detach().requires_grad_(), cu, rw)
        self.assertEqual(_none_messages(self, moonep_ops.moonep_experts, args, names, fake=False), no_grad)
        self.assertExpectedInline(
            _none_messages(self, experts_out_op, (x, wg, wu, wd, rw, cu, torch.empty(NVS, K)), {6: "out"}),
            """out=None: moonep::experts_out: out must be a Tensor, got None""")

    def test_backward_ops(self):
        a, w, cu = _gg_args()
        grad = torch.randn(NVS, N)
        ops = torch.ops.moonep
        self.assertExpectedInline("\n".join([
            _none_messages(self, ops.grouped_gemm_dgrad.default, (grad, w, cu), {0: "grad_out", 1: "w", 2: "cu"}),
            _none_messages(self, ops.grouped_gemm_wgrad.default, (grad, a, cu), {0: "grad_out", 1: "a", 2: "cu"}),
            _none_messages(self, ops.grouped_gemm_dual_dgrad.default, (grad, grad, w, w, cu), {1: "grad_up", 3: "w_up"}),
            _none_messages(self, ops.silu_mul_weight_backward.default, (grad, grad, grad, None, cu), {0: "grad"}),
            _none_messages(self, ops.grouped_gemm_silu_mul_backward.default, (grad, a, w, w, None, cu), {0: "grad"}),
        ]), """\
grad_out=None: moonep::grouped_gemm_dgrad: grad_out must be a Tensor, got None
w=None: moonep::grouped_gemm_dgrad: w must be a Tensor, got None
cu=None: moonep::grouped_gemm_dgrad: cu_seqlens must be a Tensor, got None
grad_out=None: moonep::grouped_gemm_wgrad: grad_out must be a Tensor, got None
a=None: moonep::grouped_gemm_wgrad: a must be a Tensor, got None
cu=None: moonep::grouped_gemm_wgrad: cu_seqlens must be a Tensor, got None
grad_up=None: moonep::grouped_gemm_dual_dgrad: grad_up must be a Tensor, got None
w_up=None: moonep::grouped_gemm_dual_dgrad: w_up must be a Tensor, got None
grad=None: moonep::silu_mul_weight_backward: grad must be a Tensor, got None
grad=None: moonep::grouped_gemm_silu_mul_backward: grad must be a Tensor, got None""")


def _not_a_tensor_messages(case, fn, args, names, fake=True):
    """``fn(*args)`` with each of ``names`` replaced by a list, one line each: the first line of the
    message (the dispatcher's, which goes on with the schema)."""
    return "\n".join(f"{name}: {msg.splitlines()[0]}"
                     for name, msg in _replaced_messages(case, fn, args, names, [1.0, 2.0], fake))


class TestDeviceCapability(BadInputCase):
    """The CUDA kernels' device floor, sm80 (sm89 for the FP8 ops' e4m3 MMAs), named as the op: their
    CUDA functions called on CPU tensors with the capability forced (no GPU needed)."""

    def forced(self, capability):
        from moonep_ops.kernels.cuda import paths

        stack = contextlib.ExitStack()
        stack.enter_context(unittest.mock.patch.object(paths, "capability_of", lambda t: capability))
        stack.enter_context(unittest.mock.patch.object(checks, "_PASSED", set()))  # (checks cached per signature)
        return stack

    def test_below_sm80(self):
        from moonep_ops.kernels.cuda import register

        with self.forced((7, 5)):
            self.assertExpectedInline(
                self.raises(register.grouped_gemm, *_gg_args(), fake=False),
                """moonep::grouped_gemm: the CUDA kernels need an NVIDIA GPU of compute capability 8.0 or newer (sm80+); this one is 7.5""")
            self.assertExpectedInline(
                self.raises(register.experts, *_experts_args(), fake=False),
                """moonep::experts: the CUDA kernels need an NVIDIA GPU of compute capability 8.0 or newer (sm80+); this one is 7.5""")

    def test_none_gets_the_checks_message(self):
        """The CUDA functions (with their device-floor check) name a None argument as the CPU ops do."""
        from moonep_ops.kernels.cuda import fp8 as cuda_fp8, register

        cases = [(register.grouped_gemm, gg, _gg_args(), {0: "a", 1: "w", 2: "cu"}),
                 (register.silu_mul_weight, smw, _smw_args(), {0: "gate", 1: "up", 3: "cu"}),
                 (register.experts, experts_op, _experts_args(), {0: "x", 1: "w_gate", 3: "w_down", 5: "cu"}),
                 (cuda_fp8.grouped_gemm_fp8, gg8, _gg8_args(), {0: "a", 1: "w", 2: "w_scale", 3: "cu"}),
                 (cuda_fp8.experts_fp8, experts8, _experts8_args(), {0: "x", 2: "w_gate_scale", 8: "cu"})]
        for cuda_fn, cpu_op, args, names in cases:
            with self.subTest(cuda_fn.__name__), unittest.mock.patch.object(checks, "_PASSED", set()):
                self.assertEqual(_none_messages(self, cuda_fn, args, names, fake=False),
                                 _none_messages(self, cpu_op, args, names, fake=False))

    def test_fp8_below_sm89(self):
        from moonep_ops import fp8
        from moonep_ops.kernels.cuda import fp8 as cuda_fp8

        a = torch.randn(NVS, 128, dtype=torch.bfloat16)
        w, scale = fp8.quantize_weight(torch.randn(G, 128, 128))
        with self.forced((8, 6)):
            self.assertExpectedInline(
                self.raises(cuda_fp8.grouped_gemm_fp8, a, w, scale, _cu(), fake=False),
                """moonep::grouped_gemm_fp8: FP8 (e4m3) matrix multiply needs a GPU of compute capability 8.9 or newer; this one is 8.6""")


class TestNotATensor(BadInputCase):
    """Something other than a Tensor or None (a list) where a tensor goes: the op and the argument
    named, never an error from inside the Python API."""

    def test_grouped_gemm(self):
        a, w, cu = _gg_args()
        self.assertExpectedInline(_not_a_tensor_messages(self, moonep_ops.grouped_gemm, (a, w, cu), {0: "a", 1: "w"}),
                                  """\
a: moonep::grouped_gemm() Expected a value of type 'Tensor' for argument 'a' but instead found type 'list'.
w: moonep::grouped_gemm() Expected a value of type 'Tensor' for argument 'w' but instead found type 'list'.""")
        out = functools.partial(moonep_ops.grouped_gemm, out=torch.empty(NVS, N))
        self.assertExpectedInline(_not_a_tensor_messages(self, out, (a, w, cu), {1: "w"}), """\
w: moonep::grouped_gemm_out() Expected a value of type 'Tensor' for argument 'w' but instead found type 'list'.""")

    def test_moonep_experts_with_and_without_grad(self):
        x, wg, wu, wd, rw, cu = _experts_args()
        names = {0: "x", 1: "w_gate", 2: "w_up", 3: "w_down", 4: "cu", 5: "route_weights"}
        no_grad = _not_a_tensor_messages(self, moonep_ops.moonep_experts, (x, wg, wu, wd, cu, rw), names)
        self.assertExpectedInline(no_grad, """\
x: moonep::experts() Expected a value of type 'Tensor' for argument 'x' but instead found type 'list'.
w_gate: moonep::experts() Expected a value of type 'Tensor' for argument 'w_gate' but instead found type 'list'.
w_up: moonep::experts() Expected a value of type 'Tensor' for argument 'w_up' but instead found type 'list'.
w_down: moonep::experts() Expected a value of type 'Tensor' for argument 'w_down' but instead found type 'list'.
cu: moonep::experts() Expected a value of type 'Tensor' for argument 'cu_seqlens' but instead found type 'list'.
route_weights: moonep::experts() Expected a value of type 'Optional[Tensor]' for argument 'route_weights' but instead found type 'list'.""")
        # With grad the wrapper composes the training ops; the messages must not change.
        for grad in (1, 3):
            args = [x, wg, wu, wd, cu, rw]
            args[grad] = args[grad].detach().requires_grad_()
            with_grad = {i: n for i, n in names.items() if i != grad}
            self.assertEqual(_not_a_tensor_messages(self, moonep_ops.moonep_experts, args, with_grad, fake=False),
                             "\n".join(line for line in no_grad.splitlines()
                                        if not line.startswith(names[grad] + ":")))


class TestMoonepExpertsCuSeqlensValues(BadInputCase):
    """Bad cu_seqlens values read as moonep::experts' error whether or not a gradient is needed."""

    def test_same_message_with_and_without_grad(self):
        x, wg, wu, wd, rw, _ = _experts_args()
        lines = []
        for ends in ((4, 2, 6), (-1, 2, 6), (3, 3, NVS + 1)):
            cu = _cu(ends)
            msgs = []
            for needs in ((), (0,), (1, 2), (3,)):
                args = [t.detach().requires_grad_(i in needs) for i, t in enumerate((x, wg, wu, wd))]
                for recompute in (False, True):
                    fn = functools.partial(moonep_ops.moonep_experts, recompute=recompute)
                    msgs.append(self.raises(fn, *args, cu, rw, fake=False))
            self.assertEqual(len(set(msgs)), 1, msgs)
            lines.append(msgs[0])
        self.assertExpectedInline("\n".join(lines), """\
moonep::experts: cu_seqlens must be non-decreasing, got cu_seqlens[0] = 4 > cu_seqlens[1] = 2
moonep::experts: cu_seqlens must be non-negative, got cu_seqlens[0] = -1
moonep::experts: cu_seqlens[-1] = 9 exceeds NvS = 8 (the number of rows)""")


# --- FP8 block-scaled ops ------------------------------------------------------------------------

gg8 = torch.ops.moonep.grouped_gemm_fp8.default
gg8_out = torch.ops.moonep.grouped_gemm_fp8_out.default
experts8 = torch.ops.moonep.experts_fp8.default
experts8_out = torch.ops.moonep.experts_fp8_out.default
FP8 = torch.float8_e4m3fn


def _fp8_weight(*shape):
    """An e4m3fn weight and its fp32 block scales (ones: only the metadata matters here)."""
    g, n, k = shape
    return torch.randn(shape).to(FP8), torch.ones(g, -(-n // 128), -(-k // 128))


def _gg8_args():
    """``(a [NvS, K] bf16, w [G, N, K] e4m3fn, w_scale [G, 1, 1], cu_seqlens)``."""
    return (torch.randn(NVS, K, dtype=torch.bfloat16), *_fp8_weight(G, N, K), _cu())


def _experts8_args():
    """``(x [NvS, H=K] bf16, w_gate, scale, w_up, scale [G, I=N, H], w_down, scale [G, H, I], rw, cu)``."""
    x = torch.randn(NVS, K, dtype=torch.bfloat16)
    return (x, *_fp8_weight(G, N, K), *_fp8_weight(G, N, K), *_fp8_weight(G, K, N), torch.rand(NVS), _cu())


def _replaced(args, **changes):
    """``args`` of experts_fp8 with the named ones replaced."""
    names = ("x", "w_gate", "w_gate_scale", "w_up", "w_up_scale", "w_down", "w_down_scale", "route_weights",
             "cu_seqlens")
    return tuple(changes.get(name, arg) for name, arg in zip(names, args))


def _k_strided(w):
    """``w`` with the same values, K not the innermost dimension in memory."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


class TestGroupedGemmFp8BadInput(BadInputCase):
    def test_activation_dtype(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(gg8, a.float(), w, s, cu),
            """moonep::grouped_gemm_fp8: a has dtype torch.float32, expected torch.bfloat16 or torch.float16 (the FP8 ops quantize 16-bit activations themselves)""")
        self.assertExpectedInline(
            self.raises(gg8, a.to(FP8), w, s, cu),
            """moonep::grouped_gemm_fp8: a has dtype torch.float8_e4m3fn, expected torch.bfloat16 or torch.float16 (the FP8 ops quantize 16-bit activations themselves)""")

    def test_weight_dtype(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(gg8, a, w.bfloat16(), s, cu),
            """moonep::grouped_gemm_fp8: w has dtype torch.bfloat16, expected torch.float8_e4m3fn (the FP8 ops take e4m3fn weights only)""")
        self.assertExpectedInline(
            self.raises(gg8, a, w.to(torch.float8_e5m2), s, cu),
            """moonep::grouped_gemm_fp8: w has dtype torch.float8_e5m2; the supported FP8 format is torch.float8_e4m3fn (per 128 x 128 block scaled)""")

    def test_scale_shape(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(gg8, a, w, torch.ones(G, 1, 2), cu),
            """moonep::grouped_gemm_fp8: w_scale has shape [3, 1, 2], expected [G, ceil(N/128), ceil(K/128)] = [3, 1, 1] for w of shape [3, 12, 16]""")
        self.assertExpectedInline(
            self.raises(gg8, a, w, s[0], cu),
            """moonep::grouped_gemm_fp8: w_scale has shape [1, 1], expected [G, ceil(N/128), ceil(K/128)] = [3, 1, 1] for w of shape [3, 12, 16]""")
        a_wide, (w_wide, _), cu = torch.randn(NVS, 300, dtype=torch.bfloat16), _fp8_weight(G, 130, 300), _cu()
        self.assertExpectedInline(
            self.raises(gg8, a_wide, w_wide, torch.ones(G, 1, 3), cu),
            """moonep::grouped_gemm_fp8: w_scale has shape [3, 1, 3], expected [G, ceil(N/128), ceil(K/128)] = [3, 2, 3] for w of shape [3, 130, 300]""")

    def test_scale_dtype(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(gg8, a, w, s.bfloat16(), cu),
            """moonep::grouped_gemm_fp8: w_scale has dtype torch.bfloat16, expected torch.float32""")
        self.assertExpectedInline(
            self.raises(gg8, a, w, s.to(FP8), cu),
            """moonep::grouped_gemm_fp8: w_scale has dtype torch.float8_e4m3fn, expected torch.float32""")

    def test_shapes_and_cu_seqlens(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(gg8, a[:, :K - 1], w, s, cu),
            """moonep::grouped_gemm_fp8: a is [NvS, K] = [8, 15] and w is [G, N, K] = [3, 12, 16]: K must match (out = a @ w[g].T)""")
        self.assertExpectedInline(
            self.raises(gg8, a, w[0], s, cu),
            """moonep::grouped_gemm_fp8: w must be 3-D [G, N, K] or block-major 5-D [G, N/128, K/128, 128, 128], got shape [12, 16]""")
        self.assertExpectedInline(
            self.raises(gg8, a, w, s, _cu((3, 6))),
            """moonep::grouped_gemm_fp8: cu_seqlens has 2 entries but w has G = 3 groups (w.shape[0]); they must match""")
        self.assertExpectedInline(
            self.raises(gg8, a, w, s, cu.long()),
            """moonep::grouped_gemm_fp8: cu_seqlens must be int32, got torch.int64""")

    def test_devices(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(gg8, a, w, s.to("meta"), cu),
            """moonep::grouped_gemm_fp8: w_scale is on meta but a is on cpu; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises_fake(gg8, a, w, s, cu, cuda=(0, 1, 3)),
            """moonep::grouped_gemm_fp8: w_scale is on cpu but a is on cuda:0; all tensors must be on one device""")

    def test_cuda_layout(self):
        # CUDA loads weight rows along K and scales by flat index; the CPU kernel takes any strides.
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises_fake(gg8, a, _k_strided(w), s, cu, cuda=(0, 1, 2, 3)),
            """moonep::grouped_gemm_fp8: w must have its K dimension contiguous on CUDA (w.stride(-1) == 1), got shape [3, 12, 16] with strides [192, 1, 12]""")
        a_wide, (w_wide, _) = torch.randn(NVS, 300, dtype=torch.bfloat16), _fp8_weight(G, N, 300)
        s_strided = torch.ones(G, 1, 6)[:, :, ::2]  # [G, 1, 3], every other element
        self.assertExpectedInline(
            self.raises_fake(gg8, a_wide, w_wide, s_strided, cu, cuda=(0, 1, 2, 3)),
            """moonep::grouped_gemm_fp8: w_scale must have its last dimension contiguous on CUDA (w_scale.stride(-1) == 1), got shape [3, 1, 3] with strides [6, 6, 2]""")
        s_padded = torch.ones(G, 4, 3)[:, :1]  # [G, 1, 3] rows of a buffer with padded groups: fine
        self.assertEqual(tuple(_fake_call(gg8, (a_wide, w_wide, s_padded, cu), cuda=(0, 1, 2, 3)).shape), (NVS, N))
        self.assertEqual(gg8(a, _k_strided(w), s, cu).shape, (NVS, N))  # CPU: fine

    def test_out(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(gg8_out, a, w, s, cu, torch.empty(NVS, N)),
            """moonep::grouped_gemm_fp8_out: out has dtype torch.float32, expected torch.bfloat16""")
        self.assertExpectedInline(
            self.raises(gg8_out, a, w, s, cu, torch.empty(NVS, K, dtype=torch.bfloat16)),
            """moonep::grouped_gemm_fp8_out: out has shape [8, 16], expected [8, 12]""")
        self.assertExpectedInline(
            self.raises(gg8_out, a, w, s, cu, torch.empty(N, NVS, dtype=torch.bfloat16).t()),
            """moonep::grouped_gemm_fp8_out: out must be contiguous, got shape [8, 12] with strides [1, 8]""")

    def test_out_overlaps_an_input(self):
        a, w, s, cu = _gg8_args()
        buf = torch.empty(NVS * (K + N), dtype=torch.bfloat16)
        a_in_buf = buf[:NVS * K].view(NVS, K).copy_(a)
        self.assertExpectedInline(
            self.raises(gg8_out, a_in_buf, w, s, cu, buf[NVS * 4:NVS * 4 + NVS * N].view(NVS, N), fake=False),
            """moonep::grouped_gemm_fp8_out: out overlaps a in memory; out must not share memory with any input (pass a separate buffer)""")
        scale_buf = torch.empty(2 * NVS * N, dtype=torch.bfloat16)
        s_in_buf = scale_buf.view(torch.float32)[:G].view(G, 1, 1).copy_(s)
        self.assertExpectedInline(
            self.raises(gg8_out, a, w, s_in_buf, cu, scale_buf[:NVS * N].view(NVS, N), fake=False),
            """moonep::grouped_gemm_fp8_out: out overlaps w_scale in memory; out must not share memory with any input (pass a separate buffer)""")


    def test_block_major(self):
        """Block-major weights ``[G, N/128, K/128, 128, 128]``: blocks of another size, K against
        ``a``, scales against the weight's ``[G, N, K]``, out against its N."""
        a = torch.randn(NVS, 256, dtype=torch.bfloat16)
        w = torch.zeros(G, 3, 2, 128, 128, dtype=FP8)
        s = torch.ones(G, 3, 2)
        self.assertExpectedInline(
            self.raises(gg8, a, w[..., :64], s, _cu()),
            """moonep::grouped_gemm_fp8: w must be 3-D [G, N, K] or block-major 5-D [G, N/128, K/128, 128, 128], got shape [3, 3, 2, 128, 64]""")
        self.assertExpectedInline(
            self.raises(gg8, a[:, :128], w, s, _cu()),
            """moonep::grouped_gemm_fp8: a is [NvS, K] = [8, 128] and w is block-major [G, N/128, K/128, 128, 128] = [3, 3, 2, 128, 128] ([G, N, K] = [3, 384, 256]): K must match (out = a @ w[g].T)""")
        self.assertExpectedInline(
            self.raises(gg8, a, w, s[:, :2], _cu()),
            """moonep::grouped_gemm_fp8: w_scale has shape [3, 2, 2], expected [G, ceil(N/128), ceil(K/128)] = [3, 3, 2] for w of shape [3, 3, 2, 128, 128] (block-major: [G, N, K] = [3, 384, 256])""")
        self.assertExpectedInline(
            self.raises(gg8_out, a, w, s, _cu(), torch.empty(NVS, 256, dtype=torch.bfloat16)),
            """moonep::grouped_gemm_fp8_out: out has shape [8, 256], expected [8, 384]""")


class TestExpertsFp8BadInput(BadInputCase):
    def test_shapes(self):
        args = _experts8_args()
        x, wg, sg, wu, su, wd, sd, rw, cu = args
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_up=wu[:, :N - 1])),
            """moonep::experts_fp8: w_up has shape [3, 11, 16] but w_gate has shape [3, 12, 16]; they must match ([G, I, H], or both block-major)""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_down=wg, w_down_scale=sg)),
            """moonep::experts_fp8: w_down must be [G, H, I] = [3, 16, 12] (G, I and the layout from w_gate, H from x), got shape [3, 12, 16]""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_down_scale=torch.ones(G, 2, 1))),
            """moonep::experts_fp8: w_down_scale has shape [3, 2, 1], expected [G, ceil(N/128), ceil(K/128)] = [3, 1, 1] for w_down of shape [3, 16, 12]""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, route_weights=rw[:NVS - 1])),
            """moonep::experts_fp8: route_weights must be [NvS] = [8] (one per row of x), got shape [7]""")

    def test_block_major_layouts_match(self):
        """The three weights in one layout: block-major gate with a row-major up or down."""
        x = torch.randn(NVS, 256, dtype=torch.bfloat16)
        gate = up = (torch.zeros(G, 3, 2, 128, 128, dtype=FP8), torch.ones(G, 3, 2))
        down = (torch.zeros(G, 2, 3, 128, 128, dtype=FP8), torch.ones(G, 2, 3))
        args = (x, *gate, *up, *down, torch.rand(NVS), _cu())
        experts8(*args)  # the valid call
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_up=torch.zeros(G, 384, 256, dtype=FP8))),
            """moonep::experts_fp8: w_up has shape [3, 384, 256] but w_gate has shape [3, 3, 2, 128, 128]; they must match ([G, I, H], or both block-major)""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_down=torch.zeros(G, 256, 384, dtype=FP8))),
            """moonep::experts_fp8: w_down must be block-major [G, H/128, I/128, 128, 128] = [3, 2, 3, 128, 128] (G, I and the layout from w_gate, H from x), got shape [3, 256, 384]""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_down=torch.zeros(G, 3, 2, 128, 128, dtype=FP8))),
            """moonep::experts_fp8: w_down must be block-major [G, H/128, I/128, 128, 128] = [3, 2, 3, 128, 128] (G, I and the layout from w_gate, H from x), got shape [3, 3, 2, 128, 128]""")

    def test_dtypes(self):
        args = _experts8_args()
        x, wg, sg, wu, su, wd, sd, rw, cu = args
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, x=x.float())),
            """moonep::experts_fp8: x has dtype torch.float32, expected torch.bfloat16 or torch.float16 (the FP8 ops quantize 16-bit activations themselves)""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, x=x.to(FP8))),
            """moonep::experts_fp8: x has dtype torch.float8_e4m3fn, expected torch.bfloat16 or torch.float16 (the FP8 ops quantize 16-bit activations themselves)""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_up=wu.bfloat16())),
            """moonep::experts_fp8: w_up has dtype torch.bfloat16, expected torch.float8_e4m3fn (the FP8 ops take e4m3fn weights only)""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_down=wd.to(torch.float8_e5m2))),
            """moonep::experts_fp8: w_down has dtype torch.float8_e5m2; the supported FP8 format is torch.float8_e4m3fn (per 128 x 128 block scaled)""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, w_gate_scale=sg.double())),
            """moonep::experts_fp8: w_gate_scale has dtype torch.float64, expected torch.float32""")
        self.assertExpectedInline(
            self.raises(experts8, *_replaced(args, route_weights=rw.bfloat16())),
            """moonep::experts_fp8: route_weights must be float32, got torch.bfloat16""")

    def test_devices_and_cuda_layout(self):
        args = _experts8_args()
        self.assertExpectedInline(
            self.raises_fake(experts8, *args, cuda=(0, 1, 2, 3, 4, 5, 6, 8)),
            """moonep::experts_fp8: route_weights is on cpu but x is on cuda:0; all tensors must be on one device""")
        self.assertExpectedInline(
            self.raises_fake(experts8, *_replaced(args, w_down=_k_strided(args[5])), cuda=range(9)),
            """moonep::experts_fp8: w_down must have its K dimension contiguous on CUDA (w_down.stride(-1) == 1), got shape [3, 16, 12] with strides [192, 1, 16]""")

    def test_out(self):
        args = _experts8_args()
        self.assertExpectedInline(
            self.raises(experts8_out, *args, torch.empty(NVS, N, dtype=torch.bfloat16)),
            """moonep::experts_fp8_out: out has shape [8, 12], expected [8, 16]""")
        self.assertExpectedInline(
            self.raises(experts8_out, *args, torch.empty(NVS, K, dtype=torch.float16)),
            """moonep::experts_fp8_out: out has dtype torch.float16, expected torch.bfloat16""")
        buf = torch.empty(NVS * K + 1, dtype=torch.bfloat16)
        x_in_buf = buf[:NVS * K].view(NVS, K).copy_(args[0])
        self.assertExpectedInline(
            self.raises(experts8_out, *_replaced(args, x=x_in_buf), buf[1:].view(NVS, K), fake=False),
            """moonep::experts_fp8_out: out overlaps x in memory; out must not share memory with any input other than x itself (pass a separate buffer)""")


class TestFp8ApiBadInput(BadInputCase):
    """The public API picks the FP8 op from the weights' dtype and the scales; what does not fit
    is refused, naming the op and the argument."""

    def _experts(self, args, **scales):
        x, wg, _, wu, _, wd, _, rw, cu = args
        return self.raises(functools.partial(moonep_ops.moonep_experts, **scales), x, wg, wu, wd, cu, rw, fake=False)

    def test_fp8_weight_without_scale(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(moonep_ops.grouped_gemm, a, w, cu, fake=False),
            """moonep::grouped_gemm_fp8: w is torch.float8_e4m3fn but w_scale is None; FP8 weights need their fp32 block scales [G, ceil(N/128), ceil(K/128)] (w_scale=)""")
        args = _experts8_args()
        self.assertExpectedInline(self._experts(args), """moonep::experts_fp8: w_gate is torch.float8_e4m3fn but w_gate_scale is None; FP8 weights need their fp32 block scales [G, ceil(N/128), ceil(K/128)] (w_gate_scale=)""")
        self.assertExpectedInline(
            self._experts(args, w_gate_scale=args[2], w_down_scale=args[6]),
            """moonep::experts_fp8: w_up is torch.float8_e4m3fn but w_up_scale is None; FP8 weights need their fp32 block scales [G, ceil(N/128), ceil(K/128)] (w_up_scale=)""")

    def test_scale_for_non_fp8_weight(self):
        a, w, s, cu = _gg8_args()
        self.assertExpectedInline(
            self.raises(functools.partial(moonep_ops.grouped_gemm, w_scale=s), a, w.bfloat16(), cu, fake=False),
            """moonep::grouped_gemm_fp8: w_scale is given but w has dtype torch.bfloat16; block scales go with torch.float8_e4m3fn weights only""")
        self.assertExpectedInline(
            self.raises(functools.partial(moonep_ops.grouped_gemm, w_scale=s, out=torch.empty(NVS, N)), a.float(),
                        w.float(), cu, fake=False),
            """moonep::grouped_gemm_fp8_out: w_scale is given but w has dtype torch.float32; block scales go with torch.float8_e4m3fn weights only""")
        x, wg, sg, wu, su, wd, sd, rw, cu = _experts8_args()
        bf16_args = (x, wg.bfloat16(), sg, wu.bfloat16(), su, wd.bfloat16(), sd, rw, cu)
        self.assertExpectedInline(
            self._experts(bf16_args, w_up_scale=su),
            """moonep::experts_fp8: w_up_scale is given but w_up has dtype torch.bfloat16; block scales go with torch.float8_e4m3fn weights only""")

    def test_mixed_weight_dtypes(self):
        args = _experts8_args()
        x, wg, sg, wu, su, wd, sd, rw, cu = args
        scales = dict(w_gate_scale=sg, w_up_scale=su, w_down_scale=sd)
        mixed = (x, wg, sg, wu.bfloat16(), su, wd, sd, rw, cu)
        self.assertExpectedInline(
            self._experts(mixed, **scales),
            """moonep::experts_fp8: weights must be all torch.float8_e4m3fn (with block scales) or none, got w_gate torch.float8_e4m3fn, w_up torch.bfloat16, w_down torch.float8_e4m3fn""")
        # Without scales and a bf16 w_gate the call is the bf16 op, whose dtype error points at the scales.
        self.assertExpectedInline(
            self._experts((x, wg.bfloat16(), sg, wu, su, wd.bfloat16(), sd, rw, cu)),
            """moonep::experts: w_up has dtype torch.float8_e4m3fn but x has dtype torch.bfloat16; they must match (FP8 weights need their block scales: moonep_ops.grouped_gemm(..., w_scale=) or moonep_ops.moonep_experts(..., w_gate_scale=, w_up_scale=, w_down_scale=))""")

    def test_e5m2(self):
        a, w, s, cu = _gg8_args()
        w52 = w.to(torch.float8_e5m2)
        self.assertExpectedInline(
            self.raises(moonep_ops.grouped_gemm, a, w52, cu, fake=False),
            """moonep::grouped_gemm: w has dtype torch.float8_e5m2 but a has dtype torch.bfloat16; they must match (FP8 weights must be torch.float8_e4m3fn with block scales; torch.float8_e5m2 is not supported)""")
        self.assertExpectedInline(
            self.raises(functools.partial(moonep_ops.grouped_gemm, w_scale=s), a, w52, cu, fake=False),
            """moonep::grouped_gemm_fp8: w has dtype torch.float8_e5m2; the supported FP8 format is torch.float8_e4m3fn (per 128 x 128 block scaled)""")

    def test_none_for_a_required_tensor(self):
        a, w, s, cu = _gg8_args()
        names = {0: "a", 1: "w", 2: "w_scale", 3: "cu"}
        self.assertExpectedInline(_none_messages(self, gg8, (a, w, s, cu), names), """\
a=None: moonep::grouped_gemm_fp8: a must be a Tensor, got None
w=None: moonep::grouped_gemm_fp8: w must be a Tensor, got None
w_scale=None: moonep::grouped_gemm_fp8: w_scale must be a Tensor, got None
cu=None: moonep::grouped_gemm_fp8: cu_seqlens must be a Tensor, got None""")
        names = {0: "x", 1: "w_gate", 2: "w_gate_scale", 3: "w_up", 4: "w_up_scale", 5: "w_down", 6: "w_down_scale",
                 8: "cu"}
        self.assertExpectedInline(_none_messages(self, experts8, _experts8_args(), names), """\
x=None: moonep::experts_fp8: x must be a Tensor, got None
w_gate=None: moonep::experts_fp8: w_gate must be a Tensor, got None
w_gate_scale=None: moonep::experts_fp8: w_gate_scale must be a Tensor, got None
w_up=None: moonep::experts_fp8: w_up must be a Tensor, got None
w_up_scale=None: moonep::experts_fp8: w_up_scale must be a Tensor, got None
w_down=None: moonep::experts_fp8: w_down must be a Tensor, got None
w_down_scale=None: moonep::experts_fp8: w_down_scale must be a Tensor, got None
cu=None: moonep::experts_fp8: cu_seqlens must be a Tensor, got None""")

    def test_cu_seqlens_values(self):
        lines = []
        for ends in ((4, 2, 6), (3, 3, NVS + 1)):
            a, w, s, _ = _gg8_args()
            args = _replaced(_experts8_args(), cu_seqlens=_cu(ends))
            out = torch.empty(NVS, N, dtype=torch.bfloat16)
            lines += [self.raises(gg8, a, w, s, _cu(ends), fake=False),
                      self.raises(gg8_out, a, w, s, _cu(ends), out, fake=False),
                      self.raises(experts8, *args, fake=False),
                      self.raises(experts8_out, *args, torch.empty_like(args[0]), fake=False)]
        self.assertExpectedInline("\n".join(lines), """\
moonep::grouped_gemm_fp8: cu_seqlens must be non-decreasing, got cu_seqlens[0] = 4 > cu_seqlens[1] = 2
moonep::grouped_gemm_fp8_out: cu_seqlens must be non-decreasing, got cu_seqlens[0] = 4 > cu_seqlens[1] = 2
moonep::experts_fp8: cu_seqlens must be non-decreasing, got cu_seqlens[0] = 4 > cu_seqlens[1] = 2
moonep::experts_fp8_out: cu_seqlens must be non-decreasing, got cu_seqlens[0] = 4 > cu_seqlens[1] = 2
moonep::grouped_gemm_fp8: cu_seqlens[-1] = 9 exceeds NvS = 8 (the number of rows)
moonep::grouped_gemm_fp8_out: cu_seqlens[-1] = 9 exceeds NvS = 8 (the number of rows)
moonep::experts_fp8: cu_seqlens[-1] = 9 exceeds NvS = 8 (the number of rows)
moonep::experts_fp8_out: cu_seqlens[-1] = 9 exceeds NvS = 8 (the number of rows)""")
