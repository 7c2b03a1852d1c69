"""gate_free_solve, stage 01: the per-chunk inverse with no gate, K K^T shared by a group's value heads.

What it computes (``flashqla.reference.gate_free_solve``): for every chunk of C = 64 tokens and
every value head (value head i reads key head i // (HV / H)),

    Ab = A_r diag(beta),   A_r = (I + StrictLower(diag(beta) K K^T))^-1      [64, 64] per chunk,

stored in bf16 per token like Ai ([B, T, HV, 64], token t holds row t mod 64 of its chunk's Ab).

What changed from chunk_fwd_intra.s01 (the reformulation, notebooks/04_reformulation.py): no
gate. The decayed matrix of chunk_kkt is D L D^-1 (D = diag(exp(g_cum))), so its inverse is
Gamma * A_r elementwise
and the recurrence kernel (gdn_fwd.s04) restores the gate with the 64 x 64 decay tile it builds
anyway for the output; w and u are never formed, so this kernel stores only Ab (128 bytes a token
and value head instead of the 512 of w and u). Without the gate, K K^T and the flags below are the
same for every value head of a key head: one CTA per (chunk, key head) loads K once, runs K K^T
once on wgmma, keeps it in shared memory (fp32), and then, value head by value head, builds
A = StrictLower(diag(beta) K K^T), solves (I + A) X = I by column substitution and stores
X diag(beta). The solve is chunk_fwd_intra.s01's scheme: warp w owns columns 16w..16w+15 from row
16w on, the two lanes l, l ^ 16 of a column each sum half of every row (blocks of 4, one LDS.128)
and meet with one shuffle.

Precision policy (measured on CPU, float64 against fp32 solves, in notebooks/04_reformulation.py):
floating point is blind to the diagonal similarity D . D^-1, so the gate-free solve has exactly
the rounding error of
the gated one, entry for entry relative to Gamma, as long as A_r stays in float32's range. Below
the diagonal A_r_ij = -beta_i k_i^T P_{i-1} ... P_{j+1} k_j with P_l = I - beta_l k_l k_l^T, whose
norm is max(1, |1 - beta_l ||k_l||^2|): where every token of the chunk has beta ||k||^2 <= 2
(GROWTH_LIMIT; always so for L2-normalized keys and beta <= 2) |Ab_ij| <= 2 sqrt(beta_i beta_j),
but past it A_r grows by up to |1 - beta ||k||^2| a token: with ||k||^2 = 8 and beta = 1 it
overflows float32 (inf) within a chunk, while under a decay of exp(-3) a token the gated inverse
and the recurrence itself stay small. So the kernel checks beta_i (K K^T)_ii <= 2 on every row of
the chunk (the diagonal of the product it already has: no extra pass) and, for a (chunk, value
head) that fails, solves the gated matrix StrictLower(diag(beta) K K^T * Gamma) instead, stores
Ai diag(beta), and sets gated[chunk, head] = 1 so that the recurrence uses it as it is. No host
synchronization, no error: a flagged chunk costs 64 x 64 exp2 more. The stage's ``run`` (the op
has no gate) passes zero gates, where both solves are the same matrix.

Measured effect (one H200, CUDA events, median of 20 after 3 warm-up calls, one run of
profiles/reformulation_lab.py timing): this code was timed only inside s04's ``run`` (see there:
the benchmark at commit 9ef1cd8). Its first version wrote the
loop over the four warps as ``for warp in range(4)``, which TileLang turns into a TIR loop: nvcc
then kept x_col in local memory (ptxas: 128-byte stack frame), and the kernel took 3.599 / 0.364 /
1.827 ms on (H, HV) = (16, 64) 1 x 32768, (2, 8) 1 x 32768 and (16, 32) 8 x 4096 tokens, against
1.430 / 0.200 / 0.719 ms for chunk_fwd_intra.s01, which also forms w and u. In that version
sharing K K^T paid: one value head per CTA took 5.042 / 0.650 / 2.584 ms (1.4-1.8x). Looping over a
Python tuple (four copies, every index a constant) gives no stack frame and 137 registers a
thread (ptxas), and the compile takes 12 s instead of 80 s on the CPU machine; the GPU tests
pass.

Taught in: notebooks/04_reformulation.py, as gdn_fwd.s04's solve.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: K K^T (bf16 in, fp32 accumulate); float x_col[32]: a thread's half of its column of the
# inverse in fp32 registers; __shfl_xor_sync: the two halves of each row sum meet
SOURCE_MUST_CONTAIN = ("wgmma", "float x_col[32]", "__shfl_xor_sync")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile; also the solving threads
HEAD_DIM = 128        # K
THREADS = 128         # one warpgroup
GROWTH_LIMIT = 2.0    # beta ||k||^2 <= 2  <=>  ||I - beta k k^T|| <= 1: A_r cannot grow
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)


def gate_free_solve_kernel(H: int, HV: int, heads_per_cta: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA solving ``heads_per_cta``
    value heads of one key head (a divisor of HV / H); any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R = CHUNK_SIZE, HEAD_DIM, heads_per_cta
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gate_free_solve_fwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # read only for flagged chunks
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_chunks, HV // R, threads=THREADS) as (i_c, i_r):
            t = T.get_thread_binding()
            col = 16 * (t // 32) + t % 16                      # warp w solves columns 16w..16w+15
            half = (t // 16) % 2                               # which half of each row sum
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_s = T.alloc_shared((C, K), "bfloat16")
            kkt_s = T.alloc_shared((C, C), "float32")
            a_s = T.alloc_shared((C, C), "float32")
            out_s = T.alloc_shared((C, C), "bfloat16")
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_col = T.alloc_local((C // 2,), "float32")        # this half's x_j of column col
            acc = T.alloc_local((4,), "float32")               # four partial sums of a row
            row = T.alloc_local((1,), "float32")

            # flag_r <- 0 (the barriers before K K^T order these stores before the ones below)
            for r in T.Parallel(R):
                flag_s[r] = 0
            # K <- k[bos : bos + n]; beta, log2(e) g_cum of the R value heads; zeros below row n
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for r, i in T.Parallel(R, C):
                beta_s[r, i] = T.if_then_else(i < n, beta[bos + i, hv0 + r], 0)
                g_s[r, i] = T.if_then_else(i < n, g_cum[bos + i, hv0 + r] * LOG2E, 0)
            # K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), kept for every value head
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            T.copy(kkt_f, kkt_s)
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1

            for r in T.serial(R):
                # A <- StrictLower(diag(beta) K K^T) on rows < n (gate-free), or for a flagged head
                # StrictLower(diag(beta) K K^T * Gamma): exponents g_i - g_j <= 0 for j < i
                if flag_s[r] == 0:
                    for i, j in T.Parallel(C, C):
                        a_s[i, j] = T.if_then_else((j < i) & (i < n), beta_s[r, i] * kkt_s[i, j], 0)
                else:
                    for i, j in T.Parallel(C, C):
                        a_s[i, j] = T.if_then_else(
                            (j < i) & (i < n), beta_s[r, i] * kkt_s[i, j] * T.exp2(g_s[r, i] - g_s[r, j]), 0)

                # x <- (I + A)^-1 e_col by forward substitution: x_i = [i == col] - sum_{j<i} A_ij x_j.
                # x_j = 0 for j < col, so warp w starts at row 16w. Half h keeps the x_j of the
                # blocks of four j with (j / 4) mod 2 = h, x_col[s] = x_j for j = 8 (s / 4) + 4 h +
                # s mod 4; it sums its half of row i over whole blocks (unknown x_j are still 0) in
                # four chains, and one shuffle adds the other half
                for s in T.unroll(C // 2):
                    x_col[s] = 0.0
                for warp in (0, 1, 2, 3):  # a Python loop: four copies, every index a constant
                    if t // 32 == warp:
                        for i in T.unroll(16 * warp, C):
                            for q in T.unroll(4):
                                acc[q] = 0.0
                            for b in T.unroll(2 * warp, C // 8):
                                if 8 * b < i:
                                    for q in T.unroll(4):
                                        acc[q] = acc[q] + a_s[i, 8 * b + 4 * half + q] * x_col[4 * b + q]
                            row[0] = (acc[0] + acc[1]) + (acc[2] + acc[3])
                            row[0] = T.if_then_else(i == col, 1.0, 0.0) - (row[0] + T.shfl_xor(row[0], 16))
                            if (i // 4) % 2 == half:
                                x_col[4 * (i // 8) + i % 4] = row[0]
                # Ab[:, col] <- x beta_col (bf16), each half its own rows
                for s in T.unroll(C // 2):
                    out_s[8 * (s // 4) + 4 * half + s % 4, col] = x_col[s] * beta_s[r, col]
                # ab[bos : bos + n, hv0 + r] <- Ab, whole 128-byte rows
                for i, j in T.Parallel(C, C):
                    if i < n:
                        ab[bos + i, hv0 + r, j] = out_s[i, j]
                if t == 0:
                    gated[i_c, hv0 + r] = flag_s[r]

    return gate_free_solve_fwd


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int):
    return compile_hopper(gate_free_solve_kernel(H, HV, heads_per_cta))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    H, HV = DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]
    return _compiled(H, HV, HV // H).get_kernel_source()


def _check(k, beta, chunk_size):
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K, HV = k.shape[2], k.shape[3], beta.shape[2]
    if K != HEAD_DIM:
        raise ValueError(f"gate_free_solve.s01: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if HV % H:
        raise ValueError(f"gate_free_solve.s01: `beta` must have a number of value heads HV that is "
                         f"a multiple of the H = {H} heads of k; got HV = {HV}")


def solve(k, beta, g_cum, cu_seqlens=None, heads_per_cta=None):
    """The kernel with its fallback: k [B, T, H, K] bf16, beta, g_cum [B, T, HV] fp32 ->
    (ab [B, T, HV, 64] bf16, gated [NT, HV] int32, one row per row of the chunk table): ab holds
    Ab for chunks with gated = 0 and Ai diag(beta) (the gate kept) for chunks with gated = 1.
    ``heads_per_cta`` defaults to HV / H (K K^T once per key head)."""
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
        kernel = _compiled(H, HV, HV // H if heads_per_cta is None else heads_per_cta)
        with nvtx_range("gate_free_solve.s01"):
            kernel(k_flat, beta_flat, g_flat, bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (see the module doc).
    The op has no gate: with g_cum = 0 the fallback solves the same matrix."""
    _check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
