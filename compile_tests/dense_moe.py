"""Dense float64 MoE reference: every token through each of its K experts, no layout at all.

Written without the dispatch emulator or the ops: a loop over experts with boolean masks, on
the host, so nothing here shares code (or bugs) with the path under test.
"""

import torch


def _expert(x, w_gate, w_up, w_down):
    gate = x @ w_gate.T
    return (gate / (1 + torch.exp(-gate)) * (x @ w_up.T)) @ w_down.T


def dense_moe_ref(x, w_gate, w_up, w_down, topk_ids, topk_weights, *, weights_on_input=False):
    """``out[s] = sum_k w[s,k] * expert_{ids[s,k]}(x[s])`` in float64, ``[S, H]``.

    ``weights_on_input``: ``sum_k expert_{ids[s,k]}(w[s,k] * x[s])`` (top-1, Llama-4 style).
    Weights are ``[E, I, H]`` (gate, up) and ``[E, H, I]`` (down).
    """
    f64 = dict(device="cpu", dtype=torch.float64)
    x = x.detach().to(**f64)
    wg, wu, wd = (w.detach().to(**f64) for w in (w_gate, w_up, w_down))
    ids = topk_ids.detach().cpu().long()
    wts = topk_weights.detach().to(**f64)
    out = torch.zeros_like(x)
    for e in range(wg.shape[0]):
        for k in range(ids.shape[1]):
            sel = ids[:, k] == e
            if not sel.any():
                continue
            w = wts[sel, k, None]
            if weights_on_input:
                out[sel] += _expert(x[sel] * w, wg[e], wu[e], wd[e])
            else:
                out[sel] += w * _expert(x[sel], wg[e], wu[e], wd[e])
    return out
