"""gdn_fwd, stage 37: s36 where the wide kernel runs at 64 value columns a CTA; s34 at 128.

What changed from s36: the forward stores WY in the solve (s36's solve and wide kernel) only where
the wide launch is at BV 64; at BV 128 it is s34's again. The kernels are s36's and s34's.

Why: s36 against s34 (``bench.time_row`` in one process, one H100, commit f496a5f; the API
running s34's kernels), ms:

    problem              BV    API (s34)   s34      s36
    (16, 48) 1x2048      64     0.1089    0.1056   0.0951
    (16, 48) 1x8192      64     0.3710    0.3709   0.3389
    (16, 48) 1x32768     64     1.4367    1.4545   1.3343
    (16, 48) 28672+4096  64     1.3216    1.3185   1.2467
    (16, 64) 1x8192      64     0.3911    0.3862   0.3790
    (16, 64) 1x32768     64     1.5318    1.5360   1.5009
    (16, 64) 28672+4096  64     1.4782    1.4776   1.4858
    (16, 64) 8x4096     128     1.1633    1.1642   1.3436
    (16, 48) 8x4096     128     0.9117    0.8965   1.0144
    (8, 32) 8x4096      128     0.5834    0.5885   0.6660

At 64 columns s36 takes 0.90-1.01x s34's time; at 128, 1.13-1.15x. At 128 a CTA holds a whole
head, so the wide kernel built WY once a head already, and the solve's added exponentials (one per
stored element, on the many-chunk batches where the solve is a third of the forward) cost more
than the pass they replace. At 64 two CTAs built it for each head.

Its GPU tests passed (one H100, commit 924ffec): the public shapes, AutoCP's, and the library
built from it (promoted at ad1a56b, bit for bit). On the problem s36 never timed, with s34 in the
same process (``bench.time_row``), ms: (2, 8) 8x4096 0.1974 against 0.2091. Of the benchmark's 40
problems it stores WY on (16, 48) and (16, 64) at 1x2048, 1x8192, 1x32768 and 28672+4096, and on
(2, 8) 8x4096. gdn_fwd.s40 replaced its wide kernel in the library.

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

from flashqla import autocp, stages

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("cudaGridDependencySynchronize()", "wgmma", "tma_load", "tma_store", "exp2f")

S36 = stages.load("gdn_fwd", 36)        # the solve storing WY, the wide kernel without its pass
S34 = S36.S34                           # the forward, its kernels elsewhere
CHUNK_SIZE = S36.CHUNK_SIZE
HEAD_DIM = S36.HEAD_DIM
STEP = S36.STEP
WY_BLOCK_V = 64  # the one width at which the solve stores WY


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s36's kernels (the solve storing WY, the wide kernel at 64)."""
    return S36.kernel_source()


def stores_wy(q, v, cu_seqlens, cp) -> bool:
    """s36's condition (a wide launch that AutoCP leaves whole, after s06's solve) at BV 64 only."""
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    BV = S36.S27.S18.PIPELINE.launch_width(cu_seqlens, B, T, HV, V, autocp.num_sms(q.device), STEP)
    return BV == WY_BLOCK_V and S36.stores_wy(q, v, cu_seqlens, cp)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s34's forward, with s36's solve and wide kernel where ``stores_wy`` (``cp`` None decides, False
    never splits, True splits at the rule's cheapest L, an int is the segment length in chunks)."""
    if not stores_wy(q, v, cu_seqlens, cp):
        return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold)
    return S34.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, threshold,
                       prologue=S36.prologue, fused=S36._wide)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s37: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s37: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s37: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s37: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
