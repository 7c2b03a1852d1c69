"""gdn_fwd, stage 27: s26's kernels launched as programmatic dependents: each waits on the one
before it inside the kernel, not at the launch boundary.

What changed from s26: every TileLang kernel of the forward (the chunk table where a CUDA graph
captures it, cumsum, solve, AutoCP's windows, warm-up and chain, the fused kernel) is compiled with ``flashqla.hopper.dependent_launch``: its
first statements are ``griddepcontrol.wait`` (wait for the previous kernel to finish and its
writes to be visible) and ``griddepcontrol.launch_dependents`` (let the next kernel's CTAs be
scheduled), and TileLang launches it with programmatic stream serialization. Nothing else
changes: the same programs after those two instructions, the same order, the same rule; the
forward also calls the kernels directly, as the library does (one chunk table, built once).

Why: on the 1x2048 problems the whole forward is 77-115 us (the API, one H100, commit 98a6f05)
and four kernels run one after another: the chunk table, the cumsum (1.6-2.5 us alone), the solve
(6-23 us) and the fused kernel. Without PDL each launch waits for its predecessor's last CTA to
retire before its own CTAs are even scheduled; the per-kernel times alone (``results/
prologue.csv``) add up to less than the forward's time. With PDL a kernel's CTAs are resident and
waiting when the previous one ends, so the gap between kernels shrinks to the wait's release. The
wait comes first, before any load, so no kernel reads what its predecessor (or one before it,
which the predecessor waited for) has not finished writing.

Measured effect (the benchmark, one H100, commit c45772f, CUDA-graph replay, these rows and both
peers in one process), ms. The API runs s26's kernels with the same host code as this stage (one
chunk table), so s27 / API is what PDL changes:

    problem             s27      API    s27/API   s26    FlashQLA    FLA
    (2, 8) 1x2048      0.0743   0.0781   0.95    0.0818   0.0710    0.0848
    (4, 16) 1x2048     0.0849   0.0844   1.01    0.0909   0.0758    0.1032
    (8, 32) 1x2048     0.0939   0.0964   0.97    0.1044   0.0877    0.1450
    (8, 24) 1x2048     0.0882   0.0941   0.94    0.0986   0.0853    0.1250
    (16, 16) 1x2048    0.0819   0.0852   0.96    0.0889   0.0800    0.1096
    (16, 32) 1x2048    0.0872   0.0908   0.96    0.0967   0.0902    0.1482
    (16, 48) 1x2048    0.1102   0.1109   0.99    0.1189   0.1112    0.2178
    (16, 64) 1x2048    0.1154   0.1162   0.99    0.1200   0.1212    0.2596
    (16, 16) 1x8192    0.2255   0.2319   0.97    0.2354   0.2333    0.3692
    (8, 32) 1x8192     0.2985   0.3073   0.97    0.3065   0.3073    0.5219
    (16, 48) 1x8192    0.3873   0.3846   1.01    0.3875   0.3812    0.7654

0.94-1.01x the API's time, 3-6 us off most short problems. A kernel timeline of one replay
(``profiles/timeline_lab.py``, ``results/timeline.csv``; one H100, commit ab90d41) shows why it is
not more: without PDL the gaps between kernels are
already 0.3-0.5 us in a graph; what PDL hides is the launch's ramp (the next kernel's CTAs are
resident when the wait releases). The chunk table kernel (3.5-3.8 us, one CTA) and the solve stay
on the path: on (8, 32) 1x2048 the solve takes 24 us at four heads a CTA where FlashQLA's takes 18
(gate_free_solve.s11, gdn_fwd.s28). GPU tests: the public shapes (24); AutoCP's tests of this
stage and the bit-for-bit test against s26, eager and two forwards in one graph (11; c45772f).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch
from flashqla.nvtx import nvtx_range
from flashqla import varlen
from flashqla.varlen import capturing, chunk_table, num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "cudaTriggerProgrammaticLaunchCompletion()",
                       "wgmma", "tma_load")

PIPELINE = stages.load("gdn_fwd", 26)   # the rule, the solve's grouping, the stages of every kernel
S24 = PIPELINE.PIPELINE
S18 = S24.CHAIN.PIPELINE.PIPELINE
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
SOLVE = stages.load(*PIPELINE.SOLVE)
DEFAULT_SHAPE = dict(H=16, HV=32)
FUSED_CONFIGS = {"tl.disable_shared_memory_reuse": True, "tl.enable_fast_math": True}
# every kernel of the forward: (its builder, the pass configs its stage compiles it with)
KERNELS = {
    "table": (varlen._table_kernel, None),
    "cumsum": (stages.load(*PIPELINE.CUMSUM).chunk_local_cumsum_kernel, {"tl.disable_safe_memory_legalize": True}),
    "solve": (SOLVE.BY_HEADS.BALANCED.gate_free_solve_kernel, None),
    "solve_tf32": (SOLVE.BY_HEADS.TENSOR_CORE.gate_free_solve_kernel, None),
    "windows": (S18.windows_kernel, None),
    "warmup": (S24.PIPELINE.warmup_kernel, FUSED_CONFIGS),
    "chain": (S24.chain_kernel, None),
    "fused_narrow": (stages.load("gdn_fwd", 12).fused_reform_kernel, FUSED_CONFIGS),
    "fused": (stages.load("gdn_fwd", 16).fused_state_value_kernel, FUSED_CONFIGS),
}
FUSED_AT = {32: "fused_narrow", 64: "fused", 128: "fused"}   # s17's widths


@functools.cache
def _compiled(name: str, *shape):
    builder, configs = KERNELS[name]
    return compile_hopper(dependent_launch(builder(*shape)), configs)


def chunk_rows(cu_seqlens, B: int, T: int, device):
    """``flashqla.varlen.chunk_table``; inside a CUDA-graph capture (where that builds the table
    anew on every replay) built by its kernel as a programmatic dependent, like the others."""
    build = _compiled("table", CHUNK_SIZE)  # compiled on the first (eager) call, never inside a capture
    if not capturing(device):
        return chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    bounds = seq_bounds(cu_seqlens, B, T, device)
    table = torch.empty(num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE), 2, dtype=torch.int32, device=device)
    first_chunk = torch.empty(bounds.shape[0], dtype=torch.int32, device=device)
    with nvtx_range("gdn_fwd.s27"):
        # table, first_chunk <- [start, end) of every chunk, each sequence's first chunk row
        build(bounds, B * T, table, first_chunk)
    return table, first_chunk


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the cumsum, the solve and the fused kernel at the default
    shape."""
    H, HV = DEFAULT_SHAPE["H"], DEFAULT_SHAPE["HV"]
    return (_compiled("cumsum", HV).get_kernel_source()
            + _compiled("solve_tf32", H, HV, 2).get_kernel_source()
            + _compiled("fused", H, HV, HEAD_DIM, HEAD_DIM, 64).get_kernel_source())


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, *, solve=SOLVE):
    """s26's forward with every kernel a programmatic dependent (``cp`` None decides, False never
    splits, True splits at the rule's cheapest L, an int is the segment length in chunks).
    ``solve``: the gate_free_solve stage whose grouping (``heads_per_cta``) the solve takes
    (gdn_fwd.s28 passes s11)."""
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

    chunks, first_chunk = chunk_rows(cu_seqlens, B, T, device)
    g_cum = torch.empty(B * T, HV, **fp32)
    ab = torch.empty(B * T, HV, CHUNK_SIZE, dtype=torch.bfloat16, device=device)
    gated = torch.empty(chunks.shape[0], HV, dtype=torch.int32, device=device)
    sms = autocp.num_sms(device)
    R = solve.heads_per_cta(H, HV, chunks.shape[0], sms)
    with nvtx_range("gdn_fwd.s27"):
        # g_cum <- chunk-local cumsum of g; Ab, gated <- the gate-free solve
        _compiled("cumsum", HV)(g, chunks, g_cum)
        _compiled("solve_tf32" if R <= SOLVE.BY_HEADS.TENSOR_CORE_MAX_HEADS else "solve", H, HV, R)(
            k, beta, g_cum, chunks, ab, gated)
    widths, fused = S18.WIDTHS, S18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = PIPELINE.split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is not None:  # AutoCP: windows, phase 1 (Z, M), phase 2 (each segment row's h0)
        J = p.max_segments
        win_start = torch.empty(J * N, HV, dtype=torch.int32, device=device)
        exact = torch.empty_like(win_start)
        z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
        h_seg = torch.empty(p.bounds.shape[0] - 1, HV, K, V, **fp32)
        with nvtx_range("gdn_fwd.s27"):
            _compiled("windows", HV)(g, g_cum, beta, gated, p.slot_start, p.slot_warm.to(torch.int32),
                                     p.slot_chunk, p.segment_chunks, float(threshold), win_start, exact)
            _compiled("warmup", H, HV)(k, v, ab, g_cum, gated, win_start, p.slot_start, p.slot_chunk,
                                       exact, z, m)
            _compiled("chain", HV)(h0, z, m, exact, p.row_of_slot, h_seg)
        h0, seqs, first_chunk = h_seg, p.bounds, p.first_chunk
        BV = fused.block_v([1] * (seqs.shape[0] - 1), HV, V, sms, widths.step)
    ht = torch.empty(h0.shape, **fp32)
    with nvtx_range("gdn_fwd.s27"):
        # o, final states <- the fused chain and output over sequences (or segments)
        _compiled(FUSED_AT[BV], H, HV, K, V, BV)(q, k, v, ab, g_cum, gated, h0, seqs, first_chunk,
                                                 scale, o, ht)
    if p is not None and output_final_state:
        ht = ht.index_select(0, p.last_segment)  # the state a sequence's last segment leaves
    return o.view(B, T, HV, V), (ht if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s27: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s27: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s27: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s27: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
