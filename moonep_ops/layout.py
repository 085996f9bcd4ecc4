"""A single-device stand-in for MoonEP's dispatch and combine (tests, benchmarks, vLLM glue).

MoonEP itself needs several GPUs with NVLink multicast. :func:`dispatch` produces, on one device,
exactly the layout MoonEP hands the experts (see ``CONTRACT.md``)::

    x_nvs          [NvS, H]  rows grouped by weight row, each non-empty segment padded with zero
                             rows to a multiple of ``token_padding``; rows past cu_seqlens[-1] undefined
    route_weights  [NvS]     fp32 router weight of each row (0 on padding rows)
    cu_seqlens     [G]       int32 cumulative segment ends, no leading zero; empty segments repeat
                             the previous end; G = E + B (B prefetch slots mirroring hot experts)

and :func:`combine` sums each token's K rows back to ``[S, H]``.

Everything runs on the device with static shapes (sort, cumsum, scatter, gather; no ``nonzero``,
no ``.item()``, no data-sized outputs), so router -> dispatch -> experts -> combine compiles with
``torch.compile(fullgraph=True)`` and captures in one CUDA graph. The only data-dependent check,
"the padded segments fit in NvS", is a ``torch._assert_async``: it raises at once on CPU and is a
device-side assert on CUDA (MoonEP's bound, :func:`nvs_bound`, always fits).
"""

from dataclasses import dataclass
from typing import Optional

import torch


def align_up(n, multiple):
    return (n + multiple - 1) // multiple * multiple


def nvs_bound(num_tokens, topk, num_local_experts, token_padding=128):
    """MoonEP's static row count: ``align_up(S*K + (token_padding - 1)*2*epn, token_padding)``.

    Every rank receives exactly ``S*K`` real rows spread over at most ``2*epn`` weight rows (``epn``
    local experts plus ``epn`` prefetch slots), and each non-empty segment wastes fewer than
    ``token_padding`` rows on padding. Works with ``SymInt`` sizes.
    """
    if token_padding == 1:
        return num_tokens * topk
    return align_up(num_tokens * topk + (token_padding - 1) * 2 * num_local_experts, token_padding)


@dataclass
class Dispatched:
    """What :func:`dispatch` returns. ``NvS = x_nvs.shape[0]``; ``S*K`` real rows in all."""

    x_nvs: torch.Tensor  # [NvS, H], x's dtype
    route_weights: torch.Tensor  # [NvS] float32; 0 on padding rows, undefined past cu_seqlens[-1]
    cu_seqlens: torch.Tensor  # [G] int32
    src_token: torch.Tensor  # [NvS] int64 source token of each row; S on padding and tail rows
    valid: torch.Tensor  # [NvS] bool, True on real rows
    row_of: torch.Tensor  # [S, K] int64: the row holding token s's k-th expert (what combine reads)
    prefetch_for: torch.Tensor  # [B] int64: the expert each prefetch slot E + b mirrors

    @property
    def num_rows(self) -> int:
        return self.x_nvs.shape[0]

    @property
    def num_groups(self) -> int:
        return self.cu_seqlens.shape[0]


def hottest_experts(topk_ids: torch.Tensor, num_experts: int, num_prefetch: int) -> torch.Tensor:
    """The ``num_prefetch`` experts with the most tokens (ties: lower id first), on the device."""
    if num_prefetch > num_experts:
        raise ValueError(f"cannot pick {num_prefetch} distinct hot experts out of {num_experts}")
    ids = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    return torch.sort(counts, descending=True, stable=True).indices[:num_prefetch]


def expand_weights(w: torch.Tensor, prefetch_for: torch.Tensor) -> torch.Tensor:
    """``[E, ...] -> [E + B, ...]``: prefetch slot ``E + b`` holds a copy of expert ``prefetch_for[b]``.

    This is what MoonEP's ``prefetch_weight`` does for the hot experts, here as one contiguous tensor.
    """
    return torch.cat([w, w.index_select(0, prefetch_for.to(device=w.device, dtype=torch.int64))])


