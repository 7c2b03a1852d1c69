"""AutoCP: the planner against plain Python walks, the warm-up bound in float64, and gdn_fwd.s06,
s08 and s11 on the GPU.

CPU: the decision rule (and every split the committed benchmark runs timed: the rule splits where
it won), the segment table (every token in exactly one segment), each segment's
first chunk row, the warm-up counts against a brute-force count, the device-side fallback where
the bound's conditions fail, the chaining of phase 2 against a loop, the reference's exact
chaining against the recurrence, and the bound itself in float64
(||approximated - exact|| <= exp(log decay over the window) ||state where the window starts||);
for the backward, the reference's segment gradients: M_j, the exact reverse chain, dZ_j as the
segment run alone, and windows from each segment's start within the same bound.
GPU, for each stage (s06: s05's kernel as the chain; s08: s07's; s11: s10's): CP on against CP
off (each head's error against float64), varlen with many segments, bitwise determinism, and
CUDA-graph capture and replay of the whole forward.
"""

import functools
import inspect
import math
import textwrap

import pytest
import torch

from flashqla import autocp, bench
from flashqla import reference as ref
from flashqla.varlen import chunk_table, num_chunk_rows
from flashqla.testing import (ROUNDING_FLOOR, TOLERANCE_FACTOR, Problem, cast_floats, check_op,
                              rel_l2, run_on_threads)

F64 = torch.float64
CPU = torch.device("cpu")
C = autocp.CHUNK_SIZE


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


# ---- decision rule ------------------------------------------------------------------------------

def test_decision_rule():
    rule = autocp.segment_chunks
    # (16, 64): 128 CTAs of 132 SMs are busy without CP: no split; (2, 8): 16 CTAs, split
    assert rule(32768, 1, 32768, 64, 132, 2) == 0
    assert rule(32768, 1, 32768, 8, 132, 2) == 64                   # 8 segments x 16 CTAs
    assert rule(32768, 1, 32768, 16, 132, 2) == 128                 # 4 segments x 32 CTAs
    assert rule(32768, 1, 32768, 32, 132, 2) == 0                   # 2 segments x 64 CTAs: too few
    assert rule(65536, 1, 65536, 16, 132, 2) == 256                 # 4 segments x 32 CTAs
    assert rule(256, 1, 256, 8, 132, 2) == 0                        # 4 chunks: shorter than L
    assert rule(8 * 32768, 8, 32768, 8, 132, 2) == 0                # 8 x 16 CTAs: SMs busy enough
    assert rule(2048, 1, 2048, 8, 132, 2) == 0                      # 4 x 8: saves 8 chunk steps < 100
    assert rule(8192, 1, 8192, 8, 132, 2) == 0                      # 8 x 16: saves 80 < 100 (lost 0.96x)
    assert rule(16384, 1, 16384, 8, 132, 2) == 32                   # 8 x 32: saves 160
    assert rule(8192, 1, 8192, 16, 132, 2) == 0                     # 4 x 32: saves 32
    # the launch without a split at BV 32 (gdn_fwd.s13, the API): its steps take NARROW_STEP of a
    # BV 64 step, so only larger savings split. 4 x H200, 4e37c66: (4, 16) and (16, 16) 1 x 32768 ran
    # 1.08 and 1.10 ms unsplit at BV 32 (s12), 1.28 and 1.43 split (s11); (2, 8) 1 x 32768 and
    # 28672 + 4096 ran 1.02 and 0.90 unsplit at BV 32, 0.81 and 0.85 split
    narrow = dict(unsplit_step=autocp.NARROW_STEP)
    assert rule(32768, 1, 32768, 16, 132, 2) == 128 and rule(32768, 1, 32768, 16, 132, 2, **narrow) == 0
    assert rule(32768, 1, 32768, 8, 132, 2, **narrow) == 64
    assert rule(32768, 2, 32768, 8, 132, 2, **narrow) == 74
    # forced
    assert rule(32768, 1, 32768, 8, 132, 2, force=False) == 0
    assert rule(32768, 1, 32768, 64, 132, 2, force=True) == 512     # on, but one segment: no gain
    assert rule(256, 1, 256, 8, 132, 2, force=True) == 4            # one segment
    assert rule(256, 1, 256, 8, 132, 2, force=3) == 3
    with pytest.raises(ValueError, match="force"):
        rule(256, 1, 256, 8, 132, 2, force=0)


def measured_splits():
    """(what, rule's arguments, speed-up of the split) for every split a committed run timed:
    gdn_fwd.csv's AutoCP stage against its chain alone (s06 / s05, s08 / s07) where they
    differ by more than 8 % (the run split there: ``bench.autocp_splits_timed``). Not autocp.csv's forced splits: they ran s03's
    chain, 1.77x slower a step, where splits pay from shorter sequences (autocp.segment_chunks)."""
    out = []
    for label, cp, alone, split in bench.autocp_splits_timed(bench.read_csv(bench.RESULTS / "gdn_fwd.csv")):
        _, hv, lengths = bench.heads_and_lengths(label)
        args = (sum(lengths), len(lengths), sum(lengths), hv)            # varlen: the bound T
        out.append((f"{label} {cp}", args, alone / split))
    return out


def test_decision_rule_splits_where_the_measured_splits_won():
    cases = measured_splits()
    assert len(cases) >= 6, cases
    for what, args, speedup in cases:
        splits = autocp.segment_chunks(*args, 132, 2) > 0
        assert splits == (speedup > 1), (what, args, f"{speedup:.2f}x", "split" if splits else "no split")


def split_sweep(number: int) -> dict:
    """profiles/results/autocp_split.csv: problem label -> {L: ms} of gdn_fwd.sNN (L 0: unsplit)."""
    stage = f"gdn_fwd.s{number}"
    return {label: {int(L): ms for (impl, L), ms in t.items() if impl == stage and L != ""}
            for label, t in bench.split_sweep(stage).items()}


SWEEP_OF = {18: 18, 20: 20, 22: 21, 23: 23, 24: 24, 25: 24, 26: 24}  # the stage whose sweep checks a rule (s22 runs
# s21's kernels, s25 and s26 s24's)
RULE_CASES = [(number, label) for number in SWEEP_OF for label in split_sweep(SWEEP_OF[number])]


