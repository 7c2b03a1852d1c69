"""Chapter 4's exercises: the gate restored on the gate-free inverse, and the chain step without w, u.

Both checks call the learner's function chunk by chunk, in float64, on one sequence of 200 tokens
(three chunks of 64 and one of 8) with three value heads sharing a key head: head 0 with g = 0,
head 1 with an ordinary decay, head 2 with a strong one (about -2 a token). They compare with the
float64 reference's sub-steps (``flashqla.reference``) under the derived bound of
``flashqla.testing``: ``TOLERANCE_FACTOR`` times the error of the same reference math run in bf16
(at least ``ROUNDING_FLOOR``). A right answer lands near float64 rounding; the plausible mistakes
are off by orders of magnitude, and the report says on which heads.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
import torch.nn.functional as F

from flashqla import reference
from flashqla.exercises import report, run_answer
from flashqla.testing import ROUNDING_FLOOR, TOLERANCE_FACTOR, cast_floats, rel_l2

C = 64                       # chunk size
T_TOKENS, K, V = 200, 16, 16
HEADS = ("g = 0", "ordinary decay", "strong decay")


@functools.cache
def _problem() -> dict:
    """One sequence, one key head, three value heads (HEADS), float64, seeded."""
    gen = torch.Generator().manual_seed(4)
    f64 = torch.float64
    k = reference.l2norm(torch.randn(1, T_TOKENS, 1, K, generator=gen, dtype=f64))
    v = torch.randn(1, T_TOKENS, len(HEADS), V, generator=gen, dtype=f64)
    g = torch.stack([torch.zeros(T_TOKENS, dtype=f64),
                     F.logsigmoid(torch.randn(T_TOKENS, generator=gen, dtype=f64) + 2.0),
                     -2.0 + 0.1 * torch.randn(T_TOKENS, generator=gen, dtype=f64)], -1)[None]
    beta = torch.sigmoid(torch.randn(1, T_TOKENS, len(HEADS), generator=gen, dtype=f64))
    h0 = torch.randn(1, len(HEADS), K, V, generator=gen, dtype=f64)
    return dict(k=k, v=v, g=g, beta=beta, h0=h0)


def _chunks():
    return [(s, min(s + C, T_TOKENS)) for s in range(0, T_TOKENS, C)]


def _bound(bf16, want) -> float:
    """The derived tolerance: TOLERANCE_FACTOR x max(the same math's bf16 error, ROUNDING_FLOOR)."""
    return TOLERANCE_FACTOR * max(rel_l2(bf16, want), ROUNDING_FLOOR)


def _wy(x: dict) -> torch.Tensor:
    """The gated inverse (I + A)^-1 per token row, from the reference's chunk_kkt and kkt_solve."""
    g_cum = reference.chunk_local_cumsum(x["g"])
    return reference.kkt_solve(reference.chunk_kkt(x["k"], g_cum, x["beta"]))


def _per_head(got, want, bound) -> list[str]:
    """The heads (dimension 1 of got and want) that are wrong, by name, with their errors; a hint
    when only the decaying ones are."""
    errs = [rel_l2(got[:, hd], want[:, hd]) for hd in range(len(HEADS))]
    wrong = [f"head with {name}: {e:.1e}" for name, e in zip(HEADS, errs) if e > bound]
    if wrong and errs[0] <= bound:
        wrong.append("right where g = 0, wrong where the head decays: a decay factor is missing, "
                     "or its exponent is not a difference gamma_i - gamma_j <= 0")
    return wrong


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}


def allocations(module, builder, **names) -> list[tuple[str, str, tuple[int, ...], str, int]]:
    """[(name, "shared" or "fragment", shape, dtype, bytes)] of every ``T.alloc_shared`` and
    ``T.alloc_fragment`` in a kernel builder of ``module`` (a stage, or ``flashqla.fwd``), shapes
    evaluated with the module's integer constants, C = CHUNK_SIZE, BV = BLOCK_V and K, V of its
    DEFAULT_SHAPE (128 if it has none); ``names`` overrides any of them (e.g. ``BV=128``,
    ``NUM_STAGES=3``). Chapter 5 reads s05's and the library's allocations with it."""
    names = {**{n: v for n, v in vars(module).items() if n.isupper() and isinstance(v, int)},
             "C": module.CHUNK_SIZE, "BV": module.BLOCK_V,
             **getattr(module, "DEFAULT_SHAPE", {"K": 128, "V": 128}), **names}
    out = []
    pattern = r"(\w+) = T\.alloc_(shared|fragment)\(\(([^)]*)\),\s*\"(\w+)\"\)"
    for name, kind, shape, dtype in re.findall(pattern, inspect.getsource(builder)):
        dims = tuple(eval(d, {}, names) for d in shape.split(",") if d.strip())
        out.append((name, kind, dims, dtype, DTYPE_BYTES[dtype] * int(torch.tensor(dims).prod())))
    return out


