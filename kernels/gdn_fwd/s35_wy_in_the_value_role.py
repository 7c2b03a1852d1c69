"""gdn_fwd, stage 35: s34 with WY built by the value warpgroup of the wide fused kernel, not by the
scores / output warpgroup.

What changed from s34: one block moves between roles of the wide kernel (BV 64 and 128). WY =
Gamma * Ab on j <= i < n (Ab as the solve stored it for a gated chunk) is built over the Ab tile by
the value warpgroup, first thing in its chunk, before it waits for S_c; s34's scores / output
warpgroup built it after P and handed it over (``bar_scores_ready``, which now orders only P for
the output, inside that warpgroup). The value warpgroup computes its own exponentials for it; the
same formula in the same float32 order, so the bits do not change. Everything else is s34's, and
s34's forward runs it (its ``fused`` keyword).

Why: ``profiles/role_timeline_lab.py`` on s34 (one H100, dac1807, (16, 64) 1x8192 at BV 64): the
scores / output warpgroup still sets the pace (waits under 12 % of its span) and the region where
it builds P and WY takes 1400-1600 cycles of its 6300 a chunk, while the value warpgroup waits 22 %
of its span for S_c. A what-if without the WY pass at all (wrong results, timing only; one H100,
357e1d9) took 0.820x s34's forward on (16, 64) 1x8192 and 0.789x on (16, 48) 1x32768: the bound
of what moving it off that warpgroup can give.

Measured effect: slower, 1.22-1.50x s34's time; not promoted. Its tests passed on the GPU (one
H100, 45722b0: the public shapes; bit for bit s34's, eagerly and from a CUDA graph). The forward
(``bench.time_row`` in one process, the API running s34's kernels), ms:

    problem              API (s34)   s34      s35
    (16, 64) 1x8192       0.3933    0.3890   0.5737
    (16, 48) 1x8192       0.3745    0.3720   0.5592
    (16, 48) 1x32768      1.4442    1.4627   2.1951
    (16, 64) 1x32768      1.5312    1.5368   2.2613
    (16, 64) 8x4096       1.1606    1.1684   1.5701
    (16, 32) 8x4096       0.6177    0.6190   0.8184
    (16, 16) 8x4096       0.3686    0.3706   0.4545
    (8, 24) 28672+4096    0.8645    0.8588   1.0477

The stamps say why (``results/role_timeline.csv``, (16, 64) 1x8192): the value warpgroup now sets
the pace, 76 % of its span its own work (6635 cycles a chunk against s34's 2252), and the WY block
alone takes 4400-4550 cycles there (between its two named barriers), about three times what P and
WY together took in the scores / output warpgroup; the state warpgroup's wait for Vd grows from
55 % to 70 %. ptxas reports no spills (128 registers). What differs is the fragment: in the scores
warpgroup WY is built in P's wgmma accumulator layout, next to Gamma already in registers; here
TileLang gives ``wy_f`` a row-major layout of its own and each element computes its exponential
again, with ``keep`` loaded from global memory just before its first use. The lesson for the next
stage: take WY off the chain's warpgroups altogether (the solve can store Gamma * Ab; the what-if
without the pass was 0.79-0.82x s34), not onto another of them.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "tma_store")

S34 = stages.load("gdn_fwd", 34)        # the forward, the kernel this one edits, its constants
S27 = S34.S27
CHUNK_SIZE = S34.CHUNK_SIZE
HEAD_DIM = S34.HEAD_DIM
STEP = S34.STEP
CHUNK_LOOP = S34.CHUNK_LOOP
NUM_STAGES, LOG2E, WARPGROUP = S34.NUM_STAGES, S34.LOG2E, S34.WARPGROUP
STATE_END, VALUE_END, SCORES_END, THREADS = S34.STATE_END, S34.VALUE_END, S34.SCORES_END, S34.THREADS
REGS_PRODUCER, REGS_STATE, REGS_VALUE, REGS_SCORES = (S34.REGS_PRODUCER, S34.REGS_STATE, S34.REGS_VALUE,
                                                      S34.REGS_SCORES)
DEFAULT_SHAPE = S34.DEFAULT_SHAPE


def fused_state_value_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV value columns of the
    state per CTA (32, 64 or 128); any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C = CHUNK_SIZE
    chunk_parts = stages.load(*CHUNK_LOOP).chunk_parts
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_fused_state_value(
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
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            num_seq_chunks = T.ceildiv(eos - bos, C)

            # tile stages (producer -> consumers); g holds log2(e) g_cum. v_s[b] then holds W
            # (value), ab_s[b] then holds WY (scores -> value)
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # state, value, scores
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # value
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # scores, value
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # scores
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # value: exp(g); state: exp(g_C)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # value: exp(g_C - g)
            p_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")      # scores -> output (same WG)
            # single hand-off buffers: S_c (state -> value, output), V~_c (value -> output),
            # Vd_c (value -> state)
            h_s = T.alloc_shared((K, BV), "bfloat16")
            vn_s = T.alloc_shared((C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            o_s = T.alloc_shared((C, BV), "bfloat16")                # output: O, for whole-row stores
            # registers of the state, value and scores / output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            x_f = T.alloc_fragment((C, BV), "float32")             # U, then W, V~, Vd
            gam_f = T.alloc_fragment((C, C), "float32")
            wy_f = T.alloc_fragment((C, C), "float32")            # value: WY, built over the Ab tile
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            keep = T.alloc_var("int32")                            # value: this chunk's gated flag
            # v_s and ab_s are read and written in the accumulator layout
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)       # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_STAGES)     # scores -> output (P)
            bar_state_ready = T.alloc_barrier(WARPGROUP)                     # state -> value, output
            bar_state_free = T.alloc_barrier(WARPGROUP)                      # output -> state
            bar_vd_ready = T.alloc_barrier(WARPGROUP)                        # value -> state
            bar_vn_ready = T.alloc_barrier(WARPGROUP)                        # value -> output
            bar_vn_free = T.alloc_barrier(WARPGROUP)                         # output -> value

            tx = T.get_thread_binding()
            if tx < STATE_END:  # ---- the state warpgroup
                T.set_max_nreg(REGS_STATE, 1)
                # S <- h0
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:  # the odd last chunk under an `if` (s12's chunk_parts says why)
                        for r in T.serial(reps):
                            for b in slots:
                                c = c0 + 2 * r + b
                                T.barrier_wait(bar_tiles_full[b], (c // NUM_STAGES) % 2)
                                # h_shared is free once the output warpgroup has read S_{c-1}
                                # (the value warpgroup read it before handing Vd_{c-1} over)
                                T.barrier_wait(bar_state_free, c % 2 ^ 1)
                                # S_c -> bf16, the operand of K S_c and Q S_c
                                T.copy(h_f, h_s)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_state_ready)
                                # S <- exp(g_C) S while the value warpgroup builds Vd
                                for i, j in T.Parallel(K, BV):
                                    h_f[i, j] = h_f[i, j] * eg_s[b, C - 1]
                                # S <- S + K^T Vd
                                T.barrier_wait(bar_vd_ready, c % 2)
                                T.gemm(k_s[b, :, :], vd_s, h_f, transpose_A=True)
                                T.barrier_arrive(bar_tiles_empty[b])
                T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

            elif tx >= STATE_END and tx < VALUE_END:  # ---- the value warpgroup
                T.set_max_nreg(REGS_VALUE, 1)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks):
                    if present:
                        for r in T.serial(reps):
                            for b in slots:
                                c = c0 + 2 * r + b
                                T.barrier_wait(bar_tiles_full[b], (c // NUM_STAGES) % 2)
                                # WY <- Gamma * Ab (Ab as stored for a gated chunk) on j <= i < n,
                                # 0 elsewhere (n: the chunk's tokens), over the Ab tile, built
                                # here while the state warpgroup hands S_c over (s34's scores
                                # warpgroup built it, on the kernel's critical role)
                                keep = gated[row0 + c, i_hv]
                                T.copy(ab_s[b, :, :], wy_f)
                                for i, j in T.Parallel(C, C):
                                    wy_f[i, j] = T.if_then_else(
                                        (j <= i) & (i < eos - bos - c * C),
                                        wy_f[i, j] * T.if_then_else(
                                            keep != 0, 1.0, T.exp2(T.min(g_s[b, i] - g_s[b, j], 0))), 0)
                                T.copy(wy_f, ab_s[b, :, :])
                                T.fence_proxy_async()
                                T.barrier_wait(bar_state_ready, c % 2)
                                # U <- K S_c
                                T.gemm(k_s[b, :, :], h_s, x_f, clear_accum=True)
                                # W <- V - diag(exp(g)) U, over the V tile; rows >= n are finite
                                # and meet only WY's zero columns, so V~ needs no mask
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = v_s[b, i, j] - eg_s[b, i] * x_f[i, j]
                                T.copy(x_f, v_s[b, :, :])
                                T.fence_proxy_async()
                                # V~ <- WY W
                                T.gemm(ab_s[b, :, :], v_s[b, :, :], x_f, clear_accum=True)
                                # V~_c -> vn_shared once the output has read V~_{c-1}
                                T.barrier_wait(bar_vn_free, c % 2 ^ 1)
                                T.copy(x_f, vn_s)
                                # Vd <- diag(exp(g_C - g)) V~ -> vd_shared (the state has read
                                # Vd_{c-1}: it handed S_c over after its update)
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = x_f[i, j] * egd_s[b, i]
                                T.copy(x_f, vd_s)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_vd_ready)
                                T.barrier_arrive(bar_vn_ready)
                                T.barrier_arrive(bar_tiles_empty[b])

            elif tx >= VALUE_END and tx < SCORES_END:  # ---- the scores / output warpgroup
                T.set_max_nreg(REGS_SCORES, 1)
                # step c: the first half of chunk c - 1's output, chunk c's scores, the second
                # half of chunk c - 1's output (stage s = c % 2 for the scores, 1 - s for the output)
                for c0, reps, slots, present in chunk_parts(num_seq_chunks + 1):
                    if present:
                        for r in T.serial(reps):
                            for s in slots:
                                c = c0 + 2 * r + s
                                b = 1 - s
                                t0 = bos + (c - 1) * C
                                if c >= 1:
                                    # O <- scale diag(exp g) Q S_{c-1}
                                    T.barrier_wait(bar_state_ready, (c - 1) % 2)
                                    T.gemm(q_s[b, :, :], h_s, o_f, clear_accum=True)
                                    T.barrier_arrive(bar_state_free)
                                    # the row factor scale exp(g_i): the producer's exp(g) (one
                                    # exp2 a row, not one an element)
                                    for i, j in T.Parallel(C, BV):
                                        o_f[i, j] = o_f[i, j] * (scale * eg_s[b, i])
                                    # this warpgroup is done with chunk c - 1's tiles (P_{c-1} is in
                                    # p_shared): the producer may load chunk c + 1 while the chain
                                    # still runs chunk c - 1
                                    T.barrier_arrive(bar_tiles_empty[b])
                                if c < num_seq_chunks:
                                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                                    # P <- Q K^T, issued without waiting: Gamma is built while
                                    # the tensor cores run it
                                    T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True,
                                                 clear_accum=True)
                                    # Gamma <- exp(g_i - g_j), the exponent clamped at 0 so that
                                    # the upper triangle (masked below) stays finite: no branch
                                    for i, j in T.Parallel(C, C):
                                        gam_f[i, j] = T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                                    T.wait_wgmma(0)
                                    # P's reads stay after the wait (a thread's 32 registers of P)
                                    T.warpgroup_fence_operand(p_f, num_regs=C * C // WARPGROUP)
                                    # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal
                                    for i, j in T.Parallel(C, C):
                                        p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * gam_f[i, j], 0)
                                    T.copy(p_f, p_s[s, :, :])
                                    T.fence_proxy_async()
                                    T.barrier_arrive(bar_scores_ready[s])
                                if c >= 1:
                                    # O <- O + P_{c-1} V~_{c-1} (P from every thread of this
                                    # warpgroup: its barrier)
                                    T.barrier_wait(bar_scores_ready[b], ((c - 1) // NUM_STAGES) % 2)
                                    T.barrier_wait(bar_vn_ready, (c - 1) % 2)
                                    T.gemm(p_s[b, :, :], vn_s, o_f)
                                    T.barrier_arrive(bar_vn_free)
                                    # o[t0 : t0 + n] <- O through shared memory: a whole chunk by one
                                    # TMA store, left running (its wait is the next chunk's, just
                                    # before o_shared is written again), a sequence's partial last
                                    # chunk row by row
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

            elif tx >= SCORES_END:  # ---- the producer warpgroup
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
                    # the row factors exp(g_i) and exp(g_C - g_i) (exp(g_C) is the last of the first)
                    for i in T.Parallel(C):
                        eg_s[s, i] = T.exp2(g_s[s, i])
                        egd_s[s, i] = T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_state_value


@functools.cache
def _wide(H: int, HV: int, K: int, V: int, BV: int):
    return compile_hopper(dependent_launch(fused_state_value_kernel(H, HV, K, V, BV)), S27.FUSED_CONFIGS)


def fused(H: int, HV: int, K: int, V: int, BV: int):
    """The compiled fused kernel at BV: s12's (s33's) at 16 and 32, this stage's at 64 and 128."""
    return S34.fused(H, HV, K, V, BV) if BV <= 32 else _wide(H, HV, K, V, BV)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: this stage's fused kernel at (16, 64), BV 64."""
    return _wide(**DEFAULT_SHAPE, BV=64).get_kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, *, fused=fused):
    """s34's forward on this stage's wide kernel (``cp`` None decides, False never splits, True
    splits at the rule's cheapest L, an int is the segment length in chunks)."""
    return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold,
                       fused=fused)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s35: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s35: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s35: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s35: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
