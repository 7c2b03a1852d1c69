"""chunk_kkt, stage 01: the first TileLang kernel of the workbench; K K^T on the tensor cores.

What it computes (``flashqla.reference.chunk_kkt``): for every chunk of C = 64 tokens and every
value head,

    A = StrictLower(diag(beta) K K^T * Gamma),   Gamma_ij = exp(g_cum_i - g_cum_j),

stored per token: token t, at row i = its position in its chunk, holds row i of its chunk's A.

Why chunk_kkt first: it is the smallest step of the chunked forward that has a real matrix product
(64 x 64 x K per chunk and head), has no dependence between chunks, and reads every input that the
later kernels read (bf16 keys, fp32 gates, varlen boundaries). So it is where the three things that
every later kernel repeats are shown once, on their own:

- the product on the tensor cores: ``T.gemm`` of two shared-memory tiles lowers to Hopper's
  warpgroup MMA (``wgmma.mma_async``), one warpgroup of 128 threads owning a 64 x 64 fp32
  accumulator (32 registers a thread);
- the chunk map for varlen: one CTA per (chunk, value head); the host turns ``cu_seqlens`` into a
  small int32 table of chunk bounds [start, end) over the packed tokens (FLA builds the same thing
  as ``chunk_indices``, as (sequence, chunk) pairs). Chunks restart at every sequence start; a
  sequence's last chunk may hold 1 to 64 tokens. An equal-length batch is the same thing with
  B sequences of T tokens, so one kernel, compiled once per (H, HV, K), serves both: the token
  and chunk counts are symbolic (``T.dynamic``);
- partial chunks: rows past the chunk's end are loaded as zeros, never as the next sequence's
  tokens, and output rows past the end are not written (they are the next sequence's rows).

Measured effect (one H200, ``profiles/chunk_kkt_lab.py`` -> ``profiles/results/chunk_kkt.csv``,
every row in the same run): on (H, HV) = (16, 64), 1 x 32768 tokens, ``run`` takes 0.55 ms, 19x
faster than the fp32 PyTorch reference (10.7 ms) but 0.49x the speed of FLA's Triton
``chunk_scaled_dot_kkt_fwd`` (0.27 ms); across the five lab shapes it reaches 0.13-0.49x FLA, and
an earlier run of the same code gave 0.68 ms (host-side noise, below). It is correct (relative
error about 2e-7 against float64) and slow for reasons that later stages fix: the host rebuilds
the chunk table from ``cu_seqlens`` on every call (a device sync and a copy, about 0.2 ms when the
kernel alone is timed, most of the time on small shapes); each value head reloads its key head
(HV / H times the k traffic); the loads are plain, not TMA; and the fp32 A tile, the largest
traffic (64 floats per token and head), is stored straight from registers.

Taught in: Lab log (book page lab_log); background in notebooks/03_forward_kernels.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range

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


def prepare_chunk_bounds(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int,
                         chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [num_chunks, 2]: [start, end) over the packed tokens of every chunk, sequence by sequence.

    Without cu_seqlens the batch is ``batch`` sequences of ``seqlen`` tokens packed back to back.
    Reads cu_seqlens on the host (one device synchronization).
    """
    if cu_seqlens is None:
        bounds = [b * seqlen for b in range(batch + 1)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
    rows = [(start, min(start + chunk_size, eos))
            for bos, eos in zip(bounds, bounds[1:])
            for start in range(bos, eos, chunk_size)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def run(k, g_cum, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, g_cum, beta [B, T, HV] fp32 -> A [B, T, HV, 64] fp32 (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_kkt.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = k.shape
    HV = beta.shape[2]
    if K % 16 or not 16 <= K <= 256:
        raise ValueError(f"chunk_kkt.s01: `k` must have a head dim K that is a multiple of 16 "
                         f"up to 256; got K = {K}")
    if HV % H:
        raise ValueError(f"chunk_kkt.s01: `beta` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of k; got HV = {HV}")
    device = k.device
    k_flat = k.to(torch.bfloat16).contiguous().view(B * T, H, K)
    g_flat = g_cum.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    beta_flat = beta.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    bounds = prepare_chunk_bounds(cu_seqlens, B, T).to(device)
    A = torch.empty(B * T, HV, CHUNK_SIZE, dtype=torch.float32, device=device)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row of A gets written
        kernel = _compiled(H, HV, K)
        with nvtx_range("chunk_kkt.s01"):
            kernel(k_flat, g_flat, beta_flat, bounds, A)
    return A.view(B, T, HV, CHUNK_SIZE)
