"""gate_free_solve, stage 16: s14's kernel (the chunk table and the cumsum in the solve's prologue,
one or two value heads a CTA) with s15's solve: phase B's block levels on mma.sync.

What changed from s14 (as promoted in ``flashqla.fwd.gate_free_solve_with_cumsum_kernel``): the solve
after the prologue. s14 ran s08's: phase A, level 1 on the CUDA cores (fp32), the lower-left 32 x 32
half as two tf32 products of whole halves staged in shared memory. Here it is s15's: phase A, then
for each unflagged head a warp walks a block column down with mma.sync (``S15.phase_b_on_mma``); a
flagged head keeps s06's fp32 walk. The halves' staging buffers go: at one head a CTA the generated
kernel's shared memory ends at 23,104 bytes (s12's docstring: 33,296 for s08's).

Why (one H100, ccabfe0; each kernel alone, 20 launches in a CUDA graph): s15's solve after the
library's cumsum kernel already beat s14's one kernel on the grids the forward gives one or two
heads a CTA, us:

    problem             heads a CTA    s14      cumsum + s15
    (16, 16) 8x4096          1        143.2      2.9 + 103.1
    (16, 16) 1x8192          1         42.7      2.5 +  32.8
    (16, 32) 8x4096          2        212.9      4.1 + 143.4
    (16, 32) 1x8192          2         56.4      2.9 +  39.2
    (8, 32) 1x2048           2         14.9      2.7 +  11.4
    (8, 24) 1x2048           1         15.3      2.6 +  13.9
    (16, 16) 1x2048          1         11.2      2.4 +   7.9

One kernel keeps the short grids' launch (the cumsum's 2.4-2.9 us).

Precision: s15's (tf32 level products; phase A and flagged heads in fp32).

Measured effect (one H100, commit 69c6bf5; ``profiles/solve_lab.py --kernels`` ->
``results/solve_kernels.csv``, the same method), us:

    problem              heads a CTA    s14      s16
    (16, 16) 8x4096           1        143.2    109.9
    (16, 16) 1x8192           1         42.5     33.0
    (16, 32) 8x4096           2        213.9    190.1
    (16, 32) 1x8192           2         57.6     49.6
    (8, 32) 1x2048            2         14.9     13.7
    (8, 24) 1x2048            1         15.5     12.7
    (16, 16) 1x2048           1         11.2      9.0

0.77-0.92x s14's time, at the same launch bounds (ptxas: 80 registers and 68 bytes of spill
stores at one head, 96 and 108 at two); Ab within 5.2e-4 relative L2 of s14's (whose lower-left
half is tf32 too). In the forward: gdn_fwd.s43. Its GPU tests passed at 597433d (adversarial
inputs against float64, the flagged heads' rows bit for bit s14's; the public shapes).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla import autocp, fwd, stages
from flashqla.hopper import compile_hopper, min_ctas_per_sm
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("tl::mma_sync<tl::DataType::kTensorFloat32", "first_chunk[", "g_cum[")

S14 = stages.load("gate_free_solve", 14)        # the kernel this one edits, its CTAs an SM
S15 = stages.load("gate_free_solve", 15)        # the solve it takes
CHUNK_SIZE, HEAD_DIM, THREADS = fwd.CHUNK_SIZE, fwd.HEAD_DIM, fwd.THREADS
SOLVE_BLOCK, CUMSUM_SEGMENTS = fwd.SOLVE_BLOCK, fwd.CUMSUM_SEGMENTS
MIN_CTAS_PER_SM, GROWTH_LIMIT, LOG2E = fwd.MIN_CTAS_PER_SM, fwd.GROWTH_LIMIT, fwd.LOG2E
DEFAULT_SHAPE = dict(H=16, HV=32, heads_per_cta=2)


def cumsum_solve_kernel(H: int, HV: int, heads_per_cta: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA scanning and solving
    ``heads_per_cta`` (one or two) value heads of one key head; any token, sequence or row count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R, NB = CHUNK_SIZE, HEAD_DIM, heads_per_cta, CHUNK_SIZE // SOLVE_BLOCK
    P = CUMSUM_SEGMENTS
    L = C // P                     # tokens a scanning thread
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")
    num_rows = T.dynamic("num_rows")

    solve_heads = S15.solve_after_kkt(T, R, False)

    @T.prim_func
    def gate_free_solve_with_cumsum_levels_on_mma(
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
            gq = (t % 32) // 4                                 # phase B: the lane's mma group ...
            tq = t % 4                                         # ... and its place in the quad
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
            kkt_s = T.alloc_shared((C, S15.KKT_STRIDE), "float32")
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            xd_s = T.alloc_shared((R, C, SOLVE_BLOCK), "float32")   # head r, row i: X's diagonal block row i
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_a = T.alloc_local((R * 8,), "float32")           # phase A: X_jj[8 half + q, c] of head u at 8 u + q
            x_col = T.alloc_local((NB * 8,), "float32")        # flagged phase B: X_{j+l, j}[8 half + q, c] at 8 l + q
            t_col = T.alloc_local((SOLVE_BLOCK,), "float32")   # ... a level's row sums, both halves added
            acc = T.alloc_local((2 * R,), "float32")           # two partial sums of a row, per head
            row = T.alloc_local((R,), "float32")
            xa = T.alloc_local((NB * 8,), "float32")           # mma phase B: X_{j+e, j}^T, A fragments
            ta = T.alloc_local((8,), "float32")                # ... t^T as A fragments
            tc = T.alloc_local((8,), "float32")                # ... t^T, two accumulators
            xc = T.alloc_local((8,), "float32")                # ... -X_{D, j}^T, two accumulators
            b = T.alloc_local((2,), "float32")                 # ... a B fragment
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
            for i, jj in T.Parallel(C, C):
                kkt_s[i, jj] = kkt_f[i, jj]
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1
            T.sync_threads()
            # phase A, then phase B head by head (s15's)
            solve_heads(kkt_s, g_s, beta_s, flag_s, xd_s, x_a, x_col, t_col, acc, row, xa, ta, tc, xc, b,
                        any_flag, t, warp, c, half, gq, tq, n, hv0, bos, i_c, ab, gated)

    return gate_free_solve_with_cumsum_levels_on_mma


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int):
    return compile_hopper(min_ctas_per_sm(cumsum_solve_kernel(H, HV, heads_per_cta), S14.ctas_per_sm(heads_per_cta)))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def cumsum_and_solve(k, beta, g, cu_seqlens=None):
    """s14's ``cumsum_and_solve`` on this kernel: k [B, T, H, K] bf16, beta, g [B, T, HV] fp32 ->
    (g_cum [B T, HV] fp32, table int32 [NT, 2], first_chunk int32 [N + 1], ab [B, T, HV, 64] bf16,
    gated [NT, HV] int32); where a CTA holds three or four heads, chunk_local_cumsum.s03 and s15."""
    S15._check(k, beta, CHUNK_SIZE)
    B, T, H, K = k.shape
    HV = beta.shape[2]
    device = k.device
    num_rows = num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE)  # the chunk table's rows, on the host
    R = S14.BY_GRID.BY_FORWARD.heads_per_cta(H, HV, num_rows, autocp.num_sms(device))
    if not B * T or not num_rows:
        return S14.cumsum_and_solve(k, beta, g, cu_seqlens)  # nothing to solve
    if R > S14.PROLOGUE.TENSOR_CORE_MAX_HEADS:
        g_cum, table, first_chunk = S14.PROLOGUE.CUMSUM.cumsum_and_table(g, cu_seqlens)
        ab, gated = S15.solve(k, beta, g_cum.view(B, T, HV), cu_seqlens, heads_per_cta=R)
        return g_cum, table, first_chunk, ab, gated
    bounds = seq_bounds(cu_seqlens, B, T, device)
    g_cum = torch.empty(B * T, HV, device=device, dtype=torch.float32)
    table = torch.zeros(num_rows, 2, device=device, dtype=torch.int32)
    first_chunk = torch.zeros(bounds.shape[0], device=device, dtype=torch.int32)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, device=device, dtype=torch.bfloat16)
    gated = torch.empty(num_rows, HV, device=device, dtype=torch.int32)
    with nvtx_range("gate_free_solve.s16"):
        # g_cum, table, first_chunk, Ab, gated <- this kernel at s14's CTAs an SM
        _compiled(H, HV, R)(k.to(torch.bfloat16).contiguous().view(B * T, H, K),
                            beta.to(torch.float32).contiguous().view(B * T, HV),
                            g.to(torch.float32).contiguous().view(B * T, HV),
                            bounds, g_cum, table, first_chunk, ab, gated)
    return g_cum, table, first_chunk, ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16. The op has no gate: with
    g = 0 the cumsum is 0 and the solve's Ab is the gate-free one."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s16: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    return cumsum_and_solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[3]
