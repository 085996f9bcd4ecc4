"""Host-cheap pre-checks for the CUDA kernels' eager calls.

Each function answers "are these arguments certainly valid?" with plain comparisons on
concrete metadata. When it says yes, the full checks in :mod:`._checks` (one ``torch._check``
per condition, with a message) are skipped; when it says no, the caller runs them, and they
raise the precise error. So a "yes" here must imply that the full checks pass: these may be
stricter than the full checks (a false "no" only costs time), never looser. Fake impls (symbolic shapes) always run the full checks.
"""

import torch

_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_gemm_ok(a, w, cu) -> bool:
    return (a.dim() == 2 and w.dim() == 3 and cu.dim() == 1 and w.shape[0] >= 1
            and a.shape[1] == w.shape[2] and a.dtype in _CUDA_DTYPES and w.dtype == a.dtype
            and cu.dtype == torch.int32 and cu.shape[0] == w.shape[0]
            and w.device == a.device and cu.device == a.device)


def out_ok(out, rows, cols, dtype, device) -> bool:
    return (out.dim() == 2 and out.shape[0] == rows and out.shape[1] == cols and out.dtype == dtype
            and out.device == device and out.is_contiguous())


def route_weights_ok(rw, rows) -> bool:
    return rw is None or (rw.dim() == 1 and rw.shape[0] == rows.shape[0] and rw.dtype == torch.float32
                          and rw.device == rows.device)


def silu_mul_weight_ok(gate, up, rw, cu) -> bool:
    return (gate.dim() == 2 and up.shape == gate.shape and gate.dtype in _CUDA_DTYPES
            and up.dtype == gate.dtype and up.device == gate.device and cu.device == gate.device
            and cu.dim() == 1 and cu.dtype == torch.int32 and cu.shape[0] >= 1
            and route_weights_ok(rw, gate))


def grouped_gemm_silu_mul_ok(x, w_gate, w_up, rw, cu) -> bool:
    return (grouped_gemm_ok(x, w_gate, cu) and w_up.shape == w_gate.shape and w_up.dtype == x.dtype
            and w_up.device == x.device and route_weights_ok(rw, x))


def experts_ok(x, w_gate, w_up, w_down, rw, cu) -> bool:
    return (grouped_gemm_silu_mul_ok(x, w_gate, w_up, rw, cu) and w_down.dim() == 3
            and w_down.shape[0] == w_gate.shape[0] and w_down.shape[1] == x.shape[1]
            and w_down.shape[2] == w_gate.shape[1] and w_down.dtype == x.dtype and w_down.device == x.device)
