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
# # What Gated DeltaNet computes
#
# Gated DeltaNet (GDN) is a linear-attention layer: instead of attending over every earlier token,
# each head keeps a fixed-size matrix memory, the *state* $h$, and updates it once per token. This
# chapter defines exactly what is computed (the recurrence, with the conventions of FLA's
# `chunk_gated_delta_rule`), explains why it has this form, runs the float64 reference on small
# examples, and ends with the reason it cannot be run on a GPU as written: it is one long chain of
# tiny sequential steps. Chapter 2 rewrites it so that most of the work becomes matrix products.
#
# **What you will learn**
#
# - the recurrence of one value head, token by token, and the shapes of FLA's API (GVA heads,
#   packed sequences with `cu_seqlens`, initial and final states);
# - why it has this form: a key-value memory, the delta rule as one step of online least squares,
#   the gate as forgetting, and why the state cannot blow up;
# - how to check any implementation against the float64 reference (`flashqla.reference`);
# - what the recurrence costs, and why a GPU cannot run it fast as written.
#
# **What you need first**
#
# Matrix products and outer products, the spectral norm, and PyTorch tensors (`einsum` helps).
# Nothing about GPUs yet. Everything here runs on a CPU in a few seconds. The code that defines GDN
# lives in the library (`flashqla.reference`); this chapter only imports it, prints it and checks
# it.

# %%
import inspect
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import flashqla
from flashqla import reference
from flashqla.exercises.ch01 import check_gdn_step, check_run_packed
from flashqla.testing import rel_l2

torch.manual_seed(0)
f64 = torch.float64

# %% [markdown]
# ## The recurrence
#
# Fix one value head. Its state is a matrix $h \in \mathbb{R}^{K \times V}$ that maps keys (length
# $K$) to values (length $V$). Token $t$ brings a query $q_t$ and a key $k_t$ (length $K$), a value
# $v_t$ (length $V$), a log decay $g_t \le 0$ and a step size $\beta_t \in (0, 1)$. In order:
#
# $$
# \begin{aligned}
# h &\leftarrow e^{g_t}\, h && \text{decay first} \\
# e_t &= \beta_t \left(v_t - h^\top k_t\right) && \text{the delta rule: correct the prediction } h^\top k_t \\
# h &\leftarrow h + k_t\, e_t^\top && \text{rank-one write} \\
# o_t &= h^\top (s\, q_t) && \text{read with the query, } s = K^{-1/2} \text{ by default}
# \end{aligned}
# $$
#
# The output of token $t$ reads the state *after* token $t$ has been written, so a token sees itself.
# Substituting $e_t$ gives the state update as one affine map:
#
# $$
# h_t = e^{g_t} \left(I - \beta_t k_t k_t^\top\right) h_{t-1} + \beta_t\, k_t v_t^\top .
# $$
#
# The matrix $e^{g_t}(I - \beta_t k_t k_t^\top)$ acts on the key side of the state (from the left);
# the $V$ columns of $h$ never mix. That is the whole layer; everything in this project computes
# exactly this, faster.

# %% [markdown]
# ## Shapes and conventions
#
# The library follows FLA's `chunk_gated_delta_rule`, so it is a drop-in replacement:
#
# | tensor | shape | notes |
# |---|---|---|
# | `q`, `k` | `[B, T, H, K]` | usually bf16, L2-normalized over $K$ (by the caller, or `use_qk_l2norm_in_kernel=True`) |
# | `v` | `[B, T, HV, V]` | $H_V$ value heads, a multiple of $H$ |
# | `g` | `[B, T, HV]` | log decay, $g \le 0$ (fp32); the multiplier is $e^{g}$ |
# | `beta` | `[B, T, HV]` | step size in $(0, 1)$, typically a sigmoid (fp32) |
# | `initial_state`, final state | `[N, HV, K, V]` | fp32, one $K \times V$ matrix per (sequence, value head) |
# | `cu_seqlens` | `[N + 1]` | optional: $N$ sequences packed along $T$ with $B = 1$ |
# | `o` | `[B, T, HV, V]` | in the dtype of `v` |
#
# *GVA* (grouped value attention): there are fewer query/key heads than value heads, and value head
# $i$ reads query/key head $\lfloor i / (H_V / H) \rfloor$. The reference implements that by repeating
# heads:

