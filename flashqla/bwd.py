"""The promoted backward: the TileLang kernels that train ``flashqla.chunk_gated_delta_rule`` on SM90.

Promoted from ``kernels/gdn_bwd/s01_separate_kernels.py`` (1.12x FLA's backward on (H, HV) =
(16, 64), 1 x 32768 tokens, 0.83x on (2, 8); see its docstring): each kernel below is a copy,
unchanged, of the stage it names, and ``tests/test_promoted.py`` asserts that it builds the same
TileLang program. The forward's chunk-local cumsum is the one of ``flashqla.fwd``. Like FLA, the
backward keeps nothing from the forward but its inputs and recomputes the rest:

    chunk_local_cumsum.s01   g                         -> g_cum        (flashqla.fwd's kernel)
    chunk_kkt.s02            k, g_cum, beta            -> A
    kkt_solve.s01            A                         -> Ai           (wy_bwd needs it)
    chunk_w_u.s01            k, v, beta, Ai, g_cum     -> w, u
    chunk_h.s01              k, w, u, g_cum, h0        -> h, v_new
    chunk_bwd_dv_local.s01   q, k, dO, g_cum           -> dV~_loc
    chunk_bwd_dhu.s01        q, k, w, g_cum, dht, dO   -> dh, dh0, dV~ (= du)
    chunk_bwd_dqkwg.s01      q, k, v_new, h, dV~, dh   -> dq, dk, dw, dg_cum
    wy_bwd.s01               k, v, beta, Ai, dw, du    -> dk', dv, dbeta, dg_cum'
    reverse cumsum           dg_cum + dg_cum'          -> dg           (PyTorch on the device)

``backward`` launches them, each in an NVTX range ``bwd.<kernel>``, with no host synchronization,
so that a training step can be captured in a CUDA graph: h and dh get the chunk table's row count
(``flashqla.varlen``; for varlen a bound, whose rows past the real chunks chunk_h and
chunk_bwd_dhu never write and chunk_bwd_dqkwg, whose CTAs for them have no tokens, never reads).
"""

import torch

from flashqla.fwd import CHUNK_SIZE, HEAD_DIM, LOG2E, THREADS, _compiled, chunk_local_cumsum_kernel
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

BV = 64               # V columns of the state (chunk_h) or of its gradient (chunk_bwd_dhu) per CTA
TWO_WG_THREADS = 256  # chunk_bwd_dqkwg, wy_bwd: two warpgroups, each owning half the columns


