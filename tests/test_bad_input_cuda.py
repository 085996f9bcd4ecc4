"""Bad input on CUDA tensors: the same errors as on CPU, no host sync, a healthy context after.

Every case of tests/test_bad_input.py (which pins the messages on CPU and on fake CUDA
tensors) is rebuilt here on real CUDA tensors and called under
``torch.cuda.set_sync_debug_mode("error")``, so a check that synced would raise a different
error. Each must raise exactly the message the fake impl gives for the same metadata (what
torch.compile would raise), and, where the case does not involve devices or the CUDA dtype
list, exactly the CPU kernel's message. Bad ``cu_seqlens`` *values* cannot be checked on CUDA
without a sync: there the kernels must neither fault nor assert on the device (their values
are unspecified), and ``MOONEP_OPS_DEBUG=1`` turns them into the CPU errors. After every test
a normal op call and ``torch.cuda.synchronize()`` must still succeed.

The case table also runs on CPU in CI (each case must be rejected there too), so a wrong
case shows up before the GPU run.
"""

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moonep_ops
from moonep_ops.fp8 import quantize_weight
from moonep_ops.schemas import SCHEMAS
from .reference import TOLERANCE, grouped_gemm_ref, rel_err
from .test_bad_input import _no_sync

HAS_CUDA = torch.cuda.is_available()
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

NVS, K, N, G = 8, 16, 12, 3


