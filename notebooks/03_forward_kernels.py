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
# # Forward kernels: from the recurrence to a fused chunked forward
#
# The first two chapters defined GDN and rewrote it in chunks, in PyTorch. This chapter turns the
# forward into GPU kernels, written in TileLang. Each kernel version is a numbered *stage* of the
# op `gdn_fwd`, a frozen file under `kernels/gdn_fwd/` that changes one thing from the stage
# before:
#
# | stage | what it is | what it shows |
# |---|---|---|
# | s00 | FLA's Triton forward, called as a library | the baseline every stage is timed against |
# | s01 | one TileLang kernel that runs the recurrence, with the state on chip | why the recurrence is slow on a GPU |
# | s02 | the chunked form as six TileLang kernels, one per sub-step of `flashqla.reference` | tensor cores, and what the traffic between kernels costs |
# | s03 | the state recurrence and the output fused into one kernel fed by TMA | per-chunk states that never leave the chip |
#
# **What you will learn**
#
# - how a kernel version is kept: a frozen, numbered stage with its own checks, and which stages
#   make up the course path;
# - s01: the recurrence with its state in registers, and why it is slow: no tensor cores, and a
#   chain of $T$ dependent steps;
# - s02: the chunked form on the tensor cores (`wgmma`), one kernel per sub-step, and what the
#   intermediates that cross HBM between kernels cost;
# - s03: the state chain and the output in one kernel, fed by TMA, its per-chunk states on chip;
# - to read generated CUDA for the instructions that matter, to check a kernel against a derived
#   tolerance, and to read measured times next to their napkin math.
#
# **What you need first**
#
# Chapters 1 and 2, and the GPU vocabulary: an SM runs CTAs (thread blocks) of warps (32 threads);
# four warps form a warpgroup; data lives in registers, shared memory (per CTA) or HBM. TileLang is
# read here, not taught from scratch: `T.Kernel` launches a grid of CTAs, `T.alloc_shared` and
# `T.alloc_fragment` place a tile in shared memory or in registers, `T.copy` moves a tile, `T.gemm`
# multiplies two, `T.Parallel` is an elementwise loop over a tile, and `T.Pipelined` loads the next
# iteration's tiles while the current one computes.
#
# Every cell runs on a CPU. TileLang compiles for Hopper (sm_90a) without a GPU, so the generated
# CUDA shown is real; the kernels *run* only on a Hopper GPU, and their speeds here are read from
# the committed results in `profiles/results/`.

# %%
import inspect
import math
import re
import statistics
import textwrap
import warnings
from collections import Counter

import matplotlib.pyplot as plt
import torch

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by TileLang
import tilelang
import tilelang.language as T

from flashqla import bench, stages
from flashqla.exercises.ch03 import check_chunk_scores, check_fused_chunk
from flashqla.hopper import cuda_excerpt, hopper_gpu_missing
from flashqla.stages import KERNELS_DIR, MILESTONES, OPS, discover, load
from flashqla.testing import ROUNDING_FLOOR, TOLERANCE_FACTOR, Problem, cast_floats, check_op

tilelang.set_log_level("WARNING")        # keep "begins to compile kernel" lines out of the outputs
ROOT = KERNELS_DIR.parent

# %% [markdown]
# ## The course path and the stages in this checkout
#
# `flashqla.stages.discover()` finds every stage file under `kernels/`, ordered by op and number.
# A few of them are *milestones* (`flashqla.stages.MILESTONES`, `Stage.milestone`): the course
# path these chapters follow, each milestone adding one idea to the one before. This chapter
# teaches the first three; chapter 4 the gate-free reformulation (s04), chapter 5 warp
# specialization (s05), chapter 6 AutoCP (s06) and the final forward that the library runs (s44),
# chapter 7 the backward.

# %%
STAGES = discover()
# the course path, each milestone with its one-line comment in flashqla/stages.py
path = re.findall(r'"(gdn_\w+\.s\d\d)",\s*#\s*(.+)', inspect.getsource(stages))
assert [stage_id for stage_id, _ in path] == list(MILESTONES), path
for stage_id, what in path:
    print(f"{stage_id:12s} {what}")

# %% [markdown]
# Every other stage is the *lab log*: the experiments between two milestones, each frozen, tested
# and measured, some kept and some dropped (`Stage.milestone` is False). The book page
# [Lab log](/lab_log.md) lists them with what each changed and what it measured; you never need
# it to follow the course.

# %%
lab_log = Counter(s.op for s in STAGES if not s.milestone)
print(f"{len(STAGES)} stages: {len(MILESTONES)} milestones; the lab log holds "
      + ", ".join(f"{n} of {op}" for op, n in lab_log.most_common()))

# %% [markdown]
# A stage file defines
#
# - `NEEDS`: what it needs to run (`"hopper"` for an SM90 GPU, or a package such as `"fla"`);
# - `run(...)`: the same arguments and outputs as the op's reference, `OPS[op][0]`, so that tests
#   and the benchmark call every stage of an op the same way;
# - for TileLang stages, `kernel_source()`, the CUDA C++ generated for sm_90a (built on any
#   machine), and `SOURCE_MUST_CONTAIN`, the instructions the stage is about, which a CPU test
#   asserts are in that source.
#
# Its docstring says what changed from the stage before, why, and the measured effect. For
# `gdn_fwd` the reference is the chunked forward of chapter 2, with FLA's signature:

# %%
print("gdn_fwd" + str(inspect.signature(OPS["gdn_fwd"][0])), "->", OPS["gdn_fwd"][1])

# %% [markdown]
# Numbers never change, so this chapter loads a stage by (op, number) with
# `flashqla.stages.load`. The helpers below only *display* things: a docstring without its
# measured-effect paragraphs (the measured numbers come from the results files, at the end), a
# slice of a kernel's source, and the lines of generated CUDA that hold the instructions this
# chapter is about.

# %%
def summary_line(module):
    """A stage docstring's first line without its "op, stage NN: " prefix."""
    return inspect.getdoc(module).splitlines()[0].split(": ", 1)[-1]


def design(module):
    """A stage's docstring up to its measured effect: what it computes, what changed, and why."""
    doc = inspect.getdoc(module)
    return doc[:doc.index("\nMeasured effect")].rstrip()


def show_source(fn, first, last):
    """Print the lines of fn's source from the first line containing `first` up to the next
    line containing `last` (excluded)."""
    lines = inspect.getsource(fn).splitlines()
    i = next(n for n, line in enumerate(lines) if first in line)
    j = next(n for n in range(i + 1, len(lines)) if last in lines[n])
    print(textwrap.dedent("\n".join(lines[i:j])))


FEATURES = (  # (what it is, a pattern matched against each line of the generated CUDA)
    ("wgmma: a warpgroup issues a tensor-core MMA", r"tl::wgmma_\w+<"),
    ("wgmma: wait for issued MMAs", r"tl::warpgroup_wait<"),
    ("TMA load (cp.async.bulk.tensor)", r"tl::tma_load\(|cp\.async\.bulk"),
    ("mbarrier wait / arrive / expect bytes", r"mbarrier\[.*\]\.(wait|arrive|expect_transaction)\("),
    ("exp2f (PTX ex2.approx.f32)", r"exp2f\("),
    ("warp shuffle", r"__shfl_xor_sync"),
    ("__syncthreads", r"__syncthreads\(\)"),
)

# %% [markdown]
# A count below is of *lines* of CUDA source, not of instructions executed: a line inside an
# unrolled or serial loop runs many times. What matters is which instructions appear at all.
#
# ## s00: FLA's Triton forward, the baseline
#
# The first row of every comparison is the system this project re-derives, called exactly as a
# model calls it:

# %%
s00 = load("gdn_fwd", 0)
print(design(s00))
print()
print(inspect.getsource(s00.run))

# %% [markdown]
# FLA's forward is the chunked form of chapter 2, split into separate Triton kernels. It writes
# every intermediate to HBM and reads it back, including the per-chunk states $h$ in bf16.
# Stage s02 below has the same shape, in TileLang; s03 removes its largest traffic.
#
# ## s01: the recurrence, state on chip
#
# The first TileLang stage runs the definition of chapter 1 as written, one token after another.
# Each CTA owns one (sequence, value head, tile of 16 value columns) and keeps its slice of the
# $K \times V$ state in registers for the whole sequence, so the state never touches HBM.

# %%
s01 = load("gdn_fwd", 1)
print(design(s01))

# %% [markdown]
# The output needs no second pass over the state. Since $h_t = e^{g_t} h_{t-1} + k_t e_t^\top$,
#
# $$
# o_t = s\, h_t^\top q_t = s \big( e^{g_t} h_{t-1}^\top q_t + e_t\, (k_t \cdot q_t) \big),
# $$
#
# so the three reductions over $K$ ($h^\top k_t$, $h^\top q_t$, $k_t \cdot q_t$) are computed
# together before $h$ is updated. The kernel's loop: a block of 32 tokens staged in shared memory,
# then one token at a time:

# %%
show_source(s01.recurrent_kernel, "for c in T.Pipelined", "# final state <- h")

# %% [markdown]
# In the generated CUDA, the sums over a lane group are `__shfl_xor_sync` butterflies and the
# decay is one `exp2f` per token; the token blocks arrive by TMA. There is no `wgmma`: the tensor
# cores stay idle.

# %%
cuda_excerpt(s01.kernel_source(), FEATURES)

# %% [markdown]
# ### Napkin math: why it cannot be fast
#
# **No tensor cores.** A Hopper tensor-core instruction (`wgmma`) multiplies a 64-row tile by a
# tile of $N$ columns. Per token the recurrence does two matrix-vector products ($h^\top k_t$,
# $h^\top q_t$) and one rank-one update: one row, not 64. Rows cannot be batched, since token $t$'s
# prediction needs the state after token $t - 1$. So all $7KV$ FLOPs per token and head run on the
# FP32 units, about 67 TFLOP/s on an H100 SXM (datasheet), against about 790 TFLOP/s measured for
# a bf16 GEMM.
#
# **A chain of $T$ steps.** However many SMs there are, a CTA walks all $T$ tokens of its sequence
# in order, and each step is a dependent chain: FMAs over the thread's rows, three rounds of
# shuffles, the error $e_t$, the update. If one step takes $L$ cycles, a sequence takes at least
# $T L / f$ seconds at clock $f$.