# ---- promoted from kernels/chunk_kkt/s02_device_chunk_table.py
def chunk_kkt_kernel(H: int, HV: int, K: int):
    """The T.prim_func for H key heads, HV value heads, head dim K; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT = CHUNK_SIZE
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def chunk_kkt_fwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        beta: T.Tensor((num_tokens, HV), "float32"),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        A: T.Tensor((num_tokens, HV, BT), "float32"),          # row (t mod C) of each chunk's A
    ):
        with T.Kernel(num_chunks, HV, threads=THREADS) as (i_c, i_hv):
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 1..64

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            beta_shared = T.alloc_shared((BT,), "float32")
            A_fragment = T.alloc_fragment((BT, BT), "float32")

            # K <- k[bos : bos + n], zeros below row n (explicit loads; rows >= n would be the
            # next sequence's tokens)
            for i, d in T.Parallel(BT, K):
                k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            # g <- log2(e) g_cum (so that exp(x) = exp2(log2(e) x)), beta <- beta; zeros below row n
            for i in T.Parallel(BT):
                g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                beta_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)

            # A <- K K^T   (64 x 64 x K, bf16 in, fp32 accumulate: wgmma)
            T.gemm(k_shared, k_shared, A_fragment, transpose_B=True, clear_accum=True)

            # A <- StrictLower(diag(beta) A * Gamma); the exponent is taken only where j < i,
            # where g_cum_i - g_cum_j <= 0 (g <= 0), so it never overflows
            for i, j in T.Parallel(BT, BT):
                A_fragment[i, j] = T.if_then_else(
                    j < i, beta_shared[i] * A_fragment[i, j] * T.exp2(g_shared[i] - g_shared[j]), 0)

            # A[bos + i] <- row i, for the chunk's own n rows only
            for i, j in T.Parallel(BT, BT):
                if i < n:
                    A[bos + i, i_hv, j] = A_fragment[i, j]

    return chunk_kkt_fwd


# ---- promoted from kernels/kkt_solve/s01_column_substitution.py
def kkt_solve_kernel(HV: int):
    """The T.prim_func for HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT = CHUNK_SIZE
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def kkt_solve_fwd(
        A: T.Tensor((num_tokens, HV, BT), "float32"),          # row (t mod C) of each chunk's A
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of (I + A)^-1
    ):
        with T.Kernel(num_chunks, HV, threads=BT) as (i_c, i_hv):
            c = T.get_thread_binding()                         # this thread's column
            bos = chunk_bounds[i_c, 0]
            n = chunk_bounds[i_c, 1] - bos                     # chunk length, 0..64

            A_shared = T.alloc_shared((BT, BT), "float32")
            Ai_shared = T.alloc_shared((BT, BT), "bfloat16")
            x = T.alloc_local((BT,), "float32")
            acc = T.alloc_local((4,), "float32")               # four partial sums of a row

            # A <- A[bos : bos + n], zero rows below n (identity rows of I + A)
            for i, j in T.Parallel(BT, BT):
                A_shared[i, j] = T.if_then_else(i < n, A[bos + i, i_hv, j], 0)

            # x <- (I + A)^-1 e_c: x_i = [i == c] - sum_{j < i} A_ij x_j, rows from the warp's
            # first column on (x_j = 0 above it); the sum runs in four chains (j mod 4) that
            # meet at the end of the row, and ptxas merges the four reads of A into one LDS.128
            for i in T.unroll(BT):
                x[i] = 0.0
            for first in (0, 32):
                if c // 32 == first // 32:
                    for i in T.unroll(first, BT):
                        for q in T.unroll(4):
                            acc[q] = 0.0
                        for j in T.unroll(first, BT):
                            if j < i:
                                acc[j % 4] = acc[j % 4] + A_shared[i, j] * x[j]
                        x[i] = T.if_then_else(i == c, 1.0, 0.0) - ((acc[0] + acc[1]) + (acc[2] + acc[3]))
            # Ai[:, c] <- x (bf16)
            for i in T.unroll(BT):
                Ai_shared[i, c] = x[i]

            # Ai[bos + i] <- row i, for the chunk's own n rows only
            for i, j in T.Parallel(BT, BT):
                if i < n:
                    Ai[bos + i, i_hv, j] = Ai_shared[i, j]

    return kkt_solve_fwd


