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
# # The chunked backward
#
# Training needs the gradients of the loss with respect to $q, k, v, g, \beta$ and the initial
# state. Autograd could differentiate the chunked reference of chapter 2, but a kernel cannot call
# autograd: it needs the backward written out, as matrix products over the same chunks, in an order
# that keeps the only sequential part short. This chapter derives it by hand, one sub-step at a
# time, in the order a backward kernel runs them (FLA's decomposition and names):
#
# | sub-step | computes | sequential? |
# |---|---|---|
# | `chunk_bwd_dv_local` | the intra-chunk part of the gradient of `v_new` | no |
# | `chunk_bwd_dhu` | the gradient of the state, walking the chunks backwards; the full gradient of `v_new` | yes |
# | `chunk_bwd_dqkwg` | $dq$, $dk$, $dw$ and the gradient of $\gamma$ from the output and the state update | no |
# | `wy_bwd` | back through $w$, $u$ and the triangular inverse to $k$, $v$, $\beta$, $\gamma$ | no |
# | `chunk_local_reverse_cumsum` | from the gradient of $\gamma$ to that of $g$ | no |
#
# **What you will learn**
#
# - the five sub-steps of the chunked backward, each derived with three rules of reverse mode and
#   checked against `torch.autograd` in float64;
# - the reverse state recurrence: the transpose of the forward's chain, and how the gradient decays
#   backwards as the state decays forwards;
# - the gradient of the log decay without differentiating an exponential, and the GVA sums;
# - what the backward costs against the forward, and what to save for it or recompute;
# - the milestone stages `gdn_bwd.s01` (the steps as separate TileLang kernels) and `gdn_bwd.s02`
#   (both sequential walks in one launch), measured against FLA and FlashQLA, and what the library
#   runs.
#
# **What you need first**
#
# - chapter 2: the chunked form and its sub-steps (`chunk_kkt`, `kkt_solve`, `chunk_w_u`,
#   `chunk_h`, `chunk_o`) and their notation ($\gamma$, $\Gamma$, $\mathcal{T}$, $w$, $u$, $\tilde V$);
# - reverse-mode differentiation of matrix products;
# - chapter 3, for what a stage and its measurement are. No GPU: everything below runs on the CPU
#   or reads committed measurements.

# %%
import ast
import inspect
import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch.utils.flop_counter import FlopCounterMode

from IPython.display import Markdown, display

from flashqla import bench, bwd, reference, stages
from flashqla.exercises.ch07 import check_dg_from_dgamma, check_dhu_step
from flashqla.testing import Problem, cast_floats, rel_l2

f64 = torch.float64


def weights_like(x, seed):
    """Fixed random upstream gradients (a loss linear in the outputs)."""
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def autograd(fn, inputs: dict, wrt, weights):
    """torch.autograd's gradients of sum_i <weights_i, fn(**inputs)_i> w.r.t. the inputs named in wrt."""
    leaves = {n: inputs[n].clone().requires_grad_() for n in wrt}
    outs = fn(**{**inputs, **leaves})
    loss = sum((o * w).sum() for o, w in zip(outs, weights) if w is not None)
    return dict(zip(wrt, torch.autograd.grad(loss, list(leaves.values()))))


# %% [markdown]
# ## What the backward computes
#
# Autograd hands the backward $dO = \partial L / \partial o$ and $dS_T = \partial L / \partial h_T$
# (the gradient of the final state; zero when the final state is not used). Since only these enter,
# the backward is the gradient of the linear loss $\langle dO, o \rangle + \langle dS_T, h_T \rangle$.
# Throughout, $dX$ is $\partial L / \partial X$, of the shape of $X$.
#
# Per chunk and value head, with $S$ the state entering the chunk and $S'$ the state leaving it,
# the forward of chapter 2 is ($\tilde V$ is `v_new`, $s$ the scale, $\gamma$ the chunk-local
# cumulative log decay, $\Gamma_{ij} = e^{\gamma_i - \gamma_j}$):
#
# $$
# \tilde V = U - W S, \qquad
# S' = e^{\gamma_C} S + K^\top \operatorname{diag}(e^{\gamma_C - \gamma})\, \tilde V, \qquad
# O = s \big(\operatorname{diag}(e^{\gamma}) Q S + P \tilde V\big), \quad P = (Q K^\top \odot \Gamma)_{\text{lower incl. diag}},
# $$
#
# with $W = \mathcal{T} \operatorname{diag}(\beta e^{\gamma}) K$, $U = \mathcal{T} \operatorname{diag}(\beta) V$,
# $\mathcal{T} = (I + A)^{-1}$, $A = \operatorname{StrictLower}(\operatorname{diag}(\beta) K K^\top \odot \Gamma)$.
# Three rules of reverse mode are all we need: for $Y = XZ$, $dX = dY Z^\top$ and $dZ = X^\top dY$;
# for $Y = X \odot Z$, $dX = dY \odot Z$; and for $Y = X^{-1}$, $dX = -Y^\top dY\, Y^\top$.
#
# The running example: three sequences (100, 1 and 70 tokens), GVA with $(H, H_V) = (2, 4)$, an
# initial state, a used final state, and the heads with $g = 0$ and strong decay that every
# `Problem` has. The target: autograd through the token-by-token recurrence.

# %%
x = cast_floats(Problem(2, 4, (100, 1, 70), K=16, V=16).inputs(), f64)
q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
o_naive, ht_naive = reference.naive_recurrent_gated_delta_rule(**x)
do, dht = weights_like(o_naive, 1), weights_like(ht_naive, 2)
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")
want = autograd(reference.naive_recurrent_gated_delta_rule, x, LEAVES, (do, dht))
print({n: tuple(t.shape) for n, t in want.items()})

# the forward intermediates, recomputed with the forward sub-steps of chapter 2
g_cum = reference.chunk_local_cumsum(g, cu)
Ai = reference.kkt_solve(reference.chunk_kkt(k, g_cum, beta, cu), cu)
w, u = reference.chunk_w_u(k, v, beta, Ai, g_cum, cu)
h, v_new, ht = reference.chunk_h(k, w, u, g_cum, h0, True, cu)
assert rel_l2(ht, ht_naive) < 1e-12

# %% [markdown]
# ## Step 1: the intra-chunk gradient of `v_new`
#
# $\tilde V$ enters the output through $s P \tilde V$, so that term contributes
#
# $$
# d\tilde V_{\text{loc}} = s\, P^\top dO = s\, \big(K Q^\top \odot \Gamma^\top\big)_{\text{upper incl. diag}}\, dO :
# $$
#
# token $j$ collects the output gradients of the tokens $i \ge j$ of its chunk that read it, each
# weighted by the decay $e^{\gamma_i - \gamma_j}$ between them. It needs nothing from other chunks,
# so it runs for all chunks at once.

# %%
print(inspect.getsource(reference.chunk_bwd_dv_local))

# %%
dv_local = reference.chunk_bwd_dv_local(q, k, do, g_cum, cu_seqlens=cu)
check = autograd(lambda v_new: (reference.chunk_o(q, k, v_new, h, g_cum, cu_seqlens=cu),),
                 {"v_new": v_new}, ["v_new"], (do,))
