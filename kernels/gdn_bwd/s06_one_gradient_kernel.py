"""gdn_bwd, stage 06: the chunk-parallel gradients in one kernel, dw kept on chip.

What changed from s05: s05 ends with two chunk-parallel kernels and a finish, one CTA per (chunk
row, key head) each, walking the value heads of the group in turn:

    chunk_bwd_dqkwg.s01  q, k, v_new, g_cum, h, dV~, dO, dh        -> dq, dk_a, dw, dg_a
    wy_bwd (s05's)       k, v, beta, Ab, gated, g_cum, dw, du = dV~ -> dk_b, dv, dbeta, dg_b
    finish (s02's)       dg = reverse cumsum of dg_a + dg_b in each chunk;  dk = dk_a + dk_b

This stage runs them as ONE kernel, ``gradients_kernel``, on the same grid: per value head of the
group, chunk_bwd_dqkwg's products (part A), then, at once, wy_bwd's on the dW that part A left in
shared memory (part B). The group's dk is one fp32 sum in registers over both parts, a value
head's dg_cum the sum of both parts in shared memory, and its reverse cumsum runs in the kernel
before dg is stored: dw, dk_a, dk_b, dg_a and dg_b never reach HBM, and the finish is gone. The
math is s05's, product for product (``flashqla.reference.chunk_bwd_dqkwg``, then
``flashqla.reference.wy_bwd_ab``, then ``chunk_local_reverse_cumsum``), with three differences in
rounding: dk is rounded to bf16 once (s05: dk_a and dk_b each, then their sum); E = dW K'^T +
dU V^T accumulates dU V^T onto the column-scaled dW K^T in one wgmma accumulator (s05: two
fragments, then a sum); dg's reverse cumsum is TileLang's 1-D scan over the chunk where s02's
finish ran its 2-D one over (chunk, value heads), the same fp32 sums, perhaps in another order.

Why: measured per-kernel times of one training step (torch.profiler, one H100, the library's
backward = s03, commit 6bdfe52) on (16, 64) 8 x 4096: wy_bwd 2.21 ms, chunk_bwd_dqkwg 2.19,
finish 0.17 (walk 3.45, prep 1.82, which s05 replaces). Between the two kernels and the finish
pass bytes no gradient needs in HBM; napkin math at (16, 64), 32768 tokens (bf16 [T, HV, 128] =
512 MiB, bf16 [T, H, 128] = 128 MiB, fp32 [T, HV] = 8 MiB): dw written and read (1024 MiB);
dk_a, dk_b written and read by the finish (512 MiB); dg_a, dg_b likewise (32 MiB); k, g_cum and
dV~ read a second time (648 MiB): 2.3 GB, 0.69 ms at an H100's 3.35 TB/s peak, and one launch.
Both kernels ran at one CTA an SM; so does this one.

Launch order (each step in an NVTX range gdn_bwd.s06.<name>):

    solve, wu           s05's: g_cum, the chunk table, Ab, gated; w, u
    -- split only (s05's, so s03's plan and rule, unchanged):
    segment_states      h_j;   segment_grads: dht_j
    --
    walk                s02's, over the sequences or the segment rows: h, v_new, dh, dV~, dh0
    gradients           this stage's: q, k, v, v_new, g_cum, beta, Ab, gated, h, dV~, dO, dh ->
                        dq, dk, dv, dbeta, dg (the reverse cumsum included)

The kernel (``gradients_kernel``): THREADS = 2 warpgroups a (chunk row, key head), each owning
half the columns of every product (TileLang's split of a 64-row wgmma). Q, K, K K^T (fp32, in
shared memory) once; then per value head of the group:

    loads     S, dS' by TMA (one mbarrier, parity = the head's index mod 2) while the plain loads
              of g, beta, dO, V~, dV~ run
    part A    chunk_bwd_dqkwg.s01's products in its order (dO V~^T, dO S^T + dP K, V~ dS'^T,
              dP^T Q), its row sums and <S, dS'>; then dW = -dV~ S^T, moved last so that dW is
              written over dO, which is dead by then; part A's dg_cum into shared memory
    part B    s05's wy_bwd: V over V~ (dead), T_b, M, Ai = I - T_b M, E, E T_b^T, dA~, D, the
              transposed row sums, D K + D^T K, Ai^T dW, Ai^T dU; dv staged over dW (dead after
              Ai^T dW) and stored; dbeta stored; part B's dg_cum added to part A's (one thread a
              row, shared memory only: the fragments' rows are held by several threads), reverse
              cumsum in shared memory, dg stored
    after the group: dq, dk (fp32 sums over the group, dk over both parts) staged over dO, stored

Shared memory (offsets as TileLang 0.1.15 places them, the same at every public layout; its
planner gives no two buffers one address inside the value-head loop, so the reuse is by hand:
one buffer of the right shape holds, in turn, what the list says):

    dh, s          2 x 32 KiB     dS', S (TMA), part A
    e              16.25 KiB      diag(beta) dA~ * K K^T, fp32, rows of 65 (transposed reads on
                                  32 banks), part B
    b, dg, g, last 4 x 256 B      beta; dg_cum -> its reverse cumsum; log2(e) g_cum; dg_C's terms,
                                  then part B's dg_cum
    do             16 KiB         dO (A) -> dW (end of A, read by E and Ai^T dW) -> dv staging (B)
                                  -> dq, dk staging (after the group)
    du             16 KiB         dV~ = dL/du, both parts
    k, q           2 x 16 KiB     K, Q of the key head
    kk             16 KiB         K K^T, fp32, the whole group
    vn             16 KiB         V~ (A, to V~ dS'^T) -> V (B)
    ai, dai, dp,   5 x 8 KiB      Ai; E; dP (A) -> D = diag(beta) dA~ * Gamma (B); M -> E T_b^T;
    m, tb                         T_b (part B but dP)
    workspaces     8 x 1 KiB      TileLang's, one per reduce_sum

    230,656 B dynamic + 1 KiB static = 226.25 KiB of the 227 KiB an SM allows: one CTA an SM
    (s05's kernels: chunk_bwd_dqkwg.s01 177 KiB, wy_bwd 141 KiB)

Registers (ptxas -v, nvcc 13.0, sm_90a, launch bounds (256, 1), every public layout): 255, the
most a thread can have at 256 threads. At (16, 16) (one value head a key head, no loop) no
spills; with 2-4 value heads a key head 72-84 bytes of spill stores and loads: ptxas hoists the
wgmma descriptors (64 bits per operand buffer and orientation) out of the value-head loop as
invariants; at (16, 64) it stores eight of them and four 32-bit scalars once before the loop and
loads each once a value head (LDL near part B's first products); no fragment is spilled. The
fp32 fragments that live across the group are the dq and dk sums, 2 x 32 a thread; within a
head the 64 x 128 accumulator (32) and one 64 x 64 (16). (s05's kernels: chunk_bwd_dqkwg.s01
255, wy_bwd 224, neither spills.)

Exponents: as s05's two kernels (every exp2 argument <= 0: g_i, g_i - g_j for j <= i, g_C - g_i
for real rows); rows >= n of every tile are zero and never stored; an empty chunk row does
nothing.

Measured effect: slower than s05 and s03 on every problem timed (one H100, commit c8873d0,
``python -m flashqla bench --mode gdn_train``, CUDA-graph replay, FLA and FlashQLA in the same run,
``profiles/results/gdn_train_s05_s06.csv``; ms of the training step / of the backward alone):

    problem             s05              s06              s06's speed   FlashQLA
    (2, 8) 1x8192       0.655 / 0.536    0.681 / 0.563    0.96x s05     0.434
    (2, 8) 1x32768      2.010 / 1.755    2.154 / 1.898    0.93x         1.129
    (16, 64) 1x32768    12.132 / 10.939  12.895 / 11.803  0.94x         7.433
    (16, 64) 8x4096     12.031 / 10.974  12.901 / 11.799  0.93x         5.423

The fusion saved the HBM round trips (about 0.69 ms of bytes at (16, 64), above) and a launch, and
still lost 0.8-0.9 ms at (16, 64). Not measured yet is where (``profiles/bwd_breakdown_lab.py`` on
this row, then Nsight Compute on the kernel); the likely causes, from its build: one CTA of 8 warps
an SM runs part A and part B of every value head back to back, so nothing hides a product's or a
load's latency behind another CTA's, as the two kernels' grids did with their loads and stores
between launches; and the loop's descriptor reloads at 255 registers. Checked
(one H100, c8873d0): ``tests/test_stages.py -k "gdn_bwd and s06" -m gpu`` passes on the 24 public
problems, and dq, dv and dh0 are bitwise s05's on each of them (``tests/test_one_gradient_kernel.py
-k bitwise_s05 -m gpu``); the bench checked every timed row against float64 first. Not run yet:
the rest of ``tests/test_one_gradient_kernel.py -m gpu`` (beta = 0, flagged chunks, determinism,
graph replay).

Taught in: not taught (lab log).
"""

