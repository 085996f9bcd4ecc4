"""Every ``MOONEP_OPS_*`` switch, parsed one way.

The switches that the kernels consult on every call are read once, at the first call that needs
them (an environment lookup per switch per call is a measurable part of an eager call's host
cost); after changing one in a running process, call :func:`reload`. A set variable is off when
it is ``""``, ``0``, ``false``, ``no`` or ``off`` (any case), on otherwise.

| variable | default | effect |
| --- | --- | --- |
| ``MOONEP_OPS_DEBUG`` | off | data checks of ``cu_seqlens`` on CUDA too (they sync the host) |
| ``MOONEP_OPS_PORTABLE`` | off | the portable sm80 kernels on any GPU (so Hopper can test them) |
| ``MOONEP_OPS_GLUON`` | on | the warp-specialized Gluon kernels for the sm90 forward GEMMs |
| ``MOONEP_OPS_PDL`` | on | programmatic dependent launches (sm90): the experts op's down GEMM, an FP8 pair's 2nd |
| ``MOONEP_OPS_FAST_LAUNCH`` | on | launch cached compiled kernels directly (skip Triton's per-call binding) |
| ``MOONEP_OPS_DISABLE_VLLM_PLUGIN`` | off | the vLLM plugin installs nothing (read when vLLM loads plugins) |
"""

import os
from typing import NamedTuple, Optional

DEBUG = "MOONEP_OPS_DEBUG"
PORTABLE = "MOONEP_OPS_PORTABLE"
GLUON = "MOONEP_OPS_GLUON"
PDL = "MOONEP_OPS_PDL"
FAST_LAUNCH = "MOONEP_OPS_FAST_LAUNCH"
DISABLE_VLLM_PLUGIN = "MOONEP_OPS_DISABLE_VLLM_PLUGIN"


_OFF = ("", "0", "false", "no", "off")


def enabled(name: str, default: bool = False) -> bool:
    """The switch ``name`` as the environment sets it now."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF


class Switches(NamedTuple):
    """The per-call switches, as :func:`reload` last read them (hashable: launch plans key on it)."""
    debug: bool
    portable: bool
    gluon: bool
    pdl: bool
    fast_launch: bool


_current: Optional[Switches] = None


def reload() -> Switches:
    """Read the per-call switches from the environment again (after changing one in-process)."""
    global _current
    _current = Switches(debug=enabled(DEBUG), portable=enabled(PORTABLE), gluon=enabled(GLUON, default=True),
                        pdl=enabled(PDL, default=True), fast_launch=enabled(FAST_LAUNCH, default=True))
    return _current


def current() -> Switches:
    return _current if _current is not None else reload()


def debug_checks() -> bool:
    return current().debug


def portable_only() -> bool:
    return current().portable


def gluon() -> bool:
    return current().gluon


def pdl() -> bool:
    return current().pdl


def fast_launch() -> bool:
    return current().fast_launch


def vllm_plugin_disabled() -> bool:
    return enabled(DISABLE_VLLM_PLUGIN)
