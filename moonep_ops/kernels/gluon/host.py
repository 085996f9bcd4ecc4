"""Host side of the Gluon kernel: TMA descriptors, the kernel's arguments, launch plans.

:func:`run` is the CUDA ops' entry (a plan per static signature, then direct launches of the
compiled kernel); :func:`launch` takes an explicit config (tests, the AOT compile check).
"""

import dataclasses
import enum

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...cache import layout_signature
from ...fp8 import BLOCK, is_block_major, weight_dims
from .. import launch as direct
from ..pdl import PdlRole
from ..triton.grouped_gemm import num_row_tiles, persistent_programs
from .config import CONSUMER_REGS, PRODUCER_REGS, GluonConfig
from .kernel import gluon_grouped_gemm_kernel

# Rows per TMA store of the producer's zero buffer (the tail's zeros): small, because the ring
# already takes nearly all of the shared memory (8 x 128 bf16 is 2 KiB).
ZERO_ROWS = 8

# Polls of a row tile's flag (about 0.1-0.3 us apart) before the dependent falls back to the
# grid-wide wait: far longer than a legitimate wait (one or two of the primary's items), short
# enough that a flag that never fills costs a few milliseconds once, never a hang.
MAX_POLLS = 16384


class GluonResult(enum.Enum):
    NOT_APPLICABLE = 0  # these operands are not for this kernel (e.g. TMA cannot address them)
    RAN = 1
    RAN_AND_ZEROED_TAIL_OUT = 2  # also zeroed ``tail_out``'s tail rows (a ``takes_out_tail`` config)


@dataclasses.dataclass(frozen=True)
class Handoff:
    """The row-tile handoff of the experts op's pair: ``state`` (:func:`handoff_state`) holds the
    dependent's item counter, then one flag per row tile of ``act``; the primary adds to a row
    tile's flag as it stores it, the dependent waits until it reaches ``flag_target``."""
    state: torch.Tensor
    flag_target: int = 0


def flag_target(cfg: GluonConfig, n: int) -> int:
    """A row tile's flag once the primary (config ``cfg``, ``n`` output columns) stored all of it:
    each of its column tiles adds one per consumer thread."""
    return triton.cdiv(n, cfg.block_n) * 32 * cfg.num_warps


def handoff_state(num_rows: int, num_groups: int, block_m: int, device) -> torch.Tensor:
    """The handoff's state, zeroed (one per pair launch): the item counter, then one flag per row
    tile (a static bound on their number)."""
    return torch.zeros(1 + num_row_tiles(num_rows, num_groups, block_m), dtype=torch.int32, device=device)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


