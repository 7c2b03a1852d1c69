"""The backward's w, u and wy_bwd on the forward's solve (gdn_bwd.s05).

CPU: ``reference.chunk_w_u_ab`` and ``reference.wy_bwd_ab`` read Ab and the gated flags where
``chunk_w_u`` and ``wy_bwd`` read Ai and beta, and give the same in float64 (1e-12), with beta = 0
tokens, flagged chunks (the solve's policy, at random, all) and varlen; the closed forms of the
T_b rewrite (beta_i dA_ij and dbeta) hold too. Each check is shown to fail on a deliberately
broken variant. The stage's contract and its errors.
GPU (gpu, hopper): the stage against float64 (``check_op``) on the public shape set at its rule,
split at a forced segment length and unsplit; without h0 or dht; with beta = 0 tokens and with
keys the solve flags; bitwise equal from run to run; a CUDA-graph replay equals the eager call.
"""

import functools

import pytest
import torch

from flashqla import autocp
from flashqla import reference as ref
from flashqla.stages import load
from flashqla.testing import (PUBLIC_HEADS, Problem, adversarial_inputs, cast_floats, check_op, op_inputs, rel_l2,
                              run_on_threads)
from test_backward_reference import mutant
from test_bwd_autocp import GPU_PROBLEMS, check_graph_replay, check_segmented_stage_contract, gpu_inputs

S05 = load("gdn_bwd", 5)

F64 = torch.float64
TOL = 1e-12
# varlen with lengths 1 and not multiples of 64, an equal-length GVA batch, the solve's flagged keys
PROBLEMS = {
    "varlen": Problem(1, 3, (1, 63, 64, 65, 200, 1, 7), K=32, V=16),
    "batch": Problem(2, 4, (150, 150), varlen=False, K=16, V=16),
}
CASES = [("varlen", "policy"), ("varlen", "random"), ("varlen", "all"), ("batch", "policy"),
         ("batch", "random"), ("unnormalized_keys", "policy")]


@functools.cache
def inputs(label, flags):
    """Float64 inputs with every fifth token's beta 0 and a run of beta = 0 in one head; Ab and
    gated as the solve's policy gives them (``flagged_solve``), or flagged at random or all (both
    forms of Ab hold the same T_b); dw, du random."""
    x = cast_floats(PROBLEMS[label].inputs() if label in PROBLEMS else
                    adversarial_inputs(label, H=1, HV=2, lengths=(100, 1, 30), device="cpu"), F64)
    k, v, g, cu = x["k"], x["v"], x["g"], x["cu_seqlens"]
    beta = x["beta"].clone()
    beta[:, ::5] = 0
    beta[:, 10:30, -1] = 0
    g_cum = ref.chunk_local_cumsum(g, cu)
    Ai = ref.kkt_solve(ref.chunk_kkt(k, g_cum, beta, cu), cu)
    Ab, gated = ref.flagged_solve(k, g_cum, beta, cu)
    if flags != "policy":
        ch = ref.Chunking(*k.shape[:2], cu, ref.CHUNK_SIZE, k.device)
        shape = (ch.num_seqs, ch.num_chunks, beta.shape[2])
        flag = (torch.ones(shape, dtype=torch.bool) if flags == "all"
                else torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.5)
        tb = ref._heads_first(ch.pad(Ai)) * ref._heads_first(ch.pad(beta))[..., None, :]
        free = ref._heads_first(ch.pad(ref.gate_free_solve(k, beta, cu)))
        Ab = ch.unpad(ref._tokens_first(torch.where(flag[..., None, None], tb, free)))
        gated = ch.pack_chunks(flag.to(torch.int32))
    gen = torch.Generator().manual_seed(1)
    dw = torch.randn(*v.shape[:3], k.shape[3], generator=gen, dtype=F64)
    du = torch.randn(v.shape, generator=gen, dtype=F64)
    return dict(k=k, v=v, beta=beta, g_cum=g_cum, Ai=Ai, Ab=Ab, gated=gated, dw=dw, du=du, cu_seqlens=cu)


def check_w_u(label, flags):
    """chunk_w_u_ab == chunk_w_u."""
    a = inputs(label, flags)
    got = ref.chunk_w_u_ab(a["k"], a["v"], a["Ab"], a["gated"], a["g_cum"], a["cu_seqlens"])
    want = ref.chunk_w_u(a["k"], a["v"], a["beta"], a["Ai"], a["g_cum"], a["cu_seqlens"])
    return max(rel_l2(x, y) for x, y in zip(got, want))


