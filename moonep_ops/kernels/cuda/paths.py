"""Which kernel runs a CUDA GEMM: the sm90 Gluon kernel, the Triton kernel with TMA loads, or the
portable Triton kernel (sm80+, any strides), and with which config.

The choosers (``choose_*``) are module-level functions: the launch plan caches key on them, and
each runs once per static signature. Triton and Gluon are imported at first use, so importing
``moonep_ops`` needs neither.
"""

import contextlib
import functools

import torch

from ... import flags
from ..pdl import PdlRole
from ..triton import configs


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def config_capability(capability):
    """The capability whose kernel path and config tables a GPU of ``capability`` takes. The tables
    have two classes: sm90 and up (227 KB of shared memory per block, TMA, the H200's tuning) and
    sm80/sm86/sm89. Consumer Blackwell (sm120, sm121: RTX 50, RTX PRO 6000, GB10) has 99 KB per
    block and neither wgmma nor tcgen05, so it runs as sm89 (the portable path, mma.sync)."""
    if capability is not None and capability >= (12, 0):
        return (8, 9)
    return capability


def capability_of(t: torch.Tensor):
    """The capability the kernel choice goes by (:func:`config_capability` of the device's), or
    None for CPU tensors (TRITON_INTERPRET=1 runs, the AOT compile check)."""
    if t.device.type != "cuda":
        return None
    return config_capability(_capability(t.device.index if t.device.index is not None
                                         else torch.cuda.current_device()))


def on_device(t: torch.Tensor):
    """Triton launches on the current device: switch to the tensors' device when it differs."""
    if t.device.index is None or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def contiguous(t):
    """The kernels index ``cu_seqlens`` and ``route_weights`` as contiguous vectors; a strided view
    (even stride 0) becomes a copy here, on the device (free when already contiguous)."""
    return None if t is None else t.contiguous()


_GLUON_HOST = []  # [module or None] once the import was tried


def gluon_host():
    """:mod:`..gluon.host`, or None when this Triton's Gluon (an experimental layer) lacks what it
    uses: then the Triton kernels run."""
    if not _GLUON_HOST:
        try:
            from ..gluon import host as module
        except Exception:  # noqa: BLE001  (ImportError, or an API that moved)
            module = None
        _GLUON_HOST.append(module)
    return _GLUON_HOST[0]


def gluon_wanted(capability, dtype) -> bool:
    """The per-call part of the Gluon choice (the TMA checks run once per signature, in the
    choosers): sm90 exactly (wgmma; Blackwell has none), bf16/fp16, the switches allowing."""
    return (capability == (9, 0) and dtype in (torch.bfloat16, torch.float16) and flags.gluon()
            and not flags.portable_only() and gluon_host() is not None)


def hopper_tma(capability, dtype) -> bool:
    """TMA loads: sm90+ and bf16/fp16 (fp32 takes the portable path), unless ``MOONEP_OPS_PORTABLE``."""
    return (capability is not None and capability >= (9, 0) and dtype != torch.float32
            and not flags.portable_only())


def _gluon_usable(a, out, *weights) -> bool:
    """Operands and output that TMA can address (``tma_usable`` also refuses empty extents)."""
    from ..triton.grouped_gemm import tma_addressable, tma_usable

    return gluon_wanted(capability_of(a), a.dtype) and tma_usable(a, *weights) and tma_addressable(out)


def choose_gluon_unfused(a, w, _w_up, out):
    """Config of ``a @ w[g].T`` on the Gluon kernel, or None (not for this kernel)."""
    from ..gluon import config

    if not _gluon_usable(a, out, w):
        return None
    return config.gluon_gemm_config(w.shape[1], a.shape[1], a.shape[0], fused=False, groups=w.shape[0])


def choose_gluon_fused(x, w_gate, w_up, out):
    from ..gluon import config

    if not _gluon_usable(x, out, w_gate, w_up):
        return None
    return config.gluon_gemm_config(w_gate.shape[1], x.shape[1], x.shape[0], fused=True, groups=w_gate.shape[0])


def _use_tma(capability, a, *weights) -> bool:
    from ..triton.grouped_gemm import tma_usable

    return hopper_tma(capability, a.dtype) and tma_usable(a, *weights)


