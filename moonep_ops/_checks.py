"""Argument checks shared by every kernel and by the fake impls.

Everything here reads metadata only (shapes, dtypes, devices), so it never syncs a CUDA
tensor with the host and works on fake tensors with symbolic sizes (``torch._check``
defers a symbolic comparison to a runtime assert instead of guarding). The data checks
on ``cu_seqlens`` (:func:`check_cu_seqlens_values`) read the tensor and are for the
CPU path, or for CUDA when ``MOONEP_OPS_DEBUG=1``.
"""

import os

import torch

_HALF_DTYPES = (torch.bfloat16, torch.float16)
# float64 exists for gradcheck and references; the CUDA kernels stop at float32.
_CPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def debug_checks_enabled() -> bool:
    """``MOONEP_OPS_DEBUG=1`` adds the data checks (which sync) on CUDA."""
    return os.environ.get("MOONEP_OPS_DEBUG", "0") not in ("", "0")


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels accumulate and compute the activation in."""
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _fail(op_name: str, msg: str):
    return lambda: f"moonep::{op_name}: {msg}"


def _check_dtype(op_name: str, arg: str, t: torch.Tensor) -> None:
    allowed = _CUDA_DTYPES if t.device.type == "cuda" else _CPU_DTYPES
    torch._check(
        t.dtype in allowed,
        _fail(op_name, f"{arg} has dtype {t.dtype}, expected one of "
              f"{', '.join(str(d) for d in allowed)} on {t.device.type}"),
    )


def _check_same_device(op_name: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is None:
            continue
        torch._check(
            t.device == ref.device,
            _fail(op_name, f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                  "all tensors must be on one device"),
        )


def _check_cu_seqlens_meta(op_name: str, cu_seqlens: torch.Tensor, num_groups=None) -> None:
    torch._check(
        cu_seqlens.dim() == 1,
        _fail(op_name, f"cu_seqlens must be 1-D [G], got shape {_shape(cu_seqlens)}"),
    )
    torch._check(
        cu_seqlens.dtype == torch.int32,
        _fail(op_name, f"cu_seqlens must be int32, got {cu_seqlens.dtype}"),
    )
    if num_groups is None:
        torch._check(
            cu_seqlens.shape[0] >= 1,
            _fail(op_name, "cu_seqlens must have at least one segment, got shape [0]"),
        )
    else:
        torch._check(
            cu_seqlens.shape[0] == num_groups,
            _fail(op_name, f"cu_seqlens has {cu_seqlens.shape[0]} entries but w has "
                  f"G = {num_groups} groups (w.shape[0]); they must match"),
        )


def check_grouped_gemm(op_name: str, a: torch.Tensor, w: torch.Tensor,
                       cu_seqlens: torch.Tensor) -> None:
    torch._check(a.dim() == 2, _fail(op_name, f"a must be 2-D [NvS, K], got shape {_shape(a)}"))
    torch._check(w.dim() == 3, _fail(op_name, f"w must be 3-D [G, N, K], got shape {_shape(w)}"))
    torch._check(w.shape[0] >= 1, _fail(op_name, f"w must have G >= 1 groups, got shape {_shape(w)}"))
    torch._check(
        a.shape[1] == w.shape[2],
        _fail(op_name, f"a is [NvS, K] = {_shape(a)} and w is [G, N, K] = {_shape(w)}: "
              "K must match (out = a @ w[g].T)"),
    )
    _check_dtype(op_name, "a", a)
    torch._check(
        w.dtype == a.dtype,
        _fail(op_name, f"w has dtype {w.dtype} but a has dtype {a.dtype}; they must match"),
    )
    _check_same_device(op_name, "a", a, w=w, cu_seqlens=cu_seqlens)
    _check_cu_seqlens_meta(op_name, cu_seqlens, w.shape[0])


def check_out(op_name: str, out: torch.Tensor, shape, dtype: torch.dtype,
              device: torch.device) -> None:
    expected = "[" + ", ".join(str(s) for s in shape) + "]"
    torch._check(
        out.dim() == len(shape) and all(o == s for o, s in zip(out.shape, shape)),
        _fail(op_name, f"out has shape {_shape(out)}, expected {expected}"),
    )
    torch._check(out.dtype == dtype, _fail(op_name, f"out has dtype {out.dtype}, expected {dtype}"))
    torch._check(out.device == device, _fail(op_name, f"out is on {out.device}, expected {device}"))
    torch._check(
        out.is_contiguous(),
        _fail(op_name, f"out must be contiguous, got shape {_shape(out)} with strides {list(out.stride())}"),
    )


def check_silu_mul_weight(op_name: str, gate: torch.Tensor, up: torch.Tensor,
                          route_weights, cu_seqlens: torch.Tensor) -> None:
    torch._check(gate.dim() == 2, _fail(op_name, f"gate must be 2-D [NvS, I], got shape {_shape(gate)}"))
    torch._check(
        up.dim() == gate.dim() and all(u == g for u, g in zip(up.shape, gate.shape)),
        _fail(op_name, f"up has shape {_shape(up)} but gate has shape {_shape(gate)}; they must match"),
    )
    _check_dtype(op_name, "gate", gate)
    torch._check(
        up.dtype == gate.dtype,
        _fail(op_name, f"up has dtype {up.dtype} but gate has dtype {gate.dtype}; they must match"),
    )
    _check_same_device(op_name, "gate", gate, up=up, route_weights=route_weights,
                       cu_seqlens=cu_seqlens)
    if route_weights is not None:
        torch._check(
            route_weights.dim() == 1 and route_weights.shape[0] == gate.shape[0],
            _fail(op_name, f"route_weights must be [NvS] = [{gate.shape[0]}] (one per row of gate), "
                  f"got shape {_shape(route_weights)}"),
        )
        allowed = (torch.float32, torch.float64) if gate.dtype == torch.float64 else (torch.float32,)
        torch._check(
            route_weights.dtype in allowed,
            _fail(op_name, f"route_weights must be float32, got {route_weights.dtype}"),
        )
    _check_cu_seqlens_meta(op_name, cu_seqlens)


def check_cu_seqlens_values(op_name: str, cu_seqlens: torch.Tensor, num_rows: int) -> None:
    """Data checks: non-negative, non-decreasing, last end <= NvS. Reads the tensor (syncs on CUDA)."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if cu.numel() == 0:
        return
    if bool((cu < 0).any()):
        g = int(torch.nonzero(cu < 0)[0])
        raise RuntimeError(f"moonep::{op_name}: cu_seqlens must be non-negative, "
                           f"got cu_seqlens[{g}] = {int(cu[g])}")
    if cu.numel() > 1:
        drops = cu[1:] < cu[:-1]
        if bool(drops.any()):
            g = int(torch.nonzero(drops)[0]) + 1
            raise RuntimeError(f"moonep::{op_name}: cu_seqlens must be non-decreasing, "
                               f"got cu_seqlens[{g - 1}] = {int(cu[g - 1])} > cu_seqlens[{g}] = {int(cu[g])}")
    last = int(cu[-1])
    if last > num_rows:
        raise RuntimeError(f"moonep::{op_name}: cu_seqlens[-1] = {last} exceeds NvS = {num_rows} "
                           "(the number of rows)")
