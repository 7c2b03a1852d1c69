"""gdn_fwd, stage 28: s27's programmatic dependents with gate_free_solve.s11's grouping.

What changed from s27: the solve's value heads a CTA come from gate_free_solve.s11 (s06's three or
four heads a CTA only where they leave three CTAs an SM; else s08's kernel at two heads, or one)
in place of s10. The kernels, their order and PDL are s27's; on a problem where s10 and s11 group
alike the two stages run the same launches.

Why: a kernel timeline of one forward in a CUDA graph (``profiles/timeline_lab.py``,
``results/timeline.csv``; one H100, commit ab90d41) put the gap to
FlashQLA on (8, 32) 1x2048 in the solve: 24.3 us at four heads a CTA (264 CTAs, two an SM) against
FlashQLA's 17.6, with the fused kernels level (61.5 and 62.7 us). Timing the solve inside the
forward at every grouping (``results/solve_in_forward.csv``) gave s11's rule: 15.9 us at two heads
a CTA there, and 15.9 where 25.4 on (2, 8) 1x8192.

Measured effect (the benchmark, one H100, commit 349a8ed, CUDA-graph replay, these rows and both
peers in one process; the API runs this stage, bit for bit), ms, with s27 and the API before it (s26's
kernels without PDL) from the run at c45772f on the same card:

    problem            s28      API     FlashQLA    FLA     | c45772f: s27     API
    (8, 32) 1x2048    0.0827   0.0832   0.0855    0.1419    |         0.0939  0.0964
    (4, 16) 1x2048    0.0781   0.0771   0.0764    0.1016    |         0.0849  0.0844
    (8, 24) 1x2048    0.0872   0.0885   0.0818    0.1237    |         0.0882  0.0941
    (2, 8) 1x8192     0.1569   0.1582   0.1675    0.2427    |            -    0.1696

On (8, 32) 1x2048 the library goes from 0.91x FlashQLA's speed to 1.03x, on (4, 16) 1x2048 from
0.90x to 0.99x, on (2, 8) 1x8192 from 0.98x to 1.06x. (8, 24) 1x2048 stays behind (0.92-0.94x):
one head a CTA saves 2 us of solve there (19.8 against 21.6 us) and the forward is level
(``results/solve_in_forward.csv``); its gap is in the fused kernel and the chunk table, not the
solve. On every other problem of the benchmark s11 groups as s10 did, so s28 runs s27's launches.
GPU tests (commit 349a8ed): the public shapes (24), AutoCP's tests of this stage (7), the library
bit for bit against it and its AutoCP check against float64 (``test_promoted``, 13).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

from flashqla import autocp, stages

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "cudaTriggerProgrammaticLaunchCompletion()",
                       "wgmma", "tma_load")

PIPELINE = stages.load("gdn_fwd", 27)   # the kernels, as programmatic dependents
SOLVE = stages.load("gate_free_solve", 11)
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
kernel_source = PIPELINE.kernel_source


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s27's forward with s11's grouping of the solve (``cp`` None decides, False never splits,
    True splits at the rule's cheapest L, an int is the segment length in chunks)."""
    return PIPELINE.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            cp, threshold, solve=SOLVE)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s28: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s28: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s28: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s28: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