def check_wy_bwd(label, flags):
    """wy_bwd_ab == wy_bwd: dk, dv, dbeta, dg."""
    a = inputs(label, flags)
    got = ref.wy_bwd_ab(a["k"], a["v"], a["beta"], a["Ab"], a["gated"], a["g_cum"], a["dw"], a["du"],
                        a["cu_seqlens"])
    want = ref.wy_bwd(a["k"], a["v"], a["beta"], a["Ai"], a["g_cum"], a["dw"], a["du"], a["cu_seqlens"])
    return max(rel_l2(x, y) for x, y in zip(got, want))


def check_closed_forms(label, flags, m_t_term=True):
    """Per chunk, from T_b, M and E alone: beta_i dA_ij = -(T_b^T E T_b^T)_ij (strictly lower)
    and dbeta_i = [E G^T]_ii - [M^T T_b^T E G^T]_ii with G = I - M T_b, against wy_bwd's dA
    (-Ai^T dAi Ai^T) and dbeta. ``m_t_term``: False drops the M^T term (the broken variant)."""
    a = inputs(label, flags)
    k, v, cu = a["k"], a["v"], a["cu_seqlens"]
    ch = ref.Chunking(*k.shape[:2], cu, ref.CHUNK_SIZE, k.device)
    hv = v.shape[2]
    kc = ref._heads_first(ch.pad(ref.expand_heads(k, hv)))
    vc, dwc, duc = (ref._heads_first(ch.pad(x)) for x in (v, a["dw"], a["du"]))
    gc = ref._heads_first(ch.pad_g_cum(a["g_cum"]))
    bc = ref._heads_first(ch.pad(a["beta"]))
    ai = ref._heads_first(ch.pad(a["Ai"]))
    tb = ref._gated_t(ch, a["Ab"], a["gated"], gc)
    gamma, strict = ref._decay_matrix(gc, -1)
    m = torch.where(strict, kc @ kc.mT * gamma, 0)
    big_e = dwc @ (torch.exp(gc)[..., None] * kc).mT + duc @ vc.mT
    eye = torch.eye(ref.CHUNK_SIZE, dtype=F64)
    G = eye - m @ tb
    # wy_bwd's: dAi = E diag(beta), dA = -StrictLower(Ai^T dAi Ai^T); its dbeta
    da = -torch.where(strict, ai.mT @ (big_e * bc[..., None, :]) @ ai.mT, 0)
    want_dbeta = ref._heads_first(ch.pad(ref.wy_bwd(k, v, a["beta"], a["Ai"], a["g_cum"], a["dw"], a["du"],
                                                    cu)[2]))
    beta_da = -torch.where(strict, tb.mT @ big_e @ tb.mT, 0)
    egt = big_e @ G.mT
    dbeta = torch.diagonal(egt, dim1=-2, dim2=-1)
    if m_t_term:
        dbeta = dbeta - torch.diagonal(m.mT @ tb.mT @ egt, dim1=-2, dim2=-1)
    return max(rel_l2(beta_da, bc[..., None] * da), rel_l2(dbeta, want_dbeta))


CHECKS = [check_w_u, check_wy_bwd, check_closed_forms]


@pytest.mark.parametrize("label, flags", CASES, ids=[f"{p} {f}" for p, f in CASES])
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_from_solve_equals_from_ai(check, label, flags):
    assert check(label, flags) < TOL


def test_cases_have_beta_zero_and_both_branches():
    """Every case has beta = 0 tokens; the policy flags chunks of the unnormalized keys only, so
    the random and all cases are where the other problems take the gated branch."""
    for label, flags in CASES:
        a = inputs(label, flags)
        assert (a["beta"] == 0).any()
        flagged = int(a["gated"].sum())
        assert (flagged > 0) == (flags != "policy" or label == "unnormalized_keys"), (label, flags)


def test_dividing_by_beta_is_not_finite():
    """Why wy_bwd_ab never forms Ai = T_b diag(1 / beta): at a beta = 0 token that is 0 / 0."""
    a = inputs("varlen", "policy")
    ch = ref.Chunking(*a["k"].shape[:2], a["cu_seqlens"], ref.CHUNK_SIZE, a["k"].device)
    tb = ref._gated_t(ch, a["Ab"], a["gated"], ref._heads_first(ch.pad_g_cum(a["g_cum"])))
    assert not torch.isfinite(tb / ref._heads_first(ch.pad(a["beta"]))[..., None, :]).all()


