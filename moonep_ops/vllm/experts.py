"""``MoonEPOpsExperts``: vLLM's MoonEP experts with the expert compute on the ``moonep`` ops.

It subclasses vLLM's ``MoonEPExperts``, so the support predicates (but the device one:
sm90+ here, any CUDA device in vLLM), the ``[E+B]`` weight layout (``full_gate/up/down_weight``,
built by vLLM at load time) and ``process_weights_after_loading`` stay vLLM's. ``apply`` changes: three
``torch._grouped_mm`` calls, an eager ``silu``/``mul_``/``mul_`` and a final
``output.copy_`` become the ``moonep`` ops, which write straight into ``output``, apply
the route weight in fp32 inside the activation and never sync the host.
"""

from typing import ClassVar

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.experts.moonep_experts import MoonEPExperts
from vllm.platforms import current_platform

from ..ops import moonep_experts


def _check_supported(moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig) -> None:
    """Refuse, at construction, what the ops do not compute (vLLM only asserts some of it)."""
    name = "MoonEPOpsExperts"
    if quant_config.quant_dtype is not None:
        raise NotImplementedError(
            f"{name} runs unquantized experts only; got quant_dtype={quant_config.quant_dtype}")
    if quant_config.w1_bias is not None or quant_config.w2_bias is not None:
        raise NotImplementedError(f"{name} has no expert biases (w1_bias/w2_bias)")
    if moe_config.activation != MoEActivation.SILU:
        raise NotImplementedError(
            f"{name} computes silu(gate) * up only; got activation {moe_config.activation}")
    swiglu = (moe_config.swiglu_limit, moe_config.swiglu_alpha, moe_config.swiglu_beta)
    if any(v is not None for v in swiglu):
        raise NotImplementedError(f"{name} has no SwiGLU limit/alpha/beta variants")


class MoonEPOpsExperts(MoonEPExperts):
    """MoonEP experts whose ``apply`` runs ``moonep_ops.moonep_experts`` into vLLM's output."""

    #: Let vLLM's oracle pick this class on its CPU platform. For tests only: MoonEP itself
    #: runs on sm90+ GPUs with NVSwitch multicast, and the ops' CPU kernels read cu_seqlens
    #: on the host.
    allow_cpu: ClassVar[bool] = False

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 max_num_tokens: int | None = None, num_dispatchers: int | None = None):
        _check_supported(moe_config, quant_config)
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)

    @classmethod
    def _supports_current_device(cls) -> bool:
        # MoonEP's devices: sm90+ (vLLM checks NVSwitch multicast when it builds the buffers).
        if current_platform.is_cuda():
            return current_platform.has_device_capability(90)
        return cls.allow_cpu and current_platform.is_cpu()

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: mk.ExpertTokensMetadata | None,
                         activation: MoEActivation) -> tuple[tuple[int, ...], ...]:
        # M is NvS. The ops allocate their own [NvS, I] intermediates, so no workspace13 /
        # workspace2; the modular kernel still needs the exact [NvS, H] output shape.
        return (0,), (0,), (M, K)

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
              a2_scale: torch.Tensor | None, workspace13: torch.Tensor,
              workspace2: torch.Tensor, expert_tokens_meta: mk.ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool) -> None:
        # expert_map is ignored, as in vLLM: MoonEP addresses global [E+B] weight rows.
        if a1q_scale is not None or a2_scale is not None:
            raise NotImplementedError("MoonEPOpsExperts: quantized activations are not supported")
        layout, cu_seqlens, route_weights = self._segments(activation, topk_weights, expert_tokens_meta,
                                                           apply_router_weight_on_input)
        # w1 is the [E+B, I, H] gate tensor, w2 the [E+B, H, I] down tensor.
        moonep_experts(hidden_states, w1, layout.full_up_weight, w2, cu_seqlens,
                       route_weights, out=output)

    def _segments(self, activation: MoEActivation, topk_weights: torch.Tensor,
                  expert_tokens_meta: mk.ExpertTokensMetadata | None, apply_router_weight_on_input: bool):
        """What every ``apply`` checks and derives: ``(layout, cu_seqlens, route_weights)``."""
        name = type(self).__name__
        if activation != MoEActivation.SILU:
            raise NotImplementedError(f"{name}: activation {activation} is not SiLU")
        layout = self.weight_layout
        if layout is None:
            raise RuntimeError(f"{name}: process_weights_after_loading() has not run")
        if expert_tokens_meta is None or expert_tokens_meta.expert_num_tokens is None:
            raise ValueError(f"{name} needs per-row segment lengths in "
                             "expert_tokens_meta.expert_num_tokens (a MoonEP prepare)")
        if topk_weights.dim() != 1:
            raise ValueError(f"{name} expects route weights in [NvS] row order, got shape "
                             f"{tuple(topk_weights.shape)}: is the prepare/finalize MoonEP's?")
        # Segment ends on the device: no host sync, capture safe.
        cu_seqlens = torch.cumsum(expert_tokens_meta.expert_num_tokens, 0, dtype=torch.int32)
        # Top-1 input-weighted routing (Llama 4) was applied before dispatch.
        return layout, cu_seqlens, None if apply_router_weight_on_input else topk_weights
