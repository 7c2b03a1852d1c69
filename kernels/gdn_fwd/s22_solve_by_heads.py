"""gdn_fwd, stage 22: s21's forward on gate_free_solve.s09, the solve chosen by the value heads a
CTA holds (s08's tensor-core half with one or two, s06 with three or four).

What changed from s21: the solve. s21 (through s18) ran gate_free_solve.s05; the library has run
s06 (the same bits, 0.85-0.90x its time) since commit 02d7c5e, and s09 runs s08's kernel where it
is faster: 0.83-0.85x s06's time on (16, 32), 0.93-0.94x on (16, 16) (``results/solve.csv``, 4 x
H100, commit d8516c1). Where s08 runs, Ab is no longer s02's bits: its lower-left half is two tf32
products (1.5-2.9e-4 relative L2 on Ab, against 1.6-1.9e-3 for its bf16 store).

Measured effect: not yet (GPU tests pending).

Taught in: notebooks/04_reformulation.py (the solve), notebooks/05_autocp.py (the pipeline)
"""

import torch

from flashqla import autocp, stages
from flashqla.nvtx import nvtx_range

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "autocp_chain", "kTensorFloat32")

PIPELINE = stages.load("gdn_fwd", 21)   # everything but the solve
SOLVE = ("gate_free_solve", 9)          # Ab and the gated flags
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s21's kernels, then the solves s09 chooses from."""
    return PIPELINE.kernel_source() + stages.load(*SOLVE).kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s21's ``forward`` (same rule, ``cp`` as there) with SOLVE's solve."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    s20 = PIPELINE.PIPELINE
    s18 = s20.PIPELINE
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    widths, fused = s18.WIDTHS, s18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = s20.split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is None:
        o, ht = fused._fused(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV, widths)
        return o, (ht if output_final_state else None)

    N, J = p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    # windows (s18's), then phase 1 (s20's)
    win_start, exact = s18.windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV),
                                   gated, threshold)
    with nvtx_range("gdn_fwd.s22"):
        s20._compiled(H, HV)(k.view(B * T, H, K), v.view(B * T, HV, V), ab.view(B * T, HV, CHUNK_SIZE),
                                  g_cum.view(B * T, HV), gated, win_start, p.slot_start, p.slot_chunk,
                                  exact, z, m)
    # phase 2, one launch: the initial state of every segment row
    h_seg = PIPELINE.segment_initial_states(p, h0, z, m)
    # phase 3: the fused kernel over all segments (of equal length), each from its own state
    rows = p.bounds.shape[0] - 1
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(h_seg.shape, **fp32)
    BV = fused.block_v([1] * rows, HV, V, sms, widths.step)
    with nvtx_range("gdn_fwd.s22"):
        stages.load(*widths.kernels[BV])._compiled(H, HV, K, V, BV)(
            q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
            ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
            h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s22: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s22: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s22: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s22: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
