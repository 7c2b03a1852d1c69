"""gdn_fwd, stage 05: the fused kernel warp-specialized: chain, scores, output and producer roles.

What it adds over s04, the previous milestone: warp specialization. s04's fused kernel, like
s03's, runs the state chain and the output work in the same warps, one after the other. Here each
warpgroup of a 512-thread CTA has one role (chain, scores, output, producer), registers are moved
between them by setmaxnreg, and they hand work to each other through shared memory, ordered by
mbarriers, so the output of chunk c is computed while the chain already works on chunk c + 1.
Why: in s03 the output work doubled the chain's path (about 3.6 us a chunk, latency-bound; the
chain alone took 1.7). The math is s03's (w, u from the preparation stages), not s04's, so
that the one change this milestone teaches is the organization; gdn_fwd.s07 (the lab log) puts
s04's reformulated chain, U = K S, W = V - diag(exp g) U, V~ = (Gamma * Ab) W, into the block
marked "chain math", with the producer loading v and Ab instead of u and w. Per chunk of
C = 64 tokens, with S the CTA's K x 64 slice of the state (fp32, in the chain's registers):

    chain     V~ = U - W S (rows past the sequence end zeroed);
              S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~
    scores    P = scale (Q K^T * Gamma), lower triangle incl. the diagonal (needs no state)
    output    O = scale diag(exp(g)) Q S_c + P V~_c, stored straight from registers
    producer  q, k, w, u by TMA (full 64-row boxes), and log2(e) g into the stage's gate buffer

Pipeline (two tile stages, two hand-off slots; arrows are mbarrier arrivals):

    time ->   |--------- chunk c ---------|-------- chunk c+1 --------|----- chunk c+2 ---
    chain     [S_c->h_s  W S  V~  Vd  K^T Vd][S_c+1->h_s'  W S  V~ ...   ][ ...
                            `-> bar_state_ready[c%2]      `-> bar_state_ready[(c+1)%2]
    scores    [Q K^T c, mask -> p_s][Q K^T c+1 ...]          (needs no state: runs ahead)
                               `-> bar_scores_ready[c%2]
    output                      [Q S_c, scale][+ P_c V~_c, o rows][Q S_c+1 ...
                                               `-> bar_state_free, bar_scores_free[c%2]
    producer  [TMA c+1 -> stage (c+1)%2]     [TMA c+2 -> stage c%2, once chain, scores and
                                                output arrived on bar_tiles_empty[c%2]]

The consumers release a tile stage as soon as they no longer read it (the output right after
Q S_c), so chunk c + 2's loads start before the output has finished chunk c.

Shared memory (185 KB of 227) and registers (setmaxnreg moves them within the CTA's pool of
512 x 128; "used" read from the SASS):

    buffer             shape x slots        KB   written by -> read by
    q_s, k_s, w_s      64 x 128 bf16 x 2    96   producer (TMA) -> q: scores, output;
                                                 k: chain, scores; w: chain
    u_s                64 x 64 bf16 x 2     16   producer (TMA) -> chain
    g_s                64 fp32 x 2         0.5   producer -> all three
    h_s (S_c, bf16)    128 x 64 x 2         32   chain -> chain (W S), output (Q S_c)
    vn_s (V~_c)        64 x 64 x 2          16   chain -> output
    p_s (P_c)          64 x 64 x 2          16   scores -> output
    vd_s               64 x 64               8   chain -> chain (K^T Vd)

    role       threads      setmaxnreg  used   holds
    chain      [0, 128)        216      ~143   S (64 fp32 a thread), V~ and Vd (32 + 32)
    scores     [128, 256)      136       ~94   P (32)
    output     [256, 384)      136       ~56   O (32)
    producer   [384, 512)       24       ~12   addresses

TileLang 0.1.15 facts this rests on: roles are branches of ONE if / elif chain on the thread
index (three `with T.ws(i)` blocks got a __syncthreads() between them, a deadlock);
T.alloc_barrier, T.tma_copy(..., barrier=) (expect-tx and the load, one elected thread),
T.barrier_arrive / T.barrier_wait(bar, parity) and T.set_max_nreg lower as expected, and
TileLang's own syncs inside a branch are named barriers over its 128 threads; shared-memory reuse
must be off (tl.disable_shared_memory_reuse: the planner treats the branches as sequential and
gave two roles' buffers one address); wgmma operands written by another warpgroup need
T.fence_proxy_async() before the arrive. Fast math (tl.enable_fast_math) makes each exp2 one
ex2.approx instruction.

Measured effect (one H200, CUDA events, median of 20 after 3 warm-up calls, all in one run; fused
kernels alone on s03's w, u, g_cum, then whole runs; o and final state agree with s03's kernel to
1e-5 relative):

    (H, HV) tokens       s03 kernel  3 roles  3 roles, fast P   s05 kernel   s03 run  s05 run
    (16, 64) 1 x 32768   1.97 ms     1.79     1.28              1.19 (1.66x) 3.53     2.76
    (2, 8)   1 x 32768   1.90 ms     1.94     1.32              1.23 (1.55x) 2.16     1.48
    (16, 32) 8 x 4096    0.95 ms     0.92     0.66              0.62 (1.52x) 1.77     1.44

"3 roles" was the first version (chain | output | producer, 384 threads): no faster than s03.
Timing it with one role's math removed (another run, same card) showed why: chain alone 0.73 ms
at (16, 64) (1.4 us a chunk), output alone 1.64 ms. The output warpgroup's P tile compiled to 32
divergent branches a thread (exp2f's slow path inside the mask condition); clamping the exponent
at 0, masking with a select and fast math ("fast P") took 1.79 -> 1.28 ms, and giving P its own
warpgroup (this stage) 1.19 ms. A chunk now takes 2.3-2.4 us, still above the chain's 1.4.
Nsight Compute (``profiles/ncu_lab.py``, (16, 64) 1 x 8192,
``profiles/results/ncu_gdn_fwd_s05.csv``): 297 us against s03's 484, 260 TFLOP/s on the tensor
cores (busy 27 % of the time), DRAM 33 % of peak, 24.8 % achieved occupancy (one 512-thread CTA
per SM, 186 KB of shared memory), top stall long_scoreboard: still latency-bound.

Taught in: notebooks/05_warp_specialization.py.
"""

