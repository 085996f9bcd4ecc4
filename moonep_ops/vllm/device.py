"""The device side of ``MoonEPOpsPrepareAndFinalize``, in plain torch (this module never imports vLLM).

One MoE step on a MoonEP ``Buffer`` of token capacity ``S``::

    stage_tokens     s tokens, their ids and weights -> the [S, ...] staging tensors
    count_tokens     staged ids -> tokens_per_expert [E], a scatter_add_ into a fixed buffer
    buffer.dispatch  -> hidden_nvsh [NvS, H], route_weights_nvs [NvS], cu_seqlens [E+B], plan
    buffer.prefetch_weight(plan, ...)        the hot experts' weights (and FP8 scales) into rows [E, E+B)
    segment_lengths  cu_seqlens -> per-row segment lengths [E+B] (vLLM's expert_num_tokens)
      ... the experts ...
    buffer.combine   -> [S, H]; its first s rows are copied into the layer's output

Nothing here reads device data on the host, makes a tensor whose size depends on data, or
creates a ``Buffer``: :class:`Staging` is allocated once per capacity at model load, and
dispatch returns the Buffer's own shard (``zero_copy``) where MoonEP offers it. So these steps
capture in a CUDA graph wherever MoonEP's own calls do.
"""

import inspect
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Staging:
    """Persistent inputs of one Buffer capacity ``S``, shared by every MoE layer on that Buffer."""

    hidden: torch.Tensor  # [S, H] tokens handed to dispatch
    topk_ids: torch.Tensor  # [S, K] int32
    topk_weights: torch.Tensor  # [S, K] fp32; 0 on padding rows and invalid routes
    filler_ids: torch.Tensor  # [S, K] int32 (s*K + k) % E: ids of padding rows and invalid routes
    flat_ids: torch.Tensor  # [S*K] int64, scratch for the histogram
    ones: torch.Tensor  # [S*K] int32
    tokens_per_expert: torch.Tensor  # [E] int32
    segment_lengths: torch.Tensor  # [E+B] int32

    @classmethod
    def allocate(cls, capacity: int, hidden: int, topk: int, num_experts: int,
                 num_prefetch: int, dtype: torch.dtype, device) -> "Staging":
        n = capacity * topk
        i32 = dict(dtype=torch.int32, device=device)
        filler = torch.arange(n, device=device).remainder_(num_experts).to(torch.int32)
        return cls(
            hidden=torch.zeros(capacity, hidden, dtype=dtype, device=device),
            topk_ids=filler.view(capacity, topk).clone(),
            topk_weights=torch.zeros(capacity, topk, dtype=torch.float32, device=device),
            filler_ids=filler.view(capacity, topk),
            flat_ids=torch.zeros(n, dtype=torch.int64, device=device),
            ones=torch.ones(n, **i32),
            tokens_per_expert=torch.zeros(num_experts, **i32),
            segment_lengths=torch.zeros(num_experts + num_prefetch, **i32),
        )

    @property
    def capacity(self) -> int:
        return self.hidden.shape[0]


def stage_tokens(staging: Staging, a1: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, weights_on_input: bool) -> torch.Tensor:
    """Fill the staging tensors for ``s = a1.shape[0]`` tokens; returns the ``[S, H]`` tokens to dispatch.

    Rows ``[s, S)`` become padding: weight 0 and ids spread over the experts; their tokens are
    whatever an earlier step left (combine sums them into rows ``[s, S)`` only, which are
    dropped). An invalid (negative) id from the engine gets a filler id and weight 0, so it
    adds nothing. With ``weights_on_input`` (top-1) each token is scaled by its weight here, in fp32.
    """
    s = a1.shape[0]
    ids, weights = staging.topk_ids[:s], staging.topk_weights[:s]
    ids.copy_(topk_ids)
    weights.copy_(topk_weights)
    invalid = ids < 0
    torch.where(invalid, staging.filler_ids[:s], ids, out=ids)
    weights.masked_fill_(invalid, 0.0)
    staging.topk_ids[s:].copy_(staging.filler_ids[s:])
    staging.topk_weights[s:].zero_()
    if s == staging.capacity and not weights_on_input and a1.is_contiguous():
        return a1
    if weights_on_input:
        torch.mul(a1, weights, out=staging.hidden[:s])
    else:
        staging.hidden[:s].copy_(a1)
    return staging.hidden


