"""gdn_fwd, stage 38: s37 with the chain of the wide kernel (its state and value warpgroups) no
longer waiting on the scores / output warpgroup within a chunk, where the solve stores WY (BV 64).

What changed from s37: three edits to s36's wide kernel, which s37 runs at BV 64 after the solve
that stores WY = Gamma * Ab:

- the value warpgroup computes V~ = WY W as soon as W is in shared memory: it no longer waits for
  the scores warpgroup's ``bar_scores_ready``, which s36 kept so that the scores warpgroup could
  zero WY's rows past a sequence's end in its partial last chunk. The value warpgroup masks those
  rows in Vd instead (its pass over Vd already exists; a select is added): the rows of V~ there
  are finite (WY's tile rows there are the next sequence's) and meet only Vd's mask and P's zero
  columns;
- S_c and V~_c get two slots each, by chunk parity (``NUM_HANDOFF``), with a barrier pair a slot:
  the state warpgroup writes S_{c+1} while the output still reads S_c, the value warpgroup writes
  V~_{c+1} while the output still reads V~_c. In s36 each was one buffer, so the chain waited
  every chunk for the output warpgroup to read the previous one (``bar_state_free``,
  ``bar_vn_free``);
- shared memory: 24 KB more at BV 64 (S: 16 KB, V~: 8 KB), 192 KB in all.

Why: with WY stored by the solve (s36), the scores / output warpgroup builds P and O only, and the
chain (S_c -> K S_c -> W -> WY W -> Vd -> S_{c+1}, a dependent sequence of three GEMMs and three
shared-memory hand-offs) sets the pace where it has no wait on that warpgroup. s36's chain still
waited on it three times a chunk.

Measured effect: slower. Its GPU tests passed (one H100, commit 924ffec: s37's bits on four
problems, eagerly and from a CUDA graph; the gdn_fwd check against float64; the public shapes). The
forward, ``bench.time_row`` in one process (the API running s37's kernels), ms:

    problem              s34      s37      s38
    (16, 48) 1x8192     0.3747   0.3424   0.3518
    (16, 64) 1x8192     0.3884   0.3803   0.3888
    (16, 48) 1x32768    1.4615   1.3431   1.3712
    (16, 64) 1x32768    1.5430   1.4978   1.5281
    (2, 8) 8x4096       0.2091   0.1974   0.2052
    (16, 48) 1x2048     0.1063   0.0967   0.0980

1.01-1.04x s37's time. The role timeline (same commit, (16, 64) 1x8192, cycles a chunk with the
stamps' cost) says why: in s37 the value warpgroup waited on the scores / output warpgroup for 3 %
of its span (``bar_scores_ready``) and 2 % (``bar_vn_free``), the state warpgroup 3 %
(``bar_state_free``): the chain was not waiting on it. The chain itself (state -> value -> state)
sets the pace: the state warpgroup waits 54 % of its 5847 cycles for Vd, the value warpgroup spends
2242 on its own work (the copies of U, W, V~ and Vd between registers and shared memory), 927 in
wgmma and 678 at named barriers. With the stamps s38's span reads 5575 cycles a chunk, yet without
them the forward is slower: the few hundred cycles of waits it removed are within what the stamps
themselves cost, and the masked Vd pass and two-slot buffers add instructions on the chain.
gdn_fwd.s39 takes the chain's hand-offs out instead.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "tma_store", "exp2f")

S37 = stages.load("gdn_fwd", 37)        # where the solve stores WY (BV 64), its forward
S36 = S37.S36                           # the solve storing WY, the prologue; the wide kernel this one edits
S34 = S36.S34                           # the forward, its kernels elsewhere
S27 = S36.S27
CHUNK_SIZE = S36.CHUNK_SIZE
HEAD_DIM = S36.HEAD_DIM
STEP = S36.STEP
DEFAULT_SHAPE = S36.DEFAULT_SHAPE
# the wide kernel's constants (s16's)
CHUNK_LOOP = S36.CHUNK_LOOP
NUM_STAGES, LOG2E, WARPGROUP = S36.NUM_STAGES, S36.LOG2E, S36.WARPGROUP
STATE_END, VALUE_END, SCORES_END, THREADS = S36.STATE_END, S36.VALUE_END, S36.SCORES_END, S36.THREADS
REGS_PRODUCER, REGS_STATE, REGS_VALUE, REGS_SCORES = (S36.REGS_PRODUCER, S36.REGS_STATE, S36.REGS_VALUE,
                                                      S36.REGS_SCORES)
NUM_HANDOFF = 2  # slots for S_c and V~_c, by chunk parity


def fused_state_value_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV = 64 value columns of the
    state per CTA, ab holding WY (s36's solve); any token or sequence count."""
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
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # WY = Gamma * Ab, rows per token
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        gated: T.Tensor((num_chunks, HV), "int32"),            # unread: ab holds WY (s36's solve)
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
            # (value)
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # state, value, scores
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # value
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # value: WY
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # scores
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # value: exp(g); state: exp(g_C)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # value: exp(g_C - g)
            p_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")      # scores -> output (same WG)
            # hand-off slots by chunk parity: S_c (state -> value, output) and V~_c (value ->
            # output), so that the chain writes chunk c + 1's while the output still reads chunk c's;
            # one buffer for Vd_c (value -> state)
            h_s = T.alloc_shared((NUM_HANDOFF, K, BV), "bfloat16")
            vn_s = T.alloc_shared((NUM_HANDOFF, C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            o_s = T.alloc_shared((C, BV), "bfloat16")                # output: O, for whole-row stores
            # registers of the state, value and scores / output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            x_f = T.alloc_fragment((C, BV), "float32")             # U, then W, V~, Vd
            gam_f = T.alloc_fragment((C, C), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            # v_s and ab_s are read and written in the accumulator layout
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)       # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_STAGES)     # scores -> output
            bar_state_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # state -> value, output
            bar_state_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)      # output -> state
            bar_vd_ready = T.alloc_barrier(WARPGROUP)                        # value -> state
            bar_vn_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)        # value -> output
            bar_vn_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)         # output -> value

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
                                # slot b is free once the output warpgroup has read S_{c-2}
                                # (the value warpgroup read it before handing Vd_{c-2} over)
                                T.barrier_wait(bar_state_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                                # S_c -> bf16 in slot b, the operand of K S_c and Q S_c
                                T.copy(h_f, h_s[b, :, :])
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_state_ready[b])
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
                                T.barrier_wait(bar_state_ready[b], (c // NUM_HANDOFF) % 2)
                                # U <- K S_c
                                T.gemm(k_s[b, :, :], h_s[b, :, :], x_f, clear_accum=True)
                                # W <- V - diag(exp(g)) U, over the V tile; rows >= n are finite
                                # and meet only WY's zero columns
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = v_s[b, i, j] - eg_s[b, i] * x_f[i, j]
                                T.copy(x_f, v_s[b, :, :])
                                T.fence_proxy_async()
                                # V~ <- WY W, WY as the solve stored it (the tile's rows i >= n of a
                                # sequence's partial last chunk are the next sequence's: V~'s rows
                                # there are finite, and only P's zero columns and Vd's mask meet them)
                                T.gemm(ab_s[b, :, :], v_s[b, :, :], x_f, clear_accum=True)
                                # V~_c -> slot b once the output has read V~_{c-2}
                                T.barrier_wait(bar_vn_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                                T.copy(x_f, vn_s[b, :, :])
                                # Vd <- diag(exp(g_C - g)) V~ on rows i < n, 0 below -> vd_shared
                                # (the state has read Vd_{c-1}: it handed S_c over after its update)
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = T.if_then_else(i < eos - bos - c * C, x_f[i, j] * egd_s[b, i], 0)
                                T.copy(x_f, vd_s)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_vd_ready)
                                T.barrier_arrive(bar_vn_ready[b])
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
                                    T.barrier_wait(bar_state_ready[b], ((c - 1) // NUM_HANDOFF) % 2)
                                    T.gemm(q_s[b, :, :], h_s[b, :, :], o_f, clear_accum=True)
                                    T.barrier_arrive(bar_state_free[b])
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
                                    T.barrier_wait(bar_vn_ready[b], ((c - 1) // NUM_HANDOFF) % 2)
                                    T.gemm(p_s[b, :, :], vn_s[b, :, :], o_f)
                                    T.barrier_arrive(bar_vn_free[b])
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
    if BV != S37.WY_BLOCK_V:
        raise ValueError(f"gdn_fwd.s38: the wide kernel runs at BV {S37.WY_BLOCK_V} only; got {BV}")
    return compile_hopper(dependent_launch(fused_state_value_kernel(H, HV, K, V, BV)), S27.FUSED_CONFIGS)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: this stage's wide kernel at BV 64."""
    return _wide(**DEFAULT_SHAPE, BV=64).get_kernel_source()


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
        raise ValueError(f"gdn_fwd.s38: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s38: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s38: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s38: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
