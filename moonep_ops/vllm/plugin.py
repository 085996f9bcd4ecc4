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

It also registers the quantization method ``moonep_fp8``
(:class:`~moonep_ops.vllm.fp8.MoonEPFp8Config`, vLLM's ``register_quantization_config``): FP8
128x128 block checkpoints under MoonEP, for users who pass ``--quantization moonep_fp8``, and
wraps ``VllmConfig.__post_init__`` (:mod:`moonep_ops.vllm.config_gate`) so that exactly that
combination passes vLLM's MoonEP check, which refuses any quantization. Both change nothing
until a user names ``moonep_fp8`` (docs/vllm.md, "FP8").
"""

import importlib
import logging

from .. import flags

logger = logging.getLogger(__name__)

DISABLE_ENV = flags.DISABLE_VLLM_PLUGIN
EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"
ALL2ALL_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"
QUANTIZATION_MODULE = "vllm.model_executor.layers.quantization"
FP8_QUANTIZATION = "moonep_fp8"


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


def _register_fp8() -> None:
    """Register ``moonep_fp8`` and install its ``VllmConfig`` gate (both inert until a user names
    ``moonep_fp8``)."""
    try:
        quantization = importlib.import_module(QUANTIZATION_MODULE)
        from .fp8 import MoonEPFp8Config
    except ImportError as e:
        logger.warning("moonep_ops: --quantization %s is unavailable with this vLLM (%s)",
                       FP8_QUANTIZATION, e)
        return
    from . import config_gate

    config_gate.install()
    if FP8_QUANTIZATION in quantization.QUANTIZATION_METHODS:
        current = getattr(quantization, "_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", {}).get(FP8_QUANTIZATION)
        if isinstance(current, type) and issubclass(current, MoonEPFp8Config):
            return  # already registered in this process
        logger.warning("moonep_ops: quantization method %s is already registered as %r; leaving it",
                       FP8_QUANTIZATION, current)
        return
    quantization.register_quantization_config(FP8_QUANTIZATION)(MoonEPFp8Config)
    logger.info("moonep_ops: registered --quantization %s (FP8 block MoE under MoonEP)",
                FP8_QUANTIZATION)


def register() -> None:
    """Install both classes in vLLM and register ``moonep_fp8``; safe to call any number of times."""
    if disabled():
        logger.info("moonep_ops: %s is set; vLLM keeps its own MoonEP classes", DISABLE_ENV)
        return
    _install(EXPERTS_MODULE, "MoonEPExperts", absent_is_normal=False)
    _install(ALL2ALL_MODULE, "MoonEPPrepareAndFinalize", absent_is_normal=True)
    _register_fp8()
