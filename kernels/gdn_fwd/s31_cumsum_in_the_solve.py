"""gdn_fwd, stage 31: s30 with the cumsum and the chunk table made in the solve's prologue
(gate_free_solve.s13): two launches a forward where the solve runs s08's kernel.

What changed from s30: where s30 runs chunk_local_cumsum.s03 and then s08's solve (one or two
value heads a CTA), one kernel does both: each solve CTA finds its chunk from the sequence bounds,
scans g for its heads, writes g_cum and the table, and solves (gate_free_solve.s13, compiled as a
programmatic dependent at s12's CTAs an SM). With three or four heads a CTA (s06's kernel) s30's
two kernels run. AutoCP's kernels and the fused kernel are s30's.

Why: on the short problems, where s08's kernel runs, the forward is the prologue and one fused
kernel; the cumsum is a launch of its own (2.0-2.9 us in a graph, one H100, 4c2e89f) that the
solve waits for, though the solve needs only k and beta but for a flagged head's gate.

Measured effect: not yet run on a GPU (written with the session's GPU time spent). Its tests: the
public shapes; bit for bit against s30 (the same table, g_cum, Ab and flags), eagerly and from a
CUDA graph (``tests/test_autocp.py``).

Taught in: notebooks/04_reformulation.py (the solve)
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch, min_ctas_per_sm
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "first_chunk[", "wgmma", "tma_load")

S30 = stages.load("gdn_fwd", 30)        # the kernels where s06 solves, AutoCP's, the fused kernel
S27 = S30.S27
SOLVE = stages.load("gate_free_solve", 13)
CHUNK_SIZE = S30.CHUNK_SIZE
HEAD_DIM = S30.HEAD_DIM


@functools.cache
def _cumsum_solve(H: int, HV: int, heads_per_cta: int, ctas: int):
    """gate_free_solve.s13's kernel at ``ctas`` CTAs an SM, as a programmatic dependent."""
    kernel = min_ctas_per_sm(SOLVE.cumsum_solve_kernel(H, HV, heads_per_cta), ctas)
    return compile_hopper(dependent_launch(kernel))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the cumsum and solve at two heads a CTA, then s29's kernels."""
    return (_cumsum_solve(16, 32, 2, SOLVE.MIN_CTAS_PER_SM).get_kernel_source()
            + S30.S29.kernel_source())


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s30's forward with the cumsum and the chunk table in the solve's prologue where s08's kernel
    solves (``cp`` None decides, False never splits, True splits at the rule's cheapest L, an int
    is the segment length in chunks)."""
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
    R = SOLVE.BY_GRID.BY_FORWARD.heads_per_cta(H, HV, chunks.shape[0], sms)
    with nvtx_range("gdn_fwd.s31"):
        if R <= SOLVE.TENSOR_CORE_MAX_HEADS:
            # g_cum, chunks, first_chunk, Ab, gated <- the table, the cumsum and s08's solve at s12's
            # CTAs an SM, in one kernel (gate_free_solve.s13)
            ctas = SOLVE.BY_GRID.ctas_per_sm(H, HV, chunks.shape[0], sms)
            _cumsum_solve(H, HV, R, ctas)(k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated)
        else:
            # g_cum, chunks, first_chunk <- the chunk-local cumsum of g and the chunk table; then
            # Ab, gated <- s06's solve
            S30.S29._cumsum(HV)(g, seqs, g_cum, chunks, first_chunk)
            S27._compiled("solve", H, HV, R)(k, beta, g_cum, chunks, ab, gated)
    widths, fused = S27.S18.WIDTHS, S27.S18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = S27.PIPELINE.split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is not None:  # AutoCP: windows, phase 1 (Z, M), phase 2 (each segment row's h0)
        J = p.max_segments
        win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
        exact = torch.empty_like(win_start)
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
        with nvtx_range("gdn_fwd.s31"):
            S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                         p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
            S27._compiled("warmup", H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk,
                                           exact, z, m)
            S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
        h0, seqs, first_chunk = h_seg, p.bounds, p.first_chunk
        BV = fused.block_v([1] * (seqs.shape[0] - 1), HV, V, sms, widths.step)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("gdn_fwd.s31"):
        # o, final states <- the fused chain and output over sequences (or segments)
        S27._compiled(S27.FUSED_AT[BV], H, HV, K, V, BV)(q, k, v, ab, g_cum, gated, h0, seqs, first_chunk,
                                                         scale, o, ht)
    if p is not None and output_final_state:
        ht = ht.index_select(0, p.last_segment)  # the state a sequence's last segment leaves
    return o.view(B, T, HV, V), (ht if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s31: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s31: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s31: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s31: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
