"""gate_free_solve, stage 15: the library's solve (s06's, three or four value heads a CTA) with the
block levels of phase B on the tensor cores, warp by warp (mma.sync, tf32).

What changed from s06 (as promoted in ``flashqla.fwd.gate_free_solve_kernel``): phase B of an
unflagged head. Phase A (the four 16 x 16 diagonal inverses X_jj, fp32 forward substitution) and
every flagged head stay s06's. For head r a warp walks block column j down as before (the Latin
square), but each level D = j + d is two warp-wide products of 16 x 16 blocks, held transposed so
that one product's output fragment is the next one's input fragment without a shuffle:

    t^T       <- sum_{e < d} X_{j+e, j}^T (K K^T)_{D, j+e}^T diag(beta_D)   (d products, mma.sync)
    X_{D,j}^T <- -t^T X_DD^T                                                (one product)

An m16n8k8 product's accumulator holds columns (2 t, 2 t + 1) of its rows in a lane's quad, where
its A operand wants columns (t, t + 4): read as A, the accumulator's columns are a permutation of
k, and the B operand is loaded with rows permuted the same way (``b0`` at row 2 t, ``b1`` at 2 t +
1), so the sum is unchanged. Operands are rounded to tf32 (nearest; ``tf32``).

Why: s06's time is mostly shared-memory loads. Each lane computes one column of a block product
and reads every K K^T entry it multiplies (16 lanes read the same word): about 2,240 loads a lane
for four heads, about 9,000 warp-wide loads a CTA, which at one a cycle an SM make about 80 of the
98 us Nsight Compute measured on (16, 64) 1x8192 (``results/ncu_gate_free_solve_s06.csv``). An
m16n8k8 fragment is 4 (A) or 2 (B) loads a lane for
128 or 64 products: phase B's loads fall from about 2,000 to about 300 a lane.

Precision: tf32 (rounded to nearest) in the level products, fp32 accumulation; the diagonal
inverses and every flagged head in fp32 as s06.

Measured effect (one H100, commit 69c6bf5; ``profiles/solve_lab.py --kernels`` ->
``results/solve_kernels.csv``: each kernel alone, 20 launches in a CUDA graph, best of five
replays), us:

    problem              heads a CTA    s06      s15
    (16, 64) 1x8192           4         94.8     75.5
    (16, 64) 8x4096           4        388.9    264.8
    (16, 48) 1x32768          3        310.7    236.5
    (8, 24) 28672+4096        3        155.9    126.0
    (8, 32) 1x8192            4         49.1     39.2
    (2, 8) 8x4096             4         48.4     37.8

0.68-0.81x s06's time; Ab within 3.0e-4 relative L2 of s06's. Nsight Compute on (16, 64) 1x8192
(``results/ncu_gate_free_solve_s15.csv``): 78.3 us against s06's 98.1, DRAM 32.8 % of peak (26.2
%), occupancy 23.7 % (23.3 %), 37 KiB of shared memory and 128 registers; the first stalls are
now ``long_scoreboard`` (2.48: K's global loads before K K^T) and ``short_scoreboard`` (2.32:
shared-memory reads). In the forward: gdn_fwd.s42. Its GPU tests passed at ccabfe0 and 597433d
(adversarial inputs against float64, the flagged heads' rows bit for bit s06's; the public
shapes).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla import fwd
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "tl::mma_sync<tl::DataType::kTensorFloat32", "__shfl_xor_sync")

CHUNK_SIZE = fwd.CHUNK_SIZE      # C: tokens per chunk
BLOCK = fwd.SOLVE_BLOCK          # the inverse's blocks: 16 x 16, one m16 tile
HEAD_DIM, THREADS, MIN_CTAS_PER_SM = fwd.HEAD_DIM, fwd.THREADS, fwd.MIN_CTAS_PER_SM  # s06's
GROWTH_LIMIT, LOG2E = fwd.GROWTH_LIMIT, fwd.LOG2E
KKT_STRIDE = fwd.CHUNK_SIZE + 8  # K K^T's rows padded by 8 floats: the B loads (row g, column 2t) at most
                                 # 2-way bank conflicts, 8-way unpadded
DEFAULT_SHAPE = dict(H=16, HV=64)


def tf32(T, x):
    """x rounded to the nearest tf32 (10 mantissa bits; the low 13 bits then cleared)."""
    return T.reinterpret((T.reinterpret(x, "uint32") + T.uint32(0x1000)) & T.uint32(0xFFFFE000), "float32")


def phase_b_on_mma(T, store_wy: bool):
    """Phase B of an unflagged head as a TileLang macro: warp by warp, the block column jb of head r
    walked down on mma.sync (the module doc), then Ab's column block stored (or WY if ``store_wy``)."""
    NB = CHUNK_SIZE // BLOCK

    @T.macro
    def mma(a_frag, a_at, b_frag, acc, acc_at):
        # acc[acc_at : +4] += A (16 x 8, a_frag[a_at : +4]) B (8 x 8, b_frag[0:2]), tf32 in, fp32 out
        T.ptx_mma("float32", "m16n8k8", "row", "col", "tf32", "tf32", "fp32",
                  a_frag.data, a_at, b_frag.data, 0, acc.data, acc_at, T.bool(False))

    def wy_gate(g_s, r, i, l):
        # WY's gate for Ab entry (i, l): exp(g_i - g_l), the exponent clamped at 0 (zeros above the
        # diagonal stay finite)
        return T.exp2(T.min(g_s[r, i] - g_s[r, l], 0)) if store_wy else 1.0

    @T.macro
    def levels_on_mma(kkt_s, beta_s, g_s, xd_s, xa, ta, tc, xc, b, jb, gq, tq, r, n, hv0, bos, ab):
        # xa[8 e + 4 kk ..]: X_{j+e, j}^T as A fragments (m = column c of the block, k = row i in the
        # permuted order: k-step kk, lane quad tq holds rows 8 kk + 2 tq and 8 kk + 2 tq + 1)
        for kk in T.unroll(2):
            for s in T.unroll(4):
                xa[4 * kk + s] = tf32(T, xd_s[r, BLOCK * jb + 8 * kk + 2 * tq + s // 2, gq + 8 * (s % 2)])
        for d in T.unroll(1, NB):
            if jb + d < NB:
                for s in T.unroll(8):
                    tc[s] = 0.0
                # t^T <- sum_{e < d} X_{j+e, j}^T (K K^T)_{D, j+e}^T (n = row i of block D, two n-tiles)
                for e in T.unroll(d):
                    for nn in T.unroll(2):
                        for kk in T.unroll(2):
                            for s in T.unroll(2):
                                b[s] = tf32(T, kkt_s[BLOCK * (jb + d) + 8 * nn + gq, BLOCK * (jb + e) + 8 * kk + 2 * tq + s])
                            mma(xa, 8 * e + 4 * kk, b, tc, 4 * nn)
                # t^T <- t^T diag(beta_D); as A fragments: accumulator (c0, c1, c2, c3) -> (c0, c2, c1, c3)
                for nn in T.unroll(2):
                    for s in T.unroll(4):
                        ta[4 * nn + (s // 2) + 2 * (s % 2)] = tf32(
                            T, tc[4 * nn + s] * beta_s[r, BLOCK * (jb + d) + 8 * nn + 2 * tq + s % 2])
                for s in T.unroll(8):
                    xc[s] = 0.0
                # X_{D, j}^T <- -t^T X_DD^T
                for nn in T.unroll(2):
                    for kk in T.unroll(2):
                        for s in T.unroll(2):
                            b[s] = tf32(T, xd_s[r, BLOCK * (jb + d) + 8 * nn + gq, 8 * kk + 2 * tq + s])
                        mma(ta, 4 * kk, b, xc, 4 * nn)
                for kk in T.unroll(2):
                    for s in T.unroll(4):
                        xa[8 * d + 4 * kk + (s // 2) + 2 * (s % 2)] = tf32(T, -xc[4 * kk + s])
        # Ab[:, col] = X[:, col] beta_col in bf16 from the fragments (rows < n); the block rows
        # above j are zero
        for d in T.unroll(NB):
            if jb + d < NB:
                for kk in T.unroll(2):
                    for s in T.unroll(4):
                        i = BLOCK * (jb + d) + 8 * kk + 2 * tq + s // 2
                        col = BLOCK * jb + gq + 8 * (s % 2)
                        if i < n:
                            ab[bos + i, hv0 + r, col] = xa[8 * d + 4 * kk + s] * beta_s[r, col] * wy_gate(g_s, r, i, col)
        for d in T.unroll(1, NB):
            if jb >= d:
                for kk in T.unroll(2):
                    for s in T.unroll(4):
                        i = BLOCK * (jb - d) + 8 * kk + 2 * tq + s // 2
                        if i < n:
                            ab[bos + i, hv0 + r, BLOCK * jb + gq + 8 * (s % 2)] = 0

    return levels_on_mma


def solve_after_kkt(T, R: int, store_wy: bool):
    """Phases A and B of R value heads once K K^T, beta, log2(e) g_cum and the flags are in shared
    memory, as a TileLang macro: s06's phase A and flagged walk, this stage's walk on mma.sync for
    the other heads (storing WY if ``store_wy``). gate_free_solve.s16 runs it after its prologue."""
    NB = CHUNK_SIZE // BLOCK
    phase_a, phase_b = fwd.solve_phases(T, lambda r, b, half, q, j: (r, BLOCK * b + 8 * half + q, j))
    levels_on_mma = phase_b_on_mma(T, store_wy)

    @T.macro
    def solve_heads(kkt_s, g_s, beta_s, flag_s, xd_s, x_a, x_col, t_col, acc, row, xa, ta, tc, xc, b,
                    any_flag, t, warp, c, half, gq, tq, n, hv0, bos, i_c, ab, gated):
        any_flag[0] = 0
        for r in T.unroll(R):
            any_flag[0] = any_flag[0] | flag_s[r]

        # phase A (s06's): warp w solves X_ww of every head, the heads' substitutions interleaved;
        # a CTA with a flagged head solves its heads one at a time, each with its own A
        if any_flag[0] == 0:
            phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, 0, R, False)
        else:
            for r in T.unroll(R):
                if flag_s[r] == 1:
                    phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, r, 1, True)
                else:
                    phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, r, 1, False)
        T.sync_threads()

        # phase B: for head r warp w walks block column jb down (s06's Latin square)
        for r in T.serial(R):
            jb = T.if_then_else(r % 2 == 0, (warp + 2 * (r // 2)) % NB, NB - 1 - (warp + 2 * (r // 2)) % NB)
            if flag_s[r] == 1:
                # s06's fp32 walk with the gated A; Ab[:, col] = X[:, col] beta_col (it holds the gate)
                col = BLOCK * jb + c
                phase_b(kkt_s, g_s, beta_s, xd_s, x_col, t_col, acc, row, jb, c, half, n, r, True)
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
            else:
                levels_on_mma(kkt_s, beta_s, g_s, xd_s, xa, ta, tc, xc, b, jb, gq, tq, r, n, hv0, bos, ab)
            if t == 0:
                gated[i_c, hv0 + r] = flag_s[r]

    return solve_heads


def gate_free_solve_kernel(H: int, HV: int, heads_per_cta: int, store_wy: bool = False):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA solving ``heads_per_cta``
    value heads of one key head (a divisor of HV / H); any token or chunk count. ``store_wy``
    (gdn_fwd.s36's solve): store WY = Gamma * Ab instead of Ab (a flagged head's Ab holds the gate)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R, NB = CHUNK_SIZE, HEAD_DIM, heads_per_cta, CHUNK_SIZE // BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    solve_heads = solve_after_kkt(T, R, store_wy)

    @T.prim_func
    def gate_free_solve_levels_on_mma(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # read for flagged chunks (and WY)
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab (or WY)
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_chunks, HV // R, threads=THREADS) as (i_c, i_r):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            t = T.get_thread_binding()
            warp = t // 32                                     # phase A: this warp's block column
            c = t % 16                                         # the lane's column within a block
            half = (t // 16) % 2                               # which half of each row sum
            gq = (t % 32) // 4                                 # phase B: the lane's mma group ...
            tq = t % 4                                         # ... and its place in the quad
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_s = T.alloc_shared((C, K), "bfloat16")
            kkt_s = T.alloc_shared((C, KKT_STRIDE), "float32")
            xd_s = T.alloc_shared((R, C, BLOCK), "float32")    # head r, row i: X's diagonal block row i
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_a = T.alloc_local((R * 8,), "float32")           # phase A: X_jj[8 half + q, c] of head u at 8 u + q
            x_col = T.alloc_local((NB * 8,), "float32")        # flagged phase B: X_{j+l, j}[8 half + q, c] at 8 l + q
            t_col = T.alloc_local((BLOCK,), "float32")         # ... a level's row sums, both halves added
            acc = T.alloc_local((2 * R,), "float32")           # two partial sums of a row, per head
            row = T.alloc_local((R,), "float32")
            xa = T.alloc_local((NB * 8,), "float32")           # mma phase B: X_{j+e, j}^T, A fragments
            ta = T.alloc_local((8,), "float32")                # ... t^T as A fragments
            tc = T.alloc_local((8,), "float32")                # ... t^T, two accumulators
            xc = T.alloc_local((8,), "float32")                # ... -X_{D, j}^T, two accumulators
            b = T.alloc_local((2,), "float32")                 # ... a B fragment
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
            for i, j in T.Parallel(C, C):
                kkt_s[i, j] = kkt_f[i, j]
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1
            T.sync_threads()
            # phase A, then phase B head by head
            solve_heads(kkt_s, g_s, beta_s, flag_s, xd_s, x_a, x_col, t_col, acc, row, xa, ta, tc, xc, b,
                        any_flag, t, warp, c, half, gq, tq, n, hv0, bos, i_c, ab, gated)

    return gate_free_solve_levels_on_mma


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int, store_wy: bool = False):
    return compile_hopper(gate_free_solve_kernel(H, HV, heads_per_cta, store_wy))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    H, HV = DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]
    return _compiled(H, HV, fwd.cta_heads(H, HV)).get_kernel_source()


def _check(k, beta, chunk_size):
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s15: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K, HV = k.shape[2], k.shape[3], beta.shape[2]
    if K != HEAD_DIM:
        raise ValueError(f"gate_free_solve.s15: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if HV % H:
        raise ValueError(f"gate_free_solve.s15: `beta` must have a number of value heads HV that is "
                         f"a multiple of the H = {H} heads of k; got HV = {HV}")


def solve(k, beta, g_cum, cu_seqlens=None, heads_per_cta=None):
    """s06's ``solve`` on this kernel: k [B, T, H, K] bf16, beta, g_cum [B, T, HV] fp32 -> (ab [B, T,
    HV, 64] bf16, gated [NT, HV] int32): ab holds Ab for chunks with gated = 0 and Ai diag(beta)
    (the gate kept) for chunks with gated = 1. ``heads_per_cta`` defaults to ``cta_heads``."""
    _check(k, beta, CHUNK_SIZE)
    B, T, H, K = k.shape
    HV = beta.shape[2]
    device = k.device
    fp32 = dict(device=device, dtype=torch.float32)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, device=device, dtype=torch.bfloat16)
    gated = torch.empty(bounds.shape[0], HV, device=device, dtype=torch.int32)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(H, HV, heads_per_cta or fwd.cta_heads(H, HV))
        with nvtx_range("gate_free_solve.s15"):
            kernel(k.to(device=device, dtype=torch.bfloat16).contiguous().view(B * T, H, K),
                   beta.to(**fp32).contiguous().view(B * T, HV), g_cum.to(**fp32).contiguous().view(B * T, HV),
                   bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (see the module doc).
    The op has no gate: with g_cum = 0 the fallback solves the same matrix."""
    _check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