err = rel_l2(dv_local, check["v_new"])
print(f"dv_local against autograd of chunk_o (states held fixed): {err:.1e}")
assert err < 1e-12, err

# %% [markdown]
# ## Step 2: the reverse state recurrence
#
# The state $S$ entering chunk $c$ is used three times: in the output ($s \operatorname{diag}(e^\gamma) Q S$),
# in the prediction ($\tilde V = U - W S$) and, decayed, in the next state ($e^{\gamma_C} S$). And
# $\tilde V$ is used twice: in the output and in the next state. Collecting,
#
# $$
# d\tilde V = d\tilde V_{\text{loc}} + \operatorname{diag}(e^{\gamma_C - \gamma})\, K\, dS', \qquad
# dS = e^{\gamma_C}\, dS' + s\, Q^\top \operatorname{diag}(e^{\gamma})\, dO - W^\top d\tilde V .
# $$
#
# $dS$ needs $dS'$, the gradient of the state leaving the chunk, i.e. entering the next one: the
# recurrence runs from the last chunk of every sequence back to its first, starting from
# $dS_T$. It is the transpose of the forward's chain: the same $T / C$ dependent steps, each two
# $C \times K \times V$ products plus one more for $Q^\top dO$. What it returns:
#
# - `dh[c]` $= dS'$ of chunk $c$, in the layout of the forward's `h` ($[B', N_T, H_V, K, V]$). As in FLA
#   it is the gradient of the state *leaving* chunk $c$, which is what chunk $c$'s keys and decays feed;
#   the last chunk of a sequence holds $dS_T$.
# - `dh0` $= dS$ of each sequence's first chunk: the gradient of the initial state.
# - `dv2` $= d\tilde V$, the full gradient of `v_new`. Since $\tilde V = U - WS$, it is also $dU$,
#   and $dW = -d\tilde V S^\top$.

# %%
print(inspect.getsource(reference.chunk_bwd_dhu))

# %% [markdown]
# Check against autograd of the forward's `chunk_h` and `chunk_o` composed, with $w$, $u$, $\gamma$
# and $h_0$ as leaves: `dv2` must be the gradient of $u$, and `dh0` that of the initial state.

# %%
def h_and_o(q, k, w, u, g_cum, initial_state):
    hs, vn, final = reference.chunk_h(k, w, u, g_cum, initial_state, True, cu)
    return reference.chunk_o(q, k, vn, hs, g_cum, cu_seqlens=cu), final


inner = dict(q=q, k=k, w=w, u=u, g_cum=g_cum, initial_state=h0)
want_inner = autograd(h_and_o, inner, list(inner), (do, dht))
dh, dh0, dv2 = reference.chunk_bwd_dhu(q, k, w, g_cum, h0, dht, do, dv_local, cu_seqlens=cu)
errs = {"dv2 vs du": rel_l2(dv2, want_inner["u"]), "dh0": rel_l2(dh0, want_inner["initial_state"]),
        "dh0 vs naive": rel_l2(dh0, want["initial_state"])}
print({n: f"{e:.1e}" for n, e in errs.items()}, "dh:", tuple(dh.shape))
assert max(errs.values()) < 1e-12, errs

# %% [markdown]
# `dh[c]` itself has a definition that needs no chunks: the gradient of the loss with respect to the
# state after the first $64 (c + 1)$ tokens, obtained by running the recurrence on the remaining
# tokens from that state and differentiating with respect to it. On one sequence of 200 tokens:

# %%
x1 = cast_floats(Problem(1, 2, (200,), varlen=False, K=16, V=16).inputs(), f64)
o1, ht1 = reference.naive_recurrent_gated_delta_rule(**x1)
do1, dht1 = weights_like(o1, 3), weights_like(ht1, 4)
gc1 = reference.chunk_local_cumsum(x1["g"])
w1, u1 = reference.chunk_fwd_intra(x1["k"], x1["v"], gc1, x1["beta"])
dh1, _, _ = reference.chunk_bwd_dhu(x1["q"], x1["k"], w1, gc1, None, dht1, do1,
                                    reference.chunk_bwd_dv_local(x1["q"], x1["k"], do1, gc1))
SEQ = ("q", "k", "v", "g", "beta")
for c in range(dh1.shape[1]):
    t0 = min(64 * (c + 1), 200)
    state = reference.naive_recurrent_gated_delta_rule(**{**x1, **{n: x1[n][:, :t0] for n in SEQ}})[1]
    rest = {**x1, **{n: x1[n][:, t0:] for n in SEQ}, "initial_state": state}
    d_state = autograd(reference.naive_recurrent_gated_delta_rule, rest, ["initial_state"],
                       (do1[:, t0:], dht1))["initial_state"]
    err = rel_l2(dh1[:, c], d_state)
    print(f"dh[{c}] = dL/d(state after {t0:3d} tokens): {err:.1e}")
    assert err < 1e-12, (c, err)

# %% [markdown]
# The gradient flows backwards through the same decays that make the forward forget. Below, a
# gradient on the final state only ($dO = 0$), $K = 128$, walked back through 2048 tokens: in a head
# with strong decay ($g \approx -2$ per token) it is gone within a chunk, with ordinary decay it
# shrinks by about $e^{-10}$ per chunk, and with $g = 0$ it is carried across the whole sequence,
# shrinking only through the delta rule's own contractions $I - \beta_t k_t k_t^\top$. This matters
# for context parallelism in the backward as in the forward: a segment's $dS'$ can be warmed up from a
# few later chunks only where the decay has cut the dependence.

# %%
x_long = cast_floats(Problem(1, 4, (2048,), varlen=False, K=128, V=16, initial_state=False).inputs(), f64)
gcl = reference.chunk_local_cumsum(x_long["g"])
wl, _ = reference.chunk_fwd_intra(x_long["k"], x_long["v"], gcl, x_long["beta"])
do_l = torch.zeros_like(x_long["v"])
dht_l = weights_like(torch.empty(1, 4, 128, 16), 5)    # a gradient on the final state only
dhl, _, _ = reference.chunk_bwd_dhu(x_long["q"], x_long["k"], wl, gcl, None, dht_l, do_l, do_l)
fig, ax = plt.subplots(figsize=(7, 3.3))
for head, label in enumerate(["g = 0", "strong decay (g ~ -2)", "ordinary decay (g ~ -0.15)"]):
    norms = dhl[0, :, head].flatten(1).norm(dim=1)
    ax.semilogy(range(len(norms)), norms, "o-", ms=3, label=f"head {head}: {label}")
ax.set_ylim(1e-30, 1e3)
ax.set_xlabel("chunk c")
ax.set_ylabel("||dh[c]||")
ax.set_title("The gradient of the final state, walked back through 32 chunks")
ax.legend(fontsize=8)
fig.tight_layout()
assert dhl[0, 0, 0].norm() > 1e-4 * dhl[0, -1, 0].norm()          # g = 0: carried to the start
assert dhl[0, -2, 1].norm() < 1e-20 * dhl[0, -1, 1].norm()        # strong decay: gone after a chunk

