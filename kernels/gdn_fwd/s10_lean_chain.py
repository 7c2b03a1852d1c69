"""gdn_fwd, stage 10: s07 with the chain warpgroup's per-chunk path made lean (no branch, no exp).

What changed vs s07 (roles, barriers, budgets, math and precision are s07's; only the chain's
per-chunk code and where its exponentials come from), three changes read off the SASS (nvcc 13.0 for
sm_90a on the CPU machine, nvdisasm; "loop": the instructions of one chunk of the chain's loop,
s10's loop body holds two chunks and is halved):

1. The W pass reads precomputed row factors. s07 built W = V - diag(exp g) U under the mask
   ``i < n`` with the exp2 inside the select: 14 divergent-branch regions (BSSY) in the loop, each
   with its own MUFU.EX2 and scalar LDS; with Vd = diag(exp(g_C - g)) V~ and the decay exp(g_C),
   also exp2 in the chain, 19 MUFU.EX2 a chunk. The mask is not needed: the scores warpgroup writes
   WY as zero outside j <= i < n, so WY's columns j >= n are zero and V~ = WY W never reads W's
   rows i >= n, which are finite (the tile's rows past the sequence end are the next sequence's
   tokens or TMA's zeros, U = K S of the same, exp(g) <= 1 with g padded by the last real row) and
   meet exact zeros; V~'s rows >= n are then exactly zero, and so are Vd's (K^T Vd ignores K's rows
   past the end) and the output's P V~ terms. The producer, after writing log2(e) g, writes per
   stage the 64 factors exp(g_i) (eg_s) and exp(g_C - g_i) (egd_s), from the same g_s values as
   s07's exp2 (bit-identical factors); the chain reads them, and exp(g_C) is eg_s's last entry. No
   zero is needed past the end (egd is 1 there, multiplying V~'s zero rows). Chain loop: 0 BSSY,
   0 MUFU.EX2.
2. The hand-off stores of S_c and V~_c use stmatrix. TileLang 0.1.15 lowers a fragment -> shared
   copy to stmatrix only when the destination is a whole buffer (src/cuda/op/copy.cc, LowerLDSM:
   every destination range starts at 0 and spans the buffer), so s07's h_s[b] and vn_s[b] were
   stored with 32 + 16 STS.32 a thread. Here each slot is a buffer of its own (h_s0 / h_s1,
   vn_s0 / vn_s1) and the chain and output warpgroups run their chunks in pairs, then an odd last
   chunk, with the loop body expanded once per slot (a Python loop over the slots when the kernel
   is built), so that slot b = c % 2 (and the tile stage, the same) is a constant in each copy:
   8 + 4 STSM a chunk. The scores warpgroup and producer keep s07's loop (wy_s, p_s slotted).
3. The state decay overlaps U = K S. s07 decayed S (64 FMUL a thread) after the Vd store, between
   it and the update's issue. Here K S is issued with T.wgmma_gemm, S <- exp(g_C) S runs on the
   registers while it runs (K S reads S_c in h_s, not the registers), then the chain waits for it;
   the update adds K^T Vd to the decayed S as before: the same operations on the same values.

Chain loop per chunk (instructions; s07 counted by the same script, its memo reading was ~796):

    SASS              s07    s10
    instructions      806    500
    HGMMA              20     20
    BSSY               14      0
    MUFU.EX2           19      0
    STS (.32)          48      0
    STSM                8     20
    LDS                22     21
    BAR.SYNC            7      7

The odd last chunk's copy is straight-line too (the chain's code has no BSSY and no MUFU). The
price: the chain's and output's loop bodies are written out twice, plus the last chunk once
(instruction cache: the chain's loop is ~16 KB of SASS, s07's ~13 KB), and 1 KB of shared memory.
Why: the chain's per-chunk latency sets the time of the long problems (s07 on (16, 64) 1 x 32768:
128 CTAs each walk 512 chunks, 2.05 ms against FlashQLA's 1.52), and these are the differences
between s07's chain and FlashQLA's state path that the SASS shows (FlashQLA 0.1.3's fused forward
at BV 64 built the same way: state warpgroup ~178 instructions a chunk and its V warpgroup ~384,
no divergent branch on the state path, its snapshot 8 STSM). What to measure: s10 beside s07 in
one ``python -m flashqla bench --heads 16,64`` run (and (2, 8) 1 x 32768); with Nsight Compute,
the chain's ``smsp__inst_executed.sum`` and ``smsp__sass_branch_targets_threads_divergent.sum``
per chunk, and the stall samples at its
WARPGROUP.DEPBAR and mbarrier try-wait PCs.

Per chunk of C = 64 tokens, with S the CTA's K x 64 slice of the state (fp32, in the chain's
registers), as in s07:

    chain     U = K S  (S <- exp(g_C) S meanwhile);  W = V - diag(exp g) U;  V~ = WY W;
              S <- S + K^T diag(exp(g_C - g)) V~
    scores    Gamma_ij = exp(g_i - g_j) on j <= i, ONE exp tile for both of:
              WY = Gamma * Ab (Ab as stored where the solve flagged the chunk ``gated``), rows < n;
              P = scale (Q K^T * Gamma), lower triangle incl. the diagonal (needs no state)
    output    O = scale diag(exp(g)) Q S_c + P V~_c, stored straight from registers
    producer  q, k, v, Ab by TMA (full 64-row boxes); log2(e) g, then exp(g) and exp(g_C - g)
              into the stage's gate buffers

Pipeline (s07's; two tile stages, two hand-off slots; arrows are mbarrier arrivals):

    time ->   |------------ chunk c ------------|----------- chunk c+1 ----------|---
    chain     [S_c->h_sb  K S||decay  W  (wait WY) WY W  Vd  K^T Vd][S_c+1->h_sb' ...
                                          `-> bar_wy_free[c%2]  `-> bar_state_ready[c%2]
    scores    [Gamma, WY c -> wy_s][Q K^T c, P -> p_s][Gamma, WY c+1 ...]   (runs ahead)
                       `-> bar_wy_ready[c%2]  `-> bar_scores_ready[c%2]
    output                               [Q S_c, scale][+ P_c V~_c, o rows][Q S_c+1 ...
                                          `-> bar_state_free, bar_scores_free[c%2]
    producer  [TMA c+1 -> stage (c+1)%2]  [TMA c+2 -> stage c%2, once chain, scores and
                                           output arrived on bar_tiles_empty[c%2]]

Shared memory (194 KB of 227, ending at byte 198656 of the generated code; s07: 193) and registers
(s07's setmaxnreg budgets, per thread, within the CTA's pool of 512 x 128; ptxas, nvcc 13.0 on the
CPU machine: no spills, no stack frame):

    buffer             shape x slots        KB   written by -> read by
    q_s, k_s           64 x 128 bf16 x 2    64   producer (TMA) -> q: scores, output;
                                                 k: chain, scores
    v_s                64 x 64 bf16 x 2     16   producer (TMA) -> chain
    ab_s               64 x 64 bf16 x 2     16   producer (TMA) -> scores
    g_s                64 fp32 x 2         0.5   producer -> scores, output
    eg_s, egd_s        64 fp32 x 2 each      1   producer -> chain (exp(g), exp(g_C - g))
    h_s0, h_s1 (S_c)   128 x 64 bf16 each   32   chain -> chain (K S), output (Q S_c)
    wy_s (WY_c)        64 x 64 x 2          16   scores -> chain (WY W)
    vn_s0, vn_s1 (V~)  64 x 64 bf16 each    16   chain -> output
    p_s (P_c)          64 x 64 x 2          16   scores -> output
    w_s, vd_s          64 x 64 each         16   chain -> chain (WY W, K^T Vd)

    role       threads      setmaxnreg  holds
    chain      [0, 128)        216      S (64 fp32 a thread), U / W / Vd (32), V~ (32)
    scores     [128, 256)      136      P (32), Gamma (32)
    output     [256, 384)      136      O (32)
    producer   [384, 512)       24      addresses

TileLang 0.1.15 facts this rests on: s07's (one if / elif chain over the roles;
tl.disable_shared_memory_reuse; tl.enable_fast_math: exp2 is one ex2.approx; T.fence_proxy_async()
before arriving on a tile that another warpgroup's wgmma reads), and: a fragment -> shared T.copy
becomes stmatrix only into a whole buffer; a Python loop over a tuple inside the kernel is expanded
when the kernel is built (its index stays a Python int); T.wgmma_gemm + T.wait_wgmma let
register work run beside a product that does not touch those registers.

Precision: s07's (the same products in the same precisions, the same factors). Checked on the CPU
in float64 against ``reference.chunk_gated_delta_rule_ref``, the kernel's operations in this
order (full 64-row tiles with the next sequence's tokens past the end, padded gates, exp2 of
log2(e)-scaled gates, W unmasked, the decay rounded to fp32 before the update adds to it,
gate_free_solve.s01's Ab and its fallback): varlen (1, 200, 777, 64, 130, 65), 8 heads with g = 0,
strong-decay and ordinary ones, one chunk of keys of norm 3 and three chunks flagged ``gated`` by
force (11 of 192 flagged): o and final state within 1.1e-14 / 1.0e-14 of the reference
(relative L2), as s07; with bf16 and fp32 where the kernel rounds, 5.4e-3 / 5.7e-3 (the test's
bound 2.2e-2 / 2.4e-2), o bit for bit s07's, the final state within 2.4e-7 absolute (the s07
emulation rounds the decayed S one step later; both kernels round it as here); the same on
flashqla.testing's adversarial inputs.

On the GPU (H200), the first build failed its test on every public problem (o off by 0.1-0.3
relative L2). Against s07 chunk by chunk, sequences of an odd number of chunks (64, 192 tokens)
came out bit for bit s07's, o and final state; of an even number (100, 128, 256), every chunk
but the last matched, and the last and the final state did not. TileLang 0.1.15 had lowered the
odd chunk's loop, ``T.serial(num_seq_chunks % 2)``, to its body with no guard, so even counts ran
a chunk past the end on stale tiles; ``chunk_parts`` puts it under an ``if`` (the generated code
now tests the count's low bit; the chain's loop is unchanged, 500 instructions a chunk). The
fixed build passes the stage's GPU tests (24 public problems, H200, commit 3198fc1).

Measured effect (``python -m flashqla bench``, 4 x H200, commit a76066e, CUDA-graph replay, every
row of a problem in one process, profiles/results/gdn_fwd.csv): 1.05-1.13x s07 on all 40 problems
(geomean 1.09x). (16, 64) 1 x 32768: 1.827 ms against s07's 1.910 (FlashQLA 1.538, FLA 3.455); the
fused kernel alone 1226 against s07's 1331 us on one H200 (torch.profiler,
profiles/results/kernel_split.csv), 2.40 against 2.60 us a chunk: 500 instructions instead of 806
bought 8 %, the chain being latency-bound (three dependent products a chunk), not issue-bound.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

import torch

from flashqla import stages
from flashqla.hopper import HOPPER_TARGET
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# wgmma: the six products; tma_load: the q, k, v, Ab tiles (PTX cp.async.bulk.tensor);
# warpgroup_reg_alloc / _dealloc: the roles' register budgets (PTX setmaxnreg.inc / .dec)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
BLOCK_V = 64          # BV: value columns of the state owned by one CTA
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32, K=128, V=128)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)

# ---- warp roles, one warpgroup each, in thread order (one if / elif chain over them, as in s05)
WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP   # [0, 128)   chain: owns S; U = K S, W, V~ = WY W, the state update
SCORES_END = 2 * WARPGROUP  # [128, 256) scores: WY = Gamma * Ab and P = scale (Q K^T * Gamma)
OUTPUT_END = 3 * WARPGROUP  # [256, 384) output: O = scale diag(exp g) Q S_c + P V~_c
THREADS = 4 * WARPGROUP     # [384, 512) producer: TMA loads of q, k, v, Ab; the gates
# ---- register budgets (setmaxnreg, per thread), within the launch pool of 4 x 128
REGS_PRODUCER = 24    # addresses
REGS_CHAIN = 216      # S (64 fp32 a thread), U / W / Vd (32), V~ (32)
REGS_SCORES = 136     # P (32), Gamma (32)
REGS_OUTPUT = 136     # O (32)
assert REGS_PRODUCER + REGS_CHAIN + REGS_SCORES + REGS_OUTPUT <= 4 * 128
# ---- buffering
NUM_STAGES = 2        # tile stages: the producer fills chunk c + 2 once chunk c is consumed
NUM_HANDOFF = 2       # slots for S_c, WY_c, V~_c and P_c: chunk c + 1's are written while
                      # chunk c's are still read
HANDOFF_SLOTS = (0, 1)  # the chain and output unroll their chunk loop over them
assert NUM_STAGES == NUM_HANDOFF == len(HANDOFF_SLOTS)  # chunk c's stage is its slot, c % 2


def chunk_parts(num_seq_chunks):
    """The chain's and output's chunk loop in two parts, (first chunk, trips, slots, present): the
    pairs (chunks 2r, 2r + 1), then the odd last chunk, present only when the count is odd. The
    odd chunk sits under an `if` with one trip: TileLang 0.1.15 lowered ``T.serial(n % 2)`` (a
    loop whose extent it can bound by 1) to its body with no guard, so every even count ran one
    chunk more than it had, on stale tiles (the GPU test of this stage's first build)."""
    return ((0, num_seq_chunks // 2, HANDOFF_SLOTS, True),
            (num_seq_chunks - 1, 1, HANDOFF_SLOTS[:1], num_seq_chunks % 2 == 1))


def fused_reform_kernel(H: int, HV: int, K: int, V: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V; any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C, BV = CHUNK_SIZE, BLOCK_V
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_fused_ws_lean(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # gate_free_solve: rows per token
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab already holds the gate
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # sequence starts, then the total
        first_chunk: T.Tensor((num_bounds,), "int32"),         # each sequence's first chunk row
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
    ):
        with T.Kernel(V // BV, HV, num_seqs, threads=THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            v0 = i_v * BV
            num_seq_chunks = T.ceildiv(eos - bos, C)

            # tile stages (producer -> consumers); g holds log2(e) g_cum
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores, output
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain, scores
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # chain
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # scores
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # scores, output
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # chain: exp(g)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # chain: exp(g_C - g)
            # hand-off slots: S_c (bf16) and V~_c from the chain, one buffer per slot (a store
            # into a whole buffer lowers to stmatrix); WY_c and P_c from the scores
            h_s0 = T.alloc_shared((K, BV), "bfloat16")
            h_s1 = T.alloc_shared((K, BV), "bfloat16")
            wy_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            vn_s0 = T.alloc_shared((C, BV), "bfloat16")
            vn_s1 = T.alloc_shared((C, BV), "bfloat16")
            p_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            # chain only: W, the B operand of WY W; diag(exp(g_C - g)) V~, that of K^T Vd
            w_s = T.alloc_shared((C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            # registers of the chain, scores and output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            x_f = T.alloc_fragment((C, BV), "float32")             # U, then W, then Vd
            vn_f = T.alloc_fragment((C, BV), "float32")
            gam_f = T.alloc_fragment((C, C), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            keep = T.alloc_var("int32")                            # this chunk's gated flag
            # v_s and ab_s are read in the accumulator layout (8 rows of 128 bytes per warp access)
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)      # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_wy_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)       # scores -> chain
            bar_wy_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)        # chain -> scores
            bar_state_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # chain -> output
            bar_state_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # output -> chain
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)   # scores -> output
            bar_scores_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # output -> scores

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
                # S <- h0 (this CTA's BV columns of it)
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
                # chunks in pairs, then an odd last one: each copy of the body has a constant
                # stage and slot b = c % 2 (stmatrix stores into whole buffers h_sb, vn_sb)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:  # the odd last chunk under an `if` (chunk_parts says why)
                        for r in T.serial(reps):
                            for b, h_sb, vn_sb in zip(slots, (h_s0, h_s1), (vn_s0, vn_s1)):
                                c = c0 + 2 * r + b
                                phase = (c // NUM_HANDOFF) % 2
                                T.barrier_wait(bar_tiles_full[b], phase)
                                T.barrier_wait(bar_state_free[b], phase ^ 1)
                                # S_c (fp32 registers) -> bf16 in slot b: the operand of K S
                                # here and of Q S in the output warpgroup
                                T.copy(h_f, h_sb)
                                # U <- K S, issued without waiting, while S <- exp(g_C) S (registers
                                # K S does not read; the update below adds K^T Vd to it)
                                T.wgmma_gemm(k_s[b, :, :], h_sb, x_f, clear_accum=True)
                                for i, j in T.Parallel(K, BV):
                                    h_f[i, j] = h_f[i, j] * eg_s[b, C - 1]
                                T.wait_wgmma(0)
                                # W <- V - diag(exp(g)) U; rows >= n are finite and meet only WY's
                                # zero columns, so V~ needs no mask
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = v_s[b, i, j] - eg_s[b, i] * x_f[i, j]
                                T.copy(x_f, w_s)
                                # V~ <- WY W, WY from the scores warpgroup; its slot is free once
                                # this returns
                                T.barrier_wait(bar_wy_ready[b], phase)
                                T.gemm(wy_s[b, :, :], w_s, vn_f, clear_accum=True)
                                T.barrier_arrive(bar_wy_free[b])
                                # V_d <- diag(exp(g_C - g)) V~, the decayed copy the update reads
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = vn_f[i, j] * egd_s[b, i]
                                T.copy(x_f, vd_s)
                                # S <- S + K^T V_d (S already decayed), issued without waiting ...
                                T.wgmma_gemm(k_s[b, :, :], vd_s, h_f, transpose_A=True)
                                # ... while V~_c goes to slot b and S_c, V~_c are handed to the
                                # output warpgroup (generic-proxy stores that its wgmma reads:
                                # fence, then arrive)
                                T.copy(vn_f, vn_sb)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_state_ready[b])
                                T.wait_wgmma(0)
                                T.barrier_arrive(bar_tiles_empty[b])
                T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

            elif tx >= CHAIN_END and tx < SCORES_END:  # ---- the scores warpgroup
                T.set_max_nreg(REGS_SCORES, 1)
                for c in T.serial(num_seq_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    n = T.min(eos - bos - c * C, C)
                    keep = gated[row0 + c, i_hv]
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_wy_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # Gamma <- exp(g_i - g_j), the exponent clamped at 0 so that the upper
                    # triangle (masked below) stays finite: no branch
                    for i, j in T.Parallel(C, C):
                        gam_f[i, j] = T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                    # WY <- Gamma * Ab (Ab as stored for a gated chunk) on j <= i < n, 0 elsewhere;
                    # handed to the chain first: it waits for it, the output does not yet
                    for i, j in T.Parallel(C, C):
                        wy_s[b, i, j] = T.if_then_else(
                            (j <= i) & (i < n),
                            ab_s[s, i, j] * T.if_then_else(keep != 0, 1.0, gam_f[i, j]), 0)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_wy_ready[b])
                    # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal
                    T.barrier_wait(bar_scores_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    T.gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * gam_f[i, j], 0)
                    T.barrier_arrive(bar_tiles_empty[s])
                    T.copy(p_f, p_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_scores_ready[b])

            elif tx >= SCORES_END and tx < OUTPUT_END:  # ---- the output warpgroup
                T.set_max_nreg(REGS_OUTPUT, 1)
                # the chain's pairs and odd last chunk: slot b, h_sb and vn_sb as there
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:  # the odd last chunk under an `if` (chunk_parts says why)
                        for r in T.serial(reps):
                            for b, h_sb, vn_sb in zip(slots, (h_s0, h_s1), (vn_s0, vn_s1)):
                                c = c0 + 2 * r + b
                                phase = (c // NUM_HANDOFF) % 2
                                t0 = bos + c * C
                                n = T.min(eos - t0, C)
                                T.barrier_wait(bar_tiles_full[b], phase)
                                T.barrier_wait(bar_state_ready[b], phase)
                                # O <- scale diag(exp(g)) Q S_c; then the tile stage is free
                                T.gemm(q_s[b, :, :], h_sb, o_f, clear_accum=True)
                                for i, j in T.Parallel(C, BV):
                                    o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[b, i]))
                                T.barrier_arrive(bar_tiles_empty[b])
                                # O <- O + P_c V~_c
                                T.barrier_wait(bar_scores_ready[b], phase)
                                T.gemm(p_s[b, :, :], vn_sb, o_f)
                                T.barrier_arrive(bar_state_free[b])
                                T.barrier_arrive(bar_scores_free[b])
                                # o[t0 : t0 + n] <- O, the chunk's own rows only, from the registers
                                for i, j in T.Parallel(C, BV):
                                    if i < n:
                                        o[t0 + i, i_hv, v0 + j] = o_f[i, j]

            elif tx >= OUTPUT_END:  # ---- the producer warpgroup
                T.set_max_nreg(REGS_PRODUCER, 0)
                for c in T.serial(num_seq_chunks):
                    s = c % NUM_STAGES
                    t0 = bos + c * C
                    T.barrier_wait(bar_tiles_empty[s], (c // NUM_STAGES) % 2 ^ 1)
                    # full 64-row boxes; rows past the sequence end are masked by the consumers
                    T.tma_copy(q[t0:t0 + C, i_h, :], q_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(k[t0:t0 + C, i_h, :], k_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(v[t0:t0 + C, i_hv, v0:v0 + BV], v_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(ab[t0:t0 + C, i_hv, :], ab_s[s, :, :], barrier=bar_tiles_full[s])
                    # g <- log2(e) g_cum, rows past the end padded with the last real row, so every
                    # exponent (g_i - g_j with i >= j, g_C - g_i, g_i, g_C) is <= 0
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    # the chain's row factors exp(g_i) and exp(g_C - g_i), 64 exponentials a chunk
                    # here instead of 64 x 64 there (exp(g_C) is the last of the first)
                    for i in T.Parallel(C):
                        eg_s[s, i] = T.exp2(g_s[s, i])
                        egd_s[s, i] = T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_ws_lean


@functools.cache
def _compiled(H: int, HV: int, K: int, V: int):
    import tilelang

    # as in s05: no shared-memory reuse (the planner treats the role branches as sequential);
    # fast math (exp2 is one ex2.approx, no branch)
    return tilelang.compile(fused_reform_kernel(H, HV, K, V), target=HOPPER_TARGET,
                            pass_configs={"tl.disable_shared_memory_reuse": True,
                                          "tl.enable_fast_math": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def fused_reform(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale):
    """The fused kernel alone, with s04's interface: [B, T, ...] inputs (ab bf16 and gated from
    gate_free_solve.s01's ``solve``, g_cum fp32) -> (o [B, T, HV, V] bf16, final state
    [N, HV, K, V] fp32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    bounds = seq_bounds(cu_seqlens, B, T, device)
    _, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N = bounds.shape[0] - 1
    if initial_state is None:
        initial_state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device)
    if B * T:
        kernel = _compiled(H, HV, K, V)
        with nvtx_range("gdn_fwd.s10"):
            kernel(q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V),
                   ab.reshape(B * T, HV, CHUNK_SIZE), g_cum.reshape(B * T, HV), gated,
                   initial_state.to(torch.float32).contiguous(), bounds, first_chunk, scale, o, ht)
    else:
        ht.copy_(initial_state)
    return o.view(B, T, HV, V), ht


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s10: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s10: `q` must have head dim K = 128; got K = {K}")
    if V != 128:
        raise ValueError(f"gdn_fwd.s10: `v` must have head dim V = 128; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s10: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, chunk_size)
    ab, gated = stages.load("gate_free_solve", 1).solve(k, beta, g_cum, cu_seqlens)
    o, ht = fused_reform(q, k, v, ab, g_cum.contiguous(), gated, initial_state, cu_seqlens, scale)
    return o, (ht if output_final_state else None)
