"""gdn_bwd, stage 04: one reverse kernel computes every gradient of a chunk.

What changed from s03: s03's reverse walk role wrote dh and dV~ to HBM, and two chunk-parallel
kernels (chunk_bwd_dqkwg.s01, wy_bwd.s01) read them back with v_new and h, wrote dw and the dk and
dg halves, and a finish kernel summed the halves. Here ONE kernel per (segment row, value head, 64
value columns) walks the row's chunks in reverse with its columns of dS (K x 64) in fp32 registers
and, in the same iteration, computes everything the three did for that chunk: dV~, the dS step,
dq, dk, dw (kept in shared memory, never in HBM), dv, dbeta and dg (reverse-cumsummed inside the
chunk). Why: ../shared/BACKWARD.md 4 and 5 (s04_fused_reverse): s02 and s03 send dh, dV~, dw,
v_new and the dk / dg halves through HBM, about 176 KiB per (chunk, value head), in three launches.

The math is s02's FLA form (Ai = FLA's gated T from s02's prep, w, u; V~ = U - W S; the walk's dS
recurrence; chunk_bwd_dqkwg's and wy_bwd's formulas), fused per chunk, not the gate-free form of
BACKWARD.md 1.3. Why: every formula here exists as GPU-tested TileLang code in flashqla/bwd.py,
the solve needs no `gated` branch (Ai inverts the gated matrix itself, solved in fp32), and the
stage's lesson is the fusion; the gate-free math is a change of its own.

The value columns are split in two (V = 128 = 2 x 64, as the walks split them): dS's registers
halve, and twice the CTAs run a row. dV~, dv and dh0 are column-wise; every V contraction (dP,
dW, dq, dk, <S, dS'>, and through dW and dV~ V^T the whole wy part, which is linear in them) gives
a part per column block, which the finish sums. The price: the wy part's 64 x 64 products and its
D K, D^T K and Ai^T dW run once per block.

Kernels in launch order (C = 64 tokens a chunk, K = V = 128, g = chunk-local cumsum of the gates,
Gamma_ij = exp(g_i - g_j), rows of a chunk past its n real tokens zero):

    prep             s02's: g, k, v, beta -> g_cum, Ai, w = Ai diag(beta exp g) K, u = Ai diag(beta) V
    segment states   s03's (only where s03's rule splits): h_seg, the initial state of every row
    segment grads    s03's (only where split): dht_seg, the final-state gradient of every row
    forward walk     ``fwd_walk_kernel``, s02's walk without its reverse role, over the rows:
                     h[chunk] = S, V~ = U - W S, S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~
    fused reverse    ``fused_reverse_kernel``, per (row, value head, column block), the chunks
                     backwards, dS' = dS leaving the chunk (fp32 registers), S = h[chunk] (bf16):
                     dV~ = diag(exp(g_C - g)) K dS' + P^T dO    (P^T = scale (K Q^T * Gamma^T), j <= i)
                     dS  = exp(g_C) dS' + scale Q^T diag(exp g) dO - W^T dV~
                     dP  = scale (dO V~^T * Gamma), c <= i;  dW = -dV~ S^T
                     dq  = scale diag(exp g) dO S^T + dP K
                     dk  = diag(exp(g_C - g)) V~ dS'^T + dP^T Q + D K + D^T K + diag(beta exp g) Ai^T dW
                     dv  = diag(beta) Ai^T dV~;  dbeta and dg_cum as wy_bwd.s01 and
                     chunk_bwd_dqkwg.s01 (dAi = (dW K^T) diag(beta exp g) + (dV~ V^T) diag(beta),
                     dA~ = -(Ai^T dAi Ai^T) * Gamma strictly lower, D = diag(beta) dA~);
                     dg = the reverse cumsum of dg_cum inside the chunk; dh0 of the row = the last dS
    finish           ``finish_kernel``: dq, dk <- the sums of the parts over each GVA group and both
                     column blocks (fp32, one rounding); dg, dbeta <- the sums over the blocks

dh0 of each sequence is its first segment row's. No launch reads a device value on the host (a
split plan's lengths are read once per ``cu_seqlens``, s03's ``split_plan``), no atomics: the sums
are in a fixed order, the step is graph-capturable and bitwise deterministic.

Threads, barriers, budgets. The reverse kernel: two math warpgroups (256 threads) share every
product (synchronous ``T.gemm`` on wgmma, each warpgroup half the columns or rows); tiles come by
masked plain loads, no producer, no mbarriers, no setmaxnreg; ``__syncthreads`` only (TileLang's,
and one a chunk before the loads). Registers: dS (32 fp32 a thread) lives in registers during the
walk step only and in shared memory (``sf_s``) through the dqkwg and wy parts; the chunk's dk
between its products and the wy row sums are in shared memory too. With all three in registers
the kernel used 255 registers and spilled 152 bytes a thread; now, compiled for sm_90a
(``cuobjdump -res-usage``), 248-254 registers and no stack or local memory at every public head
layout. 220 KiB of shared memory (224,768 bytes with the barrier's), one CTA an SM.
Shared buffers are reused by hand along the iteration: W's holds dW once the dS step has read W;
V~'s holds V once dk's V~ term is done; Q's holds -diag(exp g) K in the wy part; one 64 x 64
buffer holds dO' and then -dV~; one holds P^T, then dP, then dAi; one M = dAi Ai^T, then D. The
forward walk: s02's consumer / producer pair (TMA tiles in two stages, bar_full / bar_empty), 156
registers, no spills.

Correctness: its GPU tests pass on an H100 (61 tests at commit 94273f8: float64 checks of every
gradient on the public head layouts with segments forced and off, h0 / dht present and absent,
bitwise determinism, CUDA graph replay equal to eager).

Measured effect: slower than s03. One H100, commit ca60ad2, CUDA graph replay, a training step
(the library's forward + the stage's backward), FLA and FlashQLA in the same run
(``profiles/results/gdn_train_s04.csv``):

    problem           FLA ms  FlashQLA ms  s02 ms  s03 ms  s04 ms  s04/s03  s04/s02  vs FlashQLA
    (2, 8) 1x8192     0.964   0.425        0.901   0.634   0.870   0.73x    1.04x    0.49x
    (2, 8) 1x32768    3.823   1.117        3.420   1.882   2.833   0.66x    1.21x    0.39x

(s02's column is the library's row, which ran s02 then.) Napkin math, (2, 8) 1x32768: s04's step
does 51.5 TFLOP/s of useful work (6.9 % of the measured bf16 roof), s03's 77.6. Eager (no graph),
s04 has fewer launches and wins at 1x8192 (1.00 ms against s03's 1.29) but not at 1x32768 (2.88
against 1.93). Why slower: the fusion moves chunk_bwd_dqkwg's and wy_bwd's work, which s03 runs
chunk-parallel over every chunk at once, into the sequential reverse walk: each CTA now does all
of a chunk's gradient products, synchronously (loads, then products, no overlap), before its next
dS step, and at 220 KiB of shared memory one CTA an SM runs. What it saves (HBM round trips) is
not what bounds these problems (6-7 % of the copy roof). Lesson: a fused backward pays only when
the walk's critical path is overlapped with the chunk-parallel work, by warp roles (BACKWARD.md 5,
the warp-specialized pipeline), not by putting that work on the chain.

Taught in: not taught (lab log: the fusion measured before the warp-specialized pipeline).
"""

