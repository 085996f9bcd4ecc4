"""vLLM integration: ``MoonEPOpsExperts``, ``MoonEPOpsPrepareAndFinalize`` and their plugin.

Importing this package does not import vLLM; its members do, on first access, so
``moonep_ops`` itself works without vLLM installed. :mod:`moonep_ops.vllm.device` (the
prepare/finalize's device work) never imports vLLM. See docs/vllm.md.

- :class:`~moonep_ops.vllm.experts.MoonEPOpsExperts`: vLLM's ``MoonEPExperts`` on the moonep ops.
- :class:`~moonep_ops.vllm.prepare_finalize.MoonEPOpsPrepareAndFinalize`: vLLM's
  ``MoonEPPrepareAndFinalize`` without host syncs or buffer creation in the forward.
- :func:`~moonep_ops.vllm.plugin.register`: the ``vllm.general_plugins`` entry point.
- FP8 block-quantized MoE under MoonEP (``--quantization moonep_fp8``, :mod:`moonep_ops.vllm.fp8`):
  :class:`~moonep_ops.vllm.fp8.MoonEPOpsFp8Experts`, :class:`~moonep_ops.vllm.fp8.MoonEPFp8MoEMethod`,
  :class:`~moonep_ops.vllm.fp8.MoonEPFp8Config`. :mod:`moonep_ops.vllm.fp8_layout` (their ``[E+B]``
  weight and scale layout) never imports vLLM either.
"""

import importlib

_MEMBERS = {
    "MoonEPOpsExperts": "experts",
    "MoonEPOpsPrepareAndFinalize": "prepare_finalize",
    "register": "plugin",
    "MoonEPOpsFp8Experts": "fp8",
    "MoonEPFp8MoEMethod": "fp8",
    "MoonEPFp8Config": "fp8",
}

__all__ = list(_MEMBERS)


def __getattr__(name):
    if name in _MEMBERS:
        return getattr(importlib.import_module(f".{_MEMBERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
