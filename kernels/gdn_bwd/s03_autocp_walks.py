"""gdn_bwd, stage 03: backward AutoCP, s02's two state walks cut into segments that run in parallel.

What changed from s02: s02's walk runs one chain per (sequence, value head, 64 value columns) and
role, 4 HV CTAs a sequence at one CTA an SM, each as long as its sequence; with few heads on one
long sequence most SMs idle (32 CTAs walk 512 chunks each on (2, 8) 1 x 32768). This stage cuts
every sequence into segments of L chunks (``flashqla.autocp``'s plan, the forward's) and runs the
same walk kernel over the segment rows as if they were sequences, each from its own initial state
h_j (forward role) and its own final-state gradient dht_j (reverse role). s02's prep,
chunk_bwd_dqkwg.s01, wy_bwd.s01 and finish run unchanged: the segments' chunks are the sequences'
chunk-table rows, so h, dh, v_new and dV~ land where the chunk-parallel kernels read them. Why:
``profiles/results/gdn_train.csv`` (H200) has the training step at 0.26-0.36x FlashQLA's on the
few-head single sequences, where FlashQLA cuts its backward into segments (../shared/BACKWARD.md
2.5, 4).

The segment boundary values, with the plan's slots (segment j of sequence n), in launch order:

    prep                 s02's: g, k, v, beta -> g_cum, Ai (gated T), w, u
    the forward's solve  gdn_fwd.s44's prologue: g -> g_cum, the chunk table; k, beta -> Ab, gated.
                         The forward's warm-up reads the gate-free Ab, which s02's prep does not
                         make (its Ai is FLA's gated T, without diag(beta)); re-running the solve
                         (chunk-parallel, one launch) is cheaper than a new warm-up kernel on w, u
    windows              gdn_fwd.s44's: per (slot, head) its forward window or exact
    warm-up              gdn_fwd.s44's: Z_j and, for exact heads, M_j from k, v, Ab
    chain                gdn_fwd.s44's: h_j = Z_j + M_j h_{j-1}, the initial state of every row
    backward windows     ``bwd_windows_kernel``: per backward slot and head its window from the
                         segment's start, ``flashqla.autocp.backward_windows`` as a kernel
    dh warm-up           ``dh_warmup_kernel``: per backward slot and head, dZ_j, the reverse walk
                         from zero over the window (s02's reverse role without its stores), and
                         for exact heads M_j^T, the same walk from dS' = I with dO = 0 (not the
                         forward's warm-up from S = I: it reads whole chunks only, where a
                         sequence's last segment, whose M_j^T carries dht, may end in a partial
                         one, and it gives M, which the chain would need transposed)
    reverse chain        gdn_fwd.s44's chain kernel on the backward slots: dht_{j-1} = dZ_j +
                         M_j^T dht_j, from each sequence's dht (its last segment's) back
    walk                 s02's, over the segment rows: h, v_new, dh, dV~, a dh0 per row
    chunk_bwd_dqkwg.s01, wy_bwd.s01, finish   s02's, unchanged; dh0 <- each sequence's first row

Backward slots count from each sequence's end (``flashqla.autocp.backward_windows``): slot r N + n
walks segment J_n - r, so the reverse chain walks contiguous slots forward, as the forward's
chain kernel does, and needs no kernel of its own. The dh recurrence is written with s02's w
(dS = exp(g_C) dS' + scale Q^T diag(exp g) dO - w^T dV~, dV~ = diag(exp(g_C - g)) K dS' + P^T
dO): M_j^T = prod over the segment's chunks of exp(g_C) I - w^T diag(exp(g_C - g)) K, in fp32,
like Z, M, dZ. Windows are counted from the segment's start forward (FlashQLA's backward warm-up
counts, ``hopper/cp_fwd.py:196-210``): a decaying head's window is a chunk or two; a g = 0 head
(or one whose segment breaks the bound's conditions: g > 0, beta < 0, a chunk the solve flagged
gated) walks the whole segment and chains M_j^T. A sequence's last segment with no dht needs no
M_j.

The rule (``segment_chunks``), in chunk steps of s02's walk. Unsplit, the walk takes the longest
sequence's chunks, or its CTA-chunks / SMs where it runs in waves (4 HV CTAs a sequence, 1 an
SM). Split at L: L x its waves (4 HV CTAs a segment) + WARMUP_STEPS L (both warm-ups, an exact
head's L chunks each, assumed to fit one wave) + SEGMENT_STEPS a segment of the longest sequence
(the two chains) + FIXED_STEPS (the solve, the windows, the launches), over the lengths of
SEGMENT_LADDER and L0, 2 L0 (L0: the shortest L whose walk fits one wave); split when the
cheapest is below 1 / MIN_GAIN of the unsplit walk. The constants are ASSUMED, not measured:
a warm-up step like a walk step (the same products without the stores) plus s44's phase 1 at
0.6 of one, a chain step 1.7 walk steps (gdn_fwd's SEGMENT_STEPS 4.8 fused steps of ~1.1 us,
against ~3 us a walk step: s01's chunk_h 1.53 ms and dhu 1.61 ms for 512 chunks on (16, 64) 1 x
32768), a fixed 15 steps. On 132 SMs they split (2, 8) 1 x 8192 (L 16), 1 x 32768 of (2, 8),
(4, 16) and (16, 16) (L 32), 28672 + 4096 of those three (L 32), and nothing with 24 value heads
or more, nor 8 x 4096 (the walk fills the SMs there).

Measured effect (H100, one run, FLA and FlashQLA timed beside it, training step = the library's
forward + this backward, CUDA graph replay; ``profiles/results/gdn_train_s03.csv``, commit
a502c0e): the split problems got faster, the unsplit one did not move, and every one is still
behind FlashQLA, whose backward is one fused, warp-specialized reverse kernel (s04 fused the
reverse work without the warp roles and lost to this stage: 0.66-0.73x).

    problem          s02 ms  s03 ms  s03 / s02  FlashQLA ms  s03 vs FlashQLA  s03 vs FLA
    (2, 8) 1x8192     0.923   0.637    1.45x       0.426         0.67x          1.51x
    (2, 8) 1x32768    3.378   1.895    1.78x       1.109         0.59x          2.00x
    (4, 16) 1x8192    1.195   1.191    1.00x       0.608         0.51x   (no split) 1.11x
    (4, 16) 1x32768   4.379   3.500    1.25x       1.931         0.55x          1.51x

Napkin math, (2, 8) 1x32768: 77 TFLOP/s of useful training-step work (9.7 % of the 797 TFLOP/s
measured bf16 roof) and 180 GB/s of compulsory bytes (6.1 % of the copy roof): latency-bound
chains and HBM round trips, not a roof. The split cut the walks as planned; what is left is s02's
five launches and their ~470 KiB of HBM traffic per (chunk, value head) (BACKWARD.md 4).

Promoted: the library's backward (``flashqla/bwd.py``) runs this plan where the rule splits.

Taught in: notebooks/08_backward_autocp.py.
"""

