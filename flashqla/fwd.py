"""The promoted forward: the TileLang kernels that ``flashqla.chunk_gated_delta_rule`` runs on SM90.

Promotion copies a stage's kernel, unchanged, from the workbench (``kernels/``, which is not
installed) into the library; ``tests/test_promoted.py`` asserts that every kernel here builds the
same TileLang program as the stage it came from, and is compiled with the same options, so the
library runs exactly what the stage tests and the benchmark checked. The fastest correct pieces
(``profiles/results/gdn_fwd.csv``, ``profiles/results/autocp.csv``, and the measurements in each
stage's docstring; H200):

    chunk_local_cumsum.s01   g                      -> g_cum      one CTA per chunk, all heads
    chunk_fwd_intra.s01      k, v, g_cum, beta      -> w, u       K K^T, (I + A)^-1 and the WY
                                                                  products in one kernel: A and Ai
                                                                  stay on chip (s03 ran them as
                                                                  three kernels)
    gdn_fwd.s06 (warm-up)    k, w, u, g_cum, windows -> Z, M      AutoCP: long sequences with few
                                                                  heads are cut into segments whose
                                                                  chains run in parallel; this
                                                                  kernel gives the segments' initial
                                                                  states. 2.4-2.9x s03 on (2, 8)
                                                                  from 32768 tokens under a CUDA
                                                                  graph (measured with s03's kernel
                                                                  as the chain)
    gdn_fwd.s05 (fused)      q, k, w, u, g_cum, h0  -> o, final state: the state chain and the
                                                       output in one warp-specialized kernel
                                                       (chain, scores, output and producer
                                                       warpgroups, mbarrier hand-offs):
                                                       1.52-1.66x s03's fused kernel

``forward`` builds the varlen maps (``flashqla.varlen``) and AutoCP's plan (``flashqla.autocp``:
the decision from host integers, the segment table on the device), with no host synchronization.
Without a split the fused kernel walks whole sequences. With one, the warm-up kernel runs the
chain over each segment's warm-up window (Z; and M, the previous segment's transition, for heads
whose window is the whole previous segment), a batched matmul per segment chains
h_j = Z_j + M_j h_{j-1}, and the fused kernel walks all segments at once, each from its h_j. Each
kernel launch is in an NVTX range ``fwd.<kernel>``.
"""

import functools

import torch

from flashqla import autocp
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
HEAD_DIM = 128        # K = V: the only head dims the kernels take
THREADS = 128         # one warpgroup (chunk_fwd_intra; the warm-up kernel, TileLang adds a producer)
BLOCK_V = 64          # BV: value columns of the state owned by one CTA of the fused kernel
BLOCK = 64            # state columns per CTA of the warm-up kernel
LOG2E = 1.4426950408889634
# ---- the fused kernel's warp roles, one warpgroup each (128 threads: the unit of wgmma and of
# setmaxnreg), in thread order, as one if / elif chain (separate `with T.ws(i)` blocks deadlock)
WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP   # [0, 128)   chain: owns S; V~ = U - W S, S <- exp(g_C) S + K^T ..
SCORES_END = 2 * WARPGROUP  # [128, 256) scores: P = scale (Q K^T * Gamma), needs no state
OUTPUT_END = 3 * WARPGROUP  # [256, 384) output: O = scale diag(exp g) Q S_c + P V~_c
H_O_THREADS = 4 * WARPGROUP  # [384, 512) producer: TMA loads of q, k, w, u; the gates (s05's THREADS)
# ---- its register budgets (setmaxnreg, per thread), within the launch's pool of 4 x 128
REGS_PRODUCER = 24    # addresses (about 12 used)
REGS_CHAIN = 216      # S (64 fp32 a thread), V~ and its decayed copy (32 + 32): about 143 used
REGS_SCORES = 136     # P (32): about 94 used
REGS_OUTPUT = 136     # O (32): about 56 used
assert REGS_PRODUCER + REGS_CHAIN + REGS_SCORES + REGS_OUTPUT <= 4 * 128
# ---- its buffering
NUM_STAGES = 2        # tile stages: the producer fills chunk c + 2 once chunk c is consumed
NUM_HANDOFF = 2       # slots for S_c, V~_c and P_c: chunk c + 1's are written while the output
                      # warpgroup still reads chunk c's


