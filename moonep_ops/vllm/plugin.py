"""The ``vllm.general_plugins`` entry point: make vLLM's MoonEP backend build ``MoonEPOpsExperts``.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers)
before any model is built. vLLM has no registry for experts classes; its unquantized-MoE
oracle (``oracle/unquantized.py: backend_to_kernel_cls``) runs
``from ...experts.moonep_experts import MoonEPExperts`` each time it picks the MoonEP
backend, so replacing that module attribute with our subclass is seen by every later lookup
and touches no vLLM function (docs/vllm.md, "How the plugin hooks in").
"""

import logging

from .. import flags

logger = logging.getLogger(__name__)

DISABLE_ENV = flags.DISABLE_VLLM_PLUGIN
_MODULE = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"


def disabled() -> bool:
    return flags.vllm_plugin_disabled()


def register() -> None:
    """Install ``MoonEPOpsExperts`` as vLLM's ``MoonEPExperts``; safe to call any number of times."""
    if disabled():
        logger.info("moonep_ops: %s is set; vLLM keeps its own MoonEP experts", DISABLE_ENV)
        return
    import importlib

    try:
        module = importlib.import_module(_MODULE)
    except ImportError as e:
        logger.warning("moonep_ops: this vLLM has no MoonEP experts (%s); the plugin does nothing", e)
        return
    if not isinstance(getattr(module, "MoonEPExperts", None), type):
        logger.warning("moonep_ops: %s has no MoonEPExperts class; the plugin does nothing", _MODULE)
        return

    from .experts import MoonEPOpsExperts

    current = module.MoonEPExperts
    if issubclass(current, MoonEPOpsExperts):
        return  # already installed in this process
    vllm_cls = MoonEPOpsExperts.__bases__[0]
    if current is not vllm_cls:
        # Someone else replaced it: do not silently undo their choice.
        logger.warning("moonep_ops: %s.MoonEPExperts is already %s.%s; leaving it in place",
                       _MODULE, current.__module__, current.__qualname__)
        return
    module.MoonEPExperts = MoonEPOpsExperts
    logger.info("moonep_ops: vLLM's MoonEP backend now runs the moonep ops (MoonEPOpsExperts)")
