"""gate_free_solve, stage 11: heads a CTA chosen from the solve's time inside the forward: three or
four heads a CTA (s06's kernel) only where they leave three CTAs an SM.

What changed from s10: nothing in either kernel; ``heads_per_cta`` has a new threshold. s10 chose
from each kernel alone, 50 launches back to back in one CUDA graph (``results/prologue.csv``):
there a launch's tail overlaps nothing but the next launch of the same kernel, and s06's kernel at
four heads a CTA looked as fast as s08's at two from 256 CTAs on. Inside the forward the solve runs
once, between the cumsum and the fused kernel, and its time is one launch's latency. At 256 CTAs
of four heads an SM holds two of the four CTAs that fit (``MIN_CTAS_PER_SM``) and walks their
heads in turn on the CUDA cores. Here ``cta_heads`` value heads a CTA (three or four: s06's
kernel) run only where ``num_chunks x HV / cta_heads`` is at least ``WAVE_CTAS_PER_SM = 3`` CTAs an
SM; elsewhere s08's kernel (the inverse's lower-left half on the tensor cores) at two heads a CTA,
or one where two do not divide the group.

Why (one H100, commit b37aa0a; ``profiles/prologue_lab.py forward``: the library's forward captured
in a CUDA graph with the solve's grouping forced, the solve kernel's device time in 20 replays
under torch.profiler, ``results/solve_in_forward.csv``), us, the solve kernel / the forward:

    problem           CTAs at s10's R   s10's R: solve / forward   s11's R: solve / forward
    (8, 32) 1x2048          264          4:  24.3 / 93.4             2:  15.9 / 84.8
    (2, 8) 1x8192           258          4:  25.4 / 169.8            2:  15.9 / 160.0
    (8, 24) 1x2048          264          3:  21.6 / 90.5             1:  19.8 / 90.5

On all 16 problems of that file s11's grouping runs a solve within 5 % of the fastest grouping
timed there; s10's runs up to 1.60x it (``tests/test_bench.py``). The problems where they differ
are the ones where s10 left two CTAs an SM.

Measured effect in the forward: gdn_fwd.s28's rows in ``results/gdn_fwd.csv``.

Precision: s08's or s06's, as in s10, at the grouping chosen.

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import torch

from flashqla import autocp, stages
from flashqla.varlen import num_chunk_rows

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "__shfl_xor_sync", "kTensorFloat32")

BY_GRID = stages.load("gate_free_solve", 10)     # stage_for: s08 at one or two heads, s06 above
BY_HEADS = BY_GRID.BY_HEADS
CHUNK_SIZE = BY_HEADS.CHUNK_SIZE
WAVE_CTAS_PER_SM = 3  # CTAs an SM that s06's grouping must leave (of the 4 that fit an SM)


def heads_per_cta(H: int, HV: int, num_chunks: int, num_sms: int) -> int:
    """``cta_heads(H, HV)``; where that is three or four and ``num_chunks`` rows of the chunk table
    x HV / it are fewer than WAVE_CTAS_PER_SM CTAs an SM, two (s08's kernel), or one where two do
    not divide it."""
    R = BY_HEADS.cta_heads(H, HV)
    if R > BY_HEADS.TENSOR_CORE_MAX_HEADS and num_chunks * HV < R * WAVE_CTAS_PER_SM * num_sms:
        return BY_HEADS.TENSOR_CORE_MAX_HEADS if R % BY_HEADS.TENSOR_CORE_MAX_HEADS == 0 else 1
    return R


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
