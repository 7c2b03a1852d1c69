"""gdn_fwd, stage 32: s31 with the cumsum-and-solve kernel at gate_free_solve.s14's CTAs an SM.

What changed from s31: the launch bounds of the first kernel where s08's solve runs in it (one or
two value heads a CTA): six CTAs an SM at one head a CTA and five at two, on every grid
(gate_free_solve.s14), where s31 took four but where six made the grid one wave (s12's rule).
The kernels and everything after the first are s31's.

Why: s08's kernel alone is up to 15 % faster at six CTAs an SM with one head a CTA on grids of
many waves ((16, 16) 8x4096: 135.3 us against 144.1) and 9 % faster at five with two heads on
(2, 8) 1x8192 (gate_free_solve.s14's table, one H100, ba1bffa).

Measured effect (``python -m flashqla bench``, one H100, commit 6eedafa, the same run), ms:

    problem            s29      s32      FlashQLA   FLA
    (2, 8) 1x2048     0.0724   0.0685   0.0714    0.0822
    (2, 8) 1x8192     0.1535   0.1520   0.1672    0.2635
    (4, 16) 1x2048    0.0761   0.0758   0.0758    0.1032

s31 was not in that run (against s30 at ba1bffa: s31's docstring). (16, 16) 8x4096, the many-wave
grid where the solve alone gains most, was not timed. Its tests passed on the GPU: the public
shapes; bit for bit against s31, eagerly and from a CUDA graph (``tests/test_autocp.py``).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

from flashqla import autocp, stages

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "__launch_bounds__(128, 5)", "wgmma", "tma_load")

S31 = stages.load("gdn_fwd", 31)        # the kernels, the forward (s30's)
SOLVE = stages.load("gate_free_solve", 14)
CHUNK_SIZE = S31.CHUNK_SIZE
HEAD_DIM = S31.HEAD_DIM


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the cumsum and solve at two heads a CTA, five CTAs an SM,
    then s29's kernels."""
    return (S31._cumsum_solve(16, 32, 2, SOLVE.ctas_per_sm(2)).get_kernel_source()
            + S31.S30.S29.kernel_source())


def prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms):
    """s31's prologue with gate_free_solve.s14's CTAs an SM."""
    R = SOLVE.BY_GRID.BY_FORWARD.heads_per_cta(H, HV, chunks.shape[0], sms)
    if R <= SOLVE.PROLOGUE.TENSOR_CORE_MAX_HEADS:
        # g_cum, chunks, first_chunk, Ab, gated <- the table, the cumsum and s08's solve, one kernel
        S31._cumsum_solve(H, HV, R, SOLVE.ctas_per_sm(R))(k, beta, g, seqs, g_cum, chunks, first_chunk,
                                                           ab, gated)
    else:
        S31.S30.prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)  # s06's solve


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s31's forward with gate_free_solve.s14's CTAs an SM (``cp`` None decides, False never splits,
    True splits at the rule's cheapest L, an int is the segment length in chunks)."""
    return S31.S30.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp,
                           threshold, prologue=prologue)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s32: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s32: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s32: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s32: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
