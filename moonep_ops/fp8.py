"""FP8 block-scaled weights: what the ``*_fp8`` ops compute, as plain torch functions.

Weights are ``torch.float8_e4m3fn`` with one fp32 scale per 128 x 128 block (the DeepSeek-V3 /
Kimi-K2 checkpoint format); activations are quantized by the ops themselves, per row and per
128 columns. Everything below is exact about rounding: the CPU kernels
(:mod:`moonep_ops.kernels.cpu`) implement it with these functions, and the CUDA kernels are
tested against them.

- Weight ``w [G, N, K]`` (e4m3fn), ``scale [G, ceil(N/128), ceil(K/128)]`` (fp32): its value is
  ``w[g, n, k] * scale[g, n // 128, k // 128]`` (:func:`dequantize_weight`).
  :func:`quantize_weight` makes such a pair with ``scale = amax(|block|) / 448``.
- Activation quantization (:func:`quantize_rows`), in fp32, per row ``r`` and column group ``c``
  (columns ``[128c, 128c + 128)``, the last group possibly partial):
  ``s = amax(|x[r, group]|) / 448`` and ``m = min(448 / amax, FLT_MAX)`` (true fp32 divisions,
  once per group; ``m = 0`` where ``amax == 0``), then ``q = e4m3fn(x * m)`` with
  round-to-nearest-even (one multiply per element, as DeepGEMM's row quantization; the group's
  largest element maps to 448). Returns ``q [R, K]`` e4m3fn and ``s [R, ceil(K/128)]`` fp32.
- GEMM of quantized rows against a segment's weight: ``out[r, n] = sum_kb (sum_{k in block kb}
  float(q_a[r, k]) * float(q_w[g, n, k])) * s_a[r, kb] * scale_w[g, n // 128, kb]``, accumulated
  in fp32 and rounded to the activations' dtype once.
- Experts: ``x`` quantized as above; gate and up are the fp32 results of the GEMM rule (never
  rounded); ``act = silu(gate) * up * route_weights[:, None]`` in fp32 (no factor when
  ``route_weights`` is None); ``act`` is quantized per row per 128 columns of ``I`` by the same
  rule; then the down GEMM by the GEMM rule, rounded to ``x``'s dtype.

Rows at or past ``cu_seqlens[-1]`` are never read and come out as zeros, as in every op.

Block-major weights: the ops also take a weight as ``[G, N/128, K/128, 128, 128]``, block
``(i, j)`` of group ``g`` (the block of ``scale[g, i, j]``) in ``w[g, i, j]``
(:func:`to_block_major`; N and K multiples of 128). The values and results are the same; on CUDA
each 128 x 128 block is then 16 KiB of consecutive bytes, which the GEMMs stream from DRAM faster
than 128 rows of 128 bytes (docs/fp8.md). A group's blocks stay in one contiguous ``w[g]``, so
copying experts by group works in either layout.
"""

import torch

BLOCK = 128
"""Side of a weight scale block, and the column group of activation scales."""

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "num_blocks", "scale_shape", "weight_dims", "is_block_major",
           "to_block_major", "from_block_major", "quantize_weight", "dequantize_weight", "quantize_rows"]


def _check_tensor(fn_name: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn_name}: {name} must be a Tensor, got {type(t).__name__}")


def num_blocks(size):
    """``ceil(size / BLOCK)``; works on ints and on symbolic sizes."""
    return (size + BLOCK - 1) // BLOCK


def scale_shape(weight_shape) -> tuple:
    """The scale shape ``[G, ceil(N/128), ceil(K/128)]`` of a weight ``[G, N, K]``."""
    g, n, k = weight_shape
    return (g, num_blocks(n), num_blocks(k))


def is_block_major(w: torch.Tensor) -> bool:
    """Whether ``w`` is a block-major weight ``[G, N/128, K/128, 128, 128]`` (else ``[G, N, K]``)."""
    return w.dim() == 5


def weight_dims(w: torch.Tensor) -> tuple:
    """``(G, N, K)`` of a weight in either layout (symbolic sizes too)."""
    if is_block_major(w):
        g, n_blocks, k_blocks = w.shape[:3]
        return (g, n_blocks * BLOCK, k_blocks * BLOCK)
    return tuple(w.shape)


