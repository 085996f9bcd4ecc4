"""Every ``MOONEP_OPS_*`` switch, parsed one way.

Read at call time (a test or a user may flip one between calls), except ``FAST_LAUNCH`` (read
at import). A set variable is off when it is ``""``, ``0``, ``false``, ``no`` or ``off`` (any
case), on otherwise.

| variable | default | effect |
| --- | --- | --- |
| ``MOONEP_OPS_DEBUG`` | off | data checks of ``cu_seqlens`` on CUDA too (they sync the host) |
| ``MOONEP_OPS_PORTABLE`` | off | the portable sm80 kernels on any GPU (so Hopper can test them) |
| ``MOONEP_OPS_GLUON`` | on | the warp-specialized Gluon kernels for the sm90 forward GEMMs |
| ``MOONEP_OPS_PDL`` | on | the experts op's down GEMM as a programmatic dependent launch (sm90) |
| ``MOONEP_OPS_FAST_LAUNCH`` | on | launch cached compiled kernels directly (skip Triton's per-call binding) |
| ``MOONEP_OPS_DISABLE_VLLM_PLUGIN`` | off | the vLLM plugin installs nothing |
"""

import os

DEBUG = "MOONEP_OPS_DEBUG"
PORTABLE = "MOONEP_OPS_PORTABLE"
GLUON = "MOONEP_OPS_GLUON"
PDL = "MOONEP_OPS_PDL"
FAST_LAUNCH = "MOONEP_OPS_FAST_LAUNCH"
DISABLE_VLLM_PLUGIN = "MOONEP_OPS_DISABLE_VLLM_PLUGIN"


_OFF = ("", "0", "false", "no", "off")


def enabled(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF


def debug_checks() -> bool:
    return enabled(DEBUG)


def portable_only() -> bool:
    return enabled(PORTABLE)


def gluon() -> bool:
    return enabled(GLUON, default=True)


def pdl() -> bool:
    return enabled(PDL, default=True)


def fast_launch() -> bool:
    return enabled(FAST_LAUNCH, default=True)


def vllm_plugin_disabled() -> bool:
    return enabled(DISABLE_VLLM_PLUGIN)