def count_tokens(staging: Staging) -> torch.Tensor:
    """``tokens_per_expert[e]``: how many staged routes go to expert ``e`` (no bincount, no sync)."""
    staging.flat_ids.copy_(staging.topk_ids.view(-1))
    counts = staging.tokens_per_expert
    counts.zero_()
    counts.scatter_add_(0, staging.flat_ids, staging.ones)
    return counts


def segment_lengths(cu_seqlens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[g] = cu[g] - cu[g-1]`` (``cu[-1]`` read as 0 for ``g = 0``), written into ``out``."""
    out[:1].copy_(cu_seqlens[:1])
    torch.sub(cu_seqlens[1:], cu_seqlens[:-1], out=out[1:])
    return out


def supports_zero_copy(buffer: Any) -> bool:
    """Whether this MoonEP's ``dispatch`` can hand back its own shard (``zero_copy`` arguments)."""
    params = inspect.signature(buffer.dispatch).parameters
    return "zero_copy" in params and "router_weights_zero_copy" in params


SCALE_PREFETCH_ARGS = ("full_gate_scale", "full_up_scale", "full_down_scale")


def supports_scale_prefetch(buffer: Any) -> bool:
    """Whether this MoonEP's ``prefetch_weight`` copies block scales with the weights (the
    ``full_{gate,up,down}_scale`` arguments of the ``[E+B]`` API, e.g. the zhumakhan/MoonEP fork).
    ``buffer`` is a ``moonep.Buffer`` or the class itself. Without them a prefetch slot would hold
    an expert's FP8 weights with another expert's scales, so FP8 experts are refused."""
    params = inspect.signature(buffer.prefetch_weight).parameters
    return all(name in params for name in SCALE_PREFETCH_ARGS)


class Dispatched(NamedTuple):
    hidden_nvsh: torch.Tensor  # [NvS, H]
    route_weights_nvs: torch.Tensor  # [NvS] fp32
    cu_seqlens: torch.Tensor  # [E+B] int32
    plan: Any
    segment_lengths: torch.Tensor  # [E+B] int32, Staging.segment_lengths


def dispatch_step(buffer: Any, staging: Staging, full_weights, a1: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights_on_input: bool,
                  zero_copy: bool, full_scales=None) -> Dispatched:
    """Stage, count, dispatch and prefetch; ``full_weights`` is the ``[E+B]`` (gate, up, down)
    triple, ``full_scales`` their ``[E+B, ...]`` block-scale storages (FP8) or None."""
    hidden = stage_tokens(staging, a1, topk_ids, topk_weights, weights_on_input)
    counts = count_tokens(staging)
    extra = dict(zero_copy=True, router_weights_zero_copy=True) if zero_copy else {}
    hidden_nvsh, route_weights_nvs, cu_seqlens, plan = buffer.dispatch(
        hidden, staging.topk_weights, staging.topk_ids, counts, **extra)
    gate, up, down = full_weights
    scales = {} if full_scales is None else dict(zip(SCALE_PREFETCH_ARGS, full_scales))
    buffer.prefetch_weight(plan=plan, full_gate_weight=gate, full_up_weight=up,
                           full_down_weight=down, **scales)
    lengths = segment_lengths(cu_seqlens, staging.segment_lengths)
    return Dispatched(hidden_nvsh, route_weights_nvs, cu_seqlens, plan, lengths)


def combine_step(buffer: Any, plan: Any, expert_output: torch.Tensor, output: torch.Tensor) -> None:
    """Sum each token's rows (MoonEP's combine) into ``output`` ``[s, H]``."""
    combined, _, _ = buffer.combine(plan=plan, hidden_nvsh=expert_output, route_weights_nvs=None)
    output.copy_(combined[:output.shape[0]])