import functools
import operator

import torch

from flashqla import autocp
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.stages import load
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# gdn_bwd_fused_reverse: the fused kernel; gdn_bwd_fwd_walk: h and v_new; tma_load: the forward
# walk's tiles; CumSum1D: dg's reverse cumsum inside the fused kernel
SOURCE_MUST_CONTAIN = ("gdn_bwd_fused_reverse", "gdn_bwd_fwd_walk", "gdn_bwd_finish_groups",
                       "tma_load", "CumSum1D")

S02 = load("gdn_bwd", 2)         # prep
S03 = load("gdn_bwd", 3)         # the AutoCP plan, segment states and gradients
CHUNK_SIZE = S02.CHUNK_SIZE      # C = 64
HEAD_DIM = S02.HEAD_DIM          # K = V = 128
BV = S02.BV                      # 64 value columns a CTA, both walks
NVT = HEAD_DIM // BV             # 2 column blocks: CTAs a (row, value head), parts of dq, dk, dg, dbeta
STAGES = S02.STAGES              # the forward walk's tile stages
WARPGROUP = 128
MATH_THREADS = 2 * WARPGROUP     # the fused reverse kernel: two math warpgroups
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}


def fwd_walk_kernel(H: int, HV: int):
    """s02's forward walk role alone: per (row, value head, BV columns), h[chunk] = S and v_new,
    from each row's initial state (h0 or 0)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    NVT = V // BV
    group = HV // H
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # rows + 1
    num_rows = T.dynamic("num_rows")          # rows of h (the chunk table's)
    num_h0 = T.dynamic("num_h0")              # rows, or 1 (unread) without an initial state

    @T.prim_func
    def gdn_bwd_fwd_walk(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the rows
        first_chunk: T.Tensor((num_bounds,), "int32"),         # h row of each row's chunk 0
        h0: T.Tensor((num_h0, HV, K, V), "float32"),
        use_h0: T.int32,
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),         # state entering each chunk
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        with T.Kernel((num_bounds - 1) * HV * NVT, threads=2 * WARPGROUP) as bx:
            i_v = bx % NVT
            i_hv = (bx // NVT) % HV
            i_n = bx // (NVT * HV)
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            num_c = T.ceildiv(eos - bos, BT)

            k_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            w_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            u_s = T.alloc_shared((STAGES, BT, BV), "bfloat16")
            g_s = T.alloc_shared((STAGES, BT), "float32")      # log2(e) g_cum, rows past the end padded
            s_s = T.alloc_shared((K, BV), "bfloat16")           # S in bf16: operand and h row
            a_s = T.alloc_shared((BT, BV), "bfloat16")          # diag(exp(g_C - g)) V~
            s_f = T.alloc_fragment((K, BV), "float32")          # S, fp32, all along
            x_f = T.alloc_fragment((BT, BV), "float32")         # V~
            bar_full = T.alloc_barrier([WARPGROUP] * STAGES)    # producer -> consumer (+ TMA bytes)
            bar_empty = T.alloc_barrier([WARPGROUP] * STAGES)   # consumer -> producer

            tx = T.get_thread_binding()
            if tx < WARPGROUP:  # ---- the consumer warpgroup
                if use_h0 != 0:
                    T.copy(h0[i_n, i_hv, :, v0:v0 + BV], s_f)
                else:
                    T.clear(s_f)
                for it in T.serial(num_c):
                    st = it % STAGES
                    t0 = bos + it * BT
                    n = T.min(eos - t0, BT)
                    T.barrier_wait(bar_full[st], (it // STAGES) % 2)
                    # h[row0 + it] <- S (bf16)
                    T.copy(s_f, s_s)
                    T.copy(s_s, h[row0 + it, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})
                    # V~ <- U - W S, rows >= n zeroed
                    T.gemm(w_s[st, :, :], s_s, x_f, clear_accum=True)
                    for i, j in T.Parallel(BT, BV):
                        x_f[i, j] = T.if_then_else(i < n, u_s[st, i, j] - x_f[i, j], 0)
                    for i, j in T.Parallel(BT, BV):
                        if i < n:
                            v_new[t0 + i, i_hv, v0 + j] = x_f[i, j]
                    for i, j in T.Parallel(BT, BV):
                        a_s[i, j] = x_f[i, j] * T.exp2(g_s[st, BT - 1] - g_s[st, i])
                    # S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~
                    for d, j in T.Parallel(K, BV):
                        s_f[d, j] = s_f[d, j] * T.exp2(g_s[st, BT - 1])
                    T.gemm(k_s[st, :, :], a_s, s_f, transpose_A=True)
                    T.barrier_arrive(bar_empty[st])
            else:  # ---- the producer warpgroup: full 64-row boxes (rows >= n masked by the consumer)
                for it in T.serial(num_c):
                    st = it % STAGES
                    t0 = bos + it * BT
                    T.barrier_wait(bar_empty[st], (it // STAGES) % 2 ^ 1)
                    T.tma_copy(k[t0:t0 + BT, i_h, :], k_s[st, :, :], barrier=bar_full[st])
                    T.tma_copy(w[t0:t0 + BT, i_hv, :], w_s[st, :, :], barrier=bar_full[st])
                    T.tma_copy(u[t0:t0 + BT, i_hv, v0:v0 + BV], u_s[st, :, :], barrier=bar_full[st])
                    for i in T.Parallel(BT):
                        g_s[st, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    T.barrier_arrive(bar_full[st])

    return gdn_bwd_fwd_walk


def fused_reverse_kernel(H: int, HV: int):
    """Per (row, value head, BV value columns): the chunks in reverse, every gradient of a chunk in
    one iteration (the module doc's formulas); dq, dk, dbeta, dg are this column block's parts."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # rows + 1
    num_rows = T.dynamic("num_rows")          # rows of h (the chunk table's)
    num_ht = T.dynamic("num_ht")              # rows, or 1 (unread) without dht
    num_dh0 = T.dynamic("num_dh0")            # rows, or 1 (unwritten) without dh0

    @T.prim_func
    def gdn_bwd_fused_reverse(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),          # Ai diag(beta exp g) K
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),      # V~ = U - W S
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of FLA's gated T
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        beta: T.Tensor((num_tokens, HV), "float32"),
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),         # state entering each chunk
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the rows
        first_chunk: T.Tensor((num_bounds,), "int32"),         # h row of each row's chunk 0
        dht: T.Tensor((num_ht, HV, K, V), "float32"),          # dL/d final state of each row
        use_dht: T.int32,
        scale: T.float32,
        dq_p: T.Tensor((NVT, num_tokens, HV, K), "bfloat16"),  # parts: the finish sums them
        dk_p: T.Tensor((NVT, num_tokens, HV, K), "bfloat16"),
        dv: T.Tensor((num_tokens, HV, V), "bfloat16"),
        dbeta_p: T.Tensor((NVT, num_tokens, HV), "float32"),
        dg_p: T.Tensor((NVT, num_tokens, HV), "float32"),
        dh0: T.Tensor((num_dh0, HV, K, V), "float32"),         # dL/d initial state of each row
        store_dh0: T.int32,
    ):
        with T.Kernel(num_bounds - 1, HV, NVT, threads=MATH_THREADS) as (i_n, i_hv, i_v):
            i_h = i_hv // group
            v0 = i_v * BV
            # scalars held in variables (TileLang would inline each expression at every use)
            eos = T.alloc_var("int32")
            num_c = T.alloc_var("int32")
            t0 = T.alloc_var("int32")
            n = T.alloc_var("int32")
            row = T.alloc_var("int32")
            eos = bounds[i_n + 1]
            num_c = T.ceildiv(eos - bounds[i_n], BT)

            # the chunk's tiles (rows >= n zero); V-wide tiles hold this CTA's BV columns
            q_s = T.alloc_shared((BT, K), "bfloat16")          # Q, then -diag(exp g) K
            k_s = T.alloc_shared((BT, K), "bfloat16")
            wd_s = T.alloc_shared((BT, K), "bfloat16")         # W, then this block's dW = -dV~ S^T
            do_s = T.alloc_shared((BT, BV), "bfloat16")
            vv_s = T.alloc_shared((BT, BV), "bfloat16")        # V~, then V
            x_s = T.alloc_shared((BT, BV), "bfloat16")         # dO' = scale diag(exp g) dO, then -dV~
            ai_s = T.alloc_shared((BT, BT), "bfloat16")
            h_s = T.alloc_shared((K, BV), "bfloat16")          # S
            ds_s = T.alloc_shared((K, BV), "bfloat16")         # dS' in bf16: operand
            p_s = T.alloc_shared((BT, BT), "bfloat16")         # P^T, then dP, then dAi
            d_s = T.alloc_shared((BT, BT), "bfloat16")         # M = dAi Ai^T, then D = diag(beta) dA~
            e_s = T.alloc_shared((BT, BT + 1), "float32")      # K K^T, then diag(beta) E (odd rows:
            #                                                    its transposed reads hit 32 banks)
            g_s = T.alloc_shared((BT,), "float32")             # log2(e) g_cum, rows >= n: the last real
            b_s = T.alloc_shared((BT,), "float32")             # beta, rows >= n: 0
            dg_s = T.alloc_shared((BT,), "float32")            # dg_cum's dqkwg terms
            last_s = T.alloc_shared((BT,), "float32")          # the terms of dg_C
            cum_s = T.alloc_shared((BT,), "float32")           # dg_cum, then its reverse cumsum
            r_s4 = T.alloc_shared((4, BT), "float32")          # the wy row sums r_e, r_et, r_k, r_v
            sf_s = T.alloc_shared((K, BV), "float32")          # dS between the walk steps: its registers
            #                                                    are free in the dqkwg and wy parts
            dk_s = T.alloc_shared((BT, K), "float32")          # dk of the chunk (this block's part):
            #                                                    in shared, no registers held across wy
            s_f = T.alloc_fragment((K, BV), "float32")         # dS', fp32, all along
            y_f = T.alloc_fragment((BT, BV), "float32")        # dV~, then the 64 x BV products
            x_f = T.alloc_fragment((BT, K), "float32")         # the 64 x K products
            a_f = T.alloc_fragment((BT, BT), "float32")        # the 64 x 64 products
            r_q = T.alloc_fragment((BT,), "float32")
            r_ki = T.alloc_fragment((BT,), "float32")
            r_kk = T.alloc_fragment((BT,), "float32")
            r_s = T.alloc_fragment((BT,), "float32")
            r_e = T.alloc_fragment((BT,), "float32")
            r_et = T.alloc_fragment((BT,), "float32")
            r_k = T.alloc_fragment((BT,), "float32")
            r_v = T.alloc_fragment((BT,), "float32")
            dg_last = T.alloc_local((1,), "float32")

            # dS' <- dht of the row (or 0)
            if use_dht != 0:
                T.copy(dht[i_n, i_hv, :, v0:v0 + BV], sf_s)
            else:
                T.clear(sf_s)
            for it in T.serial(num_c):
                # chunk c = num_c - 1 - it: from the last one back
                t0 = bounds[i_n] + (num_c - 1 - it) * BT         # its first token
                n = T.min(eos - t0, BT)                          # its real rows, 1..64
                row = first_chunk[i_n] + num_c - 1 - it          # its row of h
                T.sync_threads()  # the previous chunk's reads of every tile are done
                # ---- loads: Q, K, W, dO, V~, Ai, g, beta (rows >= n zero), S = h[row]
                T.copy(h[row, i_hv, :, v0:v0 + BV], h_s)
                for i, d in T.Parallel(BT, K):
                    q_s[i, d] = T.if_then_else(i < n, q[t0 + i, i_h, d], 0)
                    k_s[i, d] = T.if_then_else(i < n, k[t0 + i, i_h, d], 0)
                    wd_s[i, d] = T.if_then_else(i < n, w[t0 + i, i_hv, d], 0)
                for i, j in T.Parallel(BT, BV):
                    do_s[i, j] = T.if_then_else(i < n, do[t0 + i, i_hv, v0 + j], 0)
                    vv_s[i, j] = T.if_then_else(i < n, v_new[t0 + i, i_hv, v0 + j], 0)
                for i, j in T.Parallel(BT, BT):
                    ai_s[i, j] = T.if_then_else(i < n, Ai[t0 + i, i_hv, j], 0)
                for i in T.Parallel(BT):
                    g_s[i] = g_cum[t0 + T.min(i, n - 1), i_hv] * LOG2E
                    b_s[i] = T.if_then_else(i < n, beta[t0 + i, i_hv], 0)

                # ---- the reverse walk step (s02's reverse role)
                T.copy(sf_s, s_f)
                T.copy(s_f, ds_s)
                # dO' <- scale diag(exp g) dO
                for i, j in T.Parallel(BT, BV):
                    x_s[i, j] = do_s[i, j] * (scale * T.exp2(g_s[i]))
                # X <- K dS';  dS <- exp(g_C) dS' + Q^T dO'
                T.gemm(k_s, ds_s, y_f, clear_accum=True)
                for d, j in T.Parallel(K, BV):
                    s_f[d, j] = s_f[d, j] * T.exp2(g_s[BT - 1])
                T.gemm(q_s, x_s, s_f, transpose_A=True)
                # P^T[j, i] <- scale (K Q^T)[j, i] exp(g_i - g_j), j <= i < n
                T.gemm(k_s, q_s, a_f, transpose_B=True, clear_accum=True)
                for j, i in T.Parallel(BT, BT):
                    p_s[j, i] = T.if_then_else((j <= i) & (i < n),
                                               scale * a_f[j, i] * T.exp2(g_s[i] - g_s[j]), 0)
                # dV~ <- diag(exp(g_C - g)) X + P^T dO;  -dV~ (bf16, as s02's dv2; rows >= n zero)
                for i, j in T.Parallel(BT, BV):
                    y_f[i, j] = y_f[i, j] * T.exp2(g_s[BT - 1] - g_s[i])
                T.gemm(p_s, do_s, y_f)
                for i, j in T.Parallel(BT, BV):
                    x_s[i, j] = T.if_then_else(i < n, -y_f[i, j], 0)
                # dS <- dS + W^T (-dV~)
                T.gemm(wd_s, x_s, s_f, transpose_A=True)
                T.copy(s_f, sf_s)

                # ---- chunk_bwd_dqkwg's part (this block's columns of the V contractions)
                # dP <- scale (dO V~^T * Gamma), c <= i < n
                T.gemm(do_s, vv_s, a_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BT, BT):
                    p_s[i, j] = T.if_then_else((j <= i) & (i < n),
                                               scale * a_f[i, j] * T.exp2(g_s[i] - g_s[j]), 0)
                # dW <- (-dV~) S^T, in W's buffer (W was last read by the dS step)
                T.gemm(x_s, h_s, x_f, transpose_B=True, clear_accum=True)
                T.copy(x_f, wd_s)
                # dq <- scale diag(exp g) dO S^T + dP K;  r_q <- rows of dq * Q
                T.gemm(do_s, h_s, x_f, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(BT, K):
                    x_f[i, d] = x_f[i, d] * (scale * T.exp2(g_s[i]))
                T.gemm(p_s, k_s, x_f)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dq_p[i_v, t0 + i, i_hv, d] = x_f[i, d]
                for i, d in T.Parallel(BT, K):
                    x_f[i, d] = x_f[i, d] * q_s[i, d]
                T.reduce_sum(x_f, r_q, dim=1)
                # (dk_s is only written or only read in a loop: a loop doing both got a barrier
                # per element from TileLang's sync pass)
                # dk <- diag(exp(g_C - g)) V~ dS'^T;  r_ki <- rows of it * K
                T.gemm(vv_s, ds_s, x_f, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(BT, K):
                    x_f[i, d] = T.if_then_else(i < n, x_f[i, d] * T.exp2(g_s[BT - 1] - g_s[i]), 0)
                for i, d in T.Parallel(BT, K):
                    dk_s[i, d] = x_f[i, d]
                    x_f[i, d] = x_f[i, d] * k_s[i, d]
                T.reduce_sum(x_f, r_ki, dim=1)
                # dk += dP^T Q;  r_kk <- rows of dk * K (r_ki + r_kp, the dP^T Q term's)
                T.gemm(p_s, q_s, x_f, transpose_A=True, clear_accum=True)
                for i, d in T.Parallel(BT, K):
                    x_f[i, d] = x_f[i, d] + dk_s[i, d]
                for i, d in T.Parallel(BT, K):
                    dk_s[i, d] = x_f[i, d]
                    x_f[i, d] = x_f[i, d] * k_s[i, d]
                T.reduce_sum(x_f, r_kk, dim=1)
                # r_s <- rows of S * dS' (rows d and d + 64 paired): <S, dS'> = sum r_s
                for i, j in T.Parallel(BT, BV):
                    y_f[i, j] = (T.cast(h_s[i, j], "float32") * T.cast(ds_s[i, j], "float32")
                                 + T.cast(h_s[i + BT, j], "float32") * T.cast(ds_s[i + BT, j], "float32"))
                T.reduce_sum(y_f, r_s, dim=1)
                # dg_cum <- q.dq - k.dk (to shared: no row sum stays live);
                # dg_C <- sum_i k_i.dk_i (the V~ term) + exp(g_C) <S, dS'>
                for i in T.Parallel(BT):
                    dg_s[i] = r_q[i] - r_kk[i]
                    last_s[i] = r_ki[i] + T.exp2(g_s[BT - 1]) * r_s[i]
                dg_last[0] = 0
                for i in T.serial(BT):
                    dg_last[0] = dg_last[0] + last_s[i]

                # ---- wy_bwd's part: V replaces V~ in its buffer, -diag(exp g) K replaces Q
                T.sync_threads()  # every read of V~ and Q above is done
                for i, j in T.Parallel(BT, BV):
                    vv_s[i, j] = T.if_then_else(i < n, v[t0 + i, i_hv, v0 + j], 0)
                for i, d in T.Parallel(BT, K):
                    q_s[i, d] = -k_s[i, d] * T.exp2(g_s[i])
                # K K^T (fp32, for E below) in e_s
                T.gemm(k_s, k_s, a_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BT, BT):
                    e_s[i, j] = a_f[i, j]
                # dAi <- (dW K^T) diag(beta exp g) + (dV~ V^T) diag(beta), strictly lower, rows < n:
                # the two products summed are -(dW (diag(exp g) K)^T + dV~ V^T), one accumulator
                T.gemm(wd_s, q_s, a_f, transpose_B=True, clear_accum=True)
                T.gemm(x_s, vv_s, a_f, transpose_B=True)
                for i, j in T.Parallel(BT, BT):
                    p_s[i, j] = T.if_then_else((j < i) & (i < n), -b_s[j] * a_f[i, j], 0)
                # M <- dAi Ai^T;  dA~ <- -(Ai^T M) * Gamma, strictly lower, rows < n
                T.gemm(p_s, ai_s, a_f, transpose_B=True, clear_accum=True)
                T.copy(a_f, d_s)
                T.gemm(ai_s, d_s, a_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(BT, BT):
                    a_f[i, j] = T.if_then_else((j < i) & (i < n), -a_f[i, j] * T.exp2(g_s[i] - g_s[j]), 0)
                # D <- diag(beta) dA~;  E <- dA~ * K K^T;  r_e <- rows of E;  e_s <- diag(beta) E
                for i, j in T.Parallel(BT, BT):
                    d_s[i, j] = b_s[i] * a_f[i, j]
                    a_f[i, j] = a_f[i, j] * e_s[i, j]
                for i, j in T.Parallel(BT, BT):  # a loop of its own: e_s read and written in one
                    e_s[i, j] = b_s[i] * a_f[i, j]  # got a barrier per element from TileLang
                T.reduce_sum(a_f, r_e, dim=1)
                for i in T.Parallel(BT):
                    r_s4[0, i] = r_e[i]
                # r_et <- columns of diag(beta) E (rows of its transpose)
                for i, j in T.Parallel(BT, BT):
                    a_f[i, j] = e_s[j, i]
                T.reduce_sum(a_f, r_et, dim=1)
                for i in T.Parallel(BT):
                    r_s4[1, i] = r_et[i]
                # X <- Ai^T dW;  r_k <- rows of X * K
                T.gemm(ai_s, wd_s, x_f, transpose_A=True, clear_accum=True)
                for i, d in T.Parallel(BT, K):
                    x_f[i, d] = x_f[i, d] * k_s[i, d]
                T.reduce_sum(x_f, r_k, dim=1)
                for i in T.Parallel(BT):
                    r_s4[2, i] = r_k[i]
                # dk <- dk + diag(beta exp g) X + D K + D^T K (X again: one more 64 x K x 64
                # product instead of a second 64 x K fragment)
                T.gemm(ai_s, wd_s, x_f, transpose_A=True, clear_accum=True)
                for i, d in T.Parallel(BT, K):
                    x_f[i, d] = x_f[i, d] * (b_s[i] * T.exp2(g_s[i])) + dk_s[i, d]
                T.gemm(d_s, k_s, x_f)
                T.gemm(d_s, k_s, x_f, transpose_A=True)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dk_p[i_v, t0 + i, i_hv, d] = x_f[i, d]
                # Y <- Ai^T dV~ = -(Ai^T (-dV~));  dv <- diag(beta) Y;  r_v <- rows of Y * V
                T.gemm(ai_s, x_s, y_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    y_f[i, j] = -y_f[i, j]
                for i, j in T.Parallel(BT, BV):
                    if i < n:
                        dv[t0 + i, i_hv, v0 + j] = y_f[i, j] * b_s[i]
                for i, j in T.Parallel(BT, BV):
                    y_f[i, j] = y_f[i, j] * vv_s[i, j]
                T.reduce_sum(y_f, r_v, dim=1)
                for i in T.Parallel(BT):
                    r_s4[3, i] = r_v[i]

                # (the row sums from shared: no fragment stays live across wy's products)
                # dbeta <- exp(g) r_k + r_v + r_e;  dg_cum <- the dqkwg terms (+ dg_C at the last
                # real row) + beta (exp(g) r_k + r_e) - r_et;  dg <- its reverse cumsum in the chunk
                for i in T.Parallel(BT):
                    if i < n:
                        dbeta_p[i_v, t0 + i, i_hv] = T.exp2(g_s[i]) * r_s4[2, i] + r_s4[3, i] + r_s4[0, i]
                    cum_s[i] = T.if_then_else(
                        i < n,
                        dg_s[i] + T.if_then_else(i == n - 1, dg_last[0], 0)
                        + b_s[i] * (T.exp2(g_s[i]) * r_s4[2, i] + r_s4[0, i]) - r_s4[1, i], 0)
                T.cumsum(cum_s, dim=0, reverse=True)
                for i in T.Parallel(BT):
                    if i < n:
                        dg_p[i_v, t0 + i, i_hv] = cum_s[i]
            # dh0 of the row <- dS (a row without chunks: dht, written above by other threads)
            T.sync_threads()
            if store_dh0 != 0:
                T.copy(sf_s, dh0[i_n, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})

    return gdn_bwd_fused_reverse


def finish_kernel(H: int, HV: int):
    """dq, dk [tokens, H, K] <- the sums of the parts over each GVA group and the column blocks
    (fp32, one rounding); dg, dbeta [tokens, HV] <- the sums over the column blocks."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K = CHUNK_SIZE, HEAD_DIM
    group = HV // H
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def gdn_bwd_finish_groups(
        dq_p: T.Tensor((NVT, num_tokens, HV, K), "bfloat16"),
        dk_p: T.Tensor((NVT, num_tokens, HV, K), "bfloat16"),
        dbeta_p: T.Tensor((NVT, num_tokens, HV), "float32"),
        dg_p: T.Tensor((NVT, num_tokens, HV), "float32"),
        dq: T.Tensor((num_tokens, H, K), "bfloat16"),
        dk: T.Tensor((num_tokens, H, K), "bfloat16"),
        dbeta: T.Tensor((num_tokens, HV), "float32"),
        dg: T.Tensor((num_tokens, HV), "float32"),
    ):
        with T.Kernel(T.ceildiv(num_tokens, BT), H, threads=WARPGROUP) as (i_t, i_h):
            a_f = T.alloc_fragment((BT, K), "float32")
            b_f = T.alloc_fragment((BT, K), "float32")
            T.clear(a_f)
            T.clear(b_f)
            # a fixed-order sum: column blocks, then the group's value heads in order
            for i_v in T.unroll(NVT):
                for j in T.unroll(group):
                    for i, d in T.Parallel(BT, K):
                        if i_t * BT + i < num_tokens:
                            a_f[i, d] = a_f[i, d] + T.cast(dq_p[i_v, i_t * BT + i, i_h * group + j, d], "float32")
                            b_f[i, d] = b_f[i, d] + T.cast(dk_p[i_v, i_t * BT + i, i_h * group + j, d], "float32")
            for i, d in T.Parallel(BT, K):
                if i_t * BT + i < num_tokens:
                    dq[i_t * BT + i, i_h, d] = a_f[i, d]
                    dk[i_t * BT + i, i_h, d] = b_f[i, d]
            for i, j in T.Parallel(BT, group):
                if i_t * BT + i < num_tokens:
                    dbeta[i_t * BT + i, i_h * group + j] = functools.reduce(
                        operator.add, [dbeta_p[i_v, i_t * BT + i, i_h * group + j] for i_v in range(NVT)])
                    dg[i_t * BT + i, i_h * group + j] = functools.reduce(
                        operator.add, [dg_p[i_v, i_t * BT + i, i_h * group + j] for i_v in range(NVT)])

    return gdn_bwd_finish_groups


@functools.cache
def _fwd_walk(H: int, HV: int):
    # s02's walk options: the producer's and consumer's buffers must not share addresses
    return compile_hopper(fwd_walk_kernel(H, HV), {"tl.disable_shared_memory_reuse": True})


@functools.cache
def _fused(H: int, HV: int):
    return compile_hopper(fused_reverse_kernel(H, HV))


@functools.cache
def _finish(H: int, HV: int):
    return compile_hopper(finish_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ of this stage's three new kernels, generated for sm_90a at the default shape."""
    return "\n".join(f(**DEFAULT_SHAPE).get_kernel_source() for f in (_fwd_walk, _fused, _finish))


def run(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE, cp=None):
    """(dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32, dh0
    [N, HV, K, V] fp32 or None); see the module doc. ``cp``: as s03's (None: its rule; False:
    one row per sequence; True: its cheapest split; an int: the segment length in chunks)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_bwd.s04: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s04: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s04: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_bwd.s04: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    if not (cp is None or isinstance(cp, int)):
        raise ValueError(f"gdn_bwd.s04: `cp` must be None, True, False or a segment length in chunks; got {cp!r}")
    if B * T == 0:  # no tokens: every gradient is empty, and dL/dh0 = dht (s02's answer)
        return S02.run(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, chunk_size)
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    fp32 = {"device": device, "dtype": torch.float32}
    q_flat, k_flat = (x.to(**bf16).contiguous().view(B * T, H, K) for x in (q, k))
    v_flat, do_flat = (x.to(**bf16).contiguous().view(B * T, HV, V) for x in (v, do))
    g_flat, beta_flat = (x.to(**fp32).contiguous().view(B * T, HV) for x in (g, beta))
    seqs = seq_bounds(cu_seqlens, B, T, device)
    table, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N, NT = seqs.shape[0] - 1, table.shape[0]
    p = S03.split_plan(cu_seqlens, B, T, HV, autocp.num_sms(device), device, cp)
    stand_in = torch.empty(1, HV, K, V, **fp32)  # for an absent h0 / dht / dh0: never read or written
    with nvtx_range("gdn_bwd.s04"):
        # the forward's intermediates, recomputed: g_cum, Ai, w, u (s02's prep)
        g_cum = torch.empty(B * T, HV, **fp32)
        Ai = torch.empty(B * T, HV, CHUNK_SIZE, **bf16)
        w = torch.empty(B * T, HV, K, **bf16)
        u = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s04.prep"):
            S02._prep(H, HV)(k_flat, v_flat, g_flat, beta_flat, table, g_cum, Ai, w, u)
        if p is None:  # one row per sequence, from h0 and dht themselves
            bounds, rows_first, S = seqs, first_chunk, N
            h_rows = initial_state.to(**fp32).contiguous() if initial_state is not None else stand_in
            dht_rows = dht.to(**fp32).contiguous() if dht is not None else stand_in
            use_h0, use_dht = int(initial_state is not None), int(dht is not None)
        else:  # the segment rows, from s03's segment states and gradients
            bounds, rows_first, S = p.bounds, p.first_chunk, p.bounds.shape[0] - 1
            h0 = (initial_state.to(**fp32).contiguous() if initial_state is not None
                  else torch.zeros(N, HV, K, V, **fp32))
            with nvtx_range("gdn_bwd.s04.segment_states"):
                h_rows, solve = S03.segment_states(p, k_flat, v_flat, g_flat, beta_flat, h0, seqs, NT)
            with nvtx_range("gdn_bwd.s04.segment_grads"):
                dht_rows, _ = S03.segment_grads(p, q_flat, k_flat, w, do_flat, g_flat, beta_flat, g_cum,
                                                solve, dht, seqs, scale)
            use_h0, use_dht = 1, 1
        h = torch.empty(NT, HV, K, V, **bf16)
        v_new = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s04.fwd_walk"):
            _fwd_walk(H, HV)(k_flat, w, u, g_cum, bounds, rows_first, h_rows, use_h0, h, v_new)
        dq_p, dk_p = torch.empty(NVT, B * T, HV, K, **bf16), torch.empty(NVT, B * T, HV, K, **bf16)
        dbeta_p, dg_p = torch.empty(NVT, B * T, HV, **fp32), torch.empty(NVT, B * T, HV, **fp32)
        dv = torch.empty(B * T, HV, V, **bf16)
        dh0_rows = torch.empty(S, HV, K, V, **fp32) if initial_state is not None else stand_in
        with nvtx_range("gdn_bwd.s04.fused_reverse"):
            _fused(H, HV)(q_flat, k_flat, v_flat, w, v_new, do_flat, Ai, g_cum, beta_flat, h, bounds,
                          rows_first, dht_rows, use_dht, scale, dq_p, dk_p, dv, dbeta_p, dg_p, dh0_rows,
                          int(initial_state is not None))
        dq, dk = torch.empty(B * T, H, K, **bf16), torch.empty(B * T, H, K, **bf16)
        dbeta, dg = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
        with nvtx_range("gdn_bwd.s04.finish"):
            _finish(H, HV)(dq_p, dk_p, dbeta_p, dg_p, dq, dk, dbeta, dg)
    if initial_state is None:
        dh0 = None
    else:
        dh0 = dh0_rows if p is None else dh0_rows.index_select(0, p.row_of_slot[:N])
    return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
            dbeta.view(B, T, HV), dh0)
