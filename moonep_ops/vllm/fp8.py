"""FP8 block-quantized MoE under vLLM 0.33's MoonEP backend: ``--quantization moonep_fp8``.

vLLM 0.33 runs MoonEP for unquantized (BF16) models only: ``VllmConfig`` refuses any
quantization with ``--all2all-backend moonep``, the FP8 MoE oracle has no MoonEP backend, and
MoonEP's weight layout, prepare and experts are BF16-only. This module adds the FP8 path for
checkpoints in the DeepSeek-V3 format (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
e4m3fn weights with fp32 ``weight_scale_inv``) through vLLM's supported seams, piece by piece:

- :class:`MoonEPFp8Config`, registered by the plugin as the quantization method ``moonep_fp8``
  (``register_quantization_config``): vLLM's ``Fp8Config`` whose MoE layers get
  :class:`MoonEPFp8MoEMethod` when they run under MoonEP; everything else (linear layers,
  KV-cache scales, MoE layers under other all2all backends) stays ``Fp8Config``'s. Choosing it
  (``--quantization moonep_fp8``) is the opt-in; the one monkeypatch,
  :mod:`moonep_ops.vllm.config_gate`, lets ``VllmConfig`` accept it with MoonEP (vLLM refuses
  any quantization there) and changes nothing for any other configuration.
- :class:`MoonEPFp8MoEMethod`: vLLM's ``Fp8MoEMethod`` (its ``create_weights``, weight loading,
  quant config and ``apply``) whose experts are :class:`MoonEPOpsFp8Experts` instead of the FP8
  oracle's choice (the oracle has no MoonEP entry and no registry for one), and whose
  ``_setup_kernel`` builds MoonEP's ``[E+B]`` layout with scales
  (:mod:`moonep_ops.vllm.fp8_layout`) the way vLLM's unquantized MoonEP path does for BF16.
- :class:`MoonEPOpsFp8Experts`: ``MoonEPOpsExperts`` on ``moonep_ops.moonep_experts`` with
  FP8 weights and block scales; it takes the dispatched rows in BF16 and quantizes them itself.

Memory: like vLLM's BF16 MoonEP path, every rank holds every expert (``[E+B]``, replicated).
That fits models like Qwen3-30B-A3B-FP8 (about 29 GB of experts per rank), not DeepSeek-V3 or
Kimi-K2 (docs/vllm.md, "FP8").
"""

import logging

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.experts.moonep_experts import MoonEPExperts
from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
    Fp8MoeBackend,
    resolve_fp8_moe_weight_block_shape,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import (
    MOONEP_DEFAULT_NUM_PREFETCH_SLOTS,
)
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    is_layer_skipped,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)
from vllm.model_executor.utils import replace_parameter

from ..ops import moonep_experts
from . import config_gate, device
from .experts import MoonEPOpsExperts
from .fp8_layout import MoonEPFp8WeightLayout, make_fp8_weight_layout

logger = logging.getLogger(__name__)

QUANTIZATION = config_gate.QUANTIZATION  # "moonep_fp8"
BLOCK_SHAPE = [128, 128]
WEIGHT_KEY = kFp8Static128BlockSym  # e4m3 weights, static fp32 scale per 128x128 block
ACTIVATION_KEY = kFp8Dynamic128Sym  # activations quantized per row and 128 columns, at run time


# ---------------------------------------------------------------------------------------------
# Experts


