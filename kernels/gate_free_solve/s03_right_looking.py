"""gate_free_solve, stage 03: s02's solve by a right-looking substitution, two value heads at once.

What it computes: s01's and s02's (``flashqla.reference.gate_free_solve``): per chunk of C = 64
tokens and value head, Ab = A_r diag(beta), A_r = (I + StrictLower(diag(beta) K K^T))^-1, in bf16
per token ([B, T, HV, 64]); a (chunk, value head) with some beta ||k||^2 > 2 solves the gated
matrix and is flagged ``gated``: the same precision policy.

What changed from s02: how a column of X = (I + A)^-1 is solved. s02 (and s01) formed row i of a
column as a sum over the rows before it, x_i = [i == c] - beta_i sum_{l < i} a_il x_l, so each row
waited on a sum that waited on the row before: a chain of dependent loads, multiply-adds and a
shuffle, with few warps to hide it (s02: four warps a CTA, 144 registers, three CTAs an SM, and
phase B on warp 0 alone at the end). Measured inside gdn_fwd.s11, s02 still took roughly 490 us on
(16, 64) 1 x 32768 (inferred: s01's 557 minus s11's gain over s10), where FlashQLA's kkt_solve
takes 438 and the traffic floor (K in, Ab out) is about 100. Here the update is right-looking:
once x_j is known, every later row's pending sum takes its term at once,

    x_j = [j == c] - beta_j s_j;    s_i <- s_i + a_ij x_j   for all i > j

so step j has 63 - j independent multiply-adds and only s_j's last update, a multiply and a
subtract on the path to the next step. One lane owns one column and keeps its 64 pending sums
s_i in registers; 64 lanes (two warps) solve a value head, and the CTA's four warps two value
heads at once, in passes over the key head's value heads (K K^T is still computed once per key
head, on wgmma). A's entries are read as broadcasts: all lanes of a head read the same 16 bytes.
The warp that owns columns 32..63 starts at step 32 (its x_j are 0
before), so its code is a second, shorter copy (Python-level loop over the two halves: every
register index is a constant).

The steps go in blocks of STEP_BLOCK = 4: the block's own rows first (a 4-row triangle), then
every row below it takes the block's four terms at once (one LDS.128 of row i). The sources:
src[0] is K K^T (row i holds a_i. before beta); a flagged head's slot reads src[1 + slot], built as
K K^T * Gamma below the diagonal, masked to rows < n (exp2 overflows past a chunk's end, where g is padded with 0: gate_free_solve.s02's
first bug). A lane stores each x_j as it is final, Ab_jc = x_j beta_c, straight to global memory
(no staging buffer: 68.6 KB of shared memory, three CTAs an SM).

The compile (nvcc 13.0, sm_90a, (16, 64)): nvcc hoists the unrolled steps' loads ahead of their
multiply-adds. One step at a time, with the source transposed, that took 255 registers and still
spilled; with ``__launch_bounds__(128, 3)`` (MIN_CTAS_PER_SM, the shared-memory occupancy), 168
registers and 130 spill instructions. In blocks of 4 steps: 168 registers, 37 spill instructions
(13 before the solve) among 5,664 (2,606 FFMA); blocks of 8 and 16 spilled 61 and 97.

Precision: the same products in fp32 summed in another order (each s_i in order of j, as
s01's row sums), then s01's bf16 store. Checked in float64 on the CPU: the lanes' arithmetic
(both halves' start, the blocks of steps, beta at finalize, the gated source, rows past n) against
the inverse, to 1e-16, on chunks of 64, 50, 37 and 1 rows.

Measured effect: slower than s02. Nsight Compute on (16, 64) 1 x 8192 (``profiles/ncu_lab.py``, one
H200, commit 4e37c66; ``profiles/results/ncu_gate_free_solve_s0N.csv``): s01 154 us, s02 129,
this stage 141. Its GPU tests (stage, flags, partial chunks) pass. It is still latency-bound, not
issue-bound as expected: ``barrier`` is the top stall (2.73 warps a issued instruction, against
s02's 2.35), occupancy 18 % as s02 (168 registers, 3 CTAs an SM), and the register-resident column
costs spills. The row chain was not what limited s02; the syncs between a pass's phases and the
CTAs' occupancy are. The library keeps s02; no gdn_fwd stage reads this one.

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# wgmma: K K^T (bf16 in, fp32 accumulate); float s_pending[64]: a lane's 64 pending row sums in
# fp32 registers (each one x_i once final)
SOURCE_MUST_CONTAIN = ("wgmma", "float s_pending[64]")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile; one column of X per lane
HEAD_DIM = 128        # K
HEAD_LANES = 64       # lanes that solve one value head (one column each): two warps
HEAD_SLOTS = 2        # value heads solved at once by the CTA's 128 threads
THREADS = HEAD_LANES * HEAD_SLOTS
STEP_BLOCK = 4        # steps whose terms reach the rows below them together (2 LDS.128 a row)
MIN_CTAS_PER_SM = 3   # __launch_bounds__(128, 3): 168 registers a thread, as many CTAs as the
                      # shared memory allows (nvcc hoists the unrolled steps' loads: 255 uncapped)
GROWTH_LIMIT = 2.0    # beta ||k||^2 <= 2  <=>  ||I - beta k k^T|| <= 1: A_r cannot grow
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)


def gate_free_solve_kernel(H: int, HV: int, heads_per_cta: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA solving ``heads_per_cta``
    value heads of one key head (a divisor of HV / H), two at a time; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R = CHUNK_SIZE, HEAD_DIM, heads_per_cta
    passes = -(-R // HEAD_SLOTS)
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gate_free_solve_right_looking(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # read only for flagged chunks
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_chunks, HV // R, threads=THREADS) as (i_c, i_r):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            t = T.get_thread_binding()
            slot = t // HEAD_LANES                             # which of the two heads of a pass
            c = t % HEAD_LANES                                 # this lane's column of X
            upper = (t // 32) % 2                              # 1: the warp of columns 32..63
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_s = T.alloc_shared((C, K), "bfloat16")
            # the solve's sources, A before beta (row i: a_i.): [0] K K^T, [1 + slot] K K^T * Gamma
            # for a flagged head in that slot
            src_s = T.alloc_shared((1 + HEAD_SLOTS, C, C), "float32")
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            kkt_f = T.alloc_fragment((C, C), "float32")
            s_pending = T.alloc_local((C,), "float32")         # s_i, the pending sum of row i; x_i once final
            sel = T.alloc_var("int32")                         # this slot's source

            # flag_r <- 0 (the barriers before K K^T order these stores before the ones below)
            for r in T.Parallel(R):
                flag_s[r] = 0
            # K <- k[bos : bos + n]; beta, log2(e) g_cum of the R value heads; zeros below row n
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for r, i in T.Parallel(R, C):
                beta_s[r, i] = T.if_then_else(i < n, beta[bos + i, hv0 + r], 0)
                g_s[r, i] = T.if_then_else(i < n, g_cum[bos + i, hv0 + r] * LOG2E, 0)
            # K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), once for the key head
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            T.copy(kkt_f, src_s[0, :, :])
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * src_s[0, i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1

            for p in T.serial(passes):
                # a flagged head's source: a_ij = (K K^T)_ij exp2(g_i - g_j) for j < i < n
                # (exponent <= 0), 0 elsewhere (exp2 overflows past the chunk's end)
                for sl in (0, 1):
                    if 2 * p + sl < R:
                        if flag_s[2 * p + sl] == 1:
                            for i, j in T.Parallel(C, C):
                                src_s[1 + sl, i, j] = T.if_then_else(
                                    (j < i) & (i < n),
                                    src_s[0, i, j] * T.exp2(g_s[2 * p + sl, i] - g_s[2 * p + sl, j]), 0)
                T.sync_threads()

                # x <- (I + A)^-1 e_c, right-looking: x_j = [j == c] - beta_j s_j (stored at once as
                # Ab_jc = x_j beta_c), then every s_i (i > j) takes a_ij x_j. The warp of columns
                # 32..63 starts at step 32 (its x_j are 0 before: zeros stored above)
                for half in (0, 1):  # a Python loop: two copies, every register index a constant
                    if (2 * p + slot < R) & (upper == half):
                        r = 2 * p + slot
                        sel = T.if_then_else(flag_s[r] == 1, 1 + slot, 0)
                        for j in T.unroll(32 * half):
                            if j < n:
                                ab[bos + j, hv0 + r, c] = 0
                        for i in T.unroll(32 * half, C):
                            s_pending[i] = 0.0
                        for jb in T.unroll(32 * half // STEP_BLOCK, C // STEP_BLOCK):
                            # the block's STEP_BLOCK steps, within its own rows
                            for jj in T.unroll(STEP_BLOCK):
                                j = STEP_BLOCK * jb + jj
                                s_pending[j] = T.if_then_else(j == c, 1.0, 0.0) - beta_s[r, j] * s_pending[j]
                                if j < n:
                                    ab[bos + j, hv0 + r, c] = s_pending[j] * beta_s[r, c]
                                for i in T.unroll(j + 1, STEP_BLOCK * jb + STEP_BLOCK):
                                    s_pending[i] = s_pending[i] + src_s[sel, i, j] * s_pending[j]
                            # then the rows below it, all of the block's terms at once
                            for i in T.unroll(STEP_BLOCK * jb + STEP_BLOCK, C):
                                for jj in T.unroll(STEP_BLOCK):
                                    s_pending[i] = s_pending[i] + src_s[sel, i, STEP_BLOCK * jb + jj] * s_pending[STEP_BLOCK * jb + jj]
                for sl in (0, 1):
                    if (2 * p + sl < R) & (t == 0):
                        gated[i_c, hv0 + 2 * p + sl] = flag_s[2 * p + sl]
                T.sync_threads()  # the next pass may rebuild a slot's source

    return gate_free_solve_right_looking


@functools.cache
def _compiled(H: int, HV: int, heads_per_cta: int):
    return compile_hopper(gate_free_solve_kernel(H, HV, heads_per_cta))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    H, HV = DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]
    return _compiled(H, HV, HV // H).get_kernel_source()


def _check(k, beta, chunk_size):
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gate_free_solve.s03: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K, HV = k.shape[2], k.shape[3], beta.shape[2]
    if K != HEAD_DIM:
        raise ValueError(f"gate_free_solve.s03: `k` must have head dim K = {HEAD_DIM}; got {K}")
    if HV % H:
        raise ValueError(f"gate_free_solve.s03: `beta` must have a number of value heads HV that is "
                         f"a multiple of the H = {H} heads of k; got HV = {HV}")


def solve(k, beta, g_cum, cu_seqlens=None, heads_per_cta=None):
    """The kernel with its fallback: k [B, T, H, K] bf16, beta, g_cum [B, T, HV] fp32 ->
    (ab [B, T, HV, 64] bf16, gated [NT, HV] int32, one row per row of the chunk table): ab holds
    Ab for chunks with gated = 0 and Ai diag(beta) (the gate kept) for chunks with gated = 1.
    ``heads_per_cta`` defaults to HV / H (K K^T once per key head)."""
    _check(k, beta, CHUNK_SIZE)
    B, T, H, K = k.shape
    HV = beta.shape[2]
    device = k.device
    fp32 = dict(device=device, dtype=torch.float32)
    k_flat = k.to(device=device, dtype=torch.bfloat16).contiguous().view(B * T, H, K)
    beta_flat = beta.to(**fp32).contiguous().view(B * T, HV)
    g_flat = g_cum.to(**fp32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, device=device, dtype=torch.bfloat16)
    gated = torch.empty(bounds.shape[0], HV, device=device, dtype=torch.int32)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(H, HV, HV // H if heads_per_cta is None else heads_per_cta)
        with nvtx_range("gate_free_solve.s03"):
            kernel(k_flat, beta_flat, g_flat, bounds, ab, gated)
    return ab.view(B, T, HV, CHUNK_SIZE), gated


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (see the module doc).
    The op has no gate: with g_cum = 0 the fallback solves the same matrix."""
    _check(k, beta, chunk_size)
    return solve(k, beta, torch.zeros_like(beta, dtype=torch.float32), cu_seqlens)[0]
