"""Chapter 08's exercises (backward AutoCP): the reverse chain over segments, and a backward
warm-up window counted from a segment's start.

Both run the learner's function on small float64 problems and compare it with the unsplit float64
backward of ``flashqla.reference`` and with the library's own logic (``flashqla.autocp.
backward_windows``).
"""

from __future__ import annotations

import functools
import math

import torch

from flashqla import autocp, reference
from flashqla.exercises import Report, report, run_answer
from flashqla.testing import rel_l2

C = reference.CHUNK_SIZE
F64 = torch.float64
EXACT = 1e-12          # float64: the same sums and products in another order


def _keys(gen, n, heads, dim):
    return torch.nn.functional.normalize(torch.randn(1, n, heads, dim, generator=gen, dtype=F64), dim=-1)


# ---- exercise 1: the reverse chain over segments -----------------------------------------------

CHAIN_SEGMENT_CHUNKS = 4
CHAIN_TOKENS = 12 * C + 40     # 13 chunks, the last partial: segments of 4, 4, 4 and 1 chunks


@functools.cache
def _chain_problem():
    """One sequence, four value heads with little or no decay (so that every segment's M_j is far
    from zero and far from symmetric), K = V = 16, an initial state, fixed upstream gradients.
    Returns the inputs, dO, dht, each segment's dZ_j and M_j (``reference.segment_state_grads``),
    the unsplit backward's dh per chunk (``reference.chunk_bwd_dhu``), the states entering the
    segments, and the unsplit backward's gradients (``chunk_gated_delta_rule_bwd_ref``)."""
    gen = torch.Generator().manual_seed(11)
    T, HV, K = CHAIN_TOKENS, 4, 16
    x = dict(q=_keys(gen, T, 2, K), k=_keys(gen, T, 2, K), v=torch.randn(1, T, HV, K, generator=gen, dtype=F64),
             g=torch.tensor([0.0, 0.0, -0.002, -0.01], dtype=F64).expand(1, T, HV).clone(),
             beta=torch.rand(1, T, HV, generator=gen, dtype=F64),
             initial_state=torch.randn(1, HV, K, K, generator=gen, dtype=F64))
    do = torch.randn(1, T, HV, K, generator=gen, dtype=F64)
    dht = torch.randn(1, HV, K, K, generator=gen, dtype=F64)
    g_cum = reference.chunk_local_cumsum(x["g"])
    Ab, gated = reference.flagged_solve(x["k"], g_cum, x["beta"])
    _, dz, m = reference.segment_state_grads(x["q"], x["k"], g_cum, Ab, gated, do, CHAIN_SEGMENT_CHUNKS, dht)
    w, _ = reference.chunk_fwd_intra(x["k"], x["v"], g_cum, x["beta"])
    dv_local = reference.chunk_bwd_dv_local(x["q"], x["k"], do, g_cum)
    dh, _, _ = reference.chunk_bwd_dhu(x["q"], x["k"], w, g_cum, x["initial_state"], dht, do, dv_local)
    h_seg = reference.segment_states(x["k"], x["v"], x["g"], x["beta"], CHAIN_SEGMENT_CHUNKS, x["initial_state"])
    want = reference.chunk_gated_delta_rule_bwd_ref(**x, do=do, dht=dht)
    return x, do, dht, dz[0], m[0], dh[0], h_seg[0], want


def check_reverse_chain(reverse_chain) -> Report:
    """``reverse_chain(dz, m, dht)``: dz [J, HV, K, V] (dZ_j, the reverse walk from zero over
    segment j), m [J, HV, K, K] (M_j, segment j's forward transition), dht [HV, K, V] (the gradient
    of the sequence's final state), all float64 -> [J, HV, K, V], the gradient of the state
    leaving every segment (dht for the last). Checked against the unsplit float64 backward's dh
    (``reference.chunk_bwd_dhu``) at the segment boundaries, then by running every segment's own
    backward from its h_j and your dht_j against ``reference.chunk_gated_delta_rule_bwd_ref``."""
    name = "reverse_chain"
    x, do, dht, dz, m, dh, h_seg, want = _chain_problem()
    L, J = CHAIN_SEGMENT_CHUNKS, dz.shape[0]
    got, err = run_answer(name, reverse_chain, dz.clone(), m.clone(), dht[0].clone())
    if err:
        return report(name, [err])
    if not isinstance(got, torch.Tensor) or got.shape != dz.shape or got.dtype != F64:
        return report(name, [f"returned {type(got).__name__} of shape {getattr(got, 'shape', None)}, "
                             f"dtype {getattr(got, 'dtype', None)}; expected a float64 tensor {list(dz.shape)}"])
    n_chunks = dh.shape[0]
    failures = []
    for j in range(J):
        boundary = dh[min((j + 1) * L, n_chunks) - 1]      # the gradient leaving segment j's last chunk
        if rel_l2(got[j], boundary) > EXACT:
            failures.append(f"the gradient leaving segment {j} (after chunk {min((j + 1) * L, n_chunks) - 1}) "
                            f"is off by {rel_l2(got[j], boundary):.1e} from the unsplit backward's dh")
            break
    if failures:  # what the learner's dht_j do to the gradients: every segment's own backward
        span, T = C * L, x["v"].shape[1]
        cu = torch.tensor([min(span * j, T) for j in range(J)] + [T])
        local = reference.chunk_gated_delta_rule_bwd_ref(
            x["q"], x["k"], x["v"], x["g"], x["beta"], do, got, initial_state=h_seg, cu_seqlens=cu)
        failures.append(f"with your dht_j the segments' own backwards give dk off by "
                        f"{rel_l2(local[1], want[1]):.1e} and dg off by {rel_l2(local[3], want[3]):.1e}")
    return report(name, failures)


