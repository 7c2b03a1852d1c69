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
# # The chunked form and the WY representation
#
# The recurrence of chapter 1 is $T$ dependent rank-one steps per (sequence, value head). This
# chapter groups $C$ consecutive tokens into a *chunk* and solves for all of a chunk's delta-rule
# errors at once. Inside a chunk everything becomes products of $C \times C$, $C \times K$ and
# $K \times V$ matrices, which run on tensor cores and in parallel over all chunks; the only
# sequential part left is a chain of $T / C$ state updates.
#
# **What you will learn**
#
# - to unroll the recurrence over a chunk and solve for its errors with one triangular inverse,
#   $\mathcal{T} = (I + A)^{-1}$: the *UT transform* behind the compact WY representation of a
#   product of Householder-like factors;
# - the six sub-steps of `flashqla.reference` that the GPU kernels implement one by one
#   (`chunk_local_cumsum`, `chunk_kkt`, `kkt_solve`, `chunk_w_u`, `chunk_h`, `chunk_o`), each
#   checked against the token-by-token recurrence in float64;
# - how precise the chunked form is in float32 and bf16, and why every exponent must stay $\le 0$;
# - what it costs (FLOPs, bytes) and how much parallelism it exposes.
#
# **What you need first**
#
# Chapter 1 (the recurrence, its shapes and `cu_seqlens`), and triangular matrices: forward
# substitution, and why a unit lower-triangular matrix is always invertible. Everything runs on a
# CPU in seconds.

# %%
import inspect

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from flashqla import reference
from flashqla.exercises.ch02 import check_chunk_local_cumsum, check_ut_transform
from flashqla.testing import Problem, cast_floats, rel_l2

torch.manual_seed(0)
f64 = torch.float64

# %% [markdown]
# ## Unrolling one chunk
#
# Take one value head and one chunk of $C$ tokens, numbered $t = 1, \dots, C$ inside the chunk, and
# let $h_0$ be the state entering the chunk. Define the chunk-local cumulative log decay and the
# decay between two tokens,
#
# $$
# \gamma_t = \sum_{r=1}^{t} g_r \quad (\gamma_0 = 0), \qquad \Gamma_{ts} = e^{\gamma_t - \gamma_s} \ \ (s \le t).
# $$
#
# Since $h_t = e^{g_t} h_{t-1} + k_t e_t^\top$, induction on $t$ gives the state after token $t$:
#
# $$
# h_t = e^{\gamma_t} h_0 + \sum_{s \le t} \Gamma_{ts}\, k_s e_s^\top .
# $$
#
# **The errors.** Token $t$ predicts with the decayed state $e^{g_t} h_{t-1} = e^{\gamma_t} h_0 +
# \sum_{s<t} \Gamma_{ts} k_s e_s^\top$, so
#
# $$
# e_t = \beta_t \Big( v_t - e^{\gamma_t} h_0^\top k_t - \sum_{s < t} \Gamma_{ts} (k_t \cdot k_s)\, e_s \Big).
# $$
#
# Stack the chunk's vectors as rows: $Q, K \in \mathbb{R}^{C \times K}$, $V, E \in \mathbb{R}^{C \times V}$
# (row $t$ of $K h_0$ is $(h_0^\top k_t)^\top$). Moving the sum to the left,
#
# $$
# (I + A)\, E = \operatorname{diag}(\beta)\, V - \operatorname{diag}(\beta \odot e^{\gamma})\, K h_0,
# \qquad A = \operatorname{StrictLower}\!\big(\operatorname{diag}(\beta) K K^\top \odot \Gamma\big).
# $$
#
# $I + A$ is unit lower triangular, hence always invertible. With $\mathcal{T} = (I + A)^{-1}$ (the
# code and the notation page call it `Ai` and $A_i$),
#
# $$
# E = \underbrace{\mathcal{T} \operatorname{diag}(\beta) V}_{u} - \underbrace{\mathcal{T} \operatorname{diag}(\beta \odot e^{\gamma}) K}_{w}\, h_0 = u - w\, h_0 .
# $$
#
# $u$ and $w$ depend only on the chunk's own inputs, not on $h_0$: every chunk can compute them at the
# same time. The rows of $E$ are what the code calls `v_new` ($\tilde v$ on the notation page): the
# values corrected by what the state already predicts.
#
# **The next state.** Setting $t = C$ in the unrolled state:
#
# $$
# h_C = e^{\gamma_C} h_0 + K^\top \operatorname{diag}\!\big(e^{\gamma_C - \gamma}\big)\, E .
# $$
#
# **The outputs.** $o_t = s\, h_t^\top q_t$, and the sum now includes $s = t$:
#
# $$
# O = s \Big( \operatorname{diag}(e^{\gamma})\, Q h_0 + \big( (Q K^\top) \odot \Gamma \big)_{\text{lower incl. diagonal}}\, E \Big).
# $$
#
# Only the state update is sequential: chunk $c + 1$ needs $h_0$ from chunk $c$, through
# $E = u - w h_0$. Everything else is a batch of independent matrix products.

