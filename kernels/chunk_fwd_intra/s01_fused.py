"""chunk_fwd_intra, stage 01: chunk_kkt, kkt_solve and chunk_w_u fused; A and Ai stay on chip.

What it computes (``flashqla.reference.chunk_fwd_intra``): for every chunk of C = 64 tokens and
every value head (value head i reads key head i // (HV / H)),

    A  = StrictLower(diag(beta) K K^T * Gamma),   Gamma_ij = exp(g_cum_i - g_cum_j)
    Ai = (I + A)^-1
    w  = Ai diag(beta exp(g_cum)) K        [64, K]
    u  = Ai diag(beta) V                   [64, V]

What changed: the three kernels chunk_kkt.s02, kkt_solve.s01 and chunk_w_u.s01 become one, with
one CTA (one warpgroup) per (chunk row of ``flashqla.varlen.chunk_table``, value head). K is
loaded once and serves as both operands of K K^T (wgmma) and as the B operand of w; A goes from
the wgmma accumulator to an fp32 tile in shared memory; (I + A)^-1 is solved there by
kkt_solve.s01's column substitution, spread over all four warps: warp w owns columns 16w..16w+15
and starts at row 16w, and the two lanes l, l ^ 16 of a column each sum half of every row (whole
blocks of 4, one LDS.128 each) and add the halves with one shuffle, so the longest column costs
a thread about 1150 FMAs instead of 2016. The columns go back to shared memory as bf16, already
multiplied by the column scalings (Ai diag(s) K = (Ai diag(s)) K), so K and V need no scaled
copies; two wgmma products give w and u, stored through a swizzled bf16 tile.

Why: bytes. For (H, HV) = (16, 64) and 32768 tokens the chain moves about 4.3 GB (K counted
once per value head, as each CTA reads it): A is 32768 x 64 x 64 x 4 B = 0.54 GB written and read
(1.07 GB), Ai 0.27 GB written and read (0.54 GB), and K is read a second time (32768 x 64 x 128 x
2 B = 0.54 GB, partly from L2: four value heads share a key head). Fused, what is left is K and V
in (1.07 GB) and w, u out (1.07 GB): 2.15 GB, half the traffic.

Measured effect (one H200, CUDA events, median of 20 after warm-up, ms per call of 10 back to
back; the chain's three kernels and FLA 0.6.0 ``chunk_gated_delta_rule_fwd_intra`` in the same run):

    (H, HV), tokens        this kernel   chain kernels (kkt + solve + w_u)   FLA fwd_intra
    (16, 64), 1 x 32768    1.377         1.534 (0.315 + 0.373 + 0.856)       1.480
    (2, 8), 1 x 32768      0.169         0.204                               0.189
    (16, 32), 8 x 4096     0.675         0.783                               0.750

so 10-17% less time than the chain and 7-11% less than FLA; ``run`` with its device chunk table
is within 0.012 ms of the kernel back to back. 2.15 GB in 1.377 ms is 1.56 TB/s, well below the
2.35 TB/s of chunk_w_u.s01 alone: most likely (not profiled) latency bound, as each CTA
loads, multiplies, solves, multiplies and stores in sequence, with 4 CTAs a multiprocessor (109
registers, 49 KB of shared memory). Tried in the same session: the solve on two warps only
(kkt_solve.s01's code unchanged, the other two warps idle) needed 132 registers (3 CTAs a
multiprocessor) and took 1.584 ms, slower than the chain. Overlapping one chunk's solve with the
next chunk's loads is the next step.

Taught in: Lab log (book page lab_log); background in notebooks/03_forward_kernels.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: K K^T and the products (Ai diag(.)) K, (Ai diag(.)) V (bf16 in, fp32 accumulate);
# float y[32]: a thread's half of its column of Ai in fp32 registers, found by substitution on the
# fp32 A tile in shared memory; __shfl_xor_sync: the two halves of each row sum meet
SOURCE_MUST_CONTAIN = ("wgmma", "float y[32]", "__shfl_xor_sync")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile; also the solving threads
HEAD_DIM = 128        # K = V
THREADS = 128         # one warpgroup
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)


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


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(chunk_fwd_intra_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(k, v, g_cum, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K], v [B, T, HV, V] bf16, g_cum, beta [B, T, HV] fp32 -> w [B, T, HV, K],
    u [B, T, HV, V] bf16 (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_fwd_intra.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"chunk_fwd_intra.s01: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if V != HEAD_DIM:
        raise ValueError(f"chunk_fwd_intra.s01: `v` must have head dim V = {HEAD_DIM}; got {V}")
    if HV % H:
        raise ValueError(f"chunk_fwd_intra.s01: `v` must have a number of value heads HV that is "
                         f"a multiple of the H = {H} heads of k; got HV = {HV}")
    device = k.device
    bf16, fp32 = dict(device=device, dtype=torch.bfloat16), dict(device=device, dtype=torch.float32)
    k_flat = k.to(**bf16).contiguous().view(B * T, H, K)
    v_flat = v.to(**bf16).contiguous().view(B * T, HV, V)
    g_flat = g_cum.to(**fp32).contiguous().view(B * T, HV)
    beta_flat = beta.to(**fp32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    w = torch.empty(B * T, HV, K, **bf16)
    u = torch.empty(B * T, HV, V, **bf16)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(H, HV)
        with nvtx_range("chunk_fwd_intra.s01"):
            kernel(k_flat, v_flat, g_flat, beta_flat, bounds, w, u)
    return w.view(B, T, HV, K), u.view(B, T, HV, V)
