"""CUDA kernels: Triton, JIT-compiled at first use, for NVIDIA GPUs from sm80.

Registered for the CUDA dispatch key. Triton is imported at the first call, so importing
``moonep_ops`` needs neither Triton nor a GPU. Argument checks read metadata only;
``MOONEP_OPS_DEBUG=1`` adds the data checks on ``cu_seqlens``, which sync the host.
"""

import contextlib
import functools
import os

import torch

from .. import _checks, _fast_checks
from .._library import lib
from . import configs


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability_of(t: torch.Tensor):
    """Device capability, or None for CPU tensors (TRITON_INTERPRET=1 runs)."""
    if t.device.type != "cuda":
        return None
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def portable_only() -> bool:
    """``MOONEP_OPS_PORTABLE=1`` forces the sm80 path on any GPU (so Hopper can test it)."""
    return os.environ.get("MOONEP_OPS_PORTABLE", "0") not in ("", "0")


def pdl_allowed() -> bool:
    """``MOONEP_OPS_NO_PDL=1`` launches the ``experts`` op's two GEMMs plainly, one after the other
    (on Hopper the down GEMM is otherwise a programmatic dependent launch of the fused one)."""
    return os.environ.get("MOONEP_OPS_NO_PDL", "0") in ("", "0")


def gluon_allowed() -> bool:
    """``MOONEP_OPS_GLUON=0`` keeps the forward GEMMs on the Triton kernel on Hopper too (the
    warp-specialized Gluon kernels are otherwise used where :func:`_gluon_usable` holds)."""
    return os.environ.get("MOONEP_OPS_GLUON", "1") not in ("", "0")


_GLUON_MODULE = []  # [module or None] once the import was tried


def _gluon_module():
    """:mod:`.gluon_grouped_gemm`, or None when this Triton's Gluon (an experimental layer) lacks
    what it uses: then the Triton kernels run."""
    if not _GLUON_MODULE:
        try:
            from . import gluon_grouped_gemm as module
        except Exception:  # noqa: BLE001  (ImportError, or an API that moved)
            module = None
        _GLUON_MODULE.append(module)
    return _GLUON_MODULE[0]


def _gluon_importable() -> bool:
    return _gluon_module() is not None


def _gluon_wanted(capability, dtype) -> bool:
    """The per-call part of the choice (cheap; the TMA checks run once per signature, in
    :func:`_gluon_plain` / :func:`_gluon_fused`): sm90 exactly (wgmma; Blackwell has none),
    bf16/fp16, unless ``MOONEP_OPS_PORTABLE=1`` or ``MOONEP_OPS_GLUON=0``."""
    return (capability == (9, 0) and dtype in (torch.bfloat16, torch.float16) and gluon_allowed()
            and not portable_only() and _gluon_module() is not None)


def _gluon_usable(capability, a, out, *weights) -> bool:
    """All of the choice: :func:`_gluon_wanted`, and operands and output TMA can address
    (``tma_usable`` also refuses empty extents: K = 0, no weight rows)."""
    from .triton_grouped_gemm import tma_addressable, tma_usable

    return _gluon_wanted(capability, a.dtype) and tma_usable(a, *weights) and tma_addressable(out)


def _gluon_plain(a, w, _w_up, out):
    """Config of the plain GEMM on the Gluon kernel, or None (operands TMA cannot address)."""
    if not _gluon_usable(capability_of(a), a, out, w):
        return None
    return configs.gluon_gemm_config(w.shape[1], a.shape[1], a.shape[0], fused=False)


def _gluon_fused(x, w_gate, w_up, out):
    if not _gluon_usable(capability_of(x), x, out, w_gate, w_up):
        return None
    return configs.gluon_gemm_config(w_gate.shape[1], x.shape[1], x.shape[0], fused=True)


def hopper_tma(capability, dtype) -> bool:
    """TMA loads: sm90+ and bf16/fp16 (fp32 takes the portable path), unless
    ``MOONEP_OPS_PORTABLE=1``."""
    return capability is not None and capability >= (9, 0) and dtype != torch.float32 and not portable_only()