# %% [markdown]
# ## The chunk as one matrix: WY form and the UT transform
#
# Substituting $E = u - w h_0$ into the state update splits $h_C$ into a part linear in $h_0$ and a
# part that only depends on the chunk's inputs:
#
# $$
# h_C = M h_0 + K^\top \operatorname{diag}(e^{\gamma_C - \gamma})\, u, \qquad
# M = e^{\gamma_C} I - K^\top \operatorname{diag}(e^{\gamma_C - \gamma})\, w .
# $$
#
# From the recurrence, $M$ is also the product of the chunk's $C$ transition matrices, later tokens on
# the left (each acts on the key side of the state):
#
# $$
# M = P_C P_{C-1} \cdots P_1, \qquad P_t = e^{g_t} \big( I - \beta_t k_t k_t^\top \big).
# $$
#
# For $g = 0$ this reads
#
# $$
# \prod_{t = C}^{1} \big( I - \beta_t k_t k_t^\top \big) = I - K^\top W, \qquad W = \mathcal{T} \operatorname{diag}(\beta) K,
# \qquad \mathcal{T} = \big(I + \operatorname{StrictLower}(\operatorname{diag}(\beta) K K^\top)\big)^{-1} .
# $$
#
# A product of $C$ rank-one modifications of the identity is the identity minus one term of rank at
# most $C$:
# the *compact WY representation* known from blocked Householder QR (Schreiber and Van Loan). For
# $\beta_t = 2 / \|k_t\|^2$ each factor would be a Householder reflection; here $\beta_t \in (0, 1)$
# and $\|k_t\| = 1$, so each factor shrinks the component along $k_t$ instead of reflecting it. The
# triangular matrix $\mathcal{T}$ is the *UT transform* (Joffrain et al., "Accumulating Householder
# transformations, revisited"): using $(I + \operatorname{diag}(\beta) L)^{-1} \operatorname{diag}(\beta) =
# (\operatorname{diag}(\beta)^{-1} + L)^{-1}$, one has
# $\mathcal{T} \operatorname{diag}(\beta) = \big(\operatorname{diag}(1/\beta) + \operatorname{StrictLower}(K K^\top)\big)^{-1}$,
# the inverse of a triangular matrix read off the Gram matrix of the keys. The $(I + A)$ form is the
# one the kernels use: it needs no division by $\beta$ and carries the decays.
#
# Check both identities in float64 on one chunk of $C = 32$ random tokens, once with $g = 0$ and once
# with decay. $w$ comes from the library's sub-steps; the product of the $P_t$ is formed explicitly:

# %%
def transition_from_library(k1, beta1, g1):
    """M = exp(gamma_C) I - K^T diag(exp(gamma_C - gamma)) w for one chunk (one head, B = 1)."""
    n = k1.shape[0]
    kk, bb, gg = k1[None, :, None], beta1[None, :, None], g1[None, :, None]
    g_cum = reference.chunk_local_cumsum(gg, chunk_size=n)
    Ai = reference.kkt_solve(reference.chunk_kkt(kk, g_cum, bb, chunk_size=n), chunk_size=n)
    w, _ = reference.chunk_w_u(kk, torch.zeros(1, n, 1, 1, dtype=f64), bb, Ai, g_cum, chunk_size=n)
    gam = g_cum[0, :, 0]
    return torch.exp(gam[-1]) * torch.eye(k1.shape[1], dtype=f64) - k1.T @ (torch.exp(gam[-1] - gam)[:, None] * w[0, :, 0])


def transition_product(k1, beta1, g1):
    """Illustration: P_C ... P_1 with P_t = exp(g_t) (I - beta_t k_t k_t^T), multiplied out one by one."""
    M = torch.eye(k1.shape[1], dtype=f64)
    for t in range(k1.shape[0]):
        M = torch.exp(g1[t]) * (torch.eye(k1.shape[1], dtype=f64) - beta1[t] * torch.outer(k1[t], k1[t])) @ M
    return M


Cw, Kw = 32, 16
k1 = reference.l2norm(torch.randn(Cw, Kw, dtype=f64))
beta1 = torch.sigmoid(torch.randn(Cw, dtype=f64))
for label, g1 in (("g = 0", torch.zeros(Cw, dtype=f64)),
                  ("decay", F.logsigmoid(torch.randn(Cw, dtype=f64) + 2.0))):
    M_lib, M_prod = transition_from_library(k1, beta1, g1), transition_product(k1, beta1, g1)
    err = rel_l2(M_lib, M_prod)
    print(f"{label:6s}: rel L2(I - K^T W form, product of {Cw} factors) = {err:.1e}")
    assert err < 1e-12, err

# g = 0: the compact WY form written out with the triangular matrix T of the UT transform
I_c = torch.eye(Cw, dtype=f64)
T_ut = torch.linalg.inv(I_c + torch.tril(beta1[:, None] * (k1 @ k1.T), -1))
W = T_ut @ (beta1[:, None] * k1)
err = rel_l2(torch.eye(Kw, dtype=f64) - k1.T @ W, transition_product(k1, beta1, torch.zeros(Cw, dtype=f64)))
T_from_gram = torch.linalg.inv(torch.diag(1 / beta1) + torch.tril(k1 @ k1.T, -1))
err_ut = rel_l2(T_ut @ torch.diag(beta1), T_from_gram)
print(f"I - K^T T diag(beta) K vs product: {err:.1e};  T diag(beta) vs (diag(1/beta) + StrictLower(KK^T))^-1: {err_ut:.1e}")
assert err < 1e-12 and err_ut < 1e-12, (err, err_ut)

# %% [markdown]
# ## The sub-steps of `flashqla.reference`
#
# The library splits the chunked form into the six steps that separate kernels implement, with FLA's
# names and layouts:
#
# | step | computes | sequential? |
# |---|---|---|
# | `chunk_local_cumsum` | $\gamma$ per chunk | no |
# | `chunk_kkt` | $A$ | no |
# | `kkt_solve` | $\mathcal{T} = (I + A)^{-1}$ | no |
# | `chunk_w_u` | $w$, $u$ | no |
# | `chunk_h` | the state entering every chunk, $E$ (called `v_new`), final state | **yes**, over chunks |
# | `chunk_o` | $O$ | no |
#
# The example: one sequence of $T = 200$ tokens (three full chunks of 64 and a partial one of 8),
# two value heads sharing one key head, head 0 decaying and head 1 with $g = 0$, and a random initial
# state.

