"""gdn_fwd, stage 18: s17's forward with a lean AutoCP split: phase 1 from the solve's Ab, the
windows in one kernel, the plan built on the host.

What changed from s17 (whose split is s13's, s08's and s06's): everything before phase 3.

    s17                                             s18
    plan      ~30 small torch launches, on the      built on the host from the lengths that the
              device, at every call                 width rule already reads (``autocp.host_plan``),
                                                    copied once and kept (a captured graph keeps it)
    phase 1   chunk_fwd_intra.s01 makes w, u over   ``warmup_kernel`` below reads k, v and the solve's
              the whole sequence, then s06's        Ab, as the fused kernels do: per chunk
              warm-up kernel walks them             U = K S, W = V - diag(exp(g)) U,
                                                    V~ = (Gamma * Ab) W, S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~
    windows   ``autocp.bound_violations`` and       ``windows_kernel`` below, one CTA per (slot,
              ``autocp.warmup``: ~25 torch          value head): the bound's conditions over the
              launches (a norm of every k, scans)   previous segment from g, beta and the solve's
                                                    ``gated`` flags, and the window's length
    phase 2   unchanged (one fp32 batched matmul per segment boundary)
    phase 3   unchanged (s17's fused kernels at the equal-length width rule)

Why: on 4 x H100 (commit b31b755, ``.diag`` breakdown by cumulative graph prefixes) s17's split of
(2, 8) 1 x 32768 at L = 64 took 882 us: cumsum 12, solve 70, plan 80, chunk_fwd_intra 197,
bound check and windows 109, warm-up 143, chaining 70, phase 3 199; FlashQLA's whole forward
took 395. On (4, 16) and (16, 16) chunk_fwd_intra alone took 394-404 us and the windows
131-217, so s17 did not split them at all (1.05-1.10 ms against FlashQLA's 0.67-0.69).

The bound's conditions, as ``autocp.bound_violations`` checks them per token (g_t <= 0,
0 <= beta_t ||k_t||^2 <= 2, no NaN), come here from data that is already on the device:
beta_t ||k_t||^2 > 2 is the solve's ``gated`` flag (it computes beta_i (K K^T)_ii for that
purpose), and the rest needs g and beta only (||k||^2 >= 0, so beta_t ||k_t||^2 < 0 needs
beta_t < 0). The only difference: a NaN in k is not seen here (s17 saw it through the norm). It
makes that token's own outputs NaN whatever the split. A token with k = 0 and beta < 0 counts here
and did not there: such a head runs exactly, which is never wrong.

The rule (``segment_chunks``) is new too. s17's filled one CTA an SM; here the segments fill two
(PHASE3_CTAS_PER_SM), because the fused kernel at BV 64 runs two CTAs an SM at once, and a split
must cost less than the unsplit launch in the rule's model, fitted to the sweep below: per chunk
of a segment 4.4 chunk steps at BV 64 (phases 1 and 3), per segment 3.6 (phase 2's matmul), once
33 (about 9.2, 7.5 and 70 us on an H100). The lengths come from ``host_bounds``, so the rule sees
the real longest sequence; phase 2 chains J = that sequence's segments (s17's J counted all the
tokens of a varlen batch).

Measured effect (``profiles/split_lab.py`` -> ``profiles/results/autocp_split.csv``, 4 x H100, commit
c585a80, CUDA-graph replay; its GPU tests passed there: CP on against CP off, the windows kernel
against ``autocp.warmup`` bit for bit, capture with and without an eager call), ms:

    problem              unsplit  s18 at the rule's L   s17     FlashQLA
    (2, 8) 1x32768        0.999   0.555 (L 32)          0.844   0.401
    (2, 8) 28672+4096     0.873   0.556 (L 32)          0.869   0.393
    (4, 16) 1x32768       1.027   0.850 (L 64)          1.055   0.667
    (4, 16) 28672+4096    0.940   0.857 (L 64)          0.961   0.696
    (16, 16) 1x32768      1.089   0.933 (L 64)          1.109   0.693
    (16, 16) 28672+4096   1.004   0.937 (L 64)          1.001   0.721
    1 x 8192, 2048; (8, 24), (8, 32), (16, 32) x 32768: not split (every split measured lost)

So 1.07-1.56x s17 where it splits, still 0.71-0.81x FlashQLA there. Where the rest goes (the
prefix breakdown above, s17's, still applies to phases 2 and 3): phase 2 is J - 1 fp32 batched
matmuls of ~8 us each (136 us at J = 16; FlashQLA chains in one 56 us kernel), and phase 3 at two
CTAs an SM takes ~3.4 us a chunk step of each segment (111 us for 32 chunks on (2, 8)).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds

NEEDS = ("hopper",)
# wgmma: the warm-up's K S, (Gamma * Ab) W and K^T Vd; tma_load: its tiles; the fused kernels'
# tma_store and role register budgets (setmaxnreg)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "warpgroup_reg_alloc")

PIPELINE = stages.load("gdn_fwd", 15)   # the fused launch, the width rule
WIDTHS = stages.load("gdn_fwd", 17).WIDTHS
SOLVE = ("gate_free_solve", 5)          # Ab and the gated flags
CHUNK_SIZE = 64                         # C: tokens per chunk, one 64-row wgmma tile
HEAD_DIM = 128                          # K = V = 128 only (M is K x K, tiled like the state's V columns)
BLOCK = 64                              # state columns per CTA of the warm-up kernel
THREADS = 128                           # the warm-up's consumer warpgroup (TileLang adds a producer)
WINDOW_THREADS = 256                    # the windows kernel: a token of the previous segment a thread
UNROLL = 4                              # ... four at once
MAX_WINDOW = autocp.MAX_WARMUP_CHUNKS   # chunks a window may take before the head runs exactly
PHASE3_CTAS_PER_SM = 2                  # segments fill two of phase 3's CTAs an SM (``segment_chunks``)
SEGMENT_CHUNK_STEPS = 4.4               # the split's cost per chunk of a segment (phases 1 and 3) ...
SEGMENT_STEPS = 3.6                     # ... per segment (phase 2's matmul a boundary) ...
FIXED_STEPS = 33                        # ... and once (windows, launches), in chunk steps at BV 64
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)       # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


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


def warmup_kernel(H: int, HV: int):
    """The T.prim_func of phase 1 for H key heads and HV value heads; any token or slot count.
    Grid: (V + K) / BLOCK column tiles per (slot, value head), V / BLOCK of Z, K / BLOCK of M; an M
    tile of a warm-up head, and every tile of a slot without a window, only writes its zeros."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, V, BV = CHUNK_SIZE, HEAD_DIM, HEAD_DIM, BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def gdn_autocp_warmup_ab(
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
            row0 = slot_chunk[i_s] - (eos - bos) // C          # chunk row of the window's first chunk

            k_s = T.alloc_shared((C, K), "bfloat16")
            v_s = T.alloc_shared((C, BV), "bfloat16")
            ab_s = T.alloc_shared((C, C), "bfloat16")
            g_s = T.alloc_shared((C,), "float32")
            s_s = T.alloc_shared((K, BV), "bfloat16")          # S in bf16, the wgmma operand
            w_s = T.alloc_shared((C, BV), "bfloat16")
            wy_s = T.alloc_shared((C, C), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")         # diag(exp(g_C - g)) V~
            s_f = T.alloc_fragment((K, BV), "float32")         # the state S, fp32, all along
            x_f = T.alloc_fragment((C, BV), "float32")
            vn_f = T.alloc_fragment((C, BV), "float32")
            keep = T.alloc_var("int32")

            # S <- columns c0.. of I for M tiles of exact heads, else 0
            for d, j in T.Parallel(K, BV):
                s_f[d, j] = T.if_then_else(take_m & (d == c0 + j), 1.0, 0.0)

            # the window's chunks are whole: it ends at a segment start and takes whole chunks
            # of the previous segment, all of whose chunks are full
            for c in T.Pipelined((eos - bos) // C, num_stages=2):
                t0 = bos + c * C
                keep = gated[row0 + c, i_hv]
                # K, V, Ab <- the chunk's 64-row tiles (TMA)
                T.copy(k[t0:t0 + C, i_h, :], k_s)
                T.copy(v[t0:t0 + C, i_hv, c0:c0 + BV], v_s)
                T.copy(ab[t0:t0 + C, i_hv, :], ab_s)
                # g <- log2(e) g_cum
                for i in T.Parallel(C):
                    g_s[i] = g_cum[t0 + i, i_hv] * LOG2E
                # WY <- Gamma * Ab on j <= i (Ab as stored for a gated chunk), 0 above
                for i, j in T.Parallel(C, C):
                    wy_s[i, j] = T.if_then_else(
                        j <= i, ab_s[i, j] * T.if_then_else(keep != 0, 1.0, T.exp2(T.min(g_s[i] - g_s[j], 0))), 0)
                # U <- K S
                T.copy(s_f, s_s)
                T.gemm(k_s, s_s, x_f, clear_accum=True)
                # W <- V - diag(exp(g)) U (V read as 0 for M: v = 0)
                for i, j in T.Parallel(C, BV):
                    w_s[i, j] = T.if_then_else(is_m, 0.0, v_s[i, j]) - T.exp2(g_s[i]) * x_f[i, j]
                # V~ <- WY W
                T.gemm(wy_s, w_s, vn_f, clear_accum=True)
                # V_d <- diag(exp(g_C - g)) V~
                for i, j in T.Parallel(C, BV):
                    vd_s[i, j] = vn_f[i, j] * T.exp2(g_s[C - 1] - g_s[i])
                # S <- exp(g_C) S + K^T V_d
                for d, j in T.Parallel(K, BV):
                    s_f[d, j] = s_f[d, j] * T.exp2(g_s[C - 1])
                T.gemm(k_s, vd_s, s_f, transpose_A=True)

            # Z or M tile <- S
            if is_m:
                T.copy(s_f, m[i_s, i_hv, :, c0:c0 + BV])
            if i_t < V // BV:
                T.copy(s_f, z[i_s, i_hv, :, c0:c0 + BV])

    return gdn_autocp_warmup_ab


@functools.cache
def _windows(HV: int):
    return compile_hopper(windows_kernel(HV))


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(warmup_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape: the windows and warm-up kernels,
    then s17's fused kernels."""
    return (_windows(DEFAULT_SHAPE["HV"]).get_kernel_source() + _compiled(**DEFAULT_SHAPE).get_kernel_source()
            + PIPELINE.kernel_source(WIDTHS))


def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, unsplit_step: float,
                   force: bool | int | None = None) -> int:
    """The decision rule: chunks per segment L, or 0 for no split, from the sequences' chunk
    counts (host integers). Phase 3 runs lanes = 2 HV CTAs a segment (BV 64); L is the shortest
    length (at least ``autocp.MIN_SEGMENT_CHUNKS``) whose segments fit PHASE3_CTAS_PER_SM CTAs on
    every SM, J the segments of the longest sequence. Automatic (``force`` None): split when the
    split's cost, SEGMENT_CHUNK_STEPS L + SEGMENT_STEPS J + FIXED_STEPS, is below the unsplit
    launch's, ``unsplit_step`` x the longest sequence (its width's step, ``WIDTHS.step``), in
    chunk steps at BV 64. ``force``: False never splits, True splits at this L, an int is L."""
    longest = max(seq_chunks, default=0)
    if force is False or longest == 0:
        return 0
    if not isinstance(force, bool) and isinstance(force, int):
        if force < 1:
            raise ValueError(f"gdn_fwd.s18: `cp` as segment length must be >= 1 chunk; got {force}")
        return force
    lanes = 2 * HV
    def fits(L):  # segments shrink in count as L grows: bisect for the shortest L that fits
        return L >= longest or lanes * sum(-(-c // L) for c in seq_chunks) <= PHASE3_CTAS_PER_SM * num_sms
    L, hi = autocp.MIN_SEGMENT_CHUNKS, max(autocp.MIN_SEGMENT_CHUNKS, longest)
    while L < hi:
        mid = (L + hi) // 2
        L, hi = (L, mid) if fits(mid) else (mid + 1, hi)
    J = -(-longest // L)
    if force is None and (J < 2 or SEGMENT_CHUNK_STEPS * L + SEGMENT_STEPS * J + FIXED_STEPS
                          >= unsplit_step * longest):
        return 0
    return L


def split_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, cp, unsplit_step: float):
    """The AutoCP plan (``autocp.Plan`` with ``slot_chunk``) or None (``segment_chunks``), with
    the lengths the host knows (``host_bounds``; inside a capture with no read before, one
    sequence of all the tokens stands for them). The plan comes from the host (``autocp.host_plan``),
    or is built on the device inside a capture that has no plan kept for these lengths."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                  else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
    L = segment_chunks(seq_chunks, HV, num_sms, unsplit_step, cp)
    if not L or num_seqs == 0:
        return None
    p = None if bounds is None else autocp.host_plan(bounds, L, device)
    if p is None:
        p = autocp.plan(cu_seqlens, B, T, HV, num_sms, HEAD_DIM // 64, device, force=L)
        p = autocp.dataclasses.replace(p, slot_chunk=autocp.slot_chunks(cu_seqlens, B, T, L, p.max_segments, device))
    return p


def windows(p, g, g_cum, beta, gated, threshold: float = autocp.THRESHOLD):
    """``autocp.warmup``'s (window start, exact), int32 [J N, HV] each, from ``windows_kernel``:
    g, g_cum, beta [B T, HV] (fp32), gated [chunks, HV] (the solve's), ``p`` a plan with slot_chunk."""
    HV = g.shape[1]
    win_start = torch.empty(p.slot_start.shape[0], HV, dtype=torch.int32, device=g.device)
    exact = torch.empty_like(win_start)
    with nvtx_range("gdn_fwd.s18"):
        _windows(HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32), p.slot_chunk,
                     p.segment_chunks, float(threshold), win_start, exact)
    return win_start, exact


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """``run`` with the split chosen by the caller: ``cp`` None decides (``autocp.segment_chunks``
    with this stage's costs), False never splits, True splits by the rule, an int is the segment
    length in chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    BV = PIPELINE.launch_width(cu_seqlens, B, T, HV, V, sms, WIDTHS.step)
    p = split_plan(cu_seqlens, B, T, HV, sms, device, cp, WIDTHS.step[BV])
    if p is None:
        o, ht = PIPELINE._fused(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV, WIDTHS)
        return o, (ht if output_final_state else None)

    N, J = p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    win_start, exact = windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV), gated,
                               threshold)
    with nvtx_range("gdn_fwd.s18"):
        # phase 1: Z (and M for exact heads) of every slot's window, from k, v, Ab
        _compiled(H, HV)(k.view(B * T, H, K), v.view(B * T, HV, V), ab.view(B * T, HV, CHUNK_SIZE),
                         g_cum.view(B * T, HV), gated, win_start, p.slot_start, p.slot_chunk, exact, z, m)
    # phase 2: the initial state of every segment row
    h_seg = autocp.segment_initial_states(p, h0, z, m)
    # phase 3: the fused kernel over all segments (of equal length), each from its own state
    rows = p.bounds.shape[0] - 1
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(h_seg.shape, **fp32)
    BV = PIPELINE.block_v([1] * rows, HV, V, sms, WIDTHS.step)
    with nvtx_range("gdn_fwd.s18"):
        stages.load(*WIDTHS.kernels[BV])._compiled(H, HV, K, V, BV)(
            q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
            ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
            h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s18: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s18: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s18: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s18: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
