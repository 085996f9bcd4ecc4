"""One small launch of the Gluon GEMM with a given config, for racecheck runs that narrow down
where a hazard comes from (twelfth session: every config showed the same handshake reports as
scripts/racecheck_control.py).

Usage on an sm90 GPU:
    compute-sanitizer --tool racecheck python3 scripts/racecheck_gluon_case.py "{'pingpong': False}"
(a dict of GluonConfig fields, plus 'fused': True for the SwiGLU GEMM)
"""
import ast
import sys

import torch

from moonep_ops.kernels import gluon_grouped_gemm as gg

cfg = dict(ast.literal_eval(sys.argv[1]))
fused = cfg.pop("fused", False)
torch.manual_seed(0)
rows, k, n, g = 1024, 256, 256, 4
cu = torch.tensor([200, 456, 456, 900], dtype=torch.int32, device="cuda")
a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
gg.launch(a, w, cu, out, 4, w_up=w if fused else None,
          route_weights=torch.ones(rows, device="cuda") if fused else None, **cfg)
torch.cuda.synchronize()
print("ran", cfg, "nan" if out.isnan().any() else "ok")
