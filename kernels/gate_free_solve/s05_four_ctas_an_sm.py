"""gate_free_solve, stage 05: s02 with launch bounds for four CTAs an SM.

What it computes: s02's (``flashqla.reference.gate_free_solve``), operation for operation: per
chunk of C = 64 tokens and value head, Ab = A_r diag(beta), A_r = (I + StrictLower(diag(beta)
K K^T))^-1, in bf16 per token ([B, T, HV, 64]); a (chunk, value head) with some beta ||k||^2 > 2
solves the gated matrix and is flagged ``gated``: s01's precision policy, unchanged.

What changed from s02: one line, ``T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)``, which TileLang
emits as ``__launch_bounds__(128, 4)``. s02 compiled with ``(128, 1)``: ptxas gave it 144
registers a thread, so three CTAs an SM by registers (65,536 / (144 x 128) = 3.6), while its
shared memory (45.5 KiB at (16, 32), 47 at (16, 64)) would allow four. Nsight Compute on (16, 64) 1 x 8192
(``profiles/results/ncu_gate_free_solve_s02.csv``, one H200): 17.8 % achieved occupancy, top stall
``barrier`` (2.35 warps an issue): each head's phases are separated by CTA barriers, and three
CTAs an SM are too few to cover them. With the bound, ptxas keeps the same code in 128 registers
(108 at (16, 16)), no stack frame, no spills (nvcc 13.0, sm_90a; (16, 16), (16, 32), (16, 48),
(16, 64)): four CTAs, 16 warps an SM.

Not five: at ``(128, 5)`` ptxas fits 96 registers, but the shared memory (K, K K^T twice, the
output staging) allows only four. A draft that rebuilt K K^T after a flagged head instead of
keeping a copy was no smaller (K must then stay live: 47 KiB at (16, 64)) and spilled at 96
registers; five would need the output staging gone too. gate_free_solve.s04 got five by solving one value head a CTA, and paid
for recomputing K K^T per value head (1.10-1.16x s02's time with four value heads a key head).

Measured effect (``profiles/solve_lab.py`` -> ``profiles/results/solve.csv``: each solve alone,
CUDA-graph replay, 4 x H100, commit b31b755; its GPU tests passed there, bit for bit s02's Ab and
flags): 0.83-0.91x s02's time with two to four value heads a key head ((16, 64) 1 x 32768: 0.441
against 0.519 ms; (4, 16): 0.116 against 0.140), 1.00x with one ((16, 16), where ptxas already
fit s02 in 108 registers). Against FlashQLA's kkt_solve in the same run: 0.98-1.04x its time with
four value heads a key head, 0.89-0.92 with three, 0.83-0.84 with two, 0.77 with one; at 26-43 %
of the copy roof. With one value head a key head s04 is the fastest solve (0.87x s02), still
0.77x FlashQLA's speed there.

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

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
BLOCK = 16            # the inverse's blocks: 16 x 16, one block column per warp
HEAD_DIM = 128        # K
THREADS = 128         # one warpgroup: four warps, one per block column
MIN_CTAS_PER_SM = 4   # __launch_bounds__(128, 4): at most 128 registers a thread (ptxas: 128, no
                      # spills; s02: 144, three CTAs an SM); shared memory (45.5-47 KiB) allows four
GROWTH_LIMIT = 2.0    # beta ||k||^2 <= 2  <=>  ||I - beta k k^T|| <= 1: A_r cannot grow
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)


def gate_free_solve_kernel(H: int, HV: int, heads_per_cta: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA solving ``heads_per_cta``
    value heads of one key head (a divisor of HV / H); any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R, NB = CHUNK_SIZE, HEAD_DIM, heads_per_cta, CHUNK_SIZE // BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gate_free_solve_blocked(
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
            jb = t // 32                                       # this warp's block column
            c = t % 16                                         # its column within the block
            half = (t // 16) % 2                               # which half of each row sum
            col = BLOCK * jb + c                               # the lane's column of X
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_s = T.alloc_shared((C, K), "bfloat16")
            kkt_s = T.alloc_shared((C, C), "float32")
            a_s = T.alloc_shared((C, C), "float32")
            xd_s = T.alloc_shared((C, BLOCK), "float32")       # row i: X's diagonal block row i
            out_s = T.alloc_shared((C, C), "bfloat16")
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_col = T.alloc_local((NB * 8,), "float32")        # X_{j+l, j}[8 half + q, c] at 8 l + q
            t_col = T.alloc_local((BLOCK,), "float32")         # a level's row sums, both halves added
            acc = T.alloc_local((2,), "float32")               # two partial sums of a row
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
            # K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), kept for every value head;
            # a_s, the solve's source, holds it too, or K K^T * Gamma while a flagged head solves
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            T.copy(kkt_f, kkt_s)
            T.copy(kkt_f, a_s)
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1

            for r in T.serial(R):
                # A = diag(beta) StrictLower(a_s): a_s is K K^T (no per-head pass: beta scales the
                # row sums below, and every sum meets only x_l with l < i, the others still 0),
                # or for a flagged head K K^T * Gamma below the diagonal (exponents g_i - g_j <= 0;
                # zero above it, where exp2 would overflow); beta = 0 on rows >= n
                if flag_s[r] == 1:
                    for i, j in T.Parallel(C, C):
                        a_s[i, j] = T.if_then_else((j < i) & (i < n), kkt_s[i, j] * T.exp2(g_s[r, i] - g_s[r, j]), 0)

                # phase A: X_jj <- (I + A_jj)^-1 e_c by forward substitution over the block's 16
                # rows, x_i = [i == c] - beta_i sum_{l < i} a_il x_l (unknown x_l are still 0);
                # half h sums l in 8h .. 8h + 7, one shuffle adds the other half
                for s in T.unroll(NB * 8):
                    x_col[s] = 0.0
                for i in T.unroll(BLOCK):
                    acc[0] = 0.0
                    acc[1] = 0.0
                    for q in T.unroll(8):
                        acc[q % 2] = acc[q % 2] + a_s[BLOCK * jb + i, BLOCK * jb + 8 * half + q] * x_col[q]
                    row[0] = acc[0] + acc[1]
                    row[0] = T.if_then_else(i == c, 1.0, 0.0) - beta_s[r, BLOCK * jb + i] * (
                        row[0] + T.shfl_xor(row[0], 16))
                    if i // 8 == half:
                        x_col[i % 8] = row[0]
                for q in T.unroll(8):
                    xd_s[BLOCK * jb + 8 * half + q, c] = x_col[q]
                T.sync_threads()

                # phase B, level d: block row i = j + d of the warp's block column j,
                # t <- diag(beta) sum_{e < d} a_{i, j+e} X_{j+e, j}[:, c] (16 independent row sums), then
                # X_ij[:, c] <- -X_ii t (X_ii from phase A, this half's 8 rows)
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
                                acc[s % 2] = acc[s % 2] + xd_s[BLOCK * (jb + d) + 8 * half + q, s] * t_col[s]
                            x_col[8 * d + q] = -(acc[0] + acc[1])

                # Ab[:, col] <- X[:, col] beta_col (bf16): block row j + d holds X_{j+d, j} (at
                # x_col[8 d ..]); the block rows above the diagonal block are zero
                for d in T.unroll(NB):
                    if jb + d < NB:
                        for q in T.unroll(8):
                            out_s[BLOCK * (jb + d) + 8 * half + q, col] = x_col[8 * d + q] * beta_s[r, col]
                for d in T.unroll(1, NB):
                    if jb >= d:
                        for q in T.unroll(8):
                            out_s[BLOCK * (jb - d) + 8 * half + q, col] = 0
                # ab[bos : bos + n, hv0 + r] <- Ab, whole 128-byte rows
                for i, j in T.Parallel(C, C):
                    if i < n:
                        ab[bos + i, hv0 + r, j] = out_s[i, j]
                if t == 0:
                    gated[i_c, hv0 + r] = flag_s[r]
                # a_s <- K K^T again after a flagged head
                if flag_s[r] == 1:
                    T.copy(kkt_s, a_s)

    return gate_free_solve_blocked


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int):
    return compile_hopper(gate_free_solve_kernel(H, HV, heads_per_cta))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    H, HV = DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]
    return _compiled(H, HV, HV // H).get_kernel_source()


def _check(k, beta, chunk_size):
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s05: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K, HV = k.shape[2], k.shape[3], beta.shape[2]
    if K != HEAD_DIM:
        raise ValueError(f"gate_free_solve.s05: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if HV % H:
        raise ValueError(f"gate_free_solve.s05: `beta` must have a number of value heads HV that is "
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
        with nvtx_range("gate_free_solve.s05"):
            kernel(k_flat, beta_flat, g_flat, bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (see the module doc).
    The op has no gate: with g_cum = 0 the fallback solves the same matrix."""
    _check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
