"""gdn_fwd, stage 12: s10 with the state's value columns per CTA (BV) chosen per launch, 32 or 64.

What changed from s10: BV, the value columns of the state that one CTA owns, is a parameter of the
kernel builder, and ``fused_reform`` picks it per launch (``block_v``, host integers): 32 where
the launch's CTAs at BV = 32 (num_seqs x HV x V / 32, one per SM: the shared memory) still fit one
wave, 64 otherwise. Roles, barriers, register budgets, math and precision are s10's; every shape
that held BV = 64 now holds BV.

Why: the forward is behind FLA on 7 of the benchmark's 40 problems, all single sequences with few
value heads ((2, 8), (4, 16), (16, 16); commit a76066e, profiles/results/gdn_fwd.csv). There a
launch at BV = 64 has num_seqs x HV x 2 CTAs, 32 on 132 SMs for one sequence of (16, 16), and the
time is the chain's chunk count times its per-chunk latency. At BV = 32 there are twice the CTAs,
each walking the same chunks with half the columns: products of 64 x 32 instead of 64 x 64 and
half the elementwise work. FlashQLA's fused kernel chooses its BV the same way (by CTA count: 32,
64 or 128), and its own cost fit gives 2.08 us a chunk at BV 32 against 2.60 at 64 (flash_qla 0.1.3,
``fused_fwd.py``).

What the SASS shows (nvcc 13.0, sm_90a, (16, 16), nvdisasm; the chain's and output's loop bodies
hold two chunks):

    per two chunks       BV 64   BV 32
    chain instructions    1000     636     HGMMA 64x64x16 -> 64x32x16 (40 each)
    chain STSM              40      20
    output instructions    462     342
    scores instructions   1436    1432     (718 and 716 a chunk: 8 HGMMA, 32 MUFU.EX2)
    registers (launch)     128     128     no spills, no stack frame
    shared memory        194 KB  154 KB    one CTA per SM either way

The scores warpgroup's work does not depend on BV (Q K^T, Gamma, WY on 64 x 64 tiles), and it
already issues more instructions a chunk than the chain at BV = 64 (718 against 500; it runs ahead
of the chain by the two hand-off slots, so only its throughput matters). At BV = 32 it has more
than twice the chain's (716 against 318) and may set the pace: if s12 gains less than the chain's
shorter path suggests, the scores role (its stall samples at bar_wy_free / bar_scores_free) is
where to look; its Gamma (32 exp2 a thread) and masks are the same for the V / BV CTAs of a head,
which a cluster could compute once. The problems with many heads ((16, 48), (16, 64)) or several sequences keep
BV = 64: at BV = 32 their CTAs would need a second wave.

Measured effect (``python -m flashqla bench``, all 40 problems, 4 x H200, commit 7ccb1ae, CUDA-graph
replay): 1.16-1.32x s10 on the 21 problems where ``block_v`` goes narrow (the single sequences of
every layout but (16, 48) and (16, 64), and 28672 + 4096 of (2, 8), (4, 16), (16, 16)), the most
on (2, 8) and (16, 16) from 8192 tokens; 1.00-1.01x elsewhere (the same kernel). The scores
warpgroup did not set the pace enough to cancel the chain's gain. Nsight Compute at BV = 64 on
(16, 64) 1 x 8192 (``profiles/results/ncu_gdn_fwd_s12.csv``): 320 us, tensor pipe 29 % busy,
``long_scoreboard`` the top stall; FlashQLA's fused kernel there: 282 us, 32 %
(``ncu_flashqla.csv``).

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
BLOCK_V = 64          # BV: value columns of the state owned by one CTA, where the CTAs fill the SMs
NARROW_BLOCK_V = 32   # ... and where BLOCK_V would leave SMs idle (``block_v``): twice the CTAs
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


def block_v(num_seqs: int, HV: int, V: int, num_sms: int) -> int:
    """BV for a launch, host integers only: NARROW_BLOCK_V when its CTAs (num_seqs x HV x V / BV,
    one per SM: the kernel's shared memory) still fit one wave, else BLOCK_V. Twice the CTAs, each
    chain half as wide, pay only while no CTA waits for a second wave: one sequence of (16, 16),
    (16, 32), (8, 24), (8, 32), (4, 16), (2, 8) goes narrow; (16, 48), (16, 64) and 8 sequences
    of any public layout stay at BLOCK_V."""
    return NARROW_BLOCK_V if num_seqs * HV * (V // NARROW_BLOCK_V) <= num_sms else BLOCK_V


def fused_reform_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV value columns of the
    state per CTA (BLOCK_V or NARROW_BLOCK_V); any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C = CHUNK_SIZE
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
def _compiled(H: int, HV: int, K: int, V: int, BV: int):
    import tilelang

    # as in s05: no shared-memory reuse (the planner treats the role branches as sequential);
    # fast math (exp2 is one ex2.approx, no branch)
    return tilelang.compile(fused_reform_kernel(H, HV, K, V, BV), target=HOPPER_TARGET,
                            pass_configs={"tl.disable_shared_memory_reuse": True,
                                          "tl.enable_fast_math": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape, BV = BLOCK_V then NARROW_BLOCK_V
    (no GPU needed)."""
    return "".join(_compiled(**DEFAULT_SHAPE, BV=bv).get_kernel_source() for bv in (BLOCK_V, NARROW_BLOCK_V))


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
        kernel = _compiled(H, HV, K, V, block_v(N, HV, V, torch.cuda.get_device_properties(device).multi_processor_count))
        with nvtx_range("gdn_fwd.s12"):
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
        raise ValueError(f"gdn_fwd.s12: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s12: `q` must have head dim K = 128; got K = {K}")
    if V != 128:
        raise ValueError(f"gdn_fwd.s12: `v` must have head dim V = 128; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s12: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, chunk_size)
    ab, gated = stages.load("gate_free_solve", 1).solve(k, beta, g_cum, cu_seqlens)
    o, ht = fused_reform(q, k, v, ab, g_cum.contiguous(), gated, initial_state, cu_seqlens, scale)
    return o, (ht if output_final_state else None)
