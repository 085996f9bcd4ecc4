"""A one-device stand-in for MoonEP's Python API, for tests: ``import moonep`` finds it once
``tests/moonep_stub`` is on ``sys.path``.

``Buffer`` and ``MoonEPCommPlan`` have the constructor, methods, argument names, return values
and assertions of MoonEP's ``moonep/api.py`` and ``moonep/planning.py`` (the ``[E+B]`` API that
vLLM 0.33 calls), for one rank (``num_ep_ranks == 1``), on the current CUDA device or else the
CPU. Planning, dispatch and combine are :mod:`moonep_ops.layout`'s emulation, so every call is
device work with static shapes, like MoonEP's kernels. Stricter than MoonEP where that finds
bugs: rows past ``cu_seqlens[-1]`` come out NaN (MoonEP leaves stale data there), and
``tokens_per_expert`` must equal the histogram of ``topk_experts_sk`` (MoonEP's planner checks
its sum on the device). No comm stream (``async_finish`` is refused), no ``reduce_grad``.

Quantized prefetch is the zhumakhan/MoonEP fork's ``[E+B]`` API: ``prefetch_weight`` takes
``full_{gate,up,down}_scale`` with the weights (all three or none; contiguous, ``ndim >= 2``,
``shape[0] == E + B``) and copies slot rows of both. Weights are bf16 or uint8 (the forks'
``_ELEM_TYPES`` have no float8: FP8 weights travel as uint8 views), and each expert's scale bytes
must be a multiple of 128 x 128 (MoonEP's ``retile_for_prefetch`` copies 128-row byte tiles).
"""

from dataclasses import dataclass

import torch

from moonep_ops import layout

__all__ = ["Buffer", "MoonEPCommPlan"]

NAN = float("nan")
_ELEM_TYPES = (torch.bfloat16, torch.uint8)  # prefetch_weight's weight dtypes
_SCALE_TILE_BYTES = 128 * 128  # retile_for_prefetch: an expert's scale bytes, a multiple of this
DEVICE = None  # where Buffers live; None: the current CUDA device if there is one, else the CPU


@dataclass(frozen=True)
class MoonEPCommPlan:
    dst: torch.Tensor  # [N] int32: the NvS row of each (token, k), N = s * K
    experts_to_copy: torch.Tensor  # [R, B] int32: the expert each prefetch slot mirrors, -1 unused
    zero_fill_ranges: torch.Tensor  # [E + B, 2] int32: padding rows [start, end) of each segment
    remote_stats: torch.Tensor  # [2] int32
    N: int
    R: int
    E: int
    B: int
    NvS: int
    K: int
    dup_groups: torch.Tensor  # [NvS, 3] int32, MoonEP's dedup tables: unused on one rank
    dup_loffs: torch.Tensor  # [NvS] int32
    dup_counts: torch.Tensor  # [2] int32

    @property
    def num_tokens(self) -> int:
        return self.N // self.K


