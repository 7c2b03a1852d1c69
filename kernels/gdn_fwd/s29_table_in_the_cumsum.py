"""gdn_fwd, stage 29: s28 with the chunk table built by the cumsum (chunk_local_cumsum.s03): one
launch fewer in every forward.

What changed from s28: the first kernel is chunk_local_cumsum.s03, a programmatic dependent like
the rest, which takes the sequence bounds and writes g_cum, the chunk table and first_chunk; the
solve, AutoCP's kernels and the fused kernel read that table. s28 took the table from
``flashqla.varlen.chunk_table``: from the host's cache when called eagerly, and inside a CUDA
graph from a kernel of its own, one CTA launched before the cumsum on every replay. Here no
forward builds or caches a table apart from the cumsum, eager or captured.

Why: in a graph the table kernel takes 3.3-3.8 us of every short forward (``results/
timeline.csv``, one H100, commit ab90d41) and the cumsum waits for it; FlashQLA's graph starts
with its cumsum. On the 1x2048 problems that is 4-5 % of the forward.

Measured effect (one H100, commit 4c2e89f, where the API was s28): in a CUDA graph of one forward
(``profiles/timeline_lab.py``) the span falls from 73.0 to 70.4 us on (2, 8) 1x2048, 74.9 to 72.2
on (4, 16) and 82.8 to 80.4 on (8, 32): the cumsum with its table takes 2.0-2.9 us, where the
table kernel took 3.3-3.6 and s02's cumsum 4.0-4.6 after it (overlapping by 2.6-2.9 under PDL). The
benchmark (graph replay, ms): (2, 8) 1x2048 0.0724 against s28's 0.0748 (FlashQLA 0.0696, FLA
0.0822); (4, 16) 1x2048 0.0784 against 0.0789 (FlashQLA 0.0759). Its tests passed there: the
public shapes; AutoCP's tests of the stage; bit for bit against s28 (the same kernels after the
cumsum, reading an equal table), eager and replayed from a CUDA graph. Promoted.

The library on it (one H100, commit cf060dc, graph replay; later runs replace these rows in the
CSV), ms:

    problem            API      FlashQLA  FLA
    (2, 8) 1x2048      0.0735   0.0699    0.0826
    (4, 16) 1x2048     0.0760   0.0762    0.1045
    (8, 32) 1x2048     0.0833   0.0851    0.1410
    (16, 32) 1x2048    0.0864   0.0895    0.1488
    (8, 24) 1x2048     0.0856   0.0827    0.1232
    (16, 16) 1x2048    0.0811   0.0799    0.1099
    (16, 16) 8x4096    0.3787   0.3593    1.1323

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "cudaTriggerProgrammaticLaunchCompletion()",
                       "first_chunk[", "wgmma", "tma_load")

PIPELINE = stages.load("gdn_fwd", 28)   # the kernels after the cumsum (s27's), s11's grouping
S27 = PIPELINE.PIPELINE
CUMSUM = stages.load("chunk_local_cumsum", 3)
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM


@functools.cache
def _cumsum(HV: int):
    """chunk_local_cumsum.s03's kernel as a programmatic dependent, with s03's options."""
    return compile_hopper(dependent_launch(CUMSUM.chunk_local_cumsum_kernel(HV)),
                          {"tl.disable_safe_memory_legalize": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: this stage's cumsum, then s27's kernels."""
    return _cumsum(S27.DEFAULT_SHAPE["HV"]).get_kernel_source() + S27.kernel_source()


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s28's forward with the table from the cumsum (``cp`` None decides, False never splits, True
    splits at the rule's cheapest L, an int is the segment length in chunks)."""
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
    R = PIPELINE.SOLVE.heads_per_cta(H, HV, chunks.shape[0], sms)
    with nvtx_range("gdn_fwd.s29"):
        # g_cum, chunks, first_chunk <- the chunk-local cumsum of g and the chunk table
        _cumsum(HV)(g, seqs, g_cum, chunks, first_chunk)
        # Ab, gated <- the gate-free solve
        S27._compiled("solve_tf32" if R <= PIPELINE.SOLVE.BY_HEADS.TENSOR_CORE_MAX_HEADS else "solve",
                      H, HV, R)(k, beta, g_cum, chunks, ab, gated)
    widths, fused = S27.S18.WIDTHS, S27.S18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = S27.PIPELINE.split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is not None:  # AutoCP: windows, phase 1 (Z, M), phase 2 (each segment row's h0)
        J = p.max_segments
        win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
        exact = torch.empty_like(win_start)
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
        with nvtx_range("gdn_fwd.s29"):
            S27._compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                         p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
            S27._compiled("warmup", H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk,
                                           exact, z, m)
            S27._compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
        h0, seqs, first_chunk = h_seg, p.bounds, p.first_chunk
        BV = fused.block_v([1] * (seqs.shape[0] - 1), HV, V, sms, widths.step)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("gdn_fwd.s29"):
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
        raise ValueError(f"gdn_fwd.s29: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s29: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s29: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s29: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
