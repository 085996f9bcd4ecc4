"""vLLM integration: ``MoonEPOpsExperts``, its plugin, and a one-device MoonEP prepare/finalize.

Importing this package does not import vLLM; its members do, on first access, so
``moonep_ops`` itself works without vLLM installed. See docs/vllm.md.

- :class:`~moonep_ops.vllm.experts.MoonEPOpsExperts`: vLLM's ``MoonEPExperts`` on the moonep ops.
- :func:`~moonep_ops.vllm.plugin.register`: the ``vllm.general_plugins`` entry point.
- :class:`~moonep_ops.vllm.prepare_finalize.MoonEPLayoutPrepareAndFinalize`: MoonEP's
  dispatch/combine contract emulated on one device, for tests and benchmarks.
"""

import importlib

_MEMBERS = {
    "MoonEPOpsExperts": "experts",
    "MoonEPLayoutPrepareAndFinalize": "prepare_finalize",
    "register": "plugin",
}

__all__ = list(_MEMBERS)


def __getattr__(name):
    if name in _MEMBERS:
        return getattr(importlib.import_module(f".{_MEMBERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