def base_tensors(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    return SimpleNamespace(
        a=r(NVS, K), w=r(G, N, K), w_up=r(G, N, K), gate=r(NVS, N), up=r(NVS, N), grad=r(NVS, N),
        rw=(torch.rand(NVS, generator=gen) + 0.1).to(device),
        cu=torch.tensor([3, 3, 6], dtype=torch.int32, device=device),
        out=torch.empty(NVS, N, dtype=dtype, device=device), device=device,
        w_down=r(G, K, N), x_out=torch.empty(NVS, K, dtype=dtype, device=device))


def cu_tensor(b, ends, dtype=torch.int32):
    return torch.tensor(ends, dtype=dtype, device=b.device)


def _other(b, t):
    """``t`` on the other device: CPU for a CUDA case (CPU has no counterpart: not neutral)."""
    return t.cpu() if torch.device(b.device).type == "cuda" else t.to("meta")


def _ops():
    return torch.ops.moonep


def _gg_out_api(a, w, cu, out):
    return moonep_ops.grouped_gemm(a, w, cu, out=out)


def _fp8(b):
    """FP8 arguments built from the base tensors: ``x`` bf16 ``[NvS, K]``; e4m3fn ``w``, ``w_up``
    ``[G, N, K]`` and ``w_down [G, K, N]`` with their scales (``*_s``); bf16 ``out [NvS, N]`` and
    ``x_out [NvS, K]``."""
    (w, w_s), (w_up, w_up_s), (w_down, w_down_s) = (quantize_weight(t) for t in (b.w, b.w_up, b.w_down))
    x = b.a.bfloat16()
    return SimpleNamespace(x=x, w=w, w_s=w_s, w_up=w_up, w_up_s=w_up_s, w_down=w_down, w_down_s=w_down_s,
                           out=torch.empty(NVS, N, dtype=x.dtype, device=b.device), x_out=torch.empty_like(x))


def _gg8(b, **changes):
    """``(grouped_gemm_fp8, (a, w, w_scale, cu_seqlens))`` with the named arguments replaced."""
    f = _fp8(b)
    args = dict(a=f.x, w=f.w, w_scale=f.w_s, cu_seqlens=b.cu) | changes
    return _ops().grouped_gemm_fp8, tuple(args.values())


def _gg8_out(b, **changes):
    f = _fp8(b)
    args = dict(a=f.x, w=f.w, w_scale=f.w_s, cu_seqlens=b.cu, out=f.out) | changes
    return _ops().grouped_gemm_fp8_out, tuple(args.values())


def _experts8_args(b, f, **changes):
    args = dict(x=f.x, w_gate=f.w, w_gate_scale=f.w_s, w_up=f.w_up, w_up_scale=f.w_up_s, w_down=f.w_down,
                w_down_scale=f.w_down_s, route_weights=b.rw, cu_seqlens=b.cu) | changes
    return tuple(args.values())


def _experts8(b, **changes):
    return _ops().experts_fp8, _experts8_args(b, _fp8(b), **changes)


def _experts8_out(b, **changes):
    f = _fp8(b)
    out = changes.pop("out", f.x_out)
    return _ops().experts_fp8_out, _experts8_args(b, f, **changes) + (out,)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # the moonep op (SCHEMAS key) the case is about
    args: Callable  # base namespace -> (callable, args)
    neutral: bool = True  # same message on CPU (no device names or device dtype lists in it)
    cuda_only: bool = False  # bad on CUDA only (float64 is fine on CPU)


def _c(op, args, neutral=True):
    return Case(op, args, neutral)


def _cuda_only(op, args):
    return Case(op, args, neutral=False, cuda_only=True)


CASES = {
    # grouped_gemm
    "gg_a_3d": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a[None], b.w, b.cu))),
    "gg_a_1d": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a[0], b.w, b.cu))),
    "gg_w_2d": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w[0], b.cu))),
    "gg_w_4d": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w[None], b.cu))),
    "gg_w_no_groups": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w[:0], cu_tensor(b, [])))),
    "gg_k_mismatch": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a[:, :K - 1], b.w, b.cu))),
    "gg_cu_int64": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w, b.cu.long()))),
    "gg_cu_float": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w, b.cu.float()))),
    "gg_cu_2d": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w, b.cu[:, None]))),
    "gg_cu_0d": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w, b.cu[0]))),
    "gg_cu_short": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w, cu_tensor(b, [3, 6])))),
    "gg_cu_long": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w, cu_tensor(b, [1, 2, 3, 6])))),
    "gg_w_bf16": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w.bfloat16(), b.cu))),
    "gg_a_half": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a.half(), b.w, b.cu))),
    "gg_int64": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a.long(), b.w.long(), b.cu)), False),
    "gg_bool": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a.bool(), b.w.bool(), b.cu)), False),
    "gg_float64": _cuda_only("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a.double(), b.w.double(), b.cu))),
    "gg_w_other_device": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, _other(b, b.w), b.cu)), False),
    "gg_cu_other_device": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (b.a, b.w, _other(b, b.cu))), False),
    "gg_a_other_device": _c("grouped_gemm", lambda b: (_ops().grouped_gemm, (_other(b, b.a), b.w, b.cu)), False),
    # grouped_gemm_out
    "ggo_k_mismatch": _c("grouped_gemm_out",
                         lambda b: (_ops().grouped_gemm_out, (b.a[:, :K - 1], b.w, b.cu, b.out))),
    "ggo_cu_short": _c("grouped_gemm_out", lambda b: (_ops().grouped_gemm_out, (b.a, b.w, cu_tensor(b, [3, 6]), b.out))),
    "ggo_out_cols": _c("grouped_gemm_out", lambda b: (_ops().grouped_gemm_out, (b.a, b.w, b.cu, b.a[:, :N + 1]))),
    "ggo_out_rows": _c("grouped_gemm_out", lambda b: (_ops().grouped_gemm_out, (b.a, b.w, b.cu, b.out[:NVS - 1]))),
    "ggo_out_1d": _c("grouped_gemm_out", lambda b: (_ops().grouped_gemm_out, (b.a, b.w, b.cu, b.out.view(-1)))),
    "ggo_out_bf16": _c("grouped_gemm_out", lambda b: (_ops().grouped_gemm_out, (b.a, b.w, b.cu, b.out.bfloat16()))),
    "ggo_out_other_device": _c("grouped_gemm_out",
                               lambda b: (_ops().grouped_gemm_out, (b.a, b.w, b.cu, _other(b, b.out))), False),
    "ggo_out_transposed": _c("grouped_gemm_out", lambda b: (
        _ops().grouped_gemm_out, (b.a, b.w, b.cu, torch.empty(N, NVS, device=b.device).t()))),
    "ggo_out_strided": _c("grouped_gemm_out", lambda b: (
        _ops().grouped_gemm_out, (b.a, b.w, b.cu, torch.empty(NVS, 2 * N, device=b.device)[:, ::2]))),
    "ggo_public_api_out_half": _c("grouped_gemm_out", lambda b: (_gg_out_api, (b.a, b.w, b.cu, b.out.half()))),
    # silu_mul_weight
    "smw_gate_1d": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate[0], b.up[0], b.rw, b.cu))),
    "smw_gate_3d": _c("silu_mul_weight",
                      lambda b: (_ops().silu_mul_weight, (b.gate[None], b.up[None], b.rw, b.cu))),
    "smw_up_cols": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up[:, :N - 1], b.rw, b.cu))),
    "smw_up_rows": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up[:NVS - 1], b.rw, b.cu))),
    "smw_up_3d": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up[None], b.rw, b.cu))),
    "smw_up_bf16": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up.bfloat16(), b.rw, b.cu))),
    "smw_int32": _c("silu_mul_weight",
                    lambda b: (_ops().silu_mul_weight, (b.gate.int(), b.up.int(), b.rw, b.cu)), False),
    "smw_float64": _cuda_only("silu_mul_weight",
                              lambda b: (_ops().silu_mul_weight, (b.gate.double(), b.up.double(), None, b.cu))),
    "smw_rw_short": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up, b.rw[:NVS - 1], b.cu))),
    "smw_rw_long": _c("silu_mul_weight", lambda b: (
        _ops().silu_mul_weight, (b.gate, b.up, torch.rand(NVS + 1, device=b.device), b.cu))),
    "smw_rw_2d": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up, b.rw[:, None], b.cu))),
    "smw_rw_bf16": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up, b.rw.bfloat16(), b.cu))),
    "smw_rw_double": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up, b.rw.double(), b.cu))),
    "smw_rw_bf16_bf16_rows": _c("silu_mul_weight", lambda b: (
        _ops().silu_mul_weight, (b.gate.bfloat16(), b.up.bfloat16(), b.rw.bfloat16(), b.cu))),
    "smw_cu_int64": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up, b.rw, b.cu.long()))),
    "smw_cu_2d": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up, b.rw, b.cu[:, None]))),
    "smw_cu_empty": _c("silu_mul_weight", lambda b: (_ops().silu_mul_weight, (b.gate, b.up, b.rw, b.cu[:0]))),
    "smw_up_other_device": _c("silu_mul_weight",
                              lambda b: (_ops().silu_mul_weight, (b.gate, _other(b, b.up), b.rw, b.cu)), False),
    "smw_rw_other_device": _c("silu_mul_weight",
                              lambda b: (_ops().silu_mul_weight, (b.gate, b.up, _other(b, b.rw), b.cu)), False),
    "smw_cu_other_device": _c("silu_mul_weight",
                              lambda b: (_ops().silu_mul_weight, (b.gate, b.up, None, _other(b, b.cu))), False),
    # grouped_gemm_silu_mul (x = a [NvS, H=K], w_gate = w, w_up [G, I=N, H])
    "ggsm_x_3d": _c("grouped_gemm_silu_mul",
                    lambda b: (_ops().grouped_gemm_silu_mul, (b.a[None], b.w, b.w_up, b.rw, b.cu))),
    "ggsm_k_mismatch": _c("grouped_gemm_silu_mul",
                          lambda b: (_ops().grouped_gemm_silu_mul, (b.a[:, :K - 1], b.w, b.w_up, b.rw, b.cu))),
    "ggsm_cu_short": _c("grouped_gemm_silu_mul",
                        lambda b: (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up, b.rw, cu_tensor(b, [3, 6])))),
    "ggsm_int64": _c("grouped_gemm_silu_mul", lambda b: (
        _ops().grouped_gemm_silu_mul, (b.a.long(), b.w.long(), b.w_up.long(), b.rw, b.cu)), False),
    "ggsm_float64": _cuda_only("grouped_gemm_silu_mul", lambda b: (
        _ops().grouped_gemm_silu_mul, (b.a.double(), b.w.double(), b.w_up.double(), None, b.cu))),
    "ggsm_w_up_cols": _c("grouped_gemm_silu_mul",
                         lambda b: (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up[:, :N - 1], b.rw, b.cu))),
    "ggsm_w_up_groups": _c("grouped_gemm_silu_mul",
                           lambda b: (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up[:G - 1], b.rw, b.cu))),
    "ggsm_w_up_2d": _c("grouped_gemm_silu_mul",
                       lambda b: (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up[0], b.rw, b.cu))),
    "ggsm_w_up_bf16": _c("grouped_gemm_silu_mul",
                         lambda b: (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up.bfloat16(), b.rw, b.cu))),
    "ggsm_rw_short": _c("grouped_gemm_silu_mul",
                        lambda b: (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up, b.rw[:NVS - 1], b.cu))),
    "ggsm_rw_bf16": _c("grouped_gemm_silu_mul",
                       lambda b: (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up, b.rw.bfloat16(), b.cu))),
    "ggsm_w_up_other_device": _c("grouped_gemm_silu_mul", lambda b: (
        _ops().grouped_gemm_silu_mul, (b.a, b.w, _other(b, b.w_up), b.rw, b.cu)), False),
    "ggsm_rw_other_device": _c("grouped_gemm_silu_mul", lambda b: (
        _ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up, _other(b, b.rw), b.cu)), False),
    # grouped_gemm_silu_mul_with_gate_up: the same argument rules as grouped_gemm_silu_mul
    "ggsm_gu_k_mismatch": _c("grouped_gemm_silu_mul_with_gate_up", lambda b: (
        _ops().grouped_gemm_silu_mul_with_gate_up, (b.a[:, :K - 1], b.w, b.w_up, b.rw, b.cu))),
    "ggsm_gu_float64": _cuda_only("grouped_gemm_silu_mul_with_gate_up", lambda b: (
        _ops().grouped_gemm_silu_mul_with_gate_up, (b.a.double(), b.w.double(), b.w_up.double(), None, b.cu))),
    "ggsm_gu_w_up_groups": _c("grouped_gemm_silu_mul_with_gate_up", lambda b: (
        _ops().grouped_gemm_silu_mul_with_gate_up, (b.a, b.w, b.w_up[:G - 1], b.rw, b.cu))),
    "ggsm_gu_rw_short": _c("grouped_gemm_silu_mul_with_gate_up", lambda b: (
        _ops().grouped_gemm_silu_mul_with_gate_up, (b.a, b.w, b.w_up, b.rw[:NVS - 1], b.cu))),
    "ggsm_gu_rw_other_device": _c("grouped_gemm_silu_mul_with_gate_up", lambda b: (
        _ops().grouped_gemm_silu_mul_with_gate_up, (b.a, b.w, b.w_up, _other(b, b.rw), b.cu)), False),
    # experts / experts_out: grouped_gemm_silu_mul's rules, plus w_down [G, H, I] (H = K, I = N)
    "experts_w_up_groups": _c("experts", lambda b: (
        _ops().experts, (b.a, b.w, b.w_up[:G - 1], b.w_down, b.rw, b.cu))),
    "experts_w_down_transposed": _c("experts", lambda b: (
        _ops().experts, (b.a, b.w, b.w_up, b.w, b.rw, b.cu))),
    "experts_w_down_bf16": _c("experts", lambda b: (
        _ops().experts, (b.a, b.w, b.w_up, b.w_down.bfloat16(), b.rw, b.cu))),
    "experts_w_down_other_device": _c("experts", lambda b: (
        _ops().experts, (b.a, b.w, b.w_up, _other(b, b.w_down), b.rw, b.cu)), False),
    "experts_float64": _cuda_only("experts", lambda b: (
        _ops().experts, (b.a.double(), b.w.double(), b.w_up.double(), b.w_down.double(), None, b.cu))),
    "experts_out_cols": _c("experts_out", lambda b: (
        _ops().experts_out, (b.a, b.w, b.w_up, b.w_down, b.rw, b.cu, b.out))),
    "experts_out_transposed": _c("experts_out", lambda b: (
        _ops().experts_out, (b.a, b.w, b.w_up, b.w_down, b.rw, b.cu, torch.empty(K, NVS, device=b.device).t()))),
    "experts_out_rw_short": _c("experts_out", lambda b: (
        _ops().experts_out, (b.a, b.w, b.w_up, b.w_down, b.rw[:NVS - 1], b.cu, b.x_out))),
    # FP8 ops: 16-bit activations, e4m3fn weights with fp32 block scales
    "gg8_a_fp32": _c("grouped_gemm_fp8", lambda b: _gg8(b, a=b.a.float())),
    "gg8_w_bf16": _c("grouped_gemm_fp8", lambda b: _gg8(b, w=b.w.bfloat16())),
    "gg8_w_e5m2": _c("grouped_gemm_fp8", lambda b: _gg8(b, w=_fp8(b).w.to(torch.float8_e5m2))),
    "gg8_scale_shape": _c("grouped_gemm_fp8", lambda b: _gg8(b, w_scale=torch.ones(G, 1, 2, device=b.device))),
    "gg8_scale_bf16": _c("grouped_gemm_fp8", lambda b: _gg8(b, w_scale=_fp8(b).w_s.bfloat16())),
    "gg8_k_mismatch": _c("grouped_gemm_fp8", lambda b: _gg8(b, a=_fp8(b).x[:, :K - 1])),
    "gg8_cu_short": _c("grouped_gemm_fp8", lambda b: _gg8(b, cu_seqlens=cu_tensor(b, [3, 6]))),
    "gg8_scale_other_device": _c("grouped_gemm_fp8", lambda b: _gg8(b, w_scale=_other(b, _fp8(b).w_s)), False),
    "gg8_w_k_strided": _cuda_only("grouped_gemm_fp8", lambda b: _gg8(
        b, w=_fp8(b).w.transpose(1, 2).contiguous().transpose(1, 2))),
    "gg8_api_no_scale": _c("grouped_gemm_fp8", lambda b: (moonep_ops.grouped_gemm, (_fp8(b).x, _fp8(b).w, b.cu))),
    "gg8o_out_cols": _c("grouped_gemm_fp8_out", lambda b: _gg8_out(b, out=_fp8(b).x_out)),
    "gg8o_out_fp32": _c("grouped_gemm_fp8_out", lambda b: _gg8_out(b, out=_fp8(b).out.float())),
    "gg8o_out_other_device": _c("grouped_gemm_fp8_out", lambda b: _gg8_out(b, out=_other(b, _fp8(b).out)), False),
    "e8_x_fp32": _c("experts_fp8", lambda b: _experts8(b, x=b.a)),
    "e8_w_up_bf16": _c("experts_fp8", lambda b: _experts8(b, w_up=b.w_up.bfloat16())),
    "e8_w_down_transposed": _c("experts_fp8", lambda b: _experts8(b, w_down=_fp8(b).w, w_down_scale=_fp8(b).w_s)),
    "e8_w_up_scale_shape": _c("experts_fp8", lambda b: _experts8(b, w_up_scale=torch.ones(G, 2, 1, device=b.device))),
    "e8_rw_short": _c("experts_fp8", lambda b: _experts8(b, route_weights=b.rw[:NVS - 1])),
    "e8_w_down_other_device": _c("experts_fp8", lambda b: _experts8(b, w_down=_other(b, _fp8(b).w_down)), False),
    "e8_w_down_k_strided": _cuda_only("experts_fp8", lambda b: _experts8(
        b, w_down=_fp8(b).w_down.transpose(1, 2).contiguous().transpose(1, 2))),
    "e8o_out_cols": _c("experts_fp8_out", lambda b: _experts8_out(b, out=_fp8(b).out)),
    "e8o_rw_bf16": _c("experts_fp8_out", lambda b: _experts8_out(b, route_weights=b.rw.bfloat16())),
    # backward ops: grad [NvS, N]
    "dgrad_n_mismatch": _c("grouped_gemm_dgrad",
                           lambda b: (_ops().grouped_gemm_dgrad, (b.grad[:, :N - 1], b.w, b.cu))),
    "dgrad_w_other_device": _c("grouped_gemm_dgrad",
                               lambda b: (_ops().grouped_gemm_dgrad, (b.grad, _other(b, b.w), b.cu)), False),
    "dual_dgrad_grad_up_cols": _c("grouped_gemm_dual_dgrad", lambda b: (
        _ops().grouped_gemm_dual_dgrad, (b.grad, b.grad[:, :N - 1], b.w, b.w_up, b.cu))),
    "wgrad_rows_mismatch": _c("grouped_gemm_wgrad",
                              lambda b: (_ops().grouped_gemm_wgrad, (b.grad[:NVS - 1], b.a, b.cu))),
    "wgrad_cu_int64": _c("grouped_gemm_wgrad", lambda b: (_ops().grouped_gemm_wgrad, (b.grad, b.a, b.cu.long()))),
    "smw_backward_grad_cols": _c("silu_mul_weight_backward", lambda b: (
        _ops().silu_mul_weight_backward, (b.grad[:, :N - 1], b.gate, b.up, b.rw, b.cu))),
    "smw_backward_rw_bf16": _c("silu_mul_weight_backward", lambda b: (
        _ops().silu_mul_weight_backward, (b.grad, b.gate, b.up, b.rw.bfloat16(), b.cu))),
    "ggsm_backward_grad_cols": _c("grouped_gemm_silu_mul_backward", lambda b: (
        _ops().grouped_gemm_silu_mul_backward, (b.grad[:, :N - 1], b.a, b.w, b.w_up, b.rw, b.cu))),
    "ggsm_backward_cu_other_device": _c("grouped_gemm_silu_mul_backward", lambda b: (
        _ops().grouped_gemm_silu_mul_backward, (b.grad, b.a, b.w, b.w_up, b.rw, _other(b, b.cu))), False),
}
# Cases of ops this checkout does not define are left out (test_every_op_has_a_case checks
# the converse).
CASES = {name: case for name, case in CASES.items() if case.op in SCHEMAS}
NEUTRAL = [name for name, case in CASES.items() if case.neutral]

