"""gdn_bwd, stage 02: both state walks in one launch, dv_local folded into the reverse walk.

What it adds over s01, the previous milestone: fusion and overlap. The forward state walk and the
reverse walk run side by side in one launch, dv_local is computed inside the reverse walk, and the
preparation and the last sums are one kernel each: five launches where s01 ran nine and about
fifteen small PyTorch kernels. Why: on few heads s01's two sequential walks, one after the other,
were 3.1 of its 4.0 ms on (2, 8) 1 x 32768. The library's backward (``flashqla.bwd``).

What it computes: the same as stage 01 (``flashqla.reference.chunk_gated_delta_rule_bwd_ref``),
the gradients dq, dk, dv, dg, dbeta, dh0 of <dO, o> + <dht, final state>, recomputing the
forward's intermediates from its inputs. Five kernels, where s01 ran nine and about fifteen small
PyTorch kernels (the profiler's count):

    prep     g, k, v, beta                -> g_cum, Ai, w, u        (one kernel, below)
    walk     forward role:  k, w, u, h0   -> h, v_new               (one launch, both walks)
             reverse role:  q, k, w, dO, dht -> dh, dh0, dV~ (= du)
    chunk_bwd_dqkwg.s01  q, k, v_new, h, dV~, dh -> dq, dk, dw, dg_cum
    wy_bwd.s01           k, v, beta, Ai, dw, du  -> dk', dv, dbeta, dg_cum'
    finish   dg_cum + dg_cum', dk + dk'   -> dg (reverse cumsum per chunk), dk  (one kernel)

What changed from s01, and why:

* The two sequential walks run in ONE launch. The forward state walk (chunk_h: needs w, u) and
  the reverse walk (chunk_bwd_dhu: needs w, q, k, dO) do not depend on each other, so the grid
  holds 2 x (sequences x value heads x 2 V tiles) CTAs and blockIdx.y picks the role. With few
  heads each walk alone fills a fraction of the SMs (16 CTAs at (2, 8)) and s01 ran them one
  after the other (3.1 of its 4.0 ms there, by s01's docstring); here they run side by side.
* dv_local is computed inside the reverse walk, which loads K, Q and dO anyway: per chunk
  B = K Q^T, P^T = scale (B * Gamma^T, upper incl. diagonal), dV~ = diag(exp(g_C - g)) K dS' +
  P^T dO, with K Q^T and Q^T dO' issued together with K dS' and waited for once. The reverse walk
  now walks the chunks once, in reverse, and dV~_loc never reaches HBM (nor is rounded to bf16).
* The walk is warp-specialized by hand (TileLang's automatic producer/consumer split handles one
  pipelined loop per kernel, and here there are two roles): a producer warpgroup TMA-loads each
  chunk's tiles into two stages and fills the gates, a consumer warpgroup keeps the fp32 state
  (or its gradient) in registers; mbarriers full / empty per stage. The two roles share the same
  shared-memory tiles (k, w, a third 64 x 128 tile for q, one 64 x 64 tile for u or dO).
* h and dh have as many rows as the device-built chunk table (an upper bound for varlen), so no
  run reads ``cu_seqlens`` on the host: s01's chunk_h and chunk_bwd_dhu each synchronized once.
* The preparation is one kernel: the chunk-local cumsum of g (a warp scan), K K^T, A, the
  column substitution of chunk_fwd_intra.s01 for Ai = (I + A)^-1, w and u, writing g_cum, Ai
  (wy_bwd needs it) and w, u. A is never stored.
* The last step, dg = per-chunk reverse cumsum of dg_cum + dg_cum' and dk = dk + dk', is one small
  kernel instead of a dozen PyTorch ops.

Exponents: every exp2 takes a non-positive, log2(e)-scaled argument: g_cum (<= 0), g_i - g_j for
j <= i inside a chunk, g_C - g_i; the gates of rows past a sequence's end are padded with its last
real gate, and those rows are zeroed by selects before they can reach a stored value.

Measured effect (one H200, profiles/gdn_bwd_s01_lab.py --only bwd: CUDA events, median of 20,
kernels by the PyTorch profiler; s01 and FLA 0.6.0's autograd backward in the same run). The
first build, on (16, 64) 1 x 32768, took 15.89 ms against 10.21 for s01 and 11.44 for FLA, with
two defects found afterwards in its SASS and fixed here:

    prep  6.11 ms: a TIR loop over the four warps left the substitution's y[] in local memory
          (2583 LDL/STL); the loop is unrolled in Python now: no LDL/STL, 109 registers, as
          chunk_fwd_intra.s01, whose code this is plus the g scan and the Ai store
    walk  5.19 ms, more than s01's chunk_h, dv_local and dhu together (1.45 + 0.55 + 1.53): a
          flat grid over both roles made TileLang inline a 64-bit software remainder (bx mod a
          runtime count) into every address, 43 calls in the SASS; the role is blockIdx.y now
          and none are left

Unchanged since that run: finish 0.13 ms where s01's PyTorch dk sum and reverse cumsum took
0.75 ms; chunk_bwd_dqkwg.s01 2.10 ms and wy_bwd.s01 2.14 ms. The fixed build passes the GPU
tests (24 of 24). Timed as a training step after the promoted forward (``python -m flashqla bench
--mode gdn_train``, H200, 18 problems of six head configurations, profiles/results/gdn_train.csv):
0.73-1.28x FLA's autograd step (geomean 1.03x); 1.05-3.78x s01's, but s01's rows are timed with
events (its host synchronization fails graph capture), so launch gaps count there; on (16, 64) 1 x 32768 12.23 ms against s01 12.82, FLA 15.41
and FlashQLA 7.01. Behind FLA on the 1 x 8192 problems and on (16, 16), (4, 16), (2, 8) 1 x 32768:
few (sequence, head) pairs leave each walk a few dozen CTAs. The walk keeps 1 CTA per SM (145 KiB of shared
memory, 184 registers), so at (16, 64) its 256 CTAs run in two waves and only few-head problems
overlap the two walks.

Taught in: notebooks/07_backward.py.
"""

