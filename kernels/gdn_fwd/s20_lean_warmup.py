"""gdn_fwd, stage 20: s18's AutoCP with phase 1 on warp roles: the warm-up walks a window with
the fused kernel's lean chain.

What changed from s18: the warm-up kernel (phase 1), which gives every (segment slot, value head)
the state Z that its window leaves from a zero state, and the transition M = the window's map of
an initial state where the head runs exactly. s18's kernel walked a window in one warpgroup (plus
the producer TileLang adds): each chunk it read g and the gated flag from global memory on the
chain's path, built Gamma * Ab (64 x 64 exponentials), then ran the three products, every step
waiting for the one before. Here ``warmup_kernel`` splits that over three warpgroups, as the
fused kernels do (gdn_fwd.s10):

    producer   TMA loads of the chunk's K, V and Ab tiles into two stages; g, exp(g) and
               exp(g_C - g) (64 exponentials a chunk)
    wy         WY = Gamma * Ab (Ab as stored where the chunk is gated), one chunk ahead of the
               chain, handed over in two slots (``bar_wy_ready`` / ``bar_wy_free``)
    chain      S in fp32 registers: U = K S, W = V - diag(exp g) U, V~ = WY W,
               S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~ (no exponential, no global read)

The math, the grid ((V + K) / BV column tiles of Z and M per (slot, value head)) and the outputs
are s18's; so is everything else in the forward (windows, phase 2, phase 3). The rule's costs
are refitted (``segment_chunks``): a chunk of a segment costs less now, so splits pay at shorter
lengths and on shorter sequences.

Why: on 4 x H100 (commit d8516c1, ``torch.profiler`` device times), s18's warm-up kernel took
231 us of the library forward's 533 on (2, 8) 1 x 32768 (32 chunks a window: 7.2 us a chunk) and
420 of 887 on (4, 16) and (16, 16) 1 x 32768 (64 chunks), where FlashQLA's whole phase 1
(``prepare_h``) took 156 and 294 us; its fused kernel and ours (phase 3) took the same time
(107 against 112 us, 223 against 224).

Measured effect (GPU tests passed on 2 x H100 at commit 9ce8cef: Z and M bit for bit s18's over
every window kind, CP on against CP off, the flags, public shapes):

- the warm-up kernel alone (``torch.profiler``, same process): 0.62-0.68x s18's time: 232 -> 150
  us on (2, 8) 1 x 32768 at L 32 (4.7 us a chunk), 418 -> 260 on (16, 16) 1 x 32768 at L 64,
  108 -> 68 and 130 -> 88 on (2, 8) and (16, 16) 1 x 8192 at L 16. A chunk still costs more
  than in phase 3 (3.3 us at two CTAs an SM): not profiled yet.
- the split sweep (``profiles/split_lab.py --stage 20`` -> ``results/autocp_split.csv``, 2 x
  H100, 9ce8cef, CUDA-graph replay), ms:

      problem              s20 at its L       s18 (its rule)   FlashQLA
      (2, 8) 1x32768       0.483 (L 32)       0.563            0.407
      (2, 8) 28672+4096    0.475 (L 32)       0.558            0.395
      (2, 8) 1x8192        0.229 (L 16)       0.274 (unsplit)  0.163
      (4, 16) 1x32768      0.694 (L 64)       0.856            0.682
      (4, 16) 28672+4096   0.700 (L 64)       0.860            0.701
      (16, 16) 1x32768     0.769 (L 64)       0.937            0.689
      (16, 16) 28672+4096  0.780 (L 64)       0.949            0.734
      1 x 8192 of (4, 16) and (16, 16), 1 x 2048, 1 x 32768 of (8, 32) and (16, 32): no split
      wins by more than 1 % (unsplit as s18)

  1.17-1.23x s18 where both split; (2, 8) 1 x 8192 now splits (1.19x its unsplit launch).
- The rule: s18's L alone no longer is the fastest: on (2, 8) 1 x 8192 it gives L 8 (0.271 ms;
  phase 2's 15 matmuls), where L 16 takes 0.229. So the rule prices L0 and 2 L0, and a chunk
  by how many phase-3 CTAs share an SM (the (16, 16) 1 x 8192 split at L 16, with two a SM,
  loses where (2, 8)'s, with one, wins). ``tests/test_autocp.py`` checks that it picks a fastest
  measured choice (within 2 %) on all 12 problems of the sweep.
- Promoted (the warm-up kernel and the rule, ``flashqla/fwd.py``): the API on 2 x H100 (commit
  7310763, the benchmark's 7 problems whose split changed, every row in one process) is 1.19-1.28x
  s18 and 0.74-1.03x FlashQLA there ((4, 16) 28672+4096: 1.03x; (2, 8) 1x8192: 0.74x, was 0.64x).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds

NEEDS = ("hopper",)
# wgmma: the warm-up's K S, WY W and K^T Vd; tma_load: its tiles; setmaxnreg: its roles' budgets;
# the fused kernels' tma_store
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "warpgroup_reg_alloc", "gdn_autocp_warmup_lean")

PIPELINE = stages.load("gdn_fwd", 18)   # windows, plan, phase 2, phase 3
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
BLOCK = 64                              # state columns per CTA of the warm-up (a Z or an M tile)
# ---- the warm-up's warp roles, one warpgroup each, in thread order
WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP    # [0, 128)   chain: owns S; U = K S, W, V~ = WY W, the state update
WY_END = 2 * WARPGROUP       # [128, 256) wy: WY = Gamma * Ab, one chunk ahead
THREADS = 3 * WARPGROUP      # [256, 384) producer: TMA loads of k, v, Ab; the gates
# ---- their register budgets (setmaxnreg, per thread), within the launch's pool of 3 x 168
# (65536 / 384 threads: each starts with 168)
REGS_PRODUCER = 24           # addresses
REGS_CHAIN = 240             # S (64 fp32 a thread), U / W / Vd (32), V~ (32)
REGS_WY = 160                # Gamma * Ab, 32 elements a thread (released: .dec from 168)
assert REGS_PRODUCER + REGS_CHAIN + REGS_WY <= 3 * 168
NUM_STAGES = 2               # tile stages: the producer fills chunk c + 2 once chunk c is consumed
NUM_HANDOFF = 2              # WY slots: chunk c + 1's is built while the chain reads chunk c's
# the rule's costs (``segment_chunks``), in chunk steps of phase 3 at BV 64 (about 2.1 us on an
# H100): per chunk of a segment at one CTA an SM (phases 1 and 3), per segment (phase 2's matmul a
# boundary), once (windows, launches); fitted to the sweep (``profiles/split_lab.py --stage 20``):
# a point of a grid search where the rule picks a fastest measured split on every problem, as it
# does at 124 of the 125 grid points within +-0.1, +-0.4 and +-4 of it
SEGMENT_CHUNK_STEPS = 2.6
SEGMENT_STEPS = 3.8
FIXED_STEPS = 8
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)       # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def warmup_kernel(H: int, HV: int):
    """The T.prim_func of phase 1 for H key heads and HV value heads; any token or slot count.
    Grid: (V + K) / BLOCK column tiles per (slot, value head), V / BLOCK of Z, K / BLOCK of M; an M
    tile of a warm-up head, and every tile of a slot without a window, only writes its zeros."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C, K, V, BV = CHUNK_SIZE, HEAD_DIM, HEAD_DIM, BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def gdn_autocp_warmup_lean(
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

            # tile stages (producer -> chain, wy); g holds log2(e) g_cum
            k_s = T.alloc_shared((NUM_STAGES, C, K), "bfloat16")      # chain
            v_s = T.alloc_shared((NUM_STAGES, C, BV), "bfloat16")     # chain
            ab_s = T.alloc_shared((NUM_STAGES, C, C), "bfloat16")     # wy
            g_s = T.alloc_shared((NUM_STAGES, C), "float32")          # wy
            eg_s = T.alloc_shared((NUM_STAGES, C), "float32")         # chain: exp(g)
            egd_s = T.alloc_shared((NUM_STAGES, C), "float32")        # chain: exp(g_C - g)
            wy_s = T.alloc_shared((NUM_HANDOFF, C, C), "bfloat16")    # wy -> chain
            # chain only: S in bf16 (the B operand of K S), W (of WY W), Vd (of K^T Vd)
            h_s = T.alloc_shared((K, BV), "bfloat16")
            w_s = T.alloc_shared((C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            h_f = T.alloc_fragment((K, BV), "float32")             # the state S, fp32, all along
            x_f = T.alloc_fragment((C, BV), "float32")             # U, then W, then Vd
            vn_f = T.alloc_fragment((C, BV), "float32")            # V~
            keep = T.alloc_var("int32")                            # this chunk's gated flag
            # v_s and ab_s are read in the accumulator layout (8 rows of 128 bytes per warp access)
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # ---- barriers; arrive counts: every thread of each arriving role arrives once
            bar_tiles_full = T.alloc_barrier([WARPGROUP] * NUM_STAGES)      # producer -> chain, wy
            bar_tiles_empty = T.alloc_barrier([2 * WARPGROUP] * NUM_STAGES)  # chain, wy -> producer
            bar_wy_ready = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)       # wy -> chain
            bar_wy_free = T.alloc_barrier([WARPGROUP] * NUM_HANDOFF)        # chain -> wy

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup
                T.set_max_nreg(REGS_CHAIN, 1)
                # S <- columns c0.. of I for M tiles of exact heads, else 0
                for d, j in T.Parallel(K, BV):
                    h_f[d, j] = T.if_then_else(take_m & (d == c0 + j), 1.0, 0.0)
                for c in T.serial(win_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    # S (fp32 registers) -> bf16: the operand of K S
                    T.copy(h_f, h_s)
                    # U <- K S, issued without waiting, while S <- exp(g_C) S (registers K S does
                    # not read; the update below adds K^T Vd to it)
                    T.wgmma_gemm(k_s[s, :, :], h_s, x_f, clear_accum=True)
                    for i, j in T.Parallel(K, BV):
                        h_f[i, j] = h_f[i, j] * eg_s[s, C - 1]
                    T.wait_wgmma(0)
                    # W <- V - diag(exp(g)) U (V read as 0 for M: the map of S alone)
                    for i, j in T.Parallel(C, BV):
                        x_f[i, j] = T.if_then_else(is_m, 0.0, v_s[s, i, j]) - eg_s[s, i] * x_f[i, j]
                    T.copy(x_f, w_s)
                    # V~ <- WY W, WY from the wy warpgroup; its slot is free once this returns
                    T.barrier_wait(bar_wy_ready[b], (c // NUM_HANDOFF) % 2)
                    T.gemm(wy_s[b, :, :], w_s, vn_f, clear_accum=True)
                    T.barrier_arrive(bar_wy_free[b])
                    # V_d <- diag(exp(g_C - g)) V~
                    for i, j in T.Parallel(C, BV):
                        x_f[i, j] = vn_f[i, j] * egd_s[s, i]
                    T.copy(x_f, vd_s)
                    # S <- S + K^T V_d (S already decayed)
                    T.wgmma_gemm(k_s[s, :, :], vd_s, h_f, transpose_A=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(bar_tiles_empty[s])
                # Z or M tile <- S
                if is_m:
                    T.copy(h_f, m[i_s, i_hv, :, c0:c0 + BV])
                else:
                    T.copy(h_f, z[i_s, i_hv, :, c0:c0 + BV])

            elif tx >= CHAIN_END and tx < WY_END:  # ---- the wy warpgroup
                T.set_max_nreg(REGS_WY, 0)
                for c in T.serial(win_chunks):
                    s = c % NUM_STAGES
                    b = c % NUM_HANDOFF
                    keep = gated[row0 + c, i_hv]
                    T.barrier_wait(bar_tiles_full[s], (c // NUM_STAGES) % 2)
                    T.barrier_wait(bar_wy_free[b], (c // NUM_HANDOFF) % 2 ^ 1)
                    # WY <- Gamma * Ab on j <= i (Ab as stored for a gated chunk), 0 above; the
                    # exponent clamped at 0 so that the masked upper triangle stays finite
                    for i, j in T.Parallel(C, C):
                        wy_s[b, i, j] = T.if_then_else(
                            j <= i,
                            ab_s[s, i, j] * T.if_then_else(keep != 0, 1.0, T.exp2(T.min(g_s[s, i] - g_s[s, j], 0))),
                            0)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_wy_ready[b])
                    T.barrier_arrive(bar_tiles_empty[s])

            elif tx >= WY_END:  # ---- the producer warpgroup
                T.set_max_nreg(REGS_PRODUCER, 0)
                for c in T.serial(win_chunks):
                    s = c % NUM_STAGES
                    t0 = bos + c * C
                    T.barrier_wait(bar_tiles_empty[s], (c // NUM_STAGES) % 2 ^ 1)
                    T.tma_copy(k[t0:t0 + C, i_h, :], k_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(v[t0:t0 + C, i_hv, c0:c0 + BV], v_s[s, :, :], barrier=bar_tiles_full[s])
                    T.tma_copy(ab[t0:t0 + C, i_hv, :], ab_s[s, :, :], barrier=bar_tiles_full[s])
                    # g <- log2(e) g_cum (whole chunks: no padding); the chain's row factors
                    # exp(g_i) and exp(g_C - g_i) (exp(g_C) is the last of the first)
                    for i in T.Parallel(C):
                        g_s[s, i] = g_cum[t0 + i, i_hv] * LOG2E
                    for i in T.Parallel(C):
                        eg_s[s, i] = T.exp2(g_s[s, i])
                        egd_s[s, i] = T.exp2(g_s[s, C - 1] - g_s[s, i])
                    T.barrier_arrive(bar_tiles_full[s])

    return gdn_autocp_warmup_lean


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(warmup_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape: the warm-up kernel, then s18's
    windows, warm-up and fused kernels."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source() + PIPELINE.kernel_source()


def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, unsplit_step: float,
                   force: bool | int | None = None) -> int:
    """The decision rule, s18's with this stage's costs and one more candidate: L0 is s18's L
    (``PIPELINE.segment_chunks``: the shortest whose segments fit two phase-3 CTAs an SM); L0 and
    2 L0 each cost, in chunk steps at BV 64,

        SEGMENT_CHUNK_STEPS L (1 + load / 2) + SEGMENT_STEPS J + FIXED_STEPS

    with J the longest sequence's segments and load the phase-3 CTAs an SM (2 HV a segment): a
    chunk of phases 1 and 3 takes longer where their CTAs share SMs. Automatic (``force`` None):
    the cheaper, if below the unsplit launch's ``unsplit_step`` x the longest sequence, else 0.
    ``force``: False never splits, True splits at the cheaper, an int is L."""
    if force is not None and force is not True:
        return PIPELINE.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, force)
    L0 = PIPELINE.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, True)
    if not L0:
        return 0
    longest = max(seq_chunks)
    costs = []
    for L in (L0, 2 * L0):
        J = -(-longest // L)
        load = 2 * HV * sum(-(-c // L) for c in seq_chunks) / num_sms
        if J >= 2:
            costs.append((SEGMENT_CHUNK_STEPS * L * (1 + load / 2) + SEGMENT_STEPS * J + FIXED_STEPS, L))
    if force is True:
        return min(costs)[1] if costs else L0
    return min(costs + [(unsplit_step * longest, 0)])[1]


def split_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, cp, unsplit_step: float):
    """s18's ``split_plan`` at the segment length of this stage's rule (None: no split)."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                  else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
    L = segment_chunks(seq_chunks, HV, num_sms, unsplit_step, cp)
    return PIPELINE.split_plan(cu_seqlens, B, T, HV, num_sms, device, L if L else False, unsplit_step)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """``run`` with the split chosen by the caller: ``cp`` None decides (``segment_chunks``), False
    never splits, True splits by the rule, an int is the segment length in chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*PIPELINE.SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    widths, fused = PIPELINE.WIDTHS, PIPELINE.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is None:
        o, ht = fused._fused(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV, widths)
        return o, (ht if output_final_state else None)

    N, J = p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    win_start, exact = PIPELINE.windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV),
                                        gated, threshold)
    with nvtx_range("gdn_fwd.s20"):
        # phase 1: Z (and M for exact heads) of every slot's window, on warp roles
        _compiled(H, HV)(k.view(B * T, H, K), v.view(B * T, HV, V), ab.view(B * T, HV, CHUNK_SIZE),
                         g_cum.view(B * T, HV), gated, win_start, p.slot_start, p.slot_chunk, exact, z, m)
    # phase 2: the initial state of every segment row
    h_seg = autocp.segment_initial_states(p, h0, z, m)
    # phase 3: the fused kernel over all segments (of equal length), each from its own state
    rows = p.bounds.shape[0] - 1
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(h_seg.shape, **fp32)
    BV = fused.block_v([1] * rows, HV, V, sms, widths.step)
    with nvtx_range("gdn_fwd.s20"):
        stages.load(*widths.kernels[BV])._compiled(H, HV, K, V, BV)(
            q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
            ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
            h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s20: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s20: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s20: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s20: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