def _device() -> torch.device:
    if DEVICE is not None:
        return torch.device(DEVICE)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Buffer:
    """MoonEP's communication buffer for one rank: a ``[NvS, H]`` bf16 shard and ``[NvS]`` weights."""

    instances = 0  # Buffers constructed in this process (tests count them around a forward)

    def __init__(self, S: int, H: int, K: int, E: int, num_ep_ranks: int, num_sms: int | None = None,
                 token_padding: int = 128, B: int | None = None, group=None,
                 comm_stream_priority: int = -1, enable_pdl: bool = True,
                 explicitly_destroy: bool = False):
        assert num_ep_ranks == 1, "the moonep stub runs one rank"
        assert E % num_ep_ranks == 0, f"E ({E}) must be divisible by R ({num_ep_ranks})"
        epn = E // num_ep_ranks
        B = epn if B is None else B
        assert isinstance(B, int) and 0 < B <= E, f"B must be in [1, E], got {B}"
        assert isinstance(token_padding, int) and token_padding > 0
        nvs = layout.nvs_bound(S, K, epn, token_padding)
        device = _device()
        self._ctx = {
            "rank": 0, "R": num_ep_ranks, "S": S, "H": H, "K": K, "E": E, "B": B, "N": S * K,
            "NvS": nvs, "token_padding": token_padding, "num_sms": num_sms or 32,
            "device": device, "group": group,
            "hidden_buf_local": torch.empty(nvs, H, dtype=torch.bfloat16, device=device),
            "weights_buf_local": torch.empty(nvs, dtype=torch.int32, device=device),
        }
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = False
        Buffer.instances += 1

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def hidden_nvsh_buffer_view(self) -> torch.Tensor:
        return self._require_ctx()["hidden_buf_local"]

    @property
    def router_weight_buffer_view(self) -> torch.Tensor:
        return self._require_ctx()["weights_buf_local"].view(torch.float32)

    def _require_ctx(self) -> dict:
        assert not self._destroyed, "MoonEP Buffer has been destroyed"
        return self._ctx

    def destroy(self) -> None:
        self._ctx = None
        self._destroyed = True

    def _plan(self, topk: torch.Tensor, tokens_per_expert: torch.Tensor):
        """Plan a fresh dispatch of ``topk`` ``[s, K]``: ``(plan, cu_seqlens)``."""
        ctx = self._ctx
        E, B, K, nvs, dev = ctx["E"], ctx["B"], ctx["K"], ctx["NvS"], ctx["device"]
        s = topk.shape[0]
        ids = topk.long()
        counts = torch.zeros(E, dtype=torch.int32, device=dev)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(s * K, dtype=torch.int32, device=dev))
        torch._assert_async((counts == tokens_per_expert).all(),
                            "moonep stub: tokens_per_expert is not the histogram of topk_experts_sk")
        # Only the plan is used: the rows are placed by _place, as MoonEP's dispatch does.
        d = layout.dispatch(torch.zeros(s, 1, device=dev), ids, torch.zeros(s, K, device=dev), E,
                            num_rows=nvs, token_padding=ctx["token_padding"], num_prefetch=B)
        cu = d.cu_seqlens
        lengths = torch.diff(cu, prepend=cu.new_zeros(1))
        # Rows in use per segment, and from there each segment's zero padding.
        group_of_row = torch.searchsorted(cu, torch.arange(nvs, device=dev, dtype=torch.int32), right=True)
        used = torch.zeros(E + B + 1, dtype=torch.int32, device=dev)
        used.index_add_(0, group_of_row, d.valid.to(torch.int32))
        zero_fill = torch.stack([cu - lengths + used[:E + B], cu], 1).to(torch.int32)
        slots = torch.where(lengths[E:] > 0, d.prefetch_for, -1).to(torch.int32)
        plan = MoonEPCommPlan(
            dst=d.row_of.reshape(-1).to(torch.int32), experts_to_copy=slots.view(1, B),
            zero_fill_ranges=zero_fill, remote_stats=torch.zeros(2, dtype=torch.int32, device=dev),
            N=s * K, R=1, E=E, B=B, NvS=nvs, K=K,
            dup_groups=torch.zeros(nvs, 3, dtype=torch.int32, device=dev),
            dup_loffs=torch.zeros(nvs, dtype=torch.int32, device=dev),
            dup_counts=torch.zeros(2, dtype=torch.int32, device=dev))
        return plan, cu

    def _place(self, plan: MoonEPCommPlan, hidden_sh: torch.Tensor,
               route_weights_sk: torch.Tensor | None) -> None:
        """Write the dispatched rows (and weights) into the shard: padding rows zero, tail NaN."""
        ctx = self._ctx
        nvs, n, K, dev = plan.NvS, plan.N, plan.K, ctx["device"]
        row_assign = torch.full((nvs + 1,), n, dtype=torch.int64, device=dev)
        row_assign = row_assign.scatter(0, plan.dst.long(), torch.arange(n, device=dev))[:nvs]
        live = torch.arange(nvs, device=dev) < plan.zero_fill_ranges[-1, 1]  # below cu_seqlens[-1]
        tokens = torch.cat([hidden_sh, hidden_sh.new_zeros(1, hidden_sh.shape[1])])
        rows = tokens.index_select(0, row_assign // K)  # padding rows read the zero row
        ctx["hidden_buf_local"].copy_(torch.where(live[:, None], rows, NAN))
        if route_weights_sk is not None:
            w = torch.cat([route_weights_sk.reshape(-1), route_weights_sk.new_zeros(1)])[row_assign]
            self.router_weight_buffer_view.copy_(torch.where(live, w, NAN))

    def dispatch(self, hidden_sh: torch.Tensor, route_weights_sk: torch.Tensor | None = None,
                 topk_experts_sk: torch.Tensor | None = None,
                 tokens_per_expert: torch.Tensor | None = None,
                 plan: MoonEPCommPlan | None = None, async_finish: bool = False, *,
                 inter_rank_sync: bool = True, zero_copy: bool = False,
                 router_weights_zero_copy: bool = False):
        """``(hidden_nvsh [NvS, H], route_weights_nvs [NvS] or None, cu_seqlens [E+B] or None, plan)``."""
        ctx = self._require_ctx()
        if async_finish:
            raise NotImplementedError("the moonep stub has no comm stream (async_finish)")
        assert hidden_sh.ndim == 2, f"hidden_sh must be [s, H], got {tuple(hidden_sh.shape)}"
        assert hidden_sh.dtype == torch.bfloat16 and hidden_sh.shape[1] == ctx["H"]
        num_tokens = hidden_sh.shape[0]
        assert 0 < num_tokens <= ctx["S"], (
            f"hidden_sh has {num_tokens} tokens; Buffer capacity S={ctx['S']}")
        if route_weights_sk is not None:
            assert route_weights_sk.dtype == torch.float32
            assert tuple(route_weights_sk.shape) == (num_tokens, ctx["K"])
        if plan is None:
            assert topk_experts_sk is not None and tokens_per_expert is not None
            assert topk_experts_sk.dtype == torch.int32 and \
                topk_experts_sk.numel() == num_tokens * ctx["K"], (
                    f"topk_experts_sk must be [s={num_tokens}, K={ctx['K']}], "
                    f"got {tuple(topk_experts_sk.shape)}")
            assert tokens_per_expert.dtype == torch.int32
            assert tokens_per_expert.numel() == ctx["E"] and tokens_per_expert.is_contiguous()
            plan, cu_seqlens = self._plan(topk_experts_sk.reshape(num_tokens, ctx["K"]),
                                          tokens_per_expert)
        else:
            assert isinstance(plan, MoonEPCommPlan)
            assert plan.num_tokens == num_tokens, (
                f"plan was made for {plan.num_tokens} tokens, hidden_sh has {num_tokens}")
            cu_seqlens = None
        self._place(plan, hidden_sh, route_weights_sk)
        hidden_nvsh = ctx["hidden_buf_local"]
        if not zero_copy:
            hidden_nvsh = hidden_nvsh.clone()
        route_weights_nvs = None
        if route_weights_sk is not None:
            route_weights_nvs = self.router_weight_buffer_view
            if not router_weights_zero_copy:
                route_weights_nvs = route_weights_nvs.clone()
        return hidden_nvsh, route_weights_nvs, cu_seqlens, plan

    def prefetch_weight(self, plan: MoonEPCommPlan | None = None, async_finish: bool = False, *,
                        full_gate_weight: torch.Tensor | None = None,
                        full_up_weight: torch.Tensor | None = None,
                        full_down_weight: torch.Tensor | None = None,
                        full_gate_scale: torch.Tensor | None = None,
                        full_up_scale: torch.Tensor | None = None,
                        full_down_scale: torch.Tensor | None = None):
        """Copy expert ``plan.experts_to_copy[rank, b]`` into row ``E + b`` (skipping ``-1``), with
        its block scales when they are given."""
        ctx = self._require_ctx()
        assert isinstance(plan, MoonEPCommPlan), "Buffer.prefetch_weight: plan is required"
        if async_finish:
            raise NotImplementedError("the moonep stub prefetches synchronously only")
        weights = (full_gate_weight, full_up_weight, full_down_weight)
        assert all(w is not None for w in weights), "prefetch_weight tensors must be provided together"
        E, B = ctx["E"], ctx["B"]
        for w in weights:
            assert w.dtype in _ELEM_TYPES, f"prefetch_weight: unsupported weight dtype {w.dtype}"
            assert w.is_contiguous()
            assert w.ndim == 3 and w.shape[0] == E + B
        scales = (full_gate_scale, full_up_scale, full_down_scale)
        if any(s is not None for s in scales):
            assert all(s is not None for s in scales), "prefetch_weight scales must be provided together"
            for s in scales:
                assert s.is_contiguous()
                assert s.ndim >= 2 and s.shape[0] == E + B
                per_expert = s.nbytes // s.shape[0]
                assert per_expert % _SCALE_TILE_BYTES == 0, (
                    f"retile_for_prefetch: per-expert extent {per_expert} bytes is not a multiple of "
                    f"{_SCALE_TILE_BYTES}")
        else:
            scales = ()
        slots = plan.experts_to_copy[ctx["rank"]].long()
        for t in (*weights, *scales):
            used = (slots >= 0).view(-1, *([1] * (t.ndim - 1)))
            t[E:].copy_(torch.where(used, t[:E].index_select(0, slots.clamp(min=0)), t[E:]))

    def combine(self, plan: MoonEPCommPlan | None = None, hidden_nvsh: torch.Tensor | None = None,
                route_weights_nvs: torch.Tensor | None = None, async_finish: bool = False,
                inter_rank_sync: bool = True, *, zero_copy: bool = False,
                router_weights_zero_copy: bool = False):
        """``(hidden_sh [s, H], route_weights_sk [s, K] or None, None)``: each token's K rows summed."""
        ctx = self._require_ctx()
        assert isinstance(plan, MoonEPCommPlan), "Buffer.combine: plan is required"
        if async_finish:
            raise NotImplementedError("the moonep stub has no comm stream (async_finish)")
        assert hidden_nvsh is not None
        assert hidden_nvsh.dtype == torch.bfloat16
        assert hidden_nvsh.is_contiguous()
        assert tuple(hidden_nvsh.shape) == (ctx["NvS"], ctx["H"])
        shard = ctx["hidden_buf_local"]
        weights = self.router_weight_buffer_view
        if route_weights_nvs is not None:
            assert route_weights_nvs.dtype == torch.float32 and route_weights_nvs.is_contiguous()
            assert tuple(route_weights_nvs.shape) == (ctx["NvS"],)
        if zero_copy:
            assert hidden_nvsh.data_ptr() == shard.data_ptr(), (
                "combine(zero_copy=True): hidden_nvsh must alias the NVL shard view returned by "
                "dispatch(zero_copy=True)")
        else:
            shard.copy_(hidden_nvsh)
        if route_weights_nvs is not None and router_weights_zero_copy:
            assert route_weights_nvs.data_ptr() == weights.data_ptr()
        elif route_weights_nvs is not None:
            weights.copy_(route_weights_nvs)
        s, K, H = plan.num_tokens, plan.K, ctx["H"]
        rows = plan.dst.long()
        hidden_sh = shard.index_select(0, rows).view(s, K, H).float().sum(1).to(torch.bfloat16)
        route_weights_sk = None
        if route_weights_nvs is not None:
            route_weights_sk = weights.index_select(0, rows).view(s, K)
        return hidden_sh, route_weights_sk, None
