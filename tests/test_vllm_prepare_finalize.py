"""vLLM's MoonEPPrepareAndFinalize and MoonEPOpsPrepareAndFinalize, each with vLLM's MoonEPExperts
and with MoonEPOpsExperts, through vLLM's real FusedMoEKernel on the one-device moonep stub (CPU;
vLLM 0.33), against a dense float64 MoE; and what our prepare/finalize does not do in a forward."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.moonep_experts import MoonEPExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import (  # noqa: E402
    MoonEPPrepareAndFinalize,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: E402
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceNoOP,
)

from moonep_ops.vllm import MoonEPOpsExperts, MoonEPOpsPrepareAndFinalize  # noqa: E402
from moonep_ops.vllm import prepare_finalize as ours_module  # noqa: E402
from moonep_ops.vllm.prepare_finalize import pool_capacities  # noqa: E402

from . import moonep_stub, vllm_cases as vc  # noqa: E402
from .reference import TOLERANCE, rel_err  # noqa: E402

MAX_TOKENS = 512  # capacities 128, 256, 512
PREPARE_FINALIZE = [MoonEPPrepareAndFinalize, MoonEPOpsPrepareAndFinalize]
EXPERTS = [MoonEPExperts, MoonEPOpsExperts]


@pytest.fixture(autouse=True)
def moonep(monkeypatch):
    vc.ensure_workspace_manager()
    return moonep_stub.use(monkeypatch, "cpu")


def build(pf_cls, experts_cls, case, w13, w2, max_tokens=MAX_TOKENS):
    experts, layout = vc.loaded_experts(experts_cls, case, w13, w2)
    pf = pf_cls(vc.buffer_pool(case, max_tokens), max_tokens, 1, case.experts)
    return mk.FusedMoEKernel(pf, experts), layout


def run(kernel, layout, case, x, ids, weights):
    return kernel.apply(x, layout.full_gate_weight, layout.full_down_weight, weights, ids,
                        MoEActivation.SILU, case.experts, None, case.on_input)


@pytest.mark.parametrize("case", vc.CASES, ids=str)
def test_every_pairing_matches_dense_reference(case):
    x, ids, weights, w13, w2 = vc.make_problem(case)
    ref = vc.dense_reference(x, ids, weights, w13, w2, case.on_input)
    tol = TOLERANCE[case.dtype]
    outs = {}
    for pf_cls in PREPARE_FINALIZE:
        for experts_cls in EXPERTS:
            kernel, layout = build(pf_cls, experts_cls, case, w13, w2)
            out = run(kernel, layout, case, x, ids, weights)
            assert out.shape == x.shape and out.dtype == x.dtype
            assert rel_err(out, ref) <= tol, (pf_cls.__name__, experts_cls.__name__)
            outs[pf_cls, experts_cls] = out
    for experts_cls in EXPERTS:  # same experts, either prepare/finalize
        a, b = outs[MoonEPPrepareAndFinalize, experts_cls], outs[MoonEPOpsPrepareAndFinalize, experts_cls]
        assert rel_err(b, a.double()) <= tol


def test_invalid_top1_route_with_weights_on_input_adds_nothing():
    # vLLM's prepare scales the token by the weight of an invalid route before it maps the route
    # to expert 0, so expert 0's output of that token reaches the layer output; ours zeroes
    # the weight first.
    case = vc.Case("top1_invalid", 60, 128, 128, 8, 1, on_input=True, invalid=12)
    x, ids, weights, w13, w2 = vc.make_problem(case)
    ref = vc.dense_reference(x, ids, weights, w13, w2, True)
    ours = run(*build(MoonEPOpsPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2), case, x, ids, weights)
    assert rel_err(ours, ref) <= TOLERANCE[case.dtype]
    theirs = run(*build(MoonEPPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2), case, x, ids, weights)
    invalid = (ids < 0).any(1)
    assert rel_err(theirs[~invalid], ref[~invalid]) <= TOLERANCE[case.dtype]
    assert rel_err(theirs[invalid], ref[invalid]) > 0.5  # vLLM 0.33's behaviour


class HostReads(TorchDispatchMode):
    """Records every aten op; Tensor.tolist/numpy raise (they read data without an aten op)."""

    SYNCING = ("aten._local_scalar_dense", "aten.bincount", "aten.nonzero", "aten.masked_select",
               "aten.unique", "aten._unique", "aten.repeat_interleave.Tensor")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            name += "(bool mask)"  # a data-sized result
        self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy

        def refuse(*_, **__):
            raise AssertionError("a host read of device data inside prepare/finalize")

        torch.Tensor.tolist = torch.Tensor.numpy = refuse
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)

    def syncs(self):
        return sorted({op for op in self.ops if op.startswith(self.SYNCING) or "bool mask" in op})


def recorded(pf, monkeypatch) -> HostReads:
    """Record what pf.prepare and pf.finalize run (not the experts in between)."""
    mode = HostReads()
    for name in ("prepare", "finalize"):
        method = getattr(pf, name)

        def wrapped(*args, _method=method, **kwargs):
            with mode:
                return _method(*args, **kwargs)

        monkeypatch.setattr(pf, name, wrapped)
    return mode


def test_forward_reads_no_device_data_on_the_host(monkeypatch):
    case = vc.CASES[2]
    x, ids, weights, w13, w2 = vc.make_problem(case)
    kernel, layout = build(MoonEPOpsPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2)
    mode = recorded(kernel.prepare_finalize, monkeypatch)
    run(kernel, layout, case, x, ids, weights)
    assert "aten.scatter_add_.default" in mode.ops  # the histogram
    assert mode.syncs() == []

    kernel, layout = build(MoonEPPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2)
    mode = recorded(kernel.prepare_finalize, monkeypatch)
    run(kernel, layout, case, x, ids, weights)
    assert mode.syncs() == ["aten.bincount.default"]  # vLLM 0.33: a device-to-host sync on CUDA


def test_buffers_are_made_at_kernel_construction_and_outputs_stay_put(moonep, monkeypatch):
    case = vc.CASES[1]
    x, ids, weights, w13, w2 = vc.make_problem(case)
    before = moonep.Buffer.instances
    kernel, layout = build(MoonEPOpsPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2)
    pf = kernel.prepare_finalize
    assert pool_capacities(pf.buffer_pool) == [128, 256, 512]
    assert moonep.Buffer.instances == before + 3
    # A second layer on the same pool shares its Buffers and its staging tensors.
    experts2, _ = vc.loaded_experts(MoonEPOpsExperts, case, w13, w2)
    pf2 = MoonEPOpsPrepareAndFinalize(pf.buffer_pool, MAX_TOKENS, 1, case.experts)
    mk.FusedMoEKernel(pf2, experts2)
    assert moonep.Buffer.instances == before + 3
    assert all(pf2._staging[c] is pf._staging[c] for c in (128, 256, 512))

    returned = []
    prepare = pf.prepare

    def keep(*args, **kwargs):
        returned.append(prepare(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(pf, "prepare", keep)
    for tokens in (64, 100, 300, 70):  # capacities 128, 128, 512, 128
        x, ids, weights = vc.make_problem(case, tokens)[:3]
        out = run(kernel, layout, case, x, ids, weights)
        assert rel_err(out, vc.dense_reference(x, ids, weights, w13, w2, False)) <= TOLERANCE[case.dtype]
    assert moonep.Buffer.instances == before + 3  # none made in a forward

    def addresses(result):
        hidden, _, meta, _, route = result
        return hidden.data_ptr(), route.data_ptr(), meta.expert_num_tokens.data_ptr()

    assert addresses(returned[0]) == addresses(returned[1]) == addresses(returned[3])
    assert addresses(returned[2]) != addresses(returned[0])  # another capacity, its own Buffer
    _, buffer = pf.buffer_pool.get(128)
    assert returned[0][0].data_ptr() == buffer.hidden_nvsh_buffer_view.data_ptr()  # zero-copy

    # vLLM's own prepare/finalize makes its Buffer inside the first forward.
    kernel, layout = build(MoonEPPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2)
    made = moonep.Buffer.instances
    run(kernel, layout, case, x, ids, weights)
    assert moonep.Buffer.instances == made + 1


def test_capacity_follows_the_largest_data_parallel_rank(monkeypatch):
    case = vc.CASES[1]
    x, ids, weights, w13, w2 = vc.make_problem(case, 40)
    kernel, layout = build(MoonEPOpsPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2)
    dp = type("DP", (), {"num_tokens_across_dp_cpu": torch.tensor([40, 300])})
    context = type("Context", (), {"dp_metadata": dp})
    monkeypatch.setattr(ours_module, "get_forward_context", lambda: context)
    out = run(kernel, layout, case, x, ids, weights)
    assert rel_err(out, vc.dense_reference(x, ids, weights, w13, w2, False)) <= TOLERANCE[case.dtype]
    _, buffer = kernel.prepare_finalize.buffer_pool.get(512)
    assert kernel.prepare_finalize.num_dispatched_slots == buffer._ctx["NvS"]


def test_contract_errors():
    case = vc.CASES[1]
    x, ids, weights, w13, w2 = vc.make_problem(case)
    experts, _ = vc.loaded_experts(MoonEPOpsExperts, case, w13, w2)
    unbuilt = MoonEPOpsPrepareAndFinalize(vc.buffer_pool(case, MAX_TOKENS), MAX_TOKENS, 1, case.experts)
    unbuilt._fused_experts = experts
    quant = FUSED_MOE_UNQUANTIZED_CONFIG

    def prepare(pf, x=x, ids=ids, on_input=False, quant=quant):
        return pf.prepare(x, weights[:, :ids.shape[1]], ids, case.experts, None, on_input, quant)

    with pytest.raises(RuntimeError, match="post_init_setup"):
        prepare(unbuilt)
    pf = build(MoonEPOpsPrepareAndFinalize, MoonEPOpsExperts, case, w13, w2)[0].prepare_finalize
    with pytest.raises(NotImplementedError, match="BF16"):
        prepare(pf, x=x.float())
    with pytest.raises(NotImplementedError, match="quantized"):
        prepare(pf, quant=FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="top-1"):
        prepare(pf, on_input=True)
    many = vc.make_problem(case, MAX_TOKENS + 1)
    with pytest.raises(ValueError, match="capacity exceeded"):
        prepare(pf, x=many[0], ids=many[1])
    with pytest.raises(RuntimeError, match="without prepare"):
        pf.finalize(torch.empty_like(x), x, weights, ids, False, TopKWeightAndReduceNoOP())
    x_nvs = prepare(pf)[0]
    with pytest.raises(RuntimeError, match="before finalize"):
        prepare(pf)
    with pytest.raises(ValueError, match="TopKWeightAndReduceNoOP"):
        pf.finalize(torch.empty_like(x), torch.zeros_like(x_nvs), weights, ids, False,
                    TopKWeightAndReduceContiguous())