def _check_fp8_supported(moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig) -> None:
    """Refuse, at construction, what ``moonep_ops.moonep_experts`` does not compute."""
    name = "MoonEPOpsFp8Experts"
    if quant_config.quant_dtype != torch.float8_e4m3fn or list(quant_config.block_shape or ()) != BLOCK_SHAPE:
        raise NotImplementedError(
            f"{name} runs float8_e4m3fn experts with 128x128 block scales only; got quant_dtype="
            f"{quant_config.quant_dtype}, block_shape={quant_config.block_shape}")
    if quant_config.per_act_token_quant or quant_config.per_out_ch_quant:
        raise NotImplementedError(f"{name}: per-token / per-channel scales are not block scales")
    if quant_config.a1_scale is not None or quant_config.a2_scale is not None:
        raise NotImplementedError(f"{name} quantizes activations dynamically; static input scales "
                                  "(activation_scheme 'static') are not supported")
    if quant_config.w1_scale is None or quant_config.w2_scale is None:
        raise ValueError(f"{name} needs the weights' block scales (w1_scale, w2_scale)")
    if quant_config.w1_bias is not None or quant_config.w2_bias is not None:
        raise NotImplementedError(f"{name} has no expert biases (w1_bias/w2_bias)")
    if moe_config.activation != MoEActivation.SILU:
        raise NotImplementedError(f"{name} computes silu(gate) * up only; got activation "
                                  f"{moe_config.activation}")
    variants = (moe_config.swiglu_limit, moe_config.swiglu_alpha, moe_config.swiglu_beta,
                quant_config.gemm1_alpha, quant_config.gemm1_beta, quant_config.gemm1_clamp_limit)
    if any(v is not None for v in variants):
        raise NotImplementedError(f"{name} has no SwiGLU limit/alpha/beta variants")


class MoonEPOpsFp8Experts(MoonEPOpsExperts):
    """MoonEP experts on FP8 block-quantized weights: ``moonep_ops.moonep_experts`` with scales.

    vLLM hands ``apply`` the ``[E+B]`` gate (``w1``) and down (``w2``) e4m3fn tensors, their
    block scales through the quant config (``self.w1_scale``, ``self.w2_scale``), and the
    dispatched rows in BF16: ``expects_unquantized_inputs`` makes vLLM's modular kernel call
    ``prepare`` with ``defer_input_quant=True`` (as for FlashInfer CUTLASS), and the op quantizes
    each row per 128 columns itself (docs/fp8.md). The up projection and its scales come from
    the layout, as in ``MoonEPExperts``. Everything but the quantization scheme (device, SiLU,
    MoonEP parallel config without EPLB, no chunking, no expert map, NoOP finalize) is
    ``MoonEPOpsExperts``'.
    """

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 max_num_tokens: int | None = None, num_dispatchers: int | None = None):
        _check_fp8_supported(moe_config, quant_config)
        # MoonEPOpsExperts.__init__ and MoonEPExperts.__init__ refuse a quantized config: run the
        # modular experts' own __init__ and set what MoonEPExperts.__init__ sets.
        super(MoonEPExperts, self).__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        self._weight_layout = None

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key == WEIGHT_KEY and activation_key == ACTIVATION_KEY

    @property
    def expects_unquantized_inputs(self) -> bool:
        # MoonEP dispatches BF16 rows; the op quantizes them (per row, per 128 columns).
        return True

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layout = getattr(layer, "_moonep_weight_layout", None)
        if not isinstance(layout, MoonEPFp8WeightLayout):
            raise RuntimeError("MoonEPOpsFp8Experts needs the layer's FP8 [E+B] layout "
                               "(_moonep_weight_layout, built by MoonEPFp8MoEMethod); got "
                               f"{type(layout).__name__}")
        # The quant config must carry the layout's scales (built after the layout replaced the
        # layer's scale parameters), or prefetched slots would never reach the op.
        for name, scale, want in (("w1_scale", self.w1_scale, layout.full_gate_scale),
                                  ("w2_scale", self.w2_scale, layout.full_down_scale)):
            if scale is None or scale.shape != want.shape or scale.data_ptr() != want.data_ptr():
                raise RuntimeError(f"MoonEPOpsFp8Experts: quant_config.{name} is not the [E+B] "
                                   "layout's scale tensor; build the kernel after the layout")
        self._weight_layout = layout

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
              a2_scale: torch.Tensor | None, workspace13: torch.Tensor,
              workspace2: torch.Tensor, expert_tokens_meta: mk.ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool) -> None:
        if a1q_scale is not None or hidden_states.dtype not in (torch.bfloat16, torch.float16):
            raise NotImplementedError(f"{type(self).__name__} takes BF16/FP16 rows and quantizes them itself; "
                                      f"got {hidden_states.dtype} rows with a1q_scale "
                                      f"{'set' if a1q_scale is not None else 'None'}")
        layout, cu_seqlens, route_weights = self._segments(activation, topk_weights, expert_tokens_meta,
                                                           apply_router_weight_on_input)
        # w1 is the [E+B, I, H] gate tensor, w2 the [E+B, H, I] down tensor, all e4m3fn and
        # block-major underneath (the layout's rows_view): the op takes their blocks.
        w1, w2 = w1.view(layout.full_gate_weight.shape), w2.view(layout.full_down_weight.shape)
        moonep_experts(hidden_states, w1, layout.full_up_weight, w2, cu_seqlens, route_weights,
                       out=output, w_gate_scale=self.w1_scale, w_up_scale=layout.full_up_scale,
                       w_down_scale=self.w2_scale)


