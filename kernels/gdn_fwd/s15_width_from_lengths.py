"""gdn_fwd, stage 15: s13's pipeline with the fused kernel's width chosen from the sequence lengths:
32 or 64 value columns a CTA on s12's kernel, 128 on s14's.

What changed from s13: ``block_v`` takes the sequences' chunk counts, not only their number. It
weighs each width's chunk steps (``WIDTHS.step``: s14's ``STEP``) by the larger of three floors on
the launch's time in steps: the longest sequence (its CTAs walk it alone), the CTA-chunks spread
over all SMs, and the waves of CTAs times the shortest sequence (a wave is at least that long).
With equal lengths that is s14's rule, waves x step. The lengths come from
``flashqla.varlen.host_bounds``: one read of ``cu_seqlens`` per tensor, kept for the capture that
follows an eager call; inside a capture that has no eager call before it, the width falls back to
the equal-length rule. At 32 and 64 the kernel is s12's (s14's own is 1.00-1.08x slower there,
``kernel_width.csv``), at 128 s14's. The AutoCP plan and its segments are s13's; the segments of
phase 3 are of equal length by construction, so their launch takes the equal-length rule. Which
kernel runs at each width, and its step there, is one ``Widths`` record (s17 runs this pipeline
on another).

Why: s14's kernel at 128 is 0.76-0.83x s12's on the batches of 8 sequences where the wave rule
picks it, but that rule, blind to the lengths, also picks it on 28672 + 4096 of (16, 48) and
(16, 64), where it is 1.35-1.59x slower; and s12's own rule picks 64 on 28672 + 4096 of (8, 24),
(8, 32) and (16, 32), where 32 is 0.80-0.90x the time. On every one of the 40 problems of
``profiles/results/kernel_width.csv`` (4 x H100, commit 51893cc) this rule picks the fastest of s12
at 32, s12 at 64 and s14 at 128 (``tests/test_stages.py::test_width_rules_pick_the_fastest_measured``).

Measured effect (``python -m flashqla bench``, all 40 problems, 4 x H100, commit 188c42c):
0.91-1.24x s13, geomean 1.03x; 1.11-1.18x on 8 x 4096 of six layouts (128 columns) and 1.10-1.24x
on 28672 + 4096 of (8, 24), (8, 32) and (16, 32) (32 columns); the one loss, 0.91x, is (2, 8)
1 x 32768, which AutoCP splits.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

from typing import NamedTuple

import torch

from flashqla import autocp, stages
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, host_bounds, seq_bounds

NEEDS = ("hopper",)
# the kernels it may launch: wgmma and TMA (the warm-up's and the fused kernels' products and
# tiles); warpgroup_reg_alloc / _dealloc: the fused kernels' role register budgets (setmaxnreg)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")

SOLVE = ("gate_free_solve", 2)  # the stage that gives Ab and the gated flags
WARMUP = ("gdn_fwd", 6)         # the stage whose warm-up kernel runs phase 1
CHUNK_SIZE = 64                 # C: tokens per chunk
HEAD_DIM = 128                  # K = V = 128 only (the warm-up kernel's M is K x K)


class Widths(NamedTuple):
    """What the pipeline launches at each width BV, and what the launch costs there."""
    kernels: dict  # BV -> the stage whose fused kernel (``_compiled(H, HV, K, V, BV)``) runs at BV
    step: dict     # BV -> a chunk step of that kernel, in chunk steps at BV = 64
    nvtx: str      # the NVTX range of the pipeline's launches


WIDTHS = Widths(kernels={32: ("gdn_fwd", 12), 64: ("gdn_fwd", 12), 128: ("gdn_fwd", 14)},
                step={32: 0.77, 64: 1.0, 128: 1.6},  # s14's STEP
                nvtx="gdn_fwd.s15")


def block_v(seq_chunks: list[int], HV: int, V: int, num_sms: int, step: dict = WIDTHS.step) -> int:
    """BV for a launch over sequences of ``seq_chunks`` chunks each (host integers): the width of
    the fewest chunk steps, ``step[BV]`` x max(longest sequence, CTA-chunks / SMs, waves x
    shortest sequence), where a sequence has HV x V / BV CTAs. With equal lengths ([1] * N) it is
    s14's rule, waves x step."""
    ctas_per_seq = {bv: HV * (V // bv) for bv in step}

    def steps(bv):
        waves = -(-len(seq_chunks) * ctas_per_seq[bv] // num_sms)
        return step[bv] * max(max(seq_chunks), ctas_per_seq[bv] * sum(seq_chunks) / num_sms,
                              waves * min(seq_chunks))
    return min(step, key=steps)


def launch_width(cu_seqlens, B: int, T: int, HV: int, V: int, num_sms: int, step: dict = WIDTHS.step) -> int:
    """``block_v`` of the sequences of inputs [B, T] (or varlen ``cu_seqlens``); the equal-length
    rule where the lengths cannot be read (``host_bounds`` under capture)."""
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    if bounds is None:
        return block_v([1] * (cu_seqlens.shape[0] - 1), HV, V, num_sms, step)
    return block_v([-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])], HV, V, num_sms, step)


def kernel_source(widths: Widths = WIDTHS) -> str:
    """The CUDA C++ generated for sm_90a at the default shape: phase 1's kernel, then each fused
    kernel of ``widths`` (s15's: s12's and s14's)."""
    fused = dict.fromkeys(widths.kernels.values())  # each stage once, in width order
    return stages.load(*WARMUP).kernel_source() + "".join(stages.load(*k).kernel_source() for k in fused)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, widths: Widths = WIDTHS):
    """``run`` with the split chosen by the caller: ``cp`` None decides (``autocp.segment_chunks``),
    False never splits, True splits by the rule, an int is the segment length in chunks; the fused
    kernels and their steps are ``widths``'."""
    warm = stages.load(*WARMUP)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    BV = launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    # the plan cuts segments for 2 CTAs a head (s11's); a split must beat BV 32's shorter steps
    p = autocp.plan(cu_seqlens, B, T, HV, sms, V // 64, device, force=cp,
                    unsplit_step=widths.step[32] if BV == 32 else 1.0)
    if p is None:
        o, ht = _fused(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV, widths)
        return o, (ht if output_final_state else None)

    N, J = p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    # phase 1: Z (and M for exact heads) of every slot's window, from w, u
    w, u = stages.load("chunk_fwd_intra", 1).run(k, v, g_cum, beta, cu_seqlens, CHUNK_SIZE)
    win_start, exact, _ = autocp.warmup(p, g_cum.view(B * T, HV), autocp.bound_violations(k, g, beta),
                                        threshold)
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    with nvtx_range(widths.nvtx):
        warm._compiled(H, HV)(k.view(B * T, H, K), w.view(B * T, HV, K), u.view(B * T, HV, V),
                              g_cum.view(B * T, HV), win_start, p.slot_start, exact, z, m)
    # phase 2: the initial state of every segment row
    h_seg = autocp.segment_initial_states(p, h0, z, m)
    # phase 3: the fused kernel over all segments (of equal length), each from its own
    # state; gated's rows per segment are the whole sequences' chunk rows (p.first_chunk)
    rows = p.bounds.shape[0] - 1
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(h_seg.shape, **fp32)
    BV = block_v([1] * rows, HV, V, sms, widths.step)
    with nvtx_range(widths.nvtx):
        stages.load(*widths.kernels[BV])._compiled(H, HV, K, V, BV)(
            q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
            ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
            h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def _fused(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV, widths):
    """``widths``' fused kernel at BV over whole sequences -> (o [B, T, HV, V], final state [N, HV, K, V])."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    bounds = seq_bounds(cu_seqlens, B, T, device)
    _, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N = bounds.shape[0] - 1
    if initial_state is None:
        initial_state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device)
    if B * T:
        with nvtx_range(widths.nvtx):
            stages.load(*widths.kernels[BV])._compiled(H, HV, K, V, BV)(
                q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V),
                ab.reshape(B * T, HV, CHUNK_SIZE), g_cum.reshape(B * T, HV), gated,
                initial_state.to(torch.float32).contiguous(), bounds, first_chunk, scale, o, ht)
    else:
        ht.copy_(initial_state)
    return o.view(B, T, HV, V), ht


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE, widths: Widths = WIDTHS):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    name = widths.nvtx
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"{name}: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"{name}: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"{name}: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"{name}: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, widths=widths)
