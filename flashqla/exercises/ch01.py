"""Chapter 1's exercises: one token of the recurrence, and sequences packed with ``cu_seqlens``.

Both checks run the learner's code in float64 on four packed sequences (1, 37, 64 and 100 tokens)
with four value heads sharing one key head: head 0 with g = 0, head 1 with a strong decay (about
-2 a token), heads 2 and 3 with an ordinary one (``flashqla.testing.Problem``), K = V = 16, and a
random initial state per sequence. They compare the outputs and final states with
``flashqla.reference.naive_recurrent_gated_delta_rule`` in float64 under the derived bound of
``flashqla.testing``: ``TOLERANCE_FACTOR`` times the error of the same recurrence run in bf16 (at
least ``ROUNDING_FLOOR``). A right answer lands near float64 rounding; the report of a wrong one
says where it goes wrong (which heads, which sequences).
"""

from __future__ import annotations

import functools

import torch

from flashqla import reference
from flashqla.exercises import report, run_answer
from flashqla.testing import ROUNDING_FLOOR, TOLERANCE_FACTOR, Problem, cast_floats, rel_l2

LENGTHS = (1, 37, 64, 100)
HEADS = ("g = 0", "strong decay", "ordinary decay", "ordinary decay")   # Problem's head kinds


@functools.cache
def _problem() -> dict:
    """The inputs (float64, bf16-rounded activations) and the float64 and bf16 references' results."""
    x = cast_floats(Problem(H=1, HV=len(HEADS), lengths=LENGTHS, K=16, V=16).inputs(seed=3),
                    torch.float64)
    want = reference.naive_recurrent_gated_delta_rule(**x)
    bf16 = reference.naive_recurrent_gated_delta_rule(**cast_floats(x, torch.bfloat16))
    return dict(x=x, want=want, bf16=bf16)


def _bound(bf16, want) -> float:
    """The derived tolerance: TOLERANCE_FACTOR x max(the same math's bf16 error, ROUNDING_FLOOR)."""
    return TOLERANCE_FACTOR * max(rel_l2(bf16, want), ROUNDING_FLOOR)


def _compare(got, hint) -> list[str]:
    """What is wrong with got = (o [1, T, HV, V], final states [N, HV, K, V]), value head by value
    head, each against its own bound; then ``hint(o, want_o, wrong_heads)``, where else o goes wrong."""
    p = _problem()
    failures, wrong_o = [], []
    for name, g_, w_, b_ in zip(("o", "final state"), got, p["want"], p["bf16"]):
        if not isinstance(g_, torch.Tensor) or tuple(g_.shape) != tuple(w_.shape):
            shape = tuple(g_.shape) if isinstance(g_, torch.Tensor) else type(g_).__name__
            failures.append(f"`{name}` has shape {shape}, expected {tuple(w_.shape)}")
            continue
        dim = 2 if name == "o" else 1
        errs = [rel_l2(g_.select(dim, hd), w_.select(dim, hd)) for hd in range(len(HEADS))]
        bounds = [_bound(b_.select(dim, hd), w_.select(dim, hd)) for hd in range(len(HEADS))]
        wrong = [hd for hd in range(len(HEADS)) if not errs[hd] <= bounds[hd]]
        if wrong:
            failures.append(f"{name} wrong on heads {', '.join(f'{hd} ({HEADS[hd]})' for hd in wrong)}: "
                            f"rel L2 errors {', '.join(f'{errs[hd]:.1e}' for hd in wrong)} > bounds "
                            f"{', '.join(f'{bounds[hd]:.1e}' for hd in wrong)}")
            if name == "o":
                wrong_o = wrong
    if wrong_o:
        failures.append(hint(got[0], p["want"][0], wrong_o))
    return [f for f in failures if f]


def _decay_hint(o, want, wrong_heads) -> str:
    if 0 not in wrong_heads:
        return "right where g = 0, wrong where the head decays: look at where the decay enters"
    return ""


def _sequence_hint(o, want, wrong_heads) -> str:
    cu = _problem()["x"]["cu_seqlens"].tolist()
    errs = [rel_l2(o[:, s:e], want[:, s:e]) for s, e in zip(cu[:-1], cu[1:])]
    right = [n for n, e in enumerate(errs) if e < 1e-10]
    if right == [0]:
        return "sequence 0 is right and every later one is wrong: which state does each sequence start from?"
    return "o is right on sequences " + (", ".join(map(str, right)) or "none")


def _run_steps(step):
    """The problem run token by token through ``step(h, q_t, k_t, v_t, g_t, beta_t, scale)``, one
    (sequence, value head) at a time -> (o, final states)."""
    x = _problem()["x"]
    hv = x["v"].shape[2]
    q, k = (reference.expand_heads(x[n], hv)[0] for n in ("q", "k"))      # [T, HV, K]
    v, g, beta = x["v"][0], x["g"][0], x["beta"][0]
    scale = q.shape[-1] ** -0.5
    cu = x["cu_seqlens"].tolist()
    o, finals = torch.zeros_like(v), torch.zeros_like(x["initial_state"])
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        for hd in range(hv):
            h = x["initial_state"][n, hd].clone()
            for t in range(s, e):
                o[t, hd], h = step(h, q[t, hd], k[t, hd], v[t, hd], g[t, hd], beta[t, hd], scale)
            finals[n, hd] = h
    return o[None], finals


def check_gdn_step(step):
    """``step(h [K, V], q_t, k_t [K], v_t [V], g_t, beta_t, scale) -> (o_t [V], h [K, V])``, one token
    of one value head, against the float64 recurrence."""
    got, error = run_answer("gdn_step", _run_steps, step)
    return report("gdn_step", [error] if error else _compare(got, _decay_hint))


def check_run_packed(run_packed):
    """``run_packed(q, k, v, g, beta, initial_state, cu_seqlens) -> (o [1, T, HV, V], final states
    [N, HV, K, V])`` over sequences packed along T, against the float64 recurrence."""
    x = _problem()["x"]
    args = {n: x[n].clone() for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")}
    got, error = run_answer("run_packed", run_packed, **args)
    if error is None and not (isinstance(got, tuple) and len(got) == 2):
        error = f"returned {type(got).__name__}; expected a pair (o, final states)"
    return report("run_packed", [error] if error else _compare(got, _sequence_hint))
