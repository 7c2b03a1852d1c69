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
# # AutoCP and the final forward
#
# The chunked forward of chapter 2 leaves one sequential part: the chain of state updates, one
# walk over the chunks per (sequence, value head). The fused kernel of chapters 3 and 5 runs that
# walk in one CTA per (sequence, value head, 64 value columns): with 8 value heads and one sequence
# of 32768 tokens that is 16 CTAs on a 132-SM card, each walking 512 chunks, and 116 SMs idle.
# FlashQLA's answer, *gate-driven intra-card context parallelism* (AutoCP), cuts each sequence into
# segments that walk in parallel. This chapter derives why that is allowed, builds it as the
# milestone stage `gdn_fwd.s06`, measures it, and ends with the forward the library runs today.
#
# **What you will learn**
#
# - why the chain can be cut at all: it is affine in the state, so a segment's state is $M h + Z$;
# - why a *warm-up* from zero over a few chunks is enough for a decaying head (a bound, $e^{-10}$,
#   checked in float64), and why heads with $g = 0$ need the exact transition $M$ instead;
# - how `flashqla.autocp` plans the segments from host integers and device tensors, so the forward
#   can be captured in a CUDA graph (FlashQLA's host-side plan cannot);
# - what the split buys, measured, and what the final forward (`gdn_fwd.s44`, the library's
#   `flashqla/fwd.py`) launches, when it splits, and how it compares with FLA and FlashQLA.
#
# **What you need first**
#
# - chapter 2: the chunked form, the chunk-local cumulative decay $\gamma$, $w$, $u$ and the state
#   chain $h_{c+1} = e^{\gamma_C} h_c + K^\top \operatorname{diag}(e^{\gamma_C - \gamma})(u - w h_c)$;
# - chapters 3-5: what a fused chain + output kernel is, the gate-free solve ($A_b$) and warp roles;
#   the kernels here are used, not rebuilt;
# - no GPU: everything below runs in float64 on the CPU or reads committed measurements.

# %%
import contextlib
import inspect
import itertools
import math

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Rectangle

from flashqla import autocp, bench, fwd, reference
from flashqla.exercises.ch06 import check_segment_transition, check_warmup_window
from flashqla.stages import KERNELS_DIR, discover, load
from flashqla.testing import PUBLIC_HEADS, Problem, cast_floats, rel_l2

torch.manual_seed(0)
f64 = torch.float64
C = reference.CHUNK_SIZE
RESULTS = KERNELS_DIR.parent / "profiles" / "results"

# %% [markdown]
# ## 1. The chain is affine in the state
#
# Per token, with state $h$ ($K \times V$):
#
# $$h \leftarrow \exp(g_t)\,(I - \beta_t k_t k_t^\top)\, h + \beta_t k_t v_t^\top .$$
#
# Every step is $h \mapsto A_t h + B_t$ with $A_t$ independent of $h$ and of $v$, so any span of
# tokens composes to
#
# $$h_\text{end} = M\, h_\text{start} + Z, \qquad M = A_n \cdots A_1, \qquad Z = \text{the final state from } h_\text{start} = 0 .$$
#
# Over one chunk, in the WY form of chapter 2, $M = e^{g_C} I - K^\top \operatorname{diag}(e^{g_C - g}) W$
# (`reference.chunk_transition`). Two facts make $M$ cheap to get with the kernels we already
# have: $M$ is the final state of the same recurrence run with $v = 0$ from $h_\text{start} = I$
# (when $K = V$, as here), and $Z$ is the final state run from zero. Checked in float64:

# %%
p = Problem(2, 4, (600, 200), K=16, V=16)
x = cast_floats(p.inputs(), f64)
cu = x["cu_seqlens"]
M = reference.chunk_transition(x["k"], reference.chunk_local_cumsum(x["g"], cu), x["beta"], cu)
product = torch.eye(16, dtype=f64).expand(2, 4, 16, 16)
for c in range(M.shape[1]):                       # M of each whole sequence: the chunks' product
    product = M[:, c] @ product
v0 = torch.zeros_like(x["v"])
_, from_identity = reference.naive_recurrent_gated_delta_rule(
    x["q"], x["k"], v0, x["g"], x["beta"], initial_state=torch.eye(16, dtype=f64).expand(2, 4, 16, 16),
    output_final_state=True, cu_seqlens=cu)
print("chunk transitions per sequence:", tuple(M.shape), "  [N, NT, HV, K, K]")
print(f"product of chunk transitions vs run with v = 0 from I: rel err {rel_l2(product, from_identity):.1e}")
assert rel_l2(product, from_identity) < 1e-12

# %% [markdown]
# So with segments of $L$ chunks the state entering segment $j + 1$ is
# $h_{j+1} = M_j h_j + Z_j$: every segment's $M_j$ and $Z_j$ can be computed in parallel, then a
# short sequential loop over the segments (one batched $K \times K$ by $K \times V$ matmul per
# step) chains them, then all segments run the chain + output kernel at once, each from its own
# state. `reference.segment_states` does exactly that; it matches the state entering each chunk
# computed by the plain chunk-by-chunk walk (segments of one chunk) to float64 rounding:

# %%
args = (x["k"], x["v"], x["g"], x["beta"])
per_chunk = reference.segment_states(*args, 1, x["initial_state"], cu)
for L in (2, 3, 5):
    chained = reference.segment_states(*args, L, x["initial_state"], cu)
    err = rel_l2(chained, per_chunk[:, ::L])
    print(f"segments of {L} chunks: {chained.shape[1]} per sequence, chained vs walked: rel err {err:.1e}")
    assert err < 1e-12

