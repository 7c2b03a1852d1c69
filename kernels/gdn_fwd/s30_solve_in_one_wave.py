"""gdn_fwd, stage 30: s29 with the solve at gate_free_solve.s12's launch bounds.

What changed from s29: where s29 runs s08's solve kernel (one or two value heads a CTA), s30
compiles it with gate_free_solve.s12's ``ctas_per_sm``: six CTAs an SM (``__launch_bounds__(128,
6)``, 80 registers and a few spills) where that makes the solve's grid one wave and four an SM do
not; elsewhere four, s29's kernel exactly. Among the benchmark's problems only (8, 24) 1x2048
changes: 792 CTAs, 1.5 waves at four an SM, one at six.

Why: the solve takes 19.8 us of (8, 24) 1x2048's forward against FlashQLA's 13.8
(``results/solve_in_forward.csv``, one H100); the library runs at 0.97x FlashQLA's speed there
(one H100, commit cf060dc), the last 1x2048 problem more than 1 % behind but (2, 8).

Measured effect (one H100, commit ba1bffa): (8, 24) 1x2048 0.0805 ms against the API's (s29's)
0.0854 and FlashQLA's 0.0813 in the same run (``python -m flashqla bench``); in a graph the solve
takes 15.6 us against s29's 20.4 (``results/timeline_prologue.csv``). Elsewhere s29's kernels (0.0719 against
0.0726 on (2, 8) 1x2048, run to run). Its tests passed on the GPU: the public shapes; bit for bit
against s29 on (8, 24) 1x2048, eagerly and from a CUDA graph (``tests/test_autocp.py``), the solve
at six CTAs an SM bit for bit s08's (``tests/test_reformulation.py``).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "__launch_bounds__(128, 6)", "wgmma", "tma_load")

S29 = stages.load("gdn_fwd", 29)        # the cumsum with the table, s27's kernels after it
S27 = S29.S27
SOLVE = stages.load("gate_free_solve", 12)
CHUNK_SIZE = S29.CHUNK_SIZE
HEAD_DIM = S29.HEAD_DIM


@functools.cache
def _solve_tf32(H: int, HV: int, heads_per_cta: int, ctas: int):
    """s08's kernel at ``ctas`` CTAs an SM (gate_free_solve.s12) as a programmatic dependent: at four,
    the program s27 compiles."""
    return compile_hopper(dependent_launch(SOLVE.gate_free_solve_kernel(H, HV, heads_per_cta, ctas)))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the solve at six CTAs an SM, then s29's kernels."""
    return (_solve_tf32(8, 24, 1, SOLVE.ONE_WAVE_CTAS_PER_SM).get_kernel_source()
            + S29.kernel_source())


def prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms):
    """The forward's kernels before AutoCP's and the fused kernel, on its flat buffers."""
    R = SOLVE.BY_FORWARD.heads_per_cta(H, HV, chunks.shape[0], sms)
    # g_cum, chunks, first_chunk <- the chunk-local cumsum of g and the chunk table
    S29._cumsum(HV)(g, seqs, g_cum, chunks, first_chunk)
    # Ab, gated <- the gate-free solve (s08's kernel at s12's CTAs an SM, or s06's)
    if R <= SOLVE.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS:
        ctas = SOLVE.ctas_per_sm(H, HV, chunks.shape[0], sms)
        _solve_tf32(H, HV, R, ctas)(k, beta, g_cum, chunks, ab, gated)
    else:
        S27._compiled("solve", H, HV, R)(k, beta, g_cum, chunks, ab, gated)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, *, prologue=prologue):
    """s29's forward with gate_free_solve.s12's launch bounds for the solve (``cp`` None decides,
    False never splits, True splits at the rule's cheapest L, an int is the segment length in
    chunks). ``prologue``: the kernels before AutoCP's (gdn_fwd.s31 passes its own)."""
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
    with nvtx_range("gdn_fwd.s30"):
        prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)
    widths, fused = S27.S18.WIDTHS, S27.S18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = S27.PIPELINE.split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is not None:  # AutoCP: windows, phase 1 (Z, M), phase 2 (each segment row's h0)
        J = p.max_segments
        win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
        exact = torch.empty_like(win_start)
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
        with nvtx_range("gdn_fwd.s30"):
            S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                         p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
            S27._compiled("warmup", H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk,
                                           exact, z, m)
            S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
        h0, seqs, first_chunk = h_seg, p.bounds, p.first_chunk
        BV = fused.block_v([1] * (seqs.shape[0] - 1), HV, V, sms, widths.step)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("gdn_fwd.s30"):
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
        raise ValueError(f"gdn_fwd.s30: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s30: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s30: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s30: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
