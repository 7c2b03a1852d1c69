"""gate_free_solve, stage 04: s02's blocked inverse, one value head per CTA.

What it computes: s02's (``flashqla.reference.gate_free_solve``): per chunk of C = 64 tokens and
value head, Ab = A_r diag(beta), A_r = (I + StrictLower(diag(beta) K K^T))^-1, in bf16 per token
([B, T, HV, 64]); a (chunk, value head) with some beta ||k||^2 > 2 solves the gated matrix and is
flagged ``gated``: s01's precision policy, unchanged.

What changed from s02: the parallel decomposition, nothing else. s02 runs one CTA per (chunk, key
head) and loops over the key head's HV / H value heads, computing K K^T once and keeping it in a
second 64 x 64 fp32 buffer (restored into the solve's after a flagged head). Nsight Compute on
(16, 64) 1 x 8192 (one H200, ``profiles/results/ncu_gate_free_solve_s02.csv``): 129 us, 144
registers a thread at 128 threads, so three CTAs an SM (17.8 % achieved occupancy), 2,064 CTAs of
four value heads each, top stall ``barrier`` (2.35 warps a issued instruction): each head's
phases are separated by barriers, and three CTAs an SM are too few to hide them. FlashQLA's
kkt_solve on the same problem (``ncu_flashqla.csv``): 116 us with one CTA per (chunk, value head),
8,192 CTAs, 94 registers, 17 KB of shared memory, 29.4 % occupancy, recomputing K K^T per value
head on the tensor cores. Here the grid is (chunks, HV), one value head per CTA: each CTA loads
its key head's K (each K tile is now read HV / H times), runs K K^T on wgmma (64 x 64 x 128: eight
instructions; on (16, 64) four times s02's tensor FLOPs) straight into the solve's buffer, and
flags and solves its one head. A flagged head builds K K^T * Gamma in place, so the separate
K K^T copy, its restore and the per-head arrays are gone. The solve itself is s02's code: the
16 x 16 block structure is kept, since it fits the register budget as it is.

The compile (nvcc 13.0, sm_90a, TileLang's flags, (16, 32)): with ``__launch_bounds__(128, 5)``
(MIN_CTAS_PER_SM) 96 registers, no stack frame, no spills; uncapped 108 (four CTAs an SM); with 6
CTAs 80 and a 4-byte spill. Shared memory 20.5 KiB (21,008 bytes dynamic: TileLang lays the
solve's buffer over K once the product is done and the output staging over it after phase B),
against s02's 45.5 KiB, so registers, not shared memory, bound it: five CTAs (20 warps) an SM,
against s02's three (12). 4,320 SASS instructions (s02: 4,408): 2,016 FFMA, 663 LDS (529
LDS.128), 112 SHFL, 8 HGMMA, 8 BAR.SYNC, of which about 340 are the flagged head's branch (32
MUFU.EX2). Not the whole story, noted for the profile: s02 compiled with the same launch bounds
also fits 96 registers without spills, but its 45.5 KiB would still allow only four CTAs an SM.

Precision: s02's, operation for operation (the same fp32 sums in the same order, the same bf16
store); the flagged head's K K^T * Gamma is masked to rows < n as in s02.

Measured effect (one H100, commit 188c42c, each solve alone under CUDA-graph replay, median of
20; 8 x 4096 and 1 x 32768 of every public layout): bitwise the same Ab and flags as s02, and
0.85-1.16x its time, so it is not promoted:

    HV / H = 1, (16, 16)                 0.85-0.86x   (s02 has one head a CTA too, at 45.5 KiB)
    HV / H = 2, (16, 32)                 0.94-0.96x
    HV / H = 3, (8, 24), (16, 48)        1.00-1.01x
    HV / H = 4, (2, 8) (4, 16) (8, 32) (16, 64)   1.10-1.16x   ((16, 64) 8 x 4096: 0.564 against 0.515 ms)

Five CTAs an SM pay only where s02 had no K K^T to share; with four value heads a key head, the
fourfold K K^T products and K reads cost more than the occupancy gains. The solve stays
latency-bound: FlashQLA's kkt_solve, one value head a CTA as here, took 116 us against s02's 129
on (16, 64) 1 x 8192 (Nsight Compute, above), so what it does better is inside the CTA.

GPU tests: the public shapes (``tests/test_stages.py``), the flags and the flagged partial chunks
(``tests/test_reformulation.py``) pass (4 x H100, commit 51893cc).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: K K^T (bf16 in, fp32 accumulate), once per value head; float t_col[16]: a level's 16 row
# sums of the lane's column in fp32 registers; __shfl_xor_sync: the two halves of each row sum meet
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "__shfl_xor_sync")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
BLOCK = 16            # the inverse's blocks: 16 x 16, one block column per warp
HEAD_DIM = 128        # K
THREADS = 128         # one warpgroup: four warps, one per block column
MIN_CTAS_PER_SM = 5   # __launch_bounds__(128, 5): at most 102 registers a thread (ptxas: 96, no
                      # spills; 108 uncapped, 4 CTAs an SM); 6 gives 80 and a spill
GROWTH_LIMIT = 2.0    # beta ||k||^2 <= 2  <=>  ||I - beta k k^T|| <= 1: A_r cannot grow
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)


def gate_free_solve_kernel(H: int, HV: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, one CTA per (chunk, value head);
    any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, NB = CHUNK_SIZE, HEAD_DIM, CHUNK_SIZE // BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gate_free_solve_one_head(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # read only for flagged chunks
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_chunks, HV, threads=THREADS) as (i_c, i_hv):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            t = T.get_thread_binding()
            jb = t // 32                                       # this warp's block column
            c = t % 16                                         # its column within the block
            half = (t // 16) % 2                               # which half of each row sum
            col = BLOCK * jb + c                               # the lane's column of X
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_s = T.alloc_shared((C, K), "bfloat16")
            a_s = T.alloc_shared((C, C), "float32")
            xd_s = T.alloc_shared((C, BLOCK), "float32")       # row i: X's diagonal block row i
            out_s = T.alloc_shared((C, C), "bfloat16")
            beta_s = T.alloc_shared((C,), "float32")
            g_s = T.alloc_shared((C,), "float32")
            flag_s = T.alloc_shared((1,), "int32")
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_col = T.alloc_local((NB * 8,), "float32")        # X_{j+l, j}[8 half + q, c] at 8 l + q
            t_col = T.alloc_local((BLOCK,), "float32")         # a level's row sums, both halves added
            acc = T.alloc_local((2,), "float32")               # two partial sums of a row
            row = T.alloc_local((1,), "float32")

            # flag <- 0 (the barriers before K K^T order this store before the ones below)
            if t == 0:
                flag_s[0] = 0
            # K <- k[bos : bos + n]; beta, log2(e) g_cum of the value head; zeros below row n
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for i in T.Parallel(C):
                beta_s[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
                g_s[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
            # a_s <- K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), for this value head
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            T.copy(kkt_f, a_s)
            # flag <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for i in T.Parallel(C):
                if beta_s[i] * a_s[i, i] > GROWTH_LIMIT:
                    flag_s[0] = 1
            # A = diag(beta) StrictLower(a_s): a_s stays K K^T (beta scales the row sums below, and
            # every sum meets only x_l with l < i, the others still 0), or for a flagged head
            # a_s <- K K^T * Gamma below the diagonal (exponents g_i - g_j <= 0; zero above it,
            # where exp2 would overflow, and on rows >= n)
            if flag_s[0] == 1:
                for i, j in T.Parallel(C, C):
                    a_s[i, j] = T.if_then_else((j < i) & (i < n), a_s[i, j] * T.exp2(g_s[i] - g_s[j]), 0)

            # phase A: X_jj <- (I + A_jj)^-1 e_c by forward substitution over the block's 16 rows,
            # x_i = [i == c] - beta_i sum_{l < i} a_il x_l (unknown x_l are still 0); half h sums
            # l in 8h .. 8h + 7, one shuffle adds the other half
            for s in T.unroll(NB * 8):
                x_col[s] = 0.0
            for i in T.unroll(BLOCK):
                acc[0] = 0.0
                acc[1] = 0.0
                for q in T.unroll(8):
                    acc[q % 2] = acc[q % 2] + a_s[BLOCK * jb + i, BLOCK * jb + 8 * half + q] * x_col[q]
                row[0] = acc[0] + acc[1]
                row[0] = T.if_then_else(i == c, 1.0, 0.0) - beta_s[BLOCK * jb + i] * (
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
                        t_col[i] = beta_s[BLOCK * (jb + d) + i] * (row[0] + T.shfl_xor(row[0], 16))
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
                        out_s[BLOCK * (jb + d) + 8 * half + q, col] = x_col[8 * d + q] * beta_s[col]
            for d in T.unroll(1, NB):
                if jb >= d:
                    for q in T.unroll(8):
                        out_s[BLOCK * (jb - d) + 8 * half + q, col] = 0
            # ab[bos : bos + n, i_hv] <- Ab, whole 128-byte rows
            for i, j in T.Parallel(C, C):
                if i < n:
                    ab[bos + i, i_hv, j] = out_s[i, j]
            if t == 0:
                gated[i_c, i_hv] = flag_s[0]

    return gate_free_solve_one_head


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(gate_free_solve_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]).get_kernel_source()


def _check(k, beta, chunk_size):
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s04: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K, HV = k.shape[2], k.shape[3], beta.shape[2]
    if K != HEAD_DIM:
        raise ValueError(f"gate_free_solve.s04: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if HV % H:
        raise ValueError(f"gate_free_solve.s04: `beta` must have a number of value heads HV that is "
                         f"a multiple of the H = {H} heads of k; got HV = {HV}")


def solve(k, beta, g_cum, cu_seqlens=None):
    """The kernel with its fallback: k [B, T, H, K] bf16, beta, g_cum [B, T, HV] fp32 ->
    (ab [B, T, HV, 64] bf16, gated [NT, HV] int32, one row per row of the chunk table): ab holds
    Ab for chunks with gated = 0 and Ai diag(beta) (the gate kept) for chunks with gated = 1."""
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
        with nvtx_range("gate_free_solve.s04"):
            _compiled(H, HV)(k_flat, beta_flat, g_flat, bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (see the module doc).
    The op has no gate: with g_cum = 0 the fallback solves the same matrix."""
    _check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