# %% [markdown]
# ## Step 3: dq, dk, dw and the gradient of $\gamma$, chunk by chunk
#
# With $S$ (from the forward) and $dS'$ (from step 2) stored per chunk, the rest is local. The
# output's score matrix $P$ has the gradient $dP = s\,(dO\, \tilde V^\top \odot \Gamma)_{\text{lower incl. diag}}$,
# and
#
# $$
# dQ = s \operatorname{diag}(e^{\gamma})\, dO\, S^\top + dP\, K, \qquad
# dK = dP^\top Q + \operatorname{diag}(e^{\gamma_C - \gamma})\, \tilde V\, dS'^\top, \qquad
# dW = -d\tilde V\, S^\top .
# $$
#
# **The gradient of $\gamma$ without differentiating an exponential.** Inside a chunk, $\gamma_i$
# appears only as a factor $e^{\gamma_i}$ on row $i$ of $Q$ (in $e^{\gamma_i} q_i$ and in
# $\Gamma_{ij} q_i \cdot k_j$) and as $e^{-\gamma_i}$ on row $i$ of $K$ (in $\Gamma_{ji}$ and in
# $e^{\gamma_C - \gamma_i} k_i$). Scaling a row by $e^{\gamma_i}$ and differentiating with respect
# to $\gamma_i$ is the same as differentiating with respect to the row and taking the dot product
# with it, so
#
# $$
# d\gamma_i = q_i \cdot dq_i - k_i \cdot dk_i ,
# $$
#
# plus the terms of $\gamma_C$, the chunk's last cumulative decay, which multiplies all of $S$ and
# every row of the state update: $d\gamma_C \mathrel{+}= e^{\gamma_C} \langle S, dS' \rangle +
# \sum_i k_i \cdot \big(e^{\gamma_C - \gamma_i}\, (\tilde V dS'^\top)_i\big)$. In a sequence's last,
# partial chunk, $\gamma_C$ is the last real token's value (the padding carries it), so those terms land
# on that token. No division by $e^{\gamma}$ and no positive exponent appears anywhere.
#
# $dq$ and $dk$ come back with $H$ heads; the GVA sum is explained below.

# %%
print(inspect.getsource(reference.chunk_bwd_dqkwg))

# %%
dq, dk, dw, dg_cum = reference.chunk_bwd_dqkwg(q, k, v_new, g_cum, h, dv2, do, dh, cu_seqlens=cu)
errs = {"dq": rel_l2(dq, want_inner["q"]), "dk": rel_l2(dk, want_inner["k"]),
        "dw": rel_l2(dw, want_inner["w"]), "dg_cum": rel_l2(dg_cum, want_inner["g_cum"]),
        "dq vs naive": rel_l2(dq, want["q"])}
print({n: f"{e:.1e}" for n, e in errs.items()})
assert max(errs.values()) < 1e-12, errs

# %% [markdown]
# $dq$ is final already ($q$ is used nowhere else). $dk$ and $d\gamma$ are partial: $k$ and $\gamma$
# also built $w$, $u$ and $\mathcal{T}$.
#
# ## Step 4: back through the WY representation
#
# Given $dW$ (from step 3) and $dU = d\tilde V$ (from step 2), write $\hat K = \operatorname{diag}(\beta e^{\gamma}) K$
# and $\hat V = \operatorname{diag}(\beta) V$, so that $W = \mathcal{T} \hat K$ and $U = \mathcal{T} \hat V$:
#
# $$
# d\mathcal{T} = dW \hat K^\top + dU \hat V^\top, \qquad d\hat K = \mathcal{T}^\top dW, \qquad d\hat V = \mathcal{T}^\top dU .
# $$
#
# From $\hat K$ and $\hat V$: $dK \mathrel{+}= \operatorname{diag}(\beta e^\gamma)\, d\hat K$, $dV = \operatorname{diag}(\beta)\, d\hat V$,
# $d\beta_i \mathrel{+}= e^{\gamma_i}\, k_i \cdot d\hat k_i + v_i \cdot d\hat v_i$ and $d\gamma_i \mathrel{+}= \beta_i e^{\gamma_i}\, k_i \cdot d\hat k_i$.
#
# Through the inverse, $\mathcal{T} = (I + A)^{-1}$ gives $dA = -\mathcal{T}^\top d\mathcal{T}\, \mathcal{T}^\top$, of which only the
# strictly lower part (where $A$ lives) counts. With $A_{ij} = \beta_i\, (k_i \cdot k_j)\, e^{\gamma_i - \gamma_j}$:
#
# $$
# d\beta_i \mathrel{+}= \sum_j dA_{ij} (K K^\top \odot \Gamma)_{ij}, \qquad
# d\gamma_i \mathrel{+}= \sum_j dA_{ij} A_{ij} - \sum_j dA_{ji} A_{ji}, \qquad
# dK \mathrel{+}= (G + G^\top) K, \ \ G = \operatorname{diag}(\beta)\, dA \odot \Gamma .
# $$
#
# Two more $C \times C \times C$ products than the forward's solve, all chunk-local.

# %%
print(inspect.getsource(reference.wy_bwd))

# %%
dk_wy, dv, dbeta, dg_cum_wy = reference.wy_bwd(k, v, beta, Ai, g_cum, dw, dv2, cu)


def wy_forward(k, v, beta, g_cum):
    Ai_ = reference.kkt_solve(reference.chunk_kkt(k, g_cum, beta, cu), cu)
    return reference.chunk_w_u(k, v, beta, Ai_, g_cum, cu)


want_wy = autograd(wy_forward, dict(k=k, v=v, beta=beta, g_cum=g_cum), ["k", "v", "beta", "g_cum"],
                   (dw, dv2))
errs = {"dk": rel_l2(dk_wy, want_wy["k"]), "dv": rel_l2(dv, want_wy["v"]),
        "dbeta": rel_l2(dbeta, want_wy["beta"]), "dg_cum": rel_l2(dg_cum_wy, want_wy["g_cum"]),
        "dv vs naive": rel_l2(dv, want["v"]), "dbeta vs naive": rel_l2(dbeta, want["beta"]),
        "dk + dk_wy vs naive": rel_l2(dk + dk_wy, want["k"])}
print({n: f"{e:.1e}" for n, e in errs.items()})
assert max(errs.values()) < 1e-12, errs

# %% [markdown]
# ## Step 5: from $\gamma$ back to $g$
#
# $\gamma_t = \sum_{s \le t} g_s$ within a chunk, so $g_t$ feeds every $\gamma_s$ with $s \ge t$ of its
# chunk: $dg_t = \sum_{s \ge t} d\gamma_s$, a cumulative sum from the chunk's end (the adjoint of
# `chunk_local_cumsum`). Both $d\gamma$ contributions, from step 3 and step 4, are added first.

# %%
print(inspect.getsource(reference.chunk_local_reverse_cumsum))

# %%
dg = reference.chunk_local_reverse_cumsum(dg_cum + dg_cum_wy, cu)
err = rel_l2(dg, want["g"])
print(f"dg vs naive: {err:.1e}")
assert err < 1e-12, err

