"""gdn_fwd, stage 08: AutoCP (s06) with s07's fused kernel as the chain.

What changed from s06: the kernel that walks the segments in phase 3, and the whole sequences when
the plan does not split, is s07's (warp-specialized, reformulated math: preparation
chunk_local_cumsum.s01 + gate_free_solve.s01, no w, u) instead of s05's. s07 does not fit s06's
``CHAIN`` interface (it reads v, Ab and the per-(chunk, value head) ``gated`` flags instead of w,
u), hence a stage of its own. Why: s07 is the fastest stage on all 30 benchmark problems
(1.03-1.40x s05), but alone it is behind FLA on the few-head ones (its docstring), where one chain
per (sequence, head) leaves most SMs idle: the problems AutoCP splits. No new kernel; the pieces,
in order:

    preparation  g_cum (chunk_local_cumsum.s01), then Ab and gated (gate_free_solve.s01), as s07
    plan         ``flashqla.autocp.plan``, as s06; no split: s07's kernel over the sequences, done
    phase 1      s06's warm-up kernel, unchanged. It runs s03's chain math (V~ = U - W S), so it
                 reads w, u: chunk_fwd_intra.s01 computes them, on this path only
    phase 2      ``flashqla.autocp.segment_initial_states``: h_j = Z_j + M_j h_{j-1} (s06's chaining)
    phase 3      s07's kernel over the segment rows (``Plan.bounds``), each from its h_j; the final
                 state of a sequence is the one its last segment leaves

The one new index: s07's scores warpgroup reads ``gated[row0 + c, i_hv]`` for chunk c of its
"sequence", row0 = ``first_chunk[i_n]``, and gate_free_solve wrote ``gated`` per row of the chunk
table of the WHOLE sequences (``flashqla.varlen.chunk_table``). Segments start on chunk boundaries
of their sequence (every segment but a sequence's last has L x 64 tokens), so segment j of
sequence n owns the rows from (sequence n's first row) + j L on: ``Plan.first_chunk``, checked
against the chunk table in tests/test_autocp.py. Ab is stored per token, so the segment bounds
find its rows as they find q, k, v's.

Not done here: a warm-up kernel on Ab (s07's chain math without the output) would drop the
chunk_fwd_intra launch from the split path; it is a new kernel, so the simplest correct design
comes first. chunk_fwd_intra.s01 alone took 0.169 ms on (2, 8) 1 x 32768 (its docstring, H200),
against 0.944 ms for s06's whole forward there (s03's kernel as the chain, graph replay); with
s07's faster chain its share of the split path grows (measured effect below).

Measured effect (``python -m flashqla bench``, H200, CUDA-graph replay, 30 problems of six head
configurations, profiles/results/gdn_fwd.csv): 0.81-1.04x s07, geomean 0.99x. Where the plan keeps
the sequences whole (27 of the 30) it is s07 within 1%. It splits three (16, 16) problems: 1.04x on
1 x 32768 (1.617 ms against 1.683), but 0.81x on 1 x 8192 (0.681 against 0.549) and on 28672 + 4096
(1.827 against 1.481). The split path adds chunk_fwd_intra and s06's warm-up kernel, which runs
s03's chain math, slower per chunk than s07's kernel: the plan's cost model (``flashqla.autocp``)
was set with s05's chain and split too eagerly for s07's. It now counts phase 1 at
``autocp.WARMUP_STEPS`` = 2 steps of s07's kernel a chunk, fitted to these runs and autocp.csv's,
and no longer splits those two problems (not yet timed with the new rule). The library runs this path; it is
0.57-1.91x FLA and 0.37-1.17x FlashQLA there (geomean 1.18x and 0.63x), 1.04-1.55x this stage
(the stage builds its varlen tables in each of its sub-calls).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import torch

from flashqla import autocp, stages
from flashqla.nvtx import nvtx_range

NEEDS = ("hopper",)
# both kernels AutoCP adds: wgmma and TMA (the warm-up's and the fused kernel's products and
# tiles); warpgroup_reg_alloc / _dealloc: the fused kernel's role register budgets (setmaxnreg)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")

WARMUP = ("gdn_fwd", 6)  # the stage whose warm-up kernel runs phase 1
CHAIN = ("gdn_fwd", 7)   # the stage whose fused kernel runs phase 3 (and the forward without a split)
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
    ab, gated = stages.load("gate_free_solve", 1).solve(k, beta, g_cum, cu_seqlens)
    p = autocp.plan(cu_seqlens, B, T, HV, autocp.num_sms(device), V // chain.BLOCK_V, device, force=cp)
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
    with nvtx_range("gdn_fwd.s08"):
        warm._compiled(H, HV)(k.view(B * T, H, K), w.view(B * T, HV, K), u.view(B * T, HV, V),
                              g_cum.view(B * T, HV), win_start, p.slot_start, exact, z, m)
    # phase 2: the initial state of every segment row
    h_seg = autocp.segment_initial_states(p, h0, z, m)
    # phase 3: s07's kernel over all segments, each from its own state; gated's rows per segment
    # are the whole sequences' chunk rows (p.first_chunk)
    o, ht = torch.empty(B * T, HV, V, **bf16), torch.empty(h_seg.shape, **fp32)
    with nvtx_range("gdn_fwd.s07"):
        chain._compiled(H, HV, K, V)(q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
                                     ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
                                     h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s08: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s08: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s08: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s08: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
