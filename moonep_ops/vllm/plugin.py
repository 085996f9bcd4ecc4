"""The ``vllm.general_plugins`` entry point: vLLM's MoonEP backend on ``MoonEPOpsExperts`` and
``MoonEPOpsPrepareAndFinalize``.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers)
before any model is built. vLLM has no registry for either class; it looks both up by name:

- the unquantized-MoE oracle (``oracle/unquantized.py: backend_to_kernel_cls``) runs
  ``from ...experts.moonep_experts import MoonEPExperts`` each time it picks the MoonEP backend;
- ``fused_moe/all2all_utils.py`` imports ``MoonEPPrepareAndFinalize`` at module level (on
  CUDA-like platforms, when the ``moonep`` package is installed) and builds it by that global
  name in ``maybe_make_prepare_finalize``.

Replacing those two module attributes with our subclasses is seen by every later lookup and
touches no vLLM function. An attribute that is neither vLLM's class nor ours is someone else's
choice and stays (docs/vllm.md, "How the plugin hooks in").
"""

import importlib
import logging

from .. import flags

logger = logging.getLogger(__name__)

DISABLE_ENV = flags.DISABLE_VLLM_PLUGIN
EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"
ALL2ALL_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"


def disabled() -> bool:
    return flags.vllm_plugin_disabled()


def _ours(attr: str) -> type:
    if attr == "MoonEPExperts":
        from .experts import MoonEPOpsExperts

        return MoonEPOpsExperts
    from .prepare_finalize import MoonEPOpsPrepareAndFinalize

    return MoonEPOpsPrepareAndFinalize


def _install(module_name: str, attr: str, *, absent_is_normal: bool) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        logger.warning("moonep_ops: this vLLM has no %s (%s); the plugin leaves it", module_name, e)
        return
    current = getattr(module, attr, None)
    if not isinstance(current, type):
        # all2all_utils binds the name only on CUDA-like platforms with `moonep` installed.
        log = logger.info if absent_is_normal else logger.warning
        log("moonep_ops: %s has no %s class; nothing to replace", module_name, attr)
        return
    ours = _ours(attr)
    if issubclass(current, ours):
        return  # already installed in this process
    if current is not ours.__bases__[0]:
        # Someone else replaced it: do not silently undo their choice.
        logger.warning("moonep_ops: %s.%s is already %s.%s; leaving it in place",
                       module_name, attr, current.__module__, current.__qualname__)
        return
    setattr(module, attr, ours)
    logger.info("moonep_ops: vLLM's MoonEP backend now builds %s", ours.__qualname__)


def register() -> None:
    """Install both classes in vLLM; safe to call any number of times."""
    if disabled():
        logger.info("moonep_ops: %s is set; vLLM keeps its own MoonEP classes", DISABLE_ENV)
        return
    _install(EXPERTS_MODULE, "MoonEPExperts", absent_is_normal=False)
    _install(ALL2ALL_MODULE, "MoonEPPrepareAndFinalize", absent_is_normal=True)
