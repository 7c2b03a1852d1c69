"""The forward that ``flashqla.chunk_gated_delta_rule`` runs on SM90: TileLang kernels, each a copy
of the stage it was promoted from (``tests/test_promoted.py``: the same program, compiled with the
same options, the same bits; the book's Lab log tells how each came to be). C = 64 tokens a chunk,
K = V = 128. ``forward`` launches, in order, each kernel a programmatic dependent of the one before
it and in an NVTX range ``fwd.<name>``:

  gate_free_solve_with_cumsum  k, beta, g, seqs -> g_cum, chunks, first_chunk, Ab, gated: the two
                               kernels below in one, where a solve CTA holds one or two value heads
  chunk_local_cumsum           g, seqs -> g_cum (the chunk-local prefix sum of g) and the chunk
                               table; each CTA finds its chunk row from the sequence bounds
  gate_free_solve              k, beta, g_cum -> Ab = (I + StrictLower(diag(beta) K K^T))^-1
                               diag(beta), or WY = Gamma * Ab (``store_wy``); a (chunk, head) with
                               some beta ||k||^2 > GROWTH_LIMIT solves the gated matrix (``gated``)
  autocp_windows               per (segment, value head): where its warm-up window starts, or exact
  autocp_warmup                Z = the chain over the window from S = 0; M = from S = I with v = 0
  autocp_chain                 each segment's initial state h_j = Z_j + M_j h_{j-1}
  chunk_h_o                    q, k, v, Ab, g_cum, h0 -> o, final state. Per chunk: U = K S,
                               W = V - diag(exp g) U, V~ = WY W, P = scale (Q K^T * Gamma),
                               O = scale diag(exp g) Q S + P V~,
                               S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~

The solve: THREADS = 128, one CTA per (chunk, ``solve_heads`` value heads of a key head), K K^T once
on wgmma, the 16 x 16 diagonal blocks by substitution (phase A), the block levels as mma.sync tf32
products (phase B; fp32 for a flagged head); 128 registers at MIN_CTAS_PER_SM (37 KB of shared
memory at four heads), with the cumsum at SOLVE_CTAS_PER_SM (80 and 96 registers, 22.6 and 35.5 KB
at one and two heads; Nsight Compute, ``profiles/results/ncu_targets.csv``). A CTA takes
``cta_heads``; where that is three or four and leaves fewer than SOLVE_WAVE_CTAS_PER_SM CTAs an SM,
two (or one).

chunk_h_o is one of three warp-specialized kernels of 4 x WARPGROUP = 512 threads: roles by thread
range, registers moved by setmaxnreg, tiles by TMA in NUM_STAGES stages, hand-offs in NUM_HANDOFF
slots, mbarriers named below. Shared memory as allocated (Nsight Compute counts 1.5 KB more):

  fused_reform_kernel            chain [0, CHAIN_END) REGS_CHAIN: S, U, W, V~, the update; scores
   BV 16, 32: 133.5, 153.5 KiB   [.., SCORES_END) REGS_SCORES: WY, P; output [.., OUTPUT_END)
                                 REGS_OUTPUT: O, stored from registers; producer [.., FUSED_THREADS)
                                 REGS_PRODUCER: q, k, v, Ab, exp(g). bar_tiles_full/empty,
                                 bar_wy_ready/free, bar_state_ready/free, bar_scores_ready/free
  fused_state_value_kernel       state [0, WIDE_STATE_END) REGS_WIDE_STATE: S, its update; value
   BV 64, 128: 153.5, 209.5 KiB  [.., WIDE_VALUE_END) REGS_WIDE_VALUE: U, W, V~, Vd; scores and
                                 output [.., WIDE_SCORES_END) REGS_WIDE_SCORES: WY, P, O by TMA
                                 store; producer. bar_tiles_full/empty, bar_scores_ready,
                                 bar_state_ready/free, bar_vd_ready, bar_vn_ready/free
  fused_state_in_registers_kernel  chain REGS_CHAIN: S^T in registers, U^T = S^T K^T, V~^T =
   BV 64, ab = WY: 169.5 KiB     V^T WY^T - (U^T D) WY^T, S^T <- exp(g_C) S^T + Vd^T K; scores: P;
                                 output: O by TMA store; producer. bar_tiles_full/empty,
                                 bar_state_ready/free, bar_vn_ready/free, bar_scores_ready/free

The warm-up kernel, WARMUP_THREADS = 384: chain [0, WARMUP_CHAIN_END) REGS_WARMUP_CHAIN (S^T in
registers; U^T = S^T K^T, S^T <- exp(g_C) S^T + V^T XB - U^T XA), x [.., WARMUP_X_END) REGS_WARMUP_X
(X = Ab^T K, XA, XB, a chunk ahead), producer REGS_WARMUP_PRODUCER; bar_tiles_full/empty,
bar_x_ready/free; 129 KiB. The chain kernel: CHAIN_COLUMNS state columns a CTA; M_{j+1} (read only
for a head with an exact slot) loads while M_j multiplies, CHAIN_STAGES buffers of 64 KiB.

Which kernels run. The width BV (``block_v``) is the one of the fewest chunk steps, STEP[BV] x the
largest of the longest sequence, CTA-chunks / SMs and waves x the shortest sequence. The solve
stores WY, and fused_state_in_registers_kernel runs, at BV = WY_BLOCK_V after a solve of three or
four heads a CTA, unsplit. AutoCP (``segment_chunks``, ``split_plan``) splits where a split costs
fewer chunk steps than the unsplit launch, STEP[BV] (or WY_STEP) x the longest sequence's chunks. It
weighs the lengths L of SEGMENT_LADDER up to a third of the longest sequence, and L0 and 2 L0 (L0:
the shortest at which 2 HV CTAs a segment fit PHASE3_CTAS_PER_SM an SM), each at WAVE_CHUNK_STEPS L
waves + SEGMENT_STEPS J + FIXED_STEPS (J: the longest sequence's segments); the fused kernel then
walks the segments, its BV chosen for equal lengths. The lengths come from one host read of
``cu_seqlens`` a tensor (``flashqla.varlen.host_bounds``); inside a CUDA-graph capture with none
before it, the width assumes equal lengths, the rule one sequence of all the tokens, and the plan is
built on the device.
"""

import functools
import threading

import torch

from flashqla import autocp
from flashqla.caches import cache_once
from flashqla.hopper import compile_hopper, dependent_launch, min_ctas_per_sm
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds, num_chunk_rows, seq_bounds

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
HEAD_DIM = 128        # K = V: the only head dims the kernels take
THREADS = 128         # one warpgroup (gate_free_solve)
GROWTH_LIMIT = 2.0    # gate_free_solve: beta ||k||^2 <= 2  <=>  ||I - beta k k^T|| <= 1: A_r cannot grow
BLOCK_V = 64          # BV: value columns of the state owned by one CTA of the fused kernel, where
                      # the CTAs fill the SMs
NARROW_BLOCK_V = 32   # ... and where BLOCK_V would leave SMs idle (``block_v``): twice the CTAs
NARROWEST_BLOCK_V = 16  # ... and where one wave holds four times the CTAs (gdn_fwd.s33)
BLOCK = 64            # state columns per CTA of the warm-up kernel
WINDOW_THREADS = 256  # the windows kernel: a token of the previous segment a thread ...
UNROLL = 4            # ... four at once
MAX_WINDOW = autocp.MAX_WARMUP_CHUNKS  # chunks a window may take before the head runs exactly
CHAIN_COLUMNS = 8     # AutoCP's phase 2 (gdn_fwd.s21's tiles): state columns per CTA, V / 8 per (sequence, head)
CHAIN_THREADS = 256   # ... 4 state elements a thread (TileLang adds a producer warpgroup)
CHAIN_STAGES = 2      # ... M_j buffers: M_{j+1} loads while M_j multiplies
SEGMENT_LADDER = (8, 16, 24, 32, 48, 64, 96)  # AutoCP's rule (``segment_chunks``, gdn_fwd.s25's form at
PHASE3_CTAS_PER_SM = 2                 # s44's costs): the lengths it weighs besides L0 and 2 L0; phase
WAVE_CHUNK_STEPS = 1.85                # 3's BV 64 CTAs an SM in a wave; a split's cost in chunk steps at
SEGMENT_STEPS = 4.8                    # BV 64: per chunk of a segment and wave of phase 3, per segment
FIXED_STEPS = 16                       # of the longest sequence, once
WY_STEP = 0.75                         # ... and a chunk step of the unsplit launch where it stores WY
SOLVE_BLOCK = 16      # gate_free_solve: the inverse's 16 x 16 blocks; a warp walks one block column
MAX_HEADS_PER_CTA = 4 # gate_free_solve: value heads a CTA solves (of one key head)
MIN_CTAS_PER_SM = 4   # gate_free_solve: __launch_bounds__(128, 4), 128 registers a thread, no spills
KKT_STRIDE = 72       # gate_free_solve.s15: K K^T's rows padded by 8 floats (mma B loads: at most 2-way bank conflicts)
SOLVE_TF32_MAX_HEADS = 2  # gate_free_solve.s09: s08's kernel where a CTA holds at most this many heads
SOLVE_CTAS_PER_SM = {1: 6, 2: 5}  # gate_free_solve.s14: its __launch_bounds__(128, n) at 1 or 2 heads a CTA
WY_BLOCK_V = 64           # gdn_fwd.s37: the width at which the solve stores WY (unsplit, three or four heads a CTA),
                          # and gdn_fwd.s40's kernel runs (S^T's rows: one wgmma M tile)
SOLVE_WAVE_CTAS_PER_SM = 3  # gate_free_solve.s11: CTAs an SM that three or four heads a CTA must leave
CUMSUM_SEGMENTS = 8       # chunk_local_cumsum.s02's and s03's: threads a head, each scanning 64 / 8 tokens
LOG2E = 1.4426950408889634
# ---- the fused kernel's warp roles, one warpgroup each (128 threads: the unit of wgmma and of
# setmaxnreg), in thread order, as one if / elif chain (separate `with T.ws(i)` blocks deadlock)
WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP   # [0, 128)   chain: owns S; U = K S, W, V~ = WY W, the state update
SCORES_END = 2 * WARPGROUP  # [128, 256) scores: WY = Gamma * Ab and P = scale (Q K^T * Gamma)
OUTPUT_END = 3 * WARPGROUP  # [256, 384) output: O = scale diag(exp g) Q S_c + P V~_c
FUSED_THREADS = 4 * WARPGROUP  # [384, 512) producer: TMA loads of q, k, v, Ab; the gates (s10's THREADS)
# ---- its register budgets (setmaxnreg, per thread), within the launch's pool of 4 x 128
REGS_PRODUCER = 24    # addresses
REGS_CHAIN = 216      # S (64 fp32 a thread), U / W / Vd (32), V~ (32)
REGS_SCORES = 136     # P (32), Gamma (32)
REGS_OUTPUT = 136     # O (32)
assert REGS_PRODUCER + REGS_CHAIN + REGS_SCORES + REGS_OUTPUT <= 4 * 128
# ---- its buffering
NUM_STAGES = 2        # tile stages: the producer fills chunk c + 2 once chunk c is consumed
NUM_HANDOFF = 2       # slots for S_c, WY_c, V~_c and P_c: chunk c + 1's are written while
                      # chunk c's are still read
