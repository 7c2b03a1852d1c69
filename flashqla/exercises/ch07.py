"""Chapter 07's exercises (the chunked backward): one step of the reverse state recurrence, and
the gradient of g from that of its chunk-local cumulative sum.

Both run the learner's function on one small float64 sequence and compare with the backward
sub-steps of ``flashqla.reference`` and with ``torch.autograd`` through the token-by-token
recurrence.
"""

from __future__ import annotations

import functools

import torch

from flashqla import reference
from flashqla.exercises import Report, report, run_answer
from flashqla.testing import Problem, cast_floats, rel_l2

F64 = torch.float64
C = reference.CHUNK_SIZE
EXACT = 1e-12          # float64: the same sums and products in another order


@functools.cache
def _problem(tokens: int):
    """One sequence, (H, HV) = (2, 4) with the g = 0, strong and ordinary decay heads of every
    Problem, K = V = 16, an initial state; fixed upstream gradients of o and of the final state.
    Returns the inputs, do, dht, the forward intermediates and autograd's gradients."""
    x = cast_floats(Problem(2, 4, (tokens,), varlen=False, K=16, V=16).inputs(seed=7), F64)
    del x["cu_seqlens"]
    gen = torch.Generator().manual_seed(8)
    o, ht = reference.naive_recurrent_gated_delta_rule(**x)
    do, dht = (torch.randn(t.shape, generator=gen, dtype=F64) for t in (o, ht))
    leaves = {n: x[n].clone().requires_grad_() for n in ("g", "initial_state")}
    o, ht = reference.naive_recurrent_gated_delta_rule(**{**x, **leaves})
    grads = dict(zip(leaves, torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()))))
    g_cum = reference.chunk_local_cumsum(x["g"])
    w, _ = reference.chunk_fwd_intra(x["k"], x["v"], g_cum, x["beta"])
    return x, do, dht, g_cum, w, grads


# ---- exercise 1: one step of the reverse state recurrence --------------------------------------

DHU_TOKENS = 4 * C     # four whole chunks


def check_dhu_step(dhu_step) -> Report:
    """``dhu_step(dS_next, q, k, w, do, dv_local, g_cum, scale)``: one chunk of one value head, all
    float64 (q, k, w [C, K]; do, dv_local [C, V]; g_cum [C], the chunk-local cumulative log decay;
    dS_next [K, V], the gradient of the state leaving the chunk) -> (dS, dv): the gradient of the
    state entering the chunk and the full gradient of v_new. Walked from the last chunk to the
    first, it is checked against ``reference.chunk_bwd_dhu`` and, for the initial state's
    gradient, against autograd through the recurrence."""
    name = "dhu_step"
    x, do, dht, g_cum, w, grads = _problem(DHU_TOKENS)
    q, k = (reference.expand_heads(x[n], 4)[0] for n in ("q", "k"))                # [T, HV, K]
    scale = q.shape[-1] ** -0.5
    dv_local = reference.chunk_bwd_dv_local(x["q"], x["k"], do, g_cum)
    dh, dh0, dv2 = reference.chunk_bwd_dhu(x["q"], x["k"], w, g_cum, x["initial_state"], dht, do, dv_local)
    got_dh0, got_dv = torch.empty_like(dh0), torch.empty_like(dv2)
    for head in range(q.shape[1]):
        dS = dht[0, head]
        for c in reversed(range(DHU_TOKENS // C)):
            t = slice(c * C, (c + 1) * C)
            out, err = run_answer(name, dhu_step, dS.clone(), q[t, head], k[t, head], w[0, t, head],
                                  do[0, t, head], dv_local[0, t, head], g_cum[0, t, head], scale)
            if err:
                return report(name, [err])
            shapes = (dS.shape, do[0, t, head].shape)
            if not (isinstance(out, tuple) and len(out) == 2
                    and all(isinstance(o, torch.Tensor) and o.shape == s for o, s in zip(out, shapes))):
                return report(name, [f"returned {type(out).__name__}; expected a pair of tensors (dS, dv) "
                                     f"of shapes {[list(s) for s in shapes]}"])
            dS, got_dv[0, t, head] = out
        got_dh0[0, head] = dS
    failures = []
    if rel_l2(got_dv, dv2) > EXACT:
        failures.append(f"dv (the gradient of v_new) is off by {rel_l2(got_dv, dv2):.1e} from "
                        "reference.chunk_bwd_dhu's")
    if rel_l2(got_dh0, grads["initial_state"]) > EXACT:
        failures.append(f"the initial state's gradient, walked back through {DHU_TOKENS // C} chunks, is off by "
                        f"{rel_l2(got_dh0, grads['initial_state']):.1e} from autograd's")
    return report(name, failures)


# ---- exercise 2: from the gradient of gamma to that of g ----------------------------------------

DG_TOKENS = 200        # three whole chunks and a partial one


def check_dg_from_dgamma(dg_from_dgamma) -> Report:
    """``dg_from_dgamma(dgamma)``: dgamma float64 [T, HV], the gradient of one sequence's chunk-local
    cumulative log decay gamma (both contributions, from the state and output steps and from the WY
    step) -> dg [T, HV], the gradient of g. Checked against ``reference.chunk_local_reverse_cumsum``
    and against autograd's gradient of g through the recurrence."""
    name = "dg_from_dgamma"
    x, do, dht, g_cum, _, grads = _problem(DG_TOKENS)
    q, k, v, beta, h0 = (x[n] for n in ("q", "k", "v", "beta", "initial_state"))
    Ai = reference.kkt_solve(reference.chunk_kkt(k, g_cum, beta))
    w, u = reference.chunk_w_u(k, v, beta, Ai, g_cum)
    h, v_new, _ = reference.chunk_h(k, w, u, g_cum, h0)
    dv_local = reference.chunk_bwd_dv_local(q, k, do, g_cum)
    dh, _, dv2 = reference.chunk_bwd_dhu(q, k, w, g_cum, h0, dht, do, dv_local)
    _, _, dw, dgamma = reference.chunk_bwd_dqkwg(q, k, v_new, g_cum, h, dv2, do, dh)
    dgamma = dgamma + reference.wy_bwd(k, v, beta, Ai, g_cum, dw, dv2)[3]
    got, err = run_answer(name, dg_from_dgamma, dgamma[0].clone())
    if err:
        return report(name, [err])
    if not isinstance(got, torch.Tensor) or got.shape != dgamma.shape[1:]:
        return report(name, [f"returned {type(got).__name__} of shape {getattr(got, 'shape', None)}; "
                             f"expected a tensor {list(dgamma.shape[1:])}"])
    want = reference.chunk_local_reverse_cumsum(dgamma)[0]
    failures = []
    if rel_l2(got, want) > EXACT:
        t = int((got - want).abs().sum(1).argmax())
        failures.append(f"dg is off by {rel_l2(got, want):.1e} from reference.chunk_local_reverse_cumsum, "
                        f"most at token {t} (chunk {t // C}, position {t % C})")
    if rel_l2(got, grads["g"][0]) > EXACT:
        failures.append(f"and by {rel_l2(got, grads['g'][0]):.1e} from autograd's gradient of g")
    return report(name, failures)
