"""Argument checks of every op, shared by the kernels and the fake impls.

Everything here reads metadata only (shapes, dtypes, devices), so it never syncs a CUDA tensor
with the host and works on fake tensors with symbolic sizes (``torch._check`` defers a symbolic
comparison to a runtime assert instead of guarding). Messages are formatted only when a check
fails. The kernels' eager calls go through :func:`checked`, which runs a check once per static
signature (:mod:`moonep_ops.cache`). The data checks on ``cu_seqlens``
(:func:`check_cu_seqlens_values`) read the tensor: the CPU path runs them, CUDA only with
``MOONEP_OPS_DEBUG=1`` (:func:`debug_checks`). The FP8 ops' checks (the end of this module) add
e4m3fn weights with their fp32 block scales, and on CUDA a contiguous last dimension for each weight
and each scale.
"""

import torch

from . import flags, fp8
from .cache import signature

_HALF_DTYPES = (torch.bfloat16, torch.float16)
# float64 exists for gradcheck and references; the CUDA kernels stop at float32.
_CPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels accumulate and compute the activation in."""
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _fail(op_name: str, msg):
    """The message callable for ``torch._check``: ``msg`` (a str or a callable) is formatted
    only when the check fails, so passing checks cost no string formatting."""
    return lambda: f"moonep::{op_name}: {msg() if callable(msg) else msg}"


def _check(cond, message) -> None:
    """``torch._check``, with a fast exit for a plain ``True`` (the eager case); symbolic
    conditions and failures go to ``torch._check``, which raises or defers to a runtime assert."""
    if cond is True:
        return
    torch._check(cond, message)


def _check_tensors(op_name: str, **named) -> None:
    """Each of ``named`` is a Tensor (the dispatcher lets None through for a ``Tensor`` argument)."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            got = "None" if t is None else type(t).__name__
            raise RuntimeError(f"moonep::{op_name}: {name} must be a Tensor, got {got}")


def _fp8_hint(*tensors: torch.Tensor) -> str:
    """What to do instead when an FP8 weight reaches an op that is not an FP8 op."""
    dtypes = {t.dtype for t in tensors}
    if torch.float8_e5m2 in dtypes:
        return " (FP8 weights must be torch.float8_e4m3fn with block scales; torch.float8_e5m2 is not supported)"
    if torch.float8_e4m3fn in dtypes:
        return (" (FP8 weights need their block scales: moonep_ops.grouped_gemm(..., w_scale=) or "
                "moonep_ops.moonep_experts(..., w_gate_scale=, w_up_scale=, w_down_scale=))")
    return ""


def _check_dtype(op_name: str, arg: str, t: torch.Tensor) -> None:
    allowed = _CUDA_DTYPES if t.device.type == "cuda" else _CPU_DTYPES
    _check(
        t.dtype in allowed,
        _fail(op_name, lambda: f"{arg} has dtype {t.dtype}, expected one of "
              f"{', '.join(str(d) for d in allowed)} on {t.device.type}{_fp8_hint(t)}"),
    )