# %%
print(inspect.getsource(reference.expand_heads))

# %% [markdown]
# In the Qwen3.5 models $K = V = 128$ and $(H, H_V)$ is for example $(16, 32)$ or $(16, 64)$ before
# tensor parallelism divides both. The examples below use $K = V = 16$ so that they run instantly.

# %% [markdown]
# ## Why the recurrence has this form
#
# ### Linear attention is a key-value memory
#
# Causal attention without the softmax computes $o_t = \sum_{s \le t} (q_t \cdot k_s)\, v_s$. Moving
# the sum inside,
#
# $$
# o_t = \Big(\sum_{s \le t} k_s v_s^\top\Big)^{\!\top} q_t = h_t^\top q_t, \qquad h_t = h_{t-1} + k_t v_t^\top .
# $$
#
# The state $h$ is an associative memory: the outer product $k v^\top$ *writes* value $v$ at key $k$,
# and $h^\top q$ *reads* at $q$. Reading at a stored key $k_j$ returns
# $\sum_s (k_j \cdot k_s)\, v_s$: exactly $v_j$ if the keys are orthonormal, but there are at most $K$
# orthonormal keys, and beyond that every read picks up crosstalk from all other writes. Worse,
# writing a new value at an existing key *adds* to the old one; nothing is ever replaced, so the state
# grows without bound.
#
# ### The delta rule is one step of online least squares
#
# Ask the memory to satisfy $h^\top k_t \approx v_t$ for the current pair, with the loss
#
# $$
# L_t(h) = \tfrac{1}{2} \left\| h^\top k_t - v_t \right\|^2 .
# $$
#
# Write $r = h^\top k_t - v_t$, so $r_j = \sum_i h_{ij} k_{t,i} - v_{t,j}$ and
# $\partial L_t / \partial h_{ij} = r_j\, k_{t,i}$, that is
#
# $$
# \nabla_h L_t = k_t \left(h^\top k_t - v_t\right)^\top .
# $$
#
# One gradient step with step size $\beta_t$ is
#
# $$
# h \leftarrow h - \beta_t k_t (h^\top k_t - v_t)^\top = h + k_t \underbrace{\beta_t (v_t - h^\top k_t)}_{e_t}{}^{\!\top},
# $$
#
# which is the delta-rule write. Plain linear attention writes $v_t$; the delta rule writes only the
# *error* $v_t - h^\top k_t$ of the memory's current prediction, scaled by $\beta_t$ (the
# Widrow-Hoff / LMS rule).
#
# ### The gate forgets
#
# Before the write, the whole state is multiplied by $e^{g_t} \in (0, 1]$: a data-dependent scalar
# decay per token and head, as in Mamba2. An association written at token $s$ and not disturbed
# afterwards is read back at token $t$ scaled by $\exp\big(\sum_{r=s+1}^{t} g_r\big)$. With $g = 0$ the
# head never forgets; in the models about a quarter of the heads have no decay.
#
# ### The state cannot blow up
#
# With $\|k_t\| = 1$ the matrix $I - \beta_t k_t k_t^\top$ has eigenvalue $1 - \beta_t$ along $k_t$ and
# $1$ on the orthogonal complement, so for $0 \le \beta_t \le 1$ (indeed up to 2) its spectral norm
# is at most 1: the old state is never amplified, and neither is rounding error. Even more concretely,
# the read-out at the key being written becomes
#
# $$
# h_{\mathrm{new}}^\top k_t = (1 - \beta_t)\, h^\top k_t + \beta_t v_t \qquad (\|k_t\| = 1,\ \text{after the decay}),
# $$
#
# a convex combination of the old read-out and the new value. With $\beta_t = 1$ the value at key
# $k_t$ is overwritten exactly. We check all of this numerically below.

# %% [markdown]
# ## The recurrence as code
#
# The definition in the library is a direct transcription, vectorized over sequences and heads and
# looping over time:

# %%
print(inspect.getsource(reference.naive_recurrent_gated_delta_rule))

