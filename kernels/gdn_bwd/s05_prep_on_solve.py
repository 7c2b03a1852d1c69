"""gdn_bwd, stage 05: the backward's prep on the forward's solve, which now runs once, split or not.

What changed from s03: s03 (the library's backward) recomputes the forward's intermediates with
s02's prep, one launch per (chunk row, value head): the chunk-local cumsum, K K^T, then
Ai = (I + StrictLower(diag(beta) K K^T * Gamma))^-1 by forward substitution on the CUDA cores
(a lane pair a column), then w and u on wgmma. Where it splits it also runs the forward's solve
(gdn_fwd.s44's prologue, the program ``flashqla.fwd.solve`` runs) for the forward's warm-up, which
reads the gate-free Ab. This stage drops the prep: the forward's solve runs once, split or not,
and two kernels read what it makes (g_cum, the chunk table, Ab and the gated flags):

    wu         ``wu_kernel``: w = T_b diag(exp g) K, u = T_b V, with T_b = Ai diag(beta) =
               Gamma * Ab (Gamma_ij = exp(g_i - g_j), i >= j), or Ab itself for a chunk the solve
               flagged gated (some beta ||k||^2 > 2: its Ab is the gated inverse times diag(beta)).
               Gamma * Ab because K K^T * Gamma = D K K^T D^-1, D = diag(exp g). No K K^T, no
               substitution: loads, an elementwise T_b and two 64 x 128 x 64 wgmma.
    wy_bwd     ``wy_bwd_kernel``: wy_bwd.s01's gradients (dk', dv, dbeta, dg_cum') from Ab and the
               flags in Ai's place. Ai = T_b diag(1 / beta) would be 0 / 0 at a beta = 0 token;
               instead, with M = StrictLower(K K^T * Gamma) (A = diag(beta) M), Ai = I - T_b M
               (from Ai (I + diag(beta) M) = I), one more 64^3 product on the K K^T the kernel
               forms anyway, and dAi Ai^T = E diag(beta) Ai^T = E T_b^T with E = dW K'^T + dU V^T
               (K' = diag(exp g) K). Every other product and sum is s01's: dA = -Ai^T (E T_b^T),
               dk' = diag(beta exp g) Ai^T dW + (D + D^T) K, dv = diag(beta) Ai^T dU, dbeta, dg.
               Its float64 form is ``flashqla.reference.wy_bwd_ab`` (and ``chunk_w_u_ab`` the
               wu kernel's), equal to ``wy_bwd`` / ``chunk_w_u`` at 1e-12 with beta = 0 tokens
               and flagged chunks (tests/test_wy_from_solve.py).

Why: the recompute of g_cum, Ai, w and u is the backward's biggest chunk-parallel step (1.62 of
s01's 10.26 ms at (16, 64) 1 x 32768, H200, s01's docstring; s02's prep does the same work in one
kernel and was not timed alone since). It solves every chunk again by substitution on the CUDA
cores, where the forward's solve runs its block levels on mma.sync; and on the split path s03
paid for both.

Launch order (each step in an NVTX range gdn_bwd.s05.<name>, chunk_bwd_dqkwg.s01 in its own):

    solve           gdn_fwd.s44's prologue: g, seqs -> g_cum, the chunk table, first_chunk;
                    k, beta -> Ab, gated (one or two kernels, programmatic dependents)
    wu              k, v, g_cum, Ab, gated -> w, u (a programmatic dependent of the solve)
    -- split only (s03's plan and rule, unchanged):
    segment_states  gdn_fwd.s44's windows, warm-up and chain on the solve's outputs: h_j
    segment_grads   s03's backward windows, dh warm-up (on w and the solve's g_cum) and the
                    reverse chain: dht_j
    --
    walk            s02's, over the sequences or the segment rows: h, v_new, dh, dV~, dh0
    chunk_bwd_dqkwg.s01   q, k, v_new, g_cum, h, dV~, do, dh -> dq, dk, dw, dg_cum
    wy_bwd          this stage's: k, v, beta, Ab, gated, g_cum, dw, dV~ -> dk', dv, dbeta, dg_cum'
    finish          s02's: dg (reverse cumsum of dg_cum + dg_cum'), dk = dk + dk'

Threads, barriers and budgets (ptxas -v for sm_90a, nvcc 13.0, on the CPU machine, at H = 16,
HV = 32; shared memory as TileLang allocates it; no local memory, no spills in either kernel):

    wu       WARPGROUP threads a (chunk row, value head), no barrier but the CTA's; 109 registers
             (the 64 x 128 fp32 accumulator is 64 a thread), 49 KiB of shared memory (K, V, T_b,
             T_b diag(exp g), the output staging tile, some of them sharing addresses): four
             CTAs an SM. s02's prep: 109 registers, 57 KiB
    wy_bwd   THREADS = 2 warpgroups a (chunk row, key head), the value heads of the group in
             turn, each warpgroup half the columns of every product, dk' summed in registers;
             wy_bwd.s01's products plus Ai = I - T_b M; 224 registers (s01: 214), 141 KiB of
             shared memory (s01: 133; T_b's 8 KiB more, M borrows the tile of dAi Ai^T): one
             CTA an SM, as s01

Exponents: every exp2 argument is <= 0: g_i - g_j for j <= i (T_b, M, Gamma), g_i (w's decay:
exp(g_i) Ab_ij = Gamma_ij Ab_ij exp(g_j) for an ungated chunk; exp(g_j) for a gated one), for
g <= 0 as every stage assumes.

Precision against s03: T_b is Ab (bf16, the solve's store) times Gamma, rounded to bf16 once
more, where s03's prep rounded its fp32 substitution once; Ai = I - T_b M is formed on wgmma from
bf16 T_b and bf16 M and rounded to bf16, where s03 loaded the prep's bf16 Ai. Both enter the same
bf16 products after.

Measured effect: slower than s03 on every problem timed (one H100, commit c8873d0, ``python -m
flashqla bench --mode gdn_train``, CUDA-graph replay, FLA and FlashQLA in the same run,
``profiles/results/gdn_train_s05_s06.csv``; ms of the training step / of the backward alone):

    problem             s03              s05              s05's speed   FlashQLA
    (2, 8) 1x8192       0.634 / 0.522    0.655 / 0.536    0.97x s03     0.434
    (2, 8) 1x32768      1.885 / 1.627    2.010 / 1.755    0.94x         1.129
    (16, 64) 1x32768    10.847 / 9.625   12.132 / 10.939  0.89x         7.433
    (16, 64) 8x4096     10.828 / 9.677   12.031 / 10.974  0.90x         5.423

At (16, 64) the backward got 1.3 ms slower where the prep it replaces took 1.82 ms (torch.profiler,
commit 6bdfe52): the solve, wu and the larger wy_bwd together cost about 3.1 ms. The napkin math
expected less than the prep: wu moves about 1.9 GB at (16, 64) 32768 tokens (k, v, Ab in; w, u
out), 0.57 ms at 3.35 TB/s, and the solve writes 256 MiB of Ab. Which of the three kernels takes
the time is not measured yet (``profiles/bwd_breakdown_lab.py`` on this row is the next run).
Checked: ``tests/test_stages.py -k "gdn_bwd and s05" -m gpu`` passes on the 24 public problems
(one H100, c8873d0), and the bench checked every timed row against float64 first. Not run yet:
``tests/test_wy_from_solve.py -m gpu`` (beta = 0, flagged chunks, forced splits, determinism,
graph replay).

Taught in: not taught (lab log).
"""

