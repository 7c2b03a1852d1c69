"""Backward AutoCP (gdn_bwd.s03): its planning on the CPU against the float64 references, the stage
on the GPU.

CPU: ``flashqla.autocp.backward_windows`` (the spec of s03's windows kernel) against the brute-force
walk of tests/test_autocp.py, with the bound's conditions broken on some tokens; the chain algebra
(the backward slots, the windows, the reverse chain as the forward's chain kernel runs it, with
dZ and M^T walked per window in float64) against ``flashqla.reference.segment_state_grads``, at
1e-12; s03's rule; the stage's contract and its errors. Each check is shown to fail on a one-line
mutant.
GPU (gpu, hopper): the stage against float64 (``check_op``) on the public shape set split
(``cp=True``, ``cp=2``) and unsplit, CP on against CP off per value head, its windows kernel against
the spec, its segment gradients against float64, determinism, CUDA-graph capture.
"""

import functools
import inspect
import math
import textwrap
import zlib

import pytest
import torch

from flashqla import autocp
from flashqla import reference as ref
from flashqla.stages import load
from flashqla.testing import (PUBLIC_HEADS, ROUNDING_FLOOR, TOLERANCE_FACTOR, Problem, cast_floats,
                              check_op, op_inputs, rel_l2, run_on_threads)
from flashqla.varlen import chunk_table
from test_autocp import GPU_CASES, brute_force_bwd_windows, bwd_inputs, cu_of, head_errors

F64 = torch.float64
CPU = torch.device("cpu")
C = autocp.CHUNK_SIZE
S03 = load("gdn_bwd", 3)


@pytest.fixture
def one_thread():
    """Many tiny float64 ops: a second intra-op thread only adds synchronization on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the windows ------------------------------------------------------------------------------

def plan_of(problem, L):
    x = problem.inputs()
    B, T = x["q"].shape[:2]
    return x, autocp.plan(x["cu_seqlens"] if problem.varlen else None, B, T, problem.HV, 132, 2, CPU, force=L)


def check_windows(lengths, L, threshold, has_dht=True, bad=(), fn=None):
    """The number of (backward slot, head) entries where ``backward_windows`` (or ``fn``) differs
    from the brute-force walk: for segment j >= 1 of sequence n, backward slot (J_n - j) N + n
    starts at the segment's first token and ends at its window's end (the whole segment where the
    brute force finds no window, or where ``bad`` (token, head) pairs break the bound's
    conditions: g > 0 there), exact where the walk takes the whole segment, unless that is the
    sequence's last segment and there is no dht; every other slot empty; and the
    dht rows: backward slot r N + n holds segment J_n - 1 - r's row (-1 past the first)."""
    problem = Problem(2, 8, lengths, K=16, V=16)
    x, p = plan_of(problem, L)
    g = x["g"].clone()
    for t, h in bad:
        g[0, t, h] = 0.5
    B, T, HV = g.shape
    g_cum = ref.chunk_local_cumsum(g, x["cu_seqlens"]).view(B * T, HV)
    viol = autocp.bound_violations(x["k"], g, x["beta"])
    start, end, exact, row = (fn or autocp.backward_windows)(p, g_cum, viol, threshold, has_dht)
    want = brute_force_bwd_windows(g_cum, lengths, L, threshold)
    N, J = len(lengths), p.max_segments
    cu = cu_of(lengths).tolist()
    first_row = p.row_of_slot[:N].tolist()
    wrong = 0
    for n in range(N):
        count = max(1, math.ceil(lengths[n] / (C * L)))
        for r in range(J):
            j = count - r
            if r < count:
                wrong += int(row[r * N + n] != first_row[n] + count - 1 - r)
            else:
                wrong += int(row[r * N + n] != -1)
            for h in range(HV):
                got = (int(start[r * N + n, h]), int(end[r * N + n, h]), bool(exact[r * N + n, h]))
                if r >= 1 and j >= 1:
                    s = cu[n] + j * C * L
                    e = min(s + C * L, cu[n + 1])
                    chunks, whole = want[(n, j, h)]
                    whole = whole or any(s <= t < e and hh == h for t, hh in bad)
                    w_end = e if whole else min(s + C * chunks, e)
                    ex = w_end == e and (e < cu[n + 1] or has_dht)
                    wrong += int(got != (s, w_end, ex))
                else:
                    wrong += int(got[0] != got[1] or got[2])
    return wrong