import functools

import torch

from flashqla import autocp
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla.stages import load
from flashqla.varlen import chunk_table, host_bounds, seq_bounds

NEEDS = ("hopper",)
# gdn_bwd_autocp_dh_warmup: the dh warm-up kernel; tma_load: its tiles; wgmma_rs: P^T dO with P^T
# in registers; cudaGridDependencySynchronize: the new kernels are programmatic dependents, as the
# forward's AutoCP kernels they run beside
SOURCE_MUST_CONTAIN = ("gdn_bwd_autocp_dh_warmup", "gdn_bwd_autocp_windows", "tma_load", "wgmma_rs",
                       "cudaGridDependencySynchronize()")

S02 = load("gdn_bwd", 2)         # prep, the walk, finish; chunk_bwd_dqkwg.s01 and wy_bwd.s01
S44 = load("gdn_fwd", 44)        # the forward's solve (its prologue), windows, warm-up and chain
CHUNK_SIZE = S02.CHUNK_SIZE      # C = 64
HEAD_DIM = S02.HEAD_DIM          # K = V = 128
BV = S02.BV                      # 64 value (or M^T) columns a warm-up CTA, as s02's walk
WARPGROUP = 128
STAGES = S02.STAGES              # the dh warm-up's tile stages, as s02's walk
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}
WINDOW_THREADS = 256             # the backward windows kernel: a token of the segment a thread ...
UNROLL = 4                       # ... four at once
MAX_WINDOW = autocp.MAX_WARMUP_CHUNKS
# ---- the rule (``segment_chunks``), in chunk steps of s02's walk; assumed until measured (above)
WALK_LANES = 2 * (HEAD_DIM // BV)  # CTAs a (segment, value head): two roles x two column tiles
SEGMENT_LADDER = (8, 16, 24, 32, 48, 64, 96, 128)
WARMUP_STEPS = 1.6               # per chunk of a segment: the dh warm-up (1) and the forward's (0.6)
SEGMENT_STEPS = 3.5              # per segment of the longest sequence: the two chains
FIXED_STEPS = 15                 # once: the solve, both windows kernels, the launches
MIN_GAIN = 1.1                   # a split must be predicted this much faster than the unsplit walk


def bwd_windows_kernel(HV: int):
    """The T.prim_func of ``flashqla.autocp.backward_windows`` for HV value heads, the bound's
    conditions read as the forward's windows kernel reads them (g <= 0 and beta >= 0 a token; a
    chunk the solve flagged gated, some beta ||k||^2 > 2): one CTA per (backward slot, head)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, W = CHUNK_SIZE, MAX_WINDOW
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_bounds = T.dynamic("num_bounds")     # N + 1
    num_slots = T.dynamic("num_slots")       # J N

    @T.prim_func
    def gdn_bwd_autocp_windows(
        g: T.Tensor((num_tokens, HV), "float32"),              # per-token log decay
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        beta: T.Tensor((num_tokens, HV), "float32"),
        gated: T.Tensor((num_chunks, HV), "int32"),            # the solve's: some beta ||k||^2 > 2
        seqs: T.Tensor((num_bounds,), "int32"),                # token offsets of the sequences
        first_chunk: T.Tensor((num_bounds,), "int32"),         # chunk row of each sequence's chunk 0
        row_of_slot: T.Tensor((num_slots,), "int32"),          # the plan's: slot n = first segment row
        seg_chunks: T.int32,                                   # L
        threshold: T.float64,
        use_dht: T.int32,
        win_start: T.Tensor((num_slots, HV), "int32"),
        win_end: T.Tensor((num_slots, HV), "int32"),
        exact: T.Tensor((num_slots, HV), "int32"),
        dht_row: T.Tensor((num_slots,), "int32"),
    ):
        with T.Kernel(num_slots, HV, threads=WINDOW_THREADS) as (i_s, i_hv):
            tx = T.get_thread_binding()
            span = seg_chunks * C
            dec_s = T.alloc_shared((2, W), "float64")          # [0]: chunk decays, [1]: their sums
            flags_s = T.alloc_shared((2,), "int32")             # [0]: the bound fails; [1]: short
            cum = T.alloc_local((1,), "float64")
            # scalars held in variables (TileLang would inline each expression at every use)
            i_n = T.alloc_var("int32")
            r = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            count = T.alloc_var("int32")
            j = T.alloc_var("int32")
            s = T.alloc_var("int32")
            e = T.alloc_var("int32")
            real = T.alloc_var("int32")
            i_n = i_s % (num_bounds - 1)
            r = i_s // (num_bounds - 1)                         # backward slot r of sequence i_n
            eos = seqs[i_n + 1]
            count = T.max(T.ceildiv(eos - seqs[i_n], span), 1)  # the sequence's segments, J_n
            j = count - r                                       # the segment this slot walks
            warm = (r >= 1) & (j >= 1)
            s = T.if_then_else(warm, seqs[i_n] + j * span, eos)
            e = T.min(s + span, eos)
            real = T.ceildiv(e - s, C)                          # the segment's chunks
            w_max = T.min(real, W)

            if tx < 2:
                flags_s[tx] = 0
            # dec_i <- log decay of the segment's chunk i (g_cum at its last real token)
            if tx < W:
                dec_s[0, tx] = T.if_then_else(warm & (tx < w_max),
                                           T.Cast("float64", g_cum[T.max(T.min(s + C * (tx + 1), e) - 1, 0), i_hv]),
                                           0.0)
            T.sync_threads()
            # bad <- a token of the segment with g > 0 or beta < 0 (or NaN: both comparisons fail
            # on it), or a chunk of it flagged gated (beta ||k||^2 > 2)
            if warm:
                for it in T.serial(T.ceildiv(e - s, WINDOW_THREADS * UNROLL)):
                    for u in T.unroll(UNROLL):
                        t = s + (it * UNROLL + u) * WINDOW_THREADS + tx
                        if t < e:
                            if T.Not((g[t, i_hv] <= 0) & (beta[t, i_hv] >= 0)):
                                flags_s[0] = 1
                for it in T.serial(T.ceildiv(real, WINDOW_THREADS)):
                    c = it * WINDOW_THREADS + tx
                    if c < real:
                        if gated[first_chunk[i_n] + j * seg_chunks + c, i_hv] != 0:
                            flags_s[0] = 1
            # cum_i <- the log decay of chunks 0..i, in float64 as autocp.backward_windows sums it
            if tx < W:
                cum[0] = 0.0
                for m in T.serial(W):
                    if m <= tx:
                        cum[0] = cum[0] + dec_s[0, m]
                dec_s[1, tx] = cum[0]
            T.sync_threads()
            # short <- the chunks whose cumulative decay stays above the threshold (a prefix when
            # g <= 0; when it is not, the bound fails and the head walks its whole segment anyway)
            if tx < w_max:
                if (dec_s[1, tx] > threshold) & ((tx + 1 == w_max) | (dec_s[1, T.min(tx + 1, W - 1)] <= threshold)):
                    flags_s[1] = tx + 1
            T.sync_threads()
            if tx == 0:
                whole = warm & ((flags_s[1] == w_max) | (flags_s[0] != 0))
                end = T.if_then_else(warm, T.min(s + C * T.if_then_else(whole, real, flags_s[1] + 1), e), s)
                win_start[i_s, i_hv] = s
                win_end[i_s, i_hv] = end
                exact[i_s, i_hv] = T.if_then_else(warm & (end == e) & ((e < eos) | (use_dht != 0)), 1, 0)
                if i_hv == 0:
                    dht_row[i_s] = T.if_then_else(r < count, row_of_slot[i_n] + count - 1 - r, -1)

    return gdn_bwd_autocp_windows


def dh_warmup_kernel(H: int, HV: int):
    """The T.prim_func of the dh warm-up for H key heads and HV value heads; any token or slot
    count. Grid: (V + K) / BV column tiles per (backward slot, value head), V / BV of dZ, K / BV of
    M^T; a tile walks the chunks of [win_start, win_end) from the last back, as s02's reverse role
    (a consumer and a producer warpgroup, tiles by TMA in STAGES stages, mbarriers full / empty
    per stage), from dS' = 0 (dZ) or, for an exact head, from dS' = I with dO = 0 (M^T). A tile with
    nothing to walk (an M^T tile of a window head, an empty window) writes zeros, which the chain
    reads as M = 0. Compiled for sm_90a: 176 registers a thread, no local memory (``cuobjdump
    -res-usage``), 145 KiB of shared memory as s02's walk: one CTA an SM."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def gdn_bwd_autocp_dh_warmup(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),          # s02's prep: Ai diag(beta exp(g_cum)) K
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        win_start: T.Tensor((num_slots, HV), "int32"),         # the segment's first token
        win_end: T.Tensor((num_slots, HV), "int32"),           # where the walk starts from zero
        exact: T.Tensor((num_slots, HV), "int32"),             # 1: M^T of the segment too
        scale: T.float32,
        dz: T.Tensor((num_slots, HV, K, V), "float32"),        # dZ: the gradient at the segment start
        mt: T.Tensor((num_slots, HV, K, K), "float32"),        # M^T of the segment, 0 where not exact
    ):
        with T.Kernel((V + K) // BV, HV, num_slots, threads=2 * WARPGROUP) as (i_t, i_hv, i_s):
            i_h = i_hv // group
            is_z = i_t < V // BV                               # a tile of dZ (else of M^T)
            take_m = (i_t >= V // BV) & (exact[i_s, i_hv] != 0)
            c0 = (i_t % (V // BV)) * BV                        # its columns (K = V)
            bos = win_start[i_s, i_hv]
            eos = win_end[i_s, i_hv]
            num_c = T.if_then_else(is_z | take_m, T.ceildiv(eos - bos, BT), 0)

            # tile stages, producer -> consumer; g holds log2(e) g_cum, rows past the end padded
            k_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            w_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            q_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            x_s = T.alloc_shared((STAGES, BT, BV), "bfloat16")  # dO's columns c0.. (M^T tiles: unread)
            g_s = T.alloc_shared((STAGES, BT), "float32")
            # consumer only
            s_s = T.alloc_shared((K, BV), "bfloat16")           # dS' in bf16: the operand
            a_s = T.alloc_shared((BT, BV), "bfloat16")          # dO' (0 for M^T)
            b_s = T.alloc_shared((BT, BV), "bfloat16")          # -dV~
            s_f = T.alloc_fragment((K, BV), "float32")          # dS', fp32, all along
            x_f = T.alloc_fragment((BT, BV), "float32")         # dV~
            kq_f = T.alloc_fragment((BT, BT), "float32")        # K Q^T
            p_f = T.alloc_fragment((BT, BT), "bfloat16")        # P^T (0 for M^T)
            bar_full = T.alloc_barrier([WARPGROUP] * STAGES)    # producer -> consumer (+ TMA bytes)
            bar_empty = T.alloc_barrier([WARPGROUP] * STAGES)   # consumer -> producer

            tx = T.get_thread_binding()
            if tx < WARPGROUP:  # ---- the consumer warpgroup: s02's reverse walk, no stores
                # dS' <- 0 (dZ), or columns c0.. of I (M^T of an exact head)
                for d, j in T.Parallel(K, BV):
                    s_f[d, j] = T.if_then_else(take_m & (d == c0 + j), 1.0, 0.0)
                for it in T.serial(num_c):
                    c = num_c - 1 - it                           # chunks from the window's last back
                    st = it % STAGES
                    t0 = bos + c * BT
                    n = T.min(eos - t0, BT)                      # real rows of the chunk, 1..64
                    T.barrier_wait(bar_full[st], (it // STAGES) % 2)
                    T.copy(s_f, s_s)
                    # dO' <- scale diag(exp(g)) dO, rows >= n zeroed (M^T: 0)
                    for i, j in T.Parallel(BT, BV):
                        a_s[i, j] = T.if_then_else(is_z & (i < n), x_s[st, i, j] * (scale * T.exp2(g_s[st, i])), 0)
                    # X <- K dS';  dS <- exp(g_C) dS' + Q^T dO';  B <- K Q^T: one wait for all
                    for d, j in T.Parallel(K, BV):
                        s_f[d, j] = s_f[d, j] * T.exp2(g_s[st, BT - 1])
                    T.wgmma_gemm(k_s[st, :, :], s_s, x_f, clear_accum=True)
                    T.wgmma_gemm(q_s[st, :, :], a_s, s_f, transpose_A=True)
                    T.gemm(k_s[st, :, :], q_s[st, :, :], kq_f, transpose_B=True, clear_accum=True)
                    # P^T[j, i] <- scale B[j, i] exp(g_i - g_j) for j <= i < n, else 0 (M^T: 0)
                    for j, i in T.Parallel(BT, BT):
                        p_f[j, i] = T.if_then_else(
                            is_z & (j <= i) & (i < n), scale * kq_f[j, i] * T.exp2(g_s[st, i] - g_s[st, j]), 0)
                    # dV~ <- diag(exp(g_C - g)) X + P^T dO   (64 x BV x 64, P^T from registers)
                    for i, j in T.Parallel(BT, BV):
                        x_f[i, j] = x_f[i, j] * T.exp2(g_s[st, BT - 1] - g_s[st, i])
                    T.gemm(p_f, x_s[st, :, :], x_f)
                    # -dV~ (rows >= n: 0) to shared for W^T
                    for i, j in T.Parallel(BT, BV):
                        b_s[i, j] = T.if_then_else(i < n, -x_f[i, j], 0)
                    # dS <- dS + W^T (-dV~)   (K x BV x 64, wgmma, W read transposed)
                    T.gemm(w_s[st, :, :], b_s, s_f, transpose_A=True)
                    T.barrier_arrive(bar_empty[st])
                if is_z:
                    T.copy(s_f, dz[i_s, i_hv, :, c0:c0 + BV])
                else:
                    T.copy(s_f, mt[i_s, i_hv, :, c0:c0 + BV])
            else:  # ---- the producer warpgroup: full 64-row boxes (rows >= n masked by the consumer)
                for it in T.serial(num_c):
                    st = it % STAGES
                    t0 = bos + (num_c - 1 - it) * BT
                    T.barrier_wait(bar_empty[st], (it // STAGES) % 2 ^ 1)
                    T.tma_copy(k[t0:t0 + BT, i_h, :], k_s[st, :, :], barrier=bar_full[st])
                    T.tma_copy(q[t0:t0 + BT, i_h, :], q_s[st, :, :], barrier=bar_full[st])
                    T.tma_copy(w[t0:t0 + BT, i_hv, :], w_s[st, :, :], barrier=bar_full[st])
                    T.tma_copy(do[t0:t0 + BT, i_hv, c0:c0 + BV], x_s[st, :, :], barrier=bar_full[st])
                    for i in T.Parallel(BT):
                        g_s[st, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    T.barrier_arrive(bar_full[st])

    return gdn_bwd_autocp_dh_warmup


@functools.cache
def _windows(HV: int):
    return compile_hopper(dependent_launch(bwd_windows_kernel(HV)))


@functools.cache
def _dh_warmup(H: int, HV: int):
    # s02's walk options: the two warpgroups' buffers must not share addresses
    return compile_hopper(dependent_launch(dh_warmup_kernel(H, HV)), {"tl.disable_shared_memory_reuse": True})


def kernel_source() -> str:
    """The CUDA C++ of this stage's two new kernels, generated for sm_90a at the default shape."""
    return "\n".join((_windows(DEFAULT_SHAPE["HV"]).get_kernel_source(),
                      _dh_warmup(**DEFAULT_SHAPE).get_kernel_source()))


def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, force: bool | int | None = None) -> int:
    """The decision rule: chunks per segment L, or 0 for no split, from the sequences' chunk
    counts (host integers); the module doc gives the costs. ``force``: False never splits, True
    splits at the cheapest L (even where the unsplit walk is cheaper), an int is L."""
    longest = max(seq_chunks, default=0)
    if force is False or longest == 0:
        return 0
    if not isinstance(force, bool) and isinstance(force, int):
        if force < 1:
            raise ValueError(f"gdn_bwd.s03: `cp` as segment length must be >= 1 chunk; got {force}")
        return force
    lanes = WALK_LANES * HV

    def segments(L):
        return sum(-(-c // L) for c in seq_chunks)
    L0, hi = autocp.MIN_SEGMENT_CHUNKS, max(autocp.MIN_SEGMENT_CHUNKS, longest)
    while L0 < hi:  # segments shrink in count as L grows: bisect for the shortest L that fits
        mid = (L0 + hi) // 2
        L0, hi = (L0, mid) if lanes * segments(mid) <= num_sms else (mid + 1, hi)
    lengths = ({L for L in SEGMENT_LADDER if 2 * L <= longest}
               | {L for L in (L0, 2 * L0) if -(-longest // L) >= 2})
    costs = [(L * -(-lanes * segments(L) // num_sms) + WARMUP_STEPS * L + SEGMENT_STEPS * -(-longest // L)
              + FIXED_STEPS, L) for L in sorted(lengths)]
    if force is True:
        return min(costs)[1] if costs else max(1, longest // 2)
    unsplit = max(longest, lanes * sum(seq_chunks) / num_sms)
    best = min(costs, default=(unsplit, 0))
    return best[1] if MIN_GAIN * best[0] < unsplit else 0


def split_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, cp):
    """The AutoCP plan (``autocp.Plan`` with ``slot_chunk``) or None, at this stage's rule, from
    the lengths the host knows (``host_bounds``, one read per ``cu_seqlens`` tensor; inside a
    CUDA-graph capture with none before, one sequence of all the tokens stands for them, and the
    plan is built on the device)."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                  else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
    L = segment_chunks(seq_chunks, HV, num_sms, cp)
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if not L or num_seqs == 0:
        return None
    p = None if bounds is None else autocp.host_plan(bounds, L, device)
    if p is None:
        p = autocp.plan(cu_seqlens, B, T, HV, num_sms, WALK_LANES, device, force=L)
        p = autocp.dataclasses.replace(p, slot_chunk=autocp.slot_chunks(cu_seqlens, B, T, L, p.max_segments, device))
    return p


def segment_states(p, k, v, g, beta, h0, seqs, num_rows, threshold=autocp.THRESHOLD):
    """The forward's AutoCP phases 1 and 2 (gdn_fwd.s44's kernels, after its solve): every segment
    row's initial state h_seg [S, HV, K, V] fp32, and the solve's (g_cum, chunk table's first rows,
    gated) for the backward windows. k [B T, H, K] bf16, v [B T, HV, V] bf16, g, beta [B T, HV]
    fp32, h0 [N, HV, K, V] fp32, seqs the sequences' bounds, num_rows the chunk table's."""
    H, HV, K, V = k.shape[1], v.shape[1], k.shape[2], v.shape[2]
    device, N, J = k.device, seqs.shape[0] - 1, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    chunks = torch.empty(num_rows, 2, dtype=torch.int32, device=device)
    first_chunk = torch.empty(N + 1, dtype=torch.int32, device=device)
    g_cum = torch.empty(g.shape, **fp32)
    ab = torch.empty(k.shape[0], HV, CHUNK_SIZE, dtype=torch.bfloat16, device=device)
    gated = torch.empty(chunks.shape[0], HV, dtype=torch.int32, device=device)
    win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
    exact = torch.empty_like(win_start)
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
    S44.S43.prologue(False)(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated,
                            autocp.num_sms(device))
    S44.S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                     p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
    S44._warmup(H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk, exact, z, m)
    S44.S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
    return h_seg, (g_cum, first_chunk, gated)


def segment_grads(p, q, k, w, do, g, beta, g_cum_w, solve, dht, seqs, scale, threshold=autocp.THRESHOLD):
    """The backward's phases: every segment row's final-state gradient dht_seg [S, HV, K, V] fp32,
    and the backward windows (win_start, win_end, exact, dht_row). q, k [B T, H, K], w, do [B T, HV,
    K or V] bf16; g, beta, g_cum_w (s02's prep's, which made w) [B T, HV] fp32; ``solve``:
    ``segment_states``' (g_cum, first_chunk, gated); dht [N, HV, K, V] fp32 or None."""
    HV, K, V = w.shape[1], w.shape[2], do.shape[2]
    device, N, J = q.device, seqs.shape[0] - 1, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    g_cum, first_chunk, gated = solve
    win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
    win_end, exact = torch.empty_like(win_start), torch.empty_like(win_start)
    dht_row = torch.empty(J * N, dtype=torch.int32, device=device)
    _windows(HV)(g, g_cum, beta, gated, seqs, first_chunk, p.row_of_slot, p.segment_chunks, float(threshold),
                 int(dht is not None), win_start, win_end, exact, dht_row)
    dz, mt = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    _dh_warmup(q.shape[1], HV)(q, k, w, do, g_cum_w, win_start, win_end, exact, scale, dz, mt)
    dht_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
    dht_n = dht.to(**fp32).contiguous() if dht is not None else torch.zeros(N, HV, K, V, **fp32)
    # the reverse chain: the forward's chain kernel over the backward slots, M^T for M
    S44.S27._compiled("chain", HV)(dht_n, dz, mt, exact, dht_row, dht_seg)
    return dht_seg, (win_start, win_end, exact, dht_row)


def run(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE, cp=None):
    """(dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32, dh0
    [N, HV, K, V] fp32 or None); see the module doc. ``cp``: None decides (``segment_chunks``),
    False never splits (s02's backward), True splits at the rule's cheapest L, an int is L."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_bwd.s03: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s03: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s03: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_bwd.s03: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    if not (cp is None or isinstance(cp, int)):
        raise ValueError(f"gdn_bwd.s03: `cp` must be None, True, False or a segment length in chunks; got {cp!r}")
    device = q.device
    p = None if B * T == 0 else split_plan(cu_seqlens, B, T, HV, autocp.num_sms(device), device, cp)
    if p is None:
        return S02.run(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, chunk_size)
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    fp32 = {"device": device, "dtype": torch.float32}
    q_flat, k_flat = (x.to(**bf16).contiguous().view(B * T, H, K) for x in (q, k))
    v_flat, do_flat = (x.to(**bf16).contiguous().view(B * T, HV, V) for x in (v, do))
    g_flat, beta_flat = (x.to(**fp32).contiguous().view(B * T, HV) for x in (g, beta))
    seqs = seq_bounds(cu_seqlens, B, T, device)
    table, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N, NT, S = seqs.shape[0] - 1, table.shape[0], p.bounds.shape[0] - 1
    dqkwg, wy = (load(op, number).run for op, number in S02.STEPS)
    with nvtx_range("gdn_bwd.s03"):
        # the forward's intermediates, recomputed: g_cum, Ai, w, u (s02's prep)
        g_cum = torch.empty(B * T, HV, **fp32)
        Ai = torch.empty(B * T, HV, CHUNK_SIZE, **bf16)
        w = torch.empty(B * T, HV, K, **bf16)
        u = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s03.prep"):
            S02._prep(H, HV)(k_flat, v_flat, g_flat, beta_flat, table, g_cum, Ai, w, u)
        # every segment row's initial state (the forward's AutoCP) and final-state gradient
        h0 = initial_state.to(**fp32).contiguous() if initial_state is not None else torch.zeros(N, HV, K, V, **fp32)
        with nvtx_range("gdn_bwd.s03.segment_states"):
            h_seg, solve = segment_states(p, k_flat, v_flat, g_flat, beta_flat, h0, seqs, NT)
        with nvtx_range("gdn_bwd.s03.segment_grads"):
            dht_seg, _ = segment_grads(p, q_flat, k_flat, w, do_flat, g_flat, beta_flat, g_cum, solve,
                                       dht, seqs, scale)
        # s02's walk over the segment rows: h, v_new forward; dh, a dh0 per row, dV~ in reverse
        h = torch.empty(1, NT, HV, K, V, **bf16)
        dh = torch.empty(1, NT, HV, K, V, **bf16)
        v_new = torch.empty(B * T, HV, V, **bf16)
        dv2 = torch.empty(B * T, HV, V, **bf16)
        dh0_rows = torch.empty(S if initial_state is not None else 1, HV, K, V, **fp32)
        with nvtx_range("gdn_bwd.s03.walk"):
            S02._walk(H, HV)(q_flat, k_flat, w, u, do_flat, g_cum, p.bounds, p.first_chunk,
                             h_seg, 1, dht_seg, 1, scale, h.view(NT, HV, K, V), v_new,
                             dh.view(NT, HV, K, V), dh0_rows, int(initial_state is not None), dv2)
        dh0 = dh0_rows.index_select(0, p.row_of_slot[:N]) if initial_state is not None else None
        # the chunk-parallel gradients, s02's
        as_bt = lambda x: x.view(B, T, *x.shape[1:])  # noqa: E731
        dq, dk_a, dw, dg_a = dqkwg(q, k, as_bt(v_new), as_bt(g_cum), h, as_bt(dv2), do, dh, scale,
                                   cu_seqlens, chunk_size)
        dk_b, dv, dbeta, dg_b = wy(k, v, beta, as_bt(Ai), as_bt(g_cum), dw, as_bt(dv2), cu_seqlens,
                                   chunk_size)
        dg = torch.empty(B * T, HV, **fp32)
        dk = torch.empty(B * T, H, K, **bf16)
        with nvtx_range("gdn_bwd.s03.finish"):
            S02._finish(H, HV)(dg_a.view(B * T, HV), dg_b.view(B * T, HV), dk_a.view(B * T, H, K),
                               dk_b.view(B * T, H, K), table, dg, dk)
    return dq, dk.view(B, T, H, K), dv, dg.view(B, T, HV), dbeta, dh0
