"""kkt_solve, stage 01: (I + A)^-1 per chunk by forward substitution, one thread per column.

What it computes (``flashqla.reference.kkt_solve``): for every chunk of C = 64 tokens and every
value head, with A the chunk's strictly lower 64 x 64 matrix (fp32, rows stored per token),

    Ai = (I + A)^-1,

unit lower triangular, stored per token in bf16 (the dtype of the keys: it is an operand of the
next wgmma, in chunk_w_u).

How: column c of Ai is the solution x of (I + A) x = e_c, found by forward substitution,

    x_i = [i == c] - sum_{j < i} A_ij x_j      for i = 0, 1, ..., 63,

so thread c of the CTA owns column c: its 64 values live in registers (the loops are unrolled, so
every index is a constant), and at each step all threads read the same A_ij from shared memory
(a broadcast, no bank conflicts) and do one fp32 FMA. The 64 columns need no communication at all.
x_j = 0 for j < c, so the warp of columns 32..63 starts at row 32 (496 FMAs a thread instead of
2016); the two warps run two copies of the unrolled code with different start rows. The columns
are then written into a bf16 tile in shared memory, which is stored a whole row at a time.

A partial chunk (n < 64 tokens): rows past the end are loaded as zeros, so those rows of I + A are
identity rows; they never feed rows < n (the matrix is lower triangular), and they are not
stored. One CTA of 64 threads per (chunk row of ``flashqla.varlen.chunk_table``, value head);
empty varlen rows [T, T) load and store nothing. The traffic is 16 KB of fp32 in and 8 KB of
bf16 out per chunk and head, so the kernel is meant to be memory bound: the 2.5 thousand FMAs
a (chunk, head) costs are spread over many resident CTAs (eight a multiprocessor, at 128
registers a thread). It is not there yet: a CTA loads, then solves, then stores, with nothing of
its own to overlap.

Measured effect (one H200, CUDA events, median of 20 after warm-up; FLA 0.6.0 in the same run):
the kernel alone takes 0.376 ms on (H, HV) = (16, 64), 1 x 32768 tokens (0.81 GB moved, 2.14
TB/s) and 0.204 ms on (16, 32), 8 x 4096 (varlen), against 1.35 and 0.68 ms for FLA's
``solve_tril`` with bf16 output (10 calls back to back): 3.6x and 3.3x faster. ``run`` adds the
device chunk table: 0.70 / 0.52 ms as single calls, 0.47 / 0.34 ms back to back. In the SASS
(sm_90a) a (chunk, head) costs 2512 FFMA and 624 LDS.128 over its two warps. FLA's forward does
not run ``solve_tril``: its ``chunk_gated_delta_rule_fwd_intra`` fuses K K^T with the solve, then
forms w and u, in 1.46 / 0.75 ms back to back, against 1.56 / 0.81 ms for the kernels of
chunk_kkt, kkt_solve and chunk_w_u here.

Taught in: notebooks/03_forward_kernels.py, as a kernel of gdn_fwd.s02.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# x: each thread's column of Ai in 64 fp32 registers; acc: the four partial sums of a row
SOURCE_MUST_CONTAIN = ("float x[64]", "float acc[4]")

CHUNK_SIZE = 64       # C; also the threads of a CTA, one per column
DEFAULT_SHAPE = dict(HV=32)


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


@functools.cache
def _compiled(HV: int):
    return compile_hopper(kkt_solve_kernel(HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(A, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """A [B, T, HV, 64] fp32, strictly lower per chunk -> Ai [B, T, HV, 64] bf16 (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"kkt_solve.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, HV, C = A.shape
    if C != CHUNK_SIZE:
        raise ValueError(f"kkt_solve.s01: `A` must have last dim {CHUNK_SIZE} (the chunk size); got {C}")
    device = A.device
    A_flat = A.to(torch.float32).contiguous().view(B * T, HV, C)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    Ai = torch.empty(B * T, HV, C, dtype=torch.bfloat16, device=device)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(HV)
        with nvtx_range("kkt_solve.s01"):
            kernel(A_flat, bounds, Ai)
    return Ai.view(B, T, HV, C)