@pytest.mark.parametrize("number, label", RULE_CASES, ids=[f"s{n}-{label}" for n, label in RULE_CASES])
def test_rule_picks_a_fastest_measured_split(number, label):
    """gdn_fwd.s18's, s20's, s22's, s23's and s24's rules, on every problem of their sweeps
    (``profiles/split_lab.py``; s22's is s21's), pick the fastest measured choice (split or not, and
    L), or one within 3 % of it: the sweep's noise (about 1 % between runs), and L0 = 103 on (8, 24)
    1x32768, 2.7 % behind L 96, whose sixth segment the rule does not price. s24's sweep adds (8,
    32) and (16, 32) 28672+4096, where the rule's candidates are unsplit, 150 and 300 and the best
    L is 64 (7 % faster than unsplit): s24's rule is held to the fastest of its own choices;
    s25's, which weighs every length of the sweep's ladder, to the fastest of all."""
    from flashqla.stages import load

    mod = load("gdn_fwd", number)
    _, HV, lengths = bench.heads_and_lengths(label)
    seq_chunks = [-(-n // C) for n in lengths]
    s18 = load("gdn_fwd", 18)  # s20 runs s18's widths
    BV = s18.PIPELINE.block_v(seq_chunks, HV, 128, 132, s18.WIDTHS.step)
    L = mod.segment_chunks(seq_chunks, HV, 132, s18.WIDTHS.step[BV])
    timed = split_sweep(SWEEP_OF[number])[label]
    best = min(timed.values())
    if number == 24:  # the fastest of the choices the rule weighs: unsplit, L0 and 2 L0
        L0 = s18.segment_chunks(seq_chunks, HV, 132, 0.0, True)
        best = min(timed[c] for c in (0, L0, 2 * L0) if c in timed)
    assert len(timed) > 1 and L in timed and timed[L] <= 1.03 * best, (L, timed)


S44_CASES = sorted(split_sweep(44))


@pytest.mark.parametrize("label", S44_CASES)
def test_s44_rule_picks_a_fastest_measured_split(label, monkeypatch):
    """gdn_fwd.s44's decision (``launch``: its rule at WAVE_CHUNK_STEPS 1.85, the WY launch weighed
    at WY_STEP) picks, on every problem of its sweep (``profiles/split_lab.py --stage 44``, one
    H100, 71f4b9e and fbf3c07), the fastest measured choice or one within 3 %: it splits (8, 32)
    and (16, 32) 1x8192 at L 32 (0.83-0.86x the unsplit launch), and leaves (16, 48) and (16, 64)
    1x32768 whole, where s40's launch after the WY solve beats every split (s25's costs with
    STEP[64] would split them)."""
    from flashqla.stages import load

    s44 = load("gdn_fwd", 44)
    monkeypatch.setattr(autocp, "num_sms", lambda device: 132)
    H, HV, lengths = bench.heads_and_lengths(label)
    x = Problem(H, HV, lengths).inputs("cpu", seed=0)
    _, plan, _ = s44.launch(x["q"], x["v"], x["cu_seqlens"], None)
    L = 0 if plan is None else plan.segment_chunks
    timed = split_sweep(44)[label]
    assert len(timed) > 1 and L in timed and timed[L] <= 1.03 * min(timed.values()), (L, timed)


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("seqs", [1, 2, 3])
def test_auto_split_fills_at_most_one_wave(heads, seqs):
    for tokens in (2048, 8192, 32768, 65536, 1 << 20):
        L = autocp.segment_chunks(seqs * tokens, seqs, tokens, heads, 132, 2)
        if L:
            segments = seqs * math.ceil(tokens / (C * L))
            assert autocp.MIN_SEGMENTS <= math.ceil(tokens / (C * L)) <= autocp.MAX_SEGMENTS
            assert segments * heads * 2 <= 132, (heads, seqs, tokens, L)


# ---- the segment table --------------------------------------------------------------------------

def python_segments(lengths, L):
    """[(start, end, n, j)] of every real segment, in token order."""
    out, t = [], 0
    for n, length in enumerate(lengths):
        js = max(1, math.ceil(length / (C * L)))
        for j in range(js):
            out.append((t + min(j * C * L, length), t + min((j + 1) * C * L, length), n, j))
        t += length
    return out


@pytest.mark.parametrize("L", [1, 2, 3, 8])
@pytest.mark.parametrize("lengths", [(0, 1, 500, 64, 1300, 0, 129), (5,), (640, 640, 640), (1000,), (3000, 40)])
def test_host_plan_is_the_device_plan(lengths, L):
    """``autocp.host_plan`` (the lengths known, J from the longest sequence) has the device plan's
    segment rows, slots and chunk rows; its slots stop at its J, the device's bound (all the tokens)
    may have more, empty. ``slot_chunk``: the chunk-table row at each real slot's start."""
    T, N = sum(lengths), len(lengths)
    bounds = cu_of(lengths).tolist()
    got = autocp.host_plan(bounds, L, CPU)
    want = autocp.plan(cu_of(lengths), 1, T, 4, 132, 2, CPU, force=L)
    J = got.max_segments
    assert J == max(1, max(-(-n // (C * L)) for n in lengths)) <= want.max_segments
    for field in ("bounds", "slot_of_segment", "last_segment", "first_chunk"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    for field in ("slot_start", "slot_warm"):
        assert torch.equal(getattr(got, field), getattr(want, field)[: J * N]), field
    for r, slot in enumerate(got.slot_of_segment.tolist()):
        if got.bounds[r] < got.bounds[r + 1]:
            assert got.slot_chunk[slot] == got.first_chunk[r], (r, slot)
    assert autocp.host_plan(bounds, L, CPU) is got                  # kept for the same lengths


@pytest.mark.parametrize("L", [1, 2, 3, 8])
@pytest.mark.parametrize("lengths,varlen", [((0, 1, 500, 64, 1300, 0, 129), True), ((5,), True),
                                            ((640, 640, 640), False), ((1000,), True)])
def test_plan_covers_every_token_once(lengths, varlen, L):
    T = sum(lengths)
    batch, seqlen = (1, T) if varlen else (len(lengths), lengths[0])
    p = autocp.plan(cu_of(lengths) if varlen else None, batch, seqlen, 4, 132, 2, CPU, force=L)
    N, J = len(lengths), p.max_segments
    want = python_segments(lengths, L)
    bounds = p.bounds.tolist()
    assert p.bounds.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == T
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))          # contiguous, in order: each
    rows = list(zip(bounds, bounds[1:]))                            # token in exactly one row
    assert len(rows) >= len(want) and rows[: len(want)] == [(s, e) for s, e, _, _ in want]
    assert all(s == e == T for s, e in rows[len(want):])            # empty rows past the real ones
    assert J >= max(j for _, _, _, j in want) + 1
    assert p.slot_of_segment[: len(want)].tolist() == [j * N + n for _, _, n, j in want]
    last = {n: i for i, (_, _, n, _) in enumerate(want)}
    assert p.last_segment.tolist() == [last[n] for n in range(N)]
    starts, warm = p.slot_start.view(J, N).tolist(), p.slot_warm.view(J, N).tolist()
    seg = {(n, j): (s, e) for s, e, n, j in want}
    cu = cu_of(lengths).tolist()
    for j in range(J):
        for n in range(N):
            assert starts[j][n] == seg.get((n, j), (cu[n + 1],))[0]
            assert warm[j][n] == (j >= 1 and (n, j) in seg)


@pytest.mark.parametrize("L", [1, 2, 3, 8])
@pytest.mark.parametrize("lengths,varlen", [((0, 1, 500, 64, 1300, 0, 129), True), ((5,), True),
                                            ((640, 640, 640), False), ((1000,), True),
                                            ((130, 0, 0, 2000, 63, 65), True)])
def test_first_chunk_rows_are_the_whole_sequences_rows(lengths, varlen, L):
    """Segment j of sequence n starts at row (chunks of the sequences before n) + j L of the
    sequences' chunk table, the row that starts at the segment's first token; a segment's rows end
    where the next one's begin; rows past the real segments hold the real chunk count."""
    T = sum(lengths)
    batch, seqlen = (1, T) if varlen else (len(lengths), lengths[0])
    cu = cu_of(lengths) if varlen else None
    p = autocp.plan(cu, batch, seqlen, 4, 132, 2, CPU, force=L)
    table, seq_first = chunk_table(cu, batch, seqlen, C, CPU)
    want = python_segments(lengths, L)
    total = sum(math.ceil(n / C) for n in lengths)
    first = p.first_chunk.tolist()
    assert p.first_chunk.dtype == torch.int32 and len(first) == p.bounds.shape[0]
    for r, (s, e, n, j) in enumerate(want):
        assert first[r] == sum(math.ceil(m / C) for m in lengths[:n]) + j * L, r
        assert first[r] == seq_first[n] + j * L
        assert first[r + 1] - first[r] == math.ceil((e - s) / C), r       # its chunks, no more
        if e > s:
            assert table[first[r]].tolist() == [s, min(s + C, e)], r
    assert all(f == total for f in first[len(want):])


def test_segment_initial_states_chain_the_slots():
    """Phase 2 against a plain loop per sequence: h_0 = h0, h_j = Z_j + M_j h_{j-1}, gathered by
    segment row (empty rows get slot 0's state)."""
    lengths, L, HV, K = (700, 1, 300, 0, 1500), 3, 2, 4
    p = autocp.plan(cu_of(lengths), 1, sum(lengths), HV, 132, 2, CPU, force=L)
    N, J = len(lengths), p.max_segments
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(N, HV, K, K, generator=gen)
    z = torch.randn(J * N, HV, K, K, generator=gen)
    m = torch.randn(J * N, HV, K, K, generator=gen)
    got = autocp.segment_initial_states(p, h0, z, m)
    want = {}
    for n in range(N):
        h = h0[n]
        for j in range(J):
            if j:
                h = z[j * N + n] + m[j * N + n] @ h
            want[j * N + n] = h
    rows = p.bounds.shape[0] - 1
    assert got.shape == (rows, HV, K, K)
    for r, slot in enumerate(p.slot_of_segment.tolist()):
        assert torch.allclose(got[r], want[slot], rtol=1e-5, atol=1e-5), r


def test_plan_is_kept_for_the_same_cu_seqlens():
    cu = cu_of((700, 300))
    p = autocp.plan(cu, 1, 1000, 4, 132, 2, CPU, force=2)
    assert autocp.plan(cu, 1, 1000, 4, 132, 2, CPU, force=2) is p
    cu[1] = 600                                                     # edited in place: rebuilt
    assert autocp.plan(cu, 1, 1000, 4, 132, 2, CPU, force=2).bounds[:3].tolist() == [0, 128, 256]
    assert autocp.plan(cu, 1, 1000, 64, 132, 2, CPU) is None        # auto: too short to split


# ---- warm-up counts -----------------------------------------------------------------------------

def problem_inputs(problem, seed=0):
    x = problem.inputs(seed=seed)
    B, T = x["q"].shape[:2]
    return x, B, T


def brute_force_windows(g_cum, lengths, L, threshold, bad_tokens=()):
    """{(j, n, head): (chunks, exact)} by walking chunk by chunk back from each segment start."""
    out, t0 = {}, 0
    for n, length in enumerate(lengths):
        for j in range(1, math.ceil(length / (C * L))):
            s = t0 + j * C * L
            for h in range(g_cum.shape[1]):
                total, w = 0.0, None
                for i in range(min(L, autocp.MAX_WARMUP_CHUNKS)):
                    total += float(g_cum[s - C * i - 1, h])
                    if total <= threshold:
                        w = i + 1
                        break
                bad = any(s - C * L <= t < s and hh == h for t, hh in bad_tokens)
                out[(j, n, h)] = (L, True) if (w is None or bad) else (w, False)
        t0 += length
    return out


@pytest.mark.parametrize("threshold", [-10.0, -3.0, -40.0])
@pytest.mark.parametrize("L", [1, 3, 8])
def test_warmup_counts_match_brute_force(threshold, L):
    lengths = (3000, 1, 700, 2500)
    x, B, T = problem_inputs(Problem(2, 8, lengths, K=16, V=16))
    cu = x["cu_seqlens"]
    g_cum = ref.chunk_local_cumsum(x["g"], cu).view(B * T, -1)
    p = autocp.plan(cu, B, T, 8, 132, 2, CPU, force=L)
    viol = autocp.bound_violations(x["k"], x["g"], x["beta"])
    assert viol[-1] == 0                                            # the Problem keeps the conditions
    start, exact, chunks = autocp.warmup(p, g_cum, viol, threshold)
    want = brute_force_windows(g_cum, lengths, L, threshold)
    N, J = len(lengths), p.max_segments
    s = p.slot_start.view(J, N, 1)
    got_w, got_e = chunks.view(J, N, -1), exact.view(J, N, -1)
    for j in range(J):
        for n in range(N):
            for h in range(8):
                w, e = want.get((j, n, h), (0, False))
                assert (got_w[j, n, h].item(), bool(got_e[j, n, h])) == (w, e), (j, n, h)
    assert (start.view(J, N, -1) == s - C * got_w).all()
    kind, warm = torch.arange(8) % 4, p.slot_warm.view(J, N)[:, 0]
    if L >= 3 and threshold == -10.0:                               # both paths are exercised
        assert got_e[warm, 0][:, kind == 0].all() and not got_e[warm, 0][:, kind == 1].any()


def test_warmup_longer_than_the_cap_is_exact():
    lengths, L = (9000,), 70                                        # 2 segments of 70 chunks
    x, B, T = problem_inputs(Problem(1, 4, lengths, K=16, V=16))
    g = x["g"].clone()
    g[..., 2] = -0.0023                                             # -10 after 68 chunks: past the cap
    g[..., 3] = -0.0026                                             # -10 after 61 chunks
    cu = x["cu_seqlens"]
    g_cum = ref.chunk_local_cumsum(g, cu).view(B * T, -1)
    p = autocp.plan(cu, B, T, 4, 132, 2, CPU, force=L)
    _, exact, chunks = autocp.warmup(p, g_cum, autocp.bound_violations(x["k"], g, x["beta"]))
    assert exact[1].tolist() == [1, 0, 1, 0] and chunks[1].tolist()[2:] == [L, 61]
    want = brute_force_windows(g_cum, lengths, L, autocp.THRESHOLD)
    assert [want[(1, 0, h)] for h in range(4)] == [(w, bool(e)) for w, e in zip(chunks[1].tolist(), exact[1].tolist())]


def test_conditions_broken_fall_back_to_exact():
    lengths = (2000,)
    x, B, T = problem_inputs(Problem(1, 4, lengths, K=16, V=16))
    k, g, beta = x["k"].clone(), x["g"].clone(), x["beta"].clone()
    k[0, 600] *= 2.0                                                # ||k||^2 = 4: beta ||k||^2 > 2?
    beta[0, 600] = 0.9                                              # yes, for every head (GVA)
    g[0, 1400, 2] = 0.01                                            # g > 0 on head 2 only
    beta[0, 1500, 3] = -0.1                                         # beta < 0 on head 3 only
    bad_tokens = [(600, h) for h in range(4)] + [(1400, 2), (1500, 3)]
    cu = x["cu_seqlens"]
    g_cum = ref.chunk_local_cumsum(g, cu).view(B * T, -1)
    p = autocp.plan(cu, B, T, 4, 132, 2, CPU, force=4)              # segments of 256 tokens
    _, exact, chunks = autocp.warmup(p, g_cum, autocp.bound_violations(k, g, beta))
    want = brute_force_windows(g_cum, lengths, 4, autocp.THRESHOLD, bad_tokens)
    for (j, n, h), (w, e) in want.items():
        assert (chunks[j, h].item(), bool(exact[j, h])) == (w, e), (j, h)
    assert exact[3, :].all() and exact[6, 2] and exact[6, 3] and not exact[6, 1]


# ---- the reference, in float64 ------------------------------------------------------------------

SMALL = [Problem(2, 4, (1000, 300, 1), K=16, V=16), Problem(1, 4, (777,), K=32, V=32),
         Problem(2, 6, (640, 640), varlen=False, K=16, V=16)]


@pytest.mark.parametrize("problem", SMALL, ids=lambda p: p.label)
def test_transition_is_the_chain_from_identity_with_v_zero(problem):
    x = cast_floats(problem.inputs(), F64)
    cu, K = x["cu_seqlens"], problem.K
    M = ref.chunk_transition(x["k"], ref.chunk_local_cumsum(x["g"], cu), x["beta"], cu)
    prod = torch.eye(K, dtype=F64).expand(M.shape[0], M.shape[2], K, K)
    for c in range(M.shape[1]):
        prod = M[:, c] @ prod
    v0 = torch.zeros(*x["k"].shape[:2], problem.HV, K, dtype=F64)
    eye = torch.eye(K, dtype=F64).expand(len(problem.lengths), problem.HV, K, K)
    _, final = ref.naive_recurrent_gated_delta_rule(x["q"], x["k"], v0, x["g"], x["beta"],
                                                    initial_state=eye, output_final_state=True,
                                                    cu_seqlens=cu)
    assert rel_l2(prod, final) < 1e-12
    # the bound's premise: ||M||_2 <= exp(sum of g over the chunk)
    ch = ref.Chunking(*x["g"].shape[:2], cu, C, CPU)
    decay = ch.pad(x["g"]).sum(2)                                   # [N, NT, HV]
    assert (torch.linalg.matrix_norm(M, ord=2) <= torch.exp(decay) * (1 + 1e-12)).all()


@pytest.mark.parametrize("problem", SMALL, ids=lambda p: p.label)
@pytest.mark.parametrize("L", [1, 2, 5])
def test_chaining_is_exact(problem, L):
    x = cast_floats(problem.inputs(), F64)
    args = (x["k"], x["v"], x["g"], x["beta"])
    per_chunk = ref.segment_states(*args, 1, x["initial_state"], x["cu_seqlens"])
    chained = ref.segment_states(*args, L, x["initial_state"], x["cu_seqlens"])
    assert rel_l2(chained, per_chunk[:, ::L]) < 1e-12
    _, final = ref.naive_recurrent_gated_delta_rule(**x)            # past the end: the final state
    past = [n for n, length in enumerate(problem.lengths) if math.ceil(length / C) <= (chained.shape[1] - 1) * L]
    assert rel_l2(chained[past, -1], final[past]) < 1e-12


@pytest.mark.parametrize("threshold", [-10.0, -4.0, -1.0])
def test_warmup_error_within_the_bound_in_float64(threshold):
    """The planner's windows, applied by the float64 reference: exact heads exact, the others
    within exp(log decay over the window) x the norm of the state where the window starts."""
    lengths, L = (2500, 1300, 700), 4
    problem = Problem(2, 8, lengths, K=16, V=16)
    x = cast_floats(problem.inputs(), F64)
    cu = x["cu_seqlens"]
    B, T = x["q"].shape[:2]
    g_cum = ref.chunk_local_cumsum(x["g"].float(), cu).view(B * T, -1)
    p = autocp.plan(cu, B, T, 8, 132, 2, CPU, force=L)
    N, J = len(lengths), p.max_segments
    _, exact, chunks = autocp.warmup(p, g_cum, autocp.bound_violations(x["k"], x["g"], x["beta"]),
                                     threshold)
    w = torch.where(exact.bool(), -1, chunks).view(J, N, -1).transpose(0, 1)  # [N, J, HV]
    args = (x["k"], x["v"], x["g"], x["beta"])
    approx = ref.segment_states(*args, L, x["initial_state"], cu, warmup_chunks=w)
    states = ref.segment_states(*args, 1, x["initial_state"], cu)   # entering every chunk
    decay = ref.Chunking(B, T, cu, C, CPU).pad(x["g"]).sum(2)       # [N, NT, HV]
    err = (approx - states[:, ::L]).flatten(3).norm(dim=-1)         # [N, J, HV]
    n_warm = 0
    for n in range(N):
        for j in range(1, math.ceil(lengths[n] / (C * L))):
            for h in range(8):
                ww = int(w[n, j, h])
                scale = states[n, j * L].norm()
                if ww < 0:
                    assert err[n, j, h] <= 1e-12 * scale
                    continue
                n_warm += 1
                window = decay[n, j * L - ww: j * L, h].sum()
                assert window <= threshold + 1e-5
                bound = torch.exp(window) * states[n, j * L - ww, h].norm()
                assert err[n, j, h] <= bound * (1 + 1e-9) + 1e-12 * scale, (n, j, h)
    assert n_warm > 0


# ---- backward AutoCP: the reference's segment gradients, in float64 -----------------------------
#
# The backward's chain runs the other way: segment j's gradient at its start needs dht_j, the
# gradient of the state leaving it, which the later segments produce. ref.segment_state_grads
# gives per segment dZ_j (the reverse walk from zero over segment j, or over a window of its first
# chunks) and its transition M_j, chained as dht_{j-1} = dZ_j + M_j^T dht_j. Checked: M_j is the
# forward's, the exact chain is the reverse recurrence (per chunk and against autograd of the
# naive recurrence), dZ_j is the walk of segment j alone (its plan row run as a sequence), and the
# windows (counted from each segment's start, the backward counterpart of autocp.warmup's) are
# within the forward's bound. Each check fails on a one-line mutant of segment_state_grads.

BWD_SMALL = SMALL + [Problem(1, 2, (700, 130), K=16, V=16, initial_state=False)]


@pytest.fixture
def one_thread():
    """Thousands of tiny float64 ops: a second intra-op thread only adds synchronization, which
    costs 4x on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def bwd_inputs(problem):
    """Float64 inputs, the solve's Ab and flags, and do, dht drawn with a fixed seed."""
    x = cast_floats(problem.inputs(), F64)
    g_cum = ref.chunk_local_cumsum(x["g"], x["cu_seqlens"])
    Ab, gated = ref.flagged_solve(x["k"], g_cum, x["beta"], x["cu_seqlens"])
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(x["v"].shape, generator=gen, dtype=F64)
    dht = torch.randn(len(problem.lengths), problem.HV, problem.K, problem.V, generator=gen, dtype=F64)
    return x, dict(q=x["q"], k=x["k"], g_cum=g_cum, Ab=Ab, gated=gated, do=do, dht=dht,
                   cu_seqlens=x["cu_seqlens"])


def segment_grads(problem, L, warmup_chunks=None):
    _, a = bwd_inputs(problem)
    return ref.segment_state_grads(a["q"], a["k"], a["g_cum"], a["Ab"], a["gated"], a["do"], L, a["dht"],
                                   cu_seqlens=a["cu_seqlens"], warmup_chunks=warmup_chunks)


@functools.cache
def dh_per_chunk(problem):
    """[N, NT, HV, K, V]: chunk_bwd_dhu's gradient of the state leaving every chunk (dht past a
    sequence's end, where the chunks are padding)."""
    x, a = bwd_inputs(problem)
    cu = x["cu_seqlens"]
    w, _ = ref.chunk_fwd_intra(x["k"], x["v"], a["g_cum"], x["beta"], cu)
    dv_local = ref.chunk_bwd_dv_local(x["q"], x["k"], a["do"], a["g_cum"], cu_seqlens=cu)
    dh = ref.chunk_bwd_dhu(x["q"], x["k"], w, a["g_cum"], None, a["dht"], a["do"], dv_local, cu_seqlens=cu)[0]
    ch = ref.Chunking(*x["q"].shape[:2], cu, C, CPU)
    return torch.where(ch.chunk_valid[..., None, None, None], ch.unpack_chunks(dh), a["dht"][:, None])


def check_segment_transition(problem, L=3):
    """M_j == the product of the forward's chunk transitions over segment j (identity past the end)."""
    x, a = bwd_inputs(problem)
    M = ref.chunk_transition(x["k"], a["g_cum"], x["beta"], x["cu_seqlens"])      # [N, NT, HV, K, K]
    want = []
    for j in range(-(-M.shape[1] // L)):
        prod = torch.eye(problem.K, dtype=F64).expand_as(M[:, 0])
        for c in range(j * L, min((j + 1) * L, M.shape[1])):
            prod = M[:, c] @ prod
        want.append(prod)
    return rel_l2(segment_grads(problem, L)[2], torch.stack(want, 1))


def check_gradient_chaining(problem, L=2):
    """The exact chain: dht_seg[:, j] == the gradient leaving segment j's last chunk, per chunk."""
    dh = dh_per_chunk(problem)
    last = [min((j + 1) * L, dh.shape[1]) - 1 for j in range(-(-dh.shape[1] // L))]
    return rel_l2(segment_grads(problem, L)[0], dh[:, last])


def check_dz_is_the_segment_alone(problem, L=2):
    """dZ_j == dh0 of dh_chain_cancelled run on the plan's segment rows as sequences, from zero."""
    x, a = bwd_inputs(problem)
    B, T = x["q"].shape[:2]
    p = autocp.plan(x["cu_seqlens"], B, T, problem.HV, 132, 2, CPU, force=L)
    bounds = p.bounds.long()
    real = bounds[1:] > bounds[:-1]                                    # rows with tokens
    flat = {n: a[n].reshape(1, B * T, *a[n].shape[2:]) for n in ("q", "k", "g_cum", "Ab", "do")}
    zero = torch.zeros(bounds.shape[0] - 1, *a["dht"].shape[1:], dtype=F64)
    _, dz_rows = ref.dh_chain_cancelled(**flat, gated=a["gated"].reshape(1, -1, problem.HV), dht=zero,
                                        cu_seqlens=bounds)
    dz = segment_grads(problem, L)[1]                                 # [N, J, HV, K, V]
    slots = p.slot_of_segment[real]
    return rel_l2(dz_rows[real], dz[slots % p.num_seqs, slots // p.num_seqs])


@functools.cache
def naive_segment_grads(problem, L):
    """[N, J - 1, HV, K, V]: dL/d(state after (j + 1) L chunks), by autograd of the naive
    recurrence on the rest of the tokens started from that state (an equal-length batch)."""
    x, a = bwd_inputs(problem)
    grads = []
    for t0 in range(L * C, x["q"].shape[1], L * C):
        head = {**x, **{n: x[n][:, :t0] for n in ("q", "k", "v", "g", "beta")}, "output_final_state": True}
        state = ref.naive_recurrent_gated_delta_rule(**head)[1].clone().requires_grad_()
        tail = {**head, **{n: x[n][:, t0:] for n in ("q", "k", "v", "g", "beta")}, "initial_state": state}
        o, final = ref.naive_recurrent_gated_delta_rule(**tail)
        grads.append(torch.autograd.grad((o * a["do"][:, t0:]).sum() + (final * a["dht"]).sum(), state)[0])
    return torch.stack(grads, 1)


def check_gradient_chaining_against_naive(problem, L=2):
    """dht_seg[:, j] == naive_segment_grads for every segment but the last."""
    want = naive_segment_grads(problem, L)
    return rel_l2(segment_grads(problem, L)[0][:, :want.shape[1]], want)


def brute_force_bwd_windows(g_cum, lengths, L, threshold):
    """{(n, j, head): (chunks, exact)} for segments j >= 1: walking chunk by chunk forward from the
    segment's start until the chunks' log decays sum to <= threshold (within the segment's real
    chunks and MAX_WARMUP_CHUNKS), exact where they never do."""
    out, t0 = {}, 0
    for n, length in enumerate(lengths):
        for j in range(1, math.ceil(length / (C * L))):
            s = t0 + j * C * L
            real = min(L, math.ceil((t0 + length - s) / C))
            for h in range(g_cum.shape[1]):
                total, w = 0.0, None
                for i in range(min(real, autocp.MAX_WARMUP_CHUNKS)):
                    total += float(g_cum[min(s + C * (i + 1), t0 + length) - 1, h])
                    if total <= threshold:
                        w = i + 1
                        break
                out[(n, j, h)] = (L, True) if w is None else (w, False)
        t0 += length
    return out


BWD_WINDOWS = (Problem(2, 8, (2500, 1300, 700), K=16, V=16), 4)


def check_backward_windows_within_the_bound(threshold, n_warm_min=1):
    """The windows, applied by segment_state_grads, on every real segment i of every sequence:
    its last segment gets dht itself; the others' dht_i comes from slot i + 1, a window head's
    within exp(log decay over the window) x the norm of the true gradient where the window ends,
    an exact head's off only by what M_{i+1}^T carries of dht_{i+1}'s error. Returns the worst
    excess over the bound, relative to the true dht_i's norm."""
    problem, L = BWD_WINDOWS
    x, a = bwd_inputs(problem)
    N, HV = len(problem.lengths), problem.HV
    B, T = x["q"].shape[:2]
    windows = brute_force_bwd_windows(a["g_cum"].reshape(B * T, HV), problem.lengths, L, threshold)
    dh = dh_per_chunk(problem)
    J = -(-dh.shape[1] // L)
    w = torch.zeros(N, J, HV, dtype=torch.long)                     # 0: no window (slots past the end)
    for (n, j, h), (chunks, exact) in windows.items():
        w[n, j, h] = -1 if exact else chunks
    approx = segment_grads(problem, L, w)[0]
    want = dh[:, [min((j + 1) * L, dh.shape[1]) - 1 for j in range(J)]]
    err = (approx - want).flatten(3).norm(dim=-1)                      # [N, J, HV]
    decay = ref.Chunking(B, T, x["cu_seqlens"], C, CPU).pad(x["g"]).sum(2)      # [N, NT, HV]
    worst, n_warm = 0.0, 0
    for n, length in enumerate(problem.lengths):
        segments = math.ceil(length / (C * L))
        for i in range(segments):
            for h in range(HV):
                if i == segments - 1:
                    bound = torch.zeros(())
                elif windows[(n, i + 1, h)][1]:
                    bound = torch.exp(decay[n, (i + 1) * L:(i + 2) * L, h].sum()) * err[n, i + 1, h]
                else:
                    n_warm += 1
                    ww = windows[(n, i + 1, h)][0]
                    window = decay[n, (i + 1) * L: (i + 1) * L + ww, h].sum()
                    assert window <= threshold + 1e-5
                    bound = torch.exp(window) * dh[n, (i + 1) * L + ww - 1, h].norm()
                scale = want[n, i, h].norm()
                worst = max(worst, float((err[n, i, h] - bound * (1 + 1e-9)) / scale))
    assert n_warm >= n_warm_min
    return worst


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("problem", BWD_SMALL, ids=lambda p: p.label)
def test_backward_segment_transition_is_the_forwards(problem):
    assert check_segment_transition(problem) < 1e-12


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("problem", BWD_SMALL, ids=lambda p: p.label)
@pytest.mark.parametrize("L", [1, 2, 5])
def test_gradient_chaining_is_exact(problem, L):
    assert check_gradient_chaining(problem, L) < 1e-12


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("problem", BWD_SMALL, ids=lambda p: p.label)
def test_dz_is_the_segment_run_alone(problem):
    assert check_dz_is_the_segment_alone(problem) < 1e-12


@pytest.mark.usefixtures("one_thread")
def test_gradient_chaining_against_autograd_of_the_recurrence():
    assert check_gradient_chaining_against_naive(SMALL[2]) < 1e-12


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("threshold", [-10.0, -4.0, -1.0])
def test_backward_warmup_error_within_the_bound_in_float64(threshold):
    assert check_backward_windows_within_the_bound(threshold) <= 1e-12


@pytest.mark.usefixtures("one_thread")
def test_backward_windows_take_both_paths():
    """g = 0 heads never reach the threshold (exact), the strongly decaying ones in one chunk."""
    problem, L = BWD_WINDOWS
    _, a = bwd_inputs(problem)
    g_cum = a["g_cum"].reshape(-1, problem.HV)
    windows = brute_force_bwd_windows(g_cum, problem.lengths, L, autocp.THRESHOLD)
    kind = {h: h % 4 for h in range(problem.HV)}
    assert all(exact for (n, j, h), (w, exact) in windows.items() if kind[h] == 0)
    assert all(w == 1 and not exact for (n, j, h), (w, exact) in windows.items() if kind[h] == 1)


def segment_mutant(old: str, new: str):
    """ref.segment_state_grads with the source text ``old`` replaced by ``new``: one deliberate bug."""
    src = textwrap.dedent(inspect.getsource(ref.segment_state_grads))
    assert src.count(old) == 1, old
    namespace = {}
    exec(compile(src.replace(old, new), "<mutant of segment_state_grads>", "exec"), vars(ref), namespace)
    return namespace["segment_state_grads"]


SEGMENT_BROKEN = {  # name: (old, new, checks it fails)
    "M_j multiplied in the wrong order": (
        "mt_seg = mt[:, c] @ mt_seg", "mt_seg = mt_seg @ mt[:, c]",
        [check_segment_transition, check_gradient_chaining]),
    "chained with M_j where M_j^T belongs": (
        "ms[j].mT @ dht_seg[0]", "ms[j] @ dht_seg[0]",
        [check_gradient_chaining, check_gradient_chaining_against_naive]),
    "the segment walked forward": (
        "for c in reversed(range(j * L, min((j + 1) * L, n_chunks))):",
        "for c in range(j * L, min((j + 1) * L, n_chunks)):",
        [check_dz_is_the_segment_alone, check_gradient_chaining]),
    "window one chunk short": (
        "j * L + w[:, j])[..., None, None]", "j * L + w[:, j] - 1)[..., None, None]",
        [check_backward_windows_within_the_bound]),
    "exact heads not chained": (
        "chained = torch.where(exact[j][..., None, None], ms[j].mT @ dht_seg[0], 0)", "chained = 0",
        [check_backward_windows_within_the_bound]),
    "no window reaches the sequence's end": (
        " | (j * L + w[:, j] >= seq_chunks)", "", [check_backward_windows_within_the_bound]),
}
SEGMENT_BROKEN_CASES = [(name, check) for name, (_, _, checks) in SEGMENT_BROKEN.items() for check in checks]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name, check", SEGMENT_BROKEN_CASES,
                         ids=[f"{n}-{c.__name__}" for n, c in SEGMENT_BROKEN_CASES])
def test_segment_check_fails_on_broken_variant(monkeypatch, name, check):
    old, new, _ = SEGMENT_BROKEN[name]
    monkeypatch.setattr(ref, "segment_state_grads", segment_mutant(old, new))
    if check is check_backward_windows_within_the_bound:
        assert check(-10.0, n_warm_min=0) > 1e-3
    else:
        assert check(SMALL[2]) > 1e-3


# ---- gdn_fwd.s06, s08, s11, s13, s15, s17, s18 and s20 on the GPU ------------------------------

GPU_HEADS = ((2, 8), (4, 16), (16, 16))


@pytest.fixture(scope="module", params=[6, 8, 11, 13, 15, 17, 18, 20, 21, 22, 23, 24, 26, 27, 28, 29, 30, 31, 32, 33,
                                        34, 35, 36, 37, 38, 39, 40, 41, 44, 45],
                ids=["s06", "s08", "s11", "s13", "s15", "s17", "s18", "s20", "s21", "s22", "s23", "s24", "s26",
                     "s27", "s28", "s29", "s30", "s31", "s32", "s33", "s34", "s35", "s36", "s37", "s38", "s39", "s40",
                     "s41", "s44", "s45"])
def stage(request):
    """The stage (s06; s08 on s07's kernel, s11 on s10's, s13 on s12's, s15 on s12's and s14's, s17
    on s12's and s16's, s18 s17's with its own phase 1, s20 s18's with phase 1 on warp roles, s21
    s20's with phase 2 in one kernel, s22 s21's on gate_free_solve.s09, s23 s22's with phase 1 on
    the state/value split, s24 s23's with phase 2 reading M only where needed, s26 s24's with
    the cumsum and solve of short problems and s25's rule, s27 s26's kernels as programmatic
    dependents, s28 s27's with gate_free_solve.s11's grouping, s29 s28's with the chunk table from
    the cumsum, s30 s29's with gate_free_solve.s12's launch bounds, s31 s30's with the cumsum in
    the solve's prologue, s32 s31's at gate_free_solve.s14's CTAs an SM, s33 s32's with BV 16, s34 s33's with the wide
    kernel's output overlapped, s35 s34's with WY built by the value warpgroup, s36 s34's with WY stored by the solve, s37 s36's at BV 64 only, s38 s37's with the chain
    running ahead of the output, s39 s37's with the state in registers,
    s40 s39's with stmatrix hand-offs, s41 s40's with -WY D K from the scores, s44 s43's with
    phase 1 on two products, s45 s44's with the narrow chain on w and u), with its kernels (and those of the chain it runs) compiled on threads first."""
    from flashqla.stages import load
    from flashqla.testing import PUBLIC_HEADS

    mod = load("gdn_fwd", request.param)
    run_on_threads([functools.partial(mod.forward, **Problem(H, HV, (700,)).inputs("cuda"), cp=2)
                    for H, HV in PUBLIC_HEADS])
    return mod


def head_errors(got, want, axis):
    return [rel_l2(got.select(axis, h), want.select(axis, h)) for h in range(got.shape[axis])]


GPU_CASES = [
    (Problem(2, 8, (4096,)), 8),                                    # 8 segments of 512 tokens
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # varlen, 17 segments, empty rows
    (Problem(16, 16, (2048, 2048), varlen=False), 3),
    (Problem(2, 8, (777, 5000), initial_state=False), 2),           # 42 segments
]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,L", GPU_CASES, ids=lambda c: getattr(c, "label", str(c)))
def test_cp_on_matches_cp_off(stage, problem, L):
    """Every value head with CP is as close to float64 as without (x TOLERANCE_FACTOR): the
    warm-up heads' approximation (<= e^-10 of a state) is far below the kernel's bf16 rounding,
    and the exact heads change only where rounding happens. Plus the usual check_op bound."""
    x = problem.inputs("cuda", seed=1)
    on = stage.forward(**x, cp=L)
    off = stage.forward(**x, cp=False)
    want = ref.chunk_gated_delta_rule_ref(**cast_floats(x, F64))
    for got_on, got_off, w, axis in ((on[0], off[0], want[0], 2), (on[1], off[1], want[1], 1)):
        e_on, e_off = head_errors(got_on, w, axis), head_errors(got_off, w, axis)
        for h, (a, b) in enumerate(zip(e_on, e_off)):
            assert a <= TOLERANCE_FACTOR * max(b, ROUNDING_FLOOR), (h, a, b)
    check_op("gdn_fwd", lambda **kw: stage.forward(**kw, cp=L), x)
    # the plan took both paths: g = 0 heads exact, the strongly decaying ones warmed up
    B, T = x["q"].shape[:2]
    p = autocp.plan(x["cu_seqlens"], B, T, problem.HV, 132, 2, x["q"].device, force=L)
    g_cum = ref.chunk_local_cumsum(x["g"], x["cu_seqlens"]).view(B * T, -1)
    _, exact, _ = autocp.warmup(p, g_cum, autocp.bound_violations(x["k"], x["g"], x["beta"]))
    warm = p.slot_warm
    kind = torch.arange(problem.HV, device="cuda") % 4
    assert exact[warm][:, kind == 0].all() and not exact[warm][:, kind == 1].any()


@pytest.mark.gpu
@pytest.mark.hopper
def test_bitwise_deterministic(stage):
    x = Problem(4, 16, (3000, 1, 700, 2500)).inputs("cuda", seed=2)
    first = stage.forward(**x, cp=4)
    for _ in range(3):
        again = stage.forward(**x, cp=4)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", [Problem(2, 8, (16384,)), Problem(2, 8, (16000, 3000, 192))],
                         ids=lambda p: p.label)
def test_cuda_graph_replay_equals_eager(stage, problem):
    """run decides and plans on the device: the whole forward captures, and replays bitwise."""
    x = problem.inputs("cuda", seed=3)
    B, T = x["q"].shape[:2]
    assert autocp.plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), 2, x["q"].device)
    eager = stage.run(**x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = stage.run(**x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    x["v"].mul_(-1)                                                 # new inputs, same tensors
    graph.replay()
    flipped = stage.run(**x)
    torch.cuda.synchronize()
    assert torch.equal(captured[0], flipped[0]) and torch.equal(captured[1], flipped[1])


def flag_every_third_chunk(x):
    """Problem inputs with the keys of every third chunk (rows 1, 4, 7, ... of the chunk table)
    times 3, ||k||^2 = 9, and there odd value heads beta ~ 1 with a decay of -3 to -4 a token
    (beta ||k||^2 > 2: gate_free_solve keeps the gate and flags the chunk) and even heads beta = 0.2
    (1.8 <= 2: not flagged), as in flashqla.testing.adversarial_inputs; other chunks unchanged (not
    flagged). An odd head's flags then change from chunk to chunk: a segment reading another
    chunk's flag applies its gate twice or not at all."""
    B, T, HV = x["g"].shape
    table, _ = chunk_table(x["cu_seqlens"], B, T, C, x["g"].device)
    third = torch.zeros(B * T, dtype=torch.bool, device=x["g"].device)
    for s, e in table[1::3].tolist():
        third[s:e] = True
    third = third.view(B, T, 1)
    odd = torch.arange(HV, device=third.device) % 2 == 1
    gen = torch.Generator(third.device).manual_seed(7)
    beta = torch.where(odd, 1 - 1e-3 * torch.rand(B, T, HV, generator=gen, device=third.device), 0.2)
    g = torch.where(odd, -3.0 - torch.rand(B, T, HV, generator=gen, device=third.device), x["g"])
    return {**x, "k": torch.where(third[..., None], 3 * x["k"], x["k"]),
            "beta": torch.where(third, beta, x["beta"]), "g": torch.where(third, g, x["g"])}


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,L", [(Problem(2, 8, (4096,)), 8),
                                       (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),
                                       (Problem(2, 8, (1000, 1000), varlen=False), 2)],
                         ids=lambda c: getattr(c, "label", str(c)))
@pytest.mark.parametrize("number", [8, 11, 13, 15, 17, 18, 20, 21, 22, 23, 24],
                         ids=["s08", "s11", "s13", "s15", "s17", "s18", "s20", "s21", "s22", "s23", "s24"])
def test_segments_read_their_own_chunks_gated_flags(number, problem, L):
    """Phase 3 of gdn_fwd.s08, s11, s13, s15, s17, s18, s20, s21, s22, s23 and s24 reads ``gated`` at each segment's rows of the whole
    sequences' chunk table (Plan.first_chunk): with flags that change from chunk to chunk, CP on is
    as close to float64 as CP off, head by head, and passes the gdn_fwd check. (No L is a multiple
    of the flags' period 3, so a segment reading its sequence's first rows would read other flags.)"""
    from flashqla.stages import load

    mod = load("gdn_fwd", number)
    x = flag_every_third_chunk(problem.inputs("cuda", seed=5))
    cu = x["cu_seqlens"]
    g_cum = load("chunk_local_cumsum", 1).run(x["g"], cu)
    _, gated = load("gate_free_solve", 1).solve(x["k"], x["beta"], g_cum, cu)
    odd = torch.arange(problem.HV, device="cuda") % 2 == 1
    assert gated[:, odd].any() and not gated[:, odd].all() and not gated[:, ~odd].any()
    on = mod.forward(**x, cp=L)
    off = mod.forward(**x, cp=False)
    want = ref.chunk_gated_delta_rule_ref(**cast_floats(x, F64))
    for got_on, got_off, w, axis in ((on[0], off[0], want[0], 2), (on[1], off[1], want[1], 1)):
        e_on, e_off = head_errors(got_on, w, axis), head_errors(got_off, w, axis)
        for h, (a, b) in enumerate(zip(e_on, e_off)):
            assert a <= TOLERANCE_FACTOR * max(b, ROUNDING_FLOOR), (h, a, b)
    check_op("gdn_fwd", lambda **kw: mod.forward(**kw, cp=L), x)


def break_the_bound(x):
    """Problem inputs where, on value head 1, one token in every 700 has g = +0.5, and on value head
    2 one token in every 900 has beta = -0.5: autocp.bound_violations counts both."""
    g, beta = x["g"].clone(), x["beta"].clone()
    g[:, ::700, 1] = 0.5
    beta[:, 350::900, 2] = -0.5
    return {**x, "g": g, "beta": beta}


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("inputs", ["plain", "flagged", "broken"])
@pytest.mark.parametrize("problem,L", GPU_CASES + [(Problem(2, 8, (9000,)), 100)],
                         ids=lambda c: getattr(c, "label", str(c)))
@pytest.mark.parametrize("threshold", [-10.0, -3.0])
def test_s18_windows_are_autocp_warmups(problem, L, inputs, threshold):
    """gdn_fwd.s18's windows kernel gives every (slot, value head) the window start and exact flag
    that ``autocp.warmup`` gives from ``autocp.bound_violations``: with g = 0 heads (exact: no
    window reaches the threshold), chunks flagged by the solve (beta ||k||^2 > 2), tokens with
    g > 0 or beta < 0, and a segment longer than the longest window (L = 100 > 64)."""
    from flashqla.stages import load

    mod = load("gdn_fwd", 18)
    x = problem.inputs("cuda", seed=4)
    x = {"plain": x, "flagged": flag_every_third_chunk(x), "broken": break_the_bound(x)}[inputs]
    B, T, HV = x["g"].shape
    cu = x["cu_seqlens"]
    g, beta = x["g"].float().contiguous(), x["beta"].float().contiguous()
    g_cum = load("chunk_local_cumsum", 1).run(g, cu, C).contiguous()
    _, gated = load(*mod.SOLVE).solve(x["k"], beta, g_cum, cu)
    p = mod.split_plan(cu, B, T, HV, 132, x["q"].device, L, 1.0)
    got = mod.windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV), gated, threshold)
    want = autocp.warmup(p, g_cum.view(B * T, HV), autocp.bound_violations(x["k"], g, beta), threshold)
    assert torch.equal(got[1], want[1]), "exact flags differ"
    assert torch.equal(got[0], want[0]), "window starts differ"
    assert want[1][p.slot_warm].any() and not want[1][p.slot_warm].all()  # both paths taken


def phase1_inputs(problem, L, inputs):
    """Phase 1's operands for ``problem`` split at L (s18's plan, windows and solve; ``inputs``:
    plain, flagged or broken) -> (the inputs, the plan, the exact flags, run), where
    ``run(compiled)`` builds a warm-up kernel with ``compiled(H, HV)`` and returns its (Z, M),
    both NaN before it runs."""
    from flashqla.stages import load

    s18 = load("gdn_fwd", 18)
    x = problem.inputs("cuda", seed=4)
    x = {"plain": x, "flagged": flag_every_third_chunk(x), "broken": break_the_bound(x)}[inputs]
    B, T, H, K = x["k"].shape
    HV = x["g"].shape[2]
    cu = x["cu_seqlens"]
    g, beta = x["g"].float().contiguous(), x["beta"].float().contiguous()
    g_cum = load("chunk_local_cumsum", 1).run(g, cu, C).contiguous()
    ab, gated = load(*s18.SOLVE).solve(x["k"], beta, g_cum, cu)
    p = s18.split_plan(cu, B, T, HV, 132, x["q"].device, L, 1.0)
    win_start, exact = s18.windows(p, g.view(B * T, HV), g_cum.view(B * T, HV), beta.view(B * T, HV), gated)
    args = (x["k"].view(B * T, H, K), x["v"].view(B * T, HV, K), ab.view(B * T, HV, C), g_cum.view(B * T, HV),
            gated, win_start, p.slot_start, p.slot_chunk, exact)

    def run(compiled):
        z = torch.full((win_start.shape[0], HV, K, K), float("nan"), device="cuda")
        m = torch.full_like(z, float("nan"))
        compiled(H, HV)(*args, z, m)
        return z, m
    return {**x, "g": g, "beta": beta, "gated": gated, "win_start": win_start}, p, exact, run


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("inputs", ["plain", "flagged", "broken"])
@pytest.mark.parametrize("problem,L", GPU_CASES + [(Problem(2, 8, (9000,)), 100)],
                         ids=lambda c: getattr(c, "label", str(c)))
def test_s20_warmup_gives_s18s_z_and_m(problem, L, inputs):
    """gdn_fwd.s20's warm-up kernel (warp roles) gives every slot's Z and M bit for bit as s18's
    (one warpgroup) does: the same operations on the same operands, in the same order, over
    windows of every kind (short, exact, none; flagged chunks; broken bound conditions)."""
    from flashqla.stages import load

    s18, s20 = load("gdn_fwd", 18), load("gdn_fwd", 20)
    x, p, exact, run = phase1_inputs(problem, L, inputs)
    (z18, m18), (z20, m20) = run(s18._compiled), run(s20._compiled)
    assert torch.equal(z20, z18), "Z differs"
    assert torch.equal(m20, m18), "M differs"
    assert exact[p.slot_warm].any() and z18.abs().sum() > 0 and m18.abs().sum() > 0  # both paths taken


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("inputs", ["plain", "flagged", "broken"])
@pytest.mark.parametrize("problem,L", GPU_CASES + [(Problem(2, 8, (9000,)), 100)],
                         ids=lambda c: getattr(c, "label", str(c)))
def test_s23_warmup_gives_s20s_z_and_m(problem, L, inputs):
    """gdn_fwd.s23's warm-up kernel (the chain split over a state and a value warpgroup, fast math)
    writes every slot's Z and M (NaN before it runs) as s20's (one chain warpgroup) does, up to
    rounding: its exponentials are ex2.approx, so a few bf16 snapshots of S round the other way.
    Bound: a bf16 half-ulp of S, 2^-9, relative L2; a wrong tile, column or chunk is off by O(1).
    (The forward's error head by head against float64 is ``test_cp_on_matches_cp_off``.)"""
    from flashqla.stages import load

    s20, s23 = load("gdn_fwd", 20), load("gdn_fwd", 23)
    x, p, exact, run = phase1_inputs(problem, L, inputs)
    (z20, m20), (z23, m23) = run(s20._compiled), run(s23._compiled)
    assert not (z23.isnan().any() or m23.isnan().any()), "a tile was not written"
    assert rel_l2(z23, z20) <= 2 ** -9 and rel_l2(m23, m20) <= 2 ** -9, (rel_l2(z23, z20), rel_l2(m23, m20))
    assert exact[p.slot_warm].any() and z20.abs().sum() > 0 and m20.abs().sum() > 0  # both paths taken


def windows_in_float64(x, win_start, slot_start, exact):
    """Phase 1 in float64 by the token recurrence: per (slot, value head) Z, the state from zero
    over the window [win_start, slot_start), and M, the state from I with v = 0 over it (exact
    heads; 0 for the others). x: varlen inputs (B = 1); [J N, HV, K, K] each."""
    k = ref.expand_heads(x["k"].to(F64), x["g"].shape[2])             # [1, T, HV, K]
    v, g, beta = (x[n].to(F64) for n in ("v", "g", "beta"))
    S, HV = win_start.shape
    K = k.shape[-1]
    z = torch.zeros(S, HV, K, K, dtype=F64, device=k.device)
    m = torch.zeros_like(z)
    eye = torch.eye(K, dtype=F64, device=k.device).expand(1, HV, K, K)
    for s in range(S):
        end, start = int(slot_start[s]), int(win_start[s].min())
        if end == start:
            continue
        # tokens before a head's own window start neither decay nor write (k = 0, g = 0)
        inside = (torch.arange(start, end, device=k.device)[:, None] >= win_start[s][None, :].long())[None]
        kw = torch.where(inside[..., None], k[:, start:end], 0)
        gw = torch.where(inside, g[:, start:end], 0)
        _, z[s] = ref.naive_recurrent_gated_delta_rule(kw, kw, v[:, start:end], gw, beta[:, start:end],
                                                       output_final_state=True)
        _, ms = ref.naive_recurrent_gated_delta_rule(kw, kw, torch.zeros_like(v[:, start:end]), gw,
                                                     beta[:, start:end], initial_state=eye,
                                                     output_final_state=True)
        m[s] = torch.where(exact[s].bool()[:, None, None], ms[0], 0)
    return z, m


@pytest.mark.parametrize("broken", [False, True])
def test_two_products_match_the_float64_windows_and_the_check_catches_a_wrong_factor(broken):
    """s44's algebra, S <- exp(g_C) S + X^T (E V - exp(g_C) K S) with X = Ab^T K chunk by chunk
    (``reference.gate_free_solve``'s Ab), in float64 on the CPU, gives ``windows_in_float64``'s Z
    and M (the token recurrence) to 1e-10; with XB's row factor E dropped (X^T (V - ...)) it misses
    them by more than the GPU test's bound allows (TOLERANCE_FACTOR x ROUNDING_FLOOR), so that test
    can fail for that bug."""
    problem, L = Problem(2, 4, (700, 1400), K=16, V=16), 4
    x = cast_floats(problem.inputs(), F64)
    B, T, H, K = x["k"].shape
    HV = problem.HV
    p = autocp.plan(x["cu_seqlens"], B, T, HV, 132, 2, CPU, force=L)
    g_cum = ref.chunk_local_cumsum(x["g"], x["cu_seqlens"]).view(B * T, HV)
    win_start, exact, _ = autocp.warmup(p, g_cum, autocp.bound_violations(x["k"], x["g"], x["beta"]))
    z64, m64 = windows_in_float64(x, win_start, p.slot_start, exact)
    k = ref.expand_heads(x["k"], HV).view(B * T, HV, K)
    v = x["v"].view(B * T, HV, -1)
    ab = ref.gate_free_solve(x["k"], x["beta"], x["cu_seqlens"]).view(B * T, HV, C)
    z, m = torch.zeros_like(z64), torch.zeros_like(m64)
    for slot in range(win_start.shape[0]):
        end = int(p.slot_start[slot])
        for h in range(HV):
            states = [(z, torch.zeros(K, K, dtype=F64))] + ([(m, torch.eye(K, dtype=F64))] if exact[slot, h] else [])
            for out, S in states:
                for t0 in range(int(win_start[slot, h]), end, C):      # whole chunks
                    kc, gam = k[t0:t0 + C, h], g_cum[t0:t0 + C, h]
                    vc = v[t0:t0 + C, h] if out is z else torch.zeros(C, K, dtype=F64)
                    X = ab[t0:t0 + C, h].T @ kc                        # Ab^T K
                    e = torch.ones(C, dtype=F64) if broken else (gam[-1] - gam).exp()
                    S = gam[-1].exp() * S + X.T @ (e[:, None] * vc - gam[-1].exp() * (kc @ S))
                out[slot, h] = S
    assert exact[p.slot_warm].any() and not exact[p.slot_warm].all()  # exact and warm-up windows
    err = max(rel_l2(z, z64), rel_l2(m, m64))
    if broken:
        assert rel_l2(z, z64) > TOLERANCE_FACTOR * ROUNDING_FLOOR, rel_l2(z, z64)
    else:
        assert err < 1e-10, err


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("inputs", ["plain", "flagged", "broken"])
@pytest.mark.parametrize("problem,L", [(Problem(2, 8, (4096,)), 8), (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),
                                       (Problem(2, 8, (9000,)), 100)], ids=lambda c: getattr(c, "label", str(c)))
def test_s44_warmup_is_as_close_to_float64_as_s23s(problem, L, inputs):
    """gdn_fwd.s44's warm-up (two products a chunk with X = Ab^T K; gated chunks through their own
    X) writes every slot's Z and M (NaN before it runs) within TOLERANCE_FACTOR x the relative L2
    error that s23's kernel, the one it replaces, makes against the float64 recurrence over the
    same windows, for Z and for M alike. Flagged chunks (the solve kept the gate) sit in exact
    windows; a wrong factor on them, or a dropped V^T XB, is off by O(1)."""
    from flashqla.stages import load

    s23, s44 = load("gdn_fwd", 23), load("gdn_fwd", 44)
    x, p, exact, run = phase1_inputs(problem, L, inputs)
    (z23, m23), (z44, m44) = run(s23._compiled), run(s44._warmup)
    assert not (z44.isnan().any() or m44.isnan().any()), "a tile was not written"
    z64, m64 = windows_in_float64(x, x["win_start"], p.slot_start, exact)
    for name, got, base, want in (("Z", z44, z23, z64), ("M", m44, m23, m64)):
        err, err23 = rel_l2(got.double(), want), rel_l2(base.double(), want)
        assert err <= TOLERANCE_FACTOR * max(err23, ROUNDING_FLOOR), (name, err, err23)
    assert exact[p.slot_warm].any() and z64.abs().sum() > 0 and m64.abs().sum() > 0  # both paths taken
    if inputs == "flagged":  # a gated chunk inside an exact window
        rows = torch.cat([torch.arange(int(c) - L, int(c)) for c, w in zip(p.slot_chunk.tolist(), p.slot_warm.tolist()) if w])
        assert (x["gated"][rows.to(x["gated"].device)] != 0).any()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("bounds, L", [([0, 32768], 32), ([0, 3000, 3001, 3700, 6200, 6264, 7564], 4),
                                       ([0, 28672, 32768], 64)])
def test_s21_chaining_is_as_close_to_float64_as_the_matmuls(bounds, L):
    """gdn_fwd.s21's one-kernel phase 2 gives ``autocp.segment_initial_states``' states to fp32
    rounding, and is as close to the same chaining in float64 as the fp32 batched matmuls are
    (M zero where a (slot, head) is not exact, as phase 1 writes it)."""
    from flashqla.stages import load

    mod = load("gdn_fwd", 21)
    HV, K = 8, 128
    p = autocp.host_plan(bounds, L, "cuda")
    J, N = p.max_segments, p.num_seqs
    gen = torch.Generator("cuda").manual_seed(9)
    h0 = torch.randn(N, HV, K, K, generator=gen, device="cuda")
    z = torch.randn(J * N, HV, K, K, generator=gen, device="cuda")
    exact = (torch.rand(J * N, HV, generator=gen, device="cuda") < 0.4).float()
    m = torch.randn(J * N, HV, K, K, generator=gen, device="cuda") * 0.08 * exact[..., None, None]
    want = autocp.segment_initial_states(p, h0, z, m)
    exact64 = autocp.segment_initial_states(p, h0.double(), z.double(), m.double())
    got = mod.segment_initial_states(p, h0, z, m)
    assert rel_l2(got, want) < 1e-5, rel_l2(got, want)
    assert rel_l2(got, exact64) <= 2 * rel_l2(want, exact64) + 1e-7, (rel_l2(got, exact64), rel_l2(want, exact64))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("bounds, L", [([0, 32768], 32), ([0, 3000, 3001, 3700, 6200, 6264, 7564], 4),
                                       ([0, 28672, 32768], 64)])
def test_s24_chain_writes_s21s_states_by_row_without_reading_unneeded_m(bounds, L):
    """gdn_fwd.s24's phase 2 writes every real segment row (NaN before it runs) with s21's state
    for it, bit for bit, and never reads M of a (sequence, head) with no exact slot: there M is
    NaN, and s21 gets zeros (what phase 1 writes)."""
    from flashqla.stages import load

    s21, s24 = load("gdn_fwd", 21), load("gdn_fwd", 24)
    HV, K = 8, 128
    p = autocp.host_plan(bounds, L, "cuda")
    J, N = p.max_segments, p.num_seqs
    gen = torch.Generator("cuda").manual_seed(9)
    h0 = torch.randn(N, HV, K, K, generator=gen, device="cuda")
    z = torch.randn(J * N, HV, K, K, generator=gen, device="cuda")
    exact = (torch.rand(J * N, HV, generator=gen, device="cuda") < 0.4).int()
    exact[:, :3] = 0                                          # heads 0-2: no exact slot anywhere
    exact[:N] = 0                                             # a sequence's first slot has no window
    m = torch.randn(J * N, HV, K, K, generator=gen, device="cuda") * 0.08 * exact[..., None, None]
    want = s21.segment_initial_states(p, h0, z, m)
    m[:, :3] = float("nan")
    rows = p.row_of_slot[p.row_of_slot >= 0].long()
    got = torch.full((p.bounds.shape[0] - 1, HV, K, K), float("nan"), device="cuda")
    s24._chain(HV)(h0, z, m, exact, p.row_of_slot, got)
    assert torch.equal(got[rows], want[rows]), (got[rows] - want[rows]).abs().max()
    assert exact[:, 3:].any()                                 # both paths taken


@pytest.mark.gpu
@pytest.mark.hopper
def test_s18_captures_without_an_eager_call():
    """Captured with a ``cu_seqlens`` the host has never read, gdn_fwd.s18 plans on the device (no
    host plan, no lengths): the replay is as close to float64 as the eager split, head by head."""
    from flashqla.stages import load

    mod = load("gdn_fwd", 18)
    x = Problem(2, 8, (16000, 3000, 192)).inputs("cuda", seed=6)
    eager = mod.run(**x)
    fresh = {**x, "cu_seqlens": x["cu_seqlens"].clone()}               # not read by the host yet
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mod.run(**fresh)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.chunk_gated_delta_rule_ref(**cast_floats(x, F64))
    for got_cap, got_eager, w, axis in ((captured[0], eager[0], want[0], 2), (captured[1], eager[1], want[1], 1)):
        e_cap, e_eager = head_errors(got_cap, w, axis), head_errors(got_eager, w, axis)
        for h, (a, b) in enumerate(zip(e_cap, e_eager)):
            assert a <= TOLERANCE_FACTOR * max(b, ROUNDING_FLOOR), (h, a, b)


@pytest.mark.parametrize("number, constant, value", [(18, "PHASE3_CTAS_PER_SM", 1), (18, "FIXED_STEPS", 0),
                                                     (20, "SEGMENT_STEPS", 0), (20, "SEGMENT_CHUNK_STEPS", 3.2),
                                                     (22, "SEGMENT_STEPS", 3.8), (22, "SEGMENT_CHUNK_STEPS", 2.6),
                                                     (23, "SEGMENT_CHUNK_STEPS", 2.0), (23, "FIXED_STEPS", 10),
                                                     (24, "SEGMENT_CHUNK_STEPS", 1.1), (24, "FIXED_STEPS", 36),
                                                     (25, "WAVE_CHUNK_STEPS", 1.5), (25, "FIXED_STEPS", 60)])
def test_rule_check_catches_a_wrong_rule(number, constant, value, monkeypatch):
    """The check above fails for an s18 rule that fills one CTA an SM (L = 64 on (2, 8) 1 x 32768:
    0.78 ms against 0.56 at L = 32) or forgets the fixed cost (splits 1 x 8192, which lost), and
    for an s20 rule that forgets phase 2's cost per segment (L = 8 on (2, 8) 1 x 8192: 0.27 ms
    against 0.23 at L = 16) or overprices a chunk (no split there), and for an s22 rule with s20's
    price of a segment (L = 16 on (2, 8) 1 x 8192: 0.193 ms against 0.185 at L = 8) or of a chunk
    (no split of (8, 24) 1 x 32768: 1.124 ms against 0.968 at L = 96), and for an s23 rule with
    s22's price of a chunk (no split of (16, 32) 1 x 32768: 1.150 ms against 1.061 at L = 128) or
    of the fixed cost (L = 8 on (2, 8) 1 x 2048: 0.100 ms against 0.094 unsplit), and for an s24
    rule with s23's price of a chunk or its fixed cost (L = 32 on (16, 32) 1 x 8192: 0.333 ms
    against 0.318 unsplit), and for an s25 rule with s24's price of a chunk (the same split of
    (16, 32) 1 x 8192) or too large a fixed cost (no split of (4, 16) 1 x 8192: 0.281 ms against
    0.208 at L = 16)."""
    from flashqla.stages import load

    monkeypatch.setattr(load("gdn_fwd", number), constant, value)
    with pytest.raises(AssertionError):
        for label in split_sweep(SWEEP_OF[number]):
            test_rule_picks_a_fastest_measured_split(number, label)


@pytest.mark.parametrize("constant, value", [("WAVE_CHUNK_STEPS", 2.45), ("WY_STEP", 1.0)])
def test_s44_rule_check_catches_a_wrong_rule(constant, value, monkeypatch):
    """The check above fails for s44's rule with s25's price of a chunk (no split of (8, 32) 1x8192:
    0.294 ms against 0.246 at L 32) or with the WY launch at s16's step (L 64 on (16, 48) 1x32768:
    1.19 ms against 1.04 unsplit)."""
    from flashqla.stages import load

    monkeypatch.setattr(load("gdn_fwd", 44), constant, value)
    with pytest.raises(AssertionError):
        for label in S44_CASES:
            test_s44_rule_picks_a_fastest_measured_split(label, monkeypatch)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(2, 8, (2000,)), None),                                 # unsplit, two heads a solve CTA
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # varlen, split
    (Problem(16, 64, (700, 650, 700, 1, 700)), False),              # BV 128
    (Problem(2, 8, (777, 5000), initial_state=False), 2),           # 42 segments
], ids=["short", "varlen-L4", "wide", "no-h0-L2"])
def test_s27_dependent_launches_give_s26s_bits(problem, cp):
    """gdn_fwd.s27 runs s26's kernels as programmatic dependents (each waits on the one before it
    inside the kernel): the same bits as s26, eagerly and from a CUDA graph that holds two forwards
    back to back (the second's kernels waiting on the first's), replayed on new inputs."""
    from flashqla.stages import load

    assert_same_bits_eager_and_in_a_graph(load("gdn_fwd", 27), load("gdn_fwd", 26), problem, cp, seed=3)


def assert_same_bits_eager_and_in_a_graph(stage, before, problem, cp, seed):
    """``stage.forward`` gives ``before.forward``'s bits on two input sets: eagerly, from a CUDA graph
    holding both forwards back to back, and from that graph replayed on new inputs."""
    x = problem.inputs("cuda", seed=seed)
    y = {**x, "v": -x["v"], "q": x["k"]}
    want_x, want_y = before.forward(**x, cp=cp), before.forward(**y, cp=cp)
    for got, want in ((stage.forward(**x, cp=cp), want_x), (stage.forward(**y, cp=cp), want_y)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first, second = stage.forward(**x, cp=cp), stage.forward(**y, cp=cp)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in ((first, want_x), (second, want_y)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x["v"].mul_(-1)                                                 # new inputs, same tensors
    y["v"].mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in ((first, before.forward(**x, cp=cp)), (second, before.forward(**y, cp=cp))):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(2, 8, (2000,)), None),                                 # unsplit
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # varlen, split
    (Problem(16, 64, (700, 650, 700, 1, 700)), False),              # BV 128
    (Problem(4, 16, (333, 333), varlen=False), 2),                  # a batch: no cu_seqlens
], ids=["short", "varlen-L4", "wide", "batch-L2"])
def test_s29_table_from_the_cumsum_gives_s28s_bits(problem, cp):
    """gdn_fwd.s29 builds the chunk table in its cumsum (chunk_local_cumsum.s03) where s28 took it
    from varlen: the same bits, eagerly and from a CUDA graph holding two forwards, replayed on new
    inputs."""
    from flashqla.stages import load

    assert_same_bits_eager_and_in_a_graph(load("gdn_fwd", 29), load("gdn_fwd", 28), problem, cp, seed=5)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(8, 24, (2048,)), None),                                # the solve at six CTAs an SM
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # at four: s29's kernels
], ids=["one-wave", "varlen-L4"])
def test_s30_solve_in_one_wave_gives_s29s_bits(problem, cp):
    """gdn_fwd.s30 runs s29's kernels with the solve at gate_free_solve.s12's launch bounds: the
    same bits, eagerly and from a CUDA graph holding two forwards, replayed on new inputs."""
    from flashqla.stages import load

    s30 = load("gdn_fwd", 30)
    x = problem.inputs("cpu")
    B, T = x["q"].shape[:2]
    rows = num_chunk_rows(x["cu_seqlens"], B, T, s30.CHUNK_SIZE)
    ctas = s30.SOLVE.ctas_per_sm(problem.H, problem.HV, rows, autocp.num_sms("cuda"))
    assert (ctas == s30.SOLVE.ONE_WAVE_CTAS_PER_SM) == (problem.HV == 24)
    assert_same_bits_eager_and_in_a_graph(s30, load("gdn_fwd", 29), problem, cp, seed=6)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(2, 8, (2000,)), None),                                 # the cumsum in the solve, 2 heads a CTA
    (Problem(8, 24, (2048,)), None),                                # ... 1 head a CTA, six CTAs an SM
    (Problem(4, 16, (333, 333), varlen=False), 2),                  # ... a batch (no cu_seqlens), split
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # 4 heads a CTA: s30's two kernels
], ids=["short", "one-wave", "batch-L2", "varlen-L4"])
def test_s31_cumsum_in_the_solve_gives_s30s_bits(problem, cp):
    """gdn_fwd.s31 makes the chunk table and g_cum in the solve's prologue where s08's kernel solves
    (gate_free_solve.s13): the same bits as s30, eagerly and from a CUDA graph holding two
    forwards, replayed on new inputs."""
    from flashqla.stages import load

    assert_same_bits_eager_and_in_a_graph(load("gdn_fwd", 31), load("gdn_fwd", 30), problem, cp, seed=7)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(2, 8, (2000,)), None),                                 # two heads a CTA: five CTAs an SM
    (Problem(16, 16, (4096,) * 3), None),                           # one head a CTA: six, many waves
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # 4 heads a CTA: s31's two kernels
], ids=["two-heads", "one-head", "varlen-L4"])
def test_s32_ctas_by_heads_gives_s31s_bits(problem, cp):
    """gdn_fwd.s32 compiles the cumsum-and-solve kernel at gate_free_solve.s14's CTAs an SM: the same
    bits as s31, eagerly and from a CUDA graph holding two forwards, replayed on new inputs."""
    from flashqla.stages import load

    assert_same_bits_eager_and_in_a_graph(load("gdn_fwd", 32), load("gdn_fwd", 31), problem, cp, seed=8)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(2, 8, (2000,)), None),                                 # BV 16: 64 CTAs
    (Problem(16, 16, (1000,)), None),                               # BV 16: 128 CTAs
    (Problem(4, 16, (333, 333), varlen=False), 2),                  # split: phase 3's width
], ids=["narrow", "one-wave", "batch-L2"])
def test_s33_sixteen_columns_give_s32s_bits(problem, cp):
    """gdn_fwd.s33 runs the fused kernel at BV 16 where one wave holds it: a value column's chain does
    not depend on the others, so o and the final state are s32's bits, eagerly and from a CUDA graph
    holding two forwards, replayed on new inputs."""
    from flashqla.stages import load

    s33 = load("gdn_fwd", 33)
    x = problem.inputs("cpu")
    B, T = x["q"].shape[:2]
    width = s33.S27.S18.PIPELINE.launch_width(x["cu_seqlens"], B, T, problem.HV, 128, autocp.num_sms("cuda"),
                                              s33.STEP)
    assert (width == 16) == (cp is None)
    assert_same_bits_eager_and_in_a_graph(s33, load("gdn_fwd", 32), problem, cp, seed=9)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(16, 48, (3000,)), None),                               # one sequence, a partial last chunk
    (Problem(16, 64, (700, 650, 700, 1, 700)), False),              # BV 128, varlen, a one-token sequence
    (Problem(16, 32, (4000, 300)), 3),                              # split: segment rows
], ids=["one", "varlen", "split"])
@pytest.mark.parametrize("stage", [34, 35])
def test_s34_s35_wide_kernels_give_the_previous_bits(problem, cp, stage):
    """gdn_fwd.s34's wide kernel computes what s16's does in the same order (O's row factor is the same
    ex2.approx of the same g), and s35's what s34's does (WY by the same formula in another role): o
    and the final state are the previous stage's bits, eagerly and from a CUDA graph holding two
    forwards, replayed on new inputs. The first two problems run the wide kernel (BV 64 or 128)."""
    from flashqla.stages import load

    mod = load("gdn_fwd", stage)
    x = problem.inputs("cpu")
    B, T = x["q"].shape[:2]
    width = mod.S27.S18.PIPELINE.launch_width(x["cu_seqlens"], B, T, problem.HV, 128, autocp.num_sms("cuda"),
                                              mod.STEP)
    assert width >= 64 or cp
    assert_same_bits_eager_and_in_a_graph(mod, load("gdn_fwd", stage - 1), problem, cp, seed=10)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, flagged", [
    (Problem(16, 64, (2000, 333)), False),                          # BV 64, varlen, a partial last chunk
    (Problem(16, 64, (700, 650, 700, 1, 700)), False),              # BV 128, a one-token sequence
    (Problem(16, 64, (1700,), varlen=False), False),                # no cu_seqlens
    (Problem(8, 32, (2500, 1, 700)), False),                        # four heads a CTA of (8, 32)
    (Problem(16, 48, (3000,)), False),                              # three heads a CTA
    (Problem(16, 48, (3000,)), True),                               # ... with flagged chunks
], ids=["varlen", "bv128", "batch", "8-32", "16-48", "flagged"])
def test_s36_wy_in_the_solve_passes_the_check(problem, flagged):
    """gdn_fwd.s36 where it stores WY in the solve (``stores_wy``): the gdn_fwd check against float64,
    also with chunks whose beta ||k||^2 > 2 (the solve's gated path: Ab already holds the gate); and
    the same bits eagerly, from a CUDA graph and replayed on new inputs."""
    from flashqla.stages import load

    s36 = load("gdn_fwd", 36)
    x = problem.inputs("cuda", seed=11)
    if flagged:  # keys of 60 tokens of the second chunk 2.5x longer: beta ||k||^2 > 2 for most of them
        x["k"][:, 70:130] *= 2.5
    assert s36.stores_wy(x["q"], x["v"], x["cu_seqlens"], None)
    check_op("gdn_fwd", lambda **kw: s36.forward(**kw), x)
    if not flagged:
        assert_same_bits_eager_and_in_a_graph(s36, s36, problem, None, seed=12)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", [
    Problem(16, 64, (2000, 5, 333, 70)),                            # partial chunks, a 5-token sequence
    Problem(16, 48, (3000,), initial_state=False),                  # three heads a CTA, no h0
    Problem(8, 32, (2500, 1, 700)),                                 # a one-token sequence
    Problem(16, 64, (1700,), varlen=False),                         # no cu_seqlens
], ids=["varlen", "16-48", "8-32", "batch"])
def test_s38_chain_ahead_gives_s37s_bits(problem):
    """gdn_fwd.s38's wide kernel (the chain waits on no scores, S and V~ in two slots) computes what
    s36's does where s37 runs it: V~'s rows past a sequence's end differ, but only Vd's mask (zero,
    as s36's zeroed WY rows made it) and P's zero columns meet them. The same bits as s37, eagerly and
    from a CUDA graph replayed on new inputs; and the gdn_fwd check against float64."""
    from flashqla.stages import load

    s37, s38 = load("gdn_fwd", 37), load("gdn_fwd", 38)
    x = problem.inputs("cuda", seed=13)
    assert s37.stores_wy(x["q"], x["v"], x["cu_seqlens"], None)
    check_op("gdn_fwd", lambda **kw: s38.forward(**kw), x)
    assert_same_bits_eager_and_in_a_graph(s38, s37, problem, None, seed=14)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, flagged", [
    (Problem(16, 64, (2000, 5, 333, 70)), False),                   # partial chunks, a 5-token sequence
    (Problem(16, 48, (3000,), initial_state=False), False),         # three heads a CTA, no h0
    (Problem(8, 32, (2500, 1, 700)), False),                        # a one-token sequence
    (Problem(16, 64, (1700,), varlen=False), False),                # no cu_seqlens
    (Problem(16, 48, (3000,)), True),                               # flagged chunks
], ids=["varlen", "16-48", "8-32", "batch", "flagged"])
@pytest.mark.parametrize("number", [39, 40, 41, 42, 43])
def test_state_in_registers_forwards_pass_the_check(problem, flagged, number):
    """gdn_fwd.s39-s43 where their kernel runs (s37's ``stores_wy``): the gdn_fwd check against
    float64, also with chunks whose beta ||k||^2 > 2 (the solve's gated path); and the same bits
    eagerly, from a CUDA graph and replayed on new inputs (s40: s39's bits; s41 rounds another
    product, its own; s42 and s43 run s40's kernel after gate_free_solve.s15's solve, their own)."""
    from flashqla.stages import load

    stage = load("gdn_fwd", number)
    x = problem.inputs("cuda", seed=15)
    if flagged:  # keys of 60 tokens of the second chunk 2.5x longer: beta ||k||^2 > 2 for most of them
        x["k"][:, 70:130] *= 2.5
    assert stage.S37.stores_wy(x["q"], x["v"], x["cu_seqlens"], None)
    check_op("gdn_fwd", lambda **kw: stage.forward(**kw), x)
    if not flagged:
        assert_same_bits_eager_and_in_a_graph(stage, load("gdn_fwd", number if number in (41, 42, 43) else 39), problem, None,
                                              seed=16)


