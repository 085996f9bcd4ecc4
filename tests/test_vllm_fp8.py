"""FP8 128x128 block-quantized MoE under vLLM 0.33's MoonEP backend (``--quantization moonep_fp8``),
on the CPU with vLLM's real classes and the one-device moonep stub.

A MoE layer goes the way vLLM takes it: ``MoonEPFp8Config`` (a real ``Fp8Config``) hands out
``MoonEPFp8MoEMethod`` (a real ``Fp8MoEMethod``), whose ``create_weights`` registers vLLM's FP8
parameters on a stub layer; vLLM's own expert loader helpers load a checkpoint's e4m3 weights and
``weight_scale_inv`` shards into them; ``process_weights_after_loading`` builds the ``[E+B]`` layout
and the kernel through vLLM's ``make_fp8_moe_kernel`` and ``maybe_make_prepare_finalize`` (its MoonEP
branch, which builds our ``MoonEPOpsPrepareAndFinalize`` after ``register()``); ``Fp8MoEMethod.apply``
runs vLLM's ``FusedMoEKernel``. Outputs are compared with a float64 MoE on the dequantized weights
(docs/fp8.md's accuracy) and, tighter, with a float64 MoE of moonep_ops' FP8 semantics.
Then: the opt-in, the refusal of a MoonEP without scale prefetch, and the config gate in a process
that vLLM takes for an sm90 CUDA machine.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import vllm.distributed  # noqa: E402
import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe import RoutedExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep  # noqa: E402
from vllm.model_executor.layers.quantization import fp8 as vllm_fp8  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)

from moonep_ops import fp8  # noqa: E402
from moonep_ops.vllm import MoonEPOpsExperts, MoonEPOpsPrepareAndFinalize, plugin  # noqa: E402
from moonep_ops.vllm import config_gate, device  # noqa: E402
from moonep_ops.vllm import experts as experts_module  # noqa: E402
from moonep_ops.vllm import fp8 as fp8_module  # noqa: E402
from moonep_ops.vllm.fp8 import (  # noqa: E402
    MoonEPFp8Config,
    MoonEPFp8MoEMethod,
    MoonEPOpsFp8Experts,
)
from moonep_ops.vllm.fp8_layout import (  # noqa: E402
    SCALE_TILE_BYTES,
    MoonEPFp8WeightLayout,
    make_fp8_weight_layout,
)

from . import moonep_stub, vllm_cases as vc  # noqa: E402
from .reference import rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 256
B = vc.NUM_PREFETCH

# docs/fp8.md: experts_fp8 is 0.043-0.044 from float64 on the dequantized weights and unquantized
# activations (bound 0.055 there); here the K outputs of a token are summed, which averages a little.
DEQUANTIZED_TOLERANCE = 5.5e-2
# docs/fp8.md: the ops are within 1e-2 of the float64 computation of their own FP8 semantics.
SEMANTICS_TOLERANCE = 1e-2

CASES = [
    vc.Case("uniform", 64, 256, 256, 8, 2),
    vc.Case("hot_expert", 120, 256, 384, 6, 3, skew=8.0),  # prefetch slots in use
    vc.Case("top1_on_input", 80, 128, 256, 4, 1, skew=2.0, on_input=True),
    vc.Case("invalid_ids", 50, 256, 128, 8, 2, invalid=9),
]


# --- fixtures: vLLM's MoonEP path on one CPU "rank" ------------------------------------------

class CpuPlatform:
    """What MoonEPOpsExperts' device predicate asks of vLLM's ``current_platform``."""

    def is_cuda(self):
        return False

    def is_cpu(self):
        return True


class OneRankEpGroup:
    world_size = 1


@pytest.fixture(autouse=True)
def moonep(monkeypatch):
    vc.ensure_workspace_manager()
    return moonep_stub.use(monkeypatch, "cpu")


@pytest.fixture
def vllm_moonep_path(monkeypatch):
    """vLLM's MoE building blocks as on a one-rank MoonEP deployment, with the plugin registered:
    ``maybe_make_prepare_finalize`` takes its MoonEP branch (with our class), the EP/TP groups
    are one rank, and the experts accept the CPU."""
    experts_mod = __import__(plugin.EXPERTS_MODULE, fromlist=["x"])
    all2all = __import__(plugin.ALL2ALL_MODULE, fromlist=["x"])
    monkeypatch.setattr(experts_mod, "MoonEPExperts", experts_mod.MoonEPExperts)
    for name in ("MoonEPPrepareAndFinalize", "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS",
                 "MOONEP_DEFAULT_NUM_SMS", "MOONEP_DEFAULT_TOKEN_PADDING"):
        monkeypatch.setattr(all2all, name, getattr(vllm_moonep, name), raising=False)
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "__post_init__", VllmConfig.__post_init__)  # the gate, undone after
    plugin.register()
    assert all2all.MoonEPPrepareAndFinalize is MoonEPOpsPrepareAndFinalize
    monkeypatch.setattr(all2all, "get_ep_all2all_manager", lambda *a, **k: vc.OneRankAll2All())
    monkeypatch.setattr(fp8_module, "_ep_group", lambda: OneRankEpGroup())
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(experts_module, "current_platform", CpuPlatform())
    monkeypatch.setattr(MoonEPOpsExperts, "allow_cpu", True)
    return all2all


def moe_config(case):
    config = vc.moe_config(case)
    config.max_num_tokens = MAX_TOKENS
    return config


class StubLayer(RoutedExperts):
    """A ``RoutedExperts`` without its constructor (which needs vLLM's distributed state): what
    ``Fp8MoEMethod`` and the quantization config read of the layer, and vLLM's own expert-shard
    loaders (``_load_w13`` narrows w1 (gate) and w3 (up) into the two halves of ``w13``)."""

    def __init__(self, case):
        torch.nn.Module.__init__(self)
        self.moe_config = moe_config(case)
        self.activation = MoEActivation.SILU
        self.global_num_experts = case.experts
        self._expert_map = None
        self.apply_router_weight_on_input = case.on_input
        self.quant_method = None

    def _expert_routing_tables(self):
        return None


# --- a block-FP8 checkpoint and references ---------------------------------------------------

def block_scaled(shape, fan_in):
    """``N(0, 1/fan_in)`` with each 128x128 block scaled by 2^U{-3..3}: an expert's blocks differ
    by up to 64x, so a scale paired with the wrong block (or gate's with up's) shows."""
    e, n, k = shape
    nb, kb = fp8.num_blocks(n), fp8.num_blocks(k)
    mag = 2.0 ** torch.randint(-3, 4, (e, nb, kb)).float()
    mag = mag.repeat_interleave(fp8.BLOCK, 1)[:, :n].repeat_interleave(fp8.BLOCK, 2)[:, :, :k]
    return torch.randn(shape) / fan_in ** 0.5 * mag


@dataclasses.dataclass
class Checkpoint:
    """Per-projection e4m3 weights and fp32 block scales, as a DeepSeek-V3-format checkpoint has."""

    gate: tuple
    up: tuple
    down: tuple

    @classmethod
    def make(cls, case):
        e, h, i = case.experts, case.hidden, case.inter
        return cls(*(fp8.quantize_weight(block_scaled(shape, fan_in))
                     for shape, fan_in in (((e, i, h), h), ((e, i, h), h), ((e, h, i), i))))

    def dequantized(self):
        return [fp8.dequantize_weight(*p).double() for p in (self.gate, self.up, self.down)]


def load_checkpoint(layer, ckpt: Checkpoint):
    """Each expert's w1/w3/w2 weights and scales through vLLM's shard loaders."""
    for e in range(layer.w13_weight.shape[0]):
        for shard, (q, s) in (("w1", ckpt.gate), ("w3", ckpt.up), ("w2", ckpt.down)):
            dim = 1 if shard == "w2" else 0
            stem = "w2" if shard == "w2" else "w13"
            for param, loaded, is_scale in ((f"{stem}_weight", q, False),
                                            (f"{stem}_weight_scale_inv", s, True)):
                layer._load_model_weight_or_group_weight_scale(
                    shard_dim=dim, expert_data=getattr(layer, param).data[e], shard_id=shard,
                    loaded_weight=loaded[e], tp_rank=0, is_scale=is_scale)


def dequantized_reference(case, ckpt, x, ids, weights):
    """Float64 MoE on the dequantized weights and unquantized activations."""
    gate, up, down = ckpt.dequantized()
    return vc.dense_reference(x, ids, weights, torch.cat([gate, up], 1), down, case.on_input)


def _dequantize_rows(t):
    q, s = fp8.quantize_rows(t)
    return q.double() * s.double().repeat_interleave(fp8.BLOCK, 1)[:, :t.shape[1]]


def fp8_semantics_reference(case, ckpt, x, ids, weights):
    """Float64 MoE of moonep_ops' FP8 semantics (docs/fp8.md): each dispatched row quantized per
    128 columns, gate/up on the dequantized weights, silu(gate) * up * route weight quantized
    again, the down projection; a token's K outputs rounded to bf16 and summed."""
    gate, up, down = ckpt.dequantized()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(case.experts):
        for k in range(case.topk):
            sel = ids[:, k] == e
            if not sel.any():
                continue
            w = weights[sel, k].float()[:, None]
            rows = (x[sel].float() * w).to(x.dtype) if case.on_input else x[sel]
            a = _dequantize_rows(rows)
            g, u = a @ gate[e].T, a @ up[e].T
            act = (g / (1 + torch.exp(-g)) * u).float()
            if not case.on_input:
                act = act * w
            y = _dequantize_rows(act) @ down[e].T
            out[sel] += y.to(x.dtype).double()
    return out


def problem(case, tokens=None):
    x, ids, weights, _, _ = vc.make_problem(case, tokens)
    return x, ids, weights


def fp8_layer(case, ckpt, quant_config=None):
    """A stub layer with vLLM's FP8 parameters from our method's create_weights, loaded."""
    quant_config = quant_config or MoonEPFp8Config(weight_block_size=[128, 128])
    layer = StubLayer(case)
    method = layer.quant_method = quant_config.get_quant_method(layer, "model.layers.0.mlp.experts")
    method.create_weights(layer, case.experts, case.hidden, case.inter, torch.bfloat16,
                          weight_loader=None)
    load_checkpoint(layer, ckpt)
    return layer, method


def forward(layer, method, x, ids, weights):
    return method.apply(layer, x, weights, ids, shared_experts=None, shared_experts_input=None)


# --- end to end through vLLM's classes -------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_moe_layer_end_to_end(vllm_moonep_path, case):
    ckpt = Checkpoint.make(case)
    layer, method = fp8_layer(case, ckpt)
    assert isinstance(method, vllm_fp8.Fp8MoEMethod) and type(method) is MoonEPFp8MoEMethod
    # vLLM's create_weights: e4m3 w13 [E, 2I, H] (w1 = gate rows first) and [E, 2I/128, H/128] scales.
    i = case.inter
    assert layer.w13_weight.dtype == torch.float8_e4m3fn
    assert tuple(layer.w13_weight_scale_inv.shape) == (case.experts, 2 * i // 128, case.hidden // 128)
    assert torch.equal(layer.w13_weight[:, :i].view(torch.uint8), ckpt.gate[0].view(torch.uint8))
    assert torch.equal(layer.w13_weight_scale_inv[:, :i // 128], ckpt.gate[1])

    method.process_weights_after_loading(layer)

    kernel = method.moe_kernel
    assert isinstance(kernel, mk.FusedMoEKernel)
    assert type(kernel.prepare_finalize) is MoonEPOpsPrepareAndFinalize
    assert type(kernel.fused_experts) is MoonEPOpsFp8Experts
    assert method.fp8_backend is Fp8MoeBackend.TRITON
    quant = kernel.fused_experts.quant_config
    assert quant.quant_dtype == torch.float8_e4m3fn and quant.block_shape == [128, 128]
    weights_layout = layer._moonep_weight_layout
    assert isinstance(weights_layout, MoonEPFp8WeightLayout)
    # The layer's w13/w2 and their scales are now the [E+B] gate and down tensors (vLLM's MoonEP
    # convention); the quant config hands the experts those scale tensors.
    rows = case.experts + B
    assert tuple(layer.w13_weight.shape) == (rows, i, case.hidden)
    assert layer.w13_weight.data_ptr() == weights_layout.full_gate_weight.data_ptr()
    assert layer.w2_weight_scale_inv.data_ptr() == weights_layout.full_down_scale.data_ptr()
    assert quant.w1_scale.data_ptr() == weights_layout.full_gate_scale.data_ptr()
    for scale in weights_layout.full_gate_scale, weights_layout.full_up_scale, weights_layout.full_down_scale:
        scale[case.experts:] = vc.NAN  # slots: prepare must fill what a segment reads
    for w in weights_layout[:3]:
        w[case.experts:] = vc.NAN  # e4m3fn NaN

    x, ids, weights = problem(case)
    with torch.inference_mode():
        out = forward(layer, method, x, ids, weights)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    ref = fp8_semantics_reference(case, ckpt, x, ids, weights)
    assert rel_err(out, ref) <= SEMANTICS_TOLERANCE
    assert rel_err(out, dequantized_reference(case, ckpt, x, ids, weights)) <= DEQUANTIZED_TOLERANCE
    if case.name == "hot_expert":
        slots = torch.isnan(weights_layout.full_gate_scale[case.experts:].flatten(1)).all(1)
        assert not slots.all(), "no prefetch slot was used"


def test_fp8_scale_prefetch_moves_scales_with_weights(vllm_moonep_path):
    # A slot copy of an expert's weights with another expert's scales would still look plausible;
    # compare the slots' bytes with their sources after a forward with a hot expert.
    case = CASES[1]
    ckpt = Checkpoint.make(case)
    layer, method = fp8_layer(case, ckpt)
    method.process_weights_after_loading(layer)
    pf = method.moe_kernel.prepare_finalize
    x, ids, weights = problem(case)
    prepare = pf.prepare
    plans = []

    def keep(*args, **kwargs):
        result = prepare(*args, **kwargs)
        plans.append(pf.plan)
        return result

    pf.prepare = keep
    with torch.inference_mode():
        forward(layer, method, x, ids, weights)
    slots = plans[0].experts_to_copy[0].long()
    assert (slots >= 0).any()
    lay = layer._moonep_weight_layout
    e = case.experts
    for b, src in enumerate(slots.tolist()):
        if src < 0:
            continue
        for w in lay.prefetch_weights:
            assert torch.equal(w[e + b], w[src])
        for s in (lay.full_gate_scale, lay.full_up_scale, lay.full_down_scale):
            assert torch.equal(s[e + b], s[src])


def test_fp8_prepare_finalize_read_no_device_data_on_the_host(vllm_moonep_path, monkeypatch):
    from .test_vllm_prepare_finalize import recorded

    case = CASES[1]
    layer, method = fp8_layer(case, Checkpoint.make(case))
    method.process_weights_after_loading(layer)
    mode = recorded(method.moe_kernel.prepare_finalize, monkeypatch)
    x, ids, weights = problem(case)
    with torch.inference_mode():
        forward(layer, method, x, ids, weights)
    assert mode.ops and mode.syncs() == []


def test_bf16_path_unchanged_next_to_fp8(vllm_moonep_path):
    # The plugin's FP8 pieces leave vLLM's BF16 MoonEP path as it was: the same prepare/finalize
    # class with MoonEPOpsExperts and vLLM's unquantized config, no scales passed to prefetch.
    case = vc.CASES[1]
    x, ids, weights, w13, w2 = vc.make_problem(case)
    experts, weights_layout = vc.loaded_experts(MoonEPOpsExperts, case, w13, w2)
    pf = MoonEPOpsPrepareAndFinalize(vc.buffer_pool(case, MAX_TOKENS), MAX_TOKENS, 1, case.experts)
    kernel = mk.FusedMoEKernel(pf, experts)
    seen = []
    buffer = pf.buffer_pool.get(64)[1]
    original = buffer.prefetch_weight

    def spy(*args, **kwargs):
        seen.append(sorted(kwargs))
        return original(*args, **kwargs)

    buffer.prefetch_weight = spy
    out = kernel.apply(x, weights_layout.full_gate_weight, weights_layout.full_down_weight, weights,
                       ids, MoEActivation.SILU, case.experts, None, False)
    ref = vc.dense_reference(x, ids, weights, w13, w2, False)
    assert rel_err(out, ref) <= 2e-2
    assert seen == [["full_down_weight", "full_gate_weight", "full_up_weight", "plan"]]


# --- the layout, the experts, the method and config on their own ------------------------------

def test_layout_splits_gate_and_up_and_pads_scale_rows():
    case = vc.Case("layout", 1, 256, 384, 3, 1)
    ckpt = Checkpoint.make(case)
    w13 = torch.cat([ckpt.gate[0], ckpt.up[0]], 1)
    s13 = torch.cat([ckpt.gate[1], ckpt.up[1]], 1)
    lay = make_fp8_weight_layout(w13, ckpt.down[0], s13, ckpt.down[1], B)
    e = case.experts
    for full, (q, s), full_scale in ((lay.full_gate_weight, ckpt.gate, lay.full_gate_scale),
                                     (lay.full_up_weight, ckpt.up, lay.full_up_scale),
                                     (lay.full_down_weight, ckpt.down, lay.full_down_scale)):
        assert full.is_contiguous() and full.shape[0] == e + B and fp8.is_block_major(full)
        assert torch.equal(fp8.from_block_major(full[:e]).view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(full_scale[:e], s)
    for w, full in zip(lay.prefetch_weights, lay[:3]):
        assert w.dtype == torch.uint8 and w.data_ptr() == full.data_ptr() and w.is_contiguous()
        assert tuple(w.shape) == (e + B, *fp8.weight_dims(full)[1:])  # [E+B, N, K], as MoonEP expects
    for storage, view in zip(lay.prefetch_scales, (lay.full_gate_scale, lay.full_up_scale,
                                                   lay.full_down_scale)):
        assert storage.is_contiguous() and storage.dim() == 2 and storage.shape[0] == e + B
        assert (storage.nbytes // storage.shape[0]) % SCALE_TILE_BYTES == 0  # retile_for_prefetch
        assert view.data_ptr() == storage.data_ptr()
        storage[e, 0] = 7.0  # the view sees what prefetch writes into the storage
        assert view[e, 0, 0] == 7.0
    with pytest.raises(ValueError, match="multiples of 128"):
        make_fp8_weight_layout(w13[:, :, :100], ckpt.down[0][:, :100], s13, ckpt.down[1], B)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        make_fp8_weight_layout(w13.float(), ckpt.down[0], s13, ckpt.down[1], B)


def test_gather_uses_uint8_bytes_in_global_order(monkeypatch):
    # Two EP ranks of 2 experts each: all_gather sees uint8 bytes (not float8) and fp32 scales.
    case = vc.Case("gather", 1, 128, 128, 4, 1)
    ckpt = Checkpoint.make(case)
    w13 = torch.cat([ckpt.gate[0], ckpt.up[0]], 1)
    s13 = torch.cat([ckpt.gate[1], ckpt.up[1]], 1)
    full = (w13, ckpt.down[0], s13, ckpt.down[1])
    dtypes, other_rank = [], iter(full)  # gathered in the order w13, w2, w13 scales, w2 scales

    class TwoRanks:
        world_size = 2

        def all_gather(self, t, dim):
            dtypes.append(t.dtype)
            return torch.cat([t, next(other_rank)[2:].view(t.dtype)], dim)

    monkeypatch.setattr(fp8_module, "_ep_group", lambda: TwoRanks())
    lay = fp8_module.gather_fp8_weight_layout(*(t[:2] for t in full), num_global_experts=4,
                                              num_prefetch_slots=B)
    assert dtypes == [torch.uint8, torch.uint8, torch.float32, torch.float32]
    assert torch.equal(fp8.from_block_major(lay.full_up_weight[:4]).view(torch.uint8), ckpt.up[0].view(torch.uint8))
    assert torch.equal(lay.full_down_scale[:4], ckpt.down[1])
    with pytest.raises(NotImplementedError, match="evenly divisible"):
        fp8_module.gather_fp8_weight_layout(*(t[:1] for t in full), num_global_experts=4,
                                            num_prefetch_slots=B)


def test_experts_support_checks_vllm_calls(vllm_moonep_path, monkeypatch):
    case = CASES[0]
    fmt = mk.FusedMoEActivationFormat.Standard
    moonep = moe_config(case)

    def supported(config, weight_key=kFp8Static128BlockSym, activation_key=kFp8Dynamic128Sym):
        return MoonEPOpsFp8Experts.is_supported_config(MoonEPOpsFp8Experts, config, weight_key,
                                                       activation_key, fmt)

    assert supported(moonep) == (True, None)
    assert not supported(moonep, None, None)[0]  # unquantized: MoonEPOpsExperts' job
    assert not supported(moonep, kFp8Static128BlockSym, None)[0]
    assert MoonEPOpsFp8Experts(moonep, _fp8_quant()).expects_unquantized_inputs
    assert not MoonEPOpsExperts._supports_quant_scheme(kFp8Static128BlockSym, kFp8Dynamic128Sym)
    other = moe_config(case)
    other.moe_parallel_config.all2all_backend = "deepep_low_latency"
    assert not supported(other)[0]
    eplb = moe_config(case)
    eplb.moe_parallel_config.enable_eplb = True
    assert not supported(eplb)[0]
    monkeypatch.setattr(MoonEPOpsExperts, "allow_cpu", False)
    ok, reason = supported(moonep)
    assert not ok and "device" in reason


def _fp8_quant(**overrides):
    kwargs = dict(w1_scale=torch.ones(12, 2, 2), w2_scale=torch.ones(12, 2, 2), block_shape=[128, 128])
    return FusedMoEQuantConfig.make(torch.float8_e4m3fn, **{**kwargs, **overrides})


def test_experts_refuse_what_the_op_does_not_compute():
    config = moe_config(CASES[0])
    with pytest.raises(NotImplementedError, match="128x128"):
        MoonEPOpsFp8Experts(config, _fp8_quant(block_shape=None))
    with pytest.raises(NotImplementedError, match="static input scales"):
        MoonEPOpsFp8Experts(config, _fp8_quant(a1_scale=torch.ones(1)))
    with pytest.raises(NotImplementedError, match="activation"):
        MoonEPOpsFp8Experts(vc.moe_config(CASES[0], MoEActivation.GELU), _fp8_quant())
    with pytest.raises(NotImplementedError, match="quant_dtype"):
        MoonEPOpsFp8Experts(config, FusedMoEQuantConfig.make())
    experts = MoonEPOpsFp8Experts(config, _fp8_quant())
    with pytest.raises(RuntimeError, match="FP8 \\[E\\+B\\] layout"):
        experts.process_weights_after_loading(torch.nn.Module())


def test_method_sets_what_fp8_moe_method_sets(vllm_moonep_path, monkeypatch):
    # Our __init__ skips the FP8 oracle; it must leave the same attributes as vLLM's own
    # Fp8MoEMethod.__init__ (here given the oracle's answer directly).
    case = CASES[0]
    layer = StubLayer(case)
    config = MoonEPFp8Config(weight_block_size=[128, 128])
    monkeypatch.setattr(vllm_fp8, "select_fp8_moe_backend",
                        lambda **kw: (Fp8MoeBackend.TRITON, MoonEPOpsFp8Experts))
    theirs = vllm_fp8.Fp8MoEMethod(config, layer)
    ours = MoonEPFp8MoEMethod(config, layer)
    assert sorted(vars(ours)) == sorted(vars(theirs))
    for name in ("weight_block_size", "block_quant", "weight_scale_name", "weight_scale_refine",
                 "moe_block_shape", "per_act_token_quant", "fp8_backend", "experts_cls"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert not ours.supports_eplb and not MoonEPFp8MoEMethod.supports_pre_processed_weights


def test_config_routes_only_moonep_moe_layers(vllm_moonep_path, monkeypatch):
    config = MoonEPFp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    assert isinstance(config, vllm_fp8.Fp8Config) and config.get_name() == "moonep_fp8"
    sentinel = object()
    monkeypatch.setattr(vllm_fp8, "Fp8MoEMethod", lambda cfg, layer: sentinel)  # vLLM's own

    def routed(backend):
        layer = StubLayer(CASES[0])
        layer.moe_config.moe_parallel_config.all2all_backend = backend
        return layer

    assert type(config.get_quant_method(routed("moonep"), "model.layers.0.mlp.experts")) is MoonEPFp8MoEMethod
    assert config.get_quant_method(routed("deepep_low_latency"), "model.layers.0.mlp.experts") is sentinel
    with pytest.raises(ValueError, match="weight_block_size"):
        MoonEPFp8Config()  # a per-tensor FP8 config


def test_override_needs_the_opt_in_and_a_block_fp8_checkpoint():
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert MoonEPFp8Config.override_quantization_method(block, None) is None
    assert MoonEPFp8Config.override_quantization_method(block, "fp8") is None
    assert MoonEPFp8Config.override_quantization_method(block, "moonep_fp8") == "moonep_fp8"
    for bad in ({"quant_method": "fp8", "activation_scheme": "static"},
                {**block, "weight_block_size": [64, 64]},
                {"quant_method": "compressed-tensors"}):
        with pytest.raises(ValueError, match="weight_block_size \\[128, 128\\]"):
            MoonEPFp8Config.override_quantization_method(bad, "moonep_fp8")


# --- refusals ----------------------------------------------------------------------------------

def _without_scale_prefetch(moonep, monkeypatch):
    """A MoonEP whose prefetch_weight has the [E+B] weight arguments only (vLLM 0.33's call)."""
    def prefetch_weight(self, plan=None, async_finish=False, *, full_gate_weight=None,
                        full_up_weight=None, full_down_weight=None):
        raise AssertionError("not reached")

    monkeypatch.setattr(moonep.Buffer, "prefetch_weight", prefetch_weight)


def test_moonep_without_scale_prefetch_is_refused_at_load(vllm_moonep_path, moonep, monkeypatch):
    case = CASES[0]
    ckpt = Checkpoint.make(case)
    layer, method = fp8_layer(case, ckpt)
    _without_scale_prefetch(moonep, monkeypatch)
    assert not device.supports_scale_prefetch(moonep.Buffer)
    # At model construction, before any weight is loaded ...
    with pytest.raises(RuntimeError, match="cannot prefetch FP8 block scales.*full_gate_scale"):
        MoonEPFp8Config(weight_block_size=[128, 128]).get_quant_method(StubLayer(case), "experts")
    # ... and when the kernel (and its Buffers) are built.
    with pytest.raises(RuntimeError, match="cannot prefetch FP8 block scales"):
        method.process_weights_after_loading(layer)


def test_quantized_experts_behind_moonep_must_take_bf16_rows(vllm_moonep_path):
    # vLLM's own FP8 experts (quantize-before-dispatch) paired with our prepare/finalize are
    # refused at kernel build, not in the first forward.
    case = CASES[0]

    class QuantizeFirst(MoonEPOpsFp8Experts):
        @property
        def expects_unquantized_inputs(self):
            return False

    pf = MoonEPOpsPrepareAndFinalize(vc.buffer_pool(case, MAX_TOKENS), MAX_TOKENS, 1, case.experts)
    with pytest.raises(NotImplementedError, match="dispatches BF16 hidden states"):
        mk.FusedMoEKernel(pf, QuantizeFirst(moe_config(case), _fp8_quant()))


def test_method_refuses_a_foreign_prepare_finalize(vllm_moonep_path, monkeypatch):
    vllm_moonep_path.MoonEPPrepareAndFinalize = vllm_moonep.MoonEPPrepareAndFinalize
    case = CASES[0]
    layer, method = fp8_layer(case, Checkpoint.make(case))
    with pytest.raises(RuntimeError, match="not moonep_ops' MoonEPOpsPrepareAndFinalize"):
        method.process_weights_after_loading(layer)


def test_stub_prefetch_checks_scale_rows():
    # The stub is as strict as MoonEP's retile_for_prefetch: unpadded scale rows are refused.
    case = CASES[0]
    buffer = vc.buffer_pool(case, MAX_TOKENS).get(64)[1]
    x, ids, weights = problem(case, 64)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=case.experts).int()
    _, _, _, plan = buffer.dispatch(x, weights, ids, counts)
    e = case.experts + B
    w = [torch.zeros(e, 128, 128, dtype=torch.uint8) for _ in range(3)]
    with pytest.raises(AssertionError, match="retile_for_prefetch"):
        buffer.prefetch_weight(plan=plan, full_gate_weight=w[0], full_up_weight=w[1],
                               full_down_weight=w[2], full_gate_scale=torch.ones(e, 2, 2),
                               full_up_scale=torch.ones(e, 2, 2), full_down_scale=torch.ones(e, 2, 2))
    with pytest.raises(AssertionError, match="together"):
        buffer.prefetch_weight(plan=plan, full_gate_weight=w[0], full_up_weight=w[1],
                               full_down_weight=w[2], full_gate_scale=torch.ones(e, 4096))
    with pytest.raises(AssertionError, match="unsupported weight dtype"):
        buffer.prefetch_weight(plan=plan, full_gate_weight=w[0].view(torch.float8_e4m3fn),
                               full_up_weight=w[1], full_down_weight=w[2])


# --- the opt-in and the VllmConfig gate, in a process vLLM takes for an sm90 machine -----------

GATE_SCRIPT = """
    import dataclasses, json, os, sys
    from tests import vllm_platform_stub
    vllm_platform_stub.install()
    import torch
    # Queried when vLLM's FP8 config module is imported (vllm_platform_stub stands in for the rest).
    torch.ops._C.cutlass_scaled_mm_supports_fp8 = lambda capability: False
    sys.path.insert(0, {stub!r})

    import vllm.plugins
    from vllm.config import CompilationConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    vllm.plugins.load_general_plugins()
    from moonep_ops.vllm import config_gate

    def build(quantization, backend="moonep", replace=False):
        try:
            model = ModelConfig(model={model!r}, quantization=quantization, skip_tokenizer_init=True)
            config = VllmConfig(
                model_config=model,
                parallel_config=ParallelConfig(all2all_backend=backend, enable_expert_parallel=True,
                                               data_parallel_size=2),
                compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                     cudagraph_mode=CUDAGraphMode.PIECEWISE))
            if replace:  # what vLLM's workers do (weight-cache daemon, EAGLE): __post_init__ again
                config = dataclasses.replace(config, cache_config=config.cache_config)
        except Exception as e:
            return {{"error": f"{{type(e).__name__}}: {{e}}", "gate": config_gate.installed()}}
        q = config.quant_config
        return {{"quantization": config.model_config.quantization,
                "quant_config": f"{{type(q).__module__}}.{{type(q).__qualname__}}",
                "block": q.weight_block_size, "cudagraph": config.compilation_config.cudagraph_mode.name,
                "gate": config_gate.installed()}}

    got = {{"auto": build(None), "fp8": build("fp8")}}
    if os.environ.get("MOONEP_OPS_DISABLE_VLLM_PLUGIN") != "1":
        got["moonep_fp8"] = build("moonep_fp8")
        got["moonep_fp8_replaced"] = build("moonep_fp8", replace=True)
        got["moonep_fp8_other_backend"] = build("moonep_fp8", "deepep_low_latency")
        got["auto_after_opt_in"] = build(None)
    else:
        got["moonep_fp8"] = build("moonep_fp8")
    print(json.dumps(got))
"""


def write_fp8_checkpoint_config(path):
    """A tiny Qwen3-MoE config.json with a DeepSeek-V3-format FP8 quantization_config (no weights:
    VllmConfig reads the config only)."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def run_gate_script(model_dir, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", plugin.DISABLE_ENV)}
    env.update(env_changes, HF_HUB_OFFLINE="1")
    code = textwrap.dedent(GATE_SCRIPT.format(stub=moonep_stub.PATH, model=model_dir))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return write_fp8_checkpoint_config(tmp_path_factory.mktemp("qwen3_moe_fp8"))


def test_vllm_config_gate_opens_only_for_moonep_fp8(fp8_checkpoint):
    got = run_gate_script(fp8_checkpoint)
    # Without the opt-in vLLM refuses FP8 with MoonEP as before: the gate is installed with the
    # plugin but lets vLLM's check run unchanged.
    for key in ("auto", "fp8"):
        assert "supports unquantized BF16 models only" in got[key]["error"], got[key]
        assert got[key]["gate"] is True
    opted = got["moonep_fp8"]
    assert opted == {"quantization": "moonep_fp8", "quant_config": "moonep_ops.vllm.fp8.MoonEPFp8Config",
                     "block": [128, 128], "cudagraph": "NONE", "gate": True}, opted
    assert got["moonep_fp8_replaced"] == opted
    # Other backends need no gate: moonep_fp8 is Fp8Config there (vLLM's own FP8 MoE methods).
    other = got["moonep_fp8_other_backend"]
    assert other["quant_config"].endswith("MoonEPFp8Config") and other["cudagraph"] == "PIECEWISE", other
    # The patch changes nothing for configs that did not opt in.
    assert "unquantized" in got["auto_after_opt_in"]["error"], got["auto_after_opt_in"]


def test_opt_out_leaves_moonep_fp8_unknown(fp8_checkpoint):
    got = run_gate_script(fp8_checkpoint, MOONEP_OPS_DISABLE_VLLM_PLUGIN="1")
    assert "moonep_fp8" in got["moonep_fp8"]["error"] and got["moonep_fp8"]["gate"] is False, got
    assert "unquantized" in got["auto"]["error"]


def test_layout_and_gate_modules_do_not_import_vllm():
    code = ("import json, sys; import moonep_ops.vllm.fp8_layout, moonep_ops.vllm.config_gate; "
            "print(json.dumps([m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_gate_install_is_idempotent_and_reversible():
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    was_installed = config_gate.installed()
    try:
        config_gate.install()
        wrapped = VllmConfig.__post_init__
        config_gate.install()
        assert VllmConfig.__post_init__ is wrapped and config_gate.installed()
        assert wrapped.__wrapped__ is (original.__wrapped__ if was_installed else original)
        config_gate.uninstall()
        assert not config_gate.installed()
    finally:
        VllmConfig.__post_init__ = original