import functools

import torch

from flashqla.hopper import HOPPER_TARGET, compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.stages import load
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# tma_load: the walk's tiles (cp.async.bulk.tensor); wgmma_rs: P^T dO with P^T in registers;
# __shfl_xor_sync: the halves of each row sum of the prep's column substitution; CumSum: the
# chunk-local scans (g -> g_cum in the prep, reverse for dg in the finish)
SOURCE_MUST_CONTAIN = ("tma_load", "wgmma_rs", "__shfl_xor_sync", "CumSum1D", "CumSum2D")

STEPS = (("chunk_bwd_dqkwg", 1), ("wy_bwd", 1))
CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V = 128 only
BV = 64               # V columns of the state per walk CTA
WARPGROUP = 128
STAGES = 2            # the walk's tile stages: chunk c + 1 loads while chunk c computes
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def prep_kernel(H: int, HV: int):
    """g, k, v, beta -> g_cum, Ai, w, u per (chunk row, value head); any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_bwd_prep(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g: T.Tensor((num_tokens, HV), "float32"),              # per-token log decay
        beta: T.Tensor((num_tokens, HV), "float32"),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        g_cum: T.Tensor((num_tokens, HV), "float32"),
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of (I + A)^-1
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        with T.Kernel(num_chunks, HV, threads=WARPGROUP) as (i_c, i_hv):
            t = T.get_thread_binding()
            c = 16 * (t // 32) + t % 16                        # warp w solves columns 16w..16w+15
            half = (t // 16) % 2                               # which half of each row sum
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            beta_shared = T.alloc_shared((BT,), "float32")
            A_shared = T.alloc_shared((BT, BT), "float32")
            Ai_shared = T.alloc_shared((BT, BT), "bfloat16")   # (I + A)^-1
            Aik_shared = T.alloc_shared((BT, BT), "bfloat16")  # Ai diag(beta exp(g_cum))
            Aiv_shared = T.alloc_shared((BT, BT), "bfloat16")  # Ai diag(beta)
            out_shared = T.alloc_shared((BT, K), "bfloat16")
            A_frag = T.alloc_fragment((BT, BT), "float32")
            acc_frag = T.alloc_fragment((BT, K), "float32")
            y = T.alloc_local((BT // 2,), "float32")          # this half's x_j of column c
            acc = T.alloc_local((4,), "float32")               # four partial sums of a row
            part = T.alloc_local((1,), "float32")
            # swizzled: the accumulator's 8-row stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            # K, V <- rows of the chunk; g, beta <- rows of the chunk; zeros below row n
            for i, d in T.Parallel(BT, K):
                k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for i, d in T.Parallel(BT, V):
                v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
            for i in T.Parallel(BT):
                g_shared[i] = T.if_then_else(i < n, g[bos + i, i_hv], 0)
                beta_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
            # g_cum <- cumsum of g inside the chunk (rows >= n carry the last real value)
            T.cumsum(g_shared, dim=0)
            for i in T.Parallel(BT):
                if i < n:
                    g_cum[bos + i, i_hv] = g_shared[i]
                g_shared[i] = g_shared[i] * LOG2E              # exp(x) = exp2(log2(e) x) below

            # A <- StrictLower(diag(beta) K K^T * Gamma), rows < n (exponent g_i - g_j <= 0), fp32
            T.gemm(k_shared, k_shared, A_frag, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                A_shared[i, j] = T.if_then_else(
                    (j < i) & (i < n), beta_shared[i] * A_frag[i, j] * T.exp2(g_shared[i] - g_shared[j]), 0)

            # x <- (I + A)^-1 e_c by forward substitution, x_i = [i == c] - sum_{j < i} A_ij x_j,
            # from the warp's first column on (x_j = 0 above it). Lanes l and l ^ 16 share column
            # c: half h keeps x_j for the blocks of 4 rows with (j / 4) mod 2 = h, in y[s] with
            # j = 8 (s / 4) + 4 h + s mod 4, sums its half of every row in four chains, and one
            # shuffle adds the other half. x_j not found yet are 0, so whole blocks are summed.
            for s in T.unroll(BT // 2):
                y[s] = 0.0
            for warp, first in enumerate((0, 16, 32, 48)):  # unrolled here: constant loop bounds
                if t // 32 == warp:
                    for i in T.unroll(first, BT):
                        for q in T.unroll(4):
                            acc[q] = 0.0
                        for b in T.unroll(first // 8, BT // 8):
                            if 8 * b < i:
                                for q in T.unroll(4):
                                    acc[q] = acc[q] + A_shared[i, 8 * b + 4 * half + q] * y[4 * b + q]
                        part[0] = (acc[0] + acc[1]) + (acc[2] + acc[3])
                        part[0] = T.if_then_else(i == c, 1.0, 0.0) - (part[0] + T.shfl_xor(part[0], 16))
                        y[4 * (i // 8) + i % 4] = T.if_then_else(half == (i // 4) % 2, part[0],
                                                                 y[4 * (i // 8) + i % 4])
            # column c of Ai, of Ai diag(beta exp(g_cum)) and of Ai diag(beta), each half its rows
            for s in T.unroll(BT // 2):
                Ai_shared[8 * (s // 4) + 4 * half + s % 4, c] = y[s]
                Aik_shared[8 * (s // 4) + 4 * half + s % 4, c] = y[s] * (beta_shared[c] * T.exp2(g_shared[c]))
                Aiv_shared[8 * (s // 4) + 4 * half + s % 4, c] = y[s] * beta_shared[c]
            # the generic-proxy stores above must be visible to the wgmma (async proxy) reads below
            T.fence_proxy_async()

            # Ai[bos + i] <- row i, rows of the chunk
            for i, j in T.Parallel(BT, BT):
                if i < n:
                    Ai[bos + i, i_hv, j] = Ai_shared[i, j]
            # w <- (Ai diag(beta exp(g_cum))) K   (64 x 128 x 64, wgmma)
            T.gemm(Aik_shared, k_shared, acc_frag, clear_accum=True)
            T.copy(acc_frag, out_shared)
            for i, d in T.Parallel(BT, K):
                if i < n:
                    w[bos + i, i_hv, d] = out_shared[i, d]
            # u <- (Ai diag(beta)) V   (64 x 128 x 64, wgmma)
            T.gemm(Aiv_shared, v_shared, acc_frag, clear_accum=True)
            T.copy(acc_frag, out_shared)
            for i, d in T.Parallel(BT, V):
                if i < n:
                    u[bos + i, i_hv, d] = out_shared[i, d]

    return gdn_bwd_prep


def walk_kernel(H: int, HV: int, BV: int):
    """Both state walks in one grid: blockIdx.y = 0 walks forward, 1 in reverse, blockIdx.x picks
    (sequence, value head, tile of BV value columns of the state)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    NVT = V // BV
    group = HV // H  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # N + 1
    num_rows = T.dynamic("num_rows")          # rows of h and dh (the chunk table's)
    num_h0 = T.dynamic("num_h0")              # N, or 1 (unread) without an initial state
    num_ht = T.dynamic("num_ht")              # N, or 1 (unread) without dht
    num_dh0 = T.dynamic("num_dh0")            # N, or 1 (unwritten) without dh0

    @T.prim_func
    def gdn_bwd_walk(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the sequences
        first_chunk: T.Tensor((num_bounds,), "int32"),         # row of h / dh of each chunk 0
        h0: T.Tensor((num_h0, HV, K, V), "float32"),
        use_h0: T.int32,
        dht: T.Tensor((num_ht, HV, K, V), "float32"),          # dL/d final state
        use_dht: T.int32,
        scale: T.float32,
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),         # state entering each chunk
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
        dh: T.Tensor((num_rows, HV, K, V), "bfloat16"),        # dL/d(state leaving each chunk)
        dh0: T.Tensor((num_dh0, HV, K, V), "float32"),         # dL/d initial state
        store_dh0: T.int32,
        dv2: T.Tensor((num_tokens, HV, V), "bfloat16"),        # dL/dv_new
    ):
        # x: (sequence, value head, V tile), V tiles adjacent; y: the role, forward walks first.
        # (A flat axis over both roles needs bx mod a runtime count: a 64-bit software remainder,
        # which TileLang inlined into every address computation of the walk.)
        with T.Kernel((num_bounds - 1) * HV * NVT, 2, threads=2 * WARPGROUP) as (bx, role):
            i_v = bx % NVT
            i_hv = (bx // NVT) % HV
            i_n = bx // (NVT * HV)
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            num_c = T.ceildiv(eos - bos, BT)

            # tile stages, producer -> consumer; g holds log2(e) g_cum, rows past the end padded
            k_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            w_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            q_s = T.alloc_shared((STAGES, BT, K), "bfloat16")   # reverse walk only
            x_s = T.alloc_shared((STAGES, BT, BV), "bfloat16")  # U (forward) or dO (reverse)
            g_s = T.alloc_shared((STAGES, BT), "float32")
            # consumer only
            s_s = T.alloc_shared((K, BV), "bfloat16")           # S or dS' in bf16: operand, h / dh row
            a_s = T.alloc_shared((BT, BV), "bfloat16")          # diag(exp(g_C - g)) V~, or dO'
            b_s = T.alloc_shared((BT, BV), "bfloat16")          # -dV~ (reverse walk)
            s_f = T.alloc_fragment((K, BV), "float32")          # S or dS', fp32, all along
            x_f = T.alloc_fragment((BT, BV), "float32")         # V~ or dV~
            kq_f = T.alloc_fragment((BT, BT), "float32")        # K Q^T (reverse walk)
            p_f = T.alloc_fragment((BT, BT), "bfloat16")        # P^T (reverse walk)
            bar_full = T.alloc_barrier([WARPGROUP] * STAGES)    # producer -> consumer (+ TMA bytes)
            bar_empty = T.alloc_barrier([WARPGROUP] * STAGES)   # consumer -> producer

            tx = T.get_thread_binding()
            if tx < WARPGROUP:  # ---- the consumer warpgroup
                if role == 0:  # forward walk (chunk_h)
                    # S <- h0[n] (or 0)
                    if use_h0 != 0:
                        T.copy(h0[i_n, i_hv, :, v0:v0 + BV], s_f)
                    else:
                        T.clear(s_f)
                    for it in T.serial(num_c):
                        st = it % STAGES
                        t0 = bos + it * BT
                        n = T.min(eos - t0, BT)                  # real rows of the chunk, 1..64
                        T.barrier_wait(bar_full[st], (it // STAGES) % 2)
                        # h[row0 + it] <- S (bf16), plain 16-byte stores from the operand copy
                        T.copy(s_f, s_s)
                        T.copy(s_s, h[row0 + it, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})
                        # V~ <- U - W S   (64 x BV x K, wgmma), rows >= n zeroed
                        T.gemm(w_s[st, :, :], s_s, x_f, clear_accum=True)
                        for i, j in T.Parallel(BT, BV):
                            x_f[i, j] = T.if_then_else(i < n, x_s[st, i, j] - x_f[i, j], 0)
                        for i, j in T.Parallel(BT, BV):
                            if i < n:
                                v_new[t0 + i, i_hv, v0 + j] = x_f[i, j]
                        for i, j in T.Parallel(BT, BV):
                            a_s[i, j] = x_f[i, j] * T.exp2(g_s[st, BT - 1] - g_s[st, i])
                        # S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~   (K x BV x 64, wgmma)
                        for d, j in T.Parallel(K, BV):
                            s_f[d, j] = s_f[d, j] * T.exp2(g_s[st, BT - 1])
                        T.gemm(k_s[st, :, :], a_s, s_f, transpose_A=True)
                        T.barrier_arrive(bar_empty[st])
                else:  # reverse walk (chunk_bwd_dv_local + chunk_bwd_dhu)
                    # dS' <- dht[n] (or 0)
                    if use_dht != 0:
                        T.copy(dht[i_n, i_hv, :, v0:v0 + BV], s_f)
                    else:
                        T.clear(s_f)
                    for it in T.serial(num_c):
                        c = num_c - 1 - it                       # chunks from the last one back
                        st = it % STAGES
                        t0 = bos + c * BT
                        n = T.min(eos - t0, BT)
                        T.barrier_wait(bar_full[st], (it // STAGES) % 2)
                        # dh[row0 + c] <- dS' (bf16)
                        T.copy(s_f, s_s)
                        T.copy(s_s, dh[row0 + c, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})
                        # dO' <- scale diag(exp(g)) dO, rows >= n zeroed
                        for i, j in T.Parallel(BT, BV):
                            a_s[i, j] = T.if_then_else(i < n, x_s[st, i, j] * (scale * T.exp2(g_s[st, i])), 0)
                        # X <- K dS';  dS <- exp(g_C) dS' + Q^T dO';  B <- K Q^T: one wait for all
                        for d, j in T.Parallel(K, BV):
                            s_f[d, j] = s_f[d, j] * T.exp2(g_s[st, BT - 1])
                        T.wgmma_gemm(k_s[st, :, :], s_s, x_f, clear_accum=True)
                        T.wgmma_gemm(q_s[st, :, :], a_s, s_f, transpose_A=True)
                        T.gemm(k_s[st, :, :], q_s[st, :, :], kq_f, transpose_B=True, clear_accum=True)
                        # P^T[j, i] <- scale B[j, i] exp(g_i - g_j) for j <= i < n, else 0
                        for j, i in T.Parallel(BT, BT):
                            p_f[j, i] = T.if_then_else(
                                (j <= i) & (i < n), scale * kq_f[j, i] * T.exp2(g_s[st, i] - g_s[st, j]), 0)
                        # dV~ <- diag(exp(g_C - g)) X + P^T dO   (64 x BV x 64, P^T from registers)
                        for i, j in T.Parallel(BT, BV):
                            x_f[i, j] = x_f[i, j] * T.exp2(g_s[st, BT - 1] - g_s[st, i])
                        T.gemm(p_f, x_s[st, :, :], x_f)
                        # dv2 <- dV~, rows < n; -dV~ (rows >= n: 0) to shared for W^T
                        for i, j in T.Parallel(BT, BV):
                            x_f[i, j] = T.if_then_else(i < n, x_f[i, j], 0)
                        for i, j in T.Parallel(BT, BV):
                            if i < n:
                                dv2[t0 + i, i_hv, v0 + j] = x_f[i, j]
                        for i, j in T.Parallel(BT, BV):
                            b_s[i, j] = -x_f[i, j]
                        # dS <- dS + W^T (-dV~)   (K x BV x 64, wgmma, W read transposed)
                        T.gemm(w_s[st, :, :], b_s, s_f, transpose_A=True)
                        T.barrier_arrive(bar_empty[st])
                    # dh0[n] <- dS
                    if store_dh0 != 0:
                        T.copy(s_f, dh0[i_n, i_hv, :, v0:v0 + BV])
            else:  # ---- the producer warpgroup: full 64-row boxes (rows >= n masked by the consumer)
                if role == 0:
                    for it in T.serial(num_c):
                        st = it % STAGES
                        t0 = bos + it * BT
                        T.barrier_wait(bar_empty[st], (it // STAGES) % 2 ^ 1)
                        T.tma_copy(k[t0:t0 + BT, i_h, :], k_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(w[t0:t0 + BT, i_hv, :], w_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(u[t0:t0 + BT, i_hv, v0:v0 + BV], x_s[st, :, :], barrier=bar_full[st])
                        for i in T.Parallel(BT):
                            g_s[st, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                        T.barrier_arrive(bar_full[st])
                else:
                    for it in T.serial(num_c):
                        st = it % STAGES
                        t0 = bos + (num_c - 1 - it) * BT
                        T.barrier_wait(bar_empty[st], (it // STAGES) % 2 ^ 1)
                        T.tma_copy(k[t0:t0 + BT, i_h, :], k_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(q[t0:t0 + BT, i_h, :], q_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(w[t0:t0 + BT, i_hv, :], w_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(do[t0:t0 + BT, i_hv, v0:v0 + BV], x_s[st, :, :], barrier=bar_full[st])
                        for i in T.Parallel(BT):
                            g_s[st, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                        T.barrier_arrive(bar_full[st])

    return gdn_bwd_walk


def finish_kernel(H: int, HV: int):
    """dg <- per-chunk reverse cumsum of dg_a + dg_b;  dk <- dk_a + dk_b; one CTA per chunk row."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K = CHUNK_SIZE, HEAD_DIM
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_bwd_finish(
        dg_a: T.Tensor((num_tokens, HV), "float32"),           # dL/dg_cum, two parts
        dg_b: T.Tensor((num_tokens, HV), "float32"),
        dk_a: T.Tensor((num_tokens, H, K), "bfloat16"),        # dL/dk, two parts
        dk_b: T.Tensor((num_tokens, H, K), "bfloat16"),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),
        dg: T.Tensor((num_tokens, HV), "float32"),
        dk: T.Tensor((num_tokens, H, K), "bfloat16"),
    ):
        with T.Kernel(num_chunks, threads=WARPGROUP) as i_c:
            bos = chunk_bounds[i_c, 0]
            n = chunk_bounds[i_c, 1] - bos
            d_shared = T.alloc_shared((BT, HV), "float32")
            # dg_t <- sum over the chunk's tokens s >= t of (dg_a + dg_b)_s
            for i, j in T.Parallel(BT, HV):
                d_shared[i, j] = T.if_then_else(i < n, dg_a[bos + i, j] + dg_b[bos + i, j], 0)
            T.cumsum(d_shared, dim=0, reverse=True)
            for i, j in T.Parallel(BT, HV):
                if i < n:
                    dg[bos + i, j] = d_shared[i, j]
            # dk <- dk_a + dk_b (fp32 sum, one rounding)
            for i, hh, d in T.Parallel(BT, H, K):
                if i < n:
                    dk[bos + i, hh, d] = (T.cast(dk_a[bos + i, hh, d], "float32")
                                          + T.cast(dk_b[bos + i, hh, d], "float32"))

    return gdn_bwd_finish


@functools.cache
def _prep(H: int, HV: int):
    return compile_hopper(prep_kernel(H, HV))


@functools.cache
def _walk(H: int, HV: int):
    import tilelang

    # the producer and consumer branches run at the same time: TileLang's shared-memory planner,
    # which sees them one after the other, must not give two of their buffers one address
    return tilelang.compile(walk_kernel(H, HV, BV), target=HOPPER_TARGET,
                            pass_configs={"tl.disable_shared_memory_reuse": True})


@functools.cache
def _finish(H: int, HV: int):
    return compile_hopper(finish_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ of the three kernels, generated for sm_90a at the default shape (no GPU needed)."""
    return "\n".join(f(**DEFAULT_SHAPE).get_kernel_source() for f in (_prep, _walk, _finish))


def run(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE):
    """(dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32, dh0
    [N, HV, K, V] fp32 or None); see the module doc. No host synchronization."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_bwd.s02: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s02: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s02: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_bwd.s02: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    fp32 = {"device": device, "dtype": torch.float32}
    q_flat, k_flat = (x.to(**bf16).contiguous().view(B * T, H, K) for x in (q, k))
    v_flat, do_flat = (x.to(**bf16).contiguous().view(B * T, HV, V) for x in (v, do))
    g_flat, beta_flat = (x.to(**fp32).contiguous().view(B * T, HV) for x in (g, beta))
    bounds = seq_bounds(cu_seqlens, B, T, device)
    table, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N, NT = bounds.shape[0] - 1, table.shape[0]
    dh0 = torch.empty(N, HV, K, V, **fp32) if initial_state is not None else None
    if B * T == 0:  # no tokens: every gradient is empty, and dL/dh0 = dht
        if dh0 is not None:
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                torch.zeros(B, T, HV, **fp32), torch.zeros(B, T, HV, **fp32), dh0)
    dqkwg, wy = (load(op, number).run for op, number in STEPS)
    stand_in = torch.empty(1, HV, K, V, **fp32)  # for an absent h0 / dht / dh0: never read or written
    with nvtx_range("gdn_bwd.s02"):
        # the forward's intermediates, recomputed: g_cum, Ai, w, u
        g_cum = torch.empty(B * T, HV, **fp32)
        Ai = torch.empty(B * T, HV, CHUNK_SIZE, **bf16)
        w = torch.empty(B * T, HV, K, **bf16)
        u = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s02.prep"):
            _prep(H, HV)(k_flat, v_flat, g_flat, beta_flat, table, g_cum, Ai, w, u)
        # both walks: h, v_new forward; dh, dh0, dV~ in reverse
        h = torch.empty(1, NT, HV, K, V, **bf16)
        dh = torch.empty(1, NT, HV, K, V, **bf16)
        v_new = torch.empty(B * T, HV, V, **bf16)
        dv2 = torch.empty(B * T, HV, V, **bf16)
        h0 = initial_state.to(**fp32).contiguous() if initial_state is not None else stand_in
        dht_in = dht.to(**fp32).contiguous() if dht is not None else stand_in
        with nvtx_range("gdn_bwd.s02.walk"):
            _walk(H, HV)(q_flat, k_flat, w, u, do_flat, g_cum, bounds, first_chunk,
                         h0, int(initial_state is not None), dht_in, int(dht is not None), scale,
                         h.view(NT, HV, K, V), v_new, dh.view(NT, HV, K, V),
                         dh0 if dh0 is not None else stand_in, int(dh0 is not None), dv2)
        # the chunk-parallel gradients
        as_bt = lambda x: x.view(B, T, *x.shape[1:])  # noqa: E731
        dq, dk_a, dw, dg_a = dqkwg(q, k, as_bt(v_new), as_bt(g_cum), h, as_bt(dv2), do, dh, scale,
                                   cu_seqlens, chunk_size)
        dk_b, dv, dbeta, dg_b = wy(k, v, beta, as_bt(Ai), as_bt(g_cum), dw, as_bt(dv2), cu_seqlens,
                                   chunk_size)
        dg = torch.empty(B * T, HV, **fp32)
        dk = torch.empty(B * T, H, K, **bf16)
        with nvtx_range("gdn_bwd.s02.finish"):
            _finish(H, HV)(dg_a.view(B * T, HV), dg_b.view(B * T, HV), dk_a.view(B * T, H, K),
                           dk_b.view(B * T, H, K), table, dg, dk)
    return dq, dk.view(B, T, H, K), dv, dg.view(B, T, HV), dbeta, dh0