# ---------------------------------------------------------------------------------------------
# Weights: vLLM's loaded FP8 tensors -> MoonEP's [E+B] layout


def _ep_group():
    from vllm.distributed import get_ep_group

    return get_ep_group()


def gather_fp8_weight_layout(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                             w2_scale: torch.Tensor, num_global_experts: int,
                             num_prefetch_slots: int) -> MoonEPFp8WeightLayout:
    """vLLM's ``gather_moonep_weight_layout`` for FP8: all-gather this rank's experts (weights as
    uint8 bytes, and their fp32 scales) into global order, then build the replicated layout."""
    group = _ep_group()
    if group.world_size > 1:
        if w13.shape[0] * group.world_size != num_global_experts:
            raise NotImplementedError(
                "MoonEP requires num_experts to be evenly divisible across EP ranks: "
                f"{num_global_experts} experts, {group.world_size} ranks")

        def gather(t):
            if t.dtype == torch.float8_e4m3fn:
                return group.all_gather(t.contiguous().view(torch.uint8), dim=0).view(t.dtype)
            return group.all_gather(t.contiguous(), dim=0)

        w13, w2, w13_scale, w2_scale = (gather(t) for t in (w13, w2, w13_scale, w2_scale))
    return make_fp8_weight_layout(w13, w2, w13_scale, w2_scale, num_prefetch_slots)


def _require_scale_prefetch() -> None:
    """Refuse early (model construction, before weights load) when the installed MoonEP cannot
    prefetch block scales; the prepare/finalize checks its Buffers again at kernel build."""
    try:
        from moonep import Buffer
    except ImportError as e:
        raise RuntimeError(f"{QUANTIZATION}: the MoonEP backend needs the `moonep` package ({e})") from e
    if not device.supports_scale_prefetch(Buffer):
        raise RuntimeError(
            f"{QUANTIZATION}: the installed MoonEP cannot prefetch FP8 block scales "
            f"(moonep.Buffer.prefetch_weight has no {', '.join(device.SCALE_PREFETCH_ARGS)} "
            "arguments), so a prefetched expert would run with another expert's scales. Install a "
            "MoonEP whose [E+B] prefetch_weight takes full_gate_scale/full_up_scale/full_down_scale "
            "(e.g. the zhumakhan/MoonEP fork), or serve an unquantized (BF16) checkpoint.")


_LOGGED: set = set()


def _log_once(msg: str, *args) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.info(msg, *args)


# ---------------------------------------------------------------------------------------------
# The MoE method