def _use_tma(capability, a, *weights) -> bool:
    from .triton_grouped_gemm import tma_usable

    return hopper_tma(capability, a.dtype) and tma_usable(a, *weights)


def _choose_plain(a, w, _, _a2=None):
    cap = capability_of(a)
    return configs.gemm_config(w.shape[1], a.shape[1], a.shape[0], a.dtype, cap), _use_tma(cap, a, w)


def _choose_fused(x, w_gate, w_up, _a2=None):
    cap = capability_of(x)
    return (configs.fused_gemm_config(w_gate.shape[1], x.shape[1], x.shape[0], x.dtype, cap),
            _use_tma(cap, x, w_gate, w_up))


def _dense(t):
    """The kernels index ``cu_seqlens`` and ``route_weights`` as dense vectors; a strided view
    (even stride 0) becomes a copy here, on the device (free when already contiguous)."""
    return None if t is None else t.contiguous()


def _run_plain(a, w, cu, out, pdl: str = "", idle_weights=None, zero_tail: bool = True, sched=None,
               flag_target: int = 0) -> bool:
    """The plain GEMM on the Gluon kernel when it applies (True), else on the Triton kernel.
    ``idle_weights``, ``sched``, ``flag_target``: see ``gluon_grouped_gemm._kernel_args`` (the
    Triton kernel ignores them)."""
    if _gluon_wanted(capability_of(a), a.dtype) and _gluon_module().run_gluon_gemm(
            a, w, None, None, cu, out, _gluon_plain, zero_tail=zero_tail, pdl=pdl, idle_weights=idle_weights,
            sched=sched, flag_target=flag_target):
        return True
    from .triton_grouped_gemm import run_moe_gemm

    run_moe_gemm(a, w, None, None, cu, out, _choose_plain, portable_only(), zero_tail=zero_tail, pdl=pdl)
    return False


def _run_fused(x, w_gate, w_up, route_weights, cu, out, zero_tail: bool = True, pdl: str = "", tail_out=None,
               sched=None):
    """The fused GEMM on the Gluon kernel when it applies (its result: True, or ``TOOK_TAIL`` when
    it also zeroed ``tail_out``'s tail), else on the Triton kernel (False; ``tail_out`` untouched)."""
    if _gluon_wanted(capability_of(x), x.dtype):
        ran = _gluon_module().run_gluon_gemm(x, w_gate, w_up, route_weights, cu, out, _gluon_fused,
                                             zero_tail=zero_tail, pdl=pdl, tail_out=tail_out, sched=sched)
        if ran:
            return ran
    from .triton_grouped_gemm import run_moe_gemm

    run_moe_gemm(x, w_gate, w_up, route_weights, cu, out, _choose_fused, portable_only(), zero_tail=zero_tail,
                 pdl=pdl)
    return False


def grouped_gemm_into(a, w, cu_seqlens, out) -> None:
    _run_plain(a, w, _dense(cu_seqlens), out)


def grouped_gemm_silu_mul_into(x, w_gate, w_up, route_weights, cu_seqlens, out) -> None:
    _run_fused(x, w_gate, w_up, _dense(route_weights), _dense(cu_seqlens), out)


def grouped_gemm_silu_mul_with_gate_up_into(x, w_gate, w_up, route_weights, cu_seqlens, act, gate, up) -> None:
    from .triton_grouped_gemm import run_moe_gemm

    run_moe_gemm(x, w_gate, w_up, _dense(route_weights), _dense(cu_seqlens), act, _choose_fused,
                 portable_only(), saved=(gate, up))


def experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    """The fused gate/up GEMM into a scratch ``act``, then the down GEMM into ``out``. ``act``'s tail
    rows are left unwritten: the down GEMM never reads rows past ``cu_seqlens[-1]``."""
    cu = _dense(cu_seqlens)
    act = torch.empty((x.shape[0], w_gate.shape[1]), dtype=x.dtype, device=x.device)
    # On Hopper the down GEMM (Gluon or Triton) is launched as a programmatic dependent of the
    # fused one (Gluon or Triton): its programs start as the fused kernel's finish, issue their
    # first weight loads and wait for ``act``. Only when the fused kernel does launch (I > 0), so
    # that it is the kernel right before it (NvS = 0 launches neither).
    pdl = pdl_allowed() and w_gate.shape[1] > 0
    rw = _dense(route_weights)
    # The row-tile handoff (both GEMMs on Gluon, and the fused config asks for it): the down GEMM's
    # programs take items dynamically and start on row tiles of act the fused GEMM has finished,
    # instead of waiting for its whole grid.
    target = _handoff_target(x, w_gate, w_up, w_down, act, out) if pdl else 0
    sched = _gluon_module().handoff_buffer(x.shape[0], w_gate.shape[0], 128, x.device) if target else None
    # A fused Gluon config with ``takes_out_tail`` zeroes out's tail while it computes.
    fused = _run_fused(x, w_gate, w_up, rw, cu, act, zero_tail=False, pdl="primary" if pdl else "", tail_out=out,
                       sched=sched)
    took_tail = fused == _gluon_module().TOOK_TAIL if fused else False
    # act's rows with route weight 0 are zero (silu(gate) * up * 0), so their output rows are too:
    # the down GEMM may skip them like the fused one did (the Gluon kernels' idle upper halves).
    _run_plain(act, w_down, cu, out, pdl="dependent" if pdl else "", idle_weights=rw, zero_tail=not took_tail,
               sched=sched, flag_target=target)


_HANDOFF: dict = {}


def _handoff_target(x, w_gate, w_up, w_down, act, out) -> int:
    """The flag target of the experts op's row-tile handoff for these operands (0: no handoff):
    only where both GEMMs run on Gluon, in 128-row tiles, and the fused config asks for it.
    Memoized per static signature (host cost)."""
    key = (x.shape, x.stride(), w_gate.shape, w_gate.stride(), w_up.stride(), w_down.shape, w_down.stride(),
           out.stride(), x.dtype, x.device, x.data_ptr() % 16, w_gate.data_ptr() % 16, w_up.data_ptr() % 16,
           w_down.data_ptr() % 16, out.data_ptr() % 16)
    target = _HANDOFF.get(key)
    if target is None:
        target = 0
        if _gluon_wanted(capability_of(x), x.dtype):
            fused = _gluon_fused(x, w_gate, w_up, act)
            down = _gluon_plain(act, w_down, None, out)
            if fused is not None and down is not None and fused.handoff and fused.block_m == down.block_m == 128:
                target = _gluon_module().flag_target(fused, w_gate.shape[1])
        _HANDOFF[key] = target
    return target


def silu_mul_weight_into(gate, up, route_weights, cu_seqlens, out) -> None:
    from .triton_silu_mul_weight import launch_silu_mul_weight

    cfg = configs.eltwise_config(gate.shape[1], capability_of(gate))
    launch_silu_mul_weight(gate, up, _dense(route_weights), _dense(cu_seqlens), out, cfg)


def _on_device(t: torch.Tensor):
    """Triton launches on the current device: switch to the tensors' device when it differs."""
    if t.device.index is None or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _debug_checks(op_name, cu_seqlens, num_rows) -> None:
    if _checks.debug_checks_enabled():
        _checks.check_cu_seqlens_values(op_name, cu_seqlens, num_rows)


def grouped_gemm(a, w, cu_seqlens):
    if not _fast_checks.grouped_gemm_ok(a, w, cu_seqlens):
        _checks.check_grouped_gemm("grouped_gemm", a, w, cu_seqlens)
    _debug_checks("grouped_gemm", cu_seqlens, a.shape[0])
    out = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    with _on_device(a):
        grouped_gemm_into(a, w, cu_seqlens, out)
    return out


