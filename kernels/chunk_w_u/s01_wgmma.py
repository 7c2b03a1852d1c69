"""chunk_w_u, stage 01: the WY factors w and u, two 64 x 64 x 128 products on the tensor cores.

What it computes (``flashqla.reference.chunk_w_u``): for every chunk of C = 64 tokens and every
value head, with Ai = (I + A)^-1 the chunk's unit lower triangular matrix (from kkt_solve),

    w = Ai diag(beta exp(g_cum)) K        [64, K]
    u = Ai diag(beta) V                   [64, V]

in bf16 out, stored per token like K and V. Value head i reads key head i // (HV / H).

How: one CTA (one warpgroup, 128 threads) per (chunk row of ``flashqla.varlen.chunk_table``,
value head). The row scalings are applied while the tiles are loaded: K and V are read from global
memory, multiplied by beta exp(g_cum) and beta in fp32, rounded to bf16 and written into shared
memory, where they are the B operands of two wgmma products with the bf16 Ai tile as A operand
(fp32 accumulators, 64 registers a thread each, used one after the other). Each product goes back
through shared memory as bf16 so that it is stored a whole row (256 bytes) at a time. Rows past
the chunk's end are loaded as zeros and not stored; empty varlen rows [T, T) do nothing.
Traffic per chunk and head: 8 KB of Ai, 16 KB each of K and V in, 32 KB of w and u out; the
products are 2 x 64 x 64 x 128 multiply-adds, so the kernel is memory bound.

Measured effect (one H200, CUDA events, median of 20 after warm-up; FLA 0.6.0 in the same run):
the kernel alone takes 0.865 ms on (H, HV) = (16, 64), 1 x 32768 tokens (2.03 GB moved, 2.35
TB/s) and 0.433 ms on (16, 32), 8 x 4096 (varlen); FLA's ``recompute_w_u_fwd`` takes 0.887 and
0.428 ms as single calls, 0.712 and 0.356 ms per call when 10 run back to back, so this kernel
is about 0.82x FLA. ``run`` adds the device chunk table (single call 1.24 / 0.80 ms, back to back
0.96 / 0.52 ms). Tried and rejected in the same run: moving the scalings onto the columns of Ai
(so that K and V are plain copies) made the Ai loads scalar 2-byte loads with a per-column scale,
2.30 / 1.16 ms, 2.7x slower.

Taught in: notebooks/03_forward_kernels.py, as a kernel of gdn_fwd.s02.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: the products Ai (diag(.) K) and Ai (diag(.) V) (bf16 in, fp32 accumulate);
# exp2f: the decay exp(g_cum) = exp2(log2(e) g_cum)
SOURCE_MUST_CONTAIN = ("wgmma", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V
THREADS = 128         # one warpgroup
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)


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


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(chunk_w_u_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(k, v, beta, Ai, g_cum, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K], v [B, T, HV, V] bf16, beta, g_cum [B, T, HV] fp32, Ai [B, T, HV, 64] bf16
    (fp32 is cast) -> w [B, T, HV, K], u [B, T, HV, V] bf16 (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_w_u.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"chunk_w_u.s01: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if V != HEAD_DIM:
        raise ValueError(f"chunk_w_u.s01: `v` must have head dim V = {HEAD_DIM}; got {V}")
    if HV % H:
        raise ValueError(f"chunk_w_u.s01: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of k; got HV = {HV}")
    if Ai.shape[-1] != CHUNK_SIZE:
        raise ValueError(f"chunk_w_u.s01: `Ai` must have last dim {CHUNK_SIZE}; got {Ai.shape[-1]}")
    device = k.device
    bf16, fp32 = dict(device=device, dtype=torch.bfloat16), dict(device=device, dtype=torch.float32)
    k_flat = k.to(**bf16).contiguous().view(B * T, H, K)
    v_flat = v.to(**bf16).contiguous().view(B * T, HV, V)
    beta_flat = beta.to(**fp32).contiguous().view(B * T, HV)
    Ai_flat = Ai.to(**bf16).contiguous().view(B * T, HV, CHUNK_SIZE)
    g_flat = g_cum.to(**fp32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    w = torch.empty(B * T, HV, K, **bf16)
    u = torch.empty(B * T, HV, V, **bf16)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(H, HV)
        with nvtx_range("chunk_w_u.s01"):
            kernel(k_flat, v_flat, beta_flat, Ai_flat, g_flat, bounds, w, u)
    return w.view(B, T, HV, K), u.view(B, T, HV, V)