# ---- promoted from kernels/chunk_local_cumsum/s01_all_heads_per_cta.py
def chunk_local_cumsum_kernel(HV: int):
    """The T.prim_func for HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT = CHUNK_SIZE
    threads = 32 * -(-HV // 32)  # one thread per head, whole warps
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def chunk_local_cumsum_fwd(
        g: T.Tensor((num_tokens, HV), "float32"),              # [B*T, HV], sequences packed
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        g_cum: T.Tensor((num_tokens, HV), "float32"),
    ):
        with T.Kernel(num_chunks, threads=threads) as i_c:
            h = T.get_thread_binding()                         # this thread's value head
            bos = chunk_bounds[i_c, 0]
            n = chunk_bounds[i_c, 1] - bos                     # chunk length, 0..64
            x = T.alloc_local((BT,), "float32")
            acc = T.alloc_var("float32")
            if h < HV:
                # x_i <- g[bos + i, h] for the chunk's n rows
                for i in T.unroll(BT):
                    if i < n:
                        x[i] = g[bos + i, h]
                # g_cum[bos + i, h] <- x_0 + ... + x_i
                acc = 0.0
                for i in T.unroll(BT):
                    if i < n:
                        acc = acc + x[i]
                        g_cum[bos + i, h] = acc

    return chunk_local_cumsum_fwd


# ---- promoted from kernels/chunk_fwd_intra/s01_fused.py
def chunk_fwd_intra_kernel(H: int, HV: int):
    """The T.prim_func for H key heads, HV value heads, K = V = 128; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def chunk_fwd_intra_fwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        beta: T.Tensor((num_tokens, HV), "float32"),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        with T.Kernel(num_chunks, HV, threads=THREADS) as (i_c, i_hv):
            t = T.get_thread_binding()
            c = 16 * (t // 32) + t % 16                        # warp w solves columns 16w..16w+15
            h = (t // 16) % 2                                  # which half of each row sum
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            beta_shared = T.alloc_shared((BT,), "float32")
            A_shared = T.alloc_shared((BT, BT), "float32")
            Aik_shared = T.alloc_shared((BT, BT), "bfloat16")  # Ai diag(beta exp(g_cum))
            Aiv_shared = T.alloc_shared((BT, BT), "bfloat16")  # Ai diag(beta)
            out_shared = T.alloc_shared((BT, K), "bfloat16")
            A_fragment = T.alloc_fragment((BT, BT), "float32")
            acc_fragment = T.alloc_fragment((BT, K), "float32")
            y = T.alloc_local((BT // 2,), "float32")          # this half's x_j of column c
            acc = T.alloc_local((4,), "float32")               # four partial sums of a row
            part = T.alloc_local((1,), "float32")
            # swizzled: the accumulator's 8-row stmatrix stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            # K <- k[bos : bos + n], V <- v[bos : bos + n]; zeros below row n
            for i, d in T.Parallel(BT, K):
                k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for i, d in T.Parallel(BT, V):
                v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
            # g <- log2(e) g_cum (so that exp(x) = exp2(log2(e) x)), beta <- beta; zeros below row n
            for i in T.Parallel(BT):
                g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                beta_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)

            # A <- K K^T   (64 x 64 x K, bf16 in, fp32 accumulate: wgmma)
            T.gemm(k_shared, k_shared, A_fragment, transpose_B=True, clear_accum=True)

            # A <- StrictLower(diag(beta) A * Gamma) into shared fp32, rows of the chunk only (the
            # exponent is taken only where j < i < n, where g_cum_i - g_cum_j <= 0: no overflow);
            # rows >= n are zero, identity rows of I + A that never feed rows < n
            for i, j in T.Parallel(BT, BT):
                A_shared[i, j] = T.if_then_else(
                    (j < i) & (i < n),
                    beta_shared[i] * A_fragment[i, j] * T.exp2(g_shared[i] - g_shared[j]), 0)

            # x <- (I + A)^-1 e_c: x_i = [i == c] - sum_{j < i} A_ij x_j, rows from the warp's
            # first column on (x_j = 0 above it). Two lanes (l, l ^ 16) share column c: half h keeps
            # the x_j of the j-blocks of 4 with (j / 4) mod 2 = h (y[s] = x_j, j = 8 (s / 4) + 4 h +
            # s mod 4), sums its half of each row in four chains (one broadcast LDS.128 a block),
            # and one shuffle adds the other half; x_j not yet found are 0, so whole blocks are summed
            for s in T.unroll(BT // 2):
                y[s] = 0.0
            for warp, first in enumerate((0, 16, 32, 48)):
                if t // 32 == warp:
                    for i in T.unroll(first, BT):
                        for q in T.unroll(4):
                            acc[q] = 0.0
                        for b in T.unroll(first // 8, BT // 8):
                            if 8 * b < i:
                                for q in T.unroll(4):
                                    acc[q] = acc[q] + A_shared[i, 8 * b + 4 * h + q] * y[4 * b + q]
                        part[0] = (acc[0] + acc[1]) + (acc[2] + acc[3])
                        part[0] = T.if_then_else(i == c, 1.0, 0.0) - (part[0] + T.shfl_xor(part[0], 16))
                        y[4 * (i // 8) + i % 4] = T.if_then_else(h == (i // 4) % 2, part[0],
                                                                 y[4 * (i // 8) + i % 4])
            # Aik[:, c] <- x beta_c exp(g_cum_c), Aiv[:, c] <- x beta_c (bf16), each half its rows
            for s in T.unroll(BT // 2):
                Aik_shared[8 * (s // 4) + 4 * h + s % 4, c] = y[s] * (beta_shared[c] * T.exp2(g_shared[c]))
                Aiv_shared[8 * (s // 4) + 4 * h + s % 4, c] = y[s] * beta_shared[c]
            # the generic-proxy stores above must be visible to the wgmma (async proxy) reads below
            T.fence_proxy_async()

            # w <- (Ai diag(beta exp(g_cum))) K   (64 x 128 x 64, wgmma)
            T.gemm(Aik_shared, k_shared, acc_fragment, clear_accum=True)
            T.copy(acc_fragment, out_shared)
            for i, d in T.Parallel(BT, K):
                if i < n:
                    w[bos + i, i_hv, d] = out_shared[i, d]

            # u <- (Ai diag(beta)) V   (64 x 128 x 64, wgmma)
            T.gemm(Aiv_shared, v_shared, acc_fragment, clear_accum=True)
            T.copy(acc_fragment, out_shared)
            for i, d in T.Parallel(BT, V):
                if i < n:
                    u[bos + i, i_hv, d] = out_shared[i, d]

    return chunk_fwd_intra_fwd


# ---- promoted from kernels/gdn_fwd/s06_autocp.py (AutoCP's phase 1)
def warmup_kernel(H: int, HV: int):
    """The T.prim_func of phase 1 for H key heads and HV value heads; any token or slot count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, V, BV = CHUNK_SIZE, HEAD_DIM, HEAD_DIM, BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def gdn_autocp_warmup(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        win_start: T.Tensor((num_slots, HV), "int32"),         # first token of the window
        win_end: T.Tensor((num_slots,), "int32"),              # the segment's first token
        exact: T.Tensor((num_slots, HV), "int32"),             # 1: M of the window too
        z: T.Tensor((num_slots, HV, K, V), "float32"),
        m: T.Tensor((num_slots, HV, K, K), "float32"),
    ):
        with T.Kernel((V + K) // BV, HV, num_slots, threads=THREADS) as (i_t, i_hv, i_s):
            i_h = i_hv // group
            is_m = i_t >= V // BV                              # a tile of M (else of Z)
            take_m = is_m & (exact[i_s, i_hv] != 0)
            c0 = (i_t % (V // BV)) * BV                        # its columns (K = V)
            bos = win_start[i_s, i_hv]
            eos = T.if_then_else(is_m & (exact[i_s, i_hv] == 0), bos, win_end[i_s])

            k_s = T.alloc_shared((C, K), "bfloat16")
            w_s = T.alloc_shared((C, K), "bfloat16")
            u_s = T.alloc_shared((C, BV), "bfloat16")
            g_s = T.alloc_shared((C,), "float32")
            s_s = T.alloc_shared((K, BV), "bfloat16")          # S in bf16, the wgmma operand
            vd_s = T.alloc_shared((C, BV), "bfloat16")         # diag(exp(g_C - g)) V~
            s_f = T.alloc_fragment((K, BV), "float32")         # the state S, fp32, all along
            vn_f = T.alloc_fragment((C, BV), "float32")
            g_last = T.alloc_local((1,), "float32")

            # S <- columns c0.. of I for M tiles of exact heads, else 0
            for d, j in T.Parallel(K, BV):
                s_f[d, j] = T.if_then_else(take_m & (d == c0 + j), 1.0, 0.0)

            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=2):
                t0 = bos + c * C
                n = T.min(eos - t0, C)                          # real rows of the chunk, 1..64
                # K, W, U <- full 64-row tiles (TMA); K first, as in chunk_h.s01 (g's buffer)
                T.copy(k[t0:t0 + C, i_h, :], k_s)
                T.copy(w[t0:t0 + C, i_hv, :], w_s)
                T.copy(u[t0:t0 + C, i_hv, c0:c0 + BV], u_s)
                # g <- log2(e) g_cum, 0 past the end
                for i in T.Parallel(C):
                    g_s[i] = T.if_then_else(i < n, g_cum[t0 + i, i_hv] * LOG2E, 0)
                T.copy(s_f, s_s)
                # V~ <- U - W S (U read as 0 for M: v = 0)
                T.gemm(w_s, s_s, vn_f, clear_accum=True)
                # V_d <- diag(exp(g_C - g)) V~, rows >= n zero
                g_last[0] = g_s[n - 1]
                for i, j in T.Parallel(C, BV):
                    vd_s[i, j] = T.if_then_else(
                        i < n,
                        T.if_then_else(is_m, -vn_f[i, j], u_s[i, j] - vn_f[i, j])
                        * T.exp2(g_last[0] - g_s[i]), 0)
                # S <- exp(g_C) S + K^T V_d
                for d, j in T.Parallel(K, BV):
                    s_f[d, j] = s_f[d, j] * T.exp2(g_last[0])
                T.gemm(k_s, vd_s, s_f, transpose_A=True)

            # Z or M tile <- S
            if is_m:
                T.copy(s_f, m[i_s, i_hv, :, c0:c0 + BV])
            if i_t < V // BV:
                T.copy(s_f, z[i_s, i_hv, :, c0:c0 + BV])

    return gdn_autocp_warmup


# ---- promoted from kernels/gdn_fwd/s05_warp_specialized.py (THREADS renamed H_O_THREADS)
def fused_h_o_kernel(H: int, HV: int, K: int, V: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V; any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C, BV = CHUNK_SIZE, BLOCK_V
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")

    @T.prim_func
    def gdn_fused_ws(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # sequence starts, then the total
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
    ):
        with T.Kernel(V // BV, HV, num_seqs, threads=H_O_THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            v0 = i_v * BV
            num_chunks = T.ceildiv(eos - bos, C)

            # tile stages (producer -> consumers); g holds log2(e) g_cum
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores, output
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain, scores
            w_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain
            u_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # chain
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # all three
            # hand-off slots: S_c (bf16) and V~_c from the chain, P_c from the scores warpgroup
            h_s = T.alloc_shared((NUM_HANDOFF, K, BV), "bfloat16")
            vn_s = T.alloc_shared((NUM_HANDOFF, C, BV), "bfloat16")
            p_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            # chain only: diag(exp(g_C - g)) V~
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            # registers of the chain, scores and output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            vn_f = T.alloc_fragment((C, BV), "float32")
            vd_f = T.alloc_fragment((C, BV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            # u_s is read in the accumulator layout (8 rows of 128 bytes per warp access): swizzle it
            T.annotate_layout({u_s: tilelang.layout.make_swizzled_layout(u_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)      # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_state_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # chain -> output
            bar_state_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # output -> chain
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)   # scores -> output
            bar_scores_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # output -> scores

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
                # S <- h0 (this CTA's BV columns of it)
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
                for c in T.serial(num_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    n = T.min(eos - bos - c * C, C)                # real rows of this chunk, 1..64
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_state_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # S_c (fp32 registers) -> bf16 in slot b: the operand of W S here and of Q S
                    # in the output warpgroup
                    T.copy(h_f, h_s[b, :, :])
                    # ---- chain math (s03's w, u form)
                    # V~ <- U - W S, zero rows >= n (they then add nothing to the state);
                    # V_d <- diag(exp(g_C - g)) V~, the decayed copy the state update reads
                    T.gemm(w_s[s, :, :], h_s[b, :, :], vn_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = T.if_then_else(i < n, u_s[s, i, j] - vn_f[i, j], 0)
                        vd_f[i, j] = vn_f[i, j] * T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.copy(vd_f, vd_s)
                    # ---- end of the chain math
                    # S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~, issued without waiting ...
                    for i, j in T.Parallel(K, BV):
                        h_f[i, j] = h_f[i, j] * T.exp2(g_s[s, C - 1])
                    T.wgmma_gemm(k_s[s, :, :], vd_s, h_f, transpose_A=True)
                    # ... while V~_c goes to slot b and S_c, V~_c are handed to the output
                    # warpgroup (generic-proxy stores that its wgmma reads: fence, then arrive)
                    T.copy(vn_f, vn_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_state_ready[b])
                    T.wait_wgmma(0)
                    T.barrier_arrive(bar_tiles_empty[s])
                T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

            elif tx >= CHAIN_END and tx < SCORES_END:  # ---- the scores warpgroup
                T.set_max_nreg(REGS_SCORES, 1)
                for c in T.serial(num_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_scores_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal; the exponent
                    # is clamped at 0 so that the masked upper triangle stays finite (no branch)
                    T.gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        p_f[i, j] = scale * p_f[i, j] * T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                        p_f[i, j] = T.if_then_else(j <= i, p_f[i, j], 0)
                    T.barrier_arrive(bar_tiles_empty[s])
                    T.copy(p_f, p_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_scores_ready[b])

            elif tx >= SCORES_END and tx < OUTPUT_END:  # ---- the output warpgroup
                T.set_max_nreg(REGS_OUTPUT, 1)
                for c in T.serial(num_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    t0 = bos + c * C
                    n = T.min(eos - t0, C)
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_state_ready[b], (c // NUM_HANDOFF) % 2)
                    # O <- scale diag(exp(g)) Q S_c; the tile stage is then no longer needed
                    T.gemm(q_s[s, :, :], h_s[b, :, :], o_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[s, i]))
                    T.barrier_arrive(bar_tiles_empty[s])
                    # O <- O + P_c V~_c
                    T.barrier_wait(bar_scores_ready[b], (c // NUM_HANDOFF) % 2)
                    T.gemm(p_s[b, :, :], vn_s[b, :, :], o_f)
                    T.barrier_arrive(bar_state_free[b])
                    T.barrier_arrive(bar_scores_free[b])
                    # o[t0 : t0 + n] <- O, the chunk's own rows only, straight from the registers
                    for i, j in T.Parallel(C, BV):
                        if i < n:
                            o[t0 + i, i_hv, v0 + j] = o_f[i, j]

            elif tx >= OUTPUT_END:  # ---- the producer warpgroup
                T.set_max_nreg(REGS_PRODUCER, 0)
                for c in T.serial(num_chunks):
                    s = c % NUM_STAGES
                    t0 = bos + c * C
                    T.barrier_wait(bar_tiles_empty[s], (c // NUM_STAGES) % 2 ^ 1)
                    # full 64-row boxes; rows past the sequence end are masked by the consumers
                    T.tma_copy(q[t0:t0 + C, i_h, :], q_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(k[t0:t0 + C, i_h, :], k_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(w[t0:t0 + C, i_hv, :], w_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(u[t0:t0 + C, i_hv, v0:v0 + BV], u_s[s, :, :], barrier=bar_tiles_full[s])
                    # g <- log2(e) g_cum, rows past the end padded with the last real row, so every
                    # exponent below (g_i - g_j with i >= j, g_C - g_i) is <= 0
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_ws


# compile options beyond the target, as the stages use them. The fused kernel: no shared-memory
# reuse (TileLang plans it as if the role branches ran one after another), fast math (exp2 is one
# ex2.approx, no branch)
PASS_CONFIGS = {fused_h_o_kernel: {"tl.disable_shared_memory_reuse": True, "tl.enable_fast_math": True}}


@functools.cache
def _compiled(builder, *shape):
    return compile_hopper(builder(*shape), PASS_CONFIGS.get(builder))


def forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp=None):
    """Checked API inputs (bf16 q, k, v; K = V = 128) -> (o [B, T, HV, V] bf16, final state or None).

    ``cp``: AutoCP's split (``flashqla.autocp.segment_chunks``' ``force``): None decides, False
    never splits, True splits by the rule, an int is the segment length in chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k = (x.contiguous().view(B * T, H, K) for x in (q, k))
    v = v.contiguous().view(B * T, HV, V)
    g, beta = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (g, beta))
    seqs = seq_bounds(cu_seqlens, B, T, device)
    N = seqs.shape[0] - 1
    bf16, fp32 = dict(dtype=torch.bfloat16, device=device), dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(torch.float32).contiguous())
    o = torch.empty(B * T, HV, V, **bf16)
    if B * T == 0:
        return o.view(B, T, HV, V), (h0.clone() if output_final_state else None)

    chunks, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    g_cum = torch.empty(B * T, HV, **fp32)
    w, u = torch.empty(B * T, HV, K, **bf16), torch.empty(B * T, HV, V, **bf16)
    with nvtx_range("fwd.chunk_local_cumsum"):
        _compiled(chunk_local_cumsum_kernel, HV)(g, chunks, g_cum)
    with nvtx_range("fwd.chunk_fwd_intra"):
        _compiled(chunk_fwd_intra_kernel, H, HV)(k, v, g_cum, beta, chunks, w, u)

    p = autocp.plan(cu_seqlens, B, T, HV, autocp.num_sms(device), V // BLOCK_V, device, force=cp)
    if p is not None:  # AutoCP: the fused kernel walks segments, each from its own initial state
        J = p.max_segments
        # phase 1: Z (and M for exact heads) of every slot's warm-up window
        win_start, exact, _ = autocp.warmup(p, g_cum, autocp.bound_violations(
            k.view(B, T, H, K), g.view(B, T, HV), beta.view(B, T, HV)))
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        with nvtx_range("fwd.autocp_warmup"):
            _compiled(warmup_kernel, H, HV)(k, w, u, g_cum, win_start, p.slot_start, exact, z, m)
        # phase 2: h_j = Z_j + M_j h_{j-1}, slot j * N + n, all (sequence, head) pairs per step
        hs = torch.empty(J, N * HV, K, V, **fp32)
        hs[0].copy_(h0.view(N * HV, K, V))
        zs, ms = z.view(J, N * HV, K, V), m.view(J, N * HV, K, K)
        for j in range(1, J):
            torch.baddbmm(zs[j], ms[j], hs[j - 1], out=hs[j])
        seqs, h0 = p.bounds, hs.view(J * N, HV, K, V).index_select(0, p.slot_of_segment)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("fwd.chunk_h_o"):
        _compiled(fused_h_o_kernel, H, HV, K, V)(q, k, w, u, g_cum, h0, seqs, scale, o, ht)
    if p is not None and output_final_state:
        ht = ht.index_select(0, p.last_segment)  # the state a sequence's last segment leaves
    return o.view(B, T, HV, V), (ht if output_final_state else None)
