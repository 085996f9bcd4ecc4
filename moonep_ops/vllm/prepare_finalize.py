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

FP8 (``--quantization moonep_fp8``, docs/vllm.md): with :class:`~moonep_ops.vllm.fp8.MoonEPOpsFp8Experts`
the hidden states are still dispatched in BF16 (the experts quantize them: vLLM's
``defer_input_quant``), and ``prefetch_weight`` copies the hot experts' block scales with their
FP8 weights (:class:`~moonep_ops.vllm.fp8_layout.MoonEPFp8WeightLayout`). A MoonEP whose
``prefetch_weight`` cannot copy scales is refused at model load.
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
from .fp8_layout import MoonEPFp8WeightLayout

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
        if fused_experts.quant_config.quant_dtype is not None:
            _check_fp8_pairing(type(self).__name__, fused_experts, buffer)

    def _resolve_weight_layout(self):
        """The experts' ``[E+B]`` layout: vLLM's BF16 one or :class:`MoonEPFp8WeightLayout`."""
        layout = getattr(self._fused_experts, "weight_layout", None)
        if self.weight_layout is None and isinstance(layout, MoonEPFp8WeightLayout):
            self.weight_layout = layout
        return super()._resolve_weight_layout()

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
        fp8 = quant_config.quant_dtype is not None
        if fp8 and not (defer_input_quant and _is_fp8_block_128(quant_config)):
            raise NotImplementedError(
                f"{name}: MoonEP has no quantized dispatch (FP8 128x128 block-quantized experts that "
                f"quantize their own BF16 inputs are supported); got quant_dtype="
                f"{quant_config.quant_dtype}, block_shape={quant_config.block_shape}, "
                f"defer_input_quant={defer_input_quant}")
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
        if isinstance(layout, MoonEPFp8WeightLayout) != fp8:
            raise RuntimeError(f"{name}: the experts' weight layout is {type(layout).__name__} but their "
                               f"quant_dtype is {quant_config.quant_dtype}")
        if fp8:
            weights, scales = layout.prefetch_weights, layout.prefetch_scales
        else:
            weights, scales = layout[:3], None
        d = device.dispatch_step(buffer, staging, weights, a1, topk_ids, topk_weights,
                                 apply_router_weight_on_input, self._zero_copy, scales)
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


def _is_fp8_block_128(quant_config: FusedMoEQuantConfig) -> bool:
    return (quant_config.quant_dtype == torch.float8_e4m3fn
            and list(quant_config.block_shape or ()) == [128, 128])


def _check_fp8_pairing(name: str, fused_experts: mk.FusedMoEExperts, buffer) -> None:
    """At model load: quantized experts behind MoonEP must take BF16 rows (MoonEP dispatches BF16)
    and be 128x128 block FP8, and this MoonEP must prefetch their scales with the weights."""
    quant = fused_experts.quant_config
    if not (fused_experts.expects_unquantized_inputs and _is_fp8_block_128(quant)):
        raise NotImplementedError(
            f"{name}: MoonEP dispatches BF16 hidden states; {type(fused_experts).__name__} wants them "
            f"quantized (quant_dtype={quant.quant_dtype}, block_shape={quant.block_shape}, "
            f"expects_unquantized_inputs={fused_experts.expects_unquantized_inputs}). Only FP8 128x128 "
            "block experts that quantize their own inputs (moonep_ops' MoonEPOpsFp8Experts, "
            "--quantization moonep_fp8) run behind MoonEP.")
    if not device.supports_scale_prefetch(buffer):
        raise RuntimeError(
            f"{name}: the installed MoonEP cannot prefetch FP8 block scales: its "
            f"Buffer.prefetch_weight has no {', '.join(device.SCALE_PREFETCH_ARGS)} arguments, so a "
            "prefetched expert would run with another expert's scales. Install a MoonEP whose "
            "[E+B] prefetch_weight takes full_gate_scale/full_up_scale/full_down_scale (e.g. the "
            "zhumakhan/MoonEP fork), or serve an unquantized (BF16) checkpoint.")