import functools

import torch

from flashqla import stages
from flashqla.hopper import HOPPER_TARGET
from flashqla.nvtx import nvtx_range
from flashqla.varlen import seq_bounds

NEEDS = ("hopper",)
# wgmma: the five products; tma_load: the q, k, w, u tiles (PTX cp.async.bulk.tensor);
# warpgroup_reg_alloc / _dealloc: the roles' register budgets (PTX setmaxnreg.inc / .dec)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
BLOCK_V = 64          # BV: value columns of the state owned by one CTA
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32, K=128, V=128)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)
# the preparation, as in s03: g -> g_cum -> A -> Ai -> w, u
PREP_STAGES = (("chunk_local_cumsum", 1), ("chunk_kkt", 2), ("kkt_solve", 1), ("chunk_w_u", 1))

# ---- warp roles, one warpgroup each (128 threads: the unit of wgmma and of setmaxnreg), in
# thread order. One if / elif chain over them: TileLang's sync pass then sees exclusive branches
# (separate `with T.ws(i)` blocks got a __syncthreads() between them: a deadlock)
WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP   # [0, 128)   chain: owns S; V~ = U - W S, S <- exp(g_C) S + K^T ..
SCORES_END = 2 * WARPGROUP  # [128, 256) scores: P = scale (Q K^T * Gamma), needs no state
OUTPUT_END = 3 * WARPGROUP  # [256, 384) output: O = scale diag(exp g) Q S_c + P V~_c
THREADS = 4 * WARPGROUP     # [384, 512) producer: TMA loads of q, k, w, u; the gates
# ---- register budgets (setmaxnreg, per thread). With 512 threads ptxas gives each 128 registers
# at launch; setmaxnreg moves them between warpgroups within that pool of 4 x 128
REGS_PRODUCER = 24    # addresses (about 12 used)
REGS_CHAIN = 216      # S (64 fp32 a thread), V~ and its decayed copy (32 + 32): about 143 used
REGS_SCORES = 136     # P (32): about 94 used
REGS_OUTPUT = 136     # O (32): about 56 used
assert REGS_PRODUCER + REGS_CHAIN + REGS_SCORES + REGS_OUTPUT <= 4 * 128
# ---- buffering
NUM_STAGES = 2        # tile stages: the producer fills chunk c + 2 once chunk c is consumed
NUM_HANDOFF = 2       # slots for S_c, V~_c and P_c: chunk c + 1's are written while the output
                      # warpgroup still reads chunk c's


