"""gdn_fwd, stage 44: s43 with AutoCP's phase 1 (the warm-up kernel) on two dependent products a
chunk, the state transposed in the chain's registers, and X = Ab^T K built beside it. The
library's forward (``flashqla.fwd``).

What it adds over s06, the previous milestone (the road between them is the book's Lab log, 36
gdn_fwd stages and 17 of the cumsum and the solve): s06 is AutoCP over s05's warp-specialized kernel
on s03's math, with s02's four preparation kernels. s44 runs s04's reformulated math on those roles
(s07) with a chain stripped to its products (s10), at a width chosen per launch from the sequence
lengths: 16 or 32 value columns a CTA for few heads (s12, s33), 64 or 128 with the state in a
warpgroup of its own and O stored by TMA (s14, s16, s34), and, where the solve can store WY (Gamma *
Ab), a kernel holding S^T in the chain's registers (s36, s40). Its preparation is two launches, the
cumsum writing the chunk table (chunk_local_cumsum.s03) and the gate-free solve
(gate_free_solve.s15), or one, the solve making both in its prologue (s16); the solve's blocked
inverse runs its block levels on mma.sync (s06, s15) at a grouping of heads and CTAs an SM chosen
for the grid (s11, s14). AutoCP became lean: the plan from the lengths on the host, the windows in
one kernel (s18), phase 1 on warp roles, now two dependent products a chunk (s20, s44), phase 2 in
one kernel (s21, s24), a rule that prices every segment length by phase 3's waves (s25), refitted to
each sweep. Every kernel is a programmatic dependent (s27). Why: each step removed what the role
timelines, Nsight Compute or the split sweeps showed on the critical path. The effect, each against
FlashQLA in the same run: s05's pipeline took 2.870 ms on (16, 64) 1x32768 against FlashQLA's 1.522
(0.53x its speed; one H200, s07's run); s44's takes 1.126 against 1.561 (1.39x; one H100, fbf3c07),
and is at least FlashQLA's speed on all 40 problems of the benchmark (below).

What changed from s43, the stage before it: the warm-up kernel (``warmup_kernel``) and the rule's
costs (below); the windows, phase 2 and phase 3 are s43's. s23's kernel walks each window as the
fused kernel's chain does,

    U = K S,  W = V - diag(exp g) U,  V~ = WY W,  S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~

three products in a row on the state's path, with S and Vd handed between a state and a value
warpgroup through shared memory and WY = Gamma * Ab built by a third. The gate-free solve gives
WY = D Ab D^-1 (D = diag(exp g)), so the state's update folds into one product by a matrix that
does not depend on S (FlashQLA's prepare_h uses the same algebra):

    K^T diag(exp(g_C - g)) D Ab D^-1 (V - D U) = K^T Ab (diag(exp(g_C - g)) V - exp(g_C) U)
    S^T <- exp(g_C) S^T + V^T XB + (-U^T) XA,   X = Ab^T K (64 x 128),
                                                XB = diag(exp(g_C - g)) X,  XA = exp(g_C) X

A chunk whose solve kept the gate (``gated``: Ab already holds Gamma) uses X = (diag(exp(g_C - g))
Ab)^T K, XB = X, XA = diag(exp g) X instead (the same update with W's factor on U). Every factor
is exp of a non-positive exponent. The roles (``warmup_kernel``):

    chain      S^T (64 x 128 fp32) in registers: U^T = S^T K^T, V^T XB issued beside it, then
               S^T += (-U^T) XA: two dependent products, no shared-memory hand-off of S or V~
    x          X = Ab^T K (a wgmma from shared memory), XA and XB to shared memory, a chunk ahead
    producer   TMA loads of K, V and Ab into two stages; g, exp(g), exp(g_C - g)

M tiles (exact heads) run the same chain from I with V = 0 (no V^T XB product).

Then the rule (``segment_chunks``, s25's form): with phase 1 cheaper a chunk of a split costs 1.85
steps a wave (WAVE_CHUNK_STEPS; s25: 2.45), and the unsplit launch that stores WY (BV 64 after a
solve of three or four heads a CTA: s40's kernel) is weighed at its own step, WY_STEP = 0.75, not
s16's 1.0 (``launch``). Both from this stage's split sweep (``profiles/split_lab.py --stage 44``,
``results/autocp_split.csv``, one H100, 71f4b9e and fbf3c07): 1.7-2.0 is where s25's rule with
SEGMENT_STEPS and FIXED_STEPS kept picks within 3 % of the fastest on all six problems of the
first call; the WY launch took 0.71-0.88 steps against the splits it beat ((16, 48) and (16, 64)
1x32768 and 28672+4096), and below 0.8 none of them splits. On the benchmark's 40 problems the
refit changes two choices: (8, 32) and (16, 32) 1x8192 split at L 32.

Why: phase 1 is L chunks of one CTA's chain latency on every exact head's tile (s23: 3.0 us a
chunk, 338 us of the forward's 854 on (8, 24) 28672+4096, one H100, 2066b86,
``results/timeline_weak_rows.csv``); FlashQLA's phase 1 there took 249 + 36 us.

Measured effect (one H100). The forward, s43 and this stage at s43's rule, ``bench.time_row`` in one
process (commit cd21a8d, ``results/warmup_two_products.csv``), ms:

    problem              s43      s44
    (8, 24) 28672+4096  0.8245   0.6469
    (8, 24) 1x32768     0.7776   0.6227
    (16, 16) 1x32768    0.5726   0.4639
    (2, 8) 1x32768      0.3171   0.2580
    (4, 16) 1x32768     0.5233   0.4288
    (8, 32) 1x32768     0.9534   0.7498
    (16, 32) 28672+4096 1.0434   0.8521
    (16, 16) 28672+4096 0.5721   0.4683
    (2, 8) 1x8192       0.1468   0.1184
    (4, 16) 28672+4096  0.5139   0.4135
    (16, 16) 1x8192     0.2037   0.1736
    (8, 24) 1x8192      0.2497   0.2060

0.78-0.85x s43's time on every split problem. With the refitted rule, (8, 32) 1x8192 0.244 ms and
(16, 32) 1x8192 0.254 against s43's unsplit 0.293 (fbf3c07). Promoted (fbf3c07): with the peers
in the same run (``python -m flashqla bench``, all 40 problems, three calls on one H100) the API is
1.05-2.06x FlashQLA's speed (geomean 1.33x, at least its speed on all 40; (8, 24) 28672+4096 0.667
ms against 0.798), 1.39-4.21x FLA's (geomean 2.74x); (16, 64) 1x32768 (unsplit, unchanged) 1.126
ms, 2.22x the floor. Its GPU tests passed: Z and M against float64 within TOLERANCE_FACTOR x s23's
error, on plain, flagged (gated chunks in exact windows) and broken inputs (cd21a8d); AutoCP's CP
on against off per head, determinism and graph replay (71f4b9e); the public shapes (fbf3c07);
the library's forward bit for bit this stage's (test_promoted, fbf3c07).

Taught in: notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds, num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "gdn_autocp_warmup_two_products")

S43 = stages.load("gdn_fwd", 43)        # the forward this one edits: its prologue
S42 = S43.S42                           # where s40's kernel runs (s37's stores_wy)
S34, S37, S40 = S42.S34, S42.S37, S42.S40
S27 = S34.S27                           # AutoCP's windows and phase 2, the pass configs
S23 = S27.S24.PIPELINE                  # the warm-up kernel this one replaces
CHUNK_SIZE = S43.CHUNK_SIZE
HEAD_DIM = S43.HEAD_DIM
STEP = S34.STEP
LOG2E = S34.LOG2E
DEFAULT_SHAPE = dict(H=16, HV=32)
BLOCK = S23.BLOCK                       # state columns per CTA (a Z or an M tile), as s20 and s23

WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP    # [0, 128)   chain: owns S^T; U^T = S^T K^T, S^T += V^T XB - U^T XA
X_END = 2 * WARPGROUP        # [128, 256) x: X = Ab^T K, XA and XB, a chunk ahead
THREADS = 3 * WARPGROUP      # [256, 384) producer: TMA loads of k, v, Ab; the gates
# register budgets (setmaxnreg, per thread), within the launch's 65536 / 384 = 170
REGS_CHAIN = 232             # S^T (64 fp32 a thread), its bf16 copy (32), U^T (32), -U^T bf16 (16)
REGS_X = 168                 # X (64 fp32 a thread), XA or XB in bf16 (32): the launch's own
REGS_PRODUCER = 40           # addresses, the gates
assert (REGS_CHAIN + REGS_X + REGS_PRODUCER) * WARPGROUP <= 65536

NUM_STAGES = 2               # tile stages: the producer fills chunk c + 2 once chunk c is consumed
NUM_HANDOFF = 2              # XA / XB slots: chunk c + 1's are built while the chain reads c's

# the rule (s25's form, ``segment_chunks``), in chunk steps of phase 3 at BV 64
S25 = stages.load("gdn_fwd", 25)          # the rule this stage refits
WAVE_CHUNK_STEPS = 1.85      # per chunk of a segment and wave of phase 3 (phases 1 and 3; s25: 2.45)
SEGMENT_STEPS = S25.SEGMENT_STEPS    # per segment of the longest sequence (phases 1 and 2)
FIXED_STEPS = S25.FIXED_STEPS        # once (windows, phase 2's launch)
WY_STEP = 0.75               # a chunk step of the unsplit launch where it runs s40's kernel after a
                             # solve storing WY (BV 64, three or four heads a CTA; STEP[64] = 1.0 is s16's)


def warmup_kernel(H: int, HV: int):
    """The T.prim_func of phase 1 for H key heads and HV value heads; any token or slot count.
    s23's grid and outputs: (V + K) / BV column tiles per (slot, value head), V / BV of Z, K / BV
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
        with T.Kernel((V + K) // BV, HV, num_slots, threads=THREADS) as (i_t, i_hv, i_s):
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
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
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

            elif tx >= CHAIN_END and tx < X_END:  # ---- the x warpgroup
                T.set_max_nreg(REGS_X, 1)
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

            elif tx >= X_END:  # ---- the producer warpgroup
                T.set_max_nreg(REGS_PRODUCER, 0)
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


@functools.cache
def _warmup(H: int, HV: int):
    return compile_hopper(dependent_launch(warmup_kernel(H, HV)), S27.FUSED_CONFIGS)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the warm-up kernel at (16, 32)."""
    return _warmup(**DEFAULT_SHAPE).get_kernel_source()


def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, unsplit_step: float,
                   force: bool | int | None = None) -> int:
    """s25's rule at this stage's costs: the cheapest of LADDER's lengths (at most a third of the
    longest sequence) and s18's L0, 2 L0 (where they leave two segments or more), each costing
    WAVE_CHUNK_STEPS L waves + SEGMENT_STEPS J + FIXED_STEPS; automatic (``force`` None): that L
    if cheaper than ``unsplit_step`` x the longest sequence, else 0. ``force``: False never
    splits, True splits at the cheapest, an int is L."""
    s18 = S25.PIPELINE.CHAIN.PIPELINE.PIPELINE
    if force is not None and force is not True:
        return s18.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, force)
    L0 = s18.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, True)
    if not L0:
        return 0
    longest = max(seq_chunks)
    lengths = ({L for L in S25.LADDER if 3 * L <= longest}
               | {L for L in (L0, 2 * L0) if L and -(-longest // L) >= 2})
    priced = []
    for L in sorted(lengths):
        segments = sum(-(-c // L) for c in seq_chunks)
        waves = -(-2 * HV * segments // (S25.PHASE3_CTAS_PER_SM * num_sms))
        priced.append((WAVE_CHUNK_STEPS * L * waves + SEGMENT_STEPS * -(-longest // L) + FIXED_STEPS, L))
    if force is True:
        return min(priced)[1] if priced else L0
    return min(priced + [(unsplit_step * longest, 0)])[1]


def split_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, cp, unsplit_step: float):
    """s26's ``split_plan`` with this stage's rule (None: no split)."""
    if cp is None or cp is True:
        bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
        seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                      else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
        cp = segment_chunks(seq_chunks, HV, num_sms, unsplit_step, cp) or False
    return S27.PIPELINE.PIPELINE.split_plan(cu_seqlens, B, T, HV, num_sms, device, cp, unsplit_step)


def launch(q, v, cu_seqlens, cp):
    """(BV, AutoCP's plan or None, whether the solve stores WY) for inputs q [B, T, H, K], v [B, T,
    HV, V]: host integers only (the lengths the API read once). The unsplit launch at BV 64 after a
    solve of three or four heads a CTA is s40's, with WY stored by the solve (s37's condition); the
    rule weighs it at its own step, WY_STEP."""
    B, T, H = q.shape[:3]
    HV, V = v.shape[2], v.shape[3]
    sms = autocp.num_sms(q.device)
    BV = S27.S18.PIPELINE.launch_width(cu_seqlens, B, T, HV, V, sms, STEP)  # the width rule (s15, s17)
    R = S42.S30.SOLVE.BY_FORWARD.heads_per_cta(H, HV, num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE), sms)
    wy = BV == S37.WY_BLOCK_V and R > S42.S30.SOLVE.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS
    p = split_plan(cu_seqlens, B, T, HV, sms, q.device, cp, WY_STEP if wy else STEP[BV])
    return BV, p, wy and p is None


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s43's forward with this stage's phase 1 and rule (``cp`` None decides, False never splits,
    True splits at the rule's cheapest L, an int is the segment length in chunks)."""
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
    BV, p, store_wy = launch(q.view(B, T, H, K), v.view(B, T, HV, V), cu_seqlens, cp)
    with nvtx_range("gdn_fwd.s44"):
        S43.prologue(store_wy)(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)
    if p is not None:  # AutoCP: windows, phase 1 (Z, M: this stage's kernel), phase 2
        J = p.max_segments
        win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
        exact = torch.empty_like(win_start)
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
        with nvtx_range("gdn_fwd.s44"):
            S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                         p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
            _warmup(H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk, exact, z, m)
            S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
        h0, seqs, first_chunk = h_seg, p.bounds, p.first_chunk
        BV = S27.S18.PIPELINE.block_v([1] * (seqs.shape[0] - 1), HV, V, sms, STEP)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("gdn_fwd.s44"):
        # o, final states <- the fused chain and output over sequences (or segments)
        (S40._wide if store_wy else S34.fused)(H, HV, K, V, BV)(q, k, v, ab, g_cum, gated, h0, seqs, first_chunk, scale, o, ht)
    if p is not None and output_final_state:
        ht = ht.index_select(0, p.last_segment)  # the state a sequence's last segment leaves
    return o.view(B, T, HV, V), (ht if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s44: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s44: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s44: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s44: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