HANDOFF_SLOTS = (0, 1)  # the chain and output unroll their chunk loop over them
assert NUM_STAGES == NUM_HANDOFF == len(HANDOFF_SLOTS)  # chunk c's stage is its slot, c % 2
# ---- gdn_fwd.s16's fused kernel at BV = 64 and 128: roles, one warpgroup each, in thread order
# (s16's names, prefixed WIDE_); its producer's budget is REGS_PRODUCER, its tile stages NUM_STAGES
WIDE_BLOCK_V = 128               # all the value columns of a head
WIDE_STATE_END = 1 * WARPGROUP   # [0, 128)   state: owns S; its snapshot, decay and update
WIDE_VALUE_END = 2 * WARPGROUP   # [128, 256) value: U = K S_c, W, V~ = WY W, Vd
WIDE_SCORES_END = 3 * WARPGROUP  # [256, 384) scores and output: WY, P; O = scale exp(g) Q S_c + P V~
WIDE_THREADS = 4 * WARPGROUP     # [384, 512) producer: TMA loads of q, k, v, Ab; the gates
REGS_WIDE_STATE = 168            # S (128 fp32 a thread)
REGS_WIDE_VALUE = 128            # U / W / V~ / Vd (64)
REGS_WIDE_SCORES = 192           # O (64) while Gamma (32) and P (32) of the next chunk are built
assert REGS_PRODUCER + REGS_WIDE_STATE + REGS_WIDE_VALUE + REGS_WIDE_SCORES <= 4 * 128
# ---- gdn_fwd.s44's warm-up kernel (AutoCP's phase 1): roles, one warpgroup each, in thread order
# (s44's names, prefixed WARMUP_); its stages NUM_STAGES, its XA / XB slots NUM_HANDOFF
WARMUP_CHAIN_END = 1 * WARPGROUP  # [0, 128)   chain: owns S^T; U^T = S^T K^T, S^T += V^T XB - U^T XA
WARMUP_X_END = 2 * WARPGROUP      # [128, 256) x: X = Ab^T K, XA and XB, a chunk ahead
WARMUP_THREADS = 3 * WARPGROUP    # [256, 384) producer: TMA loads of k, v, Ab; the gates
REGS_WARMUP_CHAIN = 232           # S^T (64 fp32 a thread), its bf16 copy (32), U^T (32), -U^T bf16 (16)
REGS_WARMUP_X = 168               # X (64 fp32 a thread), XA or XB in bf16 (32): the launch's own
REGS_WARMUP_PRODUCER = 40         # addresses, the gates
assert REGS_WARMUP_CHAIN + REGS_WARMUP_X + REGS_WARMUP_PRODUCER <= 65536 // WARPGROUP
STEP = {NARROWEST_BLOCK_V: 0.74,  # a chunk step of the fused kernel at each BV, in steps at BV = 64
        NARROW_BLOCK_V: 0.85,     # (gdn_fwd.s17's: s12 at 32 and s16 at 128 against s16 at 64, one
        BLOCK_V: 1.0,             # wave each, 4 x H100, kernel_width.csv; s33's: s12 at 16 against
        WIDE_BLOCK_V: 1.37}       # 32, one wave each, one H100)


