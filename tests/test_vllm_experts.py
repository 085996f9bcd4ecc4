"""MoonEPOpsExperts.apply against vLLM's MoonEPExperts and float64 references, on the layout MoonEP
hands the experts (built here with moonep_ops.layout); its device predicate (CPU; vLLM 0.33).
The experts inside FusedMoEKernel, with both MoonEP prepare/finalizes: test_vllm_prepare_finalize.py."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
    biased_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts.moonep_experts import MoonEPExperts  # noqa: E402

from moonep_ops import layout  # noqa: E402
from moonep_ops.vllm import MoonEPOpsExperts  # noqa: E402
from moonep_ops.vllm import experts as experts_module  # noqa: E402

from .reference import TOLERANCE, experts_ref, rel_err  # noqa: E402
from .vllm_cases import CASES, NAN, Case, loaded_experts, make_problem, moe_config  # noqa: E402
from .vllm_cases import dense_reference  # noqa: E402


def apply_args(experts, case: Case, x, ids, weights):
    """What vLLM's modular kernel hands ``experts.apply`` after a MoonEP prepare: rows from
    ``moonep_ops.layout.dispatch`` (NaN tail), the prefetch rows filled, per-row segment lengths.
    Returns the arguments and the dispatch (for combine)."""
    weights_layout = experts.weight_layout
    invalid = ids < 0  # vLLM's convention: expert 0, weight 0
    ids, weights = torch.where(invalid, 0, ids), torch.where(invalid, 0.0, weights)
    if case.on_input:
        x = (x.float() * weights).to(x.dtype)
    d = layout.dispatch(x, ids, weights, case.experts, token_padding=128,
                        num_prefetch=weights_layout.num_prefetch_slots, fill_tail=NAN)
    for w in weights_layout[:3]:
        w[case.experts:] = w[:case.experts].index_select(0, d.prefetch_for)
    lengths = torch.diff(d.cu_seqlens, prepend=d.cu_seqlens.new_zeros(1))
    meta = mk.ExpertTokensMetadata(expert_num_tokens=lengths, expert_num_tokens_cpu=None)
    args = dict(hidden_states=d.x_nvs, w1=weights_layout.full_gate_weight,
                w2=weights_layout.full_down_weight, topk_weights=d.route_weights, topk_ids=ids,
                activation=MoEActivation.SILU, global_num_experts=case.experts, expert_map=None,
                a1q_scale=None, a2_scale=None, workspace13=d.x_nvs.new_empty(0),
                workspace2=d.x_nvs.new_empty(0), expert_tokens_meta=meta,
                apply_router_weight_on_input=case.on_input)
    return args, d


def prepared(case: Case):
    """Experts with loaded weights, their layout, and ``apply`` arguments for one batch."""
    x, ids, weights, w13, w2 = make_problem(case)
    experts, weights_layout = loaded_experts(MoonEPOpsExperts, case, w13, w2)
    return experts, weights_layout, apply_args(experts, case, x, ids, weights)[0]


@pytest.mark.parametrize("case", [
    Case("fp32_odd_shapes", 37, 72, 40, 5, 2, skew=2.0, dtype=torch.float32),
    Case("fp32_top1_on_input", 29, 64, 48, 4, 1, on_input=True, dtype=torch.float32),
], ids=str)
def test_apply_fp32_any_shape(case):
    # Beyond vLLM's BF16-only path: the ops take fp32 and sizes that are not multiples of 128.
    x, ids, weights, w13, w2 = make_problem(case)
    experts, _ = loaded_experts(MoonEPOpsExperts, case, w13, w2)
    args, d = apply_args(experts, case, x, ids, weights)
    out = torch.full_like(args["hidden_states"], NAN)
    experts.apply(output=out, **args)
    moe = layout.combine(out, d)
    ref = dense_reference(x, ids, weights, w13, w2, case.on_input)
    assert moe.dtype == torch.float32 and rel_err(moe, ref) <= TOLERANCE[torch.float32]


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
    args2 = apply_args(experts, bigger, x, ids, weights)[0]
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


class Platform(SimpleNamespace):
    """What the device predicate asks of vLLM's ``current_platform``."""

    def is_cuda(self):
        return self.kind == "cuda"

    def is_cpu(self):
        return self.kind == "cpu"

    def has_device_capability(self, capability):
        return self.capability >= capability


@pytest.mark.parametrize("platform,allow_cpu,supported", [
    (Platform(kind="cuda", capability=80), False, False),  # A100: no MoonEP
    (Platform(kind="cuda", capability=89), False, False),
    (Platform(kind="cuda", capability=90), False, True),  # H100, H200
    (Platform(kind="cuda", capability=100), False, True),
    (Platform(kind="cpu", capability=0), False, False),
    (Platform(kind="cpu", capability=0), True, True),  # the test switch
    (Platform(kind="rocm", capability=0), True, False),
], ids=["sm80", "sm89", "sm90", "sm100", "cpu", "cpu_allowed", "rocm"])
def test_device_predicate_matches_moonep(monkeypatch, platform, allow_cpu, supported):
    monkeypatch.setattr(experts_module, "current_platform", platform)
    monkeypatch.setattr(MoonEPOpsExperts, "allow_cpu", allow_cpu)
    assert MoonEPOpsExperts._supports_current_device() is supported
    # The oracle asks through is_supported_config, which checks the device first.
    ok, reason = MoonEPOpsExperts.is_supported_config(
        MoonEPOpsExperts, moe_config(CASES[1]), None, None, mk.FusedMoEActivationFormat.Standard)
    assert ok is supported and (supported or "device" in str(reason).lower()), reason
