"""Chapter 3's exercises: one chunk of the fused kernel's loop, and a tensor-core product on Hopper.

``check_fused_chunk`` runs the learner's chunk step over every chunk of four packed sequences (1,
100, 64 and 130 tokens) with four value heads sharing one key head (``flashqla.testing.Problem``:
g = 0, strong decay, two ordinary decays), K = V = 32, in float64, with w, u and the chunk-local
cumsum from the float64 reference, and hands the whole forward to ``flashqla.testing.check_op``:
the bound is ``TOLERANCE_FACTOR`` times the error of the same reference math run in bf16 (at least
``ROUNDING_FLOOR``), the check every gdn_fwd stage passes.

``check_chunk_scores`` compiles the learner's TileLang kernel for sm_90a (no GPU needed, a few
seconds) and reads the generated CUDA: the product Q K^T must be a warpgroup MMA (``wgmma``), and
the decay an ``exp2f`` of log2(e)-scaled logs.
"""

from __future__ import annotations

import functools
import re

import torch

from flashqla import reference
from flashqla.exercises import report, run_answer
from flashqla.testing import Problem, check_op, rel_l2

LENGTHS = (1, 100, 64, 130)


@functools.cache
def _inputs() -> dict:
    return Problem(H=1, HV=4, lengths=LENGTHS, K=32, V=32).inputs(seed=5)


def _forward_by_chunks(fused_chunk):
    """A gdn_fwd with the learner's chunk step: the float64 reference prepares g_cum, w and u; the
    step walks every (sequence, value head) chunk by chunk, as one CTA of s03 does."""

    def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None):
        q, k, v, g, beta, h0 = (x.double() for x in (q, k, v, g, beta, initial_state))
        hv, C = v.shape[2], reference.CHUNK_SIZE
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        g_cum = reference.chunk_local_cumsum(g, cu_seqlens)
        w, u = reference.chunk_fwd_intra(k, v, g_cum, beta, cu_seqlens)
        q, k = (reference.expand_heads(x, hv) for x in (q, k))
        o, finals = torch.zeros_like(v), torch.zeros_like(h0)
        bounds = cu_seqlens.tolist()
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
            for hd in range(hv):
                S = h0[n, hd]
                for s in range(bos, eos, C):
                    e = min(s + C, eos)
                    o[0, s:e, hd], S = fused_chunk(S, q[0, s:e, hd], k[0, s:e, hd], w[0, s:e, hd],
                                                   u[0, s:e, hd], g_cum[0, s:e, hd], scale)
                finals[n, hd] = S
        return o, (finals if output_final_state else None)

    return forward


def check_fused_chunk(fused_chunk):
    """``fused_chunk(S [K, V], q_c, k_c, w_c [n, K], u_c [n, V], g_c [n], scale) -> (o_c [n, V],
    the state leaving the chunk [K, V])``: one chunk of one value head, S the state entering it."""
    forward = _forward_by_chunks(fused_chunk)
    _, error = run_answer("fused_chunk", check_op, "gdn_fwd", forward, _inputs())
    if error is None:
        return report("fused_chunk", [])
    if not error.startswith("raised AssertionError: "):
        return report("fused_chunk", [error])
    failures = [line.strip() for line in error.splitlines()[1:]]   # check_op: one line a wrong output
    if not any(line.startswith("final_state") for line in failures):
        failures.append("the final state is right and o is wrong: " + _output_hint(fused_chunk))
    return report("fused_chunk", failures)


def _output_hint(fused_chunk) -> str:
    """What the output of one full chunk of a decaying head looks like, against the known mistakes."""
    x = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
         for n, t in _inputs().items()}
    s, e, hd = 101, 165, 2                              # sequence 2's chunk; head 2 decays
    q_c, k_c = x["q"][0, s:e, 0], x["k"][0, s:e, 0]
    g_cum = torch.cumsum(x["g"][:, s:e], 1)
    w, u = reference.chunk_fwd_intra(x["k"][:, s:e], x["v"][:, s:e], g_cum, x["beta"][:, s:e])
    g_c, w_c, u_c = g_cum[0, :, hd], w[0, :, hd], u[0, :, hd]
    S = torch.randn(k_c.shape[1], u_c.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    scale = q_c.shape[-1] ** -0.5
    got, error = run_answer("fused_chunk", fused_chunk, S.clone(), q_c, k_c, w_c, u_c, g_c, scale)
    if error:
        return f"called on one chunk it {error}"
    if not (isinstance(got, tuple) and isinstance(got[0], torch.Tensor) and got[0].shape == u_c.shape):
        return f"called on one chunk it must return (o_c {tuple(u_c.shape)}, the state leaving it)"
    v_new = u_c - w_c @ S
    S_next = torch.exp(g_c[-1]) * S + k_c.T @ (torch.exp(g_c[-1] - g_c)[:, None] * v_new)
    scores = q_c @ k_c.T * torch.exp(torch.tril(g_c[:, None] - g_c[None, :]))

    def output(state, diagonal):
        return scale * (torch.exp(g_c)[:, None] * (q_c @ state) + torch.tril(scores, diagonal) @ v_new)

    if rel_l2(got[0], output(S_next, 0)) < 1e-8:
        return ("it reads the state leaving the chunk; a chunk's output reads the state entering it "
                "(the kernel keeps that one in shared memory while it updates the registers)")
    if rel_l2(got[0], output(S, -1)) < 1e-8:
        return "its mask drops the diagonal; a token sees itself (lower triangle incl. the diagonal)"
    return "compare it, line by line, with O = scale (diag(exp(g)) Q S + (Q K^T * Gamma, lower incl. diagonal) V~)"


def check_chunk_scores(chunk_scores):
    """``chunk_scores()`` -> the ``T.prim_func`` of chapter 3's exercise 2, compiled for sm_90a."""
    from flashqla.hopper import compile_hopper

    kernel, error = run_answer("chunk_scores", lambda: compile_hopper(chunk_scores()))
    if error:
        return report("chunk_scores", [f"compiling it {error}"])
    src = kernel.get_kernel_source()
    failures = []
    if "tl::wgmma_" not in src:
        threads = re.search(r"__launch_bounds__\((\d+)", src)
        threads = f"{threads.group(1)} threads" if threads else "its threads"
        found = "tl::mma_sync, one warp's 16x8x16 MMA" if "tl::mma_sync" in src else "no tensor-core MMA"
        failures.append(f"T.gemm compiled to {found}, not wgmma: a wgmma is issued by a warpgroup, "
                        f"4 warps (128 threads) together; this CTA has {threads}")
    if "exp2f(" not in src:
        failures.append("no exp2f in the CUDA: take the decay as exp2 of log2(e)-scaled logs")
    return report("chunk_scores", failures)
