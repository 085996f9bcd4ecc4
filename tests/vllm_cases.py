"""Shared by the vLLM tests: MoE problems, vLLM configs, loaded experts, and the moonep stub.

Imports vLLM: use only from tests that ``pytest.importorskip("vllm")`` first.
"""

import dataclasses

import torch

from vllm.distributed.device_communicators.all2all import MoonEPAll2AllManager
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import (
    MOONEP_DEFAULT_NUM_PREFETCH_SLOTS,
    MOONEP_DEFAULT_NUM_SMS,
    MOONEP_DEFAULT_TOKEN_PADDING,
    MoonEPBufferPool,
    MoonEPExpertWeightLayout,
    make_moonep_weight_layout,
)
from vllm.platforms import current_platform

from compile_tests.dense_moe import dense_moe_ref

NUM_PREFETCH = MOONEP_DEFAULT_NUM_PREFETCH_SLOTS  # B = 4
NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    topk: int
    skew: float = 0.0  # how strongly the router favours low expert ids
    on_input: bool = False  # apply_router_weight_on_input (top-1, Llama 4)
    invalid: int = 0  # routes set to -1 (padded slots from the engine)
    dtype: torch.dtype = torch.bfloat16

    def __str__(self):
        return self.name


CASES = [
    Case("one_token", 1, 128, 128, 4, 2),
    Case("uniform", 64, 128, 256, 8, 2),
    Case("skewed_top4", 200, 256, 128, 16, 4, skew=3.0),
    Case("all_experts", 48, 128, 128, 8, 8),
    Case("hot_expert", 90, 128, 384, 6, 3, skew=8.0),
    Case("top1_on_input", 150, 128, 128, 8, 1, skew=2.0, on_input=True),
    Case("invalid_ids", 40, 128, 128, 8, 2, invalid=7),
]


def ensure_workspace_manager() -> None:
    # Outside vLLM's CPU build the modular kernel takes its buffers from the workspace manager.
    if not current_platform.is_cpu():
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))


def moe_config(case: Case, activation=MoEActivation.SILU) -> FusedMoEConfig:
    parallel = FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=2, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0,
        ep_rank=0, sp_size=1, use_ep=True, all2all_backend="moonep", enable_eplb=False)
    return FusedMoEConfig(
        num_experts=case.experts, experts_per_token=case.topk, hidden_dim=case.hidden,
        intermediate_size=case.inter, num_local_experts=case.experts,
        num_logical_experts=case.experts, activation=activation, device="cpu",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
        in_dtype=case.dtype)


def make_problem(case: Case, tokens: int | None = None):
    """Tokens, routing and vLLM-layout weights (``w13`` [E, 2I, H] gate rows first, ``w2``)."""
    s = case.tokens if tokens is None else tokens
    h, i, e, k = case.hidden, case.inter, case.experts, case.topk
    x = torch.randn(s, h).to(case.dtype)
    w13 = (torch.randn(e, 2 * i, h) / h ** 0.5).to(case.dtype)
    w2 = (torch.randn(e, h, i) / i ** 0.5).to(case.dtype)
    return (x, *make_routing(case, s), w13, w2)


def make_routing(case: Case, tokens: int):
    """``(topk_ids [S, K] int32, topk_weights [S, K] fp32)`` for a fresh batch."""
    logits = torch.randn(tokens, case.experts) + case.skew * torch.linspace(1, 0, case.experts)
    top, ids = logits.topk(case.topk, dim=1)
    weights = torch.sigmoid(top) if case.on_input else top.softmax(dim=1)
    ids = ids.to(torch.int32)
    if case.invalid:
        flat = torch.randperm(tokens * case.topk)[:case.invalid]
        ids.view(-1)[flat] = -1
    return ids, weights.float()


def dense_reference(x, ids, weights, w13, w2, on_input) -> torch.Tensor:
    """Float64 ``sum_k w_k * down_e(silu(gate_e x) * up_e x)``; an id of -1 adds nothing."""
    inter = w2.shape[2]
    return dense_moe_ref(x, w13[:, :inter], w13[:, inter:], w2, ids, weights,
                         weights_on_input=on_input)


def weight_layout(w13, w2) -> MoonEPExpertWeightLayout:
    """vLLM's own ``[E+B]`` layout builder when it accepts the shapes, else the same by hand.
    Prefetch rows are NaN: prepare() must fill the ones a segment uses, and nothing may read
    the others."""
    h, i = w2.shape[1], w2.shape[2]
    if w13.dtype == torch.bfloat16 and h % 128 == 0 and i % 128 == 0:
        layout = make_moonep_weight_layout(w13.clone(), w2.clone(), NUM_PREFETCH)
    else:
        pad = lambda w: torch.cat([w, w.new_zeros(NUM_PREFETCH, *w.shape[1:])]).contiguous()  # noqa: E731
        layout = MoonEPExpertWeightLayout(pad(w13[:, :i]), pad(w13[:, i:]), pad(w2), NUM_PREFETCH)
    e = w13.shape[0]
    for w in layout[:3]:
        w[e:] = NAN
    return layout


def loaded_experts(experts_cls, case: Case, w13, w2):
    """Experts after ``process_weights_after_loading``, and their ``[E+B]`` weight layout."""
    layer = torch.nn.Module()
    layer._moonep_weight_layout = weight_layout(w13, w2)
    experts = experts_cls(moe_config(case), FUSED_MOE_UNQUANTIZED_CONFIG)
    experts.process_weights_after_loading(layer)
    return experts, layer._moonep_weight_layout


class OneRankAll2All:
    """What ``maybe_make_prepare_finalize`` needs of vLLM's ``MoonEPAll2AllManager``, for one rank:
    vLLM's own Buffer arguments and pool, without the process group."""

    world_size = 1
    dp_world_size = 1
    rank = 0
    cpu_group = None
    _device_group = None

    def get_handle(self, kwargs) -> MoonEPBufferPool:
        kw = MoonEPAll2AllManager._make_buffer_kwargs(self, **kwargs)
        return MoonEPBufferPool(kw, max_tokens_per_rank=kw["S"])


def buffer_pool(case: Case, max_tokens: int) -> MoonEPBufferPool:
    return OneRankAll2All().get_handle(dict(
        max_num_tokens_per_dp_rank=max_tokens, token_hidden_size=case.hidden, num_topk=case.topk,
        num_global_experts=case.experts, num_prefetch_slots=NUM_PREFETCH,
        token_padding=MOONEP_DEFAULT_TOKEN_PADDING, num_sms=MOONEP_DEFAULT_NUM_SMS))
