"""gdn_fwd, stage 06: AutoCP, long sequences cut into segments whose chains run in parallel.

What it adds over s05, the previous milestone: context parallelism on one GPU. s05's kernel
(``CHAIN``; the measurements below ran it on s03's, which s05 replaced with the same interface) is
unchanged; it now runs over segments of L chunks instead of whole sequences, as one varlen problem
whose "sequences" are the segments, each started from its own initial state. Why:
the chain is one sequential walk per (sequence, value head), so (2, 8) on one sequence of 32768
tokens runs 16 CTAs on 132 SMs, each 512 chunks long. With AutoCP it runs 8 segments x 16 CTAs, 64
chunks each. How the initial states come (``flashqla.autocp``; derivation in
notebooks/06_autocp.py):

    plan      segment table and decision, on the device (no host synchronization): L chunks per
              segment from the tokens, sequences, heads and SM count; J slots per sequence
    phase 1   one chain-only kernel (below), per (slot, value head), from the previous segment:
                Z = the chain from zero over the warm-up window (w chunks before the segment, w
                    where the cumulative log decay reaches THRESHOLD = -10; the whole previous
                    segment when that takes more than it or 64 chunks (g = 0 heads), or when a
                    token there breaks the bound's conditions g <= 0, 0 <= beta ||k||^2 <= 2)
                M = for those exact heads only, the same chain run with v = 0 from S = I: the
                    previous segment's transition matrix (K x K); zero for the others
    phase 2   h_0 = h0 of the sequence; h_j = Z_j + M_j h_{j-1}, j = 1 .. J - 1: one fp32
              batched matmul per step over all (sequence, head) (warm-up heads have M = 0, so they
              get Z: an approximation within exp(-10) of the state where their window starts)
    phase 3   CHAIN's fused kernel over all segments at once; the final state of a sequence is
              the one its last segment leaves

To switch the chain, change ``CHAIN``: the stage named there must provide ``PREP_STAGES`` (the
preparation stages giving g_cum, then w, u), ``BLOCK_V`` and ``fused_h_o(q, k, w, u, g_cum,
initial_state, cu_seqlens, scale) -> (o, final state)``, as s03 does.

The warm-up kernel is s03's chain without the output: per chunk, V~ = U - W S and S <- exp(g_C) S
+ K^T diag(exp(g_C - g)) V~ on wgmma, the next chunk's K, W, U arriving by TMA. Its grid has
(V + K) / 64 column tiles per (slot, head): V / 64 for Z, K / 64 for M (u read as 0, S from I);
M tiles of warm-up heads and every tile of slots without a window exit at once.

Measured effect (one H200, profiles/autocp_lab.py -> profiles/results/autocp.csv, median of 20,
CUDA-graph replay / CUDA events around eager calls, same run; one sequence, K = V = 128, h0;
the CSV's "s06 forced on" rows):

    (H, HV) tokens   s03 graph   s06 CP graph (segments x L)   s03 eager   s06 CP eager
    (2, 8)   2048    0.268 ms    0.294 ms (4 x 8)               0.40 ms     1.83 ms
    (2, 8)   4096    0.436       0.402    (8 x 8)               0.51        1.66
    (2, 8)   8192    0.690       0.472    (8 x 16)              0.65        1.36
    (2, 8)  32768    2.264       0.944    (8 x 64)              2.14        1.67
    (2, 8)  65536    4.325       1.507    (8 x 128)             4.23        2.18
    (16, 64) 65536   7.119       7.129    (off: 128 CTAs already)

2.4-2.9x on (2, 8) from 32768 tokens on under a graph. Where the 1.51 ms of (2, 8) x 65536 go:
preparation 0.60 (unchanged from s03), plan (bound check, windows) 0.13, phase 1 0.28 (the
exact heads' 128-chunk walks), phase 2 0.05, phase 3 0.44 (s03's kernel on the whole sequence:
3.71). At 8192: 0.22 + 0.08 + 0.04 + 0.05 + 0.07. The fixed cost (~0.13 ms on the device) loses
at 2048 tokens, so the rule now also asks CP to save at least 40 chunk steps (off at 2048; the
"s06 auto" rows of the CSV were measured with the rule before that). With s05's kernel as the
chain, a 2-segment split lost on (16, 32) 1 x 32768 (2.46 against 2.12 ms, the benchmark at commit
9ef1cd8), so an automatic split now needs 3 segments or more (``autocp.MIN_SEGMENTS``). Eager calls pay ~1.4 ms of
host time for the ~45 small launches of the plan and the chaining: CP pays eagerly only from
about 32768 tokens; it is meant to run captured. (16, 64) forced on (one segment, no split) costs
0.1-0.45 ms more than s03. FlashQLA's forward on (2, 8) 1 x 32768 is 0.40 ms (NOTES.md).

Taught in: notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range

NEEDS = ("hopper",)
# wgmma: W S and K^T V~ of the warm-up chain; tma_load: its K, W, U tiles (cp.async.bulk.tensor)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load")

CHAIN = ("gdn_fwd", 5)  # the stage whose preparation and fused chain + output kernel run the segments
CHUNK_SIZE = 64         # C: tokens per chunk, one 64-row wgmma tile
HEAD_DIM = 128          # K = V = 128 only (M is K x K, tiled like the state's V columns)
BLOCK = 64              # state columns per CTA of the warm-up kernel
THREADS = 128           # one consumer warpgroup (TileLang adds a producer warpgroup)
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def warmup_kernel(H: int, HV: int):
    """The T.prim_func of phase 1 for H key heads and HV value heads; any token or slot count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    C, K, V, BV = CHUNK_SIZE, HEAD_DIM, HEAD_DIM, BLOCK
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def gdn_autocp_warmup(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        win_start: T.Tensor((num_slots, HV), "int32"),         # first token of the window
        win_end: T.Tensor((num_slots,), "int32"),              # the segment's first token
        exact: T.Tensor((num_slots, HV), "int32"),             # 1: M of the window too
        z: T.Tensor((num_slots, HV, K, V), "float32"),
        m: T.Tensor((num_slots, HV, K, K), "float32"),
    ):
        with T.Kernel((V + K) // BV, HV, num_slots, threads=THREADS) as (i_t, i_hv, i_s):
            i_h = i_hv // group
            is_m = i_t >= V // BV                              # a tile of M (else of Z)
            take_m = is_m & (exact[i_s, i_hv] != 0)
            c0 = (i_t % (V // BV)) * BV                        # its columns (K = V)
            bos = win_start[i_s, i_hv]
            eos = T.if_then_else(is_m & (exact[i_s, i_hv] == 0), bos, win_end[i_s])

            k_s = T.alloc_shared((C, K), "bfloat16")
            w_s = T.alloc_shared((C, K), "bfloat16")
            u_s = T.alloc_shared((C, BV), "bfloat16")
            g_s = T.alloc_shared((C,), "float32")
            s_s = T.alloc_shared((K, BV), "bfloat16")          # S in bf16, the wgmma operand
            vd_s = T.alloc_shared((C, BV), "bfloat16")         # diag(exp(g_C - g)) V~
            s_f = T.alloc_fragment((K, BV), "float32")         # the state S, fp32, all along
            vn_f = T.alloc_fragment((C, BV), "float32")
            g_last = T.alloc_local((1,), "float32")

            # S <- columns c0.. of I for M tiles of exact heads, else 0
            for d, j in T.Parallel(K, BV):
                s_f[d, j] = T.if_then_else(take_m & (d == c0 + j), 1.0, 0.0)

            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=2):
                t0 = bos + c * C
                n = T.min(eos - t0, C)                          # real rows of the chunk, 1..64
                # K, W, U <- full 64-row tiles (TMA); K first, as in chunk_h.s01 (g's buffer)
                T.copy(k[t0:t0 + C, i_h, :], k_s)
                T.copy(w[t0:t0 + C, i_hv, :], w_s)
                T.copy(u[t0:t0 + C, i_hv, c0:c0 + BV], u_s)
                # g <- log2(e) g_cum, 0 past the end
                for i in T.Parallel(C):
                    g_s[i] = T.if_then_else(i < n, g_cum[t0 + i, i_hv] * LOG2E, 0)
                T.copy(s_f, s_s)
                # V~ <- U - W S (U read as 0 for M: v = 0)
                T.gemm(w_s, s_s, vn_f, clear_accum=True)
                # V_d <- diag(exp(g_C - g)) V~, rows >= n zero
                g_last[0] = g_s[n - 1]
                for i, j in T.Parallel(C, BV):
                    vd_s[i, j] = T.if_then_else(
                        i < n,
                        T.if_then_else(is_m, -vn_f[i, j], u_s[i, j] - vn_f[i, j])
                        * T.exp2(g_last[0] - g_s[i]), 0)
                # S <- exp(g_C) S + K^T V_d
                for d, j in T.Parallel(K, BV):
                    s_f[d, j] = s_f[d, j] * T.exp2(g_last[0])
                T.gemm(k_s, vd_s, s_f, transpose_A=True)

            # Z or M tile <- S
            if is_m:
                T.copy(s_f, m[i_s, i_hv, :, c0:c0 + BV])
            if i_t < V // BV:
                T.copy(s_f, z[i_s, i_hv, :, c0:c0 + BV])

    return gdn_autocp_warmup


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(warmup_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """``run`` with the split chosen by the caller: ``cp`` None decides (``autocp.segment_chunks``),
    False never splits, True splits by the rule, an int is the segment length in chunks."""
    base = stages.load(*CHAIN)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    cumsum, kkt, solve, w_u = (stages.load(op, number).run for op, number in base.PREP_STAGES)
    g_cum = cumsum(g, cu_seqlens, CHUNK_SIZE).contiguous()
    Ai = solve(kkt(k, g_cum, beta, cu_seqlens, CHUNK_SIZE), cu_seqlens, CHUNK_SIZE)
    w, u = (x.contiguous() for x in w_u(k, v, beta, Ai, g_cum, cu_seqlens, CHUNK_SIZE))
    p = autocp.plan(cu_seqlens, B, T, HV, autocp.num_sms(device), V // base.BLOCK_V, device, force=cp)
    if p is None:
        o, ht = base.fused_h_o(q, k, w, u, g_cum, initial_state, cu_seqlens, scale)
        return o, (ht if output_final_state else None)

    N, J, fp32 = p.num_seqs, p.max_segments, dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    # phase 1: Z (and M for exact heads) of every slot's window
    win_start, exact, _ = autocp.warmup(p, g_cum.view(B * T, HV), autocp.bound_violations(k, g, beta),
                                        threshold)
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    with nvtx_range("gdn_fwd.s06"):
        _compiled(H, HV)(k.view(B * T, H, K), w.view(B * T, HV, K), u.view(B * T, HV, V),
                         g_cum.view(B * T, HV), win_start, p.slot_start, exact, z, m)
    # phase 2: h_j = Z_j + M_j h_{j-1}, slot j * N + n, all (sequence, head) pairs per step
    hs = torch.empty(J, N * HV, K, V, **fp32)
    hs[0].copy_(h0.view(N * HV, K, V))
    zs, ms = z.view(J, N * HV, K, V), m.view(J, N * HV, K, K)
    for j in range(1, J):
        torch.baddbmm(zs[j], ms[j], hs[j - 1], out=hs[j])
    h_seg = hs.view(J * N, HV, K, V).index_select(0, p.slot_of_segment)
    # phase 3: the chain + output over all segments, each from its own state
    o, ht = base.fused_h_o(q, k, w, u, g_cum, h_seg, p.bounds, scale)
    return o, (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s06: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s06: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s06: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s06: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
