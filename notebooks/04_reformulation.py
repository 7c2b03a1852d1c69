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
# # The gate-free solve, a forward without $w$ and $u$, and warp specialization
#
# Chapter 3 ended with a fused forward (`gdn_fwd.s03`) whose preparation still forms the decayed
# triangular inverse $\mathcal{T} = (I + A)^{-1}$ and the WY matrices $w$ and $u$, writes $w$ and $u$ to
# HBM and reads them back, and whose fused kernel runs the state chain and the output one after the
# other in the same warps. This chapter takes both on:
#
# | stage | what changes | why |
# |---|---|---|
# | `gate_free_solve.s01` | the triangular inverse is taken *without the decay*: $A_r = (I + L)^{-1}$ with $\beta$ folded in | the decay comes back as an elementwise product, with the tile the output mask needs anyway |
# | `gdn_fwd.s04` | the fused kernel computes $\tilde V = (\Gamma \odot A_r \operatorname{diag}\beta)(V - D K S)$ directly | $w$ and $u$ never exist: fewer bytes, one product less |
# | `gdn_fwd.s05` | s03's fused kernel (still on $w$ and $u$) is split into four warpgroup roles: chain, scores, output and producer | the chain of chunk $c + 1$ runs while the scores and the output of chunk $c$ are computed |
#
# The two changes are independent: s04 changes the math, s05 the organization of the same work
# (a later stage can combine them). We prove the identity behind s04, check it in float64, count per chunk what it saves,
# look at where it can lose precision and what the stage does about it, read the stages' source and
# generated CUDA, draw the warp-specialized pipeline, and finish with the measured numbers.
# Every cell runs on a CPU; the GPU numbers are read from the committed results.

# %%
import ast
import csv
import inspect
import math
import re
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by TileLang
import tilelang

from flashqla import autocp, bench, reference
from flashqla.hopper import cuda_excerpt, hopper_gpu_missing
from flashqla.stages import KERNELS_DIR, load
from flashqla.testing import Problem, cast_floats, rel_l2

tilelang.set_log_level("WARNING")
torch.manual_seed(0)
f64 = torch.float64
ROOT = KERNELS_DIR.parent
NAMES = ("q", "k", "v", "g", "beta", "initial_state", "output_final_state", "cu_seqlens")

# %% [markdown]
# ## 1. The identity
#
# Take one chunk of $C$ tokens of one value head, as in chapter 2: $\gamma$ the chunk-local cumulative
# log decay, $D = \operatorname{diag}(e^{\gamma})$, $\Gamma_{ij} = e^{\gamma_i - \gamma_j}$ for $i \ge j$
# (and $0$ above the diagonal), and
#
# $$
# A = \operatorname{StrictLower}\big(\operatorname{diag}(\beta) K K^\top \odot \Gamma\big), \qquad
# \mathcal{T} = (I + A)^{-1}, \qquad
# L = \operatorname{StrictLower}\big(\operatorname{diag}(\beta) K K^\top\big) \ \text{(the same without decay)}.
# $$
#
# **The decay is a similarity transform.** For $i > j$,
# $A_{ij} = \beta_i (k_i \cdot k_j)\, e^{\gamma_i} e^{-\gamma_j} = e^{\gamma_i} L_{ij} e^{-\gamma_j}
# = (D L D^{-1})_{ij}$, and both sides vanish for $i \le j$. So $A = D L D^{-1}$,
# $I + A = D (I + L) D^{-1}$, and
#
# $$
# \mathcal{T} = (I + A)^{-1} = D\, (I + L)^{-1} D^{-1} = D A_r D^{-1}, \qquad A_r := (I + L)^{-1}.
# $$
#
# **Entrywise, that is a mask.** $(D A_r D^{-1})_{ij} = e^{\gamma_i - \gamma_j} (A_r)_{ij}$, and $A_r$ is
# lower triangular (the inverse of a unit lower triangular matrix), so
#
# $$
# \mathcal{T} = \Gamma \odot A_r .
# $$
#
# $\Gamma$, lower triangle including the diagonal, is exactly the decay tile of the output's
# intra-chunk scores $(Q K^\top) \odot \Gamma$: one $C \times C$ exponential tile per chunk serves both.
# $A_r$ depends on $K$ and $\beta$ only: the solve needs no gates and no exponential at all.
#
# **$w$ and $u$ need never exist.** Chapter 2's $\tilde V = u - w h$ with
# $u = \mathcal{T} \operatorname{diag}(\beta) V$ and $w = \mathcal{T} \operatorname{diag}(\beta e^{\gamma}) K$
# factors as
#
# $$
# \tilde V = \mathcal{T} \operatorname{diag}(\beta) \big( V - D K h \big)
#          = (\Gamma \odot A_b)\, W, \qquad A_b := A_r \operatorname{diag}(\beta), \quad
#            W := V - D U, \quad U := K h,
# $$
#
# using that a column scaling commutes with the elementwise product:
# $(\Gamma \odot A_r) \operatorname{diag}(\beta) = \Gamma \odot (A_r \operatorname{diag}(\beta))$.
# So a fused kernel that holds the state $h$ computes $U = K h$ (instead of $w h$), $W = V - D U$
# (elementwise) and $\tilde V = (\Gamma \odot A_b) W$ (instead of reading $u$); the product
# $w = \mathcal{T} \operatorname{diag}(\beta e^\gamma) K$ disappears, and only $A_b$ ($C \times C$ per chunk
# and value head) crosses HBM instead of $w$ and $u$ ($C \times (K + V)$).
#
# **Every exponent stays $\le 0$.** $D^{-1}$ is never formed (with strong decay $e^{-\gamma}$ overflows
# float32; see below): the kernels take $\exp_2$ of differences of logs pre-scaled by $\log_2 e$,
# $(\gamma_i - \gamma_j) \log_2 e \le 0$ for $i \ge j$, and of $\gamma_i \log_2 e \le 0$ and
# $(\gamma_C - \gamma_i) \log_2 e \le 0$.
#
# ### Checked in float64
#
# On the example of chapter 2: one sequence of 200 tokens (three full chunks and one of 8 tokens),
# two value heads sharing a key head, head 0 decaying and head 1 with $g = 0$, a random initial
# state; the chunk states $h$ and $\tilde V$ (`v_new`) come from the reference sub-steps.

# %%
B, T, H, HV, K, V, C = 1, 200, 1, 2, 16, 16, 64
q = reference.l2norm(torch.randn(B, T, H, K, dtype=f64))
k = reference.l2norm(torch.randn(B, T, H, K, dtype=f64))
v = torch.randn(B, T, HV, V, dtype=f64)
g = F.logsigmoid(torch.randn(B, T, HV, dtype=f64) + 2.0)
g[..., 1] = 0.0
beta = torch.sigmoid(torch.randn(B, T, HV, dtype=f64))
h0 = torch.randn(1, HV, K, V, dtype=f64)

g_cum = reference.chunk_local_cumsum(g, chunk_size=C)
A = reference.chunk_kkt(k, g_cum, beta, chunk_size=C)
Ai = reference.kkt_solve(A, chunk_size=C)
w, u = reference.chunk_w_u(k, v, beta, Ai, g_cum, chunk_size=C)
h, v_new, h_final = reference.chunk_h(k, w, u, g_cum, initial_state=h0, output_final_state=True,
                                      chunk_size=C)
k_heads = reference.expand_heads(k, HV)[0]                    # [T, HV, K]
chunks = [(s, min(s + C, T)) for s in range(0, T, C)]


def decay_tile(gam):
    """Gamma: exp(gam_i - gam_j) on and below the diagonal, 0 above; only exponents <= 0 are taken."""
    lower = torch.ones(len(gam), len(gam), dtype=torch.bool).tril()
    diff = torch.where(lower, gam[:, None] - gam[None, :], torch.zeros((), dtype=gam.dtype))
    return torch.where(lower, torch.exp(diff), torch.zeros((), dtype=gam.dtype))


worst = dict(similarity=0.0, mask=0.0, v_new=0.0)
for c, (s, e) in enumerate(chunks):
    for head in range(HV):
        Kc, bc, gam = k_heads[s:e, head], beta[0, s:e, head], g_cum[0, s:e, head]
        eye = torch.eye(e - s, dtype=f64)
        L = torch.tril(bc[:, None] * (Kc @ Kc.T), -1)                    # gate-free coupling
        D, D_inv = torch.diag(torch.exp(gam)), torch.diag(torch.exp(-gam))
        A_r = torch.linalg.inv(eye + L)
        A_c, Ai_c = A[0, s:e, head, :e - s], Ai[0, s:e, head, :e - s]   # this chunk's A and (I + A)^-1
        S = h[0, c, head]                                                # state entering chunk c
        W_c = v[0, s:e, head] - torch.exp(gam)[:, None] * (Kc @ S)       # W = V - D K h
        Ab = A_r * bc[None, :]                                           # A_r diag(beta)
        worst["similarity"] = max(worst["similarity"], rel_l2(A_c, D @ L @ D_inv))
        worst["mask"] = max(worst["mask"], rel_l2(Ai_c, decay_tile(gam) * A_r))
        worst["v_new"] = max(worst["v_new"], rel_l2(v_new[0, s:e, head], (decay_tile(gam) * Ab) @ W_c))
for name, err in worst.items():
    print(f"{name:10s} worst rel L2 over {len(chunks)} chunks x {HV} heads: {err:.1e}")
assert max(worst.values()) < 1e-12, worst
print("A = D L D^-1,  (I + A)^-1 = Gamma * (I + L)^-1,  v_new = (Gamma * A_r diag(beta)) (V - D K h): all hold")

# %% [markdown]
# The library's reference for the new step is `reference.gate_free_solve`, with the signature of a
# kernel op (the stage `gate_free_solve.s01` computes exactly it):

# %%
print("gate_free_solve" + str(inspect.signature(reference.gate_free_solve)))
print(reference.gate_free_solve.__doc__)

# %% [markdown]
# Its rows are stored per token like those of `kkt_solve` (token $t$ holds row $t \bmod C$ of its
# chunk's matrix), so chunk $c$'s $A_b$ is a slice. Check it against the inverse taken above, and
# that masking it with $\Gamma$ gives `kkt_solve`'s $\mathcal{T}$ with $\beta$ folded, for every chunk of
# both heads, and on a packed varlen batch too:

# %%
def beta_columns(beta, cu_seqlens=None):
    """[B, T, HV, C]: for each token row, beta of column j of its chunk (to fold beta into Ai)."""
    ch = reference.Chunking(beta.shape[0], beta.shape[1], cu_seqlens, C, beta.device)
    bc = ch.pad(beta)                                                    # [N, NT, C, HV]
    cols = bc.permute(0, 1, 3, 2)[:, :, None].expand(-1, -1, C, -1, -1)  # [N, NT, C(row), HV, C(col)]
    return ch.unpad(cols)


def masked_rows(Ab_rows, g_cum, cu_seqlens=None):
    """Gamma * A_b per token row: the decayed inverse with beta folded, (I + A)^-1 diag(beta)."""
    ch = reference.Chunking(g_cum.shape[0], g_cum.shape[1], cu_seqlens, C, g_cum.device)
    gamma, lower = reference._decay_matrix(reference._heads_first(ch.pad_g_cum(g_cum)), 0)
    gamma = torch.where(lower, gamma, torch.zeros_like(gamma))        # [N, NT, HV, C, C]
    return ch.unpad(reference._tokens_first(gamma)) * Ab_rows


Ab_rows = reference.gate_free_solve(k, beta, chunk_size=C)
print("A_b:", tuple(Ab_rows.shape))
err_ab = max(rel_l2(Ab_rows[0, s:e, hd, :e - s],
                    torch.linalg.inv(torch.eye(e - s, dtype=f64) + torch.tril(
                        beta[0, s:e, hd, None] * (k_heads[s:e, hd] @ k_heads[s:e, hd].T), -1))
                    * beta[0, s:e, hd][None, :])
             for s, e in chunks for hd in range(HV))
err_t = rel_l2(masked_rows(Ab_rows, g_cum), Ai * beta_columns(beta))
cu = torch.tensor([0, 70, T], dtype=torch.int32)
g_cum_cu = reference.chunk_local_cumsum(g, cu_seqlens=cu)
Ai_cu = reference.kkt_solve(reference.chunk_kkt(k, g_cum_cu, beta, cu_seqlens=cu), cu_seqlens=cu)
err_cu = rel_l2(masked_rows(reference.gate_free_solve(k, beta, cu_seqlens=cu), g_cum_cu, cu),
              Ai_cu * beta_columns(beta, cu))
print(f"A_b vs (I + L)^-1 diag(beta): {err_ab:.1e};  Gamma * A_b vs kkt_solve diag(beta): {err_t:.1e};  "
      f"varlen [0, 70, 200]: {err_cu:.1e}")
assert max(err_ab, err_t, err_cu) < 1e-12, (err_ab, err_t, err_cu)

# %% [markdown]
# ### The whole forward without $w$ and $u$
#
# Per chunk, with the state $S$ entering it (this is the loop of the fused kernel `gdn_fwd.s04`,
# written in PyTorch as an illustration for one sequence):
#
# $$
# U = K S, \quad W = V - D U, \quad \tilde V = (\Gamma \odot A_b) W, \quad
# O = s\big(D Q S + ((Q K^\top) \odot \Gamma)\, \tilde V\big), \quad
# S \leftarrow e^{\gamma_C} S + K^\top \operatorname{diag}(e^{\gamma_C - \gamma}) \tilde V .
# $$
#
# The same $\Gamma$ tile appears twice. Against the token-by-token recurrence of chapter 1:

# %%
def forward_without_w_u(q, k, v, g, beta, h0, scale):
    """Illustration, one sequence (B = 1, no cu_seqlens): the chunked forward from A_b alone."""
    hv = v.shape[2]
    qh, kh = (reference.expand_heads(x, hv)[0] for x in (q, k))         # [T, HV, K]
    g_cum = reference.chunk_local_cumsum(g, chunk_size=C)[0]            # [T, HV]
    Ab_rows = reference.gate_free_solve(k, beta, chunk_size=C)[0]       # [T, HV, C]
    S, o = h0[0].clone(), torch.zeros_like(v[0])
    for s in range(0, q.shape[1], C):
        e = min(s + C, q.shape[1])
        for hd in range(hv):
            Qc, Kc, Vc, gam = qh[s:e, hd], kh[s:e, hd], v[0, s:e, hd], g_cum[s:e, hd]
            G = decay_tile(gam)                                         # the one exp tile
            U = Kc @ S[hd]                                              # U = K S
            W = Vc - torch.exp(gam)[:, None] * U                        # W = V - D U
            Vt = (G * Ab_rows[s:e, hd, :e - s]) @ W                     # V~ = (Gamma * A_b) W
            o[s:e, hd] = scale * (torch.exp(gam)[:, None] * (Qc @ S[hd]) + ((Qc @ Kc.T) * G) @ Vt)
            S[hd] = torch.exp(gam[-1]) * S[hd] + Kc.T @ (torch.exp(gam[-1] - gam)[:, None] * Vt)
    return o[None], S[None]


o_naive, hT_naive = reference.naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                               output_final_state=True)
o_wu, hT_wu = forward_without_w_u(q, k, v, g, beta, h0, K ** -0.5)
err_o, err_h = rel_l2(o_wu, o_naive), rel_l2(hT_wu, hT_naive)
print(f"forward without w and u vs the recurrence: o {err_o:.1e}, final state {err_h:.1e}")
assert err_o < 1e-12 and err_h < 1e-12, (err_o, err_h)

# %% [markdown]
# ### Why $D^{-1}$ is never formed
#
# The similarity $D A_r D^{-1}$ is a proof device, not a recipe. With strong decay ($g = -2$ per
# token, $\gamma_C = -128$), $e^{-\gamma_C} = e^{128}$ overflows float32 and $e^{\gamma_C}$ underflows to 0;
# the product $D A_r D^{-1}$ is then $0 \cdot \infty = \mathrm{NaN}$. The mask $\Gamma \odot A_r$ takes
# only exponents $\le 0$ and is exact to rounding:

# %%
gam32 = torch.cumsum(torch.full((C,), -2.0), 0)                        # float32, gamma_C = -128
k32 = reference.l2norm(torch.randn(C, 32))
b32 = torch.sigmoid(torch.randn(C))
A_r32 = torch.linalg.inv(torch.eye(C) + torch.tril(b32[:, None] * (k32 @ k32.T), -1))
via_similarity = torch.diag(torch.exp(gam32)) @ A_r32 @ torch.diag(torch.exp(-gam32))  # illustration: don't
via_mask = decay_tile(gam32) * A_r32
truth = decay_tile(gam32.double()) * torch.linalg.inv(
    torch.eye(C, dtype=f64) + torch.tril(b32.double()[:, None] * (k32.double() @ k32.double().T), -1))
for name, X in (("D A_r D^-1", via_similarity), ("Gamma * A_r", via_mask)):
    print(f"{name:12s} NaN: {int(X.isnan().sum()):4d}  inf: {int(X.isinf().sum()):3d}  "
          f"rel L2 vs float64: {rel_l2(X, truth):.1e}")
assert via_similarity.isnan().any() and rel_l2(via_mask, truth) < 1e-5

# %% [markdown]
# ## 2. What it saves, per chunk
#
# Napkin math per (chunk, value head) for $K = V = 128$, $C = 64$, counting what each kernel of a
# pipeline does, in four currencies:
#
# - **tensor-core FLOPs** (`wgmma`, 2 per multiply-add);
# - **CUDA-core operations**, elementwise work on the FP32 units: one per add, multiply or FMA, and
#   one per fp32 -> bf16 conversion of a wgmma operand; the triangular solve's
#   $C(C-1)(C-2)/6$ FMAs;
# - **SFU exponentials** (`MUFU.EX2`): a masked $C \times C$ tile counts $C^2$, since the lanes of a
#   warp issue it together whatever the mask; per-row factors count $C$;
# - **HBM bytes**, in the kernels' dtypes (bf16 activations, WY matrices and $A_b$, fp32 gates); the
#   $q$ and $k$ tiles of a key head are charged to its $H_V / H$ value heads in equal shares, as in
#   chapter 3, and a tile that both $V$-tile CTAs read is counted once (the second read mostly hits
#   L2).
#
# The fused kernels split $V$ into tiles of $B_V$ columns, one CTA each; work that does not depend on
# the $V$ tile (the scores $Q K^\top$, the decay tile and what is masked with it) is repeated by each
# of the $V / B_V$ CTAs. The pipelines, as the stages build them:
#
# - **before**, what the library runs after chapter 3: chunk-local cumsum, the fused preparation
#   `chunk_fwd_intra.s01` ($A$, its inverse, $w$ and $u$, one CTA per chunk and *value* head), and
#   s03's fused recurrence and output;
# - **after**, `gdn_fwd.s04`: cumsum, `gate_free_solve.s01` (no gate, so $K K^\top$ is the same for
#   all value heads of a key head: one CTA per chunk and *key* head computes it once, then solves
#   each value head's $A_b$; it also checks the growth condition of section 3 on every row), and the
#   fused kernel computing $U$, $W$, the decay tile, $\tilde V$, the state and the output.

# %%
KC = VC = 128
CC = 64
H_L, HV_L, T_L = 16, 64, 32768           # the layer for totals: Qwen3.5 397B / 122B at TP1
BF16, FP32 = 2, 4
s04_bv = load("gdn_fwd", 4).BLOCK_V      # B_V of s04's fused kernel
# A_b crosses HBM in bf16: the dtype of the `ab` tensor of gate_free_solve.s01's kernel
assert re.search(r'ab: T\.Tensor\([^)]*\), "bfloat16"\)', inspect.getsource(load("gate_free_solve", 1)))


def per_chunk(pipeline, C=CC, K=KC, V=VC, BV=64, H=H_L, HV=HV_L):
    """Line items (kernel, what, currency, count) per (chunk, value head) of one pipeline."""
    nv = V // BV                                    # CTAs per value head in the fused kernel
    qk = C * K * BF16 * H / HV                      # a value head's share of one q or k tile
    solve = C * (C - 1) * (C - 2) // 6              # FMAs of a unit-lower-triangular inverse
    tc, cc, ex, hb = "tensor FLOP", "CUDA-core op", "exp2", "HBM byte"
    items = [("cumsum", "g -> g_cum", cc, C), ("cumsum", "read g, write g_cum", hb, 2 * C * FP32)]
    if pipeline == "before":
        items += [
            ("prep", "K K^T (each value head)", tc, 2 * C * C * K),
            ("prep", "w = (Ai diag(beta e^g)) K", tc, 2 * C * C * K),
            ("prep", "u = (Ai diag(beta)) V", tc, 2 * C * C * V),
            ("prep", "A = beta_i (KK^T)_ij Gamma_ij (sub, 2 mul)", cc, 3 * C * C),
            ("prep", "(I + A)^-1 substitution", cc, solve),
            ("prep", "Ai diag(beta e^g), Ai diag(beta); to bf16", cc, 2 * 2 * C * C),
            ("prep", "w, u to bf16", cc, C * (K + V)),
            ("prep", "Gamma tile of A", ex, C * C),
            ("prep", "e^g_j (w's column scaling)", ex, C),
            ("prep", "read k, v, g_cum, beta", hb, qk + C * V * BF16 + 2 * C * FP32),
            ("prep", "write w, u", hb, C * (K + V) * BF16),
            ("fused", "V~ = U - W S: W S", tc, 2 * C * K * V),
            ("fused", "read w, u, g_cum", hb, C * (K + V) * BF16 + C * FP32),
        ]
    else:
        items += [
            ("prep", "K K^T (once per key head)", tc, 2 * C * C * K * H / HV),
            ("prep", "flag: beta_i (KK^T)_ii > 2 on some row", cc, 2 * C),
            ("prep", "L = beta_i (KK^T)_ij (mul)", cc, C * C),
            ("prep", "(I + L)^-1 substitution", cc, solve),
            ("prep", "A_b = A_r diag(beta); to bf16", cc, 2 * C * C),
            ("prep", "read k, beta", hb, qk + C * FP32),
            ("prep", "write A_b, flag", hb, C * C * BF16 + 4),
            ("fused", "U = K S", tc, 2 * C * K * V),
            ("fused", "V~ = (Gamma * A_b) W", tc, 2 * C * C * V),
            ("fused", "W = V - D U (FMA); to bf16", cc, 2 * C * V),
            ("fused", "Gamma * A_b (sub, mul); to bf16", cc, 3 * C * C * nv),
            ("fused", "read v, A_b, flag, g_cum", hb, C * V * BF16 + C * C * BF16 + 4 + C * FP32),
        ]
    items += [  # the rest of the fused kernel: the same in both
        ("fused", "S <- e^g_C S + K^T diag(e^(g_C - g)) V~", tc, 2 * C * K * V),
        ("fused", "Q S", tc, 2 * C * K * V),
        ("fused", "Q K^T (each V tile)", tc, 2 * C * C * K * nv),
        ("fused", "P V~", tc, 2 * C * C * V),
        ("fused", "V~ decayed; S decayed; O scaled", cc, 2 * C * V + K * V),
        ("fused", "S, V~, V~ decayed to bf16", cc, K * V + 2 * C * V),
        ("fused", "P = s (QK^T) * Gamma, masked; to bf16", cc,
         (3 if pipeline == "before" else 2) * C * C * nv + C * C * nv),
        ("fused", "Gamma tile (each V tile)", ex, C * C * nv),
        ("fused", "e^g_i, e^(g_C - g_i), e^g_C (each V tile)", ex, (2 * C + 1) * nv),
        ("fused", "read q, k; write o", hb, 2 * qk + C * V * BF16),
    ]
    return items


