"""moonep_ops/kernels/launch.py: direct launches of compiled kernels.

CPU: a stand-in compiled kernel whose launcher has the form the direct path calls below Triton's
descriptor wrapper; the encoded descriptors are cached per base address, Triton's launcher takes
over where a launch hook is set or the form is unknown. CUDA: the ops' results are bitwise those
of launches through Triton's JIT, and on the Triton releases with the known form the plans do
cache their descriptors.
"""

import types

import pytest
import torch

import moonep_ops
from moonep_ops.kernels import launch

from .layouts import Layout, experts_inputs


class _Runner:
    """Stands in for Triton's ``CudaLauncher``: ``launch`` closes over the C entry point, the
    descriptors' argument indices and their metadata, as Triton 3.5-3.6's wrapper does."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, indices, meta, entry, calls):
        launcher, tensordesc_indices, tensordesc_meta = entry, set(indices), meta

        def inner(*args):  # the closure's names are what the direct path reads
            return launcher, tensordesc_indices, tensordesc_meta

        self.launch = inner
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(("triton", args))


class _Base:
    """A tensor-like base whose address the test picks."""

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


@pytest.fixture
def known_form(monkeypatch):
    """A module holding the stand-in launcher class, Triton's 13 base arguments and an encoder
    that records what it encodes; the direct path accepts this Triton's version."""
    encoded = []
    pytest.importorskip("triton")  # (the release the direct path accepts is the installed one)
    module = types.ModuleType("stand_in_driver")
    module._BASE_ARGS_FORMAT_LEN = 13

    def make_tensordesc_arg(desc, meta):
        encoded.append((desc.base.data_ptr(), meta))
        return [f"map{desc.base.data_ptr()}/{meta}", 64, 8]

    module.make_tensordesc_arg = make_tensordesc_arg
    runner = type("CudaLauncher", (_Runner,), {"__module__": module.__name__})
    monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    monkeypatch.setattr(launch, "_RAW_LAUNCHER_RELEASES", (launch.triton.__version__,))
    monkeypatch.setattr(launch, "_driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 77)))
    return runner, encoded


def _kernel(runner_cls, entry_calls, triton_calls, indices=(1, 3), meta=("m1", "m3")):
    def entry(*args):
        entry_calls.append(args)

    kernel = types.SimpleNamespace(function="fn", packed_metadata=(4, 1, 0),
                                   launch_metadata=lambda grid, stream, *args: None)
    kernel.run = runner_cls(indices, list(meta), entry, triton_calls)
    return kernel


def _descriptor(base):
    return types.SimpleNamespace(base=base)


def test_descriptors_are_encoded_once_per_base_address(known_form):
    runner, encoded = known_form
    entry_calls, triton_calls = [], []
    direct = launch.DirectLaunch(_kernel(runner, entry_calls, triton_calls), (5,), ["C1", "C2"],
                                 {1: _descriptor, 3: _descriptor})
    assert direct.caches_descriptors
    w, x = _Base(1000), _Base(2000)
    for _ in range(3):
        direct(["a0", w, "a2", x, 9])
    assert encoded == [(1000, "m1"), (2000, "m3")]
    assert triton_calls == []
    # grid, stream, then function, cooperative, pdl, scratch, metadata, launch metadata, hooks;
    # then the arguments with each descriptor expanded, then the constexprs
    assert entry_calls[-1] == (5, 1, 1, 77, "fn", False, True, None, None, (4, 1, 0), None, None, None,
                               "a0", "map1000/m1", 64, 8, "a2", "map2000/m3", 64, 8, 9, "C1", "C2")
    direct(["a0", w, "a2", _Base(3000), 9])  # another x: only its descriptor is encoded
    assert encoded[2:] == [(3000, "m3")]


def test_a_slot_starts_over_past_its_capacity(known_form):
    runner, encoded = known_form
    direct = launch.DirectLaunch(_kernel(runner, [], []), (1,), [], {1: _descriptor, 3: _descriptor})
    w = _Base(8)
    for i in range(launch._CACHED_DESCRIPTORS + 1):
        direct([None, w, None, _Base(10_000 + 16 * i)])
    direct([None, w, None, _Base(10_000)])  # dropped when the slot started over
    assert encoded.count((8, "m1")) == 1 and encoded.count((10_000, "m3")) == 2


def test_a_launch_hook_sends_launches_through_triton(known_form, monkeypatch):
    runner, encoded = known_form
    entry_calls, triton_calls = [], []
    direct = launch.DirectLaunch(_kernel(runner, entry_calls, triton_calls), (2,), ["C"],
                                 {1: _descriptor, 3: _descriptor})
    monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", lambda metadata: None)
    direct(["a0", _Base(16), "a2", _Base(32), 1])
    assert entry_calls == [] and len(triton_calls) == 1
    args = triton_calls[0][1]
    assert [d.base.data_ptr() for d in (args[-5], args[-3])] == [16, 32] and args[-1] == "C"


@pytest.mark.parametrize("change", ["release", "indices", "scratch"])
def test_an_unknown_launcher_takes_triton_s_path(known_form, monkeypatch, change):
    runner, _ = known_form
    indices = (1, 3)
    if change == "release":
        monkeypatch.setattr(launch, "_RAW_LAUNCHER_RELEASES", ("0.0.",))
    elif change == "indices":
        indices = (1,)  # a descriptor the plan knows is not one the launcher expands
    else:
        monkeypatch.setattr(runner, "global_scratch_size", 128)
    triton_calls = []
    direct = launch.DirectLaunch(_kernel(runner, [], triton_calls, indices=indices), (1,), [],
                                 {1: _descriptor, 3: _descriptor})
    assert not direct.caches_descriptors
    direct([None, _Base(16), None, _Base(32)])
    assert len(triton_calls) == 1


# CUDA: the direct launches against Triton's JIT ---------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_direct_launches_match_triton_s_launches_bitwise(dtype, switches):
    """Every call after the first launches directly; with ``MOONEP_OPS_FAST_LAUNCH=0`` every call
    goes through Triton's JIT. Same inputs, new routing each call: the same bits."""
    from moonep_ops.kernels.gluon import host
    from moonep_ops.kernels.triton import grouped_gemm

    routings = [(40, 0, 131, 7), (7, 131, 0, 40), (0, 178, 0, 0)]  # one signature, new routing
    results = {}
    for fast in ("1", "0"):
        switches(FAST_LAUNCH=fast)
        outs = []
        for seed, sizes in enumerate(routings):
            torch.manual_seed(seed)
            inputs = experts_inputs(Layout("direct", sizes, 256, k=256, n=128), dtype, "cuda")
            x, w_gate, w_up, w_down, cu, rw = inputs
            outs.append(moonep_ops.moonep_experts(x, w_gate, w_up, w_down, cu, rw))
        results[fast] = torch.stack(outs)
    torch.testing.assert_close(results["1"], results["0"], rtol=0, atol=0)
    if launch.triton.__version__.startswith(launch._RAW_LAUNCHER_RELEASES):
        plans = [p.launch for p in host._PLANS.values() if isinstance(p, host._Plan)]
        plans += [p[1] for p in grouped_gemm._PLANS.values()]
        assert plans and all(p.caches_descriptors for p in plans if p.descriptors)