# %% [markdown]
# A small example: one sequence of $T = 200$ tokens, $H = 1$ query/key head shared by $H_V = 2$ value
# heads. Head 0 decays ($g_t = \log \sigma(x_t + 2)$ with $x_t$ standard normal, about $-0.2$ per
# token); head 1 has $g = 0$.
# Keys and queries are unit vectors, as in the models.

# %%
B, T, H, HV, K, V = 1, 200, 1, 2, 16, 16
q = reference.l2norm(torch.randn(B, T, H, K, dtype=f64))
k = reference.l2norm(torch.randn(B, T, H, K, dtype=f64))
v = torch.randn(B, T, HV, V, dtype=f64)
g = F.logsigmoid(torch.randn(B, T, HV, dtype=f64) + 2.0)
g[..., 1] = 0.0                                    # head 1: no decay
beta = torch.sigmoid(torch.randn(B, T, HV, dtype=f64))

o, h_final = reference.naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
print("o", tuple(o.shape), "final state", tuple(h_final.shape))
print("mean g per head:", g.mean(dim=(0, 1)).tolist())

# %% [markdown]
# The reference returns only the final state. To watch the state evolve, run it one token at a
# time and feed each final state back in as the next `initial_state`. That this reproduces the
# single call exactly is itself a property we will rely on (chaining, below):

# %%
states = [torch.zeros(1, HV, K, V, dtype=f64)]
outs = []
for t in range(T):
    o_t, h_t = reference.naive_recurrent_gated_delta_rule(
        q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
        initial_state=states[-1], output_final_state=True)
    outs.append(o_t)
    states.append(h_t)
states = torch.stack(states, 0)[:, 0]             # [T + 1, HV, K, V], states[t] = after t tokens
err = rel_l2(torch.cat(outs, 1), o)
assert err < 1e-14, err
assert rel_l2(states[-1], h_final[0]) < 1e-14

# %% [markdown]
# For contrast, plain linear attention on the same keys and values with no decay. This is an
# illustration written inline (it is not part of the library): $h \leftarrow h + k_t v_t^\top$.

# %%
# illustration: ungated linear attention, h <- h + k_t v_t^T (value head 1's inputs)
h_lin = torch.zeros(K, V, dtype=f64)
lin_norms = [0.0]
for t in range(T):
    h_lin = h_lin + torch.outer(k[0, t, 0], v[0, t, 1])
    lin_norms.append(h_lin.norm().item())

# %%
norms = states.flatten(2).norm(dim=-1)            # Frobenius norm per step and head
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(norms[:, 0], label="GDN, head 0 (decay, mean g = %.2f)" % g[0, :, 0].mean())
ax.plot(norms[:, 1], label="GDN, head 1 (g = 0)")
ax.plot(lin_norms, "--", label="plain linear attention (g = 0, no delta rule)")
ax.set_xlabel("tokens processed t")
ax.set_ylabel(r"$\|h_t\|_F$")
ax.set_title("State norm over time")
ax.legend()
fig.tight_layout()

# %% [markdown]
# Plain linear attention keeps adding outer products, and its norm grows like a random walk. The
# delta rule with $g = 0$ levels off: once the memory predicts the values about as well as
# $K = 16$ dimensions allow, each write only corrects. The decaying head stays lower still, since
# it also forgets. The spectral-norm claim, checked on every token of the example:

# %%
I = torch.eye(K, dtype=f64)
kk = k[0, :, 0]                                    # [T, K] unit keys (shared by both value heads)
worst = 0.0
for t in range(T):
    for head in range(HV):
        b = beta[0, t, head]
        transition = torch.exp(g[0, t, head]) * (I - b * torch.outer(kk[t], kk[t]))
        worst = max(worst, torch.linalg.matrix_norm(transition, ord=2).item())
print(f"largest spectral norm of a transition matrix: {worst:.12f}")
assert worst <= 1 + 1e-12, worst

# %% [markdown]
# And the output itself, $o_t$ for every token and value channel of both heads:

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3), sharey=True)
lim = o.abs().max().item()
for head, ax in enumerate(axes):
    im = ax.imshow(o[0, :, head].T, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim)
    ax.set_title(f"o, head {head}" + (" (g = 0)" if head == 1 else " (decay)"))
    ax.set_xlabel("token t")
