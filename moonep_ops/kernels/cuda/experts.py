"""The ``experts`` op on CUDA: the fused gate/up GEMM into a scratch ``act``, then the down GEMM.

``act``'s tail rows are never written: the down GEMM never reads rows past ``cu_seqlens[-1]``.
On sm90 the down GEMM (Gluon or Triton) is a programmatic dependent launch of the fused one
(:mod:`..pdl`): its programs start as the fused kernel's finish, issue their first weight loads
and wait for ``act``. Where both GEMMs run on Gluon and the fused config asks for it, the row-tile
handoff lets the down GEMM's programs start on finished row tiles of ``act`` instead of waiting for
the whole fused grid.
"""

import torch

from ... import flags
from ...cache import layout_signature
from ..pdl import PdlRole
from . import paths


def experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out, *, key=None) -> None:
    """``key``: the call's static signature (the checks' one), which fixes every operand's layout;
    the pair's launch plans key on it (None: they compute their own)."""
    cu = paths.contiguous(cu_seqlens)
    rw = paths.contiguous(route_weights)
    act = torch.empty((x.shape[0], w_gate.shape[1]), dtype=x.dtype, device=x.device)
    gluon = paths.gluon_wanted(paths.capability_of(x), x.dtype)  # (act has x's dtype and device)
    # PDL only when the fused kernel does launch (I > 0), so that it is the kernel right before
    # the down GEMM (NvS = 0 launches neither).
    pdl = flags.pdl() and w_gate.shape[1] > 0
    handoff = _handoff(x, w_gate, w_up, w_down, act, out, key) if pdl and gluon else None
    zeroed_out_tail = paths.run_fused(x, w_gate, w_up, rw, cu, act, zero_tail=False, gluon=gluon,
                                      role=PdlRole.PRIMARY if pdl else PdlRole.NONE, tail_out=out, handoff=handoff,
                                      key=None if key is None else (key, "fused"))
    # act's rows with route weight 0 are zero (silu(gate) * up * 0), so their output rows are too:
    # the down GEMM may skip them like the fused one did (the Gluon kernel's idle upper halves).
    paths.run_unfused(act, w_down, cu, out, role=PdlRole.DEPENDENT if pdl else PdlRole.NONE, idle_weights=rw,
                      zero_tail=not zeroed_out_tail, handoff=handoff, gluon=gluon,
                      key=None if key is None else (key, "down"))


_FLAG_TARGETS: dict = {}


def _handoff(x, w_gate, w_up, w_down, act, out, key):
    """The handoff state for this call (a fresh zeroed buffer), or None where the pair takes none.
    Only called where both GEMMs may run on Gluon."""
    target = _flag_target(x, w_gate, w_up, w_down, act, out, key)
    if not target:
        return None
    host = paths.gluon_host()
    return host.Handoff(host.handoff_state(x.shape[0], w_gate.shape[0], 128, x.device), target)


def _flag_target(x, w_gate, w_up, w_down, act, out, key) -> int:
    """The handoff's flag target for these operands (0: no handoff): only where both GEMMs run on
    Gluon, in 128-row tiles, and the fused config asks for it. Memoized per static signature."""
    if key is None:
        key = layout_signature(x, w_gate, w_up, w_down, out)
    target = _FLAG_TARGETS.get(key)
    if target is None:
        target = 0
        fused = paths.choose_gluon_fused(x, w_gate, w_up, act)
        down = paths.choose_gluon_unfused(act, w_down, None, out)
        if fused is not None and down is not None and fused.handoff and fused.block_m == down.block_m == 128:
            target = paths.gluon_host().flag_target(fused, w_gate.shape[1])
        _FLAG_TARGETS[key] = target
    return target
