"""Chapter 06's exercises (AutoCP): the warm-up window, and the exact transition of a segment.

Both run the learner's function on small float64 problems and compare it with the library's own
logic (``flashqla.autocp.warmup``) and with the float64 segment states of ``flashqla.reference``.
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


# ---- exercise 1: the warm-up window ---------------------------------------------------------

WINDOW_SEGMENT_CHUNKS = 8                       # L of the check's plan
WINDOW_LENGTHS = (1900, 1300)                   # two sequences: 4 and 3 segments of 512 tokens


@functools.cache
def _window_problem():
    """Two sequences, six value heads: g = 0, a constant decay, and four whose decay changes from
    chunk to chunk (so that where the sum starts matters). Returns the inputs, the plan and
    autocp.warmup's (window start, exact, chunks), and the exact float64 segment states."""
    gen = torch.Generator().manual_seed(6)
    T, HV = sum(WINDOW_LENGTHS), 6
    rate = torch.exp(torch.empty(-(-T // C), HV, dtype=F64).uniform_(math.log(1e-3), math.log(0.4), generator=gen))
    rate[:, 0] = 0.0                            # a head with no decay: always exact
    rate[:, 1] = 0.03                           # about -1.9 a chunk: a window of 6 chunks
    g = -rate.repeat_interleave(C, 0)[:T][None]  # [1, T, HV]; constant within a 64-token block
    x = dict(k=_keys(gen, T, 2, 16), v=torch.randn(1, T, HV, 16, generator=gen, dtype=F64), g=g,
             beta=torch.rand(1, T, HV, generator=gen, dtype=F64),
             cu=torch.tensor([0, WINDOW_LENGTHS[0], T], dtype=torch.int64))
    bounds = x["cu"].tolist()
    plan = autocp.host_plan(bounds, WINDOW_SEGMENT_CHUNKS, "cpu")
    g_cum = reference.chunk_local_cumsum(g, x["cu"])[0]                          # [T, HV]
    rule = autocp.warmup(plan, g_cum, autocp.bound_violations(x["k"], g, x["beta"]))
    states = reference.segment_states(x["k"], x["v"], g, x["beta"], WINDOW_SEGMENT_CHUNKS, cu_seqlens=x["cu"])
    return x, plan, rule, states


def check_warmup_window(warmup_window) -> Report:
    """``warmup_window(decays, threshold)``: decays float64 [L], the log decay of each chunk of the
    previous segment, oldest first -> w, the fewest chunks counted back from the segment start
    whose decays sum to <= threshold, or 0 where no window of the segment reaches it (exact path).
    Checked on every (segment, head) of a two-sequence problem against ``autocp.warmup``, then the
    windows' float64 warm-up states against ``reference.segment_states``."""
    name = "warmup_window"
    x, plan, (_, exact, chunks), states = _window_problem()
    L, N, HV = plan.segment_chunks, plan.num_seqs, x["g"].shape[2]
    g = x["g"][0]
    wrong, windows = [], torch.full((N, plan.max_segments, HV), -1)              # -1: exact
    for slot in range(plan.max_segments * N):
        if not plan.slot_warm[slot]:
            continue
        j, n = divmod(slot, N)
        start = int(plan.slot_start[slot])
        decays = g[start - C * L:start].reshape(L, C, HV).sum(1)                  # [L, HV], oldest first
        for head in range(HV):
            got, err = run_answer(name, warmup_window, decays[:, head].clone(), autocp.THRESHOLD)
            if err:
                return report(name, [err])
            try:
                got = int(got)
            except Exception:  # whatever the answer returned, the check reports it
                return report(name, [f"returned {got!r}; expected a whole number of chunks"])
            want = 0 if exact[slot, head] else int(chunks[slot, head])
            windows[n, j, head] = got if got else -1
            if got != want:
                wrong.append((n, j, head, got, want))
    if not wrong:
        return report(name, [])
    n, j, head, got, want = wrong[0]
    say = lambda w: f"{w} chunk{'s' * (w != 1)}" if w else "0 (exact)"
    # what the learner's windows do to the states, in float64
    warm = reference.segment_states(x["k"], x["v"], x["g"], x["beta"], L, cu_seqlens=x["cu"],
                                    warmup_chunks=windows)
    err = rel_l2(warm, states)
    return report(name, [f"{len(wrong)} of the (segment, head) windows differ from autocp.warmup's; "
                         f"sequence {n}, segment {j}, head {head}: yours {say(got)}, the rule's {say(want)} "
                         f"(the window ends where the segment starts); with your windows the "
                         f"float64 segment states are off by {err:.1e}, against e^{autocp.THRESHOLD:.0f} = "
                         f"{math.exp(autocp.THRESHOLD):.1e} per window"])


# ---- exercise 2: the exact transition of a segment --------------------------------------------

TRANSITION_SEGMENT_CHUNKS = 4


@functools.cache
def _transition_problem():
    """One sequence of 12 chunks (3 segments of 4), four value heads with little or no decay, so
    that every segment's transition is far from zero; K = V = 16. Returns the chunks' transitions
    and, per segment, the float64 recurrence's M (run with v = 0 from I) and Z (run from zero),
    and the states entering the segments from ``reference.segment_states``."""
    gen = torch.Generator().manual_seed(7)
    L, T, HV, K = TRANSITION_SEGMENT_CHUNKS, 12 * C, 4, 16
    k = _keys(gen, T, 2, K)
    v = torch.randn(1, T, HV, K, generator=gen, dtype=F64)
    g = torch.tensor([0.0, 0.0, -0.002, -0.01], dtype=F64).expand(1, T, HV).clone()
    beta = torch.rand(1, T, HV, generator=gen, dtype=F64)
    h0 = torch.randn(1, HV, K, K, generator=gen, dtype=F64)
    chunk_M = reference.chunk_transition(k, reference.chunk_local_cumsum(g), beta)[0]  # [NT, HV, K, K]

    def run(t0, t1, v_, h):  # the float64 recurrence over tokens [t0, t1): its final state
        part = [x[:, t0:t1] for x in (k, v_, g, beta)]
        return reference.naive_recurrent_gated_delta_rule(part[0], *part, initial_state=h,
                                                          output_final_state=True)[1][0]

    eye = torch.eye(K, dtype=F64).expand(1, HV, K, K)
    spans = [(j * L * C, (j + 1) * L * C) for j in range(T // (L * C))]
    M = [run(t0, t1, torch.zeros_like(v), eye) for t0, t1 in spans]
    Z = [run(t0, t1, v, None) for t0, t1 in spans]
    states = reference.segment_states(k, v, g, beta, L, h0)[0]                        # [J, HV, K, V]
    return chunk_M, M, Z, h0[0], states


def check_segment_transition(segment_transition) -> Report:
    """``segment_transition(chunk_M)``: chunk_M float64 [L, HV, K, K], the transitions of a
    segment's chunks in the order they run -> the segment's transition M [HV, K, K], so that the
    state leaving the segment is M h + Z. Checked per segment against the float64 recurrence run
    with v = 0 from I, then chained, h_{j+1} = M_j h_j + Z_j, against ``reference.segment_states``."""
    name = "segment_transition"
    chunk_M, want_M, Z, h0, want_states = _transition_problem()
    L, shape = TRANSITION_SEGMENT_CHUNKS, chunk_M.shape[1:]
    states, failures = [h0], []
    for j, (m, z) in enumerate(zip(want_M, Z)):
        got, err = run_answer(name, segment_transition, chunk_M[j * L:(j + 1) * L].clone())
        if err:
            return report(name, [err])
        if not isinstance(got, torch.Tensor) or got.shape != shape or got.dtype != F64:
            return report(name, [f"returned {type(got).__name__} of shape {getattr(got, 'shape', None)}, "
                                 f"dtype {getattr(got, 'dtype', None)}; expected a float64 tensor {list(shape)}"])
        if rel_l2(got, m) > EXACT and not failures:
            failures.append(f"segment {j}: M differs from the recurrence run with v = 0 from I over its "
                            f"tokens by {rel_l2(got, m):.1e}")
        states.append(got @ states[-1] + z)                                       # h_{j+1} = M_j h_j + Z_j
    err = rel_l2(torch.stack(states[:-1]), want_states)
    if err > EXACT:
        failures.append(f"the chained states entering the segments are off by {err:.1e} from "
                        "reference.segment_states")
    return report(name, failures)