import functools

import torch

from flashqla import autocp
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.stages import load
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
# gdn_bwd_gradients: the fused kernel; wgmma: its products; tma_load: S and dS'; exp2f: the decays
SOURCE_MUST_CONTAIN = ("gdn_bwd_gradients", "wgmma", "tma_load", "exp2f")

S05 = load("gdn_bwd", 5)         # the solve, wu, the split path, the walk (s02's)
S03 = S05.S03
S02 = S05.S02
S44 = S05.S44
CHUNK_SIZE = S05.CHUNK_SIZE      # C = 64
HEAD_DIM = S05.HEAD_DIM          # K = V = 128
THREADS = 256                    # two warpgroups, each owning half the columns of every product
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}


def gradients_kernel(H: int, HV: int):
    """chunk_bwd_dqkwg.s01 and s05's wy_bwd in one kernel (the module doc): the T.prim_func for H
    key heads and HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value heads i_h * group .. i_h * group + group - 1 read key head i_h
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")      # rows of the chunk table, of h and of dh

    @T.prim_func
    def gdn_bwd_gradients(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        beta: T.Tensor((num_tokens, HV), "float32"),
        ab: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # the solve's: row (t mod C) of Ab
        gated: T.Tensor((num_chunks, HV), "int32"),            # the solve's flags: Ab holds the gate
        h: T.Tensor((num_chunks, HV, K, V), "bfloat16"),       # state entering each chunk
        dv2: T.Tensor((num_tokens, HV, V), "bfloat16"),        # dL/dv_new = dL/du
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        dh: T.Tensor((num_chunks, HV, K, V), "bfloat16"),      # dL/d(state leaving each chunk)
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        scale: T.float32,
        dq: T.Tensor((num_tokens, H, K), "bfloat16"),
        dk: T.Tensor((num_tokens, H, K), "bfloat16"),
        dv: T.Tensor((num_tokens, HV, V), "bfloat16"),
        dbeta: T.Tensor((num_tokens, HV), "float32"),
        dg: T.Tensor((num_tokens, HV), "float32"),             # dL/dg (the reverse cumsum taken)
    ):
        # chunks and key heads on one flat grid axis (x has no 65535 limit)
        with T.Kernel(num_chunks * H, threads=THREADS) as bx:
            i_h = bx % H
            i_c = bx // H
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length: 1..64, 0 for empty rows
            flag = T.alloc_var("int32")

            q_shared = T.alloc_shared((BT, K), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            s_shared = T.alloc_shared((K, V), "bfloat16")       # S
            dh_shared = T.alloc_shared((K, V), "bfloat16")      # dS'
            do_shared = T.alloc_shared((BT, V), "bfloat16")     # dO -> dW -> dv staging -> dq, dk staging
            vn_shared = T.alloc_shared((BT, V), "bfloat16")     # V~ -> V
            du_shared = T.alloc_shared((BT, V), "bfloat16")     # dV~ = dL/du
            dp_shared = T.alloc_shared((BT, BT), "bfloat16")    # dP -> D = diag(beta) dA~ * Gamma
            tb_shared = T.alloc_shared((BT, BT), "bfloat16")    # T_b = Ai diag(beta)
            ai_shared = T.alloc_shared((BT, BT), "bfloat16")    # Ai = I - T_b M
            dai_shared = T.alloc_shared((BT, BT), "bfloat16")   # E, strictly lower (dAi = E diag(beta))
            m_shared = T.alloc_shared((BT, BT), "bfloat16")     # M -> E T_b^T = dAi Ai^T
            e_shared = T.alloc_shared((BT, BT + 1), "float32")  # diag(beta) dA~ * K K^T (odd row
            #                                                     length: its transposed reads hit 32 banks)
            g_shared = T.alloc_shared((BT,), "float32")
            b_shared = T.alloc_shared((BT,), "float32")
            last_shared = T.alloc_shared((BT,), "float32")
            dg_shared = T.alloc_shared((BT,), "float32")
            kk_shared = T.alloc_shared((BT, BT), "float32")     # K K^T, the whole group
            p_frag = T.alloc_fragment((BT, BT), "float32")      # dO V~^T; then part B's 64 x 64 products
            acc = T.alloc_fragment((BT, K), "float32")
            dq_sum = T.alloc_fragment((BT, K), "float32")
            dk_sum = T.alloc_fragment((BT, K), "float32")
            r_q = T.alloc_fragment((BT,), "float32")
            r_ki = T.alloc_fragment((BT,), "float32")
            r_kp = T.alloc_fragment((BT,), "float32")
            r_s = T.alloc_fragment((BT,), "float32")
            r_e = T.alloc_fragment((BT,), "float32")
            r_et = T.alloc_fragment((BT,), "float32")
            r_k = T.alloc_fragment((BT,), "float32")
            r_v = T.alloc_fragment((BT,), "float32")
            g_last = T.alloc_local((1,), "float32")
            dg_last = T.alloc_local((1,), "float32")
            loaded = T.alloc_barrier(THREADS)                  # the S and dS' TMA loads landed

            if n > 0:
                # Q, K <- q[bos : bos + n], k[bos : bos + n]; zeros below row n
                for i, d in T.Parallel(BT, K):
                    q_shared[i, d] = T.if_then_else(i < n, q[bos + i, i_h, d], 0)
                    k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
                # KK <- K K^T   (64 x 64 x K, wgmma), shared by the group
                T.gemm(k_shared, k_shared, p_frag, transpose_B=True, clear_accum=True)
                T.copy(p_frag, kk_shared)
                T.clear(dq_sum)
                T.clear(dk_sum)

                for j in T.serial(group):
                    i_hv = i_h * group + j
                    flag = gated[i_c, i_hv]
                    T.sync_threads()  # the previous head's reads of every tile are done
                    # S, dS' <- whole 128 x 128 tiles (TMA, one barrier for both), while the
                    # plain loads below run
                    T.tma_copy(h[i_c, i_hv, :, :], s_shared, barrier=loaded)
                    T.tma_copy(dh[i_c, i_hv, :, :], dh_shared, barrier=loaded)
                    T.barrier_arrive(loaded)
                    # g <- log2(e) g_cum, beta; dO, V~, dV~ <- rows of the chunk; zeros below row n
                    for i in T.Parallel(BT):
                        g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                        b_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
                    for i, d in T.Parallel(BT, V):
                        do_shared[i, d] = T.if_then_else(i < n, do[bos + i, i_hv, d], 0)
                        vn_shared[i, d] = T.if_then_else(i < n, v_new[bos + i, i_hv, d], 0)
                        du_shared[i, d] = T.if_then_else(i < n, dv2[bos + i, i_hv, d], 0)
                    g_last[0] = g_shared[n - 1]
                    T.mbarrier_wait_parity(loaded, j % 2)

                    # ---- part A: chunk_bwd_dqkwg.s01's products, dW last ----
                    # dP <- scale (dO V~^T * Gamma), lower incl. diagonal, real rows (exponent <= 0)
                    T.gemm(do_shared, vn_shared, p_frag, transpose_B=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        dp_shared[i, c] = T.if_then_else(
                            (c <= i) & (i < n), scale * p_frag[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)

                    # dQ_v <- scale diag(exp(g)) dO S^T + dP K;  dQ += dQ_v;  r_q <- rows of dQ_v * Q
                    T.gemm(do_shared, s_shared, acc, transpose_B=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        acc[i, d] = acc[i, d] * (scale * T.exp2(g_shared[i]))
                    T.gemm(dp_shared, k_shared, acc)
                    for i, d in T.Parallel(BT, K):
                        dq_sum[i, d] = dq_sum[i, d] + acc[i, d]
                        acc[i, d] = acc[i, d] * q_shared[i, d]
                    T.reduce_sum(acc, r_q, dim=1)

                    # dK_i <- diag(exp(g_C - g)) V~ dS'^T (rows < n);  dK += dK_i;  r_ki <- rows of dK_i * K
                    T.gemm(vn_shared, dh_shared, acc, transpose_B=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        acc[i, d] = T.if_then_else(i < n, acc[i, d] * T.exp2(g_last[0] - g_shared[i]), 0)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d]
                        acc[i, d] = acc[i, d] * k_shared[i, d]
                    T.reduce_sum(acc, r_ki, dim=1)

                    # dK_p <- dP^T Q   (64 x K x 64, dP read transposed);  dK += dK_p;  r_kp <- rows of dK_p * K
                    T.gemm(dp_shared, q_shared, acc, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d]
                        acc[i, d] = acc[i, d] * k_shared[i, d]
                    T.reduce_sum(acc, r_kp, dim=1)

                    # r_s <- rows of S * dS' (rows d and d + 64 of the tiles paired): <S, dS'> = sum r_s
                    for i, d in T.Parallel(BT, V):
                        acc[i, d] = (T.cast(s_shared[i, d], "float32") * T.cast(dh_shared[i, d], "float32")
                                     + T.cast(s_shared[i + BT, d], "float32")
                                     * T.cast(dh_shared[i + BT, d], "float32"))
                    T.reduce_sum(acc, r_s, dim=1)
                    # dg_C's terms: sum_i k_i.dK_i + exp(g_C) <S, dS'>
                    for i in T.Parallel(BT):
                        last_shared[i] = r_ki[i] + T.exp2(g_last[0]) * r_s[i]

                    # dW <- -dV~ S^T   (64 x K x V, wgmma), over dO (its last reader was dO S^T)
                    T.gemm(du_shared, s_shared, acc, transpose_B=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        do_shared[i, d] = -acc[i, d]
                    dg_last[0] = 0
                    for i in T.serial(BT):
                        dg_last[0] = dg_last[0] + last_shared[i]
                    # part A's dg_cum: q_i.dq_i - k_i.dk_i, and dg_C at the last real row; rows < n
                    for i in T.Parallel(BT):
                        dg_shared[i] = T.if_then_else(
                            i < n, r_q[i] - r_ki[i] - r_kp[i] + T.if_then_else(i == n - 1, dg_last[0], 0), 0)

                    # ---- part B: s05's wy_bwd on dW (do_shared) and dU = dV~ (du_shared) ----
                    # V <- rows of the chunk, over V~ (its last reader was V~ dS'^T); zeros below row n
                    for i, d in T.Parallel(BT, V):
                        vn_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
                    # T_b <- Gamma * Ab (a gated chunk: Ab), lower incl. diagonal, rows < n;
                    # M <- StrictLower(K K^T * Gamma), rows < n (exponents <= 0)
                    for i, c in T.Parallel(BT, BT):
                        tb_shared[i, c] = T.if_then_else(
                            (c <= i) & (i < n),
                            ab[bos + i, i_hv, c] * T.if_then_else(flag != 0, 1.0, T.exp2(g_shared[i] - g_shared[c])), 0)
                        m_shared[i, c] = T.if_then_else(
                            (c < i) & (i < n), kk_shared[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)

                    # Ai <- I - T_b M = (I + diag(beta) M)^-1, rows < n   (64 x 64 x 64, wgmma)
                    T.gemm(tb_shared, m_shared, p_frag, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        ai_shared[i, c] = T.if_then_else(i < n, T.if_then_else(i == c, 1.0, 0.0) - p_frag[i, c], 0)

                    # E <- (dW K^T) diag(exp(g)) + dU V^T (one accumulator), strictly lower, rows < n
                    T.gemm(do_shared, k_shared, p_frag, transpose_B=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        p_frag[i, c] = p_frag[i, c] * T.exp2(g_shared[c])
                    T.gemm(du_shared, vn_shared, p_frag, transpose_B=True)
                    for i, c in T.Parallel(BT, BT):
                        dai_shared[i, c] = T.if_then_else((c < i) & (i < n), p_frag[i, c], 0)

                    # dAi Ai^T = E diag(beta) Ai^T = E T_b^T   (64 x 64 x 64, wgmma), over M
                    T.gemm(dai_shared, tb_shared, p_frag, transpose_B=True, clear_accum=True)
                    T.copy(p_frag, m_shared)
                    # dA~ <- -(Ai^T (dAi Ai^T)) * Gamma, strictly lower, rows < n
                    T.gemm(ai_shared, m_shared, p_frag, transpose_A=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        p_frag[i, c] = T.if_then_else(
                            (c < i) & (i < n), -p_frag[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)
                    # D <- diag(beta) dA~ (over dP);  E' <- dA~ * KK;  r_e <- rows of E'
                    for i, c in T.Parallel(BT, BT):
                        dp_shared[i, c] = b_shared[i] * p_frag[i, c]
                        p_frag[i, c] = p_frag[i, c] * kk_shared[i, c]
                    T.reduce_sum(p_frag, r_e, dim=1)
                    # r_et <- columns of diag(beta) E' (rows of its transpose, through shared memory)
                    for i, c in T.Parallel(BT, BT):
                        e_shared[i, c] = b_shared[i] * p_frag[i, c]
                    for i, c in T.Parallel(BT, BT):
                        p_frag[i, c] = e_shared[c, i]
                    T.reduce_sum(p_frag, r_et, dim=1)

                    # dK += D K + D^T K   (64 x K x 64 each, D read transposed for the second)
                    T.gemm(dp_shared, k_shared, acc, clear_accum=True)
                    T.gemm(dp_shared, k_shared, acc, transpose_A=True)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d]

                    # X <- Ai^T dW;  dK += diag(beta exp(g)) X;  r_k <- rows of X * K
                    T.gemm(ai_shared, do_shared, acc, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d] * (b_shared[i] * T.exp2(g_shared[i]))
                        acc[i, d] = acc[i, d] * k_shared[i, d]
                    T.reduce_sum(acc, r_k, dim=1)

                    # Y <- Ai^T dU;  dv <- diag(beta) Y (rows < n, staged over dW);  r_v <- rows of Y * V
                    T.gemm(ai_shared, du_shared, acc, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(BT, V):
                        do_shared[i, d] = acc[i, d] * b_shared[i]
                    for i, d in T.Parallel(BT, V):
                        if i < n:
                            dv[bos + i, i_hv, d] = do_shared[i, d]
                    for i, d in T.Parallel(BT, V):
                        acc[i, d] = acc[i, d] * vn_shared[i, d]
                    T.reduce_sum(acc, r_v, dim=1)

                    # dbeta_i <- exp(g_i) r_k + r_v + r_e;  part B's dg_cum (over the dg_C terms):
                    # beta_i (exp(g_i) r_k + r_e) - r_et;  rows < n
                    for i in T.Parallel(BT):
                        if i < n:
                            dbeta[bos + i, i_hv] = T.exp2(g_shared[i]) * r_k[i] + r_v[i] + r_e[i]
                        last_shared[i] = T.if_then_else(
                            i < n, b_shared[i] * (T.exp2(g_shared[i]) * r_k[i] + r_e[i]) - r_et[i], 0)
                    # dg_cum <- part A's + part B's (one thread a row: shared memory only)
                    for i in T.Parallel(BT):
                        dg_shared[i] = dg_shared[i] + last_shared[i]
                    # dg_t <- sum over the chunk's rows s >= t of dg_cum_s
                    T.cumsum(dg_shared, dim=0, reverse=True)
                    for i in T.Parallel(BT):
                        if i < n:
                            dg[bos + i, i_hv] = dg_shared[i]

                # dq, dk <- the group's sums, rows of the chunk, staged over dv's staging
                T.copy(dq_sum, do_shared)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dq[bos + i, i_h, d] = do_shared[i, d]
                T.copy(dk_sum, do_shared)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dk[bos + i, i_h, d] = do_shared[i, d]

    return gdn_bwd_gradients


@functools.cache
def _gradients(H: int, HV: int):
    return compile_hopper(gradients_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ of this stage's one new kernel, generated for sm_90a at the default shape."""
    return _gradients(**DEFAULT_SHAPE).get_kernel_source()


