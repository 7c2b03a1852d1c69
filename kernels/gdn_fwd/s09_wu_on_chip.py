"""gdn_fwd, stage 09: s07 with w and u formed on chip by the scores warpgroup: the chain is s05's.

What changed vs s07: the chain's per-chunk path was three dependent products (U = K S, then
V~ = WY W with W = V - diag(exp g) U, then the update K^T Vd), s05's was two (V~ = u - w S, then
the update), but s05 read w and u from HBM, written there by the preparation. Since WY = Gamma * Ab
needs no state,

    V~ = WY (V - D K S) = (WY V) - (WY D K) S = u_c - w_c S,      D = diag(exp g),

so the scores warpgroup, which already builds WY and runs ahead of the chain, now also forms
u_c = WY V (64 x BV) and w_c = (WY D) K (64 x 128) per chunk, on wgmma with WY and WY D as bf16
operands in its registers, and hands them to the chain through slots of their own with their own
barrier pair (bar_wu_ready / bar_wu_free), where s07 handed over WY. The chain runs s05's two
products (w S, then K^T Vd) and one elementwise pass; the preparation stays s04's and s07's
(chunk_local_cumsum.s01 + gate_free_solve.s01: no w, u round trip through HBM). Why: at (16, 64)
1 x 32768 s07's 128 CTAs each walk 512 chunks and the chain's per-chunk latency sets the time
(2.05 ms, FlashQLA 1.52); this takes one product, one elementwise pass and one 8 KB
shared-memory store off that path (its wait for WY becomes a wait for w and u, before its first
product instead of its second). Per chunk of C = 64 tokens, with S the CTA's K x 64 slice
of the state (fp32, in the chain's registers):

    chain     V~ = u - w S;  S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~
    scores    Gamma_ij = exp(g_i - g_j) on j <= i, ONE exp tile for both of:
              P = scale (Q K^T * Gamma), lower triangle incl. the diagonal;
              WY = Gamma * Ab (Ab as stored where the solve flagged the chunk ``gated``), rows < n,
              WY D = WY diag(exp g);  u = WY V,  w = (WY D) K        (none of it needs the state)
    output    O = scale diag(exp(g)) Q S_c + P V~_c, stored straight from registers
    producer  q, k, v, Ab by TMA (full 64-row boxes); log2(e) g and exp(g) into the stage's gate
              buffers

The algebra, exact for both kinds of chunk: unflagged, WY D = (Gamma * Ab) D and
Gamma_ij exp(g_j) = exp(g_i) (j <= i); flagged, Ab already holds the gated inverse times
diag(beta), WY = Ab and WY D scales its columns. The kernel scales columns for both (one code
path; the 64 factors exp(g_j) come from the producer, so no second exp tile), and every exponent
stays <= 0 as in s04: Gamma's are clamped differences, exp(g_j) >= exp(g_i) for j <= i, so a
factor that flushes to zero only zeroes entries whose true value is smaller still. Rows past the
sequence end: WY is zero on rows i >= n and so, with j <= i, on columns j >= n, so u and w are
exactly zero there (the tiles' rows past the end, the next sequence's tokens or TMA's zeros, are
multiplied by zeros) and so is V~: the chain needs no mask. Checked on the CPU in float64 against
``reference.chunk_gated_delta_rule_ref``, the kernel's operations in order (full 64-row tiles,
padded gates, exp2 of log2(e)-scaled gates, gate_free_solve.s01's Ab and its fallback): varlen
(1, 200, 777, 64, 130, 65) with g = 0, strong-decay and ordinary heads, one chunk of keys of norm 3
(flagged on every head) and three chunks flagged by force: o and final state within 1.2e-14 of
the reference (relative), as s07's chain (1.1e-14).

Why the scores warpgroup should still run ahead of the chain: chunk c + 1's P, WY, u and w
depend only on its tile stage, which the producer fills as soon as the three consumers have
released chunk c - 1 (the chain once chunk c - 1's update has landed); so the scores
warpgroup starts chunk c + 1 as the chain starts chunk c, one load later, and has the chain's
whole period for it. Its path to w, u is the Gamma tile (while Q K^T runs), one elementwise pass
building WY and WY D, and two products (u: 0.5 MFLOP, w: 1.0) with 24 KB of stores; the chain's
period is two products (2.1 MFLOP) with 32 KB of stores and three waits. The two are of the same
order, so this is the stage's risk: its total work per chunk (P, WY, u, w: 2.6 MFLOP in three
products) now exceeds the chain's, where s07's was one product. What to measure: (1) the kernel
against s07 in the same run, on (16, 64) and (2, 8) 1 x 32768 (the long chains); (2) whether the
chain waits for w, u: Nsight Compute's warp-stall samples at the chain's wait on bar_wu_ready (the
mbarrier try-wait after its store of S_c), or, as in s05, the kernel timed with the scores
warpgroup's products removed: if that is no faster, the scores warpgroup is off the critical
path. If it is on it, the next step is to split its work (w, u in one warpgroup, P in another).
w_c is the same for the V / BV = 2 CTAs of a value head; each forms it (1 MFLOP a chunk more per
CTA than s07, about 6.3 MFLOP of products a chunk and CTA in all).

Pipeline (two tile stages, two hand-off slots; arrows are mbarrier arrivals):

    time ->   |------------- chunk c -------------|------------ chunk c+1 ------------|---
    chain     [S_c->h_s (wait w,u) w S  V~,Vd  K^T Vd][S_c+1->h_s' (wait w,u) w S ...
                                  `-> bar_wu_free[c%2]   `-> bar_state_ready[c%2]
    scores    [Q K^T || Gamma, P; WY, WY D; u, w of c+1 -> slots][P c+1 -> p_s][Q K^T c+2 ...
                                       `-> bar_wu_ready[(c+1)%2]     `-> bar_scores_ready
    output                               [Q S_c, scale][+ P_c V~_c, o rows][Q S_c+1 ...
                                          `-> bar_state_free, bar_scores_free[c%2]
    producer  [TMA c+1 -> stage (c+1)%2]  [TMA c+2 -> stage c%2, once chain, scores and
                                           output arrived on bar_tiles_empty[c%2]]

Shared memory (217 KB of 227 in the buffers below, ending at byte 222208 of the generated code;
s07: 193; plus 1 KB of static shared memory for the mbarriers, as in s07) and registers
(setmaxnreg budgets, per thread, within the CTA's pool of 512 x 128; "used": the highest register
each role's code names in the SASS, ptxas and nvcc 13.0 on the CPU machine, nvdisasm; no spills,
no stack frame):

    buffer             shape x slots        KB   written by -> read by
    q_s, k_s           64 x 128 bf16 x 2    64   producer (TMA) -> q: scores, output;
                                                 k: chain, scores
    v_s                64 x 64 bf16 x 2     16   producer (TMA) -> scores (u = WY V)
    ab_s               64 x 64 bf16 x 2     16   producer (TMA) -> scores
    g_s, eg_s          64 fp32 x 2 each      1   producer -> g: all three; exp(g): scores
    h_s (S_c, bf16)    128 x 64 x 2         32   chain -> chain (w S), output (Q S_c)
    w_s (w_c)          64 x 128 x 2         32   scores -> chain (w S)
    u_s (u_c)          64 x 64 x 2          16   scores -> chain (V~ = u - w S)
    vn_s (V~_c)        64 x 64 x 2          16   chain -> output
    p_s (P_c)          64 x 64 x 2          16   scores -> output
    vd_s               64 x 64               8   chain -> chain (K^T Vd)

    role       threads      setmaxnreg  used   holds
    chain      [0, 128)        176      ~145   S (64 fp32 a thread), V~ and Vd (32 + 32)
    scores     [128, 256)      200      ~186   P (32), Gamma (32) then w (64), WY and WY D
                                               (bf16, 16 + 16), u (32)
    output     [256, 384)      112       ~57   O (32)
    producer   [384, 512)       24       ~12   addresses

Against s07 the chain gives back 40 registers (s05's chain, ~143 used there), the output 24 (it
uses the same ~57 as in s07), and the scores warpgroup gets 64 more: its peak is during w, with P,
WY D and w live (112 a thread; Gamma dies once P and WY D are built). w_s and u_s (48 KB) replace
s07's wy_s, w_s (24 KB). The same SASS reading gives s07's roles ~155 / ~116 / ~57 / ~12.

TileLang 0.1.15 facts this rests on: s05's and s07's (one if / elif chain over the roles;
tl.disable_shared_memory_reuse; tl.enable_fast_math; T.fence_proxy_async() before arriving on a
tile that another warpgroup's wgmma reads: h_s, w_s, vn_s, p_s), and: T.gemm with A a bf16
fragment lowers to wgmma with A from registers (tl::wgmma_rs); the fragment takes the thread
layout of the 64 x 64 accumulator (that of P and Gamma), so WY and WY D are built in registers
from Gamma elementwise, with no shared-memory copy; T.wgmma_gemm + T.wait_wgmma let Q K^T run
while the Gamma tile is built.

Precision: s07's roundings of WY (bf16) plus s05's of u and w (bf16, as they were in HBM); S_c,
Vd, V~ and P as in s07. Emulated on the CPU (PyTorch, the kernel's operations in order, bf16 where
it rounds, fp32 elsewhere), relative L2 error of o / final state, s09 against s07 (the test bound,
twice the bf16 PyTorch reference's error, in brackets): 5.7e-3 / 5.9e-3 against 5.4e-3 / 5.7e-3
[2.2e-2 / 2.4e-2] on the varlen problem above; on flashqla.testing's adversarial inputs with the
seeds of tests/test_reformulation.py, near-duplicate keys 7.1e-3 / 5.5e-3 against 6.4e-3 / 4.8e-3
[1.4e-2 / 1.1e-2], unnormalized keys (half the chunks flagged) 2.35e-2 / 1.87e-2 against
2.33e-2 / 1.85e-2 [8.6e-2 / 6.3e-2], very strong decay 2.5e-3 / 8.0e-4 against 2.5e-3 / 7.8e-4
[2.4e-1 / 3.6e-2]. The emulated s07 lands near what s04 (the same math) measured on the GPU on
these three kinds (other seeds): 6.4e-3, 2.3e-2 and 2.5e-3 for o, against 6.6e-3, 2.0e-2 and
2.5e-3.

Measured effect (``python -m flashqla bench``, H200, CUDA-graph replay, 30 problems of six head
configurations, profiles/results/gdn_fwd.csv): slower, 0.57-0.79x s07 (geomean 0.65x); (16, 64)
1 x 32768 3.289 ms against s07's 2.062. The chain got shorter, but the scores warpgroup now runs
four products and builds WY and WY D in registers each chunk (~1700 SASS instructions, 64
divergent-branch regions in its loop, against the chain's ~800), and the chain waits for its w_c
and u_c on ``bar_wu_ready``: the per-chunk time is now the scores role's. Not promoted. The first
build allocated 112 registers to the output warpgroup with setmaxnreg.inc, below the 128 a thread
starts with: an illegal instruction on the GPU; it gives them back with .dec now
(tests/test_stages.py checks every stage's budgets).

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

import torch

from flashqla import stages
from flashqla.hopper import HOPPER_TARGET
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# wgmma_ss: the five products from shared memory; wgmma_rs: u = WY V and w = (WY D) K, A in
# registers; tma_load: the q, k, v, Ab tiles (PTX cp.async.bulk.tensor); warpgroup_reg_alloc /
# _dealloc: the roles' register budgets (PTX setmaxnreg.inc / .dec)
SOURCE_MUST_CONTAIN = ("wgmma_ss", "wgmma_rs", "tma_load", "warpgroup_reg_alloc",
                       "warpgroup_reg_dealloc")

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
BLOCK_V = 64          # BV: value columns of the state owned by one CTA
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32, K=128, V=128)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)

# ---- warp roles, one warpgroup each, in thread order (one if / elif chain over them, as in s05)
WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP   # [0, 128)   chain: owns S; V~ = u - w S, the state update
SCORES_END = 2 * WARPGROUP  # [128, 256) scores: WY = Gamma * Ab, u = WY V, w = WY D K, P
OUTPUT_END = 3 * WARPGROUP  # [256, 384) output: O = scale diag(exp g) Q S_c + P V~_c
THREADS = 4 * WARPGROUP     # [384, 512) producer: TMA loads of q, k, v, Ab; the gates
# ---- register budgets (setmaxnreg, per thread), within the launch pool of 4 x 128
REGS_PRODUCER = 24    # addresses
REGS_CHAIN = 176      # S (64 fp32 a thread), V~ and Vd (32 + 32): s05's chain
REGS_SCORES = 200     # P (32), Gamma or w (32 or 64), WY and WY D (bf16, 16 + 16), u (32)
REGS_OUTPUT = 112     # O (32)
assert REGS_PRODUCER + REGS_CHAIN + REGS_SCORES + REGS_OUTPUT <= 4 * 128
# ---- buffering
NUM_STAGES = 2        # tile stages: the producer fills chunk c + 2 once chunk c is consumed
NUM_HANDOFF = 2       # slots for S_c, u_c and w_c, V~_c and P_c: chunk c + 1's are written while
                      # chunk c's are still read


def fused_wu_kernel(H: int, HV: int, K: int, V: int):
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
    def gdn_fused_ws_wu(
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
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # scores
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # scores
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # all three
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # scores: exp(g_cum)
            # hand-off slots: S_c (bf16) and V~_c from the chain, u_c, w_c and P_c from the scores
            h_s = T.alloc_shared((NUM_HANDOFF, K, BV), "bfloat16")
            u_s = T.alloc_shared((NUM_HANDOFF, C, BV), "bfloat16")
            w_s = T.alloc_shared((NUM_HANDOFF, C, K), "bfloat16")
            vn_s = T.alloc_shared((NUM_HANDOFF, C, BV), "bfloat16")
            p_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            # chain only: diag(exp(g_C - g)) V~, the B operand of K^T Vd
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            # registers of the chain, scores and output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            vn_f = T.alloc_fragment((C, BV), "float32")
            vd_f = T.alloc_fragment((C, BV), "float32")
            gam_f = T.alloc_fragment((C, C), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            wy_f = T.alloc_fragment((C, C), "bfloat16")            # A operand of u = WY V
            wyd_f = T.alloc_fragment((C, C), "bfloat16")           # A operand of w = (WY D) K
            u_f = T.alloc_fragment((C, BV), "float32")
            w_f = T.alloc_fragment((C, K), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            keep = T.alloc_var("int32")                            # this chunk's gated flag
            # ab_s and u_s are read in the accumulator layout (8 rows of 128 bytes per warp access)
            T.annotate_layout({ab_s: tilelang.layout.make_swizzled_layout(ab_s),
                               u_s: tilelang.layout.make_swizzled_layout(u_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)      # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_wu_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)       # scores -> chain
            bar_wu_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)        # chain -> scores
            bar_state_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # chain -> output
            bar_state_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # output -> chain
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)   # scores -> output
            bar_scores_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # output -> scores

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
                # S <- h0 (this CTA's BV columns of it)
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
                for c in T.serial(num_seq_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_state_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # S_c (fp32 registers) -> bf16 in slot b: the operand of w S here and of Q S
                    # in the output warpgroup
                    T.copy(h_f, h_s[b, :, :])
                    # V~ <- u - w S (rows past the sequence end are zero in u and w, so in V~);
                    # V_d <- diag(exp(g_C - g)) V~, the decayed copy the state update reads;
                    # the u, w slot is free once both are read
                    T.barrier_wait(bar_wu_ready[b], (c // NUM_HANDOFF) % 2)
                    T.gemm(w_s[b, :, :], h_s[b, :, :], vn_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = u_s[b, i, j] - vn_f[i, j]
                        vd_f[i, j] = vn_f[i, j] * T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.barrier_arrive(bar_wu_free[b])
                    T.copy(vd_f, vd_s)
                    # S <- exp(g_C) S + K^T V_d, issued without waiting ...
                    for i, j in T.Parallel(K, BV):
                        h_f[i, j] = h_f[i, j] * T.exp2(g_s[s, C - 1])
                    T.wgmma_gemm(k_s[s, :, :], vd_s, h_f, transpose_A=True)
                    # ... while V~_c goes to slot b and S_c, V~_c are handed to the output
                    # warpgroup (generic-proxy stores that its wgmma reads: fence, then arrive)
                    T.copy(vn_f, vn_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_state_ready[b])
                    T.wait_wgmma(0)
                    T.barrier_arrive(bar_tiles_empty[s])
                T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

            elif tx >= CHAIN_END and tx < SCORES_END:  # ---- the scores warpgroup
                T.set_max_nreg(REGS_SCORES, 1)
                for c in T.serial(num_seq_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    n = T.min(eos - bos - c * C, C)                # real rows of this chunk, 1..64
                    keep = gated[row0 + c, i_hv]
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    # P <- Q K^T, issued without waiting, while the Gamma tile is built:
                    # Gamma <- exp(g_i - g_j), the exponent clamped at 0 so that the upper
                    # triangle (masked below) stays finite: no branch
                    T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True,
                                 clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        gam_f[i, j] = T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                    T.wait_wgmma(0)
                    # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal
                    for i, j in T.Parallel(C, C):
                        p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * gam_f[i, j], 0)
                    # WY <- Gamma * Ab (Ab as stored for a gated chunk) on j <= i < n, 0 elsewhere;
                    # WY D <- WY diag(exp(g)), its columns scaled (bf16, A operands in registers)
                    for i, j in T.Parallel(C, C):
                        wy_f[i, j] = T.if_then_else(
                            (j <= i) & (i < n),
                            ab_s[s, i, j] * T.if_then_else(keep != 0, 1.0, gam_f[i, j]), 0)
                        wyd_f[i, j] = T.if_then_else(
                            (j <= i) & (i < n),
                            ab_s[s, i, j] * T.if_then_else(keep != 0, 1.0, gam_f[i, j])
                            * eg_s[s, j], 0)
                    # u <- WY V, into slot b once the chain has read chunk c - 2's u and w
                    T.gemm(wy_f, v_s[s, :, :], u_f, clear_accum=True)
                    T.barrier_wait(bar_wu_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    T.copy(u_f, u_s[b, :, :])
                    # w <- (WY D) K; the tile stage is then no longer needed
                    T.gemm(wyd_f, k_s[s, :, :], w_f, clear_accum=True)
                    T.barrier_arrive(bar_tiles_empty[s])
                    T.copy(w_f, w_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_wu_ready[b])
                    # P_c -> slot b for the output warpgroup
                    T.barrier_wait(bar_scores_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    T.copy(p_f, p_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_scores_ready[b])

            elif tx >= SCORES_END and tx < OUTPUT_END:  # ---- the output warpgroup
                T.set_max_nreg(REGS_OUTPUT, 0)  # gives 16 back: below the 128 it starts with
                for c in T.serial(num_seq_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    t0 = bos + c * C
                    n = T.min(eos - t0, C)
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_state_ready[b], (c // NUM_HANDOFF) % 2)
                    # O <- scale diag(exp(g)) Q S_c; the tile stage is then no longer needed
                    T.gemm(q_s[s, :, :], h_s[b, :, :], o_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[s, i]))
                    T.barrier_arrive(bar_tiles_empty[s])
                    # O <- O + P_c V~_c
                    T.barrier_wait(bar_scores_ready[b], (c // NUM_HANDOFF) % 2)
                    T.gemm(p_s[b, :, :], vn_s[b, :, :], o_f)
                    T.barrier_arrive(bar_state_free[b])
                    T.barrier_arrive(bar_scores_free[b])
                    # o[t0 : t0 + n] <- O, the chunk's own rows only, straight from the registers
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
                    # exponent (g_i - g_j with i >= j, g_C - g_i, g_i, g_C) is <= 0; and exp(g_cum)
                    # (D, the column scaling of WY D: 64 exponentials here, not 64 x 64 there)
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                        eg_s[s, i] = T.exp2(g_s[s, i])
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_ws_wu


@functools.cache
def _compiled(H: int, HV: int, K: int, V: int):
    import tilelang

    # as in s05: no shared-memory reuse (the planner treats the role branches as sequential);
    # fast math (exp2 is one ex2.approx, no branch)
    return tilelang.compile(fused_wu_kernel(H, HV, K, V), target=HOPPER_TARGET,
                            pass_configs={"tl.disable_shared_memory_reuse": True,
                                          "tl.enable_fast_math": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def fused_wu(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale):
    """The fused kernel alone, with s07's interface: [B, T, ...] inputs (ab bf16 and gated from
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
        with nvtx_range("gdn_fwd.s09"):
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
        raise ValueError(f"gdn_fwd.s09: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s09: `q` must have head dim K = 128; got K = {K}")
    if V != 128:
        raise ValueError(f"gdn_fwd.s09: `v` must have head dim V = 128; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s09: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, chunk_size)
    ab, gated = stages.load("gate_free_solve", 1).solve(k, beta, g_cum, cu_seqlens)
    o, ht = fused_wu(q, k, v, ab, g_cum.contiguous(), gated, initial_state, cu_seqlens, scale)
    return o, (ht if output_final_state else None)
