"""gate_free_solve, stage 13: the chunk table and the cumsum of g in the prologue of s08's kernel,
so that the forward's first two kernels are one.

What changed from s12: s08's kernel (one or two value heads a CTA) takes g and the sequence
bounds instead of g_cum and the chunk table, and makes both itself before its solve. Each CTA
(chunk row i_c, head group i_r) finds its chunk from the bounds as chunk_local_cumsum.s03 does (a
prefix sum of the sequences' chunk counts over its 128 threads, the thread whose sequences hold
row i_c giving [start, end)), and the CTAs of head group 0 write the table row (CTA (0, 0) also
``first_chunk``). Then 8 R of its threads scan g over the chunk for its R value heads, s02's scan
in s02's order (eight tokens a thread, the segment totals through shared memory), write g_cum,
and keep log2(e) g_cum in shared memory for a flagged head's gate, where s08 read it back from
HBM. From K K^T on the kernel is s08's, line for line. Where s11 groups three or four heads a CTA
(s06's kernel), nothing changes: chunk_local_cumsum.s03, then s06.

Why: in a CUDA graph of one forward on (2, 8) 1x2048 (one H100, 4c2e89f) the cumsum takes 2.0 us
and the solve, a programmatic dependent of it, 8.9 us, starting 1.3 us before the cumsum ends:
about 9.6 us from the first kernel's start to the fused kernel's, against FlashQLA's 8.3 (its
cumsum 1.8, its solve 6.3). The solve needs only k and beta except for a flagged head's gate, so
its chunk's cumsum (eight threads a head, a few hundred cycles) costs it less than a launch that
it must wait for. The same bits: the table and g_cum are s03's, Ab and the flags s08's.

Measured effect (inside gdn_fwd.s31's forward, one CUDA graph, one H100, commit ba1bffa,
``results/timeline_prologue.csv``), us:

    problem            s30: cumsum + solve, span    s31: this kernel, span
    (2, 8) 1x2048         2.1 + 8.9    71.7             8.4    70.4
    (4, 16) 1x2048        2.6 + 12.2   73.5            11.7    73.6
    (8, 32) 1x2048        2.8 + 17.1   80.7            16.1    79.6
    (16, 16) 1x2048       2.6 + 11.8   77.1            11.9    74.7

The cumsum costs the solve kernel nothing measurable (8.4 us against s08's 8.9 alone after it). Its
tests passed on the GPU: the public shapes; g_cum, the table and first_chunk bit for bit s03's and
Ab and the flags bit for bit s12's on adversarial inputs (``tests/test_reformulation.py``).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, min_ctas_per_sm
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "kTensorFloat32", "first_chunk[", "g_cum[")

BY_GRID = stages.load("gate_free_solve", 12)     # heads a CTA (s11's) and CTAs an SM (s12's)
TENSOR_CORE = BY_GRID.TENSOR_CORE                # s08: the solve after the prologue
CUMSUM = stages.load("chunk_local_cumsum", 3)    # the table and the scan, for all heads a CTA
CHUNK_SIZE = TENSOR_CORE.CHUNK_SIZE              # C
BLOCK = TENSOR_CORE.BLOCK                        # the inverse's 16 x 16 blocks
HEAD_DIM = TENSOR_CORE.HEAD_DIM                  # K
THREADS = TENSOR_CORE.THREADS                    # one warpgroup
MIN_CTAS_PER_SM = TENSOR_CORE.MIN_CTAS_PER_SM    # __launch_bounds__(128, 4), unless s12 says 6
GROWTH_LIMIT = TENSOR_CORE.GROWTH_LIMIT
HALF = TENSOR_CORE.HALF
LOG2E = TENSOR_CORE.LOG2E
SEGMENTS = CUMSUM.SEGMENTS                       # P: threads a head in the scan, 64 / P tokens each
TENSOR_CORE_MAX_HEADS = BY_GRID.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS
DEFAULT_SHAPE = dict(H=16, HV=32, heads_per_cta=2)


def cumsum_solve_kernel(H: int, HV: int, heads_per_cta: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA scanning and solving
    ``heads_per_cta`` (one or two) value heads of one key head; any token, sequence or row count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R, NB = CHUNK_SIZE, HEAD_DIM, heads_per_cta, CHUNK_SIZE // BLOCK
    P = SEGMENTS
    L = C // P                     # tokens a scanning thread
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")
    num_rows = T.dynamic("num_rows")

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
    def gate_free_solve_with_cumsum(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g: T.Tensor((num_tokens, HV), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # [N + 1]: where each sequence starts
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # out: the chunk-local cumsum of g
        table: T.Tensor((num_rows, 2), "int32"),               # out: [start, end) of every chunk
        first_chunk: T.Tensor((num_bounds,), "int32"),         # out: each sequence's first row
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab
        gated: T.Tensor((num_rows, HV), "int32"),              # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_rows, HV // R, threads=THREADS) as (i_c, i_r):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            t = T.get_thread_binding()
            warp = t // 32                                     # phase A: this warp's block column
            c = t % 16                                         # the lane's column within a block
            half = (t // 16) % 2                               # which half of each row sum
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            n_seqs = num_bounds - 1
            per = T.ceildiv(n_seqs, THREADS)                   # sequences [t per, (t + 1) per) are t's
            h = t % R                                          # the scan: this thread's head ...
            j = t // R                                         # ... and segment; >= P past 8 R threads

            scan_s = T.alloc_shared((THREADS,), "int32")
            row_s = T.alloc_shared((2,), "int32")              # this CTA's chunk: [start, end)
            mine = T.alloc_local((1,), "int32")
            step = T.alloc_local((1,), "int32")
            x = T.alloc_local((L,), "float32")
            totals = T.alloc_shared((R * P,), "float32")       # t_j,h at h P + j
            tt = T.alloc_local((P,), "float32")                # t_0,h .. t_{P-1},h
            off = T.alloc_var("float32")
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

            # ---- the chunk (chunk_local_cumsum.s03's prologue): row_s <- [T, T) unless found below
            if t == 0:
                row_s[0] = num_tokens
                row_s[1] = num_tokens
            # mine <- the chunks of this thread's sequences, ceil(length / C) each
            mine[0] = 0
            for i in T.serial(per):
                if t * per + i < n_seqs:
                    mine[0] = mine[0] + T.ceildiv(bounds[t * per + i + 1] - bounds[t * per + i], C)
            # scan_s <- inclusive prefix sums of mine over the threads (Hillis-Steele)
            scan_s[t] = mine[0]
            for d in [1 << e for e in range((THREADS - 1).bit_length())]:  # a Python loop: unrolled
                T.sync_threads()
                step[0] = scan_s[t] + T.if_then_else(t >= d, scan_s[T.max(t - d, 0)], 0)
                T.sync_threads()
                scan_s[t] = step[0]
            T.sync_threads()
            # walk this thread's sequences from the chunks before them: CTA (0, 0) writes first_chunk;
            # the sequence holding row i_c gives row_s its chunk, clipped to the sequence's end
            mine[0] = scan_s[t] - mine[0]
            for i in T.serial(per):
                if t * per + i < n_seqs:
                    step[0] = T.ceildiv(bounds[t * per + i + 1] - bounds[t * per + i], C)
                    if (i_c == 0) & (i_r == 0):
                        first_chunk[t * per + i] = mine[0]
                    if mine[0] <= i_c and i_c < mine[0] + step[0]:
                        row_s[0] = bounds[t * per + i] + (i_c - mine[0]) * C
                        row_s[1] = T.min(bounds[t * per + i] + (i_c - mine[0] + 1) * C,
                                         bounds[t * per + i + 1])
                    mine[0] = mine[0] + step[0]
            if (i_c == 0) & (i_r == 0) & (t == THREADS - 1):
                first_chunk[n_seqs] = scan_s[THREADS - 1]
            T.sync_threads()
            bos = row_s[0]                                     # first token of the chunk
            n = row_s[1] - bos                                 # its length, 0..64
            if (i_r == 0) & (t == 0):
                table[i_c, 0] = bos
                table[i_c, 1] = row_s[1]

            # ---- the cumsum of the R heads (s02's scan, s02's order): x_r <- g[bos + j L + r, h],
            # zero past the chunk's end
            for r in T.unroll(L):
                x[r] = 0.0
                if (j < P) & (j * L + r < n):
                    x[r] = g[bos + j * L + r, hv0 + h]
            # x_r <- x_0 + ... + x_r: the prefix within the segment; x_{L-1} is its total
            for r in T.unroll(1, L):
                x[r] = x[r] + x[r - 1]
            if t < P * R:
                totals[h * P + j] = x[L - 1]
            # flag_r <- 0 (the barriers before K K^T order these stores before the ones below)
            for r in T.Parallel(R):
                flag_s[r] = 0
            T.sync_threads()
            # off = t_0,h + ... + t_{j-1},h; g_cum <- off + x_r, and log2(e) g_cum (0 past the chunk's
            # end) for a flagged head's gate
            for jj in T.vectorized(P):
                tt[jj] = totals[h * P + jj]
            off = 0.0
            for jj in T.unroll(P - 1):
                if jj < j:
                    off = off + tt[jj]
            if t < P * R:
                for r in T.unroll(L):
                    g_s[h, j * L + r] = T.if_then_else(j * L + r < n, (off + x[r]) * LOG2E, 0)
                    if j * L + r < n:
                        g_cum[bos + j * L + r, hv0 + h] = off + x[r]
            # ---- s08's solve: K <- k[bos : bos + n]; beta of the R value heads; zeros below row n
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for r, i in T.Parallel(R, C):
                beta_s[r, i] = T.if_then_else(i < n, beta[bos + i, hv0 + r], 0)
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

    return gate_free_solve_with_cumsum


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int, ctas: int):
    return compile_hopper(min_ctas_per_sm(cumsum_solve_kernel(H, HV, heads_per_cta), ctas))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE, ctas=MIN_CTAS_PER_SM).get_kernel_source()


def cumsum_and_solve(k, beta, g, cu_seqlens=None):
    """k [B, T, H, K] bf16, beta, g [B, T, HV] fp32 -> (g_cum [B T, HV] fp32, table int32 [NT, 2],
    first_chunk int32 [N + 1], ab [B, T, HV, 64] bf16, gated [NT, HV] int32): one kernel where s11
    groups one or two heads a CTA, else chunk_local_cumsum.s03 and gate_free_solve.s12."""
    TENSOR_CORE._check(k, beta, CHUNK_SIZE)
    B, T, H, K = k.shape
    HV = beta.shape[2]
    device = k.device
    num_rows = num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE)  # the chunk table's rows, on the host
    sms = autocp.num_sms(device)
    R = BY_GRID.BY_FORWARD.heads_per_cta(H, HV, num_rows, sms)
    if R > TENSOR_CORE_MAX_HEADS:
        g_cum, table, first_chunk = CUMSUM.cumsum_and_table(g, cu_seqlens)
        ab, gated = BY_GRID.solve(k, beta, g_cum.view(B, T, HV), cu_seqlens)
        return g_cum, table, first_chunk, ab, gated
    k_flat = k.to(torch.bfloat16).contiguous().view(B * T, H, K)
    beta_flat, g_flat = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (beta, g))
    bounds = seq_bounds(cu_seqlens, B, T, device)
    g_cum = torch.empty(B * T, HV, device=device, dtype=torch.float32)
    table = torch.zeros(num_rows, 2, device=device, dtype=torch.int32)
    first_chunk = torch.zeros(bounds.shape[0], device=device, dtype=torch.int32)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, device=device, dtype=torch.bfloat16)
    gated = torch.empty(num_rows, HV, device=device, dtype=torch.int32)
    if B * T and num_rows:  # every token lies in exactly one chunk, so every row gets written
        with nvtx_range("gate_free_solve.s13"):
            _compiled(H, HV, R, BY_GRID.ctas_per_sm(H, HV, num_rows, sms))(
                k_flat, beta_flat, g_flat, bounds, g_cum, table, first_chunk, ab, gated)
    return g_cum, table, first_chunk, ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16. The op has no gate: with
    g = 0 the cumsum is 0 and the solve's Ab is the gate-free one."""
    TENSOR_CORE._check(k, beta, chunk_size)
    return cumsum_and_solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[3]