# Bad cu_seqlens values (CPU raises; CUDA cannot look without a sync), on every op that
# takes cu_seqlens: (name, ends).
BAD_VALUES = {
    "decreasing": [4, 2, 6],
    "negative": [-1, 2, 6],
    "past_nvs": [3, 3, NVS + 1],
    "int32_max": [3, 3, 2 ** 31 - 1],
    "int32_min": [-2 ** 31, 3, 6],
}


def value_calls(b, cu):
    """Every op with cu_seqlens ``cu``, otherwise valid arguments."""
    calls = {
        "grouped_gemm": (_ops().grouped_gemm, (b.a, b.w, cu)),
        "grouped_gemm_out": (_ops().grouped_gemm_out, (b.a, b.w, cu, b.out)),
        "silu_mul_weight": (_ops().silu_mul_weight, (b.gate, b.up, b.rw, cu)),
        "grouped_gemm_silu_mul": (_ops().grouped_gemm_silu_mul, (b.a, b.w, b.w_up, b.rw, cu)),
        "grouped_gemm_silu_mul_with_gate_up": (_ops().grouped_gemm_silu_mul_with_gate_up,
                                               (b.a, b.w, b.w_up, b.rw, cu)),
        "experts": (_ops().experts, (b.a, b.w, b.w_up, b.w_down, b.rw, cu)),
        "experts_out": (_ops().experts_out, (b.a, b.w, b.w_up, b.w_down, b.rw, cu, b.x_out)),
        "grouped_gemm_fp8": _gg8(b, cu_seqlens=cu),
        "grouped_gemm_fp8_out": _gg8_out(b, cu_seqlens=cu),
        "experts_fp8": _experts8(b, cu_seqlens=cu),
        "experts_fp8_out": _experts8_out(b, cu_seqlens=cu),
        "grouped_gemm_dgrad": (_ops().grouped_gemm_dgrad, (b.grad, b.w, cu)),
        "grouped_gemm_dual_dgrad": (_ops().grouped_gemm_dual_dgrad, (b.grad, b.grad, b.w, b.w_up, cu)),
        "grouped_gemm_wgrad": (_ops().grouped_gemm_wgrad, (b.grad, b.a, cu)),
        "silu_mul_weight_backward": (_ops().silu_mul_weight_backward, (b.grad, b.gate, b.up, b.rw, cu)),
        "grouped_gemm_silu_mul_backward": (_ops().grouped_gemm_silu_mul_backward,
                                           (b.grad, b.a, b.w, b.w_up, b.rw, cu)),
    }
    return {op: call for op, call in calls.items() if op in SCHEMAS}


