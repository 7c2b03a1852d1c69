"""gdn_fwd, stage 33: s32 with a fourth width for the fused kernel, 16 value columns a CTA.

What changed from s32: the width rule (s15's ``block_v``, a launch's chunk steps at each width)
gets BV = 16 at ``STEP[16]`` = 0.74 of a step at 64, and the launch at 16 runs s12's kernel, as
at 32. The kernel, the plan and the other launches are s32's. s12's kernel holds any BV: at 16 a
CTA's chain products are 64 x 16 and its output tile 64 x 16, and V / 16 = 8 CTAs share a
head's scores (each computes them). Among the benchmark's problems 16 is chosen on the unsplit
single sequences of (2, 8), (4, 16) and (16, 16) at 1x2048 (64, 128 and 128 CTAs, one wave); on
the problems AutoCP splits the split and phase 3's width do not change (a CPU check on all 40).

Why: where a launch at 32 leaves SMs idle (one short sequence of few heads: 32 to 64 CTAs on 132
SMs), the time is the chain's chunk count times its per-chunk latency, and half the columns
shorten that latency. s12's kernel alone in a CUDA graph at 16 against 32 (one H100, ba1bffa;
the same bits, a column's chain does not depend on the others):

    problem            CTAs at 16/32   BV 16 us   BV 32 us   ratio
    (2, 8) 1x2048         64/32          57.5       67.7     0.850
    (4, 16) 1x2048       128/64          58.9       65.7     0.897
    (16, 16) 1x2048      128/64          55.7       64.1     0.869
    (2, 8) 1x8192         64/32         202.6      238.1     0.851
    (8, 24) 1x2048       192/96         109.3       64.8     1.685   (two waves at 16)
    (8, 32) 1x2048      256/128         107.0       65.8     1.627   (two waves at 16)

``STEP[16]`` is s17's step at 32 (0.85) times the geomean of the one-wave ratios (0.867).

Measured effect (``python -m flashqla bench``, one H100, commit 6eedafa; the API, which runs s33's
kernels bit for bit, ``tests/test_promoted.py``), ms:

    problem            s29      s32      s33 (API)   FlashQLA   FLA
    (2, 8) 1x2048     0.0724   0.0685   0.0621      0.0714    0.0822
    (4, 16) 1x2048    0.0761   0.0758   0.0677      0.0758    0.1032
    (16, 16) 1x2048   0.0791      -     0.0719      0.0801    0.1092
    (2, 8) 1x8192     0.1535   0.1520   0.1533      0.1672    0.2635   (split: no change)
    (8, 24) 1x2048    0.0859      -     0.0809      0.0807    0.1228   (BV 32: s32's gain)

On the three problems that go to 16 columns the forward is 0.89-0.91x s32's time (or s29's) and
1.11-1.15x FlashQLA's speed. Its tests passed on the GPU: the public shapes; bit for bit against
s32, eagerly and from a CUDA graph (``tests/test_autocp.py``).

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import torch

from flashqla import autocp, stages
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "tma_store")

S32 = stages.load("gdn_fwd", 32)        # the prologue
S27 = S32.S31.S30.S27                   # AutoCP's kernels, the fused kernels, the plan
CHUNK_SIZE = S32.CHUNK_SIZE
HEAD_DIM = S32.HEAD_DIM
STEP = {16: 0.74, **S27.S18.WIDTHS.step}                 # a chunk step at each BV, in steps at 64
FUSED_AT = {16: "fused_narrow", **S27.FUSED_AT}          # the fused kernel at each BV (s12's at 16)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s32's kernels, then s12's fused kernel at BV 16."""
    return S32.kernel_source() + S27._compiled(FUSED_AT[16], 2, 8, HEAD_DIM, HEAD_DIM, 16).get_kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, *, prologue=S32.prologue):
    """s32's forward with the widths of ``STEP`` (``cp`` None decides, False never splits, True
    splits at the rule's cheapest L, an int is the segment length in chunks). ``prologue``: the
    kernels before AutoCP's (s32's)."""
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
    with nvtx_range("gdn_fwd.s33"):
        prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)
    fused = S27.S18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, STEP)
    p = S27.PIPELINE.split_plan(cu_seqlens, B, T, HV, sms, device, cp, STEP[BV])
    if p is not None:  # AutoCP: windows, phase 1 (Z, M), phase 2 (each segment row's h0)
        J = p.max_segments
        win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
        exact = torch.empty_like(win_start)
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
        with nvtx_range("gdn_fwd.s33"):
            S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                         p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
            S27._compiled("warmup", H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk,
                                           exact, z, m)
            S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
        h0, seqs, first_chunk = h_seg, p.bounds, p.first_chunk
        BV = fused.block_v([1] * (seqs.shape[0] - 1), HV, V, sms, STEP)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("gdn_fwd.s33"):
        # o, final states <- the fused chain and output over sequences (or segments)
        S27._compiled(FUSED_AT[BV], H, HV, K, V, BV)(q, k, v, ab, g_cum, gated, h0, seqs, first_chunk,
                                                     scale, o, ht)
    if p is not None and output_final_state:
        ht = ht.index_select(0, p.last_segment)  # the state a sequence's last segment leaves
    return o.view(B, T, HV, V), (ht if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s33: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s33: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s33: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s33: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
