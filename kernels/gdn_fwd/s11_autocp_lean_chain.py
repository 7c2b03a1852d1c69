"""gdn_fwd, stage 11: AutoCP (s08) with s10's fused kernel as the chain and gate_free_solve.s02.

What changed from s08: the kernel that walks the segments in phase 3, and the whole sequences when
the plan does not split, is s10's (s07's roles, barriers, math and precision, with the chain's
per-chunk path lean: no mask and no exp in its elementwise passes, stmatrix hand-offs, the decay
beside K S) instead of s07's; and the solve is gate_free_solve.s02's blocked inverse (the same Ab
and flags as s01's, with no 64-row serial chain: s01 took 153 of s10's 471 us on (16, 64)
1 x 8192, torch.profiler, one H200). s10's ``fused_reform``, ``_compiled`` and ``BLOCK_V`` are s07's
interface (the same arguments in the same order: v, Ab, ``gated``, the bounds and each sequence's
first chunk row), so the pipeline is s08's line for line; only ``CHAIN`` and ``SOLVE`` differ. No new kernel:

    preparation  g_cum (chunk_local_cumsum.s01), then Ab and gated (``SOLVE``: gate_free_solve.s02)
    plan         ``flashqla.autocp.plan``; no split: s10's kernel over the sequences, done
    phase 1      s06's warm-up kernel on chunk_fwd_intra.s01's w, u (this path only), as in s08
    phase 2      ``flashqla.autocp.segment_initial_states``: h_j = Z_j + M_j h_{j-1}
    phase 3      s10's kernel over the segment rows (``Plan.bounds``), each from its h_j, reading
                 ``gated`` at its rows of the whole sequences' chunk table (``Plan.first_chunk``);
                 the final state of a sequence is the one its last segment leaves

Why: s10 is the fastest chain. ``python -m flashqla bench`` on 2 x H200 at commit 3198fc1, CUDA-graph
replay, every row of a problem in one process with FLA and FlashQLA (profiles/results/gdn_fwd.csv):
s10 is 1.05-1.12x s07 on the 19 problems of (2, 8), (4, 16), (16, 64) and (16, 16) it was timed on.
In ms:

    problem             s07      s10      s08 (s07 + AutoCP)   FlashQLA   FLA
    (16, 64) 1x8192     0.5263   0.4982   0.5251               0.4056     0.8541
    (16, 64) 1x32768    1.9164   1.8202   1.9116               1.5298     3.4808
    (16, 16) 1x8192     0.4252   0.3813   0.4265               0.2227     0.3398
    (2, 8) 1x32768      1.4775   1.3376   0.8034 (split)       0.3993     1.1222

s08 gains where AutoCP splits ((2, 8) 1x32768: 1.84x s07), s10 where it does not; this stage
should have both. The plan's cost model (``autocp.WARMUP_STEPS``) was fitted with s07's kernel as
the chain; a step of s10's is shorter, so phase 1 weighs more against it: on (16, 16) 1x32768,
which the rule splits, s10 alone (1.427 ms) was already faster than s08's split (1.494).

Measured effect (``python -m flashqla bench``, 4 x H200, commit a76066e, CUDA-graph replay, 40
problems of eight head layouts, profiles/results/gdn_fwd.csv): 0.96-1.66x s10, geomean 1.05x.
Where the plan keeps sequences whole, the difference is the solve (gate_free_solve.s02's docstring):
1.02-1.08x with three or four value heads per key head, 0.98-1.01x with one, 0.96-0.97x on (16, 32)
from 32768 tokens. The plan (``autocp.MIN_SAVED_CHUNKS`` = 100 since this stage was written) splits
(2, 8) 1 x 32768 and 28672 + 4096 (1.66x and 1.34x s10), (4, 16) 1 x 32768 (1.08x) and (16, 16)
1 x 32768, where it lost: 1.457 ms against s10's 1.415 (0.97x). The library runs this pipeline
(with its varlen tables built once, by one kernel): 0.77-2.40x FLA (geomean 1.38x), 0.47-5.27x
FlashQLA (geomean 0.81x); (16, 64) 1 x 32768 1.750 ms, 3.65x the floor, FlashQLA 1.538.

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
CHAIN = ("gdn_fwd", 10)  # the stage whose fused kernel runs phase 3 (and the forward without a split)
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
    with nvtx_range("gdn_fwd.s11"):
        warm._compiled(H, HV)(k.view(B * T, H, K), w.view(B * T, HV, K), u.view(B * T, HV, V),
                              g_cum.view(B * T, HV), win_start, p.slot_start, exact, z, m)
    # phase 2: the initial state of every segment row
    h_seg = autocp.segment_initial_states(p, h0, z, m)
    # phase 3: the chain's kernel over all segments, each from its own state; gated's rows per
    # segment are the whole sequences' chunk rows (p.first_chunk)
    o, ht = torch.empty(B * T, HV, V, **bf16), torch.empty(h_seg.shape, **fp32)
    with nvtx_range(f"{CHAIN[0]}.s{CHAIN[1]:02d}"):
        chain._compiled(H, HV, K, V)(q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
                                     ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
                                     h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s11: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s11: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s11: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s11: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
