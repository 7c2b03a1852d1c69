# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Backward AutoCP
#
# Chapter 07's backward has two sequential walks: the forward's state chain, recomputed, and the
# reverse chain of the state's gradient. Both run one chain per (sequence, value head), so the
# backward starves the card on a long sequence with few heads, as the forward did before AutoCP
# (chapter 06). This chapter cuts the backward's walks into segments too, derives why that is
# exact (or, with a warm-up, within a bound), and measures the milestone stage `gdn_bwd.s03`, whose
# plan the library's backward runs wherever its rule splits.
#
# **What you will learn**
#
# - the reverse chain over segments: each segment's $dZ_j$ (its reverse walk from zero) and $M_j^\top$,
#   chained from the sequence's final-state gradient, $dh_{j-1} = dZ_j + M_j^\top dh_j$; with each
#   segment's own $h_j$ and $dh_j$, its local backward gives every gradient exactly;
# - the backward warm-up: a decaying head forgets the gradient going backwards, so a window counted
#   from the segment's *start* is enough, within $e^{-10}$; exact heads chain $M_j^\top$;
# - what `flashqla.bwd` launches when it splits, and when its rule splits;
# - what the split measured against s02, FLA and FlashQLA, and why fusing the reverse kernel
#   without warp roles (`gdn_bwd.s04`, lab log) lost.
#
# **What you need first**
#
# - chapter 06: the segment states $h_{j+1} = M_j h_j + Z_j$, the warm-up bound, the exact path for
#   $g = 0$ heads, and `flashqla.autocp`'s device-built plan;
# - chapter 07: the reverse state recurrence (`chunk_bwd_dhu`), `gdn_bwd.s02` and its walk kernel;
# - no GPU: everything below runs in float64 on the CPU or reads committed measurements.

# %%
import math

import matplotlib.pyplot as plt
import torch

from flashqla import autocp, bench, bwd, reference, stages
from flashqla.exercises.ch08 import check_backward_window, check_reverse_chain
from flashqla.testing import PUBLIC_HEADS, Problem, cast_floats, rel_l2

f64 = torch.float64
C = reference.CHUNK_SIZE
RESULTS = bench.RESULTS
SMS = 132                                          # an H100's SMs


