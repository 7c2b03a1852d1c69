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

Measured effect (one H100, commit ba1bffa, the same run; ms): (2, 8) 1x2048 0.0726 against s30's
0.0719, (4, 16) 0.0744 against 0.0769, (8, 24) 0.0800 against 0.0805, (16, 16) 0.0769 against 0.0781
(FlashQLA 0.0704, 0.0755, 0.0813, 0.0885). In a graph the span is 0.3-2.4 us shorter but on (4, 16),
where it is equal (gate_free_solve.s13's table, ``results/timeline_prologue.csv``). Its tests passed on the GPU: the public shapes; bit
for bit against s30 (the same table, g_cum, Ab and flags), eagerly and from a CUDA graph
(``tests/test_autocp.py``).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch, min_ctas_per_sm

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "first_chunk[", "wgmma", "tma_load")

S30 = stages.load("gdn_fwd", 30)        # the kernels where s06 solves, AutoCP's, the fused kernel
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


def prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms):
    """s30's prologue with the cumsum and the chunk table made by the solve where s08's kernel solves."""
    R = SOLVE.BY_GRID.BY_FORWARD.heads_per_cta(H, HV, chunks.shape[0], sms)
    if R <= SOLVE.TENSOR_CORE_MAX_HEADS:
        # g_cum, chunks, first_chunk, Ab, gated <- the table, the cumsum and s08's solve at s12's
        # CTAs an SM, in one kernel (gate_free_solve.s13)
        ctas = SOLVE.BY_GRID.ctas_per_sm(H, HV, chunks.shape[0], sms)
        _cumsum_solve(H, HV, R, ctas)(k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated)
    else:
        S30.prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)  # s06's solve


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s30's forward with the cumsum and the chunk table in the solve's prologue where s08's kernel
    solves (``cp`` None decides, False never splits, True splits at the rule's cheapest L, an int
    is the segment length in chunks)."""
    return S30.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp,
                       threshold, prologue=prologue)


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
