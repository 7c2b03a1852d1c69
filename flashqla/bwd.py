"""The backward that trains ``flashqla.chunk_gated_delta_rule`` on SM90: TileLang kernels, each a
copy of the stage it was promoted from (gdn_bwd.s02 and s03, chunk_bwd_dqkwg.s01, wy_bwd.s01), or
the forward's own (``flashqla.fwd``); ``tests/test_promoted.py``: the same program, compiled with
the same options. Like FLA's, it keeps nothing from the forward but its inputs and recomputes the
rest. C = 64 tokens a chunk, K = V = 128, g = the chunk-local cumsum, Gamma_ij = exp(g_i - g_j).
``backward`` launches, in order, each in an NVTX range ``bwd.<name>``:

  prep             g, k, v, beta -> g_cum, Ai = (I + StrictLower(diag(beta) K K^T * Gamma))^-1,
                   w = Ai diag(beta exp(g)) K, u = Ai diag(beta) V
  -- split only (backward AutoCP: every sequence cut into segments of L chunks, ``split_plan``):
  solve            the forward's ``fwd.solve``: g -> g_cum, the chunk table; k, beta -> the
                   gate-free Ab and the gated flags, which the forward's warm-up reads
  segment_states   the forward's ``fwd.segment_states`` (windows, warm-up, chain): h_j, the
                   initial state of every segment row
  dh_windows       per (backward slot, value head) its window from the segment's start
                   (``flashqla.autocp.backward_windows``): a chunk or two for a decaying head, the
                   whole segment, exact, where the decay stays above autocp.THRESHOLD or a token
                   breaks the bound's conditions. Backward slot r N + n is segment J_n - r of
                   sequence n: the reverse chain walks contiguous slots forward
  dh_warmup        per backward slot and value head: dZ_j, the reverse walk from dS' = 0 over the
                   window, and for exact heads M_j^T, the same walk from dS' = I with dO = 0
  dh_chain         the forward's chain kernel on the backward slots: dht_{j-1} = dZ_j + M_j^T
                   dht_j, from each sequence's dht back: dht_j of every segment row
  --
  walk             over the sequences, or over the segment rows from h_j and dht_j (then dh0 is
                   each sequence's first row's). Forward role: h[chunk] = S, V~ = U - W S,
                   S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~
                   reverse role, the chunks backwards: dh[chunk] = dS'; with dO' = scale diag(exp g)
                   dO and P^T = scale (K Q^T * Gamma^T, upper incl. diagonal),
                   dV~ = diag(exp(g_C - g)) K dS' + P^T dO,  dS <- exp(g_C) dS' + Q^T dO' - W^T dV~
  chunk_bwd_dqkwg  q, k, v_new, h, dV~, dh -> dq, dk, dw = -dV~ S^T, dg_cum
                   (through dP = scale (dO V~^T * Gamma, lower incl. diagonal))
  wy_bwd           k, v, beta, Ai, dw, du = dV~ -> dk', dv, dbeta, dg_cum' (through w and u)
  finish           dg = the per-chunk reverse cumsum of dg_cum + dg_cum'; dk = dk + dk'

A segment's chunks are its sequence's chunk-table rows, so h, dh, v_new and dV~ land where the
chunk-parallel kernels read them, split or not.

Threads, barriers and budgets (registers and shared memory as the stages' docstrings give them):

  prep             WARPGROUP threads a (chunk row, value head): K K^T on wgmma, each lane pair a
                   column of Ai by forward substitution, w and u on wgmma; 109 registers
  dh_windows       WINDOW_THREADS a (backward slot, value head), UNROLL tokens a thread a step
  dh_warmup        2 x WARPGROUP threads a (column tile, value head, backward slot), the walk's
                   roles and STAGES stages; 176 registers, 145 KiB of shared memory
  walk             2 x WARPGROUP threads a (sequence or segment row, value head, BV columns),
                   blockIdx.y the role, so both walks run side by side: a consumer warpgroup
                   [0, WARPGROUP) holds S or dS' (K x BV fp32) in registers, a producer
                   warpgroup TMA-loads k, w and u (forward) or k, q, w and dO (reverse) into
                   STAGES stages, with the gates; bar_full and bar_empty per stage. 184
                   registers, 145 KiB of shared memory: one CTA an SM
  chunk_bwd_dqkwg  TWO_WG_THREADS a (chunk, key head): the group's value heads in turn, S and dS'
                   by TMA (barrier ``loaded``), dq and dk summed over the group in registers (no
                   atomics); 177 KB of shared memory, one CTA an SM
  wy_bwd           TWO_WG_THREADS a (chunk, key head), the value heads in turn, dk summed in
                   registers; about 136 KB of shared memory
  finish           WARPGROUP threads a chunk row

When it splits (``segment_chunks``), in chunk steps of the walk. Unsplit, the walk takes the
longest sequence's chunks, or its CTA-chunks / SMs where it runs in waves (WALK_LANES = 4 CTAs a
(sequence, value head), one an SM). Split at L: L x its waves (4 HV CTAs a segment) +
WARMUP_STEPS L (both warm-ups) + SEGMENT_STEPS a segment of the longest sequence (the two chains)
+ FIXED_STEPS (the solve, the windows, the launches), over the lengths of SEGMENT_LADDER (at most
half the longest sequence) and L0, 2 L0 (L0: the shortest L whose walk fits one wave); it splits
when the cheapest is below 1 / MIN_GAIN of the unsplit walk. The constants are assumed, not
measured (gdn_bwd.s03's docstring derives them). On 132 SMs: (2, 8) 1 x 8192 splits at L 16; 1 x 32768 of (2, 8), (4, 16) and
(16, 16), and 28672 + 4096 of those, at L 32; nothing with 24 value heads or more, nor 8 x 4096.

No launch reads a device value on the host, so a training step can be captured in a CUDA graph
after one eager call: h and dh get the chunk table's row count (``flashqla.varlen``; for varlen a
bound, whose rows past the real chunks the walk never writes and chunk_bwd_dqkwg, whose CTAs for
them have no tokens, never reads), and the split is decided from the lengths that ``host_bounds``
reads once per ``cu_seqlens`` tensor, as the forward does (inside a capture with no read before,
one sequence of all the tokens stands for them, and the plan is built on the device).
"""

