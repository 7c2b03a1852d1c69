"""gdn_fwd, stage 24: s23 with phase 2 moving only what it needs: M only where a head has an
exact slot, and each segment's initial state written straight into its row.

What changed from s23: phase 2 (``chain_kernel``, s21's chaining h_j = Z_j + M_j h_{j-1}).
- s21's kernel loads M_j (128 x 128 fp32, 64 KiB) in every CTA of every (sequence, value head),
  and its CTAs hold 8 state columns each: M is read 16 times over. A warm-up head's M_j is zero
  (phase 1 writes zeros), so for a head with no exact slot that is all wasted: h_j = Z_j. Here a
  CTA first reads its head's exact flags (J ints) and only where one is set runs s21's pipelined
  chain; elsewhere it copies Z_j.
- s21 wrote the slots (j N + n) and ``index_select`` copied them into segment rows for phase 3
  (``Plan.slot_of_segment``): a second pass over all the states (8 MiB on (4, 16) 1x8192 at L 16).
  Here the kernel writes each slot's state into its row (``Plan.row_of_slot``, -1: no segment).

Why (one H100, commit f36f275, torch.profiler): phase 2 took 33-37 us on every split problem,
whatever its heads and length: (2, 8) 1x8192 at L 8, 34.5 us; (16, 16) 1x32768 at L 64, 36.0;
(8, 24) 1x32768 at L 103, 32.7. Each moved M 16 times: 16 slots x 8 heads x 64 KiB x 16 = 134 MB
on (2, 8) 1x8192, 134 MB on (16, 16) 1x32768, 151 MB on (8, 24): 3.9-4.6 TB/s, the L2's
bandwidth. On the benchmark's inputs only the g = 0 heads (a quarter) are exact, so a quarter of
that traffic is needed. The ``index_select`` after it took 5-13 us more.

Then the rule. s23's costs were fitted to a sweep of 14 problems; they also split five problems
that no earlier rule split and no sweep had timed: (8, 32) and (16, 32) 1x8192 (L 32: 3-5 % slower
than unsplit), (8, 24) 1x8192 (L 26: 0.92x unsplit, the best), (8, 32) and (16, 32) 28672+4096
(L 150: 1 % slower than unsplit, where L 64 is 7 % faster; the rule's candidates are only L0 = 150
and 2 L0). This stage's sweep (``profiles/split_lab.py --stage 24``, 19 problems, commits 6879a4c
and c5feab3) refits s23's form: a chunk of a segment 1.5 steps, a segment 0.2, fixed 24
(``SEGMENT_CHUNK_STEPS``). On those two 28672+4096 problems the rule is held to the best of its
own choices (unsplit), not to L 64: choosing L outside {L0, 2 L0} is left for later.

Measured effect (one H100). Per kernel at the same L as s23 (commit 6879a4c, torch.profiler):
phase 2 takes 25-26 us instead of 36-37 on (4, 16) and (16, 16) 1x8192 and (16, 16) 1x32768, 22.7
instead of 32.6 on (8, 24) 1x32768; no change on (2, 8) (37.5 us at L 32, 36.3 at L 8): with two
exact heads the chain is latency-bound, 15 serial steps of a 128-long fp32 product each. Whole
forward, same L, same process: 0.89-0.96x s23's time on (4, 16), (16, 16), (8, 24) and (2, 8)
1x8192; level on (2, 8) 1x32768. The benchmark (commit 66387ea, one H100; s22 the stage before
the split warm-up, both peers in the same process), ms:

    problem               s24     s22    x s22   FlashQLA   FLA
    (2, 8) 1x8192         0.167   0.186  0.90     0.168    0.243
    (2, 8) 1x32768        0.355   0.391  0.91     0.402    0.996
    (2, 8) 28672+4096     0.359   0.418  0.86     0.393    0.913
    (4, 16) 1x8192        0.208   0.248  0.84     0.220    0.334
    (4, 16) 1x32768       0.569   0.650  0.88     0.677    1.381
    (4, 16) 28672+4096    0.567   0.681  0.83     0.694    1.310
    (8, 32) 1x32768       1.051   1.129  0.93     1.256    2.182
    (16, 32) 1x32768      1.041   1.122  0.93     1.265    2.207
    (8, 24) 1x8192        0.280   0.299  0.94     0.282    0.429
    (8, 24) 1x32768       0.843   0.959  0.88     1.024    1.766
    (8, 24) 28672+4096    0.885   0.994  0.89     0.810    1.715
    (16, 16) 1x8192       0.233   0.275  0.85     0.228    0.361
    (16, 16) 1x32768      0.623   0.701  0.89     0.692    1.416
    (16, 16) 28672+4096   0.625   0.742  0.84     0.717    1.347

(the other four split problems of the run stay unsplit under this rule: 0.99-1.02x s22.)
GPU tests (commit 6879a4c, with s23's rule): phase 2 bit for bit against s21's on every real row,
M NaN where no slot is exact (3 plans); the public shapes (24); AutoCP's CP on vs off, flags,
determinism, graph replay (10). The library's forward on this stage: ``test_promoted`` (c5feab3).

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "autocp_chain_rows", "gdn_autocp_warmup_split")

PIPELINE = stages.load("gdn_fwd", 23)   # the solve, the rule, windows, phase 1, phase 3
CHAIN = stages.load("gdn_fwd", 21)      # phase 2's tiles
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
DEFAULT_SHAPE = dict(HV=32)
# the rule's costs (s23's ``segment_chunks``), refitted to this stage's sweep, which adds the five
# problems that s23's costs split and no earlier rule did: the grid search of s22 and s23, with a
# problem's bar the fastest of the choices the rule weighs (unsplit, L0, 2 L0; on (8, 32) and (16,
# 32) 28672+4096 L0 is 150, the sweep's best L 64); of the points with a segment cost >= 0, the one
# with the most feasible grid neighbours (121 of 125)
SEGMENT_CHUNK_STEPS = 1.5
SEGMENT_STEPS = 0.2
FIXED_STEPS = 24


def chain_kernel(HV: int):
    """The T.prim_func of phase 2 for HV value heads: every segment row's initial state [S, HV, K,
    V] from h0 [N, HV, K, V], phase 1's Z [J N, HV, K, V] and M [J N, HV, K, K] (read only for a
    (sequence, head) with an exact slot), the exact flags [J N, HV] and ``Plan.row_of_slot`` [J N]."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    K, V, BC = HEAD_DIM, HEAD_DIM, CHAIN.CHAIN_COLUMNS
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def autocp_chain_rows(
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        z: T.Tensor((num_slots, HV, K, V), "float32"),         # slot j N + n: segment j of sequence n
        m: T.Tensor((num_slots, HV, K, K), "float32"),         # zero where exact is 0
        exact: T.Tensor((num_slots, HV), "int32"),
        row_of_slot: T.Tensor((num_slots,), "int32"),          # -1: sequence n has no segment j
        h_seg: T.Tensor((num_rows, HV, K, V), "float32"),      # each segment row's initial state
    ):
        with T.Kernel(V // BC, HV, num_seqs, threads=CHAIN.CHAIN_THREADS) as (i_c, i_hv, i_n):
            c0 = i_c * BC
            steps = num_slots // num_seqs - 1
            m_s = T.alloc_shared((K, K), "float32")
            h_s = T.alloc_shared((K, BC), "float32")
            h_f = T.alloc_fragment((K, BC), "float32")
            chained = T.alloc_var("int32")                     # steps of the chain that read M
            # M's rows swizzled (s21's): a warp reads one column of 16 rows at once
            T.annotate_layout({m_s: tilelang.layout.make_swizzled_layout(m_s)})

            # chained <- steps if any slot of this (sequence, head) is exact, else 0
            chained = 0
            for j in T.serial(steps):
                if exact[(j + 1) * num_seqs + i_n, i_hv] != 0:
                    chained = steps
            # h_0 <- the sequence's initial state (slot n is its first segment, always a row)
            T.copy(h0[i_n, i_hv, :, c0:c0 + BC], h_f)
            T.copy(h_f, h_seg[row_of_slot[i_n], i_hv, :, c0:c0 + BC])
            for j in T.Pipelined(chained, num_stages=CHAIN.CHAIN_STAGES):
                s = (j + 1) * num_seqs + i_n
                # M_j (its load is issued ahead: it does not read h)
                T.copy(m[s, i_hv, :, :], m_s)
                # h_j <- Z_j + M_j h_{j-1}
                T.copy(h_f, h_s)
                T.copy(z[s, i_hv, :, c0:c0 + BC], h_f)
                for e in T.serial(K):
                    for r, c in T.Parallel(K, BC):
                        h_f[r, c] = h_f[r, c] + m_s[r, e] * h_s[e, c]
                if row_of_slot[s] >= 0:
                    T.copy(h_f, h_seg[row_of_slot[s], i_hv, :, c0:c0 + BC])
            for j in T.serial(steps - chained):
                s = (j + 1) * num_seqs + i_n
                # h_j <- Z_j (every M_j of this head is zero)
                if row_of_slot[s] >= 0:
                    T.copy(z[s, i_hv, :, c0:c0 + BC], h_f)
                    T.copy(h_f, h_seg[row_of_slot[s], i_hv, :, c0:c0 + BC])

    return autocp_chain_rows


@functools.cache
def _chain(HV: int):
    return compile_hopper(chain_kernel(HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the chaining kernel at the default shape, then s23's."""
    return _chain(**DEFAULT_SHAPE).get_kernel_source() + PIPELINE.kernel_source()


def segment_initial_states(p, h0, z, m, exact):
    """s21's ``segment_initial_states`` (h0 [N, HV, K, V], Z [J N, HV, K, V], M [J N, HV, K, K],
    fp32; exact [J N, HV] int32) written by row -> [S, HV, K, V]; rows past the real ones (empty
    segments) stay unwritten: phase 3 only copies them into final states that nobody reads."""
    h_seg = torch.empty(p.bounds.shape[0] - 1, *z.shape[1:], dtype=z.dtype, device=z.device)
    with nvtx_range("gdn_fwd.s24"):
        _chain(h0.shape[1])(h0, z, m, exact, p.row_of_slot, h_seg)
    return h_seg


def segment_chunks(seq_chunks: list[int], HV: int, num_sms: int, unsplit_step: float,
                   force: bool | int | None = None) -> int:
    """s23's rule at this stage's costs."""
    return PIPELINE.segment_chunks(seq_chunks, HV, num_sms, unsplit_step, force,
                                   (SEGMENT_CHUNK_STEPS, SEGMENT_STEPS, FIXED_STEPS))


def split_plan(cu_seqlens, B: int, T: int, HV: int, num_sms: int, device, cp, unsplit_step: float):
    """s23's ``split_plan`` at this stage's costs."""
    return PIPELINE.split_plan(cu_seqlens, B, T, HV, num_sms, device, cp, unsplit_step,
                               (SEGMENT_CHUNK_STEPS, SEGMENT_STEPS, FIXED_STEPS))


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s23's ``forward`` with this stage's phase 2 and rule (``cp`` None decides, False never
    splits, True splits by the rule, an int is the segment length in chunks)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    s18 = CHAIN.PIPELINE.PIPELINE
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*PIPELINE.PIPELINE.SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    widths, fused = s18.WIDTHS, s18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is None:
        o, ht = fused._fused(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV, widths)
        return o, (ht if output_final_state else None)

    N, J = p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    # windows (s18's), then phase 1 (s23's)
    win_start, exact = s18.windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV),
                                   gated, threshold)
    with nvtx_range("gdn_fwd.s24"):
        PIPELINE._compiled(H, HV)(k.view(B * T, H, K), v.view(B * T, HV, V), ab.view(B * T, HV, CHUNK_SIZE),
                                  g_cum.view(B * T, HV), gated, win_start, p.slot_start, p.slot_chunk,
                                  exact, z, m)
    # phase 2 (this stage's): the initial state of every segment row
    h_seg = segment_initial_states(p, h0, z, m, exact)
    # phase 3: the fused kernel over all segments (of equal length), each from its own state
    rows = p.bounds.shape[0] - 1
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(h_seg.shape, **fp32)
    BV = fused.block_v([1] * rows, HV, V, sms, widths.step)
    with nvtx_range("gdn_fwd.s24"):
        stages.load(*widths.kernels[BV])._compiled(H, HV, K, V, BV)(
            q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
            ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
            h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s24: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s24: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s24: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s24: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