# %% [markdown]
# ## The GVA reductions
#
# With $H_V > H$, key head $j$ is copied to the $H_V / H$ value heads $jH_V/H, \dots, (j+1)H_V/H - 1$
# (`expand_heads`). The adjoint of a copy is a sum: the gradient of a key (or query) head is the sum of
# the gradients its value heads computed. Every sub-step computes per value head, then sums once
# (`_sum_groups`); a kernel does the same with one reduction per group (or atomics). The adjoint
# identity $\langle \operatorname{expand}(a), b \rangle = \langle a, \operatorname{sum\_groups}(b) \rangle$,
# and what a missing sum would cost:

# %%
print(inspect.getsource(reference._sum_groups))
a_, b_ = weights_like(q, 6), weights_like(v, 7)      # [B, T, H, K] and [B, T, HV, K = V]
lhs = (reference.expand_heads(a_, 4) * b_).sum()
rhs = (a_ * reference._sum_groups(b_, 2)).sum()
assert abs(lhs - rhs) < 1e-10 * abs(lhs), (lhs, rhs)
first_only = lambda y: y[:, :, ::2]                  # a broken "reduction": the group's first head
per_value_head = reference.chunk_bwd_dqkwg(reference.expand_heads(q, 4), reference.expand_heads(k, 4),
                                           v_new, g_cum, h, dv2, do, dh, cu_seqlens=cu)[0]
print(f"dq as the sum over each group:  {rel_l2(reference._sum_groups(per_value_head, 2), want['q']):.1e}")
print(f"dq from each group's first head: {rel_l2(first_only(per_value_head), want['q']):.2f}")
assert rel_l2(reference._sum_groups(per_value_head, 2), want["q"]) < 1e-12
assert rel_l2(first_only(per_value_head), want["q"]) > 0.1

# %% [markdown]
# ## All together
#
# `chunk_gated_delta_rule_bwd_ref` recomputes the forward's intermediates from the inputs with the
# forward sub-steps and runs the five steps. It is the oracle every backward kernel stage is checked
# against (`flashqla.stages.OPS["gdn_bwd"]` and one op per sub-step), and what the library's autograd
# function runs in float32 after the kernels' forward.

# %%
print(inspect.getsource(reference.chunk_gated_delta_rule_bwd_ref))

# %%
got = dict(zip(LEAVES, reference.chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht,
                                                                 initial_state=h0, cu_seqlens=cu)))
errs = {n: rel_l2(got[n], want[n]) for n in LEAVES}
print({n: f"{e:.1e}" for n, e in errs.items()})
assert max(errs.values()) < 1e-12, errs

# %% [markdown]
# **Precision.** The same functions in float32 and bfloat16 on the same inputs, against float64. The
# bf16 column is the "same math in bf16" that the stage tests derive their tolerance from
# (`flashqla.testing.check_op`): twice that error is what a backward kernel may not exceed.

# %%
args = (q, k, v, g, beta, do, dht)
print(f"{'':8s}" + " ".join(f"{n:>14s}" for n in LEAVES))
precision = {}
for dtype in (torch.float32, torch.bfloat16):
    low = reference.chunk_gated_delta_rule_bwd_ref(*(t.to(dtype) for t in args),
                                                   initial_state=h0.to(dtype), cu_seqlens=cu)
    precision[dtype] = [rel_l2(a, got[n]) for a, n in zip(low, LEAVES)]
    print(f"{str(dtype).split('.')[1]:9s}" + " ".join(f"{e:14.1e}" for e in precision[dtype]))
assert max(precision[torch.float32]) < 1e-5 and max(precision[torch.bfloat16]) < 0.1

# %% [markdown]
# ## Cost: FLOPs and bytes of each step
#
# Per (chunk, value head) with $K = V = 128$ and $C = 64$, counting $2$ FLOPs per multiply-add of
# the matrix products. The formulas below are read off the derivations above; `FlopCounterMode`
# counts the matrix products the reference functions actually run on one chunk of one head, and
# the two must agree.

# %%
K = V = 128
C = 64
KERNEL_FLOPS = {   # name: matrix-product FLOPs per (chunk, value head)
    # forward (chapter 2)
    "chunk_kkt": 2 * C * C * K,                                    # K K^T
    "chunk_w_u": 2 * C * C * (K + V),                              # T (..K), T (..V)
    "chunk_h": 2 * 2 * C * K * V,                                  # W S, K^T V~
    "chunk_o": 2 * C * C * (K + V) + 2 * C * K * V,                # Q K^T, P V~, Q S
    # backward
    "chunk_bwd_dv_local": 2 * C * C * (K + V),                     # K Q^T, P^T dO
    "chunk_bwd_dhu": 3 * 2 * C * K * V,                            # K dS', Q^T dO, W^T dV~
    "chunk_bwd_dqkwg": 2 * C * C * (V + 2 * K) + 3 * 2 * C * K * V,   # dO V~^T, dP K, dP^T Q; dO S^T, V~ dS'^T, dV~ S^T
    "wy_bwd": 2 * 2 * C * C * (K + V) + 2 * 2 * C ** 3 + 2 * 2 * C * C * K,  # dT, T^T dW, T^T dU; T^T dT T^T; K K^T, (G + G^T) K
}

one = cast_floats(Problem(1, 1, (C,), varlen=False, K=K, V=V).inputs(), f64)
h1_ = one["initial_state"]
g1 = reference.chunk_local_cumsum(one["g"])
A1 = reference.chunk_kkt(one["k"], g1, one["beta"])
Ai1 = reference.kkt_solve(A1)
w1_, u1_ = reference.chunk_w_u(one["k"], one["v"], one["beta"], Ai1, g1)
hs1, vn1, _ = reference.chunk_h(one["k"], w1_, u1_, g1, h1_)
do1_ = weights_like(vn1, 8)
dvl1 = reference.chunk_bwd_dv_local(one["q"], one["k"], do1_, g1)
dh1_, _, dv21 = reference.chunk_bwd_dhu(one["q"], one["k"], w1_, g1, h1_, None, do1_, dvl1)
dw1 = reference.chunk_bwd_dqkwg(one["q"], one["k"], vn1, g1, hs1, dv21, do1_, dh1_)[2]
CALLS = {
    "chunk_kkt": lambda: reference.chunk_kkt(one["k"], g1, one["beta"]),
    "chunk_w_u": lambda: reference.chunk_w_u(one["k"], one["v"], one["beta"], Ai1, g1),
    "chunk_h": lambda: reference.chunk_h(one["k"], w1_, u1_, g1, h1_),
    "chunk_o": lambda: reference.chunk_o(one["q"], one["k"], vn1, hs1, g1),
    "chunk_bwd_dv_local": lambda: reference.chunk_bwd_dv_local(one["q"], one["k"], do1_, g1),
    "chunk_bwd_dhu": lambda: reference.chunk_bwd_dhu(one["q"], one["k"], w1_, g1, h1_, None, do1_, dvl1),
    "chunk_bwd_dqkwg": lambda: reference.chunk_bwd_dqkwg(one["q"], one["k"], vn1, g1, hs1, dv21, do1_, dh1_),
    "wy_bwd": lambda: reference.wy_bwd(one["k"], one["v"], one["beta"], Ai1, g1, dw1, dv21),
}
for name, call in CALLS.items():
    with FlopCounterMode(display=False) as counter:
        call()
    assert counter.get_total_flops() == KERNEL_FLOPS[name], (name, counter.get_total_flops(), KERNEL_FLOPS[name])

