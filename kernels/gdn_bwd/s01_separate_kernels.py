"""gdn_bwd, stage 01: the chunked backward as separate kernels, one per reference sub-step.

The backward's first milestone. What it adds over the forward's milestones: the gradients, for
training. Why this shape: like gdn_fwd.s02 it is the chunked form as one kernel per sub-step, the
simplest correct version and FLA's shape, so that each kernel is checked and measured alone.

What it computes (``flashqla.reference.chunk_gated_delta_rule_bwd_ref``): the gradients dq, dk, dv,
dg, dbeta and dh0 of <dO, o> + <dht, final state> for the chunked forward, given dO and dht. Like
FLA's backward it keeps nothing from the forward but its inputs: the intermediates are recomputed
by the forward stages, then the backward sub-steps run in the reference's order, each its own
tested stage:

    chunk_local_cumsum.s01   g                         -> g_cum
    chunk_kkt.s02            k, g_cum, beta            -> A
    kkt_solve.s01            A                         -> Ai        (wy_bwd needs it)
    chunk_w_u.s01            k, v, beta, Ai, g_cum     -> w, u
    chunk_h.s01              k, w, u, g_cum, h0        -> h, v_new
    chunk_bwd_dv_local.s01   q, k, dO, g_cum           -> dV~_loc
    chunk_bwd_dhu.s01        q, k, w, g_cum, dht, dO   -> dh, dh0, dV~ (= du)
    chunk_bwd_dqkwg.s01      q, k, v_new, h, dV~, dh   -> dq, dk, dw, dg_cum
    wy_bwd.s01               k, v, beta, Ai, dw, du    -> dk', dv, dbeta, dg_cum'
    reverse cumsum           dg_cum + dg_cum'          -> dg        (PyTorch on the device, below)

w and u come from chunk_w_u with the Ai that wy_bwd needs anyway, rather than from the fused
chunk_fwd_intra, which would solve every chunk a second time. The last step, dg_t = the sum of
dg_cum over the tokens s >= t of t's chunk (the adjoint of the chunk-local cumsum), is a handful
of PyTorch ops on the device (gather into [chunks, 64, HV] through the device-built chunk table,
flip-cumsum-flip, scatter back): no host sync, a small fraction of the time.

Why: the simplest correct chunked backward, the shape of FLA's, so that every kernel can be
checked and measured alone. Its cost is the traffic between kernels: every intermediate crosses
HBM twice, the largest being h and dh (K V bf16 per chunk and value head each); chunk_h's and
chunk_bwd_dhu's ``run`` each read the real chunk count on the host for varlen (to size h, dh).

Measured effect (one H200, CUDA events, median of 20 after 3 warm-up calls,
``profiles/gdn_bwd_s01_lab.py``; FLA 0.6.0's backward timed as ``torch.autograd.grad`` through its
``chunk_gated_delta_rule`` with FLA_FLASH_QLA=0, in the same run; K = V = 128, h0 and dht given):

    (H, HV)   tokens        this stage   FLA      steps of this stage alone (ms)
    (16, 64)  1 x 32768     10.26 ms     11.51    recompute g_cum, Ai, w, u 1.62, chunk_h 1.53,
                                                  dv_local 0.59, dhu 1.61, dqkwg 2.24, wy_bwd 2.25,
                                                  reverse cumsum 0.20
    (2, 8)    1 x 32768      4.01 ms      3.32    0.26, 1.50, 0.12, 1.57, 0.36, 0.34, 0.20

Correct on the public test shapes (all six gradients within the derived bounds; 2.9e-3 to 6.4e-3
relative to FLA's at these shapes), 1.12x FLA on (16, 64) and 0.83x on (2, 8). FLA keeps the
forward's A, we solve again (part of the 1.62 ms). On (2, 8) the two sequential walks, chunk_h
and chunk_bwd_dhu (16 CTAs each), are 3.1 of the 4.0 ms: the next stages should put more CTAs on
them or fuse them with the chunk-parallel kernels.

Taught in: notebooks/07_backward.py.
"""

import torch

from flashqla.nvtx import nvtx_range
from flashqla.stages import load
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)

STEPS = (("chunk_local_cumsum", 1), ("chunk_kkt", 2), ("kkt_solve", 1), ("chunk_w_u", 1),
         ("chunk_h", 1), ("chunk_bwd_dv_local", 1), ("chunk_bwd_dhu", 1), ("chunk_bwd_dqkwg", 1),
         ("wy_bwd", 1))
CHUNK_SIZE = 64


def _chunk_local_reverse_cumsum(dg_cum, cu_seqlens):
    """dg_cum [B, T, HV] fp32 -> dg [B, T, HV]: per chunk, the sum over its tokens s >= t."""
    B, T, HV = dg_cum.shape
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, dg_cum.device)        # [NT, 2]
    flat = torch.cat([dg_cum.reshape(B * T, HV).float(), dg_cum.new_zeros(1, HV, dtype=torch.float32)])
    idx = bounds[:, :1].long() + torch.arange(CHUNK_SIZE, device=dg_cum.device)  # [NT, 64] tokens
    idx = torch.where(idx < bounds[:, 1:].long(), idx, B * T)   # past a chunk's end: the zero row
    rev = flat[idx].flip(1).cumsum(1).flip(1)                   # [NT, 64, HV]
    out = torch.empty_like(flat)
    out[idx.flatten()] = rev.flatten(0, 1)   # every token is in one chunk; the zero row is dropped
    return out[:-1].view(B, T, HV)


def run(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE):
    """(dq, dk [B, T, H, K], dv [B, T, HV, V], dg, dbeta [B, T, HV], dh0 [N, HV, K, V] fp32 or
    None), one kernel per sub-step (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_bwd.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    cumsum, kkt, solve, w_u, chunk_h, dv_local, dhu, dqkwg, wy = (load(op, n).run for op, n in STEPS)
    with nvtx_range("gdn_bwd.s01"):
        # the forward's intermediates, recomputed
        g_cum = cumsum(g, cu_seqlens, chunk_size)
        Ai = solve(kkt(k, g_cum, beta, cu_seqlens, chunk_size), cu_seqlens, chunk_size)
        w, u = w_u(k, v, beta, Ai, g_cum, cu_seqlens, chunk_size)
        h, v_new, _ = chunk_h(k, w, u, g_cum, initial_state, False, cu_seqlens, chunk_size)
        # the backward, chunk by chunk and through the states in reverse
        dvl = dv_local(q, k, do, g_cum, scale, cu_seqlens, chunk_size)
        dh, dh0, dv2 = dhu(q, k, w, g_cum, initial_state, dht, do, dvl, scale, cu_seqlens, chunk_size)
        dq, dk, dw, dg_cum = dqkwg(q, k, v_new, g_cum, h, dv2, do, dh, scale, cu_seqlens, chunk_size)
        dk_wy, dv, dbeta, dg_cum_wy = wy(k, v, beta, Ai, g_cum, dw, dv2, cu_seqlens, chunk_size)
        dg = _chunk_local_reverse_cumsum(dg_cum.float() + dg_cum_wy.float(), cu_seqlens)
    return dq, (dk.float() + dk_wy.float()).to(dk.dtype), dv, dg, dbeta, dh0