def _check_same_dtype(op_name: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    _check(
        t.dtype == ref.dtype,
        _fail(op_name, lambda: f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; "
              f"they must match{_fp8_hint(t, ref)}"),
    )


def _check_same_device(op_name: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is None:
            continue
        _check(
            t.device == ref.device,
            _fail(op_name, lambda: f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                  "all tensors must be on one device"),
        )


def _check_cu_seqlens_meta(op_name: str, cu_seqlens: torch.Tensor, num_groups=None,
                           w_name: str = "w") -> None:
    _check(
        cu_seqlens.dim() == 1,
        _fail(op_name, lambda: f"cu_seqlens must be 1-D [G], got shape {_shape(cu_seqlens)}"),
    )
    _check(
        cu_seqlens.dtype == torch.int32,
        _fail(op_name, lambda: f"cu_seqlens must be int32, got {cu_seqlens.dtype}"),
    )
    if num_groups is None:
        _check(
            cu_seqlens.shape[0] >= 1,
            _fail(op_name, "cu_seqlens must have at least one segment, got shape [0]"),
        )
    else:
        _check(
            cu_seqlens.shape[0] == num_groups,
            _fail(op_name, lambda: f"cu_seqlens has {cu_seqlens.shape[0]} entries but {w_name} has "
                  f"G = {num_groups} groups ({w_name}.shape[0]); they must match"),
        )


def _check_rank(op_name: str, name: str, t: torch.Tensor, layout: str) -> None:
    """``t`` has one dimension per name in ``layout`` (e.g. ``"[NvS, K]"``)."""
    dims = layout.count(",") + 1
    _check(t.dim() == dims, _fail(op_name, lambda: f"{name} must be {dims}-D {layout}, got shape {_shape(t)}"))


def _check_operands(op_name: str, ref_name: str, ref: torch.Tensor, other_name: str, other: torch.Tensor,
                    cu_seqlens: torch.Tensor, num_groups=None) -> None:
    """A GEMM's two operands: ``ref``'s dtype allowed on its device, ``other`` in the same dtype,
    all on one device, and ``cu_seqlens``'s metadata (``num_groups`` entries when given)."""
    _check_dtype(op_name, ref_name, ref)
    _check_same_dtype(op_name, other_name, other, ref_name, ref)
    _check_same_device(op_name, ref_name, ref, **{other_name: other, "cu_seqlens": cu_seqlens})
    _check_cu_seqlens_meta(op_name, cu_seqlens, num_groups, other_name)


def check_grouped_gemm(op_name: str, a: torch.Tensor, w: torch.Tensor,
                       cu_seqlens: torch.Tensor, *, a_name: str = "a", w_name: str = "w") -> None:
    """``a [NvS, K]``, ``w [G, N, K]``, ``cu_seqlens [G]``; ``a_name``/``w_name`` are the
    argument names the calling op's schema uses (errors must name what the user passed)."""
    _check_tensors(op_name, **{a_name: a, w_name: w, "cu_seqlens": cu_seqlens})
    _check_gemm_shapes(op_name, a, w, a_name, w_name)
    _check_operands(op_name, a_name, a, w_name, w, cu_seqlens, w.shape[0])


def _check_gemm_shapes(op_name: str, a: torch.Tensor, w: torch.Tensor, a_name: str, w_name: str) -> None:
    """``a [NvS, K]`` against ``w [G, N, K]``: ranks, at least one group, the same K."""
    _check_rank(op_name, a_name, a, "[NvS, K]")
    _check_rank(op_name, w_name, w, "[G, N, K]")
    _check(w.shape[0] >= 1,
           _fail(op_name, lambda: f"{w_name} must have G >= 1 groups, got shape {_shape(w)}"))
    _check(
        a.shape[1] == w.shape[2],
        _fail(op_name, lambda: f"{a_name} is [NvS, K] = {_shape(a)} and {w_name} is [G, N, K] = "
              f"{_shape(w)}: K must match (out = {a_name} @ {w_name}[g].T)"),
    )


def check_out(op_name: str, out: torch.Tensor, shape, dtype: torch.dtype,
              device: torch.device) -> None:
    _check_tensors(op_name, out=out)
    _check(
        out.dim() == len(shape) and all(o == s for o, s in zip(out.shape, shape)),
        _fail(op_name, lambda: f"out has shape {_shape(out)}, expected "
              f"[{', '.join(str(s) for s in shape)}]"),
    )
    _check(out.dtype == dtype, _fail(op_name, lambda: f"out has dtype {out.dtype}, expected {dtype}"))
    _check(out.device == device, _fail(op_name, lambda: f"out is on {out.device}, expected {device}"))
    _check(
        out.is_contiguous(),
        _fail(op_name, lambda: f"out must be contiguous, got shape {_shape(out)} with strides {list(out.stride())}"),
    )


GROUPED_GEMM_INPUTS = ("a", "w", "cu_seqlens")
EXPERTS_INPUTS = ("x", "w_gate", "w_up", "w_down", "route_weights", "cu_seqlens")


def _byte_range(t: torch.Tensor) -> tuple:
    """``[first, last)`` byte addresses that ``t``'s elements can touch (empty for no elements)."""
    start = t.data_ptr()
    extent = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return start, start
        extent += (size - 1) * stride
    return start, start + extent * t.element_size()


def check_out_overlap(op_name: str, out: torch.Tensor, names: tuple, *inputs, may_be: str = None) -> None:
    """``out`` shares no byte with any of ``inputs`` (named by ``names``; None skipped), except that
    it may be the very view of the input named ``may_be`` (same address, sizes and strides): the
    experts op reads ``x`` only in its first GEMM, and each row tile of ``x`` is read in full before
    any row of ``out`` in it is written. Any other overlap is refused: the CUDA kernels read an
    input's rows from many programs while others write ``out``. Conservative: views of one storage
    whose byte spans cross are refused even when their elements interleave without meeting.
    Addresses only, no data read: runs on every eager call (fakes have no addresses)."""
    base = out.untyped_storage().data_ptr()
    out_span = None
    for name, t in zip(names, inputs):
        if t is None or t.untyped_storage().data_ptr() != base:
            continue
        if name == may_be and _same_view(out, t):
            continue
        out_span = out_span or _byte_range(out)
        start, end = _byte_range(t)
        if start < out_span[1] and out_span[0] < end:
            allowed = f" other than {may_be} itself" if may_be else ""
            raise RuntimeError(f"moonep::{op_name}: out overlaps {name} in memory; out must not share "
                               f"memory with any input{allowed} (pass a separate buffer)")


def check_grouped_gemm_out_overlap(op_name: str, a, w, cu_seqlens, out) -> None:
    check_out_overlap(op_name, out, GROUPED_GEMM_INPUTS, a, w, cu_seqlens)


def check_experts_out_overlap(op_name: str, x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    check_out_overlap(op_name, out, EXPERTS_INPUTS, x, w_gate, w_up, w_down, route_weights, cu_seqlens, may_be="x")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def check_silu_mul_weight(op_name: str, gate: torch.Tensor, up: torch.Tensor,
                          route_weights, cu_seqlens: torch.Tensor) -> None:
    _check_tensors(op_name, gate=gate, up=up, cu_seqlens=cu_seqlens)
    _check_rank(op_name, "gate", gate, "[NvS, I]")
    _check(
        up.dim() == gate.dim() and all(u == g for u, g in zip(up.shape, gate.shape)),
        _fail(op_name, lambda: f"up has shape {_shape(up)} but gate has shape {_shape(gate)}; they must match"),
    )
    _check_dtype(op_name, "gate", gate)
    _check_same_dtype(op_name, "up", up, "gate", gate)
    _check_same_device(op_name, "gate", gate, up=up, route_weights=route_weights,
                       cu_seqlens=cu_seqlens)
    _check_route_weights(op_name, route_weights, gate, "gate")
    _check_cu_seqlens_meta(op_name, cu_seqlens)


def _check_route_weights(op_name: str, route_weights, rows: torch.Tensor, rows_name: str) -> None:
    """``route_weights`` is None or ``[NvS]`` float32 (float64 allowed with float64 rows)."""
    if route_weights is None:
        return
    _check(
        route_weights.dim() == 1 and route_weights.shape[0] == rows.shape[0],
        _fail(op_name, lambda: f"route_weights must be [NvS] = [{rows.shape[0]}] (one per row of {rows_name}), "
              f"got shape {_shape(route_weights)}"),
    )
    allowed = (torch.float32, torch.float64) if rows.dtype == torch.float64 else (torch.float32,)
    _check(
        route_weights.dtype in allowed,
        _fail(op_name, lambda: f"route_weights must be float32, got {route_weights.dtype}"),
    )


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


def check_grouped_gemm_silu_mul(op_name: str, x: torch.Tensor, w_gate: torch.Tensor,
                                w_up: torch.Tensor, route_weights, cu_seqlens: torch.Tensor) -> None:
    check_grouped_gemm(op_name, x, w_gate, cu_seqlens, a_name="x", w_name="w_gate")
    _check_tensors(op_name, w_up=w_up)
    _check(
        w_up.dim() == 3 and all(u == g for u, g in zip(w_up.shape, w_gate.shape)),
        _fail(op_name, lambda: f"w_up has shape {_shape(w_up)} but w_gate has shape {_shape(w_gate)}; "
              "they must match ([G, I, H])"),
    )
    _check_same_dtype(op_name, "w_up", w_up, "x", x)
    _check_same_device(op_name, "x", x, w_up=w_up, route_weights=route_weights)
    _check_route_weights(op_name, route_weights, x, "x")


def check_experts(op_name: str, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, route_weights, cu_seqlens: torch.Tensor) -> None:
    """The whole expert path: the fused gate/up GEMM's arguments, and ``w_down [G, H, I]``."""
    check_grouped_gemm_silu_mul(op_name, x, w_gate, w_up, route_weights, cu_seqlens)
    _check_tensors(op_name, w_down=w_down)
    expected = (w_gate.shape[0], x.shape[1], w_gate.shape[1])
    _check(
        w_down.dim() == 3 and all(d == e for d, e in zip(w_down.shape, expected)),
        _fail(op_name, lambda: f"w_down must be [G, H, I] = [{', '.join(str(e) for e in expected)}] "
              f"(G, I from w_gate, H from x), got shape {_shape(w_down)}"),
    )
    _check_same_dtype(op_name, "w_down", w_down, "x", x)
    _check_same_device(op_name, "x", x, w_down=w_down)


def check_grouped_gemm_out(op_name: str, a, w, cu_seqlens, out) -> None:
    check_grouped_gemm(op_name, a, w, cu_seqlens)
    check_out(op_name, out, (a.shape[0], w.shape[1]), a.dtype, a.device)


def check_experts_out(op_name: str, x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    check_experts(op_name, x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    check_out(op_name, out, tuple(x.shape), x.dtype, x.device)


def _check_same_shape_dtype(op_name: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    _check(
        t.dim() == ref.dim() and all(a == b for a, b in zip(t.shape, ref.shape)),
        _fail(op_name, lambda: f"{name} has shape {_shape(t)} but {ref_name} has shape {_shape(ref)}; "
              "they must match"),
    )
    _check_same_dtype(op_name, name, t, ref_name, ref)


def check_grouped_gemm_dgrad(op_name: str, grad_out: torch.Tensor, w: torch.Tensor,
                             cu_seqlens: torch.Tensor) -> None:
    """``grad_out [NvS, N]``, ``w [G, N, K]``, ``cu_seqlens [G]``."""
    _check_tensors(op_name, grad_out=grad_out, w=w, cu_seqlens=cu_seqlens)
    _check_rank(op_name, "grad_out", grad_out, "[NvS, N]")
    _check_rank(op_name, "w", w, "[G, N, K]")
    _check(w.shape[0] >= 1, _fail(op_name, lambda: f"w must have G >= 1 groups, got shape {_shape(w)}"))
    _check(
        grad_out.shape[1] == w.shape[1],
        _fail(op_name, lambda: f"grad_out is [NvS, N] = {_shape(grad_out)} and w is [G, N, K] = {_shape(w)}: "
              "N must match (grad_a = grad_out @ w[g])"),
    )
    _check_operands(op_name, "grad_out", grad_out, "w", w, cu_seqlens, w.shape[0])


def check_grouped_gemm_dual_dgrad(op_name: str, grad_gate: torch.Tensor, grad_up: torch.Tensor,
                                  w_gate: torch.Tensor, w_up: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """``grad_gate``, ``grad_up [NvS, I]``; ``w_gate``, ``w_up [G, I, H]``; ``cu_seqlens [G]``."""
    _check_tensors(op_name, grad_gate=grad_gate, grad_up=grad_up, w_gate=w_gate, w_up=w_up, cu_seqlens=cu_seqlens)
    check_grouped_gemm_dgrad(op_name, grad_gate, w_gate, cu_seqlens)
    _check_same_shape_dtype(op_name, "grad_up", grad_up, "grad_gate", grad_gate)
    _check_same_shape_dtype(op_name, "w_up", w_up, "w_gate", w_gate)
    _check_same_device(op_name, "grad_gate", grad_gate, grad_up=grad_up, w_up=w_up)


def check_grouped_gemm_wgrad(op_name: str, grad_out: torch.Tensor, a: torch.Tensor,
                             cu_seqlens: torch.Tensor) -> None:
    """``grad_out [NvS, N]``, ``a [NvS, K]``, ``cu_seqlens [G]`` (G is taken from cu_seqlens)."""
    _check_tensors(op_name, grad_out=grad_out, a=a, cu_seqlens=cu_seqlens)
    _check_rank(op_name, "grad_out", grad_out, "[NvS, N]")
    _check_rank(op_name, "a", a, "[NvS, K]")
    _check(
        grad_out.shape[0] == a.shape[0],
        _fail(op_name, lambda: f"grad_out is [NvS, N] = {_shape(grad_out)} and a is [NvS, K] = {_shape(a)}: "
              "NvS must match (grad_w[g] = grad_out[seg].T @ a[seg])"),
    )
    _check_operands(op_name, "grad_out", grad_out, "a", a, cu_seqlens)


def check_silu_mul_weight_backward(op_name: str, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                                   route_weights, cu_seqlens: torch.Tensor) -> None:
    _check_tensors(op_name, grad=grad)
    check_silu_mul_weight(op_name, gate, up, route_weights, cu_seqlens)
    _check_same_shape_dtype(op_name, "grad", grad, "gate", gate)
    _check_same_device(op_name, "gate", gate, grad=grad)


def check_grouped_gemm_silu_mul_backward(op_name: str, grad: torch.Tensor, x: torch.Tensor,
                                         w_gate: torch.Tensor, w_up: torch.Tensor, route_weights,
                                         cu_seqlens: torch.Tensor) -> None:
    _check_tensors(op_name, grad=grad)
    check_grouped_gemm_silu_mul(op_name, x, w_gate, w_up, route_weights, cu_seqlens)
    expected = (x.shape[0], w_gate.shape[1])
    _check(
        grad.dim() == 2 and grad.shape[0] == expected[0] and grad.shape[1] == expected[1],
        _fail(op_name, lambda: f"grad has shape {_shape(grad)}, expected [NvS, I] = "
              f"[{expected[0]}, {expected[1]}] (the forward output's shape)"),
    )
    _check_same_dtype(op_name, "grad", grad, "x", x)
    _check_same_device(op_name, "x", x, grad=grad)


def grad_route_weights_dtype(dtype: torch.dtype) -> torch.dtype:
    """``d route_weights`` is returned in the accumulation dtype: fp32, fp64 for fp64 rows."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_PASSED: set = set()


def checked(check, op_name: str, *args) -> tuple:
    """``check(op_name, *args)`` once per static signature of ``args`` (tensors or None; eager
    calls only: symbolic sizes are not hashable, so fakes call the checks directly). Returns that
    signature: launch plans of the same call key on it instead of computing their own. A tensor
    without storage (a ``torch.func`` transform's wrapper, reaching the public API) has no data
    pointer for a signature: it is checked every call, and None returned."""
    try:
        key = (check, op_name, signature(*args))
    except RuntimeError:
        check(op_name, *args)
        return None
    if key not in _PASSED:
        check(op_name, *args)
        _PASSED.add(key)
    return key


def debug_checks(op_name: str, cu_seqlens: torch.Tensor, num_rows: int) -> None:
    """The data checks on CUDA, when ``MOONEP_OPS_DEBUG=1`` asks for them (they sync the host)."""
    if flags.debug_checks():
        check_cu_seqlens_values(op_name, cu_seqlens, num_rows)


# FP8 block-scaled ops -------------------------------------------------------------------------

_FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
_FP8_ACTIVATION_DTYPES = _HALF_DTYPES
FP8_GEMM_INPUTS = ("a", "w", "w_scale", "cu_seqlens")
EXPERTS_FP8_INPUTS = ("x", "w_gate", "w_gate_scale", "w_up", "w_up_scale", "w_down", "w_down_scale",
                      "route_weights", "cu_seqlens")


def _check_fp8_activations(op_name: str, name: str, t: torch.Tensor) -> None:
    _check(
        t.dtype in _FP8_ACTIVATION_DTYPES,
        _fail(op_name, lambda: f"{name} has dtype {t.dtype}, expected torch.bfloat16 or torch.float16 "
              "(the FP8 ops quantize 16-bit activations themselves)"),
    )


def _check_fp8_weight_dtype(op_name: str, name: str, w: torch.Tensor) -> None:
    if w.dtype == torch.float8_e5m2:
        raise RuntimeError(f"moonep::{op_name}: {name} has dtype torch.float8_e5m2; the supported FP8 "
                           "format is torch.float8_e4m3fn (per 128 x 128 block scaled)")
    _check(
        w.dtype == _FP8_WEIGHT_DTYPE,
        _fail(op_name, lambda: f"{name} has dtype {w.dtype}, expected torch.float8_e4m3fn "
              "(the FP8 ops take e4m3fn weights only)"),
    )


_BLOCK_MAJOR = f"[G, N/{fp8.BLOCK}, K/{fp8.BLOCK}, {fp8.BLOCK}, {fp8.BLOCK}]"


def _fp8_weight_desc(w: torch.Tensor) -> str:
    """``w``'s layout and shape, with its ``[G, N, K]`` when it is block-major."""
    if fp8.is_block_major(w):
        return f"block-major {_BLOCK_MAJOR} = {_shape(w)} ([G, N, K] = {list(fp8.weight_dims(w))})"
    return f"[G, N, K] = {_shape(w)}"


def _block_major_dims(w: torch.Tensor) -> str:
    return f" (block-major: [G, N, K] = {list(fp8.weight_dims(w))})" if fp8.is_block_major(w) else ""


def _check_fp8_weight_shape(op_name: str, w_name: str, w: torch.Tensor) -> None:
    """``w [G, N, K]``, or block-major ``[G, N/128, K/128, 128, 128]``; G >= 1."""
    _check(
        w.dim() == 3 or (w.dim() == 5 and w.shape[3] == fp8.BLOCK and w.shape[4] == fp8.BLOCK),
        _fail(op_name, lambda: f"{w_name} must be 3-D [G, N, K] or block-major 5-D {_BLOCK_MAJOR}, "
              f"got shape {_shape(w)}"),
    )
    _check(w.shape[0] >= 1, _fail(op_name, lambda: f"{w_name} must have G >= 1 groups, got shape {_shape(w)}"))


def _check_fp8_gemm_shapes(op_name: str, a: torch.Tensor, w: torch.Tensor, a_name: str, w_name: str) -> None:
    """``a [NvS, K]`` against an FP8 weight in either layout: ranks, at least one group, the same K."""
    _check_rank(op_name, a_name, a, "[NvS, K]")
    _check_fp8_weight_shape(op_name, w_name, w)
    _check(
        a.shape[1] == fp8.weight_dims(w)[2],
        _fail(op_name, lambda: f"{a_name} is [NvS, K] = {_shape(a)} and {w_name} is {_fp8_weight_desc(w)}: K must "
              f"match (out = {a_name} @ {w_name}[g].T)"),
    )


def _check_fp8_scale(op_name: str, scale_name: str, scale: torch.Tensor, w_name: str, w: torch.Tensor) -> None:
    """``scale`` is fp32 ``[G, ceil(N/128), ceil(K/128)]`` for ``w [G, N, K]`` (either layout)."""
    expected = fp8.scale_shape(fp8.weight_dims(w))
    _check(
        scale.dim() == 3 and all(s == e for s, e in zip(scale.shape, expected)),
        _fail(op_name, lambda: f"{scale_name} has shape {_shape(scale)}, expected [G, ceil(N/128), ceil(K/128)] = "
              f"[{', '.join(str(e) for e in expected)}] for {w_name} of shape {_shape(w)}{_block_major_dims(w)}"),
    )
    _check(
        scale.dtype == torch.float32,
        _fail(op_name, lambda: f"{scale_name} has dtype {scale.dtype}, expected torch.float32"),
    )


def _check_fp8_cuda_layout(op_name: str, w_name: str, w: torch.Tensor, scale_name: str, scale: torch.Tensor) -> None:
    """CUDA kernels load weight rows along K and each scale row's K blocks as consecutive floats (a
    scale may be a view, e.g. of a buffer whose groups are padded); the CPU kernels take any strides."""
    if w.device.type != "cuda":
        return
    _check(
        w.shape[-1] <= 1 or w.stride(-1) == 1,
        _fail(op_name, lambda: f"{w_name} must have its K dimension contiguous on CUDA ({w_name}.stride(-1) == 1), "
              f"got shape {_shape(w)} with strides {list(w.stride())}"),
    )
    _check(
        scale.shape[2] <= 1 or scale.stride(2) == 1,
        _fail(op_name, lambda: f"{scale_name} must have its last dimension contiguous on CUDA "
              f"({scale_name}.stride(-1) == 1), got shape {_shape(scale)} with strides {list(scale.stride())}"),
    )


def _check_fp8_weight(op_name: str, w_name: str, w: torch.Tensor, scale_name: str, scale: torch.Tensor,
                      ref_name: str, ref: torch.Tensor) -> None:
    """An FP8 weight (shape checked by the caller) and its scale, on ``ref``'s device."""
    _check_fp8_weight_dtype(op_name, w_name, w)
    _check_same_device(op_name, ref_name, ref, **{w_name: w, scale_name: scale})
    _check_fp8_scale(op_name, scale_name, scale, w_name, w)
    _check_fp8_cuda_layout(op_name, w_name, w, scale_name, scale)


def check_grouped_gemm_fp8(op_name: str, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                           cu_seqlens: torch.Tensor, *, a_name: str = "a", w_name: str = "w",
                           scale_name: str = "w_scale") -> None:
    """``a [NvS, K]`` bf16/fp16, ``w [G, N, K]`` (or block-major) e4m3fn, ``w_scale [G,
    ceil(N/128), ceil(K/128)]`` fp32, ``cu_seqlens [G]`` int32."""
    _check_tensors(op_name, **{a_name: a, w_name: w, scale_name: w_scale, "cu_seqlens": cu_seqlens})
    _check_fp8_gemm_shapes(op_name, a, w, a_name, w_name)
    _check_fp8_activations(op_name, a_name, a)
    _check_fp8_weight(op_name, w_name, w, scale_name, w_scale, a_name, a)
    _check_same_device(op_name, a_name, a, cu_seqlens=cu_seqlens)
    _check_cu_seqlens_meta(op_name, cu_seqlens, w.shape[0], w_name)


def check_experts_fp8(op_name: str, x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale,
                      route_weights, cu_seqlens) -> None:
    """The bf16 experts op's shape rules (``w_gate``, ``w_up [G, I, H]``, ``w_down [G, H, I]``) with
    e4m3fn weights, each with its fp32 block scales, and bf16/fp16 ``x``."""
    _check_tensors(op_name, x=x, w_gate=w_gate, w_gate_scale=w_gate_scale, w_up=w_up, w_up_scale=w_up_scale,
                   w_down=w_down, w_down_scale=w_down_scale, cu_seqlens=cu_seqlens)
    check_grouped_gemm_fp8(op_name, x, w_gate, w_gate_scale, cu_seqlens, a_name="x", w_name="w_gate",
                           scale_name="w_gate_scale")
    _check(
        w_up.dim() == w_gate.dim() and all(u == g for u, g in zip(w_up.shape, w_gate.shape)),
        _fail(op_name, lambda: f"w_up has shape {_shape(w_up)} but w_gate has shape {_shape(w_gate)}; "
              "they must match ([G, I, H], or both block-major)"),
    )
    _check_fp8_weight(op_name, "w_up", w_up, "w_up_scale", w_up_scale, "x", x)
    g, inter, hidden = fp8.weight_dims(w_gate)
    if fp8.is_block_major(w_gate):  # the three weights in one layout
        layout = f"block-major [G, H/{fp8.BLOCK}, I/{fp8.BLOCK}, {fp8.BLOCK}, {fp8.BLOCK}]"
        expected = (g, x.shape[1] // fp8.BLOCK, inter // fp8.BLOCK, fp8.BLOCK, fp8.BLOCK)
    else:
        layout, expected = "[G, H, I]", (g, x.shape[1], inter)
    _check(
        w_down.dim() == len(expected) and all(d == e for d, e in zip(w_down.shape, expected)),
        _fail(op_name, lambda: f"w_down must be {layout} = [{', '.join(str(e) for e in expected)}] "
              f"(G, I and the layout from w_gate, H from x), got shape {_shape(w_down)}"),
    )
    _check_fp8_weight(op_name, "w_down", w_down, "w_down_scale", w_down_scale, "x", x)
    _check_same_device(op_name, "x", x, route_weights=route_weights)
    _check_route_weights(op_name, route_weights, x, "x")


def check_grouped_gemm_fp8_out(op_name: str, a, w, w_scale, cu_seqlens, out) -> None:
    check_grouped_gemm_fp8(op_name, a, w, w_scale, cu_seqlens)
    check_out(op_name, out, (a.shape[0], fp8.weight_dims(w)[1]), a.dtype, a.device)


def check_experts_fp8_out(op_name: str, x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale,
                          route_weights, cu_seqlens, out) -> None:
    check_experts_fp8(op_name, x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale,
                      route_weights, cu_seqlens)
    check_out(op_name, out, tuple(x.shape), x.dtype, x.device)


def check_grouped_gemm_fp8_out_overlap(op_name: str, a, w, w_scale, cu_seqlens, out) -> None:
    check_out_overlap(op_name, out, FP8_GEMM_INPUTS, a, w, w_scale, cu_seqlens)


def check_experts_fp8_out_overlap(op_name: str, x, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale,
                                  route_weights, cu_seqlens, out) -> None:
    # out may be x itself, as for the bf16 experts op: only the first GEMM (with its
    # quantization of x) reads x, and each row tile of x is read before out's rows in it are written.
    check_out_overlap(op_name, out, EXPERTS_FP8_INPUTS, x, w_gate, w_gate_scale, w_up, w_up_scale, w_down,
                      w_down_scale, route_weights, cu_seqlens, may_be="x")


def check_fp8_weights_and_scales(op_name: str, weights: tuple, scales: tuple) -> None:
    """What the public API checks before it calls an FP8 op: every weight FP8 or none, and a scale
    exactly for each FP8 weight. ``weights`` and ``scales`` are ``(name, value)`` pairs in the same
    order. Non-tensor weights are left to the op's own check (it names them)."""
    tensors = [(name, w) for name, w in weights if isinstance(w, torch.Tensor)]
    fp8_names = [name for name, w in tensors if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if fp8_names and len(fp8_names) < len(tensors):
        described = ", ".join(f"{name} {w.dtype}" for name, w in tensors)
        raise RuntimeError(f"moonep::{op_name}: weights must be all torch.float8_e4m3fn (with block scales) "
                           f"or none, got {described}")
    for (w_name, w), (scale_name, scale) in zip(weights, scales):
        if not isinstance(w, torch.Tensor):
            continue
        if w_name in fp8_names and scale is None:
            raise RuntimeError(f"moonep::{op_name}: {w_name} is {w.dtype} but {scale_name} is None; FP8 weights "
                               f"need their fp32 block scales [G, ceil(N/128), ceil(K/128)] ({scale_name}=)")
        if w_name not in fp8_names and scale is not None:
            raise RuntimeError(f"moonep::{op_name}: {scale_name} is given but {w_name} has dtype {w.dtype}; "
                               "block scales go with torch.float8_e4m3fn weights only")
