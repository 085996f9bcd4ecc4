"""Where the eager host time of one expert-path call goes (cProfile, tiny problem)."""

import cProfile
import pstats

import torch

from .paths import PATHS
from .run import host_cost_us


def main():
    from moonep_ops.kernels import fast_launch, triton_grouped_gemm

    fn = PATHS["moonep"]
    enabled = fast_launch.ENABLED
    for fast in (True, False):
        fast_launch.ENABLED = fast
        triton_grouped_gemm._PLANS.clear()
        for inference in (True, False):
            print(f"fast_launch={fast} inference_mode={inference}:",
                  {name: round(host_cost_us(f, inference=inference), 1) for name, f in PATHS.items()})
    fast_launch.ENABLED = enabled
    g, h, i, nvs = 4, 128, 128, 256
    x = torch.randn(nvs, h, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(g, i, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    wd = torch.randn(g, h, i, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([64, 128, 192, 256], dtype=torch.int32, device="cuda")
    rw = torch.rand(nvs, device="cuda")
    out = torch.empty(nvs, h, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        fn(x, wg, wu, wd, cu, rw, out)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fn(x, wg, wu, wd, cu, rw, out)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
