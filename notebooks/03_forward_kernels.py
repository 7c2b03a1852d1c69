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
# forward into GPU kernels. Each kernel version is a numbered *stage* of the op `gdn_fwd`, a frozen
# file under `kernels/gdn_fwd/` that changes one thing from the stage before:
#
# | stage | what it is | what it shows |
# |---|---|---|
# | s00 | FLA's Triton forward, called as a library | the baseline that every later stage is timed against |
# | s01 | one TileLang kernel that runs the recurrence, with the state on chip | why the recurrence is slow on a GPU |
# | s02 | the chunked form as six TileLang kernels, one per sub-step of `flashqla.reference` | tensor cores, and what the traffic between kernels costs |
# | s03 | the state recurrence and the output fused into one kernel fed by TMA | per-chunk states that never leave the chip |
#
# The sub-steps of chapter 2 are ops of their own (`chunk_local_cumsum`, `chunk_kkt`, `kkt_solve`,
# `chunk_w_u`, `chunk_h`, `chunk_o`), with their own stages and their own checks, so a wrong kernel
# is caught where it is wrong. For every stage we read what changed and why (its docstring), its
# TileLang source, the lines of generated CUDA that matter, the napkin math of one chunk, and the
# measured speed.
#
# Every cell runs on a CPU. TileLang compiles for Hopper (sm_90a) without a GPU, so the generated
# CUDA is real; the kernels only *run* on the GPU machine, where the tests and the benchmark were
# run, and their numbers are read here from the committed results.

# %%
import ast
import csv
import inspect
import math
import re
import statistics
import warnings

import matplotlib.pyplot as plt
import torch

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by TileLang
import tilelang

from flashqla import bench, fwd
from flashqla.hopper import cuda_excerpt, hopper_gpu_missing
from flashqla.stages import KERNELS_DIR, OPS, discover, load
from flashqla.testing import (ROUNDING_FLOOR, TOLERANCE_FACTOR, Problem, cast_floats, check_op,
                              op_inputs)

tilelang.set_log_level("WARNING")        # keep "begins to compile kernel" lines out of the outputs
ROOT = KERNELS_DIR.parent

# %% [markdown]
# ## The stages in this checkout
#
# `flashqla.stages.discover()` finds every stage file under `kernels/`, ordered by op and number.
# Each one says what it needs to run; on this machine only the references run.

# %%
STAGES = discover()
for s in STAGES:
    print(f"{s.id:24s} {str(s.path.relative_to(ROOT)):50s} needs {', '.join(s.module.NEEDS):12s}"
          f" {s.missing() or 'runs here'}")

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
# For `gdn_fwd` the reference is the chunked forward of chapter 2, with FLA's signature:

# %%
print("gdn_fwd" + str(inspect.signature(OPS["gdn_fwd"][0])), "->", OPS["gdn_fwd"][1])

# %% [markdown]
# File names say what changed and may still be renamed; numbers do not change. So this chapter
# loads a stage by (op, number) with `flashqla.stages.load`, never by file name, and the few helpers
# below only *display* things: the kernel-building function of a stage (the function that returns a
# `T.prim_func`), the sub-op stages a `gdn_fwd` stage calls, and the lines of generated CUDA that
# hold the instructions this chapter is about.

# %%
def stage_module(op, number):
    """The module of stage op.sNN, or None (with a note) while the checkout has none."""
    try:
        return load(op, number)
    except LookupError:
        print(f"{op}.s{number:02d} is not in this checkout yet")
        return None


def stage_file(module):
    return str(inspect.getsourcefile(module)).removeprefix(str(ROOT) + "/")


def kernel_builders(module):
    """The functions of a stage file that build a T.prim_func: the kernels TileLang compiles."""
    return [f for f in vars(module).values()
            if inspect.isfunction(f) and f.__module__ == module.__name__
            and "@T.prim_func" in inspect.getsource(f)]