def _message(fn, args, ctx=contextlib.nullcontext) -> str:
    with pytest.raises(RuntimeError) as err, ctx():
        fn(*args)
    return str(err.value)


def _fake_message(fn, args) -> str:
    """What the fake impl (torch.compile's view) raises for the same metadata."""
    mode = FakeTensorMode()
    with mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        return _message(fn, fake)


@pytest.fixture
def healthy_cuda():
    """After the test: a correct op call and a device synchronize must still work (a device-side
    assert or fault would have poisoned the context)."""
    yield
    torch.cuda.synchronize()
    b = base_tensors("cuda", torch.bfloat16)
    out = moonep_ops.grouped_gemm(b.a, b.w, b.cu)
    torch.cuda.synchronize()
    assert rel_err(out, grouped_gemm_ref(b.a, b.w, b.cu)) <= TOLERANCE[torch.bfloat16]


# --- CPU (CI): the table is right -------------------------------------------------------------

def test_every_op_has_a_case():
    covered = {case.op for case in CASES.values()}
    assert set(SCHEMAS) <= covered, f"no bad-input case for {sorted(set(SCHEMAS) - covered)}"
    assert set(SCHEMAS) <= set(value_calls(base_tensors("cpu"), cu_tensor(base_tensors("cpu"), [3, 3, 6])))


