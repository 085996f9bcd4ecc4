"""MoonEPOpsExperts inside vLLM's FusedMoEKernel, against vLLM's MoonEPExperts and a dense
float64 MoE reference, with the one-device MoonEP prepare/finalize (CPU; vLLM 0.33)."""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    RoutingMethodType,
    biased_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts.moonep_experts import MoonEPExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import (  # noqa: E402
    MoonEPExpertWeightLayout,
    make_moonep_weight_layout,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: E402
    TopKWeightAndReduceContiguous,
)
from vllm.platforms import current_platform  # noqa: E402

from moonep_ops.vllm import MoonEPLayoutPrepareAndFinalize, MoonEPOpsExperts  # noqa: E402
from .reference import TOLERANCE, experts_ref, rel_err  # noqa: E402

NUM_PREFETCH = 4  # vLLM's MOONEP_DEFAULT_NUM_PREFETCH_SLOTS
NAN = float("nan")


@pytest.fixture(scope="module", autouse=True)
def _workspace_manager():
    # Outside vLLM's CPU build the modular kernel takes its buffers from the workspace manager.
    if not current_platform.is_cpu():
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))


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


def make_problem(case: Case):
    """Tokens, routing and vLLM-layout weights (``w13`` [E, 2I, H] gate rows first, ``w2``)."""
    s, h, i, e, k = case.tokens, case.hidden, case.inter, case.experts, case.topk
    x = torch.randn(s, h).to(case.dtype)
    w13 = (torch.randn(e, 2 * i, h) / h ** 0.5).to(case.dtype)
    w2 = (torch.randn(e, h, i) / i ** 0.5).to(case.dtype)
    logits = torch.randn(s, e) + case.skew * torch.linspace(1, 0, e)
    top, ids = logits.topk(k, dim=1)
    weights = torch.sigmoid(top) if case.on_input else top.softmax(dim=1)
    ids = ids.to(torch.int32)
    if case.invalid:
        flat = torch.randperm(s * k)[:case.invalid]
        ids.view(-1)[flat] = -1
    return x, ids, weights.float(), w13, w2


def dense_reference(x, ids, weights, w13, w2, on_input) -> torch.Tensor:
    """Token-major float64 MoE: ``sum_k w_k * down_e(silu(gate_e x) * up_e x)``."""
    x64, w13_64, w2_64 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for s in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, w = int(ids[s, j]), float(weights[s, j])
            if e < 0:
                continue  # an invalid route contributes nothing
            xs = x64[s] * w if on_input else x64[s]
            gate, up = w13_64[e, :inter] @ xs, w13_64[e, inter:] @ xs
            y = w2_64[e] @ (torch.nn.functional.silu(gate) * up)
            out[s] += y if on_input else w * y
    return out


def weight_layout(w13, w2) -> MoonEPExpertWeightLayout:
    """vLLM's own ``[E+B]`` layout builder when it accepts the shapes, else the same by hand.
    Prefetch rows are NaN: they must be filled by prepare() before the experts read them."""
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


def build_kernel(experts_cls, case: Case, w13, w2):
    layer = torch.nn.Module()
    layer._moonep_weight_layout = weight_layout(w13, w2)
    experts = experts_cls(moe_config(case), FUSED_MOE_UNQUANTIZED_CONFIG)
    experts.process_weights_after_loading(layer)
    prepare_finalize = MoonEPLayoutPrepareAndFinalize(case.experts, fill_tail=NAN)
    return mk.FusedMoEKernel(prepare_finalize, experts), layer._moonep_weight_layout


def run_kernel(experts_cls, case, x, ids, weights, w13, w2) -> torch.Tensor:
    kernel, layout = build_kernel(experts_cls, case, w13, w2)
    return kernel.apply(
        x, layout.full_gate_weight, layout.full_down_weight, weights, ids, MoEActivation.SILU,
        case.experts, None, case.on_input)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_vllm_experts_and_dense_reference(case):
    x, ids, weights, w13, w2 = make_problem(case)
    ref = dense_reference(x, ids, weights, w13, w2, case.on_input)
    ours = run_kernel(MoonEPOpsExperts, case, x, ids, weights, w13, w2)
    theirs = run_kernel(MoonEPExperts, case, x, ids, weights, w13, w2)
    assert ours.shape == x.shape and ours.dtype == x.dtype
    tol = TOLERANCE[case.dtype]
    assert rel_err(ours, ref) <= tol
    assert rel_err(theirs, ref) <= tol  # the harness itself agrees with vLLM's experts
    assert rel_err(ours, theirs.double()) <= tol