def fused_h_o_kernel(H: int, HV: int, K: int, V: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V; any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C, BV = CHUNK_SIZE, BLOCK_V
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")

    @T.prim_func
    def gdn_fused_ws(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # sequence starts, then the total
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
    ):
        with T.Kernel(V // BV, HV, num_seqs, threads=THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            v0 = i_v * BV
            num_chunks = T.ceildiv(eos - bos, C)

            # tile stages (producer -> consumers); g holds log2(e) g_cum
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores, output
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain, scores
            w_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain
            u_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # chain
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # all three
            # hand-off slots: S_c (bf16) and V~_c from the chain, P_c from the scores warpgroup
            h_s = T.alloc_shared((NUM_HANDOFF, K, BV), "bfloat16")
            vn_s = T.alloc_shared((NUM_HANDOFF, C, BV), "bfloat16")
            p_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            # chain only: diag(exp(g_C - g)) V~
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            # registers of the chain, scores and output warpgroups
            h_f = T.alloc_fragment((K, BV), "float32")
            vn_f = T.alloc_fragment((C, BV), "float32")
            vd_f = T.alloc_fragment((C, BV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            # u_s is read in the accumulator layout (8 rows of 128 bytes per warp access): swizzle it
            T.annotate_layout({u_s: tilelang.layout.make_swizzled_layout(u_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)      # producer -> all
            bar_tiles_empty = T.alloc_barrier([3 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_state_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # chain -> output
            bar_state_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)     # output -> chain
            bar_scores_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)   # scores -> output
            bar_scores_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)    # output -> scores

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
                # S <- h0 (this CTA's BV columns of it)
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
                for c in T.serial(num_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    n = T.min(eos - bos - c * C, C)                # real rows of this chunk, 1..64
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_state_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # S_c (fp32 registers) -> bf16 in slot b: the operand of W S here and of Q S
                    # in the output warpgroup
                    T.copy(h_f, h_s[b, :, :])
                    # ---- chain math (s03's w, u form)
                    # V~ <- U - W S, zero rows >= n (they then add nothing to the state);
                    # V_d <- diag(exp(g_C - g)) V~, the decayed copy the state update reads
                    T.gemm(w_s[s, :, :], h_s[b, :, :], vn_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = T.if_then_else(i < n, u_s[s, i, j] - vn_f[i, j], 0)
                        vd_f[i, j] = vn_f[i, j] * T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.copy(vd_f, vd_s)
                    # ---- end of the chain math
                    # S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~, issued without waiting ...
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
                for c in T.serial(num_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_scores_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal; the exponent
                    # is clamped at 0 so that the masked upper triangle stays finite (no branch)
                    T.gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        p_f[i, j] = scale * p_f[i, j] * T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))
                        p_f[i, j] = T.if_then_else(j <= i, p_f[i, j], 0)
                    T.barrier_arrive(bar_tiles_empty[s])
                    T.copy(p_f, p_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_scores_ready[b])

            elif tx >= SCORES_END and tx < OUTPUT_END:  # ---- the output warpgroup
                T.set_max_nreg(REGS_OUTPUT, 1)
                for c in T.serial(num_chunks):
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
                for c in T.serial(num_chunks):
                    s = c % NUM_STAGES
                    t0 = bos + c * C
                    T.barrier_wait(bar_tiles_empty[s], (c // NUM_STAGES) % 2 ^ 1)
                    # full 64-row boxes; rows past the sequence end are masked by the consumers
                    T.tma_copy(q[t0:t0 + C, i_h, :], q_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(k[t0:t0 + C, i_h, :], k_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(w[t0:t0 + C, i_hv, :], w_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(u[t0:t0 + C, i_hv, v0:v0 + BV], u_s[s, :, :], barrier=bar_tiles_full[s])
                    # g <- log2(e) g_cum, rows past the end padded with the last real row, so every
                    # exponent below (g_i - g_j with i >= j, g_C - g_i) is <= 0
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_ws


@functools.cache
def _compiled(H: int, HV: int, K: int, V: int):
    import tilelang

    # no shared-memory reuse: TileLang plans it as if the role branches ran one after another
    # (it put two roles' buffers at one address); fast math: exp2 is one ex2.approx, no branch
    return tilelang.compile(fused_h_o_kernel(H, HV, K, V), target=HOPPER_TARGET,
                            pass_configs={"tl.disable_shared_memory_reuse": True,
                                          "tl.enable_fast_math": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def fused_h_o(q, k, w, u, g_cum, initial_state, cu_seqlens, scale):
    """The fused kernel alone: [B, T, ...] inputs (w, u bf16, g_cum fp32) -> (o, final state)."""
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    device = q.device
    bounds = seq_bounds(cu_seqlens, B, T, device)
    N = bounds.shape[0] - 1
    if initial_state is None:
        initial_state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device)
    if B * T:
        kernel = _compiled(H, HV, K, V)
        with nvtx_range("gdn_fwd.s05"):
            kernel(q.reshape(B * T, H, K), k.reshape(B * T, H, K), w.reshape(B * T, HV, K),
                   u.reshape(B * T, HV, V), g_cum.reshape(B * T, HV),
                   initial_state.to(torch.float32).contiguous(), bounds, scale, o, ht)
    else:
        ht.copy_(initial_state)
    return o.view(B, T, HV, V), ht


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s05: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s05: `q` must have head dim K = 128; got K = {K}")
    if V != 128:
        raise ValueError(f"gdn_fwd.s05: `v` must have head dim V = 128; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s05: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    cumsum, kkt, solve, w_u = (stages.load(op, number).run for op, number in PREP_STAGES)
    g_cum = cumsum(g, cu_seqlens, chunk_size)
    A = kkt(k, g_cum, beta, cu_seqlens, chunk_size)
    Ai = solve(A, cu_seqlens, chunk_size)
    w, u = w_u(k, v, beta, Ai, g_cum, cu_seqlens, chunk_size)
    o, ht = fused_h_o(q, k, w.contiguous(), u.contiguous(), g_cum.contiguous(), initial_state,
                      cu_seqlens, scale)
    return o, (ht if output_final_state else None)
