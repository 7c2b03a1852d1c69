"""gdn_fwd, stage 43: s42 with gate_free_solve.s16's kernel (the table, the cumsum and s15's solve in
one) wherever a CTA of the solve holds one or two value heads.

What changed from s42: the prologue's kernel at one or two heads a CTA (s14's launch bounds, six
CTAs an SM at one head, five at two); nothing else. With s42 every solve of the forward runs phase
B's block levels on mma.sync.

Why: gate_free_solve.s16's table (s15's solve against s14's kernel). The forwards it serves are
the (16, 16) and (16, 32) problems and the short ones (1x2048), where the solve was up to 40 % of
the forward ((16, 16) 8x4096: 146 us of 364; one H100, 2066b86, ``results/timeline_weak_rows.csv``).

Measured effect (one H100, commit 597433d; ``bench.time_row`` in one process), ms:

    problem              s40      s42      s43
    (16, 16) 8x4096     0.3692   0.3707   0.3367
    (16, 16) 1x8192     0.2162   0.2150   0.2046
    (16, 16) 1x32768    0.6067   0.6062   0.5707
    (16, 32) 8x4096     0.6156   0.6108   0.5902
    (16, 32) 1x8192     0.2941   0.2944   0.2867
    (16, 32) 28672+4096 1.0694   1.0692   1.0446
    (8, 24) 1x2048      0.0805   0.0806   0.0771
    (16, 16) 1x2048     0.0695   0.0707   0.0667
    (2, 8) 1x2048       0.0611   0.0607   0.0609
    (8, 32) 1x2048      0.0803   0.0806   0.0796

0.94-0.97x s42's time where the solve is s16's, unchanged elsewhere. Promoted: the library's
forward is s43's from 597433d on. With the peers (``python -m flashqla bench``, one H100, commit
1a05b0c, all 40 problems in one run of three calls on one machine): 0.96-2.06x FlashQLA's speed,
geomean 1.22x, at least its speed on 39 of 40 ((8, 24) 28672+4096: 0.827 ms against 0.798);
1.35-4.09x FLA's, geomean 2.50x; (16, 64) 1x32768 in 1.127 ms, 2.28x the floor. Its GPU tests
passed at 597433d and the library's (test_promoted, test_api) at 1a05b0c.

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

import functools

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper, dependent_launch, min_ctas_per_sm

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "tl::mma_sync<tl::DataType::kTensorFloat32", "first_chunk[")

S42 = stages.load("gdn_fwd", 42)                # the forward this one edits
SOLVE = stages.load("gate_free_solve", 16)      # the table, the cumsum and s15's solve in one kernel
S37, S30 = S42.S37, S42.S30
CHUNK_SIZE = S42.CHUNK_SIZE
HEAD_DIM = S42.HEAD_DIM
DEFAULT_SHAPE = dict(H=16, HV=32, R=2)


@functools.cache
def _cumsum_solve(H: int, HV: int, R: int):
    return compile_hopper(dependent_launch(min_ctas_per_sm(SOLVE.cumsum_solve_kernel(H, HV, R),
                                                           SOLVE.S14.ctas_per_sm(R))))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the cumsum-and-solve kernel at two heads a CTA."""
    return _cumsum_solve(**DEFAULT_SHAPE).get_kernel_source()


def prologue(store_wy: bool):
    """s42's prologue with gate_free_solve.s16's kernel where a CTA holds one or two heads."""
    wide = S42.prologue(store_wy)

    def run_prologue(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms):
        R = S30.SOLVE.BY_FORWARD.heads_per_cta(H, HV, chunks.shape[0], sms)
        if R > S30.SOLVE.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS:
            return wide(H, HV, k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated, sms)
        # g_cum, chunks, first_chunk, Ab, gated <- the table, the cumsum and s15's solve, one kernel
        _cumsum_solve(H, HV, R)(k, beta, g, seqs, g_cum, chunks, first_chunk, ab, gated)
    return run_prologue


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s42's forward with this stage's prologue (``cp`` None decides, False never splits, True
    splits at the rule's cheapest L, an int is the segment length in chunks)."""
    return S42.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold,
                       prologue=prologue)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s43: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s43: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s43: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s43: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