def show_kernel(module):
    """Print the kernel-building function(s) of a stage, or its run() when it builds no kernel."""
    for f in kernel_builders(module) or [module.run]:
        print(inspect.getsource(f))


def math_comments(module):
    """The comment lines of a stage's kernel: one per block, stating the math it computes."""
    return [line.strip() for f in kernel_builders(module)
            for line in inspect.getsource(f).splitlines() if line.strip().startswith("#")]


def sub_steps(module):
    """(op, number) of every sub-op stage that a gdn_fwd stage names in its source, in order."""
    pairs = re.findall(r'\(\s*"(\w+)",\s*(\d+)\s*\)', inspect.getsource(module))
    return list(dict.fromkeys((op, int(n)) for op, n in pairs if op in OPS and op != "gdn_fwd"))


FEATURES = (  # (what it is, a pattern matched against each line of the generated CUDA)
    ("wgmma: a warpgroup issues a tensor-core MMA", r"tl::wgmma_\w+<"),
    ("wgmma: wait for issued MMAs", r"tl::warpgroup_wait<"),
    ("TMA load (cp.async.bulk.tensor)", r"tl::tma_load\(|cp\.async\.bulk"),
    ("TMA store", r"tl::tma_store\("),
    ("mbarrier wait / arrive / expect bytes", r"mbarrier\[.*\]\.(wait|arrive|expect_transaction)\("),
    ("exp2f (PTX ex2.approx.f32)", r"exp2f\("),
    ("warp shuffle", r"__shfl_xor_sync"),
    ("__syncthreads", r"__syncthreads\(\)"),
)


# %% [markdown]
# A count is of *lines* of source, not of instructions executed: a line inside an unrolled or
# serial loop runs many times (a `wgmma` line sits in a loop over the $K / 16$ slices of the
# reduction, for instance). What matters is which instructions appear at all.
#
# ## s00: FLA's Triton forward, the baseline
#
# The first row of every comparison is the system this project re-derives, called exactly as a
# model would call it:

# %%
s00 = stage_module("gdn_fwd", 0)
if s00:
    print(s00.__doc__)
    print(inspect.getsource(s00.run))

# %% [markdown]
# FLA's forward is the chunked form of chapter 2, split into separate Triton kernels (plus the host
# work that prepares varlen indices). It writes every intermediate to HBM and reads it back,
# including the per-chunk states $h$ in bf16. Stage s02 below has the same shape, in TileLang; s03
# removes its largest traffic.
#
# ## s01: the recurrence, state on chip
#
# The first TileLang stage runs the definition of chapter 1 as written, one token after another.
# Each CTA owns one (sequence, value head, V tile) and keeps its slice of the $K \times V$ state in
# registers for the whole sequence, so the state never touches HBM: per token, a CTA reads
# $q_t, k_t, v_t, g_t, \beta_t$ and writes its part of $o_t$.

# %%
s01 = stage_module("gdn_fwd", 1)
if s01:
    print(s01.__doc__)

# %% [markdown]
# The output needs no second pass over the state. Since $h_t = e^{g_t} h_{t-1} + k_t e_t^\top$,
#
# $$
# o_t = s\, h_t^\top q_t = s \big( e^{g_t} h_{t-1}^\top q_t + e_t\, (k_t \cdot q_t) \big),
# $$
#
# so the three reductions over $K$ ($h^\top k_t$, $h^\top q_t$, $k_t \cdot q_t$) are computed together
# before $h$ is updated. The kernel:

# %%
if s01:
    show_kernel(s01)

# %% [markdown]
# In the generated CUDA, the reductions over a group of lanes are `__shfl_xor_sync` butterflies
# and the decay is one `exp2f` per token. Whatever the kernel does to bring the tokens in, there is
# no `wgmma`: the tensor cores stay idle.

# %%
if s01:
    cuda_excerpt(s01.kernel_source(), FEATURES)

