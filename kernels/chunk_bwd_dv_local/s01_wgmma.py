"""chunk_bwd_dv_local, stage 01: the output's gradient into v_new inside each chunk, two wgmma.

What it computes (``flashqla.reference.chunk_bwd_dv_local``): for every chunk of C = 64 tokens and
every value head, the part of dL/dv_new that flows back through the causal attention inside the
chunk (the forward's second term of o, scale (Q K^T * Gamma, lower incl. diagonal) V~):

    dV_local = scale (K Q^T * Gamma^T, upper incl. diagonal) dO,   Gamma_ij = exp(g_cum_i - g_cum_j),

i.e. row j of dV_local sums scale exp(g_cum_i - g_cum_j) (k_j . q_i) dO_i over the rows i >= j of
the chunk. The rest of dL/dv_new (through the state into later chunks) is chunk_bwd_dhu's.

How: the mirror of chunk_o.s01. One CTA of one warpgroup per (chunk row of
``flashqla.varlen.chunk_table``, value head), the whole head (V = 128) per CTA so K Q^T is
computed once per chunk and head. K, Q and dO arrive by TMA as full tiles (one mbarrier); both
products are wgmma: B = K Q^T (64 x 64 x K, shared x shared), then dV = P^T dO (64 x V x 64)
with P^T = scale (B * Gamma^T) taken from registers in bf16. Gamma's exponent is taken only where
j <= i < n (n the chunk's real rows), where g_cum_i - g_cum_j <= 0; elsewhere P^T is 0 by a
select, so the tile's rows past the chunk's end (the next sequence's tokens or TMA's zero fill)
never reach a stored row, and output rows >= n are not stored. Empty chunk rows [T, T) do nothing.

Measured effect (one H200, CUDA events around ``run``, median of 20 after 3 warm-up calls; FLA
0.6.0's Triton ``chunk_bwd_dv_local`` on the same inputs in the same run,
``profiles/gdn_bwd_s01_lab.py``; K = V = 128):

    (H, HV)   tokens        this stage   FLA
    (16, 64)  1 x 32768     0.580 ms     0.589
    (2, 8)    1 x 32768     0.099 ms     0.135

Correct on the public test shapes, on par with FLA on the large row and 1.4x faster on the small
one; its bf16 output equals FLA's (relative difference 0.0 at both shapes: the same products, in
the same order, rounded the same way). A second run gave 0.585 / 0.122 ms (FLA 0.604 / 0.207).

Taught in: notebooks/07_backward.py, as a kernel of gdn_bwd.s01.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma_ss: K Q^T (PTX wgmma.mma_async, bf16 -> f32, operands in shared memory); wgmma_rs: P^T dO
# with P^T in registers; tma_load: the K, Q, dO tiles (cp.async.bulk.tensor); exp2f: the decays
SOURCE_MUST_CONTAIN = ("wgmma_ss", "wgmma_rs", "tma_load", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V = 128 only
THREADS = 128         # one warpgroup
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


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


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(chunk_bwd_dv_local_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(q, k, do, g_cum, scale=None, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """q, k [B, T, H, K] bf16, do [B, T, HV, V] bf16, g_cum [B, T, HV] fp32
    -> dv_local [B, T, HV, V] bf16 (see the module doc). No host sync."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_bwd_dv_local.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"chunk_bwd_dv_local.s01: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"chunk_bwd_dv_local.s01: `do` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"chunk_bwd_dv_local.s01: `do` must have a number of value heads HV that "
                         f"is a multiple of the H = {H} heads of q; got HV = {HV}")
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    q_flat = q.to(**bf16).contiguous().view(B * T, H, K)
    k_flat = k.to(**bf16).contiguous().view(B * T, H, K)
    do_flat = do.to(**bf16).contiguous().view(B * T, HV, V)
    g_flat = g_cum.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    dv = torch.empty(B * T, HV, V, **bf16)
    if bounds.shape[0]:  # every token lies in exactly one chunk
        kernel = _compiled(H, HV)
        with nvtx_range("chunk_bwd_dv_local.s01"):
            kernel(q_flat, k_flat, do_flat, g_flat, bounds, scale, dv)
    return dv.view(B, T, HV, V)
