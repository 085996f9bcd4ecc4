"""vLLM 0.33's MoonEP expert compute, rewritten from its documentation, for comparison.

Three ``torch._grouped_mm`` calls with an eager ``silu``, ``mul_(up)`` and ``mul_(route_weight)``
between them (see ``/work/shared/seed`` and ``CONTRACT.md``). Known properties the compile tests
pin down:

- ``torch._grouped_mm`` never writes output rows past ``offs[-1]``: the tail is uninitialised
  memory (vLLM's docstring says zero-filled).
- Off its fast path (CUDA sm90/sm100 with bf16) it runs ``offs.cpu()`` plus a loop of matmuls:
  a device-to-host sync, so no CUDA-graph capture.
- Its meta function accepts bf16 only, so ``torch.compile`` of an fp32 composition fails
  although eager CPU runs fp32.
- Row strides must be multiples of 16 bytes.
"""

from typing import Optional

import torch


def grouped_mm(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``out[seg_g] = a[seg_g] @ w[g].T``, with ``w`` in vLLM's ``[G, N, K]`` convention."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=cu_seqlens)


def grouped_mm_experts(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor, cu_seqlens: torch.Tensor,
                       route_weights: Optional[torch.Tensor] = None, *,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same signature as :func:`moonep_ops.moonep_experts`."""
    gate = grouped_mm(x, w_gate, cu_seqlens)
    up = grouped_mm(x, w_up, cu_seqlens)
    # gate and up are already rounded to x's dtype here, unlike the fused moonep activation.
    act = torch.nn.functional.silu(gate)
    act.mul_(up)
    if route_weights is not None:
        act.mul_(route_weights.to(act.dtype).unsqueeze(-1))
    down = grouped_mm(act, w_down, cu_seqlens)
    if out is None:
        return down
    out.copy_(down)
    return out


def supported(dtype: torch.dtype, device) -> bool:
    """Whether ``torch._grouped_mm`` runs eagerly here at all (CPU support came late)."""
    a = torch.zeros(8, 8, dtype=dtype, device=device)
    w = torch.zeros(1, 8, 8, dtype=dtype, device=device)
    try:
        grouped_mm(a, w, torch.tensor([8], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True