axes[0].set_ylabel("value channel")
fig.colorbar(im, ax=axes, shrink=0.9);

# %% [markdown]
# ## The delta rule overwrites
#
# Write $v_1$ at key $k$, then an unrelated pair $(k', v')$, then $v_2$ at the same key $k$, all with
# $\beta = 1$ and no decay, and read at $k$ after every token by passing $q_t = k$ with scale 1.
# After the third token the read-out must be exactly $v_2$: the convex combination above with
# $\beta = 1$. Plain linear attention would return $v_1 + v_2$ plus the crosstalk $(k \cdot k')v'$.

# %%
unit = lambda x: x / x.norm()             # exactly unit (reference.l2norm adds eps = 1e-6 under the root)
kv_k = unit(torch.randn(K, dtype=f64))
kv_other = unit(torch.randn(K, dtype=f64))
v1, v_other, v2 = torch.randn(3, V, dtype=f64)

keys = torch.stack([kv_k, kv_other, kv_k])[None, :, None]        # [1, 3, 1, K]
vals = torch.stack([v1, v_other, v2])[None, :, None]             # [1, 3, 1, V]
reads = keys[:, [0, 0, 0]]                                       # query = k at every step
ones, zeros = torch.ones(1, 3, 1, dtype=f64), torch.zeros(1, 3, 1, dtype=f64)
o_demo, _ = reference.naive_recurrent_gated_delta_rule(reads, keys, vals, zeros, ones, scale=1.0)

read_after_2 = o_demo[0, 1, 0]
read_after_3 = o_demo[0, 2, 0]
linear_attention_read = v1 + v2 + (kv_k @ kv_other) * v_other    # h = k v1^T + k' v'^T + k v2^T, read at k
print("after writing v1:         |read - v1| =", (o_demo[0, 0, 0] - v1).norm().item())
print("after writing (k', v'):   |read - v1| =", (read_after_2 - v1).norm().item(), " (crosstalk)")
print("after writing v2 at k:    |read - v2| =", (read_after_3 - v2).norm().item())
print("linear attention instead: |read - v2| =", (linear_attention_read - v2).norm().item())
assert (o_demo[0, 0, 0] - v1).norm() < 1e-12
assert (read_after_3 - v2).norm() < 1e-12

# %%
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(v2, "o-", label="$v_2$ (the last value written at $k$)")
ax.plot(read_after_3, "x", ms=9, label=r"GDN read-out $h^\top k$")
ax.plot(linear_attention_read, "s--", alpha=0.6, label="linear attention read-out")
ax.set_xlabel("value channel")
ax.set_title(r"Writing twice at the same key with $\beta = 1$")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# ## The gate forgets
#
# Write $v_1$ at key $k = e_1$ (the first unit vector) with $\beta = 1$, then keep writing random
# pairs whose keys are orthogonal to $k$, under a random decay. The writes never touch what is
# stored at $k$ (their prediction $h^\top k'$ and their write $k' e^\top$ are both orthogonal to $k$), so
# the only thing that changes the read-out at $k$ is the gate:
#
# $$
# h_t^\top k = \exp\Big(\sum_{r=2}^{t} g_r\Big)\, v_1 \qquad (\text{tokens numbered from } 1;\ \text{the write at token 1 happens after its own decay}).
# $$

# %%
Tm = 120
e1 = torch.zeros(K, dtype=f64); e1[0] = 1.0
others = torch.randn(Tm, K, dtype=f64); others[:, 0] = 0.0      # orthogonal to e1
keys_m = reference.l2norm(others); keys_m[0] = e1                 # token 0 writes at e1
vals_m = torch.randn(Tm, V, dtype=f64)
g_m = F.logsigmoid(torch.randn(Tm, dtype=f64) + 3.0)             # about -0.07 per token
beta_m = torch.sigmoid(torch.randn(Tm, dtype=f64)); beta_m[0] = 1.0

o_m, _ = reference.naive_recurrent_gated_delta_rule(
    e1.expand(1, Tm, 1, K), keys_m[None, :, None], vals_m[None, :, None],
    g_m[None, :, None], beta_m[None, :, None], scale=1.0)