# %%
B, T, H, HV, K, V, C = 1, 200, 1, 2, 16, 16, 64
q = reference.l2norm(torch.randn(B, T, H, K, dtype=f64))
k = reference.l2norm(torch.randn(B, T, H, K, dtype=f64))
v = torch.randn(B, T, HV, V, dtype=f64)
g = F.logsigmoid(torch.randn(B, T, HV, dtype=f64) + 2.0)
g[..., 1] = 0.0
beta = torch.sigmoid(torch.randn(B, T, HV, dtype=f64))
h0 = torch.randn(1, HV, K, V, dtype=f64)
chunks = [(s, min(s + C, T)) for s in range(0, T, C)]
print("chunks:", chunks)

# %% [markdown]
# The ground truth comes from chapter 1's recurrence, run one token at a time with the state
# chained through `initial_state`, so that every intermediate state is available. The delta-rule
# errors $e_t$ then follow from their definition applied to those states:
# $e_t = \beta_t (v_t - (e^{g_t} h_{t-1})^\top k_t)$.

# %%
o_naive, _ = reference.naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
states = [h0[0]]
for t in range(T):
    _, h_t = reference.naive_recurrent_gated_delta_rule(
        q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
        initial_state=states[-1][None], output_final_state=True)
    states.append(h_t[0])
states = torch.stack(states)                       # [T + 1, HV, K, V]: states[t] = after t tokens
k_heads = reference.expand_heads(k, HV)[0]         # [T, HV, K]
decayed = torch.exp(g[0])[..., None, None] * states[:-1]
e_naive = beta[0][..., None] * (v[0] - torch.einsum("thkv,thk->thv", decayed, k_heads))  # [T, HV, V]

# %% [markdown]
# ### 1. `chunk_local_cumsum`: $\gamma$

# %%
print(inspect.getsource(reference.chunk_local_cumsum))

# %% [markdown]
# It pads each sequence to whole chunks (`Chunking`, which also handles `cu_seqlens`), takes the
# cumulative sum inside each chunk, and unpads. The sum restarts at every chunk start:

# %%
g_cum = reference.chunk_local_cumsum(g, chunk_size=C)
for s, e in chunks:
    err = (g_cum[0, s:e] - torch.cumsum(g[0, s:e], 0)).abs().max().item()
    assert err < 1e-13, err
print("g_cum at the first tokens of each chunk (head 0):", [round(g_cum[0, s, 0].item(), 3) for s, _ in chunks])
print("g at those tokens:                               ", [round(g[0, s, 0].item(), 3) for s, _ in chunks])

# %% [markdown]
# ### 2. `chunk_kkt`: $A = \operatorname{StrictLower}(\operatorname{diag}(\beta) K K^\top \odot \Gamma)$

# %%
print(inspect.getsource(reference.chunk_kkt))
print(inspect.getsource(reference._decay_matrix))

# %% [markdown]
# The layout is per token: `A[b, t, head]` holds row $t \bmod C$ of its chunk's $C \times C$ matrix,
# so chunk $c$'s matrix is `A[0, cC:(c+1)C, head, :]` (for the partial last chunk, the first $n$
# rows and columns). The check against the recurrence is the equation that defines $A$:
# $(I + A) E = \operatorname{diag}(\beta) V - \operatorname{diag}(\beta e^{\gamma}) K h_0$, with $E$ the
# naive errors and $h_0$ the naive state at the chunk start.

# %%
A = reference.chunk_kkt(k, g_cum, beta, chunk_size=C)
print("A:", tuple(A.shape))


def chunk_matrix(x, s, e, head):
    """One chunk's C x C matrix from the per-token layout [B, T, HV, C] (n x n for a partial chunk of n tokens)."""
    return x[0, s:e, head, :e - s]


worst = 0.0
for s, e in chunks:
    for head in range(HV):
        A_c, E_c = chunk_matrix(A, s, e, head), e_naive[s:e, head]
        b_c, gam = beta[0, s:e, head], g_cum[0, s:e, head]
        rhs = b_c[:, None] * v[0, s:e, head] - (b_c * torch.exp(gam))[:, None] * (k_heads[s:e, head] @ states[s, head])
        worst = max(worst, rel_l2(E_c + A_c @ E_c, rhs))
print(f"(I + A) E = diag(beta) V - diag(beta e^gamma) K h_0, worst rel L2 over chunks and heads: {worst:.1e}")
assert worst < 1e-12, worst

# %% [markdown]
# What these matrices look like for chunk 0: the decay matrix $\Gamma$ of the decaying head, $A$,
# and its inverse (next step). $A$ is strictly lower triangular; its entries shrink away from the
# diagonal as the decay between the two tokens grows.

# %%
Ai = reference.kkt_solve(A, chunk_size=C)
gam0 = g_cum[0, :C, 0]
Gamma0 = torch.exp(torch.tril(gam0[:, None] - gam0[None, :]))
Gamma0 = torch.where(torch.ones(C, C, dtype=torch.bool).tril(), Gamma0, torch.nan)
fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
for ax, (title, mat, cmap) in zip(axes, [
        (r"$\Gamma$ (head 0, chunk 0)", Gamma0, "viridis"),
        (r"$A$ (head 0, chunk 0)", A[0, :C, 0], "RdBu_r"),
        (r"$\mathcal{T} = (I + A)^{-1}$", Ai[0, :C, 0], "RdBu_r")]):
    lim = None if cmap == "viridis" else mat.abs().max().item()
    im = ax.imshow(mat, cmap=cmap, vmin=None if lim is None else -lim, vmax=lim)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, shrink=0.8)
fig.tight_layout()

# %% [markdown]
# ### 3. `kkt_solve`: $\mathcal{T} = (I + A)^{-1}$

