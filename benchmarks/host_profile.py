"""Where the eager host time of one expert-path call goes (cProfile, tiny problem)."""

import cProfile
import pstats

from .paths import PATHS
from .run import host_costs_interleaved, tiny_problem


def main():
    from moonep_ops.kernels import fast_launch, triton_grouped_gemm

    fn = PATHS["moonep"]
    enabled = fast_launch.ENABLED
    for fast in (True, False):
        fast_launch.ENABLED = fast
        triton_grouped_gemm._PLANS.clear()
        print(f"fast_launch={fast}:", {name: round(us, 1) for name, us in host_costs_interleaved(PATHS).items()})
    fast_launch.ENABLED = enabled
    args = tiny_problem()
    for _ in range(10):
        fn(*args)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fn(*args)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
