"""gdn_fwd, stage 26: the prologue that short problems wait on: chunk_local_cumsum.s02 and
gate_free_solve.s10, on s25's rule.

What changed from s25: the two kernels before the fused launch.
- The cumulative gate: chunk_local_cumsum.s02 (a head's chunk scanned by eight threads, the
  totals through shared memory, no bounds checks where the chunk table keeps accesses in range)
  in place of s01 (one thread a head walking its 64 tokens in turn).
- The solve: gate_free_solve.s10 (two value heads a CTA on s08's kernel where s09's grouping
  leaves SMs without a CTA) in place of s09.
- The rule: s25's (every length of the sweep's ladder, priced by phase 3's waves), which s24's
  forward ran only at the L it chose; here the stage is one forward.

Why: on the 1x2048 problems the fused launch is level with FlashQLA's (62 us on (8, 32)), so the
gap is in the prologue. Each kernel alone (one H100, commit 677241e; 50 launches captured in one
CUDA graph, the replay's time / 50), us:

    problem            cumsum s01   s02    solve s09   s10
    (2, 8) 1x2048          4.0      1.7       10.2      6.2
    (4, 16) 1x2048         4.1      1.7       10.7      8.2
    (8, 32) 1x2048         6.8      1.6       13.3     13.3
    (16, 64) 1x8192        7.0      2.5       92.2     92.2

Measured effect (the benchmark, one H100, commit 98a6f05, CUDA-graph replay, these rows and both
peers in one process), ms. The API runs this stage's kernels in this stage's order (bit for bit,
``tests/test_promoted.py``); the stage rows also pay for their sub-steps' own chunk tables, which
inside a capture are built anew by each: four launches of the table kernel in s26's forward as
timed (the cumsum, the solve's grid count, the solve, the fused launch), three in s24's, one in the
library's, about 2 us each on these short problems. So the API row is the one to read against the
peers, and s26 against s24 carries one extra table launch. (Since then gate_free_solve.s10 counts
the rows on the host, ``num_chunk_rows``, so s26 launches three tables, as s24; the kernels, their
order and their results are unchanged.)

    problem               API     s26     s24    s26/s24  FlashQLA   FLA
    (2, 8) 1x2048        0.0775  0.0850  0.0913   0.93       -*     0.0828
    (4, 16) 1x2048       0.0834  0.0952  0.0943   1.01       -*     0.1043
    (8, 32) 1x2048       0.0963  0.1072  0.1085   0.99     0.0871   0.1449
    (16, 32) 1x2048      0.0878  0.0978  0.1000   0.98     0.0871   0.1459
    (8, 24) 1x2048       0.0934  0.1030  0.1014   1.02     0.0828   0.1241
    (16, 64) 1x2048      0.1152  0.1244  0.1262   0.99     0.1191   0.2579
    (2, 8) 1x8192        0.1696  0.1783  0.1723   1.03     0.1667   0.2625
    (8, 32) 1x8192       0.3071  0.3133  0.3152   0.99     0.3080   0.5232
    (16, 32) 1x8192      0.3055  0.3132  0.3161   0.99     0.3068   0.5344
    (8, 32) 28672+4096   1.0629  1.0676  1.1319   0.94     1.2855   2.1947
    (16, 32) 28672+4096  1.0680  1.0495  1.1212   0.94     1.2976   2.2043

(* FlashQLA's CUDA-graph capture failed and it was timed without a graph, 1.2 and 0.32 ms: not a
measure of its kernels. These problems have more input sets than its 4-entry chunk-index cache,
each with its own cu_seqlens then; ``flashqla.bench.input_sets`` now shares one.) s25's rule splits both
28672+4096 problems at L 64: 0.94x s24's time, 1.21-1.24x FlashQLA's speed. On (2, 8) 1x8192 it
picks L 16 where s24 picks 8: 1.03x s24's time here (1.015x in s24's sweep), the price of a rule
that ranks every length with one formula. On the 1x2048 problems the API is 1.07x FLA's speed on
(2, 8) (s24's library was 0.97x, an earlier run) and level with FlashQLA on (16, 32) and ahead on
(16, 64); (8, 32) and (8, 24) stay 0.89-0.90x FlashQLA's speed. The solve at two heads a CTA and
the new cumsum take 4-6 us off (2, 8) 1x2048 (s26 against s24, less the extra table launch);
elsewhere the gain is the cumsum's 2-5 us, within two table launches of the stage rows' noise.
GPU tests (commit 98a6f05): the public shapes (24), gate_free_solve.s10's (24), AutoCP's tests
of this stage (7); the library bit for bit against it, ``test_promoted`` (12, commit d832bf8).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import torch

from flashqla import autocp, stages
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "autocp_chain_rows", "gdn_autocp_warmup_split")

RULE = stages.load("gdn_fwd", 25)       # the segment length
PIPELINE = stages.load("gdn_fwd", 24)   # windows, phases 1, 2 and 3
CUMSUM = ("chunk_local_cumsum", 2)
SOLVE = ("gate_free_solve", 10)
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
segment_chunks = RULE.segment_chunks


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s24's kernels, then the cumsum's and the solve's."""
    return (PIPELINE.kernel_source() + stages.load(*CUMSUM).kernel_source()
            + stages.load(*SOLVE).kernel_source())


def split_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, cp, unsplit_step: float):
    """s24's ``split_plan`` at s25's segment length (None: no split)."""
    if cp is None or cp is True:
        bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
        seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                      else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
        cp = segment_chunks(seq_chunks, HV, num_sms, unsplit_step, cp) or False
    return PIPELINE.split_plan(cu_seqlens, B, T, HV, num_sms, device, cp, unsplit_step)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s24's ``forward`` with this stage's prologue and s25's rule (``cp`` None decides, False
    never splits, True splits at the rule's cheapest L, an int is the segment length in chunks)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    s18 = PIPELINE.CHAIN.PIPELINE.PIPELINE
    g_cum = stages.load(*CUMSUM).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    widths, fused = s18.WIDTHS, s18.PIPELINE
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
    # windows (s18's), then phase 1 (s23's)
    win_start, exact = s18.windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV),
                                   gated, threshold)
    with nvtx_range("gdn_fwd.s26"):
        PIPELINE.PIPELINE._compiled(H, HV)(
            k.view(B * T, H, K), v.view(B * T, HV, V), ab.view(B * T, HV, CHUNK_SIZE),
            g_cum.view(B * T, HV), gated, win_start, p.slot_start, p.slot_chunk, exact, z, m)
    # phase 2 (s24's): the initial state of every segment row
    h_seg = PIPELINE.segment_initial_states(p, h0, z, m, exact)
    # phase 3: the fused kernel over all segments (of equal length), each from its own state
    rows = p.bounds.shape[0] - 1
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(h_seg.shape, **fp32)
    BV = fused.block_v([1] * rows, HV, V, sms, widths.step)
    with nvtx_range("gdn_fwd.s26"):
        stages.load(*widths.kernels[BV])._compiled(H, HV, K, V, BV)(
            q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
            ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
            h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s26: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s26: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s26: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s26: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