# %%
print(inspect.getsource(reference.kkt_solve))

# %% [markdown]
# Because $I + A$ is unit lower triangular, its inverse follows row by row by forward substitution:
# row $i$ of $(I + A) X = I$ reads $X_i + \sum_{j < i} A_{ij} X_j = e_i^\top$. A few lines, as an
# illustration (the kernels do the same on $16 \times 16$ blocks and merge them):

# %%
def forward_substitution(A_c):
    """Illustration: X = (I + A_c)^-1 for strictly lower-triangular A_c, one row at a time."""
    n = A_c.shape[0]
    X = torch.eye(n, dtype=A_c.dtype)
    for i in range(n):
        X[i] = X[i] - A_c[i, :i] @ X[:i]       # X_i = e_i - sum_{j<i} A_ij X_j
    return X


worst_fs, worst_inv = 0.0, 0.0
for s, e in chunks:
    for head in range(HV):
        A_c, Ai_c = chunk_matrix(A, s, e, head), chunk_matrix(Ai, s, e, head)
        worst_fs = max(worst_fs, rel_l2(forward_substitution(A_c), Ai_c))
        eye = torch.eye(e - s, dtype=f64)
        worst_inv = max(worst_inv, ((eye + A_c) @ Ai_c - eye).abs().max().item())
print(f"forward substitution vs kkt_solve: {worst_fs:.1e};  max |(I + A) Ai - I| = {worst_inv:.1e}")
assert worst_fs < 1e-12 and worst_inv < 1e-12, (worst_fs, worst_inv)

# %% [markdown]
# ### 4. `chunk_w_u`: $w = \mathcal{T} \operatorname{diag}(\beta e^{\gamma}) K$, $u = \mathcal{T} \operatorname{diag}(\beta) V$

# %%
print(inspect.getsource(reference.chunk_w_u))

# %% [markdown]
# Check: $u - w h_0$ must equal the naive errors $E$ of each chunk, with $h_0$ the naive state at the
# chunk's start. ($w h_0$ is the part of the prediction that comes from the entering state, decayed to
# each token; $u$ is what the errors would be with $h_0 = 0$.)

# %%
w, u = reference.chunk_w_u(k, v, beta, Ai, g_cum, chunk_size=C)
worst = 0.0
for s, e in chunks:
    for head in range(HV):
        E_from_wu = u[0, s:e, head] - w[0, s:e, head] @ states[s, head]
        worst = max(worst, rel_l2(E_from_wu, e_naive[s:e, head]))
print(f"u - w h_0 vs naive errors, worst over chunks and heads: {worst:.1e}")
assert worst < 1e-12, worst

# %% [markdown]
# ### 5. `chunk_h`: the sequential chain over chunks

# %%
print(inspect.getsource(reference.chunk_h))

# %% [markdown]
# This is the only loop over time left, one iteration per chunk. A partial last chunk is padded with
# zeros, including its $\gamma$, so the decay to the chunk's end, $e^{\gamma_C}$, must be read at the
# chunk's last *real* token (`chunk_last`), not at position $C - 1$; a kernel must do the same. The
# checks: the state entering chunk $c$ equals the naive state after $cC$ tokens, `v_new` equals the
# naive errors, and the final state equals the naive final state.

# %%
h_chunks, v_new, h_final = reference.chunk_h(k, w, u, g_cum, initial_state=h0, output_final_state=True,
                                             chunk_size=C)
print("h:", tuple(h_chunks.shape), " v_new:", tuple(v_new.shape), " final:", tuple(h_final.shape))
err_h = rel_l2(h_chunks[0], states[[s for s, _ in chunks]])
err_e = rel_l2(v_new[0], e_naive)
err_f = rel_l2(h_final[0], states[T])
print(f"chunk states {err_h:.1e}, v_new {err_e:.1e}, final state {err_f:.1e}")
assert max(err_h, err_e, err_f) < 1e-12, (err_h, err_e, err_f)

# %% [markdown]
# ### 6. `chunk_o`: the outputs

# %%
print(inspect.getsource(reference.chunk_o))

# %%
o_chunk = reference.chunk_o(q, k, v_new, h_chunks, g_cum, chunk_size=C)
err = rel_l2(o_chunk, o_naive)
print(f"chunk_o vs naive output: {err:.1e}")
assert err < 1e-12, err

# %% [markdown]
# ### The composition
#
# `chunk_gated_delta_rule_ref` chains the six steps; it is what the public API runs today and the
# oracle every GPU stage is tested against.

# %%
print(inspect.getsource(reference.chunk_gated_delta_rule_ref))

# %% [markdown]
# In float64 it agrees with the recurrence to rounding, for a single sequence and for packed
# sequences (chunks restart at every sequence start, so with `cu_seqlens = [0, 70, 200]` the
# sequences have 2 and 3 chunks and `h` holds 5 chunk states).

# %%
o_ref, hT_ref = reference.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0,
                                                     output_final_state=True)
err_o, err_h = rel_l2(o_ref, o_naive), rel_l2(hT_ref[0], states[T])
print(f"single sequence: output {err_o:.1e}, final state {err_h:.1e}")
assert err_o < 1e-10 and err_h < 1e-10, (err_o, err_h)

cu = torch.tensor([0, 70, T], dtype=torch.int32)
h0_2 = torch.randn(2, HV, K, V, dtype=f64)
args = (q, k, v, g, beta)
o_n, hT_n = reference.naive_recurrent_gated_delta_rule(*args, initial_state=h0_2, output_final_state=True, cu_seqlens=cu)
o_c, hT_c = reference.chunk_gated_delta_rule_ref(*args, initial_state=h0_2, output_final_state=True, cu_seqlens=cu)
g_cum_cu = reference.chunk_local_cumsum(g, cu_seqlens=cu)
h_cu, _, _ = reference.chunk_h(k, *reference.chunk_w_u(k, v, beta, reference.kkt_solve(
    reference.chunk_kkt(k, g_cum_cu, beta, cu_seqlens=cu), cu_seqlens=cu), g_cum_cu, cu_seqlens=cu),
    g_cum_cu, initial_state=h0_2, cu_seqlens=cu)