# %% [markdown]
# ### Napkin math: why it cannot be fast
#
# **No tensor cores.** A Hopper tensor-core instruction (`wgmma`) multiplies a 64-row tile by a
# tile of $N$ columns. Per token the recurrence does two matrix-vector products ($h^\top k_t$,
# $h^\top q_t$) and one rank-one update: one row, not 64. Rows cannot be batched, since token $t$'s
# prediction needs the state after token $t - 1$. So all $7KV$ FLOPs per token and head run on the
# FP32 units, about 67 TFLOP/s on an H100 SXM (datasheet), against about 790 TFLOP/s measured
# for a bf16 GEMM.
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
BV_RECURRENT = 16                                   # s01's V tile (its docstring)

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
    ctas = HV * V // BV_RECURRENT
    print(f"(H, HV) = ({H}, {HV}), one sequence: {ctas} CTAs, each walking all 32768 tokens, "
          f"for {SMS} SMs")

# %% [markdown]
# The recurrence does fewer FLOPs than the chunked form, but on units twelve times slower, and its
# chain of $T$ dependent steps bounds it from below whatever the parallelism. It needs no more HBM
# traffic than a fully fused chunked kernel would (the CTAs that share a key head can find its $q$
# and $k$ in L2): that is its one strength, and the reason the same kernel shape is the natural
# decode kernel ($T = 1$, nothing to chunk). For long prefill, the chunked form is the way out.
#
# ## s02: the chunked form, one kernel per sub-step
#
# Stage s02 runs the chunked forward of chapter 2 on the tensor cores, as separate kernels that
# mirror `reference.chunk_gated_delta_rule_ref` one sub-step at a time. It has no kernel of its own:
# its `run` chains the sub-op stages.

# %%
s02 = stage_module("gdn_fwd", 2)
if s02:
    print(s02.__doc__)
    show_kernel(s02)

# %% [markdown]
# Every sub-step is its own op, and each kernel is first checked alone against its own reference,
# on inputs computed by the float64 reference (`flashqla.testing.op_inputs`), so that an error
# shows up in the kernel that makes it. The kernels s02 chains, with the one-line math comment of
# every block of each kernel:

# %%
steps = sub_steps(s02) if s02 else []
for op, number in steps:
    module = stage_module(op, number)
    if module:
        print(f"== {op}.s{number:02d}  ({stage_file(module)})")
        print("   " + module.__doc__.strip().splitlines()[0])
        for line in math_comments(module):
            print("      " + line)
        print()

# %% [markdown]
# Four of the six (the cumsum, $A$, its inverse, $w$ and $u$) are independent across chunks: one CTA
# per chunk and head, thousands of them. `chunk_h` is the chain over chunks, and `chunk_o` needs its
# per-chunk states. Those two are what s03 fuses, so here they are in full. First `chunk_h`: one CTA
# per (sequence, value head, V tile), the fp32 state in registers, two `wgmma` products per chunk,
# the next chunk's tiles loaded by TMA while the current one computes. It writes every per-chunk
# state $h$ and every `v_new` row to HBM:

# %%
chunk_h = stage_module("chunk_h", 1)
if chunk_h:
    show_kernel(chunk_h)
    cuda_excerpt(chunk_h.kernel_source(), FEATURES)

# %% [markdown]
# And `chunk_o`, which reads them back: per chunk, $Q h$ and $Q K^\top$ from shared memory, then
# $P\,\tilde V$ with the masked, decayed $P$:

# %%
chunk_o = stage_module("chunk_o", 1)
if chunk_o:
    show_kernel(chunk_o)
    cuda_excerpt(chunk_o.kernel_source(), FEATURES)

# %% [markdown]
# The smallest of them shows what a latency-bound kernel looks like. `chunk_local_cumsum.s01` gives
# a head's whole chunk to one thread: 64 loads, then 63 dependent adds, one warp a CTA, and
# TileLang guards every access against the tensor's bounds (a branch around each load and store).
# `s02` splits the chunk over eight threads a head (a scan of 8 in registers, the totals through
# shared memory, one barrier: 15 dependent adds on the path) and turns the bounds checks off,
# because the chunk table already keeps every access in bounds. Find the bounds checks in the
# generated CUDA (each sits inside a loop that ptxas unrolls 64 times: about 255 branches in s01's
# SASS):