def descriptors(a, w, w_up, out, cfg: GluonConfig, tail_out=None) -> tuple:
    """TMA descriptors for ``cfg``'s blocks: ``a [NvS, K]``; ``w`` and ``w_up`` each as one
    ``[G*N, K]`` matrix; ``out [NvS, N]`` by output tile (half its columns for a split epilogue, half
    its rows for split rows);
    ``out`` again (or ``tail_out``) by ``ZERO_ROWS x epilogue`` chunk for the tail's zeros; and
    ``a`` by half a row tile where the config skips idle upper halves (the producer loads their
    lower halves alone; else None)."""
    zeroed = out if tail_out is None else tail_out
    epi_n = cfg.epilogue_n or cfg.block_n
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], _GL_DTYPES[a.dtype])
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], _GL_DTYPES[w.dtype])
    epi_m = cfg.block_m // 2 if cfg.split_rows else cfg.block_m  # (each consumer stores its half)
    o_layout = gl.NVMMASharedLayout.get_default_for([epi_m, epi_n], _GL_DTYPES[out.dtype])
    z_layout = gl.NVMMASharedLayout.get_default_for([ZERO_ROWS, epi_n], _GL_DTYPES[zeroed.dtype])
    return (TensorDescriptor(a, list(a.shape), list(a.stride()), [cfg.block_m, cfg.block_k], a_layout),
            _weight_descriptor(w, cfg, w_layout), _weight_descriptor(w_up, cfg, w_layout),
            TensorDescriptor(out, list(out.shape), list(out.stride()), [epi_m, epi_n], o_layout),
            TensorDescriptor(zeroed, list(zeroed.shape), list(zeroed.stride()), [ZERO_ROWS, epi_n], z_layout),
            TensorDescriptor(a, list(a.shape), list(a.stride()), [cfg.block_m // 2, cfg.block_k], a_layout)
            if cfg.skip_idle_half else None)


def _weight_descriptor(w, cfg: GluonConfig, layout) -> TensorDescriptor:
    """``w [G, N, K]`` as one ``[G*N, K]`` matrix, or a block-major FP8 weight as one
    ``[G*N*K/128, 128]`` matrix (contiguous: each 128 x 128 block is 128 consecutive rows)."""
    if is_block_major(w):
        flat = w.view(-1, BLOCK)
        return TensorDescriptor(flat, list(flat.shape), [BLOCK, 1], [cfg.block_n, cfg.block_k], layout)
    g, n, k = w.shape
    return TensorDescriptor(w, [g * n, k], [w.stride(1), 1], [cfg.block_n, cfg.block_k], layout)


def _weights_ptr(a, route_weights, idle_weights):
    """The kernel's ``row_weights_ptr``: the route weights, else the idle-row weights, else ``a``
    (unused)."""
    return route_weights if route_weights is not None else a if idle_weights is None else idle_weights


@dataclasses.dataclass(frozen=True)
class Fp8Scales:
    """The fp32 block scales of an FP8 launch (:class:`.bundles.Scales`): ``a``'s, ``w``'s,
    ``w_up``'s (the fused GEMM; else ``w``'s again) and, for the fused GEMM, ``act``'s that it
    writes (``out``; else None)."""
    a: torch.Tensor
    w: torch.Tensor
    w_up: torch.Tensor
    out: torch.Tensor = None

    def runtime_args(self) -> list:
        """The kernel's scale pointers, then their strides (a: rows; weights: group, row)."""
        out = self.a if self.out is None else self.out
        return [self.a, self.w, self.w_up, out, self.a.stride(0), self.w.stride(0), self.w.stride(1),
                self.w_up.stride(0), self.w_up.stride(1), out.stride(0)]


def _scale_args(a, scales: Fp8Scales) -> list:
    """Scale pointers and strides for the kernel: placeholders (``a``, zeros) without FP8."""
    return [a] * 4 + [0] * 6 if scales is None else scales.runtime_args()


def kernel_args(a, w, w_up, route_weights, cu_seqlens, out, cfg: GluonConfig, descs, *, zero_tail: bool = True,
                role: PdlRole = PdlRole.NONE, idle_weights=None, tail_out=None, handoff: Handoff = None,
                scales: Fp8Scales = None) -> dict:
    """Every kernel argument by name (unused pointers point at ``a``; an unused ``handoff_ptr`` at
    ``cu_seqlens``).

    ``w_up``: the fused SwiGLU GEMM's up weights (None: a plain GEMM). ``idle_weights`` (plain
    GEMM): ``[NvS]`` fp32 whose zeros mark rows of ``a`` that are zero (the experts op's ``act``
    where the route weight is 0), so that idle upper halves are skipped as in the fused GEMM.
    ``tail_out``: another ``[NvS, *]`` tensor whose tail rows the producer zeroes instead of
    ``out``'s (the experts op's fused GEMM zeroing the down GEMM's output). ``handoff``: between a
    PDL primary, which signals each row tile of its output, and its dependent, which takes items
    from the counter and waits per row tile. ``scales``: the block scales of e4m3 ``a`` and
    weights (FP8; the fused GEMM's ``out`` is then e4m3 ``act``; ``w`` and ``w_up`` may then be
    block-major, :mod:`moonep_ops.fp8`)."""
    g, n, k = weight_dims(w)
    if handoff is not None and role is PdlRole.NONE:
        raise ValueError("the row-tile handoff is between a PDL primary and its dependent")
    if tail_out is not None and zero_tail:
        raise ValueError("zero_tail and tail_out: the kernel zeroes one tail")
    if cfg.skip_idle_tiles and (handoff is not None or scales is None):
        raise ValueError("skip_idle_tiles: the FP8 GEMMs' 64-row tiles only, without the row-tile handoff")
    if cfg.split_rows and scales is None:
        raise ValueError("split_rows: the FP8 GEMMs only")
    if is_block_major(w) and (scales is None or cfg.block_n != BLOCK or cfg.block_k != BLOCK):
        raise ValueError("block-major weights: the FP8 GEMMs' 128 x 128 weight tiles only")
    scale_names = ("a_scale_ptr", "w_scale_ptr", "w_up_scale_ptr", "out_scale_ptr", "stride_asm", "stride_wsg",
                   "stride_wsn", "stride_usg", "stride_usn", "stride_osm")
    return dict(zip(scale_names, _scale_args(a, scales)),
                a_desc=descs[0], w_desc=descs[1], w_up_desc=descs[2], out_desc=descs[3], zero_desc=descs[4],
                a_half_desc=descs[5], out_ptr=out, row_weights_ptr=_weights_ptr(a, route_weights, idle_weights),
                cu_seqlens_ptr=cu_seqlens, handoff_ptr=cu_seqlens if handoff is None else handoff.state, G=g,
                NUM_ROWS=a.shape[0], N=n, K=k, stride_om=out.stride(0),
                ZERO_N=n if tail_out is None else tail_out.shape[1],
                FLAG_TARGET=0 if handoff is None else handoff.flag_target,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
                BLOCK_G=max(16, min(1024, triton.next_power_of_2(g))), GROUP_MAJOR=cfg.group_major,
                ZERO_TAIL=zero_tail or tail_out is not None, FUSED=w_up is not None,
                HAS_WEIGHTS=route_weights is not None, PINGPONG=cfg.pingpong,
                PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS,
                TAIL_BY_PRODUCER=cfg.tail_by_producer or tail_out is not None,
                LAUNCH_DEPENDENTS=role is PdlRole.PRIMARY, WAIT_PRIOR=role is PdlRole.DEPENDENT,
                SKIP_IDLE_HALF=cfg.skip_idle_half,
                SKIP_BY_WEIGHT=route_weights is not None or idle_weights is not None,
                SKIP_LONE_ONLY=cfg.skip_lone_tiles_only,
                SIGNAL_ROWS=handoff is not None and role is PdlRole.PRIMARY,
                HANDOFF=handoff is not None and role is PdlRole.DEPENDENT,
                MAX_POLLS=MAX_POLLS, FP8=scales is not None,
                SPLIT_RING=cfg.split_ring, SKIP_IDLE_TILES=cfg.skip_idle_tiles, SPLIT_ROWS=cfg.split_rows,
                BLOCK_MAJOR=is_block_major(w), SKIP_EMPTY_RUNS=cfg.skip_empty_runs,
                RUN_ON={None: 0, True: 1, False: 2}[cfg.on_multi_tile],
                SKIP_ON_LONG_SEGMENTS=cfg.skip_on_long_segments, num_warps=cfg.num_warps)


def _compile_and_launch(grid, kwargs, role: PdlRole):
    # (The compiled kernel's metadata keeps launch_pdl: the direct launches use it too.)
    options = {"launch_pdl": True} if role is PdlRole.DEPENDENT else {}
    return gluon_grouped_gemm_kernel[grid](**kwargs, **options)


def launch(a, w, cu_seqlens, out, num_programs: int, *, w_up=None, route_weights=None, zero_tail=True,
           role: PdlRole = PdlRole.NONE, idle_weights=None, tail_out=None, handoff: Handoff = None,
           scales: Fp8Scales = None, **cfg):
    """Launch with an explicit config (tests, the AOT compile check): ``cfg`` are
    :class:`GluonConfig` fields (``tail_out`` is used whenever given)."""
    config = GluonConfig(**cfg)
    descs = descriptors(a, w, w if w_up is None else w_up, out, config, tail_out)
    kwargs = kernel_args(a, w, w_up, route_weights, cu_seqlens, out, config, descs, zero_tail=zero_tail, role=role,
                         idle_weights=idle_weights, tail_out=tail_out, handoff=handoff, scales=scales)
    return _compile_and_launch((num_programs,), kwargs, role)


@dataclasses.dataclass(frozen=True)
class _Plan:
    launch: direct.DirectLaunch  # the compiled kernel, its grid and constexprs
    half_loads: bool  # the ``a_half`` descriptor is passed
    result: GluonResult


_PLANS: dict = {}


def _fast_descriptor(base, shape, strides, block_shape, layout):
    """A Gluon TensorDescriptor without ``__post_init__``'s checks (the plan's first launch ran them)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout,
                         padding="zero")
    return desc


def _descriptor_factory(desc):
    """Builds a descriptor of ``desc``'s geometry on another base tensor."""
    geometry = (list(desc.shape), list(desc.strides), list(desc.block_shape), desc.layout)
    return lambda base: _fast_descriptor(base, *geometry)


def _first_run(a, w, w_up, route_weights, cu_seqlens, out, cfg, zero_tail, role, idle_weights, tail_out, handoff,
               scales):
    """Compile (through Triton's JIT) and launch; returns the plan for later direct launches."""
    tail = tail_out if cfg.takes_out_tail and w_up is not None else None
    descs = descriptors(a, w, w if w_up is None else w_up, out, cfg, tail)
    kwargs = kernel_args(a, w, w_up, route_weights, cu_seqlens, out, cfg, descs, zero_tail=zero_tail, role=role,
                         idle_weights=idle_weights, tail_out=tail, handoff=handoff, scales=scales)
    items = num_row_tiles(a.shape[0], w.shape[0], cfg.block_m) * triton.cdiv(weight_dims(w)[1], cfg.block_n)
    grid = (max(1, min(persistent_programs(a.device), items)),)
    kernel = _compile_and_launch(grid, kwargs, role)
    names = gluon_grouped_gemm_kernel.arg_names  # runtime arguments, then the constexprs from BLOCK_M
    factories = {index: _descriptor_factory(d) for index, d in enumerate(descs) if d is not None}
    launch = direct.DirectLaunch(kernel, grid, [kwargs[name] for name in names[names.index("BLOCK_M"):]], factories)
    result = GluonResult.RAN if tail is None else GluonResult.RAN_AND_ZEROED_TAIL_OUT
    return _Plan(launch, descs[5] is not None, result)


def _roles(launches: int, role: PdlRole, pair_pdl: bool) -> tuple:
    """The PDL role of each launch of a GEMM: ``role``, or a pair's (which takes no role of its own)."""
    if launches == 1:
        return (role,)
    if launches != 2 or role is not PdlRole.NONE:
        raise ValueError(f"a GEMM's launches: one, or a pair without a PDL role of its own; got {launches} "
                         f"launches in role {role.value}")
    return (PdlRole.PRIMARY, PdlRole.DEPENDENT) if pair_pdl else (role, role)


def run(a, w, w_up, route_weights, cu_seqlens, out, choose, *, zero_tail: bool = True,
        role: PdlRole = PdlRole.NONE, idle_weights=None, tail_out=None, handoff: Handoff = None,
        scales: Fp8Scales = None, key=None, pair_pdl: bool = False) -> GluonResult:
    """The CUDA ops' entry on sm90: ``out[seg_g] = a[seg_g] @ w[g].T``, or with ``w_up`` the fused
    SwiGLU GEMM (arguments as in :func:`kernel_args`). ``choose(a, w, w_up, out)`` runs once per
    static signature: a :class:`GluonConfig`, or a pair of configs whose launches each take the
    whole GEMM or nothing (``on_multi_tile``), or None (not for this kernel). With ``pair_pdl`` a
    pair's second launch is a programmatic dependent of its first: its programs start as the
    first's finish, so that the launch that takes nothing costs little. The first call per
    signature compiles and launches through Triton's JIT; later calls launch the compiled kernels
    directly (:mod:`..launch`). ``key``: the caller's static signature of these operands, when it
    has one (it must fix every operand's layout, scales included); else this computes one."""
    if w.shape[1] == 0:
        return GluonResult.RAN
    if a.shape[0] == 0:  # no rows: no tail either
        return GluonResult.RAN if tail_out is None else GluonResult.RAN_AND_ZEROED_TAIL_OUT
    w_up_or_w = w if w_up is None else w_up
    rw = _weights_ptr(a, route_weights, idle_weights)
    if key is None:
        key = layout_signature(a, w, w_up_or_w, out, rw, cu_seqlens, tail_out,
                               None if handoff is None else handoff.state,
                               *(() if scales is None else (scales.a, scales.w, scales.w_up, scales.out)))
    key = (key, w_up is None, route_weights is None, idle_weights is None, choose, zero_tail, role,
           None if handoff is None else handoff.flag_target, pair_pdl)
    plans = _PLANS.get(key)
    if plans is None:
        chosen = choose(a, w, w_up, out)
        if chosen is None:
            _PLANS[key] = GluonResult.NOT_APPLICABLE
            return GluonResult.NOT_APPLICABLE
        configs = chosen if isinstance(chosen, tuple) else (chosen,)
        plans = tuple(_first_run(a, w, w_up, route_weights, cu_seqlens, out, cfg, zero_tail, launch_role, idle_weights,
                                 tail_out, handoff, scales)
                      for cfg, launch_role in zip(configs, _roles(len(configs), role, pair_pdl)))
        if direct.enabled() and all(hasattr(plan.launch.kernel, "run") for plan in plans):
            _PLANS[key] = plans
        return plans[0].result
    if plans is GluonResult.NOT_APPLICABLE:
        return plans
    zeroed = tail_out if plans[0].result is GluonResult.RAN_AND_ZEROED_TAIL_OUT else out
    g, n, k = weight_dims(w)
    rest = [out, rw, cu_seqlens, cu_seqlens if handoff is None else handoff.state, g, a.shape[0], n, k, out.stride(0),
            zeroed.shape[1], 0 if handoff is None else handoff.flag_target, *_scale_args(a, scales)]
    for plan in plans:  # (a launch may replace tensors in its list by descriptors: a list each)
        plan.launch([a, w, w_up_or_w, out, zeroed, a if plan.half_loads else None, *rest])
    return plans[0].result
