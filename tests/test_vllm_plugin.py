"""The vLLM plugin: entry point, idempotence, opt-out, foreign classes; and, in a fresh process
that vLLM takes for an sm90 CUDA machine with MoonEP installed, what vLLM builds after
``vllm.plugins.load_general_plugins()`` and that its CUDA-graph settings do not change (vLLM 0.33)."""

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep  # noqa: E402

from moonep_ops.vllm import plugin  # noqa: E402

from . import moonep_stub  # noqa: E402
from .vllm_cases import CASES, OneRankAll2All, moe_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", plugin.DISABLE_ENV)}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_moonep_ops_does_not_import_vllm():
    proc = run_python(f"""
        import json, sys
        import moonep_ops, moonep_ops.vllm, moonep_ops.vllm.plugin, moonep_ops.vllm.device
        sys.path.insert(0, {moonep_stub.PATH!r})
        import moonep  # the stub the CUDA capture test runs on, without vLLM
        print(json.dumps(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))))
    """)
    assert last_json(proc) == []


def test_entry_point_is_installed():
    # vLLM finds the plugin only through the installed distribution's metadata.
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "moonep_ops" and ep.value == "moonep_ops.vllm.plugin:register" for ep in eps), (
        "install moonep_ops into this environment (pip install -e .) so vLLM sees its entry point")


@pytest.fixture
def vllm_modules(monkeypatch):
    """vLLM's two lookup modules as on a CUDA machine with ``moonep`` installed (all2all_utils
    binds the prepare/finalize names only there), restored after the test."""
    experts = importlib.import_module(plugin.EXPERTS_MODULE)
    all2all = importlib.import_module(plugin.ALL2ALL_MODULE)
    monkeypatch.setattr(experts, "MoonEPExperts", experts.MoonEPExperts)
    for name in ("MoonEPPrepareAndFinalize", "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS",
                 "MOONEP_DEFAULT_NUM_SMS", "MOONEP_DEFAULT_TOKEN_PADDING"):
        monkeypatch.setattr(all2all, name, getattr(vllm_moonep, name), raising=False)
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    return experts, all2all


def ours():
    from moonep_ops.vllm import MoonEPOpsExperts, MoonEPOpsPrepareAndFinalize

    return MoonEPOpsExperts, MoonEPOpsPrepareAndFinalize


def test_register_installs_both_once(vllm_modules):
    experts, all2all = vllm_modules
    ours_experts, ours_pf = ours()
    assert experts.MoonEPExperts is ours_experts.__bases__[0]
    assert all2all.MoonEPPrepareAndFinalize is ours_pf.__bases__[0]
    for _ in range(2):
        plugin.register()
        assert experts.MoonEPExperts is ours_experts
        assert all2all.MoonEPPrepareAndFinalize is ours_pf


@pytest.mark.parametrize("value", ["1", "true"])
def test_register_honours_opt_out(vllm_modules, monkeypatch, value):
    experts, all2all = vllm_modules
    before = experts.MoonEPExperts, all2all.MoonEPPrepareAndFinalize
    monkeypatch.setenv(plugin.DISABLE_ENV, value)
    plugin.register()
    assert (experts.MoonEPExperts, all2all.MoonEPPrepareAndFinalize) == before


def test_register_on_vllm_without_moonep_only_warns(monkeypatch, caplog):
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, plugin.EXPERTS_MODULE, None)  # the import now fails
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert "moonep_experts" in caplog.text and "leaves it" in caplog.text


def test_register_without_the_moonep_package_leaves_all2all_alone(vllm_modules, monkeypatch, caplog):
    # Off CUDA, or without `moonep` installed, all2all_utils has no MoonEPPrepareAndFinalize.
    experts, all2all = vllm_modules
    monkeypatch.delattr(all2all, "MoonEPPrepareAndFinalize")
    with caplog.at_level(logging.INFO, logger=plugin.__name__):
        plugin.register()
    assert experts.MoonEPExperts is ours()[0]
    assert not hasattr(all2all, "MoonEPPrepareAndFinalize")
    assert [r.levelname for r in caplog.records if "nothing to replace" in r.message] == ["INFO"]


@pytest.mark.parametrize("attr", ["MoonEPExperts", "MoonEPPrepareAndFinalize"])
def test_register_leaves_a_foreign_replacement(vllm_modules, caplog, attr):
    module = vllm_modules[attr == "MoonEPPrepareAndFinalize"]
    foreign = type("Other", (getattr(module, attr),), {})
    setattr(module, attr, foreign)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert getattr(module, attr) is foreign
    assert "leaving it in place" in caplog.text