print("varlen chunk states h:", tuple(h_cu.shape))
err_o, err_h = rel_l2(o_c, o_n), rel_l2(hT_c, hT_n)
print(f"packed [0, 70, 200]: output {err_o:.1e}, final states {err_h:.1e}")
assert h_cu.shape[1] == 5
assert err_o < 1e-10 and err_h < 1e-10, (err_o, err_h)

# %% [markdown]
# ## Precision: dtype and chunk size
#
# The reference functions compute in the dtype of their inputs, so casting every input to float32
# or bfloat16 gives "the same math" in that precision (the triangular solve always runs in at least
# float32, since PyTorch has no bfloat16 solver). The test tolerances of the kernels are derived from
# exactly this bf16 error (`flashqla.testing`).
#
# Inputs here come from `flashqla.testing.Problem`, the generator the tests use: bf16 $q, k, v$ with
# unit $q, k$; four value heads with $g = 0$, strong decay ($g \approx -2$ per token), and ordinary
# decay; a random initial state. Truth is the float64 chunked reference on the same (already
# bf16-rounded) inputs, which matches the recurrence to float64 rounding (checked above), so only
# the arithmetic differs. $K = V = 64$ keeps it fast.

# %%
names = ("q", "k", "v", "g", "beta", "initial_state")


def inputs_in(inp, dtype):
    x = cast_floats(inp, dtype)
    return {n: x[n] for n in names}


lengths = [128, 512, 2048]
problems = {T_: Problem(H=1, HV=4, lengths=(T_,), varlen=False, K=64, V=64).inputs(seed=1) for T_ in lengths}
truth = {T_: reference.chunk_gated_delta_rule_ref(**inputs_in(inp, f64), output_final_state=True)
         for T_, inp in problems.items()}
errs = {dt: [] for dt in (torch.float32, torch.bfloat16)}
for T_, inp in problems.items():
    for dt in errs:
        o_dt, _ = reference.chunk_gated_delta_rule_ref(**inputs_in(inp, dt), output_final_state=True)
        errs[dt].append(rel_l2(o_dt, truth[T_][0]))
for dt, e in errs.items():
    print(f"{str(dt):15s}", "  ".join(f"T={T_}: {x:.2e}" for T_, x in zip(lengths, e)))
assert max(errs[torch.float32]) < 1e-5, errs
assert max(errs[torch.bfloat16]) < 5e-2, errs

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.3))
ax = axes[0]
for dt, marker in ((torch.float32, "o-"), (torch.bfloat16, "s-")):
    ax.loglog(lengths, errs[dt], marker, label=str(dt).replace("torch.", ""))
for u_, name in ((2.0 ** -24, "float32 u"), (2.0 ** -9, "bfloat16 u")):
    ax.axhline(u_, color="gray", ls=":", lw=1)
    ax.text(lengths[0], u_ * 1.3, name, fontsize=8, color="gray")
ax.set_xticks(lengths, [str(n) for n in lengths])
ax.minorticks_off()
ax.set_xlabel("sequence length T")
ax.set_ylabel("rel L2 error of o vs float64")
ax.set_title("Chunked reference (C = 64) by dtype")
ax.legend()

chunk_sizes = [16, 32, 64, 128]
inp = problems[512]
err_c = {dt: [rel_l2(reference.chunk_gated_delta_rule_ref(**inputs_in(inp, dt), chunk_size=c)[0], truth[512][0])
              for c in chunk_sizes] for dt in (torch.float32, torch.bfloat16)}
ax = axes[1]
for dt, marker in ((torch.float32, "o-"), (torch.bfloat16, "s-")):
    ax.semilogy(chunk_sizes, err_c[dt], marker, label=str(dt).replace("torch.", ""))
ax.set_xscale("log", base=2)
ax.set_xticks(chunk_sizes, [str(c) for c in chunk_sizes])
ax.set_xlabel("chunk size C")
ax.set_title("Error vs chunk size (T = 512)")
ax.legend()
fig.tight_layout()
print("float32 by C:", [f"{x:.2e}" for x in err_c[torch.float32]])
print("bf16 by C:   ", [f"{x:.2e}" for x in err_c[torch.bfloat16]])
assert max(err_c[torch.float32]) < 1e-5, err_c

# %% [markdown]
# Float32 stays within a few units of its rounding error $u = 2^{-24}$ and grows only slowly with
# $T$: the chain over chunks does not amplify errors, for the same reason the recurrence does not
# (transition norms $\le 1$). bfloat16 sits at a few units of its $u = 2^{-9}$, equally flat. The error grows
# slightly with the chunk size: larger chunks mean longer sums in the intra-chunk products and a
# larger triangular solve. $C = 64$ is chosen for the hardware (tile shapes of the tensor-core
# instructions, shared memory), and costs little accuracy.