def test_s33_goes_to_sixteen_columns_only_on_short_single_sequences():
    """gdn_fwd.s33's width rule on the benchmark's 40 problems (132 SMs): BV 16 on the unsplit single
    sequences of (2, 8), (4, 16) and (16, 16) at 1x2048, and nowhere else; AutoCP's split and phase
    3's width as s32's everywhere."""
    from flashqla.bench import PROBLEMS
    from flashqla.stages import load

    s33 = load("gdn_fwd", 33)
    fused, old_step = s33.S27.S18.PIPELINE, s33.S27.S18.WIDTHS.step
    sixteen = set()
    for p in PROBLEMS:
        seq_chunks = [-(-n // s33.CHUNK_SIZE) for n in p.lengths]
        splits = []
        for step in (old_step, s33.STEP):
            BV = fused.block_v(seq_chunks, p.HV, 128, 132, step)
            L = s33.S27.PIPELINE.segment_chunks(seq_chunks, p.HV, 132, step[BV], None)
            rows = sum(-(-c // L) for c in seq_chunks) if L else 0
            splits.append((L, fused.block_v([1] * rows, p.HV, 128, 132, step) if L else None))
            if step is s33.STEP and BV == 16 and not L:   # the launch runs at 16
                sixteen.add(p.label)
        assert splits[0] == splits[1], p.label
    assert sixteen == {"(2, 8) 1x2048", "(4, 16) 1x2048", "(16, 16) 1x2048"}
