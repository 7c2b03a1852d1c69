"""gate_free_solve, stage 12: s08's kernel at six CTAs an SM where that makes its grid one wave.

What changed from s11: the launch bounds of s08's kernel (one or two value heads a CTA), nothing
else. s08 is compiled with ``__launch_bounds__(128, 4)``: ptxas gives it 108 registers a thread
and four CTAs fit an SM, though its 33,296 bytes of shared memory would let six. Where s11's
grouping gives more CTAs than four an SM hold and no more than six hold (``ctas_per_sm``), the
same program is compiled with ``__launch_bounds__(128, 6)`` (``flashqla.hopper.min_ctas_per_sm``):
ptxas fits it in 80 registers with 40 bytes of spill stores and 36 of spill loads (24-byte stack
frame; nvdisasm: 8 STL and 7 LDL among 21,486 instructions at one head a CTA); at (128, 5) 96
registers, no spills. Elsewhere s11's kernels run unchanged.

Why: inside the forward the solve is one launch's latency (gate_free_solve.s11). On (8, 24)
1x2048 the key heads hold three value heads each, so s11 runs s08 at one head a CTA: 33 chunk rows
x 24 heads = 792 CTAs, which at four an SM on 132 SMs is 1.5 waves, and the second half-wave
costs a whole CTA's latency. 19.8 us in the forward against FlashQLA's 13.8
(``results/solve_in_forward.csv``, ``results/timeline.csv``; one H100). At six an SM, 792 CTAs
are exactly one wave. Among the public problems only (8, 24) 1x2048 takes it.

Measured effect (one H100, commit ba1bffa): alone in a CUDA graph on (8, 24) 1x2048, 23.0 us at six
CTAs an SM against 27.1 at four (gate_free_solve.s14's table, which also times five and six on
grids of many waves); inside the forward (gdn_fwd.s30, ``results/timeline_prologue.csv``) 15.6 us against
s29's 20.4, the forward's span 79.7 us against 84.5 (FlashQLA's 79.6). Its tests passed on the GPU:
the public shapes (at four CTAs an SM, where those small grids put it), and forced to six CTAs an SM
the flags past the bound and Ab and the flags bit for bit s08's on adversarial inputs
(``tests/test_reformulation.py``); the rule (CPU).

Precision: s08's; the program is the same.

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, min_ctas_per_sm
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, num_chunk_rows

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("__launch_bounds__(128, 6)", "wgmma", "kTensorFloat32")

BY_FORWARD = stages.load("gate_free_solve", 11)   # heads a CTA, and s06's or s08's kernel
TENSOR_CORE = BY_FORWARD.BY_HEADS.TENSOR_CORE     # s08
CHUNK_SIZE = TENSOR_CORE.CHUNK_SIZE
ONE_WAVE_CTAS_PER_SM = 6  # s08's CTAs an SM where its grid fits one wave of them: 6 x 33,296 B of
                          # shared memory, 80 registers a thread
DEFAULT_SHAPE = dict(H=8, HV=24, heads_per_cta=1, ctas=ONE_WAVE_CTAS_PER_SM)


def ctas_per_sm(H: int, HV: int, num_chunks: int, num_sms: int) -> int:
    """s08's launch bounds for s11's grouping: ONE_WAVE_CTAS_PER_SM where s08 runs and its
    ``num_chunks x HV / heads`` CTAs are more than four an SM hold and no more than that many
    hold; else s08's MIN_CTAS_PER_SM (4)."""
    R = BY_FORWARD.heads_per_cta(H, HV, num_chunks, num_sms)
    ctas = num_chunks * (HV // R)
    if (R <= BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS
            and TENSOR_CORE.MIN_CTAS_PER_SM * num_sms < ctas <= ONE_WAVE_CTAS_PER_SM * num_sms):
        return ONE_WAVE_CTAS_PER_SM
    return TENSOR_CORE.MIN_CTAS_PER_SM


def gate_free_solve_kernel(H: int, HV: int, heads_per_cta: int, ctas: int):
    """s08's T.prim_func, launched with ``__launch_bounds__(128, ctas)``."""
    return min_ctas_per_sm(TENSOR_CORE.gate_free_solve_kernel(H, HV, heads_per_cta), ctas)


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int, ctas: int):
    return compile_hopper(gate_free_solve_kernel(H, HV, heads_per_cta, ctas))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s08's kernel at six CTAs an SM, one head a CTA."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def solve(k, beta, g_cum, cu_seqlens=None, ctas=None):
    """s11's ``solve``, with s08's kernel at ``ctas`` CTAs an SM (default: ``ctas_per_sm``):
    k [B, T, H, K] bf16, beta, g_cum [B, T, HV] fp32 -> (ab [B, T, HV, 64] bf16, gated [NT, HV]
    int32)."""
    TENSOR_CORE._check(k, beta, CHUNK_SIZE)
    B, T, H, K = k.shape
    HV = beta.shape[2]
    device = k.device
    num_chunks = num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE)  # the chunk table's rows, on the host
    sms = autocp.num_sms(device)
    R = BY_FORWARD.heads_per_cta(H, HV, num_chunks, sms)
    ctas = ctas or ctas_per_sm(H, HV, num_chunks, sms)
    if R > BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS or ctas == TENSOR_CORE.MIN_CTAS_PER_SM:
        return BY_FORWARD.solve(k, beta, g_cum, cu_seqlens)
    k_flat = k.to(torch.bfloat16).contiguous().view(B * T, H, K)
    beta_flat, g_flat = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (beta, g_cum))
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, device=device, dtype=torch.bfloat16)
    gated = torch.empty(bounds.shape[0], HV, device=device, dtype=torch.int32)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        with nvtx_range("gate_free_solve.s12"):
            _compiled(H, HV, R, ctas)(k_flat, beta_flat, g_flat, bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (s06's or s08's). The op
    has no gate: with g_cum = 0 the solve's Ab is the gate-free one."""
    TENSOR_CORE._check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
