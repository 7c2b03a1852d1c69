"""gate_free_solve, stage 07: s06 with one copy of the solve's code.

What it computes: s02's, operation for operation (Ab and the flags bit for bit s02's, as s06).

What changed from s06: where a flagged head's gate is applied. s06 read K K^T * Gamma element by
element inside the solve (``a_elem``: an exp2, a compare and a select per multiply-add) in a
second copy of phases A and B, kept for the rare flagged head. The unrolled kernel grew to 27,152
SASS instructions (434 KB; 2,000 of them MUFU.EX2, all on the cold path; nvcc 13.0, sm_90a,
(16, 64)), and Nsight Compute on (16, 64) 1 x 8192 (``profiles/results/ncu_gate_free_solve_s06.csv``,
one H100) put ``no_instruction`` first among the stall reasons (1.38 warps an issue): the warps,
each on its own block column, run different stretches of a large code and miss the instruction
cache. Here the solve always reads a_s, s02's buffer: K K^T, or, in a CTA that has a flagged head,
rebuilt before each of its heads (K K^T * Gamma for the flagged ones, K K^T again for the
others) between barriers, with that head's phase A run alone. One copy of phase B serves both
paths, and the fast path (no flagged head: phase A of all heads interleaved, one barrier) is
s06's.

SASS: 5,712 instructions (s06: 27,152; s05: 4,400), 32 MUFU, no spills (nvcc 13.0, sm_90a, (16, 64)). Shared memory: 51 KiB (a_s is back), four CTAs an SM still fit (launch
bounds (128, 4): 128 registers, no spills).

Measured effect (``profiles/solve_lab.py`` -> ``profiles/results/solve.csv``, 4 x H100, commit
ce27576; its GPU tests passed there, bit for bit s02's): slower. 1.04-1.19x s06's time on all 16
problems (0.89-1.07x s05's), so it is not promoted. Nsight Compute on (16, 64) 1 x 8192
(``profiles/results/ncu_gate_free_solve_s07.csv``, same run): 110 us against s06's 98;
``no_instruction`` fell from 1.38 to 1.17 warps an issue, but ``short_scoreboard`` (shared memory
and shuffles) rose to first, 1.62. What costs more is not established. Two differences remain
to test: the 16 KiB of a_s (51 KiB a CTA, 35 in s06) and the loop over heads, which now holds
barriers inside a branch (8 BAR instructions against 5). The lesson is the measurement: a
smaller kernel was not a faster one here.

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: K K^T (bf16 in, fp32 accumulate); float t_col[16]: a level's 16 row sums of the lane's
# column in fp32 registers; __shfl_xor_sync: the two halves of each row sum meet
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "__shfl_xor_sync")

CHUNK_SIZE = 64          # C: tokens per chunk; one 64-row wgmma tile
BLOCK = 16               # the inverse's blocks: 16 x 16
HEAD_DIM = 128           # K
THREADS = 128            # one warpgroup: four warps, each a block column of every head
MAX_HEADS_PER_CTA = 4    # value heads a CTA solves (of one key head): phase A keeps 8 floats a head
MIN_CTAS_PER_SM = 4      # __launch_bounds__(128, 4), as s05
GROWTH_LIMIT = 2.0       # beta ||k||^2 <= 2  <=>  ||I - beta k k^T|| <= 1: A_r cannot grow
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)


def cta_heads(H: int, HV: int) -> int:
    """The largest divisor of HV / H up to MAX_HEADS_PER_CTA: the value heads sharing one K K^T."""
    group = HV // H
    return max(r for r in range(1, MAX_HEADS_PER_CTA + 1) if group % r == 0)


def gate_free_solve_kernel(H: int, HV: int, heads_per_cta: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA solving ``heads_per_cta``
    value heads of one key head (a divisor of HV / H); any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R, NB = CHUNK_SIZE, HEAD_DIM, heads_per_cta, CHUNK_SIZE // BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.macro
    def phase_a(a_s, beta_s, xd_s, x_a, acc, row, jb, c, half, r0, nr):
        # X_jj <- (I + A_jj)^-1 e_c for heads r0 .. r0 + nr - 1 at once (independent chains): forward
        # substitution over the block's 16 rows, x_i = [i == c] - beta_i sum_{l < i} a_il x_l
        # (unknown x_l are still 0); half h sums l in 8h .. 8h + 7, one shuffle adds the other half
        for s in T.unroll(nr * 8):
            x_a[s] = 0.0
        for i in T.unroll(BLOCK):
            for u in T.unroll(nr):
                acc[2 * u] = 0.0
                acc[2 * u + 1] = 0.0
                for q in T.unroll(8):
                    acc[2 * u + q % 2] = acc[2 * u + q % 2] + a_s[BLOCK * jb + i, BLOCK * jb + 8 * half + q] * x_a[8 * u + q]
            for u in T.unroll(nr):
                row[u] = acc[2 * u] + acc[2 * u + 1]
                row[u] = T.if_then_else(i == c, 1.0, 0.0) - beta_s[r0 + u, BLOCK * jb + i] * (
                    row[u] + T.shfl_xor(row[u], 16))
                if i // 8 == half:
                    x_a[8 * u + i % 8] = row[u]
        for u in T.unroll(nr):
            for q in T.unroll(8):
                xd_s[r0 + u, BLOCK * jb + 8 * half + q, c] = x_a[8 * u + q]

    @T.macro
    def phase_b(a_s, beta_s, xd_s, x_col, t_col, acc, row, jb, c, half, r):
        # X_jj's column c (phase A's, from shared: another warp may have solved it)
        for q in T.unroll(8):
            x_col[q] = xd_s[r, BLOCK * jb + 8 * half + q, c]
        # level d, block row i = j + d of block column j: t <- diag(beta) sum_{e < d} A_{i, j+e}
        # X_{j+e, j}[:, c] (16 independent row sums), then X_ij[:, c] <- -X_ii t
        for d in T.unroll(1, NB):
            if jb + d < NB:
                for i in T.unroll(BLOCK):
                    acc[0] = 0.0
                    acc[1] = 0.0
                    for e in T.unroll(d):
                        for q in T.unroll(8):
                            acc[q % 2] = acc[q % 2] + a_s[BLOCK * (jb + d) + i,
                                                          BLOCK * (jb + e) + 8 * half + q] * x_col[8 * e + q]
                    row[0] = acc[0] + acc[1]
                    t_col[i] = beta_s[r, BLOCK * (jb + d) + i] * (row[0] + T.shfl_xor(row[0], 16))
                for q in T.unroll(8):
                    acc[0] = 0.0
                    acc[1] = 0.0
                    for s in T.unroll(BLOCK):
                        acc[s % 2] = acc[s % 2] + xd_s[r, BLOCK * (jb + d) + 8 * half + q, s] * t_col[s]
                    x_col[8 * d + q] = -(acc[0] + acc[1])

    @T.prim_func
    def gate_free_solve_balanced(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # read only for flagged chunks
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_chunks, HV // R, threads=THREADS) as (i_c, i_r):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            t = T.get_thread_binding()
            warp = t // 32                                     # phase A: this warp's block column
            c = t % 16                                         # the lane's column within a block
            half = (t // 16) % 2                               # which half of each row sum
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_s = T.alloc_shared((C, K), "bfloat16")
            kkt_s = T.alloc_shared((C, C), "float32")
            a_s = T.alloc_shared((C, C), "float32")            # the solves' A: K K^T, or K K^T * Gamma
            xd_s = T.alloc_shared((R, C, BLOCK), "float32")    # head r, row i: X's diagonal block row i
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_a = T.alloc_local((R * 8,), "float32")           # phase A: X_jj[8 half + q, c] of head u at 8 u + q
            x_col = T.alloc_local((NB * 8,), "float32")        # X_{j+l, j}[8 half + q, c] at 8 l + q
            t_col = T.alloc_local((BLOCK,), "float32")         # a level's row sums, both halves added
            acc = T.alloc_local((2 * R,), "float32")           # two partial sums of a row, per head
            row = T.alloc_local((R,), "float32")
            any_flag = T.alloc_local((1,), "int32")

            # flag_r <- 0 (the barriers before K K^T order these stores before the ones below)
            for r in T.Parallel(R):
                flag_s[r] = 0
            # K <- k[bos : bos + n]; beta, log2(e) g_cum of the R value heads; zeros below row n
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for r, i in T.Parallel(R, C):
                beta_s[r, i] = T.if_then_else(i < n, beta[bos + i, hv0 + r], 0)
                g_s[r, i] = T.if_then_else(i < n, g_cum[bos + i, hv0 + r] * LOG2E, 0)
            # K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), kept for every value head;
            # a_s, the solves' source, holds it too, or K K^T * Gamma while a flagged head solves
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            T.copy(kkt_f, kkt_s)
            T.copy(kkt_f, a_s)
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1
            T.sync_threads()
            any_flag[0] = 0
            for r in T.unroll(R):
                any_flag[0] = any_flag[0] | flag_s[r]

            # phase A: warp w solves X_ww of every head, the heads' substitutions interleaved (a CTA
            # with a flagged head solves its heads one at a time below)
            if any_flag[0] == 0:
                phase_a(a_s, beta_s, xd_s, x_a, acc, row, warp, c, half, 0, R)
                T.sync_threads()

            for r in T.serial(R):
                if any_flag[0] == 1:
                    # a CTA with a flagged head, head r alone: a_s <- K K^T * Gamma below the
                    # diagonal of the real rows (zero elsewhere, where exp2 could overflow) for a
                    # flagged head, K K^T for the others; then phase A of head r
                    T.sync_threads()
                    for i, j in T.Parallel(C, C):
                        a_s[i, j] = T.if_then_else(
                            flag_s[r] == 1,
                            T.if_then_else((j < i) & (i < n), kkt_s[i, j] * T.exp2(g_s[r, i] - g_s[r, j]), 0),
                            kkt_s[i, j])
                    T.sync_threads()
                    phase_a(a_s, beta_s, xd_s, x_a, acc, row, warp, c, half, r, 1)
                    T.sync_threads()
                # phase B: for head r warp w walks block column ``jb`` down (the columns' work is 9,
                # 5, 2 and 0 block products; a Latin square over four heads (w, 3 - w, w + 2, 1 - w,
                # mod 4) spreads them: over four heads every warp takes every column once, over
                # two the long column 0 pairs with the empty column 3), then stores
                # Ab[:, col] = X[:, col] beta_col in bf16 straight from registers (rows < n)
                jb = T.if_then_else(r % 2 == 0, (warp + 2 * (r // 2)) % NB, NB - 1 - (warp + 2 * (r // 2)) % NB)
                col = BLOCK * jb + c
                phase_b(a_s, beta_s, xd_s, x_col, t_col, acc, row, jb, c, half, r)
                # block row j + l holds X_{j+l, j} (x_col[8 l ..]); the block rows above j are zero
                for l in T.unroll(NB):
                    if jb + l < NB:
                        for q in T.unroll(8):
                            if BLOCK * (jb + l) + 8 * half + q < n:
                                ab[bos + BLOCK * (jb + l) + 8 * half + q, hv0 + r, col] = x_col[8 * l + q] * beta_s[r, col]
                for l in T.unroll(1, NB):
                    if jb >= l:
                        for q in T.unroll(8):
                            if BLOCK * (jb - l) + 8 * half + q < n:
                                ab[bos + BLOCK * (jb - l) + 8 * half + q, hv0 + r, col] = 0
                if t == 0:
                    gated[i_c, hv0 + r] = flag_s[r]

    return gate_free_solve_balanced


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int):
    return compile_hopper(gate_free_solve_kernel(H, HV, heads_per_cta))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    H, HV = DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]
    return _compiled(H, HV, cta_heads(H, HV)).get_kernel_source()


def _check(k, beta, chunk_size):
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s07: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K, HV = k.shape[2], k.shape[3], beta.shape[2]
    if K != HEAD_DIM:
        raise ValueError(f"gate_free_solve.s07: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if HV % H:
        raise ValueError(f"gate_free_solve.s07: `beta` must have a number of value heads HV that is "
                         f"a multiple of the H = {H} heads of k; got HV = {HV}")


def solve(k, beta, g_cum, cu_seqlens=None, heads_per_cta=None):
    """The kernel with its fallback: k [B, T, H, K] bf16, beta, g_cum [B, T, HV] fp32 ->
    (ab [B, T, HV, 64] bf16, gated [NT, HV] int32, one row per row of the chunk table): ab holds
    Ab for chunks with gated = 0 and Ai diag(beta) (the gate kept) for chunks with gated = 1.
    ``heads_per_cta`` defaults to ``cta_heads``."""
    _check(k, beta, CHUNK_SIZE)
    B, T, H, K = k.shape
    HV = beta.shape[2]
    device = k.device
    fp32 = dict(device=device, dtype=torch.float32)
    k_flat = k.to(device=device, dtype=torch.bfloat16).contiguous().view(B * T, H, K)
    beta_flat = beta.to(**fp32).contiguous().view(B * T, HV)
    g_flat = g_cum.to(**fp32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, device=device, dtype=torch.bfloat16)
    gated = torch.empty(bounds.shape[0], HV, device=device, dtype=torch.int32)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(H, HV, heads_per_cta or cta_heads(H, HV))
        with nvtx_range("gate_free_solve.s07"):
            kernel(k_flat, beta_flat, g_flat, bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (see the module doc).
    The op has no gate: with g_cum = 0 the fallback solves the same matrix."""
    _check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
