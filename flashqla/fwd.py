"""The promoted forward: the TileLang kernels that ``flashqla.chunk_gated_delta_rule`` runs on SM90.

Promotion copies a stage's kernel, unchanged, from the workbench (``kernels/``, which is not
installed) into the library; ``tests/test_promoted.py`` asserts that every kernel here builds the
same TileLang program as the stage it came from, so the library runs exactly what the stage tests
and the benchmark checked. The fastest correct pieces (``profiles/results/gdn_fwd.csv``, and the
measurements in each stage's docstring):

    chunk_local_cumsum.s01   g                      -> g_cum      one CTA per chunk, all heads
    chunk_fwd_intra.s01      k, v, g_cum, beta      -> w, u       K K^T, (I + A)^-1 and the WY
                                                                  products in one kernel: A and Ai
                                                                  stay on chip (s03 ran them as
                                                                  three kernels)
    gdn_fwd.s03 (fused)      q, k, w, u, g_cum, h0  -> o, final state: the state recurrence and the
                                                       output in one kernel, TMA, 2-stage pipeline

``forward`` builds the varlen maps once (``flashqla.varlen``, cached per ``cu_seqlens``, no host
synchronization) and launches the three kernels, each in an NVTX range ``fwd.<kernel>``.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
HEAD_DIM = 128        # K = V: the only head dims the kernels take
THREADS = 128         # one warpgroup (chunk_fwd_intra)
H_O_THREADS = 256     # two consumer warpgroups (the fused kernel; TileLang adds a producer)
BLOCK_V = 64          # value columns of the state owned by one CTA of the fused kernel
NUM_STAGES = 2        # the fused kernel loads chunk c + 1 (TMA) while chunk c computes
LOG2E = 1.4426950408889634


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


# ---- promoted from kernels/gdn_fwd/s03_fused_h_o.py
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
    def gdn_fused_h_o(
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

            q_s = T.alloc_shared((C, K), "bfloat16")
            k_s = T.alloc_shared((C, K), "bfloat16")
            w_s = T.alloc_shared((C, K), "bfloat16")
            u_s = T.alloc_shared((C, BV), "bfloat16")
            g_s = T.alloc_shared((C,), "float32")
            h_s = T.alloc_shared((K, BV), "bfloat16")
            p_s = T.alloc_shared((C, C), "bfloat16")
            vn_s = T.alloc_shared((C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            h_f = T.alloc_fragment((K, BV), "float32")
            vn_f = T.alloc_fragment((C, BV), "float32")
            vd_f = T.alloc_fragment((C, BV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            g_f = T.alloc_fragment((C,), "float32")

            # u_s is read in the accumulator layout (8 rows of 128 bytes per warp access): swizzle it
            T.annotate_layout({u_s: tilelang.layout.make_swizzled_layout(u_s)})

            # S <- h0 (this CTA's BV columns of it)
            T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
            # gates of chunk 0 (see the loop)
            for i in T.Parallel(C):
                g_f[i] = T.if_then_else(bos < eos, g_cum[T.min(bos + i, eos - 1), i_hv], 0)

            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=NUM_STAGES):
                t0 = bos + c * C
                n = T.min(eos - t0, C)                          # real rows of this chunk, 1..64
                # full 64-row tiles by TMA; rows >= n (next sequence or zero fill) are masked below
                T.copy(w[t0:t0 + C, i_hv, :], w_s)
                T.copy(u[t0:t0 + C, i_hv, v0:v0 + BV], u_s)
                T.copy(k[t0:t0 + C, i_h, :], k_s)
                T.copy(q[t0:t0 + C, i_h, :], q_s)
                # g <- g_cum of this chunk, rows >= n padded with the last real row, so every
                # exponent below, g_i - g_j with i >= j or g_C - g_i, is <= 0. The consumers load
                # the gates into registers one chunk ahead (a pipelined shared buffer would be
                # handed back to the producer with w_s, right after W S, while still in use)
                T.copy(g_f, g_s)
                for i in T.Parallel(C):
                    g_f[i] = g_cum[T.min(t0 + C + i, eos - 1), i_hv]
                # S (fp32 registers) -> bf16 in shared memory, the wgmma operand
                T.copy(h_f, h_s)
                # V~ <- U - W S, zero rows >= n (they then add nothing to the state);
                # V_d <- diag(exp(g_C - g)) V~, the decayed copy the state update reads
                T.gemm(w_s, h_s, vn_f, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.if_then_else(i < n, u_s[i, j] - vn_f[i, j], 0)
                    vd_f[i, j] = vn_f[i, j] * T.exp2((g_s[C - 1] - g_s[i]) * LOG2E)
                T.copy(vn_f, vn_s)
                T.copy(vd_f, vd_s)
                # S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~, then O <- Q S (the incoming S, still
                # in h_s) and P <- Q K^T: three products issued back to back, one wait
                for i, j in T.Parallel(K, BV):
                    h_f[i, j] = h_f[i, j] * T.exp2(g_s[C - 1] * LOG2E)
                T.wgmma_gemm(k_s, vd_s, h_f, transpose_A=True)
                T.wgmma_gemm(q_s, h_s, o_f, clear_accum=True)
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * T.exp2((g_s[i] - g_s[j]) * LOG2E), 0)
                T.copy(p_f, p_s)
                # O <- scale exp(g) Q S + P V~
                for i, j in T.Parallel(C, BV):
                    o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[i] * LOG2E))
                T.gemm(p_s, vn_s, o_f)
                # o[t0 : t0 + n] <- O, the chunk's own rows only, straight from the registers
                for i, j in T.Parallel(C, BV):
                    if i < n:
                        o[t0 + i, i_hv, v0 + j] = o_f[i, j]

            T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

    return gdn_fused_h_o



@functools.cache
def _compiled(builder, *shape):
    return compile_hopper(builder(*shape))


def forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Checked API inputs (bf16 q, k, v; K = V = 128) -> (o [B, T, HV, V] bf16, final state or None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k = (x.contiguous().view(B * T, H, K) for x in (q, k))
    v = v.contiguous().view(B * T, HV, V)
    g, beta = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (g, beta))
    chunks, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    seqs = seq_bounds(cu_seqlens, B, T, device)
    N = seqs.shape[0] - 1
    h0 = (torch.zeros(N, HV, K, V, dtype=torch.float32, device=device) if initial_state is None
          else initial_state.to(torch.float32).contiguous())
    bf16, fp32 = dict(dtype=torch.bfloat16, device=device), dict(dtype=torch.float32, device=device)
    g_cum = torch.empty(B * T, HV, **fp32)
    w, u = torch.empty(B * T, HV, K, **bf16), torch.empty(B * T, HV, V, **bf16)
    o, ht = torch.empty(B * T, HV, V, **bf16), torch.empty(N, HV, K, V, **fp32)
    if B * T == 0:
        ht.copy_(h0)
    else:
        with nvtx_range("fwd.chunk_local_cumsum"):
            _compiled(chunk_local_cumsum_kernel, HV)(g, chunks, g_cum)
        with nvtx_range("fwd.chunk_fwd_intra"):
            _compiled(chunk_fwd_intra_kernel, H, HV)(k, v, g_cum, beta, chunks, w, u)
        with nvtx_range("fwd.chunk_h_o"):
            _compiled(fused_h_o_kernel, H, HV, K, V)(q, k, w, u, g_cum, h0, seqs, scale, o, ht)
    return o.view(B, T, HV, V), (ht if output_final_state else None)
