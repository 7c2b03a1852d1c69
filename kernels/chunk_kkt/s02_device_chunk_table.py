"""chunk_kkt, stage 02: the chunk table built on the device; no host synchronization.

What it computes: the same as stage 01 (``flashqla.reference.chunk_kkt``), with the same kernel,
line for line: for every chunk of C = 64 tokens and every value head,

    A = StrictLower(diag(beta) K K^T * Gamma),   Gamma_ij = exp(g_cum_i - g_cum_j),

stored per token (token t, at row i of its chunk, holds row i of its chunk's A).

What changed, the one change: the table of chunk bounds [start, end) that maps a CTA to its
tokens. Stage 01 built it on the host from ``cu_seqlens.tolist()``: a device synchronization (the
host waits for every queued kernel), a Python loop and a host-to-device copy on every call, about
0.2 ms when the kernel alone is timed, and a call that CUDA graphs cannot capture. Here
``flashqla.varlen.chunk_table`` builds it with a few small PyTorch ops queued on the device. The
host cannot know how many chunks the sequences make without reading their lengths, so for varlen
the table has a bound floor(T / C) + N rows instead; the rows past the real chunks are empty,
[T, T): their CTAs load nothing (every row is masked, n = 0) and store nothing. Without
``cu_seqlens`` the count B ceil(T / C) is exact.

Measured effect (one H200, CUDA events, median of 20 after warm-up; FLA 0.6.0 in the same run):
the kernel is unchanged (0.321 ms on (H, HV) = (16, 64), 1 x 32768 tokens; 0.170 ms on (16, 32),
8 x 4096 varlen; FLA's ``chunk_scaled_dot_kkt_fwd`` 0.269 / 0.140 ms back to back). What changed
is how ``run`` behaves in a stream of work. One call on an idle GPU is slower than stage 01's
(0.654 vs 0.565 ms; 0.505 vs 0.406 ms): the host launches about 25 small ops to build the table,
more host time than stage 01's sync and loop. Ten calls back to back, the way a forward chains
kernels, take 0.410 vs 0.543 ms a call (0.333 vs 0.396 ms): with no sync, the host queues the
next call while the GPU runs the current one, where stage 01 drains the GPU on every call. The
remaining gap to the kernel is that host work, paid on every call; building the table once per
forward (or in one kernel) removes it.

Taught in: notebooks/03_forward_kernels.py, as a kernel of gdn_fwd.s02.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: the product K K^T (tl::wgmma_ss, PTX wgmma.mma_async m64n64k16 bf16 -> f32);
# exp2f: the decay exp2(log2(e) (g_cum_i - g_cum_j)) (PTX ex2.approx.f32)
SOURCE_MUST_CONTAIN = ("wgmma", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
THREADS = 128         # one warpgroup
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32, K=128)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


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


@functools.cache
def _compiled(H: int, HV: int, K: int):
    return compile_hopper(chunk_kkt_kernel(H, HV, K))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(k, g_cum, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, g_cum, beta [B, T, HV] fp32 -> A [B, T, HV, 64] fp32 (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_kkt.s02: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = k.shape
    HV = beta.shape[2]
    if K % 16 or not 16 <= K <= 256:
        raise ValueError(f"chunk_kkt.s02: `k` must have a head dim K that is a multiple of 16 "
                         f"up to 256; got K = {K}")
    if HV % H:
        raise ValueError(f"chunk_kkt.s02: `beta` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of k; got HV = {HV}")
    device = k.device
    k_flat = k.to(torch.bfloat16).contiguous().view(B * T, H, K)
    g_flat = g_cum.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    beta_flat = beta.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    A = torch.empty(B * T, HV, CHUNK_SIZE, dtype=torch.float32, device=device)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row of A gets written
        kernel = _compiled(H, HV, K)
        with nvtx_range("chunk_kkt.s02"):
            kernel(k_flat, g_flat, beta_flat, bounds, A)
    return A.view(B, T, HV, CHUNK_SIZE)