WINDOW_LENGTHS = [(3000, 1, 700, 2500, 0, 130), (4096,), (640, 640, 1000)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("lengths", WINDOW_LENGTHS, ids=lambda x: "+".join(map(str, x)))
@pytest.mark.parametrize("L", [1, 3, 8])
@pytest.mark.parametrize("threshold", [-10.0, -3.0, -40.0])
@pytest.mark.parametrize("has_dht", [True, False], ids=["dht", "no_dht"])
def test_backward_windows_match_brute_force(lengths, L, threshold, has_dht):
    assert check_windows(lengths, L, threshold, has_dht) == 0


@pytest.mark.parametrize("L", [1, 3])
def test_backward_windows_where_the_bound_fails_walk_whole_segments(L):
    """A token with g > 0 makes its (segment, head) exact, and only that one."""
    bad = [(64 * L * 2 + 5, 1), (64 * L * 3 + 70, 2), (3000 + 1 + 300, 5)]
    assert check_windows(WINDOW_LENGTHS[0], L, -10.0, True, bad) == 0


def test_backward_windows_take_every_path():
    """The cases checked above occur: windows of one chunk (strong decay), of several, whole
    segments (g = 0), windows of a whole (short) segment, and empty slots."""
    lengths, L = (3000, 1, 700, 2500, 0, 130), 3
    x, p = plan_of(Problem(2, 8, lengths, K=16, V=16), L)
    B, T, HV = x["g"].shape
    g_cum = ref.chunk_local_cumsum(x["g"], x["cu_seqlens"]).view(B * T, HV)
    start, end, exact, _ = autocp.backward_windows(p, g_cum, autocp.bound_violations(x["k"], x["g"], x["beta"]))
    chunks = (end - start + C - 1) // C
    kind = torch.arange(HV) % 4
    assert (chunks[:, kind == 1] == 1).any() and (chunks[:, kind == 2] > 1).any()
    assert (exact[:, kind == 0] == 1).any() and (chunks[:, kind == 0] == L).any()
    assert (exact[:, kind != 0] == 1).any()                   # a window of a whole segment
    assert ((end == start) & (exact == 0)).any()


# ---- the chain algebra ------------------------------------------------------------------------

def chain_kernel_in_torch(h0, z, m, exact, row_of_slot, num_rows):
    """What gdn_fwd.s24's chain kernel computes, per (sequence, head): h_0 = h0 written to row
    row_of_slot[n]; for slots s = r N + n, r = 1 .. J - 1: h = z[s] + m[s] h (z[s] alone when
    no slot of the (sequence, head) is exact), written to row_of_slot[s] where that is >= 0."""
    N, HV = h0.shape[:2]
    J = z.shape[0] // N
    out = torch.full((num_rows, *h0.shape[1:]), float("nan"), dtype=h0.dtype)
    for n in range(N):
        for hv in range(HV):
            chained = any(exact[r * N + n, hv] for r in range(1, J))
            h = h0[n, hv]
            out[row_of_slot[n], hv] = h
            for r in range(1, J):
                s = r * N + n
                h = z[s, hv] + m[s, hv] @ h if chained else z[s, hv]
                if row_of_slot[s] >= 0:
                    out[row_of_slot[s], hv] = h
    return out


def walks_in_float64(a, cu, start, end, exact):
    """What s03's dh warm-up kernel computes, in float64 from the reference's per-chunk reverse
    steps (dS = M^T dS' + R_g^T dO, ``reference._padded_cancelled_steps``): per (backward slot,
    head), dZ = the walk from zero over [start, end), and M^T = the product of its chunks' M^T
    where exact (else 0)."""
    mt, b, _ = ref._padded_cancelled_steps(a["q"], a["k"], a["g_cum"], a["Ab"], a["gated"], a["do"], None,
                                           cu, C)
    bounds = cu.tolist()
    N, HV, K, V = b.shape[0], b.shape[2], b.shape[3], b.shape[4]
    dz = torch.zeros(start.shape[0], HV, K, V, dtype=F64)
    m = torch.zeros(start.shape[0], HV, K, K, dtype=F64)
    for i in range(start.shape[0]):
        n = i % N
        for h in range(HV):
            s, e = int(start[i, h]), int(end[i, h])
            if e == s:
                continue
            c0, c1 = (s - bounds[n]) // C, -(-(e - bounds[n]) // C)
            prod = torch.eye(K, dtype=F64)
            for c in reversed(range(c0, c1)):
                dz[i, h] = mt[n, c, h] @ dz[i, h] + b[n, c, h]
                prod = mt[n, c, h] @ prod
            if exact[i, h]:
                m[i, h] = prod
    return dz, m


def check_chain_algebra(problem, L, has_dht=True, windows=None):
    """The gradient leaving every segment row, from ``backward_windows``' windows walked in float64
    and chained over the backward slots as the chain kernel does, against ``segment_state_grads``
    with the brute-force windows: the worst relative L2 error over the rows."""
    x, a = bwd_inputs(problem)
    B, T = x["q"].shape[:2]
    cu = x["cu_seqlens"]
    p = autocp.plan(cu, B, T, problem.HV, 132, 2, CPU, force=L)
    g_cum = a["g_cum"].reshape(B * T, -1)
    viol = autocp.bound_violations(x["k"], x["g"], x["beta"])
    start, end, exact, row = (windows or autocp.backward_windows)(p, g_cum, viol, autocp.THRESHOLD, has_dht)
    dz, m = walks_in_float64(a, cu, start, end, exact)
    dht = a["dht"] if has_dht else torch.zeros_like(a["dht"])
    got = chain_kernel_in_torch(dht, dz, m, exact, row, p.bounds.shape[0] - 1)
    N, J = len(problem.lengths), p.max_segments
    w = torch.zeros(N, J, problem.HV, dtype=torch.long)
    for (n, j, h), (chunks, whole) in brute_force_bwd_windows(g_cum, problem.lengths, L, autocp.THRESHOLD).items():
        w[n, j, h] = -1 if whole else chunks
    want = ref.segment_state_grads(a["q"], a["k"], a["g_cum"], a["Ab"], a["gated"], a["do"], L,
                                   dht if has_dht else None, cu_seqlens=cu, warmup_chunks=w)[0]
    worst = 0.0
    bounds = p.bounds.tolist()
    for r, slot in enumerate(p.slot_of_segment.tolist()):
        if r < len(bounds) - 1 and (bounds[r] < bounds[r + 1] or r in p.last_segment.tolist()):
            worst = max(worst, rel_l2(got[r], want[slot % N, slot // N]))
    return worst


CHAIN_PROBLEMS = [Problem(2, 4, (1000, 300, 1), K=16, V=16), Problem(1, 4, (777,), K=32, V=32),
                  Problem(2, 8, (2500, 1300, 700), K=16, V=16)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("problem", CHAIN_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("L", [1, 2, 4])
@pytest.mark.parametrize("has_dht", [True, False], ids=["dht", "no_dht"])
def test_chain_over_backward_slots_is_segment_state_grads(problem, L, has_dht):
    assert check_chain_algebra(problem, L, has_dht) < 1e-12


def windows_mutant(old: str, new: str):
    """autocp.backward_windows with the source text ``old`` replaced by ``new``: one deliberate bug."""
    src = textwrap.dedent(inspect.getsource(autocp.backward_windows))
    assert src.count(old) == 1, old
    namespace = {}
    exec(compile(src.replace(old, new), "<mutant of backward_windows>", "exec"), vars(autocp), namespace)
    return namespace["backward_windows"]


WINDOWS_BROKEN = {  # name: (old, new)
    "dht rows one segment off": ("first_row + count - 1 - r", "first_row + count - r"),
    "slot r walks the segment before": ("j = count[None] - r", "j = count[None] - r - 1"),
    "window one chunk short": ("short + 1), e)", "short), e)"),
    "a window of the whole segment not chained": ("(win_end == e)", "whole"),
    "last segment chained without dht": ("((e < seq_end) | has_dht)", "(e <= seq_end)"),
    "chunk decay read at the chunk's first token": ("CHUNK_SIZE * (i + 1), e) - 1)", "CHUNK_SIZE * i, e - 1))"),
    "the bound's conditions ignored": ("((short == w_max) | bad)", "(short == w_max)"),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", WINDOWS_BROKEN)
def test_checks_fail_on_broken_windows(name):
    """Each mutant fails the brute-force check, or the chain algebra, or both."""
    broken = windows_mutant(*WINDOWS_BROKEN[name])
    bad = [(64 * 3 * 2 + 5, 1), (64 * 3 * 3 + 70, 2)]
    wrong = sum(check_windows(WINDOW_LENGTHS[0], 3, -10.0, has_dht, bad, fn=broken) for has_dht in (True, False))
    chain = max(check_chain_algebra(CHAIN_PROBLEMS[2], 2, has_dht, windows=broken) for has_dht in (True, False))
    assert wrong > 0 or chain > 1e-3, (wrong, chain)


def check_walk_over_segment_rows(problem, L, first_rows=lambda p: p.row_of_slot[:p.num_seqs], shift=0):
    """s03's premise, in float64: the walks run over the plan's segment rows as sequences (the
    reference's chunk_h and chunk_bwd_dhu with cu_seqlens = ``Plan.bounds``, every row from its
    exact initial state and final-state gradient) give the whole sequences' h, v_new, dh and dV~
    at the same chunk rows (what chunk_bwd_dqkwg and wy_bwd read), and each sequence's dh0 at
    its first segment row, ``first_rows(p)`` (s03's ``p.row_of_slot[:N]``). ``shift``: rows'
    dht taken that many rows later (a broken chain). Returns the worst relative L2 error."""
    x, a = bwd_inputs(problem)
    B, T = x["q"].shape[:2]
    cu = x["cu_seqlens"]
    p = autocp.plan(cu, B, T, problem.HV, 132, 2, CPU, force=L)
    N, S = len(problem.lengths), p.bounds.shape[0] - 1
    h0 = x["initial_state"]
    hs = ref.segment_states(x["k"], x["v"], x["g"], x["beta"], L, h0, cu)                 # [N, J, ...]
    dhts = ref.segment_state_grads(a["q"], a["k"], a["g_cum"], a["Ab"], a["gated"], a["do"], L, a["dht"],
                                   cu_seqlens=cu)[0]
    slot = p.slot_of_segment.clamp(max=N * hs.shape[1] - 1)          # rows past the real ones: any
    h_rows = hs[slot % N, slot // N]
    dht_rows = dhts[slot % N, slot // N].roll(-shift, 0)
    w, u = ref.chunk_fwd_intra(x["k"], x["v"], a["g_cum"], x["beta"], cu)
    rows = p.bounds.long()
    h, v_new, _ = ref.chunk_h(x["k"], w, u, a["g_cum"], h0, False, cu)
    h_r, v_new_r, _ = ref.chunk_h(x["k"], w, u, a["g_cum"], h_rows, False, rows)
    dv_local = ref.chunk_bwd_dv_local(x["q"], x["k"], a["do"], a["g_cum"], cu_seqlens=cu)
    dh, dh0, dv2 = ref.chunk_bwd_dhu(x["q"], x["k"], w, a["g_cum"], h0, a["dht"], a["do"], dv_local, cu_seqlens=cu)
    dh_r, dh0_r, dv2_r = ref.chunk_bwd_dhu(x["q"], x["k"], w, a["g_cum"], h_rows, dht_rows, a["do"], dv_local,
                                           cu_seqlens=rows)
    assert dh0_r.shape[0] == S
    return max(rel_l2(h_r, h), rel_l2(v_new_r, v_new), rel_l2(dh_r, dh), rel_l2(dv2_r, dv2),
               rel_l2(dh0_r[first_rows(p).long()], dh0))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("problem", CHAIN_PROBLEMS[::2], ids=lambda p: p.label)
@pytest.mark.parametrize("L", [1, 3])
def test_walk_over_segment_rows_is_the_whole_walk(problem, L):
    assert check_walk_over_segment_rows(problem, L) < 1e-12


@pytest.mark.usefixtures("one_thread")
def test_walk_check_fails_on_wrong_rows():
    """dh0 from each sequence's last segment row, or every row's dht one row off, fails the check."""
    problem = CHAIN_PROBLEMS[2]
    assert check_walk_over_segment_rows(problem, 3, first_rows=lambda p: p.last_segment) > 1e-3
    assert check_walk_over_segment_rows(problem, 3, shift=1) > 1e-3


def test_chain_check_fails_on_a_chain_without_m():
    """The chain check needs M^T: chaining dZ alone (M taken as 0 everywhere) fails it."""
    def no_exact(*args):
        start, end, exact, row = autocp.backward_windows(*args)
        return start, end, torch.zeros_like(exact), row
    assert check_chain_algebra(CHAIN_PROBLEMS[2], 2, True, windows=no_exact) > 1e-3


# ---- the rule ---------------------------------------------------------------------------------

TRAIN_LENGTHS = ((8192,), (32768,), (4096,) * 8, (28672, 4096))
WALK_CTAS = 2 * 2  # s02's walk: CTAs a (sequence, value head), two roles x two tiles of 64 value columns


def rule_violations(rule):
    """(H, HV, lengths) of the public problems where ``rule`` splits although s02's walk already has
    a wave of CTAs (4 HV a sequence, one an SM, on 132 SMs: nothing to fill), or where it leaves a
    single sequence of 32768 tokens unsplit with at most half the SMs busy."""
    bad = []
    for H, HV in PUBLIC_HEADS:
        for lengths in TRAIN_LENGTHS:
            chunks = [-(-n // C) for n in lengths]
            L = rule(chunks, HV, 132)
            ctas = WALK_CTAS * HV * len(lengths)
            if (L and ctas >= 132) or (not L and lengths == (32768,) and 2 * ctas <= 132):
                bad.append((H, HV, lengths))
    return bad


def test_rule_splits_only_where_the_walk_leaves_sms_idle():
    assert rule_violations(S03.segment_chunks) == []


def test_rule_check_fails_on_a_rule_that_forgets_the_walks_ctas(monkeypatch):
    """With one walk CTA a head instead of four, the rule splits (8, 32) 1 x 32768, whose walk fills
    the SMs."""
    monkeypatch.setattr(S03, "WALK_LANES", 1)
    assert rule_violations(S03.segment_chunks)


def test_rule_force():
    chunks = [512]
    assert S03.segment_chunks(chunks, 64, 132, False) == 0
    assert S03.segment_chunks(chunks, 64, 132, None) == 0          # (16, 64): no split
    assert S03.segment_chunks(chunks, 64, 132, True) > 0           # split anyway
    assert S03.segment_chunks(chunks, 64, 132, 5) == 5
    assert S03.segment_chunks([0], 8, 132, True) == 0               # nothing to split
    with pytest.raises(ValueError, match="`cp` as segment length must be >= 1 chunk"):
        S03.segment_chunks(chunks, 8, 132, 0)


# ---- the stage's contract ---------------------------------------------------------------------

def check_segmented_stage_contract(stage):
    """A gdn_bwd stage on AutoCP's segments (s03 and later): the reference's parameters and `cp`,
    the hopper need, its source markers, and a clear ValueError for each bad argument."""
    params = list(inspect.signature(stage.run).parameters)
    want = list(inspect.signature(ref.chunk_gated_delta_rule_bwd_ref).parameters)
    assert params == want + ["cp"]
    assert stage.NEEDS == ("hopper",) and stage.SOURCE_MUST_CONTAIN
    x = op_inputs("gdn_bwd", Problem(2, 4, (70,), K=128, V=128).inputs())
    for name, change, message in [
            ("chunk_size", 32, "`chunk_size` must be 64"),
            ("q", x["q"][..., :64], "`q` must have head dim K = 128"),
            ("v", x["v"][..., :64], "`v` must have head dim V = 128"),
            ("v", torch.cat([x["v"]] * 2, 2)[:, :, :3], "multiple of the H = 2 heads of q; got HV = 3"),
            ("cp", "auto", "`cp` must be None, True, False or a segment length in chunks; got 'auto'")]:
        with pytest.raises(ValueError, match=message):
            stage.run(**dict(x, **{name: change}))


def test_stage_contract():
    check_segmented_stage_contract(S03)


# ---- on the GPU -------------------------------------------------------------------------------

GPU_PROBLEMS = [problem for H, HV in PUBLIC_HEADS for problem in (
    Problem(H, HV, (1000,)),
    Problem(H, HV, (1, 200, 777, 64, 130)),
    Problem(H, HV, (333, 333), varlen=False, initial_state=False))]


def gpu_inputs(problem, seed=None):
    seed = zlib.crc32(problem.label.encode()) if seed is None else seed
    return op_inputs("gdn_bwd", problem.inputs(device="cuda", seed=seed))


@pytest.fixture(scope="module")
def compiled():
    """The stage's kernels, split and not, for every public head layout, compiled on threads first
    (about 60 TileLang kernels)."""
    run_on_threads([functools.partial(S03.run, **gpu_inputs(Problem(H, HV, (700, 70))), cp=cp)
                    for H, HV in PUBLIC_HEADS for cp in (2, False)])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("cp", [True, 2, False], ids=["cp_rule", "cp_2", "cp_off"])
def test_stage_matches_reference(problem, cp, compiled):
    check_op("gdn_bwd", functools.partial(S03.run, cp=cp), gpu_inputs(problem))


SPLIT_CASES = GPU_CASES  # the forward's AutoCP cases: the same splits, backward


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,L", SPLIT_CASES, ids=lambda c: getattr(c, "label", str(c)))
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no_dht"])
def test_cp_on_matches_cp_off(problem, L, with_dht, compiled):
    """Every value head's dv, dg, dbeta and dh0, and dq, dk, with CP as close to float64 as without
    (x TOLERANCE_FACTOR): the warm-up heads' error (<= e^-10 of a gradient) is far below bf16
    rounding. And the plan took both paths: g = 0 heads exact, strongly decaying ones warmed up."""
    x = gpu_inputs(problem, seed=1)
    if not with_dht:
        x["dht"] = None
    on = S03.run(**x, cp=L)
    off = S03.run(**x, cp=False)
    want = ref.chunk_gated_delta_rule_bwd_ref(**cast_floats(x, F64))
    for i, axis in ((0, None), (1, None), (2, 2), (3, 2), (4, 2), (5, 1)):
        if want[i] is None:
            assert on[i] is None and off[i] is None
            continue
        pairs = ([(rel_l2(on[i], want[i]), rel_l2(off[i], want[i]))] if axis is None else
                 list(zip(head_errors(on[i], want[i], axis), head_errors(off[i], want[i], axis))))
        for h, (a, b) in enumerate(pairs):
            assert a <= TOLERANCE_FACTOR * max(b, ROUNDING_FLOOR), (i, h, a, b)
    B, T = x["q"].shape[:2]
    p = S03.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), x["q"].device, L)
    g_cum = ref.chunk_local_cumsum(x["g"], x["cu_seqlens"]).view(B * T, -1)
    start, end, exact, _ = autocp.backward_windows(
        p, g_cum, autocp.bound_violations(x["k"], x["g"], x["beta"]), has_dht=with_dht)
    N = len(problem.lengths)
    before_last = torch.arange(start.shape[0], device="cuda")[:, None] >= 2 * N   # r >= 2: full segments
    walked = before_last & (end > start)
    kind = torch.arange(problem.HV, device="cuda") % 4
    assert walked[:, kind == 1].any()
    assert ((exact != 0) | ~walked)[:, kind == 0].all()                      # g = 0: whole, chained
    assert (((end - start <= C) & (exact == 0)) | ~walked)[:, kind == 1].all()  # strong decay: one chunk


def broken_bound(x):
    """Problem inputs with a token of g > 0 on value head 2 and keys times 3 (beta ||k||^2 > 2: the
    solve flags those chunks gated) on the first 300 tokens of key head 0."""
    x = dict(x)
    x["g"] = x["g"].clone()
    x["g"][0, 1500, 2] = 0.25
    x["k"] = x["k"].clone()
    x["k"][0, :300, 0] *= 3
    x["beta"] = torch.where(torch.arange(x["beta"].shape[2], device=x["beta"].device) < x["beta"].shape[2] // 2,
                            torch.ones_like(x["beta"]), x["beta"])
    return x


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("L", [2, 3])
@pytest.mark.parametrize("broken", [False, True], ids=["plain", "bound_broken"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no_dht"])
def test_windows_kernel_is_backward_windows(L, broken, with_dht, compiled):
    """s03's windows kernel gives ``autocp.backward_windows``' windows (from ``bound_violations``)
    bit for bit: the solve's gated flags and the per-token g, beta checks are the same conditions."""
    problem = Problem(4, 16, (3000, 1, 700, 2500, 64, 1300))
    x = gpu_inputs(problem, seed=4)
    if broken:
        x = broken_bound(x)
    B, T, H, K = x["q"].shape
    HV = problem.HV
    p = S03.split_plan(x["cu_seqlens"], B, T, HV, autocp.num_sms("cuda"), x["q"].device, L)
    flat = lambda t, *shape: t.contiguous().view(B * T, *shape)  # noqa: E731
    seqs = x["cu_seqlens"].to(torch.int32)
    NT = T // C + seqs.shape[0] - 1
    h0 = torch.zeros(seqs.shape[0] - 1, HV, K, K, device="cuda")
    _, solve = S03.segment_states(p, flat(x["k"], H, K).bfloat16(), flat(x["v"], HV, K).bfloat16(),
                                  flat(x["g"], HV).float(), flat(x["beta"], HV).float(), h0, seqs, NT)
    J, N = p.max_segments, seqs.shape[0] - 1
    got = [torch.empty(J * N, HV, dtype=torch.int32, device="cuda") for _ in range(3)]
    row = torch.empty(J * N, dtype=torch.int32, device="cuda")
    g_cum, first_chunk, gated = solve
    S03._windows(HV)(flat(x["g"], HV).float(), g_cum, flat(x["beta"], HV).float(), gated, seqs, first_chunk,
                     p.row_of_slot, p.segment_chunks, autocp.THRESHOLD, int(with_dht), *got, row)
    want = autocp.backward_windows(p, g_cum, autocp.bound_violations(x["k"], x["g"], x["beta"]),
                                   has_dht=with_dht)
    for a, b in zip((*got, row), want):
        assert torch.equal(a, b)
    if broken:
        assert want[2].any()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,L", SPLIT_CASES[:2], ids=lambda c: getattr(c, "label", str(c)))
def test_segment_gradients_match_float64(problem, L, compiled):
    """dht of every segment row (the dh warm-up and the reverse chain) against the float64
    ``segment_state_grads`` with the same windows, per value head within TOLERANCE_FACTOR x the
    same reference math in bf16."""
    x = gpu_inputs(problem, seed=5)
    B, T, H, K = x["q"].shape
    HV, N = problem.HV, len(problem.lengths)
    cu = x["cu_seqlens"]
    p = S03.split_plan(cu, B, T, HV, autocp.num_sms("cuda"), x["q"].device, L)
    g_cum = ref.chunk_local_cumsum(x["g"], cu).view(B * T, -1)
    start, end, exact, _ = autocp.backward_windows(p, g_cum, autocp.bound_violations(x["k"], x["g"], x["beta"]))
    J = p.max_segments
    count = [max(1, math.ceil(n / (C * L))) for n in problem.lengths]
    w = torch.zeros(N, J, HV, dtype=torch.long)
    for n in range(N):
        for j in range(1, count[n]):
            i = (count[n] - j) * N + n
            chunks = (end[i] - start[i] + C - 1) // C
            w[n, j] = torch.where(exact[i] != 0, -1, chunks).cpu()

    def reference(dtype):
        xx = cast_floats(x, dtype)
        gc = ref.chunk_local_cumsum(xx["g"], cu)
        ab, gated = ref.flagged_solve(xx["k"], gc, xx["beta"], cu)
        return ref.segment_state_grads(xx["q"], xx["k"], gc, ab, gated, xx["do"], L, xx["dht"], cu_seqlens=cu,
                                       warmup_chunks=w.to(x["q"].device))[0]
    want, bf16 = reference(F64), reference(torch.bfloat16)
    # the stage's pieces
    flat = lambda t, *shape: t.contiguous().view(B * T, *shape)  # noqa: E731
    q, k = flat(x["q"], H, K), flat(x["k"], H, K)
    v, do = flat(x["v"], HV, K), flat(x["do"], HV, K)
    g, beta = flat(x["g"], HV).float(), flat(x["beta"], HV).float()
    seqs = cu.to(torch.int32)
    table, _ = chunk_table(cu, B, T, C, x["q"].device)
    g_cum_w = torch.empty(B * T, HV, device="cuda")
    Ai = torch.empty(B * T, HV, C, dtype=torch.bfloat16, device="cuda")
    w_, u = torch.empty_like(v), torch.empty_like(v)
    S03.S02._prep(H, HV)(k, v, g, beta, table, g_cum_w, Ai, w_, u)
    h0 = x["initial_state"].float().contiguous()
    _, solve = S03.segment_states(p, k, v, g, beta, h0, seqs, table.shape[0])
    dht_seg, _ = S03.segment_grads(p, q, k, w_, do, g, beta, g_cum_w, solve, x["dht"], seqs, K ** -0.5)
    for r, slot in enumerate(p.slot_of_segment.tolist()):
        if p.bounds[r] < p.bounds[r + 1]:
            n, j = slot % N, slot // N
            for h in range(HV):
                err, base = rel_l2(dht_seg[r, h], want[n, j, h]), rel_l2(bf16[n, j, h], want[n, j, h])
                assert err <= TOLERANCE_FACTOR * max(base, ROUNDING_FLOOR), (r, h, err, base)


@pytest.mark.gpu
@pytest.mark.hopper
def test_bitwise_deterministic(compiled):
    x = gpu_inputs(Problem(4, 16, (3000, 1, 700, 2500)), seed=2)
    first = S03.run(**x, cp=4)
    for _ in range(3):
        again = S03.run(**x, cp=4)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,cp", [(Problem(2, 8, (16384,)), None), (Problem(2, 8, (16000, 3000, 192)), 8)],
                         ids=["rule", "varlen_cp8"])
def test_cuda_graph_replay_equals_eager(problem, cp, compiled):
    """After one eager call (which reads cu_seqlens once), the whole backward captures, and its replay
    gives the eager bits, again after the inputs change in place."""
    x = gpu_inputs(problem, seed=3)
    B, T = x["q"].shape[:2]
    assert S03.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), x["q"].device, cp)
    check_graph_replay(S03, x, cp)


def check_graph_replay(stage, x, cp):
    """``stage``'s backward on ``x`` captured in a CUDA graph after one eager call: the replay gives
    the eager bits, and again after the inputs change in place."""
    eager = stage.run(**x, cp=cp)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = stage.run(**x, cp=cp)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    x["do"].mul_(-1)                                                # new inputs, same tensors
    graph.replay()
    flipped = stage.run(**x, cp=cp)
    torch.cuda.synchronize()
    for a, b in zip(captured, flipped):
        assert torch.equal(a, b)