def to_block_major(w: torch.Tensor) -> torch.Tensor:
    """``w [G, N, K]`` -> contiguous ``[G, N/128, K/128, 128, 128]`` (block ``(i, j)`` of group
    ``g`` is ``w[g, 128i:128i+128, 128j:128j+128]``); N and K must be multiples of 128."""
    _check_tensor("to_block_major", "w", w)
    if w.dim() != 3 or w.shape[1] % BLOCK or w.shape[2] % BLOCK:
        raise ValueError(f"to_block_major: w must be [G, N, K] with N and K multiples of {BLOCK}, "
                         f"got shape {list(w.shape)}")
    g, n, k = w.shape
    return w.reshape(g, n // BLOCK, BLOCK, k // BLOCK, BLOCK).transpose(2, 3).contiguous()


def from_block_major(w: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_block_major`: contiguous ``[G, N, K]``."""
    _check_tensor("from_block_major", "w", w)
    if not is_block_major(w) or w.shape[3] != BLOCK or w.shape[4] != BLOCK:
        raise ValueError(f"from_block_major: w must be [G, N/{BLOCK}, K/{BLOCK}, {BLOCK}, {BLOCK}], "
                         f"got shape {list(w.shape)}")
    g, n_blocks, k_blocks = w.shape[:3]
    return w.transpose(2, 3).reshape(g, n_blocks * BLOCK, k_blocks * BLOCK)


def _divide_or_zero(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x / s`` (IEEE fp32 division), and 0 where ``s == 0`` (an all-zero group)."""
    return torch.where(s == 0, torch.zeros((), dtype=x.dtype, device=x.device), x / s)


def _block_amax(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``amax`` of ``t`` over consecutive blocks of ``BLOCK`` along ``dim`` (the last one possibly
    partial): that dimension shrinks to ``ceil(size / BLOCK)``. No padding, so small or odd sizes
    cost no more than their elements."""
    size = t.shape[dim]
    whole = size // BLOCK * BLOCK
    parts = []
    if whole:
        parts.append(t.narrow(dim, 0, whole).unflatten(dim, (whole // BLOCK, BLOCK)).amax(dim + 1))
    if size > whole:
        parts.append(t.narrow(dim, whole, size - whole).amax(dim, keepdim=True))
    if not parts:
        return t.narrow(dim, 0, 0)
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def _block_of(size: int, device) -> torch.Tensor:
    """The block index ``i // BLOCK`` of each position ``i < size``."""
    return torch.arange(size, device=device) // BLOCK


def _weight_scale_per_element(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``scale[g, n // 128, k // 128]`` for every element of a ``[G, N, K]`` weight."""
    return scale[:, _block_of(n, scale.device)][:, :, _block_of(k, scale.device)]


def quantize_weight(w: torch.Tensor) -> tuple:
    """``w [G, N, K]`` (any float dtype) -> ``(w_fp8 [G, N, K] e4m3fn, scale [G, ceil(N/128),
    ceil(K/128)] fp32)``, both contiguous: per 128 x 128 block ``scale = amax(|block|) / 448``
    and ``w_fp8 = e4m3fn(w / scale)`` in fp32 (0 for an all-zero block)."""
    _check_tensor("quantize_weight", "w", w)
    if w.dim() != 3:
        raise ValueError(f"quantize_weight: w must be 3-D [G, N, K], got shape {list(w.shape)}")
    g, n, k = w.shape
    q = torch.empty((g, n, k), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(scale_shape(w.shape), dtype=torch.float32, device=w.device)
    for i in range(g):  # one group at a time: the fp32 copy of a whole model's experts may not fit
        w32 = w[i:i + 1].float()
        scale[i:i + 1] = _block_amax(_block_amax(w32.abs(), 2), 1) / FP8_MAX
        q[i:i + 1] = _divide_or_zero(w32, _weight_scale_per_element(scale[i:i + 1], n, k)).to(FP8_DTYPE)
    return q, scale


def dequantize_weight(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w_fp8[g, n, k] * scale[g, n // 128, k // 128]`` in fp32, ``[G, N, K]`` (``w_fp8`` in
    either layout)."""
    _check_tensor("dequantize_weight", "w_fp8", w_fp8)
    _check_tensor("dequantize_weight", "scale", scale)
    if is_block_major(w_fp8):
        w_fp8 = from_block_major(w_fp8)
    if w_fp8.dim() != 3 or tuple(scale.shape) != scale_shape(w_fp8.shape):
        raise ValueError(f"dequantize_weight: expected w [G, N, K] and scale [G, ceil(N/128), ceil(K/128)], "
                         f"got w {list(w_fp8.shape)} and scale {list(scale.shape)}")
    _, n, k = w_fp8.shape
    return w_fp8.float() * _weight_scale_per_element(scale.float(), n, k)


def quantize_rows(x: torch.Tensor) -> tuple:
    """``x [R, K]`` (any float dtype) -> ``(q [R, K] e4m3fn, s [R, ceil(K/128)] fp32)``, in fp32:
    per row and group of 128 columns ``s = amax(|group|) / 448``, ``q = e4m3fn(x * m)`` with
    ``m = min(448 / amax, FLT_MAX)`` (0 where ``amax == 0``). Every row is read: pass only the
    live rows."""
    _check_tensor("quantize_rows", "x", x)
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be 2-D [R, K], got shape {list(x.shape)}")
    x32 = x.float()
    amax = _block_amax(x32.abs(), 1)
    q = (x32 * _reciprocal_scale(amax)[:, _block_of(x.shape[1], amax.device)]).to(FP8_DTYPE)
    return q, (amax / torch.full_like(amax, FP8_MAX)).contiguous()


def _reciprocal_scale(amax: torch.Tensor) -> torch.Tensor:
    """``min(448 / amax, FLT_MAX)``, 0 where ``amax == 0`` (a group of zeros quantizes to zeros;
    the bound keeps a subnormal ``amax`` from making an infinite multiplier). Tensor by tensor:
    torch turns ``scalar / tensor`` into a reciprocal and a multiply, not one rounded division."""
    safe = torch.where(amax > 0, amax, torch.ones((), dtype=amax.dtype, device=amax.device))
    m = (torch.full_like(safe, FP8_MAX) / safe).clamp(max=torch.finfo(torch.float32).max)
    return torch.where(amax > 0, m, torch.zeros((), dtype=amax.dtype, device=amax.device))