@pytest.mark.parametrize("name", list(CASES))
def test_case_is_rejected_on_cpu(name):
    """Every case raises on CPU (but the CUDA-only ones, which must pass there), and for device-
    neutral cases the fake impl raises the same message."""
    fn, args = CASES[name].args(base_tensors("cpu"))
    if CASES[name].cuda_only:
        fn(*args)  # fine on CPU
        return
    msg = _message(fn, args)
    assert msg.startswith("moonep::"), msg
    if CASES[name].neutral:
        assert _fake_message(fn, args) == msg


@pytest.mark.parametrize("bad", list(BAD_VALUES))
def test_bad_values_rejected_on_cpu(bad):
    b = base_tensors("cpu")
    for op, (fn, args) in value_calls(b, cu_tensor(b, BAD_VALUES[bad])).items():
        assert _message(fn, args).startswith(f"moonep::{op}: cu_seqlens"), op


# --- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.usefixtures("healthy_cuda")
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_bad_input_on_cuda(name):
    case = CASES[name]
    fn, args = case.args(base_tensors("cuda"))
    msg = _message(fn, args, _no_sync)
    assert msg == _fake_message(fn, args), "eager CUDA and fake impl disagree"
    if case.neutral:
        cpu_fn, cpu_args = case.args(base_tensors("cpu"))
        assert msg == _message(cpu_fn, cpu_args), "CUDA and CPU disagree"


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.usefixtures("healthy_cuda")
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_bad_values_on_cuda_no_sync_no_fault(bad):
    """No raise, no sync, no device fault: values are unspecified but memory stays in bounds."""
    b = base_tensors("cuda", torch.bfloat16)
    for op, (fn, args) in value_calls(b, cu_tensor(b, BAD_VALUES[bad])).items():
        with _no_sync():
            fn(*args)
        torch.cuda.synchronize()  # a fault or device assert would surface here


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.usefixtures("healthy_cuda")
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_bad_values_on_cuda_debug_mode_raises_cpu_error(bad, switches):
    """``MOONEP_OPS_DEBUG=1``: the data checks run (with a sync) and raise the CPU message."""
    switches(DEBUG="1")
    b, cpu = base_tensors("cuda"), base_tensors("cpu")
    cpu_calls = value_calls(cpu, cu_tensor(cpu, BAD_VALUES[bad]))
    for op, (fn, args) in value_calls(b, cu_tensor(b, BAD_VALUES[bad])).items():
        assert _message(fn, args) == _message(*cpu_calls[op]), op