def _groups(ids_sorted, counts, prefetch_for, num_experts):
    """Weight row of each assignment, given the assignments sorted (stably) by expert.

    An expert mirrored by ``m`` prefetch slots has its ``c`` assignments split in ``m + 1`` nearly
    equal runs, in token order: run 0 stays on the expert, run ``j`` goes to its ``j``-th slot.
    """
    n = ids_sorted.shape[0]
    num_prefetch = prefetch_for.shape[0]
    dev = ids_sorted.device
    # Rank of each assignment among its expert's assignments.
    expert_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - expert_start[ids_sorted]
    if num_prefetch == 0:
        return ids_sorted
    slots = torch.arange(num_prefetch, device=dev)
    # Ordinal of each slot among the slots mirroring the same expert (static [B, B] comparison).
    earlier = (prefetch_for[:, None] == prefetch_for[None, :]) & (slots[None, :] < slots[:, None])
    ordinal = earlier.sum(1)
    mirrors = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    mirrors.scatter_add_(0, prefetch_for, torch.ones_like(prefetch_for))
    # table[e, j]: weight row of run j of expert e (column 0: the expert itself).
    table = torch.arange(num_experts, device=dev)[:, None].repeat(1, num_prefetch + 1)
    table = table.index_put((prefetch_for, ordinal + 1), slots + num_experts)
    parts = mirrors[ids_sorted] + 1
    run = rank * parts // counts[ids_sorted]  # counts >= 1 for every expert that appears here
    return table[ids_sorted, run]


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             *, num_rows=None, token_padding: int = 128, num_prefetch: int = 0,
             prefetch_for: Optional[torch.Tensor] = None, fill_tail: Optional[float] = None,
             weights_on_input: bool = False) -> Dispatched:
    """MoonEP's dispatch on one device.

    Args:
        x: ``[S, H]`` tokens.
        topk_ids: ``[S, K]`` expert ids in ``[0, num_experts)`` (int32 or int64).
        topk_weights: ``[S, K]`` router weights (stored as fp32 ``route_weights``).
        num_experts: ``E``.
        num_rows: ``NvS``, static; default :func:`nvs_bound` with ``epn = max(E, ceil(G / 2))``,
            which always fits. A smaller capacity must still hold every padded segment.
        token_padding: each non-empty segment is padded with zero rows to a multiple of this.
        num_prefetch: ``B`` prefetch slots, weight rows ``[E, E + B)``.
        prefetch_for: ``[B]`` expert ids the slots mirror; default the ``B`` hottest experts of
            this batch (:func:`hottest_experts`, computed on the device). Give the slots the
            weights with :func:`expand_weights` (``Dispatched.prefetch_for``).
        fill_tail: value for rows ``[cu_seqlens[-1], NvS)`` of ``x_nvs`` and ``route_weights``
            (tests use NaN); None leaves them uninitialised, as MoonEP does.
        weights_on_input: multiply each row by its router weight here (top-1, Llama-4 style);
            the experts must then be called with ``route_weights=None``.
    """
    _check_dispatch_args(x, topk_ids, topk_weights, num_experts, token_padding, num_prefetch)
    num_tokens, hidden = x.shape
    topk = topk_ids.shape[1]
    n = num_tokens * topk
    prefetch_for = _prefetch_slots(topk_ids, num_experts, num_prefetch, prefetch_for, x.device)
    num_groups = num_experts + prefetch_for.shape[0]
    if num_rows is None:
        num_rows = nvs_bound(num_tokens, topk, max(num_experts, -(-num_groups // 2)), token_padding)
    if num_rows < n:
        raise ValueError(f"moonep_ops.layout.dispatch: num_rows = {num_rows} cannot hold S*K = {n} rows")
    cu, row_of, row_assign = _place_rows(topk_ids, num_experts, prefetch_for, token_padding, num_rows)
    src_token = row_assign // topk  # n // K == S: the sentinel comes for free

    w_row = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])
    w_row = w_row[row_assign]
    x_rows = torch.cat([x, x.new_zeros(1, hidden)])[src_token]  # padding rows gather the zero row
    if weights_on_input:
        x_rows = (x_rows.float() * w_row[:, None]).to(x.dtype)

    in_segments = torch.arange(num_rows, device=x.device) < cu[-1]
    if fill_tail is None:
        x_tail, w_tail = torch.empty_like(x_rows), torch.empty_like(w_row)
    else:
        x_tail, w_tail = fill_tail, fill_tail
    return Dispatched(
        x_nvs=torch.where(in_segments[:, None], x_rows, x_tail),
        route_weights=torch.where(in_segments, w_row, w_tail),
        cu_seqlens=cu.to(torch.int32),
        src_token=src_token,
        valid=row_assign < n,
        row_of=row_of.view(num_tokens, topk),
        prefetch_for=prefetch_for,
    )


def _check_dispatch_args(x, topk_ids, topk_weights, num_experts, token_padding, num_prefetch) -> None:
    """The metadata :func:`dispatch` needs, and the expert ids' range as the segments' fit is
    checked: an assert that raises at once on the CPU and is a device-side assert on CUDA (no
    host read of the ids)."""
    def fail(message):
        raise ValueError(f"moonep_ops.layout.dispatch: {message}")

    if x.dim() != 2:
        fail(f"x must be 2-D [S, H], got shape {list(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        fail(f"topk_ids must be [S, K] with S = {x.shape[0]} (x's rows), got shape {list(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        fail(f"topk_ids must hold integers, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        fail(f"topk_weights must be shaped like topk_ids {list(topk_ids.shape)}, got {list(topk_weights.shape)}")
    if num_experts < 1 or token_padding < 1 or num_prefetch < 0:
        fail(f"num_experts and token_padding must be at least 1 and num_prefetch at least 0, got "
             f"{num_experts}, {token_padding} and {num_prefetch}")
    if topk_ids.numel():
        torch._assert_async(((topk_ids >= 0) & (topk_ids < num_experts)).all(),
                            f"moonep_ops.layout.dispatch: topk_ids must lie in [0, num_experts = {num_experts})")


def _prefetch_slots(topk_ids, num_experts: int, num_prefetch: int, prefetch_for, device) -> torch.Tensor:
    """The ``[B]`` int64 expert ids the prefetch slots mirror: ``prefetch_for``, else the
    ``num_prefetch`` hottest experts of this batch."""
    if num_prefetch and prefetch_for is None:
        prefetch_for = hottest_experts(topk_ids, num_experts, num_prefetch)
    elif prefetch_for is None:
        prefetch_for = torch.zeros(0, dtype=torch.int64, device=device)
    return prefetch_for.to(device=device, dtype=torch.int64)


def _place_rows(topk_ids, num_experts: int, prefetch_for, token_padding: int, num_rows: int) -> tuple:
    """Where each (token, k) goes: ``(cu_seqlens [G] int64, row_of [S*K], row_assign [NvS])``,
    ``row_assign`` holding each row's flat index ``s * K + k``, or ``S*K`` on padding and tail rows."""
    ids = topk_ids.reshape(-1).long()
    n, dev = ids.shape[0], ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    ids_sorted, order = torch.sort(ids, stable=True)
    groups = _groups(ids_sorted, counts, prefetch_for, num_experts)

    group_counts = torch.zeros(num_experts + prefetch_for.shape[0], dtype=torch.int64, device=dev)
    group_counts.scatter_add_(0, groups, torch.ones_like(groups))
    padded = (group_counts + token_padding - 1) // token_padding * token_padding
    cu = torch.cumsum(padded, 0)
    torch._assert_async(cu[-1] <= num_rows,
                        "moonep_ops.layout.dispatch: the padded segments do not fit in num_rows (NvS)")
    # Sort by weight row (stable: token order within a row) and place each run at its segment.
    groups_sorted, order2 = torch.sort(groups, stable=True)
    seg_start = cu - padded
    count_start = torch.cumsum(group_counts, 0) - group_counts
    rows = seg_start[groups_sorted] + torch.arange(n, device=dev) - count_start[groups_sorted]
    assign = order[order2]  # flat index s * K + k of each, in row order
    row_of = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, assign, rows)
    # Row num_rows is a dummy that only an overflow (caught by the assert above) would write.
    row_assign = torch.full((num_rows + 1,), n, dtype=torch.int64, device=dev)
    row_assign = row_assign.scatter(0, rows.clamp_max(num_rows), assign)[:num_rows]
    return cu, row_of, row_assign


def combine(y_nvs: torch.Tensor, dispatched: Dispatched, num_tokens=None) -> torch.Tensor:
    """MoonEP's combine on one device: ``out[s] = sum_k y_nvs[row_of[s, k]]``, ``[S, H]``.

    A gather of exactly the ``S*K`` real rows (no atomics, deterministic): padding and tail rows
    are never read, so NaN or garbage there cannot reach the output. Summed in fp32 for
    half-precision ``y_nvs``. ``num_tokens`` is optional and only checked.
    """
    row_of = dispatched.row_of
    if num_tokens is not None and num_tokens != row_of.shape[0]:
        raise ValueError(f"moonep_ops.layout.combine: num_tokens = {num_tokens} but the dispatch had "
                         f"{row_of.shape[0]} tokens")
    nvs = dispatched.x_nvs.shape[0]
    if y_nvs.dim() != 2 or y_nvs.shape[0] != nvs:
        raise ValueError(f"moonep_ops.layout.combine: y_nvs must be [NvS, H] with NvS = {nvs} (the dispatch's "
                         f"rows), got shape {list(y_nvs.shape)}")
    acc = torch.float32 if y_nvs.dtype in (torch.bfloat16, torch.float16) else y_nvs.dtype
    picked = y_nvs.index_select(0, row_of.reshape(-1)).view(*row_of.shape, y_nvs.shape[1])
    return picked.to(acc).sum(1).to(y_nvs.dtype)