def upstream(shape, seed):
    """Fixed random upstream gradients (a loss linear in the outputs)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def rows_of(csv_name):
    """{(problem, impl): row} of a committed results CSV."""
    return {(r["problem"], r["impl"]): r for r in bench.read_csv(RESULTS / csv_name)}


S02, S03, S04 = (f"fwd + gdn_bwd/{s}" for s in ("s02_fused_walks", "s03_autocp_walks", "s04_fused_reverse"))

# %% [markdown]
# ## 1. Why: the walks are sequential per (sequence, value head)
#
# `gdn_bwd.s02`'s walk kernel runs each walk as `bwd.WALK_LANES` CTAs per (sequence, value head):
# two roles (the forward's chain, the reverse one) times two tiles of 64 value columns, one CTA an
# SM. On a single long sequence each CTA walks every chunk, one after another; with few value heads
# most of the 132 SMs of an H100 have nothing to do. The committed rows of the run that timed s02
# and s03 beside FLA and FlashQLA (`profiles/results/gdn_train_s03.csv`), training steps in ms:

# %%
s03_rows = rows_of("gdn_train_s03.csv")
problems = list(dict.fromkeys(p for p, _ in s03_rows))
print("; ".join(sorted({f"{r['gpu']}, commit {r['commit']}, {r['method']}" for r in s03_rows.values()})))
print(f"{'problem':16s} {'walk CTAs':>9s} {'chunks each':>11s} {'SMs idle':>8s} {'s02 ms':>7s} "
      f"{'FlashQLA ms':>11s} {'s02 / FlashQLA':>14s}")
behind = {}
for label in problems:
    H, HV = map(int, label[1:label.index(")")].split(", "))
    tokens = int(label.split("x")[-1])
    ctas = bwd.WALK_LANES * HV
    s02, fq = float(s03_rows[label, S02]["ms"]), float(s03_rows[label, bench.FLASHQLA_ROW]["ms"])
    behind[label] = fq / s02
    print(f"{label:16s} {ctas:9d} {tokens // C:11d} {SMS - ctas:8d} {s02:7.3f} {fq:11.3f} {fq / s02:13.2f}x")
assert [round(v, 2) for v in behind.values()] == [0.46, 0.33, 0.51, 0.44] and bwd.WALK_LANES * 8 == 32

# %% [markdown]
# On these problems s02's step runs at 0.33-0.51x FlashQLA's speed. At (2, 8) on 32768 tokens, 32
# CTAs each walk 512 chunks while 100 SMs idle. FlashQLA cuts its backward into segments (its
# backward AutoCP); so does `gdn_bwd.s03`, with the forward's machinery of chapter 06 and one new
# piece: the reverse chain of the gradient over segments.
#
# ## 2. The math: the reverse chain over segments
#
# **Forward (chapter 06, one line).** The state entering segment $j + 1$ is
# $h_{j+1} = M_j h_j + Z_j$: $M_j$ the product of the segment's chunk transitions, $Z_j$ its final
# state from zero (`reference.segment_states`).
#
# **Backward.** Chapter 07's reverse recurrence, with the terms in $dS'$ collected, is affine in
# $dS'$ too: per chunk, $dS = M_c^\top dS' + R_c^\top dO$, where $M_c$ is the forward's chunk
# transition (the gradient of an affine map goes back through the transpose of its linear part).
# Over a segment of chunks $a \dots b$:
#
# $$dS_\text{entering} = M_j^\top\, dS_\text{leaving} + dZ_j, \qquad M_j^\top = M_a^\top \cdots M_b^\top,$$
#
# with $dZ_j$ the reverse walk from $dS' = 0$ over the segment with its own $dO$ (what the segment
# contributes whatever comes after it). The gradient entering segment $j$ is the one leaving
# segment $j - 1$, so with $dh_j$ the gradient of the state leaving segment $j$,
#
# $$dh_{J-1} = dS_T \;(\text{the sequence's } dht), \qquad dh_{j-1} = dZ_j + M_j^\top dh_j ,$$
#
# a short chain from the last segment to the first. Given $h_j$ and $dh_j$, each segment is a
# sequence of its own: its local backward (chapter 07, from initial state $h_j$ and final-state
# gradient $dh_j$) gives the gradients of all its tokens, and the first segment's gives $dh_0$.
#
# The references below walk the step in its gate-cancelled form (`reference.dh_chain_cancelled`,
# FlashQLA's `cp_bwd`): $M_c^\top = e^{\gamma_C}(I - X^\top K)$ with $X = A_b K$ from the gate-free
# solve, and $R_c$ without any decay matrix; s03's dh warm-up kernel walks the same step in s02's
# form, with $w$ (chapter 07). Neither needs $v$ or $h$: the gradient of a state depends only on
# what comes after it. Checked in float64 on three sequences with the three gate kinds of every
# `Problem` (value head 0: $g = 0$; 1: strong decay; 2, 3: ordinary), segments of $L = 3$ chunks:

# %%
p = Problem(2, 4, (600, 200, 130), K=16, V=16)
x = cast_floats(p.inputs(), f64)
q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
o, ht = reference.naive_recurrent_gated_delta_rule(**x)
do, dht = upstream(o.shape, 1), upstream(ht.shape, 2)
want = reference.chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu)

g_cum = reference.chunk_local_cumsum(g, cu)
Ab, gated = reference.flagged_solve(k, g_cum, beta, cu)            # the forward's solve
w, _ = reference.chunk_fwd_intra(k, v, g_cum, beta, cu)
dh, _, _ = reference.chunk_bwd_dhu(q, k, w, g_cum, h0, dht, do, reference.chunk_bwd_dv_local(q, k, do, g_cum, cu_seqlens=cu),
                                   cu_seqlens=cu)
dh_c, dh0_c = reference.dh_chain_cancelled(q, k, g_cum, Ab, gated, do, dht, cu_seqlens=cu)
print(f"gate-cancelled chain vs chapter 07's chunk_bwd_dhu: dh {rel_l2(dh_c, dh):.1e}, dh0 {rel_l2(dh0_c, want[5]):.1e}")
assert rel_l2(dh_c, dh) < 1e-12 and rel_l2(dh0_c, want[5]) < 1e-12

L = 3
h_seg = reference.segment_states(k, v, g, beta, L, h0, cu)                     # [N, J, HV, K, V]
dh_seg, dz, m = reference.segment_state_grads(q, k, g_cum, Ab, gated, do, L, dht, cu_seqlens=cu)
print("h_seg, dh_seg, dz:", tuple(h_seg.shape), "  m:", tuple(m.shape), "  [N, J, HV, ...]")

# M_j is the forward's segment transition: the product of chapter 06's chunk transitions
M_chunk = reference.chunk_transition(k, g_cum, beta, cu)                       # [N, NT, HV, K, K]
for j in range(m.shape[1]):
    prod = torch.eye(16, dtype=f64).expand_as(m[:, j])
    for c in range(j * L, min((j + 1) * L, M_chunk.shape[1])):
        prod = M_chunk[:, c] @ prod
    assert rel_l2(m[:, j], prod) < 1e-12, j

# the chain's dh_j against the unsplit backward's dh at each segment's last chunk
unpacked = reference.Chunking(1, k.shape[1], cu, C, "cpu").unpack_chunks(dh)  # [N, NT, HV, K, V]
worst = 0.0
for n, length in enumerate(p.lengths):
    n_chunks = -(-length // C)
    for j in range(-(-n_chunks // L)):
        boundary = unpacked[n, min((j + 1) * L, n_chunks) - 1]
        worst = max(worst, rel_l2(dh_seg[n, j], boundary))
print(f"dh_j (chained over segments) vs the unsplit dh at the boundaries: max rel err {worst:.1e}")
assert worst < 1e-12

# %% [markdown]
# Now every segment as a sequence of its own: a varlen problem whose sequences are the segments
# (they start on chunk boundaries, so the chunking is the same), each with its $h_j$ as initial
# state and its $dh_j$ as final-state gradient, through the unsplit reference backward:

# %%
seg_bounds, seg_of = [0], []                      # the segment rows, in token order
for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
    for j in range(-(-(e - s) // (C * L))):
        seg_bounds.append(min(s + C * L * (j + 1), e))
        seg_of.append((n, j))
local = reference.chunk_gated_delta_rule_bwd_ref(
    q, k, v, g, beta, do, torch.stack([dh_seg[n, j] for n, j in seg_of]),
    initial_state=torch.stack([h_seg[n, j] for n, j in seg_of]), cu_seqlens=torch.tensor(seg_bounds))
errs = {name: rel_l2(a, b) for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), local, want)}
errs["dh0"] = rel_l2(local[5][[i for i, (_, j) in enumerate(seg_of) if j == 0]], want[5])
print(f"{len(seg_of)} segment rows; their local backwards vs the unsplit one:",
      {n: f"{e:.0e}" for n, e in errs.items()})
assert max(errs.values()) < 1e-12, errs

# %% [markdown]
# The whole sequence is one segment too: its $dh_0$ is the walk from zero plus
# $M^\top dS_T$, with $M$ the sequence's transition (`reference.sequence_transition`, which
# `flashqla.cp` uses across GPUs). The gradient is linear in $dS_T$:

# %%
no_dht = reference.chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, None, initial_state=h0, cu_seqlens=cu)
M_seq = reference.sequence_transition(k, g, beta, cu)                          # [N, HV, K, K]
err = rel_l2(want[5] - no_dht[5], M_seq.mT @ dht)
print(f"dh0(dht) - dh0(0) vs M^T dht: rel err {err:.1e}")
assert err < 1e-12

# %% [markdown]
# ## 3. The backward warm-up
#
# The exact chain needs $M_j^\top$, a $K \times K$ matrix per segment and head, from a walk over the
# whole segment with $K$ more columns. As in the forward, a decaying head does not need it. Walk
# segment $j$'s reverse chain from zero over only its first $w$ chunks (a *window*): the chain
# enters the segment at its start, and a gradient leaving chunk $a + w - 1$ reaches the start only
# through $M_w^\top$, the transpose of the window's transition. The dropped term is
# $M_w^\top dS_w$ ($dS_w$ the true gradient leaving the window), and since
# $\|M_w^\top\|_2 = \|M_w\|_2 \le \exp(\sum_{t \in \text{window}} g_t)$ under chapter 06's
# conditions ($g_t \le 0$, $0 \le \beta_t \|k_t\|^2 \le 2$),
#
# $$\|dh_{j-1}^\text{warm} - dh_{j-1}\|_F \le \exp\Big(\sum_{t \in \text{window}} g_t\Big)\, \|dS_w\|_F .$$
#
# The window is counted from the segment's **start** forwards (the gradient flows backwards, from
# the segment's end to its start), until the cumulative log decay reaches `autocp.THRESHOLD`; the
# forward's window ends at the segment's start instead. One sequence of 2048 tokens, five value
# heads with constant per-token log decays, $L = 16$: the gradient leaving segment 0 from windows
# of $w = 1 \dots 16$ chunks of segment 1, against the bound (dashed):

# %%
rates = (0.0, -0.002, -0.01, -0.04, -0.15)       # log decay per token, one value head each
xw = cast_floats(Problem(1, len(rates), (2048,), K=32, V=32).inputs(seed=1), f64)
xw["g"] = torch.tensor(rates, dtype=f64).expand_as(xw["g"]).clone()
gw = reference.chunk_local_cumsum(xw["g"])
Abw, gatedw = reference.flagged_solve(xw["k"], gw, xw["beta"])
dow, dhtw = upstream(xw["v"].shape, 3), upstream((1, len(rates), 32, 32), 4)
argsw = (xw["q"], xw["k"], gw, Abw, gatedw, dow)
Lw = 16
true = reference.segment_state_grads(*argsw, Lw, dhtw)[0][0, 0]                # leaving segment 0
per_chunk = reference.segment_state_grads(*argsw, 1, dhtw)[0][0]             # leaving every chunk
errs_w, bounds_w = [], []
for w_ in range(1, Lw + 1):
    warm = reference.segment_state_grads(*argsw, Lw, dhtw, warmup_chunks=torch.full((1, 2, len(rates)), w_))[0][0, 0]
    norm = true.flatten(1).norm(dim=1)
    err = (warm - true).flatten(1).norm(dim=1) / norm
    bound = torch.exp(torch.tensor(rates, dtype=f64) * C * w_) * per_chunk[Lw + w_ - 1].flatten(1).norm(dim=1) / norm
    assert (err <= bound * (1 + 1e-9)).all(), w_
    errs_w.append(err.clamp(min=1e-18).tolist())
    bounds_w.append(bound.tolist())
fig, ax = plt.subplots(figsize=(8, 4))
for hd, rate in enumerate(rates):
    line, = ax.semilogy(range(1, Lw + 1), [e[hd] for e in errs_w], "o-", ms=3, label=f"g = {rate} per token")
    ax.semilogy(range(1, Lw + 1), [b[hd] for b in bounds_w], "--", color=line.get_color(), lw=1)
ax.axhline(math.exp(autocp.THRESHOLD), color="gray", lw=0.8)
ax.set_ylim(1e-18, 10)
ax.set_xlabel("backward window w (chunks from the segment's start)")
ax.set_ylabel("||dh_warm - dh|| / ||dh||")
ax.set_title("backward warm-up error vs window (float64; dashed: the bound; w = L is exact)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# As in the forward, the bound reaches $e^{-10}$ in two chunks at $g = -0.15$ and never for $g = 0$,
# whose head takes the exact path: the whole segment, and $M_j^\top$ in the chain. FlashQLA counts
# the backward windows the same way (its `cp_fwd` sums each chunk's log decay from the segment start).
#
# **The planner.** `flashqla.autocp.backward_windows` computes, on the device, per *backward slot*
# and value head: the window's first and last token, whether the chain needs $M_j^\top$ (`exact`),
# and the segment row whose $dh_j$ the slot produces. Backward slot $r N + n$ walks segment
# $J_n - r$ of sequence $n$ (counting from the end), so the reverse chain reads contiguous slots,
# exactly as the forward's chain kernel does. A token that breaks the bound's conditions anywhere in
# the segment makes it exact. Two sequences of 1900 and 1300 tokens, the `Problem` heads, $L = 8$:

# %%
lengths2, L2 = (1900, 1300), 8
x2 = cast_floats(Problem(2, 4, lengths2, K=16, V=16).inputs(seed=3), f64)
cu2 = x2["cu_seqlens"]
plan = autocp.host_plan(cu2.tolist(), L2, "cpu")
g2 = reference.chunk_local_cumsum(x2["g"], cu2)
win_start, win_end, exact, dht_row = autocp.backward_windows(plan, g2[0], autocp.bound_violations(x2["k"], x2["g"], x2["beta"]))
N2, J2 = plan.num_seqs, plan.max_segments
windows = torch.zeros(N2, J2, 4, dtype=torch.int64)       # as reference.segment_state_grads counts them
print("slot  seq  segment  tokens        window chunks per head (* exact: M_j^T chained)")
for slot in range(J2 * N2):
    r, n = divmod(slot, N2)
    count = -(-lengths2[n] // (C * L2))
    if not 1 <= r < count:
        continue                                  # no segment, or the first one: no window
    j = count - r
    s, e = int(win_start[slot, 0]), min(int(win_start[slot, 0]) + C * L2, int(cu2[n + 1]))
    chunks = (win_end[slot] - win_start[slot] + C - 1) // C
    windows[n, j] = chunks
    print(f"{slot:4d} {n:4d} {j:8d}  [{s:4d}, {e:4d})  " + "  ".join(
        f"{int(c):2d}{'*' if x_ else ' '}" for c, x_ in zip(chunks, exact[slot])))
assert (exact[:, 0] == (win_end - win_start > 0)[:, 0]).all()   # head 0, g = 0: always the whole segment

# the planner's windows, in float64: every warm-up head within e^THRESHOLD of the gradient where its window ends
do2, dht2 = upstream(x2["v"].shape, 5), upstream((2, 4, 16, 16), 6)
Ab2, gated2 = reference.flagged_solve(x2["k"], g2, x2["beta"], cu2)
args2 = (x2["q"], x2["k"], g2, Ab2, gated2, do2, L2, dht2)
exact_seg = reference.segment_state_grads(*args2, cu_seqlens=cu2)[0]
warm_seg = reference.segment_state_grads(*args2, cu_seqlens=cu2, warmup_chunks=windows)[0]
per_chunk2 = reference.segment_state_grads(*args2[:6], 1, dht2, cu_seqlens=cu2)[0]     # [N, NT, HV, K, V]
ratio = 0.0
for n in range(N2):
    for j in range(1, J2):
        for hd in range(4):
            w_ = int(windows[n, j, hd])
            if w_ and w_ < L2 and j * L2 + w_ < -(-lengths2[n] // C):        # a warm-up, not exact
                err = (warm_seg[n, j - 1, hd] - exact_seg[n, j - 1, hd]).norm()
                ratio = max(ratio, err / per_chunk2[n, j * L2 + w_ - 1, hd].norm())
print(f"max over warm-up heads of ||error|| / ||dS_w|| = {ratio:.1e}  (e^{autocp.THRESHOLD:.0f} = "
      f"{math.exp(autocp.THRESHOLD):.1e})")
assert ratio <= math.exp(autocp.THRESHOLD)

# %% [markdown]
# ## 4. What runs
#
# `flashqla/bwd.py` runs s03's plan where its rule splits: s02's kernels around it, and for the
# segment boundary values the forward's solve, windows, warm-up and chain kernels (chapter 06) and
# two new kernels, the backward windows and the dh warm-up; the forward's chain kernel runs the
# reverse chain on the backward slots unchanged. Its launch order, from its docstring:

# %%
doc = bwd.__doc__
print(doc[doc.index("``backward`` launches"):doc.index("A segment's chunks")].rstrip())

# %% [markdown]
# **When it splits.** `bwd.segment_chunks` decides from host integers (the sequences' chunk counts,
# the value heads, the SMs), pricing a split in walk chunk steps with constants that s03's
# docstring derives and marks as assumed. On the training benchmark's problems, on 132 SMs, $L$ in
# chunks where it splits (`-`: one walk per sequence), and the walk's CTAs and chunks per CTA:

# %%
MIX_NAMES = ("1x8192", "1x32768", "8x4096", "odd mix")                        # bench.TRAIN_MIXES
print(f"{'(H, HV)':>9s} " + "".join(f"{m:>26s}" for m in MIX_NAMES))
split = {}
for H, HV in PUBLIC_HEADS:
    cells = []
    for name, mix in zip(MIX_NAMES, bench.TRAIN_MIXES):
        seq_chunks = [-(-n // C) for n in mix]
        L_ = bwd.segment_chunks(seq_chunks, HV, SMS)
        rows = sum(-(-c // L_) for c in seq_chunks) if L_ else len(mix)
        longest = min(L_, max(seq_chunks)) if L_ else max(seq_chunks)
        if L_:
            split[f"({H}, {HV}) {name}"] = L_
        cells.append(f"{'L ' + str(L_) if L_ else '-':>6s}: {bwd.WALK_LANES * HV * rows:5d} x {longest:3d}")
    print(f"({H:2d}, {HV:2d}) " + "".join(f"{c:>26s}" for c in cells))
assert split == {"(2, 8) 1x8192": 16, "(2, 8) 1x32768": 32, "(4, 16) 1x32768": 32, "(16, 16) 1x32768": 32}

# %% [markdown]
# It splits the single sequences of 32768 tokens with at most 16 value heads, and (2, 8) at 8192;
# from 24 value heads on, or with many sequences, the unsplit walk already fills the card. Like the forward, the backward reads no
# device value on the host once it has seen a `cu_seqlens` tensor, so a whole training step,
# split or not, is captured in one CUDA graph (`tests/test_api.py`, chapter 07).
#
# ## 5. Measured effect
#
# `gdn_bwd.s03` against s02 in one run, FLA and FlashQLA beside them (`gdn_train_s03.csv`, training
# step = the library's forward + the stage's backward, CUDA-graph replay), with the napkin math of
# the s03 row (useful training FLOPs over time against the GEMM roof measured in the run;
# compulsory bytes against the copy roof):

# %%
print(f"{'problem':16s} {'s02':>7s} {'s03':>7s} {'s03/s02':>8s} {'FlashQLA':>9s} {'FLA':>7s} {'vs FQ':>6s} "
      f"{'vs FLA':>7s}  s03: TFLOP/s (% roof), GB/s (% copy)")
gain, vs_fq, vs_fla = {}, {}, {}
for label in problems:
    t = {c: float(s03_rows[label, impl]["ms"]) for c, impl in
         (("s02", S02), ("s03", S03), ("FQ", bench.FLASHQLA_ROW), ("FLA", "FLA"))}
    r = s03_rows[label, S03]
    gain[label], vs_fq[label], vs_fla[label] = t["s02"] / t["s03"], t["FQ"] / t["s03"], t["FLA"] / t["s03"]
    print(f"{label:16s} {t['s02']:7.3f} {t['s03']:7.3f} {gain[label]:7.2f}x {t['FQ']:9.3f} {t['FLA']:7.3f} "
          f"{vs_fq[label]:5.2f}x {vs_fla[label]:6.2f}x  {r['tflops']:>6s} ({r['pct_gemm_roof']:>4s} %), "
          f"{r['gbs']:>4s} ({r['pct_copy_roof']} %)")
assert {r["commit"] for r in s03_rows.values()} == {"a502c0e"}
assert [round(v, 2) for v in gain.values()] == [1.45, 1.78, 1.0, 1.25]
split_fq = [v for lb, v in vs_fq.items() if lb in split]                   # the problems the rule splits
assert len(split_fq) == 3 and [round(f(split_fq), 2) for f in (min, max)] == [0.55, 0.67]
assert round(vs_fq["(4, 16) 1x8192"], 2) == 0.51
assert all(float(s03_rows[lb, S03]["pct_gemm_roof"]) < 11 and float(s03_rows[lb, S03]["pct_copy_roof"]) < 7
           for lb in problems)

# %% [markdown]
# The split problems got 1.25-1.78x faster; (4, 16) 1 x 8192, which the rule leaves whole, did not
# move. Every one is still behind FlashQLA (0.55-0.67x where split, 0.51x unsplit), and at under
# 11 % of the GEMM roof and under 7 % of the copy roof none is bound by a roof: the walks are
# shorter, but s02's five launches and their HBM round trips remain. After the promotion, the library itself, beside FLA
# and FlashQLA in one run (`gdn_train.csv`, commit ad5404b):

# %%
train = rows_of("gdn_train.csv")
api = {}
for label in ("(2, 8) 1x8192", "(2, 8) 1x32768"):
    r = train[label, bench.API_ROW]
    t = {impl: float(train[label, impl]["ms"]) for impl in (bench.API_ROW, "FLA", bench.FLASHQLA_ROW)}
    assert {train[label, impl]["commit"] for impl in t} == {"ad5404b"}
    api[label] = (t["FLA"] / t[bench.API_ROW], t[bench.FLASHQLA_ROW] / t[bench.API_ROW])
    print(f"{label:16s} library {t[bench.API_ROW]:.3f} ms, FLA {t['FLA']:.3f}, FlashQLA {t[bench.FLASHQLA_ROW]:.3f}: "
          f"{api[label][0]:.2f}x FLA, {api[label][1]:.2f}x FlashQLA  ({r['gpu']}, {r['method']}; "
          f"{r['tflops']} TFLOP/s, {r['x_floor']}x the floor)")
assert [round(x_, 2) for pair in api.values() for x_ in pair] == [1.53, 0.68, 2.03, 0.6]

# %% [markdown]
# The library runs s03's kernels on these problems (bit for bit, `tests/test_promoted.py`): in this run
# 1.53x and 2.03x FLA's speed, 0.68x and 0.60x FlashQLA's.
#
# **The fused reverse kernel (`gdn_bwd.s04`, lab log).** The next experiment fused the reverse walk
# with the chunk-parallel gradient kernels (`chunk_bwd_dqkwg`, `wy_bwd`): one kernel computes every
# gradient of a chunk in the reverse walk's iteration, so dh, dṼ and dw never go through HBM. It
# was slower than s03 (`gdn_train_s04.csv`, one run):

# %%
s04_rows = rows_of("gdn_train_s04.csv")
for label in ("(2, 8) 1x8192", "(2, 8) 1x32768"):
    t3, t4 = float(s04_rows[label, S03]["ms"]), float(s04_rows[label, S04]["ms"])
    print(f"{label:16s} s03 {t3:.3f} ms, s04 {t4:.3f} ms: s04 {t3 / t4:.2f}x s03's speed")
    assert t4 > t3
s04_doc = stages.load("gdn_bwd", 4).__doc__
print("\n" + s04_doc[s04_doc.index("Why slower"):s04_doc.index("Taught in")].strip())

# %% [markdown]
# The chunk-parallel work moved onto the sequential chain, and the HBM traffic it saved was not
# what bounded these problems. What pays is overlapping the walk's critical path with that work
# by warp roles: the warp-specialized backward pipeline, next. Every stage between the milestones
# is on the book's `lab_log` page.
#
# ## Summary
#
# - The backward's reverse chain is affine in the gradient: over a segment,
#   $dS_\text{entering} = M_j^\top dS_\text{leaving} + dZ_j$, with $M_j$ the forward's segment
#   transition and $dZ_j$ the reverse walk from zero. Chained from the sequence's $dht$,
#   $dh_{j-1} = dZ_j + M_j^\top dh_j$; with each segment's $h_j$ (forward AutoCP) and $dh_j$, its
#   local backward gives every gradient, equal to the unsplit backward in float64.
# - The backward warm-up walks from zero over a window counted from the segment's *start*, until the
#   cumulative log decay reaches $-10$: wrong by $M_w^\top dS_w$, at most $e^{-10} \|dS_w\|$. Heads
#   with $g = 0$ (or a token breaking the bound's conditions) walk the whole segment and chain
#   $M_j^\top$. `autocp.backward_windows` plans it on the device, in backward slots.
# - `flashqla.bwd` runs s03's plan where `bwd.segment_chunks` splits (on 132 SMs: single sequences
#   of 32768 tokens with at most 16 value heads, and (2, 8) at 8192), graph-capturable as before.
# - Measured on one H100: the split training steps 1.25-1.78x s02's, still 0.55-0.67x FlashQLA's;
#   fusing the gradient work into the reverse walk without warp roles (s04) lost to s03.

# %% [markdown]
# ## Exercises
#
# **1. The reverse chain.** Write `reverse_chain(dz, m, dht)` for one sequence: `dz` is
# `[J, HV, K, V]` ($dZ_j$ of each segment), `m` is `[J, HV, K, K]` ($M_j$, the segment's forward
# transition, as chapter 06 builds it), `dht` is `[HV, K, V]`; return `[J, HV, K, V]`, the gradient
# of the state leaving every segment. The check compares with the unsplit float64 backward's `dh`
# at the segment boundaries, and shows what your chain does to the gradients of the segments'
# local backwards.

# %% tags=["exercise"]
def reverse_chain(dz, m, dht):
    out = [dht]                                        # the last segment leaves with the sequence's dht
    for j in range(dz.shape[0] - 1, 0, -1):
        out.insert(0, dz[j] + m[j] @ out[0])           # TODO: how does a gradient go back through M_j?
    return torch.stack(out)


# %% tags=["check"]
check_reverse_chain(reverse_chain)

# %% tags=["solution", "hide-input"]
def reverse_chain(dz, m, dht):
    out = [dht]
    for j in range(dz.shape[0] - 1, 0, -1):
        out.insert(0, dz[j] + m[j].mT @ out[0])        # h' = M h + ...: the gradient goes back by M^T
    return torch.stack(out)


result = check_reverse_chain(reverse_chain)
assert result.passed, result
result

# %% [markdown]
# **2. A backward window.** Write the window rule of section 3 for one (segment, head):
# `backward_window(decays, threshold)` gets the log decay of each chunk of the segment
# ($\sum g$ over the chunk, all $\le 0$), first chunk first, and returns $w$, the fewest chunks
# whose decays sum to at most `threshold`, or 0 where even the whole segment does not reach it
# (the head then walks the whole segment, exact). The starting code counts the way the forward's
# window does. The check runs it on every (segment, head) with a window of a two-sequence problem,
# against `autocp.backward_windows`, and shows what your windows do to the float64 segment gradients.

# %% tags=["exercise"]
def backward_window(decays, threshold=autocp.THRESHOLD):
    total = torch.cumsum(decays.flip(0), 0)            # TODO: where does the backward's window start?
    reached = (total <= threshold).nonzero()
    return int(reached[0]) + 1 if len(reached) else 0


# %% tags=["check"]
check_backward_window(backward_window)

# %% tags=["solution", "hide-input"]
def backward_window(decays, threshold=autocp.THRESHOLD):
    total = torch.cumsum(decays, 0)                    # from the segment's start: the gradient flows backwards
    reached = (total <= threshold).nonzero()
    return int(reached[0]) + 1 if len(reached) else 0


result = check_backward_window(backward_window)
assert result.passed, result
result