# %% [markdown]
# ## Strong decay: every exponent stays $\le 0$
#
# With $g \approx -2$ per token (one head in four of the test problems), $\gamma$ reaches about $-128$
# at the end of a 64-token chunk. In float32, $e^{-128} \approx 2.6 \times 10^{-56}$ is below the
# smallest subnormal ($\approx 1.4 \times 10^{-45}$) and rounds to 0, and $e^{x}$ overflows to
# infinity for $x > 88.7$. Two tempting shortcuts fail:
#
# - forming $e^{\gamma_i}$ and $e^{\gamma_j}$ separately and dividing gives $0 / 0 = \mathrm{NaN}$
#   once both underflow;
# - computing $e^{\gamma_i - \gamma_j}$ for *all* $i, j$ and masking the upper triangle afterwards
#   takes $e^{+126} = \infty$ above the diagonal, and $\infty \cdot 0 = \mathrm{NaN}$ in the mask.
#
# The library only ever exponentiates differences $\gamma_i - \gamma_j$ with $i \ge j$ (and
# $\gamma_t$, $\gamma_C - \gamma_t$), all $\le 0$: `_decay_matrix` (printed above) selects the
# exponent with `torch.where` *before* `exp`. An underflow to 0 is then the correct limit, never a
# NaN.

# %%
gam = torch.cumsum(torch.full((C,), -2.0), 0)                 # float32, gamma_C = -128
lower = torch.ones(C, C, dtype=torch.bool).tril()
zero = torch.zeros(C, C)
ratio_form = torch.where(lower, torch.exp(gam)[:, None] / torch.exp(gam)[None, :], zero)  # illustration: don't
mask_after = torch.exp(gam[:, None] - gam[None, :]) * lower                                # illustration: don't
Gamma_lib, _ = reference._decay_matrix(gam, 0)
Gamma_lib = torch.where(lower, Gamma_lib, zero)
Gamma_true = torch.exp((gam.double()[:, None] - gam.double()[None, :]).clamp(max=0)) * lower

for name, G in (("exp(g_i) / exp(g_j)", ratio_form), ("exp(g_i - g_j), masked after", mask_after),
                ("reference._decay_matrix", Gamma_lib)):
    print(f"{name:30s} NaN: {int(G.isnan().sum()):5d}   inf: {int(G.isinf().sum()):4d}   "
          f"rel L2 vs float64: {rel_l2(G, Gamma_true):.1e}")
assert ratio_form.isnan().any() and mask_after.isnan().any()
assert torch.isfinite(Gamma_lib).all() and rel_l2(Gamma_lib, Gamma_true) < 1e-6

# %% [markdown]
# The strong-decay heads of the precision experiment above went through exactly this path in
# float32 and bfloat16 without trouble. (Kernels use `exp2` with logs pre-scaled by $\log_2 e$; the
# rule is the same.)

# %% [markdown]
# ## Cost: FLOPs and bytes
#
# Napkin math for one value head with $K = V = 128$, $C = 64$. Per chunk, the chunked form does five
# products of size $C \times C \times (K \text{ or } V)$ (at $2$ FLOPs per multiply-add) and three of
# size $C \times K \times V$:
#
# | product | size | where |
# |---|---|---|
# | $K K^\top$ | $C \cdot C \cdot K$ | `chunk_kkt` |
# | $w = \mathcal{T} (\ldots K)$, $u = \mathcal{T} (\ldots V)$ | $C \cdot C \cdot K$, $C \cdot C \cdot V$ | `chunk_w_u` |
# | $Q K^\top$, $P \cdot$ `v_new` | $C \cdot C \cdot K$, $C \cdot C \cdot V$ | `chunk_o` |
# | $w h$, $K^\top$ `v_new` | $C \cdot K \cdot V$ each | `chunk_h` |
# | $Q h$ | $C \cdot K \cdot V$ | `chunk_o` |
#
# plus the triangular inversion (about $C^3 / 3$ FLOPs, small) and elementwise work. The recurrence
# does about $7 K V$ FLOPs per token (chapter 1), all of it matrix-vector work.

# %%
Kc = Vc = 128
Cc = 64
flops_chunk_matrix = 2 * Cc * Cc * (3 * Kc + 2 * Vc) + 3 * 2 * Cc * Kc * Vc
flops_chunk_solve = Cc ** 3 // 3
flops_tok_recurrent = 7 * Kc * Vc
print(f"chunked:   {flops_chunk_matrix / 1e6:.2f} MFLOP of matrix products per chunk and head "
      f"(+ {flops_chunk_solve / 1e3:.0f} kFLOP for the solve) = {flops_chunk_matrix / Cc / 1e3:.0f} kFLOP per token")
print(f"recurrent: {flops_tok_recurrent / 1e3:.0f} kFLOP per token, none of it in matrix-matrix products")
assert abs(flops_chunk_matrix / 1e6 - 11.5) < 0.1       # NOTES section 4: about 11.5 MFLOP per chunk and head

# %% [markdown]
# Bytes: a fused implementation reads $q, k$ (bf16, per query/key head), $v$ (bf16), $g, \beta$ (fp32)
# and writes $o$ (bf16) once; the recurrence with its state on chip needs the same. Run as six
# separate kernels, the chunked form also writes and reads back every intermediate: $\gamma$ and $A$
# (fp32), $\mathcal{T}$, $w$, $u$, `v_new` and the per-chunk states (bf16, FLA's choices). The
# recurrence with its state through HBM pays $8KV$ bytes per token. Totals for a whole layer with
# $(H, H_V) = (16, 64)$ and one sequence:

# %%
H_l, HV_l = 16, 64