fwd_flops = sum(KERNEL_FLOPS[n] for n in ("chunk_kkt", "chunk_w_u", "chunk_h", "chunk_o"))
bwd_only = sum(KERNEL_FLOPS[n] for n in ("chunk_bwd_dv_local", "chunk_bwd_dhu", "chunk_bwd_dqkwg", "wy_bwd"))
print(f"forward:  {fwd_flops / 1e6:5.2f} MFLOP per chunk and value head (+ {C ** 3 / 3 / 1e3:.0f} kFLOP solve)")
print(f"backward: {bwd_only / 1e6:5.2f} MFLOP of its own = {bwd_only / fwd_flops:.2f} x the forward, "
      f"+ {(KERNEL_FLOPS['chunk_w_u'] + KERNEL_FLOPS['chunk_h']) / 1e6:.2f} MFLOP to recompute w, u, h "
      f"from a saved T (FLA)")
assert abs(fwd_flops / 1e6 - 11.5) < 0.1 and 2.1 < bwd_only / fwd_flops < 2.3

# %% [markdown]
# The backward does about $2.2\times$ the forward's products, close to the factor 2 of any chain of
# matrix products (each product $Y = XZ$ needs two, $dX$ and $dZ$), plus the two products through
# the inverse in `wy_bwd`. Its sequential part, `chunk_bwd_dhu`,
# does $1.5\times$ the work of the forward's `chunk_h` per step.
#
# Bytes, as one kernel per step, in the dtypes of FLA (bf16 activations, $\mathcal{T}$ and per-chunk
# states; fp32 gates), charging each value head its share of the query/key tiles of the
# $(H, H_V) = (16, 64)$ layer, and the time floor of a 32768-token layer on an H100 (790 TFLOP/s bf16
# GEMM measured, 3.35 TB/s):

# %%
H_L, HV_L, T_L = 16, 64, 32768
BF16, FP32 = 2, 4
GEMM_TFLOPS, HBM_TBS = 790, 3.35
PAIRS = T_L // C * HV_L
qk = C * K * BF16 * H_L / HV_L          # a value head's share of one chunk's q or k tile (or dq, dk)
act = C * V * BF16                      # one chunk of v, u, v_new, do, dv, ... of one value head
wt = C * K * BF16                       # one chunk of w or dw
state = K * V * BF16                    # one per-chunk state h or dh
gate = C * FP32                         # one chunk of g, g_cum, beta, dg, dbeta
tri = C * C * BF16                      # one chunk's T
BYTES = {  # name: (read, written) per (chunk, value head)
    "chunk_kkt": (qk + 2 * gate, C * C * FP32),
    "kkt_solve": (C * C * FP32, tri),
    "chunk_w_u": (qk + act + 2 * gate + tri, wt + act),
    "chunk_h": (qk + wt + act + gate, state + act),
    "chunk_o": (2 * qk + act + state + gate, act),
    "chunk_bwd_dv_local": (2 * qk + act + gate, act),
    "chunk_bwd_dhu": (2 * qk + wt + gate + 2 * act, state + act),
    "chunk_bwd_dqkwg": (2 * qk + 3 * act + gate + 2 * state, 2 * qk + wt + gate),
    "wy_bwd": (qk + act + 2 * gate + tri + wt + act, qk + act + 2 * gate),
    "chunk_local_reverse_cumsum": (2 * gate, gate),
}
KERNEL_FLOPS["kkt_solve"] = C ** 3 // 3
KERNEL_FLOPS["chunk_local_reverse_cumsum"] = C


def floor_ms(flops, nbytes):
    return max(flops / GEMM_TFLOPS / 1e9, nbytes / HBM_TBS / 1e9) * PAIRS


print(f"{'step':28s} {'MFLOP':>6s} {'KB read':>8s} {'KB written':>10s} {'FLOP/B':>7s} {'layer floor':>12s}")
for name, (rd, wr) in BYTES.items():
    fl = KERNEL_FLOPS[name]
    if name == "chunk_bwd_dv_local":
        print("-" * 28 + " backward")
    print(f"{name:28s} {fl / 1e6:6.2f} {rd / 1e3:8.1f} {wr / 1e3:10.1f} {fl / (rd + wr):7.0f} {floor_ms(fl, rd + wr):9.3f} ms")

# %%
fwd_names = ["chunk_kkt", "kkt_solve", "chunk_w_u", "chunk_h", "chunk_o"]
bwd_names = ["chunk_bwd_dv_local", "chunk_bwd_dhu", "chunk_bwd_dqkwg", "wy_bwd", "chunk_local_reverse_cumsum"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for ax, values, unit, title in ((axes[0], {n: KERNEL_FLOPS[n] / 1e6 for n in BYTES}, "MFLOP", "matrix FLOPs"),
                                (axes[1], {n: sum(BYTES[n]) / 1e3 for n in BYTES}, "KB", "HBM bytes, one kernel per step")):
    names = fwd_names + bwd_names
    ax.barh(range(len(names)), [values[n] for n in names],
            color=["tab:blue"] * len(fwd_names) + ["tab:orange"] * len(bwd_names))
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} per (chunk, value head)")
    ax.set_title(title + " (blue: forward, orange: backward)", fontsize=9)
fig.tight_layout()

# %% [markdown]
# Like the forward's, every backward step is far below the card's ridge of about 240 FLOP per byte
# when it runs as its own kernel: fusing them is again what a fast backward is about (FlashQLA's
# backward is one fused kernel).
#
# ## What to save, what to recompute
#
# The backward needs, per chunk, $\mathcal{T}$ (for `wy_bwd`), $w$ (for `chunk_bwd_dhu`), the states
# $S$ and `v_new` (for `chunk_bwd_dqkwg`). The forward computed all of them; it can keep them in HBM
# until the backward (memory held across the whole forward and backward of the model, for every
# layer) or the backward can recompute them from the saved inputs. Per token and value head, beyond
# the inputs that autograd keeps anyway ($q, k, v, g, \beta$):

