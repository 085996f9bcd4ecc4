"""MoonEP's ``[E+B]`` expert layout for FP8 block-quantized weights, in plain torch (never imports vLLM).

vLLM 0.33's MoonEP path builds a ``[E+B]`` layout for BF16 weights only
(``prepare_finalize/moonep.py: make_moonep_weight_layout``): rows ``[0, E)`` hold every expert
in global order (replicated on every rank), rows ``[E, E+B)`` are the prefetch slots that
``Buffer.prefetch_weight`` fills with the step's hot experts. :class:`MoonEPFp8WeightLayout`
is the same for checkpoints in the DeepSeek-V3 format (``float8_e4m3fn`` weights, one fp32
``weight_scale_inv`` per 128 x 128 block, the dequantization multiplier despite the name), plus
the scales, which must move with their weights:

- weights: gate/up ``[E+B, I, H]`` and down ``[E+B, H, I]`` e4m3fn, each expert's bytes
  contiguous and block-major (:func:`moonep_ops.fp8.to_block_major`: ``[E+B, N/128, K/128, 128,
  128]``, the layout the ops stream fastest; docs/fp8.md). An expert's blocks stay in its own
  contiguous bytes, so a copy of an expert's ``[N, K]`` bytes copies its blocks. MoonEP copies
  them as bytes: its ``prefetch_weight`` takes bf16 or uint8 (the forks' ``_ELEM_TYPES`` have no
  float8), so it gets :attr:`~MoonEPFp8WeightLayout.prefetch_weights`, ``[E+B, N, K]`` uint8
  views of the same memory (the shapes vLLM's ``[E+B]`` layout has; :meth:`rows_view` gives the
  layer's e4m3 parameters the same shapes).
- scales: MoonEP copies each expert's scale bytes as 128-row tiles (``retile_for_prefetch``
  asserts that an expert's scale bytes are a multiple of 128 x 128 = 16384), and an expert's
  block scales are far smaller (Qwen3-30B-A3B's gate: 6 x 16 x 4 = 384 bytes). So each
  projection's scales live in a contiguous ``[E+B, P]`` fp32 storage whose rows are padded to
  16 KiB (:attr:`~MoonEPFp8WeightLayout.prefetch_scales`, what ``prefetch_weight`` copies), and
  the experts read ``[E+B, ceil(N/128), ceil(K/128)]`` views of its first ``nN * nK`` columns
  (:attr:`~MoonEPFp8WeightLayout.full_gate_scale` ...), which see every prefetch.

The first four fields are those of vLLM's ``MoonEPExpertWeightLayout`` in the same order, so
``layout[:3]`` and ``layout.num_prefetch_slots`` mean the same for both.
"""

from typing import NamedTuple

import torch

from ..fp8 import BLOCK, FP8_DTYPE, num_blocks, to_block_major, weight_dims

#: Bytes per expert that MoonEP's scale prefetch copies in one tile (``retile_for_prefetch``:
#: an expert's scale bytes must be a multiple of ``M_BLOCK * N_BLOCK = 128 * 128``).
SCALE_TILE_BYTES = 128 * 128


class MoonEPFp8WeightLayout(NamedTuple):
    """FP8 expert weights and their block scales in MoonEP's ``[E+B, ...]`` layout."""

    full_gate_weight: torch.Tensor  # [E+B, I/128, H/128, 128, 128] e4m3fn, block-major
    full_up_weight: torch.Tensor  # [E+B, I/128, H/128, 128, 128] e4m3fn, block-major
    full_down_weight: torch.Tensor  # [E+B, H/128, I/128, 128, 128] e4m3fn, block-major
    num_prefetch_slots: int
    full_gate_scale: torch.Tensor  # [E+B, I/128, H/128] fp32, a view into prefetch_scales[0]
    full_up_scale: torch.Tensor  # [E+B, I/128, H/128] fp32
    full_down_scale: torch.Tensor  # [E+B, H/128, I/128] fp32
    prefetch_weights: tuple  # the three weights as [E+B, N, K] uint8 views: what prefetch_weight copies
    prefetch_scales: tuple  # three contiguous [E+B, P] fp32 storages, rows padded to 16 KiB

    @property
    def num_experts(self) -> int:
        return self.full_gate_weight.shape[0] - self.num_prefetch_slots

    @staticmethod
    def rows_view(weight: torch.Tensor) -> torch.Tensor:
        """A block-major weight as the ``[E+B, N, K]`` tensor vLLM's MoE code expects of the
        layer's parameters (its sizes; the bytes stay block-major)."""
        return weight.view(weight_dims(weight))