def layer_costs(T_):
    """FLOPs and bytes for one (16, 64) layer over one sequence of T_ tokens (napkin model)."""
    nchunks = T_ / Cc
    act = 2 * T_ * (2 * Kc * H_l + Vc * HV_l) + 8 * T_ * HV_l + 2 * T_ * Vc * HV_l  # q, k, v, g, beta in; o out
    per_head_chunk = {                                                              # unfused extra traffic
        "g_cum, beta": 4 * Cc * (5 + 1),          # g_cum written once and read by 4 steps; beta read twice
        "A": 4 * Cc * Cc * 2,                     # fp32, written and read
        "Ai": 2 * Cc * Cc * 2,                    # bf16, written and read
        "w, u": 2 * Cc * (Kc + Vc) * 2,           # bf16, written and read
        "v_new": 2 * Cc * Vc * 2,
        "h": 2 * Kc * Vc * 2,                     # per-chunk state, bf16
        "k re-reads": 3 * 2 * Cc * Kc,            # k read by 4 steps instead of once
    }
    return dict(
        flops_recurrent=flops_tok_recurrent * T_ * HV_l,
        flops_chunked=(flops_chunk_matrix + flops_chunk_solve) * nchunks * HV_l,
        bytes_min=act,
        bytes_recurrent_hbm=act + 8 * Kc * Vc * T_ * HV_l,
        bytes_chunked_unfused=act + sum(per_head_chunk.values()) * nchunks * HV_l,
    )


c32k = layer_costs(32768)
print(f"T = 32768: chunked {c32k['flops_chunked'] / 1e9:.0f} GFLOP, minimum traffic {c32k['bytes_min'] / 1e9:.2f} GB "
      f"(NOTES section 4: about 380 GFLOP and 1.4 GB)")
assert abs(c32k["flops_chunked"] / 1e9 - 380) < 10 and abs(c32k["bytes_min"] / 1e9 - 1.4) < 0.1

# %%
Ts = [2 ** p for p in range(10, 18)]
costs = [layer_costs(T_) for T_ in Ts]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
ax = axes[0]
ax.loglog(Ts, [c["flops_recurrent"] for c in costs], "o-", label="recurrent (vector units)")
ax.loglog(Ts, [c["flops_chunked"] for c in costs], "s-", label="chunked (tensor cores)")
ax.set_xlabel("tokens T")
ax.set_ylabel("FLOPs")
ax.set_title("FLOPs, (H, HV) = (16, 64), K = V = 128")
ax.legend(fontsize=8)
ax = axes[1]
ax.loglog(Ts, [c["bytes_recurrent_hbm"] for c in costs], "o-", label="recurrent, state through HBM")
ax.loglog(Ts, [c["bytes_chunked_unfused"] for c in costs], "s-", label="chunked, 6 separate kernels")
ax.loglog(Ts, [c["bytes_min"] for c in costs], "k--", label="minimum (fused, or recurrent on chip)")
ax.set_xlabel("tokens T")
ax.set_ylabel("bytes")
ax.set_title("HBM traffic")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# Both forms are linear in $T$. The chunked form does about $1.6\times$ the FLOPs of the recurrence,
# but on tensor cores that run roughly ten times faster than the vector units; what it costs in
# memory traffic depends on fusion. As time lower bounds on an H100 (790 TFLOP/s bf16 GEMM measured,
# about 67 TFLOP/s FP32 vector on the datasheet, about 3.35 TB/s):

# %%
for name, flops, rate, nbytes in (
        ("recurrent, state on chip", c32k["flops_recurrent"], 67e12, c32k["bytes_min"]),
        ("chunked, 6 separate kernels", c32k["flops_chunked"], 790e12, c32k["bytes_chunked_unfused"]),
        ("chunked, fused", c32k["flops_chunked"], 790e12, c32k["bytes_min"])):
    print(f"{name:28s} compute >= {flops / rate * 1e3:5.2f} ms, memory >= {nbytes / 3.35e12 * 1e3:5.2f} ms, "
          f"intensity {flops / nbytes:5.0f} FLOP/byte")

# %% [markdown]
# These bounds ignore the real obstacle of the recurrent form, its dependency chain; that is next.
#
# ## Parallelism
#
# The recurrence offers $N \cdot H_V$ independent chains of $T$ steps each. The chunked form computes
# $\gamma$, $A$, $\mathcal{T}$, $w$, $u$ and the intra-chunk part of $O$ for all $N \cdot H_V \cdot T / C$
# (chunk, head) tiles at once; only `chunk_h` remains a chain, of $T / C$ steps, each a pair of
# $C \times K \times V$ matrix products. For $H_V = 32$ value heads and one sequence:

# %%
HV_p, sms = 32, 132
Ts_p = [2 ** p for p in range(10, 18)]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
ax = axes[0]
ax.loglog(Ts_p, Ts_p, "o-", label="recurrent: T steps")
ax.loglog(Ts_p, [T_ / C for T_ in Ts_p], "s-", label="chunked: T / C steps of chunk_h")
ax.set_xlabel("tokens T")
ax.set_ylabel("sequential steps")
ax.set_title("Sequential depth")
ax.legend(fontsize=8)
ax = axes[1]
ax.loglog(Ts_p, [HV_p] * len(Ts_p), "o-", label="recurrent: N HV chains")
ax.loglog(Ts_p, [HV_p * T_ / C for T_ in Ts_p], "s-", label="chunked: N HV T / C intra-chunk tiles")
ax.axhline(sms, color="gray", ls="--", lw=1)
ax.text(Ts_p[0], sms * 1.2, "132 SMs", fontsize=8, color="gray")
ax.set_xlabel("tokens T")
ax.set_ylabel("independent work items")
ax.set_title(f"Parallel work, N = 1, HV = {HV_p}")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# The chunked form cuts the sequential depth by $C = 64$ and gives the parallel steps thousands of
# independent tiles. The chain in `chunk_h` still has only $N \cdot H_V$ members: with few heads and one
# long sequence, fewer than the 132 SMs. Closing that gap (splitting a long sequence into segments
# processed in parallel, "context parallelism") is chapter 6.
#
# ## Summary
#
# - Unrolled over a chunk, the delta-rule errors satisfy $(I + A) E = \operatorname{diag}(\beta) V -
#   \operatorname{diag}(\beta e^{\gamma}) K h_0$ with $A = \operatorname{StrictLower}(\operatorname{diag}(\beta)
#   K K^\top \odot \Gamma)$, so $E = u - w h_0$ where $w$ and $u$ depend only on the chunk.
# - $\mathcal{T} = (I + A)^{-1}$ is the UT transform: the chunk's $C$ transitions multiply out to
#   $e^{\gamma_C} I - K^\top \operatorname{diag}(e^{\gamma_C - \gamma}) w$ (compact WY form).
# - The six sub-steps of `flashqla.reference` match the recurrence to float64 rounding, for single
#   and packed sequences; `chunk_local_cumsum` restarts at every chunk and every sequence start, and
#   `chunk_h` reads the decay to a partial chunk's end at its last real token.
# - Float32 and bf16 errors stay at a few units of their rounding, flat in $T$; every exponent is a
#   difference $\gamma_i - \gamma_j \le 0$, so strong decays underflow to the right limit, never NaN.
# - The chunked form does about $1.6\times$ the recurrence's FLOPs, on tensor cores; run as six
#   kernels it moves many times the minimum bytes, and only `chunk_h` remains a chain, of $T / C$
#   steps, with $N \cdot H_V$ members.
#
# What comes next: chapter 3 writes GPU kernels for these sub-steps, then fuses `chunk_h` and
# `chunk_o`; chapter 4 removes the gate from the solve ($(I + D L D^{-1})^{-1} = D (I + L)^{-1}
# D^{-1}$ with $D = \operatorname{diag}(e^{\gamma})$), so that $w$ and $u$ need never be formed.

