"""gate_free_solve, stage 10: how many value heads a CTA holds, chosen from the grid as well as
from the heads: where s09's grouping leaves SMs without a CTA, two heads a CTA on s08's kernel.

What changed from s09: nothing in either kernel; ``heads_per_cta`` also looks at the launch's
CTAs. s09 always puts ``cta_heads(H, HV)`` value heads in a CTA (the most, up to four, that share
one key head's K K^T), and runs s06 (all on the CUDA cores) at three or four. On a short problem
with few heads that grid has fewer CTAs than the card has SMs: (2, 8) 1x2048 is 32 chunks x 8
heads / 4 = 64 CTAs on 132 SMs, and its time is one CTA's latency with four heads' work in it.
Here, when ``num_chunks x HV / cta_heads`` is below the SM count and the group splits in two,
a CTA holds two heads and s08's kernel (its tensor-core half, s09's choice at two) runs them:
twice the CTAs, each with half the work.

Why (one H100, commit 677241e; each kernel alone, 50 launches captured in one CUDA graph, the
replay's time / 50: ``profiles/results/prologue.csv``, ``profiles/prologue_lab.py``), us:

    problem            CTAs at s09's R   s09 (s06, R 4)   s08 at R 2   s08 at R 1
    (2, 8) 1x2048            64              10.2             6.2          7.0
    (4, 16) 1x2048          128              10.7             8.2          9.9
    (8, 32) 1x2048          256              13.3            13.5         18.6
    (2, 8) 1x8192           256              13.0            13.4         18.2
    (16, 64) 1x2048         512              23.1            25.5         34.6

Below one CTA an SM, two heads a CTA take 0.61-0.77x s09's time; from 256 CTAs on, four heads a
CTA stay as fast or faster (the key head's K K^T, computed once for four heads, wins).
One head a CTA never wins: its CTAs hold the key head's K K^T once for each value head. On all 16
problems of that file (the eight head layouts at 1x2048 and 1x8192) this choice runs a kernel
within 5 % of the fastest variant timed; s09's is up to 1.65x slower (``tests/test_bench.py``).

Measured effect in the forward (gdn_fwd.s26, with chunk_local_cumsum.s02; one H100, commit
98a6f05): s26 takes 0.93x s24's time on (2, 8) 1x2048, where the solve goes from 64 CTAs to 128.
GPU tests: the public shapes (24, commit 98a6f05), where (2, 8), (4, 16) and (8, 32) at 1000 tokens
take two heads a CTA and (16, 64) four.

Precision: s08's where it runs (tf32 adds 1.5-2.9e-4 relative L2 to Ab against 1.6-1.9e-3 for
its bf16 store); s06's elsewhere, as in s09.

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import torch

from flashqla import autocp, stages
from flashqla.varlen import num_chunk_rows

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "__shfl_xor_sync", "kTensorFloat32")

BY_HEADS = stages.load("gate_free_solve", 9)     # s06 / s08 by the heads a CTA holds
CHUNK_SIZE = BY_HEADS.CHUNK_SIZE
SPREAD_HEADS = 2                                 # heads a CTA when the grid leaves SMs idle


def heads_per_cta(H: int, HV: int, num_chunks: int, num_sms: int) -> int:
    """s09's ``cta_heads(H, HV)``, or SPREAD_HEADS where that many leave SMs without a CTA
    (``num_chunks`` rows of the chunk table x HV / cta_heads < ``num_sms``) and divide the group."""
    R = BY_HEADS.cta_heads(H, HV)
    if R > SPREAD_HEADS and R % SPREAD_HEADS == 0 and num_chunks * HV < R * num_sms:
        return SPREAD_HEADS
    return R


def stage_for(heads: int):
    """The kernel's stage at ``heads`` value heads a CTA: s08 at one or two, else s06 (s09's)."""
    return BY_HEADS.TENSOR_CORE if heads <= BY_HEADS.TENSOR_CORE_MAX_HEADS else BY_HEADS.BALANCED


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
    return stage_for(R).solve(k, beta, g_cum, cu_seqlens, heads_per_cta=R)


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (s06's or s08's). The op
    has no gate: with g_cum = 0 the solve's Ab is the gate-free one."""
    BY_HEADS.BALANCED._check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
