"""gate_free_solve, stage 08: s06 with the inverse's lower-left half on the tensor cores.

What it computes: ``flashqla.reference.gate_free_solve`` (Ab and the ``gated`` flags), no longer bit
for bit s02's: the 32 x 32 lower-left half of each inverse is two tf32 products.

What changed from s06: the levels of the blocked inverse. s06 computes all 16 block products of a
head (16 x 16 x 16 each) on the CUDA cores in fp32; 12 of them form the lower-left 32 x 32 half,
X_ll = -X_hi A_hl X_lo. Here, as FlashQLA's kkt_solve does: phase A (the diagonal blocks) and
level 1 (X_10, X_32: four block products a head) stay in fp32 on the CUDA cores, and with the
beta scalings folded into the halves (Ab_lo = X_lo diag(beta_lo), Ab_hi = X_hi diag(beta_hi),
A_hl = diag(beta_hi) (K K^T)_hl) the lower-left half of Ab is

    Ab_ll = -Ab_hi ((K K^T)_hl Ab_lo)       two 32 x 32 x 32 products, mma.sync tf32

Precision (float64 emulation, ``.diag/next/tf32emu.py``: normalized random keys, beta up to 2):
the tf32 half adds 1.5e-4 to 2.9e-4 relative L2 to Ab, against 1.6e-3 to 1.9e-3 for Ab's bf16
store. A CTA with a flagged head runs s06's fp32 path unchanged.

Measured effect (``profiles/solve_lab.py`` -> ``profiles/results/solve.csv``, 4 x H100, commit
d8516c1, CUDA-graph replay, beside s02-s07 and FlashQLA's kkt_solve; its GPU tests passed there:
the flags and flagged partial chunks with strong decay against the float64 reference, public
shapes): faster than s06 only where a CTA holds one or two value heads: 0.83-0.85x s06's time on
(16, 32) (1.14-1.15x FlashQLA's speed, where s06 is 0.96-0.97x) and 0.93-0.94x on (16, 16) (still
0.82x FlashQLA's); slower with three or four, 1.02-1.16x s06's time. Nsight Compute on (16, 64)
1 x 8192 (four heads a CTA): 112 us against s06's 98, 71 KiB of shared memory (three CTAs an SM,
occupancy 18 %), ``short_scoreboard`` stalls first (3.02), then ``long_scoreboard`` (2.09). Not
promoted: a solve chosen by heads a CTA (s08 at one or two, s06 at three or four) is the next step.

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
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "__shfl_xor_sync", "kTensorFloat32")

CHUNK_SIZE = 64          # C: tokens per chunk; one 64-row wgmma tile
BLOCK = 16               # the inverse's blocks: 16 x 16
HEAD_DIM = 128           # K
THREADS = 128            # one warpgroup: four warps, each a block column of every head
MAX_HEADS_PER_CTA = 4    # value heads a CTA solves (of one key head): phase A keeps 8 floats a head
MIN_CTAS_PER_SM = 4      # __launch_bounds__(128, 4), as s05
GROWTH_LIMIT = 2.0       # beta ||k||^2 <= 2  <=>  ||I - beta k k^T|| <= 1: A_r cannot grow
HALF = 32                # the tensor-core level: 32 x 32 halves of the 64 x 64 inverse
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

    def a_elem(kkt_s, g_s, r, i, l, n, gate):
        """A's entry (i, l) without beta: K K^T, or for a flagged head K K^T * Gamma below the
        diagonal of the chunk's real rows and 0 elsewhere (where exp2 of g_i - g_l could overflow)."""
        if gate:
            return T.if_then_else((l < i) & (i < n), kkt_s[i, l] * T.exp2(g_s[r, i] - g_s[r, l]), 0)
        return kkt_s[i, l]

    @T.macro
    def phase_a(kkt_s, g_s, beta_s, x_s, x_a, acc, row, jb, c, half, n, r0, nr, gate):
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
                    acc[2 * u + q % 2] = acc[2 * u + q % 2] + a_elem(
                        kkt_s, g_s, r0 + u, BLOCK * jb + i, BLOCK * jb + 8 * half + q, n, gate) * x_a[8 * u + q]
            for u in T.unroll(nr):
                row[u] = acc[2 * u] + acc[2 * u + 1]
                row[u] = T.if_then_else(i == c, 1.0, 0.0) - beta_s[r0 + u, BLOCK * jb + i] * (
                    row[u] + T.shfl_xor(row[u], 16))
                if i // 8 == half:
                    x_a[8 * u + i % 8] = row[u]
        for u in T.unroll(nr):
            for q in T.unroll(8):
                x_s[r0 + u, jb // 2, BLOCK * (jb % 2) + 8 * half + q, BLOCK * (jb % 2) + c] = x_a[8 * u + q]

    @T.macro
    def phase_b(kkt_s, g_s, beta_s, x_s, x_col, t_col, acc, row, jb, c, half, n, r, gate):
        # X_jj's column c (phase A's, from shared: another warp may have solved it)
        for q in T.unroll(8):
            x_col[q] = x_s[r, jb // 2, BLOCK * (jb % 2) + 8 * half + q, BLOCK * (jb % 2) + c]
        # level d, block row i = j + d of block column j: t <- diag(beta) sum_{e < d} A_{i, j+e}
        # X_{j+e, j}[:, c] (16 independent row sums), then X_ij[:, c] <- -X_ii t
        for d in T.unroll(1, NB):
            if jb + d < NB:
                for i in T.unroll(BLOCK):
                    acc[0] = 0.0
                    acc[1] = 0.0
                    for e in T.unroll(d):
                        for q in T.unroll(8):
                            acc[q % 2] = acc[q % 2] + a_elem(
                                kkt_s, g_s, r, BLOCK * (jb + d) + i, BLOCK * (jb + e) + 8 * half + q, n,
                                gate) * x_col[8 * e + q]
                    row[0] = acc[0] + acc[1]
                    t_col[i] = beta_s[r, BLOCK * (jb + d) + i] * (row[0] + T.shfl_xor(row[0], 16))
                for q in T.unroll(8):
                    acc[0] = 0.0
                    acc[1] = 0.0
                    for s in T.unroll(BLOCK):
                        acc[s % 2] = acc[s % 2] + x_s[r, (jb + d) // 2, BLOCK * ((jb + d) % 2) + 8 * half + q,
                                                           BLOCK * ((jb + d) % 2) + s] * t_col[s]
                    x_col[8 * d + q] = -(acc[0] + acc[1])

    @T.macro
    def level_one(kkt_s, beta_s, x_s, x_col, t_col, acc, row, c, half, r, b):
        # X_{j+1, j} of head r, j = 2b, column c: t <- diag(beta) A_{j+1, j} X_jj[:, c] (16
        # independent row sums), X_{j+1, j}[:, c] <- -X_{j+1, j+1} t (fp32, as s02's level 1)
        for q in T.unroll(8):
            x_col[q] = x_s[r, b, 8 * half + q, c]
        for i in T.unroll(BLOCK):
            acc[0] = 0.0
            acc[1] = 0.0
            for q in T.unroll(8):
                acc[q % 2] = acc[q % 2] + kkt_s[BLOCK * (2 * b + 1) + i, BLOCK * 2 * b + 8 * half + q] * x_col[q]
            row[0] = acc[0] + acc[1]
            t_col[i] = beta_s[r, BLOCK * (2 * b + 1) + i] * (row[0] + T.shfl_xor(row[0], 16))
        for q in T.unroll(8):
            acc[0] = 0.0
            acc[1] = 0.0
            for s in T.unroll(BLOCK):
                acc[s % 2] = acc[s % 2] + x_s[r, b, BLOCK + 8 * half + q, BLOCK + s] * t_col[s]
            x_s[r, b, BLOCK + 8 * half + q, c] = -(acc[0] + acc[1])

    @T.prim_func
    def gate_free_solve_tf32(
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
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            x_s = T.alloc_shared((R, 2, HALF, HALF), "float32")     # X's diagonal halves (lo, hi) of each head
            all_s = T.alloc_shared((HALF, HALF), "float32")         # K K^T's lower-left half
            t1_s = T.alloc_shared((R, HALF, HALF), "float32")       # (K K^T)_hl x_lo of each head
            t1_f = T.alloc_fragment((HALF, HALF), "float32")
            ll_f = T.alloc_fragment((HALF, HALF), "float32")
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
            # K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), read by every head's solve
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            T.copy(kkt_f, kkt_s)
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1
            T.sync_threads()
            any_flag[0] = 0
            for r in T.unroll(R):
                any_flag[0] = any_flag[0] | flag_s[r]

            if any_flag[0] == 0:
                # phase A (s08's): warp w solves X_ww of every head, the substitutions interleaved
                phase_a(kkt_s, g_s, beta_s, x_s, x_a, acc, row, warp, c, half, n, 0, R, False)
                # all <- K K^T[32:64, 0:32], the lower-left half's products' shared factor
                for i, j in T.Parallel(HALF, HALF):
                    all_s[i, j] = kkt_s[HALF + i, j]
                T.sync_threads()
                # level 1: X_10 and X_32 of every head, 2R blocks over the four warps
                for e in T.unroll((2 * R + NB - 1) // NB):
                    if warp + NB * e < 2 * R:
                        level_one(kkt_s, beta_s, x_s, x_col, t_col, acc, row, c, half,
                                  (warp + NB * e) // 2, (warp + NB * e) % 2)
                T.sync_threads()
                # Ab's diagonal halves, in place: x_lo <- [[X_00, 0], [X_10, X_11]] diag(beta_0:32),
                # x_hi <- [[X_22, 0], [X_32, X_33]] diag(beta_32:64)
                for r, b, i, j in T.Parallel(R, 2, HALF, HALF):
                    x_s[r, b, i, j] = T.if_then_else((i < BLOCK) & (j >= BLOCK), 0.0,
                                                     x_s[r, b, i, j] * beta_s[r, HALF * b + j])
                # level 2 on the tensor cores (tf32, fp32 accumulate): Ab's lower-left half
                # -X_hi diag(beta_hi) (K K^T)_hl X_lo diag(beta_lo) = -x_hi (all x_lo)
                for r in T.unroll(R):
                    T.gemm(all_s, x_s[r, 0, :, :], t1_f, clear_accum=True)
                    T.copy(t1_f, t1_s[r, :, :])
                for r in T.unroll(R):
                    T.gemm(x_s[r, 1, :, :], t1_s[r, :, :], ll_f, clear_accum=True)
                    for i, j in T.Parallel(HALF, HALF):
                        if HALF + i < n:
                            ab[bos + HALF + i, hv0 + r, j] = -ll_f[i, j]
                # the other three quarters: xlo, xhi, and zeros above the diagonal
                for r in T.unroll(R):
                    for i, j in T.Parallel(C, C):
                        if (i < n) & ((i < HALF) | (j >= HALF)):
                            ab[bos + i, hv0 + r, j] = T.if_then_else(
                                i < HALF, T.if_then_else(j < HALF, x_s[r, 0, i % HALF, j % HALF], 0.0),
                                x_s[r, 1, i % HALF, j % HALF])
                for r in T.Parallel(R):
                    gated[i_c, hv0 + r] = 0
            else:
                # a CTA with a flagged head: s08's path, all in fp32
                for r in T.unroll(R):
                    if flag_s[r] == 1:
                        phase_a(kkt_s, g_s, beta_s, x_s, x_a, acc, row, warp, c, half, n, r, 1, True)
                    else:
                        phase_a(kkt_s, g_s, beta_s, x_s, x_a, acc, row, warp, c, half, n, r, 1, False)
                T.sync_threads()
                for r in T.serial(R):
                    jb = T.if_then_else(r % 2 == 0, (warp + 2 * (r // 2)) % NB, NB - 1 - (warp + 2 * (r // 2)) % NB)
                    col = BLOCK * jb + c
                    if flag_s[r] == 1:
                        phase_b(kkt_s, g_s, beta_s, x_s, x_col, t_col, acc, row, jb, c, half, n, r, True)
                    else:
                        phase_b(kkt_s, g_s, beta_s, x_s, x_col, t_col, acc, row, jb, c, half, n, r, False)
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

    return gate_free_solve_tf32


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int):
    return compile_hopper(gate_free_solve_kernel(H, HV, heads_per_cta))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    H, HV = DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]
    return _compiled(H, HV, cta_heads(H, HV)).get_kernel_source()


def _check(k, beta, chunk_size):
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s08: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K, HV = k.shape[2], k.shape[3], beta.shape[2]
    if K != HEAD_DIM:
        raise ValueError(f"gate_free_solve.s08: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if HV % H:
        raise ValueError(f"gate_free_solve.s08: `beta` must have a number of value heads HV that is "
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
        with nvtx_range("gate_free_solve.s08"):
            kernel(k_flat, beta_flat, g_flat, bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (see the module doc).
    The op has no gate: with g_cum = 0 the fallback solves the same matrix."""
    _check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