# %%
K = V = 128
C = 64
SMS = 132
GEMM_TFLOPS, FP32_TFLOPS, HBM_TBS = 790, 67, 3.35   # H100: bf16 GEMM measured; FP32 and HBM datasheet
CLOCK = 1.98e9                                      # H100 SXM boost clock (datasheet): optimistic
BV_RECURRENT = 16                                   # s01's tile of value columns (its docstring)

layer = Problem(16, 64, (32768,))
flops_rec = 7 * K * V * 32768 * layer.HV
print(f"(16, 64), 32768 tokens: the recurrence does {flops_rec / 1e9:.0f} GFLOP on the FP32 units, "
      f">= {flops_rec / FP32_TFLOPS / 1e9:.2f} ms")
print(f"the chunked form does {bench.useful_flops(layer) / 1e9:.0f} GFLOP on the tensor cores, "
      f">= {bench.useful_flops(layer) / GEMM_TFLOPS / 1e9:.2f} ms")
print(f"both must move >= {bench.useful_bytes(layer) / 1e9:.2f} GB (q, k, v, g, beta, o, states), "
      f">= {bench.useful_bytes(layer) / HBM_TBS / 1e9:.2f} ms")
for L in (50, 100, 200):
    print(f"a step of {L:3d} cycles: 32768 steps in a row take >= {32768 * L / CLOCK * 1e3:.2f} ms")
for H, HV in ((2, 8), (16, 64)):
    print(f"(H, HV) = ({H}, {HV}), one sequence: {HV * V // BV_RECURRENT} CTAs, each walking all "
          f"32768 tokens, for {SMS} SMs")

# %% [markdown]
# The recurrence does fewer FLOPs than the chunked form, but on units twelve times slower, and its
# chain of $T$ dependent steps bounds it from below whatever the parallelism. It needs no more HBM
# traffic than a fully fused chunked kernel would: that is its one strength, and the reason the
# same kernel shape is the natural decode kernel ($T = 1$, nothing to chunk). For long prefill,
# the chunked form is the way out.
#
# ## s02: the chunked form, one kernel per sub-step
#
# Stage s02 runs the chunked forward of chapter 2 on the tensor cores, as separate kernels that
# mirror `reference.chunk_gated_delta_rule_ref` one sub-step at a time. It has no kernel of its
# own: its `run` chains the sub-op stages.

# %%
s02 = load("gdn_fwd", 2)
print(design(s02))

# %% [markdown]
# Every sub-step is its own op (`flashqla.stages.OPS`), and each kernel is first checked alone
# against its own reference, on inputs computed by the float64 reference
# (`flashqla.testing.op_inputs`), so that an error shows up in the kernel that makes it. The
# kernels s02 chains, with the comment that states the math of each block of each kernel:

# %%
S02_STEPS = (("chunk_local_cumsum", 1), ("chunk_kkt", 2), ("kkt_solve", 1), ("chunk_w_u", 1),
             ("chunk_h", 1), ("chunk_o", 1))  # the table in s02's docstring
for op, number in S02_STEPS:
    module = load(op, number)
    builders = [f for f in vars(module).values() if inspect.isfunction(f)
                and f.__module__ == module.__name__ and "@T.prim_func" in inspect.getsource(f)]
    print(f"== {op}.s{number:02d}: {summary_line(module)}")
    for f in builders:
        for line in inspect.getsource(f).splitlines():
            if line.strip().startswith("#"):
                print("      " + line.strip())

# %% [markdown]
# Four of the six (the cumsum, $A$, its inverse, $w$ and $u$) are independent across chunks: one
# CTA per chunk and head, thousands of them. `chunk_h` is the chain over chunks: one CTA per
# (sequence, value head, tile of value columns), the fp32 state in registers, two `wgmma` products
# per chunk. It writes every per-chunk state $h$ and every `v_new` row to HBM, and `chunk_o`
# reads them back.
#
# ### Napkin math: one chunk, kernel by kernel
#
# Per (chunk, value head) with $K = V = 128$ and $C = 64$: the FLOPs of each kernel, and the bytes
# it reads and writes in HBM, in the dtypes the kernels use (bf16 activations, $\mathcal{T}$, $w$,
# $u$, `v_new` and $h$; fp32 gates and $A$). Query and key tiles belong to key heads, which
# $H_V / H$ value heads share, so a value head is charged its share of them. The time floor of a
# whole (16, 64) layer of 32768 tokens is the larger of its FLOPs at the GEMM rate and its bytes at
# the HBM rate.

# %%
H_L, HV_L, T_L = 16, 64, 32768
BF16, FP32 = 2, 4
PAIRS = T_L // C * HV_L                     # (chunk, value head) pairs in the layer
qk_tile = C * K * BF16 * H_L / HV_L         # a value head's share of one chunk's q or k tile
v_tile = C * V * BF16                       # one chunk of v, u, v_new or o, one value head
state = K * V * BF16                        # one per-chunk state h (bf16, FLA's choice)
gates = C * FP32                            # one chunk of g, g_cum or beta