@pytest.mark.parametrize("case", [
    Case("fp32_odd_shapes", 37, 72, 40, 5, 2, skew=2.0, dtype=torch.float32),
    Case("fp32_top1_on_input", 29, 64, 48, 4, 1, on_input=True, dtype=torch.float32),
], ids=str)
def test_kernel_fp32_any_shape(case):
    # Beyond vLLM's BF16-only path: the ops take fp32 and sizes that are not multiples of 128.
    x, ids, weights, w13, w2 = make_problem(case)
    ref = dense_reference(x, ids, weights, w13, w2, case.on_input)
    out = run_kernel(MoonEPOpsExperts, case, x, ids, weights, w13, w2)
    assert out.dtype == torch.float32 and rel_err(out, ref) <= TOLERANCE[torch.float32]


def apply_args(experts, case: Case, x, ids, weights) -> dict:
    """The arguments vLLM's modular kernel hands ``experts.apply`` after our prepare()."""
    layout = experts.weight_layout
    pf = MoonEPLayoutPrepareAndFinalize(case.experts, fill_tail=NAN)
    pf.post_init_setup(experts)
    x_nvs, scale, meta, _, route = pf.prepare(x, weights, ids, case.experts, None, case.on_input,
                                              FUSED_MOE_UNQUANTIZED_CONFIG)
    assert scale is None and route.dtype == torch.float32 and route.shape == x_nvs.shape[:1]
    return dict(hidden_states=x_nvs, w1=layout.full_gate_weight, w2=layout.full_down_weight,
                topk_weights=route, topk_ids=ids, activation=MoEActivation.SILU,
                global_num_experts=case.experts, expert_map=None, a1q_scale=None, a2_scale=None,
                workspace13=x_nvs.new_empty(0), workspace2=x_nvs.new_empty(0),
                expert_tokens_meta=meta, apply_router_weight_on_input=case.on_input)


def prepared(case: Case):
    """Experts with loaded weights, their layout, and ``apply`` arguments for one batch."""
    x, ids, weights, w13, w2 = make_problem(case)
    layer = torch.nn.Module()
    layer._moonep_weight_layout = weight_layout(w13, w2)
    experts = MoonEPOpsExperts(moe_config(case), FUSED_MOE_UNQUANTIZED_CONFIG)
    experts.process_weights_after_loading(layer)
    return experts, layer._moonep_weight_layout, apply_args(experts, case, x, ids, weights)


@pytest.mark.parametrize("case", [CASES[2], CASES[5]], ids=str)
def test_apply_writes_into_output(case):
    experts, layout, args = prepared(case)
    x_nvs, meta = args["hidden_states"], args["expert_tokens_meta"]
    cu = torch.cumsum(meta.expert_num_tokens, 0, dtype=torch.int32)
    end = int(cu[-1])
    assert end < x_nvs.shape[0] and torch.isnan(x_nvs[end:]).all()  # the undefined tail is poisoned

    output = torch.full_like(x_nvs, NAN)
    ptr = output.data_ptr()
    assert experts.apply(output=output, **args) is None
    assert output.data_ptr() == ptr
    assert torch.equal(output[end:], torch.zeros_like(output[end:]))  # the ops zero the tail
    route = None if case.on_input else args["topk_weights"]
    ref = experts_ref(x_nvs, layout.full_gate_weight, layout.full_up_weight,
                      layout.full_down_weight, cu, route)
    assert rel_err(output, ref) <= TOLERANCE[case.dtype]

    theirs = torch.full_like(x_nvs, NAN)
    MoonEPExperts.apply(experts, output=theirs, **args)
    assert rel_err(output[:end], theirs[:end].double()) <= TOLERANCE[case.dtype]


def test_apply_traces_with_dynamo_fullgraph():
    case = Case("dynamo", 50, 128, 128, 8, 2, skew=1.0)
    experts, _, args = prepared(case)
    bigger = dataclasses.replace(case, tokens=200)
    x, ids, weights, _, _ = make_problem(bigger)
    args2 = apply_args(experts, bigger, x, ids, weights)
    assert args2["hidden_states"].shape[0] != args["hidden_states"].shape[0]

    seen = []

    def backend(gm, example_inputs):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")})
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)  # runs the fakes

    torch._dynamo.reset()
    compiled = torch.compile(experts.apply, backend=backend, fullgraph=True, dynamic=True)
    for a in (args, args2):
        expected = torch.full_like(a["hidden_states"], NAN)
        experts.apply(output=expected, **a)
        got = torch.full_like(a["hidden_states"], NAN)
        compiled(output=got, **a)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(seen) == 1, "NvS changed and Dynamo recompiled"
    assert any("moonep.experts_out" in t for t in seen[0]), seen[0]  # one op, straight into output
    # Nothing reads device data on the host (on CUDA that would be a sync inside the step).
    assert not any(t in ("item", "tolist", "cpu") or "local_scalar_dense" in t for t in seen[0]), seen[0]