# %%
PER_TOKEN = {   # what one token of one value head costs to keep, in bytes
    "T": C * BF16,                       # one row of the chunk's C x C inverse
    "w": K * BF16, "u": V * BF16, "v_new": V * BF16,
    "h (bf16)": K * V * BF16 / C,       # one K x V state per chunk of C tokens
    "h (fp32)": K * V * FP32 / C,
}
RECOMPUTE = {   # what the backward must rerun when something is not kept, FLOPs per (chunk, value head)
    "T": KERNEL_FLOPS["chunk_kkt"] + KERNEL_FLOPS["kkt_solve"],
    "w, u": KERNEL_FLOPS["chunk_w_u"],
    "h, v_new": KERNEL_FLOPS["chunk_h"],           # the sequential chain, once more
    "w": KERNEL_FLOPS["chunk_w_u"] // 2,
    "v_new = u - w h": 2 * C * K * V,               # from saved h: parallel over chunks
}
STRATEGIES = {  # name: (kept, recomputed, recomputation is a sequential chain)
    "inputs only (flashqla)": ([], ["T", "w, u", "h, v_new"], True),
    "T (FLA)": (["T"], ["w, u", "h, v_new"], True),
    "T, w, u": (["T", "w", "u"], ["h, v_new"], True),
    "T, h (bf16)": (["T", "h (bf16)"], ["w, u", "v_new = u - w h"], False),
    "T, h (fp32)": (["T", "h (fp32)"], ["w, u", "v_new = u - w h"], False),
    "T, w, h, v_new": (["T", "w", "h (bf16)", "v_new"], [], False),
}
rows = []
for name, (kept, redo, chain) in STRATEGIES.items():
    nbytes = sum(PER_TOKEN[n] for n in kept)
    flops = sum(RECOMPUTE[n] for n in redo)
    rows.append((name, nbytes, flops, chain))
    print(f"{name:34s} keeps {nbytes:6.0f} B per token and value head "
          f"({nbytes * T_L * HV_L / 2 ** 30:5.2f} GiB per (16, 64) layer of {T_L} tokens), "
          f"recomputes {flops / 1e6:5.2f} MFLOP per chunk ({flops / bwd_only:4.0%} of the backward)"
          + ("  [sequential]" if chain else ""))

# %%
fig, axes = plt.subplots(1, 2, figsize=(11.5, 4))
ax = axes[0]
for name, nbytes, flops, chain in rows:
    ax.plot(nbytes, flops / 1e6, "o" if chain else "s", ms=8, color="tab:red" if chain else "tab:green")
    ax.annotate(name, (nbytes, flops / 1e6), textcoords="offset points", xytext=(6, 4), fontsize=7)
