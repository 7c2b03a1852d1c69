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
# # Warp specialization: a warpgroup for each role
#
# Chapter 3's fused kernel `gdn_fwd.s03` runs every chunk's work in the same warps, one product
# after the other: the state chain ($\tilde V = u - w S$, then the state update) and the output
# ($Q S$, the scores $P$, $P \tilde V$). The chain is sequential from chunk to chunk; the output work
# of chunk $c$ is not on that path, yet it delays chunk $c + 1$'s chain by as much as it takes.
# Chapter 4's reformulation made the preparation cheaper and the chain one product longer. This
# chapter takes the kernel apart instead: `gdn_fwd.s05` keeps s03's math and gives each of four
# warpgroups one duty, so that the output of chunk $c$ is computed while the chain already works on
# chunk $c + 1$. Then it follows the same organization into the kernels the library runs.
#
# **What you will learn**
#
# - how s05 splits s03's fused kernel into chain, scores, output and producer warpgroups, and why
#   that order of hand-offs lets the chain set the pace;
# - the budget of a warp-specialized CTA: shared memory (tile stages and hand-off slots), mbarriers
#   named for what they guard, and `setmaxnreg` register budgets per role;
# - how an mbarrier's phase parity orders a ring of buffers, and the pipeline as a timeline;
# - what s05 measured against s03, FLA and FlashQLA, and what Nsight Compute says changed;
# - how the library's fused kernels (`flashqla/fwd.py`) follow from s05 with chapter 4's math, and
#   where their roles spend their cycles, from a clock read inside each warpgroup.
#
# **What you need first**
#
# - chapter 3: `gdn_fwd.s03`, TMA loads, `T.Pipelined`'s producer and consumers, wgmma;
# - chapter 4: $\tilde V = (\Gamma \odot A_b)(V - D K S)$ and the gate-free solve.
#
# Every cell runs on a CPU; the GPU numbers are read from the committed results.

# %%
import csv
import inspect
import re
import warnings

import matplotlib.pyplot as plt

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by TileLang
import tilelang
import tilelang.language as T

from flashqla import bench, fwd
from flashqla.exercises.ch04 import allocations
from flashqla.exercises.ch05 import check_register_budgets, check_smem_bytes, check_wait_parity
from flashqla.stages import load

tilelang.set_log_level("WARNING")
s03, s05 = load("gdn_fwd", 3), load("gdn_fwd", 5)
KC, CC, BF16, FP32 = 128, 64, 2, 4


def doc_numbers(doc, pattern):
    """The groups of pattern in a docstring (whitespace normalized); a ValueError when it no longer says it."""
    m = re.search(pattern, " ".join(doc.split()))
    if m is None:
        raise ValueError(f"the docstring no longer says {pattern!r}")
    return m.groups()


# %% [markdown]
# ## 1. Four roles
#
# s03 used `T.Pipelined`: a producer warpgroup that TileLang adds for the TMA loads, and consumer
# warpgroups that run the whole of every chunk. s05 writes the roles out by hand, one warpgroup
# (128 threads, the unit of wgmma and of `setmaxnreg`) each, selected by ONE `if` / `elif` chain on
# the thread index:
#
# | role | threads | per chunk $c$ |
# |---|---|---|
# | chain | [0, 128) | owns the state $S$ (fp32, in its registers): $\tilde V_c = u - w S_c$ (s03's math: $u$, $w$ from the preparation), then $S \leftarrow e^{\gamma_C} S + K^\top \operatorname{diag}(e^{\gamma_C - \gamma}) \tilde V_c$ |
# | scores | [128, 256) | $P_c = s\,(Q K^\top \odot \Gamma)$, lower triangle including the diagonal: it needs no state, so it runs ahead |
# | output | [256, 384) | $O_c = s \operatorname{diag}(e^{\gamma}) Q S_c + P_c \tilde V_c$, stored straight from its registers |
# | producer | [384, 512) | the $q$, $k$, $w$, $u$ tiles by TMA, and $\log_2(e)\,\gamma$ into the stage's gate buffer |
#
# The roles hand tiles, states and scores to each other through shared memory, ordered by
# mbarriers, and `setmaxnreg` gives the producer's registers to the roles that hold accumulators.
# What the split is worth shows in the numbers s05's docstring starts from:

# %%
s03_us, chain_alone_us = doc_numbers(s05.__doc__, r"about ([\d.]+) us a chunk, latency-bound; the chain alone took ([\d.]+)")
print(f"s03's fused kernel: {s03_us} us a chunk, of which its chain alone needs {chain_alone_us}")
assert float(chain_alone_us) < float(s03_us) / 2

# %% [markdown]
# Less than half of s03's chunk is on the chain: the rest is output work that, in its own warps,
# could run beside the next chunk's chain. The docstring also records how the stage got there,
# measurement by measurement: a first version with three roles (chain | output | producer) was no
# faster than s03; timing it with one role's math removed showed the output warpgroup to be the long
# one, its score tile compiled to divergent branches around `exp2f`, and fixing that and giving the
# scores a warpgroup of their own made this stage.
#
# ## 2. The budget: shared memory, barriers, registers
#
# A warp-specialized CTA must fit four roles in one SM: all their shared-memory buffers (up to
# 227 KiB per CTA on Hopper) and all their registers (65536 per SM; a warpgroup's `setmaxnreg`
# budget applies to each of its 128 threads). The tables below are read from the stage's kernel
# source and constants: every `T.alloc_shared` and `T.alloc_barrier` with its shape evaluated, the
# roles that touch it (a role's code runs from the branch that selects it to the next one), each
# role's threads and register budget. They are then checked against the docstring's tables, whose
# "used" column of registers was read from the SASS.

# %%
def role_blocks(src):
    """{register-budget constant: (the role's branch condition, its code up to the next role's branch)}."""
    blocks, current, lines = {}, None, src.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"T\.set_max_nreg\((\w+)", line)
        if m:
            current = m.group(1)
            blocks[current] = (lines[i - 1].strip(), [])
        elif current and re.match(r"\s*elif tx", line):
            current = None
        if current:
            blocks[current][1].append(line)
    return {name: (cond, "\n".join(body)) for name, (cond, body) in blocks.items()}


