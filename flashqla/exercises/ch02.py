"""Chapter 2's exercises: the chunk-local cumsum of packed sequences, and the UT transform.

Both checks hand the learner's function to ``flashqla.testing.check_op``, the check every kernel
stage passes, on four packed sequences (1, 100, 64 and 130 tokens: full, partial and one-token
chunks, and sequence starts that are not multiples of 64) with four value heads sharing one key
head (``flashqla.testing.Problem``: g = 0, strong decay, two ordinary decays), K = V = 16. The
inputs are those a kernel of the op gets (``op_inputs``); the bound is derived: ``TOLERANCE_FACTOR``
times the error of the same reference math run in bf16 (at least ``ROUNDING_FLOOR``). The report
of a wrong answer adds what its mistake looks like.
"""

from __future__ import annotations

import functools

import torch

from flashqla import reference
from flashqla.exercises import report, run_answer
from flashqla.testing import Problem, check_op, op_inputs

LENGTHS = (1, 100, 64, 130)


@functools.cache
def _inputs(op: str) -> dict:
    return op_inputs(op, Problem(H=1, HV=4, lengths=LENGTHS, K=16, V=16).inputs(seed=2))


def _check(exercise: str, op: str, fn, hint) -> object:
    """check_op on the op's inputs; a failure's message, then ``hint()``, what the mistake looks like."""
    _, error = run_answer(exercise, check_op, op, fn, _inputs(op))
    if error is None:
        return report(exercise, [])
    if error.startswith("raised AssertionError: "):   # check_op's "<op>: wrong answer", then one line an output
        error = "; ".join(line.strip() for line in error.splitlines()[1:])
    return report(exercise, [error, hint()])


def check_chunk_local_cumsum(chunk_local_cumsum):
    """``chunk_local_cumsum(g [1, T, HV], cu_seqlens) -> g_cum [1, T, HV]``: the cumulative sum of g,
    restarting at every chunk start, chunks of 64 counted from every sequence's first token."""

    def hint() -> str:
        x = _inputs("chunk_local_cumsum")
        got, error = run_answer("chunk_local_cumsum", chunk_local_cumsum, **x)
        if error or not isinstance(got, torch.Tensor) or got.shape != x["g"].shape:
            return "it must return a tensor shaped like g"
        want = reference.chunk_local_cumsum(x["g"].double(), x["cu_seqlens"])
        cu = x["cu_seqlens"].tolist()
        bad = [t for t in range(cu[-1]) if not torch.allclose(got[0, t].double(), want[0, t], atol=1e-4)]
        if not bad:
            return ""
        n = next(n for n in range(len(LENGTHS)) if cu[n] <= bad[0] < cu[n + 1])
        return (f"the first wrong token is {bad[0]}, token {bad[0] - cu[n]} of sequence {n} "
                f"(tokens {cu[n]}:{cu[n + 1]}): where do that sequence's chunks start?")

    return _check("chunk_local_cumsum", "chunk_local_cumsum", chunk_local_cumsum, hint)


def _chunks(cu_seqlens, chunk_size=reference.CHUNK_SIZE):
    """(start, end) of every chunk of every sequence, in token positions."""
    bounds = cu_seqlens.tolist()
    return [(s, min(s + chunk_size, e)) for b, e in zip(bounds[:-1], bounds[1:])
            for s in range(b, e, chunk_size)]


def check_ut_transform(ut_transform):
    """``ut_transform(k_c [n, K], beta_c [n], g_c [n]) -> T_c [n, n]`` for one chunk of n tokens
    and one value head (g_c its chunk-local cumsum): T = (I + A)^-1, A = StrictLower(diag(beta)
    K K^T * Gamma). Checked through w and u (``chunk_fwd_intra``), which is what T is for."""

    def w_u(k, v, g_cum, beta, cu_seqlens):
        """chunk_fwd_intra with the learner's T: w = T diag(beta exp(g)) K, u = T diag(beta) V."""
        hv = v.shape[2]
        k, v, g_cum, beta = (x.double() for x in (reference.expand_heads(k, hv), v, g_cum, beta))
        w, u = torch.zeros_like(k), torch.zeros_like(v)
        for s, e in _chunks(cu_seqlens):
            for hd in range(hv):
                T_c = ut_transform(k[0, s:e, hd], beta[0, s:e, hd], g_cum[0, s:e, hd])
                b = beta[0, s:e, hd, None]
                w[0, s:e, hd] = T_c @ (b * torch.exp(g_cum[0, s:e, hd, None]) * k[0, s:e, hd])
                u[0, s:e, hd] = T_c @ (b * v[0, s:e, hd])
        return w, u

    def hint() -> str:
        """Compare with T on a chunk of the strong-decay head: the diagonal, then the gate."""
        x = {n: t.double() if t.is_floating_point() else t for n, t in _inputs("chunk_fwd_intra").items()}
        s, e = _chunks(x["cu_seqlens"])[1]                       # the first full chunk
        k_c, b_c, g_c = x["k"][0, s:e, 0], x["beta"][0, s:e, 1], x["g_cum"][0, s:e, 1]
        got, error = run_answer("ut_transform", ut_transform, k_c, b_c, g_c)
        if error or not isinstance(got, torch.Tensor) or got.shape != (e - s, e - s):
            return f"it must return an n x n tensor for a chunk of n tokens (n = {e - s} here)"
        eye = torch.eye(e - s, dtype=torch.float64)
        if not torch.allclose(torch.diagonal(got.double()), torch.ones(e - s, dtype=torch.float64)):
            return "T's diagonal is not 1: A is strictly lower triangular, so I + A has a unit diagonal"
        no_gate = torch.linalg.inv(eye + torch.tril(b_c[:, None] * (k_c @ k_c.T), -1))
        if torch.allclose(got.double(), no_gate):
            return "T equals the inverse without the gate: A carries Gamma_ij = exp(g_i - g_j)"
        return ""

    return _check("ut_transform", "chunk_fwd_intra", w_u, hint)
