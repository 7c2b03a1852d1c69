"""The references agree with each other in float64, sub-step by sub-step, in value and in gradient."""

import pytest
import torch

from flashqla import reference as ref
from flashqla.testing import Problem, cast_floats, rel_l2

F64 = torch.float64

# Lengths that are not multiples of 64, varlen with many sequences (two of length 1), GVA,
# with and without initial state; every Problem has g = 0 heads and strong-decay heads.
PROBLEMS = [
    Problem(2, 4, (150,), K=16, V=32),
    Problem(1, 3, (1, 63, 64, 65, 200, 1, 7), K=32, V=16),
    Problem(2, 6, (100, 100), varlen=False, K=16, V=16, initial_state=False),
    Problem(4, 8, (129, 30), K=8, V=8),
]


def inputs64(problem, seed=0, beta_one=True):
    """float64 inputs; with beta_one, every 5th token has beta exactly 1 (beta in (0, 1])."""
    x = cast_floats(problem.inputs(seed=seed), F64)
    if beta_one:
        x["beta"] = x["beta"].clone()
        x["beta"][:, ::5] = 1.0
    return x


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.label)
def test_chunked_equals_naive_in_float64(problem):
    x = inputs64(problem)
    o_naive, s_naive = ref.naive_recurrent_gated_delta_rule(**x)
    o_chunk, s_chunk = ref.chunk_gated_delta_rule_ref(**x)
    assert rel_l2(o_chunk, o_naive) < 1e-10
    assert rel_l2(s_chunk, s_naive) < 1e-10


def test_strong_decay_and_no_decay_heads_are_exercised():
    g = inputs64(PROBLEMS[0])["g"]
    assert (g[..., 0] == 0).all()                     # head 0: g = 0
    assert g[..., 1].mean() < -1.5                     # head 1: strong decay
    assert -0.5 < g[..., 2].mean() < -0.01             # ordinary decay


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.label)
def test_chunk_sizes_agree(problem):
    x = inputs64(problem)
    o64, s64 = ref.chunk_gated_delta_rule_ref(**x, chunk_size=64)
    for c in (16, 32, 128):
        o, s = ref.chunk_gated_delta_rule_ref(**x, chunk_size=c)
        assert rel_l2(o, o64) < 1e-10 and rel_l2(s, s64) < 1e-10, c


def _naive_prefix_states(x, t_end):
    """The naive state after the first t_end tokens of every batch row (dense problems only)."""
    cut = {n: (v[:, :t_end] if n in "q k v g beta".split() else v) for n, v in x.items()}
    return ref.naive_recurrent_gated_delta_rule(**cut)[1]


def test_sub_steps_match_their_definitions():
    """Each sub-step against an independent definition built from the naive recurrence."""
    problem = Problem(2, 4, (150, 150), varlen=False, K=16, V=16)
    x = inputs64(problem)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    C, HV = 64, v.shape[2]
    kk = ref.expand_heads(k, HV)

    g_cum = ref.chunk_local_cumsum(g)
    for c0 in range(0, 150, C):
        assert torch.allclose(g_cum[:, c0:c0 + C], g[:, c0:c0 + C].cumsum(1))

    A = ref.chunk_kkt(k, g_cum, beta)
    t, j = 70, 66  # both in chunk 1 (tokens 64..127), rows 6 and 2
    want = beta[:, t] * (kk[:, t] * kk[:, j]).sum(-1) * torch.exp(g_cum[:, t] - g_cum[:, j])
    assert torch.allclose(A[:, t, :, j - 64], want)
    assert (A[:, t, :, t - 64:] == 0).all()           # strictly lower

    Ai = ref.kkt_solve(A)
    a = A[:, 64:128].transpose(1, 2)                  # [B, HV, C, C] chunk 1
    ai = Ai[:, 64:128].transpose(1, 2)
    eye = torch.eye(C, dtype=F64)
    assert torch.allclose((eye + a) @ ai, eye.expand_as(a), atol=1e-12)

    w, u = ref.chunk_w_u(k, v, beta, Ai, g_cum)
    h, v_new, final = ref.chunk_h(k, w, u, g_cum, h0, True)
    assert h.shape == (2, 3, HV, 16, 16)
    assert torch.allclose(h[:, 0], h0)
    for c in (1, 2):                                  # state entering chunk c
        assert rel_l2(h[:, c], _naive_prefix_states(x, c * C)) < 1e-12
    for t in (0, 5, 64, 100, 149):                    # v_new_t = e_t = beta_t (v_t - (exp(g_t) h)^T k_t)
        h_prev = h0 if t == 0 else _naive_prefix_states(x, t)
        pred = torch.einsum("bhkv,bhk->bhv", torch.exp(g[:, t])[..., None, None] * h_prev, kk[:, t])
        e = beta[:, t, :, None] * (v[:, t] - pred)
        assert rel_l2(v_new[:, t], e) < 1e-12, t
    assert rel_l2(final, _naive_prefix_states(x, 150)) < 1e-12

    o = ref.chunk_o(q, k, v_new, h, g_cum)
    assert rel_l2(o, ref.naive_recurrent_gated_delta_rule(**x)[0]) < 1e-12


def test_varlen_layout_of_h():
    """Varlen h is [1, sum of ceil(T_n / 64), HV, K, V]; a sequence's first chunk holds its h0."""
    problem = Problem(1, 2, (1, 130, 64), K=8, V=8)
    x = inputs64(problem)
    g_cum = ref.chunk_local_cumsum(x["g"], x["cu_seqlens"])
    A = ref.chunk_kkt(x["k"], g_cum, x["beta"], x["cu_seqlens"])
    w, u = ref.chunk_w_u(x["k"], x["v"], x["beta"], ref.kkt_solve(A, x["cu_seqlens"]), g_cum,
                         x["cu_seqlens"])
    h, _, _ = ref.chunk_h(x["k"], w, u, g_cum, x["initial_state"], False, x["cu_seqlens"])
    assert h.shape == (1, 1 + 3 + 1, 2, 8, 8)
    for n, first_chunk in enumerate((0, 1, 4)):
        assert torch.equal(h[0, first_chunk], x["initial_state"][n])


@pytest.mark.parametrize("problem", [PROBLEMS[1], PROBLEMS[3]], ids=lambda p: p.label)
def test_chunked_gradients_equal_naive_gradients(problem):
    x = inputs64(problem)
    names = ["q", "k", "v", "g", "beta", "initial_state"]

    def grads(fn):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        o, s = fn(**{**x, **leaves})
        wo = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
        ws = torch.randn(s.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
        ((o * wo).sum() + (s * ws).sum()).backward()
        return {n: leaves[n].grad for n in names}

    g_naive = grads(ref.naive_recurrent_gated_delta_rule)
    g_chunk = grads(ref.chunk_gated_delta_rule_ref)
    for n in names:
        assert rel_l2(g_chunk[n], g_naive[n]) < 1e-10, n


def test_empty_sequences_and_batch_of_one_token():
    x = inputs64(Problem(1, 2, (0, 1, 0), K=8, V=8))
    o_naive, s_naive = ref.naive_recurrent_gated_delta_rule(**x)
    o, s = ref.chunk_gated_delta_rule_ref(**x)
    assert o.shape == (1, 1, 2, 8) and rel_l2(o, o_naive) < 1e-12
    assert torch.equal(s[0], x["initial_state"][0]) and torch.equal(s[2], x["initial_state"][2])
    assert rel_l2(s, s_naive) < 1e-12