# ---- promoted from kernels/chunk_local_cumsum/s03_table_in_the_scan.py
def chunk_local_cumsum_kernel(HV: int):
    """The T.prim_func for HV value heads; any token, sequence or row count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, P = CHUNK_SIZE, CUMSUM_SEGMENTS
    L = BT // P                                # tokens a segment
    threads = 32 * -(-(HV * P) // 32)          # whole warps
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def chunk_local_cumsum_table(
        g: T.Tensor((num_tokens, HV), "float32"),              # [B*T, HV], sequences packed
        bounds: T.Tensor((num_bounds,), "int32"),              # [N + 1]: where each sequence starts
        g_cum: T.Tensor((num_tokens, HV), "float32"),
        table: T.Tensor((num_rows, 2), "int32"),               # out: [start, end) of every chunk
        first_chunk: T.Tensor((num_bounds,), "int32"),         # out: each sequence's first row
    ):
        with T.Kernel(num_rows, threads=threads) as i_c:
            tid = T.get_thread_binding()
            h = tid % HV                                       # this thread's value head
            j = tid // HV                                      # its segment; >= P on padding threads
            n_seqs = num_bounds - 1
            per = T.ceildiv(n_seqs, threads)                   # sequences [tid per, (tid + 1) per) are tid's
            scan_s = T.alloc_shared((threads,), "int32")
            row_s = T.alloc_shared((2,), "int32")              # this CTA's chunk: [start, end)
            mine = T.alloc_local((1,), "int32")
            step = T.alloc_local((1,), "int32")
            x = T.alloc_local((L,), "float32")
            totals = T.alloc_shared((HV * P,), "float32")      # t_j,h at h P + j
            t = T.alloc_local((P,), "float32")                 # t_0,h .. t_{P-1},h
            off = T.alloc_var("float32")
            # row_s <- [T, T): a row past the real chunks, unless a thread finds it below
            if tid == 0:
                row_s[0] = num_tokens
                row_s[1] = num_tokens
            # mine <- the chunks of this thread's sequences, ceil(length / C) each
            mine[0] = 0
            for i in T.serial(per):
                if tid * per + i < n_seqs:
                    mine[0] = mine[0] + T.ceildiv(bounds[tid * per + i + 1] - bounds[tid * per + i], BT)
            # scan_s <- inclusive prefix sums of mine over the threads (Hillis-Steele)
            scan_s[tid] = mine[0]
            for d in [1 << e for e in range((threads - 1).bit_length())]:  # a Python loop: unrolled
                T.sync_threads()
                step[0] = scan_s[tid] + T.if_then_else(tid >= d, scan_s[T.max(tid - d, 0)], 0)
                T.sync_threads()
                scan_s[tid] = step[0]
            T.sync_threads()
            # walk this thread's sequences from the chunks before them: CTA 0 writes first_chunk;
            # the sequence holding row i_c gives row_s its chunk, clipped to the sequence's end
            mine[0] = scan_s[tid] - mine[0]
            for i in T.serial(per):
                if tid * per + i < n_seqs:
                    step[0] = T.ceildiv(bounds[tid * per + i + 1] - bounds[tid * per + i], BT)
                    if i_c == 0:
                        first_chunk[tid * per + i] = mine[0]
                    if mine[0] <= i_c and i_c < mine[0] + step[0]:
                        row_s[0] = bounds[tid * per + i] + (i_c - mine[0]) * BT
                        row_s[1] = T.min(bounds[tid * per + i] + (i_c - mine[0] + 1) * BT,
                                         bounds[tid * per + i + 1])
                    mine[0] = mine[0] + step[0]
            if i_c == 0 and tid == threads - 1:
                first_chunk[n_seqs] = scan_s[threads - 1]
            T.sync_threads()
            bos = row_s[0]
            n = row_s[1] - bos                                 # chunk length, 0..64
            if tid == 0:
                table[i_c, 0] = bos
                table[i_c, 1] = row_s[1]
            # from here s02's scan: x_r <- g[bos + j L + r, h], zero past the chunk's end
            for r in T.unroll(L):
                x[r] = 0.0
                if j * L + r < n:
                    x[r] = g[bos + j * L + r, h]
            # x_r <- x_0 + ... + x_r: the prefix within the segment; x_{L-1} is its total
            for r in T.unroll(1, L):
                x[r] = x[r] + x[r - 1]
            if tid < P * HV:
                totals[h * P + j] = x[L - 1]
            T.sync_threads()
            # off = t_0,h + ... + t_{j-1},h: what the chunk's earlier segments add up to
            for jj in T.vectorized(P):
                t[jj] = totals[h * P + jj]
            off = 0.0
            for jj in T.unroll(P - 1):
                if jj < j:
                    off = off + t[jj]
            for r in T.unroll(L):
                if j * L + r < n:
                    g_cum[bos + j * L + r, h] = off + x[r]

    return chunk_local_cumsum_table


# ---- promoted from kernels/gate_free_solve/s06_balanced_columns.py (the grouping of heads, A's entries,
# phase A and the flagged heads' phase B) and s15_levels_on_mma.py (the unflagged heads' phase B on
# mma.sync, ``phase_b_on_mma``, and the kernel, BLOCK renamed SOLVE_BLOCK); both solves run them
def cta_heads(H: int, HV: int) -> int:
    """The largest divisor of HV / H up to MAX_HEADS_PER_CTA: the value heads sharing one K K^T."""
    group = HV // H
    return max(r for r in range(1, MAX_HEADS_PER_CTA + 1) if group % r == 0)


def solve_heads(H: int, HV: int, num_chunks: int, num_sms: int) -> int:
    """Value heads a solve CTA holds (gate_free_solve.s11): ``cta_heads``; where that is three or four
    and num_chunks x HV / it are fewer than SOLVE_WAVE_CTAS_PER_SM CTAs an SM, two (s08's kernel),
    or one where two do not divide it."""
    R = cta_heads(H, HV)
    if R > SOLVE_TF32_MAX_HEADS and num_chunks * HV < R * SOLVE_WAVE_CTAS_PER_SM * num_sms:
        return SOLVE_TF32_MAX_HEADS if R % SOLVE_TF32_MAX_HEADS == 0 else 1
    return R


def a_elem(kkt_s, g_s, r, i, l, n, gate):
    """Both solves' A entry (i, l) without beta: K K^T, or for a flagged head K K^T * Gamma below
    the diagonal of the chunk's real rows and 0 elsewhere (where exp2 of g_i - g_l could overflow)."""
    import tilelang.language as T  # imported here: importing flashqla must not pull in TileLang

    if gate:
        return T.if_then_else((l < i) & (i < n), kkt_s[i, l] * T.exp2(g_s[r, i] - g_s[r, l]), 0)
    return kkt_s[i, l]


def solve_phases(T, x_at):
    """Phase A and phase B of both solves (s06's and s08's), as TileLang macros: ``x_at(r, b, half,
    q, j)`` are the indices in X's shared buffer of row 8 half + q, column j of head r's diagonal
    block b (s06 keeps the diagonal blocks' rows, s08 two 32 x 32 halves a head)."""
    NB = CHUNK_SIZE // SOLVE_BLOCK

    @T.macro
    def phase_a(kkt_s, g_s, beta_s, x_s, x_a, acc, row, jb, c, half, n, r0, nr, gate):
        # X_jj <- (I + A_jj)^-1 e_c for heads r0 .. r0 + nr - 1 at once (independent chains): forward
        # substitution over the block's 16 rows, x_i = [i == c] - beta_i sum_{l < i} a_il x_l
        # (unknown x_l are still 0); half h sums l in 8h .. 8h + 7, one shuffle adds the other half
        for s in T.unroll(nr * 8):
            x_a[s] = 0.0
        for i in T.unroll(SOLVE_BLOCK):
            for u in T.unroll(nr):
                acc[2 * u] = 0.0
                acc[2 * u + 1] = 0.0
                for q in T.unroll(8):
                    acc[2 * u + q % 2] = acc[2 * u + q % 2] + a_elem(
                        kkt_s, g_s, r0 + u, SOLVE_BLOCK * jb + i, SOLVE_BLOCK * jb + 8 * half + q, n, gate) * x_a[8 * u + q]
            for u in T.unroll(nr):
                row[u] = acc[2 * u] + acc[2 * u + 1]
                row[u] = T.if_then_else(i == c, 1.0, 0.0) - beta_s[r0 + u, SOLVE_BLOCK * jb + i] * (
                    row[u] + T.shfl_xor(row[u], 16))
                if i // 8 == half:
                    x_a[8 * u + i % 8] = row[u]
        for u in T.unroll(nr):
            for q in T.unroll(8):
                x_s[x_at(r0 + u, jb, half, q, c)] = x_a[8 * u + q]

    @T.macro
    def phase_b(kkt_s, g_s, beta_s, x_s, x_col, t_col, acc, row, jb, c, half, n, r, gate):
        # X_jj's column c (phase A's, from shared: another warp may have solved it)
        for q in T.unroll(8):
            x_col[q] = x_s[x_at(r, jb, half, q, c)]
        # level d, block row i = j + d of block column j: t <- diag(beta) sum_{e < d} A_{i, j+e}
        # X_{j+e, j}[:, c] (16 independent row sums), then X_ij[:, c] <- -X_ii t
        for d in T.unroll(1, NB):
            if jb + d < NB:
                for i in T.unroll(SOLVE_BLOCK):
                    acc[0] = 0.0
                    acc[1] = 0.0
                    for e in T.unroll(d):
                        for q in T.unroll(8):
                            acc[q % 2] = acc[q % 2] + a_elem(
                                kkt_s, g_s, r, SOLVE_BLOCK * (jb + d) + i, SOLVE_BLOCK * (jb + e) + 8 * half + q, n,
                                gate) * x_col[8 * e + q]
                    row[0] = acc[0] + acc[1]
                    t_col[i] = beta_s[r, SOLVE_BLOCK * (jb + d) + i] * (row[0] + T.shfl_xor(row[0], 16))
                for q in T.unroll(8):
                    acc[0] = 0.0
                    acc[1] = 0.0
                    for s in T.unroll(SOLVE_BLOCK):
                        acc[s % 2] = acc[s % 2] + x_s[x_at(r, jb + d, half, q, s)] * t_col[s]
                    x_col[8 * d + q] = -(acc[0] + acc[1])

    return phase_a, phase_b


def tf32(T, x):
    """x rounded to the nearest tf32 (10 mantissa bits; the low 13 bits then cleared)."""
    return T.reinterpret((T.reinterpret(x, "uint32") + T.uint32(0x1000)) & T.uint32(0xFFFFE000), "float32")


def phase_b_on_mma(T, store_wy: bool):
    """Phase B of an unflagged head as a TileLang macro: warp by warp, the block column jb of head r
    walked down on mma.sync (gate_free_solve.s15's module doc), then Ab's column block stored (or WY if
    ``store_wy``)."""
    NB = CHUNK_SIZE // SOLVE_BLOCK

    @T.macro
    def mma(a_frag, a_at, b_frag, acc, acc_at):
        # acc[acc_at : +4] += A (16 x 8, a_frag[a_at : +4]) B (8 x 8, b_frag[0:2]), tf32 in, fp32 out
        T.ptx_mma("float32", "m16n8k8", "row", "col", "tf32", "tf32", "fp32",
                  a_frag.data, a_at, b_frag.data, 0, acc.data, acc_at, T.bool(False))

    def wy_gate(g_s, r, i, l):
        # WY's gate for Ab entry (i, l): exp(g_i - g_l), the exponent clamped at 0 (zeros above the
        # diagonal stay finite)
        return T.exp2(T.min(g_s[r, i] - g_s[r, l], 0)) if store_wy else 1.0

    @T.macro
    def levels_on_mma(kkt_s, beta_s, g_s, xd_s, xa, ta, tc, xc, b, jb, gq, tq, r, n, hv0, bos, ab):
        # xa[8 e + 4 kk ..]: X_{j+e, j}^T as A fragments (m = column c of the block, k = row i in the
        # permuted order: k-step kk, lane quad tq holds rows 8 kk + 2 tq and 8 kk + 2 tq + 1)
        for kk in T.unroll(2):
            for s in T.unroll(4):
                xa[4 * kk + s] = tf32(T, xd_s[r, SOLVE_BLOCK * jb + 8 * kk + 2 * tq + s // 2, gq + 8 * (s % 2)])
        for d in T.unroll(1, NB):
            if jb + d < NB:
                for s in T.unroll(8):
                    tc[s] = 0.0
                # t^T <- sum_{e < d} X_{j+e, j}^T (K K^T)_{D, j+e}^T (n = row i of block D, two n-tiles)
                for e in T.unroll(d):
                    for nn in T.unroll(2):
                        for kk in T.unroll(2):
                            for s in T.unroll(2):
                                b[s] = tf32(T, kkt_s[SOLVE_BLOCK * (jb + d) + 8 * nn + gq, SOLVE_BLOCK * (jb + e) + 8 * kk + 2 * tq + s])
                            mma(xa, 8 * e + 4 * kk, b, tc, 4 * nn)
                # t^T <- t^T diag(beta_D); as A fragments: accumulator (c0, c1, c2, c3) -> (c0, c2, c1, c3)
                for nn in T.unroll(2):
                    for s in T.unroll(4):
                        ta[4 * nn + (s // 2) + 2 * (s % 2)] = tf32(
                            T, tc[4 * nn + s] * beta_s[r, SOLVE_BLOCK * (jb + d) + 8 * nn + 2 * tq + s % 2])
                for s in T.unroll(8):
                    xc[s] = 0.0
                # X_{D, j}^T <- -t^T X_DD^T
                for nn in T.unroll(2):
                    for kk in T.unroll(2):
                        for s in T.unroll(2):
                            b[s] = tf32(T, xd_s[r, SOLVE_BLOCK * (jb + d) + 8 * nn + gq, 8 * kk + 2 * tq + s])
                        mma(ta, 4 * kk, b, xc, 4 * nn)
                for kk in T.unroll(2):
                    for s in T.unroll(4):
                        xa[8 * d + 4 * kk + (s // 2) + 2 * (s % 2)] = tf32(T, -xc[4 * kk + s])
        # Ab[:, col] = X[:, col] beta_col in bf16 from the fragments (rows < n); the block rows
        # above j are zero
        for d in T.unroll(NB):
            if jb + d < NB:
                for kk in T.unroll(2):
                    for s in T.unroll(4):
                        i = SOLVE_BLOCK * (jb + d) + 8 * kk + 2 * tq + s // 2
                        col = SOLVE_BLOCK * jb + gq + 8 * (s % 2)
                        if i < n:
                            ab[bos + i, hv0 + r, col] = xa[8 * d + 4 * kk + s] * beta_s[r, col] * wy_gate(g_s, r, i, col)
        for d in T.unroll(1, NB):
            if jb >= d:
                for kk in T.unroll(2):
                    for s in T.unroll(4):
                        i = SOLVE_BLOCK * (jb - d) + 8 * kk + 2 * tq + s // 2
                        if i < n:
                            ab[bos + i, hv0 + r, SOLVE_BLOCK * jb + gq + 8 * (s % 2)] = 0

    return levels_on_mma


def solve_after_kkt(T, R: int, store_wy: bool):
    """Phases A and B of R value heads once K K^T, beta, log2(e) g_cum and the flags are in shared
    memory, as a TileLang macro: s06's phase A and flagged walk, this stage's walk on mma.sync for
    the other heads (storing WY if ``store_wy``). Both solve kernels run it."""
    NB = CHUNK_SIZE // SOLVE_BLOCK
    phase_a, phase_b = solve_phases(T, lambda r, b, half, q, j: (r, SOLVE_BLOCK * b + 8 * half + q, j))
    levels_on_mma = phase_b_on_mma(T, store_wy)

    @T.macro
    def solve_heads(kkt_s, g_s, beta_s, flag_s, xd_s, x_a, x_col, t_col, acc, row, xa, ta, tc, xc, b,
                    any_flag, t, warp, c, half, gq, tq, n, hv0, bos, i_c, ab, gated):
        any_flag[0] = 0
        for r in T.unroll(R):
            any_flag[0] = any_flag[0] | flag_s[r]

        # phase A (s06's): warp w solves X_ww of every head, the heads' substitutions interleaved;
        # a CTA with a flagged head solves its heads one at a time, each with its own A
        if any_flag[0] == 0:
            phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, 0, R, False)
        else:
            for r in T.unroll(R):
                if flag_s[r] == 1:
                    phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, r, 1, True)
                else:
                    phase_a(kkt_s, g_s, beta_s, xd_s, x_a, acc, row, warp, c, half, n, r, 1, False)
        T.sync_threads()

        # phase B: for head r warp w walks block column jb down (s06's Latin square)
        for r in T.serial(R):
            jb = T.if_then_else(r % 2 == 0, (warp + 2 * (r // 2)) % NB, NB - 1 - (warp + 2 * (r // 2)) % NB)
            if flag_s[r] == 1:
                # s06's fp32 walk with the gated A; Ab[:, col] = X[:, col] beta_col (it holds the gate)
                col = SOLVE_BLOCK * jb + c
                phase_b(kkt_s, g_s, beta_s, xd_s, x_col, t_col, acc, row, jb, c, half, n, r, True)
                for l in T.unroll(NB):
                    if jb + l < NB:
                        for q in T.unroll(8):
                            if SOLVE_BLOCK * (jb + l) + 8 * half + q < n:
                                ab[bos + SOLVE_BLOCK * (jb + l) + 8 * half + q, hv0 + r, col] = x_col[8 * l + q] * beta_s[r, col]
                for l in T.unroll(1, NB):
                    if jb >= l:
                        for q in T.unroll(8):
                            if SOLVE_BLOCK * (jb - l) + 8 * half + q < n:
                                ab[bos + SOLVE_BLOCK * (jb - l) + 8 * half + q, hv0 + r, col] = 0
            else:
                levels_on_mma(kkt_s, beta_s, g_s, xd_s, xa, ta, tc, xc, b, jb, gq, tq, r, n, hv0, bos, ab)
            if t == 0:
                gated[i_c, hv0 + r] = flag_s[r]

    return solve_heads


def gate_free_solve_kernel(H: int, HV: int, heads_per_cta: int, store_wy: bool = False):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA solving ``heads_per_cta``
    value heads of one key head (a divisor of HV / H); any token or chunk count. ``store_wy``
    (gdn_s36's solve): store WY = Gamma * Ab instead of Ab (a flagged head's Ab holds the gate)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R, NB = CHUNK_SIZE, HEAD_DIM, heads_per_cta, CHUNK_SIZE // SOLVE_BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    solve_heads = solve_after_kkt(T, R, store_wy)

    @T.prim_func
    def gate_free_solve_levels_on_mma(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # read for flagged chunks (and WY)
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab (or WY)
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_chunks, HV // R, threads=THREADS) as (i_c, i_r):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            t = T.get_thread_binding()
            warp = t // 32                                     # phase A: this warp's block column
            c = t % 16                                         # the lane's column within a block
            half = (t // 16) % 2                               # which half of each row sum
            gq = (t % 32) // 4                                 # phase B: the lane's mma group ...
            tq = t % 4                                         # ... and its place in the quad
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            bos = chunk_bounds[i_c, 0]                         # first token of the chunk
            n = chunk_bounds[i_c, 1] - bos                     # its length, 0..64

            k_s = T.alloc_shared((C, K), "bfloat16")
            kkt_s = T.alloc_shared((C, KKT_STRIDE), "float32")
            xd_s = T.alloc_shared((R, C, SOLVE_BLOCK), "float32")    # head r, row i: X's diagonal block row i
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_a = T.alloc_local((R * 8,), "float32")           # phase A: X_jj[8 half + q, c] of head u at 8 u + q
            x_col = T.alloc_local((NB * 8,), "float32")        # flagged phase B: X_{j+l, j}[8 half + q, c] at 8 l + q
            t_col = T.alloc_local((SOLVE_BLOCK,), "float32")         # ... a level's row sums, both halves added
            acc = T.alloc_local((2 * R,), "float32")           # two partial sums of a row, per head
            row = T.alloc_local((R,), "float32")
            xa = T.alloc_local((NB * 8,), "float32")           # mma phase B: X_{j+e, j}^T, A fragments
            ta = T.alloc_local((8,), "float32")                # ... t^T as A fragments
            tc = T.alloc_local((8,), "float32")                # ... t^T, two accumulators
            xc = T.alloc_local((8,), "float32")                # ... -X_{D, j}^T, two accumulators
            b = T.alloc_local((2,), "float32")                 # ... a B fragment
            any_flag = T.alloc_local((1,), "int32")

            # flag_r <- 0 (the barriers before K K^T order these stores before the ones below)
            for r in T.Parallel(R):
                flag_s[r] = 0
            # K <- k[bos : bos + n]; beta, log2(e) g_cum of the R value heads; zeros below row n
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for r, i in T.Parallel(R, C):
                beta_s[r, i] = T.if_then_else(i < n, beta[bos + i, hv0 + r], 0)
                g_s[r, i] = T.if_then_else(i < n, g_cum[bos + i, hv0 + r] * LOG2E, 0)
            # K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), read by every head's solve
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                kkt_s[i, j] = kkt_f[i, j]
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1
            T.sync_threads()
            # phase A, then phase B head by head
            solve_heads(kkt_s, g_s, beta_s, flag_s, xd_s, x_a, x_col, t_col, acc, row, xa, ta, tc, xc, b,
                        any_flag, t, warp, c, half, gq, tq, n, hv0, bos, i_c, ab, gated)

    return gate_free_solve_levels_on_mma


# ---- promoted from kernels/gate_free_solve/s16_cumsum_levels_on_mma.py (s13's kernel with the chunk
# table and the cumsum in its prologue, then s15's solve); the forward runs it where a CTA holds at
# most SOLVE_TF32_MAX_HEADS (gate_free_solve.s09), at SOLVE_CTAS_PER_SM (gate_free_solve.s14)
def gate_free_solve_with_cumsum_kernel(H: int, HV: int, heads_per_cta: int):
    """The T.prim_func for H key heads, HV value heads, K = 128, each CTA scanning and solving
    ``heads_per_cta`` (one or two) value heads of one key head; any token, sequence or row count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, R, NB = CHUNK_SIZE, HEAD_DIM, heads_per_cta, CHUNK_SIZE // SOLVE_BLOCK
    P = CUMSUM_SEGMENTS
    L = C // P                     # tokens a scanning thread
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")
    num_rows = T.dynamic("num_rows")

    solve_heads = solve_after_kkt(T, R, False)

    @T.prim_func
    def gate_free_solve_with_cumsum_levels_on_mma(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        beta: T.Tensor((num_tokens, HV), "float32"),
        g: T.Tensor((num_tokens, HV), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # [N + 1]: where each sequence starts
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # out: the chunk-local cumsum of g
        table: T.Tensor((num_rows, 2), "int32"),               # out: [start, end) of every chunk
        first_chunk: T.Tensor((num_bounds,), "int32"),         # out: each sequence's first row
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # row (t mod C) of each chunk's Ab
        gated: T.Tensor((num_rows, HV), "int32"),              # 1: ab holds Ai diag(beta) instead
    ):
        with T.Kernel(num_rows, HV // R, threads=THREADS) as (i_c, i_r):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            t = T.get_thread_binding()
            warp = t // 32                                     # phase A: this warp's block column
            c = t % 16                                         # the lane's column within a block
            half = (t // 16) % 2                               # which half of each row sum
            gq = (t % 32) // 4                                 # phase B: the lane's mma group ...
            tq = t % 4                                         # ... and its place in the quad
            hv0 = i_r * R                                      # this CTA's first value head
            i_h = hv0 // group
            n_seqs = num_bounds - 1
            per = T.ceildiv(n_seqs, THREADS)                   # sequences [t per, (t + 1) per) are t's
            h = t % R                                          # the scan: this thread's head ...
            j = t // R                                         # ... and segment; >= P past 8 R threads

            scan_s = T.alloc_shared((THREADS,), "int32")
            row_s = T.alloc_shared((2,), "int32")              # this CTA's chunk: [start, end)
            mine = T.alloc_local((1,), "int32")
            step = T.alloc_local((1,), "int32")
            x = T.alloc_local((L,), "float32")
            totals = T.alloc_shared((R * P,), "float32")       # t_j,h at h P + j
            tt = T.alloc_local((P,), "float32")                # t_0,h .. t_{P-1},h
            off = T.alloc_var("float32")
            k_s = T.alloc_shared((C, K), "bfloat16")
            kkt_s = T.alloc_shared((C, KKT_STRIDE), "float32")
            beta_s = T.alloc_shared((R, C), "float32")
            g_s = T.alloc_shared((R, C), "float32")
            flag_s = T.alloc_shared((R,), "int32")
            xd_s = T.alloc_shared((R, C, SOLVE_BLOCK), "float32")   # head r, row i: X's diagonal block row i
            kkt_f = T.alloc_fragment((C, C), "float32")
            x_a = T.alloc_local((R * 8,), "float32")           # phase A: X_jj[8 half + q, c] of head u at 8 u + q
            x_col = T.alloc_local((NB * 8,), "float32")        # flagged phase B: X_{j+l, j}[8 half + q, c] at 8 l + q
            t_col = T.alloc_local((SOLVE_BLOCK,), "float32")   # ... a level's row sums, both halves added
            acc = T.alloc_local((2 * R,), "float32")           # two partial sums of a row, per head
            row = T.alloc_local((R,), "float32")
            xa = T.alloc_local((NB * 8,), "float32")           # mma phase B: X_{j+e, j}^T, A fragments
            ta = T.alloc_local((8,), "float32")                # ... t^T as A fragments
            tc = T.alloc_local((8,), "float32")                # ... t^T, two accumulators
            xc = T.alloc_local((8,), "float32")                # ... -X_{D, j}^T, two accumulators
            b = T.alloc_local((2,), "float32")                 # ... a B fragment
            any_flag = T.alloc_local((1,), "int32")

            # ---- the chunk (chunk_local_cumsum.s03's prologue): row_s <- [T, T) unless found below
            if t == 0:
                row_s[0] = num_tokens
                row_s[1] = num_tokens
            # mine <- the chunks of this thread's sequences, ceil(length / C) each
            mine[0] = 0
            for i in T.serial(per):
                if t * per + i < n_seqs:
                    mine[0] = mine[0] + T.ceildiv(bounds[t * per + i + 1] - bounds[t * per + i], C)
            # scan_s <- inclusive prefix sums of mine over the threads (Hillis-Steele)
            scan_s[t] = mine[0]
            for d in [1 << e for e in range((THREADS - 1).bit_length())]:  # a Python loop: unrolled
                T.sync_threads()
                step[0] = scan_s[t] + T.if_then_else(t >= d, scan_s[T.max(t - d, 0)], 0)
                T.sync_threads()
                scan_s[t] = step[0]
            T.sync_threads()
            # walk this thread's sequences from the chunks before them: CTA (0, 0) writes first_chunk;
            # the sequence holding row i_c gives row_s its chunk, clipped to the sequence's end
            mine[0] = scan_s[t] - mine[0]
            for i in T.serial(per):
                if t * per + i < n_seqs:
                    step[0] = T.ceildiv(bounds[t * per + i + 1] - bounds[t * per + i], C)
                    if (i_c == 0) & (i_r == 0):
                        first_chunk[t * per + i] = mine[0]
                    if mine[0] <= i_c and i_c < mine[0] + step[0]:
                        row_s[0] = bounds[t * per + i] + (i_c - mine[0]) * C
                        row_s[1] = T.min(bounds[t * per + i] + (i_c - mine[0] + 1) * C,
                                         bounds[t * per + i + 1])
                    mine[0] = mine[0] + step[0]
            if (i_c == 0) & (i_r == 0) & (t == THREADS - 1):
                first_chunk[n_seqs] = scan_s[THREADS - 1]
            T.sync_threads()
            bos = row_s[0]                                     # first token of the chunk
            n = row_s[1] - bos                                 # its length, 0..64
            if (i_r == 0) & (t == 0):
                table[i_c, 0] = bos
                table[i_c, 1] = row_s[1]

            # ---- the cumsum of the R heads (s02's scan, s02's order): x_r <- g[bos + j L + r, h],
            # zero past the chunk's end
            for r in T.unroll(L):
                x[r] = 0.0
                if (j < P) & (j * L + r < n):
                    x[r] = g[bos + j * L + r, hv0 + h]
            # x_r <- x_0 + ... + x_r: the prefix within the segment; x_{L-1} is its total
            for r in T.unroll(1, L):
                x[r] = x[r] + x[r - 1]
            if t < P * R:
                totals[h * P + j] = x[L - 1]
            # flag_r <- 0 (the barriers before K K^T order these stores before the ones below)
            for r in T.Parallel(R):
                flag_s[r] = 0
            T.sync_threads()
            # off = t_0,h + ... + t_{j-1},h; g_cum <- off + x_r, and log2(e) g_cum (0 past the chunk's
            # end) for a flagged head's gate
            for jj in T.vectorized(P):
                tt[jj] = totals[h * P + jj]
            off = 0.0
            for jj in T.unroll(P - 1):
                if jj < j:
                    off = off + tt[jj]
            if t < P * R:
                for r in T.unroll(L):
                    g_s[h, j * L + r] = T.if_then_else(j * L + r < n, (off + x[r]) * LOG2E, 0)
                    if j * L + r < n:
                        g_cum[bos + j * L + r, hv0 + h] = off + x[r]
            # ---- s08's solve: K <- k[bos : bos + n]; beta of the R value heads; zeros below row n
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(i < n, k[bos + i, i_h, d], 0)
            for r, i in T.Parallel(R, C):
                beta_s[r, i] = T.if_then_else(i < n, beta[bos + i, hv0 + r], 0)
            # K K^T (64 x 64 x 128, bf16 in, fp32 accumulate: wgmma), read by every head's solve
            T.gemm(k_s, k_s, kkt_f, transpose_B=True, clear_accum=True)
            for i, jj in T.Parallel(C, C):
                kkt_s[i, jj] = kkt_f[i, jj]
            # flag_r <- 1 if some row has beta_i ||k_i||^2 = beta_i (K K^T)_ii > GROWTH_LIMIT
            for r, i in T.Parallel(R, C):
                if beta_s[r, i] * kkt_s[i, i] > GROWTH_LIMIT:
                    flag_s[r] = 1
            T.sync_threads()
            # phase A, then phase B head by head (s15's)
            solve_heads(kkt_s, g_s, beta_s, flag_s, xd_s, x_a, x_col, t_col, acc, row, xa, ta, tc, xc, b,
                        any_flag, t, warp, c, half, gq, tq, n, hv0, bos, i_c, ab, gated)

    return gate_free_solve_with_cumsum_levels_on_mma


# ---- promoted from kernels/gdn_fwd/s18_lean_autocp.py (AutoCP: the windows)
def windows_kernel(HV: int):
    """The T.prim_func that gives each (slot, value head) its window start and exact flag: what
    ``autocp.warmup`` gives from ``autocp.bound_violations`` (module docstring: the differences)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, W = CHUNK_SIZE, MAX_WINDOW
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def autocp_windows(
        g: T.Tensor((num_tokens, HV), "float32"),              # per-token log decay
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        beta: T.Tensor((num_tokens, HV), "float32"),
        gated: T.Tensor((num_chunks, HV), "int32"),            # the solve's: some beta ||k||^2 > 2
        slot_start: T.Tensor((num_slots,), "int32"),           # the segment's first token
        slot_warm: T.Tensor((num_slots,), "int32"),            # 1: the previous segment has L full chunks
        slot_chunk: T.Tensor((num_slots,), "int32"),           # chunk row at the segment's start
        seg_chunks: T.int32,                                   # L
        threshold: T.float64,
        win_start: T.Tensor((num_slots, HV), "int32"),
        exact: T.Tensor((num_slots, HV), "int32"),
    ):
        with T.Kernel(num_slots, HV, threads=WINDOW_THREADS) as (i_s, i_hv):
            tx = T.get_thread_binding()
            s = slot_start[i_s]
            warm = slot_warm[i_s]
            span = seg_chunks * C                               # tokens of the previous segment
            w_max = T.min(seg_chunks, W)
            dec_s = T.alloc_shared((2, W), "float64")          # [0]: chunk decays, [1]: their sums
            flags_s = T.alloc_shared((2,), "int32")             # [0]: the bound fails; [1]: short
            cum = T.alloc_local((1,), "float64")

            if tx < 2:
                flags_s[tx] = 0
            # dec_i <- log decay of the i-th chunk back from the segment start (a full chunk)
            if tx < W:
                dec_s[0, tx] = T.if_then_else((warm != 0) & (tx < w_max),
                                           T.Cast("float64", g_cum[T.max(s - C * tx - 1, 0), i_hv]), 0.0)
            T.sync_threads()
            # bad <- a token of the previous segment with g > 0 or beta < 0 (or NaN: both
            # comparisons fail on it), or a chunk there flagged gated (beta ||k||^2 > 2)
            if warm != 0:
                for it in T.serial(T.ceildiv(span, WINDOW_THREADS * UNROLL)):
                    for r in T.unroll(UNROLL):
                        t = s - span + (it * UNROLL + r) * WINDOW_THREADS + tx
                        if t < s:
                            if T.Not((g[t, i_hv] <= 0) & (beta[t, i_hv] >= 0)):
                                flags_s[0] = 1
                for it in T.serial(T.ceildiv(seg_chunks, WINDOW_THREADS)):
                    c = it * WINDOW_THREADS + tx
                    if c < seg_chunks:
                        if gated[slot_chunk[i_s] - seg_chunks + c, i_hv] != 0:
                            flags_s[0] = 1
            # cum_i <- the log decay of the last i + 1 chunks, in float64 as autocp.warmup sums it
            if tx < W:
                cum[0] = 0.0
                for m in T.serial(W):
                    if m <= tx:
                        cum[0] = cum[0] + dec_s[0, m]
                dec_s[1, tx] = cum[0]
            T.sync_threads()
            # short <- the chunks whose cumulative decay stays above the threshold (a prefix when
            # g <= 0; when it is not, the bound fails and the head runs exactly anyway)
            if tx < w_max:
                if (dec_s[1, tx] > threshold) & ((tx + 1 == w_max) | (dec_s[1, T.min(tx + 1, W - 1)] <= threshold)):
                    flags_s[1] = tx + 1
            T.sync_threads()
            if tx == 0:
                ex = (warm != 0) & ((flags_s[1] == w_max) | (flags_s[0] != 0))
                chunks = T.if_then_else(warm != 0, T.if_then_else(ex, seg_chunks, flags_s[1] + 1), 0)
                win_start[i_s, i_hv] = s - C * chunks
                exact[i_s, i_hv] = T.if_then_else(ex, 1, 0)

    return autocp_windows


# ---- promoted from kernels/gdn_fwd/s44_warmup_two_products.py (AutoCP's phase 1; roles renamed WARMUP_...)
def warmup_kernel(H: int, HV: int):
    """The T.prim_func of phase 1 for H key heads and HV value heads; any token or slot count.
    gdn_fwd.s23's grid and outputs: (V + K) / BV column tiles per (slot, value head), V / BV of Z, K / BV
    of M; an M tile of a warm-up head, and every tile of a slot without a window, writes zeros."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C, K, V, BV = CHUNK_SIZE, HEAD_DIM, HEAD_DIM, BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def gdn_autocp_warmup_two_products(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # the solve's rows per token
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab already holds the gate
        win_start: T.Tensor((num_slots, HV), "int32"),         # first token of the window
        slot_start: T.Tensor((num_slots,), "int32"),           # its end: the segment's first token
        slot_chunk: T.Tensor((num_slots,), "int32"),           # chunk row at the segment's start
        exact: T.Tensor((num_slots, HV), "int32"),             # 1: M of the window too
        z: T.Tensor((num_slots, HV, K, V), "float32"),
        m: T.Tensor((num_slots, HV, K, K), "float32"),
    ):
        with T.Kernel((V + K) // BV, HV, num_slots, threads=WARMUP_THREADS) as (i_t, i_hv, i_s):
            i_h = i_hv // group
            is_m = i_t >= V // BV                              # a tile of M (else of Z)
            take_m = is_m & (exact[i_s, i_hv] != 0)
            c0 = (i_t % (V // BV)) * BV                        # its columns (K = V)
            eos = slot_start[i_s]
            bos = T.if_then_else(is_m & (exact[i_s, i_hv] == 0), eos, win_start[i_s, i_hv])
            # the window's chunks are whole: it ends at a segment start and takes whole chunks
            # of the previous segment, all of whose chunks are full
            win_chunks = (eos - bos) // C
            row0 = slot_chunk[i_s] - win_chunks                # chunk row of the window's first chunk

            # tile stages (producer -> chain, x); the gates as exp(g) and exp(g_C - g)
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain, x
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # chain
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # x (a gated chunk's scaled in place)
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # x: exp(g); chain: exp(g_C)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # x: exp(g_C - g)
            xa_s = T.alloc_shared((NUM_HANDOFF, C, K), "bfloat16")    # x -> chain: XA
            xb_s = T.alloc_shared((NUM_HANDOFF, C, K), "bfloat16")    # x -> chain: XB
            # the chain's registers: S^T, its bf16 copy, U^T and -U^T in bf16; the x warpgroup's X
            st_f = T.alloc_fragment((BV, K), "float32")
            st_a = T.alloc_fragment((BV, K), "bfloat16")
            u_f = T.alloc_fragment((BV, C), "float32")
            u_a = T.alloc_fragment((BV, C), "bfloat16")
            x_f = T.alloc_fragment((C, K), "float32")
            x_a = T.alloc_fragment((C, K), "bfloat16")
            keep = T.alloc_var("int32")                               # this chunk's gated flag
            # ab_s is scaled in place in the accumulator layout on a gated chunk
            T.annotate_layout({ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)       # producer -> all
            bar_tiles_empty = T.alloc_barrier([2 * WARPGROUP] * NUM_STAGES)  # all -> producer
            bar_x_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)         # x -> chain
            bar_x_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)          # chain -> x

            tx = T.get_thread_binding()
            if tx < WARMUP_CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_WARMUP_CHAIN, 1)
                # S^T <- rows c0.. of I for M tiles of exact heads, else 0
                for j, d in T.Parallel(BV, K):
                    st_f[j, d] = T.if_then_else(take_m & (d == c0 + j), 1.0, 0.0)
                for c in T.serial(win_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    # S^T rounded to bf16 in registers, then S^T <- exp(g_C) S^T (before the products:
                    # an accumulator written while a wgmma batch runs serializes it, ptxas C7515)
                    for j, d in T.Parallel(BV, K):
                        st_a[j, d] = st_f[j, d]
                        st_f[j, d] = st_f[j, d] * eg_s[s, C - 1]
                    # U^T <- S^T K^T and S^T <- S^T + V^T XB, both issued without waiting
                    T.wgmma_gemm(st_a, k_s[s, :, :], u_f, transpose_B=True, clear_accum=True)
                    T.barrier_wait(bar_x_ready[b], (c // NUM_HANDOFF) % 2)
                    if not is_m:
                        T.wgmma_gemm(v_s[s, :, :], xb_s[b, :, :], st_f, transpose_A=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(u_f, num_regs=BV * C // WARPGROUP)
                    T.warpgroup_fence_operand(st_f, num_regs=BV * K // WARPGROUP)
                    # S^T <- S^T + (-U^T) XA
                    for j, i in T.Parallel(BV, C):
                        u_a[j, i] = -u_f[j, i]
                    T.gemm(u_a, xa_s[b, :, :], st_f)
                    T.barrier_arrive(bar_x_free[b])
                    T.barrier_arrive(bar_tiles_empty[s])
                # Z or M tile <- S, transposed back
                if is_m:
                    for j, d in T.Parallel(BV, K):
                        m[i_s, i_hv, d, c0 + j] = st_f[j, d]
                else:
                    for j, d in T.Parallel(BV, K):
                        z[i_s, i_hv, d, c0 + j] = st_f[j, d]

            elif tx >= WARMUP_CHAIN_END and tx < WARMUP_X_END:  # ---- the x warpgroup
                T.set_max_nreg(REGS_WARMUP_X, 1)
                for c in T.serial(win_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    keep = gated[row0 + c, i_hv]
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    # a gated chunk: Ab <- diag(exp(g_C - g)) Ab (its Ab holds Gamma already)
                    if keep != 0:
                        for i, j in T.Parallel(C, C):
                            ab_s[s, i, j] = ab_s[s, i, j] * egd_s[s, i]
                        T.fence_proxy_async()
                    # X <- Ab^T K
                    T.gemm(ab_s[s, :, :], k_s[s, :, :], x_f, transpose_A=True, clear_accum=True)
                    # XA <- exp(g_C) X, XB <- diag(exp(g_C - g)) X; gated: XA <- diag(exp g) X, XB <- X
                    T.barrier_wait(bar_x_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    for i, d in T.Parallel(C, K):
                        x_a[i, d] = x_f[i, d] * T.if_then_else(keep != 0, eg_s[s, i], eg_s[s, C - 1])
                    T.copy(x_a, xa_s[b, :, :])
                    for i, d in T.Parallel(C, K):
                        x_a[i, d] = x_f[i, d] * T.if_then_else(keep != 0, 1.0, egd_s[s, i])
                    T.copy(x_a, xb_s[b, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_x_ready[b])
                    T.barrier_arrive(bar_tiles_empty[s])

            elif tx >= WARMUP_X_END:  # ---- the producer warpgroup
                T.set_max_nreg(REGS_WARMUP_PRODUCER, 0)
                for c in T.serial(win_chunks):
                    s = c % NUM_STAGES
                    t0 = bos + c * C
                    T.barrier_wait(bar_tiles_empty[s], (c // NUM_STAGES) % 2 ^ 1)
                    T.tma_copy(k[t0:t0 + C, i_h, :], k_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(v[t0:t0 + C, i_hv, c0:c0 + BV], v_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(ab[t0:t0 + C, i_hv, :], ab_s[s, :, :], barrier=bar_tiles_full[s])
                    # the row factors exp(g_i) and exp(g_C - g_i) (exp(g_C) is the last of the first);
                    # whole chunks: no padding
                    for i in T.Parallel(C):
                        eg_s[s, i] = T.exp2(g_cum[t0 + i, i_hv] * LOG2E)
                        egd_s[s, i] = T.exp2((g_cum[t0 + C - 1, i_hv] - g_cum[t0 + i, i_hv]) * LOG2E)
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_autocp_warmup_two_products


# ---- promoted from kernels/gdn_fwd/s24_chain_reads_what_it_needs.py (AutoCP's phase 2)
def chain_kernel(HV: int):
    """The T.prim_func of phase 2 for HV value heads: every segment row's initial state [S, HV, K,
    V] from h0 [N, HV, K, V], phase 1's Z [J N, HV, K, V] and M [J N, HV, K, K] (read only for a
    (sequence, head) with an exact slot), the exact flags [J N, HV] and ``Plan.row_of_slot`` [J N]."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    K, V, BC = HEAD_DIM, HEAD_DIM, CHAIN_COLUMNS
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def autocp_chain_rows(
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        z: T.Tensor((num_slots, HV, K, V), "float32"),         # slot j N + n: segment j of sequence n
        m: T.Tensor((num_slots, HV, K, K), "float32"),         # zero where exact is 0
        exact: T.Tensor((num_slots, HV), "int32"),
        row_of_slot: T.Tensor((num_slots,), "int32"),          # -1: sequence n has no segment j
        h_seg: T.Tensor((num_rows, HV, K, V), "float32"),      # each segment row's initial state
    ):
        with T.Kernel(V // BC, HV, num_seqs, threads=CHAIN_THREADS) as (i_c, i_hv, i_n):
            c0 = i_c * BC
            steps = num_slots // num_seqs - 1
            m_s = T.alloc_shared((K, K), "float32")
            h_s = T.alloc_shared((K, BC), "float32")
            h_f = T.alloc_fragment((K, BC), "float32")
            chained = T.alloc_var("int32")                     # steps of the chain that read M
            # M's rows swizzled (s21's): a warp reads one column of 16 rows at once
            T.annotate_layout({m_s: tilelang.layout.make_swizzled_layout(m_s)})

            # chained <- steps if any slot of this (sequence, head) is exact, else 0
            chained = 0
            for j in T.serial(steps):
                if exact[(j + 1) * num_seqs + i_n, i_hv] != 0:
                    chained = steps
            # h_0 <- the sequence's initial state (slot n is its first segment, always a row)
            T.copy(h0[i_n, i_hv, :, c0:c0 + BC], h_f)
            T.copy(h_f, h_seg[row_of_slot[i_n], i_hv, :, c0:c0 + BC])
            for j in T.Pipelined(chained, num_stages=CHAIN_STAGES):
                s = (j + 1) * num_seqs + i_n
                # M_j (its load is issued ahead: it does not read h)
                T.copy(m[s, i_hv, :, :], m_s)
                # h_j <- Z_j + M_j h_{j-1}
                T.copy(h_f, h_s)
                T.copy(z[s, i_hv, :, c0:c0 + BC], h_f)
                for e in T.serial(K):
                    for r, c in T.Parallel(K, BC):
                        h_f[r, c] = h_f[r, c] + m_s[r, e] * h_s[e, c]
                if row_of_slot[s] >= 0:
                    T.copy(h_f, h_seg[row_of_slot[s], i_hv, :, c0:c0 + BC])
            for j in T.serial(steps - chained):
                s = (j + 1) * num_seqs + i_n
                # h_j <- Z_j (every M_j of this head is zero)
                if row_of_slot[s] >= 0:
                    T.copy(z[s, i_hv, :, c0:c0 + BC], h_f)
                    T.copy(h_f, h_seg[row_of_slot[s], i_hv, :, c0:c0 + BC])

    return autocp_chain_rows


# ---- promoted from kernels/gdn_fwd/s10_lean_chain.py (THREADS renamed FUSED_THREADS)
def chunk_parts(num_seq_chunks):
    """The chain's and output's chunk loop in two parts, (first chunk, trips, slots, present): the
    pairs (chunks 2r, 2r + 1), then the odd last chunk, present only when the count is odd. The
    odd chunk sits under an `if` with one trip: TileLang 0.1.15 lowered ``T.serial(n % 2)`` (a
    loop whose extent it can bound by 1) to its body with no guard, so every even count ran one
    chunk more than it had, on stale tiles (the GPU test of this stage's first build)."""
    return ((0, num_seq_chunks // 2, HANDOFF_SLOTS, True),
            (num_seq_chunks - 1, 1, HANDOFF_SLOTS[:1], num_seq_chunks % 2 == 1))


def block_v(seq_chunks: list[int], HV: int, V: int, num_sms: int) -> int:
    """BV for a launch of the fused kernel over sequences of ``seq_chunks`` chunks each (gdn_fwd.s15's
    rule on s17's steps), host integers only: the width of the fewest chunk steps, ``STEP[BV]`` x max(longest
    sequence, CTA-chunks / SMs, waves x shortest sequence), where a sequence has HV x V / BV CTAs.
    With equal lengths ([1] * N) it is gdn_fwd.s14's rule, waves x STEP."""
    ctas_per_seq = {bv: HV * (V // bv) for bv in STEP}

    def steps(bv):
        waves = -(-len(seq_chunks) * ctas_per_seq[bv] // num_sms)
        return STEP[bv] * max(max(seq_chunks), ctas_per_seq[bv] * sum(seq_chunks) / num_sms,
                              waves * min(seq_chunks))
    return min(STEP, key=steps)


@functools.lru_cache(maxsize=256)
def equal_lengths_width(num_seqs: int, HV: int, V: int, num_sms: int) -> int:
    """``block_v`` of ``num_seqs`` sequences of equal lengths (AutoCP's segment rows), kept."""
    return block_v([1] * num_seqs, HV, V, num_sms)


def launch_width(cu_seqlens, B: int, T: int, HV: int, V: int, num_sms: int) -> int:
    """``block_v`` of the sequences of inputs [B, T] (or varlen ``cu_seqlens``, whose values
    ``host_bounds`` reads once per tensor); equal lengths assumed where they cannot be read (inside
    a CUDA-graph capture with no eager call before it)."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    if bounds is None:
        return block_v([1] * (cu_seqlens.shape[0] - 1), HV, V, num_sms)
    return block_v([-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])], HV, V, num_sms)


# ---- promoted from kernels/gdn_fwd/s18_lean_autocp.py, s25_rule_by_waves.py and s44_warmup_two_products.py
# (AutoCP's rule and plan: s18's shortest L that fits, s25's ladder and prices at s44's costs)
def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, unsplit_step: float,
                   force: bool | int | None = None) -> int:
    """The decision rule: chunks per segment L, or 0 for no split, from the sequences' chunk
    counts (host integers). Phase 3 runs 2 HV CTAs a segment (BV 64); L0 is the shortest length
    (at least ``autocp.MIN_SEGMENT_CHUNKS``) whose segments fit PHASE3_CTAS_PER_SM CTAs on every
    SM. The candidates are SEGMENT_LADDER's lengths (those at most a third of the longest
    sequence) and L0, 2 L0 (where they leave two segments or more), each costing, in chunk steps
    at BV 64, WAVE_CHUNK_STEPS L waves + SEGMENT_STEPS J + FIXED_STEPS, with J the longest
    sequence's segments and waves = ceil(2 HV S / (PHASE3_CTAS_PER_SM num_sms)) for S segments in
    all. Automatic (``force`` None): the cheapest, if below the unsplit launch's ``unsplit_step``
    x the longest sequence (its width's step, ``STEP``, or WY_STEP where it stores WY), else 0.
    ``force``: False never splits, True splits at the cheapest, an int is L."""
    longest = max(seq_chunks, default=0)
    if force is False or longest == 0:
        return 0
    if not isinstance(force, bool) and isinstance(force, int):
        if force < 1:
            raise ValueError(f"flashqla: `cp` as segment length must be >= 1 chunk; got {force}")
        return force
    lanes = 2 * HV
    def segments(L):
        return sum(-(-c // L) for c in seq_chunks)
    def fits(L):  # segments shrink in count as L grows: bisect for the shortest L that fits
        return L >= longest or lanes * segments(L) <= PHASE3_CTAS_PER_SM * num_sms
    L0, hi = autocp.MIN_SEGMENT_CHUNKS, max(autocp.MIN_SEGMENT_CHUNKS, longest)
    while L0 < hi:
        mid = (L0 + hi) // 2
        L0, hi = (L0, mid) if fits(mid) else (mid + 1, hi)
    lengths = ({L for L in SEGMENT_LADDER if 3 * L <= longest}
               | {L for L in (L0, 2 * L0) if -(-longest // L) >= 2})
    costs = [(WAVE_CHUNK_STEPS * L * -(-lanes * segments(L) // (PHASE3_CTAS_PER_SM * num_sms))
              + SEGMENT_STEPS * -(-longest // L) + FIXED_STEPS, L) for L in sorted(lengths)]
    if force is True:
        return min(costs)[1] if costs else L0
    return min(costs + [(unsplit_step * longest, 0)])[1]


def split_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, cp, unsplit_step: float):
    """The AutoCP plan (``autocp.Plan`` with ``slot_chunk``) or None (``segment_chunks``), with
    the lengths the host knows (``host_bounds``; inside a capture with no read before, one
    sequence of all the tokens stands for them). The plan comes from the host (``autocp.host_plan``),
    or is built on the device inside a capture that has no plan kept for these lengths."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                  else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
    L = segment_chunks(seq_chunks, HV, num_sms, unsplit_step, cp)
    return segment_plan(cu_seqlens, B, T, HV, num_sms, device, L, bounds)


def segment_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, L: int, bounds):
    """``split_plan``'s plan at segment length L (0: None), from the host's ``bounds`` (None inside a
    capture with no read before)."""
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if not L or num_seqs == 0:
        return None
    p = None if bounds is None else autocp.host_plan(bounds, L, device)
    if p is None:
        p = autocp.plan(cu_seqlens, B, T, HV, num_sms, HEAD_DIM // 64, device, force=L)
        p = autocp.dataclasses.replace(p, slot_chunk=autocp.slot_chunks(cu_seqlens, B, T, L, p.max_segments, device))
    return p


# ---- promoted from kernels/gdn_fwd/s12_narrow_value_blocks.py (s10's kernel at any BV)
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
        with T.Kernel(V // BV, HV, num_seqs, threads=FUSED_THREADS) as (i_v, i_hv, i_n):
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


# ---- promoted from kernels/gdn_fwd/s34_output_overlap.py (s16's roles, renamed WIDE_...)
def fused_state_value_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV value columns of the
    state per CTA (32, 64 or 128); any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C = CHUNK_SIZE
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
        with T.Kernel(V // BV, HV, num_seqs, threads=WIDE_THREADS) as (i_v, i_hv, i_n):
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
            if tx < WIDE_STATE_END:  # ---- the state warpgroup
                T.set_max_nreg(REGS_WIDE_STATE, 1)
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

            elif tx >= WIDE_STATE_END and tx < WIDE_VALUE_END:  # ---- the value warpgroup
                T.set_max_nreg(REGS_WIDE_VALUE, 1)
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

            elif tx >= WIDE_VALUE_END and tx < WIDE_SCORES_END:  # ---- the scores / output warpgroup
                T.set_max_nreg(REGS_WIDE_SCORES, 1)
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
                                    keep = gated[row0 + c, i_hv]
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

            elif tx >= WIDE_SCORES_END:  # ---- the producer warpgroup
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


# ---- promoted from kernels/gdn_fwd/s40_stmatrix_hand_offs.py (s39's kernel: the state transposed in the
# chain's registers; s12's roles, the scores building P only)
def fused_state_in_registers_kernel(H: int, HV: int, K: int, V: int, BV: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V, BV = 64 value columns of the
    state per CTA, ab holding WY (s36's solve); any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    if BV != WY_BLOCK_V:
        raise ValueError(f"fused_state_in_registers_kernel: `BV` must be {WY_BLOCK_V} (S^T's rows); got {BV}")
    C = CHUNK_SIZE
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
        with T.Kernel(V // BV, HV, num_seqs, threads=FUSED_THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            num_seq_chunks = T.ceildiv(eos - bos, C)

            # tile stages (producer -> consumers); g holds log2(e) g_cum
            q_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # scores, output
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain, scores
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # chain
            wy_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # chain
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
            # the chain's registers: S^T, the accumulators of U^T and V~^T, the bf16 left operands
            st_f = T.alloc_fragment((BV, K), "float32")
            st_a = T.alloc_fragment((BV, K), "bfloat16")
            x_f = T.alloc_fragment((BV, C), "float32")
            y_f = T.alloc_fragment((BV, C), "float32")
            x_a = T.alloc_fragment((BV, C), "bfloat16")
            # the scores' and the output's
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
                                # U^T <- S_c^T K^T, S_c^T rounded to bf16 in registers, issued without
                                # waiting
                                T.copy(st_f, st_a)
                                T.wgmma_gemm(st_a, k_s[b, :, :], x_f, transpose_B=True, clear_accum=True)
                                # while they run: S_c^T -> slot b for the output once it has read
                                # S_{c-2}^T, and S^T <- exp(g_C) S^T (the products read st_a only)
                                T.barrier_wait(bar_state_free[b], phase ^ 1)
                                T.copy(st_a, ht_sb)
                                T.fence_proxy_async()
                                T.barrier_arrive(bar_state_ready[b])
                                for j, i in T.Parallel(BV, K):
                                    st_f[j, i] = st_f[j, i] * eg_s[b, C - 1]
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(x_f, num_regs=BV * C // WARPGROUP)
                                T.warpgroup_fence_operand(y_f, num_regs=BV * C // WARPGROUP)
                                # V~^T <- V~^T - (U^T diag(exp g)) WY^T: W^T WY^T with W = V - diag(exp g) U
                                # (V's rows >= n are finite and meet only WY's zero columns)
                                for j, i in T.Parallel(BV, C):
                                    x_a[j, i] = -x_f[j, i] * eg_s[b, i]
                                T.gemm(x_a, wy_s[b, :, :], y_f, transpose_B=True)
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




# compile options beyond the target, as the stages use them. The fused and warm-up kernels: no shared-memory
# reuse (TileLang plans it as if the role branches ran one after another), fast math (exp2 is one
# ex2.approx, no branch)
PASS_CONFIGS = {builder: {"tl.disable_shared_memory_reuse": True, "tl.enable_fast_math": True}
                for builder in (fused_reform_kernel, fused_state_value_kernel, fused_state_in_registers_kernel,
                                warmup_kernel)}
# the cumsum: no bounds checks (its row guard keeps g's accesses in range, its sequence guard the bounds')
PASS_CONFIGS[chunk_local_cumsum_kernel] = {"tl.disable_safe_memory_legalize": True}


DECISIONS_CACHE = 256  # launches (lengths, heads, SMs, cp) whose host decisions are kept
_decisions: dict = {}
_decisions_lock = threading.Lock()


def launch_decisions(cu_seqlens, B: int, T: int, H: int, HV: int, V: int, num_sms: int, cp):
    """(the host's bounds or None, (R, BV, wy, L)): the solve's value heads a CTA (``solve_heads``),
    the fused kernel's width (``launch_width``), whether a launch left unsplit has the solve store
    WY = Gamma * Ab (gdn_fwd.s37: at BV WY_BLOCK_V after a solve of three or four heads a CTA; the
    fused kernel is then fused_state_in_registers_kernel, and the rule weighs that launch at
    WY_STEP, gdn_fwd.s44) and AutoCP's segment length L (0: no split). Host integers from the
    lengths, kept per (lengths, heads, SMs, cp): an eager call repeats none of the rules."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    key = (B, T, num_seqs, H, HV, V, num_sms, cp, None if bounds is None else tuple(bounds))
    with _decisions_lock:
        hit = _decisions.get(key)
    if hit is None:
        R = solve_heads(H, HV, num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE), num_sms)
        BV = launch_width(cu_seqlens, B, T, HV, V, num_sms)
        wy = BV == WY_BLOCK_V and R > SOLVE_TF32_MAX_HEADS
        seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                      else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
        hit = (R, BV, wy, segment_chunks(seq_chunks, HV, num_sms, WY_STEP if wy else STEP[BV], cp))
        with _decisions_lock:
            _decisions[key] = hit
            while len(_decisions) > DECISIONS_CACHE:
                del _decisions[next(iter(_decisions))]  # the oldest
    return bounds, hit


@cache_once  # threads: one compile per kernel (flashqla.caches)
def _compiled(builder, *shape):
    """``builder(*shape)`` as a programmatic dependent (gdn_fwd.s27): it waits on the kernel before
    it inside, and lets the one after it be scheduled at once; the solve at SOLVE_CTAS_PER_SM."""
    func = builder(*shape)
    if builder is gate_free_solve_with_cumsum_kernel:  # shape: (H, HV, heads a CTA)
        func = min_ctas_per_sm(func, SOLVE_CTAS_PER_SM[shape[2]])
    return compile_hopper(dependent_launch(func), PASS_CONFIGS.get(builder))


def solve(H, HV, R, store_wy, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated):
    """The kernels before AutoCP's: g, seqs -> g_cum, chunks, first_chunk (the chunk table, the
    chunk-local cumsum of g); k, beta -> Ab (or WY = Gamma * Ab, ``store_wy``), gated; R value
    heads a solve CTA (``solve_heads``). k [B T, H, K] bf16, g, beta [B T, HV] fp32; the rest the
    outputs, allocated by the caller."""
    if R <= SOLVE_TF32_MAX_HEADS:
        with nvtx_range("fwd.gate_free_solve_with_cumsum"):
            # g_cum, chunks, first_chunk, Ab, gated <- the chunk table, the chunk-local cumsum of g
            # and the gate-free solve, in one kernel
            _compiled(gate_free_solve_with_cumsum_kernel, H, HV, R)(k, beta, g, seqs, g_cum, chunks,
                                                                    first_chunk, ab, gated)
    else:
        with nvtx_range("fwd.chunk_local_cumsum"):
            # g_cum, chunks, first_chunk <- the chunk-local cumsum of g, the chunk table
            _compiled(chunk_local_cumsum_kernel, HV)(g, seqs, g_cum, chunks, first_chunk)
        with nvtx_range("fwd.gate_free_solve"):
            # Ab (or WY), gated <- the gate-free solve, three or four value heads a CTA
            _compiled(gate_free_solve_kernel, H, HV, R, store_wy)(k, beta, g_cum, chunks, ab, gated)


def solved(H, HV, R, store_wy, k, beta, g, seqs, cu_seqlens, B: int, T: int):
    """``solve`` into new tensors -> (g_cum, chunks, first_chunk, ab, gated), for inputs [B, T] (or
    varlen ``cu_seqlens``) flattened as ``solve`` takes them."""
    device = k.device
    chunks = torch.empty(num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE), 2, dtype=torch.int32, device=device)
    first_chunk = torch.empty(seqs.shape[0], dtype=torch.int32, device=device)
    g_cum = torch.empty(B * T, HV, dtype=torch.float32, device=device)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, dtype=torch.bfloat16, device=device)
    gated = torch.empty(chunks.shape[0], HV, dtype=torch.int32, device=device)
    solve(H, HV, R, store_wy, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated)
    return g_cum, chunks, first_chunk, ab, gated


def window_states(p, k, v, g, g_cum, beta, ab, gated):
    """AutoCP's windows and phase 1 on plan ``p``, after ``solve``: (Z [J N, HV, K, V], M [J N, HV,
    K, K], exact [J N, HV] int32) of every slot's window: per (slot, value head) its first token and
    whether it runs exactly (windows), then Z, the chain over the window from S = 0, and for exact
    heads M, the same from S = I with v = 0 (zero elsewhere; M reads no v). k [B T, H, K], v [B T,
    HV, V] bf16; g, g_cum, beta [B T, HV] fp32; ab, gated: the solve's."""
    H, HV, K, V = k.shape[1], v.shape[1], k.shape[2], v.shape[2]
    device, N, J = k.device, p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
    exact = torch.empty_like(win_start)
    with nvtx_range("fwd.autocp_windows"):
        _compiled(windows_kernel, HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                      p.slot_chunk, p.segment_chunks, float(autocp.THRESHOLD),
                                      win_start, exact)
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    with nvtx_range("fwd.autocp_warmup"):
        _compiled(warmup_kernel, H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start,
                                        p.slot_chunk, exact, z, m)
    return z, m, exact


def chain_states(p, h0, z, m, exact):
    """AutoCP's phase 2 on plan ``p``: h_j = Z_j + M_j h_{j-1}, the initial state of every segment
    row [S, HV, K, V] fp32 from the sequences' h0 [N, HV, K, V] fp32 and ``window_states``' (Z, M,
    exact); M is read only for a head with an exact slot. Rows past the real ones (empty segments)
    stay unwritten: the fused kernel only copies them into final states that nobody reads."""
    h_seg = torch.empty(p.bounds.shape[0] - 1, *h0.shape[1:], dtype=torch.float32, device=h0.device)
    with nvtx_range("fwd.autocp_chain"):
        _compiled(chain_kernel, h0.shape[1])(h0, z, m, exact, p.row_of_slot, h_seg)
    return h_seg


def segment_states(p, k, v, g, g_cum, beta, ab, gated, h0):
    """AutoCP's windows and phases 1 and 2 on plan ``p``, after ``solve``: every segment row's
    initial state h_seg [S, HV, K, V] fp32 from the sequences' h0 [N, HV, K, V] fp32
    (``window_states``, then ``chain_states``)."""
    return chain_states(p, h0, *window_states(p, k, v, g, g_cum, beta, ab, gated))


def chunk_h_o(H, store_wy, BV, q, k, v, ab, g_cum, gated, h0, seqs, first_chunk, scale):
    """The fused kernel over the sequences (or segment rows) ``seqs`` from their initial states h0
    [N, HV, K, V] fp32 -> (o [B T, HV, V] bf16, final states [N, HV, K, V] fp32): at width BV,
    fused_state_in_registers_kernel where the solve stored WY, else fused_reform_kernel (BV 16, 32)
    or fused_state_value_kernel (BV 64, 128)."""
    HV, K, V = v.shape[1], q.shape[2], v.shape[2]
    o = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    ht = torch.empty(h0.shape, dtype=torch.float32, device=v.device)
    builder = (fused_state_in_registers_kernel if store_wy else
               fused_reform_kernel if BV <= NARROW_BLOCK_V else fused_state_value_kernel)
    with nvtx_range("fwd.chunk_h_o"):
        _compiled(builder, H, HV, K, V, BV)(q, k, v, ab, g_cum, gated, h0, seqs, first_chunk, scale, o, ht)
    return o, ht


def _flat(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Checked API inputs -> q, k [B T, H, K], v [B T, HV, V] bf16; g, beta [B T, HV] fp32; the
    scale; the sequence bounds int32 [N + 1]; h0 [N, HV, K, V] fp32 (zeros without
    initial_state)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = (x.contiguous().view(B * T, H, K) for x in (q, k))
    v = v.contiguous().view(B * T, HV, V)
    g, beta = (x.to(torch.float32).contiguous().view(B * T, HV) for x in (g, beta))
    seqs = seq_bounds(cu_seqlens, B, T, q.device)
    h0 = (torch.zeros(seqs.shape[0] - 1, HV, K, V, dtype=torch.float32, device=q.device)
          if initial_state is None else initial_state.to(torch.float32).contiguous())
    return q, k, v, g, beta, K ** -0.5 if scale is None else scale, seqs, h0


def forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp=None):
    """Checked API inputs (bf16 q, k, v; K = V = 128) -> (o [B, T, HV, V] bf16, final state or None).

    ``cp``: AutoCP's split (``segment_chunks``' ``force``): None decides, False
    never splits, True splits by the rule, an int is the segment length in chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    q, k, v, g, beta, scale, seqs, h0 = _flat(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if B * T == 0:
        return (torch.empty(B, T, HV, V, dtype=torch.bfloat16, device=device),
                h0.clone() if output_final_state else None)
    sms = autocp.num_sms(device)
    bounds, (R, BV, wy, L) = launch_decisions(cu_seqlens, B, T, H, HV, V, sms, cp)
    p = segment_plan(cu_seqlens, B, T, HV, sms, device, L, bounds)
    store_wy = wy and p is None
    g_cum, _, first_chunk, ab, gated = solved(H, HV, R, store_wy, k, beta, g, seqs, cu_seqlens, B, T)
    if p is not None:  # AutoCP: the fused kernel walks segments, each from its own initial state
        h0 = segment_states(p, k, v, g, g_cum, beta, ab, gated, h0)
        # segments as sequences; gated stays indexed by the whole sequences' chunk rows
        seqs, first_chunk = p.bounds, p.first_chunk
        BV = equal_lengths_width(seqs.shape[0] - 1, HV, V, sms)  # segment rows: equal lengths
    o, ht = chunk_h_o(H, store_wy, BV, q, k, v, ab, g_cum, gated, h0, seqs, first_chunk, scale)
    if p is not None and output_final_state:
        ht = ht.index_select(0, p.last_segment)  # the state a sequence's last segment leaves
    return o.view(B, T, HV, V), (ht if output_final_state else None)


def final_state(q, k, v, g, beta, scale, initial_state, transition: bool = False, cp=True):
    """One sequence's final state without its outputs: checked inputs of one sequence (q, k
    [1, T, H, K], v [1, T, HV, V] bf16; g, beta [1, T, HV]; initial_state [1, HV, K, V] or None)
    -> (the final state [1, HV, K, V] fp32 that ``forward(..., cp=cp)`` gives, and with
    ``transition`` the transition M [1, HV, K, K] fp32, the final state from h0 = I with v = 0,
    else None). ``flashqla.cp``'s boundary pass.

    It launches what ``forward(..., cp=cp)`` launches (``cp`` True: the rule's forced L; an int is
    L), but the fused kernel over the last segment alone: ``solved``, ``window_states`` and
    ``chain_states`` (every segment's initial state h_j), then ``chunk_h_o`` over the last
    segment's tokens and chunk rows from its h_j, at that segment's ``block_v`` (BV 16 where HV V /
    16 CTAs fit the SMs). So it costs the solve over all T tokens, the warm-up over every window
    (an exact head's: the whole previous segment), J chain steps and the last segment's chunks (at
    most L) on HV V / BV CTAs. ``transition`` adds two launches: the chain from h0 = I with Z = 0
    (the windows, and the warm-up's M, read no v: the warm-up's Z with v = 0 is zero) and the
    fused kernel with v = 0 over the last segment. Where the split leaves one segment (with cp
    True: T <= 8 chunks, L being at least autocp.MIN_SEGMENT_CHUNKS), ``forward`` runs whole (for
    M a second one, v = 0 from h0 = I)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if B != 1:
        raise ValueError(f"flashqla.fwd.final_state: `q` must be one sequence [1, T, H, K]; got {tuple(q.shape)}")
    device = q.device
    fp32 = dict(dtype=torch.float32, device=device)
    eye = torch.eye(K, **fp32).expand(1, HV, K, K) if transition else None
    sms = autocp.num_sms(device)
    bounds, (R, _, _, L) = launch_decisions(None, 1, T, H, HV, V, sms, cp)
    num_chunks = -(-T // CHUNK_SIZE)
    if L == 0 or L >= num_chunks:  # one segment: the last one is the whole sequence
        ht = forward(q, k, v, g, beta, scale, initial_state, True, None)[1]
        return ht, (forward(q, k, torch.zeros_like(v), g, beta, scale, eye, True, None)[1]
                    if transition else None)
    q, k, v, g, beta, scale, seqs, h0 = _flat(q, k, v, g, beta, scale, initial_state, None)
    p = segment_plan(None, 1, T, HV, sms, device, L, bounds)
    g_cum, _, _, ab, gated = solved(H, HV, R, False, k, beta, g, seqs, None, 1, T)
    z, m, exact = window_states(p, k, v, g, g_cum, beta, ab, gated)
    # the last segment, host integers: segment j holds tokens [j L C, (j + 1) L C) and chunk rows
    # [j L, (j + 1) L); its h_j is segment row j (one sequence: its rows are 0, 1, ...)
    last = (num_chunks - 1) // L
    start = last * L * CHUNK_SIZE
    rows = slice(last * L, num_chunks)
    tokens = slice(start, T)
    seg_bounds = seq_bounds(None, 1, T - start, device)             # [0, its tokens]
    seg_first_chunk = seq_bounds(None, 1, num_chunks - last * L, device)  # [0, its chunks]
    BV = block_v([num_chunks - last * L], HV, V, sms)

    def last_segment(values, h_seg):
        return chunk_h_o(H, False, BV, q[tokens], k[tokens], values, ab[tokens], g_cum[tokens],
                         gated[rows], h_seg[last:last + 1], seg_bounds, seg_first_chunk, scale)[1]

    ht = last_segment(v[tokens], chain_states(p, h0, z, m, exact))
    if not transition:
        return ht, None
    h_seg = chain_states(p, eye.contiguous(), torch.zeros_like(z), m, exact)
    return ht, last_segment(torch.zeros(T - start, HV, V, dtype=torch.bfloat16, device=device), h_seg)
