"""gdn_fwd, stage 14: the chain split over a state warpgroup and a value warpgroup, so that one CTA
holds all BV = 128 value columns of a head's state.

What changed from s12: a third kernel width. s12's chain warpgroup held S (K x BV fp32) together
with U, W, V~ and Vd; at BV = 128 that is 128 + 64 + 64 registers a thread, past the 255 a thread
may have. Here the chain is two warpgroups:

    state    holds S (128 fp32 a thread) and nothing else: snapshot S_c -> bf16, S <- exp(g_C) S,
             S <- S + K^T Vd
    value    U = K S_c, W = V - diag(exp g) U, V~ = WY W, Vd = diag(exp(g_C - g)) V~ (one 64 x 128
             fragment, reused)

and the scores and output warpgroups of s12 become one, which runs the scores of chunk c + 1
between the two halves of chunk c's output (Q S_c first, P_c V~_c once the value warpgroup hands
V~_c over), so that WY_{c+1} is ready long before the value warpgroup needs it. Shared memory is
what binds at 128 columns (q, k, v and Ab stages alone are 112 KB), so the hand-offs are single
buffers where the order of the roles already makes them safe (S_c, V~_c, Vd), W is written over
its V tile and WY over its Ab tile; O goes to memory through shared memory in whole rows. The
kernel takes BV (32, 64 or 128) as s12's does; ``block_v`` picks the width whose waves of CTAs take
the fewest chunk steps, a step at each width weighed by its measured cost (``STEP``).

Why: with many sequences (8 x 4096) every public layout runs more CTAs than SMs, so the time is
the total work, and at BV = 64 the work that does not depend on BV (the scores: Q K^T, Gamma,
WY; the loads of q, k, Ab) is done twice a head. FlashQLA's fused kernel runs 128 columns a CTA
there and took 790 us on (16, 64) 8 x 4096 against our 1211 (``kernel_split.csv``, 05f6295); its
own cost fit gives a chunk step at 128 columns 1.55x one at 64 (4.03 against 2.60 us), so half as
many CTAs at 1.55x the step is 0.78x the time.

The pipeline, one chunk c (stage b = c % 2), arrows are barriers:

    producer   q, k, v, Ab tiles (TMA), g, exp(g), exp(g_C - g)          -> bar_tiles_full[b]
    state      [bar_state_free] S_c -> h_shared -> bar_state_ready;  S <- exp(g_C) S;
               [bar_vd_ready] S <- S + K^T Vd                             -> bar_tiles_empty[b]
    value      [bar_state_ready] U <- K S_c; W <- V - exp(g) U over V;
               [bar_scores_ready[b]] V~ <- WY W; [bar_vn_free] V~ -> vn_shared, Vd -> vd_shared
                                                      -> bar_vd_ready, bar_vn_ready, bar_tiles_empty[b]
    scores /   [bar_state_ready] O <- scale exp(g) Q S_c -> bar_state_free, bar_tiles_empty[b];
    output     scores of c + 1: Gamma, WY over Ab, P = scale Q K^T * Gamma -> bar_scores_ready;
               [bar_vn_ready] O <- O + P_c V~_c -> bar_vn_free; o <- O (through o_shared)

Measured effect (``profiles/kernel_width_lab.py``, 4 x H100, commit 3b59463,
``profiles/results/kernel_width.csv``; the fused kernels alone, CUDA-graph replay):

    (H, HV), N x T       s12 at 64   s14 at 128   ratio      waves of CTAs
    (16, 64) 8 x 4096     1.213 ms    0.926 ms    0.76      4 waves instead of 8
    (16, 48) 8 x 4096     0.897       0.698       0.78
    (16, 32) 8 x 4096     0.611       0.477       0.78
    (4, 16)  8 x 4096     0.310       0.248       0.80
    (16, 16) 8 x 4096     0.310       0.257       0.83
    (8, 24)  8 x 4096     0.452       0.472       1.04      2 waves instead of 3: ``block_v`` keeps 64
    (16, 64) 1 x 32768    1.163       1.845       1.59      one wave either way: a step at 128 is 1.6
                                                            of one at 64 (``STEP``)

The whole forward on (16, 64) 8 x 4096: s14 1.439 ms, the library (s13) 1.716, FlashQLA 1.251,
FLA 4.114. Where the lengths differ, the wave count misleads: on 28672 + 4096 of (16, 48) and
(16, 64) ``block_v`` picks 128 and the long sequence's CTA walks 448 chunks at the wider step
(s14 2.01 and 2.13 ms, s12 1.54 and 1.77; 1.36-1.57x the kernel time): the host cannot see the
lengths without a synchronization, so a library that takes this kernel must pick the width on the
device. At 32 and 64 this kernel is 1.00-1.08x s12's (the value warpgroup's two hand-offs on the
chain), so those widths are better left to s12's kernel.

Two things made the difference at 128, found by timing variants of the first build (commit
d33dafe, fused kernel alone, 4 x H100):

    first build: O stored from the registers (4-byte pieces)    (16, 64) 8 x 4096: 1025 us
    O through shared memory, whole 16-byte pieces of rows                            678 us
    ... and the output releases its tiles after Q S_c                                606 us

O is written by the scores / output warpgroup, which also hands S_c's shared buffer back to the
state warpgroup: a slow store delayed every next snapshot. The same change to s12's separate
output warpgroup gained nothing (1.00-1.05x s12's time, a draft at commit e6d76aa): there the store
is off the chain.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

import torch

from flashqla import stages
from flashqla.hopper import HOPPER_TARGET
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# wgmma: the products; tma_load: the q, k, v, Ab tiles; warpgroup_reg_alloc / _dealloc: the roles'
# register budgets (setmaxnreg)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")

CHUNK_LOOP = ("gdn_fwd", 12)  # the stage whose chunk loop split (chunk_parts) this one reuses
CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
WIDE_BLOCK_V = 128    # BV of this stage's kernel: all the value columns of a head (V = 128)
STEP = {32: 0.77,     # a chunk step of the fused kernel at each BV, in steps at BV = 64:
        64: 1.0,      # 32: autocp.NARROW_STEP (s12 against s10, 4 x H200, 4e37c66);
        128: 1.6}     # 128: this kernel against s12 at 64, one wave each ((16, 64) 1 x 32768:
                      # 1.59, kernel_width.csv; FlashQLA's own fit: 4.03 / 2.60 us = 1.55)
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=64, K=128, V=128)  # a Qwen3.5 GDN layer with many value heads

# ---- warp roles, one warpgroup each, in thread order
WARPGROUP = 128
STATE_END = 1 * WARPGROUP    # [0, 128)   state: owns S; its snapshot, decay and update
VALUE_END = 2 * WARPGROUP    # [128, 256) value: U = K S_c, W, V~ = WY W, Vd
SCORES_END = 3 * WARPGROUP   # [256, 384) scores and output: WY, P; O = scale exp(g) Q S_c + P V~
THREADS = 4 * WARPGROUP      # [384, 512) producer: TMA loads of q, k, v, Ab; the gates
# ---- register budgets (setmaxnreg, per thread), within the launch pool of 4 x 128
REGS_PRODUCER = 24    # addresses
REGS_STATE = 168      # S (128 fp32 a thread)
REGS_VALUE = 128      # U / W / V~ / Vd (64)
REGS_SCORES = 192     # O (64) while Gamma (32) and P (32) of the next chunk are built
assert REGS_PRODUCER + REGS_STATE + REGS_VALUE + REGS_SCORES <= 4 * 128
NUM_STAGES = 2        # tile stages: the producer fills chunk c + 2 once chunk c is consumed


def block_v(num_seqs: int, HV: int, V: int, num_sms: int) -> int:
    """BV for a launch, host integers only: of 32, 64 and 128 the one whose CTAs (num_seqs x HV x
    V / BV, one per SM) take the fewest chunk steps, waves x ``STEP``. One wave at 32 beats any
    wider launch (s12's rule); 128 wins where 64 needs enough more waves: 8 sequences of every
    public layout but (2, 8) and (8, 24), and (16, 48) and (16, 64) from 2 sequences. The waves
    assume sequences of equal length: on 28672 + 4096 the long sequence's CTA walks its chunks at
    the wider step and 128 loses (the docstring's table)."""
    def steps(bv):
        return -(-num_seqs * HV * (V // bv) // num_sms) * STEP[bv]
    return min(STEP, key=steps)


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
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            keep = T.alloc_var("int32")                            # this chunk's gated flag
            # v_s and ab_s are read and written in the accumulator layout
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)       # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_STAGES)     # scores -> value, output
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
                                T.barrier_wait(bar_state_ready, c % 2)
                                # U <- K S_c
                                T.gemm(k_s[b, :, :], h_s, x_f, clear_accum=True)
                                # W <- V - diag(exp(g)) U, over the V tile; rows >= n are finite
                                # and meet only WY's zero columns, so V~ needs no mask
                                for i, j in T.Parallel(C, BV):
                                    x_f[i, j] = v_s[b, i, j] - eg_s[b, i] * x_f[i, j]
                                T.copy(x_f, v_s[b, :, :])
                                T.fence_proxy_async()
                                # V~ <- WY W, WY from the scores warpgroup (over the Ab tile)
                                T.barrier_wait(bar_scores_ready[b], (c // NUM_STAGES) % 2)
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
                                    for i, j in T.Parallel(C, BV):
                                        o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[b, i]))
                                    # this warpgroup is done with chunk c - 1's tiles (P_{c-1} is in
                                    # p_shared): the producer may load chunk c + 1 while the chain
                                    # still runs chunk c - 1
                                    T.barrier_arrive(bar_tiles_empty[b])
                                if c < num_seq_chunks:
                                    keep = gated[row0 + c, i_hv]
                                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                                    # Gamma <- exp(g_i - g_j), the exponent clamped at 0 so that
                                    # the upper triangle (masked below) stays finite: no branch
                                    for i, j in T.Parallel(C, C):
                                        gam_f[i, j] = T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                                    # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal
                                    T.gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True,
                                           clear_accum=True)
                                    for i, j in T.Parallel(C, C):
                                        p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * gam_f[i, j], 0)
                                    T.copy(p_f, p_s[s, :, :])
                                    # WY <- Gamma * Ab (Ab as stored for a gated chunk) on
                                    # j <= i < n, 0 elsewhere (n: the chunk's tokens), built in P's
                                    # registers (Ab loaded unmasked, then selected: no branch),
                                    # then stored over the Ab tile
                                    T.copy(ab_s[s, :, :], p_f)
                                    for i, j in T.Parallel(C, C):
                                        p_f[i, j] = T.if_then_else(
                                            (j <= i) & (i < eos - bos - c * C),
                                            p_f[i, j] * T.if_then_else(keep != 0, 1.0, gam_f[i, j]), 0)
                                    T.copy(p_f, ab_s[s, :, :])
                                    T.fence_proxy_async()
                                    T.barrier_arrive(bar_scores_ready[s])
                                if c >= 1:
                                    # O <- O + P_{c-1} V~_{c-1} (P from every thread of this
                                    # warpgroup: its barrier)
                                    T.barrier_wait(bar_scores_ready[b], ((c - 1) // NUM_STAGES) % 2)
                                    T.barrier_wait(bar_vn_ready, (c - 1) % 2)
                                    T.gemm(p_s[b, :, :], vn_s, o_f)
                                    T.barrier_arrive(bar_vn_free)
                                    # o[t0 : t0 + n] <- O, the chunk's own rows only, through shared
                                    # memory: whole 16-byte pieces of rows (from the registers it
                                    # was 4-byte pieces, scattered: the kernel took 1.5x longer)
                                    T.copy(o_f, o_s)
                                    for i, j in T.Parallel(C, BV):
                                        if i < eos - t0:
                                            o[t0 + i, i_hv, v0 + j] = o_s[i, j]

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
def _compiled(H: int, HV: int, K: int, V: int, BV: int):
    import tilelang

    # as in s12: no shared-memory reuse (the planner treats the role branches as sequential);
    # fast math (exp2 is one ex2.approx, no branch)
    return tilelang.compile(fused_state_value_kernel(H, HV, K, V, BV), target=HOPPER_TARGET,
                            pass_configs={"tl.disable_shared_memory_reuse": True,
                                          "tl.enable_fast_math": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape, BV = 128 (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE, BV=WIDE_BLOCK_V).get_kernel_source()


def fused_reform(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV=None):
    """The fused kernel alone, with s12's interface: [B, T, ...] inputs -> (o [B, T, HV, V] bf16,
    final state [N, HV, K, V] fp32); BV None picks it (``block_v``)."""
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
        if BV is None:
            BV = block_v(N, HV, V, torch.cuda.get_device_properties(device).multi_processor_count)
        with nvtx_range("gdn_fwd.s14"):
            _compiled(H, HV, K, V, BV)(
                q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V),
                ab.reshape(B * T, HV, CHUNK_SIZE), g_cum.reshape(B * T, HV), gated,
                initial_state.to(torch.float32).contiguous(), bounds, first_chunk, scale, o, ht)
    else:
        ht.copy_(initial_state)
    return o.view(B, T, HV, V), ht


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE, BV=None):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final
    state); ``BV`` forces the kernel width (32, 64 or 128), None picks it."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s14: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s14: `q` must have head dim K = 128; got K = {K}")
    if V != WIDE_BLOCK_V:
        raise ValueError(f"gdn_fwd.s14: `v` must have head dim V = {WIDE_BLOCK_V}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s14: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    if BV not in (None, *STEP):
        raise ValueError(f"gdn_fwd.s14: `BV` must be None or one of {tuple(STEP)}; got {BV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, chunk_size)
    ab, gated = stages.load("gate_free_solve", 2).solve(k, beta, g_cum, cu_seqlens)
    o, ht = fused_reform(q, k, v, ab, g_cum.contiguous(), gated, initial_state, cu_seqlens, scale, BV)
    return o, (ht if output_final_state else None)
