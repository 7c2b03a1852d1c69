"""gdn_fwd, stage 02: the chunked forward as separate TileLang kernels, one per reference sub-step.

What it adds over s01, the previous milestone: the chunked form. The sequence is cut into chunks of
C = 64 tokens and the work is rewritten as matrix products (``flashqla.reference``,
notebooks/02_chunked_form.py), which run on the tensor cores (wgmma) and in parallel over every
chunk; only the chain of T / 64 state updates stays sequential. Each sub-step is its own stage,
checked on its own against its reference, and this stage only chains them, exactly as
``reference.chunk_gated_delta_rule_ref`` chains the references. Why: s01's time is the length of its
token chain; chunking makes that chain 64 times shorter and turns each step into products the tensor
cores run. The stages, in order:

    chunk_local_cumsum.s01   g                      -> g_cum       (fp32)
    chunk_kkt.s02            k, g_cum, beta         -> A           (fp32, 64 per token and head)
    kkt_solve.s01            A                      -> Ai          (bf16)
    chunk_w_u.s01            k, v, beta, Ai, g_cum  -> w, u        (bf16)
    chunk_h.s01              k, w, u, g_cum, h0     -> h, v_new, final state
    chunk_o.s01              q, k, v_new, h, g_cum  -> o

Why one kernel a sub-step: it is the shape of FLA's forward, and the simplest correct chunked
forward, so each kernel can be understood and measured alone. Its cost is the traffic between the
kernels: every intermediate above crosses HBM twice (written, then read), the largest being the
per-chunk states h (K V bf16 per chunk and value head) and v_new; chunk_h's ``run`` also reads the
real chunk count on the host for varlen (one sync), to return h in FLA's exact shape. s03 fuses the
last two kernels so that h and v_new never leave the chip.

Measured effect (one H200, ``python -m flashqla bench``, every row in the same run,
``profiles/results/gdn_fwd.csv``): 4.90 ms on (16, 64) 1 x 32768 (FLA 6.14, FlashQLA 1.54; the
recurrent s01 18.4), 2.77 ms on (2, 8) 1 x 32768 (FLA 1.00, s01 6.85), 2.96 ms on (16, 32)
8 x 4096 (FLA 2.47, s01 8.11): 2.7-3.8x faster than the recurrence, 0.36-1.25x FLA. Timed with
CUDA events, not a graph: chunk_h's host read of the chunk count breaks graph capture.
Taught in: notebooks/03_forward_kernels.py.
"""

from flashqla.nvtx import nvtx_range
from flashqla.stages import load

NEEDS = ("hopper",)

STEPS = (("chunk_local_cumsum", 1), ("chunk_kkt", 2), ("kkt_solve", 1), ("chunk_w_u", 1),
         ("chunk_h", 1), ("chunk_o", 1))


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=64):
    """(o [B, T, HV, V] bf16, final state [N, HV, K, V] fp32 or None), one kernel per sub-step."""
    cumsum, kkt, solve, w_u, chunk_h, chunk_o = (load(op, n).run for op, n in STEPS)
    with nvtx_range("gdn_fwd.s02"):
        g_cum = cumsum(g, cu_seqlens, chunk_size)
        A = kkt(k, g_cum, beta, cu_seqlens, chunk_size)
        Ai = solve(A, cu_seqlens, chunk_size)
        w, u = w_u(k, v, beta, Ai, g_cum, cu_seqlens, chunk_size)
        h, v_new, final_state = chunk_h(k, w, u, g_cum, initial_state, output_final_state,
                                        cu_seqlens, chunk_size)
        o = chunk_o(q, k, v_new, h, g_cum, scale, cu_seqlens, chunk_size)
    return o, final_state
