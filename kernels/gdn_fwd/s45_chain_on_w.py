"""gdn_fwd, stage 45: s44 with the narrow fused kernel's chain on FLA's w and u: V~ = u - w S_c,
where w = WY D K and u = WY V are built by the output warpgroup a chunk ahead.

What changed from s44: the fused kernel at 16 and 32 value columns (s12's, ``fused_reform_kernel``).
Its chain computed, a chunk at a time,

    U = K S_c,  W = V - D U,  V~ = WY W,  S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~

(D = diag(exp g)): three products in a row, and two passes through shared memory between them (W,
then Vd). WY (V - D K S_c) = WY V - (WY D K) S_c, and neither u = WY V nor w = WY D K depends on
the state. FLA's ``recompute_w_u`` computes both beforehand, and its state kernel runs v_new =
u - w h. Here the output warpgroup builds them: w (64 x 128, bf16) and u (64 x BV, fp32) for
chunk c + 1 while the chain walks chunk c. Then the chain's step is

    V~ = u - w S_c,  S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~

two products and one pass. WY D has entries WY_ij exp(g_j): the output warpgroup scales WY's
columns in registers (the left operand of w's product). For a gate-free chunk that is D Ab, and a
flagged chunk's Ab already holds the gate. Every factor is an exponential of a non-positive number.
The producer keeps three tile stages (s44: two), so that chunk c + 1's tiles, WY and w can be ready
while the chain walks chunk c. The one w / u buffer is rewritten once the chain's first product of
the chunk before has read it.

The roles (``fused_reform_kernel``):

    chain      S (128 x BV fp32) in registers; S_c to shared memory (bf16), the operand of w S_c
               here and of Q S_c in the output; V~ = u - w S_c; S += K^T Vd
    scores     Gamma and WY to shared memory; P = scale (Q K^T * Gamma)
    output     w = (WY D) K and u = WY V of chunk c + 1, then O = scale D Q S_c + P V~_c
    producer   TMA loads of q, k, v, Ab into three stages; g, exp(g), exp(g_C - g)

Precision: w is rounded to bf16 (FLA's w is too). s44 rounded W = V - D U instead. u stays fp32.

Why: on the short problems the chain paces the narrow kernel. The role timeline of (2, 8) 1x2048 at
BV 16 (``results/role_timeline.csv``, 4f33b5e) stamps 4042 cycles a chunk on s44's chain: 1194 in
wgmma, 1534 on its own instructions and 727 at TileLang's named barriers. Its output warpgroup
waits for the state 47 % of its span. Nsight Compute on that problem (``results/ncu_targets.csv``)
gives the kernel 1.7 us a chunk. FLA's two-product state recurrence takes 1.3 us a chunk.

Measured effect: slower; not promoted. The forward, s44 and this stage, ``bench.time_row`` in one
process on one H100 (``results/chain_on_w.csv``), ms:

    problem            s44      s45   s45/s44   build
    (2, 8) 1x2048     0.0614   0.1090   1.78   first, 635e334
    (4, 16) 1x2048    0.0675   0.1161   1.72   first, 635e334
    (16, 16) 1x2048   0.0663   0.1162   1.75   first, 635e334
    (8, 32) 1x2048    0.0813   0.1371   1.69   first, 635e334
    (16, 32) 1x2048   0.0813   0.1401   1.72   first, 635e334
    (8, 24) 1x2048    0.0780   0.1305   1.67   first, 635e334
    (16, 64) 1x2048   0.0913   0.0911   1.00   first, 635e334 (BV 64: not this kernel)
    (2, 8) 1x2048     0.0617   0.0792   1.28   this one, 5e4296f
    (4, 16) 1x2048    0.0674   0.0879   1.30   this one, 5e4296f
    (16, 16) 1x2048   0.0666   0.0856   1.29   this one, 5e4296f
    (8, 32) 1x2048    0.0808   0.1053   1.30   this one, 5e4296f
    (16, 32) 1x2048   0.0813   0.1066   1.31   this one, 5e4296f
    (8, 24) 1x2048    0.0777   0.1011   1.30   this one, 5e4296f

The first build had the scores warpgroup write WY D to shared memory beside WY, and two tile
stages. This one (its kernel unchanged since a31b494) is 1.28-1.31x s44's time on the six problems
that run it. The role timeline of (2, 8) 1x2048 in one call
(4f33b5e, stamped cycles a chunk) says why:
- the chain's own time (work, wgmma, named barriers) falls from 3455 to 2782;
- but the chain waits 2461 cycles a chunk for w (``bar_w_ready``);
- the scores warpgroup's own work rises from 2872 to 4352, and its span, 5590, now sets the pace
  (s44's chunk: 4042).

The warpgroups were balanced already: s44's scores warpgroup works 72 % of its span, its output
warpgroup 44 %. Shortening the chain's step moved the pace to the scores warpgroup, as s41's W
product did at 64 columns. The stamps do not say why the scores' own work grew: this stage changed
none of its instructions except the stage count. Beside it, on the same SM, the output
warpgroup's own work and wgmma rose from 1797 to 4150 cycles a chunk.

Its GPU tests passed (a31b494): the public shapes; the adversarial inputs, flagged chunks
included; AutoCP's CP on against off, determinism and graph replay.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "gdn_fused_chain_on_w")

S44 = stages.load("gdn_fwd", 44)        # the forward this one edits
S43, S40, S34, S27 = S44.S43, S44.S40, S44.S34, S44.S27
S12 = stages.load("gdn_fwd", 12)        # the narrow kernel this one edits
CHUNK_SIZE = S44.CHUNK_SIZE
HEAD_DIM = S44.HEAD_DIM
STEP = S44.STEP
LOG2E = S44.LOG2E
DEFAULT_SHAPE = dict(H=2, HV=8, K=128, V=128)
NARROW_WIDTHS = (16, 32)     # the widths at which the forward runs this kernel (s33's and s12's)

WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP    # [0, 128)   chain: owns S; V~ = u - w S_c, the state update
SCORES_END = 2 * WARPGROUP   # [128, 256) scores: WY, WY D and P = scale (Q K^T * Gamma)
OUTPUT_END = 3 * WARPGROUP   # [256, 384) output: w = (WY D) K, u = WY V a chunk ahead; O
THREADS = 4 * WARPGROUP      # [384, 512) producer: TMA loads of q, k, v, Ab; the gates
# register budgets (setmaxnreg, per thread), within the launch's 65536 / 512 = 128
REGS_CHAIN = 168             # S (32 fp32 a thread at BV 32), w S_c / Vd (16), V~ (16)
REGS_SCORES = 136            # P (32), Gamma (32)
REGS_OUTPUT = 184            # w (64 fp32 a thread), u (16), O (16)
REGS_PRODUCER = 24           # addresses
assert (REGS_CHAIN + REGS_SCORES + REGS_OUTPUT + REGS_PRODUCER) * WARPGROUP <= 65536

NUM_STAGES = 3               # tile stages: the producer fills chunk c + 3 once chunk c is consumed
NUM_HANDOFF = 2              # slots for S_c, V~_c, WY_c and P_c by chunk parity (w_c, u_c: one)
chunk_parts = S12.chunk_parts  # the chain's and output's loop: pairs of chunks, then an odd last one


def fused_reform_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV (16 or 32) value columns
    of the state per CTA; any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    if BV not in NARROW_WIDTHS:
        raise ValueError(f"gdn_fwd.s45: `BV` must be one of {NARROW_WIDTHS}; got {BV}")
    C = CHUNK_SIZE
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")
    num_chunks = T.dynamic("num_chunks")

    @T.macro
    def build_w_u(c, bar_tiles_full, bar_wy_ready, bar_wy_free, bar_w_ready, bar_w_free,
                  wy_s, eg_s, k_s, v_s, wyd_a, w_f, u_f, w_s, u_s):
        # the output warpgroup's w_c <- (WY D) K (WY's columns scaled by exp(g_j) in registers) and
        # u_c <- WY V, into the one buffer once the chain's first product of chunk c - 1 has read it
        T.barrier_wait(bar_tiles_full[c % NUM_STAGES], (c // NUM_STAGES) % 2)
        T.barrier_wait(bar_wy_ready[c % NUM_HANDOFF], (c // NUM_HANDOFF) % 2)
        for i, j in T.Parallel(C, C):
            wyd_a[i, j] = wy_s[c % NUM_HANDOFF, i, j] * eg_s[c % NUM_STAGES, j]
        T.gemm(wyd_a, k_s[c % NUM_STAGES, :, :], w_f, clear_accum=True)
        T.gemm(wy_s[c % NUM_HANDOFF, :, :], v_s[c % NUM_STAGES, :, :], u_f, clear_accum=True)
        T.barrier_arrive(bar_wy_free[c % NUM_HANDOFF])
        T.barrier_wait(bar_w_free[0], (c % 2) ^ 1)
        T.copy(w_f, w_s)
        T.copy(u_f, u_s)
        T.fence_proxy_async()
        T.barrier_arrive(bar_w_ready[0])

    @T.prim_func
    def gdn_fused_chain_on_w(
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
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain, scores, output
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # output
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # scores
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # scores, output
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # chain, scores: exp(g)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # chain: exp(g_C - g)
            # hand-off slots, one buffer per slot (a store into a whole buffer lowers to stmatrix):
            # S_c (bf16) and V~_c from the chain; WY_c and P_c from the scores. w_c and u_c from
            # the output: one buffer, rewritten once the chain's first product has read it
            h_s0 = T.alloc_shared((K, BV), "bfloat16")
            h_s1 = T.alloc_shared((K, BV), "bfloat16")
            vn_s0 = T.alloc_shared((C, BV), "bfloat16")
            vn_s1 = T.alloc_shared((C, BV), "bfloat16")
            w_s = T.alloc_shared((C, K), "bfloat16")
            u_s = T.alloc_shared((C, BV), "float32")
            wy_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            p_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            # chain only: diag(exp(g_C - g)) V~, the B operand of K^T Vd
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            # registers of the chain, scores and output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            x_f = T.alloc_fragment((C, BV), "float32")             # w S_c, then Vd
            vn_f = T.alloc_fragment((C, BV), "float32")
            gam_f = T.alloc_fragment((C, C), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            wyd_a = T.alloc_fragment((C, C), "bfloat16")           # WY D, the left operand of w
            w_f = T.alloc_fragment((C, K), "float32")
            u_f = T.alloc_fragment((C, BV), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            keep = T.alloc_var("int32")                            # this chunk's gated flag
            # ab_s is read in the accumulator layout (8 rows of 128 bytes per warp access)
            T.annotate_layout({ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)      # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_wy_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)       # scores -> output: WY
            bar_wy_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)        # output -> scores
            bar_w_ready = T.alloc_barrier([WARPGROUP])                      # output -> chain: w, u
            bar_w_free = T.alloc_barrier([WARPGROUP])                       # chain -> output
            bar_state_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # chain -> output: S_c, V~_c
            bar_state_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # output -> chain
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)   # scores -> output: P
            bar_scores_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # output -> scores

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
                # S <- h0 (this CTA's BV columns of it)
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:  # the odd last chunk under an `if` (s12's chunk_parts says why)
                        for r in T.serial(reps):
                            for b, h_sb, vn_sb in zip(slots, (h_s0, h_s1), (vn_s0, vn_s1)):
                                c = c0 + 2 * r + b
                                s = c % NUM_STAGES
                                phase = (c // NUM_HANDOFF) % 2
                                T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                                T.barrier_wait(bar_state_free[b], phase ^ 1)
                                # S_c (fp32 registers) -> bf16 in slot b: the operand of w S_c here
                                # and of Q S_c in the output warpgroup
                                T.copy(h_f, h_sb)
                                # w S_c, w from the output warpgroup, issued without waiting, while
                                # S <- exp(g_C) S (registers w S_c does not read)
                                T.barrier_wait(bar_w_ready[0], c % 2)
                                T.wgmma_gemm(w_s, h_sb, x_f, clear_accum=True)
                                for i, j in T.Parallel(K, BV):
                                    h_f[i, j] = h_f[i, j] * eg_s[s, C - 1]
                                T.wait_wgmma(0)
                                # V~ <- u - w S_c (rows >= n: u and w are 0 there, WY's rows are)
                                for i, j in T.Parallel(C, BV):
                                    vn_f[i, j] = u_s[i, j] - x_f[i, j]
                                T.barrier_arrive(bar_w_free[0])
                                # Vd <- diag(exp(g_C - g)) V~, the decayed copy the update reads
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = vn_f[i, j] * egd_s[s, i]
                                T.copy(x_f, vd_s)
                                # S <- S + K^T Vd (S already decayed), issued without waiting ...
                                T.wgmma_gemm(k_s[s, :, :], vd_s, h_f, transpose_A=True)
                                # ... while V~_c goes to slot b and S_c, V~_c are handed to the
                                # output warpgroup (generic-proxy stores that its wgmma reads:
                                # fence, then arrive)
                                T.copy(vn_f, vn_sb)
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
                    n = T.min(eos - bos - c * C, C)
                    keep = gated[row0 + c, i_hv]
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_wy_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # Gamma <- exp(g_i - g_j), the exponent clamped at 0 so that the upper
                    # triangle (masked below) stays finite: no branch
                    for i, j in T.Parallel(C, C):
                        gam_f[i, j] = T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                    # WY <- Gamma * Ab (Ab as stored for a gated chunk) on j <= i < n, 0 elsewhere;
                    # handed to the output warpgroup first
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
                # w_0, u_0 before the loop; in the loop chunk c + 1's, then chunk c's output
                if num_seq_chunks > 0:
                    build_w_u(0, bar_tiles_full, bar_wy_ready, bar_wy_free, bar_w_ready, bar_w_free,
                              wy_s, eg_s, k_s, v_s, wyd_a, w_f, u_f, w_s, u_s)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:
                        for r in T.serial(reps):
                            for b, h_sb, vn_sb in zip(slots, (h_s0, h_s1), (vn_s0, vn_s1)):
                                c = c0 + 2 * r + b
                                phase = (c // NUM_HANDOFF) % 2
                                t0 = bos + c * C
                                n = T.min(eos - t0, C)
                                if c + 1 < num_seq_chunks:
                                    build_w_u(c + 1, bar_tiles_full, bar_wy_ready, bar_wy_free, bar_w_ready,
                                              bar_w_free, wy_s, eg_s, k_s, v_s, wyd_a, w_f, u_f, w_s, u_s)
                                T.barrier_wait(bar_state_ready[b], phase)
                                # O <- scale diag(exp(g)) Q S_c; then the tile stage is free
                                T.gemm(q_s[c % NUM_STAGES, :, :], h_sb, o_f, clear_accum=True)
                                for i, j in T.Parallel(C, BV):
                                    o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[c % NUM_STAGES, i]))
                                T.barrier_arrive(bar_tiles_empty[c % NUM_STAGES])
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
                    # the row factors exp(g_i) and exp(g_C - g_i), 64 exponentials a chunk
                    # (exp(g_C) is the last of the first)
                    for i in T.Parallel(C):
                        eg_s[s, i] = T.exp2(g_s[s, i])
                        egd_s[s, i] = T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_chain_on_w


@functools.cache
def _narrow(H: int, HV: int, K: int, V: int, BV: int):
    return compile_hopper(dependent_launch(fused_reform_kernel(H, HV, K, V, BV)), S27.FUSED_CONFIGS)


def fused(H: int, HV: int, K: int, V: int, BV: int):
    """The compiled fused kernel at BV: this stage's at 16 and 32, s34's at 64 and 128."""
    return _narrow(H, HV, K, V, BV) if BV in NARROW_WIDTHS else S34._wide(H, HV, K, V, BV)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: this stage's kernel at (2, 8), BV 16."""
    return _narrow(**DEFAULT_SHAPE, BV=16).get_kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, *, fused=fused):
    """s44's forward with this stage's fused kernel at 16 and 32 columns (``cp`` None decides,
    False never splits, True splits at the rule's cheapest L, an int is the segment length).
    ``fused``: the compiled fused kernel at a shape (profiles/role_timeline_lab.py passes stamped ones)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k = (x.to(torch.bfloat16).contiguous().view(B * T, H, K) for x in (q, k))
    v = v.to(torch.bfloat16).contiguous().view(B * T, HV, V)
    g, beta = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (g, beta))
    seqs = seq_bounds(cu_seqlens, B, T, device)
    N = seqs.shape[0] - 1
    fp32 = dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    if B * T == 0:
        return o.view(B, T, HV, V), (h0.clone() if output_final_state else None)

    chunks = torch.empty(num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE), 2, dtype=torch.int32, device=device)
    first_chunk = torch.empty(N + 1, dtype=torch.int32, device=device)
    g_cum = torch.empty(B * T, HV, **fp32)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, dtype=torch.bfloat16, device=device)
    gated = torch.empty(chunks.shape[0], HV, dtype=torch.int32, device=device)
    sms = autocp.num_sms(device)
    BV, p, store_wy = S44.launch(q.view(B, T, H, K), v.view(B, T, HV, V), cu_seqlens, cp)
    with nvtx_range("gdn_fwd.s45"):
        S43.prologue(store_wy)(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)
    if p is not None:  # AutoCP: windows, phase 1 (Z, M), phase 2, as s44
        J = p.max_segments
        win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
        exact = torch.empty_like(win_start)
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
        with nvtx_range("gdn_fwd.s45"):
            S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                         p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
            S44._warmup(H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk, exact, z, m)
            S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
        h0, seqs, first_chunk = h_seg, p.bounds, p.first_chunk
        BV = S27.S18.PIPELINE.block_v([1] * (seqs.shape[0] - 1), HV, V, sms, STEP)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("gdn_fwd.s45"):
        # o, final states <- the fused chain and output over sequences (or segments)
        (S40._wide if store_wy else fused)(H, HV, K, V, BV)(q, k, v, ab, g_cum, gated, h0, seqs, first_chunk, scale, o, ht)
    if p is not None and output_final_state:
        ht = ht.index_select(0, p.last_segment)  # the state a sequence's last segment leaves
    return o.view(B, T, HV, V), (ht if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s45: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s45: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s45: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s45: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
