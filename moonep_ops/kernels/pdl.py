"""Programmatic dependent launch (PDL, sm90): the role a GEMM launch plays in a pair of launches.
In the ``experts`` op's pair the dependent down GEMM launches while the fused gate/up GEMM still
runs, reads its schedule (``cu_seqlens``) and first weight tiles, then waits for the primary's
memory before it reads ``act``; in an FP8 GEMM's launch pair (split rings, then split rows) the
launch that takes no work exits early. Only valid where the dependent's ``cu_seqlens`` and
weights are not written by the primary.
"""

import enum


class PdlRole(enum.Enum):
    NONE = "none"
    PRIMARY = "primary"  # lets the next kernel launch before this grid ends
    DEPENDENT = "dependent"  # launched early: reads its schedule and weights, then waits for the primary