class MoonEPFp8MoEMethod(Fp8MoEMethod):
    """``Fp8MoEMethod`` for a MoE layer under MoonEP: :class:`MoonEPOpsFp8Experts` and the
    ``[E+B]`` FP8 layout.

    ``__init__`` does what ``Fp8MoEMethod.__init__`` does for 128x128 block scales except ask the
    FP8 oracle (``select_fp8_moe_backend``) for experts: the oracle has no MoonEP backend and no
    way to register one, its choice (FlashInfer CUTLASS, DeepGEMM or Triton on an H200) would
    not run behind MoonEP, and it can raise for configurations this path supports (an explicit
    ``--moe-backend``, ``VLLM_USE_DEEP_GEMM``). Instead it checks
    ``MoonEPOpsFp8Experts.is_supported_config`` itself, as the oracle would. The backend tag is
    ``TRITON``: the one whose weight conversion is a no-op and whose quant config is the standard
    block one (``fp8_w8a8_moe_quant_config``, block [128, 128]).

    ``create_weights``, weight loading, ``process_weights_after_loading``, the quant config and
    ``apply`` are vLLM's. ``_setup_kernel`` replaces the layer's w13/w2 weights and scales with the
    layout's ``[E+B]`` gate and down tensors (``w13_weight`` becomes the gate, as in vLLM's BF16
    MoonEP path), builds the kernel from them, and hands the layer to the experts, which the FP8
    method of vLLM 0.33 never does (its unquantized method does).
    """

    # The [E+B] layout is built from the loaded checkpoint tensors (like vLLM's MoonEP path).
    supports_pre_processed_weights = False

    def __init__(self, quant_config: Fp8Config, layer: RoutedExperts):
        FusedMoEMethodBase.__init__(self, layer.moe_config)
        if list(quant_config.weight_block_size or ()) != BLOCK_SHAPE:
            raise NotImplementedError(f"{QUANTIZATION}: weight_block_size must be {BLOCK_SHAPE}, got "
                                      f"{quant_config.weight_block_size}")
        # Fp8MoEMethod.__init__'s attributes, for block quantization.
        self.quant_config = quant_config
        self.weight_block_size = quant_config.weight_block_size
        self.block_quant = True
        self.weight_scale_name = "weight_scale_inv"
        self.moe_block_shape, self.weight_scale_refine = resolve_fp8_moe_weight_block_shape(
            self.moe, self.weight_block_size, ACTIVATION_KEY, quant_config.is_checkpoint_fp8_serialized)
        if list(self.moe_block_shape) != BLOCK_SHAPE or self.weight_scale_refine is not None:
            raise NotImplementedError(
                f"{QUANTIZATION}: the MoE block scales would be refined to {self.moe_block_shape} for "
                f"tensor parallelism (intermediate size per partition "
                f"{self.moe.intermediate_size_per_partition}); MoonEP runs expert parallel with whole "
                "128x128 blocks")
        self.per_act_token_quant = False
        self.fp8_backend = Fp8MoeBackend.TRITON
        self.experts_cls = MoonEPOpsFp8Experts
        ok, reason = MoonEPOpsFp8Experts.is_supported_config(
            MoonEPOpsFp8Experts, self.moe, WEIGHT_KEY, ACTIVATION_KEY,
            mk.FusedMoEActivationFormat.Standard)
        if not ok:
            raise NotImplementedError(f"{QUANTIZATION}: MoonEPOpsFp8Experts cannot run this MoE layer: "
                                      f"{reason}")
        _require_scale_prefetch()
        _log_once("moonep_ops: %s: FP8 MoE layers under MoonEP run MoonEPOpsFp8Experts", QUANTIZATION)

    @property
    def supports_eplb(self) -> bool:
        # EPLB moves local expert rows; the replicated [E+B] layout does not follow them.
        return False

    def _setup_kernel(self, layer: RoutedExperts, w13: torch.Tensor, w2: torch.Tensor,
                      w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                      w13_input_scale: torch.Tensor | None,
                      w2_input_scale: torch.Tensor | None) -> None:
        if w13_input_scale is not None or w2_input_scale is not None:
            raise NotImplementedError(f"{QUANTIZATION}: static input scales are not supported")
        if getattr(layer, "_moonep_weight_layout", None) is not None:
            # As vLLM's MoonEP path: the source-format tensors were replaced by the layout.
            raise NotImplementedError("MoonEP does not support in-place weight reloads yet")
        layout = gather_fp8_weight_layout(w13, w2, w13_scale, w2_scale,
                                          num_global_experts=self.moe.num_experts,
                                          num_prefetch_slots=MOONEP_DEFAULT_NUM_PREFETCH_SLOTS)
        layer._moonep_weight_layout = layout
        replace_parameter(layer, "w13_weight", layout.rows_view(layout.full_gate_weight))
        replace_parameter(layer, "w2_weight", layout.rows_view(layout.full_down_weight))
        replace_parameter(layer, f"w13_{self.weight_scale_name}", layout.full_gate_scale)
        replace_parameter(layer, f"w2_{self.weight_scale_name}", layout.full_down_scale)
        self._init_moe_kernel(layer)
        self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    def _init_moe_kernel(self, layer: RoutedExperts) -> None:
        super()._init_moe_kernel(layer)
        from .prepare_finalize import MoonEPOpsPrepareAndFinalize

        pf = self.moe_kernel.prepare_finalize
        if not isinstance(pf, MoonEPOpsPrepareAndFinalize):
            # vLLM's own MoonEPPrepareAndFinalize refuses quantized experts only in a forward.
            raise RuntimeError(
                f"{QUANTIZATION}: the MoonEP prepare/finalize is {type(pf).__qualname__}, not "
                "moonep_ops' MoonEPOpsPrepareAndFinalize (is the moonep_ops vLLM plugin loaded, and "
                "did something else replace all2all_utils.MoonEPPrepareAndFinalize?)")


