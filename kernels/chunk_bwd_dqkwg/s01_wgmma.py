"""chunk_bwd_dqkwg, stage 01: dq, dk, dw and dg_cum of every chunk, six products on the tensor cores.

What it computes (``flashqla.reference.chunk_bwd_dqkwg``): for every chunk of C = 64 tokens and
every value head, with S = h[chunk] the state entering the chunk, dS' = dh[chunk] the gradient of
the state leaving it, V~ = v_new, dV~ = dv2 (its full gradient), g = g_cum, g_C its value at the
chunk's last real token and Gamma_ij = exp(g_i - g_j),

    dP  = scale (dO V~^T * Gamma), lower incl. diagonal
    dQ  = scale diag(exp(g)) dO S^T + dP K
    dK  = diag(exp(g_C - g)) V~ dS'^T + dP^T Q
    dW  = -dV~ S^T
    dg_i = q_i.dq_i - k_i.dk_i,  and at the last real token also
           sum_i k_i.(diag(exp(g_C - g)) V~ dS'^T)_i + exp(g_C) <S, dS'>

dq and dk are summed over the HV / H value heads that share a q/k head (GVA); dw and dg are per
value head.

How: one CTA of two warpgroups (256 threads) per (chunk row of ``flashqla.varlen.chunk_table``,
q/k head). Q and K are loaded once; the CTA then walks the value heads of its group one after the
other, and the group's dq and dk sums stay in fp32 registers (each warpgroup owns 64 of the 128
columns): no atomics, and the same result however the heads are split. Per value head, S and dS'
arrive by TMA (whole 128 x 128 tiles), dO, V~, dV~ and g by plain loads with rows past the
chunk's end set to zero; the six products are wgmma (bf16 in, fp32 accumulate): dO V~^T, dV~ S^T,
dO S^T, dP K, V~ dS'^T and dP^T Q (dP, bf16 in shared memory, read transposed). The row sums of
dg are taken from the fp32 products before rounding; <S, dS'> pairs rows d and d + 64 of the two
tiles so that it, too, is a row sum over a 64 x 128 fragment. Exponents are taken only where they
are <= 0 (g_i, g_i - g_j for j <= i < n, g_C - g_i for i < n); rows >= n are never stored, and
empty chunk rows [T, T) do nothing and never read h.

Traffic per chunk and value head: S and dS' 64 KB (bf16), dO, V~, dV~ 48 KB, dw 16 KB out; Q, K
in and dq, dk out 64 KB per q/k head. About 9.4 MFLOP of products per chunk and value head.

Measured effect (one H200, CUDA events around ``run``, median of 20 after 3 warm-up calls, h and
dh already bf16; FLA 0.6.0 ``chunk_bwd_dqkwg``, which on Hopper dispatches to FLA's TileLang
backend, on the same inputs in the same run; profiles/bwd_dqkwg_wy_s01_lab.py):

    (H, HV)   tokens      this stage   FLA     bytes moved at least / time
    (16, 64)  1 x 32768   2.25 ms      4.71    2.16 TB/s
    (2, 8)    1 x 32768   0.34 ms      0.64    1.79 TB/s

1.9-2.1x faster than FLA, whose outputs it matches to 2.8e-3 (dq, dk), 3e-7 (dg) relative L2 and
exactly (dw). One CTA a multiprocessor (177 KB of shared memory): loads, products and stores of
a value head run one after the other, and only the TMA of S and dS' overlaps the plain loads.

Taught in: notebooks/07_backward.py, as a kernel of gdn_bwd.s01.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: the six products (bf16 in, fp32 accumulate); tma_load: the S and dS' tiles
# (cp.async.bulk.tensor); exp2f: the decays exp2(log2(e) x) with x <= 0
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V = 128 only
THREADS = 256         # two warpgroups, each owning half the columns of every product
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


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
        with T.Kernel(num_chunks * H, threads=THREADS) as bx:
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
            loaded = T.alloc_barrier(THREADS)                  # the S and dS' TMA loads landed
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


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(chunk_bwd_dqkwg_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(q, k, v_new, g_cum, h, dv2, do, dh, scale=None, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """q, k [B, T, H, K], v_new, dv2, do [B, T, HV, V] bf16, g_cum [B, T, HV] fp32, h, dh
    [B', NT, HV, K, V] (bf16, or cast to it) -> dq, dk [B, T, H, K] bf16, dw [B, T, HV, K] bf16,
    dg [B, T, HV] fp32 (w.r.t. g_cum; see the module doc). No host sync."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_bwd_dqkwg.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"chunk_bwd_dqkwg.s01: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"chunk_bwd_dqkwg.s01: `v_new` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"chunk_bwd_dqkwg.s01: `v_new` must have a number of value heads HV that "
                         f"is a multiple of the H = {H} heads of q; got HV = {HV}")
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    q_flat, k_flat = (x.to(**bf16).contiguous().view(B * T, H, K) for x in (q, k))
    vn_flat, dv_flat, do_flat = (x.to(**bf16).contiguous().view(B * T, HV, V) for x in (v_new, dv2, do))
    h_rows, dh_rows = (x.to(**bf16).contiguous().view(-1, HV, K, V) for x in (h, dh))
    g_flat = g_cum.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    dq = torch.empty(B * T, H, K, **bf16)
    dk = torch.empty(B * T, H, K, **bf16)
    dw = torch.empty(B * T, HV, K, **bf16)
    dg = torch.empty(B * T, HV, device=device, dtype=torch.float32)
    if bounds.shape[0] and h_rows.shape[0]:  # every token lies in exactly one chunk
        kernel = _compiled(H, HV)
        with nvtx_range("chunk_bwd_dqkwg.s01"):
            kernel(q_flat, k_flat, vn_flat, g_flat, h_rows, dv_flat, do_flat, dh_rows, bounds, scale,
                   dq, dk, dw, dg)
    return dq.view(B, T, H, K), dk.view(B, T, H, K), dw.view(B, T, HV, K), dg.view(B, T, HV)
