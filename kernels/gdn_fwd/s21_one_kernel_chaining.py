"""gdn_fwd, stage 21: s20's AutoCP with phase 2 in one kernel, the next M loaded while this one
multiplies.

What changed from s20: phase 2, the chaining h_j = Z_j + M_j h_{j-1} over the J segments of each
sequence. s20 (as s18) ran it as J - 1 fp32 batched matmuls (``autocp.segment_initial_states``),
one launch per segment boundary over every (sequence, value head), each a copy of Z_j into the
output and a matmul: on (2, 8) 1 x 32768 (J = 16) 15 matmuls and 16 copies took 120 us of device
time, where FlashQLA chains in one 55 us kernel (4 x H100, ``torch.profiler``, commit d8516c1).
Here ``chain_kernel`` walks the J segments of one (sequence, value head, CHAIN_COLUMNS state
columns) in one CTA: h_{j-1}'s columns in shared memory, M_j staged in shared memory by a
two-stage pipeline (M_{j+1} is loaded while M_j multiplies: M does not depend on h), and the
product on the CUDA cores in fp32, the precision of the matmuls it replaces (tensor cores would
round M to tf32). A warm-up head's M_j is zero (phase 1 writes it), so its h_j is Z_j.

TileLang warp-specializes the loop by itself: a producer warpgroup issues M_j's TMA load into one
of two stages, 256 consumer threads hold 4 state elements each. M's shared buffer is swizzled: a
warp reads one column of 16 rows per step of the product, which unswizzled 512-byte rows put in
one bank. An earlier draft of this idea (branch ``wip/chain``'s s19, on s18) loaded M_j
synchronously each step into a padded buffer and gained 1.02-1.07x.

Measured effect (one H100, commit 0d79784; its GPU tests passed there: the chaining against the
batched matmuls (below 1e-5) and no farther from a float64 chaining than they are, CP on against CP
off head by head, the flags, public shapes; timings by ``flashqla.bench.time_row``, CUDA-graph
replay, from a timing script outside the labs, s20 and FlashQLA in the same process), ms:

    problem            s21 (s20's rule)  s20     FlashQLA   s21 at another L
    (2, 8) 1x32768     0.383 (L 32)      0.461   0.393      L 16: 0.449
    (2, 8) 1x8192      0.195 (L 16)      0.234   0.170      L 8: 0.187
    (4, 16) 1x32768    0.669 (L 64)      0.706   0.668      L 32: 0.737
    (16, 16) 1x32768   0.738 (L 64)      0.768   0.694      L 32: 0.801
    (4, 16) 1x8192     0.279 (unsplit)   0.279   0.219      L 16: 0.249
    (16, 16) 1x8192    0.302 (unsplit)   0.301   0.233      L 16: 0.287

1.04-1.20x s20 where it splits; the first of our forwards faster than FlashQLA on (2, 8) 1 x 32768
(1.03x). Per kernel (``torch.profiler``, (2, 8) 1 x 32768 at L 32): phase 2 takes 38 us in one
launch (s20: 95 us in 15 matmuls plus 27 in 16 copies). With phase 2 this cheap, s20's rule
(fitted with the matmuls) no longer picks the best split on 1 x 8192: L 16 is 1.12x and 1.05x
the unsplit launch on (4, 16) and (16, 16), and L 8 beats L 16 on (2, 8). A sweep
(``profiles/split_lab.py --stage 21``) and a refit are the next step; not promoted yet.

In doubt: o and the final state differ from s20's by 0.5-1.5e-3 (relative L2), as s19's did from
s18's. The chaining itself agrees with the matmuls to 1e-5, so the likely cause is bf16
rounding downstream: phase 3 rounds S to bf16 every chunk, and on exact (g = 0) heads a flipped
rounding is never decayed away. Both forwards pass the float64 check head by head; the cause is
not proven.

Taught in: Lab log (book page lab_log); background in notebooks/06_autocp.py.
"""

import functools

import torch

from flashqla import autocp, stages
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range

NEEDS = ("hopper",)
# s20's kernels, plus the chaining's fp32 products (no wgmma)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "autocp_chain")

PIPELINE = stages.load("gdn_fwd", 20)   # windows, phase 1, plan and rule, phase 3
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
HEAD_DIM = PIPELINE.HEAD_DIM
CHAIN_COLUMNS = 8       # state columns per CTA of the chaining: V / 8 CTAs per (sequence, head)
CHAIN_THREADS = 256     # 4 state elements a thread
CHAIN_STAGES = 2        # M_j buffers: M_{j+1} loads while M_j multiplies
DEFAULT_SHAPE = dict(HV=32)