# ---- exercise 2: a backward warm-up window ----------------------------------------------------

WINDOW_SEGMENT_CHUNKS = 8                       # L of the check's plan
WINDOW_LENGTHS = (1900, 1300)                   # two sequences: 4 and 3 segments of 512 tokens


@functools.cache
def _window_problem():
    """Two sequences, six value heads: g = 0, a constant decay, and four whose decay changes from
    chunk to chunk (so that where the count starts matters). Returns the inputs, the plan,
    ``autocp.backward_windows``' windows, g_cum, Ab, gated, dO, dht and the exact float64
    segment gradients."""
    gen = torch.Generator().manual_seed(12)
    T, HV, K = sum(WINDOW_LENGTHS), 6, 16
    rate = torch.exp(torch.empty(-(-T // C), HV, dtype=F64).uniform_(math.log(1e-3), math.log(0.4), generator=gen))
    rate[:, 0] = 0.0                            # a head with no decay: always exact
    rate[:, 1] = 0.03                           # about -1.9 a chunk: a window of 6 chunks
    g = -rate.repeat_interleave(C, 0)[:T][None]  # [1, T, HV]; constant within a 64-token block
    x = dict(q=_keys(gen, T, 2, K), k=_keys(gen, T, 2, K), g=g, beta=torch.rand(1, T, HV, generator=gen, dtype=F64),
             cu=torch.tensor([0, WINDOW_LENGTHS[0], T], dtype=torch.int64))
    do = torch.randn(1, T, HV, K, generator=gen, dtype=F64)
    dht = torch.randn(2, HV, K, K, generator=gen, dtype=F64)
    plan = autocp.host_plan(x["cu"].tolist(), WINDOW_SEGMENT_CHUNKS, "cpu")
    g_cum = reference.chunk_local_cumsum(g, x["cu"])
    rule = autocp.backward_windows(plan, g_cum[0], autocp.bound_violations(x["k"], g, x["beta"]))
    Ab, gated = reference.flagged_solve(x["k"], g_cum, x["beta"], x["cu"])
    args = (x["q"], x["k"], g_cum, Ab, gated, do, WINDOW_SEGMENT_CHUNKS, dht)
    exact = reference.segment_state_grads(*args, cu_seqlens=x["cu"])[0]
    return x, plan, rule, args, exact


def check_backward_window(backward_window) -> Report:
    """``backward_window(decays, threshold)``: decays float64 [n], the log decay of each chunk of a
    segment, first chunk first -> w, the fewest chunks counted from the segment's start whose
    decays sum to <= threshold, or 0 where no window within the segment reaches it (exact path).
    Checked on every (segment, head) that has a window, on a two-sequence problem, against
    ``autocp.backward_windows``, then the windows' float64 segment gradients against the exact
    ones (``reference.segment_state_grads``)."""
    name = "backward_window"
    x, plan, (win_start, win_end, _, _), args, exact = _window_problem()
    L, N, J, HV = plan.segment_chunks, plan.num_seqs, plan.max_segments, x["g"].shape[2]
    g, bounds = x["g"][0], x["cu"].tolist()
    wrong, windows = [], torch.zeros(N, J, HV, dtype=torch.int64)
    for n in range(N):
        count = max(1, -(-(bounds[n + 1] - bounds[n]) // (C * L)))      # J_n, its segments
        for r in range(1, count):                                        # backward slot r: segment J_n - r
            j, slot = count - r, r * N + n
            s = int(win_start[slot, 0])
            e = min(s + C * L, bounds[n + 1])
            real = -(-(e - s) // C)
            decays = torch.stack([g[t:min(t + C, e)].sum(0) for t in range(s, e, C)])   # [real, HV]
            for head in range(HV):
                got, err = run_answer(name, backward_window, decays[:, head].clone(), autocp.THRESHOLD)
                if err:
                    return report(name, [err])
                try:
                    got = int(got)
                except Exception:  # whatever the answer returned, the check reports it
                    return report(name, [f"returned {got!r}; expected a whole number of chunks"])
                got_len = real if got == 0 else got                      # 0: the whole segment, exact
                want_len = -(-int(win_end[slot, head] - win_start[slot, head]) // C)
                windows[n, j, head] = got_len
                if got_len != want_len:
                    wrong.append((n, j, head, got_len, want_len))
    if not wrong:
        return report(name, [])
    n, j, head, got, want = wrong[0]
    say = lambda w: f"{w} chunk{'s' * (w != 1)}"
    warm = reference.segment_state_grads(*args, cu_seqlens=x["cu"], warmup_chunks=windows)[0]
    err = rel_l2(warm, exact)
    return report(name, [f"{len(wrong)} of the (segment, head) windows differ from autocp.backward_windows'; "
                         f"sequence {n}, segment {j}, head {head}: yours {say(got)}, the rule's {say(want)} "
                         f"(the gradient flows backwards: the window starts where the segment starts); "
                         f"with your windows the float64 segment gradients are off by {err:.1e}, against "
                         f"e^{autocp.THRESHOLD:.0f} = {math.exp(autocp.THRESHOLD):.1e} per window"])