import functools

import torch

from flashqla import autocp
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla.stages import load
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
# gdn_bwd_wu and wy_bwd_from_solve: the two new kernels; wgmma: their products; exp2f: the decays
SOURCE_MUST_CONTAIN = ("gdn_bwd_wu", "wy_bwd_from_solve", "wgmma", "exp2f")

S02 = load("gdn_bwd", 2)         # the walk and finish; chunk_bwd_dqkwg.s01
S03 = load("gdn_bwd", 3)         # the AutoCP plan and rule, the backward windows, dh warm-up, chain
S44 = S03.S44                    # the forward's solve (its prologue), windows, warm-up and chain
CHUNK_SIZE = S02.CHUNK_SIZE      # C = 64
HEAD_DIM = S02.HEAD_DIM          # K = V = 128
WARPGROUP = 128                  # the wu kernel
THREADS = 256                    # wy_bwd: two warpgroups, each owning half the columns
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}


def wu_kernel(H: int, HV: int):
    """k, v, g_cum, Ab, gated -> w, u per (chunk row, value head); any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_bwd_wu(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        ab: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # the solve's: row (t mod C) of Ab
        gated: T.Tensor((num_chunks, HV), "int32"),            # the solve's flags: Ab holds the gate
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        with T.Kernel(num_chunks, HV, threads=WARPGROUP) as (i_c, i_hv):
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64
            flag = T.alloc_var("int32")
            flag = gated[i_c, i_hv]

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            tu_shared = T.alloc_shared((BT, BT), "bfloat16")   # T_b = Ai diag(beta)
            tw_shared = T.alloc_shared((BT, BT), "bfloat16")   # T_b diag(exp(g))
            out_shared = T.alloc_shared((BT, K), "bfloat16")
            acc_frag = T.alloc_fragment((BT, K), "float32")
            # swizzled: the accumulator's 8-row stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            # K, V, log2(e) g <- rows of the chunk; zeros below row n
            for i, d in T.Parallel(BT, K):
                k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for i, d in T.Parallel(BT, V):
                v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
            for i in T.Parallel(BT):
                g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
            # T_b <- Gamma * Ab (a gated chunk: Ab), and T_b diag(exp(g)) = diag(exp(g)) Ab (gated:
            # Ab diag(exp(g))); lower incl. diagonal, rows < n, every exponent <= 0
            for i, j in T.Parallel(BT, BT):
                tu_shared[i, j] = T.if_then_else(
                    (j <= i) & (i < n),
                    ab[bos + i, i_hv, j] * T.if_then_else(flag != 0, 1.0, T.exp2(g_shared[i] - g_shared[j])), 0)
                tw_shared[i, j] = T.if_then_else(
                    (j <= i) & (i < n),
                    ab[bos + i, i_hv, j] * T.exp2(T.if_then_else(flag != 0, g_shared[j], g_shared[i])), 0)
            # the generic-proxy stores above must be visible to the wgmma (async proxy) reads below
            T.fence_proxy_async()

            # w <- (T_b diag(exp g)) K   (64 x 128 x 64, wgmma)
            T.gemm(tw_shared, k_shared, acc_frag, clear_accum=True)
            T.copy(acc_frag, out_shared)
            for i, d in T.Parallel(BT, K):
                if i < n:
                    w[bos + i, i_hv, d] = out_shared[i, d]
            # u <- T_b V   (64 x 128 x 64, wgmma)
            T.gemm(tu_shared, v_shared, acc_frag, clear_accum=True)
            T.copy(acc_frag, out_shared)
            for i, d in T.Parallel(BT, V):
                if i < n:
                    u[bos + i, i_hv, d] = out_shared[i, d]

    return gdn_bwd_wu


def wy_bwd_kernel(H: int, HV: int):
    """wy_bwd.s01's kernel on Ab and gated in Ai's place (the module doc): the T.prim_func for H
    key heads and HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value heads i_h * group .. i_h * group + group - 1 read key head i_h
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")      # rows of the chunk table (a bound for varlen)

    @T.prim_func
    def wy_bwd_from_solve(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        beta: T.Tensor((num_tokens, HV), "float32"),
        ab: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # the solve's: row (t mod C) of Ab
        gated: T.Tensor((num_chunks, HV), "int32"),            # the solve's flags: Ab holds the gate
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        dw: T.Tensor((num_tokens, HV, K), "bfloat16"),         # dL/dw
        du: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/du
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        dk: T.Tensor((num_tokens, H, K), "bfloat16"),
        dv: T.Tensor((num_tokens, HV, V), "bfloat16"),
        dbeta: T.Tensor((num_tokens, HV), "float32"),
        dg: T.Tensor((num_tokens, HV), "float32"),             # dL/dg_cum
    ):
        # chunks and key heads on one flat grid axis (x has no 65535 limit)
        with T.Kernel(num_chunks * H, threads=THREADS) as bx:
            i_h = bx % H
            i_c = bx // H
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length: 1..64, 0 for empty rows
            flag = T.alloc_var("int32")

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            dw_shared = T.alloc_shared((BT, K), "bfloat16")
            du_shared = T.alloc_shared((BT, V), "bfloat16")
            tb_shared = T.alloc_shared((BT, BT), "bfloat16")   # T_b = Ai diag(beta)
            ai_shared = T.alloc_shared((BT, BT), "bfloat16")   # Ai = I - T_b M
            dai_shared = T.alloc_shared((BT, BT), "bfloat16")  # E, strictly lower (dAi = E diag(beta))
            m_shared = T.alloc_shared((BT, BT), "bfloat16")    # M, then E T_b^T = dAi Ai^T
            d_shared = T.alloc_shared((BT, BT), "bfloat16")    # D = diag(beta) dA * Gamma
            e_shared = T.alloc_shared((BT, BT + 1), "float32")  # diag(beta) dA * M (odd row length:
            #                                                     its transposed reads hit 32 banks)
            out_shared = T.alloc_shared((BT, V), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            b_shared = T.alloc_shared((BT,), "float32")
            kk_frag = T.alloc_fragment((BT, BT), "float32")
            wk_frag = T.alloc_fragment((BT, BT), "float32")
            uv_frag = T.alloc_fragment((BT, BT), "float32")
            m_frag = T.alloc_fragment((BT, BT), "float32")
            acc = T.alloc_fragment((BT, K), "float32")
            dk_sum = T.alloc_fragment((BT, K), "float32")
            r_e = T.alloc_fragment((BT,), "float32")
            r_et = T.alloc_fragment((BT,), "float32")
            r_k = T.alloc_fragment((BT,), "float32")
            r_v = T.alloc_fragment((BT,), "float32")
            # swizzled: the accumulator's 8-row stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            if n > 0:
                # K <- k[bos : bos + n]; zeros below row n
                for i, d in T.Parallel(BT, K):
                    k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
                # KK <- K K^T   (64 x 64 x K, wgmma), shared by the group
                T.gemm(k_shared, k_shared, kk_frag, transpose_B=True, clear_accum=True)
                T.clear(dk_sum)

                for j in T.serial(group):
                    i_hv = i_h * group + j
                    flag = gated[i_c, i_hv]
                    # g <- log2(e) g_cum, beta; V, dW, dU <- rows of the chunk; zeros below row n
                    for i in T.Parallel(BT):
                        g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                        b_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
                    for i, d in T.Parallel(BT, V):
                        v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
                        dw_shared[i, d] = T.if_then_else(i < n, dw[bos + i, i_hv, d], 0)
                        du_shared[i, d] = T.if_then_else(i < n, du[bos + i, i_hv, d], 0)
                    # T_b <- Gamma * Ab (a gated chunk: Ab), lower incl. diagonal, rows < n;
                    # M <- StrictLower(K K^T * Gamma), rows < n (exponents <= 0)
                    for i, c in T.Parallel(BT, BT):
                        tb_shared[i, c] = T.if_then_else(
                            (c <= i) & (i < n),
                            ab[bos + i, i_hv, c] * T.if_then_else(flag != 0, 1.0, T.exp2(g_shared[i] - g_shared[c])), 0)
                        m_shared[i, c] = T.if_then_else(
                            (c < i) & (i < n), kk_frag[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)

                    # Ai <- I - T_b M = (I + diag(beta) M)^-1, rows < n   (64 x 64 x 64, wgmma)
                    T.gemm(tb_shared, m_shared, m_frag, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        ai_shared[i, c] = T.if_then_else(i < n, T.if_then_else(i == c, 1.0, 0.0) - m_frag[i, c], 0)

                    # E <- (dW K^T) diag(exp(g)) + dU V^T, strictly lower, rows < n
                    T.gemm(dw_shared, k_shared, wk_frag, transpose_B=True, clear_accum=True)
                    T.gemm(du_shared, v_shared, uv_frag, transpose_B=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        dai_shared[i, c] = T.if_then_else(
                            (c < i) & (i < n), wk_frag[i, c] * T.exp2(g_shared[c]) + uv_frag[i, c], 0)

                    # dAi Ai^T = E diag(beta) Ai^T = E T_b^T   (64 x 64 x 64, wgmma)
                    T.gemm(dai_shared, tb_shared, m_frag, transpose_B=True, clear_accum=True)
                    T.copy(m_frag, m_shared)
                    # from here wy_bwd.s01's: dA~ <- -(Ai^T (dAi Ai^T)) * Gamma, strictly lower, rows < n
                    T.gemm(ai_shared, m_shared, m_frag, transpose_A=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        m_frag[i, c] = T.if_then_else(
                            (c < i) & (i < n), -m_frag[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)
                    # D <- diag(beta) dA~;  E' <- dA~ * KK;  r_e <- rows of E'
                    for i, c in T.Parallel(BT, BT):
                        d_shared[i, c] = b_shared[i] * m_frag[i, c]
                        m_frag[i, c] = m_frag[i, c] * kk_frag[i, c]
                    T.reduce_sum(m_frag, r_e, dim=1)
                    # r_et <- columns of diag(beta) E' (rows of its transpose, through shared memory)
                    for i, c in T.Parallel(BT, BT):
                        e_shared[i, c] = b_shared[i] * m_frag[i, c]
                    for i, c in T.Parallel(BT, BT):
                        m_frag[i, c] = e_shared[c, i]
                    T.reduce_sum(m_frag, r_et, dim=1)

                    # dK += D K + D^T K   (64 x K x 64 each, D read transposed for the second)
                    T.gemm(d_shared, k_shared, acc, clear_accum=True)
                    T.gemm(d_shared, k_shared, acc, transpose_A=True)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d]

                    # X <- Ai^T dW;  dK += diag(beta exp(g)) X;  r_k <- rows of X * K
                    T.gemm(ai_shared, dw_shared, acc, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d] * (b_shared[i] * T.exp2(g_shared[i]))
                        acc[i, d] = acc[i, d] * k_shared[i, d]
                    T.reduce_sum(acc, r_k, dim=1)

                    # Y <- Ai^T dU;  dv <- diag(beta) Y (rows < n);  r_v <- rows of Y * V
                    T.gemm(ai_shared, du_shared, acc, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(BT, V):
                        out_shared[i, d] = acc[i, d] * b_shared[i]
                    for i, d in T.Parallel(BT, V):
                        if i < n:
                            dv[bos + i, i_hv, d] = out_shared[i, d]
                    for i, d in T.Parallel(BT, V):
                        acc[i, d] = acc[i, d] * v_shared[i, d]
                    T.reduce_sum(acc, r_v, dim=1)

                    # dbeta_i <- exp(g_i) r_k + r_v + r_e;  dg_i <- beta_i (exp(g_i) r_k + r_e) - r_et
                    for i in T.Parallel(BT):
                        if i < n:
                            dbeta[bos + i, i_hv] = T.exp2(g_shared[i]) * r_k[i] + r_v[i] + r_e[i]
                            dg[bos + i, i_hv] = (b_shared[i] * (T.exp2(g_shared[i]) * r_k[i] + r_e[i])
                                                 - r_et[i])

                # dk <- the group's sum, rows of the chunk
                T.copy(dk_sum, out_shared)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dk[bos + i, i_h, d] = out_shared[i, d]

    return wy_bwd_from_solve


@functools.cache
def _wu(H: int, HV: int):
    # a programmatic dependent of the solve before it (gdn_fwd.s27's launches)
    return compile_hopper(dependent_launch(wu_kernel(H, HV)))


@functools.cache
def _wy_bwd(H: int, HV: int):
    return compile_hopper(wy_bwd_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ of this stage's two new kernels, generated for sm_90a at the default shape."""
    return "\n".join((_wu(**DEFAULT_SHAPE).get_kernel_source(), _wy_bwd(**DEFAULT_SHAPE).get_kernel_source()))


def segment_states(p, k, v, g, beta, h0, g_cum, gated, ab):
    """s03's ``segment_states`` after the solve (which it no longer runs): every segment row's
    initial state h_seg [S, HV, K, V] fp32 by gdn_fwd.s44's windows, warm-up and chain, from the
    solve's g_cum, Ab and gated. k [B T, H, K], v [B T, HV, V] bf16; g, beta [B T, HV] fp32; h0
    [N, HV, K, V] fp32."""
    H, HV, K, V = k.shape[1], v.shape[1], k.shape[2], v.shape[2]
    device, N, J = k.device, h0.shape[0], p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
    exact = torch.empty_like(win_start)
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
    S44.S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                     p.slot_chunk, p.segment_chunks, float(autocp.THRESHOLD), win_start, exact)
    S44._warmup(H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk, exact, z, m)
    S44.S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
    return h_seg


def run(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE, cp=None):
    """(dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32, dh0
    [N, HV, K, V] fp32 or None); see the module doc. ``cp``: as s03's (None: its rule; False:
    never splits; True: its cheapest split; an int: the segment length in chunks)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_bwd.s05: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s05: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s05: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_bwd.s05: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    if not (cp is None or isinstance(cp, int)):
        raise ValueError(f"gdn_bwd.s05: `cp` must be None, True, False or a segment length in chunks; got {cp!r}")
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
    dqkwg = load(*S02.STEPS[0]).run
    with nvtx_range("gdn_bwd.s05"):
        # the forward's solve: g_cum, the chunk table, Ab and the gated flags
        g_cum = torch.empty(B * T, HV, **fp32)
        table = torch.empty(NT, 2, dtype=torch.int32, device=device)
        first_chunk = torch.empty(N + 1, dtype=torch.int32, device=device)
        ab = torch.empty(B * T, HV, CHUNK_SIZE, **bf16)
        gated = torch.empty(NT, HV, dtype=torch.int32, device=device)
        with nvtx_range("gdn_bwd.s05.solve"):
            S44.S43.prologue(False)(H, HV, k_flat, beta_flat, g_flat, seqs, g_cum, table, first_chunk, ab,
                                    gated, sms)
        # w, u from it (the forward's intermediates s02's prep recomputed)
        w = torch.empty(B * T, HV, K, **bf16)
        u = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s05.wu"):
            _wu(H, HV)(k_flat, v_flat, g_cum, ab, gated, table, w, u)
        if p is None:  # the walks over the sequences, from h0 and dht themselves
            bounds, rows_first, S = seqs, first_chunk, N
            h_rows = initial_state.to(**fp32).contiguous() if initial_state is not None else stand_in
            dht_rows = dht.to(**fp32).contiguous() if dht is not None else stand_in
            use_h0, use_dht = int(initial_state is not None), int(dht is not None)
        else:  # over the segment rows, from their own h_j and dht_j (s03's phases)
            bounds, rows_first, S = p.bounds, p.first_chunk, p.bounds.shape[0] - 1
            h0 = (initial_state.to(**fp32).contiguous() if initial_state is not None
                  else torch.zeros(N, HV, K, V, **fp32))
            with nvtx_range("gdn_bwd.s05.segment_states"):
                h_rows = segment_states(p, k_flat, v_flat, g_flat, beta_flat, h0, g_cum, gated, ab)
            with nvtx_range("gdn_bwd.s05.segment_grads"):
                dht_rows, _ = S03.segment_grads(p, q_flat, k_flat, w, do_flat, g_flat, beta_flat, g_cum,
                                                (g_cum, first_chunk, gated), dht, seqs, scale)
            use_h0, use_dht = 1, 1
        # s02's walk: h, v_new forward; dh, a dh0 per row, dV~ in reverse
        h = torch.empty(1, NT, HV, K, V, **bf16)
        dh = torch.empty(1, NT, HV, K, V, **bf16)
        v_new = torch.empty(B * T, HV, V, **bf16)
        dv2 = torch.empty(B * T, HV, V, **bf16)
        dh0_rows = torch.empty(S, HV, K, V, **fp32) if initial_state is not None else stand_in
        with nvtx_range("gdn_bwd.s05.walk"):
            S02._walk(H, HV)(q_flat, k_flat, w, u, do_flat, g_cum, bounds, rows_first, h_rows, use_h0,
                             dht_rows, use_dht, scale, h.view(NT, HV, K, V), v_new, dh.view(NT, HV, K, V),
                             dh0_rows, int(initial_state is not None), dv2)
        # the chunk-parallel gradients: s02's chunk_bwd_dqkwg.s01, this stage's wy_bwd
        as_bt = lambda x: x.view(B, T, *x.shape[1:])  # noqa: E731
        dq, dk_a, dw, dg_a = dqkwg(q, k, as_bt(v_new), as_bt(g_cum), h, as_bt(dv2), do, dh, scale,
                                   cu_seqlens, chunk_size)
        dk_b = torch.empty(B * T, H, K, **bf16)
        dv = torch.empty(B * T, HV, V, **bf16)
        dbeta, dg_b = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
        with nvtx_range("gdn_bwd.s05.wy_bwd"):
            _wy_bwd(H, HV)(k_flat, v_flat, beta_flat, ab, gated, g_cum, dw.view(B * T, HV, K), dv2, table,
                           dk_b, dv, dbeta, dg_b)
        dg = torch.empty(B * T, HV, **fp32)
        dk = torch.empty(B * T, H, K, **bf16)
        with nvtx_range("gdn_bwd.s05.finish"):
            S02._finish(H, HV)(dg_a.view(B * T, HV), dg_b, dk_a.view(B * T, H, K), dk_b, table, dg, dk)
    if initial_state is None:
        dh0 = None
    else:
        dh0 = dh0_rows if p is None else dh0_rows.index_select(0, p.row_of_slot[:N])
    return (dq, dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV), dbeta.view(B, T, HV), dh0)
