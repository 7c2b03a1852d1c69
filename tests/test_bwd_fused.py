"""The fused reverse backward (gdn_bwd.s04): what the generic stage tests (tests/test_stages.py: the
stage at its own rule against float64 on the public shape set) do not cover.

CPU: the kernel's per-chunk formulas, in its order and with its value-column split (every
gradient a sum of per-block parts, the wy part included), replayed in float64 against
``chunk_gated_delta_rule_bwd_ref`` at 1e-12, and shown to fail with one term dropped; the stage's
contract and its errors.
GPU (gpu, hopper): the stage against float64 (``check_op``) on the public shape set split at a
forced segment length (``cp=2``) and unsplit (``cp=False``); with and without h0 and dht, split and
not; bitwise equal from run to run; a CUDA-graph replay equals the eager call.
"""

import functools

import pytest
import torch

from flashqla import autocp
from flashqla import reference as ref
from flashqla.stages import load
from flashqla.testing import PUBLIC_HEADS, Problem, cast_floats, check_op, op_inputs, rel_l2, run_on_threads
from test_bwd_autocp import GPU_PROBLEMS, check_graph_replay, check_segmented_stage_contract, gpu_inputs

S04 = load("gdn_bwd", 4)
F64 = torch.float64


def fused_reverse_f64(x, BV, drop=None):
    """The fused reverse kernel's arithmetic in float64 for one sequence (B = 1, no cu_seqlens):
    per (value head, BV value columns) the chunks backwards, every gradient of a chunk from
    dS' and S, as ``fused_reverse_kernel`` orders it; the parts summed as the finish sums them.
    ``drop``: a term left out (the mutant check)."""
    q, k, v, g, beta, do, dht, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "do", "dht", "initial_state"))
    _, T, H, K = q.shape
    HV, V, C = v.shape[2], v.shape[3], S04.CHUNK_SIZE
    G, scale = HV // H, K ** -0.5
    g_cum = ref.chunk_local_cumsum(g)
    Ai = ref.kkt_solve(ref.chunk_kkt(k, g_cum, beta))
    w, u = ref.chunk_w_u(k, v, beta, Ai, g_cum)
    h, v_new, _ = ref.chunk_h(k, w, u, g_cum, h0, False)
    dq, dk = torch.zeros(T, H, K, dtype=F64), torch.zeros(T, H, K, dtype=F64)
    dv, dg, dbeta = torch.zeros(T, HV, V, dtype=F64), torch.zeros(T, HV, dtype=F64), torch.zeros(T, HV, dtype=F64)
    dh0 = torch.zeros(HV, K, V, dtype=F64)
    rows = torch.arange(C)[:, None]
    cols = torch.arange(C)[None, :]

    def tile(t, sl, n):  # rows of the chunk, zeros from row n
        out = torch.zeros((C,) + t.shape[1:], dtype=F64)
        out[:n] = t[sl]
        return out
    for hv in range(HV):
        for v0 in range(0, V, BV):
            cs = slice(v0, v0 + BV)
            dS = dht[0, hv, :, cs].clone()
            for c in reversed(range(-(-T // C))):
                t0, n = c * C, min(T - c * C, C)
                sl = slice(t0, t0 + n)
                Q, Kc, W = (tile(t[0, :, i], sl, n) for t, i in ((q, hv // G), (k, hv // G), (w, hv)))
                dO, Vn, Vv = (tile(t[0, :, hv, cs], sl, n) for t in (do, v_new, v))
                A = tile(Ai[0, :, hv], sl, n)
                e = torch.exp(torch.cat([g_cum[0, sl, hv], g_cum[0, t0 + n - 1, hv].repeat(C - n)]))
                b = tile(beta[0, :, hv], sl, n)
                S, real = h[0, c, hv, :, cs], rows < n
                gam = e[:, None] / e[None, :]
                # the walk step
                dSp = dS.clone()
                PT = torch.where((rows <= cols) & (cols < n), scale * (Kc @ Q.T) * gam.T, 0.)
                negdV = torch.where(real, -((Kc @ dSp) * (e[-1] / e)[:, None] + PT @ dO), 0.)
                dS = dS * e[-1] + Q.T @ (dO * (scale * e)[:, None]) + W.T @ negdV
                # chunk_bwd_dqkwg's part
                dP = torch.where((cols <= rows) & real, scale * (dO @ Vn.T) * gam, 0.)
                dW = negdV @ S.T
                dQ = (dO @ S.T) * (scale * e)[:, None] + dP @ Kc
                dK_i = torch.where(real, (Vn @ dSp.T) * (e[-1] / e)[:, None], 0.)
                dK_p = dP.T @ Q
                dgc = (dQ * Q).sum(1) - (dK_i * Kc).sum(1) - (dK_p * Kc).sum(1)
                dg_last = (dK_i * Kc).sum() + e[-1] * (S * dSp).sum()
                # wy_bwd's part, from this block's dW and dV~
                dAi = torch.where((cols < rows) & real, -b[None, :] * (dW @ (-Kc * e[:, None]).T + negdV @ Vv.T), 0.)
                dA = torch.where((cols < rows) & real, -(A.T @ (dAi @ A.T)) * gam, 0.)
                D, E = b[:, None] * dA, dA * (Kc @ Kc.T)
                X, Y = A.T @ dW, -(A.T @ negdV)
                dK = dK_i + dK_p + D @ Kc + (0 if drop == "D^T K" else D.T @ Kc) + X * (b * e)[:, None]
                r_k, r_e = (X * Kc).sum(1), E.sum(1)
                dbeta[sl, hv] += (e * r_k + (Y * Vv).sum(1) + r_e)[:n]
                dgc = dgc + b * (e * r_k + r_e) - (b[:, None] * E).sum(0)
                dgc[n - 1] += dg_last
                dgc[n:] = 0
                dg[sl, hv] += dgc.flip(0).cumsum(0).flip(0)[:n]
                dq[sl, hv // G] += dQ[:n]
                dk[sl, hv // G] += dK[:n]
                dv[sl, hv, cs] = (Y * b[:, None])[:n]
            dh0[hv, :, cs] = dS
    return dq[None], dk[None], dv[None], dg[None], dbeta[None], dh0[None]


@pytest.mark.parametrize("BV", [64, 128])
def test_fused_chunk_formulas_are_the_backward_in_float64(BV):
    """The stage's per-chunk arithmetic (the value columns split in blocks of BV) is the backward:
    a varlen-free sequence of 150 tokens (a partial last chunk), GVA group 2, h0 and dht."""
    x = cast_floats(op_inputs("gdn_bwd", Problem(2, 4, (150,), varlen=False).inputs(seed=7)), F64)
    want = ref.chunk_gated_delta_rule_bwd_ref(*(x[n] for n in ("q", "k", "v", "g", "beta", "do", "dht")),
                                              None, x["initial_state"])
    for name, got, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), fused_reverse_f64(x, BV), want):
        assert rel_l2(got, w) < 1e-12, name


def test_fused_chunk_formula_check_fails_without_a_term():
    x = cast_floats(op_inputs("gdn_bwd", Problem(2, 4, (150,), varlen=False).inputs(seed=7)), F64)
    want = ref.chunk_gated_delta_rule_bwd_ref(*(x[n] for n in ("q", "k", "v", "g", "beta", "do", "dht")),
                                              None, x["initial_state"])
    assert rel_l2(fused_reverse_f64(x, 64, drop="D^T K")[1], want[1]) > 1e-3


def test_stage_contract():
    check_segmented_stage_contract(S04)


# ---- on the GPU -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """The stage's kernels, split and not, for every public head layout, compiled on threads first
    (s02's prep, s03's segment kernels, and the three new kernels: about 80 TileLang kernels)."""
    run_on_threads([functools.partial(S04.run, **gpu_inputs(Problem(H, HV, (700, 70))), cp=cp)
                    for H, HV in PUBLIC_HEADS for cp in (2, False)])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_fused_matches_reference(problem, cp, compiled):
    check_op("gdn_bwd", functools.partial(S04.run, cp=cp), gpu_inputs(problem))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "h0=None"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "dht=None"])
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_without_h0_or_dht(initial_state, with_dht, cp, compiled):
    """dht = None is a zero final-state gradient (the unsplit kernel skips its load, the split
    one chains zeros); without h0 there is no dh0."""
    x = gpu_inputs(Problem(4, 16, (1, 200, 777, 64, 130), initial_state=initial_state), seed=6)
    if not with_dht:
        x["dht"] = None
    check_op("gdn_bwd", functools.partial(S04.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [4, False], ids=["cp_4", "cp_off"])
def test_bitwise_deterministic(cp, compiled):
    x = gpu_inputs(Problem(4, 16, (3000, 1, 700, 2500)), seed=2)
    first = S04.run(**x, cp=cp)
    for _ in range(3):
        again = S04.run(**x, cp=cp)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,cp", [(Problem(2, 8, (16384,)), None), (Problem(2, 8, (16000, 3000, 192)), 8),
                                        (Problem(2, 8, (1000, 3000, 192)), False)],
                         ids=["rule", "varlen_cp8", "varlen_cp_off"])
def test_cuda_graph_replay_equals_eager(problem, cp, compiled):
    """After one eager call (which reads cu_seqlens once), the whole backward captures, and its replay
    gives the eager bits, again after the inputs change in place."""
    x = gpu_inputs(problem, seed=3)
    B, T = x["q"].shape[:2]
    split = S04.S03.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), x["q"].device, cp)
    assert (split is not None) == (cp is not False)
    check_graph_replay(S04, x, cp)