KERNELS = {  # name: (FLOPs, bytes read, bytes written) per (chunk, value head)
    "chunk_local_cumsum": (C, gates, gates),
    "chunk_kkt": (2 * C * C * K, qk_tile + 2 * gates, C * C * FP32),
    "kkt_solve": (C ** 3 // 3, C * C * FP32, C * C * BF16),
    "chunk_w_u": (2 * C * C * (K + V), qk_tile + v_tile + 2 * gates + C * C * BF16, C * K * BF16 + v_tile),
    "chunk_h": (2 * 2 * C * K * V, qk_tile + C * K * BF16 + v_tile + gates, state + v_tile),
    "chunk_o": (2 * C * C * (K + V) + 2 * C * K * V, 2 * qk_tile + v_tile + state + gates, v_tile),
}
KERNELS["fused h + o (s03)"] = (KERNELS["chunk_h"][0] + KERNELS["chunk_o"][0],
                                2 * qk_tile + C * K * BF16 + v_tile + gates, v_tile)


def floor_ms(flops, nbytes, pairs=PAIRS):
    return max(flops / GEMM_TFLOPS / 1e9, nbytes / HBM_TBS / 1e9) * pairs


print(f"{'kernel':20s} {'MFLOP':>7s} {'KB read':>8s} {'KB written':>10s} {'FLOP/byte':>9s} "
      f"{'layer floor':>12s}")
for name, (flops, rd, wr) in KERNELS.items():
    print(f"{name:20s} {flops / 1e6:7.2f} {rd / 1e3:8.1f} {wr / 1e3:10.1f} {flops / (rd + wr):9.0f} "
          f"{floor_ms(flops, rd + wr):9.3f} ms")
print(f"ridge of the card: {GEMM_TFLOPS / HBM_TBS:.0f} FLOP/byte "
      f"({GEMM_TFLOPS} TFLOP/s over {HBM_TBS} TB/s): below it a kernel is memory bound")

matrix_flops = sum(KERNELS[n][0] for n in ("chunk_kkt", "chunk_w_u", "chunk_h", "chunk_o"))
assert matrix_flops * PAIRS == bench.useful_flops(layer), (matrix_flops, bench.useful_flops(layer))

# %% [markdown]
# Every kernel is far below the ridge, so each one is bound by its memory traffic, and the traffic
# is dominated by intermediates that only exist because the kernels are separate. The two largest
# pass from `chunk_h` to `chunk_o`: one bf16 $K \times V$ state per chunk, as many bytes as 128
# tokens of `v_new`, and `v_new` itself. For the whole layer:

# %%
h_bytes = 2 * state * PAIRS                 # written by chunk_h, read by chunk_o
v_new_bytes = 2 * v_tile * PAIRS
print(f"per-chunk states h: {T_L // C} chunks x {HV_L} heads x {state // 1024} KiB = "
      f"{state * PAIRS / 1e9:.2f} GB, written and read back: {h_bytes / 1e9:.2f} GB")
print(f"v_new:              {T_L} tokens x {HV_L} heads x {V} x 2 B = {v_tile * PAIRS / 1e9:.2f} GB, "
      f"written and read back: {v_new_bytes / 1e9:.2f} GB")
print(f"together {(h_bytes + v_new_bytes) / 1e9:.2f} GB, >= {(h_bytes + v_new_bytes) / HBM_TBS / 1e9:.2f} ms "
      f"at {HBM_TBS} TB/s; the whole forward's minimum traffic is {bench.useful_bytes(layer) / 1e9:.2f} GB")

stage_kernels = {"s02": ["chunk_local_cumsum", "chunk_kkt", "kkt_solve", "chunk_w_u", "chunk_h", "chunk_o"],
                 "s03": ["chunk_local_cumsum", "chunk_kkt", "kkt_solve", "chunk_w_u", "fused h + o (s03)"]}
for stage_id, names in stage_kernels.items():
    nbytes = sum(KERNELS[n][1] + KERNELS[n][2] for n in names) * PAIRS
    total_floor = sum(floor_ms(KERNELS[n][0], KERNELS[n][1] + KERNELS[n][2]) for n in names)
    print(f"{stage_id}: {len(names)} kernels, {nbytes / 1e9:.2f} GB of HBM traffic, "
          f"sum of the kernels' floors {total_floor:.2f} ms")

# %% [markdown]
# ## s03: the state recurrence and the output in one kernel
#
# Stage s03 keeps the first four kernels of s02 and replaces `chunk_h` and `chunk_o` by one
# kernel. A CTA owns one (sequence, value head, tile of value columns) and walks its chunks in
# order, as `chunk_h` did; in each chunk it also computes that chunk's output, while the state
# entering the chunk and `v_new` are still on chip.

# %%
s03 = load("gdn_fwd", 3)
print(design(s03))

# %% [markdown]
# The loop over chunks. $W S$ comes first, since $\tilde V = U - W S$ feeds both the state update
# and the output. The state update $K^\top \operatorname{diag}(e^{\gamma_C - \gamma}) \tilde V$,
# $Q S$ and $Q K^\top$ need nothing else from the chain, so they are issued back to back and
# waited for together; $P \tilde V$ comes last. Note which state $Q S$ reads: `h_s`, the copy in
# shared memory of the state *entering* the chunk, taken before the registers `h_f` are updated.

# %%
show_source(s03.fused_h_o_kernel, "for c in T.Pipelined", "T.copy(h_f, ht")

# %% [markdown]
# `T.Pipelined(..., num_stages=2)` turns the loop into a producer warpgroup that issues the TMA
# loads of the next chunk and consumer warpgroups that compute, synchronized by mbarriers: a
# consumer waits until the expected number of bytes of a buffer has landed; the producer waits
# until the consumers have released it. In the CUDA: the TMA loads, the mbarriers, the `wgmma`
# products and their waits.

# %%
cuda_excerpt(s03.kernel_source(), FEATURES)

# %% [markdown]
# ### Napkin math: what fusing saves, and what it cannot
#
# Fusing removes the state and `v_new` round trips (about 3.2 GB for the (16, 64) layer, above)
# and one extra read of the keys. It does not shorten the chain: a CTA still walks $T / 64$
# chunks in order, each a handful of dependent products, and there are only
# $N \cdot H_V \cdot V / B_V$ CTAs. A floor for one chain, if its SM ran its tensor cores at a
# 132nd of the card's GEMM rate:

# %%
BV_FUSED = 64                                        # s03's tile of value columns (BLOCK_V)
flops_chunk_cta = (2 * C * K * BV_FUSED * 3          # W S, Q S, K^T V~
                   + 2 * C * C * K + 2 * C * C * BV_FUSED)   # Q K^T, P V~
sm_rate = GEMM_TFLOPS * 1e12 / SMS
for H, HV, T_ in ((2, 8, 32768), (16, 32, 32768), (16, 64, 32768), (16, 64, 2048)):
    ctas = HV * V // BV_FUSED
    chain_ms = T_ // C * flops_chunk_cta / sm_rate * 1e3
    print(f"(H, HV) = ({H:2d}, {HV:2d}), 1 x {T_:5d}: {ctas:3d} CTAs for {SMS} SMs, "
          f"one chain of {T_ // C:3d} chunks >= {chain_ms:.3f} ms")

# %% [markdown]
# With few heads and one long sequence, the chain alone sets the time and most SMs are idle: for
# (2, 8) only 16 CTAs have work. Nsight Compute shows what the fused kernel does with its time,
# next to the two FLA kernels it replaces, profiled on the same card model and problem at two
# commits (`profiles/ncu_lab.py`; the book page [Nsight labs](/nsight_labs.md) says how to run it):

# %%
ncu = [r for n in ("s00", "s03") for r in bench.read_csv(bench.RESULTS / f"ncu_gdn_fwd_{n}.csv")
       if r["kernel"].startswith(("chunk_gated_delta_rule_fwd_kernel_h", "chunk_fwd_kernel_o", "gdn_fused"))]
print(f"{ncu[0]['problem']} on {ncu[0]['gpu']} (commits {', '.join(dict.fromkeys(r['commit'] for r in ncu))})")
print(f"{'kernel':42s} {'us':>6s} {'DRAM MB':>8s} {'DRAM %':>6s} {'TFLOP/s':>8s} {'tensor %':>8s} "
      f"{'occup. %':>8s} {'regs':>5s} {'smem KiB':>8s}  top stall")
for r in ncu:
    print(f"{r['stage'] + ' ' + r['kernel'][:30]:42s} {r['us']:>6s} {r['dram_mb']:>8s} {r['dram_pct']:>6s} "
          f"{r['tflops']:>8s} {r['tensor_pct']:>8s} {r['occupancy_pct']:>8s} {r['regs']:>5s} "
          f"{r['smem_kb']:>8s}  {r['stalls'].split(';')[0]}")

# %% [markdown]
# The fused kernel moves about a third of the DRAM bytes of FLA's two kernels, at the same
# tensor-core rate, and still takes as long as both together: it is neither compute- nor
# memory-bound. The tensor pipe is busy a fifth of the time, DRAM runs at a fifth of its peak, and
# the top stall (`long_scoreboard`) is a warp waiting for a global-memory load along the chain.
# Its one 384-thread CTA per SM (168 registers a thread, 153 KiB of shared memory) leaves no other
# CTA to hide that latency. The other large remaining traffic is the
# $A$, $\mathcal{T}$, $w$ and $u$ that s03 still writes and reads between its first four kernels;
# chapter 4 removes $w$ and $u$, chapter 5 overlaps the chain with the output in separate
# warpgroups, and chapter 6 cuts long sequences into segments that run in parallel.
#
# ## How every stage is checked
#
# A stage passes when every output is within a bound derived from bf16 arithmetic
# (`flashqla.testing.check_op`, the book page [How a stage is checked](/checking.md)): with
# $\mathrm{err}$ the relative L2 error against the float64 reference and
# $\mathrm{err}_{\mathrm{bf16}}$ the error of the same reference math run in bf16 PyTorch,
#
# $$
# \mathrm{err} \le 2 \max(\mathrm{err}_{\mathrm{bf16}}, 2^{-9}).
# $$
#
# `check_op` takes any function with the op's signature. Here, on the CPU, it is given the
# reference itself in float32 (a stand-in for a stage) on a varlen problem like the GPU tests':
# sequences of 1, 200, 64 and 130 tokens with $(H, H_V) = (1, 4)$, one value head each with
# $g = 0$ and strong decay, two with ordinary decay.

# %%
problem = Problem(1, 4, (1, 200, 64, 130))
x = problem.inputs(seed=1)
ref_fwd = OPS["gdn_fwd"][0]


def in_float32(**kw):
    """The reference run in float32: a stand-in for a stage, to show the bounds on the CPU."""
    return ref_fwd(**cast_floats(kw, torch.float32))


print(f"{problem.label}: bound = {TOLERANCE_FACTOR:g} x max(bf16 PyTorch error, {ROUNDING_FLOOR:.2e})")
for c in check_op("gdn_fwd", in_float32, x):
    print(f"  {c.output:12s} bf16 err {c.err_bf16:.2e}  bound {c.bound:.2e}  fp32 reference err {c.err:.2e}")

# %% [markdown]
# The fp32 reference lands four to five orders of magnitude inside its bound; a kernel with bf16
# operands and fp32 accumulation should sit a little under the bf16 error. A structural bug is of
# order 1 and fails loudly. For instance a forward that forgets the decay:

# %%
def forgets_the_decay(**kw):
    kw = cast_floats(kw, torch.float32)
    return ref_fwd(**{**kw, "g": torch.zeros_like(kw["g"])})


try:
    check_op("gdn_fwd", forgets_the_decay, x)
    raise RuntimeError("check_op accepted a forward without decay")
except AssertionError as exc:
    print("AssertionError:", exc)

# %% [markdown]
# On the GPU machine the same check runs for every stage the machine can run (or one op's, with
# `-k`):
#
# ```bash
# python3 -m pytest -m gpu tests/test_stages.py -q -k gdn_fwd
# ```
#
# `tests/test_stages.py` runs each stage on the eight Qwen3.5 head configurations at
# $K = V = 128$, each with one sequence of 1000 tokens, a varlen mix (1, 200, 777, 64 and 130
# tokens) and an equal-length batch of two sequences of 333 tokens without initial state. The
# `gdn_fwd` stages are checked end to end (`o` and the final state); the sub-op stages alone. A
# CPU test in the same file compiles the milestones for sm_90a and asserts that their CUDA
# contains their `SOURCE_MUST_CONTAIN` (`pytest --all-stages` compiles every stage):

# %%
for op, number in (("gdn_fwd", 1), ("gdn_fwd", 3), *S02_STEPS):
    print(f"{op}.s{number:02d}".ljust(22), "SOURCE_MUST_CONTAIN =", load(op, number).SOURCE_MUST_CONTAIN)

# %% [markdown]
# ## Measured speeds
#
# `python -m flashqla bench` times every `gdn_fwd` stage, FLA (s00), FlashQLA and the public
# `flashqla.chunk_gated_delta_rule` on the GPU machine, on the eight head configurations and five
# token mixes, each flashqla row checked against the float64 reference before it is timed. Every
# row is timed the same way: CUDA-graph replay where capture works (CUDA events otherwise, said in
# the row), the median, inputs rotated through more than twice the L2 cache. It writes
# `profiles/results/gdn_fwd.csv`: per row the time, the ratio to each baseline timed *in the same
# run* (`vs_fla`, `vs_flashqla`, above 1: faster), TFLOP/s and GB/s of the useful work (the
# chunked form's FLOPs, the minimum bytes) with their percentage of the roofs measured in the same
# run, and `x_floor`, the time over the card's floor for that work.
#
# Stages that are not re-timed keep the rows of the run that timed them, so rows of one problem
# may come from different runs: compare a stage with the baselines through its own ratio columns,
# never through the ms of another run.

# %%
CSV_PATH = bench.RESULTS / "gdn_fwd.csv"
COURSE = [bench.FLA_ROW, *(s.name for s in STAGES if s.op == "gdn_fwd" and s.number in (1, 2, 3)),
          bench.FLASHQLA_ROW, bench.API_ROW]
rows = [r for r in bench.read_csv(CSV_PATH) if r["impl"] in COURSE]
for impl in COURSE:
    mine = [r for r in rows if r["impl"] == impl]
    runs = ", ".join(dict.fromkeys(f"{r['commit']} ({r['date']}, {r['gpu']})" for r in mine))
    print(f"{impl:34s} {len(mine):2d} problems, timed at {runs}")

# %% [markdown]
# The napkin math of one problem, (16, 64) with one sequence of 32768 tokens: every row does the
# same useful work, so TFLOP/s and GB/s compare, and `x_floor` says how far each is from the card:

# %%
print(bench.format_rows([{c: c for c in bench.COLUMNS}]
                        + [r for r in rows if r["problem"] == "(16, 64) 1x32768"]))

# %% [markdown]
# Over all 40 problems: the speed-up over each baseline in the same run (geometric mean, above 1:
# faster) and the median distance from the floor. The library row is what chapters 4 to 6 build.

# %%
def geomean(xs):
    return math.exp(statistics.fmean(math.log(x) for x in xs))


print(f"{'implementation':34s} {'problems':>8s} {'vs FLA':>7s} {'(min-max)':>11s} {'vs FlashQLA':>11s} "
      f"{'x_floor':>8s}")
for impl in COURSE:
    mine = [r for r in rows if r["impl"] == impl and r["ms"]]
    vs_fla, vs_flashqla = ([float(r[col]) for r in mine] for col in ("vs_fla", "vs_flashqla"))
    print(f"{impl:34s} {len(mine):8d} {geomean(vs_fla):7.2f} {f'({min(vs_fla):.2f}-{max(vs_fla):.2f})':>11s} "
          f"{geomean(vs_flashqla):11.2f} {statistics.median(float(r['x_floor']) for r in mine):8.1f}")

# %%
labels = list(dict.fromkeys(r["problem"] for r in rows))
fig, ax = plt.subplots(figsize=(11, 4.5))
for impl in COURSE[1:]:
    pts = [(labels.index(r["problem"]), float(r["vs_fla"])) for r in rows if r["impl"] == impl and r["vs_fla"]]
    ax.plot([p for p, _ in pts], [s for _, s in pts], "o-", ms=3, lw=1, label=impl)
ax.axhline(1, color="gray", ls=":", lw=1)
ax.text(0, 1.05, "FLA (s00)", fontsize=7, color="gray")
ax.set_yscale("log")
ax.set_xticks(range(len(labels)), [bench.short_label(p) for p in labels], rotation=90, fontsize=6)
ax.set_ylabel("speed-up over FLA, same run (log)")
ax.set_title("gdn forward on the course path, each row against FLA timed in its own run", fontsize=9)
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()

# %% [markdown]
# s01 is about 3.5 to 7 times slower than FLA on every problem: the chain of tokens, as its napkin
# math said. s02 is slower than FLA everywhere: the same separate-kernel shape, with simpler
# kernels. s03 beats FLA on the batches of eight sequences and with the most heads, and loses
# where few heads leave the card idle. The library, which adds the next three chapters' ideas, is
# faster than both baselines on every problem.
#
# On a machine with a Hopper GPU, the next cell times two problems again with the benchmark's own
# functions (`input_sets` rotates the inputs, `time_row` replays a CUDA graph, or times with
# events when capture fails), every course row in the same run.

# %%
if hopper_gpu_missing() is None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for p in (Problem(16, 64, (32768,)), Problem(2, 8, (32768,))):
        sets = bench.input_sets(p, l2)
        for name, fn, _, _ in bench.candidates():
            if name in COURSE:
                ms, method = bench.time_row(fn, sets)
                print(f"{p.label:22s} {name:34s} {ms:8.3f} ms  ({method})")
else:
    print(f"No Hopper GPU here ({hopper_gpu_missing()}): the numbers above come from "
          f"{CSV_PATH.relative_to(ROOT)}.")

# %% [markdown]
# ## Summary
#
# - A stage is a frozen file loaded by (op, number); it computes exactly its op's reference, and
#   `check_op` holds it to twice the error of the same math in bf16. The milestones are the course
#   path; every other stage is the lab log.
# - s01, the recurrence with its state in registers, moves the minimum number of bytes but runs
#   matrix-vector work on the FP32 units along a chain of $T$ dependent steps: no `wgmma` in its
#   CUDA.
# - s02 puts the chunked form on the tensor cores, one kernel per sub-step; every kernel is memory
#   bound, and the per-chunk states and `v_new` passing from `chunk_h` to `chunk_o` are the largest
#   intermediates, about 3.2 GB of round trips for a (16, 64) layer of 32768 tokens.
# - s03 fuses `chunk_h` and `chunk_o`: those intermediates stay on chip, TMA feeds the tiles, and
#   independent products are issued back to back. What remains is latency along the chain of
#   $T / 64$ chunks per (sequence, head, value tile), too few chains when heads are few and
#   sequences long, and the $A$, $\mathcal{T}$, $w$, $u$ traffic of the first four kernels.
# - Measured speeds come with their napkin math and with the baselines of the same run.
#
# Next, chapter 4: the gate-free solve, and a forward that never forms $w$ and $u$.

# %% [markdown]
# ## Exercises
#
# ### 1. One chunk of the fused loop
#
# Write, in PyTorch, what one CTA of s03 does with one chunk of one value head: from the state
# $S$ entering the chunk, compute $\tilde V = U - W S$, the chunk's output
# $O = s\,(\operatorname{diag}(e^{\gamma}) Q S + ((Q K^\top) \odot \Gamma)_{\text{lower incl. diagonal}}\, \tilde V)$
# and the state leaving it. The check runs your function over every chunk of four packed
# sequences (1, 100, 64 and 130 tokens, four value heads), with $w$, $u$ and $\gamma$ from the
# float64 reference, and hands the whole forward to `check_op`, the check every stage passes. The
# starting code gets the state chain right and the output wrong.

# %% tags=["exercise"]
def fused_chunk(S, q_c, k_c, w_c, u_c, g_c, scale):
    """One chunk, one value head: S [K, V] entering; q_c, k_c, w_c [n, K], u_c [n, V], g_c [n]
    (gamma) -> (o_c [n, V], the state leaving the chunk [K, V])."""
    v_new = u_c - w_c @ S                                               # V~ = U - W S
    Gamma = torch.exp(torch.tril(g_c[:, None] - g_c[None, :]))          # exponents <= 0
    P = torch.tril(q_c @ k_c.T * Gamma)                                 # lower incl. the diagonal
    S = torch.exp(g_c[-1]) * S + k_c.T @ (torch.exp(g_c[-1] - g_c)[:, None] * v_new)
    o_c = scale * (torch.exp(g_c)[:, None] * (q_c @ S) + P @ v_new)     # TODO: which S?
    return o_c, S


answer = fused_chunk

# %% tags=["check"]
check_fused_chunk(answer)

# %% tags=["solution", "hide-input"]
def fused_chunk(S, q_c, k_c, w_c, u_c, g_c, scale):
    """One chunk, one value head: S [K, V] entering; q_c, k_c, w_c [n, K], u_c [n, V], g_c [n]
    (gamma) -> (o_c [n, V], the state leaving the chunk [K, V])."""
    v_new = u_c - w_c @ S
    Gamma = torch.exp(torch.tril(g_c[:, None] - g_c[None, :]))
    P = torch.tril(q_c @ k_c.T * Gamma)
    o_c = scale * (torch.exp(g_c)[:, None] * (q_c @ S) + P @ v_new)     # reads the entering S
    S = torch.exp(g_c[-1]) * S + k_c.T @ (torch.exp(g_c[-1] - g_c)[:, None] * v_new)
    return o_c, S


answer = fused_chunk
result = check_fused_chunk(answer)
assert result.passed, result
result

# %% [markdown]
# In the kernel the same ordering is a matter of storage: `h_s` (shared memory) keeps the entering
# state for $Q S$ while the registers `h_f` are updated.
#
# ### 2. A product on the tensor cores
#
# The kernel below computes one chunk's decayed, masked scores $P = (Q K^\top) \odot \Gamma$ per
# CTA, as s03 does before $P \tilde V$: `T.gemm` multiplies tiles in shared memory into a register
# fragment, and the decay is `exp2` of $\log_2 e$-scaled logs. The check compiles it for sm_90a (a
# few seconds, no GPU) and reads the CUDA: the product must be a `wgmma`. As written, TileLang
# lowers `T.gemm` to the older per-warp `mma.sync` instead. Change one number.

# %% tags=["exercise"]
LOG2E = 1.4426950408889634


def chunk_scores(C=64, K=128):
    """P = (Q K^T) * Gamma, lower triangle incl. the diagonal, one CTA per chunk of one head."""
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def scores(q: T.Tensor((num_chunks * C, K), "bfloat16"), k: T.Tensor((num_chunks * C, K), "bfloat16"),
               g_cum: T.Tensor((num_chunks * C,), "float32"), p: T.Tensor((num_chunks * C, C), "float32")):
        with T.Kernel(num_chunks, threads=32) as c:                     # TODO: who issues a wgmma?
            q_shared = T.alloc_shared((C, K), "bfloat16")
            k_shared = T.alloc_shared((C, K), "bfloat16")
            g_shared = T.alloc_shared((C,), "float32")
            p_fragment = T.alloc_fragment((C, C), "float32")
            T.copy(q[c * C:(c + 1) * C, :], q_shared)
            T.copy(k[c * C:(c + 1) * C, :], k_shared)
            T.copy(g_cum[c * C:(c + 1) * C], g_shared)
            T.gemm(q_shared, k_shared, p_fragment, transpose_B=True, clear_accum=True)   # Q K^T
            for i, j in T.Parallel(C, C):                   # * Gamma below the diagonal, 0 above
                p_fragment[i, j] = T.if_then_else(
                    j <= i, p_fragment[i, j] * T.exp2((g_shared[i] - g_shared[j]) * LOG2E), 0)
            T.copy(p_fragment, p[c * C:(c + 1) * C, :])

    return scores


answer = chunk_scores

# %% tags=["check"]
check_chunk_scores(answer)

# %% tags=["solution", "hide-input"]
def chunk_scores(C=64, K=128):
    """P = (Q K^T) * Gamma, lower triangle incl. the diagonal, one CTA per chunk of one head."""
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def scores(q: T.Tensor((num_chunks * C, K), "bfloat16"), k: T.Tensor((num_chunks * C, K), "bfloat16"),
               g_cum: T.Tensor((num_chunks * C,), "float32"), p: T.Tensor((num_chunks * C, C), "float32")):
        with T.Kernel(num_chunks, threads=128) as c:                    # a warpgroup: 4 warps
            q_shared = T.alloc_shared((C, K), "bfloat16")
            k_shared = T.alloc_shared((C, K), "bfloat16")
            g_shared = T.alloc_shared((C,), "float32")
            p_fragment = T.alloc_fragment((C, C), "float32")
            T.copy(q[c * C:(c + 1) * C, :], q_shared)
            T.copy(k[c * C:(c + 1) * C, :], k_shared)
            T.copy(g_cum[c * C:(c + 1) * C], g_shared)
            T.gemm(q_shared, k_shared, p_fragment, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                p_fragment[i, j] = T.if_then_else(
                    j <= i, p_fragment[i, j] * T.exp2((g_shared[i] - g_shared[j]) * LOG2E), 0)
            T.copy(p_fragment, p[c * C:(c + 1) * C, :])

    return scores


answer = chunk_scores
result = check_chunk_scores(answer)
assert result.passed, result
result
