"""The reformulation of gdn_fwd.s04: its identities in float64 (CPU), and its precision policy on
adversarial inputs on the GPU (s04; s09, which forms w and u on chip from the same Ab; s11, whose
Ab comes from gate_free_solve.s02's blocked inverse).

    Gamma * A_r = Ai                      the gate-free inverse carries the gate elementwise
    (Gamma * Ab) (V - D K h) = u - w h    so w and u need not exist
    |Ab_ij| <= 2 sqrt(beta_i beta_j)      while beta ||k||^2 <= 2 on every row of the chunk

and past that bound the gate-free inverse overflows float32 where the gated one does not, so the
kernels must detect such chunks (gate_free_solve.s01 flags them and solves them with the gate).
"""

import itertools
import math
import zlib

import pytest
import torch

from flashqla import reference as R
from flashqla import autocp, stages
from flashqla.testing import (ADVERSARIAL, Problem, adversarial_inputs, cast_floats, check_op,
                              near_duplicate_keys, rel_l2)
from flashqla.varlen import chunk_table

C = R.CHUNK_SIZE


def _chunked(x, ch):
    """[B, T, HV, *rest] -> [N, NT, HV, C, *rest]."""
    return R._heads_first(ch.pad(x))


def _gamma(g_cum, ch):
    """Gamma [N, NT, HV, C, C], exp(g_i - g_j) on j <= i and 0 above the diagonal."""
    gam, low = R._decay_matrix(R._heads_first(ch.pad_g_cum(g_cum)), 0)
    return torch.where(low, gam, torch.zeros_like(gam))


def _f64(problem):
    return cast_floats(problem.inputs(), torch.float64)


def test_gamma_times_gate_free_inverse_is_the_gated_inverse():
    x = _f64(Problem(2, 8, (70, 130, 1)))
    k, beta, cu = x["k"], x["beta"], x["cu_seqlens"]
    g_cum = R.chunk_local_cumsum(x["g"], cu)
    ai = R.kkt_solve(R.chunk_kkt(k, g_cum, beta, cu), cu)
    ch = R._chunking(k, cu, C)
    want = _chunked(ai, ch) * _chunked(beta, ch)[..., None, :]                  # Ai diag(beta)
    got = _gamma(g_cum, ch) * _chunked(R.gate_free_solve(k, beta, cu), ch)     # Gamma * Ab
    assert (got - want).abs().max() < 1e-12


def test_v_new_without_w_and_u():
    x = _f64(Problem(4, 16, (200, 64, 33)))
    q, k, v, beta, cu = x["q"], x["k"], x["v"], x["beta"], x["cu_seqlens"]
    g_cum = R.chunk_local_cumsum(x["g"], cu)
    w, u = R.chunk_fwd_intra(k, v, g_cum, beta, cu)
    h, v_new, _ = R.chunk_h(k, w, u, g_cum, x["initial_state"], False, cu)
    ch = R._chunking(q, cu, C)
    kc = _chunked(R.expand_heads(k, v.shape[2]), ch)
    gc = R._heads_first(ch.pad_g_cum(g_cum))
    wy = _gamma(g_cum, ch) * _chunked(R.gate_free_solve(k, beta, cu), ch)
    vt = wy @ (_chunked(v, ch) - torch.exp(gc)[..., None] * (kc @ ch.unpack_chunks(h)))
    assert rel_l2(vt, _chunked(v_new, ch)) < 1e-12


def test_bound_of_the_gate_free_inverse():
    gen = torch.Generator().manual_seed(0)
    T, H, HV = 256, 2, 4
    k = near_duplicate_keys(gen, 1, T, H, 128)
    beta = 1 - 1e-3 * torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    for scale2 in (1.0, 2.0):                                        # beta ||k||^2 <= 2: bounded
        ab = _chunked(R.gate_free_solve(math.sqrt(scale2) * k, beta), R._chunking(k, None, C))
        bc = _chunked(beta, R._chunking(k, None, C))
        assert (ab.abs() / (2 * (bc[..., :, None] * bc[..., None, :]).sqrt())).max() <= 1
    # ||k||^2 = 9: the gate-free inverse grows by up to 8 a token and overflows float32, while
    # under a decay of exp(-3) a token the gated inverse (what the recurrence needs) stays small
    k9, b32 = (3 * k).float(), beta.float()
    g_cum = R.chunk_local_cumsum(torch.full_like(b32, -3.0))
    assert not torch.isfinite(R.gate_free_solve(k9, b32)).all()
    gated = R.kkt_solve(R.chunk_kkt(k9, g_cum, b32))
    assert torch.isfinite(gated).all() and gated.abs().max() < 1e3


