"""chunk_o, stage 01: the output of the chunked forward, three products on the tensor cores.

What it computes (``flashqla.reference.chunk_o``): for every chunk of C = 64 tokens and every
value head, with S = h[chunk] the state entering the chunk,

    O = scale (diag(exp(g_cum)) Q S + (Q K^T * Gamma, lower incl. diagonal) V~),

Gamma_ij = exp(g_cum_i - g_cum_j), V~ = v_new. The first term is what the earlier chunks
contribute through the state, the second the causal attention inside the chunk.

How: one CTA of one warpgroup per (chunk row of ``flashqla.varlen.chunk_table``, value head,
V tile of BV = 128, i.e. the whole head), so Q K^T is computed once per chunk and head. Q, K,
V~ and S arrive by TMA as full tiles; the three products are wgmma: Q S (64 x BV x K) and
Q K^T (64 x 64 x K) from shared memory, then P V~ (64 x BV x 64) with P = scale (Q K^T * Gamma)
taken from registers in bf16. Gamma's exponent is taken only where j <= i < n (n the chunk's real
rows), where it is <= 0; elsewhere P is 0 by a select. That makes the tile's rows past the
chunk's end (loaded whole: the next sequence's tokens or TMA's zero fill) harmless: real rows
never read a column j >= n, and output rows >= n are not stored. Chunk rows past the real chunks
(varlen: the table's empty rows [T, T)) do nothing and never read h.

Measured effect (one H200, CUDA events around ``run`` with h already in bf16, median of 20 after
3 warm-up calls; the FLA 0.6.0 Triton ``chunk_fwd_o`` on the same inputs in the same run):

    (H, HV)   tokens           this stage   FLA     BV = 64 (two CTAs a chunk and head)
    (16, 64)  1 x 32768        1.00 ms      1.27    1.08
    (2, 8)    1 x 32768        0.17 ms      0.29    0.19
    (16, 32)  8 x 4096         0.53 ms      0.62    0.58
    (16, 32)  8 x 4096 varlen  0.49 ms      0.78    0.62

Correct (relative error 2.5e-3 against float64, bound 1.1e-2) and 1.2-1.7x faster than FLA on
these rows; (16, 64) moves about 2.4 TB/s of the bytes it must move at least. One tile of the
whole head (BV = 128) beats two of 64: Q K^T and the Q, K loads are not repeated. An earlier run
of the same code gave 1.25 / 0.47 / 0.81 / 0.78 ms (FLA 1.34 / 0.27 / 0.57 / 0.66): the
small rows vary a lot between runs.

Taught in: notebooks/03_forward_kernels.py, as a kernel of gdn_fwd.s02.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma_ss: Q S and Q K^T (PTX wgmma.mma_async, bf16 -> f32, operands in shared memory);
# wgmma_rs: P V~ with P in registers; tma_load: the Q, K, V~, S tiles (cp.async.bulk.tensor);
# exp2f: the decays exp2(log2(e) g_cum) and exp2(log2(e) (g_cum_i - g_cum_j))
SOURCE_MUST_CONTAIN = ("wgmma_ss", "wgmma_rs", "tma_load", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V = 128 only
BV = 128              # V columns of the output per CTA
THREADS = 128         # one warpgroup
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def chunk_o_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")      # rows of the chunk table (a bound for varlen)
    num_rows = T.dynamic("num_rows")          # real chunks, rows of h

    @T.prim_func
    def chunk_o_fwd(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),         # state entering each chunk
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        # chunks and heads on one flat grid axis (x has no 65535 limit), the value heads that
        # share a q/k head adjacent
        with T.Kernel(num_chunks * HV, V // BV, threads=THREADS) as (bx, i_v):
            i_hv = bx % HV
            i_c = bx // HV
            i_h = i_hv // group
            v0 = i_v * BV
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length: 1..64, 0 for empty rows

            q_shared = T.alloc_shared((BT, K), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, BV), "bfloat16")
            s_shared = T.alloc_shared((K, BV), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            o_frag = T.alloc_fragment((BT, BV), "float32")
            a_frag = T.alloc_fragment((BT, BT), "float32")
            p_frag = T.alloc_fragment((BT, BT), "bfloat16")

            loaded = T.alloc_barrier(THREADS)                  # the four TMA loads landed

            if n > 0:
                # Q, K, V~, S <- full tiles (TMA, one barrier for all four); rows >= n are never
                # used for a stored row
                T.tma_copy(q[bos:bos + BT, i_h, :], q_shared, barrier=loaded)
                T.tma_copy(k[bos:bos + BT, i_h, :], k_shared, barrier=loaded)
                T.tma_copy(v_new[bos:bos + BT, i_hv, v0:v0 + BV], v_shared, barrier=loaded)
                T.tma_copy(h[i_c, i_hv, :, v0:v0 + BV], s_shared, barrier=loaded)
                T.barrier_arrive(loaded)
                # g <- log2(e) g_cum, 0 past the end (plain loads, while the TMA loads fly)
                for i in T.Parallel(BT):
                    g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                T.mbarrier_wait_parity(loaded, 0)

                # O <- Q S   (64 x BV x K, wgmma);  A <- Q K^T   (64 x 64 x K, wgmma)
                T.gemm(q_shared, s_shared, o_frag, clear_accum=True)
                T.gemm(q_shared, k_shared, a_frag, transpose_B=True, clear_accum=True)

                # O <- scale diag(exp(g_cum)) O
                for i, j in T.Parallel(BT, BV):
                    o_frag[i, j] = o_frag[i, j] * (scale * T.exp2(g_shared[i]))
                # P <- scale (A * Gamma), lower incl. diagonal, real rows only (exponent <= 0)
                for i, j in T.Parallel(BT, BT):
                    p_frag[i, j] = T.if_then_else(
                        (j <= i) & (i < n), scale * a_frag[i, j] * T.exp2(g_shared[i] - g_shared[j]), 0)

                # O <- O + P V~   (64 x BV x 64, wgmma, P from registers)
                T.gemm(p_frag, v_shared, o_frag)

                # o[bos + i] <- row i, for the chunk's own n rows only
                for i, j in T.Parallel(BT, BV):
                    if i < n:
                        o[bos + i, i_hv, v0 + j] = o_frag[i, j]

    return chunk_o_fwd


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(chunk_o_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(q, k, v_new, h, g_cum, scale=None, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """q, k [B, T, H, K] bf16, v_new [B, T, HV, V] bf16, h [B', NT, HV, K, V] (bf16, or cast to
    it), g_cum [B, T, HV] fp32 -> o [B, T, HV, V] bf16 (see the module doc). No host sync."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_o.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"chunk_o.s01: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"chunk_o.s01: `v_new` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"chunk_o.s01: `v_new` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    q_flat = q.to(**bf16).contiguous().view(B * T, H, K)
    k_flat = k.to(**bf16).contiguous().view(B * T, H, K)
    v_flat = v_new.to(**bf16).contiguous().view(B * T, HV, V)
    h_rows = h.to(**bf16).contiguous().view(-1, HV, K, V)
    g_flat = g_cum.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    o = torch.empty(B * T, HV, V, **bf16)
    if bounds.shape[0] and h_rows.shape[0]:  # every token lies in exactly one chunk
        kernel = _compiled(H, HV)
        with nvtx_range("chunk_o.s01"):
            kernel(q_flat, k_flat, v_flat, h_rows, g_flat, bounds, scale, o)
    return o.view(B, T, HV, V)
