"""gdn_fwd, stage 25: s24's kernels with a rule that weighs every segment length of a ladder and
prices phase 3 by its waves.

What changed from s24: only the rule (``segment_chunks``). s18-s24's rules weigh two lengths, L0
(s18's: the shortest whose segments fill PHASE3_CTAS_PER_SM CTAs an SM on the SMs the unsplit
launch leaves idle) and 2 L0, priced as SEGMENT_CHUNK_STEPS L (1 + load / 2) + ... With two
sequences L0 comes out long: 150 chunks on (8, 32) and (16, 32) 28672+4096, where s24's sweep
has L 64 7 % faster than the unsplit launch the rule keeps (1.074 / 1.085 ms against 1.153 /
1.137). Here the candidates are LADDER (the lengths the sweep times, each at most a third of the
longest sequence) plus L0 and 2 L0, and a length costs, in chunk steps at BV 64,

    WAVE_CHUNK_STEPS L waves + SEGMENT_STEPS J + FIXED_STEPS,
    waves = ceil(2 HV S / (PHASE3_CTAS_PER_SM num_sms))      (S segments in all, J the longest's)

the phase-3 chunk loop as often as its CTAs (2 HV a segment at BV 64) take waves of the card.
The form with ``1 + load / 2`` has no constants that pick a measured length within 3 % of the best
on all 19 problems of s24's sweep once every length of the ladder is weighed; this one has 1380
grid points that do.

Why measured choices only: every length this rule can pick on a problem of the sweep was timed
there (the ladder is the sweep's), and on the benchmark's 40 problems it splits only problems of
the sweep. The constants: the grid search of s22-s24 (A in [0.5, 3], B in [0, 6], F in [0, 140])
over s24's sweep, every problem within 3 % of its fastest measured choice; the point with the most
feasible grid neighbours (101 of 125).

Measured effect (s24's sweep, one H100, commits 6879a4c and c5feab3; s24's kernels at this
rule's L): 0.93x s24's rule on (8, 32) and (16, 32) 28672+4096 (L 64: 1.074 and 1.085 ms against
1.153 and 1.137 unsplit; FlashQLA 1.302 and 1.303), 1.015x on (2, 8) 1x8192 (L 16 against 8:
0.174 against 0.171 ms, within the sweep's noise on that problem), the same choice on the other
16. Not timed as a row of the benchmark yet, and not promoted.

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import math

import torch

from flashqla import autocp, stages
from flashqla.varlen import host_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "autocp_chain_rows", "gdn_autocp_warmup_split")

PIPELINE = stages.load("gdn_fwd", 24)   # every kernel, and the forward at a given L
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
LADDER = (8, 16, 24, 32, 48, 64, 96)    # segment lengths weighed besides L0 and 2 L0 (split_lab's LS)
PHASE3_CTAS_PER_SM = 2                  # BV 64 CTAs an SM in a wave of phase 3
WAVE_CHUNK_STEPS = 2.45                 # per chunk of a segment and wave of phase 3
SEGMENT_STEPS = 4.8                     # per segment of the longest sequence (phases 1 and 2)
FIXED_STEPS = 16                        # once (windows, phase 2's launch)


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s24's kernels."""
    return PIPELINE.kernel_source()


def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, unsplit_step: float,
                   force: bool | int | None = None) -> int:
    """The cheapest L of LADDER (those at most a third of the longest sequence) and of L0, 2 L0
    (s18's, where they leave two segments or more), priced as in the module doc; automatic
    (``force`` None): that L if cheaper than the unsplit launch's ``unsplit_step`` x the longest
    sequence, else 0. ``force``: False never splits, True splits at the cheapest, an int is L."""
    s18 = PIPELINE.CHAIN.PIPELINE.PIPELINE
    if force is not None and force is not True:
        return s18.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, force)
    L0 = s18.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, True)
    if not L0:
        return 0
    longest = max(seq_chunks)
    lengths = {L for L in LADDER if 3 * L <= longest} | {L for L in (L0, 2 * L0) if L and -(-longest // L) >= 2}
    priced = []
    for L in sorted(lengths):
        segments = sum(-(-c // L) for c in seq_chunks)
        waves = math.ceil(2 * HV * segments / (PHASE3_CTAS_PER_SM * num_sms))
        priced.append((WAVE_CHUNK_STEPS * L * waves + SEGMENT_STEPS * -(-longest // L) + FIXED_STEPS, L))
    if force is True:
        return min(priced)[1] if priced else L0
    return min(priced + [(unsplit_step * longest, 0)])[1]


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s24's ``forward`` at this stage's L (``cp`` None decides, False never splits, True splits at
    the rule's cheapest L, an int is the segment length in chunks)."""
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    if cp is None or cp is True:
        s18 = PIPELINE.CHAIN.PIPELINE.PIPELINE
        sms = autocp.num_sms(q.device)
        bounds = list(range(0, (B + 1) * T, T)) if cu_seqlens is None else host_bounds(cu_seqlens)
        seq_chunks = ([-(-B * T // CHUNK_SIZE)] if bounds is None
                      else [-(-(e - s) // CHUNK_SIZE) for s, e in zip(bounds, bounds[1:])])
        BV = s18.PIPELINE.launch_width(cu_seqlens, B, T, HV, V, sms, s18.WIDTHS.step)
        cp = segment_chunks(seq_chunks, HV, sms, s18.WIDTHS.step[BV], cp) or False
    return PIPELINE.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            cp, threshold)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s25: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s25: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s25: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s25: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