# %%
cumsum1, cumsum2 = stage_module("chunk_local_cumsum", 1), stage_module("chunk_local_cumsum", 2)
if cumsum1 and cumsum2:
    show_kernel(cumsum2)
    checks = {name: m.kernel_source().split("__global__")[-1].count("< num_tokens")
              for name, m in (("s01", cumsum1), ("s02", cumsum2))}
    print("bounds checks against num_tokens in the kernel's CUDA:", checks)
    assert checks["s01"] == 2 and checks["s02"] == 0

# %% [markdown]
# Measured (one H100, each kernel alone as 50 launches in one CUDA graph): s02 takes 1.6-2.5 us
# where s01 takes 4.0-7.3 on the 1 x 2048 and 1 x 8192 problems of every head layout, about 2.5-5
# us off every forward. The library runs s02 from `gdn_fwd.s26` on (notebook 06).
#
# Every cumsum so far reads the chunk table, which another kernel built (inside a CUDA graph: one
# CTA, 3.3-3.8 us before the cumsum on every replay). `chunk_local_cumsum.s03` takes the sequence
# bounds instead: each CTA counts every sequence's chunks, prefix-sums the counts over its threads,
# finds its own chunk, and writes its row of the table for the kernels after it (CTA 0 also each
# sequence's first row); its scan is s02's. Inside gdn_fwd.s29's forward in a CUDA graph it takes
# 2.0-2.9 us on the 1 x 2048 problems of (2, 8), (4, 16) and (8, 32), where the table kernel took
# 3.3-3.6 and s02 4.0-4.6 after it (one H100, commit 4c2e89f); the library runs it. Its prologue,
# in the generated CUDA: the Hillis-Steele steps (two barriers each) before the scan's one:

# %%
cumsum3 = stage_module("chunk_local_cumsum", 3)
if cumsum3:
    body3 = cumsum3.kernel_source().split("__global__")[-1]
    print("barriers:", body3.count("__syncthreads()"), "(s02:",
          cumsum2.kernel_source().split("__global__")[-1].count("__syncthreads()"), ")")
    print(body3[body3.index("first_chunk[") - 400:body3.index("first_chunk[") + 200])
    assert "table[" in body3 and body3.count("__syncthreads()") > 2 * 8

# %% [markdown]
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
# are the ones that pass from `chunk_h` to `chunk_o`: one bf16 $K \times V$ state per chunk, as many
# bytes as 128 tokens of `v_new`, and `v_new` itself. For the whole layer:

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
# Stage s03 keeps the first four kernels of s02 and replaces `chunk_h` and `chunk_o` by one kernel.
# A CTA owns one (sequence, value head, V tile) and walks its chunks in order, as `chunk_h` did;
# in each chunk it also computes that chunk's output, while the state entering the chunk and
# `v_new` are still in registers and shared memory. The per-chunk states and `v_new` never reach
# HBM. The tiles of $q$, $k$, $w$ and $u$ arrive by TMA, the next chunk's while the current one
# computes.

# %%
s03 = stage_module("gdn_fwd", 3)
if s03:
    print(s03.__doc__)
    print("sub-op stages it calls:", ", ".join(f"{op}.s{n:02d}" for op, n in sub_steps(s03)))
    show_kernel(s03)

# %% [markdown]
# One iteration of the loop does five products. $W S$ comes first, since $\tilde V = U - W S$
# feeds both the state update and the output. The update
# $K^\top \operatorname{diag}(e^{\gamma_C - \gamma}) \tilde V$, $Q S$ and $Q K^\top$ need nothing
# else from the chain, so they can be issued back to back and waited for together; $P \tilde V$
# comes last. `T.Pipelined` turns the loop into a producer warpgroup that issues the TMA loads of
# the next chunk and consumer warpgroups that compute, synchronized by mbarriers (a consumer waits
# until the expected number of bytes of a buffer has landed; the producer waits until a buffer has
# been released). In the CUDA: the TMA loads, the mbarriers, the `wgmma` products and their waits:

# %%
if s03:
    cuda_excerpt(s03.kernel_source(), FEATURES)

# %% [markdown]
# ### Napkin math: what fusing saves, and what it cannot
#
# Fusing removes the state and `v_new` round trips (the table above: about 3.2 GB and a
# millisecond of HBM time for the (16, 64) layer) and one extra read of the keys. It does not
# shorten the chain: a CTA still walks $T / 64$ chunks in order, each a handful of dependent
# products, and there are only $N \cdot H_V \cdot V / B_V$ CTAs. A floor for one chain, if its SM
# ran its tensor cores at a 132nd of the card's GEMM rate:

# %%
BV_FUSED = 64                                        # s03's V tile (its source above)
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
# (2, 8) only 16 CTAs have work. Cutting a long sequence into segments that run in parallel
# (context parallelism) addresses that, in a later chapter. The other large remaining traffic is
# the $A$, $\mathcal{T}$, $w$ and $u$ that s03 still writes and reads between its first kernels.

# %%
later = [s for s in STAGES if s.op == "gdn_fwd" and s.number > 3]
for s in later:
    print(f"{s.id} ({stage_file(s.module)}), added after this chapter was written:")
    print("   " + s.module.__doc__.strip().splitlines()[0])
if not later:
    print("no gdn_fwd stage after s03 in this checkout")

# %% [markdown]
# ## What the library runs: promotion
#
# One more fusion, at the front of the forward: `chunk_fwd_intra.s01` computes $A$, solves
# $(I + A)^{-1}$ and forms $w$ and $u$ in one kernel per (chunk, value head), so $A$ (fp32, 64
# values per token and head) and its inverse never reach HBM. It is its own op, checked against
# the composition of the three references it replaces. `flashqla.chunk_gated_delta_rule` then runs,
# on an SM90 GPU with bf16 inputs and $K = V = 128$, kernels copied from their stages into
# `flashqla/fwd.py`. For a while those were chunk-local cumsum, this fused preparation and s03's
# fused recurrence and output; today they are the later chapters' stages: the gate-free solve and
# the warp-specialized fused kernel on the reformulated math (`gdn_fwd.s10`, chapter 4), with
# AutoCP (`gdn_fwd.s11`, chapter 5) when few heads run long sequences, where this fused
# preparation still gives the warm-up kernel its $w$ and $u$. A test asserts that each copy builds
# the same TileLang program as its stage, so the library runs exactly what the stage tests checked.

# %%
intra = load("chunk_fwd_intra", 1)
print(intra.__doc__.strip().splitlines()[0])
print()
print(fwd.__doc__)
print(inspect.getsource(fwd.forward))

# %% [markdown]
# ## How every stage is checked
#
# A stage passes when every output is within a bound derived from bf16 arithmetic
# (`flashqla.testing.check_op`, the page "How a stage is checked"): with $\mathrm{err}$ the
# relative L2 error against the float64 reference and $\mathrm{err}_{\mathrm{bf16}}$ the error of the
# same reference math run in bf16 PyTorch,
#
# $$
# \mathrm{err} \le 2 \max(\mathrm{err}_{\mathrm{bf16}}, 2^{-9}).
# $$
#
# `check_op` takes any function with the op's signature. Here, on the CPU, it is given the reference
# itself in float32, on the varlen mix of the GPU tests (sequences of 1, 200, 777, 64 and 130
# tokens) with $(H, H_V) = (1, 4)$: one value head each with $g = 0$ and strong decay, two with
# ordinary decay. Each sub-op gets the inputs its kernel gets (`op_inputs`: upstream results of
# the float64 reference, cast to the kernel dtypes). The printout is the bound each stage of
# each op must meet on this problem:

# %%
problem = Problem(1, 4, (1, 200, 777, 64, 130))
x = problem.inputs(seed=1)
print(f"{problem.label}: bound = {TOLERANCE_FACTOR:g} x max(bf16 PyTorch error, {ROUNDING_FLOOR:.2e})")
print(f"{'op':20s} {'output':12s} {'bf16 err':>9s} {'bound':>9s} {'fp32 ref err':>12s}")
def in_float32(ref_fn):
    """The reference run in float32: a stand-in for a stage, to show the bounds on the CPU."""
    return lambda **kw: ref_fn(**cast_floats(kw, torch.float32))


for op, (ref_fn, _) in OPS.items():
    for c in check_op(op, in_float32(ref_fn), op_inputs(op, x)):
        print(f"{op:20s} {c.output:12s} {c.err_bf16:9.2e} {c.bound:9.2e} {c.err:12.2e}")

# %% [markdown]
# The fp32 reference lands four to five orders of magnitude inside its bound; a kernel with bf16
# operands and fp32 accumulation should sit a little under the bf16 column. A structural bug is of
# order 1 and fails loudly. For instance a forward that forgets the decay:

# %%
ref_fwd = OPS["gdn_fwd"][0]


def forgets_the_decay(**kw):
    kw = cast_floats(kw, torch.float32)
    return ref_fwd(**{**kw, "g": torch.zeros_like(kw["g"])})


try:
    check_op("gdn_fwd", forgets_the_decay, x)
    raise RuntimeError("check_op accepted a forward without decay")
except AssertionError as exc:
    print("AssertionError:", exc)

# %% [markdown]
# On the GPU machine the same check runs for every stage that the machine can run (all of them, or
# one op's with `-k`):
#
# ```bash
# python3 -m pytest -m gpu tests/test_stages.py -q
# python3 -m pytest -m gpu tests/test_stages.py -q -k gdn_fwd
# ```
#
# `tests/test_stages.py` runs each stage on the eight Qwen3.5 head configurations at $K = V = 128$,
# each with one sequence of 1000 tokens, the varlen mix above, and an equal-length batch of two
# sequences of 333 tokens without initial state: 24 problems per stage. The `gdn_fwd` stages are
# checked end to end (`o` and the final state); the sub-op stages are checked alone. A CPU test in
# the same file compiles every TileLang stage for sm_90a and asserts that its CUDA contains its
# `SOURCE_MUST_CONTAIN`, the same sources excerpted above.

# %%
for s in STAGES:
    must = getattr(s.module, "SOURCE_MUST_CONTAIN", None)
    if must:
        print(f"{s.id:24s} SOURCE_MUST_CONTAIN = {must}")

# %% [markdown]
# ## Measured speeds
#
# `python -m flashqla bench` times, on the GPU machine and in one run, every `gdn_fwd` stage, FLA
# (s00), FlashQLA and the public `flashqla.chunk_gated_delta_rule`, on the eight head
# configurations and five token mixes, each row checked against the float64 reference before it is
# timed. The timing method is the same for every row:

# %%
print(bench.__doc__)

# %% [markdown]
# It writes `profiles/results/gdn_fwd.csv`, one row per (problem, implementation), with the card,
# the driver and library versions, the commit and the roofs measured in the same run. The plots
# below are drawn from that file:

# %%
CSV_PATH = bench.RESULTS / "gdn_fwd.csv"
if CSV_PATH.exists():
    rows = bench.read_csv(CSV_PATH)
    timed = [r for r in rows if r["ms"]]
    meta = rows[0]
    print(f"{len(rows)} rows from {CSV_PATH.relative_to(ROOT)}: {meta['gpu']}, driver {meta['driver']}, "
          f"CUDA {meta['cuda']}, torch {meta['torch']}, TileLang {meta['tilelang']}, fla {meta['fla']}, "
          f"flash-qla {meta['flash_qla']}, commit {meta['commit']}, {meta['date']}")
    print(f"roofs measured in the same run: bf16 GEMM {meta['gemm_roof_tflops']} TFLOP/s, "
          f"copy {meta['copy_roof_gbs']} GB/s")
    for r in rows:
        if not r["ms"]:
            print(f"not timed: {r['impl']} on {r['problem']} ({r['method']})")
