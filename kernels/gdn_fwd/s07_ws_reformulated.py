"""gdn_fwd, stage 07: s05's warp-specialized fused kernel on s04's reformulated math.

What changed: s05 split the fused kernel into four warpgroups (chain, scores, output, producer)
but still read s03's w, u; s04 rebuilt the WY product in the kernel (preparation: cumsum + the
gate-free solve, no w, u round trip through HBM) but ran it in s03's two consumer warpgroups, where
its extra dependent product made the kernel 13-17 % slower than s03's. Here s04's math runs in
s05's roles: the preparation is chunk_local_cumsum.s01 + gate_free_solve.s01 (Ab bf16 and the
per-(chunk, value head) ``gated`` flag), the producer loads q, k, v (64 x BV) and Ab (64 x 64)
instead of w, u, and the chain's "chain math" block becomes U = K S, W = V - diag(exp g) U,
V~ = WY W. Why: the reformulation pays in the preparation, and the warp specialization is what can
hide the chain's extra product behind the output work. ``fused_reform`` (the kernel alone) has
s04's interface (v, Ab, gated in place of s05's w, u), so s06's AutoCP cannot use it as CHAIN. Per chunk of C = 64 tokens, with S the
CTA's K x 64 slice of the state (fp32, in the chain's registers):

    chain     U = K S;  W = V - diag(exp g) U (rows past the sequence end zeroed);  V~ = WY W;
              S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~
    scores    Gamma_ij = exp(g_i - g_j) on j <= i, ONE exp tile for both of:
              WY = Gamma * Ab (Ab as stored where the solve flagged the chunk ``gated``), rows < n;
              P = scale (Q K^T * Gamma), lower triangle incl. the diagonal (needs no state)
    output    O = scale diag(exp(g)) Q S_c + P V~_c, stored straight from registers
    producer  q, k, v, Ab by TMA (full 64-row boxes), and log2(e) g into the stage's gate buffer

WY is built in the scores warpgroup, not in the chain, and handed over through its own slots and
barrier pair (bar_wy_ready / bar_wy_free). Why: WY needs no state, only g, Ab and the flag, and the
scores warpgroup already builds the Gamma tile for P and runs ahead of the chain; built there, the
64 x 64 exp tile and its select are off the chain, whose per-chunk path is then three products
(K S, WY W, K^T Vd) and two elementwise passes, the same elementwise work as s05's chain plus one
product. The price is 16 KB of shared memory (two WY slots) and one barrier wait in the chain,
which finds WY ready unless the scores warpgroup falls behind.

Pipeline (two tile stages, two hand-off slots; arrows are mbarrier arrivals):

    time ->   |------------ chunk c ------------|----------- chunk c+1 ----------|---
    chain     [S_c->h_s  K S  W  (wait WY) WY W  Vd  K^T Vd][S_c+1->h_s'  K S ...
                                     `-> bar_wy_free[c%2]  `-> bar_state_ready[c%2]
    scores    [Gamma, WY c -> wy_s][Q K^T c, P -> p_s][Gamma, WY c+1 ...]   (runs ahead)
                       `-> bar_wy_ready[c%2]  `-> bar_scores_ready[c%2]
    output                               [Q S_c, scale][+ P_c V~_c, o rows][Q S_c+1 ...
                                          `-> bar_state_free, bar_scores_free[c%2]
    producer  [TMA c+1 -> stage (c+1)%2]  [TMA c+2 -> stage c%2, once chain, scores and
                                           output arrived on bar_tiles_empty[c%2]]

Shared memory (193 KB of 227: 192.5 in the buffers below, g_s padded to 1 KB, ends at byte 197632
of the generated code; s05: 185) and registers (setmaxnreg budgets, per thread, within the CTA's
pool of 512 x 128; s05's: the chain holds as many fragment registers as there, the scores
warpgroup 32 more (Gamma) within its 136; ptxas, nvcc 13.0 on the CPU machine: no spills, no
stack frame; per-role use not yet read from the SASS):

    buffer             shape x slots        KB   written by -> read by
    q_s, k_s           64 x 128 bf16 x 2    64   producer (TMA) -> q: scores, output;
                                                 k: chain, scores
    v_s                64 x 64 bf16 x 2     16   producer (TMA) -> chain
    ab_s               64 x 64 bf16 x 2     16   producer (TMA) -> scores
    g_s                64 fp32 x 2         0.5   producer -> all three
    h_s (S_c, bf16)    128 x 64 x 2         32   chain -> chain (K S), output (Q S_c)
    wy_s (WY_c)        64 x 64 x 2          16   scores -> chain (WY W)
    vn_s (V~_c)        64 x 64 x 2          16   chain -> output
    p_s (P_c)          64 x 64 x 2          16   scores -> output
    w_s, vd_s          64 x 64 each         16   chain -> chain (WY W, K^T Vd)

    role       threads      setmaxnreg  holds
    chain      [0, 128)        216      S (64 fp32 a thread), U / W / Vd (32), V~ (32)
    scores     [128, 256)      136      P (32), Gamma (32)
    output     [256, 384)      136      O (32)
    producer   [384, 512)       24      addresses

TileLang 0.1.15 facts this rests on (s05's): the roles are branches of ONE if / elif chain on the
thread index; shared-memory reuse off (tl.disable_shared_memory_reuse); fast math
(tl.enable_fast_math: exp2 is one ex2.approx); T.fence_proxy_async() before arriving on a tile that
another warpgroup's wgmma reads (h_s, wy_s, vn_s, p_s).

Precision: s04's (the same products in the same precisions; WY rounded to bf16 for the wgmma).

Measured effect (``python -m flashqla bench``, 4 x H200, one process per GPU, commits e212655 and
ffe07cf, CUDA-graph replay; rows in profiles/results/gdn_fwd.csv): over the 30 problems of six head
configurations, 1.03-1.40x s05 and 1.16-1.49x s04 (the fastest stage on all 30): s04's cheaper
preparation and s05's overlap add up. On (16, 64) 1 x 32768: 2.049 ms against s05 2.870, s04 2.799,
FLA 3.963 and FlashQLA 1.522, 4.3x the floor (0.74x FlashQLA). Against the peers: 0.45-1.93x FLA
(geomean 1.12x; behind on the 1 x 2048 problems and the few-head ones, where the preparation's
launches and the chain's per-chunk latency are not amortized), 0.33-1.11x FlashQLA (geomean
0.55x; ahead only on (16, 48) 28672+4096). GPU tests: 24 of 24 public problems (H200).

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
    def gdn_fused_ws_reform(
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
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # all three
            # hand-off slots: S_c (bf16) and V~_c from the chain, WY_c and P_c from the scores
            h_s = T.alloc_shared((NUM_HANDOFF, K, BV), "bfloat16")
            wy_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")
            vn_s = T.alloc_shared((NUM_HANDOFF, C, BV), "bfloat16")
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
                for c in T.serial(num_seq_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    n = T.min(eos - bos - c * C, C)                # real rows of this chunk, 1..64
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_state_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # S_c (fp32 registers) -> bf16 in slot b: the operand of K S here and of Q S
                    # in the output warpgroup
                    T.copy(h_f, h_s[b, :, :])
                    # U <- K S
                    T.gemm(k_s[s, :, :], h_s[b, :, :], x_f, clear_accum=True)
                    # W <- V - diag(exp(g)) U, rows >= n zero (their V~ rows are then zero too)
                    for i, j in T.Parallel(C, BV):
                        x_f[i, j] = T.if_then_else(
                            i < n, v_s[s, i, j] - T.exp2(g_s[s, i]) * x_f[i, j], 0)
                    T.copy(x_f, w_s)
                    # V~ <- WY W, WY from the scores warpgroup; its slot is free once this returns
                    T.barrier_wait(bar_wy_ready[b], (c // NUM_HANDOFF) % 2)
                    T.gemm(wy_s[b, :, :], w_s, vn_f, clear_accum=True)
                    T.barrier_arrive(bar_wy_free[b])
                    # V_d <- diag(exp(g_C - g)) V~, the decayed copy the state update reads
                    for i, j in T.Parallel(C, BV):
                        x_f[i, j] = vn_f[i, j] * T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.copy(x_f, vd_s)
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
                    # exponent (g_i - g_j with i >= j, g_C - g_i, g_i, g_C) is <= 0
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[T.min(t0 + i, eos - 1), i_hv] * LOG2E
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_fused_ws_reform


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
        with nvtx_range("gdn_fwd.s07"):
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
        raise ValueError(f"gdn_fwd.s07: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s07: `q` must have head dim K = 128; got K = {K}")
    if V != 128:
        raise ValueError(f"gdn_fwd.s07: `v` must have head dim V = 128; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s07: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, chunk_size)
    ab, gated = stages.load("gate_free_solve", 1).solve(k, beta, g_cum, cu_seqlens)
    o, ht = fused_reform(q, k, v, ab, g_cum.contiguous(), gated, initial_state, cu_seqlens, scale)
    return o, (ht if output_final_state else None)