def grouped_gemm_out(a, w, cu_seqlens, out) -> None:
    if not (_fast_checks.grouped_gemm_ok(a, w, cu_seqlens)
            and _fast_checks.out_ok(out, a.shape[0], w.shape[1], a.dtype, a.device)):
        _checks.check_grouped_gemm("grouped_gemm_out", a, w, cu_seqlens)
        _checks.check_out("grouped_gemm_out", out, (a.shape[0], w.shape[1]), a.dtype, a.device)
    _debug_checks("grouped_gemm_out", cu_seqlens, a.shape[0])
    with _on_device(a):
        grouped_gemm_into(a, w, cu_seqlens, out)


def silu_mul_weight(gate, up, route_weights, cu_seqlens):
    if not _fast_checks.silu_mul_weight_ok(gate, up, route_weights, cu_seqlens):
        _checks.check_silu_mul_weight("silu_mul_weight", gate, up, route_weights, cu_seqlens)
    _debug_checks("silu_mul_weight", cu_seqlens, gate.shape[0])
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    with _on_device(gate):
        silu_mul_weight_into(gate, up, route_weights, cu_seqlens, out)
    return out


def grouped_gemm_silu_mul(x, w_gate, w_up, route_weights, cu_seqlens):
    if not _fast_checks.grouped_gemm_silu_mul_ok(x, w_gate, w_up, route_weights, cu_seqlens):
        _checks.check_grouped_gemm_silu_mul("grouped_gemm_silu_mul", x, w_gate, w_up, route_weights,
                                            cu_seqlens)
    _debug_checks("grouped_gemm_silu_mul", cu_seqlens, x.shape[0])
    out = torch.empty((x.shape[0], w_gate.shape[1]), dtype=x.dtype, device=x.device)
    with _on_device(x):
        grouped_gemm_silu_mul_into(x, w_gate, w_up, route_weights, cu_seqlens, out)
    return out


def grouped_gemm_silu_mul_with_gate_up(x, w_gate, w_up, route_weights, cu_seqlens):
    name = "grouped_gemm_silu_mul_with_gate_up"
    if not _fast_checks.grouped_gemm_silu_mul_ok(x, w_gate, w_up, route_weights, cu_seqlens):
        _checks.check_grouped_gemm_silu_mul(name, x, w_gate, w_up, route_weights, cu_seqlens)
    _debug_checks(name, cu_seqlens, x.shape[0])
    shape = (x.shape[0], w_gate.shape[1])
    act, gate, up = (torch.empty(shape, dtype=x.dtype, device=x.device) for _ in range(3))
    with _on_device(x):
        grouped_gemm_silu_mul_with_gate_up_into(x, w_gate, w_up, route_weights, cu_seqlens, act, gate, up)
    return act, gate, up


def experts(x, w_gate, w_up, w_down, route_weights, cu_seqlens):
    if not _fast_checks.experts_ok(x, w_gate, w_up, w_down, route_weights, cu_seqlens):
        _checks.check_experts("experts", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
    _debug_checks("experts", cu_seqlens, x.shape[0])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with _on_device(x):
        experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
    return out


def experts_out(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out) -> None:
    if not (_fast_checks.experts_ok(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
            and _fast_checks.out_ok(out, x.shape[0], x.shape[1], x.dtype, x.device)):
        _checks.check_experts("experts_out", x, w_gate, w_up, w_down, route_weights, cu_seqlens)
        _checks.check_out("experts_out", out, tuple(x.shape), x.dtype, x.device)
    _debug_checks("experts_out", cu_seqlens, x.shape[0])
    with _on_device(x):
        experts_into(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)


lib.impl("grouped_gemm", grouped_gemm, "CUDA")
lib.impl("grouped_gemm_out", grouped_gemm_out, "CUDA")
lib.impl("silu_mul_weight", silu_mul_weight, "CUDA")
lib.impl("grouped_gemm_silu_mul", grouped_gemm_silu_mul, "CUDA")
lib.impl("grouped_gemm_silu_mul_with_gate_up", grouped_gemm_silu_mul_with_gate_up, "CUDA")
lib.impl("experts", experts, "CUDA")
lib.impl("experts_out", experts_out, "CUDA")