readout = o_m[0, :, 0]                                            # [Tm, V]
retention = torch.exp(torch.cumsum(g_m, 0) - g_m[0])              # exp(sum of g after the write)
err = (readout - retention[:, None] * vals_m[0]).abs().max().item()
print(f"max |read-out - exp(sum g) v1| = {err:.2e}")
assert err < 1e-12, err

# %%
fig, ax = plt.subplots(figsize=(7, 3))
ax.semilogy(readout.norm(dim=-1) / vals_m[0].norm(), lw=3, alpha=0.5, label=r"$\|h_t^\top k\| / \|v_1\|$")
ax.semilogy(retention, "k--", label=r"$\exp(\sum_{r>1} g_r)$")
ax.set_xlabel("token t")
ax.set_title("An old association fades with the gate")
ax.legend()
fig.tight_layout()

# %% [markdown]
# ## Packed sequences: `cu_seqlens`
#
# Batches of sequences with different lengths are packed along the time axis with $B = 1$;
# `cu_seqlens` holds the $N + 1$ boundaries $[0, T_1, T_1 + T_2, \dots, T]$. Each sequence starts
# from its own initial state (or zero) and ends in its own final state; nothing leaks across a
# boundary. Running two packed sequences must therefore equal running them one at a time.

# %%
cu = torch.tensor([0, 70, T], dtype=torch.int32)
h0 = torch.randn(2, HV, K, V, dtype=f64)