PIPES = {"before (s03, promoted)": per_chunk("before"), "after (s04)": per_chunk("after", BV=s04_bv)}
CURRENCIES = ("tensor FLOP", "CUDA-core op", "exp2", "HBM byte")
print(f"(H, HV) = ({H_L}, {HV_L}); fused kernels: B_V = 64 before, {s04_bv} after\n")
for name, items in PIPES.items():
    print(f"== {name}")
    for kernel, what, cur, n in items:
        print(f"   {kernel:7s} {what:44s} {cur:13s} {n:>11,.0f}")
totals = {name: {cur: sum(n for _, _, c, n in items if c == cur) for cur in CURRENCIES}
          for name, items in PIPES.items()}
print(f"\n{'per (chunk, value head)':28s}" + "".join(f"{cur:>15s}" for cur in CURRENCIES))
for name, tot in totals.items():
    print(f"{name:28s}" + "".join(f"{tot[cur]:15,.0f}" for cur in CURRENCIES))
before, after = totals.values()
print(f"{'after / before':28s}" + "".join(f"{after[cur] / before[cur]:15.2f}" for cur in CURRENCIES))

# the useful matrix work of bench.useful_flops is the "before" pipeline without the repeated Q K^T
useful = 2 * CC * CC * (3 * KC + 2 * VC) + 3 * 2 * CC * KC * VC
assert before["tensor FLOP"] - 2 * CC * CC * KC * (VC // 64 - 1) == useful

# %%
fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
kernels = ("cumsum", "prep", "fused")
colors = dict(cumsum="tab:gray", prep="tab:orange", fused="tab:blue")
for ax, cur in zip(axes, CURRENCIES):
    for x, (name, items) in enumerate(PIPES.items()):
        bottom = 0
        for kern in kernels:
            n = sum(n for kk, _, c, n in items if kk == kern and c == cur)
            ax.bar(x, n, bottom=bottom, color=colors[kern], label=kern if x == 0 else None)
            bottom += n
    ax.set_xticks([0, 1], ["before", "after"])
    ax.set_title(f"{cur}s per (chunk, head)", fontsize=9)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
axes[0].legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# Per chunk and value head, the reformulation
#
# - removes one $C \times C \times K$ product, the formation of $w$ ($U = K S$ replaces $W S$, and
#   $(\Gamma \odot A_b) W$ replaces the formation of $u$), and, for $(H, H_V) = (16, 64)$, three quarters
#   of $K K^\top$, which no longer depends on the value head;
# - removes the preparation's exponential tile (the solve needs no gate), while the fused kernel
#   restores the gate with the tile it computes for the output mask anyway: its exponentials do not
#   change;
# - moves elementwise work from the preparation into the fused kernel (the totals come out equal to
#   within 0.1 %);
# - replaces $w$ and $u$ written and read ($4 C (K + V)$ bytes in bf16) by $A_b$ written and read
#   ($4 C^2$ bytes): 44 % less HBM traffic for the whole pipeline.
#
# What these totals mean for a whole layer, as time floors at the card's rates (H200: bf16 GEMM and
# copy roofs measured by the benchmark; FP32 units and SFU from the datasheet: 128 FP32 lanes and 16
# `MUFU.EX2` per clock per SM, 132 SMs at 1.98 GHz):

# %%
SMS, CLOCK = 132, 1.98e9
rates = {"CUDA-core op": SMS * 128 * CLOCK, "exp2": SMS * 16 * CLOCK}
CSV_PATH = bench.RESULTS / "gdn_fwd.csv"
# the API's and the peers' rows of earlier runs, as they were before a later run re-timed them
EARLIER_RUNS = bench.RESULTS / "gdn_fwd_earlier_runs.csv"
meta = bench.read_csv(CSV_PATH)[0]                   # the roofs measured in the benchmark's run
rates["tensor FLOP"], rates["HBM byte"] = float(meta["gemm_roof_tflops"]) * 1e12, float(meta["copy_roof_gbs"]) * 1e9
pairs = T_L // CC * HV_L
print(f"(H, HV) = ({H_L}, {HV_L}), 1 x {T_L} tokens: {pairs} (chunk, value head) pairs")
print(f"{'':28s}" + "".join(f"{cur + ' ms':>16s}" for cur in CURRENCIES))
for name, tot in totals.items():
    print(f"{name:28s}" + "".join(f"{tot[cur] * pairs / rates[cur] * 1e3:16.3f}" for cur in CURRENCIES))
saved_gb = (before["HBM byte"] - after["HBM byte"]) * pairs / 1e9
print(f"HBM traffic saved: {saved_gb:.2f} GB, >= {saved_gb / rates['HBM byte'] * 1e12:.2f} ms at the copy roof")

# %% [markdown]
# Every floor is well below the measured times (section 5: s03 takes 3.66 ms on this layer in the
# committed H200 benchmark), so none of these resources is saturated overall: the fused kernel is latency-bound along its
# chain of chunks, and the preparation is memory-bound. So the bytes are what the reformulation should
# buy first: 1.6 GB less on this layer, at least 0.39 ms at the copy roof, taken out of the
# preparation, which now writes $C^2$ instead of $C (K + V)$ elements per chunk and head. The fused
# kernel's work per chunk stays about the same ($U = K S$ for $W S$, $(\Gamma \odot A_b) W$ added,
# $v$ and $A_b$ read for $w$ and $u$), so its chain is no shorter: that is what section 4's s05 is
# about.
#
# ## 3. Precision: when is the gate-free inverse safe?
#
# In exact arithmetic $\mathcal{T} = \Gamma \odot A_r$, always. In floating point, the gated solve
# inverts $I + A$, whose off-diagonal entries are damped by the decay; the gate-free solve inverts
# $I + L$, undamped, and multiplies by $\Gamma$ afterwards. If $A_r$ has huge entries, their rounding
# errors (relative to $|A_r|$) survive the mask wherever $\Gamma$ is not small, and $A_r$ can overflow
# where $\mathcal{T}$ is perfectly finite.
#
# **A bound.** Column $j$ of $A_r$ solves $(I + L) x = e_j$: $x_j = 1$ and, for $i > j$,
# $x_i = -\beta_i\, k_i^\top s_{i-1}$ with $s_i = \sum_{j \le m \le i} x_m k_m$. Then $s_j = k_j$ and
# $s_i = s_{i-1} + x_i k_i = (I - \beta_i k_i k_i^\top)\, s_{i-1}$: the same rank-one factors as the
# recurrence. Each has norm $\max(1, |1 - \beta_i \|k_i\|^2|)$, at most 1 exactly when
# $0 \le \beta_i \|k_i\|^2 \le 2$, and then
# $\|s_i\| \le \|k_j\|$ and
#
# $$
# |(A_r)_{ij}| = |x_i| \le \beta_i \|k_i\|\, \|k_j\| .
# $$
#
# With L2-normalized keys and $\beta \in (0, 1]$ (FLA's convention, and what the models feed), every
# entry of $A_r$ is at most 1 in magnitude, whatever the keys: near-duplicate keys, $\beta \to 1$ and
# any decay are harmless. When $\beta_i \|k_i\|^2 > 2$ a factor has the eigenvalue
# $1 - \beta_i \|k_i\|^2 < -1$ and $A_r$ grows geometrically along the chunk, up to
# $|1 - \beta \|k\|^2|^{C - 1}$ for repeated keys. The gated inverse has the factors
# $e^{g_i} (I - \beta_i k_i k_i^\top)$, so a strong decay damps exactly that growth: the case where the
# two formulations part ways is **unnormalized keys with $\beta \|k\|^2 > 2$, near-duplicate keys and
# strong decay** together.
#
# The experiment, per chunk ($C = 64$, $K = 128$): the matrix that multiplies $W$ (or $V$), i.e.
# $\mathcal{T} \operatorname{diag}(\beta)$, computed gated (solve $I + A$) and gate-free
# ($\Gamma \odot A_b$), both with inputs, products and the result in float32 or bfloat16 (the solve in
# float32, as PyTorch has no bf16 solver and the kernels solve in fp32), against float64 on the same
# rounded inputs.

# %%
def wy_gated(k1, b1, gam, dt):
    """(I + A)^-1 diag(beta) with A, the solve and the result in dt (solve in >= float32)."""
    k1, b1, gam = k1.to(dt), b1.to(dt), gam.to(dt)
    A1 = torch.tril(b1[:, None] * (k1 @ k1.T) * decay_tile(gam), -1)
    work = torch.promote_types(dt, torch.float32)
    eye = torch.eye(len(b1), dtype=work)
    Ti = torch.linalg.solve_triangular(eye + A1.to(work), eye, upper=False, unitriangular=True)
    return (Ti * b1.to(work)[None, :]).to(dt)


def wy_gate_free(k1, b1, gam, dt):
    """(Gamma * A_b, max |A_r|): the gate-free inverse, then the mask, in dt (solve in >= float32)."""
    k1, b1, gam = k1.to(dt), b1.to(dt), gam.to(dt)
    L1 = torch.tril(b1[:, None] * (k1 @ k1.T), -1)
    work = torch.promote_types(dt, torch.float32)
    eye = torch.eye(len(b1), dtype=work)
    A_r1 = torch.linalg.solve_triangular(eye + L1.to(work), eye, upper=False, unitriangular=True)
    Ab1 = (A_r1 * b1.to(work)[None, :]).to(dt)
    return decay_tile(gam) * Ab1, A_r1.abs().max().item()


CK = 128
unit = reference.l2norm(torch.randn(CC, CK, dtype=f64))
one_key = reference.l2norm(torch.randn(1, CK, dtype=f64))
near_dup = reference.l2norm(one_key + 1e-2 * torch.randn(CC, CK, dtype=f64))   # cosines ~ 0.99
beta_typ = torch.sigmoid(torch.randn(CC, dtype=f64))
beta_1 = torch.full((CC,), 0.999, dtype=f64)
g_typ = F.logsigmoid(torch.randn(CC, dtype=f64) + 2.0)
g_strong = torch.full((CC,), -2.0, dtype=f64)
CASES = {  # name: (keys, beta, g)
    "typical (unit keys)": (unit, beta_typ, g_typ),
    "near-duplicate keys": (near_dup, beta_typ, g_typ),
    "near-dup, beta ~ 1": (near_dup, beta_1, g_typ),
    "near-dup, beta ~ 1, g = -2": (near_dup, beta_1, g_strong),
    "unit keys, g = -5": (unit, beta_typ, torch.full((CC,), -5.0, dtype=f64)),
    "|k| = 1.5, near-dup, beta ~ 1": (1.5 * near_dup, beta_1, g_typ),
    "|k| = 2, near-dup, beta ~ 1": (2.0 * near_dup, beta_1, g_typ),
    "|k| = 2, near-dup, b~1, g=-2": (2.0 * near_dup, beta_1, g_strong),
    "|k| = 3, near-dup, b~1, g=-2": (3.0 * near_dup, beta_1, g_strong),
}
print(f"{'case':31s} {'beta|k|^2':>9s} {'dtype':>8s} {'gated err':>10s} {'gate-free':>10s} {'max|A_r|':>9s}")
prec = {}
for name, (k1, b1, g1) in CASES.items():
    gam = torch.cumsum(g1, 0)
    for dt in (torch.float32, torch.bfloat16):
        k_in = k1.to(dt).to(f64)                                # the rounded keys are the input
        truth = wy_gated(k_in, b1, gam, f64)
        e_g = rel_l2(wy_gated(k_in, b1, gam, dt), truth)
        X, m = wy_gate_free(k_in, b1, gam, dt)
        e_f = rel_l2(X, truth)
        prec[name, dt] = (e_g, e_f, m)
        bk2 = (b1 * (k1 * k1).sum(-1)).max().item()
        print(f"{name:31s} {bk2:9.2f} {str(dt).removeprefix('torch.'):>8s} {e_g:10.1e} {e_f:10.1e} {m:9.1e}")
# normalized keys, beta <= 1: |A_r| <= 1 and both formulations are equally accurate
for name in list(CASES)[:5]:
    for dt in (torch.float32, torch.bfloat16):
        e_g, e_f, m = prec[name, dt]
        assert m <= 1 + 1e-2 and e_f < 2 * e_g + 1e-6, (name, dt, prec[name, dt])
assert prec["|k| = 3, near-dup, b~1, g=-2", torch.float32][1] == float("inf")   # gate-free overflows
assert prec["|k| = 3, near-dup, b~1, g=-2", torch.float32][0] < 1e-5            # gated is fine

# %% [markdown]
# With unit keys and $\beta \le 1$ the two formulations are indistinguishable in both dtypes and
# $\max |A_r| = 1$, as the bound says, including near-duplicate keys, $\beta \to 1$ and decay so
# strong that $\Gamma$ underflows. Past $\beta \|k\|^2 = 2$, $\max |A_r|$ grows like
# $|1 - \beta \|k\|^2|^{C-1}$; in float32 the gate-free inverse overflows at $\|k\| = 3$ ($8^{63}
# \approx 10^{57}$), and $\infty \cdot 0$ in the mask gives NaN, while the gated inverse, damped by
# $e^{-2}$ per step, stays accurate. Growth against the key norm, for repeated keys ($\beta = 1$):

# %%
norms = torch.linspace(1.0, 3.2, 23, dtype=f64)
growth = []
for r in norms:
    _, m = wy_gate_free(r * near_dup, torch.ones(CC, dtype=f64), torch.zeros(CC, dtype=f64), f64)
    growth.append(m)
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.semilogy(norms, growth, "o-", ms=3, label=r"max $|A_r|$, near-duplicate keys, $\beta = 1$ (float64)")
ax.semilogy(norms, [max(1.0, abs(1 - r ** 2) ** (CC - 1)) for r in norms.tolist()], "k:",
            label=r"$\max(1, |1 - \|k\|^2|^{C-1})$")
ax.axhline(torch.finfo(torch.float32).max, color="tab:red", lw=1, ls="--")
ax.text(1.0, torch.finfo(torch.float32).max * 3, "float32 max", color="tab:red", fontsize=8)
ax.axvline(2 ** 0.5, color="gray", lw=1, ls="--")
ax.text(2 ** 0.5 + 0.03, 1e10, r"$\beta\|k\|^2 = 2$", fontsize=8, color="gray")
ax.set_xlabel(r"key norm $\|k\|$")
ax.set_ylabel(r"max $|A_r|$")
ax.legend(fontsize=7, loc="upper left")
fig.tight_layout()
assert max(growth[:1]) <= 1 + 1e-9 and growth[-1] > 1e38

# %% [markdown]
# ### The stage's policy
#
# The kernels must give the right answer or fail loudly. What `gate_free_solve.s01` and
# `gdn_fwd.s04` do with inputs outside the safe region, from their docstrings and the tests that pin
# the behavior down (`tests/test_reformulation.py`):

# %%
def stage_file(module):
    return str(inspect.getsourcefile(module)).removeprefix(str(ROOT) + "/")


gfs01, s04, s05 = load("gate_free_solve", 1), load("gdn_fwd", 4), load("gdn_fwd", 5)
POLICY_TESTS = ROOT / "tests" / "test_reformulation.py"
for module in (gfs01, s04):
    paras = [p for p in module.__doc__.split("\n\n") if re.match(r"\s*Precision", p)]
    print(f"== {stage_file(module)}, on precision:\n" + "\n\n".join(paras) + "\n")
tree = ast.parse(POLICY_TESTS.read_text())
print(f"== {POLICY_TESTS.relative_to(ROOT)}\n{ast.get_docstring(tree)}\n")
for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
        on_gpu = any("gpu" in ast.unparse(d) for d in node.decorator_list)
        print(f"   {node.name}" + ("  (GPU)" if on_gpu else "  (CPU)"))

# %% [markdown]
# In short: `gate_free_solve.s01` checks $\beta_i (K K^\top)_{ii} = \beta_i \|k_i\|^2 \le 2$
# (`GROWTH_LIMIT`) on every row of a chunk, reading the diagonal of the $K K^\top$ it already has. A
# (chunk, value head) that fails is solved *with* the gate instead (its $A_b$ slot then holds
# $(I + A)^{-1} \operatorname{diag}(\beta)$, already masked) and flagged; `gdn_fwd.s04` reads the flag
# and skips the mask for that chunk. No error is raised, nothing is synchronized with the host, and
# a flagged chunk costs one more exponential tile in the solve. Chunks of L2-normalized keys with
# $\beta \le 1$ are never flagged.
#
# The policy emulated in float32 PyTorch, on the adversarial inputs that the GPU test feeds to
# s04 (the generator of `tests/test_reformulation.py`, here with one key head, four value heads and
# sequences of 200, 64, 1 and 130 tokens: near-duplicate keys with $\beta \approx 1$;
# the same keys times 3 with $\beta \approx 1$ and a decay of $-3$ to $-4$ a token on odd heads;
# decays up to $-20$ a token), against the float64 reference. The forward is built from the WY
# matrix $\Gamma \odot A_b$ as the kernels would form it, in three ways: gated (s03's math), gate-free
# without the check, gate-free with the policy. The last column is the bound the GPU test holds
# s04 to: twice the error of the same math in bf16 PyTorch.

# %%
from flashqla import testing as adversarial

GROWTH_LIMIT = gfs01.GROWTH_LIMIT


def flagged(k, beta, cu_seqlens):
    """[B, T, HV] bool: the token's chunk has a row with beta ||k||^2 > GROWTH_LIMIT (per value head)."""
    ch = reference.Chunking(beta.shape[0], beta.shape[1], cu_seqlens, C, beta.device)
    growth = beta * reference.expand_heads((k * k).sum(-1, keepdim=True), beta.shape[2])[..., 0]
    per_chunk = (ch.pad(growth) > GROWTH_LIMIT).any(2, keepdim=True)     # [N, NT, 1, HV]
    return ch.unpad(per_chunk.expand(-1, -1, C, -1))


def wy_rows(k, beta, g_cum, cu_seqlens):
    """(I + A)^-1 diag(beta) per token row, as a kernel pipeline forms it: {"gated": s03's solve,
    "gate-free": Gamma * A_b without the check, "policy": gate-free, gated where flagged}."""
    gated = reference.kkt_solve(reference.chunk_kkt(k, g_cum, beta, cu_seqlens), cu_seqlens) \
        * beta_columns(beta, cu_seqlens)
    free = masked_rows(reference.gate_free_solve(k, beta, cu_seqlens), g_cum, cu_seqlens)
    policy = torch.where(flagged(k, beta, cu_seqlens)[..., None], gated, free)
    return {"gated": gated, "gate-free": free, "policy": policy}


def forward_from_wy(x, wy):
    """(o, final state) of the chunked forward with the WY rows wy, in x's dtype."""
    q_, k_, v_, g_, b_, cu_ = (x[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    g_cum_ = reference.chunk_local_cumsum(g_, cu_)
    w_, u_ = reference.chunk_w_u(k_, v_, torch.ones_like(b_), wy, g_cum_, cu_)   # wy diag(e^g) K, wy V
    h_, vn_, hT_ = reference.chunk_h(k_, w_, u_, g_cum_, x["initial_state"], True, cu_)
    return reference.chunk_o(q_, k_, vn_, h_, g_cum_, None, cu_), hT_


print(f"{'inputs':20s} {'flagged':>9s} {'max b|k|^2':>10s}   o err: {'gated':>8s} {'gate-free':>9s} "
      f"{'policy':>8s}   {'bound':>8s}")
policy_errs = {}
for kind in adversarial.ADVERSARIAL:
    x = adversarial.adversarial_inputs(kind, H=1, HV=4, lengths=(200, 64, 1, 130), device="cpu", seed=1)
    x64, x32, x16 = (cast_floats(x, dt) for dt in (f64, torch.float32, torch.bfloat16))
    o64, _ = reference.chunk_gated_delta_rule_ref(**{n: x64[n] for n in NAMES})
    o16, _ = reference.chunk_gated_delta_rule_ref(**{n: x16[n] for n in NAMES})
    g_cum32 = reference.chunk_local_cumsum(x32["g"], x32["cu_seqlens"])
    wys = wy_rows(x32["k"], x32["beta"], g_cum32, x32["cu_seqlens"])
    errs = {how: rel_l2(forward_from_wy(x32, wy)[0], o64) for how, wy in wys.items()}
    fl = flagged(x64["k"], x64["beta"], x64["cu_seqlens"])
    growth = (x64["beta"] * reference.expand_heads((x64["k"] ** 2).sum(-1, keepdim=True), x64["beta"].shape[2])[..., 0]).max()
    bound = 2 * max(rel_l2(o16, o64), 2.0 ** -9)
    policy_errs[kind] = (errs, bound)
    print(f"{kind:20s} {fl.float().mean().item():8.0%}  {growth.item():10.2f}   {errs['gated']:15.1e} "
          f"{errs['gate-free']:9.1e} {errs['policy']:8.1e}   {bound:8.1e}")
for kind, (errs, bound) in policy_errs.items():
    assert errs["policy"] < bound / 10, (kind, errs, bound)     # fp32 math: far inside the bound
assert policy_errs["unnormalized_keys"][0]["gate-free"] == float("inf")   # NaN without the check

# %% [markdown]
# On normalized keys nothing is flagged and all three agree to float32 rounding, including
# near-duplicate keys with $\beta \to 1$ and decays of up to $-20$ a token. On the unnormalized keys,
# every chunk of the odd heads ($\beta \|k\|^2 \approx 9$) is flagged and none of the even ones
# ($\beta \|k\|^2 = 1.8$); without the check the gate-free inverse overflows in the flagged chunks and
# the output is NaN, with the policy it matches the gated forward. On the GPU the same inputs
# run through the kernels themselves (`python3 -m pytest -m gpu tests/test_reformulation.py`), and
# a Hopper machine shows here what the solve flags and how far s04 lands from float64:

# %%
if torch.cuda.is_available() and hopper_gpu_missing() is None:
    from flashqla.testing import check_op

    for kind in adversarial.ADVERSARIAL:
        x = adversarial.adversarial_inputs(kind, device="cuda", seed=1)
        g_cum_gpu = load("chunk_local_cumsum", 1).run(x["g"], x["cu_seqlens"])
        _, gated_flags = gfs01.solve(x["k"], x["beta"], g_cum_gpu, x["cu_seqlens"])
        checks = check_op("gdn_fwd", s04.run, x)
        print(f"{kind:20s} flagged {int(gated_flags.sum())} of {gated_flags.numel()} (chunk, head); "
              + "; ".join(f"{c.output} err {c.err:.1e} (bound {c.bound:.1e})" for c in checks))
else:
    print(f"No Hopper GPU here ({hopper_gpu_missing()}): run `python3 -m pytest -m gpu "
          "tests/test_reformulation.py` on the GPU machine for the kernels themselves.")

# %% [markdown]
# ### What the kernels' roundings cost, inside the safe region
#
# The tables above round the WY matrix once; the kernels round every operand of every product to
# bf16 and accumulate in fp32. A CPU emulation of both pipelines, chunk by chunk for one sequence,
# with those roundings at the places where the kernels put them (`bf` marks a value stored in bf16):
#
# - s03's path: $A$ and its inverse in fp32; $w = \mathrm{bf}(\mathcal{T} \operatorname{diag}(\beta e^\gamma)) K$
#   and $u$ stored in bf16; $\tilde V = u - w\, \mathrm{bf}(S)$;
# - s04's path: $A_b = \mathrm{bf}(A_r \operatorname{diag}\beta)$;
#   $W = \mathrm{bf}(V - D K\, \mathrm{bf}(S))$; $\tilde V = \mathrm{bf}(\Gamma \odot A_b)\, W$;
#
# and then the same output and state update for both, against the float64 reference on the same
# bf16 inputs, next to the error of the whole reference run in bf16 PyTorch (the GPU test's bound is
# twice that). The problems: the test generator's gates on random unit keys, and the adversarial
# near-duplicate keys with $\beta \approx 1$; one sequence of 512 tokens, four value heads.

# %%
def bf(x):
    """x rounded to bf16, computed on in fp32: a value a kernel stores in bf16."""
    return x.to(torch.bfloat16).float()


def emulate_kernels(x, path):
    """(o, final state) of one sequence (B = 1) with the roundings of s03's ("s03") or s04's ("s04")
    kernels: bf16 operands of every product, fp32 accumulation, fp32 state."""
    hv = x["v"].shape[2]
    q_, k_ = (reference.expand_heads(x[n], hv)[0].float().transpose(0, 1) for n in ("q", "k"))  # [HV, T, K]
    v_ = x["v"][0].float().transpose(0, 1)                                                       # [HV, T, V]
    g_cum_ = reference.chunk_local_cumsum(x["g"].float()).transpose(1, 2)[0]                       # [HV, T]
    b_ = x["beta"][0].float().T
    S, outs, scale = x["initial_state"][0].float().clone(), [], q_.shape[-1] ** -0.5
    for s in range(0, q_.shape[1], C):
        e = min(s + C, q_.shape[1])
        Qc, Kc, Vc, gam, bc = q_[:, s:e], k_[:, s:e], v_[:, s:e], g_cum_[:, s:e], b_[:, s:e]
        eye = torch.eye(e - s)
        G = torch.stack([decay_tile(x_) for x_ in gam])                 # [HV, n, n], exponents <= 0
        KK = Kc @ Kc.transpose(1, 2)
        Sb = bf(S)
        if path == "s03":
            Ai_ = torch.linalg.solve_triangular(eye + torch.tril(bc[..., None] * KK * G, -1), eye, upper=False)
            w_ = bf(bf(Ai_ * (bc * torch.exp(gam))[:, None, :]) @ Kc)
            u_ = bf(bf(Ai_ * bc[:, None, :]) @ Vc)
            Vt = u_ - w_ @ Sb
        else:
            A_r_ = torch.linalg.solve_triangular(eye + torch.tril(bc[..., None] * KK, -1), eye, upper=False)
            W_ = bf(Vc - torch.exp(gam)[..., None] * (Kc @ Sb))
            Vt = bf(G * bf(A_r_ * bc[:, None, :])) @ W_
        P = bf(scale * (Qc @ Kc.transpose(1, 2)) * G)
        outs.append(bf(scale * torch.exp(gam)[..., None] * (Qc @ Sb) + P @ bf(Vt)))
        Vd = bf(Vt * torch.exp(gam[:, -1:] - gam)[..., None])
        S = torch.exp(gam[:, -1])[:, None, None] * S + Kc.transpose(1, 2) @ Vd
    return torch.cat(outs, 1).transpose(0, 1)[None], S[None]


EMUL = {"test gates, unit keys": Problem(1, 4, (512,)).inputs(seed=2),
        "near-duplicate keys": adversarial.adversarial_inputs("near_duplicate_keys", H=1, HV=4, lengths=(512,),
                                                              device="cpu", seed=2)}
print(f"{'problem':24s} {'output':12s} {'s03 path':>9s} {'s04 path':>9s} {'bf16 ref':>9s}")
emul = {}
for name, x in EMUL.items():
    x64, x16 = cast_floats(x, f64), cast_floats(x, torch.bfloat16)
    want = reference.chunk_gated_delta_rule_ref(**{n: x64[n] for n in NAMES})
    ref16 = reference.chunk_gated_delta_rule_ref(**{n: x16[n] for n in NAMES})
    got = {p: emulate_kernels(x, p) for p in ("s03", "s04")}
    for i, out in enumerate(("o", "final state")):
        emul[name, out] = [rel_l2(got[p][i], want[i]) for p in ("s03", "s04")] + [rel_l2(ref16[i], want[i])]
        print(f"{name:24s} {out:12s} " + " ".join(f"{e:9.1e}" for e in emul[name, out]))
for (name, out), (e3, e4, e16) in emul.items():
    assert e4 < 2 * max(e16, 2.0 ** -9), (name, out, e3, e4, e16)   # inside the GPU test's bound
    assert abs(e4 / e3 - 1) < 0.2, (name, out, e3, e4)                # the two paths agree

# %% [markdown]
# Within the safe region the reformulation costs no accuracy that this emulation can see: the two
# paths agree to within 20 %, at about the error of the bf16 reference itself, on random keys and
# on near-duplicate ones. Rounding $\Gamma \odot A_b$ to bf16 loses no more than rounding $w$ and $u$,
# which were products of the same (rounded) triangular matrix.

# %% [markdown]
# ## 4. The stages
#
# The display helpers of chapter 3: the kernel-building functions of a stage (those that return a
# `T.prim_func`), and per instruction of interest, how many lines of the generated CUDA hold it and
# the first such line. Two more patterns than in chapter 3: `setmaxnreg` (`tl::warpgroup_reg_alloc` /
# `_dealloc`), which moves registers between warpgroups, and named mbarriers. `T.Pipelined` already
# emits one `setmaxnreg` pair for the producer / consumer split it makes by itself (s03, s04); s05
# writes its roles out and sets each one's budget.

# %%
def kernel_builders(module):
    """The functions of a stage file that build a T.prim_func: the kernels TileLang compiles."""
    return [f for f in vars(module).values()
            if inspect.isfunction(f) and f.__module__ == module.__name__
            and "@T.prim_func" in inspect.getsource(f)]


def show_kernel(module):
    """Print the kernel-building function(s) of a stage, or its run() when it builds no kernel."""
    for f in kernel_builders(module) or [module.run]:
        print(inspect.getsource(f))


FEATURES = (  # (what it is, a pattern matched against each line of the generated CUDA)
    ("wgmma: a warpgroup issues a tensor-core MMA", r"tl::wgmma_\w+<"),
    ("wgmma: wait for issued MMAs", r"tl::warpgroup_wait<"),
    ("TMA load (cp.async.bulk.tensor)", r"tl::tma_load\(|cp\.async\.bulk"),
    ("TMA store", r"tl::tma_store\("),
    ("mbarrier wait", r"\]\.wait\("),
    ("mbarrier arrive / expect bytes", r"\]\.(arrive|arrive_and_expect_tx|expect_transaction)\("),
    ("setmaxnreg (warpgroup_reg_alloc / dealloc)", r"warpgroup_reg_(alloc|dealloc)<"),
    ("fence.proxy.async (generic stores -> TMA / wgmma reads)", r"fence_proxy_async\("),
    ("exp2f (PTX ex2.approx.f32)", r"exp2f\("),
    ("__syncthreads", r"__syncthreads\(\)"),
)


# %% [markdown]
# ### `gate_free_solve.s01`

# %%
print(gfs01.__doc__)
show_kernel(gfs01)
cuda_excerpt(gfs01.kernel_source(), FEATURES)

# %% [markdown]
# ### `gdn_fwd.s04`: the fused kernel without $w$ and $u$

# %%
print(s04.__doc__)
show_kernel(s04)
cuda_excerpt(s04.kernel_source(), FEATURES)

# %% [markdown]
# ### `gdn_fwd.s05`: warp specialization
#
# s05 keeps s03's math and preparation ($w$ and $u$ from the sub-op stages) and reorganizes the fused
# kernel. s03 used `T.Pipelined`: a producer warpgroup, and consumer warpgroups that run the whole of
# every chunk, chain and output, one product after the other. s05 writes four roles out by hand, one
# warpgroup (128 threads) each, in thread order, selected by ONE `if` / `elif` chain on the thread
# index:
#
# | role | per chunk $c$ |
# |---|---|
# | chain | owns the state $S$ (fp32, in its registers): $\tilde V_c = U - W S_c$, then $S \leftarrow e^{\gamma_C} S + K^\top \operatorname{diag}(e^{\gamma_C - \gamma}) \tilde V_c$ |
# | scores | $P_c = s\,(Q K^\top \odot \Gamma)$, lower triangle including the diagonal: it needs no state, so it runs ahead |
# | output | $O_c = s \operatorname{diag}(e^{\gamma}) Q S_c + P_c \tilde V_c$, stored straight from its registers |
# | producer | the $q$, $k$, $w$, $u$ tiles by TMA, and $\log_2(e)\,\gamma$ into the stage's gate buffer |
#
# The roles hand tiles, states and scores to each other through shared memory, ordered by
# mbarriers, and `setmaxnreg` gives the producer's registers to the roles that hold accumulators.
# The docstring tells how the stage got there, measurement by measurement: a first version with three
# roles (chain | output | producer) was no faster than s03; timing it with one role's math removed
# showed the output warpgroup to be the long one, its score tile compiled to divergent branches
# around `exp2f`, and fixing that and giving the scores a warpgroup of their own made this stage.

# %%
print(s05.__doc__)
show_kernel(s05)
cuda_excerpt(s05.kernel_source(), FEATURES)

# %% [markdown]
# ### The budget of s05: shared memory, registers, barriers
#
# A warp-specialized CTA must fit four roles in one SM: all their shared-memory buffers (up to
# 227 KiB per CTA on Hopper) and all their registers (65536 per SM; a warpgroup's `setmaxnreg`
# budget applies to each of its 128 threads). The tables below are read from the stage's kernel
# source and constants, so they follow the stage: every `T.alloc_shared`, `T.alloc_fragment` and
# `T.alloc_barrier` with its shape evaluated, the roles that touch it (a role's code runs from the
# branch that selects it to the next one), each role's threads and register budget. They are then
# checked against the two tables of the docstring, whose "used" column of registers was read from
# the SASS.

# %%
def role_blocks(src):
    """{register-budget constant: (the role's branch condition, its code up to the next role's branch)}."""
    blocks, current = {}, None
    lines = src.splitlines()
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


def buffers(module, kind):
    """[(name, shape, dtype, bytes)] of every T.alloc_<kind> in the stage's kernel, shapes evaluated."""
    src = inspect.getsource(kernel_builders(module)[0])
    names = {n: v for n, v in vars(module).items() if n.isupper() and isinstance(v, int)}
    names.update(C=module.CHUNK_SIZE, BV=module.BLOCK_V, **{d: module.DEFAULT_SHAPE[d] for d in "KV"})
    out = []
    for name, shape, dtype in re.findall(rf"(\w+) = T\.alloc_{kind}\(\(([^)]*)\),\s*\"(\w+)\"\)", src):
        dims = tuple(eval(x, {}, names) for x in shape.split(",") if x.strip())
        size = 1
        for d in dims:
            size *= d
        out.append((name, dims, dtype, size * (2 if "16" in dtype else 4)))
    return out, role_blocks(src), src


def doc_rows(doc, first, second=r".*"):
    """The rows of a docstring table (columns split at runs of 2+ spaces) whose first two columns match."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in doc.splitlines()]
    return [r for r in rows if len(r) > 2 and re.fullmatch(first, r[0]) and re.fullmatch(second, r[1])]


def doc_numbers(doc, pattern):
    """The groups of pattern in a docstring (whitespace normalized); a ValueError when it no longer says it."""
    m = re.search(pattern, " ".join(doc.split()))
    if m is None:
        raise ValueError(f"the docstring no longer says {pattern!r}")
    return m.groups()


def thread_range(cond, module):
    """[lo, hi) of a role from its branch condition, e.g. 'elif tx >= CHAIN_END and tx < SCORES_END:'."""
    lo = re.search(r"tx >= (\w+)", cond)
    hi = re.search(r"tx < (\w+)", cond)
    return (getattr(module, lo.group(1)) if lo else 0, getattr(module, hi.group(1)) if hi else module.THREADS)


smem, roles, src05 = buffers(s05, "shared")
frags, _, _ = buffers(s05, "fragment")
ROLE = {budget: budget.removeprefix("REGS_").lower() for budget in roles}   # REGS_CHAIN -> "chain"
print(f"{'shared buffer':13s} {'shape':14s} {'dtype':9s} {'KiB':>6s}  used by")
for name, dims, dtype, nbytes in smem:
    users = [ROLE[r] for r, (_, body) in roles.items() if re.search(rf"\b{name}\b", body)]
    print(f"{name:13s} {str(dims):14s} {dtype:9s} {nbytes / 1024:6.1f}  {', '.join(users)}")
BARRIERS = re.findall(r"(\w+) = T\.alloc_barrier\(\[([^\]]*)\] \* (\w+)\)\s*#\s*(.*)", src05)
n_bar = sum(getattr(s05, slots) for _, _, slots, _ in BARRIERS)
total = sum(b for *_, b in smem) + 8 * n_bar
print(f"{'mbarriers':13s} {n_bar} x 8 B")
print(f"total {total / 1024:.1f} KiB of the 227 KiB a CTA may use: one CTA per SM\n")

# the docstring's shared-memory table, row by row, against the kernel source
smem_bytes = {name: nbytes for name, _, _, nbytes in smem}
doc_smem = doc_rows(s05.__doc__, r"\w+_s(?:, \w+_s)*(?: \(.*\))?")
for row in doc_smem:
    names = re.findall(r"\w+_s\b", row[0].split(" (")[0])
    assert abs(sum(smem_bytes[n] for n in names) / 1024 - float(row[2])) < 0.05, row
assert {n for row in doc_smem for n in re.findall(r"\w+_s\b", row[0].split(" (")[0])} == set(smem_bytes)
doc_total, doc_limit = doc_numbers(s05.__doc__, r"Shared memory \((\d+) KB of (\d+)\)")
assert abs(total / 1024 - int(doc_total)) < 1 and int(doc_limit) == 227, (total, doc_total)

print(f"{'barrier':17s} {'slots':>5s} {'arrivals':>8s}  {'arrive':24s} {'wait':24s} source comment")
for bar, count, slots, comment in BARRIERS:
    arrive = [ROLE[r] for r, (_, body) in roles.items() if re.search(rf"barrier_arrive\({bar}\[", body)]
    wait = [ROLE[r] for r, (_, body) in roles.items() if re.search(rf"barrier_wait\({bar}\[", body)]
    needed = eval(count, {}, vars(s05))
    # every thread of each arriving role arrives once: the count is that many warpgroups
    assert needed == s05.WARPGROUP * len(arrive), (bar, needed, arrive)
    print(f"{bar:17s} {getattr(s05, slots):5d} {needed:8d}  {', '.join(arrive):24s} {', '.join(wait):24s} "
          f"{comment}")
print()

# the roles: threads, register budget, fp32 fragments; against the docstring's table
doc_roles = {r[0]: r for r in doc_rows(s05.__doc__, "|".join(ROLE.values()), r"\[\d+, \d+\)")}
print(f"{'role':9s} {'threads':>10s} {'setmaxnreg':>10s} {'used':>5s}  {'fp32 fragments (regs / thread)':34s} "
      f"{'registers':>9s}")
reg_total = 0
for budget, (cond, body) in roles.items():
    role, nreg = ROLE[budget], getattr(s05, budget)
    lo, hi = thread_range(cond, s05)
    _, doc_threads, doc_nreg, doc_used, _ = doc_roles[role]
    assert doc_threads == f"[{lo}, {hi})" and int(doc_nreg) == nreg, (role, doc_roles[role], lo, hi, nreg)
    mine_f = [(n, b // 4 // s05.WARPGROUP) for n, dims, dt, b in frags if re.search(rf"\b{n}\b", body)]
    reg_total += nreg * (hi - lo)
    desc = ", ".join(f"{n} {r}" for n, r in mine_f) or "-"
    print(f"{role:9s} {f'[{lo}, {hi})':>10s} {nreg:10d} {doc_used:>5s}  "
          f"{desc + f' (sum {sum(r for _, r in mine_f)})':34s} {nreg * (hi - lo):9d}")
at_launch = 65536 // s05.THREADS
print(f"{'total':9s} {s05.THREADS:10d} {'':10s} {'':5s}  {'':34s} {reg_total:9d} of 65536 "
      f"(at launch ptxas gives each thread 65536 / {s05.THREADS} = {at_launch})")
assert set(doc_roles) == set(ROLE.values())
assert total <= 227 * 1024 and reg_total <= 65536

# %% [markdown]
# The tile stages, `NUM_STAGES` copies of the $q$, $k$, $w$ and $u$ tiles and of the gates, take most
# of the shared memory. The hand-off slots, `NUM_HANDOFF` copies of $S_c$ (bf16) and $\tilde V_c$ from
# the chain and of $P_c$ from the scores warpgroup, let those two roles write chunk $c + 1$'s while the
# output warpgroup still reads chunk $c$'s; `vd_s`, the decayed copy of $\tilde V$ that the state
# update reads, is the chain's alone. No two buffers share an address: TileLang's planner treats the
# role branches as if they ran one after another and gave two roles' buffers one address, so the
# stage turns shared-memory reuse off (`tl.disable_shared_memory_reuse`).
#
# Registers: with 512 threads, every thread starts with 128; `setmaxnreg` then moves them within that
# pool of $4 \times 128$ a thread. The producer, which holds only addresses, keeps a few; the chain,
# which keeps the fp32 state ($K \times B_V / 128 = 64$ registers a thread) and $\tilde V$ in both
# forms, gets the most; scores and output each hold one $64 \times 64$ fp32 tile. The SASS uses fewer
# registers than every budget (the "used" column): a budget is a ceiling ptxas compiles the role
# under, not what it spends.
#
# Six barriers, each with one copy per stage or slot: `bar_tiles_full` (the producer's loads have
# landed) and `bar_tiles_empty` (all three consumers are done with the stage), and a ready / free
# pair for each hand-off: `bar_state_ready` / `bar_state_free` between chain and output,
# `bar_scores_ready` / `bar_scores_free` between scores and output.
#
# ### The pipeline, as a timeline
#
# Per chunk $c$: tile stage $s = c \bmod$ `NUM_STAGES`, hand-off slot $b = c \bmod$ `NUM_HANDOFF`. A
# barrier completes a phase when all its arrivals are in (and, for `bar_tiles_full`, the bytes the
# TMA loads announced); a wait names the phase by its parity, so `barrier_wait(bar[s], (c // n) % 2)`
# waits for chunk $c$'s arrivals, and `(c // n) % 2 ^ 1` for those of chunk $c - n$, the previous user
# of the same slot (it passes at once for the first $n$ chunks). Each role's loop, its
# synchronization and products in program order, read from the kernel source:

# %%
SYNC_OPS = (  # (kind, pattern) for the lines of a role's loop that the pipeline is made of
    ("wait", r"T\.barrier_wait\((\w+)\[(\w)\], \(c // (\w+)\) % 2( \^ 1)?\)"),
    ("arrive", r"T\.barrier_arrive\((\w+)\[(\w)\]\)"),
    ("tma", r"T\.tma_copy\((\w+)\[.*barrier=(\w+)\[(\w)\]\)"),
    ("mma", r"T\.(gemm|wgmma_gemm)\((\w+)(?:\[[^\]]*\])?, (\w+)(?:\[[^\]]*\])?, (\w+)"),
    ("wait_mma", r"T\.wait_wgmma\("),
    ("fence", r"T\.fence_proxy_async\("),
    ("store", r"T\.copy\((\w+_f), (\w+_s)\b"),
)
SHAPES = {name: dims for name, dims, _, _ in smem + frags}
SLOT_OF = {var: mod for var, mod in re.findall(r"(\w) = c % (\w+)", src05)}     # s -> NUM_STAGES, ...


def mma_flops(a, b, c_frag, line):
    """2 M N K of a product into the fragment c_frag; A sliced by a stage / slot index loses its first dim."""
    a_dims = SHAPES[a][1:] if re.search(rf"\b{a}\[", line) else SHAPES[a]
    m, n = SHAPES[c_frag]
    return 2 * m * n * (a_dims[0] * a_dims[1] // m)


def program(body):
    """The ops of a role's chunk loop, in program order."""
    loop = body.split("for c in T.serial(num_chunks):", 1)[1]
    ops = []
    for line in loop.splitlines():
        for kind, pattern in SYNC_OPS:
            m = re.search(pattern, line)
            if m:
                ops.append((kind, *m.groups(), line.strip()))
    return ops


PROGRAMS = {ROLE[budget]: program(body) for budget, (_, body) in roles.items()}
for role, ops in PROGRAMS.items():
    print(f"{role}:")
    for op in ops:
        kind, *args, line = op
        if kind == "wait":
            bar, var, mod, prev = args
            assert SLOT_OF[var] == mod, (bar, var, mod)          # the parity counts uses of that slot
            what, note = f"{bar}[{var}]", f"chunk c - {mod}'s arrivals" if prev else "chunk c's arrivals"
        elif kind == "arrive":
            what, note = f"{args[0]}[{args[1]}]", ""
        elif kind == "tma":
            what, note = f"{args[0]} tile", f"its bytes counted by {args[1]}[{args[2]}]"
        elif kind == "mma":
            op_, a, b, c_ = args
            what = f"{a} x {b} -> {c_}"
            note = f"{mma_flops(a, b, c_, line) / 1e6:.2f} MFLOP" + ("" if op_ == "gemm" else ", issued, not waited for")
            kind = "wgmma"
        elif kind == "wait_mma":
            kind, what, note = "wait", "the issued wgmma", ""
        elif kind == "fence":
            kind, what, note = "fence", "proxy.async", "the stores above become visible to wgmma"
        else:
            what, note = f"{args[0]} -> {args[1]}", "in bf16"
        print(f"    {kind:7s} {what:24s} {note}")

# %% [markdown]
# Read as a protocol, per chunk $c$:
#
# - **producer**: waits until the three consumers have released stage $s$ (chunk $c - 2$), issues the
#   TMA loads, writes the gates, and arrives on `bar_tiles_full[s]`, which completes once the loads'
#   bytes have landed too.
# - **chain**: waits for the tiles and for the output warpgroup to have freed slot $b$; stores $S_c$
#   in bf16 (the operand of $W S_c$ here and of $Q S_c$ in the output warpgroup), computes
#   $W S_c$, then $\tilde V_c$ and its decayed copy; issues the state update $K^\top \tilde V_d$
#   without waiting for it, and meanwhile stores $\tilde V_c$, fences and arrives on
#   `bar_state_ready[b]`; then waits for the update and releases the stage.
# - **scores**: waits for the tiles and a free slot, computes $P_c$ and releases the stage at once
#   (it no longer reads the tiles), then stores $P_c$, fences and arrives on `bar_scores_ready[b]`.
# - **output**: waits for the tiles and $S_c$; computes $Q S_c$ and releases the stage (from here on
#   it reads only the hand-off slots); waits for $P_c$, computes $P_c \tilde V_c$, frees both slots,
#   stores $O_c$.
#
# The fence matters: the hand-off tiles are written by ordinary stores (the generic proxy) and read
# by another warpgroup's wgmma (the async proxy), so each writer fences before it arrives.
#
# A small event simulation runs these programs as they are listed. Its durations are napkin
# figures: every product costs what the chain's two products cost per FLOP when the chain ran alone
# (the docstring's measurement); the producer's loads take the bytes a CTA brings from DRAM per chunk
# at an SM's share of the copy roof, counting the $q$ and $k$ tiles of a key head once for its
# $H_V / H$ value heads and the tiles both $V$-tile CTAs read once (the rest come from L2); stores,
# fences and elementwise work take no time, and the roles do not slow each other down. s03 for
# contrast: the same loads, and its consumers' measured time per chunk (its docstring), all in one
# role.

# %%
doc03, doc05 = load("gdn_fwd", 3).__doc__, s05.__doc__
s03_chunk_us = float(doc_numbers(doc03, r"about ([\d.]+) us per chunk")[0])
chain_ms, chain_h, chain_hv, chain_us = doc_numbers(doc05, r"chain alone ([\d.]+) ms at \((\d+), (\d+)\) \(([\d.]+) us a chunk\)")
chunk_lo, chunk_hi = (float(x) for x in doc_numbers(doc05, r"A chunk now takes ([\d.]+)-([\d.]+) us"))
chain_flops = sum(mma_flops(*op[2:5], op[-1]) for op in PROGRAMS["chain"] if op[0] == "mma")
US_PER_FLOP = float(chain_us) / chain_flops

bv5 = s05.BLOCK_V
n_vt = VC // bv5                                                      # CTAs per value head
qk_share = 2 * CC * KC * BF16 * H_L / HV_L / n_vt                     # q and k tiles, per CTA
cta_bytes = {"s05": qk_share + CC * KC * BF16 / n_vt + CC * bv5 * BF16 + CC * FP32 / n_vt,   # + w, u, g
             "s04": qk_share + CC * bv5 * BF16 + CC * CC * BF16 / n_vt + CC * FP32 / n_vt}   # + v, A_b, g
LOAD_US = cta_bytes["s05"] / (rates["HBM byte"] / SMS) * 1e6
print(f"chain alone: {chain_us} us a chunk for {chain_flops / 1e6:.2f} MFLOP -> {US_PER_FLOP * 1e6:.2f} us "
      f"per MFLOP, every role's products at that rate")
print(f"DRAM bytes a CTA loads per chunk at (H, HV) = ({H_L}, {HV_L}): {cta_bytes['s05'] / 1024:.1f} KiB "
      f"(q, k, w, u, g: s03, s05); {cta_bytes['s04'] / 1024:.1f} KiB with s04's v and A_b; "
      f"{LOAD_US:.2f} us at 1/{SMS} of the copy roof")


def simulate_s05(n):
    """Run the roles' programs for n chunks: bars [(role, t0, t1, label, chunk)], arrows
    [(t, from role, to role, chunk)] where a wait held a role up, and the time each chunk's loop ended."""
    need = {bar: eval(count, {}, vars(s05)) // s05.WARPGROUP for bar, count, _, _ in BARRIERS}
    arrivals, tx_end = {}, {}            # (barrier, chunk) -> [(time, role)]; the loads' end
    st = {role: dict(c=0, pc=0, t=0.0, mma_end=0.0) for role in PROGRAMS}
    bars, arrows, chunk_end, copy_free = [], [], {}, 0.0

    def completed(bar, c):
        got = arrivals.get((bar, c), [])
        if len(got) < need[bar]:
            return None
        return max(got + ([tx_end[bar, c]] if (bar, c) in tx_end else []))

    while any(s["c"] < n for s in st.values()):
        progress = False
        for role, ops in PROGRAMS.items():
            s = st[role]
            while s["c"] < n:
                kind, *args, line = ops[s["pc"]]
                c = s["c"]
                if kind == "wait":
                    bar, var, mod, prev = args
                    src = c - getattr(s05, mod) if prev else c
                    if src >= 0:
                        done = completed(bar, src)
                        if done is None:
                            break                                   # blocked until the arrivals are in
                        if done[0] > s["t"]:
                            arrows.append((done[0], done[1], role, c))
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
                    t1 = s["t"] + mma_flops(a, b, c_, line) * US_PER_FLOP
                    bars.append((role, s["t"], t1, f"{a[:-2]}·{b[:-2]}", c))
                    if op_ == "gemm":
                        s["t"] = t1
                    else:
                        s["mma_end"] = t1
                elif kind == "wait_mma":
                    s["t"] = max(s["t"], s["mma_end"])
                progress = True
                s["pc"] += 1
                if s["pc"] == len(ops):
                    chunk_end[c] = max(chunk_end.get(c, 0.0), s["t"])
                    s["pc"], s["c"] = 0, c + 1
        if not progress:
            raise RuntimeError("the roles' programs deadlock: " + str(st))
    return bars, arrows, chunk_end


def simulate_s03(n):
    """s03: a producer (the same loads, NUM_STAGES stages) and consumers that do a whole chunk in turn."""
    bars, arrows, chunk_end, t_prod, t_cons = [], [], {}, 0.0, 0.0
    for c in range(n):
        t0 = max(t_prod, chunk_end.get(c - s05.NUM_STAGES, 0.0))
        t_prod = t0 + LOAD_US
        bars.append(("producer", t0, t_prod, "TMA", c))
        start = max(t_cons, t_prod)
        t_cons = chunk_end[c] = start + s03_chunk_us
        bars.append(("consumers", start, t_cons, "", c))
    return bars, arrows, chunk_end


N_SIM = 8
fig, axes = plt.subplots(2, 1, figsize=(13, 5.2), sharex=True, gridspec_kw=dict(height_ratios=[2, 4]))
cmap = plt.get_cmap("tab10")
steady = {}
for ax, (name, sim, rows_) in zip(axes, (("s03: producer + consumers doing everything", simulate_s03,
                                           ["producer", "consumers"]),
                                          ("s05: producer, chain, scores and output warpgroups", simulate_s05,
                                           ["producer", *[r for r in PROGRAMS if r != "producer"]]))):
    bars, arrows, ends = sim(N_SIM)
    ys = {r: len(rows_) - 1 - i for i, r in enumerate(rows_)}
    for row, t0, t1, label, c in bars:
        ax.barh(ys[row], t1 - t0, left=t0, height=0.6, color=cmap(c % 10), alpha=0.75, edgecolor="k", lw=0.5)
        ax.text((t0 + t1) / 2, ys[row], label or f"chunk {c}", ha="center", va="center", fontsize=6)
    for t, r0, r1, _ in arrows:
        ax.annotate("", xy=(t, ys[r1]), xytext=(t, ys[r0]), arrowprops=dict(arrowstyle="->", lw=0.6, color="gray"))
    ax.set_yticks(list(ys.values()), list(ys))
    ax.set_title(name, fontsize=9)
    steady[name[:3]] = (ends[N_SIM - 1] - ends[1]) / (N_SIM - 2)
axes[1].set_xlabel("time (us), napkin durations; one color per chunk; arrows: a wait that held a role up; "
                   "w·h = W S_c, k·vd = K^T V~_d, q·k = Q K^T, q·h = Q S_c, p·vn = P V~", fontsize=8)
fig.tight_layout()
waits = {}
for t, r0, r1, c in simulate_s05(N_SIM)[1]:
    waits.setdefault(f"{r1} <- {r0}", []).append(c)
print(f"steady state: s03 {steady['s03']:.2f} us per chunk (its measured time), s05 {steady['s05']:.2f} us "
      f"per chunk in the timeline; measured (s05's docstring) {chunk_lo}-{chunk_hi} us")
print("who held whom up in the s05 timeline, at which chunks:", waits)
assert waits["chain <- producer"] == [0] and not any(w.startswith("chain <- ") and w != "chain <- producer"
                                                     for w in waits)   # the chain waits for its first tiles only

# %% [markdown]
# In the timeline the chain sets the pace: it waits only for its first tiles, because the scores
# warpgroup (which needs no state) runs a chunk ahead, the output warpgroup finishes chunk $c$ while
# the chain works on $c + 1$, and the second hand-off slot gives it that time. A chunk then costs the
# chain's two products, and the producer, whose DRAM share per chunk takes well under a chunk's time,
# is idle most of the time: the loads are not the next limit.
#
# The measured kernel is slower than this timeline: 2.3-2.4 us a chunk against the chain's 1.4 us
# alone (the docstring), so the roles do slow each other down. What the timeline leaves out is what
# they share: one SM's four tensor cores (a warpgroup has one warp on each of the four sub-partitions,
# so every role's wgmma runs on the same units), its issue slots and shared-memory bandwidth, and the
# elementwise work (the score tile's exponentials, the masks, the bf16 conversion of every hand-off).
# Section 5's Nsight Compute numbers show the kernel far from any throughput limit and still stalled
# on latency.
#
# s04's math would fit into the chain's block (the docstring marks it "chain math"): the producer would
# load $v$ and $A_b$ instead of $w$ and $u$ (the cell above prints both sizes), and the chain would
# have one more dependent product ($U = K S$, then $(\Gamma \odot A_b) W$, then the update), in the role
# that sets the pace.
#
# ### `gdn_fwd.s07`: s04's math in s05's roles
#
# s07 does that, with one change of place: $WY = \Gamma \odot A_b$ needs no state, only the gates,
# $A_b$ and the solve's `gated` flag, so the scores warpgroup builds it (it already builds the
# $\Gamma$ tile for $P$, and runs ahead of the chain) and hands it to the chain through two more slots
# and their own barrier pair, `bar_wy_ready` / `bar_wy_free`. The chain's per-chunk path is then
# three products ($K S$, $WY\,W$, $K^\top V_d$) and the same elementwise work as s05's chain. The
# preparation is s04's (the cumsum and the gate-free solve: no $w$, $u$ round trip through HBM). Its
# docstring has the budget (193 KB of shared memory, the same register split as s05) and the
# measured effect; section 5 reads the benchmark.

# %%
s07 = load("gdn_fwd", 7)
print(s07.__doc__)
show_kernel(s07)
cuda_excerpt(s07.kernel_source(), FEATURES)

# %% [markdown]
# ## 5. Measured effect
#
# `python -m flashqla bench` times every `gdn_fwd` stage, FLA, FlashQLA and the library's entry point
# `flashqla.chunk_gated_delta_rule`, all rows of a problem in one process on the GPU machine
# (chapter 3 explains the method), and writes `profiles/results/gdn_fwd.csv`. The committed file holds all
# eight head layouts, timed on a 4 x H100 host, one process per GPU and one or two head layouts
# (some problems in a second call; all rows of a problem in one process). This chapter reads two of
# them, (16, 64) and (16, 32), each with one sequence of 2048, 8192 or 32768 tokens and two varlen
# batches. The rows of this chapter's
# stages next to s03, the entry point (the promoted path when these rows were timed: cumsum,
# gate-free solve, the fused kernels of s12 and s16, AutoCP as in s08) and the two peers, in ms:

# %%
s03 = load("gdn_fwd", 3)
COLS = {f"s0{n}": "gdn_fwd/" + Path(m.__file__).stem for n, m in ((3, s03), (4, s04), (5, s05), (7, s07))}
COLS.update(API=bench.API_ROW, FLA=bench.FLA_ROW, FlashQLA=bench.FLASHQLA_ROW)
# the run that timed this chapter's stages (02d7c5e), kept apart in `gdn_fwd_chapter4.csv` since later
# runs replaced its API and peer rows in `gdn_fwd.csv`; already at the time of the snapshot, runs had
# re-timed the API and the peers on (16, 32) (commit e7a917b) and on (16, 64) 1x2048 (98a6f05), so
# there this table has the stages and no API or peers
CHAPTER_CSV = bench.RESULTS / "gdn_fwd_chapter4.csv"
rows = [r for r in bench.read_csv(CHAPTER_CSV) if r["problem"].startswith(("(16, 64)", "(16, 32)"))]
stage_run = {r["problem"]: r["commit"] for r in rows if r["impl"] == COLS["s03"]}
rows = [r for r in rows if r["commit"] == stage_run[r["problem"]]]
ms_of = {(r["problem"], r["impl"]): float(r["ms"]) for r in rows if r["ms"]}
problems = list(dict.fromkeys(r["problem"] for r in rows))
table = {p: {col: ms_of.get((p, impl)) for col, impl in COLS.items()} for p in problems}
assert all(t[c] is not None for t in table.values() for c in ("s03", "s04", "s05", "s07"))  # every stage cell
with_peers = {p: t for p, t in table.items() if None not in t.values()}             # and the API, FLA, FlashQLA
assert list(with_peers) == [p for p in problems if p.startswith("(16, 64)") and p != "(16, 64) 1x2048"]
assert len({r["gpu"] for r in rows}) == 1                                         # one card type
methods = {r["method"] for r in rows if r["impl"] in COLS.values()}
print(f"{CHAPTER_CSV.relative_to(ROOT)}: {rows[0]['gpu']}, commits "
      f"{', '.join(sorted({r['commit'] for r in rows}))}, {rows[0]['date']}; {', '.join(sorted(methods))}")



S06_ROW = "gdn_fwd/" + Path(load("gdn_fwd", 6).__file__).stem


def autocp_splits(label):
    """Whether AutoCP cut this problem's sequences in the committed run: s06 is s05 plus AutoCP, so
    the two rows differ (by more than timing noise, 5 %) only where it split."""
    return abs(ms_of[label, S06_ROW] / ms_of[label, COLS["s05"]] - 1) > 0.05


short = bench.short_label


cell = lambda x, w=9: f"{x:{w}.3f}" if x is not None else f"{'-':>{w}s}"
print(f"\n{'problem':22s}" + "".join(f"{c:>9s}" for c in COLS) + f"{'s03/s04':>9s}{'s03/s05':>9s}{'API/FLA':>9s}")
for p, t in table.items():
    print(f"{short(p):22s}" + "".join(cell(t[c]) for c in COLS) + f"{t['s03'] / t['s04']:8.2f}x"
          + f"{t['s03'] / t['s05']:8.2f}x" + (f"{t['FLA'] / t['API']:8.2f}x" if p in with_peers else f"{'-':>9s}"))
s05_ahead = [short(p) for p, t in table.items() if t["s05"] < t["s04"]]
split = [short(p) for p in table if autocp_splits(p)]
print("\ns05 faster than s04 on:", ", ".join(s05_ahead))
print("AutoCP splits the sequences of:", ", ".join(split))
# what the prose below says
assert all(t["s04"] < t["s03"] and t["s05"] < t["s03"] for t in table.values())
assert all(t["s04"] < t["s05"] for p, t in table.items() if p.startswith("(16, 64)") and "1x2048" not in p
           and "1x8192" not in p)
assert all(t["s04"] < t["s05"] for p, t in table.items() if p.startswith("(16, 64)"))
assert all(t["FlashQLA"] < min(t[c] for c in COLS if c not in ("FlashQLA", "API")) for t in with_peers.values())
assert [short(p) for p, t in with_peers.items() if t["API"] < t["FlashQLA"]] == [
    "(16, 64) 1x8192", "(16, 64) 1x32768", "(16, 64) 28672+4096", "(16, 64) 8x4096"]
assert all(t["API"] < t["s05"] for p, t in with_peers.items() if not autocp_splits(p))
assert all(t["s07"] < min(t["s03"], t["s04"], t["s05"]) for t in table.values())
api_over_s07 = [t["s07"] / t["API"] for t in with_peers.values()]
print(f"the entry point (s18's pipeline in these runs) over the s07 stage: "
      f"{min(api_over_s07):.2f}-{max(api_over_s07):.2f}x")
assert 1.25 < min(api_over_s07) and max(api_over_s07) < 1.65

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
for ax, heads in zip(axes, ("(16, 64)", "(16, 32)")):
    mine = [p for p in problems if p.startswith(heads)]
    width = 0.8 / len(COLS)
    for n, col in enumerate(COLS):
        ax.bar([x + n * width for x in range(len(mine))], [table[p][col] or float("nan") for p in mine], width,
               label=col)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(mine))], [short(p)[len(heads) + 1:] for p in mine],
                  fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("forward, ms (log)")
    ax.set_title(f"(H, HV) = {heads}, {rows[0]['gpu']}, each problem in one process", fontsize=9)
axes[0].legend(fontsize=7, ncol=2)
fig.tight_layout()

# %% [markdown]
# s04 and s05 beat s03 on every problem, by different mechanisms, and neither wins everywhere: s04 is
# ahead on every (16, 64) problem, where it saves the most bytes, s05 on the single sequences of
# (16, 32). s07, which has both, is the fastest of these stages on all ten. The API and the peers
# appear only where they ran in the stages' process: on (16, 32) a later run (commit e7a917b, the
# README's table) re-timed them without these stages, and on (16, 64) 1 x 2048 another (98a6f05).
# On the other four (16, 64) problems the entry point ran s18's
# pipeline (s07's lineage: s12's kernel at 32 value columns a CTA and s16's, the chain split over a
# state and a value warpgroup, at 64 and 128, the width read from the lengths; after
# `gate_free_solve.s06`, with AutoCP, which leaves these sequences whole) and was 1.27-1.60x the
# s07 stage, most on the batch of 8 x 4096, where one CTA owns all 128 columns of a head:
# besides its faster kernels, the stage builds its varlen tables (bounds, chunk table) again in each
# of its three calls (cumsum, gate-free solve, fused kernel), while the entry point builds them once,
# with one kernel. FlashQLA stays ahead of all these stages on every (16, 64) problem here; the entry
# point is ahead of FlashQLA on all four.
#
# The napkin math of sections 2 and 4 against these numbers. The reformulation changes the
# preparation (memory-bound), so its gain should track the HBM bytes it saves, whose time at the copy
# roof is a floor. Warp specialization changes only the fused kernel, with the same preparation as
# s03, so the whole run should gain what the fused kernel alone gains; the docstring of s05 timed
# the two fused kernels alone, in another run, on two of these problems:

# %%
def pairs_of(label):
    """(chunk, value head) pairs of a benchmark problem."""
    _, hv, lengths = bench.heads_and_lengths(label)
    return sum(-(-n // CC) for n in lengths) * hv


# the docstring's table: (H, HV) tokens, s03 kernel, 3 roles, 3 roles fast P, s05 kernel (x), s03 run, s05 run
KERNEL_ROW = (r"\((\d+), (\d+)\)\s+(\d+) x (\d+)\s+([\d.]+) ms\s+[\d.]+\s+[\d.]+\s+([\d.]+) \([\d.]+x\)"
              r"\s+[\d.]+\s+[\d.]+")
kernel_gain = {}
for h_, hv_, n_seq, length, k03, k05 in re.findall(KERNEL_ROW, doc05):
    seqs = f"1x{length}" if n_seq == "1" else "+".join([length] * int(n_seq))
    kernel_gain[f"({h_}, {hv_}) {seqs}"] = float(k03) - float(k05)
assert kernel_gain, "the docstring's table of fused-kernel times is gone"
saved_per_pair = before["HBM byte"] - after["HBM byte"]
print(f"{'problem':22s} {'bytes saved':>11s} {'floor':>8s} {'s03 - s04':>10s}   {'kernel gain*':>13s} "
      f"{'s03 - s05':>10s}")
for p, t in table.items():
    saved = saved_per_pair * pairs_of(p)
    gain = f"{kernel_gain[p]:10.3f} ms" if p in kernel_gain else f"{'-':>13s}"
    print(f"{short(p):22s} {saved / 1e9:8.2f} GB {saved / rates['HBM byte'] * 1e3:5.3f} ms "
          f"{t['s03'] - t['s04']:7.3f} ms   {gain} {t['s03'] - t['s05']:7.3f} ms")
print("* s03's fused kernel minus s05's, both alone, from s05's docstring (another run, on an H200)")
below_floor = [short(p) for p in table
               if table[p]["s03"] - table[p]["s04"] < saved_per_pair * pairs_of(p) / rates["HBM byte"] * 1e3]
print("s04's gain below its bytes' floor on:", ", ".join(below_floor))
single32 = ["(16, 32) 1x2048", "(16, 32) 1x8192", "(16, 32) 1x32768"]
assert set(below_floor) <= set(single32) and below_floor, below_floor
assert all(table[p]["s03"] - table[p]["s04"] < 1.4 * saved_per_pair * pairs_of(p) / rates["HBM byte"] * 1e3
           for p in single32)                                 # at most a little above the floor
for p, gain in kernel_gain.items():
    if p in table:  # the docstring timed an H200, this run an H100
        assert abs(table[p]["s03"] - table[p]["s05"] - gain) < 0.2 * gain, (p, gain)

# %% [markdown]
# s05's gain is about the fused kernel's on both problems the docstring timed, within 3-18 % (other
# runs on another card, an H200, with CUDA events; graph replay here): warp specialization changes
# nothing else. On one sequence of 32768 tokens it is 0.64 ms at (16, 64) and 0.70 ms at (16, 32):
# both launch no more CTAs than the card has SMs, so the fused kernel takes the chain's length times
# the time of a chunk, whatever the heads.
#
# s04's gain is above its bytes' floor everywhere but on the single sequences of (16, 32), where it is
# below it or little above: the s03 stage prepares $w$ and $u$ with three
# kernels (`chunk_kkt`, `kkt_solve`, `chunk_w_u`) that write $A$ and its inverse to HBM and read them
# back, more than the fused `chunk_fwd_intra.s01` that section 2's "before" pipeline counts. It
# shrinks with the value heads, as the bytes do, and s04's fused kernel is slower than s03's (13-17 %,
# its docstring), which weighs more where the fused kernel is a larger share of the run: with 32 value
# heads and single sequences, s05 is ahead, and there the slower kernel eats much of what the
# preparation saves (in this run s04 gains 0.006-0.341 ms over s03 on them, against the
# 0.017-0.276 ms its bytes would save at the copy roof).
#
# The two gains are in different kernels, s04's in the preparation and s05's in the fused kernel, so
# s07, which takes both, should gain about their sum over s03. It does (the next cell): 0.96-1.17x
# the sum, the most on (16, 32) 1 x 2048, where s04's own kernel lost most of its preparation's gain
# to the chain's extra product; in s07's roles that product hides behind the output work, as s07
# was built to do.

# %%
print(f"{'problem':22s} {'s03 - s04':>10s} {'s03 - s05':>10s} {'sum':>8s} {'s03 - s07':>10s}")
for p, t in table.items():
    g4, g5, g7 = t["s03"] - t["s04"], t["s03"] - t["s05"], t["s03"] - t["s07"]
    print(f"{short(p):22s} {g4:7.3f} ms {g5:7.3f} ms {g4 + g5:5.3f} ms {g7:7.3f} ms")
    assert g7 > 0.9 * (g4 + g5), (p, g4, g5, g7)
over_sum = [(t["s03"] - t["s07"]) / (2 * t["s03"] - t["s04"] - t["s05"]) for t in table.values()]
print(f"s07's gain over s03, in units of the sum: {min(over_sum):.2f}-{max(over_sum):.2f}x")
assert 0.9 < min(over_sum) and max(over_sum) < 1.2

# %% [markdown]
# On a machine with a Hopper GPU, the next cell times s03, s04 and s05 again on one problem with the
# benchmark's own functions (chapter 3); compare those numbers only with each other.

# %%
if torch.cuda.is_available() and hopper_gpu_missing() is None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    p = Problem(16, 64, (32768,))
    sets = bench.input_sets(p, l2)
    for number in (3, 4, 5):
        ms, method = bench.time_row(lambda x, m=load("gdn_fwd", number): m.run(**x), sets)
        print(f"{p.label:22s} gdn_fwd.s{number:02d} {ms:8.3f} ms  ({method})")
else:
    print(f"No Hopper GPU here ({hopper_gpu_missing()}): the numbers above come from "
          f"{CSV_PATH.relative_to(ROOT)}.")

# %% [markdown]
# ### What Nsight Compute says changed
#
# `profiles/ncu_lab.py` profiles a stage's fused kernel on (16, 64) 1 x 8192 and writes
# `profiles/results/ncu_gdn_fwd_sNN.csv` (chapter 3). s03's and s05's are committed (s04 is not
# profiled yet, its docstring says). Side by side: time, the tensor pipe's and DRAM's share of
# their peaks, achieved occupancy, registers a thread at launch and shared memory per CTA, and the
# three largest stall reasons (warps stalled per issued instruction, by reason):

# %%
NCU_FIELDS = ("kernel", "us", "gflop", "tflops", "tensor_pct", "dram_mb", "dram_gbs", "dram_pct", "sm_pct",
              "occupancy_pct", "regs", "smem_kb", "grid", "block", "problem", "commit", "stalls")
ncu = {}
for n in (3, 5):
    with open(bench.RESULTS / f"ncu_gdn_fwd_s{n:02d}.csv", newline="") as f:
        (ncu[n],) = csv.DictReader(f)                     # one row: the fused kernel
print(f"{'':14s}" + "".join(f"{f's{n:02d}':>32s}" for n in ncu))
for field in NCU_FIELDS[:-3]:
    print(f"{field:14s}" + "".join(f"{ncu[n][field]:>32s}" for n in ncu))
for field in NCU_FIELDS[-3:]:
    for n in ncu:
        print(f"{field if n == 3 else '':14s}s{n:02d}: {ncu[n][field]}")
assert ncu[3]["problem"] == ncu[5]["problem"] and ncu[3]["gflop"] == ncu[5]["gflop"]


def stall_reasons(text):
    """'long_scoreboard 3.62; barrier 1.69' -> {'long_scoreboard': 3.62, 'barrier': 1.69}."""
    return {name: float(x) for name, x in re.findall(r"(\w+) ([\d.]+)", text)}


def num(n, field):
    return float(ncu[n][field])


print(f"\ns03 -> s05: {num(3, 'us') / num(5, 'us'):.2f}x faster; DRAM bytes {num(3, 'dram_mb'):.0f} -> "
      f"{num(5, 'dram_mb'):.0f} MB; warps resident per SM "
      + " -> ".join(f"{num(n, 'occupancy_pct') / 100 * 64:.1f} (block of {ncu[n]['block'].split('x')[0]})"
                    for n in ncu))
# the napkin's DRAM bytes per CTA and chunk (the timeline's loads, o stored, h0 read and ht written)
prob = Problem(16, 64, (8192,)).label
assert ncu[5]["problem"] == prob, ncu[5]["problem"]
ctas = math.prod(int(x) for x in ncu[5]["grid"].split("x"))
chunks = 8192 // CC
napkin_mb = (ctas * chunks * (cta_bytes["s05"] + CC * bv5 * BF16) + ctas * 2 * KC * bv5 * FP32) / 1e6
print(f"napkin DRAM traffic of s05's kernel on {prob}: {napkin_mb:.0f} MB ({ctas} CTAs x {chunks} chunks); "
      f"measured {num(5, 'dram_mb'):.0f} MB")
assert abs(napkin_mb / num(5, "dram_mb") - 1) < 0.05

reasons = list(dict.fromkeys(r for n in ncu for r in stall_reasons(ncu[n]["stalls"])))
fig, axes = plt.subplots(1, 2, figsize=(11, 3.3))
width = 0.8 / len(ncu)
for i, n in enumerate(ncu):
    st = stall_reasons(ncu[n]["stalls"])
    xs = [x + i * width for x in range(len(reasons))]
    axes[0].bar(xs, [st.get(r, 0) for r in reasons], width, label=f"s{n:02d} {ncu[n]['kernel']}")
    for x, r in zip(xs, reasons):
        if r not in st:
            axes[0].text(x, 0.05, "not in\ntop 3", ha="center", fontsize=6)
    axes[1].bar([x + i * width for x in range(3)],
                [num(n, "tensor_pct"), num(n, "dram_pct"), num(n, "occupancy_pct")], width, label=f"s{n:02d}")
axes[0].set_xticks([x + 0.4 - width / 2 for x in range(len(reasons))], reasons, fontsize=7)
axes[0].set_ylabel("warps stalled per issued instruction")
axes[0].set_title(f"top stall reasons, fused kernel, {prob}", fontsize=9)
axes[0].legend(fontsize=7)
axes[1].set_xticks([x + 0.4 - width / 2 for x in range(3)], ["tensor pipe %", "DRAM % of peak", "occupancy %"])
axes[1].set_title("utilization", fontsize=9)
axes[1].legend(fontsize=7)
fig.tight_layout()
assert stall_reasons(ncu[3]["stalls"]).get("barrier") and "barrier" not in stall_reasons(ncu[5]["stalls"])
assert max(stall_reasons(ncu[5]["stalls"]), key=stall_reasons(ncu[5]["stalls"]).get) == "long_scoreboard"

# %% [markdown]
# From s03 to s05, on the same problem and the same work (77.3 GFLOP, the same DRAM bytes):
#
# - **Time** 484 -> 297 us, 1.63x: the kernel-alone speed-up of the docstring's table (1.52-1.66x).
# - **Throughput** rises with it but stays far from the roofs: the tensor pipe is busy 27 % of the
#   time instead of 18 % (160 -> 260 TFLOP/s), DRAM runs at 33 % of its peak instead of 20 %. The
#   napkin count of the bytes a CTA loads per chunk (the timeline's) reproduces the measured DRAM
#   traffic to a few percent, and at 33 % of peak the loads are not what limits the kernel.
# - **Occupancy** 18.6 -> 24.8 %: one CTA per SM both times, 12 warps (384 threads) then 16 (512).
#   Registers at launch drop from 168 to 128 a thread (the role budgets are set at run time by
#   `setmaxnreg`), shared memory grows from 153 to 186 KB (s05: double hand-off slots, reuse off).
# - **Stalls**: `barrier` (warps waiting for the other warps of a CTA or named barrier: s03's
#   consumer warpgroups synchronizing) has left the top three. `long_scoreboard` (waiting for the
#   result of an L1TEX memory operation) is still the top reason, with more warps waiting on it per
#   issued instruction (3.62 -> 6.15), out of 16 warps instead of 12; `short_scoreboard` (shared
#   memory, the special-function unit) has come in.
#
# So the kernel is still latency-bound, as the docstring concludes: neither the tensor pipe nor DRAM
# is near its peak, and a chunk takes 2.3-2.4 us against the 1.4 us of the chain alone. The timeline
# of section 4, where the roles never slow each other down, cannot account for that extra 1 us;
# what it leaves out, the roles sharing one SM, is where to look next.

# s07's fused kernel on the same problem (`profiles/results/ncu_gdn_fwd_s07.csv`, profiled later,
# another commit, the same card type):

# %%
with open(bench.RESULTS / "ncu_gdn_fwd_s07.csv", newline="") as f:
    (ncu7,) = csv.DictReader(f)
assert ncu7["problem"] == prob
for field in ("us", "gflop", "tflops", "tensor_pct", "dram_mb", "dram_pct", "occupancy_pct", "smem_kb", "stalls"):
    print(f"{field:14s} s05 {ncu[5][field]:>40s}   s07 {ncu7[field]:>40s}")
per_chunk = {n: float(row["us"]) / chunks for n, row in ((5, ncu[5]), (7, ncu7))}
print(f"per chunk (each CTA walks {chunks}): s05 {per_chunk[5]:.2f} us, s07 {per_chunk[7]:.2f} us")
assert float(ncu7["us"]) > num(5, "us") and float(ncu7["dram_mb"]) < num(5, "dram_mb")
assert max(stall_reasons(ncu7["stalls"]), key=stall_reasons(ncu7["stalls"]).get) == "long_scoreboard"

# %% [markdown]
# s07's kernel alone is slower than s05's (349 against 297 us, 2.7 against 2.3 us a chunk): it does
# s04's extra work inside the chunk loop ($\Gamma \odot A_b$ in the scores warpgroup, $W$ and the
# $\tilde V = (\Gamma \odot A_b) W$ product in the chain: 85.9 against 77.3 GFLOP) and reads
# $A_b$ and $v$ instead of $w$ and $u$ (398 against 467 MB of DRAM traffic). The whole forward is
# faster because the preparation it needs is cheaper (section 2). The kernel is as latency-bound as
# s05's: `long_scoreboard` is still the top stall, the tensor pipe busy a quarter of the time.
#
# ### A step back: `gdn_fwd.s09`, $u$ and $w$ on chip
#
# s07's chain still runs three dependent products a chunk ($U = K S$, then $\tilde V = W_Y W$, then
# the update). s09 tries to give it s05's two: the scores warpgroup forms $u = W_Y V$ and
# $w = (W_Y D) K$ on chip (no HBM, unlike s03's `chunk_fwd_intra`), hands them over through
# `bar_wu_ready/free`, and the chain computes $\tilde V = u - w S$. The price is in the scores
# warpgroup: two more products and $W_Y D$ built in registers every chunk. Its docstring's first
# paragraph, then what the benchmark measured beside s07:

# %%
s09 = load("gdn_fwd", 9)
print(s09.__doc__.split("\n\n")[0])
S09_ROW = "gdn_fwd/" + Path(s09.__file__).stem
ratio09 = {p: ms_of[p, COLS["s07"]] / ms_of[p, S09_ROW] for p in problems}
for p, x in ratio09.items():
    print(f"{short(p):22s} s07 {ms_of[p, COLS['s07']]:6.3f} ms   s09 {ms_of[p, S09_ROW]:6.3f} ms   {x:.2f}x")
assert all(0.55 < x < 0.7 for x in ratio09.values())          # slower everywhere: 0.57-0.69x

# %% [markdown]
# s09 is slower on every problem, 0.57-0.69x s07: shortening the chain moved the critical path to
# the scores warpgroup, which now runs four products and the $W_Y D$ build per chunk (about 1700
# SASS instructions in its loop, with 64 divergent-branch regions, against the chain's 800), and
# the chain waits on `bar_wu_ready`. In a warp-specialized kernel the slowest role sets the pace;
# the next stage has to make the chain leaner without loading another role.
#
# ### `gdn_fwd.s10`: the same chain, leaner
#
# s10 keeps s07's roles, barriers and math and changes only what the chain's loop compiles to. Three
# changes, each read off the SASS: the $W$ pass reads the factors $e^{g_i}$ and $e^{g_C - g_i}$ that
# the producer writes per stage (no mask, no exponential: the mask was not needed, since $W_Y$ is
# zero on the columns past the sequence end); the hand-offs of $S_c$ and $\tilde V_c$ go through
# `stmatrix`, which TileLang emits only into a whole buffer, so the slots are separate buffers and the
# loop runs its chunks in pairs; and the decay $S \leftarrow e^{g_C} S$ runs on the registers while
# $U = K S$ is in flight. Its docstring's SASS count of the chain's loop, then the benchmark:

# %%
s10 = load("gdn_fwd", 10)
doc10 = s10.__doc__
sass_table = doc10[doc10.index("    SASS "):].split("\n\n")[0]
print(sass_table)
instr = dict(re.findall(r"^\s+(\w[\w.()]*)\s+\d+\s+(\d+)$", sass_table, re.M))
assert int(instr["instructions"]) < 0.65 * 806 and instr["BSSY"] == "0" and instr["MUFU.EX2"] == "0"
rows_all = bench.read_csv(CSV_PATH)
ms_all = {(r["problem"], r["impl"].split("/")[-1][:3]): float(r["ms"]) for r in rows_all if r["ms"]}
labels_all = list(dict.fromkeys(r["problem"] for r in rows_all))
ratio10 = [ms_all[p, "s07"] / ms_all[p, "s10"] for p in labels_all]
print(f"s10 over s07 on all {len(labels_all)} problems: {min(ratio10):.2f}-{max(ratio10):.2f}x "
      f"(geomean {math.exp(sum(map(math.log, ratio10)) / len(ratio10)):.3f})")
assert 1.04 < min(ratio10) and max(ratio10) < 1.17

# %% [markdown]
# 500 instructions a chunk instead of 806 buy 7-15 %: the chain is still latency-bound (three
# dependent products a chunk), and only part of the loop's time was instruction issue.
#
# ### The preparation: `gate_free_solve.s02`
#
# Where the forward's time goes, kernel by kernel (`profiles/kernel_split_lab.py`, torch.profiler,
# one H200, commit 05f6295, the library's forward as gdn_fwd.s13 runs it): on the many-head problems
# the solve is more than a quarter of it and slower than FlashQLA's `kkt_solve`, while its floor,
# $K$ in and $A_b$ out, is a few dozen microseconds. (With `gate_free_solve.s01`, in an earlier run
# at c98e3fb, it was a third: 153 us on (16, 64) 1 x 8192.)

# %%
split_rows = bench.read_csv(bench.RESULTS / "kernel_split.csv")
for label in ("(16, 64) 1x8192", "(16, 64) 1x32768", "(16, 64) " + "+".join(["4096"] * 8)):
    print(short(label))
    for impl in ("gdn_fwd.s13", "FlashQLA"):
        sel = [r for r in split_rows if r["problem"] == label and r["impl"] == impl]
        print(f"  {impl:12s} {float(sel[0]['total_us']):7.1f} us: " + ", ".join(
            f"{r['kernel'][:32]} {float(r['us']):.1f}" for r in sel))
solve_us = {(r["problem"], r["impl"]): float(r["us"]) for r in split_rows if "solve" in r["kernel"]}
total_us = {(r["problem"], r["impl"]): float(r["total_us"]) for r in split_rows}
share = solve_us["(16, 64) 1x8192", "gdn_fwd.s13"] / total_us["(16, 64) 1x8192", "gdn_fwd.s13"]
floor_us = (8192 * 16 * 128 * 2 + 8192 * 64 * 64 * 2) / 4.2e6    # K in, Ab out (bf16) at 4.2 TB/s
print(f"the solve: {share:.0%} of s13's forward on (16, 64) 1x8192; its traffic floor {floor_us:.0f} us")
assert 0.25 < share < 0.32 and solve_us["(16, 64) 1x8192", "gdn_fwd.s13"] > 1.05 * solve_us["(16, 64) 1x8192", "FlashQLA"]
fused_us = {(r["problem"], r["impl"]): float(r["us"]) for r in split_rows if "fused" in r["kernel"]}
batch8 = "(16, 64) " + "+".join(["4096"] * 8)          # FlashQLA at 128 value columns a CTA, ours at 64
assert fused_us[batch8, "FlashQLA"] < 0.7 * fused_us[batch8, "gdn_fwd.s13"]

# %% [markdown]
# Nsight Compute on the three solves this chapter builds, on that problem (`profiles/ncu_lab.py`,
# one H200, commit 4e37c66; s03 comes after s02, below):

# %%
ncu_solve = {}
for n in (1, 2, 3):
    (r,) = bench.read_csv(bench.RESULTS / f"ncu_gate_free_solve_s0{n}.csv")
    ncu_solve[n] = r
    print(f"gate_free_solve.s0{n}: {float(r['us']):6.1f} us, {r['regs']} registers, occupancy "
          f"{r['occupancy_pct']} %, DRAM {r['dram_pct']} % of peak; stalls: {r['stalls']}")
us_of = {n: float(r["us"]) for n, r in ncu_solve.items()}
assert us_of[2] < us_of[3] < us_of[1]

# %% [markdown]
# `gate_free_solve.s01` solved $(I + A) X = I$ row by row: warp $w$ owns 16 columns and walks 64 - 16w
# rows, each waiting on the row before (a sum, a shuffle), with every warp's rows unrolled into its
# own copy of the code: 9,600 SASS instructions, of which each warp runs its quarter. s02 cuts the
# 64 x 64 triangle into 16 x 16 blocks. Each warp inverts one diagonal block by a 16-row substitution
# (all four at once); then warp $j$ walks its block column down, $X_{ij} = -X_{ii} \sum_{j \le l < i}
# A_{il} X_{lj}$: each level is 16 independent row sums and one product with the diagonal block's
# inverse. All warps run the same instructions (the block column is the warp index, a runtime value),
# 4,376 in all. It also drops the per-head pass that built $A$: the solve reads $K K^\top$ and scales
# each row sum by $\beta_i$. The math, in float64, against the inverse:

# %%
gen = torch.Generator().manual_seed(7)
kb = F.normalize(torch.randn(CC, 128, generator=gen, dtype=torch.float64), dim=-1)
bb = torch.rand(CC, generator=gen, dtype=torch.float64)
A = torch.tril(bb[:, None] * (kb @ kb.T), -1)
X = torch.zeros(CC, CC, dtype=torch.float64)
blk = [slice(16 * b, 16 * b + 16) for b in range(4)]
for b in range(4):                                     # phase A: the diagonal blocks
    X[blk[b], blk[b]] = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + A[blk[b], blk[b]])
for j in range(4):                                     # phase B: warp j walks its block column down
    for i in range(j + 1, 4):
        t = sum(A[blk[i], blk[l]] @ X[blk[l], blk[j]] for l in range(j, i))
        X[blk[i], blk[j]] = -X[blk[i], blk[i]] @ t
err = (X - torch.linalg.inv(torch.eye(CC, dtype=torch.float64) + A)).abs().max().item()
print(f"blocked inverse against the inverse: max abs difference {err:.1e}")
assert err < 1e-13

# %% [markdown]
# `gdn_fwd.s11` puts both into AutoCP's pipeline (s08's, chapter 5) and is what the library runs.
# Where s11 keeps the sequences whole, the difference between s11 and s10 is the solve:

# %%
by_group = {}
for p in labels_all:
    h, hv, lens = bench.heads_and_lengths(p)
    if not autocp.segment_chunks(sum(lens), len(lens), sum(lens), hv, 132, 2):   # varlen: the bound T
        by_group.setdefault(hv // h, []).append(ms_all[p, "s10"] / ms_all[p, "s11"])
for group, xs in sorted(by_group.items()):
    print(f"value heads per key head {group}: s11 over s10 {min(xs):.2f}-{max(xs):.2f}x on {len(xs)} problems")
assert min(by_group[4] + by_group[3]) > 0.99 and max(by_group[4] + by_group[3]) > 1.05
assert min(by_group[2] + by_group[1]) > 0.96 and max(by_group[2] + by_group[1]) < 1.05

# %% [markdown]
# The blocked solve pays where a CTA solves three or four value heads (it shares $K K^\top$ across
# a key head's value heads, as s01 does): up to 8-9 % of the whole forward. With one or two it is
# about even (0.97-1.04x). (Earlier runs, on H200s, had s02 from 3-4 % behind to 2 % ahead on
# (16, 32) from 32768 tokens: run-to-run differences of that size.) Nsight Compute, above, has
# s02 1.19x faster than s01 alone; both are latency-bound (`barrier` and `short_scoreboard` lead
# the stalls, 18 % occupancy: 144 registers and 128 threads a CTA), and FlashQLA's `kkt_solve` is
# still 11 % faster.
#
# ### A right-looking solve: `gate_free_solve.s03`, measured slower
#
# s02's phase B still walks a chain of row sums. s03 turns the substitution around: once $x_j$ is
# known, every later row's pending sum takes its term ($s_i \mathrel{+}= a_{ij} x_j$ for all $i > j$),
# so a step has $63 - j$ independent multiply-adds instead of a chain. One lane owns one column of
# the inverse, its 64 pending sums in registers; two value heads run at once. The profile above says
# what that bought: 141 us against s02's 129, with `barrier` the top stall and 168 registers a
# thread, because the register-resident column needs them: the same occupancy (18 %) and more
# instructions. It stays a stage (the lesson: the row chain was not what limited s02), and the
# library keeps s02.

# %%
s03_solve = load("gate_free_solve", 3)
print(s03_solve.__doc__.split("\n\n")[0])

# %% [markdown]
# ### Narrow CTAs for few heads: `gdn_fwd.s12`
#
# With one sequence and few value heads the fused kernel launches fewer CTAs than the card has SMs:
# 32 of 132 for (16, 16) at 64 value columns a CTA. The time is the chain's chunk count times its
# per-chunk latency, and more than half the card idles. s12 makes BV, the value columns a CTA owns,
# a parameter of the kernel builder and picks it per launch (`block_v`): 32 where the CTAs at 32 still
# fit one wave, 64 otherwise. A CTA at 32 walks the same chunks with products of 64 x 32 instead of
# 64 x 64 and half the elementwise work. FlashQLA chooses its BV in the same way.

# %%
s12 = load("gdn_fwd", 12)
print("block_v, 132 SMs:", {f"({h}, {hv}) x{n}": s12.block_v(n, hv, 128, 132)
                            for h, hv in ((2, 8), (16, 16), (16, 32), (16, 48), (16, 64)) for n in (1, 8)})
narrow_gain = {p: ms_all[p, "s10"] / ms_all[p, "s12"] for p in labels_all}
went_narrow = {p: x for p, x in narrow_gain.items()
               if s12.block_v(len(bench.heads_and_lengths(p)[2]), bench.heads_and_lengths(p)[1], 128, 132) == 32}
stayed = [x for p, x in narrow_gain.items() if p not in went_narrow]
print(f"s12 over s10 where it goes narrow ({len(went_narrow)} problems): "
      f"{min(went_narrow.values()):.2f}-{max(went_narrow.values()):.2f}x; elsewhere "
      f"{min(stayed):.2f}-{max(stayed):.2f}x")
assert min(went_narrow.values()) > 1.1 and 0.95 < min(stayed) and max(stayed) < 1.04

# %% [markdown]
# 1.12-1.30x where it goes narrow; the same kernel elsewhere (0.96-1.03x: run-to-run noise).
# `gdn_fwd.s13` (chapter 5) is AutoCP with this kernel; the library ran it until s17.

#
# ### A state warpgroup for 128 columns: `gdn_fwd.s14`
#
# With many sequences every layout launches more CTAs than SMs, and the time is the total work.
# At BV = 64 the work that does not depend on BV (the scores: $Q K^\top$, $\Gamma$, $\Gamma \odot
# A_b$; the loads of $q$, $k$, $A_b$) is done twice a head. A CTA that owns all 128 columns needs
# $S$ in registers, 128 float32 a thread of one warpgroup, which leaves no room for the chain's other
# tiles. s14 splits the chain in two: a **state** warpgroup that holds only $S$ (snapshot, decay,
# update) and a **value** warpgroup for $U = K S_c$, $W$, $\tilde V = (\Gamma \odot A_b) W$ and
# $V_d$; the scores and output warpgroups of s12 become one. Its roles, register budgets and
# shared memory, read from the stage:

# %%
s14 = load("gdn_fwd", 14)
roles = {"state": (s14.STATE_END, s14.REGS_STATE), "value": (s14.VALUE_END, s14.REGS_VALUE),
         "scores / output": (s14.SCORES_END, s14.REGS_SCORES), "producer": (s14.THREADS, s14.REGS_PRODUCER)}
for role, (end, regs) in roles.items():
    print(f"{role:16s} threads [{end - s14.WARPGROUP:3d}, {end:3d})  setmaxnreg {regs}")
assert sum(r for _, r in roles.values()) <= 4 * 128 and s14.REGS_STATE >= 128 + 32  # S is 128 a thread
C, K, BV = s14.CHUNK_SIZE, 128, s14.WIDE_BLOCK_V
smem = {"q, k tiles (2 stages)": 2 * 2 * C * K * 2, "v tiles, then W": 2 * C * BV * 2,
        "Ab tiles, then WY": 2 * C * C * 2, "P (2 stages)": 2 * C * C * 2, "S_c snapshot": K * BV * 2,
        "V~, Vd, O": 3 * C * BV * 2, "g, exp(g), exp(g_C - g)": 3 * 2 * C * 4}
for name, nbytes in smem.items():
    print(f"{name:24s} {nbytes / 1024:6.1f} KB")
print(f"{'total':24s} {sum(smem.values()) / 1024:6.1f} KB of 227 KB a CTA may have")
assert sum(smem.values()) < 227 * 1024

# %% [markdown]
# `profiles/kernel_width_lab.py` times the fused kernels alone at every width (4 x H100, commit
# 51893cc, `profiles/results/kernel_width.csv`). s14 at 128 against s12 at its fastest width:

# %%
widths = bench.read_csv(bench.RESULTS / "kernel_width.csv")
vs12 = {r["problem"]: float(r["s14 f128"]) / min(float(r["s12 f32"]), float(r["s12 f64"])) for r in widths}
picks = {r["problem"]: s14.block_v(len(bench.heads_and_lengths(r["problem"])[2]),
                                   bench.heads_and_lengths(r["problem"])[1], 128, 132) for r in widths}
for r in widths:
    p = r["problem"]
    print(f"{bench.short_label(p):24s} s14 at 128 / s12's fastest {vs12[p]:.2f}   block_v picks {picks[p]}")
many = [p for p in vs12 if len(bench.heads_and_lengths(p)[2]) == 8]
single = [p for p in vs12 if len(bench.heads_and_lengths(p)[2]) == 1]
uneven = [p for p in vs12 if len(bench.heads_and_lengths(p)[2]) == 2]
assert all(vs12[p] < 0.85 for p in many if picks[p] == 128)       # the batches where 128 is picked
assert all(vs12[p] > 1.0 and picks[p] == 64 for p in many if "(8, 24)" in p or "(2, 8)" in p)
assert all(vs12[p] > 1.4 for p in single)                         # one wave either way: the wider step
assert all(vs12[p] > 1.3 for p in uneven if picks[p] == 128)      # equal lengths assumed: wrong here
s14_at = {bv: [float(r[f"s14 f{bv}"]) / float(r[f"s12 f{bv}"]) for r in widths] for bv in (32, 64)}
print("s14's kernel over s12's at the same width:", {bv: f"{min(x):.2f}-{max(x):.2f}" for bv, x in s14_at.items()})
assert all(0.95 < x < 1.1 for xs in s14_at.values() for x in xs)

fig, ax = plt.subplots(figsize=(9, 3))
ax.bar(range(len(vs12)), list(vs12.values()), color=["C2" if picks[p] == 128 else "C7" for p in vs12])
ax.axhline(1, color="k", lw=0.8)
ax.set_xticks(range(len(vs12)), [bench.short_label(p) for p in vs12], rotation=90, fontsize=7)
ax.set_ylabel("s14 at 128 / s12's fastest")
ax.set_title("fused kernel alone, 4 x H100 (green: block_v picks 128)")
plt.show()

# %% [markdown]
# 0.78-0.83x on the batches of 8 where `block_v` picks 128 (half the CTAs, four waves instead of
# eight on (16, 64)); on one wave a step at 128 costs 1.6 steps at 64, so single sequences keep 32
# or 64. On 28672 + 4096 of (16, 48) and (16, 64) the waves mislead: the rule assumes equal lengths
# (the host cannot see them without a synchronization), picks 128, and the long sequence's CTA walks
# its 448 chunks at the wider step (1.35-1.59x). A library that takes this kernel must choose the
# width on the device, from `cu_seqlens`. Two changes made 128 pay, found by timing variants of the
# first build: O stored through shared memory in whole rows (the first build stored 4-byte pieces
# from the registers, and that warpgroup also frees the snapshot's buffer: 1025 -> 678 us on (16, 64)
# 8 x 4096), and releasing the tile stage right after $Q S_c$ (606 us). The whole forward there: s14
# 1.45 ms, FlashQLA 1.24, FLA 4.21 (the solve alone is 0.52 of ours).
#
# `gdn_fwd.s15` reads the lengths instead (once per `cu_seqlens` tensor: the API's validation
# already does, `flashqla.varlen.host_bounds`) and weighs each width's step by the larger of the
# longest sequence, the CTA-chunks over all SMs and the waves times the shortest sequence. On the
# lengths of every problem above it picks the fastest measured kernel, and it also moves 28672 +
# 4096 of (8, 24) and (16, 32) to 32 columns, which s12's rule, counting sequences, kept at 64:

# %%
s15 = load("gdn_fwd", 15)
for r in widths:
    _, hv, lens = bench.heads_and_lengths(r["problem"])
    ms = {32: float(r["s12 f32"]), 64: float(r["s12 f64"]), 128: float(r["s14 f128"])}
    pick = s15.block_v([-(-n // 64) for n in lens], hv, 128, 132)
    print(f"{bench.short_label(r['problem']):24s} s15 picks {pick:3d} ({ms[pick]:.3f} ms); "
          f"s12's rule {s12.block_v(len(lens), hv, 128, 132):3d}; fastest {min(ms, key=ms.get):3d}")
    assert pick == min(ms, key=ms.get)

# %% [markdown]
# ### O by TMA store (s16) and the widths again (s17)
#
# Without O's store at all, s14's first build took 0.6 of its time, yet O is a small part of the
# traffic. The SASS says why: the scores / output warpgroup writes shared memory every chunk ($P$,
# WY, O), so TileLang fences the async proxy before the wgmma that reads it, and that fence compiles
# to `MEMBAR.ALL.CTA`, which waits until the warpgroup's outstanding global stores are acknowledged.
# O's stores therefore delayed the next $Q S_c$, the release of the snapshot buffer, and the state
# warpgroup's next snapshot. s16 hands each whole chunk of O to the TMA unit instead (one elected
# thread; a bulk copy belongs to the async proxy, which no MEMBAR waits for) and keeps row stores
# for a sequence's partial last chunk. The change, in s16's source:

# %%
s16 = load("gdn_fwd", 16)
src16 = inspect.getsource(s16.fused_state_value_kernel)
store = src16[src16.index("# o[t0 : t0 + n] <- O"):src16.index("elif tx >= SCORES_END")]
print(store.rstrip())
assert "T.copy(o_s, o[t0:t0 + C, i_hv, v0:v0 + BV])" in store
assert "tma_store" in s16.SOURCE_MUST_CONTAIN

# %% [markdown]
# The same lab, same run: s16's kernel against s14's at 128, and against s12's at 64 and 32.

# %%
at = {bv: [float(r[f"s16 f{bv}"]) / float(r[f"{'s14' if bv == 128 else 's12'} f{bv}"]) for r in widths]
      for bv in (128, 64, 32)}
for bv, xs in at.items():
    print(f"BV {bv:3d}: s16 / {'s14' if bv == 128 else 's12'} {min(xs):.2f}-{max(xs):.2f}, "
          f"geomean {math.exp(sum(map(math.log, xs)) / len(xs)):.2f}")
assert max(at[128]) < 0.9 and max(at[64]) < 1.0   # faster at 128 and 64 on every problem
assert min(at[32]) > 0.95                          # ... but not at 32: s17 keeps s12's kernel there

# %% [markdown]
# With a faster step at 64 and at 128, the break-even points move, so s17 runs s15's pipeline on a
# new `Widths` record: s12's kernel at 32, s16's at 64 and 128, each step measured again against
# s16's at 64 on single sequences of 32768 tokens (one wave at every width):

# %%
s17 = load("gdn_fwd", 17)
print(s17.WIDTHS)
assert s17.WIDTHS.kernels == {32: ("gdn_fwd", 12), 64: ("gdn_fwd", 16), 128: ("gdn_fwd", 16)}
one_wave = [r for r in widths if bench.heads_and_lengths(r["problem"])[2] == [32768]]
step128 = [float(r["s16 f128"]) / float(r["s16 f64"]) for r in one_wave]
print(f"s16 at 128 / s16 at 64, one wave: {min(step128):.2f}-{max(step128):.2f}")
assert min(step128) < s17.WIDTHS.step[128] < max(step128)
moved = []
for r in widths:
    _, hv, lens = bench.heads_and_lengths(r["problem"])
    ms = {32: float(r["s12 f32"]), 64: float(r["s16 f64"]), 128: float(r["s16 f128"])}
    chunks = [-(-n // 64) for n in lens]
    pick = s17.block_v(chunks, hv, 128, 132)
    assert pick == min(ms, key=ms.get), r["problem"]
    if pick != s15.block_v(chunks, hv, 128, 132):
        moved.append(f"{bench.short_label(r['problem'])}: {s15.block_v(chunks, hv, 128, 132)} -> {pick}")
print("s17 picks the fastest measured width on all", len(widths), "problems; moved from s15's:", moved)

# %% [markdown]
# The whole forwards, from the benchmark (`python -m flashqla bench`, 4 x H100, commit 02d7c5e,
# CUDA-graph replay, `profiles/results/gdn_fwd.csv`): s13 (the library three promotions ago), s15, s17
# and the API (s18's pipeline: s17's fused kernels, chapter 5's lean AutoCP, which leaves these
# batches whole, and the solve of the next section, `gate_free_solve.s06`) and the peers on the
# batches of 8 x 4096, with the API's napkin math from the same rows (useful FLOPs and the bytes it
# must move, against the roofs measured in that process):

# %%
fwd_rows = bench.read_csv(bench.RESULTS / "gdn_fwd.csv")
names = {"s13": "gdn_fwd/s13_autocp_narrow_blocks", "s15": "gdn_fwd/s15_width_from_lengths",
         "s17": "gdn_fwd/s17_widths_on_tma_store", "API": bench.API_ROW, "FlashQLA": bench.FLASHQLA_ROW,
         "FLA": bench.FLA_ROW}
# the rows of the run that timed s13 on each problem (e7a917b re-timed the API and the peers alone
# on (16, 32) and (16, 16): those two batches show only the stages)
s13_run = {r["problem"]: r["commit"] for r in fwd_rows if r["impl"] == names["s13"]}
got = {(r["problem"], r["impl"]): r for r in fwd_rows if r["ms"] and r["commit"] == s13_run[r["problem"]]}
print(f"{'problem':16s}" + "".join(f"{n:>9s}" for n in names) + "   API: TFLOP/s  GB/s  % copy roof")
batches = [p for p in dict.fromkeys(r["problem"] for r in fwd_rows) if "4096+4096+4096" in p]
for p in batches:
    api = got.get((p, bench.API_ROW))
    print(f"{bench.short_label(p):16s}" + "".join(f"{float(got[(p, i)]['ms']):9.3f}" if (p, i) in got else f"{'-':>9s}"
                                                 for i in names.values())
          + (f"   {float(api['tflops']):7.1f} {float(api['gbs']):6.0f} {float(api['pct_copy_roof']):6.1f}" if api else ""))
    assert float(got[(p, names["s17"])]["ms"]) < float(got[(p, names["s13"])]["ms"])

# %% [markdown]
# s17 is 1.03-1.30x s13 on these batches, and the API, s17's kernels after the solve of the next
# section, 1.13-1.44x (on the six batches whose API and peers ran in s13's process); yet the API is
# only 0.97-1.04x FlashQLA there. It moves 0.8-1.2 TB/s, 28-41 % of the copy roof measured in the
# same process, and uses 28-40 % of the tensor roof:
# latency, not a throughput limit, sets the pace. On (16, 64) the solve alone takes 0.41 ms of the
# 1.22 (`profiles/results/solve.csv`, another run) and s16's kernel 0.81 in `kernel_width.csv`
# (FlashQLA's kkt_solve 0.45 ms in `solve.csv`, its fused kernel 0.79 in `kernel_split.csv`:
# another card, an H200, but a pointer to where the rest of the gap is).
#
# ### The solve again: launch bounds (s05), the barriers gone (s06), a smaller kernel (s07)
#
# The solve is a third of the forward on the batches, so it got three more stages, each measured
# alone beside FlashQLA's `kkt_solve` (`profiles/solve_lab.py`, CUDA-graph replay, the same inputs):
#
# | stage | what changed |
# |---|---|
# | `gate_free_solve.s05` | s02 compiled with launch bounds (128, 4): 128 registers instead of 144, four CTAs an SM instead of three |
# | `gate_free_solve.s06` | one barrier a CTA instead of about three a value head: phase A solves the diagonal blocks of all the CTA's heads at once, each warp then walks a different block column of each head (a Latin square), and stores its columns of $A_b$ from registers |
# | `gate_free_solve.s07` | s06 with one copy of the solve's code: a flagged head's gated $A$ is rebuilt in shared memory between barriers instead of computed element by element in a second copy |
#
# In s02 warp $j$ walks block column $j$ of every head, and the columns hold 9, 5, 2 and 0 of a
# head's 16 block products (a level $d$ below the diagonal costs $d$ products for the row sums and
# one with $X_{ii}$). The Latin square of s06 gives each warp a different column of each head:

# %%
NB = 4
col_work = [sum(d + 1 for d in range(1, NB - j)) for j in range(NB)]      # levels d = 1 .. 3 - j


def latin(w, r):  # s06's block column of warp w for the CTA's head r (its kernel's formula)
    base = (w + 2 * (r // 2)) % NB
    return base if r % 2 == 0 else NB - 1 - base


print("block products of column j:", col_work)
for heads in (1, 2, 3, 4):
    per_warp = [sum(col_work[latin(w, r)] for r in range(heads)) for w in range(NB)]
    print(f"{heads} head(s) a CTA: s02's warps do {[col_work[w] * heads for w in range(NB)]}, s06's {per_warp}")
assert col_work == [9, 5, 2, 0]
assert [sum(col_work[latin(w, r)] for r in range(4)) for w in range(NB)] == [16] * 4
assert all(sorted(latin(w, r) for w in range(NB)) == list(range(NB)) for r in range(4))

# %% [markdown]
# Measured (4 x H100, commit d8516c1, `profiles/results/solve.csv`; s08 at the section's end), each
# stage's time over s02's, and FlashQLA's `kkt_solve` against the fastest of ours:

# %%
solve_rows = bench.read_csv(bench.RESULTS / "solve.csv")
ours = ["s02", "s05", "s06", "s07", "s08"]
print(f"{'problem':20s}" + "".join(f"{n:>8s}" for n in ours[1:]) + "  FlashQLA/best  % copy roof")
for r in solve_rows:
    ms = {n: float(r[n]) for n in ours}
    print(f"{short(r['problem']):20s}" + "".join(f"{ms[n] / ms['s02']:8.2f}" for n in ours[1:])
          + f"{float(r['FlashQLA']) / min(ms.values()):14.2f}{float(r['pct_copy_roof']):12.1f}")
    H, HV = bench.heads_and_lengths(r["problem"])[:2]
    heads_a_cta = load("gate_free_solve", 6).cta_heads(H, HV)
    assert min(ms, key=ms.get) == ("s06" if heads_a_cta >= 3 else "s08") and ms["s07"] > ms["s06"], r["problem"]
    assert 0.84 < ms["s06"] / ms["s05"] < 0.91, r["problem"]
ncu_solve = {n: bench.read_csv(bench.RESULTS / f"ncu_gate_free_solve_{n}.csv")[0] for n in ("s05", "s06", "s07", "s08")}
for n, r in ncu_solve.items():
    print(f"Nsight Compute, (16, 64) 1x8192, {n}: {float(r['us']):.0f} us, occupancy {r['occupancy_pct']} %, "
          f"{r['regs']} registers, {r['smem_kb']} KiB; top stalls: {r['stalls']}")
assert "barrier" in ncu_solve["s05"]["stalls"] and "barrier" not in ncu_solve["s06"]["stalls"]

# %% [markdown]
# s06 takes 0.85-0.90x s05's time on all 16 problems and is the faster solve with three or four
# value heads a key head (1.02-1.17x FlashQLA's speed), not yet with one or two (0.76-0.97x). The
# gain is no larger with four heads a CTA, where the Latin square spreads the work, than with one,
# where it spreads nothing ((16, 16): 0.85-0.86x): what paid is the barriers and the staging
# buffer that went, not the balance, since the other three CTAs of an SM already filled what warp
# 3 left idle. Nsight Compute agrees: `barrier` is gone from the top stalls, and the first is now
# `no_instruction`, the instruction cache: s06's second copy of the solve for flagged heads made the
# kernel 27,152 SASS instructions (s05: 4,400). s07 removed that copy (5,712 instructions) and
# measured slower on every problem, 1.01-1.19x s06's time: `no_instruction` fell and
# `short_scoreboard` rose to first. Which of its two other differences costs (16 KiB more shared
# memory, barriers inside the loop over heads) is not yet measured. The library runs s06 (the API
# on it was 0.96-1.10x as fast as gdn_fwd.s18 on s05 in the same benchmark run, geomean 1.035x,
# commit 02d7c5e).
#
# s08 moves 12 of a head's 16 block products, the inverse's lower-left 32 x 32 half, onto the
# tensor cores as FlashQLA's solve does: $A_{b,ll} = -A_{b,hi}\,((K K^\top)_{hl} A_{b,lo})$, two
# 32 x 32 x 32 products in tf32 (adding 1.5-2.9e-4 relative error to $A_b$, whose bf16 store adds
# 1.6-1.9e-3). It wins where a CTA holds one or two value heads (0.83-0.85x s06's time on (16, 32),
# 0.93-0.94x on (16, 16), where it is 1.14x FlashQLA's speed on (16, 32)), and loses with three or
# four (1.02-1.16x): its 71 KiB of shared memory leaves three CTAs an SM, and Nsight Compute puts
# `short_scoreboard` (shared-memory waits) first. `gate_free_solve.s09` chooses per launch: s08
# with one or two value heads a CTA, s06 with three or four; the library runs it (through
# `gdn_fwd.s22`, notebook 06). In the forward it takes 0.91-0.98x the time of the same pipeline on
# s05 on the unsplit (16, 32) and (16, 16) problems but 1x2048 (one H100, commit e7a917b).

# %% [markdown]
# s09 decides from the heads alone. On a short problem with few heads its grid is smaller than
# the card: (2, 8) 1 x 2048 is 32 chunks x 8 heads / 4 = 64 CTAs on 132 SMs, and the solve takes
# one CTA's latency with four heads' work in it. `gate_free_solve.s10` also counts the CTAs: where
# s09's grouping leaves SMs without one, two heads a CTA on s08's kernel. Each kernel alone (one
# H100, 50 launches in one CUDA graph), from its docstring:

# %%
solve10 = load("gate_free_solve", 10)
doc = solve10.__doc__
print(doc[doc.index("    problem"):doc.index("Below one CTA")])
for H, HV, chunks in ((2, 8, 32), (4, 16, 32), (8, 32, 32), (2, 8, 128), (16, 64, 32)):
    R = solve10.heads_per_cta(H, HV, chunks, 132)
    print(f"({H}, {HV}) {chunks * 64} tokens: {R} heads a CTA, {chunks * HV // R} CTAs, "
          f"{solve10.stage_for(R).__name__.split('.')[-1]}")
assert solve10.heads_per_cta(2, 8, 32, 132) == 2 and solve10.heads_per_cta(8, 32, 32, 132) == 4

# %% [markdown]
# Below one CTA an SM two heads a CTA take 0.61-0.77x s09's time; from 256 CTAs on, four heads a
# CTA are as fast or faster, and one head a CTA never wins. `gdn_fwd.s26` ran s10 (notebook 06).
#
# Alone is not where the solve runs. Inside the forward it runs once, between the cumsum and the
# fused kernel, and its time is one launch's latency, not the throughput of 50 launches in a row.
# `profiles/prologue_lab.py forward` times it there, at every grouping, from a CUDA-graph replay of
# the library's forward with the grouping forced (torch.profiler's kernel times):

# %%
with open(bench.RESULTS / "solve_in_forward.csv", newline="") as f:
    in_forward = list(csv.DictReader(f))
solve11 = load("gate_free_solve", 11)
print(f"{'problem':18s} {'grouping':>22s} {'CTAs':>5s} {'solve us':>9s} {'forward us':>11s}  chosen by")
for r in in_forward:
    H, HV, lengths = bench.heads_and_lengths(r["problem"])
    R = int(r["kernel"].split("/")[1])
    chunks = -(-sum(lengths) // 64)
    who = [n for n, m in (("s10", solve10), ("s11", solve11)) if m.heads_per_cta(H, HV, chunks, 132) == R]
    print(f"{r['problem']:18s} {r['kernel']:>22s} {r['ctas']:>5s} {r['us']:>9s} {r['forward_us']:>11s}  {' '.join(who)}")
t_in = {(r["problem"], r["kernel"]): float(r["us"]) for r in in_forward}
assert t_in["(8, 32) 1x2048", "gate_free_solve.s08/2"] < 0.7 * t_in["(8, 32) 1x2048", "gate_free_solve.s06/4"]

# %% [markdown]
# Four heads a CTA on 264 CTAs (two of the four an SM can hold) walk their heads in turn on the
# CUDA cores: 24.3 us on (8, 32) 1 x 2048 where two heads a CTA on s08's kernel take 15.9, though
# alone the two were level. `gate_free_solve.s11` keeps s06's three or four heads a CTA only where
# they leave three CTAs an SM, and otherwise runs s08's kernel at two heads (one where two do not
# divide the group); on all 16 problems its choice is within 5 % of the fastest grouping in the
# forward, where s10's is up to 1.60x it (`tests/test_bench.py`):

# %%
print(inspect.getsource(solve11.heads_per_cta))
assert solve11.heads_per_cta(8, 32, 32, 132) == 2 and solve11.heads_per_cta(8, 24, 32, 132) == 1
assert solve11.heads_per_cta(16, 64, 32, 132) == 4

# %% [markdown]
# The library runs s11 through `gdn_fwd.s28` and `s29` (notebook 06): 1.03x FlashQLA's speed on (8, 32)
# 1 x 2048, where it was 0.90x.
#
# One problem keeps a slow solve: (8, 24) 1 x 2048, 19.8 us against FlashQLA's 13.8. Its key heads
# hold three value heads, so s11 runs s08's kernel at one head a CTA: 33 chunk rows x 24 heads =
# 792 CTAs. s08's launch bounds, `(128, 4)`, fit four CTAs an SM (ptxas: 108 registers a thread),
# so 792 CTAs are 1.5 waves on 132 SMs and the last half-wave costs a whole CTA's latency; its
# 33 KB of shared memory would let six an SM hold. `gate_free_solve.s12` compiles the same program
# with `(128, 6)` where that makes the grid one wave and four do not (ptxas: 80 registers, 40 bytes
# of spill stores). Only the launch bounds differ:

# %%
solve12 = load("gate_free_solve", 12)
print(inspect.getsource(solve12.ctas_per_sm))
bounds = {n: re.search(r"__launch_bounds__\([^)]*\)", solve12._compiled(8, 24, 1, n).get_kernel_source()).group(0)
          for n in (solve12.TENSOR_CORE.MIN_CTAS_PER_SM, solve12.ONE_WAVE_CTAS_PER_SM)}
print(bounds)
assert bounds == {4: "__launch_bounds__(128, 4)", 6: "__launch_bounds__(128, 6)"}
assert solve12.gate_free_solve_kernel(8, 24, 1, 4).script() == solve12.TENSOR_CORE.gate_free_solve_kernel(8, 24, 1).script()
assert solve12.ctas_per_sm(8, 24, 33, 132) == 6 and solve12.ctas_per_sm(8, 32, 33, 132) == 4

# %% [markdown]
# `gdn_fwd.s30` is s29 with s12's launch bounds.
#
# The solve needs g only for a flagged head's gate, and g_cum of its own chunk and heads is a
# scan of 64 tokens. `gate_free_solve.s13` therefore makes the chunk table (chunk_local_cumsum.s03's
# prologue) and the cumsum of its heads (s02's scan, in s02's order, on 8 R of its threads) before
# s08's solve, and writes g_cum and the table for the kernels after it: where s08's kernel solves,
# the forward's first two launches become one (`gdn_fwd.s31`). The prologue, and what the solve
# now reads from it instead of HBM:

# %%
solve13 = load("gate_free_solve", 13)
src13 = inspect.getsource(solve13.cumsum_solve_kernel)
print(src13[src13.index("            # ---- the cumsum of the R heads"):src13.index("            # ---- s08's solve")])
assert "g_cum[bos + i" not in src13 and "g_cum[bos + j * L + r, hv0 + h] = off + x[r]" in src13

# %% [markdown]
# Their tests passed on one H100 (commit ba1bffa): s12 at six CTAs an SM and s13 bit for bit s08's
# and s03's on adversarial inputs, s30 and s31 bit for bit their predecessors, eagerly and from a
# CUDA graph. A kernel timeline of one forward in a graph (`profiles/timeline_lab.py`,
# `results/timeline_prologue.csv`: s31, s30, the library = s29, FlashQLA):

# %%
with open(bench.RESULTS / "timeline_prologue.csv", newline="") as f:
    timeline = list(csv.DictReader(f))
print(f"{'problem':18s} {'impl':12s} {'span us':>8s}  kernels (us)")
for (prob, impl) in dict.fromkeys((r["problem"], r["impl"]) for r in timeline):
    ks = [r for r in timeline if (r["problem"], r["impl"]) == (prob, impl)]
    print(f"{prob:18s} {impl:12s} {float(ks[0]['span_us']):8.1f}  " + "  ".join(
        f"{r['kernel'].replace('_kernel', '')[:26]} {r['us']}" for r in ks))
span = {(r["problem"], r["impl"]): float(r["span_us"]) for r in timeline}
assert span["(2, 8) 1x2048", "gdn_fwd.31"] < span["(2, 8) 1x2048", "gdn_fwd.30"]
assert span["(8, 24) 1x2048", "gdn_fwd.30"] < span["(8, 24) 1x2048", "API"] - 4

# %% [markdown]
# On (8, 24) 1 x 2048 six CTAs an SM take the solve from 20.4 to 15.6 us and the span from 84.5 to
# 79.7, level with FlashQLA's 79.6. s31's one kernel (8.4 us on (2, 8)) costs less than s30's cumsum
# and solve (2.1 + 8.9): the solve absorbs its scan.
#
# Is six CTAs an SM only worth it where it makes one wave? s08's kernel alone in a graph at four,
# five and six, on grids of one wave and many (one H100, ba1bffa; the same bits at all three):
# six wins at one head a CTA on many waves too ((16, 16) 8 x 4096: 135.3 against 144.1 us), and
# five is never slower at two heads a CTA (23.1 to 21.1 on (2, 8) 1 x 8192; there shared memory
# holds four CTAs an SM whatever the bound, so the gain is the code ptxas makes at 96 registers).
# `gate_free_solve.s14` takes those bounds on every grid, by heads a CTA alone (its docstring holds
# the table):

# %%
solve14 = load("gate_free_solve", 14)
print(inspect.getsource(solve14.ctas_per_sm), solve14.CTAS_PER_SM)
bounds14 = {R: re.search(r"__launch_bounds__\([^)]*\)", solve14._compiled(16, 16 * R, R).get_kernel_source()).group(0)
            for R in (1, 2)}
print(bounds14)
assert bounds14 == {1: "__launch_bounds__(128, 6)", 2: "__launch_bounds__(128, 5)"}

# %% [markdown]
# `gdn_fwd.s32` runs s31 with s14's bounds. The narrow problems still spend most of their time in
# the fused kernel: on (2, 8) 1 x 2048 it walks 32 chunks on 32 CTAs at 32 value columns a CTA (8
# heads x 4), 100 of 132 SMs idle. Half the columns halve the chain's products again (64 x 16) and
# double the CTAs; each CTA still computes its head's scores. Alone in a graph, s12's kernel at 16
# against 32 (one H100, ba1bffa; the same bits): 0.85-0.90x the time where 16 is one wave, 1.6-1.7x
# where it is two. `gdn_fwd.s33` adds BV = 16 to s15's width rule at 0.74 of a step at 64 (s17's 0.85
# at 32 times the one-wave ratio's geomean, 0.867); of the benchmark's problems it picks 16 on the
# unsplit 1 x 2048 of (2, 8), (4, 16) and (16, 16), and AutoCP's choices do not change
# (`tests/test_autocp.py`):

# %%
s33 = load("gdn_fwd", 33)
print(s33.STEP, s33.FUSED_AT[16])
rule = s33.S27.S18.PIPELINE.block_v
widths = {(H, HV): rule([32], HV, 128, 132, s33.STEP) for H, HV in ((2, 8), (4, 16), (16, 16), (8, 24), (8, 32))}
print(widths)
assert widths == {(2, 8): 16, (4, 16): 16, (16, 16): 16, (8, 24): 32, (8, 32): 32}

# %% [markdown]
# The library now runs s33 (bit for bit, `tests/test_promoted.py`). Its benchmark rows (one H100,
# commit 6eedafa; the peers in the same process):

# %%
rows_6e = [r for r in bench.read_csv(CSV_PATH) + bench.read_csv(EARLIER_RUNS) if r["commit"].startswith("6eedafa")]
t_6e = {(r["problem"], r["impl"]): float(r["ms"]) for r in rows_6e}
impls_6e = ("gdn_fwd/s29_table_in_the_cumsum", "gdn_fwd/s32_ctas_by_heads", "flashqla.chunk_gated_delta_rule",
            "FlashQLA", "FLA (gdn_fwd/s00_fla)")
print(f"{'problem':18s} " + " ".join(f"{n:>9s}" for n in ("s29", "s32", "API=s33", "FlashQLA", "FLA")))
for prob in dict.fromkeys(r["problem"] for r in rows_6e):
    print(f"{prob:18s} " + " ".join(f"{t_6e[prob, i]:9.4f}" if (prob, i) in t_6e else f"{'-':>9s}" for i in impls_6e))
for prob in ("(2, 8) 1x2048", "(4, 16) 1x2048", "(16, 16) 1x2048"):
    assert t_6e[prob, "flashqla.chunk_gated_delta_rule"] < 0.92 * t_6e[prob, "gdn_fwd/s29_table_in_the_cumsum"]
    assert t_6e[prob, "flashqla.chunk_gated_delta_rule"] < t_6e[prob, "FlashQLA"]

# %% [markdown]
# On the three problems at 16 columns the forward takes 0.89-0.91x s29's time and runs 1.11-1.15x
# FlashQLA's speed; (2, 8) 1 x 8192, which AutoCP splits, does not change.

# %% [markdown]
# ### Inside the fused kernel: a clock on each role (s34)
#
# The benchmark says how long a forward takes; Nsight Compute says the fused kernel is
# latency-bound. Neither says which warp role the others wait for. `profiles/role_timeline_lab.py`
# asks the kernel itself: TileLang's CUDA post-processing hook (`tilelang.register_cuda_postproc`)
# edits the generated source so that thread 0 of each warpgroup writes `clock64()` before and after
# every mbarrier wait and named barrier, after every arrive, and around every wgmma batch. The
# stamps ride behind the final-state buffer, the stamped forward must give the library's bits (an
# assert), and between two stamps a role is *waiting* on a barrier, in a *gemm*, at its *named
# barrier*, or doing its own *work*. The stamps cost time themselves (each a clock read and a
# store), so the spans are longer than the kernel's; the shares are what to read. The stamps on a
# tiny made-up kernel:

# %%
import sys

sys.path.insert(0, str(bench.RESULTS.parent))
import role_timeline_lab  # noqa: E402

toy = """extern "C" __global__ void __launch_bounds__(512, 1) k(float* ht, int num_seqs) {
  bar_tiles_full[0].wait(0);
  {
    tl::warpgroup_arrive();
    tl::warpgroup_wait<0>();
  }
  bar_vd_ready[0].arrive();
}"""
stamped_toy, toy_sites = role_timeline_lab.instrument(toy, state_elems=16, cap=64)
print(stamped_toy[stamped_toy.index('extern "C"'):])
print(toy_sites)
assert [k for k, _ in toy_sites] == ["wait", "done", "gemm", "done", "arrive"]

# %% [markdown]
# Per chunk, on the library's kernels (commit 94d60f0, one H100) and on s34 (below; commit dac1807):

# %%
with open(bench.RESULTS / "role_timeline.csv", newline="") as f:
    roles_rows = list(csv.DictReader(f))
print(role_timeline_lab.report_rows(roles_rows))
share = {(r["problem"], r["impl"], r["role"], r["activity"]): float(r["share"]) for r in roles_rows}
waits = lambda prob, impl, role: sum(v for (p_, i_, r_, a_), v in share.items()
                                     if (p_, i_, r_) == (prob, impl, role) and a_.startswith("wait"))
for impl in ("API", "gdn_fwd.s34"):
    # the scores / output warpgroup barely waits: it sets the pace; the state warpgroup waits most
    assert waits("(16, 64) 1x8192", impl, "scores/output") < 0.12
    assert waits("(16, 64) 1x8192", impl, "state") > 0.5
# the narrow kernel at 16 columns: the chain warpgroup sets the pace, the output waits on it
assert waits("(2, 8) 1x2048", "API", "chain") < 0.2 and waits("(2, 8) 1x2048", "API", "output") > 0.45

# %% [markdown]
# At 64 columns the scores / output warpgroup (Gamma, $P$, WY, then $Q S_c$, $P \tilde V$ and O's
# store) spends 60 % of its span on its own work and 21 % in wgmma, and waits on nobody for more
# than 3 %; the state warpgroup waits 59 % of its span for $V_d$, the value warpgroup 20 % for
# $S_c$ and 12 % for WY. At 16 columns (s12's kernel, four roles of another cut) the chain is the
# pacer, as chapter 4's napkin timeline said. One CTA's roles over six chunks of (16, 64) 1 x 8192,
# from the stamps:

# %%
with open(bench.RESULTS / "role_timeline_events.csv", newline="") as f:
    events = [r for r in csv.DictReader(f) if r["problem"] == "(16, 64) 1x8192" and r["impl"] == "API"]
order = ["producer", "scores/output", "value", "state"]
colour = {"wait": "#dddddd", "sync": "#bbbbbb", "gemm": "tab:red", "work": "tab:blue"}
fig, ax = plt.subplots(figsize=(13, 3))
for y, role in enumerate(order):
    ev = [(r["kind"], int(r["cycle"])) for r in events if r["role"] == role]
    for (kind, t), (_, t_next) in zip(ev, ev[1:]):
        what = kind if kind in ("wait", "sync", "gemm") else "work"
        ax.broken_barh([(t, t_next - t)], (y - 0.4, 0.8), color=colour[what])
ax.set_yticks(range(len(order)), order)
ax.set_xlabel("cycles (one CTA, clock64)")
for what, c in colour.items():
    ax.plot([], [], color=c, lw=6, label={"sync": "named barrier"}.get(what, what))
ax.legend(ncol=4, loc="upper right", fontsize=8)
ax.set_title("gdn_fused_state_value_kernel at BV 64: grey = waiting")
plt.tight_layout()
plt.show()

# %% [markdown]
# So the scores / output warpgroup is the one to lighten. `gdn_fwd.s34` makes three edits there,
# nothing else: O's TMA store is left running (its wait moves to just before the next chunk writes
# o_shared), $Q K^\top$ is issued without waiting (`T.wgmma_gemm`, `T.wait_wgmma`) so that Gamma's
# exponentials run beside it, and O's row factor uses the producer's $e^{g}$ instead of one exp2 an
# element. The bits do not change (`tests/test_autocp.py`). The store's wait:

# %%
s34 = load("gdn_fwd", 34)
src34 = inspect.getsource(s34.fused_state_value_kernel)
print(src34[src34.index("# o[t0 : t0 + n] <- O"):src34.index("elif tx >= SCORES_END")].rstrip())
assert "T.tma_copy(o_s, o[t0:t0 + C" in src34 and "T.wgmma_gemm(q_s" in src34

# %% [markdown]
# It is a small step: the stamps put the store's tail at 490-670 cycles a chunk before and 190-360
# after, but the region that builds $P$ and WY (about 1300-1500 cycles, its stores to shared memory
# and Ab's loads) stays, and the forward takes 0.97-0.99x s33's time. The library runs s34 (bit for
# bit, `tests/test_promoted.py`). The benchmark's rows of the runs that timed s34 and the stages
# below with the peers (one H100; each run's rows beside the peers of the same run):

# %%
# the runs that timed s34 and s36 (6dddd4e, 357e1d9, f496a5f), kept apart in `gdn_fwd_wide_kernel.csv`
# since a later run (679347d) replaced the API and peer rows of some of their problems in `gdn_fwd.csv`
rows_s34 = bench.read_csv(bench.RESULTS / "gdn_fwd_wide_kernel.csv")
t_s34 = {(r["problem"], r["impl"]): (float(r["ms"]), r["commit"][:7]) for r in rows_s34}
impls_s34 = ("gdn_fwd/s34_output_overlap", "gdn_fwd/s36_wy_in_the_solve", "flashqla.chunk_gated_delta_rule",
             "FlashQLA", "FLA (gdn_fwd/s00_fla)")
print(f"{'problem':22s} " + " ".join(f"{n:>15s}" for n in ("s34", "s36", "API=s34", "FlashQLA", "FLA")))
for prob in dict.fromkeys(r["problem"] for r in rows_s34):
    print(f"{bench.short_label(prob):22s} " + " ".join(
        f"{t_s34[prob, i][0]:7.4f} {t_s34[prob, i][1]}" if (prob, i) in t_s34 else f"{'-':>15s}" for i in impls_s34))
same_run = lambda prob, a, b: t_s34[prob, a][1] == t_s34[prob, b][1]
for prob in ("(16, 64) 1x8192", "(16, 64) 28672+4096", "(16, 64) 4096+4096+4096+4096+4096+4096+4096+4096"):
    assert same_run(prob, "flashqla.chunk_gated_delta_rule", "FlashQLA")
    assert t_s34[prob, "flashqla.chunk_gated_delta_rule"][0] < t_s34[prob, "FlashQLA"][0]

# %% [markdown]
# What is left on that warpgroup is mostly building $P$ and WY. A what-if kernel with the WY pass
# simply deleted (wrong results, timing only; one H100, 357e1d9) took 0.82x s34's forward on
# (16, 64) 1 x 8192 and 0.79x on (16, 48) 1 x 32768: that is what taking WY off the pacing role is
# worth. `gdn_fwd.s35` tries the cheap way, moving the WY block into the value warpgroup, which
# waits 22 % of its span for $S_c$ anyway. The bits do not change, but the forward takes 1.22-1.50x
# s34's time, and the stamps show why: the block costs the value warpgroup about three times what it
# cost the scores warpgroup, and the value warpgroup becomes the pacer:

# %%
print(role_timeline_lab.report_rows([r for r in roles_rows if r["impl"] == "gdn_fwd.s35"]))
assert share["(16, 64) 1x8192", "gdn_fwd.s35", "value", "work"] > 0.7
assert waits("(16, 64) 1x8192", "gdn_fwd.s35", "value") < 0.1
assert waits("(16, 64) 1x8192", "gdn_fwd.s35", "state") > waits("(16, 64) 1x8192", "gdn_fwd.s34", "state")

# %% [markdown]
# In the scores warpgroup WY is built in $P$'s accumulator layout next to Gamma, already in
# registers; in the value warpgroup TileLang gives the tile a layout of its own and every element
# computes its exponential again. The stage stays as the measured lesson: the next step is to take
# WY off the chain's warpgroups altogether, into the solve, which can store $\Gamma \odot A_b$.
#
# `gdn_fwd.s36` does that where the wide kernel runs unsplit after s06's solve (three or four value
# heads a CTA): the solve multiplies each element it stores by $e^{g_i - g_j}$ from the $g$ it
# already holds (a flagged head's $A_b$ already holds the gate), and the wide kernel only zeroes the
# rows past a sequence's end in its partial last chunk. Its tests passed on the GPU (the gdn_fwd
# check against float64, flagged chunks included; the same bits from a CUDA graph). The solve's
# change, in s36's source:

# %%
s36 = load("gdn_fwd", 36)
src36 = inspect.getsource(s36.gated_solve_kernel)
print(src36[src36.index("# WY_ij = Ab_ij"):src36.index("for l in T.unroll(1, NB)")].rstrip())
for prob in ("(16, 48) 1x32768", "(16, 48) 1x8192", "(16, 64) 1x32768"):   # the rows above, one run each
    assert same_run(prob, "gdn_fwd/s36_wy_in_the_solve", "FlashQLA")
    assert t_s34[prob, "gdn_fwd/s36_wy_in_the_solve"][0] < t_s34[prob, "FlashQLA"][0]

# %% [markdown]
# At 64 value columns a CTA s36 takes 0.90-1.01x s34's time and passes FlashQLA on (16, 48)
# 1 x 32768 (1.326 against 1.405 ms); at 128 it is 1.13-1.15x slower (`gdn_fwd.s37`'s docstring):
# there one CTA holds a whole head, so the wide kernel built WY once a head already, and the
# solve's added exponentials cost more. `gdn_fwd.s37` stores WY only at 64 columns.
#
# ### The chain in registers (s38-s41)
#
# With WY off the scores / output warpgroup, the clock moves the pace to the chain. s37's kernel on
# the same problem (one H100, commit 924ffec):

# %%
print(role_timeline_lab.report_rows([r for r in roles_rows if r["impl"] == "gdn_fwd.s37"]))
# the state warpgroup waits over half its span for Vd; nobody waits long on the scores / output
# warpgroup any more (the value warpgroup's waits on it: bar_scores_ready, bar_vn_free)
assert share["(16, 64) 1x8192", "gdn_fwd.s37", "state", "wait bar_vd_ready"] > 0.5
assert (share["(16, 64) 1x8192", "gdn_fwd.s37", "value", "wait bar_scores_ready"]
        + share["(16, 64) 1x8192", "gdn_fwd.s37", "value", "wait bar_vn_free"]) < 0.1

# %% [markdown]
# The chain is $S_c \to U = K S_c \to W \to \tilde V = W\!Y\, W \to V_d \to S_{c+1}$: three
# dependent products with a shared-memory hand-off between warpgroups after each (a store, a fence, an
# mbarrier). `gdn_fwd.s38` lets the chain run ahead of the output (no wait on the scores, two slots
# for $S_c$ and $\tilde V_c$) and is 1.01-1.04x slower: it was not waiting there.
#
# `gdn_fwd.s39` rewrites the kernel so that the chain never leaves registers. It holds the state
# transposed, $S^\top$ (64 value columns by 128 keys), because wgmma takes its left operand from
# registers and its M dimension is 64: with $S^\top$ on the left, every product of the chain has a
# register fragment on the left and a tile the producer loaded on the right,
#
# $$U^\top = S^\top K^\top,\qquad \tilde V^\top = V^\top W\!Y^\top - (U^\top D)\, W\!Y^\top,\qquad
# S^\top \leftarrow e^{g_C} S^\top + (\tilde V^\top D_C)\, K,$$
#
# with $D = \mathrm{diag}(e^{g})$ and $D_C = \mathrm{diag}(e^{g_C - g})$. $V^\top W\!Y^\top$ needs no
# state and is issued first. The chain stores $S_c^\top$ and $\tilde V_c^\top$ only for the output
# warpgroup, whose products take them as transposed right operands; the roles are s12's (chain,
# scores, output, producer), the scores building $P$ only. The chain's chunk body:

# %%
s39 = load("gdn_fwd", 39)
src39 = inspect.getsource(s39.fused_state_value_kernel)
print(src39[src39.index("# V~^T <- V^T WY^T, issued"):src39.index("T.barrier_arrive(bar_tiles_empty[b])")].rstrip())
assert "T.gemm(x_a, k_s[b, :, :], st_f)" in src39 and "T.copy(st_f, st_a)" in src39

# %% [markdown]
# It takes 0.92-0.95x s37's time (one H200, its docstring); `gdn_fwd.s40` lowers the chain's two
# stores to `stmatrix` and moves $V_d$'s mask into the producer's $e^{g_C - g}$: 0.98-0.99x s39's.
# The stamps of both, same problem:

# %%
print(role_timeline_lab.report_rows([r for r in roles_rows if r["impl"] in ("gdn_fwd.s39", "gdn_fwd.s40")]))
span = {(r["impl"], r["role"]): int(r["span_cycles_per_chunk"]) for r in roles_rows if r["problem"] == "(16, 64) 1x8192"}
assert span["gdn_fwd.s40", "chain"] < span["gdn_fwd.s39", "chain"] < 0.85 * span["gdn_fwd.s37", "state"]
# the scores warpgroup now idles half its span: the chain, on its own instructions, sets the pace
assert share["(16, 64) 1x8192", "gdn_fwd.s40", "scores", "wait bar_tiles_full"] > 0.4
assert share["(16, 64) 1x8192", "gdn_fwd.s40", "chain", "work"] > 0.45

# %% [markdown]
# The library runs s40's kernel where s37 stores WY (bit for bit, `tests/test_promoted.py`). The
# benchmark's rows of that run, the peers in the same process (one H100, commit 679347d):

# %%
rows_40 = [r for r in bench.read_csv(CSV_PATH) + bench.read_csv(EARLIER_RUNS) if r["commit"].startswith("679347d")]
t_40 = {(r["problem"], r["impl"]): float(r["ms"]) for r in rows_40}
impls_40 = ("gdn_fwd/s40_stmatrix_hand_offs", "flashqla.chunk_gated_delta_rule", "FlashQLA", "FLA (gdn_fwd/s00_fla)")
print(f"{'problem':22s} " + " ".join(f"{n:>9s}" for n in ("s40", "API=s40", "FlashQLA", "FLA")))
problems_40 = list(dict.fromkeys(r["problem"] for r in rows_40))
for prob in problems_40:
    print(f"{bench.short_label(prob):22s} " + " ".join(f"{t_40[prob, i]:9.4f}" for i in impls_40))
assert len(problems_40) == 9
for prob in problems_40:
    assert t_40[prob, "flashqla.chunk_gated_delta_rule"] < t_40[prob, "FlashQLA"]

# %% [markdown]
# 1.11-1.70x FlashQLA's speed on these nine; (16, 48) 1 x 32768 goes from 0.97x to 1.14x, and
# (16, 64) 1 x 32768 takes 1.396 ms, 2.69x the floor. What is left on the chain is its own
# instruction stream (2461 of 4835 stamped cycles a chunk: bf16 conversions, the stores for the
# output, the passes over $U^\top$ and $\tilde V^\top$) and TileLang's named barriers, against
# about 800 cycles of tensor-core time for its three products. The kernel needs 64 value columns a
# chain (one wgmma M tile), so the batches (128 columns a CTA) and the split problems (16 or 32)
# still run s34's and s12's kernels.
#
# `gdn_fwd.s41` hands the first product of the correction to the scores warpgroup, idle half its
# span: since $(U^\top D)\, W\!Y^\top = S^\top (W\!Y D K)^\top$, it builds $M = -W\!Y D K$ once the tiles are
# in, and the chain adds $S_c^\top M^\top$ to $V^\top W\!Y^\top$ in one accumulator: two products on
# the chain instead of three. The forward is 1.02-1.04x slower (one H100, f7b01a9): the scores
# warpgroup becomes the pacer, and the chain waits for $M$:

# %%
print(role_timeline_lab.report_rows([r for r in roles_rows if r["impl"] == "gdn_fwd.s41"]))
assert waits("(16, 64) 1x8192", "gdn_fwd.s41", "scores") < 0.15
assert share["(16, 64) 1x8192", "gdn_fwd.s41", "chain", "wait bar_m_ready"] > 0.05

# %% [markdown]
# ### The solve on the tensor cores, warp by warp (`gate_free_solve.s15`, `s16`; `gdn_fwd.s42`, `s43`)
#
# With the fused kernel faster, the solve is a third of some forwards: 400 of the API's 1151 us on
# (16, 64) 8 x 4096, 146 of 364 on (16, 16) 8 x 4096, where FlashQLA's `kkt_solve` took 114
# (`profiles/results/timeline_weak_rows.csv`, one H100, 2066b86). s06 moves its bytes at about 1 TB/s, and the count
# of its shared-memory loads accounts for most of its time: in phase B a lane computes one column of a 16 x 16
# block product and reads every $K K^\top$ entry it multiplies (the 16 lanes of a half read the same
# word). Per CTA of four heads:

# %%
# phase B, one lane, four heads (the Latin square gives each warp each block column once): a level d
# of column jb reads 16 rows x d block columns x 8 entries of K K^T, then 8 x 16 of X_DD
kkt_reads = sum(16 * d * 8 for jb in range(4) for d in range(1, 4 - jb))
x_reads = sum(8 * 16 for jb in range(4) for d in range(1, 4 - jb))
phase_a_reads = 16 * 8 + 16 * 4                # 16 rows x 8 entries (shared by the heads) + beta
loads = kkt_reads + x_reads + phase_a_reads
ctas_per_sm = (8192 // 64 + 1) * 16 / 132      # (16, 64) 1 x 8192: 129 chunk rows x 16 CTAs a row
us = loads * 4 * ctas_per_sm / 1.755e3         # 4 warps, one warp-wide load a cycle, 1.755 GHz
print(f"{loads} loads a lane, {loads * 4} warp-wide a CTA, {ctas_per_sm:.1f} CTAs an SM: ~{us:.0f} us")
ncu_solve |= {n: bench.read_csv(bench.RESULTS / f"ncu_gate_free_solve_{n}.csv")[0] for n in ("s15",)}
# about four fifths of the 98 us Nsight Compute measured for s06 on this problem
assert 0.7 < us / float(ncu_solve["s06"]["us"]) < 1.0

# %% [markdown]
# An `mma.sync.m16n8k8` with tf32 operands does a 16 x 8 x 8 piece of such a product from 4 + 2
# fragment registers a lane, loaded once. `gate_free_solve.s15` walks each block column down as
# products of 16 x 16 blocks, held transposed so that one product's accumulator is the next one's
# left operand:
#
# $$t^\top = \sum_{e < d} X_{j+e,\,j}^\top\,(K K^\top)_{D,\,j+e}^\top\,\mathrm{diag}(\beta_D),\qquad
# X_{D,\,j}^\top = -\,t^\top X_{DD}^\top\qquad (D = j + d).$$
#
# The accumulator of a lane in quad position $t$ holds columns $2t$ and $2t + 1$; the A operand wants
# columns $t$ and $t + 4$. Read as A, the accumulator's columns are a permutation of $k$; loading B's
# rows in the same permuted order leaves the sum unchanged, so no shuffle is needed. Checked here on
# the fragment layouts themselves (PTX ISA, m16n8k8 tf32), in float64:

# %%
def c_fragment(C):        # 16 x 8 accumulator -> per lane (c0, c1, c2, c3)
    return [[C[l // 4, 2 * (l % 4)], C[l // 4, 2 * (l % 4) + 1], C[l // 4 + 8, 2 * (l % 4)],
             C[l // 4 + 8, 2 * (l % 4) + 1]] for l in range(32)]


def mma_16x8x8(a_frags, b_frags):   # a: per lane (a0..a3) at (g, t), (g+8, t), (g, t+4), (g+8, t+4)
    A, B = torch.zeros(16, 8, dtype=torch.float64), torch.zeros(8, 8, dtype=torch.float64)
    for l, (a, b) in enumerate(zip(a_frags, b_frags)):
        g, t = l // 4, l % 4
        A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = a
        B[t, g], B[t + 4, g] = b
    return A @ B


gen = torch.Generator().manual_seed(0)
C, Bm = torch.randn(16, 8, generator=gen, dtype=torch.float64), torch.randn(8, 8, generator=gen, dtype=torch.float64)
a_from_c = [[c0, c2, c1, c3] for c0, c1, c2, c3 in c_fragment(C)]                 # s15's (c0, c2, c1, c3)
b_permuted = [[Bm[2 * (l % 4), l // 4], Bm[2 * (l % 4) + 1, l // 4]] for l in range(32)]  # rows 2t, 2t + 1
assert torch.allclose(mma_16x8x8(a_from_c, b_permuted), C @ Bm, rtol=0, atol=1e-12)
b_plain = [[Bm[l % 4, l // 4], Bm[l % 4 + 4, l // 4]] for l in range(32)]
assert not torch.allclose(mma_16x8x8(a_from_c, b_plain), C @ Bm)                  # unpermuted B: wrong

# %% [markdown]
# The walk (phase A, the diagonal inverses, and every flagged head keep s06's fp32 code):

# %%
s15 = load("gate_free_solve", 15)
src15 = inspect.getsource(s15.phase_b_on_mma)
print(src15[src15.index("    @T.macro\n    def levels_on_mma"):src15.index("        # Ab[:, col] = X[:, col]")].rstrip())
assert "mma(xa, 8 * e + 4 * kk, b, tc, 4 * nn)" in src15 and "mma(ta, 4 * kk, b, xc, 4 * nn)" in src15

# %% [markdown]
# `gate_free_solve.s16` puts the same solve into s14's kernel (the chunk table and the cumsum in the
# prologue, one or two heads a CTA). Each kernel alone against the one it replaces, and Nsight Compute
# on (16, 64) 1 x 8192 (one H100, commit 69c6bf5):

# %%
kern_rows = bench.read_csv(bench.RESULTS / "solve_kernels.csv")
print(f"{'problem':22s} {'heads':>5s} {'before':>22s} {'us':>7s} {'after':>26s} {'us':>7s} {'ratio':>6s}")
for r in kern_rows:
    print(f"{bench.short_label(r['problem']):22s} {r['heads_per_cta']:>5s} {r['before']:>22s} {r['before_us']:>7s} "
          f"{r['after']:>26s} {r['after_us']:>7s} {float(r['after_us']) / float(r['before_us']):6.2f}")
assert all(float(r["after_us"]) < float(r["before_us"]) for r in kern_rows) and len(kern_rows) == 13
for n in ("s06", "s15"):
    r = ncu_solve[n]
    print(f"{n}: {r['us']} us, DRAM {r['dram_pct']} % of peak, occupancy {r['occupancy_pct']} %, stalls {r['stalls']}")
assert float(ncu_solve["s15"]["dram_pct"]) > float(ncu_solve["s06"]["dram_pct"])

# %% [markdown]
# 0.68-0.81x s06's time, 0.77-0.92x s14's; the new first stall is the global load of $K$ before
# $K K^\top$ (`long_scoreboard`), and the solve still uses a third of the DRAM bandwidth: prefetching
# the next chunk's $K$ is the next step there. In the forward (`gdn_fwd.s42`, then `s43`, which the
# library runs), the whole benchmark, peers in the same process (one H100, commit 1a05b0c):

# %%
rows_43 = [r for r in bench.read_csv(CSV_PATH) + bench.read_csv(EARLIER_RUNS) if r["commit"].startswith("1a05b0c")]
api_43 = [r for r in rows_43 if r["impl"] == "flashqla.chunk_gated_delta_rule"]
vs_fq, vs_fla = ([float(r[c]) for r in api_43] for c in ("vs_flashqla", "vs_fla"))
geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
print(f"{len(api_43)} problems: {min(vs_fq):.2f}-{max(vs_fq):.2f}x FlashQLA's speed (geomean {geo(vs_fq):.2f}), "
      f"{min(vs_fla):.2f}-{max(vs_fla):.2f}x FLA's (geomean {geo(vs_fla):.2f})")
for r in api_43:
    if float(r["vs_flashqla"]) < 1 or r["problem"] == "(16, 64) 1x32768":
        print(f"  {r['problem']}: {r['ms']} ms, {r['vs_flashqla']}x FlashQLA, {r['x_floor']}x the floor")
assert len(api_43) == 40 and sum(x >= 1 for x in vs_fq) == 39 and geo(vs_fq) > 1.2

# %% [markdown]
#
# ## Summary
#
# - The decay is a diagonal similarity, $A = D L D^{-1}$, so $(I + A)^{-1} = \Gamma \odot (I + L)^{-1}$:
#   the triangular solve needs no gate, and $\tilde V = (\Gamma \odot A_b)(V - D K h)$, so $w$ and $u$
#   need never exist (checked in float64 to $10^{-16}$, chunk by chunk and for the whole forward).
# - Per (chunk, value head) at $(H, H_V) = (16, 64)$, s04's pipeline does about 15 % fewer
#   tensor-core FLOPs ($w$'s product is gone, $K K^\top$ is shared by a key head's value heads), a
#   third fewer exponentials (the solve has none; the fused kernel's output mask also masks $A_b$),
#   and moves 44 % fewer HBM bytes ($A_b$ instead of $w$ and $u$): about 1.6 GB less on a layer of
#   32768 tokens. The fused kernel's chain is not shorter.
# - Precision: $|A_r| \le 1$ for L2-normalized keys and $\beta \le 1$, whatever the keys and the
#   decay; only $\beta \|k\|^2 > 2$ lets it grow, up to float32 overflow. `gate_free_solve.s01`
#   detects such chunks from the diagonal of $K K^\top$ and solves them with the gate, flagging them
#   for s04: no error, no host synchronization. Inside the safe region, emulating the kernels'
#   bf16 roundings, s04's path is as accurate as s03's.
# - s05 splits s03's fused kernel into four warpgroup roles (chain, scores, output, producer) with
#   double-buffered tile stages and hand-off slots, six mbarriers and `setmaxnreg` budgets, all read
#   here from the stage and checked against its docstring. In the napkin timeline the chain sets the
#   pace and the producer idles; measured, a chunk takes 2.3-2.4 us against the chain's 1.4 alone.
# - Measured (the benchmark on H200s, CUDA-graph replay): s04 and s05 both beat s03 on all ten
#   problems; s04 leads on (16, 64) from 32768 tokens, where it saves the most bytes, s05 on (16, 32)'s
#   single sequences; s05's gain over s03 is its fused kernel's (1.52-1.66x s03's, its docstring), to
#   within a few percent. Nsight Compute: 1.63x on the same work, tensor pipe 18 -> 27 % busy, DRAM
#   20 -> 33 % of peak, the barrier stalls gone, still latency-bound.
# - s07 puts s04's math into s05's roles, with $\Gamma \odot A_b$ built by the scores warpgroup: its
#   gain over s03 is about the sum of s04's and s05's (1.00-1.18x), the fastest of the four on all ten
#   problems (1.91 ms on (16, 64) 1 x 32768). Its kernel alone is slower than s05's (Nsight Compute:
#   349 against 297 us on (16, 64) 1 x 8192) and as latency-bound.
# - s09 forms $u$ and $w$ on chip to give the chain s05's two products, and is 0.57-0.69x s07: the
#   scores warpgroup, now the slowest role, sets the pace.
# - s10 makes s07's chain lean (500 SASS instructions a chunk instead of 806, no divergent branch, no
#   exponential): 1.05-1.14x s07 on all 40 benchmark problems (an H200 run). `gate_free_solve.s02`
#   replaces the 64-row substitution, a third of the forward on the many-head problems, with a
#   blocked inverse: up to 8-9 % of the forward where a key head has three or four value heads, even
#   with one or two (Nsight Compute: 129 against 154 us alone). s03's right-looking solve is slower
#   (141 us): the row chain was not the limit. s11 puts both into AutoCP.
# - s12 chooses the fused kernel's value columns per CTA by launch, 32 where the narrow CTAs fit one
#   wave: 1.12-1.30x s10 on the 21 problems where it goes narrow. s13 is s12's kernel with AutoCP
#   (chapter 5). FlashQLA stayed ahead most on the many-sequence batches (1.4x on (16, 64) 8 x 4096
#   in an H200 run), where its fused kernel runs 128 value columns a CTA, so its per-head work
#   outside the state (Q K^T, the gate matrix) is done once a head, where ours was done twice
#   (`profiles/results/kernel_split.csv`: 790 against 1211 us).
# - s14 splits the chain into a state and a value warpgroup so that one CTA owns all 128 value
#   columns: 0.78-0.83x s12's kernel time on the batches of 8 where it is picked, 1.4-2.1x on one
#   wave; its equal-length wave rule loses on 28672 + 4096. s15 reads the lengths (once per
#   `cu_seqlens` tensor) and picks the fastest measured width on all 40 problems. s16 stores O by
#   TMA, so the fence before the next chunk's wgmma no longer waits for O's stores: 0.78-0.87x s14's
#   kernel at 128. s17 is s15's pipeline on s16's kernel at 64 and 128 with re-measured steps:
#   1.03-1.30x s13 on the batches. The library now runs it with s18's AutoCP (chapter 5) and
#   `gate_free_solve.s06` (one barrier a CTA instead of about three a value head: 0.85-0.90x the time
#   of s05, s02 at four CTAs an SM; s07, a smaller copy of s06, measured slower): 1.502 ms on
#   (16, 64) 1 x 32768 (3.17x the floor) against FlashQLA's 1.547 and FLA's 4.180 (4 x H100, commit
#   02d7c5e). On chapter 5's later AutoCP stages and `gate_free_solve.s09` (`gdn_fwd.s22`, commit
#   e7a917b), FlashQLA is still ahead on 19 of the 38 problems where its timing is sound (the
#   README's table).
# - The solve's launch bounds are a register budget: six CTAs an SM at one head a CTA, five at two
#   (`gate_free_solve.s12`, `s14`), a few dozen bytes of spills, 0.85x the time on (8, 24) 1 x 2048
#   and on many-wave grids. `s13` scans g and builds the chunk table inside the solve, so the short
#   forwards are two kernels. `gdn_fwd.s33` runs the fused kernel at 16 value columns where one wave
#   holds them: with s30-s32, the 1 x 2048 problems go from 0.95-1.00x FlashQLA's speed to 1.00-1.15x
#   (one H100, 6eedafa).
# - A clock on each role (`profiles/role_timeline_lab.py`) shows the wide kernel's scores / output
#   warpgroup setting the pace (waiting under 12 % of its span while the state warpgroup waits over
#   half of it). `gdn_fwd.s34` lightens it (O's store left running, Gamma beside $Q K^\top$): 0.97-0.99x
#   s33's forward; (16, 64) 1 x 32768 at 1.535 ms against FlashQLA's 1.557 (one H100, 6dddd4e).
#   Building WY is what is left there (a what-if without it: 0.79-0.82x); `gdn_fwd.s35` moves it to
#   the value warpgroup and is 1.22-1.50x slower; `gdn_fwd.s36` has the solve store it: 0.90-1.01x
#   s34's time at 64 value columns a CTA ((16, 48) 1 x 32768 at 1.326 ms against FlashQLA's 1.405),
#   1.13-1.15x at 128, so `gdn_fwd.s37` keeps it to 64 columns.
# - Then the chain sets the pace. `gdn_fwd.s39` holds the state transposed in the chain's registers,
#   so that its three products take register fragments on the left and no hand-off goes through
#   shared memory: 0.92-0.95x s37's time; `gdn_fwd.s40` (stmatrix stores) 0.98-0.99x s39's. The
#   library runs it: 1.11-1.70x FlashQLA's speed on the nine problems where it runs, (16, 64)
#   1 x 32768 at 1.396 ms (2.69x the floor; one H100, 679347d). Moving $-W\!Y D K$ to the scores
#   warpgroup (`gdn_fwd.s41`) makes that warpgroup the pacer: 1.02-1.04x slower.
# - The solve was bound by shared-memory loads (a lane read every $K K^\top$ entry it multiplied).
#   `gate_free_solve.s15` runs phase B's block levels as warp-wide tf32 `mma.sync` products, held
#   transposed so that accumulators feed the next product unshuffled: 0.68-0.81x s06's time; `s16`
#   does the same in the cumsum-and-solve kernel: 0.77-0.92x s14's. The library (`gdn_fwd.s43`) is
#   0.96-2.06x FlashQLA's speed on the 40 problems (geomean 1.22x, below it only on (8, 24)
#   28672 + 4096) and 1.35-4.09x FLA's (geomean 2.50x); (16, 64) 1 x 32768 at 1.127 ms, 2.28x the
#   floor (one H100, 1a05b0c). With AutoCP's phase 1 on two products (`gdn_fwd.s44`, notebook 06)
#   the library is at least FlashQLA's speed on all 40 (geomean 1.33x, fbf3c07).
