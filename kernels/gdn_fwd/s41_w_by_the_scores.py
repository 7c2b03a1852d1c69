"""gdn_fwd, stage 41: s40 with -WY D K built by the scores warpgroup, so that the chain's value
correction is one product of the state: V~^T = V^T WY^T + S_c^T (-WY D K)^T.

What changed from s40: the chain computed U^T = S_c^T K^T, waited, scaled and negated it into a bf16
fragment (U^T D), and multiplied that by WY^T: two dependent products and a pass between them.
Since (U^T D) WY^T = S_c^T (WY D K)^T, the scores warpgroup, idle half its span in s40 (the role
timeline: 48 % waiting for tiles), now builds M = -WY D K (64 x 128, WY's columns scaled by
exp(g_j); left operand from registers) once the tiles are in, stores it to shared memory (two
stages, 32 KB) and arrives ``bar_m_ready``; the chain adds S_c^T M^T to V^T WY^T in the same
accumulator, issued without waiting. The chain's products per chunk go from three to two (k 128
and k 64), its passes from two to one. The scores warpgroup then builds P as before.

Precision: M is rounded to bf16 (FLA's w is too); s40 rounded diag(exp g) U instead.

Why: s40's chain (its role timeline, (16, 64) 1x8192) spends 2461 of its 4835 stamped cycles a chunk
on its own instructions and 1353 in wgmma, waiting on each product before the next.

Measured effect: slower; not promoted. Its GPU tests passed (one H100, commit f7b01a9: the gdn_fwd
check against float64 on five problems, flagged chunks included, the same bits eagerly and from a
CUDA graph; the public shapes; AutoCP's tests). The forward, ``bench.time_row`` in one process,
one H100, ms:

    problem              s40      s41
    (16, 48) 1x8192     0.3198   0.3309
    (16, 64) 1x8192     0.3696   0.3812
    (16, 48) 1x32768    1.2532   1.3067
    (16, 64) 1x32768    1.4322   1.4804
    (2, 8) 8x4096       0.1901   0.1944
    (16, 48) 1x2048     0.0906   0.0938
    (16, 64) 28672+4096 1.4140   1.4774

1.02-1.04x s40's time. The role timeline (same run, (16, 64) 1x8192, with the stamps' cost) says
why: the scores warpgroup now spends 3069 of its 5157 cycles a chunk on its own work (the pass
that scales and negates WY, the stores of M to shared memory, P) and 1033 in wgmma, and waits
under 10 %; the chain waits 532 cycles a chunk for M (``bar_m_ready``). The chain's own work went
from 2461 to 2353 cycles and its wgmma from 1353 to 1199: the pace moved to the scores warpgroup,
whose new work costs more than the chain saved. M's stores go through a two-stage buffer (a slice:
no stmatrix) and its pass reads WY from shared memory in the A operand's layout.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "tma_store", "exp2f", "stmatrix")

S40 = stages.load("gdn_fwd", 40)        # the kernel this one edits
S37 = S40.S37                           # where the solve stores WY (BV 64), its forward
S36, S34, S27, S12 = S40.S36, S40.S34, S40.S27, S40.S12
CHUNK_SIZE = S40.CHUNK_SIZE
HEAD_DIM = S40.HEAD_DIM
STEP = S40.STEP
DEFAULT_SHAPE = S40.DEFAULT_SHAPE
BLOCK_V = S40.BLOCK_V
NUM_STAGES, NUM_HANDOFF, LOG2E, WARPGROUP = S40.NUM_STAGES, S40.NUM_HANDOFF, S40.LOG2E, S40.WARPGROUP
CHAIN_END, SCORES_END, OUTPUT_END, THREADS = S40.CHAIN_END, S40.SCORES_END, S40.OUTPUT_END, S40.THREADS
REGS_PRODUCER = S40.REGS_PRODUCER       # addresses
REGS_CHAIN = S40.REGS_CHAIN             # S^T (64 fp32 a thread), V~^T (32), bf16 S^T (32), Vd^T (16)
REGS_SCORES = S40.REGS_SCORES           # -WY D K (64) and -WY D (16), then P (32) and Gamma (32)
REGS_OUTPUT = S40.REGS_OUTPUT           # O (32)


def fused_state_value_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV = 64 value columns of the
    state per CTA, ab holding WY (s36's solve); any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    if BV != BLOCK_V:
        raise ValueError(f"gdn_fwd.s41: the kernel takes BV = {BLOCK_V} (S^T's rows); got {BV}")
    C = CHUNK_SIZE
    chunk_parts = S12.chunk_parts
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_fused_state_in_registers(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # WY = Gamma * Ab, rows per token
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        gated: T.Tensor((num_chunks, HV), "int32"),            # unread: ab holds WY (s36's solve)
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # sequence starts, then the total
        first_chunk: T.Tensor((num_bounds,), "int32"),         # unread (the gated flags' rows)
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
    ):
        with T.Kernel(V // BV, HV, num_seqs, threads=THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            num_seq_chunks = T.ceildiv(eos - bos, C)

            # tile stages (producer -> consumers); g holds log2(e) g_cum
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores, output
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain, scores
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # chain
            wy_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # chain, scores
            m_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores -> chain: -WY D K
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # scores
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # chain, output: exp(g); exp(g_C)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # chain: exp(g_C - g), 0 past the end
            # hand-off slots by chunk parity: S_c^T, V~_c^T (chain -> output; a whole buffer a slot,
            # so that the chain's stores lower to stmatrix), P_c (scores -> output)
            ht_s0 = T.alloc_shared((BV, K), "bfloat16")
            ht_s1 = T.alloc_shared((BV, K), "bfloat16")
            vnt_s0 = T.alloc_shared((BV, C), "bfloat16")
            vnt_s1 = T.alloc_shared((BV, C), "bfloat16")
            p_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            o_s = T.alloc_shared((C, BV), "bfloat16")                 # output: O, for whole-row stores
            # the chain's registers: S^T, the accumulator of V~^T, the bf16 left operands
            st_f = T.alloc_fragment((BV, K), "float32")
            st_a = T.alloc_fragment((BV, K), "bfloat16")
            y_f = T.alloc_fragment((BV, C), "float32")
            x_a = T.alloc_fragment((BV, C), "bfloat16")
            # the scores' (-WY D, then -WY D K; Gamma and P) and the output's
            wyd_a = T.alloc_fragment((C, C), "bfloat16")
            m_f = T.alloc_fragment((C, K), "float32")
            gam_f = T.alloc_fragment((C, C), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)       # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_state_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # chain -> output: S_c^T
            bar_state_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)      # output -> chain
            bar_vn_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)        # chain -> output: V~_c^T
            bar_vn_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)         # output -> chain
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # scores -> output: P_c
            bar_scores_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # output -> scores
            bar_m_ready = T.alloc_barrier([WARPGROUP] * NUM_STAGES)          # scores -> chain: -WY D K
            # (m_shared[b] is written again for chunk c + 2 only after the producer refilled stage b,
            # which waits for the chain's tiles_empty of chunk c, after its last read of it)

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
                # S^T <- h0^T (this CTA's BV columns of h0, as rows)
                for j, i in T.Parallel(BV, K):
                    st_f[j, i] = h0[i_n, i_hv, i, v0 + j]
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:  # the odd last chunk under an `if` (s12's chunk_parts says why)
                        for r in T.serial(reps):
                            for b, ht_sb, vnt_sb in zip(slots, (ht_s0, ht_s1), (vnt_s0, vnt_s1)):
                                c = c0 + 2 * r + b
                                phase = (c // NUM_HANDOFF) % 2
                                T.barrier_wait(bar_tiles_full[b], phase)
                                # V~^T <- V^T WY^T, issued without waiting (it does not need S)
                                T.wgmma_gemm(v_s[b, :, :], wy_s[b, :, :], y_f, transpose_A=True,
                                             transpose_B=True, clear_accum=True)
                                # V~^T <- V~^T + S_c^T (-WY D K)^T = V^T WY^T - (S_c^T K^T D) WY^T, S_c^T
                                # rounded to bf16 in registers, issued without waiting once the
                                # scores warpgroup has stored -WY D K
                                T.copy(st_f, st_a)
                                T.barrier_wait(bar_m_ready[b], phase)
                                T.wgmma_gemm(st_a, m_s[b, :, :], y_f, transpose_B=True)
                                # while they run: S_c^T -> slot b for the output once it has read
                                # S_{c-2}^T, and S^T <- exp(g_C) S^T (the products read st_a only)
                                T.barrier_wait(bar_state_free[b], phase ^ 1)
                                T.copy(st_a, ht_sb)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_state_ready[b])
                                for j, i in T.Parallel(BV, K):
                                    st_f[j, i] = st_f[j, i] * eg_s[b, C - 1]
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(y_f, num_regs=BV * C // WARPGROUP)
                                # V~_c^T -> slot b for the output once it has read V~_{c-2}^T
                                T.barrier_wait(bar_vn_free[b], phase ^ 1)
                                T.copy(y_f, vnt_sb)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_vn_ready[b])
                                # Vd^T <- V~^T diag(exp(g_C - g)): 0 on the columns past a sequence's
                                # end (the producer's exp(g_C - g) is 0 there; V~^T is finite there)
                                for j, i in T.Parallel(BV, C):
                                    x_a[j, i] = y_f[j, i] * egd_s[b, i]
                                # S^T <- exp(g_C) S^T + Vd^T K
                                T.gemm(x_a, k_s[b, :, :], st_f)
                                T.barrier_arrive(bar_tiles_empty[b])
                # ht <- S^T, transposed back
                for j, i in T.Parallel(BV, K):
                    ht[i_n, i_hv, i, v0 + j] = st_f[j, i]

            elif tx >= CHAIN_END and tx < SCORES_END:  # ---- the scores warpgroup
                T.set_max_nreg(REGS_SCORES, 1)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:
                        for r in T.serial(reps):
                            for b in slots:
                                c = c0 + 2 * r + b
                                phase = (c // NUM_HANDOFF) % 2
                                T.barrier_wait(bar_tiles_full[b], phase)
                                # -WY D K (WY's columns scaled by exp(g_j), negated), for the chain
                                for i, j in T.Parallel(C, C):
                                    wyd_a[i, j] = -wy_s[b, i, j] * eg_s[b, j]
                                T.gemm(wyd_a, k_s[b, :, :], m_f, clear_accum=True)
                                T.copy(m_f, m_s[b, :, :])
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_m_ready[b])
                                # P <- Q K^T, issued without waiting: Gamma is built while the
                                # tensor cores run it
                                T.wgmma_gemm(q_s[b, :, :], k_s[b, :, :], p_f, transpose_B=True,
                                             clear_accum=True)
                                # Gamma <- exp(g_i - g_j), the exponent clamped at 0 so that the
                                # upper triangle (masked below) stays finite: no branch
                                for i, j in T.Parallel(C, C):
                                    gam_f[i, j] = T.exp2(T.min(g_s[b, i] - g_s[b, j], 0))
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(p_f, num_regs=C * C // WARPGROUP)
                                T.barrier_arrive(bar_tiles_empty[b])
                                # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal,
                                # to slot b once the output has read P_{c-2}
                                for i, j in T.Parallel(C, C):
                                    p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * gam_f[i, j], 0)
                                T.barrier_wait(bar_scores_free[b], phase ^ 1)
                                T.copy(p_f, p_s[b, :, :])
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_scores_ready[b])

            elif tx >= SCORES_END and tx < OUTPUT_END:  # ---- the output warpgroup
                T.set_max_nreg(REGS_OUTPUT, 1)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:
                        for r in T.serial(reps):
                            for b, ht_sb, vnt_sb in zip(slots, (ht_s0, ht_s1), (vnt_s0, vnt_s1)):
                                c = c0 + 2 * r + b
                                phase = (c // NUM_HANDOFF) % 2
                                t0 = bos + c * C
                                T.barrier_wait(bar_tiles_full[b], phase)
                                # O <- scale diag(exp g) Q S_c  (S_c = (S_c^T)^T)
                                T.barrier_wait(bar_state_ready[b], phase)
                                T.gemm(q_s[b, :, :], ht_sb, o_f, transpose_B=True, clear_accum=True)
                                T.barrier_arrive(bar_state_free[b])
                                for i, j in T.Parallel(C, BV):
                                    o_f[i, j] = o_f[i, j] * (scale * eg_s[b, i])
                                T.barrier_arrive(bar_tiles_empty[b])
                                # O <- O + P_c V~_c
                                T.barrier_wait(bar_scores_ready[b], phase)
                                T.barrier_wait(bar_vn_ready[b], phase)
                                T.gemm(p_s[b, :, :], vnt_sb, o_f, transpose_B=True)
                                T.barrier_arrive(bar_scores_free[b])
                                T.barrier_arrive(bar_vn_free[b])
                                # o[t0 : t0 + n] <- O through shared memory: a whole chunk by one TMA
                                # store, left running (its wait is the next chunk's, just before
                                # o_shared is written again), a sequence's partial last chunk row by row
                                T.tma_store_wait()
                                T.copy(o_f, o_s)
                                if eos - t0 >= C:
                                    T.fence_proxy_async()
                                    T.tma_copy(o_s, o[t0:t0 + C, i_hv, v0:v0 + BV])
                                else:
                                    for i, j in T.Parallel(C, BV):
                                        if i < eos - t0:
                                            o[t0 + i, i_hv, v0 + j] = o_s[i, j]
                T.tma_store_wait()  # the last chunk's store has read o_shared before the CTA ends

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
                    T.tma_copy(ab[t0:t0 + C, i_hv, :], wy_s[s, :, :], barrier=bar_tiles_full[s])
                    # g <- log2(e) g_cum, rows past the end padded with the last real row, so every
                    # exponent (g_i - g_j with i >= j, g_C - g_i, g_i, g_C) is <= 0
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    # the row factors exp(g_i) and exp(g_C - g_i) (exp(g_C) is the last of the first);
                    # the second 0 past the sequence's end: Vd's mask
                    for i in T.Parallel(C):
                        eg_s[s, i] = T.exp2(g_s[s, i])
                        egd_s[s, i] = T.if_then_else(t0 + i < eos, T.exp2(g_s[s, C - 1] - g_s[s, i]), 0)
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_state_in_registers




@functools.cache
def _wide(H: int, HV: int, K: int, V: int, BV: int):
    return compile_hopper(dependent_launch(fused_state_value_kernel(H, HV, K, V, BV)), S27.FUSED_CONFIGS)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: this stage's wide kernel at BV 64."""
    return _wide(**DEFAULT_SHAPE, BV=BLOCK_V).get_kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, *, fused=_wide):
    """s37's forward with this stage's wide kernel where s37 stores WY (``cp`` None decides, False
    never splits, True splits at the rule's cheapest L, an int is the segment length in chunks).
    ``fused(H, HV, K, V, BV)``: the compiled wide kernel (profiles/role_timeline_lab.py passes a
    stamped one)."""
    if not S37.stores_wy(q, v, cu_seqlens, cp):
        return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold)
    return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold,
                       prologue=S36.prologue, fused=fused)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s41: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s41: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s41: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s41: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