ax.set_xlabel("bytes kept per token and value head")
ax.set_ylabel("MFLOP recomputed per (chunk, value head)")
ax.set_title("Memory for recompute (red: reruns the sequential chain)", fontsize=9)
ax.set_xlim(-60, 1500)
ax = axes[1]
names = [r[0] for r in rows]
write_read = [2 * r[1] * T_L * HV_L / HBM_TBS / 1e9 for r in rows]     # written by fwd, read by bwd
recompute = [r[2] * PAIRS / GEMM_TFLOPS / 1e9 for r in rows]
ax.barh(range(len(rows)), write_read, color="tab:blue", label="write + read what is kept (HBM)")
ax.barh(range(len(rows)), recompute, left=write_read, color="tab:orange", label="recompute (GEMM rate)")
ax.set_yticks(range(len(rows)), names, fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("ms, floors for a (16, 64) layer of 32768 tokens (H100)")
ax.set_title("Either way it costs time", fontsize=9)
ax.legend(fontsize=7)
fig.tight_layout()
assert rows[0][1] == 0 and rows[-1][2] == 0
bwd_floor = sum(floor_ms(KERNEL_FLOPS[n], sum(BYTES[n])) for n in bwd_names)
print(f"recompute everything: {recompute[0]:.2f} ms at the GEMM rate; keep everything: {write_read[-1]:.2f} ms "
      f"of HBM traffic; the backward's own kernels: {bwd_floor:.2f} ms (sum of their floors)")
assert recompute[0] < write_read[-1] < bwd_floor

# %% [markdown]
# At these floors (products at the GEMM rate, kept bytes written once and read once at the HBM
# rate) recomputing is cheaper than keeping: the products are dense, the round trip through HBM is
# not. Keeping also costs capacity: up to 2.25 GiB per layer for 32768 tokens at $H_V = 64$, held
# from the forward to the backward for every GDN layer of the model. What recomputing really costs is
# latency: recomputing $h$ reruns the forward's one sequential chain before the backward's own reverse
# chain can start, unless the two are fused into one pass. Keeping only the per-chunk states (the
# green squares) removes that chain from the backward for 512 bytes per token (bf16), and `v_new`
# then follows from them in parallel. FLA keeps $\mathcal{T}$;
# `flashqla.chunk_gated_delta_rule` keeps only the inputs, and its backward (the promoted kernels
# of `flashqla/bwd.py`) recomputes the rest.

# %% [markdown]
# ## The kernels
#
# The backward as TileLang stages (`kernels/`, the workbench): `gdn_bwd.s01` runs the steps of this
# chapter as separate kernels, each its own stage with its own tests against the reference function
# of its step and its own timing against FLA's kernel for that step; `gdn_bwd.s02` then runs the two
# sequential walks (the forward's recomputed `chunk_h` and `chunk_bwd_dhu`) in one launch. The
# sub-step stages are `chunk_bwd_dv_local.s01`, `chunk_bwd_dhu.s01`, `chunk_bwd_dqkwg.s01` and
# `wy_bwd.s01`. Each docstring says what the stage does, how, and what it measured on an H200;
# below, its first paragraph.

# %%
BWD_STAGES = (("gdn_bwd", 1), ("gdn_bwd", 2), ("chunk_bwd_dv_local", 1), ("chunk_bwd_dhu", 1),
              ("chunk_bwd_dqkwg", 1), ("wy_bwd", 1))
bwd_stages = {f"{op}.s{n:02d}": stages.load(op, n) for op, n in BWD_STAGES}
ROOT = stages.KERNELS_DIR.parent


def measured_effect(doc):
    """The docstring's 'Measured effect' paragraph, the indented table(s) after it, and the paragraph
    that reads them."""
    paras = doc.split("\n\n")
    starts = [i for i, p in enumerate(paras) if p.startswith("Measured effect")]
    if len(starts) != 1:
        raise ValueError("the docstring has no single 'Measured effect' paragraph")
    end = starts[0] + 1
    while end < len(paras) and paras[end].startswith("    "):
        end += 1
    return "\n\n".join(paras[starts[0]:end + 1])


for name, module in bwd_stages.items():
    first = " ".join(module.__doc__.split("\n\n")[0].split())
    print(f"{name} ({Path(module.__file__).relative_to(ROOT)}): {first}\n")

# %% [markdown]
# The measured numbers side by side, read from the docstrings' "Measured effect" tables: each stage against FLA 0.6.0's kernel
# for the same step (for `gdn_bwd.s01`, FLA's whole backward through `torch.autograd.grad`), one
# H200, CUDA events, median of 20 after 3 warm-up calls, $K = V = 128$. Each stage was timed in its
# own run of its lab (the docstrings name them), with FLA in the same run; the ratio is FLA's time
# over the stage's.

# %%
ROW = re.compile(r"^\s+\((\d+), (\d+)\)\s+(\d+) x (\d+)\s+([\d.]+) ms\s+([\d.]+)", re.M)
STEP_ORDER = ("chunk_bwd_dv_local.s01", "chunk_bwd_dhu.s01", "chunk_bwd_dqkwg.s01", "wy_bwd.s01", "gdn_bwd.s01")
bwd_ms = {}
for name in STEP_ORDER:
    for h_, hv_, n_seq, n_tok, ours, fla in ROW.findall(measured_effect(bwd_stages[name].__doc__)):
        bwd_ms[name, f"({h_}, {hv_}) {n_seq} x {n_tok}"] = (ours, fla)      # as the docstring writes them
SHAPES = list(dict.fromkeys(shape for _, shape in bwd_ms))


def speedup(name, shape):
    """FLA's time over the stage's."""
    ours, fla = bwd_ms[name, shape]
    return float(fla) / float(ours)


lines = ["| stage | " + " | ".join(f"{s}: stage / FLA, ms" for s in SHAPES) + " |",
         "|---|" + "---|" * len(SHAPES)]
for name in STEP_ORDER:
    cells = [f"{bwd_ms[name, s][0]} / {bwd_ms[name, s][1]} ({speedup(name, s):.2f}x)"
             for s in SHAPES]                                       # every stage has both shapes, or a KeyError
    lines.append(f"| `{name}`" + (" (the whole backward)" if name.startswith("gdn_bwd") else "") + " | "
                 + " | ".join(cells) + " |")
display(Markdown("\n".join(lines)))

# what the prose below says
assert SHAPES == ["(16, 64) 1 x 32768", "(2, 8) 1 x 32768"]
assert [round(speedup("gdn_bwd.s01", s), 2) for s in SHAPES] == [1.12, 0.83]
# what the prose below says: every step at least on par with FLA, but the reverse walk with few heads
slower = [(name, s) for name in STEP_ORDER for s in SHAPES if speedup(name, s) < 1]
assert slower == [("chunk_bwd_dhu.s01", "(2, 8) 1 x 32768"), ("gdn_bwd.s01", "(2, 8) 1 x 32768")], slower

# %% [markdown]
# Step by step the kernels are on par with FLA's or faster on the many-head problem, `chunk_bwd_dqkwg`
# about twice as fast; the exception is the sequential walk with few heads: at (2, 8), 16 CTAs each
# walk 512 chunks, and `chunk_bwd_dhu` takes 1.57 ms against FLA's 1.21. The whole `gdn_bwd.s01`
# backward is 1.12x FLA's at (16, 64) and 0.83x at (2, 8), where its two walks (the recomputed
# `chunk_h` and `chunk_bwd_dhu`, 16 CTAs each) take 3.1 of its 4.0 ms, one after the other. That is
# what `gdn_bwd.s02` goes after: both walks side by side in one launch, `dv_local` folded into the
# reverse walk, one preparation kernel and one finishing kernel. The training-step benchmark below
# times it.
#
# ### A whole training step, side by side
#
# `python -m flashqla bench --mode gdn_train` times one training step: the forward, then the
# gradients of $q, k, v, g, \beta$ and the initial state for random upstream gradients of the output
# and of the final state. FLA and FlashQLA run through `torch.autograd`; each backward stage runs
# after the library's forward (`flashqla.fwd`); the entry point runs the library's forward and
# `flashqla/bwd.py` through its `autograd.Function` (it held s01's kernels when the rows of five
# head layouts were timed, s02's for those of (16, 48), (16, 64) and (8, 24)). Every flashqla row is checked against this chapter's float64
# backward first; all rows of a problem are timed in one process (CUDA-graph replay where capture
# works). The committed rows of the run that timed s01 and s02 (`profiles/results/gdn_train_chapter7.csv`;
# `gdn_train.csv` holds the library's latest rows), in ms:

# %%
TRAIN_CSV = ROOT / "profiles" / "results" / "gdn_train_chapter7.csv"   # the runs that timed s01 and s02
train_rows = bench.read_csv(TRAIN_CSV)
TRAIN_COLS = {"FLA": "FLA", "FlashQLA": bench.FLASHQLA_ROW, "s01": "fwd + gdn_bwd/s01_separate_kernels",
              "s02": "fwd + gdn_bwd/s02_fused_walks", "API": bench.API_ROW}
train_ms = {(r["problem"], r["impl"]): float(r["ms"]) for r in train_rows if r["ms"]}
train_problems = list(dict.fromkeys(r["problem"] for r in train_rows))
train = {p: {c: train_ms[p, impl] for c, impl in TRAIN_COLS.items()} for p in train_problems}
print(f"{TRAIN_CSV.relative_to(ROOT)}: " + "; ".join(sorted({f"{r['gpu']} commit {r['commit']}"
                                                              for r in train_rows})))
print(f"{'problem':22s}" + "".join(f"{c:>9s}" for c in TRAIN_COLS) + f"{'s02/FLA':>9s}{'s02/FQ':>8s}")
for p, t in train.items():
    label = bench.short_label(p)
    print(f"{label:22s}" + "".join(f"{t[c]:9.3f}" for c in TRAIN_COLS)
          + f"{t['FLA'] / t['s02']:8.2f}x{t['FlashQLA'] / t['s02']:7.2f}x")
vs_fla = [t["FLA"] / t["s02"] for t in train.values()]
print(f"s02 vs FLA: {min(vs_fla):.2f}-{max(vs_fla):.2f}x, geomean "
      f"{math.exp(sum(map(math.log, vs_fla)) / len(vs_fla)):.2f}x")
# what the prose below says
assert all(t["s02"] < t["s01"] and t["FlashQLA"] < min(v for c, v in t.items() if c != "FlashQLA")
           for t in train.values())
hv_of = {p: int(re.match(r"\((\d+), (\d+)\)", p).group(2)) for p in train}
behind = {p for p, t in train.items() if t["s02"] > t["FLA"]}
assert behind == {p for p in train if "1x" in p and (hv_of[p] <= 16 or (hv_of[p] == 32 and "x8192" in p))}, behind
# the API rows that ran s02's kernels (the promoted backward): (16, 48)'s, (16, 64)'s, (8, 24)'s
api_over_s02 = {p: t["s02"] / t["API"] for p, t in train.items() if p.startswith(("(16, 48)", "(16, 64)", "(8, 24)"))}
assert len(api_over_s02) == 9 and all(0.99 < x < 1.04 for x in api_over_s02.values()), api_over_s02

# %% [markdown]
# s02 is faster than s01 on every problem and than FLA on every varlen batch (8 x 4096 tokens) and
# every (16, 64) problem: 0.73-1.38x FLA over the 24 problems, geomean 1.07x. It falls behind FLA on
# single sequences with few value heads (all of them up to 16 value heads, and 1 x 8192 at 32):
# there, the two walks have one CTA per (sequence, value head, 64 columns), a few dozen CTAs on 132
# SMs, each walking every chunk in turn, and FLA's simpler walk takes less time per chunk. The API
# column ran s01's kernels, except on (16, 48), (16, 64) and (8, 24), where it runs s02's and is
# within 1 % of the s02 row or up to 4 % faster (the same kernels after the library's forward).
# FlashQLA is the fastest row on every problem, 1.7-3.7x FLA: its backward is one fused warp-specialized kernel (a producer
# and consumer warpgroups ordered by 16 barrier stages), the pipeline that comes after s02 here.
#
# The walk kernel that s02 adds (and the library runs) is pipelined by hand: `blockIdx.y` picks the
# walk (the forward's recomputed chain or the reverse one); in each CTA a producer warpgroup waits
# for a stage's `bar_empty`, tells its `bar_full` how many bytes to expect and issues the TMA loads,
# and the consumer warpgroup waits on `bar_full`, runs its wgmma products and arrives on `bar_empty`.

# %% [markdown]
# ### What the library runs
#
# `flashqla/bwd.py` holds the promoted backward: a copy, unchanged, of every kernel `gdn_bwd.s02` runs
# (its prep, walk and finish kernels, `chunk_bwd_dqkwg.s01` and `wy_bwd.s01`) and, where its rule
# splits a long sequence into segments, of the backward AutoCP kernels of `gdn_bwd.s03` (chapter 08:
# the forward's AutoCP of chapter 06, run for both walks); `tests/test_promoted.py` asserts
# that each builds the same TileLang program as its stage, with the same compile options:

# %%
print(bwd.__doc__)

# %% [markdown]
# `flashqla.chunk_gated_delta_rule` reaches it through autograd, and its forward saves only the
# inputs $q, k, v, g, \beta$ and the initial state: the backward recomputes $g_{cum}$,
# $\mathcal{T}$, $w$, $u$, the states and `v_new`, the first row of the save-or-recompute table
# above.

# %% [markdown]
# Neither direction reads a device value on the host once it has seen a `cu_seqlens` tensor (the
# lengths are read once per tensor), so after one eager call a whole training step (forward,
# backward, the gradients of every input) can be captured in one CUDA graph. The GPU test that checks
# it replays the graph and compares with eager execution bit for bit, before and after the inputs
# change in place:

# %%
test_api = ROOT / "tests" / "test_api.py"
tree = ast.parse(test_api.read_text())
(graph_test,) = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name == "test_training_step_replays_in_a_cuda_graph"]
print(f"# {test_api.relative_to(ROOT)}")
print(ast.get_source_segment(test_api.read_text(), graph_test))