BROKEN = {  # name: (function, old, new, the checks it fails)
    "Ai taken as I (the T_b M term dropped)": ("wy_bwd_ab", "ai = eye - tb @ m", "ai = eye", [check_wy_bwd]),
    "E T_b^T without beta (E Ai^T)": ("wy_bwd_ab", "@ tb.transpose(-1, -2), 0)", "@ ai.transpose(-1, -2), 0)",
                                      [check_wy_bwd]),
    "dbeta without the solve's term": ("wy_bwd_ab", "(vc * dvb).sum(-1) + dam.sum(-1)", "(vc * dvb).sum(-1)",
                                       [check_wy_bwd]),
    "gated flags ignored": ("_gated_t", "torch.where(flag, abc, torch.where(causal, gamma, 0) * abc)",
                            "torch.where(causal, gamma, 0) * abc", [check_w_u, check_wy_bwd, check_closed_forms]),
    "w: the decay of the wrong token": ("chunk_w_u_ab", "tb @ (torch.exp(gc)[..., None] * kc)",
                                        "torch.exp(gc)[..., None] * (tb @ kc)", [check_w_u]),
}
BROKEN_CASES = [(name, check) for name, (*_, checks) in BROKEN.items() for check in checks]


@pytest.mark.parametrize("name, check", BROKEN_CASES, ids=[f"{n}-{c.__name__}" for n, c in BROKEN_CASES])
def test_check_fails_on_broken_variant(monkeypatch, name, check):
    attr, old, new, _ = BROKEN[name]
    monkeypatch.setattr(ref, attr, mutant(getattr(ref, attr), old, new))
    assert check("varlen", "random") > 1e-3


def test_closed_form_check_fails_without_the_m_t_term():
    """The dbeta closed form needs its second term: dropped, the check fails."""
    assert check_closed_forms("varlen", "random", m_t_term=False) > 1e-3


def test_stage_contract():
    check_segmented_stage_contract(S05)


# ---- on the GPU -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """The stage's kernels, split and not, for every public head layout, compiled on threads first."""
    run_on_threads([functools.partial(S05.run, **gpu_inputs(Problem(H, HV, (700, 70))), cp=cp)
                    for H, HV in PUBLIC_HEADS for cp in (2, False)])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("cp", [True, 2, False], ids=["cp_rule", "cp_2", "cp_off"])
def test_stage_matches_reference(problem, cp, compiled):
    check_op("gdn_bwd", functools.partial(S05.run, cp=cp), gpu_inputs(problem))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "h0=None"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "dht=None"])
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_without_h0_or_dht(initial_state, with_dht, cp, compiled):
    x = gpu_inputs(Problem(4, 16, (1, 200, 777, 64, 130), initial_state=initial_state), seed=6)
    if not with_dht:
        x["dht"] = None
    check_op("gdn_bwd", functools.partial(S05.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_beta_zero_tokens(cp, compiled):
    """Every fifth token's beta and a run of one head's are 0: T_b's columns there are 0, and the
    wy_bwd kernel, which never divides by beta, stays finite and right."""
    inputs = Problem(4, 16, (1, 200, 777, 64, 130)).inputs(device="cuda", seed=8)
    inputs["beta"][:, ::5] = 0
    inputs["beta"][:, 300:400, 3] = 0
    x = op_inputs("gdn_bwd", inputs)
    check_op("gdn_bwd", functools.partial(S05.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_flagged_chunks(cp, compiled):
    """Unnormalized keys (beta ||k||^2 = 9 on odd heads): the solve flags those chunks and stores
    the gated inverse, which the wu and wy_bwd kernels read as T_b without Gamma."""
    x = op_inputs("gdn_bwd", adversarial_inputs("unnormalized_keys", H=2, HV=8, lengths=(1000, 1, 300)))
    check_op("gdn_bwd", functools.partial(S05.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [4, False], ids=["cp_4", "cp_off"])
def test_bitwise_deterministic(cp, compiled):
    x = gpu_inputs(Problem(4, 16, (3000, 1, 700, 2500)), seed=2)
    first = S05.run(**x, cp=cp)
    for _ in range(3):
        again = S05.run(**x, cp=cp)
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
    split = S05.S03.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), x["q"].device, cp)
    assert (split is not None) == (cp is not False)
    check_graph_replay(S05, x, cp)
