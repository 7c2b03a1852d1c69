"""gdn_fwd, stage 13: AutoCP (s11) with s12's kernel, whose BV (32 or 64) is chosen per launch.

What changed from s11: the chain is s12's fused kernel (s10's with the state's value columns per CTA
a parameter), and both its launches choose BV with ``block_v`` (s12): the launch over whole
sequences from the sequences, the one over segment rows from the rows. The plan cuts segments as
s11's does (V / 64 CTAs a head), and where the launch without a split would run at BV = 32 it
weighs that launch's chunk steps by ``autocp.NARROW_STEP`` (0.77 of a step at BV = 64, measured),
so a split must beat the narrow launch, not the wide one. The solve is s11's
(gate_free_solve.s02). The pipeline is otherwise s11's line for line:

    preparation  g_cum (chunk_local_cumsum.s01), then Ab and gated (``SOLVE``: gate_free_solve.s02)
    plan         ``flashqla.autocp.plan`` with V / 64 CTAs a head and the narrow launch's step;
                 no split: s12's kernel over the sequences (its own BV), done
    phase 1      s06's warm-up kernel on chunk_fwd_intra.s01's w, u, as in s08 and s11
    phase 2      ``flashqla.autocp.segment_initial_states``: h_j = Z_j + M_j h_{j-1}
    phase 3      s12's kernel over the segment rows at the rows' BV, each from its h_j, reading
                 ``gated`` at its rows of the whole sequences' chunk table (``Plan.first_chunk``)

Why: s12 targets the single sequences with few value heads, which are also where AutoCP splits;
the two must be planned together (a split fills the SMs with segments, a narrow BV with CTAs).

Measured effect (``python -m flashqla bench``, all 40 problems, 4 x H200, commit 7ccb1ae): 1.00-1.28x
s11 (geomean 1.10x); the faster of s11 (split) and s12 (narrow) wherever they differ: (2, 8)
1 x 32768 0.803 ms (s11 0.805, s12 1.009), (4, 16) 1 x 32768 1.054 (s11 1.311, s12 1.078). The
first build planned segments for the narrow CTAs (V / 32 CTAs a head) and split (2, 8) 1 x 32768
into 4 long segments: 1.05 ms against s11's 0.81 (commit 4e37c66); hence the plan above. The
library's forward runs this pipeline (``flashqla/fwd.py``).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import torch

from flashqla import autocp, stages
from flashqla.nvtx import nvtx_range

NEEDS = ("hopper",)
# both kernels AutoCP adds: wgmma and TMA (the warm-up's and the fused kernel's products and
# tiles); warpgroup_reg_alloc / _dealloc: the fused kernel's role register budgets (setmaxnreg)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")

SOLVE = ("gate_free_solve", 2)  # the stage that gives Ab and the gated flags
WARMUP = ("gdn_fwd", 6)  # the stage whose warm-up kernel runs phase 1
CHAIN = ("gdn_fwd", 12)  # the stage whose fused kernel runs phase 3 (and the forward without a split)
CHUNK_SIZE = 64          # C: tokens per chunk
HEAD_DIM = 128           # K = V = 128 only (the warm-up kernel's M is K x K)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape: phase 1's kernel, then phase 3's."""
    return stages.load(*WARMUP).kernel_source() + stages.load(*CHAIN).kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """``run`` with the split chosen by the caller: ``cp`` None decides (``autocp.segment_chunks``),
    False never splits, True splits by the rule, an int is the segment length in chunks."""
    chain, warm = stages.load(*CHAIN), stages.load(*WARMUP)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    narrow = chain.block_v(num_seqs, HV, V, sms) == chain.NARROW_BLOCK_V
    p = autocp.plan(cu_seqlens, B, T, HV, sms, V // chain.BLOCK_V, device, force=cp,
                    unsplit_step=autocp.NARROW_STEP if narrow else 1.0)
    if p is None:
        o, ht = chain.fused_reform(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale)
        return o, (ht if output_final_state else None)

    N, J = p.num_seqs, p.max_segments
    bf16, fp32 = dict(dtype=torch.bfloat16, device=device), dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    # phase 1: Z (and M for exact heads) of every slot's window, from w, u
    w, u = stages.load("chunk_fwd_intra", 1).run(k, v, g_cum, beta, cu_seqlens, CHUNK_SIZE)
    win_start, exact, _ = autocp.warmup(p, g_cum.view(B * T, HV), autocp.bound_violations(k, g, beta),
                                        threshold)
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    with nvtx_range("gdn_fwd.s13"):
        warm._compiled(H, HV)(k.view(B * T, H, K), w.view(B * T, HV, K), u.view(B * T, HV, V),
                              g_cum.view(B * T, HV), win_start, p.slot_start, exact, z, m)
    # phase 2: the initial state of every segment row
    h_seg = autocp.segment_initial_states(p, h0, z, m)
    # phase 3: the chain's kernel over all segments, each from its own state; gated's rows per
    # segment are the whole sequences' chunk rows (p.first_chunk)
    o, ht = torch.empty(B * T, HV, V, **bf16), torch.empty(h_seg.shape, **fp32)
    with nvtx_range(f"{CHAIN[0]}.s{CHAIN[1]:02d}"):
        rows = p.bounds.shape[0] - 1                          # segment rows: the launch's "sequences"
        chain._compiled(H, HV, K, V, chain.block_v(rows, HV, V, sms))(
                                     q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
                                     ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
                                     h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s13: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s13: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s13: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s13: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