# ---------------------------------------------------------------------------------------------
# The quantization config


class MoonEPFp8Config(Fp8Config):
    """``Fp8Config`` for 128x128 block FP8 checkpoints whose MoE layers run under MoonEP.

    Registered as ``moonep_fp8``; ``--quantization moonep_fp8`` selects it for a checkpoint whose
    ``quantization_config`` says ``quant_method: fp8`` (vLLM asks every registered method's
    ``override_quantization_method``, custom ones first). It reads the checkpoint's config like
    ``Fp8Config`` (``from_config`` builds ``cls``) and stays an ``Fp8Config`` for every
    ``isinstance`` check in vLLM's model code.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if list(self.weight_block_size or ()) != BLOCK_SHAPE:
            raise ValueError(f"--quantization {QUANTIZATION} serves FP8 checkpoints with "
                             f"weight_block_size {BLOCK_SHAPE}; got {self.weight_block_size}")

    @classmethod
    def get_name(cls) -> str:
        return QUANTIZATION

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        """``moonep_fp8`` for an FP8 128x128 block checkpoint when the user asked for it
        (``--quantization moonep_fp8``), and never otherwise; a checkpoint in another format is
        refused here, with its format in the message, rather than by vLLM's generic mismatch."""
        if user_quant != QUANTIZATION:
            return None
        method = hf_quant_cfg.get("quant_method")
        block = hf_quant_cfg.get("weight_block_size")
        scheme = hf_quant_cfg.get("activation_scheme", "dynamic")
        if method != "fp8" or list(block or ()) != BLOCK_SHAPE or scheme != "dynamic":
            raise ValueError(
                f"--quantization {QUANTIZATION} serves checkpoints quantized with quant_method 'fp8', "
                f"weight_block_size {BLOCK_SHAPE} and dynamic activations (DeepSeek-V3 format); this "
                f"one has quant_method={method!r}, weight_block_size={block}, "
                f"activation_scheme={scheme!r}")
        return QUANTIZATION

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if (isinstance(layer, RoutedExperts) and layer.moe_config.use_moonep_kernels
                and self.store_dtype is None
                and not is_layer_skipped(prefix=prefix, ignored_layers=self.ignored_layers,
                                         fused_mapping=self.packed_modules_mapping,
                                         match_mode=self.ignored_layers_match_mode)):
            return MoonEPFp8MoEMethod(self, layer)
        return super().get_quant_method(layer, prefix)
