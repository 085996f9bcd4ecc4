"""Make a GPU-less process look like an sm90 CUDA machine to vLLM 0.33, for config and oracle tests.

Call :func:`install` first thing in a fresh process, before anything imports vLLM: every vLLM
module binds ``current_platform`` when it is imported. It sets ``vllm.platforms.current_platform``
to a ``CudaPlatformBase`` subclass (capability 9.0, an H200's name and memory, eight devices)
and stands in for what vLLM's CUDA build would load: the ``vllm._C_stable_libtorch`` extension,
the ``torch.ops._C`` capability queries that run at import, and ``vllm.vllm_flash_attn``. Nothing
here can run a kernel; it is enough to build ``VllmConfig`` and to import ``fused_moe``.
"""

import sys
import types


class _AnyAttribute(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def install() -> None:
    import torch

    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    sys.modules["vllm.vllm_flash_attn"] = _AnyAttribute("vllm.vllm_flash_attn")
    torch.ops._C.cutlass_scaled_mm_supports_block_fp8 = lambda capability: False

    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class Sm90Platform(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 << 30

        @classmethod
        def device_count(cls) -> int:
            return 8

        @classmethod
        def is_fully_connected(cls, physical_device_ids) -> bool:
            return True

        @classmethod
        def log_warnings(cls):
            pass

    vllm.platforms.current_platform = Sm90Platform()