else:
    rows, timed = [], []
    print(f"{CSV_PATH.relative_to(ROOT)} is not in this checkout yet: run `python -m flashqla bench` "
          "on the GPU machine to write it. The plots below are skipped.")

# %%
short_label = bench.short_label


if timed:
    labels = list(dict.fromkeys(r["problem"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for impl in impls:
        pts = [(labels.index(r["problem"]), float(r["ms"])) for r in timed if r["impl"] == impl]
        ax.plot([p for p, _ in pts], [ms for _, ms in pts], "o-", ms=3, lw=1, label=impl)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), [short_label(x) for x in labels], rotation=90, fontsize=6)
    ax.set_ylabel("forward, ms (log)")
    ax.set_title(f"gdn forward, every implementation in one run ({meta['gpu']}, {meta['date']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()

# %% [markdown]
# Every row does the same useful work for its problem (the chunked form's FLOPs, the minimum bytes),
# so each problem has one arithmetic intensity and the implementations of a problem sit on one
# vertical line of the roofline; higher is faster. `x_floor` is the time over the card's floor for
# that work, $\max(\text{FLOPs} / \text{GEMM roof}, \text{bytes} / \text{copy roof})$: 1 would be
# perfect.

# %%
if timed:
    gemm_roof, copy_roof = float(meta["gemm_roof_tflops"]), float(meta["copy_roof_gbs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for impl in impls:
        pts = [(float(r["tflops"]) * 1e3 / float(r["gbs"]), float(r["tflops"])) for r in timed
               if r["impl"] == impl]
        ax.loglog([i for i, _ in pts], [t for _, t in pts], "o", ms=4, alpha=0.7, label=impl)
    xs = [16, gemm_roof * 1e3 / copy_roof, 1024]                 # the ridge at the corner
    ax.loglog(xs, [min(gemm_roof, i * copy_roof / 1e3) for i in xs], "k--", lw=1, label="roof (same run)")
    ax.set_xlabel("useful FLOP / useful byte")
    ax.set_ylabel("TFLOP/s (useful work)")
    ax.set_title("Roofline", fontsize=9)
    ax.legend(fontsize=6)
    ax = axes[1]
    for n, impl in enumerate(impls):
        xf = [float(r["x_floor"]) for r in timed if r["impl"] == impl]
        ax.semilogy([n] * len(xf), xf, "o", ms=4, alpha=0.5)
    ax.axhline(1, color="gray", ls=":", lw=1)
    ax.set_xticks(range(len(impls)), impls, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("x_floor: ms / card floor (log)")
    ax.set_title("Distance from the floor, every problem", fontsize=9)
    fig.tight_layout()

# %% [markdown]
# Summed up per implementation, over the problems it ran: the geometric mean of the speed-up over
# each baseline (above 1: faster than it) and the median distance from the floor.

# %%
def geomean(xs):
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


if timed:
    print(f"{'implementation':34s} {'problems':>8s} {'vs FLA':>7s} {'vs FlashQLA':>11s} {'x_floor':>8s}")
    for impl in impls:
        mine = [r for r in timed if r["impl"] == impl]
        vs = {col: geomean([float(r[col]) for r in mine if r[col]]) for col in ("vs_fla", "vs_flashqla")}
        print(f"{impl:34s} {len(mine):8d} {vs['vs_fla']:7.2f} {vs['vs_flashqla']:11.2f} "
              f"{statistics.median(float(r['x_floor']) for r in mine):8.1f}")
    print()
    print(bench.format_rows([{c: c for c in bench.COLUMNS}]
                            + [r for r in rows if r["problem"] == "(16, 64) 1x32768"]))

# %% [markdown]
# On a machine with a Hopper GPU, the next cell measures two problems again with the benchmark's
# own functions (`input_sets` rotates inputs larger than twice the L2 cache, `time_row` replays a
# CUDA graph, or times with events when capture fails). Compare those numbers only with each other:
# the CSV may come from another card.

# %%
if torch.cuda.is_available() and hopper_gpu_missing() is None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for p in (Problem(16, 64, (32768,)), Problem(2, 8, (32768,))):
        sets = bench.input_sets(p, l2)
        for name, fn, _ in bench.candidates():
            ms, method = bench.time_row(fn, sets)
            print(f"{p.label:22s} {name:36s} {ms:8.3f} ms  ({method})")
else:
    print(f"No Hopper GPU here ({hopper_gpu_missing()}): the numbers in this section come from "
          f"{CSV_PATH.relative_to(ROOT)}" + ("." if CSV_PATH.exists() else ", once it is committed."))

# %% [markdown]
# ## Inside a kernel: Nsight Compute
#
# A time says how far a stage is from its floor, not why. Nsight Compute (`ncu`) replays one kernel
# launch many times and reads the hardware counters: achieved DRAM bandwidth, tensor-core
# utilization, stall reasons. Every stage wraps its launches in an NVTX range named after its id in
# the `flashqla` domain (`gdn_fwd.s03`, `chunk_h.s01`, ...), so a profile can be scoped to one stage:
#
# ```bash
# ncu --nvtx --nvtx-include "flashqla@gdn_fwd.s03/" --clock-control none --csv python3 my_script.py
# ```
#
# `profiles/ncu_lab.py` runs that for the forward stages on the GPU machine and writes its tables to
# `profiles/results/ncu_*.csv`:

# %%
NCU_LAB = ROOT / "profiles" / "ncu_lab.py"
ncu_tables = sorted(bench.RESULTS.glob("ncu_*.csv"))
if NCU_LAB.exists():
    print(ast.get_docstring(ast.parse(NCU_LAB.read_text())) or "(profiles/ncu_lab.py has no docstring)")
else:
    print("profiles/ncu_lab.py is not in this checkout yet.")
for path in ncu_tables:
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    print(f"\n{path.relative_to(ROOT)}: {len(table) - 1} rows")
    for line in table[:16]:
        print("  " + " | ".join(cell[:28] for cell in line))
    if len(table) > 16:
        print(f"  ... {len(table) - 16} more rows")
if not ncu_tables:
    print("\nNo profiles/results/ncu_*.csv yet: run profiles/ncu_lab.py on the GPU machine "
          "(after `. .gpu-bundle/setup.sh`) to write them.")

# %% [markdown]
# ## Summary
#
# - A stage is a frozen file loaded by (op, number); it computes exactly its op's reference, and
#   `check_op` holds it to twice the error of the same math in bf16.
# - s01, the recurrence with its state in registers, moves the minimum number of bytes but runs
#   matrix-vector work on the FP32 units along a chain of $T$ dependent steps.
# - s02 puts the chunked form on the tensor cores, one kernel per sub-step; every kernel is memory
#   bound, and the per-chunk states and `v_new` passing from `chunk_h` to `chunk_o` are the largest
#   intermediates, about 3.2 GB of round trips for a (16, 64) layer of 32768 tokens.
# - s03 fuses `chunk_h` and `chunk_o`: those intermediates stay on chip, TMA feeds the tiles, and
#   independent products overlap. What remains is the chain of $T / 64$ chunks per (sequence, head,
#   V tile), too few chains when heads are few and sequences long, and the $A$, $\mathcal{T}$, $w$,
#   $u$ traffic of the first four kernels.
# - The next chapters take those on: the gate-free solve and a forward that never forms $w$ and
#   $u$, then context parallelism inside the card.