def scale_row_elems(scale_shape) -> int:
    """fp32 elements per expert row of a scale storage: ``nN * nK`` rounded up to 16 KiB."""
    nbytes = scale_shape[-2] * scale_shape[-1] * 4
    return -(-nbytes // SCALE_TILE_BYTES) * SCALE_TILE_BYTES // 4


def _scale_storage(scale: torch.Tensor, num_prefetch_slots: int):
    """``(storage [E+B, P] fp32 contiguous, view [E+B, nN, nK])`` with rows ``[0, E)`` = ``scale``
    and the slot rows 1.0 (a finite placeholder: nothing reads a slot before a prefetch fills it)."""
    e, nn, nk = scale.shape
    storage = torch.ones(e + num_prefetch_slots, scale_row_elems(scale.shape), dtype=torch.float32,
                         device=scale.device)
    view = storage[:, :nn * nk].unflatten(1, (nn, nk))
    view[:e].copy_(scale)
    return storage, view


def make_fp8_weight_layout(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                           w2_scale: torch.Tensor, num_prefetch_slots: int) -> MoonEPFp8WeightLayout:
    """The ``[E+B]`` layout from vLLM's loaded FP8 expert tensors, in global expert order.

    ``w13 [E, 2I, H]`` holds the gate rows (checkpoint ``w1``) first, then up (``w3``);
    ``w13_scale [E, 2*I/128, H/128]`` is split the same way (vLLM's loader narrows block scales
    like the weights: ``routed_experts.py: _load_w13``). ``w2 [E, H, I]``, ``w2_scale
    [E, H/128, I/128]``. H and I must be multiples of 128 (MoonEP's prefetch tiles them by 128,
    and a gate/up split inside a scale block would be ambiguous).
    """
    if num_prefetch_slots <= 0:
        raise ValueError(f"num_prefetch_slots must be positive, got {num_prefetch_slots}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"MoonEP FP8 layout: {name} must be torch.float8_e4m3fn, got {t.dtype}")
    for name, t in (("w13_weight_scale_inv", w13_scale), ("w2_weight_scale_inv", w2_scale)):
        if t.dtype != torch.float32:
            raise TypeError(f"MoonEP FP8 layout: {name} must be fp32 block scales, got {t.dtype}")
    e, two_i, h = w13.shape
    i = two_i // 2
    if two_i % 2 or h % BLOCK or i % BLOCK:
        raise ValueError(f"MoonEP FP8 layout: hidden size and intermediate size must be multiples of "
                         f"{BLOCK}; got w13 {tuple(w13.shape)}")
    expected = {"w2": ((e, h, i), tuple(w2.shape)),
                "w13_weight_scale_inv": ((e, 2 * num_blocks(i), num_blocks(h)), tuple(w13_scale.shape)),
                "w2_weight_scale_inv": ((e, num_blocks(h), num_blocks(i)), tuple(w2_scale.shape))}
    for name, (want, got) in expected.items():
        if want != got:
            raise ValueError(f"MoonEP FP8 layout: {name} has shape {got}, expected {want} for "
                             f"w13 {tuple(w13.shape)}")
    rows = e + num_prefetch_slots

    def weight(src):
        n, k = src.shape[1:]
        full = torch.zeros((rows, n // BLOCK, k // BLOCK, BLOCK, BLOCK), dtype=FP8_DTYPE, device=src.device)
        for expert in range(e):  # one expert's copy at a time: no second copy of the whole tensor
            full[expert] = to_block_major(src[expert:expert + 1])[0]
        return full

    gate, up, down = weight(w13[:, :i]), weight(w13[:, i:]), weight(w2)
    ni = num_blocks(i)
    gate_store, gate_scale = _scale_storage(w13_scale[:, :ni], num_prefetch_slots)
    up_store, up_scale = _scale_storage(w13_scale[:, ni:], num_prefetch_slots)
    down_store, down_scale = _scale_storage(w2_scale, num_prefetch_slots)
    return MoonEPFp8WeightLayout(
        full_gate_weight=gate, full_up_weight=up, full_down_weight=down,
        num_prefetch_slots=num_prefetch_slots,
        full_gate_scale=gate_scale, full_up_scale=up_scale, full_down_scale=down_scale,
        prefetch_weights=tuple(MoonEPFp8WeightLayout.rows_view(w).view(torch.uint8) for w in (gate, up, down)),
        prefetch_scales=(gate_store, up_store, down_store))
