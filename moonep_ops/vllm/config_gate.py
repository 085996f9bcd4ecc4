"""The one monkeypatch of the FP8 path: let ``VllmConfig`` accept ``--quantization moonep_fp8``
with ``--all2all-backend moonep``.

vLLM 0.33's ``VllmConfig.__post_init__`` (``config/vllm.py``, the ``all2all_backend == "moonep"``
block) raises ``ValueError`` whenever ``model_config.quantization`` is set, inline, after the rest
of the validation; there is no hook or setting around it. :func:`install` wraps
``VllmConfig.__post_init__`` so that, for that one combination only (backend ``moonep`` and
quantization ``moonep_fp8``), the original runs with the quantization config already built and
``model_config.quantization`` reading ``None``, and gets ``"moonep_fp8"`` back afterwards (also if
it raises). Every other configuration calls the original unchanged.

What the original then sees differently: ``_get_quantization_config`` is skipped (the config is
already there, as the original itself would have built it); the MoonEP block's quantization check
passes (its dtype, EPLB and placement checks still apply); and
``_uses_breakable_cudagraph_for_batch_invariance`` (only with ``VLLM_BATCH_INVARIANT``) and the
ROCm/XPU platform hooks would read ``None``, which does not matter for MoonEP (CUDA, and vLLM
forces ``cudagraph_mode = NONE`` for it anyway).

The plugin installs it in every process it loads in (``register()``), and it changes nothing
until a user opts in with ``--quantization moonep_fp8``: every other configuration, the BF16
MoonEP one included, runs vLLM's check unchanged. Installing it only when the opt-in is seen
would not do: vLLM rebuilds ``VllmConfig`` with ``dataclasses.replace`` (which runs
``__post_init__`` again) in processes that never resolve the model's quantization, e.g. the
weight-cache daemon, EAGLE drafts and the FlashInfer autotune cache key in the workers.
Idempotent; the wrapper keeps the original as ``__wrapped__``.
"""

import functools
import logging

logger = logging.getLogger(__name__)

QUANTIZATION = "moonep_fp8"
BACKEND = "moonep"
_MARK = "_moonep_ops_fp8_gate"


def applies(vllm_config) -> bool:
    """Whether the wrapper changes anything for this config: MoonEP backend and ``moonep_fp8``."""
    model = vllm_config.model_config
    return (model is not None and model.quantization == QUANTIZATION
            and vllm_config.parallel_config.all2all_backend == BACKEND)


def installed() -> bool:
    from vllm.config import VllmConfig

    return getattr(VllmConfig.__post_init__, _MARK, False)


def install() -> None:
    """Wrap ``VllmConfig.__post_init__`` (once per process)."""
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __post_init__(self):
        if not applies(self):
            return original(self)
        model = self.model_config
        if self.quant_config is None:
            # What the original does first, while model_config still names the method.
            self.quant_config = VllmConfig._get_quantization_config(model, self.load_config)
        model.quantization = None
        try:
            return original(self)
        finally:
            model.quantization = QUANTIZATION

    setattr(__post_init__, _MARK, True)
    VllmConfig.__post_init__ = __post_init__
    logger.info("moonep_ops: --quantization %s: VllmConfig accepts it with --all2all-backend %s",
                QUANTIZATION, BACKEND)


def uninstall() -> None:
    """Restore vLLM's ``VllmConfig.__post_init__`` (tests)."""
    from vllm.config import VllmConfig

    current = VllmConfig.__post_init__
    if getattr(current, _MARK, False):
        VllmConfig.__post_init__ = current.__wrapped__
