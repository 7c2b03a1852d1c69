"""gdn_fwd, stage 42: s40 with gate_free_solve.s15's solve (phase B's block levels on mma.sync)
wherever a CTA of the solve holds three or four value heads.

What changed from s40: the prologue's solve kernel at three or four heads a CTA, storing WY where
s40 does (s37's ``stores_wy``) and Ab elsewhere; nothing else. The cumsum-and-solve kernel (one or
two heads a CTA), the fused kernels and AutoCP are s40's.

Why: the solve was 400 us of the API's 1151 on (16, 64) 8x4096 and 163 of 854 on (8, 24)
28672+4096 (one H100, 2066b86; ``results/timeline_weak_rows.csv``), moving its bytes at about 1 TB/s,
bound by shared-memory loads (gate_free_solve.s15's docstring).

Measured effect (one H100, commit ccabfe0; ``bench.time_row`` in one process), ms:

    problem              s40      s42
    (16, 64) 1x8192     0.3621   0.2984
    (16, 64) 1x32768    1.3972   1.1137
    (16, 64) 8x4096     1.1641   1.0302
    (16, 48) 1x32768    1.2248   1.0394
    (8, 24) 28672+4096  0.8616   0.8256
    (8, 32) 1x8192      0.2950   0.2834
    (2, 8) 8x4096       0.1851   0.1573
    (4, 16) 8x4096      0.3059   0.2812

0.80-0.96x s40's time. The forward gains more than the solve alone saves ((16, 64) 1x8192: 63 us
against 19 in ``results/solve_kernels.csv``); why was not measured (a timeline of the forward,
``profiles/timeline_lab.py``, would show where). Its GPU tests passed there: the gdn_fwd check
against float64 where s40's kernel runs, flagged chunks included, and the same bits eagerly and
from a CUDA graph (``tests/test_autocp.py``); the public shapes.

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tl::mma_sync<tl::DataType::kTensorFloat32")

S40 = stages.load("gdn_fwd", 40)                # the forward this one edits
SOLVE = stages.load("gate_free_solve", 15)      # the solve with phase B on mma.sync
S37, S34 = S40.S37, S40.S34
S30 = S34.S33.S32.S31.S30                       # the cumsum (s29's) and the heads a CTA (s11's)
CHUNK_SIZE = S40.CHUNK_SIZE
HEAD_DIM = S40.HEAD_DIM
DEFAULT_SHAPE = dict(H=16, HV=64)


@functools.cache
def _solve(H: int, HV: int, R: int, store_wy: bool):
    return compile_hopper(dependent_launch(SOLVE.gate_free_solve_kernel(H, HV, R, store_wy)))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the solve at four heads a CTA, storing WY."""
    return _solve(**DEFAULT_SHAPE, R=4, store_wy=True).get_kernel_source()


def prologue(store_wy: bool):
    """s40's prologue with gate_free_solve.s15's solve where a CTA holds three or four heads
    (storing WY = Gamma * Ab if ``store_wy``), s32's kernel elsewhere."""
    def run_prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms):
        R = S30.SOLVE.BY_FORWARD.heads_per_cta(H, HV, chunks.shape[0], sms)
        if R <= S30.SOLVE.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS:
            return S34.S33.S32.prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)
        # g_cum, chunks, first_chunk <- the chunk-local cumsum of g and the chunk table
        S30.S29._cumsum(HV)(g, seqs, g_cum, chunks, first_chunk)
        # Ab (or WY), gated <- s15's solve
        _solve(H, HV, R, store_wy)(k, beta, g_cum, chunks, ab, gated)
    return run_prologue


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD, *, prologue=prologue):
    """s40's forward with this stage's prologue (``cp`` None decides, False never splits, True
    splits at the rule's cheapest L, an int is the segment length in chunks). ``prologue(store_wy)``:
    the kernels before AutoCP's (this stage's); gdn_fwd.s43 passes its own."""
    if S37.stores_wy(q, v, cu_seqlens, cp):
        return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold,
                           prologue=prologue(True), fused=S40._wide)
    return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold,
                       prologue=prologue(False))


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s42: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s42: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s42: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s42: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
