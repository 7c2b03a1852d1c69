"""wy_bwd, stage 01: the backward through the WY representation, nine products on the tensor cores.

What it computes (``flashqla.reference.wy_bwd``, FLA's ``prepare_wy_repr_bwd``): for every chunk
of C = 64 tokens and every value head, the forward being

    w = Ai diag(beta exp(g)) K,  u = Ai diag(beta) V,  Ai = (I + A)^-1,
    A = StrictLower(diag(beta) K K^T * Gamma),  Gamma_ij = exp(g_i - g_j),  g = g_cum,

the gradients from dW = dL/dw and dU = dL/du:

    dAi  = (dW K^T) diag(beta exp(g)) + (dU V^T) diag(beta)     (only its strictly lower part matters)
    dA   = -Ai^T dAi Ai^T, strictly lower;  dA~ = dA * Gamma;  E = dA~ * (K K^T)
    dK   = diag(beta exp(g)) Ai^T dW + (D + D^T) K,  D = diag(beta) dA~
    dV   = diag(beta) Ai^T dU
    dbeta_i = exp(g_i) k_i.(Ai^T dW)_i + v_i.(Ai^T dU)_i + sum_j E_ij
    dg_i    = beta_i exp(g_i) k_i.(Ai^T dW)_i + beta_i sum_j E_ij - sum_j beta_j E_ji   (w.r.t. g_cum)

dk is summed over the HV / H value heads that share a key head (GVA); dv, dbeta and dg are per
value head.

How: one CTA of two warpgroups (256 threads) per (chunk row of ``flashqla.varlen.chunk_table``,
key head). K is loaded and K K^T computed once; the CTA then walks the value heads of its group,
and the group's dk sum stays in fp32 registers (each warpgroup owns 64 of the 128 columns): no
atomics, and the same result however the heads are split. Per value head, Ai, V, dW, dU, beta
and g are loaded with rows past the chunk's end set to zero, and the products are wgmma (bf16 in,
fp32 accumulate): dW K^T and dU V^T (the scalings beta exp(g) and beta fall on their columns, so
K and V need no scaled copies), dAi Ai^T and Ai^T (dAi Ai^T) (Ai read transposed), D K and D^T K,
Ai^T dW and Ai^T dU. The masked matrices go through shared memory in bf16 as FLA's kernel does;
the column sums of E are row sums of its transpose, read back from an fp32 tile in shared memory.
Exponents are taken only where they are <= 0 (g_i, g_i - g_j for j < i < n); rows >= n are never
stored, and empty chunk rows [T, T) do nothing.

Traffic per chunk and value head: Ai 8 KB, V, dW, dU 48 KB in, dv 16 KB out; K in and dk out
32 KB per key head. About 7.3 MFLOP of products per chunk and value head.

Measured effect (one H200, CUDA events around ``run``, median of 20 after 3 warm-up calls; FLA
0.6.0 ``prepare_wy_repr_bwd`` (Triton) on the same inputs in the same run;
profiles/bwd_dqkwg_wy_s01_lab.py):

    (H, HV)   tokens      this stage   FLA     bytes moved at least / time
    (16, 64)  1 x 32768   2.23 ms      2.52    1.22 TB/s
    (2, 8)    1 x 32768   0.33 ms      0.40    1.04 TB/s

1.13-1.21x faster than FLA, whose outputs it matches to 4.9e-3 (dk), 3.3e-3 (dg), 4.7e-4 (dbeta)
relative L2 and exactly (dv). It moves fewer bytes than chunk_bwd_dqkwg.s01 in the same time:
most likely (not profiled) latency bound, one CTA a multiprocessor (about 136 KB of shared
memory) running eight products, four cross-warpgroup row sums and their barriers in sequence per
value head.

Taught in: notebooks/07_backward.py, as a kernel of gdn_bwd.s01.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: the nine products (bf16 in, fp32 accumulate); exp2f: the decays exp2(log2(e) x), x <= 0
SOURCE_MUST_CONTAIN = ("wgmma", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V = 128 only
THREADS = 256         # two warpgroups, each owning half the columns of every product
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


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
        with T.Kernel(num_chunks * H, threads=THREADS) as bx:
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


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(wy_bwd_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(k, v, beta, Ai, g_cum, dw, du, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K], v [B, T, HV, V], Ai [B, T, HV, 64], dw [B, T, HV, K], du [B, T, HV, V] bf16
    (others cast), beta, g_cum [B, T, HV] fp32 -> dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16,
    dbeta, dg [B, T, HV] fp32 (dg w.r.t. g_cum; see the module doc). No host sync."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"wy_bwd.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"wy_bwd.s01: `k` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"wy_bwd.s01: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"wy_bwd.s01: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of k; got HV = {HV}")
    if Ai.shape[-1] != CHUNK_SIZE:
        raise ValueError(f"wy_bwd.s01: `Ai` must have last dim {CHUNK_SIZE}; got {Ai.shape[-1]}")
    device = k.device
    bf16, fp32 = dict(device=device, dtype=torch.bfloat16), dict(device=device, dtype=torch.float32)
    k_flat = k.to(**bf16).contiguous().view(B * T, H, K)
    v_flat, du_flat = (x.to(**bf16).contiguous().view(B * T, HV, V) for x in (v, du))
    dw_flat = dw.to(**bf16).contiguous().view(B * T, HV, K)
    Ai_flat = Ai.to(**bf16).contiguous().view(B * T, HV, CHUNK_SIZE)
    beta_flat, g_flat = (x.to(**fp32).contiguous().view(B * T, HV) for x in (beta, g_cum))
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    dk = torch.empty(B * T, H, K, **bf16)
    dv = torch.empty(B * T, HV, V, **bf16)
    dbeta = torch.empty(B * T, HV, **fp32)
    dg = torch.empty(B * T, HV, **fp32)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(H, HV)
        with nvtx_range("wy_bwd.s01"):
            kernel(k_flat, v_flat, beta_flat, Ai_flat, g_flat, dw_flat, du_flat, bounds, dk, dv, dbeta, dg)
    return dk.view(B, T, H, K), dv.view(B, T, HV, V), dbeta.view(B, T, HV), dg.view(B, T, HV)