# ---- the GPU: gdn_fwd.s04 on adversarial inputs ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_s04_on_adversarial_inputs(kind):
    inputs = adversarial_inputs(kind, seed=zlib.crc32(kind.encode()))
    check_op("gdn_fwd", stages.load("gdn_fwd", 4).run, inputs)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("solve_stage", [1, 2, 3, 4, 5, 6, 7, 8], ids=["s01", "s02", "s03", "s04", "s05", "s06", "s07", "s08"])
def test_gate_free_solve_flags_exactly_the_chunks_past_the_bound(solve_stage):
    x = adversarial_inputs("unnormalized_keys")
    k, beta, cu = x["k"], x["beta"], x["cu_seqlens"]
    g_cum = stages.load("chunk_local_cumsum", 1).run(x["g"], cu)
    _, gated = stages.load("gate_free_solve", solve_stage).solve(k, beta, g_cum, cu)
    bounds, _ = chunk_table(cu, 1, k.shape[1], C, k.device)
    growth = beta * R.expand_heads(k.float().pow(2).sum(-1, keepdim=True), beta.shape[2])[..., 0]
    want = torch.stack([(growth[0, s:e] > 2).any(0) for s, e in bounds.tolist()]).int()
    assert torch.equal(gated, want)
    assert 0 < int(gated.sum()) < gated.numel()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("solve_stage", [4, 5, 6, 7], ids=["s04", "s05", "s06", "s07"])
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_solve_stages_give_s02s_bits(solve_stage, kind):
    """gate_free_solve.s04 (one value head a CTA), s05 (launch bounds), s06 (block columns spread
    over the warps) and s07 (flagged heads' A rebuilt in shared memory again) change where and by
    whom s02's operations run, not the operations: Ab and the flags are s02's, bit for bit."""
    x = adversarial_inputs(kind)
    k, beta, cu = x["k"], x["beta"], x["cu_seqlens"]
    g_cum = stages.load("chunk_local_cumsum", 1).run(x["g"], cu)
    want = stages.load("gate_free_solve", 2).solve(k, beta, g_cum, cu)
    got = stages.load("gate_free_solve", solve_stage).solve(k, beta, g_cum, cu)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("solve_stage, forward_stage", [(1, 8), (2, 11), (3, None), (4, None), (5, None), (6, None), (7, None), (8, None)],
                         ids=["s01", "s02", "s03", "s04", "s05", "s06", "s07", "s08"])