# %% [markdown]
# ## 2. Warm-up: the decay forgets the past, with a bound
#
# The exact path costs a $K \times K$ matrix per segment and head, computed by a second chain over
# the whole previous segment. FlashQLA observes that most heads do not need it: a decaying head
# forgets. Start the chain from **zero** $w$ chunks before the segment (a *warm-up* window) instead of
# from the true state $h_a$ there; the result is wrong by exactly $M_w h_a$, the window's
# transition applied to what was dropped.
#
# How big can $M_w h_a$ be? $I - \beta k k^\top$ is symmetric with eigenvalue $1 - \beta \|k\|^2$ along
# $k$ and 1 elsewhere, so its spectral norm is at most 1 whenever $0 \le \beta \|k\|^2 \le 2$
# (normalized keys and $0 \le \beta \le 1$ are well inside). With $g_t \le 0$:
#
# $$\|M_w h_a\|_F \le \prod_t e^{g_t} \, \|h_a\|_F = \exp\Big(\sum_{t \in \text{window}} g_t\Big)\, \|h_a\|_F .$$
#
# So a window whose cumulative log decay reaches a threshold $\tau$ gives an error of at most
# $e^{\tau}$ times the state where the window starts; FlashQLA uses $\tau = -10$
# ($e^{-10} \approx 4.5 \cdot 10^{-5}$, far below the bf16 rounding of the kernels, about $4 \cdot 10^{-3}$).
# First the premise, per chunk, in float64: the spectral norm of every chunk transition against
# $\exp(\sum g)$ over the chunk, for the problem above (its heads: $g = 0$, strong and ordinary decay).

# %%
decay = reference.Chunking(*x["g"].shape[:2], cu, C, "cpu").pad(x["g"]).sum(2)   # [N, NT, HV]
norms = torch.linalg.matrix_norm(M, ord=2)
ratio = (norms / torch.exp(decay)).max().item()
print(f"max over chunks of ||M||_2 / exp(sum g) = {ratio:.6f}  (<= 1: the premise holds)")
assert ratio <= 1 + 1e-12

k_bad = x["k"] * 2.0                              # ||k||^2 = 4, beta ||k||^2 up to 4 > 2
M_bad = reference.chunk_transition(k_bad, reference.chunk_local_cumsum(x["g"], cu), x["beta"], cu)
print(f"with keys of norm 2 instead: max ||M||_2 / exp(sum g) = "
      f"{(torch.linalg.matrix_norm(M_bad, ord=2) / torch.exp(decay)).max().item():.3g}  (no bound)")

# %% [markdown]
# Now the warm-up itself: one sequence of 2048 tokens, five value heads with constant per-token log
# decays from none ($g = 0$) to strong, the true state entering chunk 24 against the warm-up state
# started $w$ chunks earlier, for $w = 0 \dots 24$ (dashed: the bound; every point must lie under
# its line).

# %%
rates = (0.0, -0.002, -0.01, -0.04, -0.15)       # log decay per token, one value head each
pw = Problem(1, len(rates), (2048,), K=32, V=32)
xw = cast_floats(pw.inputs(seed=1), f64)
xw["g"] = torch.tensor(rates, dtype=f64).expand_as(xw["g"]).clone()
argsw = (xw["k"], xw["v"], xw["g"], xw["beta"])
start = 24                                        # the segment starts at chunk 24 (token 1536)
states = reference.segment_states(*argsw, 1, xw["initial_state"])[0]   # [NT, HV, K, V], exact
Mc = reference.chunk_transition(xw["k"], reference.chunk_local_cumsum(xw["g"]), xw["beta"])[0]
true = states[start]

# the warm-up state over w chunks misses exactly M_w h_a (checked for one w with segment_states)
w = 6
warm = reference.segment_states(*argsw, start, xw["initial_state"],
                                warmup_chunks=torch.full((1, 2, len(rates)), w))[0, 1]
M_w = torch.eye(32, dtype=f64).expand(len(rates), 32, 32)
for c in range(start - w, start):
    M_w = Mc[c] @ M_w
print(f"h - h_warm vs M_w h_a (w = {w}): rel err {rel_l2(true - warm, M_w @ states[start - w]):.1e}")
assert rel_l2(true - warm, M_w @ states[start - w]) < 1e-10

# so the error for every w is ||M_w h_a||, M_w growing one chunk further back at a time
errs, bounds = [[1.0] * len(rates)], [[1.0] * len(rates)]
M_w = torch.eye(32, dtype=f64).expand(len(rates), 32, 32)
for w in range(1, start + 1):
    M_w = M_w @ Mc[start - w]                     # M_{s-1} ... M_{s-w}
    h_a = states[start - w]
    err = (M_w @ h_a).flatten(1).norm(dim=1) / true.flatten(1).norm(dim=1)
    bound = torch.exp(torch.tensor(rates, dtype=f64) * C * w) * h_a.flatten(1).norm(dim=1) / true.flatten(1).norm(dim=1)
    assert (err <= bound * (1 + 1e-9)).all(), w
    errs.append(err.tolist())
    bounds.append(bound.tolist())
fig, ax = plt.subplots(figsize=(8, 4.2))
for h, rate in enumerate(rates):
    line, = ax.semilogy(range(start + 1), [e[h] for e in errs], "o-", ms=3, label=f"g = {rate} per token")
    ax.semilogy(range(start + 1), [b[h] for b in bounds], "--", color=line.get_color(), lw=1)