# ---- promoted from kernels/chunk_w_u/s01_wgmma.py
def chunk_w_u_kernel(H: int, HV: int):
    """The T.prim_func for H key heads, HV value heads, K = V = 128; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def chunk_w_u_fwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        beta: T.Tensor((num_tokens, HV), "float32"),
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of (I + A)^-1
        g_cum: T.Tensor((num_tokens, HV), "float32"),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        with T.Kernel(num_chunks, HV, threads=THREADS) as (i_c, i_hv):
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]
            n = chunk_bounds[i_c, 1] - bos                     # chunk length, 0..64

            Ai_shared = T.alloc_shared((BT, BT), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            out_shared = T.alloc_shared((BT, K), "bfloat16")
            kscale_shared = T.alloc_shared((BT,), "float32")
            vscale_shared = T.alloc_shared((BT,), "float32")
            acc = T.alloc_fragment((BT, K), "float32")
            # swizzled: the accumulator's 8-row stmatrix stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            # kscale_i <- beta_i exp(g_cum_i), vscale_i <- beta_i; zeros below row n
            for i in T.Parallel(BT):
                kscale_shared[i] = T.if_then_else(
                    i < n, beta[bos + i, i_hv] * T.exp2(g_cum[bos + i, i_hv] * LOG2E), 0)
                vscale_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
            # Ai <- Ai[bos : bos + n]; diag(kscale) K and diag(vscale) V in bf16; zeros below row n
            for i, j in T.Parallel(BT, BT):
                Ai_shared[i, j] = T.if_then_else(i < n, Ai[bos + i, i_hv, j], 0)
            for i, d in T.Parallel(BT, K):
                k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d] * kscale_shared[i], 0)
            for i, d in T.Parallel(BT, V):
                v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d] * vscale_shared[i], 0)

            # w <- Ai diag(beta exp(g_cum)) K   (64 x 128 x 64, wgmma)
            T.gemm(Ai_shared, k_shared, acc, clear_accum=True)
            T.copy(acc, out_shared)
            for i, d in T.Parallel(BT, K):
                if i < n:
                    w[bos + i, i_hv, d] = out_shared[i, d]

            # u <- Ai diag(beta) V   (64 x 128 x 64, wgmma)
            T.gemm(Ai_shared, v_shared, acc, clear_accum=True)
            T.copy(acc, out_shared)
            for i, d in T.Parallel(BT, V):
                if i < n:
                    u[bos + i, i_hv, d] = out_shared[i, d]

    return chunk_w_u_fwd


# ---- promoted from kernels/chunk_h/s01_wgmma_pipelined.py
def chunk_h_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token, sequence or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # N + 1
    num_rows = T.dynamic("num_rows")          # real chunks, rows of h
    num_h0 = T.dynamic("num_h0")              # N, or 1 (unread) without an initial state
    num_ht = T.dynamic("num_ht")              # N, or 1 (unwritten) without a final state

    @T.prim_func
    def chunk_h_fwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the sequences
        first_chunk: T.Tensor((num_bounds,), "int32"),         # row of h of each sequence's chunk 0
        h0: T.Tensor((num_h0, HV, K, V), "float32"),
        use_h0: T.int32,
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_ht, HV, K, V), "float32"),
        store_ht: T.int32,
    ):
        # one flat grid axis (x has no 65535 limit), V tiles of one (sequence, head) adjacent
        with T.Kernel((num_bounds - 1) * HV * (V // BV), threads=THREADS) as bx:
            i_v = bx % (V // BV)
            i_hv = (bx // (V // BV)) % HV
            i_n = bx // ((V // BV) * HV)
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]

            w_shared = T.alloc_shared((BT, K), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            u_shared = T.alloc_shared((BT, BV), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            s_shared = T.alloc_shared((K, BV), "bfloat16")      # S in bf16: wgmma operand, h row
            vd_shared = T.alloc_shared((BT, BV), "bfloat16")    # diag(exp(g_C - g_cum)) V~
            s_frag = T.alloc_fragment((K, BV), "float32")       # the state S, fp32, all along
            vn_frag = T.alloc_fragment((BT, BV), "float32")
            g_last = T.alloc_local((1,), "float32")

            # S <- h0[n] (or 0)
            if use_h0 != 0:
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], s_frag)
            else:
                T.clear(s_frag)

            for c in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=2):
                t0 = bos + c * BT
                n = T.min(eos - t0, BT)                          # real rows of the chunk, 1..64
                # K, W, U <- full 64-row tiles (TMA); rows >= n are neutralized below. K comes
                # first: TileLang's producer writes g_shared once the consumer releases the first
                # copy's buffer, and K (read by the last product) is released after g's last use
                T.copy(k[t0:t0 + BT, i_h, :], k_shared)
                T.copy(w[t0:t0 + BT, i_hv, :], w_shared)
                T.copy(u[t0:t0 + BT, i_hv, v0:v0 + BV], u_shared)
                # g <- log2(e) g_cum, 0 past the end
                for i in T.Parallel(BT):
                    g_shared[i] = T.if_then_else(i < n, g_cum[t0 + i, i_hv] * LOG2E, 0)

                # h[row0 + c] <- S (bf16), plain 16-byte stores from the shared copy: a TMA store
                # would have to be waited for before W S could read the buffer
                T.copy(s_frag, s_shared)
                T.copy(s_shared, h[row0 + c, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})

                # V~ <- U - W S   (64 x BV x K, wgmma)
                T.gemm(w_shared, s_shared, vn_frag, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    vn_frag[i, j] = u_shared[i, j] - vn_frag[i, j]
                for i, j in T.Parallel(BT, BV):
                    if i < n:
                        v_new[t0 + i, i_hv, v0 + j] = vn_frag[i, j]

                # V~ <- diag(exp(g_C - g_cum)) V~, rows >= n set to 0 (whatever they hold)
                g_last[0] = g_shared[n - 1]
                for i, j in T.Parallel(BT, BV):
                    vd_shared[i, j] = T.if_then_else(
                        i < n, vn_frag[i, j] * T.exp2(g_last[0] - g_shared[i]), 0)

                # S <- exp(g_C) S + K^T V~   (K x BV x 64, wgmma with K read transposed)
                for d, j in T.Parallel(K, BV):
                    s_frag[d, j] = s_frag[d, j] * T.exp2(g_last[0])
                T.gemm(k_shared, vd_shared, s_frag, transpose_A=True)

            # ht[n] <- S
            if store_ht != 0:
                T.copy(s_frag, ht[i_n, i_hv, :, v0:v0 + BV])

    return chunk_h_fwd


# ---- promoted from kernels/chunk_bwd_dv_local/s01_wgmma.py
def chunk_bwd_dv_local_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")      # rows of the chunk table (a bound for varlen)

    @T.prim_func
    def chunk_bwd_dv_local(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        scale: T.float32,
        dv: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        # chunks and heads on one flat grid axis, the value heads that share a q/k head adjacent
        with T.Kernel(num_chunks * HV, threads=THREADS) as bx:
            i_hv = bx % HV
            i_c = bx // HV
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length: 1..64, 0 for empty rows

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            q_shared = T.alloc_shared((BT, K), "bfloat16")
            do_shared = T.alloc_shared((BT, V), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            b_frag = T.alloc_fragment((BT, BT), "float32")
            p_frag = T.alloc_fragment((BT, BT), "bfloat16")
            dv_frag = T.alloc_fragment((BT, V), "float32")

            loaded = T.alloc_barrier(THREADS)                  # the three TMA loads landed

            if n > 0:
                # K, Q, dO <- full tiles (TMA, one barrier); rows >= n never reach a stored row
                T.tma_copy(k[bos:bos + BT, i_h, :], k_shared, barrier=loaded)
                T.tma_copy(q[bos:bos + BT, i_h, :], q_shared, barrier=loaded)
                T.tma_copy(do[bos:bos + BT, i_hv, :], do_shared, barrier=loaded)
                T.barrier_arrive(loaded)
                # g <- log2(e) g_cum, 0 past the end (plain loads, while the TMA loads fly)
                for i in T.Parallel(BT):
                    g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                T.mbarrier_wait_parity(loaded, 0)

                # B <- K Q^T   (64 x 64 x K, wgmma)
                T.gemm(k_shared, q_shared, b_frag, transpose_B=True, clear_accum=True)
                # P^T[j, i] <- scale B[j, i] exp(g_cum_i - g_cum_j) for j <= i < n, else 0
                for j, i in T.Parallel(BT, BT):
                    p_frag[j, i] = T.if_then_else(
                        (j <= i) & (i < n), scale * b_frag[j, i] * T.exp2(g_shared[i] - g_shared[j]), 0)
                # dV <- P^T dO   (64 x V x 64, wgmma, P^T from registers)
                T.gemm(p_frag, do_shared, dv_frag, clear_accum=True)

                # dv[bos + j] <- row j, for the chunk's own n rows only
                for j, d in T.Parallel(BT, V):
                    if j < n:
                        dv[bos + j, i_hv, d] = dv_frag[j, d]

    return chunk_bwd_dv_local


# ---- promoted from kernels/chunk_bwd_dhu/s01_wgmma_pipelined.py
def chunk_bwd_dhu_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token, sequence or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # N + 1
    num_rows = T.dynamic("num_rows")          # real chunks, rows of dh
    num_ht = T.dynamic("num_ht")              # N, or 1 (unread) without dht
    num_h0 = T.dynamic("num_h0")              # N, or 1 (unwritten) without dh0

    @T.prim_func
    def chunk_bwd_dhu(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        dv_local: T.Tensor((num_tokens, HV, V), "bfloat16"),   # chunk_bwd_dv_local's output
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the sequences
        first_chunk: T.Tensor((num_bounds,), "int32"),         # row of dh of each sequence's chunk 0
        dht: T.Tensor((num_ht, HV, K, V), "float32"),          # dL/d final state
        use_dht: T.int32,
        scale: T.float32,
        dh: T.Tensor((num_rows, HV, K, V), "bfloat16"),
        dh0: T.Tensor((num_h0, HV, K, V), "float32"),          # dL/d initial state
        store_dh0: T.int32,
        dv2: T.Tensor((num_tokens, HV, V), "bfloat16"),        # dL/dv_new
    ):
        # one flat grid axis (x has no 65535 limit), V tiles of one (sequence, head) adjacent
        with T.Kernel((num_bounds - 1) * HV * (V // BV), threads=THREADS) as bx:
            i_v = bx % (V // BV)
            i_hv = (bx // (V // BV)) % HV
            i_n = bx // ((V // BV) * HV)
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            num_c = T.ceildiv(eos - bos, BT)

            w_shared = T.alloc_shared((BT, K), "bfloat16")
            q_shared = T.alloc_shared((BT, K), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            do_shared = T.alloc_shared((BT, BV), "bfloat16")
            dvl_shared = T.alloc_shared((BT, BV), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            ds_shared = T.alloc_shared((K, BV), "bfloat16")     # dS in bf16: wgmma operand, dh row
            dos_shared = T.alloc_shared((BT, BV), "bfloat16")   # scale diag(exp(g_cum)) dO
            dv2_shared = T.alloc_shared((BT, BV), "bfloat16")   # -dV2
            ds_frag = T.alloc_fragment((K, BV), "float32")      # dS, fp32, all along
            dv2_frag = T.alloc_fragment((BT, BV), "float32")
            g_last = T.alloc_local((1,), "float32")

            # dS <- dht[n] (or 0)
            if use_dht != 0:
                T.copy(dht[i_n, i_hv, :, v0:v0 + BV], ds_frag)
            else:
                T.clear(ds_frag)

            for cc in T.Pipelined(num_c, num_stages=2):
                c = num_c - 1 - cc                               # chunks from the last one back
                t0 = bos + c * BT
                n = T.min(eos - t0, BT)                          # real rows of the chunk, 1..64
                # W, Q, K, dO, dV_local <- full 64-row tiles (TMA); rows >= n are neutralized
                # below. W (read by the last product) comes first: TileLang's producer writes
                # g_shared once the consumer releases the first copy's buffer
                T.copy(w[t0:t0 + BT, i_hv, :], w_shared)
                T.copy(q[t0:t0 + BT, i_h, :], q_shared)
                T.copy(k[t0:t0 + BT, i_h, :], k_shared)
                T.copy(do[t0:t0 + BT, i_hv, v0:v0 + BV], do_shared)
                T.copy(dv_local[t0:t0 + BT, i_hv, v0:v0 + BV], dvl_shared)
                # g <- log2(e) g_cum, 0 past the end
                for i in T.Parallel(BT):
                    g_shared[i] = T.if_then_else(i < n, g_cum[t0 + i, i_hv] * LOG2E, 0)

                # dh[row0 + c] <- dS (bf16), plain 16-byte stores from the shared copy
                T.copy(ds_frag, ds_shared)
                T.copy(ds_shared, dh[row0 + c, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})

                # dV2 <- dV_local + diag(exp(g_C - g_cum)) K dS   (64 x BV x K, wgmma), rows >= n: 0
                T.gemm(k_shared, ds_shared, dv2_frag, clear_accum=True)
                g_last[0] = g_shared[n - 1]
                for i, j in T.Parallel(BT, BV):
                    dv2_frag[i, j] = T.if_then_else(
                        i < n, dvl_shared[i, j] + dv2_frag[i, j] * T.exp2(g_last[0] - g_shared[i]), 0)
                for i, j in T.Parallel(BT, BV):
                    if i < n:
                        dv2[t0 + i, i_hv, v0 + j] = dv2_frag[i, j]
                # dO' <- scale diag(exp(g_cum)) dO, rows >= n: 0;  -dV2 to shared for W^T
                for i, j in T.Parallel(BT, BV):
                    dos_shared[i, j] = T.if_then_else(
                        i < n, do_shared[i, j] * (scale * T.exp2(g_shared[i])), 0)
                for i, j in T.Parallel(BT, BV):
                    dv2_shared[i, j] = -dv2_frag[i, j]

                # dS <- exp(g_C) dS + Q^T dO' + W^T (-dV2)   (K x BV x 64 each, wgmma, transposed A)
                for d, j in T.Parallel(K, BV):
                    ds_frag[d, j] = ds_frag[d, j] * T.exp2(g_last[0])
                T.gemm(q_shared, dos_shared, ds_frag, transpose_A=True)
                T.gemm(w_shared, dv2_shared, ds_frag, transpose_A=True)

            # dh0[n] <- dS
            if store_dh0 != 0:
                T.copy(ds_frag, dh0[i_n, i_hv, :, v0:v0 + BV])

    return chunk_bwd_dhu


# ---- promoted from kernels/chunk_bwd_dqkwg/s01_wgmma.py
def chunk_bwd_dqkwg_kernel(H: int, HV: int):
    """The T.prim_func for H q/k heads and HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value heads i_h * group .. i_h * group + group - 1 read q/k head i_h
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")      # rows of the chunk table (a bound for varlen)
    num_rows = T.dynamic("num_rows")          # real chunks, rows of h and dh

    @T.prim_func
    def chunk_bwd_dqkwg(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),         # state entering each chunk
        dv2: T.Tensor((num_tokens, HV, V), "bfloat16"),        # dL/dv_new
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        dh: T.Tensor((num_rows, HV, K, V), "bfloat16"),        # dL/d(state leaving each chunk)
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        scale: T.float32,
        dq: T.Tensor((num_tokens, H, K), "bfloat16"),
        dk: T.Tensor((num_tokens, H, K), "bfloat16"),
        dw: T.Tensor((num_tokens, HV, K), "bfloat16"),
        dg: T.Tensor((num_tokens, HV), "float32"),             # dL/dg_cum
    ):
        # chunks and q/k heads on one flat grid axis (x has no 65535 limit)
        with T.Kernel(num_chunks * H, threads=TWO_WG_THREADS) as bx:
            i_h = bx % H
            i_c = bx // H
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length: 1..64, 0 for empty rows

            q_shared = T.alloc_shared((BT, K), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            do_shared = T.alloc_shared((BT, V), "bfloat16")
            vn_shared = T.alloc_shared((BT, V), "bfloat16")
            dv_shared = T.alloc_shared((BT, V), "bfloat16")
            s_shared = T.alloc_shared((K, V), "bfloat16")
            dh_shared = T.alloc_shared((K, V), "bfloat16")
            dp_shared = T.alloc_shared((BT, BT), "bfloat16")
            out_shared = T.alloc_shared((BT, K), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            last_shared = T.alloc_shared((BT,), "float32")
            ds_frag = T.alloc_fragment((BT, BT), "float32")
            acc = T.alloc_fragment((BT, K), "float32")
            dq_sum = T.alloc_fragment((BT, K), "float32")
            dk_sum = T.alloc_fragment((BT, K), "float32")
            r_q = T.alloc_fragment((BT,), "float32")
            r_ki = T.alloc_fragment((BT,), "float32")
            r_kp = T.alloc_fragment((BT,), "float32")
            r_s = T.alloc_fragment((BT,), "float32")
            g_last = T.alloc_local((1,), "float32")
            dg_last = T.alloc_local((1,), "float32")
            loaded = T.alloc_barrier(TWO_WG_THREADS)                  # the S and dS' TMA loads landed
            # swizzled: the accumulator's 8-row stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            if n > 0:
                # Q, K <- q[bos : bos + n], k[bos : bos + n]; zeros below row n
                for i, d in T.Parallel(BT, K):
                    q_shared[i, d] = T.if_then_else(i < n, q[bos + i, i_h, d], 0)
                    k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
                T.clear(dq_sum)
                T.clear(dk_sum)

                for j in T.serial(group):
                    i_hv = i_h * group + j
                    T.sync_threads()  # the previous head's reads of S and dS' are done
                    # S, dS' <- whole 128 x 128 tiles (TMA, one barrier for both), while the
                    # plain loads below run
                    T.tma_copy(h[i_c, i_hv, :, :], s_shared, barrier=loaded)
                    T.tma_copy(dh[i_c, i_hv, :, :], dh_shared, barrier=loaded)
                    T.barrier_arrive(loaded)
                    # g <- log2(e) g_cum; dO, V~, dV~ <- rows of the chunk; zeros below row n
                    for i in T.Parallel(BT):
                        g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                    for i, d in T.Parallel(BT, V):
                        do_shared[i, d] = T.if_then_else(i < n, do[bos + i, i_hv, d], 0)
                        vn_shared[i, d] = T.if_then_else(i < n, v_new[bos + i, i_hv, d], 0)
                        dv_shared[i, d] = T.if_then_else(i < n, dv2[bos + i, i_hv, d], 0)
                    g_last[0] = g_shared[n - 1]
                    T.mbarrier_wait_parity(loaded, j % 2)

                    # dP <- scale (dO V~^T * Gamma), lower incl. diagonal, real rows (exponent <= 0)
                    T.gemm(do_shared, vn_shared, ds_frag, transpose_B=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        dp_shared[i, c] = T.if_then_else(
                            (c <= i) & (i < n), scale * ds_frag[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)

                    # dW <- -dV~ S^T   (64 x K x V, wgmma), rows of the chunk stored
                    T.gemm(dv_shared, s_shared, acc, transpose_B=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        out_shared[i, d] = -acc[i, d]
                    for i, d in T.Parallel(BT, K):
                        if i < n:
                            dw[bos + i, i_hv, d] = out_shared[i, d]

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

                    # dg_C += sum_i k_i.dK_i + exp(g_C) <S, dS'>
                    for i in T.Parallel(BT):
                        last_shared[i] = r_ki[i] + T.exp2(g_last[0]) * r_s[i]
                    dg_last[0] = 0
                    for i in T.serial(BT):
                        dg_last[0] = dg_last[0] + last_shared[i]
                    # dg_i <- q_i.dq_i - k_i.dk_i (+ dg_C at the last real row), rows < n
                    for i in T.Parallel(BT):
                        if i < n:
                            dg[bos + i, i_hv] = (r_q[i] - r_ki[i] - r_kp[i]
                                                 + T.if_then_else(i == n - 1, dg_last[0], 0))

                # dq, dk <- the group's sums, rows of the chunk
                T.copy(dq_sum, out_shared)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dq[bos + i, i_h, d] = out_shared[i, d]
                T.copy(dk_sum, out_shared)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dk[bos + i, i_h, d] = out_shared[i, d]

    return chunk_bwd_dqkwg


# ---- promoted from kernels/wy_bwd/s01_wgmma.py
def wy_bwd_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value heads i_h * group .. i_h * group + group - 1 read key head i_h
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")      # rows of the chunk table (a bound for varlen)

    @T.prim_func
    def wy_bwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        beta: T.Tensor((num_tokens, HV), "float32"),
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of (I + A)^-1
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
        with T.Kernel(num_chunks * H, threads=TWO_WG_THREADS) as bx:
            i_h = bx % H
            i_c = bx // H
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length: 1..64, 0 for empty rows

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            dw_shared = T.alloc_shared((BT, K), "bfloat16")
            du_shared = T.alloc_shared((BT, V), "bfloat16")
            ai_shared = T.alloc_shared((BT, BT), "bfloat16")
            dai_shared = T.alloc_shared((BT, BT), "bfloat16")  # dAi, strictly lower
            m_shared = T.alloc_shared((BT, BT), "bfloat16")    # dAi Ai^T
            d_shared = T.alloc_shared((BT, BT), "bfloat16")    # D = diag(beta) dA * Gamma
            e_shared = T.alloc_shared((BT, BT + 1), "float32")  # diag(beta) E (odd row length:
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
                    # g <- log2(e) g_cum, beta; Ai, V, dW, dU <- rows of the chunk; zeros below row n
                    for i in T.Parallel(BT):
                        g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                        b_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
                    for i, c in T.Parallel(BT, BT):
                        ai_shared[i, c] = T.if_then_else(i < n, Ai[bos + i, i_hv, c], 0)
                    for i, d in T.Parallel(BT, V):
                        v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
                        dw_shared[i, d] = T.if_then_else(i < n, dw[bos + i, i_hv, d], 0)
                        du_shared[i, d] = T.if_then_else(i < n, du[bos + i, i_hv, d], 0)

                    # dAi <- (dW K^T) diag(beta exp(g)) + (dU V^T) diag(beta), strictly lower, rows < n
                    T.gemm(dw_shared, k_shared, wk_frag, transpose_B=True, clear_accum=True)
                    T.gemm(du_shared, v_shared, uv_frag, transpose_B=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        dai_shared[i, c] = T.if_then_else(
                            (c < i) & (i < n),
                            b_shared[c] * (wk_frag[i, c] * T.exp2(g_shared[c]) + uv_frag[i, c]), 0)

                    # M <- dAi Ai^T   (64 x 64 x 64, wgmma)
                    T.gemm(dai_shared, ai_shared, m_frag, transpose_B=True, clear_accum=True)
                    T.copy(m_frag, m_shared)
                    # dA~ <- -(Ai^T M) * Gamma, strictly lower, rows < n (exponent <= 0)
                    T.gemm(ai_shared, m_shared, m_frag, transpose_A=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        m_frag[i, c] = T.if_then_else(
                            (c < i) & (i < n), -m_frag[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)
                    # D <- diag(beta) dA~;  E <- dA~ * KK;  r_e <- rows of E
                    for i, c in T.Parallel(BT, BT):
                        d_shared[i, c] = b_shared[i] * m_frag[i, c]
                        m_frag[i, c] = m_frag[i, c] * kk_frag[i, c]
                    T.reduce_sum(m_frag, r_e, dim=1)
                    # r_et <- columns of diag(beta) E (rows of its transpose, through shared memory)
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

    return wy_bwd


def _chunk_local_reverse_cumsum(dg_cum, chunks):
    """dg_cum [B*T, HV] fp32 -> dg: per chunk, the sum over its tokens s >= t (the adjoint of the
    chunk-local cumsum); as gdn_bwd.s01 does it: gather the chunks into [NT, 64, HV] through the
    chunk table, flip-cumsum-flip, scatter back."""
    num_tokens, HV = dg_cum.shape
    flat = torch.cat([dg_cum, dg_cum.new_zeros(1, HV)])
    idx = chunks[:, :1].long() + torch.arange(CHUNK_SIZE, device=dg_cum.device)  # [NT, 64] tokens
    idx = torch.where(idx < chunks[:, 1:].long(), idx, num_tokens)  # past a chunk's end: the zero row
    rev = flat[idx].flip(1).cumsum(1).flip(1)
    out = torch.empty_like(flat)
    out[idx.flatten()] = rev.flatten(0, 1)   # every token is in one chunk; the zero row is dropped
    return out[:-1]


def backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens):
    """Checked API inputs (bf16 q, k, v; K = V = 128), do [B, T, HV, V], dht [N, HV, K, V] or None
    -> (dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32,
    dh0 [N, HV, K, V] fp32, None without initial_state): the gradients of <do, o> + <dht, final state>."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = float(K ** -0.5 if scale is None else scale)
    q, k = (x.contiguous().view(B * T, H, K) for x in (q, k))
    v = v.contiguous().view(B * T, HV, V)
    do = do.to(torch.bfloat16).contiguous().view(B * T, HV, V)
    g, beta = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (g, beta))
    chunks, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    seqs = seq_bounds(cu_seqlens, B, T, device)
    N, NT = seqs.shape[0] - 1, chunks.shape[0]
    bf16, fp32 = dict(dtype=torch.bfloat16, device=device), dict(dtype=torch.float32, device=device)
    absent = torch.empty(1, HV, K, V, **fp32)  # stands in for a missing h0, dht, dh0, final state
    h0 = absent if initial_state is None else initial_state.to(torch.float32).contiguous()
    dht_in = absent if dht is None else dht.to(torch.float32).contiguous()
    dh0 = None if initial_state is None else torch.empty(N, HV, K, V, **fp32)
    g_cum, dbeta = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
    dg_cum, dg_cum_wy = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
    A, Ai = torch.empty(B * T, HV, CHUNK_SIZE, **fp32), torch.empty(B * T, HV, CHUNK_SIZE, **bf16)
    w, dw = torch.empty(B * T, HV, K, **bf16), torch.empty(B * T, HV, K, **bf16)
    u, v_new, dv_local, dv2, dv = (torch.empty(B * T, HV, V, **bf16) for _ in range(5))
    dq, dk, dk_wy = (torch.empty(B * T, H, K, **bf16) for _ in range(3))
    h, dh = torch.empty(NT, HV, K, V, **bf16), torch.empty(NT, HV, K, V, **bf16)
    if B * T == 0:  # no tokens: the final state's gradient passes through to the initial state
        if dh0 is not None:
            dh0.copy_(dht_in if dht is not None else torch.zeros_like(dh0))
        return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V),
                dg_cum.view(B, T, HV), dbeta.view(B, T, HV), dh0)
    # the forward's intermediates, recomputed
    with nvtx_range("bwd.chunk_local_cumsum"):
        _compiled(chunk_local_cumsum_kernel, HV)(g, chunks, g_cum)
    with nvtx_range("bwd.chunk_kkt"):
        _compiled(chunk_kkt_kernel, H, HV, K)(k, g_cum, beta, chunks, A)
    with nvtx_range("bwd.kkt_solve"):
        _compiled(kkt_solve_kernel, HV)(A, chunks, Ai)
    with nvtx_range("bwd.chunk_w_u"):
        _compiled(chunk_w_u_kernel, H, HV)(k, v, beta, Ai, g_cum, chunks, w, u)
    with nvtx_range("bwd.chunk_h"):
        _compiled(chunk_h_kernel, H, HV)(k, w, u, g_cum, seqs, first_chunk, h0,
                                         int(initial_state is not None), h, v_new, absent, 0)
    # the backward, chunk by chunk and through the states in reverse
    with nvtx_range("bwd.chunk_bwd_dv_local"):
        _compiled(chunk_bwd_dv_local_kernel, H, HV)(q, k, do, g_cum, chunks, scale, dv_local)
    with nvtx_range("bwd.chunk_bwd_dhu"):
        _compiled(chunk_bwd_dhu_kernel, H, HV)(q, k, w, g_cum, do, dv_local, seqs, first_chunk, dht_in,
                                               int(dht is not None), scale, dh,
                                               absent if dh0 is None else dh0, int(dh0 is not None), dv2)
    with nvtx_range("bwd.chunk_bwd_dqkwg"):
        _compiled(chunk_bwd_dqkwg_kernel, H, HV)(q, k, v_new, g_cum, h, dv2, do, dh, chunks, scale,
                                                 dq, dk, dw, dg_cum)
    with nvtx_range("bwd.wy_bwd"):
        _compiled(wy_bwd_kernel, H, HV)(k, v, beta, Ai, g_cum, dw, dv2, chunks,
                                        dk_wy, dv, dbeta, dg_cum_wy)
    with nvtx_range("bwd.chunk_local_reverse_cumsum"):
        dg = _chunk_local_reverse_cumsum(dg_cum + dg_cum_wy, chunks)
    dk = (dk.float() + dk_wy.float()).to(torch.bfloat16)
    return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
            dbeta.view(B, T, HV), dh0)