def choose_unfused(a, w, _w_up, _a_up=None):
    cap = capability_of(a)
    return configs.gemm_config(w.shape[1], a.shape[1], a.shape[0], a.dtype, cap), _use_tma(cap, a, w)


def choose_fused(x, w_gate, w_up, _a_up=None):
    cap = capability_of(x)
    return (configs.fused_gemm_config(w_gate.shape[1], x.shape[1], x.shape[0], x.dtype, cap),
            _use_tma(cap, x, w_gate, w_up))


def choose_dgrad(grad_out, w_t, _w_up, _a_up=None):
    """``w_t`` is the transposed view ``[G, K, N]`` of the weights: on sm90 TMA reads their storage
    as ``[G*N, K]`` rows when the reduction is a multiple of ``BLOCK_K``."""
    from ..triton.grouped_gemm import tma_usable_kn

    cap = capability_of(grad_out)
    cfg = configs.dgrad_config(w_t.shape[1], w_t.shape[2], grad_out.shape[0], grad_out.dtype, cap)
    return cfg, hopper_tma(cap, grad_out.dtype) and tma_usable_kn(grad_out, w_t, cfg.block_k)


def choose_dual_dgrad(grad_gate, wg_t, wu_t, grad_up):
    """Both transposed views on TMA when both pairs qualify."""
    from ..triton.grouped_gemm import tma_usable_kn

    cap = capability_of(grad_gate)
    cfg = configs.dgrad_config(wg_t.shape[1], wg_t.shape[2], grad_gate.shape[0], grad_gate.dtype, cap, dual=True)
    return cfg, (hopper_tma(cap, grad_gate.dtype) and tma_usable_kn(grad_gate, wg_t, cfg.block_k)
                 and tma_usable_kn(grad_up, wu_t, cfg.block_k))


def run_unfused(a, w, cu, out, *, role: PdlRole = PdlRole.NONE, idle_weights=None, zero_tail: bool = True,
                handoff=None, gluon: bool = None, key=None) -> None:
    """``out[seg_g] = a[seg_g] @ w[g].T`` on the Gluon kernel when it applies, else the Triton one
    (``idle_weights`` and ``handoff``: Gluon only, see :func:`..gluon.host.kernel_args`; ``gluon``:
    :func:`gluon_wanted` when the caller has it already; ``key``: the call's static signature when
    the caller has one, which must fix the layout of every operand here)."""
    if gluon_wanted(capability_of(a), a.dtype) if gluon is None else gluon:
        host = gluon_host()
        ran = host.run(a, w, None, None, cu, out, choose_gluon_unfused, zero_tail=zero_tail, role=role,
                       idle_weights=idle_weights, handoff=handoff, key=key)
        if ran is not host.GluonResult.NOT_APPLICABLE:
            return
    from ..triton import grouped_gemm

    grouped_gemm.run(a, w, None, None, cu, out, choose_unfused, zero_tail=zero_tail, role=role, key=key)


def run_fused(x, w_gate, w_up, route_weights, cu, out, *, zero_tail: bool = True, role: PdlRole = PdlRole.NONE,
              tail_out=None, handoff=None, gluon: bool = None, key=None) -> bool:
    """The fused SwiGLU GEMM on the Gluon kernel when it applies, else the Triton one. Returns
    whether it also zeroed ``tail_out``'s tail rows (a Gluon config that ``takes_out_tail``)."""
    if gluon_wanted(capability_of(x), x.dtype) if gluon is None else gluon:
        host = gluon_host()
        ran = host.run(x, w_gate, w_up, route_weights, cu, out, choose_gluon_fused, zero_tail=zero_tail, role=role,
                       tail_out=tail_out, handoff=handoff, key=key)
        if ran is not host.GluonResult.NOT_APPLICABLE:
            return ran is host.GluonResult.RAN_AND_ZEROED_TAIL_OUT
    from ..triton import grouped_gemm

    grouped_gemm.run(x, w_gate, w_up, route_weights, cu, out, choose_fused, zero_tail=zero_tail, role=role, key=key)
    return False