def thread_range(cond, module, end="THREADS"):
    """[lo, hi) of a role from its branch condition, e.g. 'elif tx >= CHAIN_END and tx < SCORES_END:'."""
    lo, hi = re.search(r"tx >= (\w+)", cond), re.search(r"tx < (\w+)", cond)
    return (getattr(module, lo.group(1)) if lo else 0, getattr(module, hi.group(1) if hi else end))


src05 = inspect.getsource(s05.fused_h_o_kernel)
roles = role_blocks(src05)
ROLE = {budget: budget.removeprefix("REGS_").lower() for budget in roles}   # REGS_CHAIN -> "chain"
allocs = allocations(s05, s05.fused_h_o_kernel)
smem = [(n, dims, dt, b) for n, kind, dims, dt, b in allocs if kind == "shared"]
print(f"{'shared buffer':13s} {'shape':14s} {'dtype':9s} {'KiB':>6s}  used by")
for name, dims, dtype, nbytes in smem:
    users = [ROLE[r] for r, (_, body) in roles.items() if re.search(rf"\b{name}\b", body)]
    print(f"{name:13s} {str(dims):14s} {dtype:9s} {nbytes / 1024:6.1f}  {', '.join(users)}")
BARRIERS = re.findall(r"(\w+) = T\.alloc_barrier\(\[([^\]]*)\] \* (\w+)\)\s*#\s*(.*)", src05)
n_bar = sum(getattr(s05, slots) for _, _, slots, _ in BARRIERS)
total = sum(b for *_, b in smem) + 8 * n_bar
print(f"{'mbarriers':13s} {n_bar} x 8 B\ntotal {total / 1024:.1f} KiB of the 227 KiB a CTA may use: one CTA per SM\n")
doc_total = doc_numbers(s05.__doc__, r"Shared memory \((\d+) KB of 227\)")[0]
assert abs(total / 1024 - int(doc_total)) < 1, (total, doc_total)

print(f"{'barrier':17s} {'slots':>5s} {'arrivals':>8s}  {'arrive':16s} {'wait':24s} source comment")
for bar, count, slots, comment in BARRIERS:
    arrive = [ROLE[r] for r, (_, body) in roles.items() if re.search(rf"barrier_arrive\({bar}\[", body)]
    wait = [ROLE[r] for r, (_, body) in roles.items() if re.search(rf"barrier_wait\({bar}\[", body)]
    needed = eval(count, {}, vars(s05))
    assert needed == s05.WARPGROUP * len(arrive), (bar, needed, arrive)   # every arriving thread once
    print(f"{bar:17s} {getattr(s05, slots):5d} {needed:8d}  {', '.join(arrive):16s} {', '.join(wait):24s} {comment}")

# the docstring's table: role, [lo, hi), setmaxnreg, ~used
doc_roles = {r: (int(lo), int(hi), int(n), u) for r, lo, hi, n, u in
             re.findall(r"^\s+(\w+)\s+\[(\d+), (\d+)\)\s+(\d+)\s+~(\d+)", s05.__doc__, re.M)}
doc_used = {r: u for r, (*_, u) in doc_roles.items()}
print(f"\n{'role':9s} {'threads':>10s} {'setmaxnreg':>10s} {'used':>5s} {'registers':>10s}")
reg_total = 0
for budget, (cond, _) in roles.items():
    lo, hi = thread_range(cond, s05)
    nreg = getattr(s05, budget)
    assert doc_roles[ROLE[budget]][:3] == (lo, hi, nreg), (budget, doc_roles[ROLE[budget]])
    reg_total += nreg * (hi - lo)
    print(f"{ROLE[budget]:9s} {f'[{lo}, {hi})':>10s} {nreg:10d} {doc_used[ROLE[budget]]:>5s} {nreg * (hi - lo):10d}")
print(f"{'total':9s} {s05.THREADS:10d} {'':10s} {'':5s} {reg_total:10d} of 65536 "
      f"(at launch each thread gets 65536 / {s05.THREADS} = {65536 // s05.THREADS})")
assert set(doc_used) == set(ROLE.values()) and total <= 227 * 1024 and reg_total <= 65536

# %% [markdown]
# The tile stages, `NUM_STAGES` copies of the $q$, $k$, $w$ and $u$ tiles and of the gates, take most
# of the shared memory. The hand-off slots, `NUM_HANDOFF` copies of $S_c$ (bf16) and $\tilde V_c$ from
# the chain and of $P_c$ from the scores warpgroup, let those two roles write chunk $c + 1$'s while
# the output warpgroup still reads chunk $c$'s; `vd_s`, the decayed copy of $\tilde V$ that the state
# update reads, is the chain's alone. No two buffers share an address: TileLang's planner treats the
# role branches as if they ran one after another and gave two roles' buffers one address, so the
# stage turns shared-memory reuse off (`tl.disable_shared_memory_reuse`).
#
# **Registers.** With 512 threads, ptxas gives every thread 128 at launch; `setmaxnreg` then moves
# them within that pool of $4 \times 128$ a thread. The producer, which holds only addresses, keeps
# 24; the chain, which keeps the fp32 state ($K \times B_V / 128 = 64$ registers a thread) and
# $\tilde V$ in both forms, gets the most; scores and output each hold one $64 \times 64$ fp32 tile. A
# budget is a ceiling ptxas compiles the role under, not what it spends (the "used" column). Two rules
# make a budget legal: `setmaxnreg.inc` may only raise, and `.dec` only lower, the count a thread
# holds (exercise 3), and the budgets must fit the pool, or an `.inc` waits forever.
#
# **Barriers**, each with one copy per stage or slot, named for what they guard: `bar_tiles_full`
# (the producer's loads have landed) and `bar_tiles_empty` (all three consumers are done with the
# stage), and a ready / free pair for each hand-off: `bar_state_ready` / `bar_state_free` between
# chain and output, `bar_scores_ready` / `bar_scores_free` between scores and output.
#
# ## 3. The pipeline
#
# Per chunk $c$: tile stage $s = c \bmod$ `NUM_STAGES`, hand-off slot $b = c \bmod$ `NUM_HANDOFF`. A
# barrier completes a phase when all its arrivals are in (and, for `bar_tiles_full`, the bytes the
# TMA loads announced); a wait names the phase by its parity, so `barrier_wait(bar[s], (c // n) % 2)`
# waits for chunk $c$'s arrivals, and `(c // n) % 2 ^ 1` for those of chunk $c - n$, the previous user
# of the same slot (it passes at once for the first $n$ chunks; exercise 1). Each role's loop, its
# synchronization and products in program order, read from the kernel source:

# %%
SYNC_OPS = (  # (kind, pattern) for the lines of a role's loop that the pipeline is made of
    ("wait", r"T\.barrier_wait\((\w+)\[(\w)\], \(c // (\w+)\) % 2( \^ 1)?\)"),
    ("arrive", r"T\.barrier_arrive\((\w+)\[(\w)\]\)"),
    ("tma", r"T\.tma_copy\((\w+)\[.*barrier=(\w+)\[(\w)\]\)"),
    ("mma", r"T\.(gemm|wgmma_gemm)\((\w+)(?:\[[^\]]*\])?, (\w+)(?:\[[^\]]*\])?, (\w+)"),
    ("wait_mma", r"T\.wait_wgmma\("),
)
SHAPES = {name: dims for name, _, dims, _, _ in allocs}
SLOT_OF = dict(re.findall(r"(\w) = c % (\w+)", src05))                       # s -> NUM_STAGES, ...


def mma_flops(a, c_frag, line):
    """2 M N K of a product into the fragment c_frag; A sliced by a stage / slot index loses its first dim."""
    a_dims = SHAPES[a][1:] if re.search(rf"\b{a}\[", line) else SHAPES[a]
    m, n = SHAPES[c_frag]
    return 2 * m * n * (a_dims[0] * a_dims[1] // m)


def program(body):
    """The ops of a role's chunk loop, in program order: (kind, *groups, line)."""
    ops = []
    for line in body.split("for c in T.serial(num_chunks):", 1)[1].splitlines():
        for kind, pattern in SYNC_OPS:
            m = re.search(pattern, line)
            if m:
                ops.append((kind, *m.groups(), line.strip()))
    return ops


PROGRAMS = {ROLE[budget]: program(body) for budget, (_, body) in roles.items()}
for role, ops in PROGRAMS.items():
    steps = []
    for kind, *args, line in ops:
        if kind == "wait":
            bar, var, mod, prev = args
            assert SLOT_OF[var] == mod, (bar, var, mod)          # the parity counts uses of that slot
            steps.append(f"wait {bar}[{var}]" + (f" (chunk c - {mod})" if prev else ""))
        elif kind == "arrive":
            steps.append(f"arrive {args[0]}[{args[1]}]")
        elif kind == "tma":
            steps.append(f"TMA {args[0]}")
        elif kind == "mma":
            steps.append(f"{args[1]} x {args[2]} ({mma_flops(args[1], args[3], line) / 1e6:.2f} MFLOP"
                         + (", async)" if args[0] == "wgmma_gemm" else ")"))
        else:
            steps.append("wait for the async wgmma")
    print(f"{role}:\n    " + "\n    ".join(steps))

# %% [markdown]
# Read as a protocol, per chunk $c$:
#
# - **producer**: waits until the three consumers have released stage $s$ (chunk $c - 2$), issues the
#   TMA loads, writes the gates, and arrives on `bar_tiles_full[s]`, which completes once the loads'
#   bytes have landed too.
# - **chain**: waits for the tiles and for the output warpgroup to have freed slot $b$; stores $S_c$
#   in bf16 (the operand of $w S_c$ here and of $Q S_c$ in the output warpgroup), computes $w S_c$,
#   then $\tilde V_c$ and its decayed copy; issues the state update $K^\top \tilde V_d$ without waiting
#   for it, and meanwhile stores $\tilde V_c$, fences and arrives on `bar_state_ready[b]`; then waits
#   for the update and releases the stage.
# - **scores**: waits for the tiles and a free slot, computes $P_c$ and releases the stage at once,
#   then stores $P_c$, fences and arrives on `bar_scores_ready[b]`.
# - **output**: waits for the tiles and $S_c$; computes $Q S_c$ and releases the stage; waits for $P_c$,
#   computes $P_c \tilde V_c$, frees both slots, stores $O_c$.
#
# The fence matters: the hand-off tiles are written by ordinary stores (the generic proxy) and read
# by another warpgroup's wgmma (the async proxy), so each writer runs `fence.proxy.async` before it
# arrives.
#
# A small event simulation runs these programs as listed. Its durations are napkin figures: every
# product costs what the chain's products cost per FLOP when the chain ran alone (the docstring's
# measurement); the producer's loads take the bytes a CTA brings from DRAM per chunk at an SM's share
# of the copy roof, counting the $q$ and $k$ tiles of a key head once for its $H_V / H$ value heads
# and the tiles both $V$-tile CTAs read once; stores, fences and elementwise work take no time, and
# the roles do not slow each other down. s03 for contrast: the same loads, and its measured time per
# chunk, all in one role.

# %%
H_L, HV_L, SMS = 16, 64, 132
chapter_rows = bench.read_csv(bench.RESULTS / "gdn_fwd_chapter4.csv")     # the run that timed s03 and s05
COPY_ROOF = float(chapter_rows[0]["copy_roof_gbs"]) * 1e9
chain_flops = sum(mma_flops(op[2], op[4], op[-1]) for op in PROGRAMS["chain"] if op[0] == "mma")
US_PER_FLOP = float(chain_alone_us) / chain_flops
n_vt = KC // s05.BLOCK_V                                               # CTAs per value head
cta_bytes = (2 * CC * KC * BF16 * H_L / HV_L + CC * KC * BF16 + CC * FP32) / n_vt + CC * s05.BLOCK_V * BF16
LOAD_US = cta_bytes / (COPY_ROOF / SMS) * 1e6                          # q, k, w, g (shared by the V tiles) + u
print(f"products at {US_PER_FLOP * 1e6:.2f} us per MFLOP (the chain alone: {chain_alone_us} us for "
      f"{chain_flops / 1e6:.2f} MFLOP); loads {cta_bytes / 1024:.1f} KiB a CTA and chunk, {LOAD_US:.2f} us")


def simulate_s05(n):
    """Run the roles' programs for n chunks: bars [(role, t0, t1, label, chunk)], waits that held a
    role up [(t, from role, to role, chunk)], and the time each chunk's last role finished it."""
    need = {bar: eval(count, {}, vars(s05)) // s05.WARPGROUP for bar, count, _, _ in BARRIERS}
    arrivals, tx_end = {}, {}            # (barrier, chunk) -> [(time, role)]; the loads' end
    st = {role: dict(c=0, pc=0, t=0.0, mma_end=0.0) for role in PROGRAMS}
    bars, held, chunk_end, copy_free = [], [], {}, 0.0

    def completed(bar, c):
        got = arrivals.get((bar, c), [])
        return max(got + ([tx_end[bar, c]] if (bar, c) in tx_end else [])) if len(got) >= need[bar] else None

    while any(s["c"] < n for s in st.values()):
        progress = False
        for role, ops in PROGRAMS.items():
            s = st[role]
            while s["c"] < n:
                kind, *args, line = ops[s["pc"]]
                c = s["c"]
                if kind == "wait":
                    bar, _, mod, prev = args
                    src = c - getattr(s05, mod) if prev else c
                    if src >= 0:
                        done = completed(bar, src)
                        if done is None:
                            break                                   # blocked until the arrivals are in
                        if done[0] > s["t"]:
                            held.append((done[0], done[1], role, c))
                            s["t"] = done[0]
                elif kind == "arrive":
                    arrivals.setdefault((args[0], c), []).append((s["t"], role))
                elif kind == "tma" and (args[1], c) not in tx_end:  # the chunk's loads, one after the other
                    t0 = max(s["t"], copy_free)
                    copy_free = t0 + LOAD_US
                    tx_end[args[1], c] = (copy_free, role)
                    bars.append((role, t0, copy_free, "TMA", c))
                elif kind == "mma":
                    op_, a, b, c_ = args
                    t1 = s["t"] + mma_flops(a, c_, line) * US_PER_FLOP
                    bars.append((role, s["t"], t1, f"{a[:-2]}·{b[:-2]}", c))
                    s["t" if op_ == "gemm" else "mma_end"] = t1
                elif kind == "wait_mma":
                    s["t"] = max(s["t"], s["mma_end"])
                progress, s["pc"] = True, s["pc"] + 1
                if s["pc"] == len(ops):
                    chunk_end[c] = max(chunk_end.get(c, 0.0), s["t"])
                    s["pc"], s["c"] = 0, c + 1
        if not progress:
            raise RuntimeError("the roles' programs deadlock: " + str(st))
    return bars, held, chunk_end


def simulate_s03(n):
    """s03: a producer (the same loads, NUM_STAGES stages) and consumers that do a whole chunk in turn."""
    bars, chunk_end, t_prod, t_cons = [], {}, 0.0, 0.0
    for c in range(n):
        t0 = max(t_prod, chunk_end.get(c - s05.NUM_STAGES, 0.0))
        t_prod = t0 + LOAD_US
        bars.append(("producer", t0, t_prod, "TMA", c))
        t_cons = chunk_end[c] = max(t_cons, t_prod) + float(s03_us)
        bars.append(("consumers", t_cons - float(s03_us), t_cons, "", c))
    return bars, [], chunk_end


N_SIM = 8
fig, axes = plt.subplots(2, 1, figsize=(13, 5), sharex=True, gridspec_kw=dict(height_ratios=[2, 4]))
steady = {}
for ax, (name, sim, rows_) in zip(axes, (("s03: producer + consumers doing everything", simulate_s03,
                                           ["producer", "consumers"]),
                                          ("s05: producer, chain, scores and output warpgroups", simulate_s05,
                                           ["producer", "chain", "scores", "output"]))):
    bars, held, ends = sim(N_SIM)
    ys = {r: len(rows_) - 1 - i for i, r in enumerate(rows_)}
    for row, t0, t1, label, c in bars:
        ax.barh(ys[row], t1 - t0, left=t0, height=0.6, color=plt.cm.tab10(c % 10), alpha=0.75, edgecolor="k", lw=0.5)
        ax.text((t0 + t1) / 2, ys[row], label or f"chunk {c}", ha="center", va="center", fontsize=6)
    for t, r0, r1, _ in held:
        ax.annotate("", xy=(t, ys[r1]), xytext=(t, ys[r0]), arrowprops=dict(arrowstyle="->", lw=0.6, color="gray"))
    ax.set_yticks(list(ys.values()), list(ys))
    ax.set_title(name, fontsize=9)
    steady[name[:3]] = (ends[N_SIM - 1] - ends[1]) / (N_SIM - 2)
axes[1].set_xlabel("time (us), napkin durations; one color per chunk; arrows: a wait that held a role up", fontsize=8)
fig.tight_layout()
held_up = {}
for t, r0, r1, c in simulate_s05(N_SIM)[1]:
    held_up.setdefault(f"{r1} <- {r0}", []).append(c)
chunk_lo, chunk_hi = doc_numbers(s05.__doc__, r"A chunk now takes ([\d.]+)-([\d.]+) us")
print(f"steady state: s03 {steady['s03']:.2f} us a chunk (measured), s05 {steady['s05']:.2f} us a chunk in the "
      f"timeline; measured (s05's docstring) {chunk_lo}-{chunk_hi} us")
print("who held whom up in the s05 timeline, at which chunks:", held_up)
assert held_up["chain <- producer"] == [0] and not any(w.startswith("chain <- ") and w != "chain <- producer"
                                                       for w in held_up)   # the chain waits for its first tiles only

# %% [markdown]
# In the timeline the chain sets the pace: it waits only for its first tiles, because the scores
# warpgroup (which needs no state) runs a chunk ahead, the output warpgroup finishes chunk $c$ while
# the chain works on $c + 1$, and the second hand-off slot gives it that time. A chunk then costs the
# chain's two products, and the producer, whose DRAM share per chunk takes well under a chunk's time,
# is idle most of the time.
#
# The measured kernel is slower than this timeline, so the roles do slow each other down. What the
# timeline leaves out is what they share: one SM's four tensor cores (a warpgroup has one warp on
# each of the four sub-partitions, so every role's wgmma runs on the same units), its issue slots and
# shared-memory bandwidth, and the elementwise work (the score tile's exponentials, the masks, the
# bf16 conversion of every hand-off).
#
# ## 4. Measured effect
#
# The benchmark's run of chapter 4 (one H100, CUDA-graph replay, each problem in one process) timed
# s03 and s05 with FLA and FlashQLA on the (16, 64) problems below; the napkin columns are s05's
# achieved tensor-core rate (useful FLOPs over its time), its share of the GEMM roof and its time over
# the card's floor for the work:

# %%
IMPLS = {"s03": "gdn_fwd/s03_fused_h_o", "s05": "gdn_fwd/s05_warp_specialized",
         "FLA": bench.FLA_ROW, "FlashQLA": bench.FLASHQLA_ROW}
row_of = {(r["problem"], r["impl"]): r for r in chapter_rows}
problems = [p for p in dict.fromkeys(r["problem"] for r in chapter_rows)
            if all((p, impl) in row_of for impl in IMPLS.values())]
assert len({row_of[p, i]["commit"] for p in problems for i in IMPLS.values()}) == 1   # one run
print(f"{chapter_rows[0]['gpu']}, commit {row_of[problems[0], IMPLS['s05']]['commit']}, {chapter_rows[0]['method']}")
print(f"{'problem':22s}" + "".join(f"{c + ' ms':>12s}" for c in IMPLS) + f"{'s03/s05':>9s}{'TFLOP/s':>9s}"
      f"{'% GEMM':>8s}{'x floor':>8s}")
speedup = {}
for p in problems:
    t = {c: float(row_of[p, impl]["ms"]) for c, impl in IMPLS.items()}
    r5 = row_of[p, IMPLS["s05"]]
    speedup[p] = t["s03"] / t["s05"]
    print(f"{bench.short_label(p):22s}" + "".join(f"{t[c]:12.3f}" for c in IMPLS) + f"{speedup[p]:8.2f}x"
          f"{float(r5['tflops']):9.1f}{float(r5['pct_gemm_roof']):7.1f}%{float(r5['x_floor']):8.2f}")
    assert t["s05"] < min(t["s03"], t["FLA"]) and t["FlashQLA"] < t["s05"]
assert all(1.2 < x < 1.25 for x in speedup.values())

# the fused kernels alone (s05's docstring: one H200, CUDA events): s03 kernel, ..., s05 kernel (x)
KERNEL_ROW = r"\((\d+), (\d+)\)\s+(\d+) x (\d+)\s+([\d.]+) ms\s+[\d.]+\s+[\d.]+\s+([\d.]+) \(([\d.]+)x\)"
kernel_alone = re.findall(KERNEL_ROW, s05.__doc__)
print("\nthe fused kernels alone (s05's docstring, one H200):")
for h_, hv_, n_seq, length, k03, k05, x in kernel_alone:
    print(f"  ({h_}, {hv_}) {n_seq} x {length}: s03 {k03} ms, s05 {k05} ms ({x}x)")
assert len(kernel_alone) == 3

# %% [markdown]
# s05 is about 1.2x faster than s03 on every one of these problems, and faster than FLA; FlashQLA
# stays well ahead. The fused kernel alone gains 1.5-1.7x (the docstring's table); the whole run
# gains less because s05 keeps s03's preparation, which chapter 4's reformulation shrinks and this
# stage does not touch. The kernel runs at a fraction of the GEMM roof: it is latency-bound.
#
# Nsight Compute (`profiles/ncu_lab.py`, chapter 3) profiled both fused kernels on (16, 64) 1 x 8192,
# the same work:

# %%
ncu = {}
for n in (3, 5):
    with open(bench.RESULTS / f"ncu_gdn_fwd_s{n:02d}.csv", newline="") as f:
        (ncu[n],) = csv.DictReader(f)
FIELDS = ("us", "gflop", "tflops", "tensor_pct", "dram_mb", "dram_pct", "occupancy_pct", "regs", "smem_kb",
          "block", "stalls")
for field in FIELDS:
    print(f"{field:14s} s03 {ncu[3][field]:<40s} s05 {ncu[5][field]}")
assert ncu[3]["problem"] == ncu[5]["problem"] and ncu[3]["gflop"] == ncu[5]["gflop"] and ncu[3]["gpu"] == ncu[5]["gpu"]
stalls = {n: dict((k, float(v)) for k, v in re.findall(r"(\w+) ([\d.]+)", ncu[n]["stalls"])) for n in ncu}
assert "barrier" in stalls[3] and "barrier" not in stalls[5] and max(stalls[5], key=stalls[5].get) == "long_scoreboard"
assert float(ncu[5]["tensor_pct"]) < 50 and float(ncu[5]["dram_pct"]) < 50

# %% [markdown]
# On the same work (the same GFLOP and DRAM bytes) the kernel's time drops by the docstring's
# kernel-alone factor; the tensor pipe is busier and DRAM runs closer to its peak, but both stay far
# from their roofs. One CTA per SM both times, 16 warps instead of 12; registers at launch drop to
# 128 a thread (the role budgets are set at run time by `setmaxnreg`), shared memory grows (the
# double hand-off slots, reuse off). The `barrier` stall (s03's consumer warpgroups synchronizing)
# has left the top three; `long_scoreboard` (waiting for a memory operation's result) is still first.
# Still latency-bound: what sets the pace is a chain of dependent steps, not a throughput.
#
# ## 5. From s05 to the library's fused kernels
#
# s05 and chapter 4's s04 change different kernels, so they combine. Three moves take s05's
# organization to the kernels `flashqla.chunk_gated_delta_rule` runs:
#
# - **s04's math in s05's roles.** The producer loads $v$ and $A_b$ instead of $w$ and $u$, and the
#   chain computes $U = K S$, $W = V - D U$, $\tilde V = (\Gamma \odot A_b) W$. The masked tile
#   $\Gamma \odot A_b$ needs no state, only the gates and $A_b$, so the *scores* warpgroup builds it
#   beside $\Gamma$ for $P$ (it runs ahead) and hands it to the chain through one more ready / free
#   barrier pair; the chain's per-chunk path keeps only products and the elementwise work between them.
# - **A width per launch.** One CTA owns $B_V$ value columns of a head's state. Where few heads leave
#   SMs idle, narrow CTAs (16 or 32 columns) make more of them; where many heads fill the card, wide
#   ones (64 or 128) repeat less of the per-head work ($Q K^\top$, $\Gamma$, $P$). `fwd.block_v` picks
#   the width from the sequence lengths.
# - **The chain split over two warpgroups at 64 and 128 columns.** A $128 \times 128$ fp32 state is
#   128 registers a thread of a warpgroup, too many beside $\tilde V$: the chain becomes a *state*
#   warpgroup (owns $S$, its snapshot, decay and update) and a *value* warpgroup ($U$, $W$, $\tilde V$,
#   $V_d$), and scores and output share one. The same kernel runs at 64 columns, except where the
#   solve already stores $\Gamma \odot A_b$ (it takes three or four value heads a CTA, and AutoCP leaves
#   the sequences whole): there one chain warpgroup keeps its 64-column state transposed in
#   registers, so that its products take it as their left operand.
#
# The library's three fused kernels, each read from `flashqla/fwd.py` as section 2 read s05: the
# roles in thread order with their register budgets, the mbarriers with the comment that says what
# each guards, and the shared memory at each width the kernel runs:

# %%
KERNELS = {fwd.fused_reform_kernel: (fwd.NARROWEST_BLOCK_V, fwd.NARROW_BLOCK_V),
           fwd.fused_state_in_registers_kernel: (fwd.WY_BLOCK_V,),
           fwd.fused_state_value_kernel: (fwd.BLOCK_V, fwd.WIDE_BLOCK_V)}
for builder, widths in KERNELS.items():
    src = inspect.getsource(builder)
    lib_roles = role_blocks(src)
    print(f"== fwd.{builder.__name__}, BV = {', '.join(map(str, widths))}: "
          + ", ".join(f"{allocs_kib:.0f} KiB" for allocs_kib in
                      (sum(b for _, kind, *_, b in allocations(fwd, builder, BV=bv) if kind == "shared") / 1024
                       for bv in widths)) + " of shared memory")
    budget_sum = 0
    for budget, (cond, _) in lib_roles.items():
        lo, hi = thread_range(cond, fwd, end="FUSED_THREADS")
        name = re.search(r"# ---- the (.+) warpgroup", cond).group(1)
        budget_sum += getattr(fwd, budget)
        print(f"   {name:16s} [{lo:3d}, {hi:3d})  setmaxnreg {getattr(fwd, budget):3d}")
    assert budget_sum == 4 * 128 and "REGS_PRODUCER" in lib_roles        # the pool of 512 threads, filled
    for bar, comment in re.findall(r"(bar_\w+) = T\.alloc_barrier\(.*\)\s*#\s*(.*)", src):
        print(f"   {bar:17s} {comment}")

# %% [markdown]
# All three keep s05's skeleton: a producer warpgroup with 24 registers, three consumer roles whose
# budgets fill the pool of 512 threads, tile stages and hand-off slots, and ready / free barriers
# named for each hand-off. The stages between s05 and the library's forward (`gdn_fwd.s07` to `s45`, some kept,
# some measured and dropped) are the [lab log](/lab_log.md): each one changed one of the
# moves above and recorded its measured effect in its docstring.
#
# ## 6. Where the roles spend their cycles
#
# The benchmark says how long a forward takes and Nsight Compute that the kernel is latency-bound;
# neither says which role the others wait for. `profiles/role_timeline_lab.py` asks the kernel
# itself: it edits the generated CUDA so that thread 0 of each warpgroup writes `clock64()` before
# and after every mbarrier wait and named barrier, after every arrive and around every wgmma batch
# (the stamped forward must give the library's bits). Between two stamps a role is *waiting* on an
# mbarrier, at its *named barrier* (TileLang's sync within the warpgroup), in a *gemm*, or doing its
# own *work*. The stamps cost time themselves, so spans are longer than the kernel's; the shares are
# what to read. `profiles/results/role_timeline.csv` holds, among others, one run of each of the
# library's kernels (at 64 columns, the stage it was promoted from, `gdn_fwd.s40`):

# %%
with open(bench.RESULTS / "role_timeline.csv", newline="") as f:
    timeline = list(csv.DictReader(f))
TIMED = {"BV 16, fused_reform_kernel": ("(2, 8) 1x2048", "API"),
         "BV 32, fused_reform_kernel": ("(8, 32) 1x8192", "API"),
         "BV 64, fused_state_in_registers_kernel": ("(16, 64) 1x8192", "gdn_fwd.s40"),
         "BV 128, fused_state_value_kernel": ("(16, 64) 4096+4096+4096+4096+4096+4096+4096+4096", "API")}
ACTIVITY = {"wait": "tab:gray", "named barrier": "silver", "gemm": "tab:red", "work": "tab:blue"}
fig, axes = plt.subplots(1, 4, figsize=(14, 3), sharex=True)
per_role, waits = {}, {}
for ax, (what, (prob, impl)) in zip(axes, TIMED.items()):
    rows = [r for r in timeline if (r["problem"], r["impl"]) == (prob, impl)]
    assert rows and rows[0]["block_v"] == what.split()[1].rstrip(","), what
    order = list(dict.fromkeys(r["role"] for r in rows))
    for y, role in enumerate(reversed(order)):
        left = 0
        for act, colour in ACTIVITY.items():
            cyc = sum(int(r["cycles_per_chunk"]) for r in rows if r["role"] == role and r["activity"].startswith(act))
            per_role[what, role, act] = cyc
            ax.barh(y, cyc, left=left, color=colour, label=act if y == 0 else None)
            left += cyc
    ax.set_yticks(range(len(order)), list(reversed(order)), fontsize=8)
    ax.set_title(f"{what.split(',')[0]}: {bench.short_label(prob)}\n{rows[0]['gpu'][7:11]}, {rows[0]['commit']}", fontsize=8)
    ax.set_xlabel("cycles per chunk", fontsize=8)
    span = {r["role"]: int(r["span_cycles_per_chunk"]) for r in rows}
    waits[what] = {role: per_role[what, role, "wait"] / span[role] for role in order}
    print(f"{what:40s} {bench.short_label(prob)}: {rows[0]['span_ns_per_chunk']} ns a chunk; waiting "
          + ", ".join(f"{role} {share:.0%}" for role, share in waits[what].items()))
axes[0].legend(fontsize=7, loc="lower right")
fig.tight_layout()
for what in list(TIMED)[:2]:                   # the narrow kernel: chain and scores barely wait, output half
    assert max(waits[what]["chain"], waits[what]["scores"]) < 0.15 and waits[what]["output"] > 0.4
w64, w128 = waits["BV 64, fused_state_in_registers_kernel"], waits["BV 128, fused_state_value_kernel"]
assert min(w64, key=w64.get) == "chain" and w128["state"] > 0.5 and min(w128, key=w128.get) == "scores/output"

# %% [markdown]
# The stamps of one CTA of the 64-column kernel over six chunks, as the measured counterpart of
# section 3's napkin timeline (`role_timeline_events.csv`; a span between two stamps takes the kind of
# the first: waiting on an mbarrier, at the named barrier, in a gemm, or work):

# %%
KEY64 = TIMED["BV 64, fused_state_in_registers_kernel"]
with open(bench.RESULTS / "role_timeline_events.csv", newline="") as f:
    events = [r for r in csv.DictReader(f) if (r["problem"], r["impl"]) == KEY64]
KIND = {"wait": "wait", "sync": "named barrier", "gemm": "gemm"}       # any other stamp starts work
order = list(dict.fromkeys(r["role"] for r in timeline if (r["problem"], r["impl"]) == KEY64))
fig, ax = plt.subplots(figsize=(13, 2.6))
for y, role in enumerate(reversed(order)):
    stamps = [(r["kind"], int(r["cycle"])) for r in events if r["role"] == role]
    for (kind, t), (_, t_next) in zip(stamps, stamps[1:]):
        ax.broken_barh([(t, t_next - t)], (y - 0.4, 0.8), color=ACTIVITY[KIND.get(kind, "work")])
ax.set_yticks(range(len(order)), list(reversed(order)))
ax.set_xlabel(f"cycles (clock64 of one CTA, {events[0]['gpu']}, {events[0]['commit']}); grey: waiting")
for act, colour in ACTIVITY.items():
    ax.plot([], [], color=colour, lw=6, label=act)
ax.legend(ncol=4, loc="lower right", bbox_to_anchor=(1, 1), fontsize=8, frameon=False)
fig.tight_layout()
assert {r["role"] for r in events} == set(order)

# %% [markdown]
# Read each panel of the bars, and this picture, for the role that waits least: it sets the pace,
# and the others wait on it.
#
# - **BV 16 and 32** (s05's four roles with chapter 4's math): the chain and the scores warpgroup
#   barely wait; the output warpgroup waits about half of its span, mostly for $S_c$. The chain's path (three
#   products a chunk) and the scores' (the $\Gamma$, $P$ and WY tiles, mostly elementwise work) are
#   about equally long.
# - **BV 64**: the chain waits least and spends most of its span on its own work and its products: it
#   is the pacer, as in s05's napkin timeline; the scores warpgroup, ahead of it, waits for tiles.
# - **BV 128**: the state warpgroup waits more than half of its span for $V_d$ from the value
#   warpgroup, and the scores / output warpgroup, which builds the whole head's $P$ and WY and
#   stores $O$, barely waits: at this width the pace is set by the output side, not the chain.
#
# A napkin rate for the 64-column kernel: per chunk a CTA runs $U = K S$, $\tilde V = W\!Y\,W$, the state
# update, $Q S$, $Q K^\top$ and $P \tilde V$:

# %%
rows64 = [r for r in timeline if (r["problem"], r["impl"]) == KEY64]
bv = fwd.WY_BLOCK_V
flop_chunk = 2 * (CC * KC * bv + CC * CC * bv + KC * CC * bv + CC * KC * bv + CC * CC * KC + CC * CC * bv)
ns_chunk = float(rows64[0]["span_ns_per_chunk"])
rate = flop_chunk / (ns_chunk * 1e-9) * SMS / 1e12                     # one CTA per SM, every SM busy
roof = float(ncu[5]["bf16_roof_tflops"]) if rows64[0]["gpu"] == ncu[5]["gpu"] else float("nan")
print(f"{flop_chunk / 1e6:.2f} MFLOP a chunk in {ns_chunk:.0f} ns (stamped) -> {rate:.0f} TFLOP/s on {SMS} SMs, "
      f"{rate / roof:.0%} of the {roof:.0f} TFLOP/s bf16 roof measured on {rows64[0]['gpu']}")
assert rate / roof < 0.5

# %% [markdown]
# Even if every SM ran such a CTA, a third of the tensor-core roof or less: the chunk's time is the length
# of the pacing role's chain of dependent steps, so every later gain comes from shortening that
# role's path or moving work off it, which is what the lab log's stages between s05 and the library
# did one step at a time. Chapter 6 takes on the other limit, too few chains to fill the card.
#
# ## Summary
#
# - `gdn_fwd.s05` splits s03's fused kernel into four warpgroup roles: a chain that owns the state,
#   a scores warpgroup that needs no state and runs ahead, an output warpgroup a chunk behind, and a
#   producer of TMA loads. They hand $S_c$, $\tilde V_c$ and $P_c$ over through double-buffered
#   shared-memory slots, ordered by six mbarriers named for what they guard (tiles full / empty, and a
#   ready / free pair per hand-off); the fence before each arrive makes generic stores visible to
#   another warpgroup's wgmma.
# - The budget, read from the source: about 185 KiB of shared memory of 227 (tile stages, hand-off
#   slots, reuse off), and `setmaxnreg` budgets that move the pool of $4 \times 128$ registers a thread
#   from the producer (24) to the chain (216). `.inc` may only raise and `.dec` only lower a thread's
#   count, and the budgets must fit the pool.
# - A wait names its phase by parity: `(c // n) % 2` for chunk $c$'s arrivals on a ring of $n$ slots,
#   `^ 1` for the slot's previous user.
# - Measured on one H100 with the peers in the same run: s05 is about 1.2x faster than s03 on the
#   (16, 64) problems, faster than FLA, behind FlashQLA; its fused kernel alone 1.5-1.7x (one H200).
#   Nsight Compute: s03's barrier stalls are gone, and the kernel is still latency-bound.
# - The library's fused kernels keep s05's skeleton with chapter 4's math: WY built by the scores
#   warpgroup (or stored by the solve), a width per launch from 16 to 128 columns, and at 128 the
#   chain split into a state and a value warpgroup. A clock in each warpgroup shows which role sets
#   the pace at each width: the chain at 64 columns, the output side at 128.
#
# ## Exercises
#
# ### 1. The parity of a wait
#
# A ring of `slots` buffers, each with a "full" barrier (the producer's loads have landed) and an
# "empty" one (the consumer released it). Chunk `c` uses slot `c % slots`. `wait_parity(c, slots,
# previous_user)` returns the parity to pass to `T.barrier_wait`: for chunk `c`'s own arrivals, or
# (`previous_user=True`) for those of chunk `c - slots`, the slot's previous user. The starting code
# flips the parity every chunk, which is right for one slot only. Fix the line marked `# TODO`; the
# check runs a producer and a consumer on 1, 2 and 3 slots, with barriers modeled as the hardware
# counts phases.

# %% tags=["exercise"]
def wait_parity(c, slots, previous_user):
    """The phase parity that chunk c waits for on its slot's barrier (slot c % slots)."""
    uses = c                                                      # TODO: how often slot c % slots was used before chunk c
    return uses % 2 ^ int(previous_user)


# %% tags=["check"]
check_wait_parity(wait_parity)

# %% tags=["solution", "hide-input"]
def wait_parity(c, slots, previous_user):
    """The phase parity that chunk c waits for on its slot's barrier (slot c % slots)."""
    uses = c // slots                                             # chunks c % slots, c % slots + slots, ...
    return uses % 2 ^ int(previous_user)


result = check_wait_parity(wait_parity)
assert result.passed, result
result

# %% [markdown]
# ### 2. s05's shared-memory budget
#
# Count the bytes of s05's shared buffers for a chunk of `C` tokens, head dim `K`, `BV` value columns
# a CTA, `stages` tile stages and `handoff` hand-off slots: per stage the $q$, $k$, $w$ tiles
# ($C \times K$, bf16), the $u$ tile ($C \times B_V$, bf16) and the gates ($C$, fp32); per slot $S_c$
# ($K \times B_V$), $\tilde V_c$ ($C \times B_V$) and $P_c$ ($C \times C$), bf16; and the chain's own
# $V_d$ ($C \times B_V$, bf16). The starting code forgets one multiplicity. Fix the line marked
# `# TODO`; the check compares with the allocations of s05's kernel source, evaluated at five
# configurations.

# %% tags=["exercise"]
def smem_bytes(C, K, BV, stages, handoff):
    tiles = stages * (3 * C * K * BF16 + C * BV * BF16 + C * FP32)          # q, k, w; u; g
    handoffs = K * BV * BF16 + C * BV * BF16 + C * C * BF16                 # TODO: S_c, V~_c, P_c
    return tiles + handoffs + C * BV * BF16                                 # + V_d


# %% tags=["check"]
check_smem_bytes(smem_bytes)

# %% tags=["solution", "hide-input"]
def smem_bytes(C, K, BV, stages, handoff):
    tiles = stages * (3 * C * K * BF16 + C * BV * BF16 + C * FP32)          # q, k, w; u; g
    handoffs = handoff * (K * BV * BF16 + C * BV * BF16 + C * C * BF16)     # one copy per slot
    return tiles + handoffs + C * BV * BF16                                 # + V_d


result = check_smem_bytes(smem_bytes)
assert result.passed, result
print(f"s05 as built: {smem_bytes(CC, KC, s05.BLOCK_V, s05.NUM_STAGES, s05.NUM_HANDOFF) / 1024:.1f} KiB; "
      f"three tile stages: {smem_bytes(CC, KC, s05.BLOCK_V, 3, s05.NUM_HANDOFF) / 1024:.1f} KiB of 227")
result

# %% [markdown]
# ### 3. Legal register budgets
#
# A kernel with s05's four roles and trivial work, 512 threads: each thread starts with
# $65536 / 512 = 128$ registers. The output warpgroup holds one $64 \times 64$ fp32 tile and was given
# 120, with `T.set_max_nreg(120, 1)`: `setmaxnreg.inc` to fewer registers than the thread holds, an
# illegal instruction on the GPU. Fix the line marked `# TODO` so that the budget is legal and still
# 120; the check compiles the kernel for sm_90a and reads the `warpgroup_reg_alloc` / `_dealloc` lines
# of the generated CUDA.

# %% tags=["exercise"]
def roles_kernel():
    @T.prim_func
    def roles(x: T.Tensor((64,), "float32"), y: T.Tensor((3, 64), "float32")):
        with T.Kernel(1, threads=512):
            x_s = T.alloc_shared((64,), "float32")
            tiles_full = T.alloc_barrier([128])          # producer -> the three consumers
            tx = T.get_thread_binding()
            if tx < 128:                                 # chain: the fp32 state
                T.set_max_nreg(216, 1)
                T.barrier_wait(tiles_full[0], 0)
                for i in T.Parallel(64):
                    y[0, i] = x_s[i]
            elif tx < 256:                               # scores: P
                T.set_max_nreg(136, 1)
                T.barrier_wait(tiles_full[0], 0)
                for i in T.Parallel(64):
                    y[1, i] = x_s[i] * 2
            elif tx < 384:                               # output: O
                T.set_max_nreg(120, 1)                   # TODO: 120 < 128: which way does the count move?
                T.barrier_wait(tiles_full[0], 0)
                for i in T.Parallel(64):
                    y[2, i] = x_s[i] * 3
            else:                                        # producer: addresses only
                T.set_max_nreg(24, 0)
                for i in T.Parallel(64):
                    x_s[i] = x[i]
                T.barrier_arrive(tiles_full[0])
    return roles


# %% tags=["check"]
check_register_budgets(roles_kernel)

# %% tags=["solution", "hide-input"]
def roles_kernel():
    @T.prim_func
    def roles(x: T.Tensor((64,), "float32"), y: T.Tensor((3, 64), "float32")):
        with T.Kernel(1, threads=512):
            x_s = T.alloc_shared((64,), "float32")
            tiles_full = T.alloc_barrier([128])          # producer -> the three consumers
            tx = T.get_thread_binding()
            if tx < 128:                                 # chain: the fp32 state
                T.set_max_nreg(216, 1)
                T.barrier_wait(tiles_full[0], 0)
                for i in T.Parallel(64):
                    y[0, i] = x_s[i]
            elif tx < 256:                               # scores: P
                T.set_max_nreg(136, 1)
                T.barrier_wait(tiles_full[0], 0)
                for i in T.Parallel(64):
                    y[1, i] = x_s[i] * 2
            elif tx < 384:                               # output: O
                T.set_max_nreg(120, 0)                   # .dec: 128 -> 120, the 8 freed go to the pool
                T.barrier_wait(tiles_full[0], 0)
                for i in T.Parallel(64):
                    y[2, i] = x_s[i] * 3
            else:                                        # producer: addresses only
                T.set_max_nreg(24, 0)
                for i in T.Parallel(64):
                    x_s[i] = x[i]
                T.barrier_arrive(tiles_full[0])
    return roles


result = check_register_budgets(roles_kernel)
assert result.passed, result
result