import torch

from flashqla import autocp, fwd
from flashqla.caches import cache_once
from flashqla.fwd import CHUNK_SIZE, HEAD_DIM, LOG2E, WARPGROUP
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, host_bounds, seq_bounds

BV = 64               # V columns of the state (forward walk) or of its gradient (reverse walk) per CTA
STAGES = 2            # the walk's tile stages: chunk c + 1 loads while chunk c computes
TWO_WG_THREADS = 256  # chunk_bwd_dqkwg, wy_bwd: two warpgroups, each owning half the columns
WINDOW_THREADS = 256  # dh_windows: a token of the segment a thread ...
UNROLL = 4            # ... four at once
MAX_WINDOW = autocp.MAX_WARMUP_CHUNKS  # chunks a window may take before the head runs exactly
# ---- the split rule (``segment_chunks``), in chunk steps of the walk; assumed, not measured
WALK_LANES = 2 * (HEAD_DIM // BV)  # walk CTAs a (segment, value head): two roles x two column tiles
SEGMENT_LADDER = (8, 16, 24, 32, 48, 64, 96, 128)
WARMUP_STEPS = 1.6    # per chunk of a segment: the dh warm-up (1) and the forward's (0.6)
SEGMENT_STEPS = 3.5   # per segment of the longest sequence: the two chains
FIXED_STEPS = 15      # once: the solve, both windows kernels, the launches
MIN_GAIN = 1.1        # a split must be predicted this much faster than the unsplit walk


# ---- promoted from kernels/gdn_bwd/s02_fused_walks.py
def prep_kernel(H: int, HV: int):
    """g, k, v, beta -> g_cum, Ai, w, u per (chunk row, value head); any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_bwd_prep(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g: T.Tensor((num_tokens, HV), "float32"),              # per-token log decay
        beta: T.Tensor((num_tokens, HV), "float32"),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        g_cum: T.Tensor((num_tokens, HV), "float32"),
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of (I + A)^-1
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
    ):
        with T.Kernel(num_chunks, HV, threads=WARPGROUP) as (i_c, i_hv):
            t = T.get_thread_binding()
            c = 16 * (t // 32) + t % 16                        # warp w solves columns 16w..16w+15
            half = (t // 16) % 2                               # which half of each row sum
            i_h = i_hv // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            beta_shared = T.alloc_shared((BT,), "float32")
            A_shared = T.alloc_shared((BT, BT), "float32")
            Ai_shared = T.alloc_shared((BT, BT), "bfloat16")   # (I + A)^-1
            Aik_shared = T.alloc_shared((BT, BT), "bfloat16")  # Ai diag(beta exp(g_cum))
            Aiv_shared = T.alloc_shared((BT, BT), "bfloat16")  # Ai diag(beta)
            out_shared = T.alloc_shared((BT, K), "bfloat16")
            A_frag = T.alloc_fragment((BT, BT), "float32")
            acc_frag = T.alloc_fragment((BT, K), "float32")
            y = T.alloc_local((BT // 2,), "float32")          # this half's x_j of column c
            acc = T.alloc_local((4,), "float32")               # four partial sums of a row
            part = T.alloc_local((1,), "float32")
            # swizzled: the accumulator's 8-row stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            # K, V <- rows of the chunk; g, beta <- rows of the chunk; zeros below row n
            for i, d in T.Parallel(BT, K):
                k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for i, d in T.Parallel(BT, V):
                v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
            for i in T.Parallel(BT):
                g_shared[i] = T.if_then_else(i < n, g[bos + i, i_hv], 0)
                beta_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
            # g_cum <- cumsum of g inside the chunk (rows >= n carry the last real value)
            T.cumsum(g_shared, dim=0)
            for i in T.Parallel(BT):
                if i < n:
                    g_cum[bos + i, i_hv] = g_shared[i]
                g_shared[i] = g_shared[i] * LOG2E              # exp(x) = exp2(log2(e) x) below

            # A <- StrictLower(diag(beta) K K^T * Gamma), rows < n (exponent g_i - g_j <= 0), fp32
            T.gemm(k_shared, k_shared, A_frag, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                A_shared[i, j] = T.if_then_else(
                    (j < i) & (i < n), beta_shared[i] * A_frag[i, j] * T.exp2(g_shared[i] - g_shared[j]), 0)

            # x <- (I + A)^-1 e_c by forward substitution, x_i = [i == c] - sum_{j < i} A_ij x_j,
            # from the warp's first column on (x_j = 0 above it). Lanes l and l ^ 16 share column
            # c: half h keeps x_j for the blocks of 4 rows with (j / 4) mod 2 = h, in y[s] with
            # j = 8 (s / 4) + 4 h + s mod 4, sums its half of every row in four chains, and one
            # shuffle adds the other half. x_j not found yet are 0, so whole blocks are summed.
            for s in T.unroll(BT // 2):
                y[s] = 0.0
            for warp, first in enumerate((0, 16, 32, 48)):  # unrolled here: constant loop bounds
                if t // 32 == warp:
                    for i in T.unroll(first, BT):
                        for q in T.unroll(4):
                            acc[q] = 0.0
                        for b in T.unroll(first // 8, BT // 8):
                            if 8 * b < i:
                                for q in T.unroll(4):
                                    acc[q] = acc[q] + A_shared[i, 8 * b + 4 * half + q] * y[4 * b + q]
                        part[0] = (acc[0] + acc[1]) + (acc[2] + acc[3])
                        part[0] = T.if_then_else(i == c, 1.0, 0.0) - (part[0] + T.shfl_xor(part[0], 16))
                        y[4 * (i // 8) + i % 4] = T.if_then_else(half == (i // 4) % 2, part[0],
                                                                 y[4 * (i // 8) + i % 4])
            # column c of Ai, of Ai diag(beta exp(g_cum)) and of Ai diag(beta), each half its rows
            for s in T.unroll(BT // 2):
                Ai_shared[8 * (s // 4) + 4 * half + s % 4, c] = y[s]
                Aik_shared[8 * (s // 4) + 4 * half + s % 4, c] = y[s] * (beta_shared[c] * T.exp2(g_shared[c]))
                Aiv_shared[8 * (s // 4) + 4 * half + s % 4, c] = y[s] * beta_shared[c]
            # the generic-proxy stores above must be visible to the wgmma (async proxy) reads below
            T.fence_proxy_async()

            # Ai[bos + i] <- row i, rows of the chunk
            for i, j in T.Parallel(BT, BT):
                if i < n:
                    Ai[bos + i, i_hv, j] = Ai_shared[i, j]
            # w <- (Ai diag(beta exp(g_cum))) K   (64 x 128 x 64, wgmma)
            T.gemm(Aik_shared, k_shared, acc_frag, clear_accum=True)
            T.copy(acc_frag, out_shared)
            for i, d in T.Parallel(BT, K):
                if i < n:
                    w[bos + i, i_hv, d] = out_shared[i, d]
            # u <- (Ai diag(beta)) V   (64 x 128 x 64, wgmma)
            T.gemm(Aiv_shared, v_shared, acc_frag, clear_accum=True)
            T.copy(acc_frag, out_shared)
            for i, d in T.Parallel(BT, V):
                if i < n:
                    u[bos + i, i_hv, d] = out_shared[i, d]

    return gdn_bwd_prep


# ---- promoted from kernels/gdn_bwd/s02_fused_walks.py
def walk_kernel(H: int, HV: int, BV: int):
    """Both state walks in one grid: blockIdx.y = 0 walks forward, 1 in reverse, blockIdx.x picks
    (sequence, value head, tile of BV value columns of the state)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    NVT = V // BV
    group = HV // H  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # N + 1
    num_rows = T.dynamic("num_rows")          # rows of h and dh (the chunk table's)
    num_h0 = T.dynamic("num_h0")              # N, or 1 (unread) without an initial state
    num_ht = T.dynamic("num_ht")              # N, or 1 (unread) without dht
    num_dh0 = T.dynamic("num_dh0")            # N, or 1 (unwritten) without dh0

    @T.prim_func
    def gdn_bwd_walk(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the sequences
        first_chunk: T.Tensor((num_bounds,), "int32"),         # row of h / dh of each chunk 0
        h0: T.Tensor((num_h0, HV, K, V), "float32"),
        use_h0: T.int32,
        dht: T.Tensor((num_ht, HV, K, V), "float32"),          # dL/d final state
        use_dht: T.int32,
        scale: T.float32,
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),         # state entering each chunk
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
        dh: T.Tensor((num_rows, HV, K, V), "bfloat16"),        # dL/d(state leaving each chunk)
        dh0: T.Tensor((num_dh0, HV, K, V), "float32"),         # dL/d initial state
        store_dh0: T.int32,
        dv2: T.Tensor((num_tokens, HV, V), "bfloat16"),        # dL/dv_new
    ):
        # x: (sequence, value head, V tile), V tiles adjacent; y: the role, forward walks first.
        # (A flat axis over both roles needs bx mod a runtime count: a 64-bit software remainder,
        # which TileLang inlined into every address computation of the walk.)
        with T.Kernel((num_bounds - 1) * HV * NVT, 2, threads=2 * WARPGROUP) as (bx, role):
            i_v = bx % NVT
            i_hv = (bx // NVT) % HV
            i_n = bx // (NVT * HV)
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            num_c = T.ceildiv(eos - bos, BT)

            # tile stages, producer -> consumer; g holds log2(e) g_cum, rows past the end padded
            k_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            w_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            q_s = T.alloc_shared((STAGES, BT, K), "bfloat16")   # reverse walk only
            x_s = T.alloc_shared((STAGES, BT, BV), "bfloat16")  # U (forward) or dO (reverse)
            g_s = T.alloc_shared((STAGES, BT), "float32")
            # consumer only
            s_s = T.alloc_shared((K, BV), "bfloat16")           # S or dS' in bf16: operand, h / dh row
            a_s = T.alloc_shared((BT, BV), "bfloat16")          # diag(exp(g_C - g)) V~, or dO'
            b_s = T.alloc_shared((BT, BV), "bfloat16")          # -dV~ (reverse walk)
            s_f = T.alloc_fragment((K, BV), "float32")          # S or dS', fp32, all along
            x_f = T.alloc_fragment((BT, BV), "float32")         # V~ or dV~
            kq_f = T.alloc_fragment((BT, BT), "float32")        # K Q^T (reverse walk)
            p_f = T.alloc_fragment((BT, BT), "bfloat16")        # P^T (reverse walk)
            bar_full = T.alloc_barrier([WARPGROUP] * STAGES)    # producer -> consumer (+ TMA bytes)
            bar_empty = T.alloc_barrier([WARPGROUP] * STAGES)   # consumer -> producer

            tx = T.get_thread_binding()
            if tx < WARPGROUP:  # ---- the consumer warpgroup
                if role == 0:  # forward walk (chunk_h)
                    # S <- h0[n] (or 0)
                    if use_h0 != 0:
                        T.copy(h0[i_n, i_hv, :, v0:v0 + BV], s_f)
                    else:
                        T.clear(s_f)
                    for it in T.serial(num_c):
                        st = it % STAGES
                        t0 = bos + it * BT
                        n = T.min(eos - t0, BT)                  # real rows of the chunk, 1..64
                        T.barrier_wait(bar_full[st], (it // STAGES) % 2)
                        # h[row0 + it] <- S (bf16), plain 16-byte stores from the operand copy
                        T.copy(s_f, s_s)
                        T.copy(s_s, h[row0 + it, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})
                        # V~ <- U - W S   (64 x BV x K, wgmma), rows >= n zeroed
                        T.gemm(w_s[st, :, :], s_s, x_f, clear_accum=True)
                        for i, j in T.Parallel(BT, BV):
                            x_f[i, j] = T.if_then_else(i < n, x_s[st, i, j] - x_f[i, j], 0)
                        for i, j in T.Parallel(BT, BV):
                            if i < n:
                                v_new[t0 + i, i_hv, v0 + j] = x_f[i, j]
                        for i, j in T.Parallel(BT, BV):
                            a_s[i, j] = x_f[i, j] * T.exp2(g_s[st, BT - 1] - g_s[st, i])
                        # S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~   (K x BV x 64, wgmma)
                        for d, j in T.Parallel(K, BV):
                            s_f[d, j] = s_f[d, j] * T.exp2(g_s[st, BT - 1])
                        T.gemm(k_s[st, :, :], a_s, s_f, transpose_A=True)
                        T.barrier_arrive(bar_empty[st])
                else:  # reverse walk (chunk_bwd_dv_local + chunk_bwd_dhu)
                    # dS' <- dht[n] (or 0)
                    if use_dht != 0:
                        T.copy(dht[i_n, i_hv, :, v0:v0 + BV], s_f)
                    else:
                        T.clear(s_f)
                    for it in T.serial(num_c):
                        c = num_c - 1 - it                       # chunks from the last one back
                        st = it % STAGES
                        t0 = bos + c * BT
                        n = T.min(eos - t0, BT)
                        T.barrier_wait(bar_full[st], (it // STAGES) % 2)
                        # dh[row0 + c] <- dS' (bf16)
                        T.copy(s_f, s_s)
                        T.copy(s_s, dh[row0 + c, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})
                        # dO' <- scale diag(exp(g)) dO, rows >= n zeroed
                        for i, j in T.Parallel(BT, BV):
                            a_s[i, j] = T.if_then_else(i < n, x_s[st, i, j] * (scale * T.exp2(g_s[st, i])), 0)
                        # X <- K dS';  dS <- exp(g_C) dS' + Q^T dO';  B <- K Q^T: one wait for all
                        for d, j in T.Parallel(K, BV):
                            s_f[d, j] = s_f[d, j] * T.exp2(g_s[st, BT - 1])
                        T.wgmma_gemm(k_s[st, :, :], s_s, x_f, clear_accum=True)
                        T.wgmma_gemm(q_s[st, :, :], a_s, s_f, transpose_A=True)
                        T.gemm(k_s[st, :, :], q_s[st, :, :], kq_f, transpose_B=True, clear_accum=True)
                        # P^T[j, i] <- scale B[j, i] exp(g_i - g_j) for j <= i < n, else 0
                        for j, i in T.Parallel(BT, BT):
                            p_f[j, i] = T.if_then_else(
                                (j <= i) & (i < n), scale * kq_f[j, i] * T.exp2(g_s[st, i] - g_s[st, j]), 0)
                        # dV~ <- diag(exp(g_C - g)) X + P^T dO   (64 x BV x 64, P^T from registers)
                        for i, j in T.Parallel(BT, BV):
                            x_f[i, j] = x_f[i, j] * T.exp2(g_s[st, BT - 1] - g_s[st, i])
                        T.gemm(p_f, x_s[st, :, :], x_f)
                        # dv2 <- dV~, rows < n; -dV~ (rows >= n: 0) to shared for W^T
                        for i, j in T.Parallel(BT, BV):
                            x_f[i, j] = T.if_then_else(i < n, x_f[i, j], 0)
                        for i, j in T.Parallel(BT, BV):
                            if i < n:
                                dv2[t0 + i, i_hv, v0 + j] = x_f[i, j]
                        for i, j in T.Parallel(BT, BV):
                            b_s[i, j] = -x_f[i, j]
                        # dS <- dS + W^T (-dV~)   (K x BV x 64, wgmma, W read transposed)
                        T.gemm(w_s[st, :, :], b_s, s_f, transpose_A=True)
                        T.barrier_arrive(bar_empty[st])
                    # dh0[n] <- dS
                    if store_dh0 != 0:
                        T.copy(s_f, dh0[i_n, i_hv, :, v0:v0 + BV])
            else:  # ---- the producer warpgroup: full 64-row boxes (rows >= n masked by the consumer)
                if role == 0:
                    for it in T.serial(num_c):
                        st = it % STAGES
                        t0 = bos + it * BT
                        T.barrier_wait(bar_empty[st], (it // STAGES) % 2 ^ 1)
                        T.tma_copy(k[t0:t0 + BT, i_h, :], k_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(w[t0:t0 + BT, i_hv, :], w_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(u[t0:t0 + BT, i_hv, v0:v0 + BV], x_s[st, :, :], barrier=bar_full[st])
                        for i in T.Parallel(BT):
                            g_s[st, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                        T.barrier_arrive(bar_full[st])
                else:
                    for it in T.serial(num_c):
                        st = it % STAGES
                        t0 = bos + (num_c - 1 - it) * BT
                        T.barrier_wait(bar_empty[st], (it // STAGES) % 2 ^ 1)
                        T.tma_copy(k[t0:t0 + BT, i_h, :], k_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(q[t0:t0 + BT, i_h, :], q_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(w[t0:t0 + BT, i_hv, :], w_s[st, :, :], barrier=bar_full[st])
                        T.tma_copy(do[t0:t0 + BT, i_hv, v0:v0 + BV], x_s[st, :, :], barrier=bar_full[st])
                        for i in T.Parallel(BT):
                            g_s[st, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                        T.barrier_arrive(bar_full[st])

    return gdn_bwd_walk


# ---- promoted from kernels/chunk_bwd_dqkwg/s01_wgmma.py
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
        with T.Kernel(num_chunks * H, threads=TWO_WG_THREADS) as bx:
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
            loaded = T.alloc_barrier(TWO_WG_THREADS)                  # the S and dS' TMA loads landed
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


# ---- promoted from kernels/wy_bwd/s01_wgmma.py
def wy_bwd_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang
    from tilelang.layout import make_swizzled_layout

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value heads i_h * group .. i_h * group + group - 1 read key head i_h
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")      # rows of the chunk table (a bound for varlen)

    @T.prim_func
    def wy_bwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        beta: T.Tensor((num_tokens, HV), "float32"),
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of (I + A)^-1
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        dw: T.Tensor((num_tokens, HV, K), "bfloat16"),         # dL/dw
        du: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/du
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        dk: T.Tensor((num_tokens, H, K), "bfloat16"),
        dv: T.Tensor((num_tokens, HV, V), "bfloat16"),
        dbeta: T.Tensor((num_tokens, HV), "float32"),
        dg: T.Tensor((num_tokens, HV), "float32"),             # dL/dg_cum
    ):
        # chunks and key heads on one flat grid axis (x has no 65535 limit)
        with T.Kernel(num_chunks * H, threads=TWO_WG_THREADS) as bx:
            i_h = bx % H
            i_c = bx // H
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length: 1..64, 0 for empty rows

            k_shared = T.alloc_shared((BT, K), "bfloat16")
            v_shared = T.alloc_shared((BT, V), "bfloat16")
            dw_shared = T.alloc_shared((BT, K), "bfloat16")
            du_shared = T.alloc_shared((BT, V), "bfloat16")
            ai_shared = T.alloc_shared((BT, BT), "bfloat16")
            dai_shared = T.alloc_shared((BT, BT), "bfloat16")  # dAi, strictly lower
            m_shared = T.alloc_shared((BT, BT), "bfloat16")    # dAi Ai^T
            d_shared = T.alloc_shared((BT, BT), "bfloat16")    # D = diag(beta) dA * Gamma
            e_shared = T.alloc_shared((BT, BT + 1), "float32")  # diag(beta) E (odd row length:
            #                                                     its transposed reads hit 32 banks)
            out_shared = T.alloc_shared((BT, V), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            b_shared = T.alloc_shared((BT,), "float32")
            kk_frag = T.alloc_fragment((BT, BT), "float32")
            wk_frag = T.alloc_fragment((BT, BT), "float32")
            uv_frag = T.alloc_fragment((BT, BT), "float32")
            m_frag = T.alloc_fragment((BT, BT), "float32")
            acc = T.alloc_fragment((BT, K), "float32")
            dk_sum = T.alloc_fragment((BT, K), "float32")
            r_e = T.alloc_fragment((BT,), "float32")
            r_et = T.alloc_fragment((BT,), "float32")
            r_k = T.alloc_fragment((BT,), "float32")
            r_v = T.alloc_fragment((BT,), "float32")
            # swizzled: the accumulator's 8-row stores would otherwise hit one bank 8 times
            T.annotate_layout({out_shared: make_swizzled_layout(out_shared)})

            if n > 0:
                # K <- k[bos : bos + n]; zeros below row n
                for i, d in T.Parallel(BT, K):
                    k_shared[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
                # KK <- K K^T   (64 x 64 x K, wgmma), shared by the group
                T.gemm(k_shared, k_shared, kk_frag, transpose_B=True, clear_accum=True)
                T.clear(dk_sum)

                for j in T.serial(group):
                    i_hv = i_h * group + j
                    # g <- log2(e) g_cum, beta; Ai, V, dW, dU <- rows of the chunk; zeros below row n
                    for i in T.Parallel(BT):
                        g_shared[i] = T.if_then_else(i < n, g_cum[bos + i, i_hv] * LOG2E, 0)
                        b_shared[i] = T.if_then_else(i < n, beta[bos + i, i_hv], 0)
                    for i, c in T.Parallel(BT, BT):
                        ai_shared[i, c] = T.if_then_else(i < n, Ai[bos + i, i_hv, c], 0)
                    for i, d in T.Parallel(BT, V):
                        v_shared[i, d] = T.if_then_else(i < n, v[bos + i, i_hv, d], 0)
                        dw_shared[i, d] = T.if_then_else(i < n, dw[bos + i, i_hv, d], 0)
                        du_shared[i, d] = T.if_then_else(i < n, du[bos + i, i_hv, d], 0)

                    # dAi <- (dW K^T) diag(beta exp(g)) + (dU V^T) diag(beta), strictly lower, rows < n
                    T.gemm(dw_shared, k_shared, wk_frag, transpose_B=True, clear_accum=True)
                    T.gemm(du_shared, v_shared, uv_frag, transpose_B=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        dai_shared[i, c] = T.if_then_else(
                            (c < i) & (i < n),
                            b_shared[c] * (wk_frag[i, c] * T.exp2(g_shared[c]) + uv_frag[i, c]), 0)

                    # M <- dAi Ai^T   (64 x 64 x 64, wgmma)
                    T.gemm(dai_shared, ai_shared, m_frag, transpose_B=True, clear_accum=True)
                    T.copy(m_frag, m_shared)
                    # dA~ <- -(Ai^T M) * Gamma, strictly lower, rows < n (exponent <= 0)
                    T.gemm(ai_shared, m_shared, m_frag, transpose_A=True, clear_accum=True)
                    for i, c in T.Parallel(BT, BT):
                        m_frag[i, c] = T.if_then_else(
                            (c < i) & (i < n), -m_frag[i, c] * T.exp2(g_shared[i] - g_shared[c]), 0)
                    # D <- diag(beta) dA~;  E <- dA~ * KK;  r_e <- rows of E
                    for i, c in T.Parallel(BT, BT):
                        d_shared[i, c] = b_shared[i] * m_frag[i, c]
                        m_frag[i, c] = m_frag[i, c] * kk_frag[i, c]
                    T.reduce_sum(m_frag, r_e, dim=1)
                    # r_et <- columns of diag(beta) E (rows of its transpose, through shared memory)
                    for i, c in T.Parallel(BT, BT):
                        e_shared[i, c] = b_shared[i] * m_frag[i, c]
                    for i, c in T.Parallel(BT, BT):
                        m_frag[i, c] = e_shared[c, i]
                    T.reduce_sum(m_frag, r_et, dim=1)

                    # dK += D K + D^T K   (64 x K x 64 each, D read transposed for the second)
                    T.gemm(d_shared, k_shared, acc, clear_accum=True)
                    T.gemm(d_shared, k_shared, acc, transpose_A=True)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d]

                    # X <- Ai^T dW;  dK += diag(beta exp(g)) X;  r_k <- rows of X * K
                    T.gemm(ai_shared, dw_shared, acc, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(BT, K):
                        dk_sum[i, d] = dk_sum[i, d] + acc[i, d] * (b_shared[i] * T.exp2(g_shared[i]))
                        acc[i, d] = acc[i, d] * k_shared[i, d]
                    T.reduce_sum(acc, r_k, dim=1)

                    # Y <- Ai^T dU;  dv <- diag(beta) Y (rows < n);  r_v <- rows of Y * V
                    T.gemm(ai_shared, du_shared, acc, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(BT, V):
                        out_shared[i, d] = acc[i, d] * b_shared[i]
                    for i, d in T.Parallel(BT, V):
                        if i < n:
                            dv[bos + i, i_hv, d] = out_shared[i, d]
                    for i, d in T.Parallel(BT, V):
                        acc[i, d] = acc[i, d] * v_shared[i, d]
                    T.reduce_sum(acc, r_v, dim=1)

                    # dbeta_i <- exp(g_i) r_k + r_v + r_e;  dg_i <- beta_i (exp(g_i) r_k + r_e) - r_et
                    for i in T.Parallel(BT):
                        if i < n:
                            dbeta[bos + i, i_hv] = T.exp2(g_shared[i]) * r_k[i] + r_v[i] + r_e[i]
                            dg[bos + i, i_hv] = (b_shared[i] * (T.exp2(g_shared[i]) * r_k[i] + r_e[i])
                                                 - r_et[i])

                # dk <- the group's sum, rows of the chunk
                T.copy(dk_sum, out_shared)
                for i, d in T.Parallel(BT, K):
                    if i < n:
                        dk[bos + i, i_h, d] = out_shared[i, d]

    return wy_bwd


# ---- promoted from kernels/gdn_bwd/s02_fused_walks.py
def finish_kernel(H: int, HV: int):
    """dg <- per-chunk reverse cumsum of dg_a + dg_b;  dk <- dk_a + dk_b; one CTA per chunk row."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K = CHUNK_SIZE, HEAD_DIM
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_bwd_finish(
        dg_a: T.Tensor((num_tokens, HV), "float32"),           # dL/dg_cum, two parts
        dg_b: T.Tensor((num_tokens, HV), "float32"),
        dk_a: T.Tensor((num_tokens, H, K), "bfloat16"),        # dL/dk, two parts
        dk_b: T.Tensor((num_tokens, H, K), "bfloat16"),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),
        dg: T.Tensor((num_tokens, HV), "float32"),
        dk: T.Tensor((num_tokens, H, K), "bfloat16"),
    ):
        with T.Kernel(num_chunks, threads=WARPGROUP) as i_c:
            bos = chunk_bounds[i_c, 0]
            n = chunk_bounds[i_c, 1] - bos
            d_shared = T.alloc_shared((BT, HV), "float32")
            # dg_t <- sum over the chunk's tokens s >= t of (dg_a + dg_b)_s
            for i, j in T.Parallel(BT, HV):
                d_shared[i, j] = T.if_then_else(i < n, dg_a[bos + i, j] + dg_b[bos + i, j], 0)
            T.cumsum(d_shared, dim=0, reverse=True)
            for i, j in T.Parallel(BT, HV):
                if i < n:
                    dg[bos + i, j] = d_shared[i, j]
            # dk <- dk_a + dk_b (fp32 sum, one rounding)
            for i, hh, d in T.Parallel(BT, H, K):
                if i < n:
                    dk[bos + i, hh, d] = (T.cast(dk_a[bos + i, hh, d], "float32")
                                          + T.cast(dk_b[bos + i, hh, d], "float32"))

    return gdn_bwd_finish


# ---- promoted from kernels/gdn_bwd/s03_autocp_walks.py
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


# ---- promoted from kernels/gdn_bwd/s03_autocp_walks.py
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


# compile options beyond the target, as the stages use them. The walk and the dh warm-up: no
# shared-memory reuse (their producer and consumer branches run at the same time; TileLang plans
# them as if one ran after the other)
PASS_CONFIGS = {walk_kernel: {"tl.disable_shared_memory_reuse": True},
                dh_warmup_kernel: {"tl.disable_shared_memory_reuse": True}}
# programmatic dependents (``flashqla.hopper.dependent_launch``), as gdn_bwd.s03 compiles them: they
# run among the forward's AutoCP kernels, which are
DEPENDENT = (bwd_windows_kernel, dh_warmup_kernel)


@cache_once  # threads: one compile per kernel (flashqla.caches)
def _compiled(builder, *shape):
    func = builder(*shape)
    return compile_hopper(dependent_launch(func) if builder in DEPENDENT else func, PASS_CONFIGS.get(builder))


@cache_once
def unsupported(H: int, HV: int) -> str | None:
    """None when every kernel of the backward compiles for H query/key heads and HV value heads,
    else why not, from TileLang's error (compiled once a head layout; the finish first: TileLang
    0.1.15 cannot map its [64, H, 128] loop for H = 3, 5, 6 or 12). The forward's kernels that a
    split backward runs are the forward's concern."""
    try:
        for builder, *shape in ((finish_kernel, H, HV), (prep_kernel, H, HV), (walk_kernel, H, HV, BV),
                                (chunk_bwd_dqkwg_kernel, H, HV), (wy_bwd_kernel, H, HV),
                                (bwd_windows_kernel, HV), (dh_warmup_kernel, H, HV)):
            _compiled(builder, *shape)
    except Exception as exc:  # noqa: BLE001 -- TileLang's lowering errors share no type
        why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return (f"the backward's kernels do not compile for {H} query/key heads and {HV} value heads "
                f"({builder.__name__}: {type(exc).__name__}: {why})")
    return None


# ---- promoted from kernels/gdn_bwd/s03_autocp_walks.py (the split rule)
def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, force: bool | int | None = None) -> int:
    """The decision rule: chunks per segment L, or 0 for no split, from the sequences' chunk
    counts (host integers); the module doc gives the costs. ``force``: False never splits, True
    splits at the cheapest L (even where the unsplit walk is cheaper), an int is L."""
    longest = max(seq_chunks, default=0)
    if force is False or longest == 0:
        return 0
    if not isinstance(force, bool) and isinstance(force, int):
        if force < 1:
            raise ValueError(f"flashqla: `cp` as segment length must be >= 1 chunk; got {force}")
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
    """The AutoCP plan (``autocp.Plan`` with ``slot_chunk``) or None, at ``segment_chunks``' L, from
    the lengths the host knows (``host_bounds``, one read per ``cu_seqlens`` tensor; inside a
    CUDA-graph capture with none before, one sequence of all the tokens stands for them);
    ``fwd.segment_plan`` builds it (on the host, or on the device inside such a capture)."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                  else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
    L = segment_chunks(seq_chunks, HV, num_sms, cp)
    return fwd.segment_plan(cu_seqlens, B, T, HV, num_sms, device, L, bounds)


def _flat(q, k, v, g, beta, do, scale):
    """Checked API inputs -> q, k [B T, H, K], v, do [B T, HV, V] bf16; g, beta [B T, HV] fp32; the
    scale as a float."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = (x.contiguous().view(B * T, H, K) for x in (q, k))
    v = v.contiguous().view(B * T, HV, V)
    do = do.to(torch.bfloat16).contiguous().view(B * T, HV, V)
    g, beta = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (g, beta))
    return q, k, v, g, beta, do, float(K ** -0.5 if scale is None else scale)


def _prep(k, v, g, beta, chunks):
    """The prep kernel over the chunk table ``chunks`` -> g_cum [B T, HV] fp32, Ai [B T, HV, C],
    w [B T, HV, K], u [B T, HV, V] bf16."""
    H, HV, K, V = k.shape[1], v.shape[1], k.shape[2], v.shape[2]
    bf16 = dict(dtype=torch.bfloat16, device=v.device)
    g_cum = torch.empty(g.shape, dtype=torch.float32, device=v.device)
    Ai = torch.empty(v.shape[0], HV, CHUNK_SIZE, **bf16)
    w, u = torch.empty(v.shape[0], HV, K, **bf16), torch.empty(v.shape[0], HV, V, **bf16)
    with nvtx_range("bwd.prep"):
        _compiled(prep_kernel, H, HV)(k, v, g, beta, chunks, g_cum, Ai, w, u)
    return g_cum, Ai, w, u


def segment_state_grads(p, q, k, w, do, g, g_cum, beta, seqs, g_cum_f, first_chunk_f, gated, dht, scale):
    """Backward AutoCP's dh windows, dh warm-up and reverse chain on plan ``p``: dht_j [S, HV, K, V]
    fp32, the gradient of the state leaving every segment row, from the sequences' dht [N, HV, K,
    V] fp32 (None: zero). q, k, w, do, g_cum: prep's and the inputs, flattened; g_cum_f,
    first_chunk_f, gated: the forward's solve (``fwd.solved``); seqs the sequence bounds."""
    HV, K, V = do.shape[1], k.shape[2], do.shape[2]
    device, N, J = do.device, p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    # the backward windows, per backward slot and value head
    win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
    win_end, exact = torch.empty_like(win_start), torch.empty_like(win_start)
    dht_row = torch.empty(J * N, dtype=torch.int32, device=device)
    with nvtx_range("bwd.dh_windows"):
        _compiled(bwd_windows_kernel, HV)(g, g_cum_f, beta, gated, seqs, first_chunk_f, p.row_of_slot,
                                          p.segment_chunks, float(autocp.THRESHOLD), int(dht is not None),
                                          win_start, win_end, exact, dht_row)
    # dZ_j (and M_j^T of exact heads) over each window, on prep's w and g_cum
    dz, mt = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    with nvtx_range("bwd.dh_warmup"):
        _compiled(dh_warmup_kernel, k.shape[1], HV)(q, k, w, do, g_cum, win_start, win_end, exact, scale,
                                                    dz, mt)
    # the reverse chain: dht_j of every segment row, from each sequence's dht
    dht_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
    with nvtx_range("bwd.dh_chain"):
        fwd._compiled(fwd.chain_kernel, HV)(torch.zeros(N, HV, K, V, **fp32) if dht is None else dht,
                                            dz, mt, exact, dht_row, dht_seg)
    return dht_seg


def backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, cp=None):
    """Checked API inputs (bf16 q, k, v; K = V = 128), do [B, T, HV, V], dht [N, HV, K, V] or None
    -> (dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32,
    dh0 [N, HV, K, V] fp32, None without initial_state): the gradients of <do, o> + <dht, final state>.

    ``cp``: backward AutoCP's split (``segment_chunks``' ``force``): None decides, False never
    splits, True splits by the rule, an int is the segment length in chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    q, k, v, g, beta, do, scale = _flat(q, k, v, g, beta, do, scale)
    chunks, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    seqs = seq_bounds(cu_seqlens, B, T, device)
    N, NT = seqs.shape[0] - 1, chunks.shape[0]
    bf16, fp32 = dict(dtype=torch.bfloat16, device=device), dict(dtype=torch.float32, device=device)
    absent = torch.empty(1, HV, K, V, **fp32)  # stands in for a missing h0, dht, dh0: never read or written
    h0 = absent if initial_state is None else initial_state.to(torch.float32).contiguous()
    dht_in = absent if dht is None else dht.to(torch.float32).contiguous()
    dh0 = None if initial_state is None else torch.empty(N, HV, K, V, **fp32)
    dq, dk = torch.empty(B * T, H, K, **bf16), torch.empty(B * T, H, K, **bf16)
    dv = torch.empty(B * T, HV, V, **bf16)
    dg, dbeta = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
    if B * T == 0:  # no tokens: the final state's gradient passes through to the initial state
        if dh0 is not None:
            dh0.copy_(dht_in if dht is not None else torch.zeros_like(dh0))
        return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
                dbeta.view(B, T, HV), dh0)
    sms = autocp.num_sms(device)
    p = split_plan(cu_seqlens, B, T, HV, sms, device, cp)
    dw = torch.empty(B * T, HV, K, **bf16)
    v_new, dv2 = (torch.empty(B * T, HV, V, **bf16) for _ in range(2))
    h, dh = torch.empty(NT, HV, K, V, **bf16), torch.empty(NT, HV, K, V, **bf16)
    dk_a, dk_b = torch.empty(B * T, H, K, **bf16), torch.empty(B * T, H, K, **bf16)
    dg_a, dg_b = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
    g_cum, Ai, w, u = _prep(k, v, g, beta, chunks)  # the forward's intermediates, recomputed
    if p is None:
        # both state walks over the sequences: h, v_new forward; dh, dh0, dV~ in reverse
        with nvtx_range("bwd.walk"):
            _compiled(walk_kernel, H, HV, BV)(q, k, w, u, do, g_cum, seqs, first_chunk,
                                              h0, int(initial_state is not None), dht_in, int(dht is not None),
                                              scale, h, v_new, dh, absent if dh0 is None else dh0,
                                              int(dh0 is not None), dv2)
    else:  # backward AutoCP: the walks over the segment rows, each from its own h_j and dht_j
        S = p.bounds.shape[0] - 1
        # the forward's g_cum, chunk table, Ab and gated flags (the forward's warm-up reads Ab,
        # which prep does not make), then h_j of every segment row
        with nvtx_range("bwd.solve"):
            g_cum_f, _, first_chunk_f, ab, gated = fwd.solved(H, HV, fwd.solve_heads(H, HV, NT, sms), False,
                                                              k, beta, g, seqs, cu_seqlens, B, T)
        with nvtx_range("bwd.segment_states"):
            h_seg = fwd.segment_states(p, k, v, g, g_cum_f, beta, ab, gated,
                                       torch.zeros(N, HV, K, V, **fp32) if initial_state is None else h0)
        dht_seg = segment_state_grads(p, q, k, w, do, g, g_cum, beta, seqs, g_cum_f, first_chunk_f, gated,
                                      dht_in if dht is not None else None, scale)
        # both state walks over the segment rows: h, v_new forward; dh, a dh0 per row, dV~ in reverse
        dh0_rows = absent if dh0 is None else torch.empty(S, HV, K, V, **fp32)
        with nvtx_range("bwd.walk"):
            _compiled(walk_kernel, H, HV, BV)(q, k, w, u, do, g_cum, p.bounds, p.first_chunk,
                                              h_seg, 1, dht_seg, 1, scale, h, v_new, dh, dh0_rows,
                                              int(dh0 is not None), dv2)
        if dh0 is not None:
            dh0 = dh0_rows.index_select(0, p.row_of_slot[:N])  # each sequence's first segment row
    # the chunk-parallel gradients, then their sums
    with nvtx_range("bwd.chunk_bwd_dqkwg"):
        _compiled(chunk_bwd_dqkwg_kernel, H, HV)(q, k, v_new, g_cum, h, dv2, do, dh, chunks, scale,
                                                 dq, dk_a, dw, dg_a)
    with nvtx_range("bwd.wy_bwd"):
        _compiled(wy_bwd_kernel, H, HV)(k, v, beta, Ai, g_cum, dw, dv2, chunks, dk_b, dv, dbeta, dg_b)
    with nvtx_range("bwd.finish"):
        _compiled(finish_kernel, H, HV)(dg_a, dg_b, dk_a, dk_b, chunks, dg, dk)
    return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
            dbeta.view(B, T, HV), dh0)


def initial_state_grad(q, k, v, g, beta, do, dht, scale, cp=True):
    """One sequence's dh0 without its other gradients: checked inputs of one sequence (q, k
    [1, T, H, K], v, do [1, T, HV, V]; g, beta [1, T, HV]; dht [1, HV, K, V] fp32 or None) -> dh0
    [1, HV, K, V] fp32, the gradient of <do, o> + <dht, final state> by the state entering the
    sequence, as ``backward(..., cp=cp)`` gives it (``cp`` True: the rule's forced L; an int is L).
    ``flashqla.cp``'s boundary pass. dh0 reads no state, so it takes no initial state.

    It launches what ``backward(..., cp=cp)`` launches up to its walk, less the forward's segment
    states, then the walk over the first segment row alone and none of the chunk-parallel kernels:
    prep, the forward's solve (``fwd.solved``: the windows read its gated flags),
    ``segment_state_grads`` (dh windows, dh warm-up, reverse chain: dht_j of every segment row),
    the walk over tokens [0, L C) (its forward role from h = 0, unread; its reverse role from dht_0
    to dh0). Where the split leaves one segment, ``backward`` runs whole."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if B != 1:
        raise ValueError(f"flashqla.bwd.initial_state_grad: `q` must be one sequence [1, T, H, K]; "
                         f"got {tuple(q.shape)}")
    device = q.device
    fp32 = dict(dtype=torch.float32, device=device)
    sms = autocp.num_sms(device)
    num_chunks = -(-T // CHUNK_SIZE)
    L = segment_chunks([num_chunks], HV, sms, cp)
    if L == 0 or L >= num_chunks:  # one segment: the first one is the whole sequence
        return backward(q, k, v, g, beta, do, dht, scale, torch.zeros(1, HV, K, V, **fp32), None)[5]
    p = fwd.segment_plan(None, 1, T, HV, sms, device, L, [0, T])
    q, k, v, g, beta, do, scale = _flat(q, k, v, g, beta, do, scale)
    chunks, _ = chunk_table(None, 1, T, CHUNK_SIZE, device)
    seqs = seq_bounds(None, 1, T, device)
    g_cum, _, w, u = _prep(k, v, g, beta, chunks)
    with nvtx_range("bwd.solve"):
        g_cum_f, _, first_chunk_f, _, gated = fwd.solved(H, HV, fwd.solve_heads(H, HV, chunks.shape[0], sms),
                                                         False, k, beta, g, seqs, None, 1, T)
    dht_seg = segment_state_grads(p, q, k, w, do, g, g_cum, beta, seqs, g_cum_f, first_chunk_f, gated,
                                  None if dht is None else dht.to(torch.float32).contiguous(), scale)
    # the walk over the first segment row alone, host integers: tokens [0, L C), chunk rows [0, L),
    # its forward role from h = 0 (h0 not read), its reverse role from dht_0; of its outputs (h,
    # v_new, dh, dh0, dv2) only dh0 is kept
    n = L * CHUNK_SIZE
    bf16 = dict(dtype=torch.bfloat16, device=device)
    absent = torch.empty(1, HV, K, V, **fp32)
    dh0 = torch.empty(1, HV, K, V, **fp32)
    with nvtx_range("bwd.walk"):
        _compiled(walk_kernel, H, HV, BV)(q[:n], k[:n], w[:n], u[:n], do[:n], g_cum[:n],
                                          seq_bounds(None, 1, n, device), seq_bounds(None, 1, L, device),
                                          absent, 0, dht_seg[:1], 1, scale,
                                          torch.empty(L, HV, K, V, **bf16), torch.empty(n, HV, V, **bf16),
                                          torch.empty(L, HV, K, V, **bf16), dh0, 1, torch.empty(n, HV, V, **bf16))
    return dh0