def test_flagged_partial_chunk_with_strong_decay(solve_stage, forward_stage):
    """Flagged (gated) heads whose chunks end early and decay strongly: past a sequence's end g_cum
    is padded with 0, so exp2(g_i - g_j) on those rows overflows (36 and 37 rows at -3 to -4 a
    token: exponents up to 200). The solve must keep those rows out of the real ones:
    gate_free_solve.s02's first build did not (inf through the diagonal block's product), which the
    public shapes and ADVERSARIAL inputs, whose partial chunks are short, never reached. The solve's
    Ab stays finite, and the forward that reads it (s08 on s01, s11 on s02; none yet reads s03, s04 or
    s05) passes the gdn_fwd check."""
    x = adversarial_inputs("unnormalized_keys", lengths=(100, 37))
    k, beta, cu = x["k"], x["beta"], x["cu_seqlens"]
    g_cum = stages.load("chunk_local_cumsum", 1).run(x["g"], cu)
    ab, gated = stages.load("gate_free_solve", solve_stage).solve(k, beta, g_cum, cu)
    bounds, _ = chunk_table(cu, 1, k.shape[1], C, k.device)
    real = bounds[:, 1] > bounds[:, 0]                     # the table's spare rows are empty chunks
    odd = torch.arange(beta.shape[2], device=beta.device) % 2 == 1
    assert gated[real][:, odd].all() and not gated[:, ~odd].any() and not gated[~real].any()
    assert torch.isfinite(ab.float()).all()
    if forward_stage is not None:
        check_op("gdn_fwd", stages.load("gdn_fwd", forward_stage).run, x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("kind", ADVERSARIAL)
@pytest.mark.parametrize("number", [9, 11, 45], ids=["s09", "s11", "s45"])
def test_stage_on_adversarial_inputs(number, kind):
    """gdn_fwd.s09 forms w = (Gamma * Ab) diag(exp g) K on chip, for flagged chunks from Ab as
    stored (its columns scaled): the unnormalized keys are where that path runs. gdn_fwd.s11 reads
    gate_free_solve.s02's blocked inverse, whose flagged heads solve K K^T * Gamma. gdn_fwd.s45's
    narrow kernel forms w = (WY D) K the same way, a chunk ahead of its chain."""
    inputs = adversarial_inputs(kind, seed=zlib.crc32(kind.encode()))
    check_op("gdn_fwd", stages.load("gdn_fwd", number).run, inputs)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("heads", [(4, 16), (8, 24)], ids=["two-heads-a-cta", "one-head-a-cta"])
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_six_ctas_an_sm_give_s08s_bits(heads, kind):
    """gate_free_solve.s12 compiles s08's program with other launch bounds (six CTAs an SM: 80
    registers a thread and a few spills): at s11's grouping, Ab and the flags are s08's bit for bit,
    flagged chunks included."""
    x = adversarial_inputs(kind, *heads)
    k, beta, cu = x["k"], x["beta"], x["cu_seqlens"]
    g_cum = stages.load("chunk_local_cumsum", 1).run(x["g"], cu)
    s12 = stages.load("gate_free_solve", 12)
    rows = chunk_table(cu, 1, k.shape[1], C, k.device)[0].shape[0]
    R = s12.BY_FORWARD.heads_per_cta(*heads, rows, autocp.num_sms(k.device))
    assert R <= s12.BY_FORWARD.BY_HEADS.TENSOR_CORE_MAX_HEADS  # s08's kernel
    want = stages.load("gate_free_solve", 8).solve(k, beta, g_cum, cu, heads_per_cta=R)
    got = s12.solve(k, beta, g_cum, cu, ctas=s12.ONE_WAVE_CTAS_PER_SM)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert kind != "unnormalized_keys" or 0 < int(got[1].sum()) < got[1].numel()


def test_six_ctas_an_sm_only_where_they_make_one_wave():
    """gate_free_solve.s12's rule on the benchmark's 40 problems (132 SMs, the chunk table's rows
    as the forward counts them): six CTAs an SM only on (8, 24) 1x2048, where s08's 792 CTAs are
    1.5 waves at four an SM and one at six."""
    from flashqla.bench import PROBLEMS
    from flashqla.varlen import num_chunk_rows

    s12 = stages.load("gate_free_solve", 12)
    six = set()
    for p in PROBLEMS:
        T = sum(p.lengths) if p.varlen else p.lengths[0]
        cu = torch.tensor([0, *itertools.accumulate(p.lengths)]) if p.varlen else None
        rows = num_chunk_rows(cu, 1 if p.varlen else len(p.lengths), T, C)
        if s12.ctas_per_sm(p.H, p.HV, rows, 132) == s12.ONE_WAVE_CTAS_PER_SM:
            six.add(p.label)
    assert six == {"(8, 24) 1x2048"}


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("heads", [(4, 16), (8, 24)], ids=["two-heads-a-cta", "one-head-a-cta"])
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_cumsum_in_the_solve_gives_s03s_and_s12s_bits(heads, kind):
    """gate_free_solve.s13 makes the chunk table and g_cum in s08's kernel before solving: the table,
    first_chunk and g_cum are chunk_local_cumsum.s03's and Ab and the flags gate_free_solve.s12's,
    bit for bit, flagged chunks (whose gate reads the in-kernel g_cum) included."""
    x = adversarial_inputs(kind, *heads)
    k, beta, g, cu = x["k"], x["beta"], x["g"], x["cu_seqlens"]
    g_cum, table, first_chunk = stages.load("chunk_local_cumsum", 3).cumsum_and_table(g, cu)
    ab, gated = stages.load("gate_free_solve", 12).solve(k, beta, g_cum.view(g.shape), cu)
    got = stages.load("gate_free_solve", 13).cumsum_and_solve(k, beta, g, cu)
    for want, have in zip((g_cum, table, first_chunk, ab, gated), got):
        assert torch.equal(have, want)
    assert kind != "unnormalized_keys" or 0 < int(gated.sum()) < gated.numel()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("heads", [(4, 16), (8, 24)], ids=["two-heads-a-cta", "one-head-a-cta"])
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_more_ctas_an_sm_give_s13s_bits(heads, kind):
    """gate_free_solve.s14 compiles s13's program at five (two heads a CTA) or six (one) CTAs an SM,
    with a few register spills: g_cum, the table, first_chunk, Ab and the flags are s13's bit for
    bit, flagged chunks included."""
    x = adversarial_inputs(kind, *heads)
    k, beta, g, cu = x["k"], x["beta"], x["g"], x["cu_seqlens"]
    s14 = stages.load("gate_free_solve", 14)
    rows = chunk_table(cu, 1, k.shape[1], C, k.device)[0].shape[0]
    R = s14.BY_GRID.BY_FORWARD.heads_per_cta(*heads, rows, autocp.num_sms(k.device))
    assert s14.ctas_per_sm(R) == (6 if heads == (8, 24) else 5)
    want = stages.load("gate_free_solve", 13).cumsum_and_solve(k, beta, g, cu)
    got = s14.cumsum_and_solve(k, beta, g, cu)
    for have, expected in zip(got, want):
        assert torch.equal(have, expected)
    assert kind != "unnormalized_keys" or 0 < int(got[4].sum()) < got[4].numel()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("number, before, heads", [(15, 6, (4, 16)), (16, 14, (4, 16)), (16, 14, (8, 24))],
                         ids=["s15", "s16-two-heads-a-cta", "s16-one-head-a-cta"])
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_levels_on_mma_pass_the_check_and_keep_the_flagged_path(number, before, heads, kind):
    """gate_free_solve.s15 (phase B's block levels on mma.sync, tf32; four value heads a CTA here) and
    s16 (s14's kernel with s15's solve; one or two) on adversarial inputs: Ab within the solve's
    derived bound of float64 (gate-free: g = 0); with the gate, the flags and the flagged heads' rows
    are those of the stage they edit (s06, s14) bit for bit (their path is unchanged), and the others
    within 1e-2 of its. WY (``store_wy``) is checked through gdn_fwd.s42 (test_autocp)."""
    from flashqla.testing import op_inputs

    new, old = stages.load("gate_free_solve", number), stages.load("gate_free_solve", before)
    x = adversarial_inputs(kind, *heads)
    check_op("gate_free_solve", new.run, op_inputs("gate_free_solve", x))
    k, beta, g, cu = x["k"], x["beta"], x["g"], x["cu_seqlens"]
    if number == 15:
        g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu)
        (want, want_gated), (got, got_gated) = (s.solve(k, beta, g_cum, cu) for s in (old, new))
    else:
        (*_, want, want_gated), (*_, got, got_gated) = (s.cumsum_and_solve(k, beta, g, cu) for s in (old, new))
    assert torch.equal(got_gated, want_gated)
    bounds, _ = chunk_table(cu, 1, k.shape[1], C, k.device)
    flagged = torch.zeros(k.shape[1], beta.shape[2], dtype=torch.bool, device=k.device)
    for row, (s, e) in enumerate(bounds.tolist()):
        flagged[s:e] = got_gated[row].bool()
    assert torch.equal(got[0][flagged], want[0][flagged])
    if kind == "unnormalized_keys":
        assert flagged.any() and not flagged.all()
    assert rel_l2(got[0][~flagged].float(), want[0][~flagged].float()) < 1e-2
