"""moonep_ops: MoonEP's mixture-of-experts compute as PyTorch custom ops.

Importing this package defines the ``moonep`` ops (:mod:`moonep_ops.schemas`), registers
their CPU and CUDA kernels (:mod:`moonep_ops.kernels`), their fake impls (the top-level
``fake_impls`` package), their autograd formulas (:mod:`moonep_ops.autograd`) and their autocast
rules (:mod:`moonep_ops.autocast`). The public API is :mod:`moonep_ops.ops`, with the FP8 weight
helpers in :mod:`moonep_ops.fp8`. vLLM integration lives in :mod:`moonep_ops.vllm` and is imported
only on demand.
"""

from . import schemas  # noqa: F401  (defines the schemas first)
from . import kernels  # noqa: F401  (registers the kernels)
import fake_impls  # noqa: F401,E402  (registers the fakes)
from . import autograd  # noqa: F401,E402  (autograd formulas; after kernels and fakes)
from . import autocast  # noqa: F401,E402  (torch.autocast casts of the GEMM ops' operands)
from . import fp8  # noqa: E402  (FP8 block-scaled weights: quantize_weight, dequantize_weight, quantize_rows)

from .ops import (grouped_gemm, grouped_gemm_silu_mul, grouped_gemm_silu_mul_with_gate_up,  # noqa: E402
                  moonep_experts, silu_mul_weight)

__version__ = "0.1.0"

__all__ = ["grouped_gemm", "silu_mul_weight", "grouped_gemm_silu_mul", "grouped_gemm_silu_mul_with_gate_up",
           "moonep_experts", "fp8", "__version__"]
