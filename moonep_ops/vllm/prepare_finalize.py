"""``MoonEPOpsPrepareAndFinalize``: vLLM's MoonEP prepare/finalize without host syncs in the forward.

vLLM's ``MoonEPPrepareAndFinalize.prepare`` counts tokens per expert with ``torch.bincount``
(on CUDA a device-to-host sync in every MoE layer), creates ``moonep.Buffer`` instances lazily
inside the forward (allocation and collectives), and pads the batch with fresh tensors. This
subclass keeps vLLM's buffer pool, capacity choice (host data only: the step's token count
and ``dp_metadata.num_tokens_across_dp_cpu``), plan bookkeeping and the MoonEP calls, and changes
where the work happens:

- every pool capacity gets its ``Buffer`` and its :class:`~moonep_ops.vllm.device.Staging`
  tensors in ``post_init_setup``, when vLLM builds the ``FusedMoEKernel`` at model load, in
  the same order on every rank; a forward only looks them up;
- the per-expert counts are a ``scatter_add_`` into a fixed ``[E]`` buffer;
- dispatch hands back MoonEP's own shard (``zero_copy``) where MoonEP offers it, and the
  segment lengths go into a fixed ``[E+B]`` buffer, so what ``prepare`` returns sits at the same
  addresses every step.

The device work itself is :mod:`moonep_ops.vllm.device` (plain torch, tested under CUDA-graph
capture without vLLM).
"""

import weakref

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import (
    MoonEPBufferPool,
    MoonEPPrepareAndFinalize,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from . import device

# Staging per pool and capacity: a pool (one per Buffer geometry) serves every MoE layer, and
# layers run one after another, so they share it as they share the MoonEP Buffers.
_STAGING: "weakref.WeakKeyDictionary[MoonEPBufferPool, dict[int, device.Staging]]" = (
    weakref.WeakKeyDictionary())


def pool_capacities(pool: MoonEPBufferPool) -> list[int]:
    """Every capacity ``pool.capacity_for`` can return: powers of two from 128, then the maximum."""
    caps, n = set(), 1
    while n < pool.max_tokens_per_rank:
        caps.add(pool.capacity_for(n))
        n *= 2
    caps.add(pool.capacity_for(pool.max_tokens_per_rank))
    return sorted(caps)


class MoonEPOpsPrepareAndFinalize(MoonEPPrepareAndFinalize):
    """MoonEP dispatch/combine for vLLM's modular kernel; a forward never syncs the host."""

    def __init__(self, buffer_pool: MoonEPBufferPool, max_tokens_per_rank: int,
                 num_dispatchers: int, num_global_experts: int, weight_layout=None):
        super().__init__(buffer_pool, max_tokens_per_rank, num_dispatchers, num_global_experts,
                         weight_layout)
        self._staging: dict[int, device.Staging] = {}
        self._zero_copy = False

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        """Create every Buffer and staging set now (model load), never inside a forward."""
        super().post_init_setup(fused_experts)
        moe = fused_experts.moe_config
        kwargs = self.buffer_pool._kwargs  # vLLM's Buffer arguments, less S
        dev = torch.device(moe.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        shared = _STAGING.setdefault(self.buffer_pool, {})
        for capacity in pool_capacities(self.buffer_pool):
            _, buffer = self.buffer_pool.get(capacity)
            if capacity not in shared:
                shared[capacity] = device.Staging.allocate(
                    capacity, kwargs["H"], kwargs["K"], kwargs["E"], kwargs["B"], moe.in_dtype, dev)
            self._staging[capacity] = shared[capacity]
        self._zero_copy = device.supports_zero_copy(buffer)

    def _step_capacity(self, num_tokens: int) -> int:
        """vLLM's rank-symmetric capacity: from the largest DP rank's token count (host data)."""
        try:
            dp_meta = get_forward_context().dp_metadata
        except AssertionError:  # outside a forward context (tests)
            dp_meta = None
        if dp_meta is not None:
            num_tokens = max(num_tokens, int(dp_meta.num_tokens_across_dp_cpu.max()))
        return self.buffer_pool.capacity_for(num_tokens)

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_map: torch.Tensor | None,
                apply_router_weight_on_input: bool, quant_config: FusedMoEQuantConfig,
                defer_input_quant: bool = False) -> mk.PrepareResultType:
        name = type(self).__name__
        if a1.dtype != torch.bfloat16:
            raise NotImplementedError(f"{name}: MoonEP dispatches BF16 hidden states only")
        if quant_config.quant_dtype is not None:
            raise NotImplementedError(f"{name}: MoonEP has no quantized dispatch")
        if num_experts != self.num_global_experts:
            raise ValueError(f"{name}: num_experts = {num_experts}, built for {self.num_global_experts}")
        if self._plan is not None:
            raise RuntimeError(f"{name}.prepare() called again before finalize()")
        if apply_router_weight_on_input and topk_ids.size(1) != 1:
            raise ValueError(f"{name}: apply_router_weight_on_input needs top-1 routing, "
                             f"got top-{topk_ids.size(1)}")
        num_tokens = a1.shape[0]
        capacity = self._step_capacity(num_tokens)
        if num_tokens > capacity:
            raise ValueError(f"MoonEP static buffer capacity exceeded: {num_tokens} tokens > S={capacity}.")
        staging = self._staging.get(capacity)
        if staging is None:
            raise RuntimeError(f"{name}: no MoonEP buffer of capacity {capacity}; they are made in "
                               "post_init_setup (FusedMoEKernel construction), never in a forward")
        _, buffer = self.buffer_pool.get(capacity)  # made in post_init_setup: a lookup
        layout = self._resolve_weight_layout()
        d = device.dispatch_step(buffer, staging, layout[:3], a1, topk_ids, topk_weights,
                                 apply_router_weight_on_input, self._zero_copy)
        self._buffer, self._plan, self._cu_seqlens = buffer, d.plan, d.cu_seqlens
        self._num_tokens = num_tokens
        meta = mk.ExpertTokensMetadata(expert_num_tokens=d.segment_lengths, expert_num_tokens_cpu=None)
        # No per-row top-k ids after dispatch; the route weights ride in the top-k weights slot.
        return d.hidden_nvsh, None, meta, None, d.route_weights_nvs

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: mk.TopKWeightAndReduce) -> None:
        name = type(self).__name__
        # The experts applied the route weights and combine sums, so anything but NoOP means the
        # experts are not MoonEP's.
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP):
            raise ValueError(f"{name}: MoonEP experts finalize with TopKWeightAndReduceNoOP, got "
                             f"{type(weight_and_reduce_impl).__name__}")
        if self._plan is None:
            raise RuntimeError(f"{name}.finalize() without prepare()")
        plan, self._plan, self._cu_seqlens = self._plan, None, None
        device.combine_step(self._buffer, plan, fused_expert_output, output)
