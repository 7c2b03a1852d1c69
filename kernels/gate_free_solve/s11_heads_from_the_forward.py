"""gate_free_solve, stage 11: heads a CTA chosen from the solve's time inside the forward: the most
heads a CTA that still leave three CTAs an SM.

What changed from s10: nothing in either kernel; ``heads_per_cta`` has a new rule. s10 picked from
each kernel alone, 50 launches back to back in one CUDA graph (``results/prologue.csv``): there a
launch's tail overlaps nothing but the next launch of the same kernel, and four heads a CTA
looked as fast as two from 256 CTAs on. Inside the forward the solve runs once, after the cumsum
and before the fused kernel, and its time is one launch's latency: with 256 CTAs of four heads,
two CTAs an SM (of the four that fit, ``MIN_CTAS_PER_SM``), an SM walks two CTAs' four heads in
turn and the other two slots stay empty. Here a CTA holds the most heads ``r`` (a divisor of
HV / H, at most ``cta_heads``) for which ``num_chunks x HV / r`` is at least ``MIN_CTAS_PER_SM - 1
= 3`` CTAs an SM; where no grouping reaches that, one head a CTA. As in s09, one or two heads a CTA
run s08's kernel (the tensor-core half), three or four s06's.

Why (one H100, commit ab90d41; ``profiles/solve_lab.py forward``: the API's forward captured in a
CUDA graph with the solve's grouping forced, the solve kernel's device time in 20 replays under
torch.profiler, ``results/solve_in_forward.csv``), us, the solve kernel / the whole forward:

    problem            CTAs at s10's R   s10's R   at s10's R    at s11's R     s11's R
    (4, 16) 1x2048          132             4      14.3 / 80.0    9.7 / 78.4       1
    (8, 32) 1x2048          264             4      24.5 / 93.5   15.5 / 84.6       2
    (8, 24) 1x2048          264             3      22.0 / 90.1   19.6 / 89.6       1
    (2, 8) 1x8192           258             4      25.5 / 169.0  15.8 / 159.7      2

Everywhere else s10's and s11's choices agree. Against each kernel alone s10 was within 5 % of
the fastest; in the forward it runs up to 1.6x the fastest grouping's solve, and s11 is within
5 % of it on all 16 problems of that file (``tests/test_bench.py``).

Measured effect in the forward: gdn_fwd.s28's rows in ``results/gdn_fwd.csv``.

Precision: s08's or s06's, as in s10, at the grouping chosen.

Taught in: notebooks/04_reformulation.py (the solve)
"""

import torch

from flashqla import autocp, stages
from flashqla.varlen import num_chunk_rows

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "__shfl_xor_sync", "kTensorFloat32")

BY_GRID = stages.load("gate_free_solve", 10)     # stage_for: s08 at one or two heads, s06 above
BY_HEADS = BY_GRID.BY_HEADS
CHUNK_SIZE = BY_HEADS.CHUNK_SIZE
MIN_CTAS_PER_SM = 3   # CTAs an SM the grid must give a grouping (of the 4 that fit an SM)


def heads_per_cta(H: int, HV: int, num_chunks: int, num_sms: int) -> int:
    """The most value heads a CTA, r <= cta_heads(H, HV) dividing HV / H, for which ``num_chunks``
    rows of the chunk table x HV / r CTAs are at least MIN_CTAS_PER_SM an SM; else one."""
    fits = [r for r in range(1, BY_HEADS.cta_heads(H, HV) + 1)
            if (HV // H) % r == 0 and num_chunks * HV >= r * MIN_CTAS_PER_SM * num_sms]
    return max(fits, default=1)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s06's kernel, then s08's."""
    return BY_HEADS.kernel_source()


def solve(k, beta, g_cum, cu_seqlens=None):
    """``solve`` of s06 or s08 at ``heads_per_cta``: k [B, T, H, K] bf16, beta, g_cum [B, T, HV]
    fp32 -> (ab [B, T, HV, 64] bf16, gated [NT, HV] int32)."""
    B, T, H = k.shape[:3]
    HV = beta.shape[2]
    num_chunks = num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE)  # the chunk table's rows, on the host
    R = heads_per_cta(H, HV, num_chunks, autocp.num_sms(k.device))
    return BY_GRID.stage_for(R).solve(k, beta, g_cum, cu_seqlens, heads_per_cta=R)


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (s06's or s08's). The op
    has no gate: with g_cum = 0 the solve's Ab is the gate-free one."""
    BY_HEADS.BALANCED._check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