# %% [markdown]
# ## Exercises
#
# Each exercise gives a function with one plausible mistake, on the line marked `# TODO`. The
# check cell hands it to `flashqla.testing.check_op`, the same check every GPU kernel of chapter 3
# passes: on four packed sequences (1, 100, 64 and 130 tokens) with four value heads (no decay,
# strong decay, two ordinary), it allows twice the error of the same reference math run in bf16.
# It says **PASS**, or what is wrong and what the mistake looks like. The solution is folded below.
#
# ### 1. The chunk-local cumsum of packed sequences
#
# $\gamma$ restarts at every chunk start, and chunks are counted from each *sequence's* first
# token: with `cu_seqlens = [0, 1, 101, ...]`, the second sequence's chunks start at tokens 1 and
# 65, not 64. The starting code cuts the packed tokens into chunks of 64 from token 0.

# %% tags=["exercise"]
def my_chunk_local_cumsum(g, cu_seqlens, chunk_size=64):
    """g [1, T, HV] -> g_cum [1, T, HV]: the cumsum of g restarting at every chunk start."""
    g_cum = torch.empty_like(g)
    for start in range(0, g.shape[1], chunk_size):     # TODO: where does each chunk start?
        g_cum[:, start:start + chunk_size] = g[:, start:start + chunk_size].cumsum(1)
    return g_cum


answer = my_chunk_local_cumsum

# %% tags=["check"]
check_chunk_local_cumsum(answer)

# %% tags=["solution", "hide-input"]
def my_chunk_local_cumsum(g, cu_seqlens, chunk_size=64):
    """g [1, T, HV] -> g_cum [1, T, HV]: the cumsum of g restarting at every chunk start."""
    g_cum = torch.empty_like(g)
    bounds = cu_seqlens.tolist()
    for bos, eos in zip(bounds[:-1], bounds[1:]):      # each sequence
        for start in range(bos, eos, chunk_size):      # its chunks, from its first token
            end = min(start + chunk_size, eos)
            g_cum[:, start:end] = g[:, start:end].cumsum(1)
    return g_cum


answer = my_chunk_local_cumsum
result = check_chunk_local_cumsum(answer)
assert result.passed, result
result

# %% [markdown]
# ### 2. The UT transform
#
# For one chunk of one value head, form $A = \operatorname{StrictLower}(\operatorname{diag}(\beta)
# K K^\top \odot \Gamma)$ and return $\mathcal{T} = (I + A)^{-1}$. The check builds $w$ and $u$
# from your $\mathcal{T}$ and compares them with `chunk_fwd_intra`. The starting code keeps one
# triangle too many of $A$.

# %% tags=["exercise"]
def ut_transform(k_c, beta_c, g_c):
    """One chunk, one value head: k_c [n, K], beta_c [n], g_c [n] (gamma) -> T = (I + A)^-1 [n, n]."""
    n = k_c.shape[0]
    Gamma = torch.exp(torch.tril(g_c[:, None] - g_c[None, :]))    # exponents <= 0 (1 above the diagonal)
    A = torch.tril(beta_c[:, None] * (k_c @ k_c.T) * Gamma)        # TODO: which entries does A keep?
    return torch.linalg.solve_triangular(torch.eye(n, dtype=A.dtype) + A, torch.eye(n, dtype=A.dtype),
                                         upper=False)


answer = ut_transform

# %% tags=["check"]
check_ut_transform(answer)

# %% tags=["solution", "hide-input"]
def ut_transform(k_c, beta_c, g_c):
    """One chunk, one value head: k_c [n, K], beta_c [n], g_c [n] (gamma) -> T = (I + A)^-1 [n, n]."""
    n = k_c.shape[0]
    Gamma = torch.exp(torch.tril(g_c[:, None] - g_c[None, :]))
    A = torch.tril(beta_c[:, None] * (k_c @ k_c.T) * Gamma, -1)    # strictly lower: j < i
    return torch.linalg.solve_triangular(torch.eye(n, dtype=A.dtype) + A, torch.eye(n, dtype=A.dtype),
                                         upper=False)


answer = ut_transform
result = check_ut_transform(answer)
assert result.passed, result
result
