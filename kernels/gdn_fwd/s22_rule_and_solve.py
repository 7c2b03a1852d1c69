"""gdn_fwd, stage 22: s21's forward with a rule refitted to its cheaper phase 2, on
gate_free_solve.s09, the solve chosen by the value heads a CTA holds (s08's tensor-core half with
one or two, s06 with three or four).

What changed from s21, first: the rule. s21 kept s20's ``segment_chunks``, whose costs were fitted
with phase 2 as batched matmuls (3.8 chunk steps a segment). s21 chains in one kernel, so a segment
costs less, and s20's rule no longer picks the fastest split: it leaves (4, 16) and (16, 16)
1x8192 unsplit (0.283 and 0.301 ms, against 0.252 and 0.281 at L 16), splits (2, 8) 1x8192 at L 16
(0.193 against 0.185 at L 8), and never splits (8, 24) 1x32768 (1.124 against 0.994 at L 103).
The same form, refitted to s21's sweep (``profiles/split_lab.py --stage 21``, ``results/
autocp_split.csv``): SEGMENT_CHUNK_STEPS 2.0 (was 2.6), SEGMENT_STEPS 1.2 (was 3.8), FIXED_STEPS
10 (was 8).

Second: the solve. s21 (through s18) ran gate_free_solve.s05; the library has run
s06 (the same bits, 0.85-0.90x its time) since commit 02d7c5e, and s09 runs s08's kernel where it
is faster: 0.83-0.85x s06's time on (16, 32), 0.93-0.94x on (16, 16) (``results/solve.csv``, 4 x
H100, commit d8516c1). Where s08 runs, Ab is no longer s02's bits: its lower-left half is two tf32
products (1.5-2.9e-4 relative L2 on Ab, against 1.6-1.9e-3 for its bf16 store).

Measured effect (the benchmark's rows s20-s22, the API and both peers rerun on the 17 problems that
the rule or the solve changed; one H100, commit e7a917b, ``results/gdn_fwd.csv``):
- the rule: 0.89x s21's time on (8, 24) 1x32768 (L 103: 0.967 ms, 1.05x FlashQLA), 0.90x on (4,
  16) 1x8192 and 0.92x on (16, 16) 1x8192 (L 16, with the solve); level on (2, 8) 1x8192 (L 8
  against s21's L 16: 0.189 ms both in this run, 0.185 against 0.193 in the sweep);
- the solve, where nothing splits: 0.91-0.98x s21's time on (16, 32) and (16, 16), except the
  1x2048 problems (1.02x and 0.99x);
- where both split alike: 0.96-1.03x (the runs' noise).
GPU tests: the public shapes, AutoCP on vs off, flags, determinism, graph replay (commit 3e168be).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import torch

from flashqla import autocp, stages
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "autocp_chain", "kTensorFloat32")

PIPELINE = stages.load("gdn_fwd", 21)   # everything but the solve and the rule
SOLVE = ("gate_free_solve", 9)          # Ab and the gated flags
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
# the rule's costs (``segment_chunks``), s20's with s21's phase 2, in chunk steps of phase 3 at
# BV 64: per chunk of a segment at one CTA an SM (phases 1 and 3), per segment (phase 2's chaining
# a boundary), once (windows, launches); a point of a grid search over s21's sweep where the rule
# picks a measured split within 3 % of the fastest on every problem, as it does at all 125 grid
# points within +-0.1, +-0.4 and +-4 of it
SEGMENT_CHUNK_STEPS = 2.0
SEGMENT_STEPS = 1.2
FIXED_STEPS = 10


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s21's kernels, then the solves s09 chooses from."""
    return PIPELINE.kernel_source() + stages.load(*SOLVE).kernel_source()


def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, unsplit_step: float,
                   force: bool | int | None = None) -> int:
    """s20's rule with this stage's costs: L0 (s18's L, the shortest whose segments fit two
    phase-3 CTAs an SM) and 2 L0 each cost, in chunk steps at BV 64,

        SEGMENT_CHUNK_STEPS L (1 + load / 2) + SEGMENT_STEPS J + FIXED_STEPS

    with J the longest sequence's segments and load the phase-3 CTAs an SM (2 HV a segment).
    Automatic (``force`` None): the cheaper, if below the unsplit launch's ``unsplit_step`` x the
    longest sequence, else 0. ``force``: False never splits, True splits at the cheaper, an int is L."""
    s18 = PIPELINE.PIPELINE.PIPELINE
    if force is not None and force is not True:
        return s18.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, force)
    L0 = s18.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, True)
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
    s18 = PIPELINE.PIPELINE.PIPELINE
    bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
    seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                  else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
    L = segment_chunks(seq_chunks, HV, num_sms, unsplit_step, cp)
    return s18.split_plan(cu_seqlens, B, T, HV, num_sms, device, L if L else False, unsplit_step)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s21's ``forward`` with this stage's rule (``cp`` None decides, False never splits, True
    splits by the rule, an int is the segment length in chunks) and SOLVE's solve."""
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
    p = split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
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
