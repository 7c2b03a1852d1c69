"""gdn_fwd, stage 36: s34 with WY = Gamma * Ab stored by the solve, where the wide fused kernel runs
unsplit after s06's solve: the kernel's pacing warpgroup no longer builds it.

What changed from s34: where the launch is wide (BV 64 or 128), AutoCP leaves it whole and the
solve runs gate_free_solve.s06's kernel (three or four value heads a CTA: the many-chunk problems
of (16, 48), (16, 64), (8, 24), (8, 32)), two kernels change:

- the solve multiplies each stored element of Ab by exp(g_i - g_j) (the exponent clamped at 0),
  from the log2(e) g_cum it already holds, except for a flagged head, whose Ab already holds the
  gate: it stores WY = Gamma * Ab, rounded to bf16 once;
- the wide kernel's scores / output warpgroup drops the WY pass (Ab loaded into registers,
  gated, masked, stored back) and the ``gated`` read; it only zeroes the rows past a sequence's
  end in its partial last chunk (the tile's rows there are the next sequence's).

Elsewhere (narrow widths, AutoCP splits, one or two heads a CTA) the forward is s34's: the warm-up
and the narrow kernel still read Ab and build WY themselves.

Why: the role timeline (``profiles/role_timeline_lab.py``) puts the pace of the wide kernel on
its scores / output warpgroup, and building P and WY on 1400-1600 of its 6300 cycles a chunk.
A what-if without the WY pass (wrong results, timing only; one H100, 357e1d9) took 0.82x s34's
forward on (16, 64) 1x8192 and 0.79x on (16, 48) 1x32768; moving the pass to the value
warpgroup (s35) made it 1.22-1.50x slower. The solve computes each WY element once, where it
already holds the element in a register; the wide kernel built it once per CTA (two or more a
head at BV 64). Precision: WY is rounded to bf16 once (s34 rounded Ab, then WY again).

Measured effect (one H100, commit f496a5f; its GPU tests passed there: the gdn_fwd check against
float64 on six problems where it stores WY, flagged chunks included, and the same bits eagerly and
from a CUDA graph; the public shapes). The forward, ``bench.time_row`` in one process (the API
running s34's kernels), ms:

    problem              BV    API (s34)   s34      s36
    (16, 48) 1x2048      64     0.1089    0.1056   0.0951
    (16, 48) 1x8192      64     0.3710    0.3709   0.3389
    (16, 48) 1x32768     64     1.4367    1.4545   1.3343
    (16, 48) 28672+4096  64     1.3216    1.3185   1.2467
    (16, 64) 1x8192      64     0.3911    0.3862   0.3790
    (16, 64) 1x32768     64     1.5318    1.5360   1.5009
    (16, 64) 28672+4096  64     1.4782    1.4776   1.4858
    (16, 64) 8x4096     128     1.1633    1.1642   1.3436
    (16, 48) 8x4096     128     0.9117    0.8965   1.0144
    (8, 32) 8x4096      128     0.5834    0.5885   0.6660

0.90-1.01x s34's time at BV 64, 1.13-1.15x at 128 (gdn_fwd.s37 keeps it to 64). With the peers
(``python -m flashqla bench``, same commit), ms:

    problem             s36      API (s34)   FlashQLA   FLA
    (16, 48) 1x32768   1.3264    1.4445     1.4052    3.2200
    (16, 64) 1x32768   1.4760    1.5253     1.5639    4.1683
    (16, 48) 1x8192    0.3400    0.3710     0.3693    0.7522

(16, 48) 1x32768 at 1.06x FlashQLA's speed, where the library is at 0.97x.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.varlen import num_chunk_rows

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "tma_store", "exp2f")

S34 = stages.load("gdn_fwd", 34)        # the forward and its other kernels; the wide kernel this one edits
S06 = stages.load("gate_free_solve", 6)  # the solve this one edits
S30 = S34.S33.S32.S31.S30               # the prologue's cumsum (s29's) and its choice of heads a CTA
S27 = S34.S27
CHUNK_SIZE = S34.CHUNK_SIZE
HEAD_DIM = S34.HEAD_DIM
STEP = S34.STEP
# the wide kernel's constants (s16's)
CHUNK_LOOP = S34.CHUNK_LOOP
NUM_STAGES, LOG2E, WARPGROUP = S34.NUM_STAGES, S34.LOG2E, S34.WARPGROUP
STATE_END, VALUE_END, SCORES_END, THREADS = S34.STATE_END, S34.VALUE_END, S34.SCORES_END, S34.THREADS
REGS_PRODUCER, REGS_STATE, REGS_VALUE, REGS_SCORES = (S34.REGS_PRODUCER, S34.REGS_STATE, S34.REGS_VALUE,
                                                      S34.REGS_SCORES)
# the solve's (s06's)
BLOCK, MIN_CTAS_PER_SM, GROWTH_LIMIT = S06.BLOCK, S06.MIN_CTAS_PER_SM, S06.GROWTH_LIMIT
SOLVE_THREADS = S06.THREADS
DEFAULT_SHAPE = S34.DEFAULT_SHAPE


def gated_solve_kernel(H: int, HV: int, heads_per_cta: int):
    """gate_free_solve.s06's T.prim_func storing WY = Gamma * Ab instead of Ab (a flagged head's Ab
    already holds the gate): H key heads, HV value heads, K = 128, ``heads_per_cta`` value heads of
    one key head a CTA; any token or chunk count."""
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
    def phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, jb, c, half, n, r0, nr, gate):
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
                xd_s[r0 + u, BLOCK * jb + 8 * half + q, c] = x_a[8 * u + q]

    @T.macro
    def phase_b(kkt_s, g_s, beta_s, xd_s, x_col, t_col, acc, row, jb, c, half, n, r, gate):
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
                            acc[q % 2] = acc[q % 2] + a_elem(
                                kkt_s, g_s, r, BLOCK * (jb + d) + i, BLOCK * (jb + e) + 8 * half + q, n,
                                gate) * x_col[8 * e + q]
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
        with T.Kernel(num_chunks, HV // R, threads=SOLVE_THREADS) as (i_c, i_r):
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

            # phase A: warp w solves X_ww of every head, the heads' substitutions interleaved; a CTA
            # with a flagged head solves its heads one at a time, each with its own A
            if any_flag[0] == 0:
                phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, 0, R, False)
            else:
                for r in T.unroll(R):
                    if flag_s[r] == 1:
                        phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, r, 1, True)
                    else:
                        phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, r, 1, False)
            T.sync_threads()

            # phase B: for head r warp w walks block column block_column(w, r) down (the columns'
            # work is 9, 5, 2 and 0 block products; the Latin square spreads them), then stores
            # Ab[:, col] = X[:, col] beta_col in bf16 straight from registers (rows < n)
            for r in T.serial(R):
                # block column of head r: a Latin square over four heads (w, 3 - w, w + 2, 1 - w, mod
                # 4): over four heads every warp takes every column once, over two the long column 0
                # pairs with the empty column 3
                jb = T.if_then_else(r % 2 == 0, (warp + 2 * (r // 2)) % NB, NB - 1 - (warp + 2 * (r // 2)) % NB)
                col = BLOCK * jb + c
                if flag_s[r] == 1:
                    phase_b(kkt_s, g_s, beta_s, xd_s, x_col, t_col, acc, row, jb, c, half, n, r, True)
                else:
                    phase_b(kkt_s, g_s, beta_s, xd_s, x_col, t_col, acc, row, jb, c, half, n, r, False)
                # block row j + l holds X_{j+l, j} (x_col[8 l ..]); the block rows above j are zero
                for l in T.unroll(NB):
                    if jb + l < NB:
                        for q in T.unroll(8):
                            if BLOCK * (jb + l) + 8 * half + q < n:
                                # WY_ij = Ab_ij exp(g_i - g_j) (the exponent clamped at 0: the
                                # diagonal block's upper triangle is zero and stays finite)
                                ab[bos + BLOCK * (jb + l) + 8 * half + q, hv0 + r, col] = (
                                    x_col[8 * l + q] * beta_s[r, col] * T.if_then_else(
                                        flag_s[r] == 1, 1.0,
                                        T.exp2(T.min(g_s[r, BLOCK * (jb + l) + 8 * half + q] - g_s[r, col], 0))))
                for l in T.unroll(1, NB):
                    if jb >= l:
                        for q in T.unroll(8):
                            if BLOCK * (jb - l) + 8 * half + q < n:
                                ab[bos + BLOCK * (jb - l) + 8 * half + q, hv0 + r, col] = 0
                if t == 0:
                    gated[i_c, hv0 + r] = flag_s[r]

    return gate_free_solve_balanced


def fused_state_value_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV value columns of the
    state per CTA (32, 64 or 128); any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C = CHUNK_SIZE
    chunk_parts = stages.load(*CHUNK_LOOP).chunk_parts
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_fused_state_value(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # WY = Gamma * Ab, rows per token
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        gated: T.Tensor((num_chunks, HV), "int32"),            # unread: ab holds WY (s36's solve)
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # sequence starts, then the total
        first_chunk: T.Tensor((num_bounds,), "int32"),         # each sequence's first chunk row
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
    ):
        with T.Kernel(V // BV, HV, num_seqs, threads=THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            num_seq_chunks = T.ceildiv(eos - bos, C)

            # tile stages (producer -> consumers); g holds log2(e) g_cum. v_s[b] then holds W
            # (value), ab_s[b] then holds WY (scores -> value)
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # state, value, scores
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # value
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # scores, value
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # scores
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # value: exp(g); state: exp(g_C)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # value: exp(g_C - g)
            p_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")      # scores -> output (same WG)
            # single hand-off buffers: S_c (state -> value, output), V~_c (value -> output),
            # Vd_c (value -> state)
            h_s = T.alloc_shared((K, BV), "bfloat16")
            vn_s = T.alloc_shared((C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            o_s = T.alloc_shared((C, BV), "bfloat16")                # output: O, for whole-row stores
            # registers of the state, value and scores / output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            x_f = T.alloc_fragment((C, BV), "float32")             # U, then W, V~, Vd
            gam_f = T.alloc_fragment((C, C), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            # v_s and ab_s are read and written in the accumulator layout
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)       # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_STAGES)     # scores -> value, output
            bar_state_ready = T.alloc_barrier(WARPGROUP)                     # state -> value, output
            bar_state_free = T.alloc_barrier(WARPGROUP)                      # output -> state
            bar_vd_ready = T.alloc_barrier(WARPGROUP)                        # value -> state
            bar_vn_ready = T.alloc_barrier(WARPGROUP)                        # value -> output
            bar_vn_free = T.alloc_barrier(WARPGROUP)                         # output -> value

            tx = T.get_thread_binding()
            if tx < STATE_END:  # ---- the state warpgroup
                T.set_max_nreg(REGS_STATE, 1)
                # S <- h0
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:  # the odd last chunk under an `if` (s12's chunk_parts says why)
                        for r in T.serial(reps):
                            for b in slots:
                                c = c0 + 2 * r + b
                                T.barrier_wait(bar_tiles_full[b], (c // NUM_STAGES) % 2)
                                # h_shared is free once the output warpgroup has read S_{c-1}
                                # (the value warpgroup read it before handing Vd_{c-1} over)
                                T.barrier_wait(bar_state_free, c % 2 ^ 1)
                                # S_c -> bf16, the operand of K S_c and Q S_c
                                T.copy(h_f, h_s)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_state_ready)
                                # S <- exp(g_C) S while the value warpgroup builds Vd
                                for i, j in T.Parallel(K, BV):
                                    h_f[i, j] = h_f[i, j] * eg_s[b, C - 1]
                                # S <- S + K^T Vd
                                T.barrier_wait(bar_vd_ready, c % 2)
                                T.gemm(k_s[b, :, :], vd_s, h_f, transpose_A=True)
                                T.barrier_arrive(bar_tiles_empty[b])
                T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

            elif tx >= STATE_END and tx < VALUE_END:  # ---- the value warpgroup
                T.set_max_nreg(REGS_VALUE, 1)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:
                        for r in T.serial(reps):
                            for b in slots:
                                c = c0 + 2 * r + b
                                T.barrier_wait(bar_tiles_full[b], (c // NUM_STAGES) % 2)
                                T.barrier_wait(bar_state_ready, c % 2)
                                # U <- K S_c
                                T.gemm(k_s[b, :, :], h_s, x_f, clear_accum=True)
                                # W <- V - diag(exp(g)) U, over the V tile; rows >= n are finite
                                # and meet only WY's zero columns, so V~ needs no mask
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = v_s[b, i, j] - eg_s[b, i] * x_f[i, j]
                                T.copy(x_f, v_s[b, :, :])
                                T.fence_proxy_async()
                                # V~ <- WY W, WY from the scores warpgroup (over the Ab tile)
                                T.barrier_wait(bar_scores_ready[b], (c // NUM_STAGES) % 2)
                                T.gemm(ab_s[b, :, :], v_s[b, :, :], x_f, clear_accum=True)
                                # V~_c -> vn_shared once the output has read V~_{c-1}
                                T.barrier_wait(bar_vn_free, c % 2 ^ 1)
                                T.copy(x_f, vn_s)
                                # Vd <- diag(exp(g_C - g)) V~ -> vd_shared (the state has read
                                # Vd_{c-1}: it handed S_c over after its update)
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = x_f[i, j] * egd_s[b, i]
                                T.copy(x_f, vd_s)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_vd_ready)
                                T.barrier_arrive(bar_vn_ready)
                                T.barrier_arrive(bar_tiles_empty[b])

            elif tx >= VALUE_END and tx < SCORES_END:  # ---- the scores / output warpgroup
                T.set_max_nreg(REGS_SCORES, 1)
                # step c: the first half of chunk c - 1's output, chunk c's scores, the second
                # half of chunk c - 1's output (stage s = c % 2 for the scores, 1 - s for the output)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks + 1):
                    if present:
                        for r in T.serial(reps):
                            for s in slots:
                                c = c0 + 2 * r + s
                                b = 1 - s
                                t0 = bos + (c - 1) * C
                                if c >= 1:
                                    # O <- scale diag(exp g) Q S_{c-1}
                                    T.barrier_wait(bar_state_ready, (c - 1) % 2)
                                    T.gemm(q_s[b, :, :], h_s, o_f, clear_accum=True)
                                    T.barrier_arrive(bar_state_free)
                                    # the row factor scale exp(g_i): the producer's exp(g) (one
                                    # exp2 a row, not one an element)
                                    for i, j in T.Parallel(C, BV):
                                        o_f[i, j] = o_f[i, j] * (scale * eg_s[b, i])
                                    # this warpgroup is done with chunk c - 1's tiles (P_{c-1} is in
                                    # p_shared): the producer may load chunk c + 1 while the chain
                                    # still runs chunk c - 1
                                    T.barrier_arrive(bar_tiles_empty[b])
                                if c < num_seq_chunks:
                                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                                    # P <- Q K^T, issued without waiting: Gamma is built while
                                    # the tensor cores run it
                                    T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True,
                                                 clear_accum=True)
                                    # Gamma <- exp(g_i - g_j), the exponent clamped at 0 so that
                                    # the upper triangle (masked below) stays finite: no branch
                                    for i, j in T.Parallel(C, C):
                                        gam_f[i, j] = T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                                    T.wait_wgmma(0)
                                    # P's reads stay after the wait (a thread's 32 registers of P)
                                    T.warpgroup_fence_operand(p_f, num_regs=C * C // WARPGROUP)
                                    # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal
                                    for i, j in T.Parallel(C, C):
                                        p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * gam_f[i, j], 0)
                                    T.copy(p_f, p_s[s, :, :])
                                    # WY: the solve stored Gamma * Ab; a sequence's partial last
                                    # chunk loads rows i >= n of the next sequence, zeroed here
                                    # (rows of whole chunks are used as stored)
                                    if eos - bos - c * C < C:
                                        T.copy(ab_s[s, :, :], p_f)
                                        for i, j in T.Parallel(C, C):
                                            p_f[i, j] = T.if_then_else(i < eos - bos - c * C, p_f[i, j], 0)
                                        T.copy(p_f, ab_s[s, :, :])
                                    T.fence_proxy_async()
                                    T.barrier_arrive(bar_scores_ready[s])
                                if c >= 1:
                                    # O <- O + P_{c-1} V~_{c-1} (P from every thread of this
                                    # warpgroup: its barrier)
                                    T.barrier_wait(bar_scores_ready[b], ((c - 1) // NUM_STAGES) % 2)
                                    T.barrier_wait(bar_vn_ready, (c - 1) % 2)
                                    T.gemm(p_s[b, :, :], vn_s, o_f)
                                    T.barrier_arrive(bar_vn_free)
                                    # o[t0 : t0 + n] <- O through shared memory: a whole chunk by one
                                    # TMA store, left running (its wait is the next chunk's, just
                                    # before o_shared is written again), a sequence's partial last
                                    # chunk row by row
                                    T.tma_store_wait()
                                    T.copy(o_f, o_s)
                                    if eos - t0 >= C:
                                        T.fence_proxy_async()
                                        T.tma_copy(o_s, o[t0:t0 + C, i_hv, v0:v0 + BV])
                                    else:
                                        for i, j in T.Parallel(C, BV):
                                            if i < eos - t0:
                                                o[t0 + i, i_hv, v0 + j] = o_s[i, j]
                T.tma_store_wait()  # the last chunk's store has read o_shared before the CTA ends

            elif tx >= SCORES_END:  # ---- the producer warpgroup
                T.set_max_nreg(REGS_PRODUCER, 0)
                for c in T.serial(num_seq_chunks):
                    s = c % NUM_STAGES
                    t0 = bos + c * C
                    T.barrier_wait(bar_tiles_empty[s], (c // NUM_STAGES) % 2 ^ 1)
                    # full 64-row boxes; rows past the sequence end are masked by the consumers
                    T.tma_copy(q[t0:t0 + C, i_h, :], q_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(k[t0:t0 + C, i_h, :], k_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(v[t0:t0 + C, i_hv, v0:v0 + BV], v_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(ab[t0:t0 + C, i_hv, :], ab_s[s, :, :], barrier=bar_tiles_full[s])
                    # g <- log2(e) g_cum, rows past the end padded with the last real row, so every
                    # exponent (g_i - g_j with i >= j, g_C - g_i, g_i, g_C) is <= 0
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    # the row factors exp(g_i) and exp(g_C - g_i) (exp(g_C) is the last of the first)
                    for i in T.Parallel(C):
                        eg_s[s, i] = T.exp2(g_s[s, i])
                        egd_s[s, i] = T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_state_value


@functools.cache
def _wide(H: int, HV: int, K: int, V: int, BV: int):
    return compile_hopper(dependent_launch(fused_state_value_kernel(H, HV, K, V, BV)), S27.FUSED_CONFIGS)


@functools.cache
def _solve(H: int, HV: int, R: int):
    return compile_hopper(dependent_launch(gated_solve_kernel(H, HV, R)))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the solve storing WY at (16, 64), four heads a CTA, then the
    wide kernel at BV 64."""
    return _solve(16, 64, 4).get_kernel_source() + _wide(**DEFAULT_SHAPE, BV=64).get_kernel_source()


def prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms):
    """s30's prologue at three or four heads a CTA with this stage's solve: ab <- WY."""
    R = S30.SOLVE.BY_FORWARD.heads_per_cta(H, HV, chunks.shape[0], sms)
    assert R > S30.SOLVE.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS
    # g_cum, chunks, first_chunk <- the chunk-local cumsum of g and the chunk table
    S30.S29._cumsum(HV)(g, seqs, g_cum, chunks, first_chunk)
    # WY, gated <- s06's solve with the gate in its store
    _solve(H, HV, R)(k, beta, g_cum, chunks, ab, gated)


def stores_wy(q, v, cu_seqlens, cp) -> bool:
    """Whether the forward goes this stage's way: a wide launch (BV 64 or 128) that AutoCP leaves
    whole, after s06's solve (three or four heads a CTA). Host integers only (the lengths the API
    read once)."""
    B, T, H = q.shape[:3]
    HV, V = v.shape[2], v.shape[3]
    sms = autocp.num_sms(q.device)
    BV = S27.S18.PIPELINE.launch_width(cu_seqlens, B, T, HV, V, sms, STEP)
    R = S30.SOLVE.BY_FORWARD.heads_per_cta(H, HV, num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE), sms)
    return (BV >= 64 and R > S30.SOLVE.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS
            and S27.PIPELINE.split_plan(cu_seqlens, B, T, HV, sms, q.device, cp, STEP[BV]) is None)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s34's forward, with this stage's solve and wide kernel where ``stores_wy`` (``cp`` None
    decides, False never splits, True splits at the rule's cheapest L, an int is the segment length
    in chunks)."""
    if not stores_wy(q, v, cu_seqlens, cp):
        return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold)
    return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold,
                       prologue=prologue, fused=_wide)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s36: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s36: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s36: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s36: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