def test_unsupported_configurations_fail_clearly():
    case = CASES[1]
    with pytest.raises(NotImplementedError, match="activation"):
        MoonEPOpsExperts(moe_config(case, MoEActivation.GELU), FUSED_MOE_UNQUANTIZED_CONFIG)
    with pytest.raises(NotImplementedError, match="quant_dtype"):
        MoonEPOpsExperts(moe_config(case), FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn))
    with pytest.raises(NotImplementedError, match="bias"):
        MoonEPOpsExperts(moe_config(case), biased_moe_quant_config(torch.zeros(8, 512), None))

    experts = MoonEPOpsExperts(moe_config(case), FUSED_MOE_UNQUANTIZED_CONFIG)
    _, _, args = prepared(case)
    out = torch.empty_like(args["hidden_states"])
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        experts.apply(output=out, **args)

    experts, _, args = prepared(case)
    token_major = dict(args, topk_weights=torch.rand(case.tokens, case.topk))
    with pytest.raises(ValueError, match="NvS"):
        experts.apply(output=out, **token_major)


def test_prepare_finalize_contract_errors():
    case = CASES[1]
    x, ids, weights, w13, w2 = make_problem(case)
    kernel, _ = build_kernel(MoonEPOpsExperts, case, w13, w2)
    pf = kernel.prepare_finalize
    with pytest.raises(ValueError, match="top-1"):
        pf.prepare(x, weights, ids, case.experts, None, True, FUSED_MOE_UNQUANTIZED_CONFIG)
    x_nvs, _, _, _, _ = pf.prepare(x, weights, ids, case.experts, None, False,
                                   FUSED_MOE_UNQUANTIZED_CONFIG)
    with pytest.raises(RuntimeError, match="before finalize"):
        pf.prepare(x, weights, ids, case.experts, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
    with pytest.raises(ValueError, match="TopKWeightAndReduceNoOP"):
        pf.finalize(torch.empty_like(x), torch.zeros_like(x_nvs), weights, ids, False,
                    TopKWeightAndReduceContiguous())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_apply_matches_and_captures_in_a_cuda_graph():
    # Inside vLLM the experts run in the opaque vllm::moe_forward op: what counts on CUDA is
    # that apply is right and captures (any host sync would abort the capture).
    case = Case("cuda", 256, 512, 256, 16, 4, skew=3.0)
    x, ids, weights, w13, w2 = (t.cuda() for t in make_problem(case))
    layer = torch.nn.Module()
    layer._moonep_weight_layout = weight_layout(w13, w2)
    experts = MoonEPOpsExperts(moe_config(case), FUSED_MOE_UNQUANTIZED_CONFIG)
    experts.process_weights_after_loading(layer)
    layout = layer._moonep_weight_layout

    def reference(args):
        cu = torch.cumsum(args["expert_tokens_meta"].expert_num_tokens, 0, dtype=torch.int32)
        return experts_ref(args["hidden_states"], layout.full_gate_weight, layout.full_up_weight,
                           layout.full_down_weight, cu, args["topk_weights"])

    args = apply_args(experts, case, x, ids, weights)
    out = torch.full_like(args["hidden_states"], NAN)
    experts.apply(output=out, **args)  # also compiles the Triton kernels before capture
    assert rel_err(out, reference(args)) <= TOLERANCE[case.dtype]

    static_out = torch.full_like(out, NAN)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts.apply(output=static_out, **args)

    # A new batch of the same size has the same NvS: copy it into the captured inputs.
    x2, ids2, weights2, _, _ = (t.cuda() for t in make_problem(case))
    args2 = apply_args(experts, case, x2, ids2, weights2)
    args["hidden_states"].copy_(args2["hidden_states"])
    args["topk_weights"].copy_(args2["topk_weights"])
    args["expert_tokens_meta"].expert_num_tokens.copy_(args2["expert_tokens_meta"].expert_num_tokens)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(static_out, reference(args2)) <= TOLERANCE[case.dtype]