def chain_kernel(HV: int):
    """The T.prim_func of phase 2 for HV value heads: ``autocp.segment_initial_states``' h of every
    slot, [J N, HV, K, V], from h0 [N, HV, K, V] and phase 1's Z [J N, HV, K, V], M [J N, HV, K, K]."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    K, V, BC = HEAD_DIM, HEAD_DIM, CHAIN_COLUMNS
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def autocp_chain(
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        z: T.Tensor((num_slots, HV, K, V), "float32"),         # slot j N + n: segment j of sequence n
        m: T.Tensor((num_slots, HV, K, K), "float32"),         # zero for a warm-up head
        hs: T.Tensor((num_slots, HV, K, V), "float32"),        # each slot's initial state
    ):
        with T.Kernel(V // BC, HV, num_seqs, threads=CHAIN_THREADS) as (i_c, i_hv, i_n):
            c0 = i_c * BC
            m_s = T.alloc_shared((K, K), "float32")
            h_s = T.alloc_shared((K, BC), "float32")
            h_f = T.alloc_fragment((K, BC), "float32")
            # M's rows swizzled: a warp reads one column of 16 rows at once (unswizzled, 512-byte
            # rows put them all in one bank)
            T.annotate_layout({m_s: tilelang.layout.make_swizzled_layout(m_s)})

            # h_0 <- the sequence's initial state
            T.copy(h0[i_n, i_hv, :, c0:c0 + BC], h_f)
            T.copy(h_f, hs[i_n, i_hv, :, c0:c0 + BC])
            for j in T.Pipelined(num_slots // num_seqs - 1, num_stages=CHAIN_STAGES):
                s = (j + 1) * num_seqs + i_n
                # M_j (its load is issued CHAIN_STAGES - 1 steps ahead: it does not read h)
                T.copy(m[s, i_hv, :, :], m_s)
                # h_j <- Z_j + M_j h_{j-1}
                T.copy(h_f, h_s)
                T.copy(z[s, i_hv, :, c0:c0 + BC], h_f)
                for e in T.serial(K):
                    for r, c in T.Parallel(K, BC):
                        h_f[r, c] = h_f[r, c] + m_s[r, e] * h_s[e, c]
                T.copy(h_f, hs[s, i_hv, :, c0:c0 + BC])

    return autocp_chain


@functools.cache
def _chain(HV: int):
    return compile_hopper(chain_kernel(HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: the chaining kernel at the default shape, then s20's."""
    return _chain(**DEFAULT_SHAPE).get_kernel_source() + PIPELINE.kernel_source()


def segment_initial_states(p, h0, z, m):
    """``autocp.segment_initial_states`` (h0 [N, HV, K, V], Z [J N, HV, K, V], M [J N, HV, K, K],
    fp32) in one launch -> [S, HV, K, V]."""
    hs = torch.empty_like(z)
    with nvtx_range("gdn_fwd.s21"):
        _chain(h0.shape[1])(h0, z, m, hs)
    return hs.index_select(0, p.slot_of_segment)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, cp=None, threshold=autocp.THRESHOLD):
    """s20's ``forward`` (same rule, ``cp`` as there) with phase 2 from ``segment_initial_states``
    above."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    s18 = PIPELINE.PIPELINE
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, CHUNK_SIZE).contiguous()
    ab, gated = stages.load(*s18.SOLVE).solve(k, beta, g_cum, cu_seqlens)
    sms = autocp.num_sms(device)
    widths, fused = s18.WIDTHS, s18.PIPELINE
    BV = fused.launch_width(cu_seqlens, B, T, HV, V, sms, widths.step)
    p = PIPELINE.split_plan(cu_seqlens, B, T, HV, sms, device, cp, widths.step[BV])
    if p is None:
        o, ht = fused._fused(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale, BV, widths)
        return o, (ht if output_final_state else None)

    N, J = p.num_seqs, p.max_segments
    fp32 = dict(dtype=torch.float32, device=device)
    h0 = (torch.zeros(N, HV, K, V, **fp32) if initial_state is None
          else initial_state.to(**fp32).contiguous())
    z, m = torch.empty(J * N, HV, K, V, **fp32), torch.empty(J * N, HV, K, K, **fp32)
    # windows (s18's), then phase 1 (s20's)
    win_start, exact = s18.windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV),
                                   gated, threshold)
    with nvtx_range("gdn_fwd.s21"):
        PIPELINE._compiled(H, HV)(k.view(B * T, H, K), v.view(B * T, HV, V), ab.view(B * T, HV, CHUNK_SIZE),
                                  g_cum.view(B * T, HV), gated, win_start, p.slot_start, p.slot_chunk,
                                  exact, z, m)
    # phase 2, one launch: the initial state of every segment row
    h_seg = segment_initial_states(p, h0, z, m)
    # phase 3: the fused kernel over all segments (of equal length), each from its own state
    rows = p.bounds.shape[0] - 1
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(h_seg.shape, **fp32)
    BV = fused.block_v([1] * rows, HV, V, sms, widths.step)
    with nvtx_range("gdn_fwd.s21"):
        stages.load(*widths.kernels[BV])._compiled(H, HV, K, V, BV)(
            q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V),
            ab.view(B * T, HV, CHUNK_SIZE), g_cum.view(B * T, HV), gated,
            h_seg, p.bounds, p.first_chunk, scale, o, ht)
    return o.view(B, T, HV, V), (ht.index_select(0, p.last_segment) if output_final_state else None)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s21: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s21: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s21: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s21: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