def check_restore_gate(restore_gate):
    """``restore_gate(A_r [n, n], gamma [n]) -> (I + A)^-1 [n, n]``: the gated inverse from the
    gate-free one, A_r = (I + StrictLower(diag(beta) K K^T))^-1, and the chunk's cumulative log decay."""
    name = "restore the gate"
    x = _problem()
    gamma = reference.chunk_local_cumsum(x["g"])[0]                                  # [T, HV]
    no_gate = dict(x, g=torch.zeros_like(x["g"]))
    a_r = _wy(no_gate)[0]                                                            # [T, HV, C]
    want = _wy(x)[0]
    bound = _bound(_wy(cast_floats(x, torch.bfloat16))[0], want)
    got = torch.zeros_like(want)
    for s, e in _chunks():
        for hd in range(len(HEADS)):
            out, err = run_answer(name, restore_gate, a_r[s:e, hd, :e - s].clone(), gamma[s:e, hd].clone())
            if err:
                return report(name, [err])
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (e - s, e - s):
                return report(name, [f"expected a tensor of shape {(e - s, e - s)} for a chunk of {e - s} "
                                     f"tokens; got {getattr(out, 'shape', type(out).__name__)}"])
            got[s:e, hd, :e - s] = out.double()
    err = rel_l2(got, want)
    if err <= bound:
        return report(name, [])
    failures = [f"rel L2 err {err:.1e} against the reference's gated solve (bound {bound:.1e})"]
    return report(name, failures + _per_head(got, want, bound))


def check_chain_step(chain_step):
    """``chain_step(S [K, V], K [n, K], V [n, V], Ab [n, n], gamma [n]) -> (V~ [n, V], S_next [K, V])``:
    one chunk of the chain from the gate-free Ab = A_r diag(beta), without w and u."""
    name = "the chain step without w and u"
    x = _problem()

    def chain(xx):
        g_cum = reference.chunk_local_cumsum(xx["g"])
        ai = reference.kkt_solve(reference.chunk_kkt(xx["k"], g_cum, xx["beta"]))
        w, u = reference.chunk_w_u(xx["k"], xx["v"], xx["beta"], ai, g_cum)
        return reference.chunk_h(xx["k"], w, u, g_cum, xx["h0"], output_final_state=True)

    h, v_new, h_final = chain(x)                 # h: the state entering each chunk [1, NT, HV, K, V]
    h16, v_new16, h_final16 = chain(cast_floats(x, torch.bfloat16))
    states = torch.cat([h[0], h_final])          # entering chunk c, and after it: states[c + 1]
    states16 = torch.cat([h16[0], h_final16])
    ab = reference.gate_free_solve(x["k"], x["beta"])[0]
    gamma = reference.chunk_local_cumsum(x["g"])[0]
    k_rows = x["k"][0, :, 0]
    got_v, got_s = torch.zeros_like(v_new[0]), torch.zeros_like(states[1:])
    for c, (s, e) in enumerate(_chunks()):
        for hd in range(len(HEADS)):
            args = (states[c, hd].clone(), k_rows[s:e].clone(), x["v"][0, s:e, hd].clone(),
                    ab[s:e, hd, :e - s].clone(), gamma[s:e, hd].clone())
            out, err = run_answer(name, chain_step, *args)
            if err:
                return report(name, [err])
            if not (isinstance(out, tuple) and len(out) == 2):
                return report(name, ["expected a pair (V~, S_next)"])
            vt, s_next = out
            if tuple(vt.shape) != (e - s, V) or tuple(s_next.shape) != (K, V):
                return report(name, [f"expected V~ {(e - s, V)} and S_next {(K, V)}; got "
                                     f"{tuple(vt.shape)} and {tuple(s_next.shape)}"])
            got_v[s:e, hd], got_s[c, hd] = vt.double(), s_next.double()
    failures = []
    for what, got_, want, bf16 in (("V~ (v_new)", got_v, v_new[0], v_new16[0]),
                                   ("the next state", got_s, states[1:], states16[1:])):
        err, bound = rel_l2(got_, want), _bound(bf16, want)
        if err > bound:
            failures.append(f"{what}: rel L2 err {err:.1e} against the reference's chunk_h (bound "
                            f"{bound:.1e})")
            failures += _per_head(got_, want, bound)
    return report(name, failures)
