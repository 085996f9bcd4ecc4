"""Smoke check of one Gluon grouped-GEMM config on a small random problem (a debugging aid):
    python scripts/gluon_smoke.py ["stages=5" [rows k n g]]        (add fused=True for the SwiGLU GEMM)"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

from moonep_ops.kernels import gluon_grouped_gemm as gg  # noqa: E402
from tests.reference import grouped_gemm_ref, grouped_gemm_silu_mul_ref, rel_err  # noqa: E402

kw = eval("dict(" + (sys.argv[1] if len(sys.argv) > 1 else "") + ")")
rows, k, n, g = (int(v) for v in (sys.argv[2:6] or (1024, 256, 512, 6)))
torch.manual_seed(0)
sizes = torch.tensor([0, 128, 300, 0, 256, 100][:g] + [0] * max(0, g - 6))
cu = sizes.cumsum(0).to(torch.int32).cuda()
a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
u = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) if kw.pop("fused", False) else None
rw = torch.rand(rows, device="cuda") if u is not None else None
out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
gg.launch(a, w, cu, out, 4, w_up=u, route_weights=rw, **kw)
torch.cuda.synchronize()
ref = (grouped_gemm_ref(a, w, cu) if u is None else grouped_gemm_silu_mul_ref(a, w, u, rw, cu))
lo = int(sizes.sum())
err = rel_err(out[:lo], ref[:lo])
print(kw, "rel err", err, "tail zero", bool((out[lo:] == 0).all()))
