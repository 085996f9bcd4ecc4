"""The vLLM plugin: entry point, idempotence, opt-out, and what vLLM's oracle picks after
``vllm.plugins.load_general_plugins()`` in a fresh process (vLLM 0.33)."""

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

from moonep_ops.vllm import plugin  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOONEP_MODULE = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"


def run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", plugin.DISABLE_ENV)}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_moonep_ops_does_not_import_vllm():
    proc = run_python("""
        import json, sys
        import moonep_ops, moonep_ops.vllm, moonep_ops.vllm.plugin
        print(json.dumps(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))))
    """)
    assert last_json(proc) == []


def test_entry_point_is_installed():
    # vLLM finds the plugin only through the installed distribution's metadata.
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "moonep_ops" and ep.value == "moonep_ops.vllm.plugin:register" for ep in eps), (
        "install moonep_ops into this environment (pip install -e .) so vLLM sees its entry point")


@pytest.fixture
def moonep_module(monkeypatch):
    """vLLM's moonep_experts module, with its MoonEPExperts restored after the test."""
    module = importlib.import_module(MOONEP_MODULE)
    monkeypatch.setattr(module, "MoonEPExperts", module.MoonEPExperts)
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    return module


def test_register_installs_once(moonep_module):
    from moonep_ops.vllm.experts import MoonEPOpsExperts

    vllm_cls = moonep_module.MoonEPExperts
    assert vllm_cls is MoonEPOpsExperts.__bases__[0]
    plugin.register()
    assert moonep_module.MoonEPExperts is MoonEPOpsExperts
    plugin.register()
    assert moonep_module.MoonEPExperts is MoonEPOpsExperts


@pytest.mark.parametrize("value", ["1", "true"])
def test_register_honours_opt_out(moonep_module, monkeypatch, value):
    vllm_cls = moonep_module.MoonEPExperts
    monkeypatch.setenv(plugin.DISABLE_ENV, value)
    plugin.register()
    assert moonep_module.MoonEPExperts is vllm_cls


def test_register_on_vllm_without_moonep_only_warns(monkeypatch, caplog):
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, MOONEP_MODULE, None)  # the import now fails
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert "no MoonEP experts" in caplog.text


def test_register_leaves_a_foreign_replacement(moonep_module, caplog):
    foreign = type("OtherExperts", (moonep_module.MoonEPExperts,), {})
    moonep_module.MoonEPExperts = foreign
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert moonep_module.MoonEPExperts is foreign
    assert "leaving it in place" in caplog.text


ORACLE_SCRIPT = """
    import json
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.experts import moonep_experts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend, select_unquantized_moe_backend)

    vllm_cls = moonep_experts.MoonEPExperts
    # vLLM's class accepts only a CUDA device; let it pass on this CPU box, so that both runs
    # differ only in the plugin (MoonEPOpsExperts overrides this predicate itself).
    vllm_cls._supports_current_device = staticmethod(lambda: True)

    import vllm.plugins
    vllm.plugins.load_general_plugins()
    vllm.plugins.load_general_plugins()

    def config(all2all_backend):
        parallel = FusedMoEParallelConfig(
            tp_size=1, pcp_size=1, dp_size=2, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0,
            ep_rank=0, sp_size=1, use_ep=True, all2all_backend=all2all_backend, enable_eplb=False)
        return FusedMoEConfig(
            num_experts=8, experts_per_token=2, hidden_dim=256, intermediate_size=128,
            num_local_experts=4, num_logical_experts=8, activation=MoEActivation.SILU,
            device="cpu", routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=parallel, in_dtype=torch.bfloat16)

    backend, cls = select_unquantized_moe_backend(config("moonep"))
    other, other_cls = select_unquantized_moe_backend(config("allgather_reducescatter"))
    print(json.dumps({
        "backend": backend.name, "cls": f"{cls.__module__}.{cls.__qualname__}",
        "is_vllm_cls": cls is vllm_cls, "subclasses_vllm_cls": issubclass(cls, vllm_cls),
        "other_backend": other.name, "other_cls": other_cls.__qualname__,
    }))
"""


@pytest.mark.parametrize("opt_out", [False, True], ids=["plugin", "opt_out"])
def test_oracle_after_load_general_plugins(opt_out):
    env = {"VLLM_TARGET_DEVICE": "cpu"}  # vLLM's CPU platform, whatever this machine is
    if opt_out:
        env[plugin.DISABLE_ENV] = "1"
    got = last_json(run_python(ORACLE_SCRIPT, **env))
    assert got["backend"] == "MOONEP"
    if opt_out:
        assert got["is_vllm_cls"], got
    else:
        assert got["cls"] == "moonep_ops.vllm.experts.MoonEPOpsExperts", got
        assert got["subclasses_vllm_cls"] and not got["is_vllm_cls"]
    # Other all2all backends are untouched.
    assert got["other_backend"] == "CPU" and "MoonEP" not in got["other_cls"]
