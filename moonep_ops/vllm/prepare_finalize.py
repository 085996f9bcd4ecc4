"""A one-device ``PrepareAndFinalize`` that hands experts exactly what MoonEP hands them.

For tests and benchmarks of MoonEP experts inside vLLM's ``FusedMoEKernel`` without MoonEP's
multi-GPU buffers: dispatch and combine are :mod:`moonep_ops.layout`'s emulation, and the
prefetch slots ``[E, E+B)`` of the experts' weight layout get copies of this step's hottest
experts, as MoonEP's ``prefetch_weight`` does. Everything stays on the device (no host sync),
so a step can be captured in a CUDA graph.

``prepare`` returns ``[NvS, H]`` rows in segment order, per-row segment lengths as
``ExpertTokensMetadata.expert_num_tokens`` and fp32 route weights in ``NvS`` order (in the
top-k weights slot); ``finalize`` sums each token's rows (the experts applied the weights).
"""

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from .. import layout


class MoonEPLayoutPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """MoonEP's prepare/finalize contract on one device, built on :mod:`moonep_ops.layout`.

    Args:
        num_experts: ``E``; the experts' weight layout must have ``E + B`` rows.
        token_padding: each non-empty segment is padded to a multiple of this (MoonEP: 128).
        fill_tail: value written to the undefined rows past ``cu_seqlens[-1]`` (tests use
            NaN to prove nothing reads them); None leaves them uninitialised, as MoonEP does.
    """

    def __init__(self, num_experts: int, *, token_padding: int = 128,
                 fill_tail: float | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.token_padding = token_padding
        self.fill_tail = fill_tail
        self._fused_experts = None
        self._dispatched: layout.Dispatched | None = None

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        # The weight layout arrives with process_weights_after_loading, after this: read it
        # from the experts in prepare().
        self._fused_experts = fused_experts

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None  # dispatch takes int32 or int64

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return 1

    def output_is_reduced(self) -> bool:
        return True  # one device: combine's output is final

    def _weight_layout(self):
        weights = getattr(self._fused_experts, "weight_layout", None)
        if weights is None:
            raise RuntimeError("MoonEPLayoutPrepareAndFinalize: the experts have no MoonEP weight "
                               "layout (process_weights_after_loading has not run)")
        rows = weights.full_gate_weight.shape[0]
        if rows != self.num_experts + weights.num_prefetch_slots:
            raise ValueError(f"weight layout has {rows} rows, expected E + B = "
                             f"{self.num_experts} + {weights.num_prefetch_slots}")
        return weights

    def _prefetch(self, weights, prefetch_for: torch.Tensor) -> None:
        """Fill slot ``E + b`` with expert ``prefetch_for[b]``'s weights (MoonEP's prefetch_weight)."""
        e = self.num_experts
        for w in (weights.full_gate_weight, weights.full_up_weight, weights.full_down_weight):
            w[e:].copy_(w[:e].index_select(0, prefetch_for))

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_map: torch.Tensor | None,
                apply_router_weight_on_input: bool, quant_config: FusedMoEQuantConfig,
                defer_input_quant: bool = False) -> mk.PrepareResultType:
        if quant_config.quant_dtype is not None:
            raise NotImplementedError("MoonEPLayoutPrepareAndFinalize: no quantized dispatch")
        if expert_map is not None:
            raise NotImplementedError("MoonEPLayoutPrepareAndFinalize is one device: no expert_map")
        if num_experts != self.num_experts:
            raise ValueError(f"num_experts = {num_experts}, but this was built for {self.num_experts}")
        if self._dispatched is not None:
            raise RuntimeError("MoonEPLayoutPrepareAndFinalize.prepare() called again before finalize()")
        weights = self._weight_layout()
        topk_weights = topk_weights.float()
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input needs top-1 routing, got top-"
                                 f"{topk_ids.shape[1]}")
            a1 = (a1.float() * topk_weights).to(a1.dtype)
        # Invalid (negative) ids from the engine go to expert 0 with zero weight, as in vLLM.
        invalid = topk_ids < 0
        topk_ids = torch.where(invalid, torch.zeros_like(topk_ids), topk_ids)
        topk_weights = torch.where(invalid, torch.zeros_like(topk_weights), topk_weights)

        d = layout.dispatch(a1, topk_ids, topk_weights, num_experts,
                            token_padding=self.token_padding,
                            num_prefetch=weights.num_prefetch_slots, fill_tail=self.fill_tail)
        self._prefetch(weights, d.prefetch_for)
        self._dispatched = d
        lengths = torch.diff(d.cu_seqlens, prepend=d.cu_seqlens.new_zeros(1))
        meta = mk.ExpertTokensMetadata(expert_num_tokens=lengths, expert_num_tokens_cpu=None)
        # No per-row top-k ids after dispatch; the route weights ride in the top-k weights slot.
        return d.x_nvs, None, meta, None, d.route_weights

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: mk.TopKWeightAndReduce) -> None:
        # The experts applied the route weights; combine only sums, so anything but NoOP means
        # the experts were not MoonEP's.
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP):
            raise ValueError("MoonEP experts must finalize with TopKWeightAndReduceNoOP, got "
                             f"{type(weight_and_reduce_impl).__name__}")
        d = self._dispatched
        if d is None:
            raise RuntimeError("MoonEPLayoutPrepareAndFinalize.finalize() without prepare()")
        self._dispatched = None
        # combine returns a fresh tensor, so this is safe even when vLLM made
        # fused_expert_output an alias of output (same shape when NvS == num_tokens).
        output.copy_(layout.combine(fused_expert_output, d, output.shape[0]))