o_packed, h_packed = reference.naive_recurrent_gated_delta_rule(
    q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
pieces, finals = [], []
for n in range(2):
    s, e = int(cu[n]), int(cu[n + 1])
    o_n, h_n = reference.naive_recurrent_gated_delta_rule(
        q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
        initial_state=h0[n:n + 1], output_final_state=True)
    pieces.append(o_n)
    finals.append(h_n)
err_o = rel_l2(o_packed, torch.cat(pieces, 1))
err_h = rel_l2(h_packed, torch.cat(finals, 0))
print(f"packed vs separate: output {err_o:.1e}, final states {err_h:.1e}")
assert err_o < 1e-14 and err_h < 1e-14, (err_o, err_h)

# %% [markdown]
# ## Chaining states
#
# The final state is everything the layer remembers, so a sequence can be processed in pieces:
# run tokens $[0, T_1)$, pass the final state as the `initial_state` of tokens $[T_1, T)$. This is how
# prefill continues into decoding, and it is the fact that context parallelism (chapter 6)
# exploits.

# %%
T1 = 83
o_full, h_full = reference.naive_recurrent_gated_delta_rule(
    q, k, v, g, beta, initial_state=h0[:1], output_final_state=True)
o_a, h_a = reference.naive_recurrent_gated_delta_rule(
    q[:, :T1], k[:, :T1], v[:, :T1], g[:, :T1], beta[:, :T1],
    initial_state=h0[:1], output_final_state=True)
o_b, h_b = reference.naive_recurrent_gated_delta_rule(
    q[:, T1:], k[:, T1:], v[:, T1:], g[:, T1:], beta[:, T1:],
    initial_state=h_a, output_final_state=True)
err_o = rel_l2(torch.cat([o_a, o_b], 1), o_full)
err_h = rel_l2(h_b, h_full)
print(f"two pieces vs one call: output {err_o:.1e}, final state {err_h:.1e}")
assert err_o < 1e-14 and err_h < 1e-14, (err_o, err_h)

# %% [markdown]
# ## The public API
#
# `flashqla.chunk_gated_delta_rule` has FLA's signature. On an SM90 GPU (H100, H200) with bf16
# $q, k, v$ and $K = V = 128$ it runs the library's kernels, which chapters 3 to 7 build; anywhere
# else (here: a CPU) it runs the chunked reference of chapter 2 in float32 (float64 for float64
# inputs) on the inputs' device, after a one-time warning that says why.

# %%
print("flashqla.chunk_gated_delta_rule" + str(inspect.signature(flashqla.chunk_gated_delta_rule)))

# %% [markdown]
# Call it on the packed example in float32 and compare with the float64 recurrence. How close
# should it be? A float32 rounding is at most $u = 2^{-24} \approx 6 \times 10^{-8}$ relative; the
# output of a token is a sum of a few hundred rounded terms whose errors partly cancel, and the
# transition matrices do not amplify them (norm $\le 1$). A relative L2 error of a few $u$ to a few
# tens of $u$ is therefore expected, and $10^{-5}$ ($\approx 170\,u$) is a bound that only a real
# bug would cross.

# %%
to32 = lambda x: x.to(torch.float32)
o_api, h_api = flashqla.chunk_gated_delta_rule(
    to32(q), to32(k), to32(v), to32(g), to32(beta), initial_state=to32(h0),
    output_final_state=True, cu_seqlens=cu)
err_o, err_h = rel_l2(o_api, o_packed), rel_l2(h_api, h_packed)
print(f"API (float32) vs naive (float64): output {err_o:.2e}, final state {err_h:.2e}"
      f"  = {err_o / 2**-24:.0f} u and {err_h / 2**-24:.0f} u")
print("dtypes:", o_api.dtype, h_api.dtype)
assert err_o < 1e-5 and err_h < 1e-5, (err_o, err_h)

# %% [markdown]
# Bad inputs raise a `ValueError` that names the argument and what was expected. Here the
# boundaries are not sorted:

# %%
bad_cu = torch.tensor([0, 130, 70, T], dtype=torch.int32)
raised = False
try:
    flashqla.chunk_gated_delta_rule(to32(q), to32(k), to32(v), to32(g), to32(beta), cu_seqlens=bad_cu)
except ValueError as exc:
    raised = True
    print("ValueError:", exc)
assert raised, "a decreasing cu_seqlens must be rejected"

# %% [markdown]
# ## What the recurrence costs
#
# Per token and value head, the recurrence touches the whole $K \times V$ state a few times:
#
# | operation | FLOPs |
# |---|---|
# | decay $h \leftarrow e^{g} h$ | $KV$ |
# | prediction $h^\top k$ | $2KV$ |
# | write $h \leftarrow h + k e^\top$ | $2KV$ |
# | read $h^\top q$ | $2KV$ |
#
# about $7KV$ FLOPs, or 115 kFLOP for $K = V = 128$. What it must move depends on where the state
# lives. Kept on chip (registers / shared memory) for the whole sequence, a token only reads
# $q, k, v$ in bf16, $g, \beta$ in fp32 and writes $o$ in bf16; read from and written back to HBM at
# every token (what a naive kernel launch per token would do), the fp32 state adds $8KV$ bytes.

# %%
Kb = Vb = 128
flops_tok = 7 * Kb * Vb
bytes_on_chip = 2 * (Kb + Kb + Vb) + 4 + 4 + 2 * Vb            # q, k, v, g, beta in; o out
bytes_in_hbm = bytes_on_chip + 2 * 4 * Kb * Vb                  # + fp32 state read and written
print(f"FLOPs per token and head:       {flops_tok:,}")
print(f"bytes, state on chip:           {bytes_on_chip:,}  -> {flops_tok / bytes_on_chip:6.1f} FLOP/byte")
print(f"bytes, state through HBM:       {bytes_in_hbm:,} -> {flops_tok / bytes_in_hbm:6.2f} FLOP/byte")

# %% [markdown]
# With the state through HBM the recurrence is hopelessly memory-bound (under 1 FLOP per byte,
# where an H100 needs several hundred to be compute-bound). With the state on chip the intensity
# looks fine, but every one of those FLOPs is a matrix-vector or rank-one operation: there is no
# matrix-matrix product anywhere, so the tensor cores (about 790 TFLOP/s for bf16 GEMM on these
# cards) sit idle and the work runs on the ordinary FP32 units (about 67 TFLOP/s on an H100 SXM,
# datasheet).
#
# The bigger problem is the dependency chain. Token $t$ needs the state after token $t - 1$: each
# (sequence, value head) is one chain of $T$ steps. On the CPU the time is simply linear in $T$:

# %%
def time_naive(Tn, reps=3):
    qq = reference.l2norm(torch.randn(1, Tn, 1, K, dtype=f64))
    vv = torch.randn(1, Tn, HV, V, dtype=f64)
    gg = torch.zeros(1, Tn, HV, dtype=f64)
    bb = torch.full((1, Tn, HV), 0.5, dtype=f64)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        reference.naive_recurrent_gated_delta_rule(qq, qq, vv, gg, bb)
        best = min(best, time.perf_counter() - t0)
    return best

lengths = [64, 128, 256, 512, 1024]
times = [time_naive(n) for n in lengths]
per_step = sorted(t / n for t, n in zip(times, lengths))[len(lengths) // 2]   # median time per token
print("microseconds per token:", [f"{t / n * 1e6:.0f}" for t, n in zip(times, lengths)])

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(lengths, [t * 1e3 for t in times], "o", label="measured")
ax.plot(lengths, [n * per_step * 1e3 for n in lengths], "k--", lw=1, label="T x median time per token")
ax.legend()
ax.set_xlabel("sequence length T")
ax.set_ylabel("ms (best of 3)")
ax.set_title("Naive recurrence on CPU: time grows linearly in T")
fig.tight_layout()

# %% [markdown]
# The per-token time is roughly constant: the loop is dominated by per-step overhead, not by the
# $7KV$ FLOPs of a step. A GPU has the same problem at a larger scale. An H100 has 132 SMs; a layer
# with $H_V = 32$ value heads and one long sequence offers 32 independent chains. The $V$ columns of a
# state evolve independently, so a kernel can split a chain over a few SMs, but every piece still
# walks all $T$ tokens in order, each step a small matrix-vector product followed by a
# synchronization. A napkin estimate, generously assuming one SM runs a step at its full FP32 rate:

# %%
sms, hv_model, T_long = 132, 32, 32768
sm_fp32 = 67e12 / sms                                  # FLOP/s of one SM's FP32 units (H100 SXM datasheet)
t_step = flops_tok / sm_fp32
total_flops = flops_tok * T_long * hv_model
print(f"one step on one SM: >= {t_step * 1e9:.0f} ns; one chain of {T_long} steps: >= {t_step * T_long * 1e3:.1f} ms")
print(f"the same {total_flops / 1e9:.0f} GFLOP spread over all tensor cores at 790 TFLOP/s: "
      f"{total_flops / 790e12 * 1e3:.3f} ms")
print(f"ratio: {t_step * T_long / (total_flops / 790e12):.0f}x")
print(f"chains: {hv_model} for {sms} SMs -> {hv_model / sms:.0%} of the SMs have work, if one chain per SM")

# %% [markdown]
# Even under that generous assumption the sequential chain takes tens of times longer than the same
# FLOPs would on the tensor cores, while most of the GPU is idle. The next chapter groups
# $C = 64$ tokens into a chunk, turns the work inside a chunk into matrix products that run in
# parallel across all chunks, and leaves a sequential chain of only $T / C$ steps.
#
# ## Summary
#
# - Per value head, GDN keeps a $K \times V$ state and, per token, decays it by $e^{g_t}$, writes the
#   delta-rule correction $e_t = \beta_t (v_t - h^\top k_t)$ at key $k_t$, and reads with $s\,q_t$.
# - The write is one SGD step on $\tfrac12\|h^\top k_t - v_t\|^2$; with unit keys and $\beta \le 1$ the
#   transition never amplifies, and $\beta = 1$ overwrites the value at a key exactly.
# - Sequences pack along $T$ with `cu_seqlens`; states chain across pieces exactly.
# - As written it is $T$ dependent steps of matrix-vector work: no tensor cores, little parallelism.

# %% [markdown]
# ## Exercises
#
# Each exercise gives a function with one plausible mistake, on the line marked `# TODO`. Run the
# check cell: it runs your function on four packed sequences (1, 37, 64 and 100 tokens) with four
# value heads (no decay, strong decay, two ordinary decays) and compares it with the float64
# recurrence, allowing twice the error of the same recurrence run in bf16 (the bound every kernel in
# this project must meet; chapter 3 explains it). It says **PASS**, or what is wrong and where.
# The solution is folded below each check.
#
# ### 1. One token
#
# Complete one token's update of one value head: decay, delta-rule error, rank-one write, read.
# The starting code computes the error $e_t$ from the prediction $h^\top k_t$ of the state it was
# given. Which state should predict $v_t$? (Look at the equations at the top of the chapter.)

# %% tags=["exercise"]
def gdn_step(h, q_t, k_t, v_t, g_t, beta_t, scale):
    """One token of one value head: state h [K, V] -> (o_t [V], the new state [K, V])."""
    e = beta_t * (v_t - h.T @ k_t)            # TODO: is this the state that should predict v_t?
    h = torch.exp(g_t) * h                    # decay
    h = h + torch.outer(k_t, e)               # rank-one write at key k_t
    o_t = h.T @ (scale * q_t)                 # read with the query
    return o_t, h


answer = gdn_step

# %% tags=["check"]
check_gdn_step(answer)

# %% tags=["solution", "hide-input"]
def gdn_step(h, q_t, k_t, v_t, g_t, beta_t, scale):
    """One token of one value head: state h [K, V] -> (o_t [V], the new state [K, V])."""
    h = torch.exp(g_t) * h                    # decay first
    e = beta_t * (v_t - h.T @ k_t)            # the error of the decayed state's prediction
    h = h + torch.outer(k_t, e)
    o_t = h.T @ (scale * q_t)
    return o_t, h


answer = gdn_step
result = check_gdn_step(answer)
assert result.passed, result
result

# %% [markdown]
# The check says where the mistake shows: only on the heads that decay. With $g = 0$ the two orders
# agree, which is why a test on undecayed inputs alone would never catch it.
#
# ### 2. Packed sequences
#
# `run_packed` walks all packed tokens in one loop, every value head at once, and must restart the
# state at each sequence start (`cu_seqlens`) from that sequence's own initial state. The starting
# code loads a state at every sequence start, but the wrong one.

# %% tags=["exercise"]
def run_packed(q, k, v, g, beta, initial_state, cu_seqlens):
    """Sequences packed along T (B = 1) -> (o [1, T, HV, V], final states [N, HV, K, V])."""
    hv, scale = v.shape[2], q.shape[3] ** -0.5
    q, k = reference.expand_heads(q, hv)[0], reference.expand_heads(k, hv)[0]   # [T, HV, K]
    starts, ends = cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()
    o, finals = torch.zeros_like(v[0]), []
    for t in range(v.shape[1]):
        if t in starts:                                   # sequence starts.index(t) begins here
            h = initial_state[0]                          # TODO: which sequence's state?
        h = torch.exp(g[0, t])[:, None, None] * h                                   # decay
        e = beta[0, t, :, None] * (v[0, t] - torch.einsum("hkv,hk->hv", h, k[t]))   # error
        h = h + k[t][:, :, None] * e[:, None, :]                                    # write
        o[t] = torch.einsum("hkv,hk->hv", h, scale * q[t])                          # read
        if t + 1 in ends:                                 # a sequence ends after token t
            finals.append(h)
    return o[None], torch.stack(finals)


answer = run_packed

# %% tags=["check"]
check_run_packed(answer)

# %% tags=["solution", "hide-input"]
def run_packed(q, k, v, g, beta, initial_state, cu_seqlens):
    """Sequences packed along T (B = 1) -> (o [1, T, HV, V], final states [N, HV, K, V])."""
    hv, scale = v.shape[2], q.shape[3] ** -0.5
    q, k = reference.expand_heads(q, hv)[0], reference.expand_heads(k, hv)[0]
    starts, ends = cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()
    o, finals = torch.zeros_like(v[0]), []
    for t in range(v.shape[1]):
        if t in starts:
            h = initial_state[starts.index(t)]            # each sequence from its own state
        h = torch.exp(g[0, t])[:, None, None] * h
        e = beta[0, t, :, None] * (v[0, t] - torch.einsum("hkv,hk->hv", h, k[t]))
        h = h + k[t][:, :, None] * e[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", h, scale * q[t])
        if t + 1 in ends:
            finals.append(h)
    return o[None], torch.stack(finals)


answer = run_packed
result = check_run_packed(answer)
assert result.passed, result
result