ax.axhline(math.exp(autocp.THRESHOLD), color="gray", lw=0.8)
ax.text(start, math.exp(autocp.THRESHOLD) * 1.5, "e^-10", ha="right", color="gray")
ax.set_ylim(1e-17, 10)
ax.set_xlabel("warm-up window w (chunks of 64 tokens)")
ax.set_ylabel("||h_warm - h|| / ||h||")
ax.set_title("warm-up state error vs window (float64; dashed: the bound)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The bound of a decaying head reaches $e^{-10}$ after $\lceil 10 / (64 |g|) \rceil$ chunks: two
# at $g = -0.15$, four at $-0.04$, sixteen at $-0.01$, 79 at $-0.002$; the actual error falls
# faster, by the contraction the keys add. The $g = 0$ head has no bound at all (its dashed line
# stays near 1). Here its error still falls, because 64 random keys per chunk in 32 dimensions
# shrink the state through the $I - \beta k k^\top$ factors; nothing guarantees that for real keys
# (section 3), so those heads take the exact path.
#
# Per (segment, value head), AutoCP therefore counts chunks back from the segment start until the
# cumulative log decay (the chunk-local cumulative gate at each chunk's last token, already computed
# by the forward) reaches $\tau$: $w$ chunks if that happens within the previous segment, otherwise
# the exact path, chained through $M$. It also takes the exact path wherever a token of the
# previous segment breaks the premise ($g > 0$, or $\beta \|k\|^2$ outside $[0, 2]$): checked on
# the device, per (segment, head), so a caller with unnormalized keys gets exact results, not
# a silently broken bound. `tests/test_autocp.py` checks the planner's counts against a brute-force
# count and the bound on the planner's windows in float64.

# %%
print(inspect.getsource(autocp.warmup))

# %% [markdown]
# ## 3. Exact transitions for the heads that do not decay
#
# A head with $g = 0$ has no bound: its warm-up error is $\|M_w h_a\|$ with $M_w$ a product of
# $I - \beta_t k_t k_t^\top$ factors alone, which shrink the state only along the directions its
# keys visit. Random keys visit them all; real keys need not. Below, two $g = 0$ heads of one
# sequence, one with random keys and one whose keys take only 4 of 16 directions. The second keeps
# most of its state however long the window.

# %%
xe = cast_floats(Problem(2, 2, (1024,), varlen=False, K=16, V=16).inputs(seed=2), f64)
xe["g"].zero_()                                                   # both heads: no decay
pick = torch.randint(0, 4, (1024,), generator=torch.Generator().manual_seed(3))
xe["k"][0, :, 1] = torch.eye(16, dtype=f64)[pick]                 # key head 1: 4 directions of 16
argse = (xe["k"], xe["v"], xe["g"], xe["beta"])
states_e = reference.segment_states(*argse, 1, xe["initial_state"])[0]   # the state entering each chunk
Me = reference.chunk_transition(xe["k"], reference.chunk_local_cumsum(xe["g"]), xe["beta"])[0]
start_e, M_w = 8, torch.eye(16, dtype=f64).expand(2, 16, 16)
print(" w  random keys  4 directions    ||h_warm - h|| / ||h|| entering chunk 8")
for w in range(1, start_e + 1):
    M_w = M_w @ Me[start_e - w]
    err = (M_w @ states_e[start_e - w]).flatten(1).norm(dim=1) / states_e[start_e].flatten(1).norm(dim=1)
    print(f"{w:2d}  {err[0]:11.1e}  {err[1]:12.2f}")
assert err[0] < 1e-4 and err[1] > 0.5

# %% [markdown]
# Such heads take the exact path: the previous segment's transition $M$ ($K \times K$: the chain
# run with $v = 0$ from $I$, $K$ more state columns to walk) and its $Z$, chained from the
# sequence's start. In float64 the chained states equal the walked ones whatever the keys:

# %%
exact_e = reference.segment_states(*argse, start_e, xe["initial_state"])[0]
print(f"exact, segments of {start_e} chunks, chained vs walked: rel err {rel_l2(exact_e, states_e[::start_e]):.1e}")
assert rel_l2(exact_e, states_e[::start_e]) < 1e-12

# %% [markdown]
# So a warm-up head costs phase 1 a window of a few chunks, an exact head the whole previous
# segment with $K + V$ state columns. The benchmark's problems give a quarter of the heads $g = 0$,
# as the models do: they set the length of phase 1.
#
# ## 4. The plan, on the device
#
# A split needs a table of segments. FlashQLA reads `cu_seqlens` on the host to build it: a device
# synchronization, which rules out CUDA-graph capture of the forward. `flashqla.autocp` decides *how
# finely* to split from host integers only (tokens, sequences, heads, SMs) and builds *where* the
# segments are on the device, with a host-known upper bound on their number: rows past the real
# segments are empty, $[T, T)$, and their CTAs load nothing. A segment starts on a chunk boundary of
# its sequence, so segment $j$ of sequence $n$ starts at that sequence's first chunk row plus $jL$
# (`first_chunk`), where kernels find the per-chunk data computed before the split. Three sequences
# of 1000, 130 and 2000 tokens in segments of 8 chunks (512 tokens):

# %%
lengths3 = (1000, 130, 2000)
cu3 = torch.tensor([0, *itertools.accumulate(lengths3)], dtype=torch.int32)
plan3 = autocp.plan(cu3, 1, sum(lengths3), 8, 132, 2, "cpu", force=8)
print("segment bounds  ", plan3.bounds.tolist())
print("first chunk rows", plan3.first_chunk.tolist())
print(f"slots per sequence J = {plan3.max_segments} (the longest possible sequence), "
      f"segment rows {plan3.bounds.shape[0] - 1} (T // 512 + N, a bound)")

# %% [markdown]
# How finely to split, in s06's rule (`autocp.segment_chunks`): without CP the chain kernel runs two
# CTAs (64 value columns each) per (sequence, head), each as long as its sequence. Segments of $L$
# chunks all run in one wave when their CTAs fit the SMs that idle; $L$ is the smallest such length
# (at least 8 chunks, at most 32 segments a sequence), and the split is taken when it makes three
# segments or more and saves at least `autocp.MIN_SAVED_CHUNKS` chain steps after paying phase 1
# (`autocp.WARMUP_STEPS` steps a chunk).
# Segments per sequence x chunks per segment, 132 SMs:

# %%
mixes = ((1, 2048), (1, 8192), (1, 32768), (1, 65536), (8, 4096))
print(f"{'(H, HV)':>9} " + " ".join(f"{f'{n}x{t}':>9}" for n, t in mixes))
for H, HV in PUBLIC_HEADS:
    cells = []
    for n, t in mixes:
        L = autocp.segment_chunks(n * t, n, t, HV, 132, 2)
        cells.append(f"{'off' if not L else f'{-(-t // (C * L))} x {L}':>9}")
    print(f"({H:2d}, {HV:2d}) " + " ".join(cells))

# %% [markdown]
# Many heads or many sequences already fill the card: no split. Few heads on long sequences get as
# many segments as one wave holds. Below, which SM works on what, without CP (left) and with the
# rule's segments (right); orange is phase 1 of the exact heads (the whole previous segment, at
# `autocp.WARMUP_STEPS` chain steps a chunk), blue the chain + output kernel. For varlen the host
# does not know the lengths, so the rule plans for one sequence holding all tokens; the short
# sequences simply get fewer segments.

# %%
def fill(ax, lengths, HV, L, sms=132):
    """One box per CTA: SM on the y axis, time in chain steps on x, CTAs given to SMs in grid order.
    Returns the time the last one ends."""
    lanes = 2 * HV                                  # CTAs per (segment, head): 2 x 64 value columns
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if L:
        b = autocp.plan(cu, 1, sum(lengths), HV, sms, 2, "cpu", force=L).bounds.tolist()
        segments = [(s, e) for s, e in zip(b, b[1:]) if e > s]
    else:
        segments = list(zip(cu.tolist(), cu.tolist()[1:]))
    later = [s for s, _ in segments if s not in set(cu.tolist())]     # segments with a phase 1
    t3 = autocp.WARMUP_STEPS * L if later else 0                      # the exact heads' walk
    for i in range(len(later) * HV):
        ax.add_patch(Rectangle((0, i % sms), t3, 0.9, color="tab:orange", alpha=0.7, lw=0))
    free_at = [t3] * sms
    for i, (s, e) in enumerate(seg for seg in segments for _ in range(lanes)):
        n = math.ceil((e - s) / C)
        ax.add_patch(Rectangle((free_at[i % sms], i % sms), n, 0.9, color="tab:blue", alpha=0.8, lw=0))
        free_at[i % sms] += n
    ax.set_ylim(0, sms)
    return max(free_at)


configs = [((2, 8), (32768,)), ((16, 32), (32768,)), ((2, 8), (20000, 9000, 3768))]
fig, axes = plt.subplots(len(configs), 2, figsize=(11, 2.3 * len(configs)), sharey=True)
for row, ((H, HV), lengths) in zip(axes, configs):
    L = autocp.segment_chunks(sum(lengths), len(lengths), sum(lengths), HV, 132, 2)
    t_off, t_on = fill(row[0], lengths, HV, 0), fill(row[1], lengths, HV, L)
    for ax in row:
        ax.set_xlim(0, t_off * 1.05)
    label = f"({H}, {HV}) " + "+".join(map(str, lengths))
    row[0].set_title(f"{label}: no CP, {t_off} steps", fontsize=9)
    row[1].set_title(f"{label}: AutoCP, L = {L} chunks, ~{t_on:.0f} steps", fontsize=9)
    row[0].set_ylabel("SM")
for ax in axes[-1]:
    ax.set_xlabel("time, in chain steps (orange: phase 1 of the exact heads)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. The stage: `gdn_fwd.s06`
#
# `gdn_fwd.s06` runs the plan, then three phases. Phase 1 is one chain-only TileLang kernel for
# every (slot, value head): $Z$ over the warm-up window, and for the exact heads $M$ (the same chain
# without the output, with $u$ read as zero and the state started from $I$). Phase 2 chains the
# segments, $h_j = Z_j + M_j h_{j-1}$, one fp32 batched matmul per step. Phase 3 is the fused chain +
# output kernel of the stage named in `CHAIN`, over all segments at once as one varlen problem.
# Nothing reads a device value on the host: `tests/test_autocp.py` captures the whole forward in a
# CUDA graph and replays it bitwise equal to the eager call.

# %%
s06 = load("gdn_fwd", 6)
src06 = inspect.getsource(s06.forward)
print(src06[src06.index("    cumsum, kkt"):])

# %% [markdown]
# ## 6. What it buys
#
# `profiles/autocp_lab.py` timed s03 (the unsplit chain) and s06 forced on (over s03's chain) on one
# sequence of 2048 to 65536 tokens, with few heads (2, 8) and many (16, 64), CUDA events around
# eager calls and CUDA-graph replay, in one run on one card (`profiles/results/autocp.csv`). The
# napkin math beside it: the CTAs the chain runs (2 per (segment, head), of 132 SMs) and the longest
# chain, in chunk steps.

# %%
rows = bench.read_csv(RESULTS / "autocp.csv")
heads = sorted({r["heads"] for r in rows}, key=lambda hd: int(hd.strip("()").split(",")[1]))
fig, axes = plt.subplots(1, len(heads), figsize=(11, 3.6), squeeze=False)
for ax, hd in zip(axes[0], heads):
    for impl, label, color in (("s03", "no CP (s03)", "tab:gray"), ("s06 forced on", "CP (s06)", "tab:blue")):
        sel = [r for r in rows if r["heads"] == hd and r["impl"] == impl]
        t = [int(r["tokens"]) for r in sel]
        ax.loglog(t, [float(r["ms_graph"]) for r in sel], "o-", color=color, label=f"{label}, graph")
        ax.loglog(t, [float(r["ms_events"]) for r in sel], "x:", color=color, label=f"{label}, eager")
    ax.set_title(f"{hd}, one sequence", fontsize=10)
    ax.minorticks_off()
    ax.set_xticks(t, [str(n) for n in t], fontsize=8)
    ax.set_xlabel("tokens")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
fig.suptitle(f"gdn forward, {rows[0]['gpu']} ({rows[0]['date']}, commit {rows[0]['commit']})", fontsize=10)
plt.tight_layout()
plt.show()
print(f"{'heads':9} {'tokens':>6} {'no CP':>7} {'CP':>7} {'speed-up':>8}   {'CTAs':>9} {'longest chain':>14}"
      "   (graph replay, ms)")
speedup = {}
for hd in heads:
    for t in sorted({int(r["tokens"]) for r in rows if r["heads"] == hd}):
        got = {r["impl"]: r for r in rows if r["heads"] == hd and int(r["tokens"]) == t}
        off, on = got["s03"], got["s06 forced on"]
        hv, L, segs = int(on["HV"]), int(on["segment_chunks"]), int(on["segments"])
        speedup[hd, t] = float(off["ms_graph"]) / float(on["ms_graph"])
        print(f"{hd:9} {t:6d} {float(off['ms_graph']):7.3f} {float(on['ms_graph']):7.3f} {speedup[hd, t]:7.2f}x"
              f"   {2 * hv:3d} -> {2 * hv * segs:3d} {t // C:6d} -> {min(L, t // C):4d}")
assert 2.3 < speedup["(2, 8)", 32768] < 2.5 and 2.8 < speedup["(2, 8)", 65536] < 3.0
assert speedup["(2, 8)", 2048] < 1
assert [round(f(x for (hd, _), x in speedup.items() if hd == "(16, 64)"), 2) for f in (min, max)] == [0.79, 0.94]

# %% [markdown]
# With few heads, CP turns a latency-bound walk of 16 CTAs into one wave of 128 short walks: 2.4x at
# 32768 tokens and 2.9x at 65536 under a graph. It does not reach the 8x that the chain steps
# promise: the preparation kernels before the chain (the solve, $w$, $u$) do not get shorter, and
# phase 1 walks a whole segment for the exact heads (s06's docstring splits the time by phase). At
# 2048 tokens the split's fixed cost loses. With (16, 64) the card is already full: forced on gives
# one segment and only adds the split's fixed cost (0.79-0.94x), so the rule keeps CP off. Eagerly,
# the plan and the chaining add host time (about 45 small launches): CP is meant to run captured in
# a graph, which the device-side plan allows.

# %% [markdown]
# ## 7. The final forward: `gdn_fwd.s44`, the library
#
# `gdn_fwd.s44` is what `flashqla.chunk_gated_delta_rule` runs on an SM90 GPU: `flashqla/fwd.py`
# holds copies of its kernels, and `tests/test_promoted.py` asserts that each builds the same
# TileLang program as the stage. It keeps s06's three phases and runs each as a kernel of its own,
# beside chapter 4's gate-free solve and chapter 5's warp-specialized fused kernel, whose width it
# chooses from the sequence lengths. Those lengths it reads on the host once per `cu_seqlens` tensor
# (`flashqla.varlen.host_bounds` keeps them), so it builds the plan there too and copies it to the
# device once (`autocp.host_plan`); a CUDA graph captured after an eager call replays with the kept
# plan, and only a capture with no eager call before it builds the plan on the device, as s06 does.
# The kernels, in launch order:
#
# | kernel (`flashqla.fwd`) | computes | launched |
# |---|---|---|
# | `gate_free_solve_with_cumsum_kernel` | the chunk table; $\gamma$, the chunk-local cumsum of $g$; $A_b = (I + \mathrm{StrictLower}(\operatorname{diag}(\beta) K K^\top))^{-1} \operatorname{diag}(\beta)$, and a `gated` flag on a (chunk, head) with $\beta \lVert k \rVert^2 > 2$, which solves with the gate instead | where a solve CTA holds one or two value heads |
# | `chunk_local_cumsum_kernel`, then `gate_free_solve_kernel` | the same in two kernels; the solve stores $\mathrm{WY} = \Gamma \odot A_b$ where the fused kernel reads it | where a solve CTA holds three or four |
# | `windows_kernel` | per (segment, value head): the warm-up window, or exact | AutoCP |
# | `warmup_kernel` | phase 1: $Z$ from zero over the window, and $M$ from $I$ for the exact heads, as $S \leftarrow e^{\gamma_C} S + X^\top (E V - e^{\gamma_C} K S)$ with $X = A_b^\top K$, $E = \operatorname{diag}(e^{\gamma_C - \gamma})$: two dependent products a chunk (roles: producer, x, chain) | AutoCP |
# | `chain_kernel` | phase 2: $h_j = Z_j + M_j h_{j-1}$ for every segment, in one kernel | AutoCP |
# | the fused kernel | $\tilde V = (\Gamma \odot A_b)(V - D K S)$, $S \leftarrow e^{\gamma_C} S + K^\top E \tilde V$, $O = s\,(D Q S + P \tilde V)$ on four warpgroups, a TMA producer and three consumers: `fused_reform_kernel` at 16 or 32 value columns a CTA and `fused_state_in_registers_kernel` at 64 after a solve that stored WY (chain, scores, output), `fused_state_value_kernel` at 64 or 128 (state, value, scores and output) | always |
#
# Their register budgets (`setmaxnreg`, registers a thread; a warpgroup's 128 threads share the
# SM's 64K registers with the others):

# %%
print(f"fused, chain / scores / output / producer:       {fwd.REGS_CHAIN} / {fwd.REGS_SCORES} / "
      f"{fwd.REGS_OUTPUT} / {fwd.REGS_PRODUCER}")
print(f"fused at 64 or 128, state / value / scores+output / producer: {fwd.REGS_WIDE_STATE} / "
      f"{fwd.REGS_WIDE_VALUE} / {fwd.REGS_WIDE_SCORES} / {fwd.REGS_PRODUCER}")
print(f"warm-up, chain / x / producer:                   {fwd.REGS_WARMUP_CHAIN} / {fwd.REGS_WARMUP_X} / "
      f"{fwd.REGS_WARMUP_PRODUCER}")
for name, budget in (("fused", fwd.REGS_CHAIN + fwd.REGS_SCORES + fwd.REGS_OUTPUT + fwd.REGS_PRODUCER),
                     ("fused at 64 or 128", fwd.REGS_WIDE_STATE + fwd.REGS_WIDE_VALUE + fwd.REGS_WIDE_SCORES
                      + fwd.REGS_PRODUCER),
                     ("warm-up", fwd.REGS_WARMUP_CHAIN + fwd.REGS_WARMUP_X + fwd.REGS_WARMUP_PRODUCER)):
    print(f"{name}: {budget} x 128 threads = {budget * 128} of the SM's 65536 registers")
    assert budget * 128 <= 65536

# %% [markdown]
# Which of them run is decided by the library's host code from integers it knows. To see it on
# this CPU, run `fwd.forward` itself on empty tensors with every kernel launch recorded instead of
# run (nothing below re-implements a decision):

# %%
@contextlib.contextmanager
def recorded_launches(sms=132):
    """flashqla's forward with each kernel launch appended to a list instead of run, and each
    AutoCP plan kept; ``sms`` an H100's SMs, on any machine."""
    launched, plans = [], []
    saved = fwd._compiled, fwd.segment_plan, autocp.num_sms
    fwd._compiled = lambda builder, *shape: lambda *args: launched.append((builder.__name__, shape))
    fwd.segment_plan = lambda *args, **kwargs: plans.append(saved[1](*args, **kwargs)) or plans[-1]
    autocp.num_sms = lambda device: sms
    try:
        yield launched, plans
    finally:
        fwd._compiled, fwd.segment_plan, autocp.num_sms = saved


def launches(p: Problem):
    """(the kernels launched for problem ``p``, in order, with their shapes; AutoCP's plan or None)."""
    T = sum(p.lengths)
    cu = torch.tensor([0, *itertools.accumulate(p.lengths)], dtype=torch.int32)
    bf16 = lambda *shape: torch.empty(1, T, *shape, dtype=torch.bfloat16)   # never read
    fp32 = lambda *shape: torch.empty(1, T, *shape, dtype=torch.float32)
    with recorded_launches() as (launched, plans):
        fwd.forward(bf16(p.H, 128), bf16(p.H, 128), bf16(p.HV, 128), fp32(p.HV), fp32(p.HV),
                    None, None, True, cu)
    return launched, plans[0]


for p in (Problem(2, 8, (2048,)), Problem(16, 64, (32768,)), Problem(2, 8, (32768,)), Problem(8, 24, (28672, 4096))):
    launched, plan = launches(p)
    split = f"AutoCP, L = {plan.segment_chunks} chunks" if plan else "no split"
    print(f"{p.label} ({split}):\n    " + "\n    ".join(f"{name}{shape}" for name, shape in launched))

# %% [markdown]
# **When AutoCP splits.** The library's rule (`fwd.segment_chunks`) has s06's inputs, host
# integers, and prices a split in chain steps with constants fitted to measured sweeps. Phase 3 runs
# 2 HV CTAs of 64 columns a segment, two to an SM; $L_0$ is the shortest length whose segments fit
# that on every SM. The rule prices $L_0$, $2 L_0$ and the lengths of `SEGMENT_LADDER`,
#
# $$\text{cost}(L) = \texttt{WAVE\_CHUNK\_STEPS} \cdot L \cdot \text{waves} + \texttt{SEGMENT\_STEPS} \cdot J + \texttt{FIXED\_STEPS},$$
#
# with $J$ the longest sequence's segments and waves those of phase 3, and splits at the cheapest
# where that is below the unsplit launch's steps (the longest sequence's chunks times `STEP` of its
# width: the unsplit launch may run narrower CTAs, each step cheaper). On the benchmark's 40
# problems, the fused kernel's value columns a CTA, and $L$ where it splits:

# %%
print(f"constants: WAVE_CHUNK_STEPS {fwd.WAVE_CHUNK_STEPS}, SEGMENT_STEPS {fwd.SEGMENT_STEPS}, "
      f"FIXED_STEPS {fwd.FIXED_STEPS}, SEGMENT_LADDER {fwd.SEGMENT_LADDER}, STEP {fwd.STEP}")
rule = {}
MIX_NAMES = ("1x2048", "1x8192", "1x32768", "28672+4096", "8x4096")          # bench.MIXES
print(f"{'(H, HV)':>9} " + "".join(f"{m:>14}" for m in MIX_NAMES))
for H, HV in PUBLIC_HEADS:
    cells = []
    for mix in bench.MIXES:
        p = Problem(H, HV, mix)
        launched, plan = launches(p)
        rule[p.label] = plan.segment_chunks if plan else 0
        cells.append(f"BV {launched[-1][1][-1]}" + (f", L {rule[p.label]}" if plan else ""))
    print(f"({H:2d}, {HV:2d}) " + "".join(f"{c:>14}" for c in cells))

# %% [markdown]
# It splits only long sequences with few value heads. `profiles/split_lab.py` forced s44 to each $L$
# on the problems where a split could pay, in one run with FlashQLA
# (`profiles/results/autocp_split.csv`). The rule's choice against the fastest length timed:

# %%
sweep = bench.split_sweep("gdn_fwd.s44")
run_of = {r["problem"]: r for r in bench.read_csv(RESULTS / "autocp_split.csv") if r["impl"] == "gdn_fwd.s44"}
print("; ".join(sorted({f"{r['gpu']}, {r['method']}" for r in run_of.values()})))
print(f"{'problem':22s} {'rule':>9s} {'fastest':>13s} {'unsplit':>8s} {'FlashQLA':>9s}  run")
for label, t in sweep.items():
    own = {int(k[1]): v for k, v in t.items() if k[0] == "gdn_fwd.s44" and k[1] != ""}
    best, L = min(own, key=own.get), rule[label]
    print(f"{bench.short_label(label):22s} {own[L]:6.3f} L{L:<3d}{own[best]:7.3f} L{best:<4d} {own[0]:8.3f} "
          f"{t['FlashQLA', '']:9.3f}  {run_of[label]['commit']}")
    assert own[L] <= 1.03 * own[best]                     # within 3 % of the fastest timed

# %% [markdown]
# **What it measures.** `python -m flashqla bench` times every row of a problem in one process,
# CUDA-graph replay where capture works, and writes `profiles/results/gdn_fwd.csv`. Below, the
# library's row (`flashqla.chunk_gated_delta_rule`) with FLA and FlashQLA from the same run, as
# ratios: the peer's time over ours (above 1: we are faster).

# %%
fwd_rows = bench.read_csv(RESULTS / "gdn_fwd.csv")
ours = {r["problem"]: r for r in fwd_rows if r["impl"] == bench.API_ROW}
same_run = {(r["problem"], r["impl"]): r for r in fwd_rows if r["problem"] in ours
            and r["commit"] == ours[r["problem"]]["commit"] and r["impl"] in (bench.FLA_ROW, bench.FLASHQLA_ROW)}
ratio = {(label, peer): float(same_run[label, peer]["ms"]) / float(r["ms"])
         for label, r in ours.items() for peer in (bench.FLA_ROW, bench.FLASHQLA_ROW)}
print("; ".join(sorted({f"{r['gpu']}, commit {r['commit']}, {r['date']}, {r['method']}" for r in ours.values()})))
print(f"{'(H, HV)':>9} " + "".join(f"{m:>13}" for m in MIX_NAMES)
      + "     vs FLA / vs FlashQLA")
for H, HV in PUBLIC_HEADS:
    labels = [Problem(H, HV, mix).label for mix in bench.MIXES]
    print(f"({H:2d}, {HV:2d}) " + "".join(
        f"{ratio[lb, bench.FLA_ROW]:6.2f} /{ratio[lb, bench.FLASHQLA_ROW]:5.2f}" for lb in labels))
geo = lambda v: math.exp(sum(map(math.log, v)) / len(v))
for peer in (bench.FLA_ROW, bench.FLASHQLA_ROW):
    v = [ratio[lb, peer] for lb in ours]
    print(f"vs {peer.split(' ')[0]:8s}: {min(v):.2f}-{max(v):.2f}x, geomean {geo(v):.2f}x over {len(v)} problems")
big, small = ours["(16, 64) 1x32768"], ours["(2, 8) 1x2048"]
for r in (big, small):
    print(f"{r['problem']}: {float(r['ms']) * 1e3:.0f} us, {r['tflops']} TFLOP/s ({r['pct_gemm_roof']} % of the "
          f"{r['gemm_roof_tflops']} TFLOP/s GEMM roof measured in the run), {r['gbs']} GB/s "
          f"({r['pct_copy_roof']} % of copy), {r['x_floor']}x the floor")
vs_q, vs_f = ([ratio[lb, peer] for lb in ours] for peer in (bench.FLASHQLA_ROW, bench.FLA_ROW))
assert len(ours) == 40 and {r["gpu"] for r in ours.values()} == {"NVIDIA H100 80GB HBM3"}
assert [round(x, 2) for x in (min(vs_q), geo(vs_q), min(vs_f), max(vs_f), geo(vs_f))] == [1.04, 1.33, 1.39, 4.07, 2.75]
assert big["x_floor"] == "2.33" and round(float(small["x_floor"])) == 15
assert float(small["pct_gemm_roof"]) < 7 and float(small["pct_copy_roof"]) < 7

# %% [markdown]
# On one H100 the library is at least FlashQLA's speed on all 40 problems (1.04-2.02x, geomean
# 1.33x) and 1.39-4.07x FLA (geomean 2.75x). The floor is the larger of the useful FLOPs at the
# measured GEMM roof and the bytes that must move at the measured copy roof: on the largest
# problem, (16, 64) 1 x 32768, the forward takes 2.33x it (1.164 ms; the run before, at fbf3c07 on
# the same kernels, took 1.126 ms, 2.22x: runs on one card vary by a few per cent). On (2, 8)
# 1 x 2048 it takes 15x it, at under 7 % of either roof: 32 dependent chunk steps of one chain plus
# the solve before it, bound by latency, not by bandwidth or FLOPs.
#
# Everything between s06 and s44 is the lab log (book page `lab_log`): each stage that was tried,
# what it measured, and whether it was kept. A learner needs none of it to follow this chapter.

# %%
between = [s for s in discover() if s.op == "gdn_fwd" and 6 < s.number < 44]
print(f"the lab log: {len(between)} gdn_fwd stages between s06 and s44, from {between[0].path.stem} "
      f"to {between[-1].path.stem}")

# %% [markdown]
# ## Summary
#
# - Each chunk's step is affine in the state, so a segment maps its entering state to $M h + Z$:
#   segments can run in parallel once their entering states are known, chained exactly
#   ($h_{j+1} = M_j h_j + Z_j$) or approximated.
# - With $g_t \le 0$ and $0 \le \beta_t \|k_t\|^2 \le 2$ every token's map has norm at most $e^{g_t}$:
#   a warm-up from zero over the chunks back to a cumulative log decay of $-10$ is within
#   $e^{-10}$ of the state where it starts. Heads with $g = 0$ (a quarter in the models), and any
#   head whose previous segment breaks the conditions, take the exact $M$.
# - `flashqla.autocp` decides from host integers and can build the segment table on the device, with
#   a host-known bound on its rows, so the forward can be captured in a CUDA graph; the library reads
#   the lengths once per `cu_seqlens` tensor and keeps the plan it builds from them.
# - `gdn_fwd.s06` splits (2, 8) on one sequence of 32768 tokens 2.4x faster than the unsplit chain
#   under a graph (2.9x at 65536); a full card gains nothing, and the rule leaves it whole.
# - The library runs `gdn_fwd.s44`: a solve, AutoCP's three kernels where the rule splits, and one
#   fused warp-specialized kernel. On one H100 it is at least FlashQLA's speed on all 40 benchmark
#   problems (geomean 1.33x) and 2.75x FLA's (geomean).

# %% [markdown]
# ## Exercises
#
# **1. The warm-up window.** Write the window rule of section 2 for one (segment, head):
# `warmup_window(decays, threshold)` gets the log decay of each chunk of the previous segment
# ($\sum g$ over the chunk, all $\le 0$), oldest first, and returns $w$, the fewest chunks counted
# back from the segment start whose decays sum to at most `threshold`, or 0 where even the whole
# segment does not reach it (the head then takes the exact path). The check runs it on every
# (segment, head) of a two-sequence problem whose decays change from chunk to chunk, against
# `autocp.warmup`, and shows what your windows do to the float64 segment states.

# %% tags=["exercise"]
def warmup_window(decays, threshold=autocp.THRESHOLD):
    total = torch.cumsum(decays, 0)                  # TODO: the window must end at the segment start
    reached = (total <= threshold).nonzero()
    return int(reached[0]) + 1 if len(reached) else 0


# %% tags=["check"]
check_warmup_window(warmup_window)

# %% tags=["solution", "hide-input"]
def warmup_window(decays, threshold=autocp.THRESHOLD):
    total = torch.cumsum(decays.flip(0), 0)          # newest chunk first: the window ends at the segment start
    reached = (total <= threshold).nonzero()
    return int(reached[0]) + 1 if len(reached) else 0


result = check_warmup_window(warmup_window)
assert result.passed, result
result

# %% [markdown]
# **2. A segment's exact transition.** An exact head needs the transition $M$ of the whole previous
# segment, the product of its chunks' transitions $M_c$ (`reference.chunk_transition`). Write
# `segment_transition(chunk_M)`: `chunk_M` is `[L, HV, K, K]`, the chunks in the order they run;
# return `[HV, K, K]` such that the state leaving the segment is $M h + Z$. The check compares each
# segment's $M$ with the float64 recurrence run with $v = 0$ from $I$ over that segment's tokens,
# then chains $h_{j+1} = M_j h_j + Z_j$ against `reference.segment_states`.

# %% tags=["exercise"]
def segment_transition(chunk_M):
    M = torch.eye(chunk_M.shape[-1], dtype=chunk_M.dtype).expand_as(chunk_M[0])
    for M_c in chunk_M:
        M = M @ M_c                                  # TODO: which factor acts on the state first?
    return M


# %% tags=["check"]
check_segment_transition(segment_transition)

# %% tags=["solution", "hide-input"]
def segment_transition(chunk_M):
    M = torch.eye(chunk_M.shape[-1], dtype=chunk_M.dtype).expand_as(chunk_M[0])
    for M_c in chunk_M:
        M = M_c @ M                                  # a later chunk acts after: M_{L-1} ... M_1 M_0
    return M


result = check_segment_transition(segment_transition)
assert result.passed, result
result
