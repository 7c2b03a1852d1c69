"""gate_free_solve, stage 14: s13's kernel at six CTAs an SM with one value head a CTA and five with
two, on every grid.

What changed from s13: the launch bounds only (``ctas_per_sm``). s12 compiled s08's program at six
CTAs an SM only where that made its grid one wave, and s13 kept that rule; here the bound depends on
the heads a CTA alone: ``__launch_bounds__(128, 6)`` at one head (ptxas: 80 registers, 28 bytes of
spill stores and 40 of spill loads against 110 registers at four), ``(128, 5)`` at two (96
registers, 52 and 32 bytes of spills against 128 at four). Where s11 groups three or four heads a
CTA nothing changes: chunk_local_cumsum.s03, then s06.

Why: s08's kernel alone in a CUDA graph at four, five and six CTAs an SM (one H100, commit ba1bffa;
the same bits at all three), us:

    problem            heads a CTA  CTAs    at 4    at 5    at 6
    (16, 16) 8x4096         1       8320   144.1   141.3   135.3
    (16, 16) 1x8192         1       2064    50.2    51.3    49.9
    (16, 16) 1x2048         1        528    17.3    17.4    17.5
    (8, 24) 1x2048          1        792    27.1    27.9    23.0
    (16, 32) 1x8192         2       2064    61.2    61.3    61.6
    (2, 8) 1x8192           2        516    23.1    21.1    21.0
    (16, 32) 8x4096         2       8320   195.6   195.4   196.4

At one head a CTA six an SM win where the grid is many waves too ((16, 16) 8x4096: the whole
solve's gap to FlashQLA's kkt_solve, 0.144 ms against 0.118, ``results/solve.csv``, shrinks by a
third), not only where they make it one wave. At two heads a CTA the shared memory holds four
CTAs an SM whatever the bound; five is never slower and 9 % faster on (2, 8) 1x8192, six spills
196 bytes.

Measured effect: inside the forward, gdn_fwd.s32 against s29 (one H100, 6eedafa): 0.0685 against
0.0724 ms on (2, 8) 1x2048, 0.1520 against 0.1535 on (2, 8) 1x8192, 0.0758 against 0.0761 on (4, 16)
1x2048 (s32's docstring). The many-wave problem it was made for, (16, 16) 8x4096, has not been
timed inside the forward. Its tests passed on the GPU: the public shapes; g_cum, the table,
first_chunk, Ab and the flags bit for bit s13's on adversarial inputs
(``tests/test_reformulation.py``).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, min_ctas_per_sm
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("__launch_bounds__(128, 5)", "wgmma", "first_chunk[", "g_cum[")

PROLOGUE = stages.load("gate_free_solve", 13)    # the kernel: the table, the cumsum, s08's solve
BY_GRID = PROLOGUE.BY_GRID                       # s12: s11's grouping; the solve where R > 2
CHUNK_SIZE = PROLOGUE.CHUNK_SIZE
CTAS_PER_SM = {1: 6,   # value heads a CTA -> __launch_bounds__(128, CTAS_PER_SM[R]) (the table above)
               2: 5}
DEFAULT_SHAPE = dict(H=16, HV=32, heads_per_cta=2)


def ctas_per_sm(heads_per_cta: int) -> int:
    """The CTAs an SM s13's kernel is compiled for at one or two value heads a CTA."""
    return CTAS_PER_SM[heads_per_cta]


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int):
    return compile_hopper(min_ctas_per_sm(PROLOGUE.cumsum_solve_kernel(H, HV, heads_per_cta),
                                          ctas_per_sm(heads_per_cta)))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def cumsum_and_solve(k, beta, g, cu_seqlens=None):
    """s13's ``cumsum_and_solve`` at ``ctas_per_sm``: k [B, T, H, K] bf16, beta, g [B, T, HV] fp32 ->
    (g_cum [B T, HV] fp32, table int32 [NT, 2], first_chunk int32 [N + 1], ab [B, T, HV, 64] bf16,
    gated [NT, HV] int32)."""
    PROLOGUE.TENSOR_CORE._check(k, beta, CHUNK_SIZE)
    B, T, H, K = k.shape
    HV = beta.shape[2]
    device = k.device
    num_rows = num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE)  # the chunk table's rows, on the host
    R = BY_GRID.BY_FORWARD.heads_per_cta(H, HV, num_rows, autocp.num_sms(device))
    if R > PROLOGUE.TENSOR_CORE_MAX_HEADS or not B * T or not num_rows:
        return PROLOGUE.cumsum_and_solve(k, beta, g, cu_seqlens)  # s03 and s06, or nothing to do
    bounds = seq_bounds(cu_seqlens, B, T, device)
    g_cum = torch.empty(B * T, HV, device=device, dtype=torch.float32)
    table = torch.zeros(num_rows, 2, device=device, dtype=torch.int32)
    first_chunk = torch.zeros(bounds.shape[0], device=device, dtype=torch.int32)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, device=device, dtype=torch.bfloat16)
    gated = torch.empty(num_rows, HV, device=device, dtype=torch.int32)
    with nvtx_range("gate_free_solve.s14"):
        # g_cum, table, first_chunk, Ab, gated <- s13's kernel at ctas_per_sm(R) CTAs an SM
        _compiled(H, HV, R)(k.to(torch.bfloat16).contiguous().view(B * T, H, K),
                            beta.to(torch.float32).contiguous().view(B * T, HV),
                            g.to(torch.float32).contiguous().view(B * T, HV),
                            bounds, g_cum, table, first_chunk, ab, gated)
    return g_cum, table, first_chunk, ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16. The op has no gate: with
    g = 0 the cumsum is 0 and the solve's Ab is the gate-free one."""
    PROLOGUE.TENSOR_CORE._check(k, beta, chunk_size)
    return cumsum_and_solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[3]