def run(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE, cp=None):
    """(dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32, dh0
    [N, HV, K, V] fp32 or None); see the module doc. ``cp``: as s03's (None: its rule; False:
    never splits; True: its cheapest split; an int: the segment length in chunks)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_bwd.s06: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s06: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s06: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_bwd.s06: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    if not (cp is None or isinstance(cp, int)):
        raise ValueError(f"gdn_bwd.s06: `cp` must be None, True, False or a segment length in chunks; got {cp!r}")
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
    N, NT = seqs.shape[0] - 1, num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE)
    sms = autocp.num_sms(device)
    p = S03.split_plan(cu_seqlens, B, T, HV, sms, device, cp)
    stand_in = torch.empty(1, HV, K, V, **fp32)  # for an absent h0 / dht / dh0: never read or written
    with nvtx_range("gdn_bwd.s06"):
        # s05's: the forward's solve (g_cum, the chunk table, Ab, the gated flags), then w, u
        g_cum = torch.empty(B * T, HV, **fp32)
        table = torch.empty(NT, 2, dtype=torch.int32, device=device)
        first_chunk = torch.empty(N + 1, dtype=torch.int32, device=device)
        ab = torch.empty(B * T, HV, CHUNK_SIZE, **bf16)
        gated = torch.empty(NT, HV, dtype=torch.int32, device=device)
        with nvtx_range("gdn_bwd.s06.solve"):
            S44.S43.prologue(False)(H, HV, k_flat, beta_flat, g_flat, seqs, g_cum, table, first_chunk, ab,
                                    gated, sms)
        w = torch.empty(B * T, HV, K, **bf16)
        u = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s06.wu"):
            S05._wu(H, HV)(k_flat, v_flat, g_cum, ab, gated, table, w, u)
        if p is None:  # the walks over the sequences, from h0 and dht themselves
            bounds, rows_first, S = seqs, first_chunk, N
            h_rows = initial_state.to(**fp32).contiguous() if initial_state is not None else stand_in
            dht_rows = dht.to(**fp32).contiguous() if dht is not None else stand_in
            use_h0, use_dht = int(initial_state is not None), int(dht is not None)
        else:  # over the segment rows, from their own h_j and dht_j (s03's phases)
            bounds, rows_first, S = p.bounds, p.first_chunk, p.bounds.shape[0] - 1
            h0 = (initial_state.to(**fp32).contiguous() if initial_state is not None
                  else torch.zeros(N, HV, K, V, **fp32))
            with nvtx_range("gdn_bwd.s06.segment_states"):
                h_rows = S05.segment_states(p, k_flat, v_flat, g_flat, beta_flat, h0, g_cum, gated, ab)
            with nvtx_range("gdn_bwd.s06.segment_grads"):
                dht_rows, _ = S03.segment_grads(p, q_flat, k_flat, w, do_flat, g_flat, beta_flat, g_cum,
                                                (g_cum, first_chunk, gated), dht, seqs, scale)
            use_h0, use_dht = 1, 1
        # s02's walk: h, v_new forward; dh, a dh0 per row, dV~ in reverse
        h = torch.empty(NT, HV, K, V, **bf16)
        dh = torch.empty(NT, HV, K, V, **bf16)
        v_new = torch.empty(B * T, HV, V, **bf16)
        dv2 = torch.empty(B * T, HV, V, **bf16)
        dh0_rows = torch.empty(S, HV, K, V, **fp32) if initial_state is not None else stand_in
        with nvtx_range("gdn_bwd.s06.walk"):
            S02._walk(H, HV)(q_flat, k_flat, w, u, do_flat, g_cum, bounds, rows_first, h_rows, use_h0,
                             dht_rows, use_dht, scale, h, v_new, dh, dh0_rows, int(initial_state is not None),
                             dv2)
        # this stage's kernel: every chunk-parallel gradient, dg's reverse cumsum included
        dq = torch.empty(B * T, H, K, **bf16)
        dk = torch.empty(B * T, H, K, **bf16)
        dv = torch.empty(B * T, HV, V, **bf16)
        dbeta, dg = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
        with nvtx_range("gdn_bwd.s06.gradients"):
            _gradients(H, HV)(q_flat, k_flat, v_flat, v_new, g_cum, beta_flat, ab, gated, h, dv2, do_flat, dh,
                              table, scale, dq, dk, dv, dbeta, dg)
    if initial_state is None:
        dh0 = None
    else:
        dh0 = dh0_rows if p is None else dh0_rows.index_select(0, p.row_of_slot[:N])
    return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
            dbeta.view(B, T, HV), dh0)