@pytest.mark.parametrize("opt_out", [False, True], ids=["plugin", "opt_out"])
def test_vllm_factory_builds_the_installed_prepare_finalize(vllm_modules, monkeypatch, opt_out):
    # all2all_utils.maybe_make_prepare_finalize, as vLLM calls it when it builds the MoE kernel.
    _, all2all = vllm_modules
    if opt_out:
        monkeypatch.setenv(plugin.DISABLE_ENV, "1")
    plugin.register()
    pf = all2all.maybe_make_prepare_finalize(moe_config(CASES[1]), FUSED_MOE_UNQUANTIZED_CONFIG,
                                             allow_new_interface=True,
                                             all2all_manager=OneRankAll2All())
    want = vllm_moonep.MoonEPPrepareAndFinalize if opt_out else ours()[1]
    assert type(pf) is want
    assert pf.max_tokens_per_rank == moe_config(CASES[1]).max_num_tokens


SM90_SCRIPT = """
    import json, sys
    from tests import vllm_platform_stub
    vllm_platform_stub.install()
    sys.path.insert(0, {stub!r})  # `moonep` is importable, as on a MoonEP machine

    from vllm.config import CompilationConfig, ParallelConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    def graphs():
        got = {{}}
        for backend in ("moonep", "deepep_low_latency"):
            config = VllmConfig(
                parallel_config=ParallelConfig(all2all_backend=backend, enable_expert_parallel=True,
                                               data_parallel_size=2),
                compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                     cudagraph_mode=CUDAGraphMode.PIECEWISE))
            c = config.compilation_config
            got[backend] = [c.cudagraph_mode.name, c.splitting_ops]
        return got

    before = graphs()
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    vllm.plugins.load_general_plugins()
    after = graphs()

    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import select_unquantized_moe_backend
    from tests.vllm_cases import CASES, OneRankAll2All, moe_config

    def name(cls):
        return f"{{cls.__module__}}.{{cls.__qualname__}}"

    config = moe_config(CASES[1])
    backend, experts_cls = select_unquantized_moe_backend(config)
    other = moe_config(CASES[1])
    other.moe_parallel_config.all2all_backend = "allgather_reducescatter"
    other_backend, other_cls = select_unquantized_moe_backend(other)
    pf = all2all_utils.maybe_make_prepare_finalize(config, FUSED_MOE_UNQUANTIZED_CONFIG,
                                                   allow_new_interface=True,
                                                   all2all_manager=OneRankAll2All())
    print(json.dumps({{
        "graphs_before": before, "graphs_after": after,
        "backend": backend.name, "experts": name(experts_cls),
        "prepare_finalize": name(type(pf)),
        "other_backend": other_backend.name, "other_experts": name(other_cls),
    }}))
"""


@pytest.mark.parametrize("opt_out", [False, True], ids=["plugin", "opt_out"])
def test_sm90_process_after_load_general_plugins(opt_out):
    env = {plugin.DISABLE_ENV: "1"} if opt_out else {}
    got = last_json(run_python(SM90_SCRIPT.format(stub=moonep_stub.PATH), **env))
    assert got["backend"] == "MOONEP"
    if opt_out:
        assert got["experts"].startswith("vllm.") and got["prepare_finalize"].startswith("vllm."), got
    else:
        assert got["experts"] == "moonep_ops.vllm.experts.MoonEPOpsExperts", got
        assert got["prepare_finalize"] == "moonep_ops.vllm.prepare_finalize.MoonEPOpsPrepareAndFinalize"
    # Other all2all backends are untouched.
    assert got["other_backend"] != "MOONEP" and "MoonEP" not in got["other_experts"]
    # CUDA graphs: vLLM forces NONE with MoonEP, keeps PIECEWISE for other backends, and the
    # plugin changes neither.
    assert got["graphs_after"] == got["graphs_before"]
    assert got["graphs_after"]["moonep"][0] == "NONE"
    assert got["graphs_after"]["deepep_low_latency"][0] == "PIECEWISE"
    splitting = got["graphs_after"]["moonep"][1]
    assert "vllm::unified_attention_with_output" in splitting
    assert not any("moe_forward" in op for op in splitting)