# %% [markdown]
# ## Summary
#
# - The backward of a chunk is matrix products over the same tiles as the forward, in five steps:
#   `chunk_bwd_dv_local`, the reverse state recurrence `chunk_bwd_dhu`, `chunk_bwd_dqkwg`,
#   `wy_bwd`, and the reverse chunk-local cumsum for $dg$. Each matched autograd in float64 here,
#   and `tests/test_backward_reference.py` checks them on many more problems, each check shown to
#   fail on a deliberately broken step.
# - The only sequential part is the reverse recurrence for $dS$, the transpose of the forward's
#   chain, started from the final state's gradient; $dS$ decays backwards as the state decays forwards.
# - $d\gamma_i = q_i \cdot dq_i - k_i \cdot dk_i$ plus the chunk-end terms: no exponential is
#   differentiated and no positive exponent appears. GVA gradients are sums over each group.
# - The backward does about $2.3\times$ the forward's matrix work, plus what it recomputes; what the
#   forward keeps for it trades HBM capacity against rerunning the sequential chain.
# - The kernels: `gdn_bwd.s01` runs the steps as separate TileLang kernels, each a tested stage
#   (`chunk_bwd_dv_local.s01`, `chunk_bwd_dhu.s01`, `chunk_bwd_dqkwg.s01`, `wy_bwd.s01`, after the
#   forward's stages recompute the intermediates); measured on an H200 it is 1.12x FLA's backward at
#   (16, 64) and 0.83x at (2, 8), where the two sequential walks dominate. `gdn_bwd.s02` puts both
#   walks in one launch: a training step with it is 0.73-1.38x FLA's (geomean 1.07x), behind on
#   single sequences with few heads; FlashQLA is 1.7-3.7x FLA. The library runs s02's kernels
#   (`flashqla/bwd.py`), saving only the inputs, and a whole training step captures in a CUDA graph.

# %% [markdown]
# ## Exercises
#
# **1. One step of the reverse state recurrence.** Write `dhu_step` for one chunk of one value head
# (step 2): given $dS'$, the gradient of the state leaving the chunk, return $dS$, that of the
# state entering it, and $d\tilde V$, the full gradient of `v_new`. The starting code decays the
# whole sum by the chunk's $e^{\gamma_C}$; only one of its terms went through that decay in the
# forward. The check walks your step from the last chunk to the first on one sequence and compares
# with `reference.chunk_bwd_dhu` and with autograd's gradient of the initial state, in float64.

# %% tags=["exercise"]
def dhu_step(dS_next, q, k, w, do, dv_local, g_cum, scale):
    g_last = g_cum[-1]
    dv = dv_local + (k * torch.exp(g_last - g_cum)[:, None]) @ dS_next          # dV~ = dV~_loc + E K dS'
    dS = torch.exp(g_last) * (dS_next + scale * (q * torch.exp(g_cum)[:, None]).T @ do
                              - w.T @ dv)                                        # TODO: what does exp(g_C) decay?
    return dS, dv


# %% tags=["check"]
check_dhu_step(dhu_step)

# %% tags=["solution", "hide-input"]
def dhu_step(dS_next, q, k, w, do, dv_local, g_cum, scale):
    g_last = g_cum[-1]
    dv = dv_local + (k * torch.exp(g_last - g_cum)[:, None]) @ dS_next
    # S' = exp(g_C) S + ...: only the path through the decayed state carries exp(g_C)
    dS = torch.exp(g_last) * dS_next + scale * (q * torch.exp(g_cum)[:, None]).T @ do - w.T @ dv
    return dS, dv


result = check_dhu_step(dhu_step)
assert result.passed, result
result

# %% [markdown]
# **2. From $d\gamma$ to $dg$.** Write step 5 for one sequence: `dg_from_dgamma(dgamma)` gets the
# gradient of the chunk-local cumulative log decay, `[T, HV]` with $T = 200$ (three whole chunks
# and a partial one), and returns the gradient of $g$. The starting code sums in the wrong
# direction. The check compares with `reference.chunk_local_reverse_cumsum` and with autograd's
# gradient of $g$ through the token-by-token recurrence.

# %% tags=["exercise"]
def dg_from_dgamma(dgamma):
    dg = torch.empty_like(dgamma)
    for s in range(0, dgamma.shape[0], C):                                     # chunk by chunk
        dg[s:s + C] = dgamma[s:s + C].cumsum(0)                                  # TODO: which gammas does g_t feed?
    return dg


# %% tags=["check"]
check_dg_from_dgamma(dg_from_dgamma)

# %% tags=["solution", "hide-input"]
def dg_from_dgamma(dgamma):
    dg = torch.empty_like(dgamma)
    for s in range(0, dgamma.shape[0], C):
        dg[s:s + C] = dgamma[s:s + C].flip(0).cumsum(0).flip(0)                 # g_t feeds gamma_s, s >= t
    return dg


result = check_dg_from_dgamma(dg_from_dgamma)
assert result.passed, result
result
